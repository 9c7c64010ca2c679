"""Fault injection for the tests of lost and paused sites: upload stages installed only when their
environment hook is set (never by a config).

- ``HPCFED_FAULT_STOP_AFTER_UPLOAD=RANK:ROUND``: rank RANK stops itself (SIGSTOP) just after its
  upload of round ROUND, a preempted node paused between its upload and the next model
  (tests/ops/test_lost_sites.py).
"""

from __future__ import annotations

import logging
import os
import signal

from hpcfed.client.upload import RoundStart, Stage, Upload, Upstream

log = logging.getLogger("hpcfed.client")

STOP_AFTER_UPLOAD = "HPCFED_FAULT_STOP_AFTER_UPLOAD"


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
