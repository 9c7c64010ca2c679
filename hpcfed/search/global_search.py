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

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hpcfed.models.mapper import Mapper, load_mapper, mapper_path
from hpcfed.search.ann import SiteSearcher, open_site
from hpcfed.search.index import MERGES, STANDARDIZED_MERGES, Hit, merge_results
from hpcfed.store.vectors import read_header

MODES = ("joint", "mapping", "nomapping")
MAX_LABEL_NAMES = 100_000


def shared_space(attrs: Mapping[str, Any]) -> bool | None:
    """Whether a site's vectors lie in the one space all sites share, from its export's attributes
    (None: the export does not say)."""
    if "shared_space" in attrs:
        return bool(attrs["shared_space"])
    if attrs.get("mode") in ("mapping", "nomapping"):
        return False  # doc2vec trained independently at each site
    if attrs.get("model") == "dame-gat":
        return False  # DAMe exports before `shared_space`: personalised (BOLA) models
    return None


def label_names(attrs: Mapping[str, Any]) -> list[str]:
    """The name of each integer label an export holds (``label_names``, a JSON list, or DAMe's
    comma-joined ``events``); [] when it names none or the attribute is malformed."""
    raw = attrs.get("label_names")
    if isinstance(raw, str) and raw:
        try:
            names = json.loads(raw)
        except ValueError:
            return []
        if isinstance(names, list) and len(names) <= MAX_LABEL_NAMES and all(isinstance(n, str) for n in names):
            return names
        return []
    events = attrs.get("events")
    return events.split(",") if isinstance(events, str) and events else []


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
                 mappers: Mapping[tuple[str, str], Mapper] | None = None, merge: str = "score",
                 infos: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"search mode {mode!r}; choose one of: {', '.join(MODES)}")
        if merge not in MERGES:
            raise ValueError(f"merge={merge!r}; choose one of: {', '.join(MERGES)}")
        self.indexes = dict(indexes)
        self.mode = mode
        self.mappers = dict(mappers or {})
        self.merge = merge
        self.infos = {site: dict(attrs) for site, attrs in (infos or {}).items()}  # export attributes per site
        self.names = {site: label_names(attrs) for site, attrs in self.infos.items()}

    def label_name(self, site: str, label: int) -> str | None:
        """The name of `label` in `site`'s export (an event, a class), or None if it names none."""
        names = self.names.get(site, [])
        return names[label] if 0 <= label < len(names) and names[label] else None

    @classmethod
    def from_folder(cls, folder: str | Path, *, entity: str | None = None, mode: str = "joint",
                    mappers_dir: str | Path | None = None, merge: str = "score", exact: bool = False,
                    nprobe: int | None = None, ef_search: int | None = None, force: bool = False) -> GlobalSearch:
        """A search over the site exports in `folder` (and, for mode=mapping, its mappers).

        ``mode="joint"`` over sites that each trained their own space (DAMe's personalised models,
        doc2vec mapping/nomapping runs) is refused unless `force`: it would rank cosines from
        different spaces as if they were one."""
        exports = site_exports(folder)
        infos = {site: read_header(path, entity).attrs for site, path in exports.items()}
        own = [site for site, attrs in infos.items() if shared_space(attrs) is False]
        if mode == "joint" and own and len(exports) > 1 and not force:
            what = infos[own[0]].get("model", "?")
            raise ValueError(f"--mode joint treats the sites' vectors as one space, but site {own[0]}'s export "
                             f"(model {what}) comes from a model of its own (a personalised DAMe model or an "
                             f"independently trained doc2vec): use --mode nomapping (each site answers in its own "
                             f"space, which is what joint would do here, named for what it is) or --mode mapping "
                             f"with mappers; --force searches as joint anyway")
        indexes = {site: open_site(path, entity, site, exact=exact, nprobe=nprobe, ef_search=ef_search)
                   for site, path in exports.items()}
        mappers = {}
        if mode == "mapping":
            mdir = Path(mappers_dir) if mappers_dir else Path(folder) / "mappers"
            for i in indexes:
                for j in indexes:
                    if i != j:
                        mappers[(i, j)] = load_mapper(mapper_path(mdir, i, j))
        return cls(indexes, mode, mappers, merge, infos)

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
        per_site = [index.hits(map_query(self.mode, home, site, vectors, self.mappers), k, exclude, standardize)
                    for site, index in self.indexes.items()]
        return [merge_results([lists[i] for lists in per_site], k, self.merge, home) for i in range(len(vectors))]

    def search_id(self, doc_id: str, k: int) -> list[Hit]:
        """The merged top-k for document `doc_id`, asked from its home site (itself left out)."""
        home = self.home_of(doc_id)
        return self.search(home, self.indexes[home].vector_of(doc_id)[None], k, [doc_id])[0]
