"""A site's upload as a pipeline of stages: train -> [attack] -> [delta -> clip -> noise -> encode ->
mask] -> send -> [fault], each stage installed only when the config asks for it
(`hpcfed.client.assemble`). The site's loop (`hpcfed.client.client`) only trains; it never knows
which stages are there.

A stage wraps everything upstream of it, as a site mod wraps the next step in Flower: it is called
with the round's `RoundStart` and `upstream`, does what it must before the site trains (secure
aggregation exchanges its keys there), calls ``upstream(start)`` for the `Upload` the stages before
it made (training first), changes it or acts on it (clip, mask, send), and returns it downstream::

    class Stage:
        def __call__(self, start, upstream):
            ...                      # before training
            upload = upstream(start)  # training and the stages before this one
            ...                      # after them: transform, send, pause
            return upload

How to add a stage: write a `Stage` subclass in its own module under `hpcfed/client/`, and one line in
`hpcfed.client.assemble.upload_pipeline` that installs it when its config (or env hook) is set.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcfed import protocol as P
from hpcfed.comm.api import Channel, Message
from hpcfed.params import ParamLayout, Params


@dataclass(frozen=True)
class RoundStart:
    """What one round hands the pipeline: the server's PARAMS, already loaded into the task."""

    round: int
    header: dict[str, Any]  # PARAMS's header (version, checkpoint, secagg_prepared, ...): read with care
    received: Params  # the model as the server sent it (unpacked; the task holds it now)
    current_model: Callable[[], Params]  # the task's model now (before training: the model as loaded)


@dataclass
class Upload:
    """What a round uploads, as it passes the stages: the model, its claimed examples and header;
    under secure aggregation also its update delta, clip and fixed-point input."""

    round: int
    params: Params  # the model to upload (float32 arrays)
    num_examples: int
    header: dict[str, Any]  # round, version, client_version, num_examples, metrics, [shard]
    copies: int = 1  # how many times the sending stage sends it
    # Secure aggregation's input (`hpcfed.client.privacy_stages`): the model as received and the
    # delta from it (float32 / float64 vectors), the clip's factor (folded into the fixed-point pass)
    # and whether the delta was within the clip norm, then the fixed-point codes (uint32, size + 1).
    sent: np.ndarray | None = None
    delta: np.ndarray | None = None
    scale: float = 1.0
    within: bool = True
    codes: np.ndarray | None = None


Upstream = Callable[[RoundStart], Upload]


class Stage:
    """One step of the upload. Subclasses override `__call__`."""

    def __call__(self, start: RoundStart, upstream: Upstream) -> Upload:
        """Run `upstream` (training and the stages before this one) for `start` and return its upload,
        acting before or after it."""
        return upstream(start)


class Superseded(Exception):
    """The server sent something else while a stage waited: the round is over for this site; `msg`
    is that message, which the site's loop handles next."""

    def __init__(self, msg: Message, during: str) -> None:
        super().__init__(f"{P.NAMES.get(msg.kind, msg.kind)} arrived during {during}")
        self.msg = msg


class Pipeline:
    """`train` wrapped by `stages`, listed in the order an upload passes them (the last wraps all)."""

    def __init__(self, train: Upstream, stages: Sequence[Stage]) -> None:
        self.stages = tuple(stages)
        run = train
        for stage in self.stages:
            run = _wrap(stage, run)
        self._run = run

    def __call__(self, start: RoundStart) -> Upload:
        """One round's upload: every stage's work before training, training, then theirs after it."""
        return self._run(start)


def _wrap(stage: Stage, upstream: Upstream) -> Upstream:
    return lambda start: stage(start, upstream)


class Send(Stage):
    """Sends the upload to the server as UPDATE (`copies` times): the last stage of a plain upload."""

    def __init__(self, channel: Channel, layout: ParamLayout) -> None:
        self.channel, self.layout = channel, layout

    def __call__(self, start: RoundStart, upstream: Upstream) -> Upload:
        upload = upstream(start)
        header, tensors = self.message(upload)
        for _ in range(upload.copies):
            self.channel.send(0, P.UPDATE, header, tensors)
        return upload

    def message(self, upload: Upload) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The UPDATE's header (its count the upload's) and tensors (the model packed by layout)."""
        upload.header["num_examples"] = upload.num_examples
        return upload.header, P.params_tensors(self.layout.pack(upload.params))
