#!/usr/bin/env python3
"""Hostile-input campaign against a LIVE hpcfed server.

    python tools/hostile_campaign.py [--json] [--messages 1200] [--config configs/quickstart.yaml]
                                     [--out DIR] [key=value ...]

Runs the real runtime twice under ``mpiexec`` on the same config, with the same world size:

1. **baseline**: ``mpiexec -n K+2 python -m hpcfed run CONFIG`` — server + K+1 honest clients;
2. **attacked**: ``mpiexec -n K+1 python -m hpcfed run CONFIG : -n 1 python tools/hostile_campaign.py
   --worker ...`` — the last rank is hostile. It is an *authenticated* client (it holds the job's key
   and completes the secure handshake) that trains honestly, so the federation has the same members
   as the baseline, and before each of its honest uploads it sends a batch of crafted messages to the
   server (rank 0):

   - frames (`FRAME_ATTACKS`): tampered ciphertext / tag / header, replayed frames, reordered
     sequence numbers and chunks, truncated frames, a wrong key (random, or the other direction's),
     wrong source / destination rank (in the frame header or only in the authenticated data),
     oversize frames, lying headers (length, total, chunk index/count/offset), bad protocol version /
     frame type / flags, handshake frames after the handshake, random garbage;
   - bundles (`BUNDLE_ATTACKS`): correctly encrypted and authenticated frames whose plaintext is a
     malformed bundle (bad magic, lying header/tensor lengths and offsets, unknown dtype code, huge
     ndim, header that is not UTF-8 / not JSON / not an object / too deep / NaN / duplicate keys,
     a 401-digit integer in num_examples / version / round / a metric, a zero-size tensor whose
     other dimension is 2**64-1);
   - runtime messages (`RUNTIME_ATTACKS`), sent through the real `SecureChannel.send` so that they
     are VALID encrypted messages and test the server's own validation: NaN/Inf parameters, wrong
     dtypes, wrong shapes, missing or unknown tensor names, lying update headers, stale rounds.

   - memory floods (`--flood-mib N`, `FLOOD_ATTACKS`), sent before the first upload: N MiB of
     valid sealed messages of a kind the server never reads (kind 99, 64 MiB each), UPDATEs larger
     than their kind's bound (4 x model + 64 MiB, see `hpcfed.protocol.server_bounds`), and forged
     first chunks declaring an 8 GiB message. The server must drop each on arrival without buffering
     it: ``server_peak_rss_growth_mib`` (attacked minus baseline) is the figure (goal: <= 64).

The JSON result: ``sent`` (crafted messages), ``accepted`` (sent minus the rejections the server
counted in ``summary.json``: must be 0), ``server_alive`` (the attacked run finished normally and
the hostile rank still got its final model), ``honest_result_equal`` (final per-site metrics and the
final global model are identical to the baseline's), plus per-attack counts and the server's
rejection reasons. Exit status 0 only when all four hold.

The frame forger uses the channel's internals (its session keys and sequence counters) on purpose:
it is the adversary holding a compromised client's keys.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

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


# =================================================================================================
# the hostile rank


class _RecordingTransport:
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
        self.transport: _RecordingTransport = channel.transport
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


def _plan(total: int, rounds: int) -> list[int]:
    """How many crafted messages to send before each round's honest upload."""
    base, extra = divmod(total, max(1, rounds))
    return [base + (1 if r < extra else 0) for r in range(rounds)]


