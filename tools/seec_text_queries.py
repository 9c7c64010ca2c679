"""Free-text doc2vec queries on 20 Newsgroups (issue 40): how often a sentence finds its own class.

    python tools/seec_text_queries.py [--data-root DIR] [--docs 4000] [--queries 200] [--words 25]
    python tools/seec_text_queries.py --starts       # where the inferred vector starts (negative 5 only)

A centralized PV-DM model (50-d, window 5, 20 epochs, gensim, one worker, seed 0) of `--docs` training
posts; each query is the first `--words` words of a held-out test post. Prints label P@10 (share of the
10 nearest training posts in the query's newsgroup; chance 0.05) for training with 5 and 15 negative
samples and inference with 40 and 400 epochs, beside the documents' own P@10 (each training post's
neighbours), all from one run, so the ratios compare side by side.

``--starts`` instead compares, on the model with 5 negatives, where inference starts (the same 40 or
400 epochs of gensim's loop from each start): gensim's small random vector; the mean vector of the 10
training posts nearest to a first 40-epoch inference (two passes: needs only the vectors a search
holds); the mean vector of the 10 training posts nearest to the query by TF-IDF over their words
(needs the documents' texts, which an export does not carry).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np


def main(argv: list[str] | None = None) -> int:
    """Train, query, print one line per setting; exit status."""
    from gensim.models.doc2vec import Doc2Vec, TaggedDocument

    from hpcfed.data.corpus import load_20newsgroups, tokenize

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-root", default=None, help="folder holding text/20news-bydate.tar.gz ($HPCFED_DATA)")
    p.add_argument("--docs", type=int, default=4000)
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--words", type=int, default=25)
    p.add_argument("--starts", action="store_true", help="compare inference starts (negative 5 only)")
    args = p.parse_args(argv)
    t0 = time.time()
    train = load_20newsgroups(args.data_root, subset="train", max_docs=args.docs, seed=0)
    test = load_20newsgroups(args.data_root, subset="test", max_docs=10 * args.queries, seed=1)
    docs = [TaggedDocument(tokenize(d.text), [i]) for i, d in enumerate(train)]
    labels = np.array([d.label for d in train])
    queries = [(words[:args.words], d.label) for d in test if len(words := tokenize(d.text)) >= args.words]
    queries = queries[:args.queries]
    print(f"{len(docs)} posts, {len(queries)} sentence queries of {args.words} words; chance 0.05", flush=True)
    if args.starts:
        return starts(docs, labels, queries, t0)
    for negative in (5, 15):
        model = Doc2Vec(docs, vector_size=50, window=5, min_count=2, dm=1, negative=negative, epochs=20,
                        workers=1, seed=0)
        dv = model.dv.vectors / np.linalg.norm(model.dv.vectors, axis=1, keepdims=True)
        own = np.mean([np.mean(labels[np.argsort(-dv @ dv[i])[1:11]] == labels[i]) for i in range(0, len(dv), 20)])
        for epochs in (40, 400):
            found = []
            for words, label in queries:
                v = model.infer_vector(words, epochs=epochs)
                v = v / (np.linalg.norm(v) or 1.0)
                found.append(np.mean(labels[np.argsort(-dv @ v)[:10]] == label))
            print(f"negative {negative}, infer_epochs {epochs}: sentence P@10 {np.mean(found):.3f} "
                  f"(documents' own P@10 {own:.3f}); {time.time() - t0:.0f} s", flush=True)
    return 0


def infer_from(model: object, words: list[str], start: np.ndarray, epochs: int) -> np.ndarray:
    """gensim's inference loop (``Doc2Vec.infer_vector``, PV-DM) from the vector `start`."""
    from gensim import matutils
    from gensim.models.doc2vec_inner import train_document_dm

    m: Any = model
    vector = np.array(start, dtype=np.float32).reshape(1, -1)
    work = np.zeros(m.layer1_size, dtype=np.float32)
    neu1 = matutils.zeros_aligned(m.layer1_size, dtype=np.float32)
    alpha, delta = m.alpha, (m.alpha - m.min_alpha) / max(epochs - 1, 1)
    for _ in range(epochs):
        train_document_dm(m, words, [0], alpha, work, neu1, learn_words=False, learn_hidden=False,
                          doctag_vectors=vector, doctags_lockf=np.ones(1, dtype=np.float32))
        alpha -= delta
    return vector[0]


def starts(docs: list, labels: np.ndarray, queries: list[tuple[list[str], int]], t0: float) -> int:
    """``--starts``: label P@10 of sentence queries by where inference starts, one line per setting."""
    from gensim.models.doc2vec import Doc2Vec
    from sklearn.feature_extraction.text import TfidfVectorizer

    model = Doc2Vec(docs, vector_size=50, window=5, min_count=2, dm=1, negative=5, epochs=20, workers=1, seed=0)
    raw = model.dv.vectors
    dv = raw / np.linalg.norm(raw, axis=1, keepdims=True)
    tfidf = TfidfVectorizer(analyzer=lambda words: words)
    tf_docs = tfidf.fit_transform([d.words for d in docs])

    def p10(v: np.ndarray, label: int) -> float:
        return float(np.mean(labels[np.argsort(-dv @ (v / (np.linalg.norm(v) or 1.0)))[:10]] == label))

    found: dict[str, list[float]] = {}
    for words, label in queries:
        rnd = model.infer_vector(words, epochs=40)
        by_words = np.argsort(-(tf_docs @ tfidf.transform([words]).T).toarray().ravel())[:10]
        first = np.argsort(-dv @ (rnd / (np.linalg.norm(rnd) or 1.0)))[:10]
        for epochs in (40, 400):
            v = rnd if epochs == 40 else model.infer_vector(words, epochs=epochs)
            found.setdefault(f"random start, {epochs} epochs", []).append(p10(v, label))
            found.setdefault(f"start at the mean of a first pass's 10 nearest, {epochs} epochs",
                             []).append(p10(infer_from(model, words, raw[first].mean(axis=0), epochs), label))
            found.setdefault(f"start at the mean of the 10 nearest by TF-IDF, {epochs} epochs",
                             []).append(p10(infer_from(model, words, raw[by_words].mean(axis=0), epochs), label))
        found.setdefault("no inference: the mean of the 10 nearest by TF-IDF", []).append(
            p10(raw[by_words].mean(axis=0), label))
    for name, vals in found.items():
        print(f"negative 5, {name}: sentence P@10 {np.mean(vals):.3f}", flush=True)
    print(f"{time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
