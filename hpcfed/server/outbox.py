"""The asynchronous server's mailbox: at most one model message in flight per client.

A client busy computing takes no message, and a large one cannot be delivered until it does. If
the server waited for that (a blocking send), every fast client would wait for the slowest one:
asynchronous aggregation would run at the straggler's pace. So the server only *owes* a client a
model: it posts the message without waiting when nothing is in flight to that client, and
otherwise posts the newest model as soon as the client has taken the previous one. A client only
ever trains on the newest model it has (`Client._skip_stale`), so the models it would have taken
in between were never needed, and a busy client costs neither time nor memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from hpcfed.comm.api import Channel, Outgoing

# (kind, header, tensors) of the message owed to a client, built when it is posted
Compose = Callable[[int, bool], tuple[int, dict[str, Any], dict[str, np.ndarray]]]


class ModelOutbox:
    """`owe(cid, answer)` now; `flush()` often. `compose(cid, answer)` builds the message
    (kind, header, tensors) from the server's state at the moment it is posted."""

    def __init__(self, channel: Channel, compose: Compose) -> None:
        self._channel = channel
        self._compose = compose
        self._owed: dict[int, bool] = {}  # client id -> whether the message answers its upload
        self._inflight: dict[int, Outgoing] = {}

    def owe(self, cid: int, answer: bool) -> None:
        """Owe client `cid` the newest model (`answer`: it answers the client's upload), posted now if it is free."""
        # An owed answer stays an answer when a broadcast is merged into it: the client waits for it.
        self._owed[cid] = self._owed.get(cid, False) or answer
        self.flush()

    def flush(self) -> None:
        """Post what is owed to every client that has taken its previous message."""
        for cid in sorted(self._owed):
            previous = self._inflight.get(cid)
            if previous is not None and not previous.done():
                continue
            kind, header, tensors = self._compose(cid, self._owed.pop(cid))
            self._inflight[cid] = self._channel.post(cid + 1, kind, header, tensors)

    def waiting(self) -> bool:
        """Whether something is owed but not yet posted (the server should flush again soon)."""
        return bool(self._owed)

    def forget(self, cid: int | None = None) -> None:
        """Owe nothing more to `cid` (a client that failed), or to anyone (the federation ends).
        Messages already posted are left to the channel, which keeps their buffers alive."""
        for c in [cid] if cid is not None else list(self._owed):
            self._owed.pop(c, None)
