"""Malicious-site behaviours the runtime itself can play (``attack=NAME``: the last client turns
malicious), for measuring what bounded influence leaves an attacker (`tools/insider_attacks.py`).

Task-defined attacks (DAMe's ``model`` / ``data``) live in their tasks; these work with any task
because they only rewrite what the site uploads:

- ``claim_examples``: a constant model, claiming 10**12 training examples (FedAvg's weight).
- ``scale``: the trained model times 1e30 (finite, enormous).
- ``sign_flip``: the received model minus 10 x the site's honest step.
- ``flood``: 20 copies of every upload, none of them asked for (async).
- ``constant_twice``: a constant model (every parameter 7.0) sent twice: it does not train, so its
  first upload reaches rank 0 before any honest one; the copy is unrequested (async) and evicts it.
- ``scale_later``: honest at first, then (from its third upload) the trained model times 1e30:
  judged against its own accepted uploads, its refusals count toward eviction.

Under secure aggregation (`hpcfed.client.secagg`) the same four act on the site's input before
masking: the tampered model's delta, weighted by the claimed count, goes into fixed point without
the site's own clip to C or its bound on the count (`unbounded_input`: a modified binary keeps
neither), within the range the encoding allows; ``flood`` sends 20 copies of each masked input.

Under secure aggregation only (``garbage*``, `garbage_input`): random field elements instead of
the site's fixed-point input (so its masked input is random too), for group testing
(`hpcfed.privacy.group_testing`): ``garbage`` (every coordinate, every round), ``garbage_weight``
(the weight only), ``garbage_vector`` (the weighted delta only), ``garbage_once`` (round 0 only),
``garbage_alternate`` (even rounds).

Misbehaviour the server evicts a site for (`hpcfed.server.eviction`): the site's first upload is
replaced by one malformed UPDATE, and then it stays quiet (``then_flood``: it keeps sending after
it is evicted):

- ``bad_header``: a header integer beyond int64 (``client_version`` = 2**64).
- ``bad_shape``: a tensor of shape (0, 2**64-1).
- ``bad_count``: ``num_examples`` beyond int64.
- ``bad_header_then_flood``: ``bad_header``, then `FLOOD_AFTER` model-sized UPDATEs after eviction.

A hostile site that will not leave (``ignore_stop``: honest uploads; ``NAME_then_linger`` for each
malformed NAME above) ignores STOP, EVICTED and every later message and keeps its process alive,
sending nothing (`linger`): rank 0 ends the job after its grace (`hpcfed.launch.rank`).

The sender's own encoder refuses all three, so the hostile site lifts its own checks while it
sends: what arrives is what a modified binary would send.

Each behaviour is an upload stage (`hpcfed.client.upload`) that `hpcfed.client.assemble` installs on
the malicious site only: `Tamper`, `UnboundedEncode` (in place of the clip and the encoding under
secure aggregation), `Garbage` (after the honest encoding, under secure aggregation only) and
`MalformedSend` (in place of `Send`); `flood_after_eviction` is the hook
`hpcfed.client.assemble.eviction_hooks` installs for ``bad_header_then_flood``.
"""

from __future__ import annotations

import itertools
import signal
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

from hpcfed import protocol as P
from hpcfed.client.upload import RoundStart, Send, Stage, Upload, Upstream
from hpcfed.comm.api import Channel, ChannelError
from hpcfed.params import ParamLayout, Params
from hpcfed.privacy import masking

if TYPE_CHECKING:
    from hpcfed.privacy.site_input import InputSpec

RUNTIME_ATTACKS = ("claim_examples", "scale", "sign_flip", "flood", "scale_later", "constant_twice")
HONEST_UPLOADS = 2  # ``scale_later``: uploads it sends untouched first
GARBAGE_ATTACKS = ("garbage", "garbage_weight", "garbage_vector", "garbage_once", "garbage_alternate")
FLOOD_COPIES = 20
MALFORMED_ATTACKS = ("bad_header", "bad_shape", "bad_count", "bad_header_then_flood")
FLOOD_AFTER = 100  # UPDATEs an evicted ``..._then_flood`` site sends anyway ...
FLOOD_FLOATS = 2 << 20  # ... of 8 MiB each (800 MiB in all: more than rank 0 could hold unnoticed)
BEYOND_INT64 = 2**64
_uploads = itertools.count()  # this site's uploads so far (``scale_later``)


