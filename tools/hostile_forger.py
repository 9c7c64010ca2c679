"""The hostile rank's weapons for tools/hostile_campaign.py: the attack lists and `Forger`, which crafts
frames, bundles, runtime messages and memory floods from a client rank that holds a live session.

The forger uses the channel's internals (its session keys and sequence counters) on purpose: it is the
adversary holding a compromised client's keys. See tools/hostile_campaign.py for what each list covers
and how a campaign is judged.
"""

from __future__ import annotations

import json
import os
import random
import struct
import time
from collections import Counter, deque
from typing import Any

import ml_dtypes
import numpy as np

FRAME_ATTACKS = (
    "tampered_ciphertext", "tampered_tag", "tampered_header", "replayed_frame", "reordered_seq",
    "reordered_chunk", "truncated_frame", "wrong_key", "wrong_direction_key", "wrong_source_rank",
    "wrong_destination_rank", "misrouted_aad", "oversize_frame", "lying_length", "lying_total",
    "lying_chunk_fields", "bad_version", "bad_frame_type", "bad_flags", "handshake_after_session",
    "confirm_after_session", "garbage",
)
BUNDLE_ATTACKS = (
    "bundle_bad_magic", "bundle_lying_header_len", "bundle_lying_num_tensors", "bundle_lying_total_len",
    "bundle_lying_tensor_nbytes", "bundle_lying_tensor_offset", "bundle_unknown_dtype", "bundle_huge_ndim",
    "bundle_header_not_utf8", "bundle_header_not_json", "bundle_header_not_object", "bundle_header_too_deep",
    "bundle_header_nan", "bundle_header_duplicate_key", "bundle_truncated",
    # issue 12: a huge JSON integer where the server does arithmetic; a zero-size tensor with a 2**64-1 dim
    "bundle_header_huge_int", "bundle_empty_tensor_huge_dim",
)
RUNTIME_ATTACKS = (
    "nan_params", "inf_params", "wrong_dtype_float64", "wrong_dtype_int32", "wrong_dtype_float16",
    "wrong_dtype_bfloat16", "wrong_dtype_group",
    "wrong_shape_short", "wrong_shape_long", "wrong_shape_2d", "wrong_shape_scalar", "missing_params",
    "unknown_name_extra", "unknown_name_only", "bad_num_examples", "bad_metrics", "stale_round",
)
ALL_ATTACKS = FRAME_ATTACKS + BUNDLE_ATTACKS + RUNTIME_ATTACKS
FLOOD_ATTACKS = ("flood_unsolicited_kind", "flood_oversize_update", "flood_declared_8gib")
FLOOD_MESSAGE = 64 << 20  # one unsolicited message of the flood
UNSOLICITED_KIND = 99
MAX_OVERSIZE = 4  # oversize frames are chunk_bytes+ each (4 MiB by default): a few make the point


class RecordingTransport:
    """Wraps the hostile rank's transport: keeps copies of its own honest frames to the server
    (material for replays) and lets the forger send raw bytes."""

    def __init__(self, inner: Any, keep: int = 32) -> None:
        self._inner = inner
        self.captured: deque[bytes] = deque(maxlen=keep)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def isend(self, frame: memoryview, dest: int) -> Any:
        if dest == 0:
            self.captured.append(bytes(frame))
        return self._inner.isend(frame, dest)

    def send_raw(self, frame: bytes | bytearray) -> None:
        """Send bytes to rank 0 as one frame and wait until MPI is done with the buffer."""
        buf = bytearray(frame)
        req = self._inner.isend(memoryview(buf), 0)
        deadline = time.monotonic() + 120
        while not req.test():
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not take a crafted frame within 120 s: it has stopped serving")
            time.sleep(1e-4)


