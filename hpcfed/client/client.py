"""Ranks 1..K: a client site's loop.

receive model -> `Task.set_parameters` -> `Task.fit` -> (evaluate) -> upload, until the server says
FINAL (evaluate on the test split, export embeddings, report) and STOP. Every wait has a deadline
(`federation.client_timeout_s`): a client never loops forever after the server is gone.

The loop only trains: what happens to the trained model on its way to the server (secure
aggregation, site-side DP, a malicious site's attack, fault hooks) is the upload pipeline's
(`hpcfed.client.upload`), assembled from the client's config (`hpcfed.client.assemble`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from hpcfed import protocol as P
from hpcfed.client import attacks
from hpcfed.client.assemble import eviction_hooks, upload_pipeline
from hpcfed.client.config import ClientConfig
from hpcfed.client.prepared import Prepared, prepare
from hpcfed.client.upload import Pipeline, RoundStart, Superseded, Upload
from hpcfed.comm.api import Channel, Message
from hpcfed.cost import rank_cost
from hpcfed.credentials import RankKeys
from hpcfed.errors import FederationError
from hpcfed.params import ParamLayout, Params
from hpcfed.tasks.base import Site, Task
from hpcfed.tasks.data_parallel import SiteRanks

log = logging.getLogger("hpcfed.client")


class Client:
    """One client site (rank 1..K): trains the task on the server's models and uploads the results."""

    def __init__(self, config: ClientConfig, channel: Channel, out_dir: Path, device: str = "cpu",
                 resume: bool = False, keys: RankKeys | None = None, ranks: SiteRanks | None = None,
                 prepared: Prepared | None = None) -> None:
        """`prepared`: what the site built before it met the server (`hpcfed join`); built here when
        there is none, or it was built for another rank or federation size than `channel`'s."""
        self.config, self.loop = config, config.loop
        self.channel = channel
        self.client_id = channel.rank - 1
        self.num_clients = channel.size - 1
        self.keys = keys or RankKeys(config.security, channel.rank)  # read once (the launch passes them)
        if prepared is None or not prepared.fits(self.client_id, self.num_clients):
            prepared = prepare(config, self.client_id, self.num_clients, out_dir, device, self.keys, ranks)
        self.prepared: Prepared | None = prepared  # until its setup exchange is done
        self.site: Site = prepared.site
        self.task: Task = prepared.task
        self._lingers = attacks.lingers(config.site.attack_played_by(self.client_id, self.num_clients))  # stays
        self._fit_s, self._examples = 0.0, 0  # the site's throughput, reported with RESULT
        self._loop_cpu0: float | None = None  # process CPU when the loop began (after the set-up), for RESULT
        self._on_evicted = eviction_hooks(channel, self.site.attack)
        self.layout: ParamLayout | None = None
        self.slowdown = float(self.loop.slowdown.get(self.client_id, 1.0))
        self.client_version = 1
        # Async: one upload in flight per client. A broadcast that arrives while our upload is
        # unanswered only replaces the model (newest wins); training waits for the answer, else
        # every broadcast would start a second training chain from a model lacking our last step.
        self._awaiting_answer = False
        self._held: Message | None = None
        self.upload: Pipeline | None = None  # train -> ... -> send, assembled once the layout is known
        self._pending: Message | None = None  # what ended an upload stage's wait early, handled next
        # This site's own checkpoint shards: written and read here only, tagged with the site's key.
        self.resume = resume
        self.state_dir, self.state_auth = prepared.state_dir, prepared.state_auth

    def run(self) -> None:
        """Take part in the federation until the server says STOP (or stops answering: FederationError)."""
        if self.client_id in self.loop.exclude_sites:
            log.warning("client %d (rank %d) is left out of this run (federation.exclude_sites): leaving",
                        self.client_id, self.client_id + 1)
            return
        if not self._setup():
            return
        self._loop_cpu0 = time.process_time()
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
                if msg.kind in (P.EVICTED, P.STOP):
                    return attacks.linger() if self._lingers else None
                if msg.kind == P.FINAL:
                    self._final(msg)
                    continue
                model = self._answered_model(msg)
                if model is None:
                    continue
                self._train_and_upload(model)
                self._awaiting_answer = self.loop.mode == "async"
        except _Stopped:
            return

    # ------------------------------------------------------------------------------------------
    def _evicted(self, msg: Message) -> None:
        """The server's last word to this site: it leaves, without ending anyone else's job."""
        reason = " ".join(str(msg.header.get("reason", "no reason given"))[:300].split())
        log.error("client %d (rank %d): evicted by the server: %s; leaving (the federation goes on without "
                  "this site)", self.client_id, self.client_id + 1, reason)
        for hook in self._on_evicted:
            hook()

    def _setup(self) -> bool:
        prepared = self.prepared
        assert prepared is not None  # one setup exchange per Client
        header, tensors = prepared.setup
        out = P.prefixed(tensors, P.SETUP_PREFIX)
        if self.client_id == 0:
            out.update(P.prefixed(self.task.get_parameters(), P.INIT_PREFIX))
        # The shards this site holds intact: on --resume the server picks a checkpoint all sites hold;
        # a site rejoining a running server (`hpcfed join` again) resumes from its newest one.
        self.channel.send(0, P.SETUP, {"task": header, "shards": prepared.shards}, out)
        reply = self._wait({P.SETUP_REPLY, P.STOP, P.EVICTED}, self.loop.setup_timeout_s + self.loop.client_timeout_s)
        if reply.kind == P.EVICTED:  # evicted in an earlier attempt of this run (the checkpoint says)
            self._evicted(reply)
            return False
        if reply.kind == P.STOP:
            raise FederationError(f"the server stopped the federation during setup: {reply.header.get('reason')}")
        self.task.on_setup((reply.header.get("task", {}), P.split_prefixed(reply.tensors, P.SETUP_PREFIX)))
        self.layout = ParamLayout.of(self.task.get_parameters())
        self.upload = upload_pipeline(self._fit, self.config, self.channel, self.layout, self.site.attack, self.keys)
        if reply.header.get("layout") != self.layout.describe():
            raise FederationError(
                f"client {self.client_id}: this site's model does not match the server's (parameter names/shapes/"
                f"dtypes differ); every site must use the same task config")
        shard = reply.header.get("shard")
        if reply.header.get("resumed") and isinstance(shard, dict):
            from hpcfed.store import site_state

            shard_round: Any = shard.get("round")  # from the server: int() refuses a non-number, caught below
            try:
                state = prepared.shard_state(int(shard_round), str(shard.get("digest")))
            except (site_state.ShardError, TypeError, ValueError) as exc:
                raise FederationError(
                    f"client {self.client_id} (rank {self.client_id + 1}): cannot resume: {exc}") from None
            self.task.load_state_dict(state)
        self.prepared = None  # its shard read ahead is not kept for the whole run
        return True

    def _train_and_upload(self, msg: Message) -> None:
        rnd = int(msg.header["round"])
        start = RoundStart(round=rnd, header=msg.header, received=self._load(msg),
                           current_model=self.task.get_parameters)
        try:
            self._pipeline(start)
        except Superseded as exc:  # the server went on without this site (a straggler): the next message
            self._pending = exc.msg

    def _fit(self, start: RoundStart) -> Upload:
        """Train on the model loaded for `start`: the parameters, the examples and the upload's header
        (round, versions, metrics, and the shard written when PARAMS asked for a checkpoint)."""
        rnd = start.round
        t0 = time.monotonic()
        result = self.task.fit(rnd)
        if self.slowdown > 1.0:
            # Straggler knob: make this site `slowdown` times slower than its real work.
            self._straggle((self.slowdown - 1.0) * (time.monotonic() - t0))
        metrics = dict(result.metrics)
        metrics["fit_time_s"] = time.monotonic() - t0
        self._fit_s += metrics["fit_time_s"]
        self._examples += int(result.num_examples)
        if self.loop.eval_every > 0 and (rnd + 1) % self.loop.eval_every == 0 and self.loop.mode == "sync":
            metrics.update(self.task.evaluate(rnd))
        self.client_version += 1
        num_examples = int(result.num_examples)
        header: dict[str, Any] = {"round": rnd, "version": start.header.get("version", 0),
                                  "client_version": self.client_version, "num_examples": num_examples,
                                  "metrics": {k: _json_number(v) for k, v in metrics.items()}}
        if start.header.get("checkpoint"):
            # After fit, before upload: the state the resumed twin needs to continue bit-identically.
            header["shard"] = self._write_shard(rnd)
        return Upload(round=rnd, params=self.task.get_parameters(), num_examples=num_examples, header=header)

    def _write_shard(self, rnd: object) -> dict[str, Any]:
        from hpcfed.store import site_state

        if not isinstance(rnd, int) or isinstance(rnd, bool) or rnd < 0:
            raise FederationError(f"client {self.client_id}: the server asked for a checkpoint of round {rnd!r}")
        path, digest = site_state.write_shard(self.state_dir, rnd, self.client_id, self.task.state_dict(),
                                              self.state_auth, keep=self.loop.keep_checkpoints)
        return {"round": rnd, "digest": digest, "path": str(path)}

    def _final(self, msg: Message) -> None:
        loop_cpu = time.process_time() - self._loop_cpu0 if self._loop_cpu0 is not None else None
        self._load(msg)
        metrics = self.task.evaluate(int(msg.header.get("round", 0)), final=True)
        path = self.task.export_embeddings(self.site.out_dir)
        if path is not None:
            from hpcfed.store.embeddings import seal_export

            seal_export(path, self.keys.file_auth("embeddings"))
            log.info("client %d: embeddings written to %s", self.client_id, path)
        self.channel.send(0, P.RESULT, {"metrics": {k: _json_number(v) for k, v in metrics.items()},
                                        "cost": {**rank_cost(self.channel.stats, loop_cpu), **self._throughput()},
                                        "export": str(path) if path else None})

    def _throughput(self) -> dict[str, float]:
        """The site's training examples per second of its rounds' training (all of its ranks together)."""
        return {"examples_per_s": self._examples / self._fit_s} if self._fit_s > 0 else {}

    def _load(self, msg: Message) -> Params:
        """Load the model `msg` carries into the task (checked against the layout); return it as received."""
        groups = P.params_groups(msg.tensors, self._layout.groups)
        wrong = self._layout.check_packed(groups)
        if wrong:
            raise FederationError(f"client {self.client_id}: the server sent a model of the wrong form ({wrong})")
        params = {k: np.array(v) for k, v in self._layout.unpack(groups).items()}
        self.task.set_parameters(params)
        return params

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
    def _pipeline(self) -> Pipeline:
        """The upload pipeline, assembled once the setup exchange is done."""
        if self.upload is None:
            raise FederationError(f"client {self.client_id}: an upload before the setup exchange")
        return self.upload

    @property
    def _layout(self) -> ParamLayout:
        """The model's layout, known once the setup exchange is done."""
        if self.layout is None:
            raise FederationError(f"client {self.client_id}: the model's layout is used before the setup exchange")
        return self.layout

    def _wait(self, kinds: set[int], timeout: float | None = None) -> Message:
        timeout = timeout or self.loop.client_timeout_s
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
