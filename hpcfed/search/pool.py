"""The sites side by side: one thread pool that loads the sites' indexes and searches them.

FAISS and numpy release the GIL while they work, so sites loaded or searched in threads use as many
cores as there are. Each worker runs FAISS with one OpenMP thread: the parallelism is the pool's (a
batch is split into row spans when there are more cores than sites), and an OpenMP team per
millisecond-long search waits a scheduler slice for every helper thread on a busy machine (see
`hpcfed.search.service.Handler.setup`). Tasks must not submit to the pool themselves.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")
MAX_WORKERS = 32
MIN_SPAN_ROWS = 64  # a batch is split no finer: a FAISS call per few queries costs more than it saves

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def workers() -> int:
    """Threads in the pool: one per core, at most `MAX_WORKERS`."""
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))


def _one_omp_thread() -> None:
    import faiss

    faiss.omp_set_num_threads(1)


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(workers(), thread_name_prefix="hpcfed-site", initializer=_one_omp_thread)
        return _pool


def map_ordered(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """`fn` over `items` in the pool, results in the items' order; a failure raises the first failing
    item's exception (in that order), as a plain loop would."""
    if len(items) <= 1 or workers() == 1:
        return [fn(item) for item in items]
    return list(_executor().map(fn, items))


def in_turn(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """`fn` over `items` on the calling thread, in order: `map_ordered` for work too small to hand over."""
    return [fn(item) for item in items]


def row_spans(rows: int, sites: int) -> list[tuple[int, int]]:
    """Spans of a batch's rows to search as separate tasks per site: enough to keep every core busy
    when there are more cores than sites, none shorter than `MIN_SPAN_ROWS`."""
    parts = max(1, min(workers() // max(1, sites), rows // MIN_SPAN_ROWS))
    step = max(1, math.ceil(rows / parts))
    return [(lo, min(rows, lo + step)) for lo in range(0, rows, step)] or [(0, 0)]