def worker_main(args: argparse.Namespace) -> int:
    """Body of the hostile rank: the real client loop, with attacks before each honest upload."""
    from hpcfed.client import client as client_mod
    from hpcfed.launch import rank as launcher
    from hpcfed.launch.parent import prepare_config

    cfg = prepare_config(args.config, args.overrides)
    out_dir = Path(args.out)
    if cfg.mode != "sync":
        raise SystemExit("the campaign compares against a baseline bit for bit: use a sync config")
    plan = _plan(args.messages, cfg.rounds)
    report: dict[str, Any] = {"rank": None, "sent": 0, "by_attack": {}, "rounds_attacked": 0,
                              "final_model_received": False, "stopped_by_server": False}
    attacks: Iterator[str] = _cycle(ALL_ATTACKS)

    class HostileClient(client_mod.Client):
        def __init__(self, config: Any, channel: Any, out_dir: Path, device: str = "cpu", resume: bool = False,
                     keys: Any = None) -> None:
            channel.transport = _RecordingTransport(channel.transport)
            super().__init__(config, channel, out_dir, device=device, resume=resume, keys=keys)
            self.forger: Forger | None = None
            report["rank"] = channel.rank

        def _train_and_upload(self, msg: Any) -> None:
            rnd = int(msg.header["round"])
            if self.forger is None:
                self.forger = Forger(self.channel, self.layout.size, seed=cfg.seed + 7)
            quota = plan[rnd] if 0 <= rnd < len(plan) else 0
            if args.flood_mib and report["rounds_attacked"] == 0:
                self.forger.flood(args.flood_mib << 20)
            done = 0
            while done < quota:
                if self.forger.attack(next(attacks), rnd, int(msg.header.get("version", 0))):
                    done += 1
            report["rounds_attacked"] += 1
            super()._train_and_upload(msg)  # then behave exactly like the honest site

        def _final(self, msg: Any) -> None:
            report["final_model_received"] = True
            super()._final(msg)

        def run(self) -> None:
            try:
                super().run()
                report["stopped_by_server"] = True
            finally:
                if self.forger is not None:
                    report["by_attack"] = dict(sorted(self.forger.sent.items()))
                    report["sent"] = sum(self.forger.sent.values())
                (out_dir / "hostile.json").write_text(json.dumps(report, indent=2))

    client_mod.Client = HostileClient  # run_rank imports Client from this module when it starts
    return launcher.run_rank(cfg, out_dir, resume=False)


def _cycle(names: tuple[str, ...]) -> Iterator[str]:
    while True:
        yield from names


# =================================================================================================
# the driver


def _mpiexec() -> str:
    exe = shutil.which("mpiexec") or shutil.which("mpirun")
    if exe is None:
        raise SystemExit("hostile_campaign: no mpiexec on PATH (pip install mpich)")
    return exe