class Forger:
    """Crafts frames, bundles and runtime messages from a client rank with a live session."""

    def __init__(self, channel: Any, layout_size: int, seed: int) -> None:
        from hpcfed.comm import frame as ch

        self.ch_mod = ch
        self.channel = channel
        self.peer = channel._session.peers[0]  # the session with the server: keys + counters
        self.transport: RecordingTransport = channel.transport
        self.rank = channel.rank
        self.size = layout_size
        self.rng = random.Random(seed)
        self.sent: Counter[str] = Counter()
        self.oversize_sent = 0
        self.max_frame = ch.HDR + channel.chunk_bytes + ch.TAG

    # -- frames ---------------------------------------------------------------------------------
    def _next_seq(self, n: int = 1) -> int:
        """Consume sequence numbers so the honest stream continues above every crafted frame."""
        self.peer.send_seq += n
        return self.peer.send_seq - n + 1

    def _next_msg_id(self) -> int:
        self.peer.next_msg_id += 1
        return self.peer.next_msg_id - 1

    def frame(self, payload: bytes, *, kind: int = 4, ftype: int | None = None, seq: int | None = None,
              src: int | None = None, dst: int = 0, msg_id: int | None = None, index: int = 0, count: int = 1,
              offset: int = 0, total: int | None = None, length: int | None = None, version: int | None = None,
              flags: int = 0, aad_header: bytes | None = None, sealer: Any = None) -> bytearray:
        """A sealed frame; every field can lie. The AAD is built from `aad_header` when given."""
        ch = self.ch_mod
        n = len(payload)
        hdr = ch.FRAME.pack(ch.VERSION if version is None else version, ch.F_DATA if ftype is None else ftype,
                            kind, flags, self.rank if src is None else src, dst, n if length is None else length,
                            self._next_seq() if seq is None else seq,
                            self._next_msg_id() if msg_id is None else msg_id, index, count, offset,
                            n if total is None else total)
        out = bytearray(ch.HDR + n + ch.TAG)
        out[:ch.HDR] = hdr
        real_seq = struct.unpack_from("<Q", hdr, 16)[0]
        (sealer or self.peer.tx).seal_into(real_seq, payload, self.channel._session.jd + (aad_header or hdr),
                                           memoryview(out)[ch.HDR:])
        return out

    def honest_bundle(self, rnd: int) -> bytes:
        """A well-formed UPDATE bundle (all-zero model) for round `rnd`."""
        from hpcfed.comm import wire

        return wire.encode(self._update_header(rnd), {"params": np.zeros(self.size, np.float32)})

    def _update_header(self, rnd: int, **over: Any) -> dict:
        h = {"round": rnd, "version": 0, "client_version": 1, "num_examples": 10, "metrics": {"loss": 1.0},
             "pad": "x" * 640}  # room to rewrite the header text in place (a 401-digit integer)
        h.update(over)
        return h

    # -- memory floods (issue 12 item 3) ------------------------------------------------------
    def flood(self, total_bytes: int) -> None:
        """`total_bytes` of authenticated, validly sealed messages the server must not buffer:
        3/4 of a kind it never reads, 1/4 UPDATEs beyond their kind's bound, and a few first
        chunks that declare an 8 GiB UPDATE and never continue."""
        from hpcfed import protocol

        junk = np.zeros(FLOOD_MESSAGE // 4 - 1024, np.float32)
        for _ in range(max(1, total_bytes * 3 // 4 // FLOOD_MESSAGE)):
            self.channel.send(0, UNSOLICITED_KIND, {"flood": True}, {"x": junk})
            self.sent["flood_unsolicited_kind"] += 1
        over = protocol.server_bounds(self.size, 1)[1][protocol.UPDATE] + (8 << 20)
        big = np.zeros(over // 4, np.float32)
        for _ in range(max(1, total_bytes // 4 // over)):
            self.channel.send(0, protocol.UPDATE, self._update_header(0), {"params": big})
            self.sent["flood_oversize_update"] += 1
        del big
        total = 8 << 30
        for _ in range(4):
            self.send_frame("flood_declared_8gib", self.frame(bytes(self.channel.chunk_bytes), kind=protocol.UPDATE,
                                                             count=-(-total // self.channel.chunk_bytes), total=total))

    def send_frame(self, name: str, frame: bytes | bytearray) -> None:
        """Put a raw frame on the wire and count it under attack `name`."""
        self.transport.send_raw(frame)
        self.sent[name] += 1

    def frame_attack(self, name: str, rnd: int) -> bool:
        """Send one crafted frame of kind `name`; False when this kind is used up (oversize)."""
        ch, rng = self.ch_mod, self.rng
        body = self.honest_bundle(rnd)
        if name == "tampered_ciphertext":
            f = self.frame(body)
            f[ch.HDR + rng.randrange(len(body))] ^= 1 << rng.randrange(8)
        elif name == "tampered_tag":
            f = self.frame(body)
            f[-1 - rng.randrange(ch.TAG)] ^= 1 << rng.randrange(8)
        elif name == "tampered_header":
            f = self.frame(body)
            f[2] ^= 0x40  # the message kind, bound into the AAD
        elif name == "replayed_frame":
            f = bytearray(self.transport.captured[rng.randrange(len(self.transport.captured))])
        elif name == "reordered_seq":
            # A freshly sealed frame carrying a sequence number the server has already accepted
            # (taken from one of this rank's honest frames): what a reordering network delivers.
            old = self.transport.captured[rng.randrange(len(self.transport.captured))]
            f = self.frame(body, seq=struct.unpack_from("<Q", old, 16)[0])
        elif name == "reordered_chunk":
            # Chunk 1 of a 2-chunk message arrives without (before) chunk 0.
            total = 8192
            seq0 = self._next_seq(2)
            mid = self._next_msg_id()
            f = self.frame(bytes(4096), seq=seq0 + 1, msg_id=mid, index=1, count=2, offset=4096, total=total)
        elif name == "truncated_frame":
            full = self.frame(body)
            f = full[:rng.randrange(len(full))]
        elif name == "wrong_key":
            f = self.frame(body, sealer=self.ch_mod.crypto.Sealer(os.urandom(32), 1))
        elif name == "wrong_direction_key":
            f = self.frame(body, sealer=self.peer.rx)  # the server->client key
        elif name == "wrong_source_rank":
            f = self.frame(body, src=rng.choice([r for r in range(self.channel.size) if r != self.rank]))
        elif name == "wrong_destination_rank":
            f = self.frame(body, dst=rng.randrange(1, self.channel.size))
        elif name == "misrouted_aad":
            # Header says rank -> 0, but the tag was made for rank -> 1 (a frame meant for another rank).
            seq = self._next_seq()
            mid = self._next_msg_id()
            aad = ch.FRAME.pack(ch.VERSION, ch.F_DATA, 4, 0, self.rank, 1, len(body), seq, mid, 0, 1, 0, len(body))
            f = self.frame(body, seq=seq, msg_id=mid, aad_header=aad)
        elif name == "oversize_frame":
            if self.oversize_sent >= MAX_OVERSIZE:
                return False
            self.oversize_sent += 1
            f = bytearray(self.max_frame + 4096)
            f[:ch.HDR] = ch.FRAME.pack(ch.VERSION, ch.F_DATA, 4, 0, self.rank, 0, len(f) - ch.HDR - ch.TAG,
                                       self._next_seq(), self._next_msg_id(), 0, 1, 0, len(f) - ch.HDR - ch.TAG)
        elif name == "lying_length":
            f = self.frame(body, length=len(body) + rng.choice([1, 100, 1 << 20]))
        elif name == "lying_total":
            f = self.frame(body, total=rng.choice([1 << 40, (1 << 63) - 1]))
        elif name == "lying_chunk_fields":
            index, count, offset = rng.choice([(0, 0, 0), (5, 2, 0), (0, 1, 64), (0, 1 << 31, 0), (1, 1, 0)])
            f = self.frame(body, index=index, count=count, offset=offset)
        elif name == "bad_version":
            f = self.frame(body, version=rng.choice([0, 2, 255]))
        elif name == "bad_frame_type":
            f = self.frame(body, ftype=rng.choice([0, 7, 99, 255]))
        elif name == "bad_flags":
            f = self.frame(body, flags=rng.choice([1, 0x80]))
        elif name == "handshake_after_session":
            ftype = rng.choice([ch.F_HELLO, ch.F_REPLY, ch.F_FINISH, ch.F_REFUSE])
            plain = os.urandom(100) if ftype != ch.F_REFUSE else b"refused"
            f = bytearray(ch.FRAME.pack(ch.VERSION, ftype, 0, 0, self.rank, 0, len(plain), 0, 0, 0, 1, 0, len(plain)))
            f += plain
        elif name == "confirm_after_session":
            f = self.frame(b"", ftype=ch.F_CONFIRM, kind=0)  # authentic, but the handshake is over
        elif name == "garbage":
            f = bytearray(os.urandom(rng.randrange(0, 600)))
            if f:
                f[0] = rng.choice([0, 2, 7, 0xFF])  # never the protocol version: pure noise
        else:
            raise ValueError(f"unknown frame attack {name!r}")
        self.send_frame(name, f)
        return True

    # -- bundles: authentic frames, malformed plaintext ----------------------------------------------
    def bundle_attack(self, name: str, rnd: int) -> bool:
        """Send one authentic frame whose bundle is malformed as `name` says; False when used up."""
        from hpcfed.comm import wire

        b = bytearray(self.honest_bundle(rnd))
        hl = struct.unpack_from("<I", b, 8)[0]
        table = 32 + (hl + 7) // 8 * 8
        header_text = lambda text: b.__setitem__(slice(32, 32 + hl), text.encode().ljust(hl, b" "))
        if name == "bundle_bad_magic":
            b[0:4] = b"PKL\x80"
        elif name == "bundle_lying_header_len":
            struct.pack_into("<I", b, 8, hl + self.rng.choice([8, 4096, 1 << 30]))
        elif name == "bundle_lying_num_tensors":
            struct.pack_into("<I", b, 12, self.rng.choice([0, 2, 10**6, 2**32 - 1]))
        elif name == "bundle_lying_total_len":
            struct.pack_into("<Q", b, 24, len(b) + self.rng.choice([64, 1 << 33]))
        elif name == "bundle_lying_tensor_nbytes":
            struct.pack_into("<Q", b, table + 16, self.size * 4 * 2)
        elif name == "bundle_lying_tensor_offset":
            struct.pack_into("<Q", b, table + 8, struct.unpack_from("<Q", b, table + 8)[0] + 64)
        elif name == "bundle_unknown_dtype":
            b[table + 2] = self.rng.choice([0, 11, 14, 200])
        elif name == "bundle_huge_ndim":
            b[table + 3] = 200
        elif name == "bundle_header_not_utf8":
            b[32:32 + hl] = b"\xff\xfe" * (hl // 2) + b"\xff" * (hl % 2)
        elif name == "bundle_header_not_json":
            header_text("{round: 1, this is not json")
        elif name == "bundle_header_not_object":
            header_text('[{"round": 1}]')
        elif name == "bundle_header_too_deep":
            header_text("[" * 60 + "]" * 60)
        elif name == "bundle_header_nan":
            header_text(f'{{"round": {rnd}, "num_examples": NaN, "metrics": {{}}}}')
        elif name == "bundle_header_duplicate_key":
            header_text(f'{{"round": {rnd}, "round": {rnd}, "num_examples": 1, "metrics": {{}}}}')
        elif name == "bundle_truncated":
            b = b[:len(b) - self.rng.randrange(1, 64)]
        elif name == "bundle_header_huge_int":
            field = self.rng.choice(["num_examples", "version", "round", "metric"])
            values = {"round": rnd, "version": 0, "num_examples": 1, "metrics": {"loss": 1.0}}
            text = json.dumps(values)
            huge = "1" + "0" * 400
            if field == "metric":
                text = text.replace('"loss": 1.0', f'"loss": {huge}')
            else:
                text = text.replace(f'"{field}": {values[field]}', f'"{field}": {huge}', 1)
            header_text(text)
        elif name == "bundle_empty_tensor_huge_dim":
            b = bytearray(wire.encode(self._update_header(rnd), {"params": np.zeros((0, 2), np.float32)}))
            hl = struct.unpack_from("<I", b, 8)[0]
            table = 32 + (hl + 7) // 8 * 8
            struct.pack_into("<Q", b, table + 24 + 8, 2**64 - 1)  # shape (0, 2**64-1): zero bytes, absurd dims
        else:
            raise ValueError(f"unknown bundle attack {name!r}")
        try:
            wire.decode(bytes(b))
        except wire.WireError:
            pass
        else:  # the campaign would be testing nothing: fail loudly instead
            raise AssertionError(f"{name}: the crafted bundle decodes; fix the campaign")
        self.send_frame(name, self.frame(bytes(b)))
        return True

    # -- runtime messages: valid encryption, invalid content ----------------------------------------
    def runtime_attack(self, name: str, rnd: int, version: int) -> bool:
        """Send one valid encrypted message with hostile content `name`; False when used up."""
        from hpcfed import protocol as P

        good = np.zeros(self.size, np.float32)
        header = self._update_header(rnd, version=version)
        header.pop("pad")
        tensors: dict[str, np.ndarray] = {P.PARAMS_KEY: good}
        if name == "nan_params":
            bad = good.copy()
            bad[self.rng.randrange(self.size)] = np.nan
            tensors = {P.PARAMS_KEY: bad}
        elif name == "inf_params":
            bad = good.copy()
            bad[self.rng.randrange(self.size)] = self.rng.choice([np.inf, -np.inf])
            tensors = {P.PARAMS_KEY: bad}
        elif name == "wrong_dtype_float64":
            tensors = {P.PARAMS_KEY: good.astype(np.float64)}
        elif name == "wrong_dtype_int32":
            tensors = {P.PARAMS_KEY: good.astype(np.int32)}
        elif name == "wrong_dtype_float16":
            tensors = {P.PARAMS_KEY: good.astype(np.float16)}
        elif name == "wrong_dtype_bfloat16":  # bf16 where the layout says float32: half the bytes, refused
            tensors = {P.PARAMS_KEY: good.astype(ml_dtypes.bfloat16)}
        elif name == "wrong_dtype_group":  # a dtype group the layout does not have
            tensors = {P.params_key("bfloat16"): good.astype(ml_dtypes.bfloat16)}
        elif name == "wrong_shape_short":
            tensors = {P.PARAMS_KEY: good[:-1]}
        elif name == "wrong_shape_long":
            tensors = {P.PARAMS_KEY: np.zeros(self.size + 7, np.float32)}
        elif name == "wrong_shape_2d":
            tensors = {P.PARAMS_KEY: good.reshape(1, -1)}
        elif name == "wrong_shape_scalar":
            tensors = {P.PARAMS_KEY: np.float32(0.5).reshape(())}
        elif name == "missing_params":
            tensors = {}
        elif name == "unknown_name_extra":
            tensors = {P.PARAMS_KEY: good, self.rng.choice(["evil", "params2", "../params", "init/params"]): good[:4]}
        elif name == "unknown_name_only":
            tensors = {self.rng.choice(["weights", "Params", "params "]): good}
        elif name == "bad_num_examples":
            header["num_examples"] = self.rng.choice([-1, "10", 1.5, True, None, [10]])
        elif name == "bad_metrics":
            header["metrics"] = self.rng.choice([[1.0], "loss", {"loss": "low"}, {"loss": [1.0]}, {"loss": {"a": 1}}])
        elif name == "stale_round":
            header["round"] = self.rng.choice([rnd - 1, rnd + 1, -5, 10**9, "0"])
        else:
            raise ValueError(f"unknown runtime attack {name!r}")
        self.channel.send(0, P.UPDATE, header, tensors)
        self.sent[name] += 1
        return True

    def attack(self, name: str, rnd: int, version: int) -> bool:
        """Send one crafted message of attack `name` (frame, bundle or runtime kind); False when used up."""
        if name in FRAME_ATTACKS:
            return self.frame_attack(name, rnd)
        if name in BUNDLE_ATTACKS:
            return self.bundle_attack(name, rnd)
        return self.runtime_attack(name, rnd, version)
