"""Cross-site semantic search over per-site exports (paper Alg. 2 GlobalSearch; spec §4.4).

    query at site q:  v_q = m_q(d)
    for each site j:  v_j = v_q                    (joint: one shared space)
                          | mapper_{q→j}(v_q)      (mapping: independently trained sites)
                          | v_q unmapped           (nomapping: the baseline)
    site j returns top-k over its own documents; the initiator merges by score and keeps k
    (or, ``merge="interleave"``, rank by rank over the sites: see `hpcfed.search.index`)

`GlobalSearch` is the offline form (every site's export in one folder); the live form over MPI in
`hpcfed.search.live` runs the same steps with each rank holding only its own export.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from hpcfed.models.mapper import Mapper, load_mapper, mapper_path
from hpcfed.search.ann import SiteSearcher, open_site
from hpcfed.search.index import MERGES, STANDARDIZED_MERGES, Hit, merge_results
from hpcfed.search.pool import map_ordered, row_spans

MODES = ("joint", "mapping", "nomapping")


def site_exports(folder: str | Path) -> dict[str, Path]:
    """``site<k>.h5`` files of a folder (a run's ``embeddings/`` or the run directory itself), by site."""
    folder = Path(folder)
    if (folder / "embeddings").is_dir():
        folder = folder / "embeddings"
    found = {}
    for path in sorted(folder.glob("site*.h5")):
        m = re.fullmatch(r"site(\d+)\.h5", path.name)
        if m:
            found[m.group(1)] = path
    if not found:
        raise ValueError(f"no site<k>.h5 embedding exports in {folder}; point at a run's embeddings/ folder")
    return dict(sorted(found.items(), key=lambda kv: int(kv[0])))


def map_query(mode: str, home: str, site: str, vectors: np.ndarray,
              mappers: Mapping[tuple[str, str], Mapper] | None) -> np.ndarray:
    """The query as site `site` sees it (spec §4.4)."""
    if mode not in MODES:
        raise ValueError(f"search mode {mode!r}; choose one of: {', '.join(MODES)}")
    if mode != "mapping" or site == home:
        return vectors
    if not mappers or (home, site) not in mappers:
        raise ValueError(f"mode=mapping needs the mapper site{home} -> site{site}; "
                         f"train it with `hpcfed search train-mappers RUN_DIR`")
    return mappers[(home, site)](vectors)


class GlobalSearch:
    """Search over every site's index at once, merging the sites' top-k lists (offline form)."""

    def __init__(self, indexes: Mapping[str, SiteSearcher], mode: str = "joint",
                 mappers: Mapping[tuple[str, str], Mapper] | None = None, merge: str = "score") -> None:
        if mode not in MODES:
            raise ValueError(f"search mode {mode!r}; choose one of: {', '.join(MODES)}")
        if merge not in MERGES:
            raise ValueError(f"merge={merge!r}; choose one of: {', '.join(MERGES)}")
        self.indexes = dict(indexes)
        self.mode = mode
        self.mappers = dict(mappers or {})
        self.merge = merge

    @classmethod
    def from_folder(cls, folder: str | Path, *, entity: str | None = None, mode: str = "joint",
                    mappers_dir: str | Path | None = None, merge: str = "score", exact: bool = False,
                    nprobe: int | None = None, ef_search: int | None = None) -> GlobalSearch:
        """A search over the site exports in `folder` (and, for mode=mapping, its mappers)."""
        exports = list(site_exports(folder).items())

        def load(item: tuple[str, Path]) -> SiteSearcher:
            return open_site(item[1], entity, item[0], exact=exact, nprobe=nprobe, ef_search=ef_search)

        # indexes load side by side (reading, hashing and FAISS parsing release the GIL); exact search
        # loads one export at a time, each one's transient copies being a whole export's size
        loaded = map_ordered(load, exports) if not exact else [load(item) for item in exports]
        indexes = {site: index for (site, _), index in zip(exports, loaded)}
        mappers = {}
        if mode == "mapping":
            mdir = Path(mappers_dir) if mappers_dir else Path(folder) / "mappers"
            for i in indexes:
                for j in indexes:
                    if i != j:
                        mappers[(i, j)] = load_mapper(mapper_path(mdir, i, j))
        return cls(indexes, mode, mappers, merge)

    def home_of(self, doc_id: str) -> str:
        """The site whose export holds `doc_id`; ValueError if none does."""
        for site, index in self.indexes.items():
            if doc_id in index.position:
                return site
        raise ValueError(f"id {doc_id!r} is in none of the sites' exports ({', '.join(self.indexes)})")

    def search(self, home: str, vectors: np.ndarray, k: int,
               exclude: Sequence[str | None] | None = None) -> list[list[Hit]]:
        """Top-k merged over all sites for each query vector of site `home` (batched)."""
        vectors = np.atleast_2d(np.asarray(vectors, dtype=np.float32))
        standardize = self.merge in STANDARDIZED_MERGES
        mapped = {site: map_query(self.mode, home, site, vectors, self.mappers) for site in self.indexes}
        tasks = [(site, lo, hi) for site in self.indexes for lo, hi in row_spans(len(vectors), len(self.indexes))]

        def hits(task: tuple[str, int, int]) -> list[list[Hit]]:
            site, lo, hi = task
            skip = list(exclude[lo:hi]) if exclude is not None else None
            return self.indexes[site].hits(mapped[site][lo:hi], k, skip, standardize)

        per_site: dict[str, list[list[Hit]]] = {site: [] for site in self.indexes}
        for (site, _, _), found in zip(tasks, map_ordered(hits, tasks)):  # the sites searched side by side
            per_site[site] += found
        lists = list(per_site.values())
        return [merge_results([site_lists[i] for site_lists in lists], k, self.merge, home)
                for i in range(len(vectors))]

    def search_id(self, doc_id: str, k: int) -> list[Hit]:
        """The merged top-k for document `doc_id`, asked from its home site (itself left out)."""
        home = self.home_of(doc_id)
        return self.search(home, self.indexes[home].vector_of(doc_id)[None], k, [doc_id])[0]
