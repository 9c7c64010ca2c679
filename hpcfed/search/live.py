"""Live cross-site search over MPI: every site rank serves only its own export.

    mpiexec -n K+1 python -m hpcfed search live RUN [--id ID | --text TEXT --home S] ...

Rank 0 is the front end; rank r (1..K) serves site r−1 (``site<r−1>.h5``, its model and its own
mappers m_{r−1→j}). Every message travels over `hpcfed.comm.channel.SecureChannel` (pre-shared key
from ``$HPCFED_PSK`` by default, or the ``security:`` section of ``--config``). One query:

  1. rank 0 -> every site   VECTORIZE {id | text, home}
     the home site (the one holding the id, or the named home for a text) computes v_q and, per
     site j, the vector j will search with (v_q, or mapper_{q→j}(v_q) in mapping mode) and answers
     with them; the other sites answer "not mine"
  2. rank 0 -> every site j SEARCH {vector for j, k, exclude id} ; site j answers its top-k
  3. rank 0 merges by score (spec §4.4; ``--merge interleave`` rank by rank, ``--merge zscore`` by
     the z-scores the sites computed over their own documents) and prints
     JSON; then STOP to every site.

Raw documents and the other sites' vectors never leave a site; only query vectors and hits move.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from hpcfed.search.ann import open_site
from hpcfed.search.index import STANDARDIZED_MERGES, Hit, merge_results
from hpcfed.store.vectors import read_header

VECTORIZE, VECTORS, SEARCH, HITS, STOP = 40, 41, 42, 43, 44
log = logging.getLogger("hpcfed.search")


def open_channel(security: Any, timeout: float) -> Any:
    """Secure channel on MPI_COMM_WORLD: the job's star (see `hpcfed.comm.star`), rank 0 the front end."""
    from mpi4py import MPI

    from hpcfed.comm.star import draw_job_id, open_star
    from hpcfed.comm.transport import MPITransport
    from hpcfed.credentials import RankKeys

    transport = MPITransport(MPI.COMM_WORLD)
    job_id = draw_job_id(transport, b"search:" + os.environ.get("SLURM_JOB_ID", "").encode() + b":")
    return open_star(transport, RankKeys(security, transport.rank).credentials(), job_id, timeout=timeout,
                     log=logging.getLogger("hpcfed.comm").warning)


