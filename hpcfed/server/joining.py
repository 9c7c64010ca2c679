"""Sites that join after the start (`hpcfed serve`): each is set up on its own and is live from then on.

A federation served across jobs starts with the sites present at its start deadline (at least
``federation.min_sites``). A site that comes later is connected and authenticated by the launcher
(`ServerCore.joiners`) at a safe point: at the start of a synchronous round, which it then takes
part in, or at the next step of the asynchronous loop, which then sends it the current model.
Here it runs its own setup exchange: its SETUP is checked like any other, and it is answered with
the reply every site got at the start (the same for every site: the task's shared setup, e.g.
doc2vec's merged vocabulary, which a late site's words do not change), the current layout, the
round it starts from, and no shard to load (it has none of this run).

The server never waits for a late site: its SETUP (sent once its data is loaded) is looked for at
each safe point. A site that sends none within ``federation.setup_timeout_s``, sends a malformed
one, or is lost meanwhile is not let in (logged with the reason); the federation goes on without it.

A site that was dropped (its job ended, or it was lost) and knocks again with its key *rejoins* the
same way: dropped first if the server had not noticed yet, then set up like a late site, except that
it resumes from its own newest shard of a committed checkpoint (its personal state, local models,
record-DP accountant) when its SETUP reports it holds that shard intact; otherwise (none, pruned,
or another run's) it goes on from the global model, and the log names the shard refused. Its
gap (dropped at round r, back at round s) goes to summary.json's participation.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from hpcfed import protocol as P
from hpcfed.comm.api import ChannelError, Message
from hpcfed.server import validation as V
from hpcfed.server.core import BelowFloor, ServerCore

log = logging.getLogger("hpcfed.server")


def admit(core: ServerCore, start_round: int) -> list[int]:
    """The late sites whose setup is done since the last call, live from now on (from `start_round`).
    A site connected by this call had its data and model ready before it knocked (`hpcfed join`):
    its SETUP is waited for up to `FRESH_SETUP_S`, so that it takes part from this safe point.
    Any other is never waited for: its SETUP is taken at a later call."""
    if core.joiners is None:
        return []
    core.check_departures()  # a site lost and back already is dropped first
    now = time.monotonic()
    connected = core.joiners()
    for cid, knocked in connected.items():
        if not core.roster.may_join(cid):  # (the door lets in only late or lost sites: a safeguard)
            log.warning("client %d (rank %d) connected but is %s: not let in", cid, cid + 1, core.roster.state(cid))
            core.channel.peer_gone(cid + 1)
            continue
        core.departures.coming_back(cid)  # its old job's end is forgotten: the new job's is seen
        core.rejects_before[cid + 1] = core.rejected_by_rank.get(cid + 1, 0)  # security.max_rejects: per job
        core.roster.rejoining[cid] = now + core.config.deadlines.setup_timeout_s
        core.knocked_at[cid] = knocked
    if connected:
        core.refresh_expect()  # their SETUP is taken
    fresh_until = time.monotonic() + FRESH_SETUP_S
    joined = [cid for cid, deadline in sorted(core.roster.rejoining.items())
              if _set_up(core, cid, start_round, deadline, fresh_until if cid in connected else 0.0)]
    if joined:
        back = core.departures.dropped.keys() & set(joined)
        core.roster.join(joined, start_round)
        core.refresh_expect()  # SETUP from them no more
        for cid in joined:
            core.metrics.log(core.round, cid, "rejoined" if cid in back else "joined", start_round,
                             **_knock_time(core, cid))
    return joined


def _knock_time(core: ServerCore, cid: int) -> dict[str, float]:
    """``knock_time``: when site `cid`'s knock was let through, on the metrics' clock (so a reader
    sees how many rounds or uploads it waited); nothing when unknown."""
    knocked = core.knocked_at.pop(cid, None)
    if knocked is None:
        return {}
    return {"knock_time": round(core.metrics.elapsed() - (time.monotonic() - knocked), 4)}


# How long a safe point waits for the SETUP of a site it has just connected: a site prepares before
# it knocks and sends its SETUP right after the handshake, so this covers a loaded node, not its data.
FRESH_SETUP_S = 5.0


def _set_up(core: ServerCore, cid: int, start_round: int, deadline: float, wait_until: float = 0.0) -> bool:
    """Late site `cid`'s setup exchange if its SETUP has come (waited for until `wait_until`): True
    once it is done. A site whose setup fails, or that is gone or silent past `deadline`, is given up
    on (the reason logged)."""
    msg = core.channel.recv(source=cid + 1, kinds={P.SETUP, P.FAILED}, timeout=max(0.0, wait_until - time.monotonic()))
    gone = core.departures.cause_of_silence(cid)
    if msg is None and gone is None and time.monotonic() < deadline:
        return False  # not yet
    del core.roster.rejoining[cid]
    why = _refused(core, cid, msg, gone)
    if why is None:
        assert msg is not None  # no refusal: its SETUP came
        reply_header, reply_tensors = core.setup_reply
        shard = _own_shard(core, cid, msg)
        try:
            core.channel.send(cid + 1, P.SETUP_REPLY, {"task": reply_header, "layout": core.layout.describe(),
                                                       "start_round": start_round, "shard": shard,
                                                       "resumed": shard is not None},
                              P.prefixed(reply_tensors, P.SETUP_PREFIX))
        except ChannelError as exc:
            why = f"it did not take its setup reply ({exc})"
    if why is not None:
        log.warning("client %d (rank %d) %s but is not let in: %s; the federation goes on without it",
                    cid, cid + 1, "came back" if cid in core.departures.dropped else "joined late", why)
        return False
    log.info("client %d (rank %d) %s: it takes part from %s %d on", cid, cid + 1,
             "is back" if cid in core.departures.dropped else "joined late",
             "round" if core.strategy.synchronous else "accepted update", start_round)
    return True


def _own_shard(core: ServerCore, cid: int, setup: Message) -> dict[str, object] | None:
    """The shard returning site `cid` resumes from: its newest in a committed checkpoint, if its
    SETUP says it holds that one intact (None: it goes on from the global model, and why is logged)."""
    ref = core.departures.newest_shard(cid)
    if ref is None:
        return None
    if (ref["round"], ref["digest"]) in V.held_shards(setup.header.get("shards")):
        log.info("client %d (rank %d) resumes from its own shard of round %d (%s)", cid, cid + 1, ref["round"],
                 ref["path"])
        return {"round": ref["round"], "digest": ref["digest"]}
    log.warning("client %d (rank %d) does not hold its shard %s of round %d intact (missing, pruned, or another "
                "run's): refused; it goes on from the global model", cid, cid + 1, ref["path"], ref["round"])
    return None


def _refused(core: ServerCore, cid: int, msg: Message | None, gone: str | None) -> str | None:
    """Why late site `cid`'s setup fails (None: it does not)."""
    if msg is None:
        return (f"it is gone ({gone})" if gone is not None else
                f"it sent no SETUP within {core.config.deadlines.setup_timeout_s:g} s (federation.setup_timeout_s)")
    if msg.kind == P.FAILED:
        return f"it failed during its setup: {V.error_text(msg.header)}"
    header = V.task_header(msg.header)
    if isinstance(header, V.Rejection):
        core.reject(msg.source, header.category, header.detail)
        return f"its SETUP was refused ({header.category})"
    return None


