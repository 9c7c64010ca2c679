"""SEEC joint learning for gensim models: one shared vocabulary, identical skeletons, averaged arrays.

SEEC (Alg. 1, §IV.A) federates doc2vec/word2vec by (1) merging the sites' word counts into one
vocabulary on the server, (2) giving every site the same model skeleton built from it, and
(3) averaging the vocabulary-indexed arrays after every round. Spec (algorithms.md §4.1-4.2):

    U[w] = Σ_i U_i[w]                                          (merged counts, §4.1 step 2)
    vocabulary = [w : U[w] >= min_count] sorted by (−U[w], w)   (deterministic order, §4.1 step 3)
    θ = (1/N) Σ_i θ_i  for θ ∈ {wv.vectors, syn1neg}            (§4.2; weighted by n_docs optionally)

Document vectors (``dv``) are never averaged: they belong to each site's own documents.

This module holds the gensim recipe only (no runtime): the server-side vocabulary merge and initial
arrays, the site-side skeleton, the learning-rate schedule of the reference code, and HDF5
storage of a trained model (so a site can vectorise new text without pickles).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from hpcfed.schema import build
from hpcfed.store.models import read_model_file, write_model_file

VOCAB_MODES = ("sum", "reference_compat")
MODEL_FORMAT = "hpcfed-gensim"
FEDERATED_ARRAYS = ("wv", "syn1neg")


@dataclass(kw_only=True)
class GensimSettings:
    """Hyperparameters shared by the server skeleton and every site (must be identical everywhere).

    Declared once, here: the gensim tasks' configs extend this class (`hpcfed.tasks.doc2vec`), and
    model files store it (`save_model`)."""

    kind: str = "doc2vec"  # doc2vec (PV-DM) | word2vec (node2vec walks)
    vector_size: int = 50
    dm: int = 1  # doc2vec: 1 = PV-DM (paper), 0 = PV-DBOW
    sg: int = 1  # word2vec: 1 = skip-gram (node2vec)
    window: int = 5
    negative: int = 5
    sample: float = 1e-3
    min_count: int = 2
    alpha: float = 0.025
    min_alpha: float = 0.0001
    infer_epochs: int = 40

    def model_settings(self, kind: str) -> GensimSettings:
        """Only the model's settings, for a `kind` model (a task config carries more options)."""
        values = {f.name: getattr(self, f.name) for f in fields(GensimSettings) if f.name != "kind"}
        return GensimSettings(kind=kind, **values)

    def gensim_kwargs(self, seed: int) -> dict[str, Any]:
        kw: dict[str, Any] = dict(vector_size=self.vector_size, window=self.window, negative=self.negative,
                                  hs=0, sample=self.sample, min_count=self.min_count, alpha=self.alpha,
                                  min_alpha=self.min_alpha, seed=seed, workers=1, sorted_vocab=0)
        if self.kind == "doc2vec":
            kw["dm"] = self.dm
        else:
            kw["sg"] = self.sg
        return kw


# -- vocabulary (§4.1) ---------------------------------------------------------------------------
def merge_counts(site_counts: Mapping[int, Mapping[str, int]], mode: str = "sum") -> dict[str, int]:
    """Merge per-site word counts (keyed by client id).

    ``sum`` (default): U[w] = Σ_i U_i[w], independent of the order in which sites answered.
    ``reference_compat``: the reference's ``merged[word] = freq`` — the site with the highest client
    id that has the word wins (sites are visited in client-id order so the result is still deterministic).
    """
    if mode not in VOCAB_MODES:
        raise ValueError(f"vocab_merge={mode!r}; choose one of: {', '.join(VOCAB_MODES)}")
    merged: Counter[str] = Counter()
    for cid in sorted(site_counts):
        for word, count in site_counts[cid].items():
            if mode == "sum":
                merged[word] += int(count)
            else:
                merged[word] = int(count)
    return dict(merged)


def order_vocab(merged: Mapping[str, int], min_count: int) -> list[tuple[str, int]]:
    """Words with count >= `min_count`, sorted by (−count, word): the same order on every site."""
    kept = [(w, int(c)) for w, c in merged.items() if c >= min_count]
    if not kept:
        raise ValueError(f"the merged vocabulary is empty: no word occurs at least min_count={min_count} "
                         f"times over all sites ({len(merged)} distinct words); lower min_count or add documents")
    return sorted(kept, key=lambda wc: (-wc[1], wc[0]))


