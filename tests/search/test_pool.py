"""The sites' thread pool: results in order, the first failure in order raised, batches split in spans."""

from __future__ import annotations

import threading

import pytest

from hpcfed.search import pool


def test_map_ordered_keeps_the_order_and_raises_the_first_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool, "workers", lambda: 4)
    names: set[str] = set()

    def square(x: int) -> int:
        names.add(threading.current_thread().name)
        return x * x

    assert pool.map_ordered(square, list(range(20))) == [x * x for x in range(20)]
    assert any(n.startswith("hpcfed-site") for n in names)  # run in the pool, not the caller

    def fail(x: int) -> int:
        if x in (3, 5):
            raise ValueError(f"site {x}")
        return x

    with pytest.raises(ValueError, match="site 3"):
        pool.map_ordered(fail, list(range(8)))


@pytest.mark.parametrize(("rows", "sites", "cores", "spans"), [
    (1, 4, 2, [(0, 1)]),  # one query: one task per site
    (1000, 4, 2, [(0, 1000)]),  # fewer cores than sites: the sites are the parallelism
    (1000, 4, 16, [(0, 250), (250, 500), (500, 750), (750, 1000)]),  # more: each site's batch in spans
    (100, 2, 16, [(0, 100)]),  # no span shorter than MIN_SPAN_ROWS
    (0, 3, 8, [(0, 0)]),
])
def test_row_spans(monkeypatch: pytest.MonkeyPatch, rows: int, sites: int, cores: int,
                   spans: list[tuple[int, int]]) -> None:
    monkeypatch.setattr(pool, "workers", lambda: cores)
    assert pool.row_spans(rows, sites) == spans