def _run(cmd: list[str], env: dict[str, str], timeout: float, log: Path) -> int:
    with open(log, "w") as fh:
        try:
            return subprocess.run(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            fh.write(f"\nhostile_campaign: killed after {timeout:g} s\n")
            return 124


def _final_model(out: Path) -> dict[str, bytes]:
    from hpcfed.store import checkpoint as ck

    newest = ck.latest_valid(out / "checkpoints", warn=lambda _: None)
    if newest is None:
        return {}
    return {k: np.ascontiguousarray(v).tobytes() for k, v in sorted(newest.strategy[1].items())}


def _num_clients(config: str, overrides: list[str]) -> int:
    from hpcfed.config import load

    n = load(config, overrides).federation.num_clients
    return n if n is not None else 2


def campaign(config: str, overrides: list[str], *, messages: int, out: Path, timeout: float = 300,
             log: Callable[[str], None] = lambda s: None, flood_mib: int = 0) -> dict[str, Any]:
    """A clean run and the same run with a hostile client; what was sent, refused, and whether results match."""
    from hpcfed.launch.parent import prepare_config

    cfg = prepare_config(config, overrides)
    if cfg.mode != "sync":
        raise ValueError(f"{config}: the campaign needs a synchronous strategy (its result is compared bit for bit)")
    honest = _num_clients(config, overrides)
    world = honest + 2  # server + honest clients + the hostile client
    overrides = [o for o in overrides if not o.startswith("federation.num_clients=")]
    # The campaign measures the channel's and runtime's refusal of every crafted message, one after
    # another from one rank: the first malformed one would evict the site (security.on_misbehaviour)
    # and the rest would be dropped unread. Eviction has tests of its own (tests/server/test_eviction*).
    if not any(o.startswith("security.on_misbehaviour=") for o in overrides):
        overrides = [*overrides, "security.on_misbehaviour=ignore"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.setdefault("HPCFED_PSK", os.urandom(32).hex())
    mpi = _mpiexec()
    py = sys.executable
    base_out, atk_out = out / "baseline", out / "attacked"
    for d in (base_out, atk_out):
        shutil.rmtree(d, ignore_errors=True)
    log(f"baseline: {world} ranks, no attack -> {base_out}")
    t0 = time.monotonic()
    rc_base = _run([mpi, "-n", str(world), py, "-m", "hpcfed", "run", config, *overrides, "--out", str(base_out)],
                   env, timeout, out / "baseline.log")
    t_base = time.monotonic() - t0
    log(f"attacked: {world - 1} ranks + 1 hostile rank sending {messages} crafted messages -> {atk_out}")
    t0 = time.monotonic()
    rc_atk = _run([mpi, "-n", str(world - 1), py, "-m", "hpcfed", "run", config, *overrides, "--out", str(atk_out),
                   ":", "-n", "1", py, str(Path(__file__).resolve()), "--worker", "--config", config,
                   "--out", str(atk_out), "--messages", str(messages), "--flood-mib", str(flood_mib), *overrides],
                  env, timeout, out / "attacked.log")
    t_atk = time.monotonic() - t0

    def read(path: Path) -> dict[str, Any]:
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    s_base, s_atk = read(base_out / "summary.json"), read(atk_out / "summary.json")
    hostile = read(atk_out / "hostile.json")
    rejected = s_atk.get("rejected", {"runtime": {}, "channel": {}})
    n_rejected = sum(rejected.get("runtime", {}).values()) + sum(rejected.get("channel", {}).values())
    base_rejected = s_base.get("rejected", {"runtime": {}, "channel": {}})
    sent = int(hostile.get("sent", 0))
    hostile_cid = str(world - 2)
    equal = (rc_base == 0 and rc_atk == 0 and bool(s_base) and bool(s_atk)
             and s_base.get("clients") == s_atk.get("clients")
             and _final_model(base_out) == _final_model(atk_out) != {})
    result = {
        "sent": sent,
        "accepted": sent - n_rejected if s_atk else sent,
        "server_alive": rc_atk == 0 and bool(s_atk) and bool(hostile.get("final_model_received"))
        and bool(hostile.get("stopped_by_server")),
        "honest_result_equal": equal,
        "world_size": world,
        "hostile_rank": hostile.get("rank"),
        "rounds_attacked": hostile.get("rounds_attacked", 0),
        "by_attack": hostile.get("by_attack", {}),
        "rejected_by_server": {"channel": rejected.get("channel", {}), "runtime": rejected.get("runtime", {})},
        "baseline_rejected": (sum(base_rejected.get("runtime", {}).values())
                              + sum(base_rejected.get("channel", {}).values())),
        "final_metrics": {"baseline": s_base.get("clients"), "attacked": s_atk.get("clients")},
        "hostile_site_final_metrics_equal": (s_base.get("clients") or {}).get(hostile_cid)
        == (s_atk.get("clients") or {}).get(hostile_cid),
        "exit_codes": {"baseline": rc_base, "attacked": rc_atk},
        "flood_mib": flood_mib,
        "server_peak_rss_mib": {"baseline": _server_rss_mib(s_base), "attacked": _server_rss_mib(s_atk)},
        "server_peak_rss_growth_mib": (round(_server_rss_mib(s_atk) - _server_rss_mib(s_base), 1)
                                       if s_base and s_atk else None),
        "wall_s": {"baseline": round(t_base, 2), "attacked": round(t_atk, 2)},
        "out": str(out),
    }
    return result


def _server_rss_mib(summary: dict[str, Any]) -> float:
    cost = (summary.get("cost") or {}).get("0") or {}
    return round(cost.get("peak_rss_bytes", 0) / 2**20, 1)


def main(argv: list[str] | None = None) -> int:
    """Run the campaign (or, with --worker, be the hostile rank) and print the result; exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", help="key=value config overrides for both runs (e.g. rounds=4)")
    p.add_argument("--config", default="configs/quickstart.yaml")
    p.add_argument("--messages", type=int, default=1200, help="crafted messages to send (spread over the rounds)")
    p.add_argument("--out", default=None, help="keep both runs here (default: a temporary folder, removed)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per run before it is killed")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--flood-mib", type=int, default=0,
                   help="also flood the server with this many MiB of unsolicited / oversize messages (e.g. 2048)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # the hostile rank itself
    args = p.parse_args(argv)
    if args.worker:
        return worker_main(args)
    if args.messages < 0 or (args.messages == 0 and not args.flood_mib):
        p.error("--messages must be at least 1 (or 0 with --flood-mib)")
    tmp = None
    if args.out:
        out = Path(args.out).resolve()
        out.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.mkdtemp(prefix="hpcfed-hostile-")
        out = Path(tmp)
    say = (lambda s: print(f"[hostile] {s}", file=sys.stderr)) if args.json else (lambda s: print(f"[hostile] {s}"))
    try:
        result = campaign(args.config, args.overrides, messages=args.messages, out=out, timeout=args.timeout, log=say,
                          flood_mib=args.flood_mib)
    finally:
        if tmp is not None and not os.environ.get("HPCFED_KEEP_CAMPAIGN"):
            shutil.rmtree(tmp, ignore_errors=True)
    ok = (result["sent"] >= args.messages and result["accepted"] == 0 and result["server_alive"]
          and result["honest_result_equal"])
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key in ("sent", "accepted", "server_alive", "honest_result_equal"):
            print(f"{key}: {result[key]}")
        print("server rejections:", json.dumps(result["rejected_by_server"]))
        if not ok:
            print(f"FAILED; logs in {out} (set --out to keep them)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