class SiteServer:
    """What one site rank does: vectorise queries it is home for, and search its own export."""

    def __init__(self, site: str, export: Path, *, entity: str | None, mode: str, models_dir: Path | None,
                 mappers_dir: Path | None, sites: list[str], exact: bool = False, nprobe: int | None = None,
                 ef_search: int | None = None) -> None:
        from hpcfed.search.global_search import label_names, shared_space

        self.site = site
        # the site's index when one is beside its export (`hpcfed search index`), else exact search
        self.index = open_site(export, entity, site, exact=exact, nprobe=nprobe, ef_search=ef_search)
        attrs = read_header(export, entity).attrs
        self.names = label_names(attrs)  # sent with the hits: the front end has no export to read them from
        self.own_space = shared_space(attrs) is False
        self.model = str(attrs.get("model", "?"))
        self.mode = mode
        self.models_dir = models_dir
        self.mappers_dir = mappers_dir
        self.sites = sites
        self._model: Any = None
        self._mappers: dict[str, Any] = {}

    def vectorize(self, header: dict) -> tuple[dict, dict[str, np.ndarray]]:
        doc_id, text, home = header.get("id"), header.get("text"), header.get("home")
        if doc_id is not None:
            if str(doc_id) not in self.index.position:
                return self._space({"mine": False}), {}
            v = self.index.vector_of(str(doc_id))
        elif text is not None and str(home) == self.site:
            v = self._infer(str(text))
        else:
            return self._space({"mine": False}), {}
        from hpcfed.search.global_search import map_query

        vectors = {}
        for j in self.sites:
            mapper = self._mapper(j) if self.mode == "mapping" and j != self.site else None
            mappers = {(self.site, j): mapper} if mapper else None
            vectors[f"site{j}"] = map_query(self.mode, self.site, j, v[None], mappers)[0]
        return self._space({"mine": True, "home": self.site}), vectors

    def _space(self, header: dict) -> dict:
        """A VECTORS answer says whether this site's space is its own (for the front end's joint refusal)."""
        return {**header, "own_space": self.own_space, "model": self.model}

    def search(self, header: dict, tensors: dict[str, np.ndarray]) -> dict:
        q = tensors.get("query")
        if q is None or q.ndim != 1:
            return {"error": f"site {self.site}: SEARCH without a 1-D 'query' vector"}
        k = int(header.get("k", 10))
        exclude = header.get("exclude")
        hits = self.index.hits(q[None].astype(np.float32), k, [exclude] if exclude else None,
                               standardize=bool(header.get("standardize", False)))[0]
        return {"hits": [[h.id, h.score, h.label, self._name(h.label)] for h in hits]}

    def _name(self, label: int) -> str:
        return self.names[label] if 0 <= label < len(self.names) else ""

    def _infer(self, text: str) -> np.ndarray:
        from hpcfed.data.corpus import tokenize
        from hpcfed.models.doc2vec import infer, load_model

        if self._model is None:
            if self.models_dir is None:
                raise ValueError("a text query needs the sites' models (--models DIR, default RUN/models)")
            self._model = load_model(self.models_dir / f"site{self.site}.h5")
        model, settings = self._model
        return infer(model, tokenize(text), settings)

    def _mapper(self, dst: str) -> Any:
        from hpcfed.models.mapper import load_mapper, mapper_path

        if dst not in self._mappers:
            if self.mappers_dir is None:
                raise ValueError("mode=mapping needs --mappers DIR (default RUN/mappers)")
            self._mappers[dst] = load_mapper(mapper_path(self.mappers_dir, self.site, dst))
        return self._mappers[dst]

    def serve(self, channel: Any, timeout: float) -> None:
        while True:
            msg = channel.recv(source=0, kinds={VECTORIZE, SEARCH, STOP}, timeout=timeout)
            if msg is None:
                raise TimeoutError(f"site {self.site}: the front end (rank 0) sent nothing for {timeout:g} s")
            if msg.kind == STOP:
                return
            try:
                if msg.kind == VECTORIZE:
                    header, tensors = self.vectorize(msg.header)
                    channel.send(0, VECTORS, header, tensors)
                else:
                    channel.send(0, HITS, self.search(msg.header, msg.tensors))
            except ValueError as exc:  # a user error at this site: report it, keep serving
                channel.send(0, VECTORS if msg.kind == VECTORIZE else HITS, {"error": f"site {self.site}: {exc}"})


def front_end(channel: Any, queries: list[dict], *, k: int, mode: str, timeout: float,
              merge: str = "score", force: bool = False) -> list[dict]:
    """Rank 0: run each query through the sites and merge their answers (``--mode joint`` over a site
    whose space is its own is refused, as `GlobalSearch.from_folder` refuses it, unless `force`)."""
    from hpcfed.search.global_search import joint_refusal

    sites = [str(r - 1) for r in range(1, channel.size)]
    out = []
    for query in queries:
        for r in range(1, channel.size):
            channel.send(r, VECTORIZE, query)
        vectors, home, own = None, None, []
        for _ in sites:
            msg = _recv(channel, VECTORS, timeout)
            if "error" in msg.header:
                raise ValueError(msg.header["error"])
            if msg.header.get("own_space") is True:
                own.append((msg.source - 1, str(msg.header.get("model", "?"))[:100]))
            if msg.header.get("mine") and (home is None or int(msg.header["home"]) < int(home)):
                vectors, home = msg.tensors, str(msg.header["home"])
        if mode == "joint" and own and len(sites) > 1 and not force:
            site, model = min(own)
            raise ValueError(joint_refusal(str(site), model))
        if vectors is None:
            what = f"id {query['id']!r}" if query.get("id") is not None else f"home site {query.get('home')!r}"
            raise ValueError(f"no site holds {what}; sites are {', '.join(sites)}")
        exclude = str(query["id"]) if query.get("id") is not None else None
        for r, j in zip(range(1, channel.size), sites):
            channel.send(r, SEARCH, {"k": k, "exclude": exclude, "standardize": merge in STANDARDIZED_MERGES},
                         {"query": np.asarray(vectors[f"site{j}"], np.float32)})
        per_site, names = [], {}
        for _ in sites:
            msg = _recv(channel, HITS, timeout)
            if "error" in msg.header:
                raise ValueError(msg.header["error"])
            site = str(msg.source - 1)
            found = site_hits(site, msg.header.get("hits"), k)
            names.update({(h.site, h.label): name for h, name in found if name})
            per_site.append([h for h, _ in found])
        merged = merge_results(per_site, k, merge, home)
        out.append({"query": query, "home": home, "mode": mode, "merge": merge,
                    "results": [_shown(h, names.get((h.site, h.label))) for h in merged]})
    return out


