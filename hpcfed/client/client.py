"""Ranks 1..K: a client site's loop.

receive model -> `Task.set_parameters` -> `Task.fit` -> (evaluate) -> upload, until the server says
FINAL (evaluate on the test split, export embeddings, report) and STOP. Every wait has a deadline
(`federation.client_timeout_s`): a client never loops forever after the server is gone.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np

from hpcfed import protocol as P
from hpcfed.client import attacks
from hpcfed.client.secagg import SecAggSite, Superseded
from hpcfed.comm.api import Channel, ChannelError, Message
from hpcfed.config import Config, build
from hpcfed.cost import rank_cost
from hpcfed.errors import FederationError
from hpcfed.params import ParamLayout, Params
from hpcfed.registry import task_class
from hpcfed.tasks.base import Site, Task

log = logging.getLogger("hpcfed.client")


class Client:
    """One client site (rank 1..K): trains the task on the server's models and uploads the results."""

    def __init__(self, cfg: Config, channel: Channel, out_dir: Path, device: str = "cpu",
                 resume: bool = False) -> None:
        self.cfg = cfg
        self.channel = channel
        self.client_id = channel.rank - 1
        self.num_clients = channel.size - 1
        task_cls = task_class(cfg.task.name, cfg.source)
        task_config = build(task_cls.Config, cfg.task.options, where=cfg.source, prefix="task.")
        from hpcfed.data.root import data_root

        malicious = cfg.attack is not None and self.client_id == self.num_clients - 1
        self.site = Site(client_id=self.client_id, num_clients=self.num_clients, seed=cfg.seed, out_dir=out_dir,
                         data_root=data_root(cfg.data_root), device=device, method=cfg.method,
                         attack=cfg.attack if malicious else None, config_hash=cfg.hash())
        self.task: Task = task_cls(task_config, self.site)
        self.layout: ParamLayout | None = None
        self.slowdown = float(cfg.federation.slowdown.get(self.client_id, 1.0))
        self.client_version = 1
        # Async: one upload in flight per client. A broadcast that arrives while our upload is
        # unanswered only replaces the model (newest wins); training waits for the answer, else
        # every broadcast would start a second training chain from a model lacking our last step.
        self._awaiting_answer = False
        self._held: Message | None = None
        self._misbehaved = False  # a MALFORMED_ATTACKS site has sent its malformed upload
        self._received: Params = {}  # the model as the server sent it (the runtime attacks tamper from it)
        self.secagg: SecAggSite | None = None  # privacy.secure_aggregation, once the layout is known
        self._pending: Message | None = None  # what ended a secure aggregation round early, handled next
        from hpcfed.credentials import state_file_auth
        from hpcfed.store import site_state

        # This site's own checkpoint shards: written and read here only, tagged with the site's key.
        self.resume = resume
        self.state_dir = site_state.site_dir(cfg.federation.site_state_dir, out=out_dir, client=self.client_id,
                                             rank=self.client_id + 1)
        self.state_auth = state_file_auth(cfg.security, self.client_id + 1, "site-shard")

    def run(self) -> None:
        """Take part in the federation until the server says STOP (or stops answering: FederationError)."""
        if self.client_id in self.cfg.federation.exclude_sites:
            log.warning("client %d (rank %d) is left out of this run (federation.exclude_sites): leaving",
                        self.client_id, self.client_id + 1)
            return
        if not self._setup():
            return
        try:
            while True:
                msg, self._pending = self._pending or self._wait({P.PARAMS, P.FINAL, P.STOP, P.CHECKPOINT,
                                                                  P.EVICTED}), None
                if msg.kind == P.CHECKPOINT:  # async: write the shard between training steps
                    self.channel.send(0, P.CHECKPOINT_DONE, self._write_shard(msg.header.get("round")))
                    continue
                if msg.kind == P.PARAMS:
                    msg = self._skip_stale(msg)
                if msg.kind == P.EVICTED:
                    self._evicted(msg)
                    return
                if msg.kind == P.STOP:
                    return
                if msg.kind == P.FINAL:
                    self._final(msg)
                    continue
                model = self._answered_model(msg)
                if model is None:
                    continue
                self._train_and_upload(model)
                self._awaiting_answer = self.cfg.mode == "async"
        except _Stopped:
            return

    # ------------------------------------------------------------------------------------------
    def _evicted(self, msg: Message) -> None:
        """The server's last word to this site: it leaves, without ending anyone else's job."""
        reason = " ".join(str(msg.header.get("reason", "no reason given"))[:300].split())
        log.error("client %d (rank %d): evicted by the server: %s; leaving (the federation goes on without "
                  "this site)", self.client_id, self.client_id + 1, reason)
        if self.site.attack == "bad_header_then_flood":  # a hostile site ignores it and keeps sending
            flood = {P.PARAMS_KEY: np.zeros(attacks.FLOOD_FLOATS, dtype=np.float32)}
            for _ in range(attacks.FLOOD_AFTER):
                try:
                    self.channel.send(0, P.UPDATE, {"round": 0, "num_examples": 1, "metrics": {}}, flood)
                except ChannelError:
                    break  # the server has finished: the flood ends with the job

    def _setup(self) -> bool:
        header, tensors = self.task.setup()
        out = P.prefixed(tensors, P.SETUP_PREFIX)
        if self.client_id == 0:
            out.update(P.prefixed(self.task.get_parameters(), P.INIT_PREFIX))
        setup_header: dict[str, Any] = {"task": header}
        if self.resume:  # the shards this site holds intact; the server picks a checkpoint all sites hold
            from hpcfed.store import site_state

            setup_header["shards"] = site_state.held_shards(self.state_dir, self.client_id, self.state_auth)
        self.channel.send(0, P.SETUP, setup_header, out)
        fed = self.cfg.federation
        reply = self._wait({P.SETUP_REPLY, P.STOP, P.EVICTED}, fed.setup_timeout_s + fed.client_timeout_s)
        if reply.kind == P.EVICTED:  # evicted in an earlier attempt of this run (the checkpoint says)
            self._evicted(reply)
            return False
        if reply.kind == P.STOP:
            raise FederationError(f"the server stopped the federation during setup: {reply.header.get('reason')}")
        self.task.on_setup((reply.header.get("task", {}), P.split_prefixed(reply.tensors, P.SETUP_PREFIX)))
        self.layout = ParamLayout.of(self.task.get_parameters())
        if self.cfg.privacy.secure_aggregation:
            hostile = (*attacks.RUNTIME_ATTACKS, *attacks.GARBAGE_ATTACKS)
            attack = self.site.attack if self.site.attack in hostile else None
            self.secagg = SecAggSite(self.cfg, self.channel, self.layout.size, attack)
        if reply.header.get("layout") != self.layout.describe():
            raise FederationError(
                f"client {self.client_id}: this site's model does not match the server's (parameter names/shapes/"
                f"dtypes differ); every site must use the same task config")
        shard = reply.header.get("shard")
        if reply.header.get("resumed") and isinstance(shard, dict):
            from hpcfed.store import site_state

            shard_round: Any = shard.get("round")  # from the server: int() refuses a non-number, caught below
            try:
                state = site_state.load_shard(self.state_dir, int(shard_round), str(shard.get("digest")),
                                              self.client_id, self.state_auth)
            except (site_state.ShardError, TypeError, ValueError) as exc:
                raise FederationError(
                    f"client {self.client_id} (rank {self.client_id + 1}): cannot resume: {exc}") from None
            self.task.load_state_dict(state)
        return True

    def _train_and_upload(self, msg: Message) -> None:
        rnd = int(msg.header["round"])
        self._load(msg)
        if self.secagg is not None:
            sent = self._layout.flatten(self.task.get_parameters())
            try:
                prepared = msg.header.get("secagg_prepared") is True  # keys shared in the last round
                self.secagg.round(rnd, sent, lambda: self._fit_for_secagg(msg), prepared,
                                  msg.header.get("secagg_groups"))  # group testing: checked by the site
            except Superseded as exc:  # the server went on without this site (a straggler): the next message
                self._pending = exc.msg
            return
        params, num_examples, header = self._fit(msg)
        copies = 1
        if self.site.attack in attacks.RUNTIME_ATTACKS:
            params, num_examples, copies = attacks.tamper(self.site.attack, params, self._received, num_examples)
        header["num_examples"] = num_examples
        tensors = P.params_tensors(self._layout.pack(params))
        if self.site.attack in attacks.MALFORMED_ATTACKS and not self._misbehaved:
            self._misbehaved = True  # once, then quiet
            attacks.malformed_update(self.site.attack, header, tensors,
                                     lambda h, t: self.channel.send(0, P.UPDATE, h, t))
            return
        for _ in range(copies):
            self.channel.send(0, P.UPDATE, header, tensors)
        if os.environ.get("HPCFED_FAULT_STOP_AFTER_UPLOAD") == f"{self.client_id + 1}:{rnd}":
            # the test of a site paused between its upload and the next model (a preempted node)
            log.warning("fault injection: rank %d stops itself after its upload of round %d", self.client_id + 1, rnd)
            os.kill(os.getpid(), signal.SIGSTOP)

    def _fit_for_secagg(self, msg: Message) -> tuple[np.ndarray, int, dict[str, Any]]:
        params, num_examples, header = self._fit(msg)
        if self.site.attack in attacks.RUNTIME_ATTACKS:  # it tampers with its input before masking
            params, num_examples, _ = attacks.tamper(self.site.attack, params, self._received, num_examples)
        return self._layout.flatten(params), num_examples, header

    def _fit(self, msg: Message) -> tuple[Params, int, dict[str, Any]]:
        """Train on the model loaded from `msg`: the parameters, the examples and the upload's header
        (round, versions, metrics, and the shard written when PARAMS asked for a checkpoint)."""
        rnd = int(msg.header["round"])
        t0 = time.monotonic()
        result = self.task.fit(rnd)
        if self.slowdown > 1.0:
            # Straggler knob: make this site `slowdown` times slower than its real work.
            self._straggle((self.slowdown - 1.0) * (time.monotonic() - t0))
        metrics = dict(result.metrics)
        metrics["fit_time_s"] = time.monotonic() - t0
        if self.cfg.eval_every > 0 and (rnd + 1) % self.cfg.eval_every == 0 and self.cfg.mode == "sync":
            metrics.update(self.task.evaluate(rnd))
        self.client_version += 1
        num_examples = int(result.num_examples)
        header: dict[str, Any] = {"round": rnd, "version": msg.header.get("version", 0),
                                  "client_version": self.client_version, "num_examples": num_examples,
                                  "metrics": {k: _json_number(v) for k, v in metrics.items()}}
        if msg.header.get("checkpoint"):
            # After fit, before upload: the state the resumed twin needs to continue bit-identically.
            header["shard"] = self._write_shard(rnd)
        return self.task.get_parameters(), num_examples, header

    def _write_shard(self, rnd: object) -> dict[str, Any]:
        from hpcfed.store import site_state

        if not isinstance(rnd, int) or isinstance(rnd, bool) or rnd < 0:
            raise FederationError(f"client {self.client_id}: the server asked for a checkpoint of round {rnd!r}")
        path, digest = site_state.write_shard(self.state_dir, rnd, self.client_id, self.task.state_dict(),
                                              self.state_auth, keep=self.cfg.keep_checkpoints)
        return {"round": rnd, "digest": digest, "path": str(path)}

    def _final(self, msg: Message) -> None:
        self._load(msg)
        metrics = self.task.evaluate(int(msg.header.get("round", 0)), final=True)
        path = self.task.export_embeddings(self.site.out_dir)
        if path is not None:
            from hpcfed.credentials import state_file_auth
            from hpcfed.store.embeddings import seal_export

            seal_export(path, state_file_auth(self.cfg.security, self.client_id + 1, "embeddings"))
            log.info("client %d: embeddings written to %s", self.client_id, path)
        self.channel.send(0, P.RESULT, {"metrics": {k: _json_number(v) for k, v in metrics.items()},
                                        "cost": rank_cost(self.channel.stats),
                                        "export": str(path) if path else None})

    def _load(self, msg: Message) -> None:
        groups = P.params_groups(msg.tensors, self._layout.groups)
        wrong = self._layout.check_packed(groups)
        if wrong:
            raise FederationError(f"client {self.client_id}: the server sent a model of the wrong form ({wrong})")
        params = {k: np.array(v) for k, v in self._layout.unpack(groups).items()}
        if self.site.attack in attacks.RUNTIME_ATTACKS:
            self._received = {k: v.copy() for k, v in params.items()}
        self.task.set_parameters(params)

    def _skip_stale(self, msg: Message) -> Message:
        """Work only on the newest instruction: a straggler (or an async client behind broadcasts)
        skips queued models it has been overtaken on, and goes straight to FINAL/STOP if queued."""
        for kind in (P.EVICTED, P.STOP, P.FINAL):
            queued = self.channel.recv(source=0, kinds={kind}, timeout=0)
            if queued is not None:
                return queued
        newest, answered = msg, _is_answer(msg)
        while (extra := self.channel.recv(source=0, kinds={P.PARAMS}, timeout=0)) is not None:
            answered = answered or _is_answer(extra)
            if extra.header.get("version", 0) >= newest.header.get("version", 0):
                newest = extra
        newest.header["answer"] = answered
        return newest

    def _answered_model(self, msg: Message) -> Message | None:
        """The newest model to train on, or None while our async upload is still unanswered."""
        if self._held is not None and self._held.header.get("version", 0) > msg.header.get("version", 0):
            msg.header, msg.tensors = {**self._held.header, "answer": _is_answer(msg)}, self._held.tensors
        if self._awaiting_answer and not _is_answer(msg):
            self._held = msg
            return None
        self._held = None
        return msg

    def _straggle(self, seconds: float) -> None:
        """Sleep for the straggler knob, but leave at once if the server says STOP meanwhile."""
        if self.channel.recv(source=0, kinds={P.STOP, P.EVICTED}, timeout=seconds) is not None:
            raise _Stopped

    @property
    def _layout(self) -> ParamLayout:
        """The model's layout, known once the setup exchange is done."""
        if self.layout is None:
            raise FederationError(f"client {self.client_id}: the model's layout is used before the setup exchange")
        return self.layout

    def _wait(self, kinds: set[int], timeout: float | None = None) -> Message:
        timeout = timeout or self.cfg.federation.client_timeout_s
        msg = self.channel.recv(source=0, kinds=kinds, timeout=timeout)
        if msg is None:
            raise FederationError(
                f"client {self.client_id} (rank {self.client_id + 1}): the server (rank 0) sent nothing for "
                f"{timeout:g} s (federation.client_timeout_s); it has probably died — leaving")
        return msg


def _is_answer(msg: Message) -> bool:
    # Sync models and the server's reply to our own upload carry answer=True (or no flag at all).
    return bool(msg.header.get("answer", True))


class _Stopped(Exception):
    """The server ended the federation while this client was busy."""


def _json_number(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if np.isfinite(f) else None
