"""The homogeneous message graph of DAMe/KPGNN (spec 1.1): messages linked by shared attributes.

Each message links to its users (author and mentions, namespace ``u_``), entities (``e_``) and
hashtags (``h_``). With ``T_u, T_e, T_h`` the binary message × attribute incidence matrices, the
message graph is::

    A = bool(T_u T_uᵀ + T_e T_eᵀ + T_h T_hᵀ)                                   (spec 1.1, step 3)

so the diagonal is 1 for every message with at least one attribute (these self-loops are kept) and a
message with no attribute has degree 0. Where the data has no mentions/hashtags/entities column they
are extracted from the text: ``@name``, ``#tag`` and, for entities, runs of capitalised words (a light
stand-in for the NER tagger of the reference preprocessing, which is not part of this project).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from hpcfed.data.messages import Messages

if TYPE_CHECKING:  # scipy is imported where it is used, to keep `import hpcfed.data` light
    import scipy.sparse

_MENTION = re.compile(r"@(\w+)")
_HASHTAG = re.compile(r"#(\w+)")
_URL = re.compile(r"https?://\S+")
_CAPS = re.compile(r"\b([A-Z][\w'’-]*(?:\s+[A-Z][\w'’-]*)*)")
# capitalised words that start sentences or are Twitter noise, not entities
_NOT_ENTITY = {"rt", "the", "a", "an", "i", "we", "you", "he", "she", "it", "they", "my", "our", "this", "that",
               "in", "on", "at", "of", "for", "to", "and", "or", "but", "is", "are", "was", "be", "via", "so",
               "what", "who", "how", "why", "when", "if", "just", "please", "omg", "lol", "new", "no", "yes"}


def extract_mentions(text: str) -> list[str]:
    """The @names mentioned in `text`, lower-cased, without the @."""
    return [m.lower() for m in _MENTION.findall(text)]


def extract_hashtags(text: str) -> list[str]:
    """The #tags in `text`, lower-cased, without the #."""
    return [h.lower() for h in _HASHTAG.findall(text)]


def extract_entities(text: str) -> list[str]:
    """Runs of capitalised words, lower-cased, without mentions, hashtags, URLs and stop words."""
    clean = _URL.sub(" ", text)
    clean = _MENTION.sub(" ", clean)
    clean = _HASHTAG.sub(" ", clean)
    out = []
    for run in _CAPS.findall(clean):
        words = [w for w in run.split() if w.lower() not in _NOT_ENTITY]
        if words and len(" ".join(words)) >= 3:
            out.append(" ".join(words).lower())
    return out


def message_attributes(messages: Messages) -> list[set[str]]:
    """Per message, its namespaced attributes ``u_*`` (author + mentions), ``e_*``, ``h_*``.

    Columns the source did not have are extracted from the text; an author id of ``-1`` means none.
    """
    has = messages.has
    attrs = []
    for i, text in enumerate(messages.texts):
        mentions = messages.mentions[i] if has.get("mentions") else extract_mentions(text)
        hashtags = messages.hashtags[i] if has.get("hashtags") else extract_hashtags(text)
        entities = messages.entities[i] if has.get("entities") else extract_entities(text)
        users = {u.lower().lstrip("@") for u in mentions}
        author = messages.users[i]
        if author and author != "-1":
            users.add(author.lower().lstrip("@"))
        a = {f"u_{u}" for u in users if u}
        a |= {f"e_{e.lower()}" for e in entities if e}
        a |= {f"h_{h.lower().lstrip('#')}" for h in hashtags if h}
        attrs.append(a)
    return attrs


def incidence(attributes: Sequence[set[str]]) -> scipy.sparse.csr_matrix:
    """Binary (messages × attributes) matrix T = [T_u | T_e | T_h] (namespaces keep them disjoint)."""
    import scipy.sparse as sp

    vocab: dict[str, int] = {}
    rows, cols = [], []
    for i, attrs in enumerate(attributes):
        for a in sorted(attrs):
            rows.append(i)
            cols.append(vocab.setdefault(a, len(vocab)))
    data = np.ones(len(rows), dtype=np.float32)
    return sp.csr_matrix((data, (rows, cols)), shape=(len(attributes), max(len(vocab), 1)))


def message_adjacency(attributes: Sequence[set[str]]) -> scipy.sparse.csr_matrix:
    """A = bool(T Tᵀ) as a sparse bool matrix (n, n), self-loops included (spec 1.1)."""
    t = incidence(attributes)
    a = (t @ t.T).astype(bool).tocsr()
    a.eliminate_zeros()
    return a


def edge_index(adjacency: scipy.sparse.spmatrix) -> np.ndarray:
    """(2, E) int64 [source; target] of a sparse adjacency (symmetric here, so direction is moot)."""
    coo = adjacency.tocoo()
    return np.stack([coo.row, coo.col]).astype(np.int64)
