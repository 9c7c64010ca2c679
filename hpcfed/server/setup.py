"""The setup exchange, and on --resume the checkpoint every site can continue from.

Every site sends SETUP (its task payload; client 0 also its initial model; on --resume the shards
it holds intact). The task's `server_setup` answers them and may build the initial model; the
strategy starts from it, or from the newest verified checkpoint manifest whose every shard its site
holds. Each site is then told the layout, the round to start from and the shard to load.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from hpcfed import protocol as P
from hpcfed.errors import FederationError
from hpcfed.server import validation as V
from hpcfed.server.config import TrackingSection
from hpcfed.server.core import ServerCore
from hpcfed.server.metrics import MetricsLog
from hpcfed.server.tracking import Mirror
from hpcfed.store import checkpoint as ckpt_store

log = logging.getLogger("hpcfed.server")

Held = dict[int, set[tuple[int, str]]]  # client id -> the (round, digest) of each shard it holds intact


def exchange(core: ServerCore, resume: bool) -> int:
    """Run the setup exchange (resuming from a checkpoint with `resume`); returns the first round to run."""
    payloads: dict[int, tuple[dict[str, Any], dict[str, np.ndarray]]] = {}
    held: Held = {}
    initial = None
    out = _left_out(core, resume)
    _drop_unconnected(core)
    deadline = time.monotonic() + core.config.deadlines.setup_timeout_s
    while len(payloads) < len(core.live):
        msg = core.recv_until(deadline, {P.SETUP, P.FAILED}, "the setup exchange",
                              waiting_for=core.live - set(payloads))
        cid = msg.source - 1
        if cid not in core.live:
            continue  # a site left out of this run: nothing it says is read
        header = V.task_header(msg.header)
        if isinstance(header, V.Rejection):
            core.reject(msg.source, header.category, header.detail)
            continue
        payloads[cid] = (header, P.split_prefixed(msg.tensors, P.SETUP_PREFIX))
        held[cid] = V.held_shards(msg.header.get("shards"))
        if cid == 0:
            initial = {k: np.array(v) for k, v in P.split_prefixed(msg.tensors, P.INIT_PREFIX).items()}
    replies, server_init = core.task_cls.server_setup(core.task_config, payloads)
    if replies:  # every site's reply is the same (empty, or what all sites share): a late site gets it
        core.setup_reply = replies[min(replies)]
    init = server_init if server_init is not None else initial
    if not init:
        raise FederationError("client 0 (rank 1) sent no initial model and the task's server_setup built none"
                              + ("; client 0 cannot be left out (federation.exclude_sites)" if 0 in out else ""))
    core.strategy.initialize(init)
    layout = core.strategy.layout
    if layout is None:
        raise FederationError(f"strategy {core.config.run.strategy!r} set no layout in initialize()")
    resumed = _load_checkpoint(core, held) if resume else None
    start_round = resumed.round + 1 if resumed else 0
    elapsed = float(resumed.meta.get("elapsed", 0.0)) if resumed else 0.0
    mirror = live_view(core.config.tracking, core.out_dir, elapsed)
    metrics = MetricsLog(core.out_dir / "metrics.jsonl", resume_round=resumed.round if resumed else None,
                         time_offset=elapsed, mirror=mirror)
    layout_header = layout.describe()
    for cid in sorted(out - set(core.config.roster.exclude_sites)):  # evicted in an earlier attempt: tell it
        if cid + 1 in core.channel.peers:  # (`hpcfed serve` lets none in: its knock was refused)
            core.channel.post(cid + 1, P.EVICTED, {"reason": core.ledger.evicted[cid].reason})
    for cid in sorted(core.live):
        reply_header, reply_tensors = replies.get(cid, ({}, {}))
        shard = None  # which of its own shards the site loads (it verifies it against this digest)
        if resumed and cid in resumed.sites:
            ref = resumed.sites[cid]  # a site dropped before this checkpoint loads its last shard
            shard = {"round": ref.get("round", resumed.round), "digest": ref["digest"]}
        core.channel.send(cid + 1, P.SETUP_REPLY, {
            "task": reply_header, "layout": layout_header, "start_round": start_round,
            "shard": shard, "resumed": bool(resumed),
        }, P.prefixed(reply_tensors, P.SETUP_PREFIX))
    log.info("setup done: %d clients, %d parameters%s", core.num_clients, layout.size,
             f", resumed from {resumed.path} (round {resumed.round})" if resumed else "")
    core.start(layout, metrics)
    return start_round


def _drop_unconnected(core: ServerCore) -> None:
    """Sites that ended during the secure handshake (the channel left them out; see
    `hpcfed.comm.star.open_star`): dropped at round -1, or the federation ends naming them."""
    for cid in sorted(core.live):
        if cid + 1 not in core.channel.peers:
            cause = core.departures.cause_of_silence(cid) or "did not complete the secure handshake"
            core.client_failed(cid, f"{cause} during setup")


def _left_out(core: ServerCore, resume: bool) -> set[int]:
    """The sites this run goes on without: those the operator excludes (federation.exclude_sites),
    and on --resume those the newest checkpoint recorded as evicted. They leave `core.live`."""
    rnd = max(core.round, 0)
    if resume:
        core.ledger.load_state(evicted_state(core.out_dir, core.file_auth), core.num_clients)
    for cid in core.config.roster.exclude_sites:
        if 0 <= cid < core.num_clients:
            core.ledger.exclude(cid, rnd)
    core.roster.leave_out()
    if core.ledger.evicted:
        log.warning("this run goes on without %s", "; ".join(
            f"client {e.client} (rank {e.rank}): {e.reason}" for e in core.ledger.evicted.values()))
    return set(core.ledger.evicted)


def evicted_state(out_dir: Path, file_auth: Any) -> object:
    """The evictions the newest verified checkpoint in `out_dir` recorded (its meta's list; None if
    none verifies): a resumed run goes on without these sites, and does not wait for them."""
    for path in ckpt_store.list_checkpoints(out_dir / "checkpoints"):
        try:
            ckpt = ckpt_store.load(path, file_auth)
        except ckpt_store.CheckpointError:
            continue  # named when the checkpoint to resume from is picked
        return ckpt.meta.get("evicted")
    return None


def evicted_on_resume(out_dir: Path, file_auth: Any, num_clients: int) -> dict[int, str]:
    """Client id -> why, for the sites the newest verified checkpoint in `out_dir` recorded as
    evicted (or excluded): `hpcfed serve --resume` does not wait for them while it gathers sites."""
    from hpcfed.server.eviction import Ledger

    ledger = Ledger("evict", 0)
    ledger.load_state(evicted_state(out_dir, file_auth), num_clients)
    return {cid: e.reason for cid, e in ledger.evicted.items()}


def _load_checkpoint(core: ServerCore, held: Held) -> ckpt_store.Checkpoint | None:
    """Load the newest checkpoint every site holds into the strategy and the core; None to start over.

    Its config is not compared with this run's here: `hpcfed.launch.out_dir.prepare_out_dir` does that
    (before any rank starts, and again on rank 0 under a bare mpiexec), and every checkpoint in one
    run directory has the same resume-critical config (see the comment there)."""
    folder = core.out_dir / "checkpoints"
    ckpt = _newest_held(core, held)
    if ckpt is None:
        found = ckpt_store.list_checkpoints(folder)
        if found:  # starting from round 0 would overwrite the run they belong to
            raise FederationError(f"--resume: none of the {len(found)} checkpoints in {folder} verifies (see above); "
                                  f"nothing was changed; move them away and rerun with --force to start over")
        if (core.out_dir / "summary.json").exists():
            raise FederationError(f"--resume: {core.out_dir} holds a finished run but no checkpoint to continue it "
                                  f"from; rerun with --force to start over, or choose another --out")
        log.warning("--resume: no checkpoint in %s yet; starting from round 0", folder)
        return None
    core.strategy.load_state_dict(ckpt.strategy)
    core.updates_accepted = int(ckpt.meta.get("updates_accepted", 0))
    core.influence.load_state(ckpt.meta.get("influence"))
    core.participation.load_state(ckpt.meta.get("participation"))
    lost = ckpt.meta.get("lost_rounds")
    core.lost_rounds = [int(r) for r in lost if isinstance(r, int)] if isinstance(lost, list) else []
    core.last_checkpoint = ckpt.path
    core.round = ckpt.round
    core.departures.load_shards(ckpt.round, ckpt.sites)
    return ckpt


def _newest_held(core: ServerCore, held: Held) -> ckpt_store.Checkpoint | None:
    """The newest verified manifest whose every site shard its site holds intact.

    A manifest whose shard is gone or corrupt at some site is skipped (named in the log); if
    valid manifests exist but none is held by every site, the federation stops naming the site."""
    first_gap = None
    for path in ckpt_store.list_checkpoints(core.out_dir / "checkpoints"):
        try:
            ckpt = ckpt_store.load(path, core.file_auth)
        except ckpt_store.CheckpointError as exc:
            log.warning("skipping checkpoint: %s", exc)
            continue
        gaps = [(cid, ref) for cid, ref in sorted(ckpt.sites.items())  # a site left out needs no shard
                if cid in core.live and (ref.get("round", ckpt.round), ref["digest"]) not in held.get(cid, set())]
        if not gaps:
            return ckpt
        cid, ref = gaps[0]
        gap = f"client {cid} (rank {cid + 1}) does not hold its shard {ref['path']} intact"
        log.warning("skipping checkpoint %s: %s", path.name, gap)
        first_gap = first_gap or f"{gap} (checkpoint {path.name})"
    if first_gap:
        raise FederationError(f"--resume: no checkpoint is held intact by every site: {first_gap}; "
                              f"restore that site's shards, or rerun with --force to start over")
    return None


def live_view(tracking: TrackingSection | None, out_dir: Path, elapsed: float) -> Mirror | None:
    """The `tracking:` trackers of the run, or None; wall times continue a resumed run's clock."""
    if tracking is None:
        return None
    from hpcfed.server.tracking import open_trackers

    return Mirror(open_trackers(tracking.trackers, out_dir, tracking.run_name, tracking.params), time.time() - elapsed)
