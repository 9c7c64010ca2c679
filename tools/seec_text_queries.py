"""Free-text doc2vec queries on 20 Newsgroups (issue 40): how often a sentence finds its own class.

    python tools/seec_text_queries.py [--data-root DIR] [--docs 4000] [--queries 200] [--words 25]

A centralized PV-DM model (50-d, window 5, 20 epochs, gensim, one worker, seed 0) of `--docs` training
posts; each query is the first `--words` words of a held-out test post. Prints label P@10 (share of the
10 nearest training posts in the query's newsgroup; chance 0.05) for training with 5 and 15 negative
samples and inference with 40 and 400 epochs, beside the documents' own P@10 (each training post's
neighbours), all from one run, so the ratios compare side by side.
"""

from __future__ import annotations

import argparse
import time

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
    args = p.parse_args(argv)
    t0 = time.time()
    train = load_20newsgroups(args.data_root, subset="train", max_docs=args.docs, seed=0)
    test = load_20newsgroups(args.data_root, subset="test", max_docs=10 * args.queries, seed=1)
    docs = [TaggedDocument(tokenize(d.text), [i]) for i, d in enumerate(train)]
    labels = np.array([d.label for d in train])
    queries = [(words[:args.words], d.label) for d in test if len(words := tokenize(d.text)) >= args.words]
    queries = queries[:args.queries]
    print(f"{len(docs)} posts, {len(queries)} sentence queries of {args.words} words; chance 0.05", flush=True)
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


if __name__ == "__main__":
    raise SystemExit(main())
