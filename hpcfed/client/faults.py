"""Fault injection for the tests of lost and paused sites: upload stages installed only when their
environment hook is set (never by a config).

- ``HPCFED_FAULT_STOP_AFTER_UPLOAD=RANK:ROUND``: rank RANK stops itself (SIGSTOP) just after its
  upload of round ROUND, a preempted node paused between its upload and the next model
  (tests/ops/test_lost_sites.py).
- ``HPCFED_FAULT_NON_LEADER_SENDS=RANK``: world rank RANK, a site's non-leader, sends frames to rank 0
  on MPI_COMM_WORLD as if it spoke for its site (tests/ops/test_site_ranks.py: they are refused).
- ``HPCFED_FAULT_NON_LEADER_KNOCKS=RANK``: rank RANK of a joined site's job (`hpcfed join`, numbered
  as under `hpcfed run`), a non-leader, knocks at the server with the site's own key once its
  leader has joined, to be let in as the site (tests/ops/test_serve_join_ranks.py: it is refused).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from hpcfed.client.upload import RoundStart, Stage, Upload, Upstream

log = logging.getLogger("hpcfed.client")

STOP_AFTER_UPLOAD = "HPCFED_FAULT_STOP_AFTER_UPLOAD"
NON_LEADER_SENDS = "HPCFED_FAULT_NON_LEADER_SENDS"
NON_LEADER_KNOCKS = "HPCFED_FAULT_NON_LEADER_KNOCKS"


class StopAfterUpload(Stage):
    """After the upload of the round `when` names (``RANK:ROUND``, this site's rank), SIGSTOP itself."""

    def __init__(self, when: str, rank: int) -> None:
        self.when, self.rank = when, rank

    def __call__(self, start: RoundStart, upstream: Upstream) -> Upload:
        upload = upstream(start)
        if self.when == f"{self.rank}:{start.round}":
            log.warning("fault injection: rank %d stops itself after its upload of round %d", self.rank, start.round)
            os.kill(os.getpid(), signal.SIGSTOP)
        return upload


def fault_stages(rank: int) -> list[Stage]:
    """The fault stages this rank's environment asks for (none in a normal run)."""
    when = os.environ.get(STOP_AFTER_UPLOAD)
    return [StopAfterUpload(when, rank)] if when else []


def non_leader_sends(world_rank: int, frames: int = 20) -> None:
    """A hostile non-leader (``HPCFED_FAULT_NON_LEADER_SENDS=RANK``): frames to rank 0 on MPI_COMM_WORLD,
    with the channel's frame tag and another, a frame header's size and a chunk's; rank 0 must refuse them all."""
    if os.environ.get(NON_LEADER_SENDS) != str(world_rank):
        return
    from mpi4py import MPI

    from hpcfed.comm.transport import FRAME_TAG

    log.warning("fault injection: non-leader rank %d sends %d frames to rank 0 on its site's behalf",
                world_rank, frames)
    for i in range(frames):
        frame = os.urandom(56 if i % 2 else 4096)
        MPI.COMM_WORLD.Send([frame, MPI.BYTE], dest=0, tag=FRAME_TAG if i % 3 else 7)


def non_leader_knocks(cfg: Any, server: str, site: int, world_rank: int, log_dir: Path) -> None:
    """A hostile non-leader of a joined site (``HPCFED_FAULT_NON_LEADER_KNOCKS=RANK``): once its leader's
    log says it joined, knock at `server` as site `site` with the site's key, in a thread of its own,
    and log what the server answered; the server must refuse it while the leader holds the site's link."""
    if os.environ.get(NON_LEADER_KNOCKS) != str(world_rank):
        return

    def body() -> None:
        from hpcfed.comm.rendezvous import RendezvousError, knock, read_server
        from hpcfed.credentials import RankKeys

        leader_log = log_dir / f"rank{site + 1}.log"
        deadline = time.monotonic() + 300
        while "joined the server" not in (leader_log.read_text() if leader_log.exists() else ""):
            if time.monotonic() > deadline:
                return
            time.sleep(0.2)
        log.warning("fault injection: non-leader rank %d knocks at the server as site %d", world_rank, site)
        try:
            knock(read_server(server)[0], RankKeys(cfg.security, site + 1).credentials(), site, timeout=30)
        except (RendezvousError, OSError) as exc:
            log.warning("fault injection: non-leader rank %d was refused: %s", world_rank, exc)
        else:
            log.error("fault injection: non-leader rank %d was let in as site %d", world_rank, site)

    threading.Thread(target=body, name="hpcfed-fault-knock", daemon=True).start()
