"""The event table's sort and unique helpers give numpy's own results (they only take cheaper roads)."""

import numpy as np
import pytest

from advisor.analysis.breakdown import _sweep, union_ns
from advisor.trace.table import grouped_lexsort, kind_mask, make_table, unique_first, unique_inverse


def test_grouped_lexsort_orders_by_group_then_start():
    start = np.array([5, 1, 1, 3])
    stream = np.array([2, 1, 2, 1])
    rank = np.zeros(4, dtype=np.int32)
    # stream 1: rows 1 (t=1), 3 (t=3); stream 2: rows 2 (t=1), 0 (t=5)
    assert grouped_lexsort((start, stream, rank)).tolist() == [1, 3, 2, 0]
    # Two minor keys: at one time, the lower step first (departures before arrivals).
    step = np.array([1, -1, 1, -1])
    time = np.array([4, 4, 2, 2])
    assert grouped_lexsort((step, time, np.zeros(4, dtype=np.int64)), n_minor=2).tolist() == [3, 2, 1, 0]


@pytest.mark.parametrize("presorted", [True, False])
def test_grouped_lexsort_equals_lexsort(presorted):
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(0, 80))
        start = rng.integers(0, 15, n)  # many ties: lexsort keeps them in position order
        start = np.sort(start) if presorted else start
        stream, device = rng.integers(-1, 6, n), rng.integers(0, 3, n)
        rank, step = rng.integers(0, 4, n).astype(np.int32), rng.choice([-1, 1], n)
        for keys, n_minor in (
            ((start, stream, rank), 1),
            ((start, stream, device, rank), 1),
            ((step, start, stream, rank), 2),
            ((start.astype(np.float64), rank), 1),
        ):
            assert grouped_lexsort(keys, n_minor).tolist() == np.lexsort(keys).tolist()
    wide = (np.arange(6), np.array([0, 2**20, 5, 2**20, 0, 7]))  # a group range over 16 bits: lexsort itself
    assert grouped_lexsort(wide).tolist() == [0, 4, 2, 5, 1, 3]


def test_unique_inverse_and_first():
    values = np.array([7, -1, 7, 3])
    distinct, inverse = unique_inverse(values)
    assert distinct.tolist() == [-1, 3, 7] and inverse.tolist() == [2, 0, 2, 1]
    distinct, first = unique_first(values)
    assert distinct.tolist() == [-1, 3, 7] and first.tolist() == [1, 3, 0]
    few = np.array([7, -1, 7, 3, 7, 7, -1, 7])  # 3 distinct of 8: the hash table's road
    assert [a.tolist() for a in unique_inverse(few)] == [[-1, 3, 7], [2, 0, 2, 1, 2, 2, 0, 2]]
    assert [a.tolist() for a in unique_first(few)] == [[-1, 3, 7], [1, 3, 0]]
    rng = np.random.default_rng(1)
    for _ in range(100):
        x = rng.integers(-3, 30, int(rng.integers(0, 60)))
        for ours, theirs in ((unique_inverse(x), np.unique(x, return_inverse=True)),
                             (unique_first(x), np.unique(x, return_index=True))):  # fmt: skip
            assert [a.tolist() for a in ours] == [a.tolist() for a in theirs]
    floats = np.array([2.5, np.nan, 2.5])  # not integers: numpy's own unique
    assert unique_inverse(floats)[1].tolist() == np.unique(floats, return_inverse=True)[1].tolist()


def test_union_and_sweep():
    starts, ends = np.array([0, 5, 20, 25]), np.array([10, 15, 25, 25])
    assert union_ns(starts, ends) == 20  # [0, 15) and [20, 25); the empty [25, 25) adds nothing
    assert union_ns(np.array([], dtype=np.int64), np.array([], dtype=np.int64)) == 0
    # Types 0 and 1: 0 alone [0, 5), both [5, 10), 1 alone [10, 15).
    assert _sweep(starts[:2], ends[:2], np.array([0, 1])).tolist() == [0, 5, 5, 5, 0, 0, 0, 0]
    rng = np.random.default_rng(2)
    for _ in range(200):
        n = int(rng.integers(0, 40))
        s = rng.integers(0, 100, n)
        e = s + rng.integers(-5 if n % 3 == 0 else 0, 30, n)  # some reversed intervals: the sweep decides
        assert union_ns(s, e) == (int(_sweep(s, e, np.zeros(n, dtype=np.int64), 1)[1]) if n else 0)


def test_kind_mask_of_all_rows_or_of_some():
    kinds = ["kernel", "annotation", "runtime", "annotation", "memcpy"]
    table = make_table({"rank": 0, "kind": kinds, "name": "x", "start_ns": np.arange(5), "dur_ns": 1})
    plain = table.assign(kind=table["kind"].astype(object))  # a table whose kinds are plain strings
    rows = np.array([4, 1, 3, 0])
    for df in (table, plain):
        assert kind_mask(df, "annotation", "memcpy").tolist() == [False, True, False, True, True]
        assert kind_mask(df, "annotation", rows=rows).tolist() == [False, True, True, False]  # in rows' order
        assert kind_mask(df, "sync", rows=rows).tolist() == [False] * 4  # a kind the table lacks
        assert kind_mask(df, "kernel", rows=rows[:0]).tolist() == []
