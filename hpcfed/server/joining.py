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
"""

from __future__ import annotations

import logging
import time

from hpcfed import protocol as P
from hpcfed.comm.api import ChannelError, Message
from hpcfed.server import validation as V
from hpcfed.server.core import ServerCore

log = logging.getLogger("hpcfed.server")


def admit(core: ServerCore, start_round: int) -> list[int]:
    """The late sites whose setup is done since the last call, live from now on (from `start_round`).
    Never waits: a site connected now sends its SETUP when its data is loaded, taken at a later call."""
    if core.joiners is None or not core.absent:
        return []
    now = time.monotonic()
    for cid in core.joiners():
        if cid in core.absent:
            core.roster.rejoining.setdefault(cid, now + core.config.deadlines.setup_timeout_s)
    joined = [cid for cid, deadline in sorted(core.roster.rejoining.items())
              if _set_up(core, cid, start_round, deadline)]
    if joined:
        core.roster.join(joined)
        core.refresh_expect()  # SETUP from them no more
        for cid in joined:
            core.metrics.log(core.round, cid, "joined", start_round)
    return joined


def _set_up(core: ServerCore, cid: int, start_round: int, deadline: float) -> bool:
    """Late site `cid`'s setup exchange if its SETUP has come: True once it is done. A site whose
    setup fails, or that is gone or silent past `deadline`, is given up on (the reason logged)."""
    msg = core.channel.recv(source=cid + 1, kinds={P.SETUP, P.FAILED}, timeout=0)
    gone = core.departures.cause_of_silence(cid)
    if msg is None and gone is None and time.monotonic() < deadline:
        return False  # not yet
    del core.roster.rejoining[cid]
    why = _refused(core, cid, msg, gone)
    if why is None:
        reply_header, reply_tensors = core.setup_reply
        try:
            core.channel.send(cid + 1, P.SETUP_REPLY, {"task": reply_header, "layout": core.layout.describe(),
                                                       "start_round": start_round, "shard": None, "resumed": False},
                              P.prefixed(reply_tensors, P.SETUP_PREFIX))
        except ChannelError as exc:
            why = f"it did not take its setup reply ({exc})"
    if why is not None:
        log.warning("client %d (rank %d) joined late but is not let in: %s; the federation goes on without it",
                    cid, cid + 1, why)
        return False
    log.info("client %d (rank %d) joined late: it takes part from %s %d on", cid, cid + 1,
             "round" if core.strategy.synchronous else "accepted update", start_round)
    return True


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
