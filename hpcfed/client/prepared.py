"""A site's slow preparation: its data, its model, its SETUP payload and its own newest shard.

`Client` prepares itself when it is built. A site that joins a running server (`hpcfed join`)
prepares *before* it knocks and hands the result to its `Client`, so that once the server lets it
in (at a safe point: a sync round's start, an async step) it sends its SETUP at once and takes
part in that round, instead of loading torch, data and model while the federation goes on
without it. Nothing here is trusted more for being early: the server still picks the shard the
site resumes from, and the site still checks that choice against the file
(`hpcfed.store.site_state.load_shard`, which names the file it refuses).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcfed.client import attacks
from hpcfed.client.config import ClientConfig, SiteSection
from hpcfed.credentials import RankKeys
from hpcfed.store.sealed import FileAuth
from hpcfed.tasks import data_parallel
from hpcfed.tasks.base import Bundle, Site, Task
from hpcfed.tasks.data_parallel import SiteRanks

log = logging.getLogger("hpcfed.client")


@dataclass
class Prepared:
    """What site `client_id` of `num_clients` built before it meets the server."""

    client_id: int
    num_clients: int
    site: Site
    task: Task
    setup: Bundle  # its SETUP payload (`Task.setup`)
    state_dir: Path  # its own checkpoint shards
    state_auth: FileAuth
    shards: list[list[Any]]  # [[round, digest hex], ...] held intact, newest first
    newest: tuple[int, str, Any] | None  # (round, digest, state) of the newest, read and verified

    def fits(self, client_id: int, num_clients: int) -> bool:
        """Whether it was prepared for the rank and federation size the server gave the site."""
        return (self.client_id, self.num_clients) == (client_id, num_clients)

    def shard_state(self, rnd: int, digest: str) -> Any:
        """The state of the shard of round `rnd` with `digest` (the one the server picked): the one
        read already when it is that one, else read now (`site_state.ShardError` naming the file)."""
        from hpcfed.store import site_state

        if self.newest is not None and self.newest[:2] == (rnd, digest):
            return self.newest[2]
        return site_state.load_shard(self.state_dir, rnd, digest, self.client_id, self.state_auth)


def prepare(config: ClientConfig, client_id: int, num_clients: int, out_dir: Path, device: str,
            keys: RankKeys, ranks: SiteRanks | None = None) -> Prepared:
    """Build site `client_id`'s task (data and model), its SETUP payload, and read its newest shard."""
    from hpcfed.store import site_state

    site = build_site(config, client_id, num_clients, out_dir, device, keys, ranks)
    task: Task = config.site.task_cls(config.site.task_config, site)
    if data_parallel.parallel(ranks):  # a site of many ranks: its leader hands each round to the others
        from hpcfed.client.site_ranks import SiteLeader

        task = SiteLeader(task, ranks)  # type: ignore[arg-type]  # parallel() checked
    state_dir = site_state.site_dir(config.loop.site_state_dir, out=out_dir, client=client_id, rank=client_id + 1)
    state_auth = keys.file_auth("site-shard")
    shards = site_state.held_shards(state_dir, client_id, state_auth)
    newest = None
    if shards:
        rnd, digest = shards[0]
        try:
            newest = (rnd, digest, site_state.load_shard(state_dir, rnd, digest, client_id, state_auth))
        except site_state.ShardError as exc:  # changed since it was listed: read again if the server picks it
            log.warning("client %d: its newest shard could not be read ahead: %s", client_id, exc)
    return Prepared(client_id, num_clients, site, task, task.setup(), state_dir, state_auth, shards, newest)


def build_site(config: ClientConfig, client_id: int, num_clients: int, out_dir: Path, device: str,
               keys: RankKeys | None, ranks: SiteRanks | None = None) -> Site:
    """Where site `client_id`'s task runs, as each of its ranks builds it (every rank of a site holds
    the site's `keys`: under record-level DP they draw the site's batches and noise alike)."""
    from hpcfed.data.root import data_root

    site = config.site
    played = site.attack_played_by(client_id, num_clients)
    return Site(client_id=client_id, num_clients=num_clients, seed=site.seed, out_dir=out_dir,
                data_root=data_root(site.data_root), device=device, method=site.method, attack=attacks.base(played),
                config_hash=site.config_hash, record_dp=_record_dp(site, keys) if keys is not None else None,
                ranks=ranks)


def _record_dp(site: SiteSection, keys: RankKeys) -> Any:
    """The site's `privacy.record_dp` settings with its secret seed (its batches and noise), or None."""
    if site.record_dp is None:
        return None
    from hpcfed.privacy.record_dp import SiteSettings

    seed = keys.secret_seed("record-dp")
    return SiteSettings(site.record_dp, site.rounds, seed, site.source)
