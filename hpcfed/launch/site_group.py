"""A site of many ranks (`federation.ranks_per_site`): its communicator, its torch.distributed group,
and the star that holds only the leaders.

At launch every rank splits MPI_COMM_WORLD twice (`split_world`), the only collectives that span
sites:

- the *site communicator*: the ranks of one site (MPI_Comm_split by site); rank 0 is in none, and
  no two sites share one;
- the *star communicator*: rank 0 and each site's leader (its local rank 0), numbered 0..K in site
  order, so that the server, the client loop and every channel see a federation of K sites as
  before. A non-leader is not in it: it has no channel and no way to address rank 0's.

Inside a site the ranks train with torch.distributed (`init_site_torch`): gloo on the CPU, NCCL on
GPUs (with a gloo group beside it for the leader's commands). The group is set up from the site
communicator: the leader opens a `TCPStore` on a free port of its own node and broadcasts
``host:port`` over the site communicator (MPI_Bcast of a fixed 256-byte buffer); the site's ranks
connect to it. The port is opened by, and used by, the site's own ranks only: nothing between
institutions, and no address agreed beforehand. (A `FileStore` on the run directory would need no
port but a file system shared by all of a site's nodes; a TCPStore needs only that the site's
nodes reach each other, which their all-reduce needs anyway.)

Rank 0 reads, and refuses, what a non-leader sends it on MPI_COMM_WORLD (`LeadersOnlyTransport`):
the channel's peers are the leaders alone, so such frames never reach a session; they are counted
and logged with the rank that sent them, and never left to pile up in MPI's unexpected queue.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcfed.comm.transport import MPITransport, Request
from hpcfed.errors import FederationError
from hpcfed.site_layout import SiteLayout
from hpcfed.tasks.data_parallel import SiteRanks

if TYPE_CHECKING:
    from hpcfed.config import Config

log = logging.getLogger("hpcfed.launch")

_ADDRESS_BYTES = 256  # host:port of the site's TCPStore, zero-padded
_MAX_DISCARDING = 64  # refused frames on MPI_COMM_WORLD still in flight, at most


@dataclass(frozen=True)
class SiteGroup:
    """This rank's place in the federation: its site (None on rank 0), its local rank, and its
    communicators."""

    layout: SiteLayout
    world_rank: int
    site: int | None
    local_rank: int
    site_comm: Any  # the site's MPI communicator; None on rank 0 and in one-rank layouts
    star_comm: Any  # rank 0 and the leaders; None on a non-leader

    @property
    def size(self) -> int:
        """Ranks in this rank's site (1 on rank 0)."""
        return 1 if self.site is None else self.layout.sizes[self.site]

    @property
    def parallel(self) -> bool:
        """Whether this rank trains together with others of its site."""
        return self.size > 1

    @property
    def is_leader(self) -> bool:
        """Whether this rank holds its site's channel with rank 0."""
        return self.site is not None and self.local_rank == 0


def split_world(comm: Any, layout: SiteLayout) -> SiteGroup:
    """Split MPI_COMM_WORLD into the sites and the star of leaders (collective over the world). With
    every site one rank, nothing is split: the star is the world, as it always was."""
    rank = comm.Get_rank()
    where = layout.site_of(rank)
    site, local = where if where is not None else (None, 0)
    if layout.single_rank:
        return SiteGroup(layout, rank, site, local, None, comm)
    from mpi4py import MPI

    site_comm = comm.Split(MPI.UNDEFINED if site is None else site, rank)
    star_comm = comm.Split(0 if local == 0 else MPI.UNDEFINED, rank)
    return SiteGroup(layout, rank, site, local,
                     None if site_comm == MPI.COMM_NULL else site_comm,
                     None if star_comm == MPI.COMM_NULL else star_comm)


def join_group(comm: Any, ranks_per_site: int | list[int], site: int, num_sites: int) -> SiteGroup:
    """This rank's place in the job of one site of `hpcfed join` (`comm`, its MPI_COMM_WORLD, is the
    site's communicator: its rank 0 is the leader, which alone knocks and holds the channel). The
    world rank is the one it would have under `hpcfed run`, for the logs."""
    layout = SiteLayout.of(ranks_per_site, num_sites)
    local = comm.Get_rank()
    return SiteGroup(layout, layout.leader(site) + local, site, local, comm, None)


def site_timeout(cfg: Config) -> float:
    """How long a site's rank waits in a collective: as long as its leader may wait for the server
    between two rounds (setup, then a round's deadline and the client timeout)."""
    fed = cfg.federation
    return fed.setup_timeout_s + fed.round_deadline_s + 2 * fed.client_timeout_s


