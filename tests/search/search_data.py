"""Small synthetic collections for the search tests: clustered vectors in a few site exports, and a
tiny doc2vec model per site for text queries."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hpcfed.store.embeddings import export_path, write_export


def clustered(n: int, d: int, seed: int, clusters: int = 40, rank: int = 6) -> np.ndarray:
    """Vectors around cluster centres with a low-rank spread and a little noise (like embeddings)."""
    structure = np.random.default_rng(1234)
    centres = structure.normal(size=(clusters, d))
    basis = structure.normal(size=(rank, d)) / np.sqrt(rank)
    rng = np.random.default_rng(seed)
    x = centres[rng.integers(clusters, size=n)] + rng.normal(size=(n, rank)) @ basis + 0.2 * rng.normal(size=(n, d))
    return x.astype(np.float32)


def write_sites(run: Path, sizes: list[int], d: int = 32, entity: str = "doc") -> dict[str, np.ndarray]:
    """One export per site, ids ``s<site>-<row>``, labels row % 5; returns the vectors by site."""
    out = {}
    for site, n in enumerate(sizes):
        vectors = clustered(n, d, seed=site)
        write_export(export_path(run, site), vectors, [f"s{site}-{i}" for i in range(n)], np.arange(n) % 5,
                     entity=entity, model="test", site=site)
        out[str(site)] = vectors
    return out


def write_doc2vec_models(run: Path, sites: int, d: int = 32) -> None:
    """A small doc2vec model per site (vocabulary of a few words), enough for text queries."""
    from hpcfed.models.doc2vec import GensimSettings, save_model, site_model

    words = ["storm", "flood", "rescue", "city", "river", "power", "fire", "shelter", "road", "bridge"]
    settings = GensimSettings(vector_size=d, min_count=1, sample=0, infer_epochs=5)
    for site in range(sites):
        model = site_model([(w, 10) for w in words], settings, seed=site, tagged_docs=[])
        save_model(run / "models" / f"site{site}.h5", model, settings, site=site)


EVENTS = ["flood", "fire", "storm", "quake"]
T0 = 1_350_000_000  # 2012-10-12T00:06:40Z


def write_message_sites(run: Path, sizes: list[int], d: int = 32) -> dict[str, np.ndarray]:
    """DAMe-like exports: ids ``m<site>-<row>``, event labels named by `EVENTS` (site 1 has no "quake"),
    a ``time`` (T0 + one hour per row) and a ``text`` column, and a numeric ``lang`` column on site 0 only."""
    import json

    out = {}
    for site, n in enumerate(sizes):
        vectors = clustered(n, d, seed=10 + site)
        events = EVENTS if site != 1 else EVENTS[:3]
        columns = {"time": T0 + 3600 * np.arange(n), "text": [f"message {i} about {events[i % len(events)]}"
                                                               for i in range(n)]}
        if site == 0:
            columns["lang"] = np.arange(n) % 3
        write_export(export_path(run, site), vectors, [f"m{site}-{i}" for i in range(n)],
                     np.arange(n) % len(events), entity="message", model="dame-gat", site=site,
                     extra={"label_names": json.dumps(events), "shared_space": True}, columns=columns)
        out[str(site)] = vectors
    return out
