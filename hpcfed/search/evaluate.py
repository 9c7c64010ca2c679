"""``hpcfed eval RUN [--central RUN]``: the cross-site search figures of a run (docs/seec.md).

    hpcfed eval RUN [--central RUN] [--mode auto|joint|mapping|nomapping] [--merge score|interleave|zscore]
                    [--k 10] [--entity doc] [--mappers DIR] [--max-queries N] [--no-write]

Every document (message, node) of every site is a query: the global search (paper Alg. 2, spec
§4.4) from its home site over all sites, its own document left out. Reported:

``label_precision_at_k``        share of the k merged results with the query's label
``remote_share_of_results``     share of the merged results that come from other sites
``cross_site_label_precision_at_k``  the same over the other sites' answers only (what joint
                                learning or a mapper adds: the home site needs neither)

With ``--central`` (a run of the same documents on one site, ``method=centralized``), also
``sim_k = |top_k^central ∩ top_k^fed| / k`` (paper §V.A.3, mean over queries),
``central_label_precision_at_k`` and ``cross_site_sim_k`` (the other sites' answers against the
central top-k among those sites' documents). The figures go into RUN/summary.json (``sim_k[name]``
and, for the default merge, ``sim_10`` / ``label_precision_at_10`` with a ``_<mode>`` suffix when
the mode is not joint) unless ``--no-write``. Labels are compared by name where the exports name them
(``label_names``: DAMe's events, a corpus's classes), since each site numbers its own labels from 0;
by number only where an export names none. ``--mode auto`` (the default) is ``mapping`` for a
doc2vec mapping run with mappers, ``nomapping`` for sites with spaces of their own, else ``joint``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import numpy as np

from hpcfed.search.global_search import GlobalSearch, map_query, shared_space
from hpcfed.search.index import STANDARDIZED_MERGES, Hit, SiteIndex, merge_results
from hpcfed.search.metrics import label_precision_at_k, mean_sim_k


def auto_mode(run: Path, mappers_dir: Path | None, entity: str | None) -> str:
    """The search mode a run was made for (module docstring)."""
    from hpcfed.search.global_search import site_exports
    from hpcfed.store.vectors import read_header

    attrs = [read_header(p, entity).attrs for p in site_exports(run).values()]
    mappers = mappers_dir or (run / "mappers")
    if any(a.get("mode") == "mapping" for a in attrs) and mappers.is_dir() and any(mappers.iterdir()):
        return "mapping"
    return "nomapping" if any(shared_space(a) is False for a in attrs) else "joint"


def score(central: Path | None, fed: Path, *, mode: str = "joint", k: int = 10, entity: str | None = None,
          max_queries: int | None = None, seed: int = 0, mappers_dir: Path | None = None,
          write_summary: bool = True, merge: str = "score") -> dict[str, Any]:
    """The figures of the module docstring for run `fed` (sim_k only against a `central` run)."""
    if k < 1:
        raise ValueError(f"--k must be >= 1, got {k}")
    cidx: SiteIndex | None = None
    central_key: LabelKey | None = None
    if central is not None:
        central_search = GlobalSearch.from_folder(central, entity=entity, exact=True)  # the reference: no index
        if len(central_search.indexes) != 1:
            raise ValueError(f"--central {central}: the centralized run must have exactly one site, "
                             f"found {len(central_search.indexes)} (run it with method=centralized)")
        only = next(iter(central_search.indexes.values()))
        assert isinstance(only, SiteIndex)  # exact=True opens every export as a SiteIndex
        cidx = only
        central_key = label_key(central_search)
    # the mode is chosen on purpose here, so a joint search over sites' own spaces is allowed
    fed_search = GlobalSearch.from_folder(fed, entity=entity, mode=mode, mappers_dir=mappers_dir, merge=merge,
                                          exact=True, force=True)
    acc = _Figures()
    rng = np.random.default_rng(seed)
    for home, index in fed_search.indexes.items():
        ids = [i for i in index.ids if cidx is None or i in cidx.position]
        if max_queries is not None:
            share = max(1, max_queries // len(fed_search.indexes))
            if share < len(ids):
                ids = [ids[i] for i in sorted(rng.choice(len(ids), share, replace=False))]
        if ids:
            _score_site(acc, fed_search, (cidx, central_key), home, ids, k, merge)
    if central is not None and not acc.labels:
        raise ValueError(f"{fed} and --central {central} share no document id; were they run on the same corpus?")
    result = acc.result(k, cidx is not None)
    result.update({"mode": mode, "merge": merge, "k": k})
    if write_summary:
        _write_summary(fed, result, mode, merge, k)
    return result


class _Figures:
    """What the queries of all sites add up to."""

    def __init__(self) -> None:
        self.labels: list[Hashable] = []
        self.fed_ids: list[list[str]] = []
        self.fed_labels: list[list[Hashable]] = []
        self.central_ids: list[list[str]] = []
        self.central_labels: list[list[Hashable]] = []
        self.remote_share: list[float] = []
        self.x_labels: list[Hashable] = []
        self.x_fed_ids: list[list[str]] = []
        self.x_fed_labels: list[list[Hashable]] = []
        self.x_central_ids: list[list[str]] = []

    def result(self, k: int, central: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            f"label_precision_at_{k}": label_precision_at_k(self.labels, self.fed_labels, k),
            "num_queries": len(self.labels),
            "remote_share_of_results": float(np.mean(self.remote_share)) if self.remote_share else float("nan")}
        if self.x_labels:
            out[f"cross_site_label_precision_at_{k}"] = label_precision_at_k(self.x_labels, self.x_fed_labels, k)
        if central:
            out[f"sim_{k}"] = mean_sim_k(self.central_ids, self.fed_ids, k)
            out[f"central_label_precision_at_{k}"] = label_precision_at_k(self.labels, self.central_labels, k)
            if self.x_central_ids:
                out[f"cross_site_sim_{k}"] = mean_sim_k(self.x_central_ids, self.x_fed_ids, k)
        return out


def _ids(rows: list[list[Hit]]) -> list[list[str]]:
    return [[h.id for h in r] for r in rows]


LabelKey = Callable[[str, int], Hashable]


def label_key(search: GlobalSearch) -> LabelKey:
    """What a label is compared by: its name in the site's export where that names it, else its number
    (None for unlabelled). Each site numbers its own labels from 0, so numbers of two sites that both
    name their labels never meet (issue 40: DAMe sites with no shared event scored 0.12)."""
    def key(site: str, label: int) -> Hashable:
        if label < 0:
            return None
        if not search.names.get(site):
            return label  # the export names no label: numbers are all there is
        named = search.label_name(site, label)
        return named if named is not None else f"site{site}:{label}"  # a number past the names: this site's
    return key


def _labels(rows: list[list[Hit]], key: LabelKey) -> list[list[Hashable]]:
    return [[key(h.site, h.label) for h in r] for r in rows]


def _score_site(acc: _Figures, search: GlobalSearch, central: tuple[SiteIndex | None, LabelKey | None],
                home: str, ids: list[str], k: int, merge: str) -> None:
    """Add the queries `ids` of site `home`: the merged search, and the other sites' answers alone."""
    index = search.indexes[home]
    assert isinstance(index, SiteIndex)  # `score` opens the exports with exact=True
    key = label_key(search)
    cidx, central_key = central
    qf = np.stack([index.vector_of(i) for i in ids])
    fed_hits = search.search(home, qf, k, ids)
    labels = [key(home, int(index.labels[index.position[i]])) for i in ids]
    acc.labels += labels
    acc.fed_ids += _ids(fed_hits)
    acc.fed_labels += _labels(fed_hits, key)
    acc.remote_share += [sum(h.site != home for h in r) / max(len(r), 1) for r in fed_hits]
    if cidx is not None and central_key is not None:
        c_hits = cidx.hits(np.stack([cidx.vector_of(i) for i in ids]), k, ids)
        acc.central_ids += _ids(c_hits)
        acc.central_labels += _labels(c_hits, central_key)
    others = [s for s in search.indexes if s != home]
    if not others:
        return
    # Cross-site view: the merged figures mix in the home site's own answers (its own space, no
    # mapping needed); this isolates what joint learning / a mapper contributes.
    per_site = [search.indexes[s].hits(map_query(search.mode, home, s, qf, search.mappers), k,
                                       standardize=merge in STANDARDIZED_MERGES) for s in others]
    remote = [merge_results([lists[n] for lists in per_site], k, merge, home) for n in range(len(ids))]
    acc.x_labels += labels
    acc.x_fed_ids += _ids(remote)
    acc.x_fed_labels += _labels(remote, key)
    if cidx is not None:
        other_ids = [i for s in others for i in search.indexes[s].ids if i in cidx.position]
        c_other = SiteIndex("central", other_ids, np.stack([cidx.vector_of(i) for i in other_ids]),
                            np.array([cidx.labels[cidx.position[i]] for i in other_ids]))
        acc.x_central_ids += _ids(c_other.hits(np.stack([cidx.vector_of(i) for i in ids]), k))


def _write_summary(fed: Path, result: dict[str, Any], mode: str, merge: str, k: int) -> None:
    path = fed / "summary.json"
    summary = json.loads(path.read_text()) if path.is_file() else {}
    if not isinstance(summary, dict):
        raise ValueError(f"{path}: expected a JSON object; move it away to write the figures")
    name = mode if merge == "score" else f"{mode}_{merge}"
    key = "" if name == "joint" else f"_{name}"
    for figure in (f"sim_{k}", f"label_precision_at_{k}"):
        if figure in result:
            summary[f"{figure}{key}"] = result[figure]
    summary.setdefault("sim_k", {})[name] = result
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2, default=str))
    tmp.replace(path)  # a reader never sees half a summary