def follow_site_leader(cfg: Config, group: SiteGroup, out_dir: Path, device: str,
                       before: Callable[[], None] | None = None) -> None:
    """A site's non-leader rank: join the site's torch.distributed group, build the site's task, then
    train each round its leader hands it until STOP. `before` runs once the group is up (fault hooks).
    The rank holds the site's key as its leader does (same site, same cluster): under record-level
    DP every rank of the site draws the site's batches and noise from its secret seed."""
    import torch

    from hpcfed.client.config import ClientConfig
    from hpcfed.client.prepared import build_site
    from hpcfed.client.site_ranks import follow_leader
    from hpcfed.credentials import RankKeys

    torch.set_num_threads(max(1, cfg.threads_per_rank))
    ranks = init_site_torch(group, device, site_timeout(cfg))
    if before is not None:
        before()
    config = ClientConfig.from_config(cfg)
    site_id = group.site or 0
    site = build_site(config, site_id, group.layout.num_sites, out_dir, device, RankKeys(cfg.security, site_id + 1),
                      ranks)
    follow_leader(config.site.task_cls(config.site.task_config, site), ranks)


def init_site_torch(group: SiteGroup, device: str, timeout_s: float) -> SiteRanks:
    """Start torch.distributed over this rank's site (collective over the site): the leader's
    TCPStore, broadcast over the site communicator; NCCL on a GPU, gloo otherwise, with a gloo
    group for the leader's commands either way. `timeout_s` bounds every collective (a member that
    waits for its leader's next command waits as long as the leader waits for the server)."""
    import numpy as np
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    buf = np.zeros(_ADDRESS_BYTES, dtype=np.uint8)
    store = None
    if group.is_leader:
        host = socket.gethostname()
        store = dist.TCPStore(host, 0, group.size, is_master=True, timeout=timeout, wait_for_workers=False)
        address = f"{host}:{store.port}".encode()
        buf[:len(address)] = np.frombuffer(address, dtype=np.uint8)
    group.site_comm.Bcast(buf, root=0)
    if store is None:
        host, port = _parse_address(bytes(buf).rstrip(b"\0"), group)
        store = dist.TCPStore(host, port, group.size, is_master=False, timeout=timeout)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        import torch

        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(backend, store=store, rank=group.local_rank, world_size=group.size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else dist.group.WORLD
    log.info("site %s: rank %d of %d joined its torch.distributed group (%s)", group.site, group.local_rank,
             group.size, backend)
    return SiteRanks(local_rank=group.local_rank, size=group.size, backend=backend, control=control)


def _parse_address(raw: bytes, group: SiteGroup) -> tuple[str, int]:
    """host:port from the leader (the site's own rank: still read within bounds)."""
    host, _, port = raw.decode("ascii", "replace").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise FederationError(f"site {group.site}: its leader sent no usable rendezvous address ({raw[:80]!r})")
    return host, int(port)


class LeadersOnlyTransport:
    """Rank 0's transport: the star communicator's, which also reads MPI_COMM_WORLD and refuses what
    arrives there (a non-leader's frames: the channel's peer for a site is its leader alone)."""

    def __init__(self, star: MPITransport, world: Any, layout: SiteLayout) -> None:
        from mpi4py import MPI

        self._star, self._world = star, MPITransport(world, tag=MPI.ANY_TAG)
        self.rank, self.size, self.layout = star.rank, star.size, layout
        self.refused: dict[int, int] = {}  # world rank -> frames refused
        self._discarding: list[Request] = []  # refused frames still on their way (never waited on)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._star, name)

    def iprobe(self, source: int | None = None) -> tuple[int, int] | None:
        """The star's next frame; first refuse anything waiting on MPI_COMM_WORLD."""
        self.refuse_world()
        return self._star.iprobe(source)

    def refuse_world(self) -> None:
        """Read and drop every frame waiting on MPI_COMM_WORLD, counting it against its sender."""
        if self._discarding:  # (every poll of rank 0 comes here: nothing to build when none is pending)
            self._discarding = [req for req in self._discarding if not req.test()]
        for _ in range(64):  # bounded per call: a flood cannot hold the server here
            if len(self._discarding) >= _MAX_DISCARDING:
                return  # frames that do not come are not waited for; the next call looks again
            found = self._world.iprobe(None)
            if found is None:
                return
            source = found[0]
            req = self._world.discard(source)
            if not req.test():
                self._discarding.append(req)
            self.refused[source] = self.refused.get(source, 0) + 1
            if self.refused[source] == 1:
                where = self.layout.site_of(source)
                leader = self.layout.leader(where[0]) if where else None
                log.warning("refused a frame from %s on MPI_COMM_WORLD: only the site's leader (rank %s) holds "
                            "its channel with rank 0; further frames from it are refused and counted",
                            self.layout.describe(source), leader)
