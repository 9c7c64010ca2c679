"""Fault injection for the tests of lost and paused sites: upload stages installed only when their
environment hook is set (never by a config).

- ``HPCFED_FAULT_STOP_AFTER_UPLOAD=RANK:ROUND``: rank RANK stops itself (SIGSTOP) just after its
  upload of round ROUND, a preempted node paused between its upload and the next model
  (tests/ops/test_lost_sites.py).
- ``HPCFED_FAULT_NON_LEADER_SENDS=RANK``: world rank RANK, a site's non-leader, sends frames to rank 0
  on MPI_COMM_WORLD as if it spoke for its site (tests/ops/test_site_ranks.py: they are refused).
"""

from __future__ import annotations

import logging
import os
import signal

from hpcfed.client.upload import RoundStart, Stage, Upload, Upstream

log = logging.getLogger("hpcfed.client")

STOP_AFTER_UPLOAD = "HPCFED_FAULT_STOP_AFTER_UPLOAD"
NON_LEADER_SENDS = "HPCFED_FAULT_NON_LEADER_SENDS"


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