_MEMBERS_POLL_S = 0.5  # how often a round short of sites looks for sites let in


def await_members(core: ServerCore, rnd: int, needed: Callable[[], int]) -> list[int]:
    """Under `hpcfed serve`: wait, letting sites in, until `needed()` are present for round `rnd`'s secure
    sum (at most ``federation.setup_timeout_s``, or until a halt; the count may grow with the sites present).
    The sites let in meanwhile."""
    if core.joiners is None or len(core.live) >= needed():
        return []
    limit = core.config.deadlines.setup_timeout_s
    step = "round" if core.strategy.synchronous else "accepted update"
    log.warning("%s %d: %d site(s) present, it needs %d: waiting up to %g s (federation.setup_timeout_s) "
                "for sites to join or rejoin", step, rnd, len(core.live), needed(), limit)
    deadline = time.monotonic() + limit
    joined: list[int] = []
    while len(core.live) < needed() and time.monotonic() < deadline and not core.halt_requested:
        joined += admit(core, rnd)
        core.maybe_status()
        time.sleep(_MEMBERS_POLL_S)
    return joined


def await_floor(core: ServerCore, rnd: int) -> list[int]:
    """Under `hpcfed serve`, before sync round `rnd` (or the async loop's next step, `rnd` uploads
    accepted): fewer than ``federation.min_sites`` present (every site's job ended at once, say) waits
    up to ``federation.setup_timeout_s`` for sites to rejoin, and only then ends the federation
    (`BelowFloor`, to be continued with --resume). The sites let in meanwhile (async: owed the model)."""
    floor = core.config.roster.min_sites
    if core.joiners is None or len(core.live) >= floor:
        return []  # (a one-job run ends as soon as a site's end leaves fewer: `ServerCore.client_failed`)
    joined = await_members(core, rnd, lambda: floor)
    if len(core.live) < floor:
        raise BelowFloor(f"only {len(core.live)} site(s) present, fewer than federation.min_sites={floor}, and none "
                         f"rejoined within {core.config.deadlines.setup_timeout_s:g} s (federation.setup_timeout_s): "
                         f"the federation stops; continue it with --resume; last checkpoint: "
                         f"{core.last_checkpoint or 'none'}")
    return joined