def decode_counts(words: Sequence[Any], counts: np.ndarray, where: str) -> dict[str, int]:
    """A site's word counts from the words and counts tensors it sent, checked (hostile input: the
    error names `where`)."""
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise ValueError(f"{where}: the vocabulary words must be a list of strings")
    counts = np.asarray(counts)
    if counts.shape != (len(words),) or counts.dtype.kind not in "iu" or (counts < 0).any():
        raise ValueError(f"{where}: {counts.shape} counts for {len(words)} words (need non-negative integers)")
    return dict(zip(words, (int(c) for c in counts)))


# -- the vocabulary on the wire: words as one uint8 tensor, counts as int64 ------------------------------
def words_to_tensor(words: list[str]) -> np.ndarray:
    """Words as one uint8 tensor ("\\n"-joined UTF-8): a 100k-word vocabulary would overflow a JSON header."""
    if any("\n" in w for w in words):
        raise ValueError("vocabulary words must not contain newlines")
    return np.frombuffer("\n".join(words).encode("utf-8"), dtype=np.uint8).copy()


def tensor_to_words(data: np.ndarray, where: str) -> list[str]:
    """The words of a `words_to_tensor` tensor another rank sent, checked (hostile input: the error names `where`)."""
    arr = np.asarray(data)
    if arr.dtype != np.uint8 or arr.ndim != 1:
        raise ValueError(f"{where}: vocabulary words must be a 1-D uint8 tensor, got {arr.dtype} {arr.shape}")
    if arr.size == 0:
        return []
    try:
        return arr.tobytes().decode("utf-8").split("\n")
    except UnicodeDecodeError:
        raise ValueError(f"{where}: vocabulary words are not valid UTF-8") from None


def counts_bundle(counts: dict[str, int]) -> dict[str, np.ndarray]:
    """A site's word counts as the tensors its setup message carries (words in sorted order)."""
    words = sorted(counts)
    return {"words": words_to_tensor(words), "counts": np.array([counts[w] for w in words], dtype=np.int64)}


def bundle_counts(tensors: dict[str, np.ndarray], where: str) -> dict[str, int]:
    """The word counts of a setup message (`counts_bundle`), checked; {} when it carries none."""
    if "words" not in tensors or "counts" not in tensors:
        return {}
    words = tensor_to_words(tensors["words"], where)
    return decode_counts(words, tensors["counts"], where)


# -- skeletons ---------------------------------------------------------------------------------------------
def _model_class(settings: GensimSettings) -> Any:
    if settings.kind == "doc2vec":
        from gensim.models.doc2vec import Doc2Vec

        return Doc2Vec
    if settings.kind == "word2vec":
        from gensim.models import Word2Vec

        return Word2Vec
    raise ValueError(f"model kind={settings.kind!r}; choose doc2vec or word2vec")


def initial_arrays(vocab: Sequence[tuple[str, int]], settings: GensimSettings, seed: int) -> dict[str, np.ndarray]:
    """Server side (§4.1 step 4): seeded initial ``wv`` and ``syn1neg`` for the ordered vocabulary."""
    model = _model_class(settings)(**settings.gensim_kwargs(seed))
    model.build_vocab_from_freq(dict(vocab))
    _check_order(model, vocab)
    return {"wv": model.wv.vectors.astype(np.float32), "syn1neg": model.syn1neg.astype(np.float32)}


def site_model(vocab: Sequence[tuple[str, int]], settings: GensimSettings, seed: int,
               tagged_docs: Sequence[Any] | None = None) -> Any:
    """Site side (§4.1 step 5): the shared skeleton, with this site's document tags (doc2vec).

    gensim 4 recipe: ``scan_vocab`` registers the local tags in ``dv``; the raw vocabulary is then
    replaced by the global one before ``prepare_vocab``/``prepare_weights``. (``build_vocab`` followed
    by ``build_vocab_from_freq`` raises IndexError in gensim 4.4.)
    """
    model = _model_class(settings)(**settings.gensim_kwargs(seed))
    if settings.kind == "doc2vec":
        docs = list(tagged_docs or [])
        total_words, corpus_count = model.scan_vocab(corpus_iterable=docs)
        model.corpus_count, model.corpus_total_words = corpus_count, total_words
        model.raw_vocab = dict(vocab)
        model.prepare_vocab()
        model.prepare_weights()
    else:
        model.build_vocab_from_freq(dict(vocab))
        if tagged_docs is not None:
            model.corpus_count = len(tagged_docs)
    _check_order(model, vocab)
    return model