LINGER = "_then_linger"


def lingers(attack: str | None) -> bool:
    """Whether a site playing `attack` stays after STOP or EVICTED (`linger`)."""
    return attack is not None and (attack == "ignore_stop" or attack.endswith(LINGER))


def base(attack: str | None) -> str | None:
    """What a site playing `attack` sends: ``bad_header`` for ``bad_header_then_linger``, nothing
    tampered for ``ignore_stop``."""
    if attack is None or attack == "ignore_stop":
        return None
    return attack.removesuffix(LINGER)


def linger() -> None:
    """Ignore every message and signal that asks this process to go, and send nothing, for ever:
    the job must end without it."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    while True:
        time.sleep(3600)


def tamper(attack: str, trained: Params, received: Params, num_examples: int) -> tuple[Params, int, int]:
    """(parameters to upload, claimed examples, copies to send) for one malicious upload."""
    if attack == "claim_examples":
        return {k: np.full_like(v, 0.5) if _is_float(v) else v for k, v in trained.items()}, 10**12, 1
    if attack == "scale":
        return {k: (v * np.float32(1e30)).astype(v.dtype) if _is_float(v) else v
                for k, v in trained.items()}, num_examples, 1
    if attack == "sign_flip":
        return {k: (received[k] - 10 * (v - received[k])).astype(v.dtype) if _is_float(v) else v
                for k, v in trained.items()}, num_examples, 1
    if attack == "flood":
        return trained, num_examples, FLOOD_COPIES
    if attack == "constant_twice":
        return {k: np.full_like(v, 7.0) if _is_float(v) else v for k, v in trained.items()}, num_examples, 2
    if attack == "scale_later":
        # one site per process: the count of its own uploads (a tampering binary keeps what it likes)
        if next(_uploads) < HONEST_UPLOADS:
            return trained, num_examples, 1
        return tamper("scale", trained, received, num_examples)
    raise ValueError(f"unknown runtime attack {attack!r}; choose one of: {', '.join(RUNTIME_ATTACKS)}")


def unbounded_input(delta: np.ndarray, claimed: int, spec: InputSpec) -> np.ndarray:
    """A malicious site's secure aggregation input: w·delta in fixed point with w = claimed /
    max_examples, NOT clipped to C, each coordinate still within the encoding's ±R, and the claimed
    count written mod 2^32 where an honest site refuses one above max_examples."""
    codes = np.empty(delta.size + 1, dtype=np.uint32)
    masking.quantise(delta, spec.value_range, spec.levels, claimed / spec.max_examples, out=codes[:-1])
    codes[-1] = claimed % (1 << 32)
    return codes


def garbage_input(attack: str, codes: np.ndarray, rnd: int) -> np.ndarray:
    """A hostile site's secure aggregation input under a ``garbage*`` attack in round `rnd`: random
    uint32 field elements where the attack puts them (`codes` as they are in a round it behaves)."""
    if (attack == "garbage_once" and rnd != 0) or (attack == "garbage_alternate" and rnd % 2):
        return codes
    rng = np.random.default_rng()
    out = codes.copy()
    part = slice(-1, None) if attack == "garbage_weight" else slice(None, -1) if attack == "garbage_vector" \
        else slice(None)
    out[part] = rng.integers(0, 1 << 32, size=out[part].size, dtype=np.uint64).astype(np.uint32)
    return out


def _is_float(v: np.ndarray) -> bool:
    return np.asarray(v).dtype.kind == "f" or str(np.asarray(v).dtype) == "bfloat16"


def malformed_update(attack: str, header: dict[str, Any], tensors: dict[str, np.ndarray],
                     send: Callable[[dict[str, Any], dict[str, np.ndarray]], None]) -> None:
    """Send one malformed UPDATE for `attack` (one of `MALFORMED_ATTACKS`) through `send`."""
    from hpcfed.comm import bounded_json, wire

    if attack == "bad_shape":
        with _patched(wire, "struct", _ShapeLie()):
            send(header, {"params": np.zeros((0, 1), dtype=np.float32)})
        return
    field = "num_examples" if attack == "bad_count" else "client_version"
    with _patched(bounded_json, "INT_MAX", BEYOND_INT64 * 2):  # the encoder's own bound, lifted
        send({**header, field: BEYOND_INT64}, tensors)


@contextmanager
def _patched(module: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


class _ShapeLie:
    """`struct` as the wire encoder sees it, except that a (0, 1) shape goes out as (0, 2**64-1)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(struct, name)

    @staticmethod
    def pack(fmt: str, *values: Any) -> bytes:
        if fmt == "<2Q" and values == (0, 1):
            values = (0, BEYOND_INT64 - 1)
        return struct.pack(fmt, *values)


