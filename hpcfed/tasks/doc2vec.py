"""SEEC doc2vec task: federated PV-DM over text split across sites (paper Alg. 1; spec §4.1-4.3).

Setup exchange (joint mode): each site sends its word counts U_i (``setup()``); the server merges
them into one ordered vocabulary and seeded initial arrays (``server_setup``); every site builds the
same gensim skeleton with its own document tags (``on_setup``). Each round is one local epoch
(``local_epochs``), or every ``rounds_per_epoch``-th document of one, with the reference's continuous
learning-rate decay; the runtime's FedAvg averages ``wv`` and ``syn1neg`` (``federated_arrays``), or
with ``update: sum`` adds up the sites' steps. Document vectors never leave the site.

Methods (``method=``):
  joint        the above (default)
  centralized  the same model on one site holding every document (run with ``--np 2``): the reference
               that sim_k compares against
  mapping      sites train independently (nothing is averaged) and also vectorise the public corpus,
  nomapping    so that `hpcfed search train-mappers` can fit m_{i→j}; ``nomapping`` trains the same way
               and searches without mappers (the baseline)

At the end each site writes ``embeddings/site<k>.h5`` (entity ``doc``: its own document vectors,
ids, labels; entity ``public``: inferred public-corpus vectors in mapping mode) and
``models/site<k>.h5`` (what inference of new text needs).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np

from hpcfed.models import doc2vec as g
from hpcfed.models.doc2vec import bundle_counts, counts_bundle
from hpcfed.params import Params
from hpcfed.store.embeddings import export_path, write_export
from hpcfed.tasks.base import Bundle, FitResult, MethodPreset, Site, Task


def gensim_method(method: str) -> MethodPreset:
    """method=joint|centralized|mapping|nomapping -> task.mode, FedAvg with an unweighted mean (§4.2)."""
    return MethodPreset(strategy="fedavg", strategy_defaults={"weighting": "uniform"}, task_options={"mode": method},
                        num_clients=1 if method == "centralized" else None)


# Independent training shares no arrays, but the runtime's protocol carries a model every round:
# the sites exchange this one constant instead (FedAvg of a constant is that constant).
INDEPENDENT_PLACEHOLDER = "independent_training_shares_nothing"


def model_path(out_dir: str | Path, client_id: int) -> Path:
    """Where site `client_id` writes its gensim model (HDF5) inside a run directory."""
    return Path(out_dir) / "models" / f"site{client_id}.h5"


@dataclass(kw_only=True)
class GensimJointOptions(g.GensimSettings):
    """The options every gensim joint task has: the model's `GensimSettings` (declared there, once)
    and the federation's schedule. The task's class decides the model's kind, and skip-gram is
    fixed, so neither is an option; a task hides the other settings it fixes the same way."""

    kind: str = field(default="doc2vec", init=False)  # GensimJointTask.kind
    sg: int = field(default=1, init=False)
    local_epochs: int = 1
    total_epochs: int = 40  # the decay spans all rounds: set rounds = total_epochs / local_epochs
    rounds_per_epoch: int = 1  # > 1: a round trains 1/n of the corpus (local_epochs must be 1)
    federated_arrays: list[str] = field(default_factory=lambda: ["syn1neg", "wv"])
    # mean: FedAvg of the arrays (spec §4.2); sum: the server's mean becomes the sum of the sites'
    # updates (FedAvg with server learning rate K; needs strategy.weighting=uniform), see scale_update
    update: Literal["mean", "sum"] = "mean"
    vocab_merge: Literal["sum", "reference_compat"] = "sum"
    model_seed: int = 0
    eval_k: int = 10


def validate_shared(config: Any, *, positive: tuple[str, ...] = ()) -> None:
    """The checks of the options every gensim joint task has (plus its own `positive` ints)."""
    for key in ("vector_size", "local_epochs", "total_epochs", "min_count", "eval_k", "rounds_per_epoch", *positive):
        if getattr(config, key) < 1:
            raise ValueError(f"{key} must be >= 1, got {getattr(config, key)}")
    if config.rounds_per_epoch > 1 and config.local_epochs != 1:
        raise ValueError(f"rounds_per_epoch={config.rounds_per_epoch} splits one epoch over rounds: set "
                         f"local_epochs=1 (got {config.local_epochs}) and rounds = total_epochs x rounds_per_epoch")
    bad = [a for a in config.federated_arrays if a not in g.FEDERATED_ARRAYS]
    if bad or not config.federated_arrays:
        raise ValueError(f"federated_arrays={config.federated_arrays}; choose from {list(g.FEDERATED_ARRAYS)}")


def _rng_seed(*keys: int) -> int:
    return int(np.random.SeedSequence([abs(int(k)) for k in keys]).generate_state(1)[0])


class GensimJointTask(Task):
    """What doc2vec and node2vec share: vocabulary exchange, shared arrays, schedule, state."""

    kind: ClassVar[str] = "doc2vec"
    entity: ClassVar[str] = "doc"
    uses_torch = False  # gensim trains on the CPU: its sites never import torch

    def __init__(self, config: Any, site: Site) -> None:
        super().__init__(config, site)
        self.settings = self._settings()
        self.corpus: list[Any] = []  # TaggedDocument (doc2vec) or list[str] walks (node2vec)
        self.model: Any = None
        self.independent = self._mode() in ("mapping", "nomapping")
        self._round_start: dict[str, np.ndarray] = {}  # the arrays this round started from (update="sum")

    # -- subclass hooks -------------------------------------------------------------------------
    def _settings(self) -> g.GensimSettings:
        return self.settings_of(self.config)

    @classmethod
    def settings_of(cls, config: GensimJointOptions) -> g.GensimSettings:
        """The model's settings in a task config (this task's kind of model)."""
        return config.model_settings(cls.kind)

    def _mode(self) -> str:
        return getattr(self.config, "mode", "joint")

    def _local_counts(self) -> Counter[str]:
        raise NotImplementedError

    # -- setup exchange -------------------------------------------------------------------------
    def setup(self) -> Bundle:
        if self.independent:
            # No shared vocabulary: every site builds its own model from its own counts now.
            vocab = g.order_vocab(dict(self._local_counts()), self.settings.min_count)
            self.model = g.site_model(vocab, self.settings, self.site.seed + self.site.client_id, self._tagged())
            return {"independent": True}, {}
        return {"num_docs": len(self.corpus)}, counts_bundle(dict(self._local_counts()))

    @classmethod
    def server_setup(cls, config: Any, payloads: dict[int, Bundle]) -> tuple[dict[int, Bundle], Params | None]:
        if getattr(config, "mode", "joint") in ("mapping", "nomapping"):
            return {cid: ({}, {}) for cid in payloads}, {INDEPENDENT_PLACEHOLDER: np.zeros(1, dtype=np.float32)}
        counts = {cid: bundle_counts(tensors, f"setup payload of client {cid}")
                  for cid, (_, tensors) in payloads.items()}
        settings = cls.settings_of(config)
        vocab = g.order_vocab(g.merge_counts(counts, config.vocab_merge), settings.min_count)
        reply = counts_bundle(dict(vocab))
        init = g.initial_arrays(vocab, settings, seed=config.model_seed)
        params = {name: init[name] for name in config.federated_arrays}
        return {cid: ({"vocab_size": len(vocab)}, reply) for cid in payloads}, params

    def on_setup(self, reply: Bundle) -> None:
        if self.independent:
            return
        _, tensors = reply
        counts = bundle_counts(tensors, "the server's vocabulary reply")
        if not counts:
            raise ValueError("the server sent no vocabulary; is every site running the same task config?")
        vocab = sorted(counts.items(), key=lambda wc: (-wc[1], wc[0]))
        self.model = g.site_model(vocab, self.settings, self.config.model_seed, self._tagged())
        # Same seed and vocabulary -> the same initial arrays as the server's; the first PARAMS overwrite them anyway.

    def _tagged(self) -> list[Any]:
        return self.corpus

    # -- parameters ---------------------------------------------------------------------------------
    def get_parameters(self) -> Params:
        if self.independent:
            return {INDEPENDENT_PLACEHOLDER: np.zeros(1, dtype=np.float32)}
        if self.model is None:  # before the vocabulary exists the server builds the initial model
            return {}
        arrays = g.get_arrays(self.model, self.config.federated_arrays)
        if self.config.update == "sum" and self._round_start:
            return g.scale_update(self._round_start, arrays, float(self.site.num_clients))
        return arrays

    def set_parameters(self, params: Params) -> None:
        if self.independent:
            return
        g.set_arrays(self.model, params)
        if self.config.update == "sum":
            self._round_start = {k: np.array(v, dtype=np.float32, copy=True) for k, v in params.items()}

    # -- learning -------------------------------------------------------------------------------------
    def fit(self, round: int) -> FitResult:
        c = self.config
        parts = c.rounds_per_epoch
        if parts > 1:  # one round = one slice of an epoch, so the sites' models drift apart less
            corpus = self.corpus[round % parts::parts]
            first_epoch, last_epoch = round // parts, round // parts
        else:
            corpus = self.corpus
            first_epoch, last_epoch = round * c.local_epochs, (round + 1) * c.local_epochs - 1
        g.train_epochs(self.model, corpus, self.settings, first_epoch=first_epoch,
                       num_epochs=last_epoch - first_epoch + 1, total_epochs=c.total_epochs,
                       seed=_rng_seed(self.site.seed, self.site.client_id, round))
        return FitResult(num_examples=len(corpus),
                         metrics={"alpha": g.epoch_alpha(self.settings, last_epoch, c.total_epochs)})

    # -- resumable state: the private arrays ------------------------------------------------------------
    def state_dict(self) -> Bundle:
        arrays: dict[str, np.ndarray] = {}
        if self.model is None:
            return {}, arrays
        if hasattr(self.model, "dv") and len(self.model.dv):
            arrays["dv"] = self.model.dv.vectors
        shared = set() if self.independent else set(self.config.federated_arrays)
        if "wv" not in shared:
            arrays["wv"] = self.model.wv.vectors
        if "syn1neg" not in shared:
            arrays["syn1neg"] = self.model.syn1neg
        return {}, arrays

    def load_state_dict(self, state: Bundle) -> None:
        _, arrays = state
        if "dv" in arrays:
            if arrays["dv"].shape != self.model.dv.vectors.shape:
                raise ValueError(f"checkpointed document vectors {arrays['dv'].shape} do not match this site's "
                                 f"{self.model.dv.vectors.shape}; the site's data changed since the checkpoint")
            self.model.dv.vectors[...] = arrays["dv"]
        g.set_arrays(self.model, {k: v for k, v in arrays.items() if k in ("wv", "syn1neg")})


class Doc2VecTask(GensimJointTask):
    """SEEC's doc2vec task: federated PV-DM over the documents split across sites (see the module doc)."""

    name = "doc2vec"
    METHODS: ClassVar[Mapping[str, MethodPreset]] = {
        method: gensim_method(method) for method in ("joint", "centralized", "mapping", "nomapping")}
    kind = "doc2vec"
    entity = "doc"
    final_figures_on = ("each site's own documents, as doc2vec has no test split: label P@k ranks a site's "
                        "documents among its own; the cross-site figures: `hpcfed eval RUN --central RUN`")
    evaluation_note = "doc2vec has no validation split: the round lines show the training loss"

    @dataclass(kw_only=True)
    class Config(GensimJointOptions):
        mode: Literal["joint", "centralized", "mapping", "nomapping"] = "joint"
        dataset: Literal["20newsgroups", "file", "gensim"] = "20newsgroups"
        subset: Literal["train", "test", "all"] = "train"  # 20NG posts the sites own
        path: str | None = None  # dataset=file: JSONL/plain text; dataset=gensim: corpus name
        max_docs: int | None = None  # seeded random sample of the corpus (quick runs), the same at every site
        split: Literal["random", "family"] = "random"
        # 20NG cleaning (scikit-learn's remove=): headers give the label away; see hpcfed.data.corpus
        remove: list[str] = field(default_factory=lambda: ["headers"])
        keep_subject: bool = False  # put the Subject: line back in front of the body
        # mapping/nomapping: the corpus every site vectorises to fit the mappers on ("none": no public corpus,
        # nomapping only): "20newsgroups:test" | "file:PATH" | "gensim:NAME" | "none"
        public_corpus: str = "20newsgroups:test"
        public_max_docs: int | None = None
        # trained: gensim's document vectors (dv) as training left them; inferred: every document
        # re-vectorised with the final model (infer_vector, seed 0), as the paper's "vectorize"
        doc_vectors: Literal["trained", "inferred"] = "trained"
        # the model's settings (vector_size 50, dm 1, min_count 2, ...) and the schedule: GensimJointOptions

        def validate(self) -> None:
            validate_shared(self, positive=("infer_epochs",))
            if self.dataset != "20newsgroups" and self.dataset != "gensim" and not self.path:
                raise ValueError(f"dataset={self.dataset} needs path (a .jsonl or .txt corpus)")
            from hpcfed.data.corpus import check_remove

            check_remove(self.remove, "task.remove")
            if self.mode == "mapping" and self.public_corpus in ("", "none"):
                raise ValueError("method=mapping fits its mappers on a public corpus every site vectorises: set "
                                 "task.public_corpus (20newsgroups:test, file:PATH or gensim:NAME), or use "
                                 "method=nomapping with task.public_corpus=none")

    def __init__(self, config: Config, site: Site) -> None:
        super().__init__(config, site)
        from gensim.models.doc2vec import TaggedDocument

        from hpcfed.data.corpus import split_documents, tokenize

        docs = self._load(config.dataset, config.path, config.subset, config.max_docs)
        if config.mode == "centralized":
            if site.num_clients != 1:
                raise ValueError(f"method=centralized trains one model on the union of the data: run it with one "
                                 f"client (--np 2), not {site.num_clients}")
            mine = docs
        else:
            mine = split_documents(docs, site.num_clients, mode=config.split, seed=site.seed)[site.client_id]
        self.docs = mine
        self.corpus = [TaggedDocument(tokenize(d.text), [d.id]) for d in mine]
        self._inferred: np.ndarray | None = None  # inferred document vectors of the current model
        self.public: list[Any] = []
        if self.independent and config.public_corpus not in ("", "none"):
            self.public = self._load_public(config.public_corpus, config.public_max_docs)

    def _load(self, dataset: str, path: str | None, subset: str, max_docs: int | None) -> list[Any]:
        from hpcfed.data import corpus

        if dataset == "20newsgroups":
            return corpus.load_20newsgroups(self.site.data_root, subset=subset, remove=self.config.remove,
                                            keep_subject=self.config.keep_subject, max_docs=max_docs,
                                            seed=self.site.seed)
        docs = corpus.gensim_test_corpus(path or "lee_background.cor") if dataset == "gensim" \
            else corpus.load_corpus_file(path)  # type: ignore[arg-type]  # a file dataset has its path: task.path is checked by the config
        return corpus.sample(docs, max_docs, self.site.seed)

    def _load_public(self, spec: str, max_docs: int | None) -> list[Any]:
        from hpcfed.data.root import DataError

        kind, _, arg = spec.partition(":")
        try:
            if kind == "20newsgroups":
                return self._load("20newsgroups", None, arg or "test", max_docs)
            if kind in ("file", "gensim"):
                return self._load(kind, arg or None, "all", max_docs)
        except DataError as exc:
            raise DataError(f"task.public_corpus={spec!r} (the corpus method={self.config.mode} vectorises at every "
                            f"site for the mappers): {exc}; set task.public_corpus=file:PATH, or none with "
                            f"method=nomapping") from None
        raise ValueError(f"task.public_corpus={spec!r}; use 20newsgroups:test, file:PATH, gensim:NAME or none")

    def _local_counts(self) -> Counter[str]:
        counts: Counter[str] = Counter()
        for d in self.corpus:
            counts.update(d.words)
        return counts

    # the inferred vectors belong to one model: any change of the model drops them
    def set_parameters(self, params: Params) -> None:
        self._inferred = None
        super().set_parameters(params)

    def fit(self, round: int) -> FitResult:
        self._inferred = None
        return super().fit(round)

    def load_state_dict(self, state: Bundle) -> None:
        self._inferred = None
        super().load_state_dict(state)

    # -- evaluation and export -----------------------------------------------------------------------
    def doc_vectors(self) -> np.ndarray:
        """This site's document vectors (n_docs, vector_size), trained or inferred (``doc_vectors``)."""
        if not self.docs:
            return np.zeros((0, self.settings.vector_size), dtype=np.float32)
        if self.config.doc_vectors == "trained":
            return np.stack([self.model.dv[d.id] for d in self.docs]).astype(np.float32)
        if self._inferred is None:  # the final evaluation and the export both need them: infer once
            self._inferred = g.infer_many(self.model, [d.words for d in self.corpus], self.settings, seed=0)
        return self._inferred

    def evaluate(self, round: int, final: bool = False) -> dict[str, float]:
        from hpcfed.search.index import SiteIndex
        from hpcfed.search.metrics import label_precision_at_k

        k = self.config.eval_k
        out = {"num_docs": float(len(self.docs)), "vocab_size": float(len(self.model.wv))}
        labels = [d.label for d in self.docs]
        if len(self.docs) > 1 and max(labels) >= 0:
            index = SiteIndex(str(self.site.client_id), [d.id for d in self.docs], self.doc_vectors(), np.array(labels))
            hits = index.hits(index.raw, k, exclude=index.ids)
            out[f"local_label_precision_at_{k}"] = label_precision_at_k(labels, [[h.label for h in r] for r in hits], k)
        return out

    def export_embeddings(self, out_dir: Path) -> Path:
        from hpcfed.data.corpus import tokenize

        cid = self.site.client_id
        path = export_path(out_dir, cid)
        from hpcfed.data.corpus import label_names

        extra = {"mode": self.config.mode, "kind": "doc2vec", "label_names": json.dumps(label_names(self.docs))}
        write_export(path, self.doc_vectors(), [d.id for d in self.docs], np.array([d.label for d in self.docs]),
                     entity="doc", model=f"doc2vec-pvdm{self.config.vector_size}", site=cid,
                     config_hash=self.site.config_hash, extra=extra)
        if self.public:
            vectors = g.infer_many(self.model, [tokenize(d.text) for d in self.public], self.settings, seed=0)
            write_export(path, vectors, [d.id for d in self.public], np.array([d.label for d in self.public]),
                         entity="public", model=f"doc2vec-pvdm{self.config.vector_size}", site=cid,
                         config_hash=self.site.config_hash, append=True,
                         extra={**extra, "label_names": json.dumps(label_names(self.public))})
        g.save_model(model_path(out_dir, cid), self.model, self.settings, site=cid)
        return path