def _check_order(model: Any, vocab: Sequence[tuple[str, int]]) -> None:
    # Averaging is row by row: a site whose vocabulary order differs would average unrelated words.
    if model.wv.index_to_key != [w for w, _ in vocab]:
        raise AssertionError("gensim reordered the shared vocabulary; the arrays would not line up across sites")


def get_arrays(model: Any, names: Iterable[str]) -> dict[str, np.ndarray]:
    """The federated arrays (``wv`` = input word vectors, ``syn1neg`` = negative-sampling weights)."""
    out = {}
    for name in names:
        if name not in FEDERATED_ARRAYS:
            raise ValueError(f"federated array {name!r}; choose from {', '.join(FEDERATED_ARRAYS)}")
        out[name] = (model.wv.vectors if name == "wv" else model.syn1neg).astype(np.float32, copy=True)
    return out


def set_arrays(model: Any, arrays: Mapping[str, np.ndarray]) -> None:
    """Overwrite the gensim model's federated arrays (``wv``, ``syn1neg``) with the aggregated ones,
    refusing a shape that differs from the model's."""
    for name, value in arrays.items():
        target = model.wv.vectors if name == "wv" else model.syn1neg
        if target.shape != np.shape(value):
            raise ValueError(f"array {name!r} has shape {np.shape(value)}, the model's is {target.shape}")
        target[...] = value
    if "wv" in arrays:
        model.wv.norms = None  # cached norms are stale once the vectors change


def average_arrays(site_arrays: Sequence[Mapping[str, np.ndarray]],
                   weights: Sequence[float] | None = None) -> dict[str, np.ndarray]:
    """θ = Σ_i w_i θ_i / Σ_i w_i over the shared arrays (unweighted when `weights` is None, §4.2)."""
    if not site_arrays:
        raise ValueError("no site arrays to average")
    w = np.ones(len(site_arrays)) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != (len(site_arrays),) or w.sum() <= 0:
        raise ValueError(f"need one positive-sum weight per site, got {list(w)}")
    return {name: (sum(wi * np.asarray(a[name], dtype=np.float64) for wi, a in zip(w, site_arrays)) / w.sum())
            .astype(np.float32) for name in site_arrays[0]}


def scale_update(start: Mapping[str, np.ndarray], trained: Mapping[str, np.ndarray],
                 scale: float) -> dict[str, np.ndarray]:
    """θ_0 + s·(θ_i − θ_0): what a site uploads so that the server's unweighted mean of K uploads
    with s = K is θ_0 + Σ_i (θ_i − θ_0).

    Plain FedAvg halves (for K sites: divides by K) every site's step on the shared word arrays,
    while a model trained on the union takes all of them; the sum keeps the union's step size
    (FedAvg with a server learning rate of K, Reddi et al., "Adaptive Federated Optimization", 2021).
    """
    out = {}
    for name, value in trained.items():
        if name not in start or np.shape(start[name]) != np.shape(value):
            raise ValueError(f"array {name!r}: no matching start of round to scale the update from")
        out[name] = (start[name] + np.float32(scale) * (value - start[name])).astype(np.float32)
    return out


# -- training (§4.2 learning-rate schedule) ---------------------------------------------------------------
def epoch_alpha(settings: GensimSettings, global_epoch: int, total_epochs: int) -> float:
    """alpha for one epoch: linear decay from alpha to min_alpha over all epochs of all rounds.

    alpha_delta = (alpha − min_alpha) / max(total_epochs − 1, 1)   [reference Doc2VecFLModel.fit_model]
    """
    delta = (settings.alpha - settings.min_alpha) / max(total_epochs - 1, 1)
    return max(settings.min_alpha, settings.alpha - delta * min(global_epoch, total_epochs - 1))


def train_epochs(model: Any, corpus: Sequence[Any], settings: GensimSettings, *, first_epoch: int,
                 num_epochs: int, total_epochs: int, seed: int) -> None:
    """Train `num_epochs` single epochs with the continuous decay; the RNG is reseeded from `seed`
    so a round repeats bit for bit (workers=1)."""
    if not corpus:
        return
    model.random = np.random.RandomState(seed % (2**32))
    for e in range(num_epochs):
        a = epoch_alpha(settings, first_epoch + e, total_epochs)
        model.alpha = model.min_alpha = a
        model.min_alpha_yet_reached = a
        model.train(corpus, total_examples=len(corpus), epochs=1, start_alpha=a, end_alpha=a)
    if hasattr(model, "dv"):
        model.dv.norms = None
    model.wv.norms = None


