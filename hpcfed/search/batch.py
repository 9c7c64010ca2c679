"""Many queries in one call: by id, by text, by vector; answered in batches per home site.

Used by ``hpcfed search query`` (``--ids-file``, ``--texts-file``) and by ``hpcfed search serve``.
Each answer has the shape of the offline search's output::

    {"query": {"id": ...} | {"text": ..., "home": ...} | {"vector": "<d floats>", "home": ...},
     "home": "<site>", "mode": ..., "merge": ..., "results": [{"site", "id", "score", "label"}, ...]}

Ids of one home site are vectorised and searched as one matrix, so 1,000 ids cost a few FAISS batch
searches, not 1,000 Python round trips.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from hpcfed.search.filters import Where
from hpcfed.search.global_search import GlobalSearch

MAX_LINES = 1_000_000
# exports of the project's tasks whose vectors no model computes for a new text (`check_text_queries`)
NO_TEXT_MODELS = ("dame-gat", "fedahe", "node2vec", "synthetic-mlp")
MAX_LINE_CHARS = 100_000


class UnknownIdError(ValueError):
    """A query names an id that no site holds."""


def read_lines(path: str | Path, what: str) -> list[str]:
    """The non-empty lines of a UTF-8 file (one query each), bounded in count and length."""
    path = Path(path)
    out: list[str] = []
    try:
        with path.open(encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if len(line) > MAX_LINE_CHARS:
                    raise ValueError(f"{path}:{number}: a {what} longer than {MAX_LINE_CHARS} characters")
                line = line.strip()
                if line:
                    out.append(line)
                if len(out) > MAX_LINES:
                    raise ValueError(f"{path}: more than {MAX_LINES} {what}s; split the file")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text near byte {exc.start}") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the {what}s file ({exc.strerror or exc})") from None
    return out


def homes_of(search: GlobalSearch, ids: Sequence[str]) -> list[str]:
    """The site holding each id; an unknown id is an error naming it (and how many more there are)."""
    homes, unknown = [], []
    for doc_id in ids:
        home = next((site for site, index in search.indexes.items() if doc_id in index.position), None)
        if home is None:
            unknown.append(doc_id)
        homes.append(home or "")
    if unknown:
        more = f" and {len(unknown) - 1} more" if len(unknown) > 1 else ""
        raise UnknownIdError(f"id {unknown[0]!r}{more} is in none of the sites' exports "
                             f"({', '.join(search.indexes)})")
    return homes


def answer_ids(search: GlobalSearch, ids: Sequence[str], k: int, where: Where | None = None) -> list[dict[str, Any]]:
    """Top-k for each id, in the order given (each query's own document left out)."""
    homes = homes_of(search, ids)
    out: list[dict[str, Any] | None] = [None] * len(ids)
    for home in sorted(set(homes)):
        rows = [i for i, h in enumerate(homes) if h == home]
        index = search.indexes[home]
        vectors = np.stack([index.vector_of(ids[i]) for i in rows])
        hits = search.search(home, vectors, k, [ids[i] for i in rows], where)
        for i, h in zip(rows, hits):
            out[i] = _answer(search, {"id": ids[i]}, home, h)
    return [a for a in out if a is not None]


def answer_vectors(search: GlobalSearch, vectors: np.ndarray, home: str, k: int,
                   queries: Sequence[dict[str, Any]] | None = None, where: Where | None = None) -> list[dict[str, Any]]:
    """Top-k for each row of `vectors`, given in the space of site `home`."""
    if home not in search.indexes:
        raise ValueError(f"home site {home!r}: no such site (sites: {', '.join(search.indexes)})")
    dim = search.indexes[home].dim
    if vectors.ndim != 2 or vectors.shape[1] != dim:
        raise ValueError(f"query vectors must have {dim} numbers (site {home}'s dimension), got {vectors.shape[-1]}")
    hits = search.search(home, vectors, k, None, where)
    shown = queries or [{"vector": f"<{dim} floats>", "home": home}] * len(vectors)
    return [_answer(search, q, home, h) for q, h in zip(shown, hits)]


class TextVectorizer:
    """Each home site's doc2vec model, loaded once, inferring one text at a time (thread-safe)."""

    def __init__(self, models_dir: Path, infer_epochs: int | None = None) -> None:
        if infer_epochs is not None and infer_epochs < 1:
            raise ValueError(f"--infer-epochs must be >= 1, got {infer_epochs}")
        self.models_dir = Path(models_dir)
        self.infer_epochs = infer_epochs
        self._models: dict[str, Any] = {}
        self._lock = threading.Lock()

    def __call__(self, home: str, text: str) -> np.ndarray:
        from hpcfed.data.corpus import tokenize
        from hpcfed.models.doc2vec import infer, load_model

        with self._lock:  # gensim's inference is not documented as thread-safe
            if home not in self._models:
                path = self.models_dir / f"site{home}.h5"
                if not path.is_file():
                    raise ValueError(f"a text query needs site {home}'s doc2vec model, {path} does not exist "
                                     f"(--models DIR; text queries work for doc2vec runs)")
                model, settings = load_model(path)
                if self.infer_epochs is not None:
                    settings = dataclasses.replace(settings, infer_epochs=self.infer_epochs)
                self._models[home] = model, settings
            model, settings = self._models[home]
            return np.asarray(infer(model, tokenize(text), settings), np.float32)


def answer_texts(search: GlobalSearch, texts: Sequence[str], home: str, k: int,
                 vectorize: TextVectorizer, where: Where | None = None) -> list[dict[str, Any]]:
    """Top-k for each text, vectorised by the model of site `home`."""
    if home not in search.indexes:
        raise ValueError(f"--home {home}: no such site (sites: {', '.join(search.indexes)})")
    if not texts:
        return []
    check_text_queries(search, home)
    vectors = np.stack([vectorize(home, t) for t in texts])
    return answer_vectors(search, vectors, home, k, [{"text": t, "home": home} for t in texts], where)


def _answer(search: GlobalSearch, query: dict[str, Any], home: str, hits: Iterable[Any]) -> dict[str, Any]:
    return {"query": query, "home": home, "mode": search.mode, "merge": search.merge,
            "results": [search.shown(h) for h in hits]}


def check_text_queries(search: GlobalSearch, home: str) -> None:
    """Refuse text queries where the home site's export is not a doc2vec model's, saying what works."""
    attrs = search.infos.get(home, {})
    model = str(attrs.get("model", ""))
    if attrs.get("kind", "doc2vec") != "doc2vec" or model.startswith(NO_TEXT_MODELS):
        raise ValueError(f"text queries are doc2vec-only: site {home}'s export holds {model or 'non-doc2vec'} "
                         f"vectors, which no model here computes for a new text (a DAMe vector comes from a GAT "
                         f"over the message graph); query by the id of a message or document instead (--id, "
                         f"--ids-file)")


def write_answers(out: IO[str], answers: list[dict[str, Any]], sites: int, *, jsonl: bool = False,
                  compact: bool = False) -> None:
    """Today's JSON document ``{"queries": [...], "sites": N}``, or one answer per line (JSONL)."""
    if jsonl:
        for a in answers:
            out.write(json.dumps(a, separators=(",", ":")) + "\n")
    else:
        out.write(json.dumps({"queries": answers, "sites": sites}, indent=None if compact else 2) + "\n")