# ------------------------------------------------------------------------------------------------
# the attacks as upload stages


class Tamper(Stage):
    """A runtime attack (`RUNTIME_ATTACKS`) on what the site trained: `tamper` with the model as received."""

    def __init__(self, attack: str) -> None:
        self.attack = attack

    def __call__(self, start: RoundStart, upstream: Upstream) -> Upload:
        received = {k: v.copy() for k, v in start.received.items()}  # before training changes the task's model
        upload = upstream(start)
        upload.params, upload.num_examples, upload.copies = tamper(self.attack, upload.params, received,
                                                                   upload.num_examples)
        return upload


class UnboundedEncode(Stage):
    """In place of the clip and the encoding under secure aggregation: `unbounded_input`, the tampered
    delta weighted by its claimed count, not clipped, the count not bounded (1 when sites weigh alike)."""

    def __init__(self, spec: InputSpec, uniform: bool) -> None:
        self.spec = spec
        self.uniform = uniform or spec.noise_std > 0

    def __call__(self, start: RoundStart, upstream: Upstream) -> Upload:
        upload = upstream(start)
        assert upload.delta is not None, "UnboundedEncode runs downstream of Delta"
        weight = 1 if self.uniform else upload.num_examples
        upload.codes, upload.within = unbounded_input(upload.delta, weight, self.spec), False
        return upload


class Garbage(Stage):
    """A ``garbage*`` attack (`GARBAGE_ATTACKS`) after the honest encoding under secure aggregation:
    `garbage_input` in place of the site's fixed-point input, in the rounds and parts the attack picks."""

    def __init__(self, attack: str) -> None:
        self.attack = attack

    def __call__(self, start: RoundStart, upstream: Upstream) -> Upload:
        upload = upstream(start)
        assert upload.codes is not None, "Garbage runs downstream of Encode"
        upload.codes = garbage_input(self.attack, upload.codes, start.round)
        return upload


class MalformedSend(Send):
    """In place of `Send`: the site's first upload is one malformed UPDATE (`malformed_update`), the
    rest are sent as an honest site sends them."""

    def __init__(self, channel: Channel, layout: ParamLayout, attack: str) -> None:
        super().__init__(channel, layout)
        self.attack, self.misbehaved = attack, False

    def __call__(self, start: RoundStart, upstream: Upstream) -> Upload:
        if self.misbehaved:
            return super().__call__(start, upstream)
        upload = upstream(start)
        header, tensors = self.message(upload)
        self.misbehaved = True  # once, then quiet
        malformed_update(self.attack, header, tensors, lambda h, t: self.channel.send(0, P.UPDATE, h, t))
        return upload


def flood_after_eviction(channel: Channel) -> None:
    """``bad_header_then_flood``: evicted, the site ignores it and sends `FLOOD_AFTER` model-sized UPDATEs."""
    flood = {P.PARAMS_KEY: np.zeros(FLOOD_FLOATS, dtype=np.float32)}
    for _ in range(FLOOD_AFTER):
        try:
            channel.send(0, P.UPDATE, {"round": 0, "num_examples": 1, "metrics": {}}, flood)
        except ChannelError:
            break  # the server has finished: the flood ends with the job