def site_hits(site: str, raw: object, k: int) -> list[tuple[Hit, str]]:
    """A site's HITS answer, checked: at most k entries of [id, score, label, label name]."""
    if not isinstance(raw, list) or len(raw) > k:
        raise ValueError(f"site {site} answered with a malformed hit list")
    out = []
    for entry in raw:
        if not (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str)
                and isinstance(entry[1], (int, float)) and isinstance(entry[2], int) and isinstance(entry[3], str)):
            raise ValueError(f"site {site} answered with a malformed hit")
        out.append((Hit(site, entry[0][:1000], float(entry[1]), int(entry[2])), entry[3][:1000]))
    return out


def _shown(hit: Hit, name: str | None) -> dict:
    out: dict[str, Any] = hit.as_dict()
    if name:
        out["label_name"] = name
    return out


def _recv(channel: Any, kind: int, timeout: float) -> Any:
    msg = channel.recv(kinds={kind}, timeout=timeout)
    if msg is None:
        raise TimeoutError(f"no answer from the site ranks within {timeout:g} s")
    return msg


def run_live(args: Any) -> int:
    """Body of every rank of ``hpcfed search live``; any failure aborts the whole job."""
    from mpi4py import MPI

    from hpcfed.config import SecurityConfig, load
    from hpcfed.schema import build
    from hpcfed.search.global_search import site_exports

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    logging.basicConfig(level=logging.WARNING, format=f"[hpcfed search r{rank}] %(levelname)s %(message)s")
    channel = None
    try:
        if size < 2:
            raise ValueError("live search needs at least 2 ranks (a front end and one site): mpiexec -n K+1")
        security = load(args.config).security if args.config else build(SecurityConfig, {})
        run = Path(args.exports)
        channel = open_channel(security, args.timeout)
        if rank == 0:
            queries = [{"id": i} for i in args.id] + [{"text": t, "home": str(args.home)} for t in args.text]
            results = front_end(channel, queries, k=args.k, mode=args.mode, timeout=args.timeout, merge=args.merge,
                                force=args.force)
            for r in range(1, size):
                channel.send(r, STOP, {})
            print(json.dumps({"queries": results, "sites": size - 1}, indent=None if args.compact else 2), flush=True)
        else:
            site = str(rank - 1)
            exports = site_exports(run)
            if site not in exports:
                raise ValueError(f"rank {rank} serves site {site} but {run} has no site{site}.h5 "
                                 f"(start as many site ranks as there are exports)")
            base = run if (run / "embeddings").is_dir() else run.parent
            SiteServer(site, exports[site], entity=args.entity, mode=args.mode,
                       models_dir=Path(args.models) if args.models else base / "models",
                       mappers_dir=Path(args.mappers) if args.mappers else base / "mappers",
                       sites=[str(s) for s in range(size - 1)], exact=args.exact, nprobe=args.nprobe,
                       ef_search=args.ef_search).serve(channel, args.timeout)
        channel.close()
        return 0
    except BaseException as exc:
        text = str(exc) if isinstance(exc, (ValueError, TimeoutError)) else traceback.format_exc()
        print(f"hpcfed search: rank {rank} failed: {text}", file=sys.stderr, flush=True)
        if rank == 0 and channel is not None and isinstance(exc, ValueError) and _stop_sites(channel, size):
            return 2  # a bad query: the sites are told to stop, so the message is not lost to MPI_Abort
        comm.Abort(2 if isinstance(exc, ValueError) else 1)
    return 1


def _stop_sites(channel: Any, size: int) -> bool:
    """Tell every site rank to stop and close the channel; False if that failed (then abort)."""
    try:
        for r in range(1, size):
            channel.send(r, STOP, {})
        channel.close()
    except Exception:
        return False
    return True
