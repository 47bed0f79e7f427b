"""Self time of host ops (breakdown._self_ns): the parents found by pointer jumping equal those of the
stack walk, on hand-made nestings, random overlaps and real traces."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from advisor.analysis import breakdown as A
from advisor.trace.table import kind_mask

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces" / "kineto"


def _both(tid, start, dur):
    tid, start, dur = (np.asarray(v, dtype=np.int64) for v in (tid, start, dur))
    order = np.lexsort((-dur, start, tid))
    return A._parents(tid, start, dur, order), A._parents_walk(tid, start, dur, order)


def test_self_time_of_a_nested_call_by_hand():
    # Thread 1: step [0, 100) holds fwd [10, 60) (which holds mm [20, 30) and add [30, 35)) and
    # bwd [60, 90); thread 2: one op [0, 40) alone.
    tid = [1, 1, 1, 1, 1, 2]
    start = [0, 10, 20, 30, 60, 0]
    dur = [100, 50, 10, 5, 30, 40]
    self_ns = A._self_ns(*(np.array(v, dtype=np.int64) for v in (tid, start, dur)))
    # step 100 - 50 - 30; fwd 50 - 10 - 5; mm, add, bwd and the other thread's op have no children.
    assert self_ns.tolist() == [20, 35, 10, 5, 30, 40]


def test_parents_of_overlaps_that_do_not_nest_are_the_stacks():
    # B starts inside A and ends after it: the stack keeps B on top, so C (inside A's time no more,
    # inside B's) is B's; D starts after B and C end but inside nothing: no parent.
    tid = [0, 0, 0, 0]
    start = [0, 5, 12, 20]
    dur = [10, 10, 2, 3]
    fast, walk = _both(tid, start, dur)
    assert fast.tolist() == walk.tolist() == [-1, 0, 1, -1]
    # A popped child before a later sibling: C's parent is A, not B.
    fast, walk = _both([0, 0, 0], [0, 2, 6], [10, 2, 14])
    assert fast.tolist() == walk.tolist() == [-1, 0, 0]
    assert A._self_ns(np.zeros(3, np.int64), np.array([0, 2, 6]), np.array([10, 2, 14])).tolist() == [0, 2, 14]


@pytest.mark.parametrize("seed", range(4))
def test_parents_equal_the_walk_on_random_overlaps(seed):
    rng = np.random.default_rng(seed)
    for _ in range(500):
        n = int(rng.integers(0, 80))
        tid, start, dur = rng.integers(0, 3, n), rng.integers(0, 60, n), rng.integers(0, 30, n)
        fast, walk = _both(tid, start, dur)
        assert fast.tolist() == walk.tolist()


def test_a_stack_deeper_than_the_rounds_falls_back_to_the_walk(monkeypatch):
    # 40 ops each inside the one before (the first [0, 2000), op k [k, 500 - k)), then one op at
    # 1000, inside the first only: its guess climbs the 40-deep stack one op a round.
    depth = 40
    start = np.r_[np.arange(depth), 1000]
    dur = np.r_[2000, 500 - 2 * np.arange(1, depth), 5]
    tid = np.zeros(depth + 1, dtype=np.int64)
    order = np.lexsort((-dur, start, tid))
    walked = []
    real_walk = A._parents_walk
    monkeypatch.setattr(A, "_parents_walk", lambda *a: walked.append(1) or real_walk(*a))
    expected = np.r_[-1, np.arange(depth - 1), 0]
    assert A._parents(tid, start, dur, order).tolist() == expected.tolist()
    assert not walked  # 256 rounds were enough
    monkeypatch.setattr(A, "PARENT_ROUNDS", 8)
    assert A._parents(tid, start, dur, order).tolist() == expected.tolist()
    assert walked == [1]


@pytest.mark.skipif(not TRACES.is_dir(), reason="../shared/traces/kineto is absent (the shared real traces)")
def test_parents_equal_the_walk_on_real_traces():
    from advisor.analysis.summary import load_trace

    checked = 0
    for trace in sorted(TRACES.iterdir())[:6]:
        try:
            df = load_trace(trace)
        except Exception:  # a folder this loader refuses is another test's business
            continue
        rows = np.flatnonzero(kind_mask(df, "cpu_op"))
        tid, start, dur = (df[c].to_numpy()[rows] for c in ("tid", "start_ns", "dur_ns"))
        order = np.lexsort((-dur, start, tid))
        fast, walk = A._parents(tid, start, dur, order), A._parents_walk(tid, start, dur, order)
        assert np.array_equal(fast, walk), trace.name
        checked += int(rows.size > 0)
    assert checked >= 2
