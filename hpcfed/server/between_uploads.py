"""What the two asynchronous loops share between uploads: `hpcfed.server.async_loop` (each upload
folded as it comes) and `hpcfed.server.buffered` (buffers summed securely among their members).

- `due`: whether a halt or a checkpoint fell due with the uploads just accepted;
- `gather_shards`: a checkpoint between uploads: every live site writes its shard and the manifest
  is committed with the server's state after the uploads so far; an upload arriving meanwhile goes
  to the loop's own handler (held, or dropped);
- `fail_silent`: a site unheard of for ``federation.round_deadline_s`` while it trains has failed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping

from hpcfed import protocol as P
from hpcfed.comm.api import Message
from hpcfed.server import validation as V
from hpcfed.server.core import ServerCore


def due(core: ServerCore, count: int, max_updates: int) -> tuple[bool, bool]:
    """(halt, checkpoint) once `count` uploads were just accepted: halt when asked (SIGUSR2, OUT/HALT)
    or when `halt_after_round` (accepted uploads) fell among them, while the budget is not spent; a
    checkpoint to halt, or when one of every ``checkpoint_every`` x K uploads fell among them."""
    done, before = core.updates_accepted, core.updates_accepted - count
    every = core.config.checkpoints.every * core.num_clients  # 0: no checkpoint but a halt's
    halt_at = core.config.checkpoints.halt_after_round
    halt = (core.halt_requested or (halt_at is not None and before < halt_at <= done)) and done < max_updates
    return halt, halt or (every > 0 and done // every > before // every)


def gather_shards(core: ServerCore, last_seen: dict[int, float], upload_kind: int,
                  on_upload: Callable[[Message], None]) -> None:
    """Ask every live site for its shard and commit the checkpoint of `core.updates_accepted`; a site
    that writes none within the round deadline has failed. A message of `upload_kind` arriving
    meanwhile (sent before the site saw CHECKPOINT) goes to `on_upload`."""
    rnd = core.updates_accepted
    for cid in sorted(core.live):
        core.send_to(cid, P.CHECKPOINT, {"round": rnd})
    sites: dict[int, V.ShardRef | None] = {}
    limit = core.config.deadlines.round_deadline_s
    deadline = time.monotonic() + limit
    while len(sites) < len(core.live):
        msg = core.recv_until(deadline, {P.CHECKPOINT_DONE, P.FAILED, upload_kind}, f"checkpoint {rnd}",
                              waiting_for=core.live - set(sites), fatal=False)
        if msg is None:  # a silent site has failed (dropped with on_client_failure=continue)
            for cid in sorted(core.live - set(sites)):
                core.client_failed(cid, f"wrote no checkpoint shard within {limit:g} s")
            break
        if msg.kind == upload_kind:
            on_upload(msg)
            continue
        cid, ref = msg.source - 1, V.shard_ref(msg.header)
        if cid not in core.live or ref is None or ref["round"] != rnd:
            core.reject(msg.source, "malformed header", f"CHECKPOINT_DONE for checkpoint {rnd}")
            continue
        sites[cid] = ref
        last_seen[cid] = time.monotonic()
    core.commit_checkpoint(rnd, sites)


def fail_silent(core: ServerCore, last_seen: Mapping[int, float], waiting: Collection[int], what: str) -> None:
    """Every live site but those `waiting` on the server that was last heard of more than
    ``round_deadline_s`` ago has failed: "`what` within LIMIT s" says what it did not do."""
    limit = core.config.deadlines.round_deadline_s
    now = time.monotonic()
    for cid in sorted(core.live - set(waiting)):
        if now - last_seen.get(cid, now) > limit:
            core.client_failed(cid, f"{what} within {limit:g} s (federation.round_deadline_s)")
