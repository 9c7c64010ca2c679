"""The FedAHE task: HIN node embedding + classification on one site (spec section 2, Algorithm 1).

Each site loads the same HIN (``dataset``), works out with the same seed which target nodes each
site holds (`hpcfed.data.partition`), and keeps only the relation instances of its held nodes;
from them it builds its meta-path adjacencies over the shared node index, so every site's model
has the same shapes. It trains on its held labelled train nodes and is evaluated on its held
val/test nodes (HeCo splits, ``split: "20"`` -> train_20/val_20/test_20). Under
``partition: by_type`` a node can be held by several sites; it then counts in each of their
scores, and the ``home_*`` metrics count every test node once, at its home site.

``model_selection: best_val`` keeps, on each site, the model it received from the server (the
federation's model) that scored the best val Micro-F1 on the site's own val nodes, and evaluates
and exports that one at the end (early stopping on validation; the test split is never looked at).

One `fit` call is the local work between two exchanges: ``sync_every: epoch`` runs `local_epochs`
passes over the site's train nodes, ``sync_every: batch`` one batch (paper Algorithm 1 exchanges
after every batch). ``method=`` picks the federation (`HINTask.METHODS`): feddwa|afed (async),
fedavg|local (sync), centralized (all data on one client rank).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np

from hpcfed.params import Params
from hpcfed.store.embeddings import export_path, write_export
from hpcfed.tasks import torch_state
from hpcfed.tasks.adam import Adam
from hpcfed.tasks.base import Bundle, FitResult, MethodPreset, Site, Task

log = logging.getLogger("hpcfed.client")

# An asynchronous run logs no evaluate: its uploads carry the val F1 instead (fit_eval_every).
_ASYNC_EVAL = {"fit_eval_every": 1}


def _rng(*keys: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([abs(int(k)) for k in keys]))


ANY_HECO_CONFIG = "configs/fedahe_hin.yaml"


def fit_metapaths(hin: Any, c: Any) -> Any:
    """`hin` with the meta-paths of ``task.metapaths`` (None: the dataset's own, inferred for a HeCo folder),
    validated; the error for a meta-path that does not fit names the dataset's own and the override."""
    own = list(hin.metapaths)
    if c.metapaths:
        hin.metapaths = list(c.metapaths)
    if not hin.metapaths:
        raise ValueError(f"dataset {c.dataset}: no meta-paths; set task.metapaths (e.g. [PAP, PSP])")
    try:
        hin.validate(c.dataset)
    except ValueError as exc:
        if not c.metapaths or not own or own == hin.metapaths:
            raise
        raise ValueError(f"dataset {c.dataset}: task.metapaths {list(c.metapaths)} do not fit it ({exc}); its own "
                         f"meta-paths are {', '.join(own)}: set task.metapaths=null to use them, or run "
                         f"{ANY_HECO_CONFIG}, made for any HeCo folder") from None
    return hin


class HINTask(Task):
    """FedAHE's task on one site: a HIN node embedding and classifier over its held nodes (see the module doc)."""

    name = "hin"
    record_dp_refusal = ("FedAHE's attention over the heterogeneous graph mixes each node with its neighbours, so one "
                         "node's data flows through its neighbours' gradients and a record is not one example")
    METHODS: ClassVar[Mapping[str, MethodPreset]] = {
        "feddwa": MethodPreset(strategy="feddwa", task_defaults=_ASYNC_EVAL),
        "afed": MethodPreset(strategy="fedasync", task_defaults=_ASYNC_EVAL),
        "fedavg": MethodPreset(strategy="fedavg"),
        "local": MethodPreset(strategy="local"),
        "centralized": MethodPreset(strategy="fedavg", task_options={"partition": "none"}, num_clients=1),
    }

    evaluation_note = ("each site's validation Micro-F1 per round is in metrics.jsonl (val_micro_f1; in "
                       "asynchronous runs received_val_micro_f1, from the uploads)")

    @dataclass(kw_only=True)
    class Config:
        dataset: str = "synthetic"  # synthetic | hin/acm | hin/aminer | a HeCo-layout folder | path/to/graph.npz
        metapaths: list[str] | None = None  # default: the dataset's (ACM: PAP, PSP)
        split: str = "20"  # HeCo train_20/val_20/test_20; files without it use train/val/test;
        # "frac:0.3" draws a stratified 30% train / 10% val / 60% test split (HAHE's --train 0.3)
        partition: Literal["random", "attribute", "dirichlet", "by_type", "none"] = "random"
        partition_attribute: str | None = None  # attr/NAME of the HIN or a node type letter (S)
        partition_type: str | None = None  # by_type: the node type the sites own (A = authors)
        dirichlet_alpha: float = 0.5
        use_features: bool = False  # concatenate the target features to A_i^π (ACM p_feat)
        # node types whose relation rows (as the site holds them) join the input, e.g. [A, S]: a
        # W_s column for author a then learns from every site holding a paper of a
        input_relations: list[str] = field(default_factory=list)
        dropout: float = 0.0  # on e_i before the classifier (eq 8), while training
        model_selection: Literal["last", "best_val"] = "last"
        dim: int = 128  # d
        pref_dim: int = 32  # k
        num_sample: int = 100
        eq4_activation: Literal["none", "sigmoid"] = "none"
        eq5_activation: Literal["none", "tanh"] = "none"
        lr: float = 1e-3
        weight_decay: float = 1e-3
        # True = AdamW (decoupled decay). With Adam's L2 form the decay gradient of a parameter the
        # site's data never touches (other sites' node columns of W_s, their p_i) is rescaled by Adam
        # into a full lr-sized step toward 0, so every site erases the others' node parameters.
        decoupled_weight_decay: bool = True
        batch_size: int = 256
        local_epochs: int = 1
        sync_every: Literal["epoch", "batch"] = "epoch"
        personal_params: list[str] = field(default_factory=list)  # e.g. ["p"]: keep preference vectors local
        fit_eval_every: int = 0  # also report val F1 from fit every n calls (async runs log no evaluate)
        synthetic: dict[str, Any] = field(default_factory=dict)  # options of hpcfed.data.hin.synthetic_hin

        def validate(self) -> None:
            for key in ("dim", "pref_dim", "num_sample", "batch_size", "local_epochs"):
                if getattr(self, key) < 1:
                    raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
            if self.lr <= 0 or self.weight_decay < 0:
                raise ValueError("lr must be > 0 and weight_decay >= 0")
            if not 0.0 <= self.dropout < 1.0:
                raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
            if self.partition == "by_type" and not self.partition_type:
                raise ValueError("partition: by_type needs partition_type, the node type the sites own (e.g. A)")
            if self.fit_eval_every < 0:
                raise ValueError(f"fit_eval_every must be >= 0, got {self.fit_eval_every}")
            unknown = set(self.personal_params) - {"p"}
            if unknown:
                raise ValueError(f"personal_params may only name 'p' (preference vectors), got {sorted(unknown)}")

    # ------------------------------------------------------------------------------------------
    def __init__(self, config: Config, site: Site) -> None:
        super().__init__(config, site)
        import torch

        from hpcfed.data.hin import metapath_adjacency
        from hpcfed.data.hin_dataset import load_dataset
        from hpcfed.data.partition import make_partition, site_view
        from hpcfed.models.fedahe import FedAHE, MetapathInput

        c = config
        hin = load_dataset(c.dataset, site.data_root, **({"seed": site.seed, **c.synthetic}
                                                         if c.dataset == "synthetic" else {}))
        self.hin = hin = fit_metapaths(hin, c)
        names = self._split_names(hin, c.split)
        try:
            self.partition = make_partition(hin, site.num_clients, c.partition, site.seed,
                                            attribute=c.partition_attribute, alpha=c.dirichlet_alpha,
                                            owner_type=c.partition_type)
        except ValueError as exc:
            if c.partition != "by_type":
                raise
            raise ValueError(f"dataset {c.dataset}: {exc}; set task.partition=random (or task.partition_type= one "
                             f"of those), or run {ANY_HECO_CONFIG}, made for any HeCo folder") from None
        view = site_view(hin, self.partition, site.client_id)
        held = self.partition.holds[site.client_id]
        self.nodes = {k: np.sort(hin.splits[n][held[hin.splits[n]]]) for k, n in zip(("train", "val", "test"), names)}
        home = self.partition.home == site.client_id
        self.nodes["home_test"] = self.nodes["test"][home[self.nodes["test"]]]
        self.own_nodes = np.flatnonzero(held)
        adjacency = [metapath_adjacency(view, mp) for mp in hin.metapaths]
        # meta-path instances this site holds: connected pairs i != j (reported in the final metrics)
        self.instances = {mp: int(a.nnz - np.count_nonzero(a.diagonal())) for mp, a in zip(hin.metapaths, adjacency)}
        log.info("site %d: %d target nodes, %d train labels, meta-path instances %s", site.client_id,
                 len(self.own_nodes), len(self.nodes["train"]), self.instances)
        side = self._side_blocks(hin, view)
        self.inputs = [MetapathInput(a, side) for a in adjacency]
        self.labels = torch.as_tensor(hin.labels)
        torch.manual_seed(site.seed)  # identical initial model on every site
        self.model = FedAHE(num_nodes=hin.num_targets, input_dim=self.inputs[0].input_dim,
                            num_metapaths=len(hin.metapaths), num_classes=max(hin.num_classes, 2), dim=c.dim,
                            pref_dim=c.pref_dim, eq4_activation=c.eq4_activation, eq5_activation=c.eq5_activation,
                            dropout=c.dropout)
        self.optimizer = Adam(self.model.parameters(), lr=c.lr, weight_decay=c.weight_decay,
                              decoupled_weight_decay=c.decoupled_weight_decay)  # torch's Adam or AdamW steps
        self.steps = 0  # fit calls so far (batch cursor for sync_every=batch)
        self.best_val = -1.0  # model_selection=best_val: best val Micro-F1 of a received model so far
        self.best_params: Params | None = None
        if c.fit_eval_every:
            # fit() evaluates, and importing sklearn takes seconds on a loaded node: do it here so the
            # first fit's time is training time. The straggler knob multiplies fit time, so a slowed
            # first import stalled the slow site for its first exchange only (and async runs could end
            # before it ever uploaded).
            import sklearn.metrics  # noqa: F401

    @staticmethod
    def _split_names(hin: Any, split: str) -> tuple[str, str, str]:
        if split.startswith("frac:"):
            from hpcfed.data.hin import stratified_split

            try:
                fraction = float(split[5:])
            except ValueError:
                raise ValueError(f"task.split={split!r}: write frac:0.3 (the train fraction)") from None
            drawn = stratified_split(hin.labels, fraction, 0.1, seed=0)  # same on every site and method
            hin.splits.update({f"{k}_{split}": v for k, v in drawn.items()})
        for names in ((f"train_{split}", f"val_{split}", f"test_{split}"), ("train", "val", "test")):
            if all(n in hin.splits for n in names):
                return names
        raise ValueError(f"dataset {hin.name}: no splits train_{split}/val_{split}/test_{split} or train/val/test; "
                         f"it has: {', '.join(sorted(hin.splits)) or 'none'}")

    def _side_blocks(self, hin: Any, view: Any) -> list[Any]:
        """Input blocks after A_i^π: the target features, then each `input_relations` row as held here."""
        from hpcfed.data.hin import relation_matrix

        c = self.config
        blocks = []
        if c.use_features:
            if hin.features is None:
                raise ValueError(f"task.use_features: dataset {c.dataset} has no node features; set it to false")
            blocks.append(hin.features)
        for t in c.input_relations:
            key = hin.target + t if hin.target + t in view.relations else t + hin.target
            if t == hin.target or key not in view.relations:
                raise ValueError(f"task.input_relations: {t!r} is not a node type related to {hin.target} in "
                                 f"{c.dataset}; relations: {', '.join(sorted(hin.relations))}")
            m = relation_matrix(view, key)
            blocks.append(m if key[0] == hin.target else m.T.tocsr())
        return blocks

    # -- parameters ---------------------------------------------------------------------------
    def get_parameters(self) -> Params:
        return torch_state.module_parameters(self.model)

    def set_parameters(self, params: Params) -> None:
        if self.config.personal_params:
            params = dict(params)
            own = self.get_parameters()
            for name in self.config.personal_params:
                params[name] = own[name]
        torch_state.load_module_parameters(self.model, params)

    # -- learning -----------------------------------------------------------------------------
    def _batches(self, rng: np.random.Generator) -> list[np.ndarray]:
        train = rng.permutation(self.nodes["train"])
        b = self.config.batch_size
        return [train[i:i + b] for i in range(0, len(train), b)]

    def fit(self, round: int) -> FitResult:
        import torch

        c = self.config
        metrics: dict[str, float] = {}
        if c.model_selection == "best_val":
            metrics.update(self._track_best())
        self.model.train()
        rng = _rng(self.site.seed, self.site.client_id, round, self.steps)
        if c.sync_every == "epoch":
            batches = [b for _ in range(c.local_epochs) for b in self._batches(rng)]
        else:
            epoch_batches = self._batches(_rng(self.site.seed, self.site.client_id, 104729,
                                               self.steps // max(1, self._num_batches())))
            batches = [epoch_batches[self.steps % len(epoch_batches)]] if epoch_batches else []
        total, count = 0.0, 0
        for nodes in batches:
            if len(nodes) == 0:
                continue  # an empty batch is skipped (spec edge case)
            self.optimizer.zero_grad()
            logits = self.model(self.inputs, nodes, c.num_sample, rng)
            loss = torch.nn.functional.cross_entropy(logits, self.labels[torch.as_tensor(nodes)])  # eq 8
            loss.backward()
            self.optimizer.step()
            total += float(loss.detach()) * len(nodes)
            count += len(nodes)
        self.steps += 1
        metrics["train_loss"] = total / max(count, 1)
        if c.fit_eval_every and self.steps % c.fit_eval_every == 0:
            metrics.update(self.evaluate(round))
        return FitResult(num_examples=int(count), metrics=metrics)

    def _num_batches(self) -> int:
        return -(-len(self.nodes["train"]) // int(self.config.batch_size))

    def embed(self, nodes: np.ndarray, chunk: int = 2048) -> np.ndarray:
        """e_i (eq 7) for `nodes`, with a fixed neighbour sample so evaluations are repeatable."""
        import torch

        self.model.eval()
        rng = _rng(self.site.seed, 65537)
        out = []
        with torch.no_grad():
            for i in range(0, len(nodes), chunk):
                out.append(self.model.embed(self.inputs, nodes[i:i + chunk], self.config.num_sample, rng).numpy())
        return np.concatenate(out) if out else np.zeros((0, self.config.dim), np.float32)

    def _track_best(self) -> dict[str, float]:
        """Score the model just received on the val nodes; keep a copy if it is the best so far."""
        val = self._f1(self.nodes["val"])
        if val and val["micro_f1"] > self.best_val:
            self.best_val = val["micro_f1"]
            self.best_params = {k: v.copy() for k, v in self.get_parameters().items()}
        return {"received_val_micro_f1": val["micro_f1"]} if val else {}

    def _f1(self, nodes: np.ndarray, emb: np.ndarray | None = None) -> dict[str, float]:
        """Loss and Micro/Macro-F1 of the classifier head on `nodes` (empty dict for no nodes)."""
        import torch
        from sklearn.metrics import f1_score

        if len(nodes) == 0:
            return {}
        emb = self.embed(nodes) if emb is None else emb
        with torch.no_grad():
            logits = self.model.classifier(torch.as_tensor(emb))
            y = self.labels[torch.as_tensor(nodes)]
            loss = float(torch.nn.functional.cross_entropy(logits, y))
        pred, truth = logits.argmax(1).numpy(), y.numpy()
        return {"loss": loss, "micro_f1": float(f1_score(truth, pred, average="micro")),
                "macro_f1": float(f1_score(truth, pred, average="macro", zero_division=0))}

    def evaluate(self, round: int, final: bool = False) -> dict[str, float]:
        if not final:
            return {f"val_{k}": v for k, v in self._f1(self.nodes["val"]).items()}
        out: dict[str, float] = {}
        if self.config.model_selection == "best_val" and self.best_params is not None:
            last = self._f1(self.nodes["val"]).get("micro_f1", -1.0)
            if self.best_val > last:  # an earlier received model did better on val: evaluate that one
                torch_state.load_module_parameters(self.model, self.best_params)
            out["selected_val_micro_f1"] = max(self.best_val, last)
        nodes = self.nodes["test"]
        if len(nodes) == 0:
            return out
        emb = self.embed(nodes)
        out.update(self._f1(nodes, emb))
        out.update({"num_test": float(len(nodes)), **{f"instances_{mp}": float(n) for mp, n in self.instances.items()}})
        home = self.nodes["home_test"]
        if len(home):  # every test node counted once over the federation, at its home site
            at = np.searchsorted(nodes, home)
            out.update({f"home_{k}": v for k, v in self._f1(home, emb[at]).items() if k != "loss"})
            out["home_num_test"] = float(len(home))
        out.update(self._logreg_f1(emb, self.labels.numpy()[nodes]))
        return out

    def _logreg_f1(self, test_emb: np.ndarray, test_y: np.ndarray) -> dict[str, float]:
        """Micro/Macro-F1 of a logistic regression trained on this site's train-node embeddings."""
        from sklearn.linear_model import LogisticRegression
        from sklearn.metrics import f1_score

        train = self.nodes["train"]
        y_train = self.labels.numpy()[train]
        if len(np.unique(y_train)) < 2:
            return {}
        clf = LogisticRegression(max_iter=2000).fit(self.embed(train), y_train)
        pred = clf.predict(test_emb)
        return {"lr_micro_f1": float(f1_score(test_y, pred, average="micro")),
                "lr_macro_f1": float(f1_score(test_y, pred, average="macro", zero_division=0))}

    def export_embeddings(self, out_dir: Path) -> Path:
        """This site's held target nodes (those whose relations it holds): e_i, original ids, labels."""
        nodes = self.own_nodes
        ids_all = self.hin.ids.get(self.hin.target)
        ids = [str(ids_all[i]) for i in nodes] if ids_all is not None else [str(i) for i in nodes]
        return write_export(export_path(out_dir, self.site.client_id), self.embed(nodes), ids,
                            self.hin.labels[nodes], entity="node", model="fedahe", site=self.site.client_id,
                            config_hash=self.site.config_hash, version=0,
                            extra={"dataset": self.hin.name, "metapaths": ",".join(self.hin.metapaths)})

    # -- resumable state ------------------------------------------------------------------------
    def state_dict(self) -> Bundle:
        header, arrays = torch_state.training_state(self.optimizer)
        best = {f"best/{k}": v for k, v in (self.best_params or {}).items()}
        return {**header, "steps": self.steps, "best_val": self.best_val}, {**arrays, **best}

    def load_state_dict(self, state: Bundle) -> None:
        header, arrays = state
        torch_state.load_training_state(self.optimizer, header, arrays)
        self.steps = int(header.get("steps", 0))
        self.best_val = float(header.get("best_val", -1.0))
        best = {k[5:]: np.array(v) for k, v in arrays.items() if k.startswith("best/")}
        self.best_params = best or None
