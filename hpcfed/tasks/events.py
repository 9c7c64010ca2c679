"""DAMe task: personalised federated social event detection on one site (paper §4; spec 1.1–1.7).

A site holds messages, their graph, features ``[SBERT ‖ time]`` and splits (`hpcfed.tasks.event_site`);
it trains a 2-layer GAT (`hpcfed.models.gat`). Per round::

    θ^g = model from the server (SEGA's personalised model for DAMe)
    θ^l = BOLA(θ^l, θ^g)  = λ*θ^l + (1−λ*)θ^g           if bola and round ≥ 1, else θ^g      (eq. 2–3)
    train 1 epoch:  L = L_t^l + α·L_GLECC                 GLECC from round 1 on              (eq. 14–18)
                    (glecc_own_model=false: no GLECC in a round where θ^g is the client's own upload)
    upload θ^l

Evaluation (spec 1.7): k-means (k = distinct events) on a split's embeddings; NMI, AMI, ARI. The final
evaluation first applies one last BOLA merge of the received final model (spec 1.6 [RECON]).

``method=dame`` adds the safety rules of `hpcfed.tasks.dame_safe` (``dame-paper``: the paper's method).
Baselines (``method=``, `EventsTask.METHODS`): Local, FedAvg, FedProx (``μ/2·||θ − θ^g||²``), Ditto (a
personal model with ``λ/2·||v − θ^g||²`` beside the uploaded shared one), ablations without BOLA, SEGA
or GLECC. Attacks on the last client (`Site.attack`): ``model`` uploads scaled or random parameters,
``data`` trains on randomly relabelled messages (a cyclic relabelling is a no-op for a clustering loss).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from hpcfed.params import ParamLayout, Params
from hpcfed.tasks import dame_safe as safe
from hpcfed.tasks import events_options, torch_state
from hpcfed.tasks.adam import Adam
from hpcfed.tasks.base import Bundle, FitResult, MethodPreset, Site, Task
from hpcfed.tasks.event_site import export_fields, load_event_site
from hpcfed.tasks.event_training import TrainData, kmeans_metrics, kmeans_predict, train_epochs
from hpcfed.tasks.event_training import seeded_rng as _rng


class EventsTask(Task):
    """DAMe's task on one site: a GAT over its message graph, BOLA, GLECC, the baselines (module doc)."""

    name = "events"
    record_dp_refusal = ("DAMe's GAT attends over the message graph, so one message flows through its neighbours' "
                         "gradients and a record is not one example")
    METHODS: ClassVar[Mapping[str, MethodPreset]] = events_options.METHODS

    class Config(events_options.EventsOptions):
        """The events task's options (`hpcfed.tasks.events_options.EventsOptions`, a dataclass)."""

    # -- construction ------------------------------------------------------------------------------

    def __init__(self, config: Config, site: Site) -> None:
        super().__init__(config, site)
        import torch

        c = config
        data = load_event_site(c, site, self.input_dim(c))
        self.dataset, self.messages, self.ids = data.dataset, data.messages, data.messages.ids
        self.labels, self.event_names = data.labels, data.event_names
        self.x, self.rowptr, self.col = data.x, data.rowptr, data.col
        self.train_idx, self.val_idx, self.test_idx = data.train_idx, data.val_idx, data.test_idx
        self.train_labels = data.train_labels

        torch.manual_seed(site.seed)  # identical initial model on every site
        self.model = self.build_model(c)
        self.global_model = self.build_model(c)  # θ^g, frozen (GLECC)
        self.scratch = self.build_model(c)  # BOLA candidates and final evaluation
        self.optimizer = Adam(self.model.parameters(), lr=c.lr, weight_decay=c.weight_decay)
        self.layout = ParamLayout.of(torch_state.module_parameters(self.model))
        personal: tuple[Any, Any] = self._twin() if c.ditto else (None, None)
        self.personal, self.personal_optimizer = personal
        # safe DAMe: the Local model, trained beside the personalised one from the same start
        self.shadow = safe.Track(*self._twin()) if c.safe else None
        # safe DAMe with cluster_track: the uploaded model, restarting from θ^g every round
        self.cluster = safe.Track(*self._twin(), name="cluster") if c.cluster_track else None
        self.sent_flat: np.ndarray | None = None  # the cluster model's last upload (cluster_track)
        self.sent_from: np.ndarray | None = None  # the θ^g that upload was trained from (BOLA methods)
        self.glecc_on = not c.safe  # the gate's verdict for this round (safe DAMe)
        self.gate_scores = (float("nan"), float("nan"))  # val NMI of θ^g and θ^l this round
        self.final: tuple[Any, dict[str, Any], dict[str, float]] | None = None  # safe: (chosen, candidates, why)
        self.local_flat: np.ndarray | None = None  # θ^l after the last training
        self.received: np.ndarray | None = None  # θ^g from the server
        self.received_used = False
        self.last_lambda = 1.0

    def _twin(self) -> tuple[Any, Any]:
        """A copy of the initial model and its own Adam (Ditto's personal model, the safe DAMe's Local)."""
        model = self.build_model(self.config)
        model.load_state_dict(self.model.state_dict())
        return model, Adam(model.parameters(), lr=self.config.lr, weight_decay=self.config.weight_decay)

    evaluation_note = "round lines: training loss; each site's val_nmi per round (validation split): metrics.jsonl"

    @classmethod
    def summary_lines(cls, summary: dict[str, Any]) -> list[str]:
        """Console lines after ``done:`` (launcher): personalised vs each site's own Local model."""
        return safe.closing_lines(summary)

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

    def _flat(self, module: Any) -> np.ndarray:
        return self.layout.flatten(torch_state.module_parameters(module))

    def _load_flat(self, module: Any, flat: np.ndarray) -> None:
        torch_state.load_module_parameters(module, self.layout.unflatten(np.asarray(flat, dtype=np.float32)))

    def get_parameters(self) -> Params:
        flat = self._flat(self.model if self.cluster is None else self.cluster.model)
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

    # -- BOLA --------------------------------------------------------------------------------------

    def _score(self, flat: np.ndarray, nodes: np.ndarray, round: int) -> float:
        """NMI of k-means on `nodes` with the model `flat` (BOLA's objective f)."""
        self._load_flat(self.scratch, flat)
        h = self._embed(self.scratch, nodes, _rng(self.site.seed, 29, self.site.client_id, round))
        return kmeans_metrics(h, self.labels[nodes])["nmi"]

    def _local_aggregate(self, round: int, theta_g: np.ndarray) -> np.ndarray:
        """θ̃ = λ*θ^l + (1−λ*)θ^g (eq. 2–3), or θ^g where BOLA does not apply (spec 1.5 edge cases)."""
        from hpcfed.tasks.bola import bola, bola_reference, merge

        c = self.config
        self.glecc_on, self.gate_scores = not c.safe, (float("nan"), float("nan"))
        if not c.bola or self.local_flat is None or round == 0:
            self.last_lambda = 0.0 if self.local_flat is None or not c.bola else 1.0
            return theta_g.copy()
        theta_l = self.local_flat
        if self._own(theta_g):  # a singleton SEGA cluster or Local: nothing global to merge in
            self.last_lambda = 1.0
            return theta_l.copy()
        val = self.val_idx
        if len(val) < 2 or len(val) < len(np.unique(self.labels[val])) or not np.isfinite(theta_g).all():
            self.last_lambda = 1.0
            return theta_l.copy()
        scores: dict[float, float] = {}

        def f(lam: float) -> float:
            if lam not in scores:
                scores[lam] = self._score(merge(theta_l, theta_g, lam), val, round)
            return scores[lam]

        if c.safe:  # the gate: does θ^g separate this site's validation events as well as θ^l?
            self.gate_scores = (f(0.0), f(1.0))
            self.glecc_on = safe.glecc_gate(*self.gate_scores, own_model=False, tol=c.glecc_gate_tol)

        seed = 42 + self.site.client_id
        if c.reference_compat:
            s_l, s_g = f(1.0), f(0.0)

            def f_pair(w: float, local_best: bool) -> float:
                return f(w) if local_best else f(1.0 - w)

            lam, _ = bola_reference(f_pair, s_l, s_g, lo=c.bola_alpha, n_init=c.bola_init, n_calls=c.bola_calls,
                                    seed=seed)
        else:
            lam, _ = bola(f, lo=c.bola_alpha, n_init=c.bola_init, n_calls=c.bola_calls, seed=seed,
                          anchors=(1.0,) if c.safe else ())
        self.last_lambda = float(lam)
        return merge(theta_l, theta_g, lam)

    # -- training ----------------------------------------------------------------------------------

    def _embed(self, model: Any, nodes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        import torch

        from hpcfed.models.gat import embed

        model.eval()
        with torch.no_grad():
            return embed(model, self.x, self.rowptr, self.col, nodes, self.config.fanouts,
                         self.config.eval_batch_size, rng).numpy()

    def fit(self, round: int) -> FitResult:
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
        use_glecc = c.glecc and round >= 1 and self.glecc_on
        if use_glecc and not c.glecc_own_model:
            # θ^g is this client's own last upload: nothing global to align with
            use_glecc = not (self.local_flat is not None and np.array_equal(self.local_flat, theta_g))
        data = TrainData(self.x, self.rowptr, self.col, self.train_idx, self.train_labels)
        models: list[tuple[Any, Any, float]] = [(self.model, self.optimizer, c.prox_mu)]
        if c.ditto:
            models.append((self.personal, self.personal_optimizer, c.ditto_mu))
        stats = train_epochs(models, data, c, global_model=self.global_model, use_glecc=use_glecc,
                             rng=self._train_rng(round), gen=self._triplet_gen(round))
        self.local_flat = self._flat(self.model)
        metrics = {f"train_{k}": v for k, v in stats.items()}
        metrics["bola_lambda"] = self.last_lambda
        if self.shadow is not None:
            metrics.update(self._fit_shadow(round, data))
        if self.cluster is not None:
            self._fit_cluster(round, data, theta_g)
        if c.bola:
            self.sent_from = theta_g  # rank 0 clips this round's upload towards it, if at all
        return FitResult(num_examples=len(self.train_idx), metrics=metrics)

    def _train_rng(self, round: int) -> np.random.Generator:
        return _rng(self.site.seed, 37, self.site.client_id, round)

    def _triplet_gen(self, round: int) -> Any:
        import torch

        return torch.Generator().manual_seed(int(_rng(self.site.seed, 31, self.site.client_id, round).integers(2**62)))

    def _fit_shadow(self, round: int, data: TrainData) -> dict[str, float]:
        """One round of the shadow Local model, on fresh copies of the round's generators (so it is
        ``method=local``'s model bit for bit), and its validation NMI; the gate's figures beside it."""
        assert self.shadow is not None
        self._train_as_local(self.shadow, round, data)
        h = self._embed(self.shadow.model, self.val_idx, _rng(self.site.seed, 41, self.site.client_id, round))
        val = kmeans_metrics(h, self.labels[self.val_idx])["nmi"]
        out = {"local_val_nmi": val, "glecc_on": float(self.glecc_on and round >= 1)}
        if all(np.isfinite(self.gate_scores)):
            out.update(gate_val_nmi_global=self.gate_scores[0], gate_val_nmi_local=self.gate_scores[1])
        return out

    def _fit_cluster(self, round: int, data: TrainData, theta_g: np.ndarray) -> None:
        """One round of the cluster model: θ^g trained plainly on Local's batches (so with one SEGA
        cluster of all sites it is ``method=fedavg``'s model bit for bit); it is the upload."""
        assert self.cluster is not None
        self._load_flat(self.cluster.model, theta_g)
        self._train_as_local(self.cluster, round, data)
        self.sent_flat = self._flat(self.cluster.model)

    def _train_as_local(self, track: safe.Track, round: int, data: TrainData) -> None:
        """One round of `track` on fresh copies of the round's generators: the batches and triplets
        ``method=local`` draws, no GLECC, no proximal term."""
        train_epochs([(track.model, track.optimizer, 0.0)], data, self.config, global_model=self.global_model,
                     use_glecc=False, rng=self._train_rng(round), gen=self._triplet_gen(round))
        track.rounds += 1

    def _tracks(self) -> list[safe.Track]:
        """The safe DAMe's models beside the personalised one (shadow Local, cluster), to save and resume."""
        return [t for t in (self.shadow, self.cluster) if t is not None]

    def _own(self, theta_g: np.ndarray) -> bool:
        """Whether θ^g is this site's own last upload (a singleton SEGA cluster): nothing global in it.
        Rank 0's bounded influence may have clipped that upload towards the model it was sent."""
        sent = self.local_flat if self.cluster is None else self.sent_flat
        return sent is not None and (np.array_equal(sent, theta_g) or (
            self.sent_from is not None and safe.is_clipped_upload(theta_g, self.sent_from, sent)))

    # -- evaluation --------------------------------------------------------------------------------

    def _final_model(self) -> Any:
        """The model a site ends with: personal (Ditto), or θ^g merged by one last BOLA step; with
        ``safe``, the candidate `_select` keeps on validation (Local, that, or the cluster's θ^g)."""
        if self.config.ditto:
            return self.personal
        if self.received is not None and not self.received_used:
            flat = self._local_aggregate(getattr(self, "_round", 0) + 1, self.received)
            self.received_used = True
            self._load_flat(self.model, flat)
        if self.shadow is None or self.shadow.rounds == 0:
            return self.model
        if self.final is None:
            self.final = self._select()
        return self.final[0]

    def _select(self) -> tuple[Any, dict[str, Any], dict[str, float]]:
        """Safe DAMe's final choice (Local, personalised, the cluster's θ^g): model, candidates, report."""
        assert self.shadow is not None
        candidates = {"local": self.shadow.model, "personal": self.model}
        if self.cluster is not None and self.received is not None and not self._own(self.received) \
                and np.isfinite(self.received).all():
            self._load_flat(self.cluster.model, self.received)  # training is over: the module holds θ^g now
            candidates["cluster"] = self.cluster.model
        c, labels, key = self.config, self.labels[self.val_idx], (self.site.seed, 53, self.site.client_id)
        preds = {name: [kmeans_predict(self._embed(m, self.val_idx, _rng(*key, r)), len(np.unique(labels)))
                        for r in range(c.eval_repeats)] for name, m in candidates.items()}  # `_scores`' draws
        chosen, report = safe.select(preds, labels, margin=c.select_margin, draws=c.select_bootstrap,
                                     confidence=c.select_confidence, tolerance=c.select_tolerance, seed=key)
        return candidates[chosen], candidates, report

    def _scores(self, model: Any, nodes: np.ndarray, key: int) -> dict[str, float]:
        """NMI/AMI/ARI of `model` on `nodes`, the mean over ``eval_repeats`` sampled embeddings (the same
        draws for any model: key 43 for the test split, 53 for the final validation)."""
        runs = [kmeans_metrics(self._embed(model, nodes, _rng(self.site.seed, key, self.site.client_id, r)),
                               self.labels[nodes]) for r in range(self.config.eval_repeats)]
        return {k: float(np.mean([m[k] for m in runs])) for k in ("nmi", "ami", "ari")}

    def evaluate(self, round: int, final: bool = False) -> dict[str, float]:
        c = self.config
        if not final:
            model = self.personal if c.ditto else self.model
            h = self._embed(model, self.val_idx, _rng(self.site.seed, 41, self.site.client_id, round))
            return {f"val_{k}": v for k, v in kmeans_metrics(h, self.labels[self.val_idx]).items()}
        out = self._scores(self._final_model(), self.test_idx, 43)
        if self.final is not None:  # safe DAMe: every candidate's test NMI, and what the site kept
            test = {name: self._scores(m, self.test_idx, 43)["nmi"] for name, m in self.final[1].items()}
            val = {name: self.final[2][f"val_{name}_nmi"] for name in test}
            out.update(self.final[2], **{f"{name}_nmi": v for name, v in test.items()})
            chosen = next(name for name, m in self.final[1].items() if m is self.final[0])
            out.update(safe.final_figures(val, test, chosen))
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
                            # BOLA and Ditto end with a model of each site's own: no shared space
                            **export_fields(self.dataset, self.event_names, self.messages,
                                            not (self.config.bola or self.config.ditto or self.site.method == "local")))

    # -- resumable state ---------------------------------------------------------------------------

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
        if self.sent_from is not None:
            out["sent_from"] = self.sent_from
        for track in self._tracks():
            track_head, track_arrays = track.state(self._flat(track.model))
            head.update(track_head)
            out.update(track_arrays)
        return head, out

    def load_state_dict(self, state: Bundle) -> None:
        header, arrays = state
        torch_state.load_training_state(self.optimizer, header, arrays)
        self.local_flat = torch_state.saved_vector(arrays, "local", self.layout.size, self.local_flat)
        self.last_lambda = float(header.get("last_lambda", 1.0))
        self.sent_from = torch_state.saved_vector(arrays, "sent_from", self.layout.size, self.sent_from)
        if self.personal is not None and "personal" in arrays:
            self._load_flat(self.personal, arrays["personal"])
            torch_state.load_optimizer_state(self.personal_optimizer, header["personal_optimizer"],
                                             {k[1:]: v for k, v in arrays.items() if k.startswith("popt/")})
        for track in self._tracks():
            if (flat := track.load(header, arrays)) is not None:
                self._load_flat(track.model, flat)
        if self.cluster is not None and self.cluster.rounds:
            self.sent_flat = self._flat(self.cluster.model)  # its last trained model is what the site uploaded