def infer(model: Any, tokens: Sequence[str], settings: GensimSettings, seed: int = 0) -> np.ndarray:
    """gensim's ``infer_vector`` loop with a fixed epoch count and reproducible randomness (§4.2).

    gensim seeds the starting vector with Python's ``hash()`` of the text, which differs between
    processes (PYTHONHASHSEED); a site answering a live query must give the same vector as an
    offline search, so the start comes from a CRC32 of the text and the RNG is reseeded here.
    """
    import zlib

    from gensim import matutils
    from gensim.models.doc2vec_inner import train_document_dbow, train_document_dm

    words = [str(t) for t in tokens]
    model.random = np.random.RandomState(seed % (2**32))
    size = model.dv.vector_size
    start = np.random.default_rng([zlib.crc32(" ".join(words).encode("utf-8")), seed % (2**32)])
    vector = ((start.random(size) - 0.5) / size).astype(np.float32).reshape(1, size)
    lockf = np.ones(1, dtype=np.float32)
    work = np.zeros(model.layer1_size, dtype=np.float32)
    neu1 = matutils.zeros_aligned(model.layer1_size, dtype=np.float32)
    alpha, epochs = settings.alpha, settings.infer_epochs
    delta = (settings.alpha - settings.min_alpha) / max(epochs - 1, 1)
    for _ in range(epochs):
        if model.dm:
            train_document_dm(model, words, [0], alpha, work, neu1, learn_words=False, learn_hidden=False,
                              doctag_vectors=vector, doctags_lockf=lockf)
        else:
            train_document_dbow(model, words, [0], alpha, work, learn_words=False, learn_hidden=False,
                                doctag_vectors=vector, doctags_lockf=lockf)
        alpha -= delta
    return vector[0].copy()


def infer_many(model: Any, token_lists: Sequence[Sequence[str]], settings: GensimSettings,
               seed: int = 0) -> np.ndarray:
    """`infer` for each document with the same `seed`: a document's vector depends on its text and
    the model only, not on its position in the list (so a site, the centralized run and a text
    query of the same words agree)."""
    out = np.zeros((len(token_lists), settings.vector_size), dtype=np.float32)
    for i, tokens in enumerate(token_lists):
        out[i] = infer(model, tokens, settings, seed)
    return out


# -- storage (HDF5, no pickle) --------------------------------------------------------------------------------
def save_model(path: str | Path, model: Any, settings: GensimSettings, *, site: int | str = "") -> Path:
    """Write what inference needs (vocabulary with counts, wv, syn1neg, settings) to HDF5 atomically."""
    words = list(model.wv.index_to_key)
    counts = np.array([model.wv.get_vecattr(w, "count") for w in words], dtype=np.int64)
    attrs = {"site": str(site), **{f"settings.{key}": value for key, value in asdict(settings).items()}}
    return write_model_file(path, MODEL_FORMAT, attrs, {"counts": counts, "wv": model.wv.vectors,
                                                       "syn1neg": model.syn1neg},
                            strings={"words": words}, compress=("wv", "syn1neg"))


def load_model(path: str | Path) -> tuple[Any, GensimSettings]:
    """Rebuild a model written by `save_model` (for `infer`); raises ValueError naming the file."""
    stored = read_model_file(path, MODEL_FORMAT, what="gensim model file",
                             required=("words", "counts", "wv", "syn1neg"),
                             missing_hint="the run writes models/site<k>.h5 at the end")
    values = {k.split(".", 1)[1]: v for k, v in stored.attrs.items() if k.startswith("settings.")}
    settings = build(GensimSettings, values, where=str(path), prefix="settings.")  # names a bad key
    words = [str(w) for w in stored.arrays["words"].reshape(-1)]
    vocab = list(zip(words, (int(c) for c in stored.arrays["counts"])))
    model = site_model(vocab, settings, seed=0, tagged_docs=[] if settings.kind == "doc2vec" else None)
    set_arrays(model, {"wv": stored.arrays["wv"], "syn1neg": stored.arrays["syn1neg"]})
    return model, settings
