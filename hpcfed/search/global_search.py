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
from hpcfed.search import columns
from hpcfed.search.ann import SiteSearcher, open_site
from hpcfed.search.filters import MaskCache, Where, compile_where, parse_cli, present_labels
from hpcfed.search.index import MERGES, STANDARDIZED_MERGES, Hit, merge_results
from hpcfed.search.pool import in_turn, map_ordered, row_spans
from hpcfed.store.vectors import read_header

MODES = ("joint", "mapping", "nomapping")
MAX_LABEL_NAMES = 100_000
# Rows a filter keeps over all sites, times query rows, up to which the sites are searched one after
# the other on the caller's thread: such a search is a fraction of a millisecond per site (`kept`:
# exact over the decoded rows), less than handing it to the pool's threads and back costs (a 1 %
# filter over 1 M rows, one query: 3.2 against 4.0 ms of CPU per request, measured in the service).
INLINE_WORK = 32_768


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


def joint_refusal(site: str, model: str) -> str:
    """Why ``--mode joint`` is refused over a site whose vectors come from a model of its own."""
    return (f"--mode joint treats the sites' vectors as one space, but site {site}'s export (model {model}) comes "
            f"from a model of its own (a personalised DAMe model or an independently trained doc2vec): use --mode "
            f"nomapping (each site answers in its own space, which is what joint would do here, named for what it "
            f"is) or --mode mapping with mappers; --force searches as joint anyway")


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
        self.masks = MaskCache()
        self._present: dict[str, frozenset[int]] | None = None  # each site's labels, for filters (once)

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
        exports = list(site_exports(folder).items())
        infos = {site: read_header(path, entity).attrs for site, path in exports}
        own = [site for site, attrs in infos.items() if shared_space(attrs) is False]
        if mode == "joint" and own and len(exports) > 1 and not force:
            raise ValueError(joint_refusal(own[0], str(infos[own[0]].get("model", "?"))))

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
        return cls(indexes, mode, mappers, merge, infos)

    def home_of(self, doc_id: str) -> str:
        """The site whose export holds `doc_id`; ValueError if none does."""
        for site, index in self.indexes.items():
            if doc_id in index.position:
                return site
        raise ValueError(f"id {doc_id!r} is in none of the sites' exports ({', '.join(self.indexes)})")

    def where(self, raw: Mapping[str, list[Any]] | Sequence[str] | None) -> Where | None:
        """A filter checked against these sites: ``{key: [values]}`` or ``--where KEY=VALUE`` strings
        (`hpcfed.search.filters`); FilterError naming what no site has."""
        if not raw:
            return None
        parsed = parse_cli(raw) if not isinstance(raw, Mapping) else raw
        if self._present is None:
            self._present = present_labels(self.indexes)
        return compile_where(parsed, self.indexes, {site: self.names.get(site, []) for site in self.indexes},
                             self._present)

    def search(self, home: str, vectors: np.ndarray, k: int,
               exclude: Sequence[str | None] | None = None, where: Where | None = None) -> list[list[Hit]]:
        """Top-k merged over all sites for each query vector of site `home` (batched), only over the
        documents `where` keeps (see `GlobalSearch.where`)."""
        vectors = np.atleast_2d(np.asarray(vectors, dtype=np.float32))
        standardize = self.merge in STANDARDIZED_MERGES
        counted = {site: (None, len(index.ids)) if where is None else
                   self.masks.counted(where, site, index, self.names.get(site, []))
                   for site, index in self.indexes.items()}
        masks = {site: mask for site, (mask, _) in counted.items()}
        searched = [site for site, (_, kept) in counted.items() if kept]
        mapped = {site: map_query(self.mode, home, site, vectors, self.mappers) for site in searched}
        if len(vectors) * sum(counted[site][1] for site in searched) <= INLINE_WORK:  # a narrow filter
            tasks, run = [(site, 0, len(vectors)) for site in searched], in_turn
        else:
            tasks = [(site, lo, hi) for site in searched for lo, hi in row_spans(len(vectors), len(searched))]
            run = map_ordered

        def hits(task: tuple[str, int, int]) -> list[list[Hit]]:
            site, lo, hi = task
            skip = list(exclude[lo:hi]) if exclude is not None else None
            return self.indexes[site].hits(mapped[site][lo:hi], k, skip, standardize, masks[site])

        per_site: dict[str, list[list[Hit]]] = {site: [] for site in searched}
        for (site, _, _), found in zip(tasks, run(hits, tasks)):  # the sites searched side by side
            per_site[site] += found
        lists = list(per_site.values())
        return [merge_results([site_lists[i] for site_lists in lists], k, self.merge, home)
                for i in range(len(vectors))]

    def shown(self, hit: Hit) -> dict[str, Any]:
        """A hit as JSON: site, id, score, label, ``label_name`` where the export names the label (an
        event, a class), and the row's attributes where the export carries them (``time``, ``text``)."""
        out: dict[str, Any] = hit.as_dict()
        name = self.label_name(hit.site, hit.label)
        if name is not None:
            out["label_name"] = name
        index = self.indexes.get(hit.site)
        if index is not None and index.columns:
            out.update(columns.shown(index.columns, index.position[hit.id]))
        return out

    def search_id(self, doc_id: str, k: int, where: Where | None = None) -> list[Hit]:
        """The merged top-k for document `doc_id`, asked from its home site (itself left out)."""
        home = self.home_of(doc_id)
        return self.search(home, self.indexes[home].vector_of(doc_id)[None], k, [doc_id], where)[0]
