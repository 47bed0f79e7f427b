"""Launch queues, idle intervals and copy bandwidth over time: HolisticTraceAnalysis' trace counters
(``hta/analyzers/trace_counters.py``: queue length, time blocked on a full queue, memory bandwidth) and
its idle-interval statistics (``get_idle_time_breakdown(show_idle_interval_stats=True)``).

Each series is one row per event that changes it, in time order per rank and stream (or copy kind),
as HTA gives them: a row's value holds from its time until the next row's. Where several events share
one time, all of them are rows and the last one holds; those that end something come first (an
operation completes, a copy ends), so work that ends as other work begins never counts as concurrent.
The summaries are pandas' ``describe`` over those rows, as HTA's are: one value per event, not
weighted by time (the queue summary adds the time-weighted mean beside them).

Where we differ from HTA, and why (``bench/results/hta_series.md`` measures each on the shared traces):

- A launch is the runtime call with the GPU event's correlation id, whatever its name: HTA takes only
  the calls it lists (``cudaLaunchKernel``, ``cudaMemcpyAsync``...), so it misses nsys' versioned names,
  ``cuLaunchKernelEx`` and synchronous ``cudaMemcpy``. A GPU event whose call is outside the trace, or
  a call whose GPU event is, is left out: when it joined its queue is unknown (HTA drops them too).
- Queue length counts launched operations not yet finished by default (``dequeue="end"``); HTA counts
  those not yet started (``dequeue="start"``), which reads one less while an operation runs.
- Copy bandwidth is bytes over the copy's duration in the table (bytes/ns = GB/s). HTA reads Kineto's
  ``memory bandwidth (GB/s)`` argument, the same ratio over CUPTI's nanosecond duration, so the two
  agree on nanosecond traces and differ on microsecond-rounded ones by that rounding. A copy without a
  byte count or with no measured duration has no known bandwidth: it is counted
  (``unknown_count``), never a 0 GB/s point (HTA stretches a 0 us copy to 1 us).
- HTA's cumulative float sum leaves residues such as 1.1e-16 GB/s where all copies have ended, which
  its summary counts as points; ours is exactly 0 there (a sum restarted whenever no copy is active).
- The order of events at one time follows the rule above; HTA's unstable sort orders them by chance
  (differently on different machines), which moves its statistics on traces where its microsecond
  rounding makes many events share a time.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pandas as pd

from advisor.analysis.breakdown import (
    _NO_CALLS,
    CONSECUTIVE_KERNEL_DELAY_NS,
    IDLE_CATEGORIES,
    IdleGaps,
    LaunchCalls,
    idle_gaps,
    kernel_spans,
    launch_calls,
)
from advisor.errors import TraceError
from advisor.trace.table import GPU_KINDS, grouped_lexsort, kind_mask, unique_inverse

MAX_QUEUE_LENGTH = 1024  # CUDA's launch queue depth that HTA assumes (trace_analysis.py default)
DEQUEUES = ("end", "start")
BW_KINDS = ("HtoD", "DtoH", "DtoD", "HtoH", "PtoP", "memset", "unknown")
"""Copy kinds of the bandwidth series: the table's memcpy directions, memsets, and copies of no known
direction."""
_STATS = ("mean", "std", "min", "p25", "p50", "p75", "max")

QUEUE_SERIES_COLUMNS = ["rank", "stream", "time_ns", "queue_length"]
QUEUE_SUMMARY_COLUMNS = [
    "rank",
    "stream",
    "change_count",
    *(f"{s}_ops" for s in _STATS),
    "time_mean_ops",
]
BLOCKED_COLUMNS = ["rank", "stream", "limit_ops", "peak_ops", "blocked_ns", "kernel_span_ns", "blocked_pct"]
IDLE_STATS_COLUMNS = ["rank", "stream", "idle_category", "interval_count", *(f"{s}_ns" for s in _STATS)]
BW_SERIES_COLUMNS = ["rank", "copy_kind", "time_ns", "bandwidth_gbps", "active_count"]
BW_SUMMARY_COLUMNS = [
    "rank",
    "copy_kind",
    "copy_count",
    "unknown_count",
    "point_count",
    *(f"{s}_gbps" for s in _STATS),
]


def _require(df: pd.DataFrame, *columns: str) -> None:
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise TraceError(f"the event table lacks column(s) {', '.join(missing)} (advisor/trace/table.py)")


def _first_of_group(*keys: np.ndarray) -> np.ndarray:
    """Whether each row of arrays sorted by ``keys`` starts a new group (a new combination of keys)."""
    n = keys[0].size if keys else 0
    first = np.zeros(n, dtype=bool)
    first[:1] = True
    for k in keys:
        first[1:] |= k[1:] != k[:-1]
    return first


def _describe(group: np.ndarray, values: np.ndarray, n_groups: int) -> dict[str, np.ndarray]:
    """pandas' ``describe`` of ``values`` per group (``group``: 0 .. n_groups-1): count, mean, std
    (ddof 1), min, 25th/50th/75th percentiles (linear interpolation) and max; NaN for a group without
    values, and std NaN for one value."""
    count = np.bincount(group, minlength=n_groups)
    out: dict[str, np.ndarray] = {"count": count}
    v = values.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        mean = np.bincount(group, weights=v, minlength=n_groups) / count
        dev = np.bincount(group, weights=(v - mean[group]) ** 2, minlength=n_groups)
        out["mean"] = mean
        out["std"] = np.where(count > 1, np.sqrt(dev / (count - 1)), np.nan)
    sorted_at = _sorted_values(group, values, n_groups)
    first = np.cumsum(count) - count
    has = count > 0
    for name, q in (("min", 0.0), ("p25", 0.25), ("p50", 0.5), ("p75", 0.75), ("max", 1.0)):
        pos = first + (count - 1) * q
        lo = np.floor(pos).astype(np.int64)
        hi = np.minimum(lo + 1, first + count - 1)
        at = np.full(n_groups, np.nan)
        if has.any():
            a, b = sorted_at(lo[has]), sorted_at(hi[has])
            at[has] = a + (b - a) * (pos[has] - lo[has])
        out[name] = at
    return out


COUNTING_BINS = 1 << 22  # the most (group, value) bins _sorted_values counts in: 32 MiB of counts


def _sorted_values(group: np.ndarray, values: np.ndarray, n_groups: int) -> Callable[[np.ndarray], np.ndarray]:
    """A function giving, for positions into ``values`` sorted by group then value, the values there (as
    float64). Integers of a small range (queue lengths: 0 to about 1024) are counted per group and each
    position found in the running count, in one pass; others are sorted (at 3.7 GB, the 15.4 M rows of
    the queue series took 1.5 s to sort)."""
    if values.dtype.kind in "iu" and values.size:
        low = int(values.min())
        width = int(values.max()) - low + 1
        if width * n_groups <= COUNTING_BINS:
            running = np.bincount(group * width + (values - low), minlength=n_groups * width).cumsum()
            # The value at sorted position i is in the first (group, value) bin whose running count
            # passes i.
            return lambda at: (np.searchsorted(running, at, side="right") % width + low).astype(np.float64)
    v = values.astype(np.float64)
    v = v[grouped_lexsort((v, group))]
    return lambda at: v[at]


def _launch_starts(
    rank: np.ndarray, corr: np.ndarray, launches: dict[int, LaunchCalls]
) -> tuple[np.ndarray, np.ndarray]:
    """(whether each GPU event has a launching call in the trace, that call's start in ns)."""
    found = np.zeros(rank.size, dtype=bool)
    start = np.zeros(rank.size, dtype=np.int64)
    order = np.argsort(rank, kind="stable")
    bounds = np.flatnonzero(rank[order][1:] != rank[order][:-1]) + 1
    for a, b in itertools.pairwise([0, *bounds.tolist(), rank.size] if rank.size else []):
        rows = order[a:b]
        calls = launches.get(int(rank[rows[0]]), _NO_CALLS)
        ok, pos = calls.find(corr[rows])
        found[rows] = ok
        start[rows[ok]] = calls.start_ns[pos[ok]]
    return found, start


def _pair_codes(rank: np.ndarray, stream: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct (rank, stream) pairs in order, as int64 rows; each row's index into them, int32)."""
    if rank.size == 0:
        return np.zeros((0, 2), dtype=np.int64), np.zeros(0, dtype=np.int32)
    rank, stream = rank.astype(np.int64, copy=False), stream.astype(np.int64, copy=False)
    r0, s0 = int(rank.min()), int(stream.min())
    width = int(stream.max()) - s0 + 1
    if (int(rank.max()) - r0 + 1) * width < 2**62:  # one int64 key per pair, in (rank, stream) order
        keys, code = unique_inverse((rank - r0) * width + (stream - s0))
        distinct = np.stack([keys // width + r0, keys % width + s0], axis=1)
    else:
        distinct, code = np.unique(np.stack([rank, stream], axis=1), axis=0, return_inverse=True)
    return distinct, code.reshape(-1).astype(np.int32)


def queue_length_series(
    df: pd.DataFrame, *, dequeue: str = "end", launches: dict[int, LaunchCalls] | None = None
) -> pd.DataFrame:
    """Per rank and CUDA stream, the number of GPU operations (kernels, copies, sets) launched and not
    yet finished, as change points: ``rank``, ``stream``, ``time_ns``, ``queue_length`` (operations, from
    this row's time on). An operation joins its stream's queue when the runtime call with its correlation
    id starts and leaves it when it ends (``dequeue="end"``) or, as HTA counts, when it starts
    (``dequeue="start"``). Two rows per operation, ordered by rank, stream and time; at one time,
    departures before arrivals. ``launches`` takes launch_calls(df) already computed."""
    if dequeue not in DEQUEUES:
        raise ValueError(f"dequeue={dequeue!r}: allowed {', '.join(DEQUEUES)}")
    _require(df, "rank", "kind", "stream", "start_ns", "dur_ns", "correlation")
    launches = launch_calls(df) if launches is None else launches
    # Each column gathered once, for the operations with a launch only, and rank and stream as one small
    # code: on a 3.7 GB export (8 M operations) the series is the analysis' largest array.
    rows = np.flatnonzero(kind_mask(df, *GPU_KINDS))
    rank = df["rank"].to_numpy()[rows]
    found, launched = _launch_starts(rank, df["correlation"].to_numpy()[rows], launches)
    rows, rank, launched = rows[found], rank[found], launched[found]
    leaves = df["start_ns"].to_numpy()[rows]
    if dequeue == "end":
        leaves += df["dur_ns"].to_numpy()[rows]
    stream = df["stream"].to_numpy()[rows]
    n = rows.size
    del rows, found
    distinct, code = _pair_codes(rank, stream)
    del rank, stream
    code = np.tile(code, 2)
    # Departures first, so that a stable sort by time puts them before arrivals at the same time.
    time = np.concatenate([leaves, launched])
    del leaves, launched
    order = grouped_lexsort((time, code))
    time = time[order]
    code = code[order]
    # Every stream's steps sum to 0, so one running sum over all of them restarts at 0 on each stream.
    length = np.cumsum(np.where(order < n, np.int8(-1), np.int8(1)), dtype=np.int64)
    del order
    return pd.DataFrame(
        {
            "rank": distinct[:, 0][code],
            "stream": distinct[:, 1][code],
            "time_ns": time,
            "queue_length": length,
        },
        columns=QUEUE_SERIES_COLUMNS,
        copy=False,  # the columns stay apart: stacked into one block, 0.5 GB copied at 3.7 GB
    )


def queue_length_summary(
    df: pd.DataFrame,
    *,
    dequeue: str = "end",
    series: pd.DataFrame | None = None,
    launches: dict[int, LaunchCalls] | None = None,
) -> pd.DataFrame:
    """Per rank and stream, HTA's queue length summary: ``change_count`` (rows of the series: two per
    operation) and the mean, std, min, 25th/50th/75th percentiles and max of the queue length over
    those rows (``*_ops``, operations), plus ``time_mean_ops``, the queue length averaged over time from
    the stream's first launch to its last departure. ``series`` takes queue_length_series(df) already
    computed (with the same ``dequeue``)."""
    series = queue_length_series(df, dequeue=dequeue, launches=launches) if series is None else series
    rank, stream, time, length = (series[c].to_numpy() for c in QUEUE_SERIES_COLUMNS)
    first = _first_of_group(rank, stream)
    group = np.cumsum(first) - 1
    n_groups = int(first.sum())
    stats = _describe(group, length, n_groups)
    held = np.zeros(time.size, dtype=np.float64)  # how long each row's value holds within its stream
    if time.size:
        held[:-1] = np.where(first[1:], 0, np.diff(time))
    last = np.flatnonzero(np.r_[first[1:], True]) if time.size else np.zeros(0, dtype=np.int64)
    span = (time[last] - time[first]).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        time_mean = np.bincount(group, weights=length * held, minlength=n_groups) / span
    return pd.DataFrame(
        {
            "rank": rank[first],
            "stream": stream[first],
            "change_count": stats["count"],
            **{f"{s}_ops": stats[s] for s in _STATS},
            "time_mean_ops": time_mean,
        },
        columns=QUEUE_SUMMARY_COLUMNS,
    )


def blocked_on_full_queue(
    df: pd.DataFrame,
    max_queue_length: int = MAX_QUEUE_LENGTH,
    *,
    dequeue: str = "end",
    series: pd.DataFrame | None = None,
    launches: dict[int, LaunchCalls] | None = None,
) -> pd.DataFrame:
    """Per rank and stream with GPU operations: the time its launch queue was full, so that a new launch
    would block the host. HTA's definition: the time the queue length was at least ``max_queue_length``
    (``limit_ops``), summed over the series' rows. Columns: ``limit_ops``, ``peak_ops`` (the longest the
    queue got), ``blocked_ns``, the rank's ``kernel_span_ns`` (first GPU event's start to last one's end)
    and ``blocked_pct`` of it (HTA divides by the span of all the rank's events' starts instead, and
    keeps one stream per rank). ``series`` takes queue_length_series(df) already computed."""
    if max_queue_length < 1:
        raise ValueError(f"max_queue_length={max_queue_length}: must be at least 1")
    series = queue_length_series(df, dequeue=dequeue, launches=launches) if series is None else series
    rank, stream, time, length = (series[c].to_numpy() for c in QUEUE_SERIES_COLUMNS)
    first = _first_of_group(rank, stream)
    group = np.cumsum(first) - 1
    n_groups = int(first.sum())
    held = np.zeros(time.size, dtype=np.int64)
    if time.size:
        held[:-1] = np.where(first[1:], 0, np.diff(time))
    blocked = np.zeros(n_groups, dtype=np.int64)
    full = length >= max_queue_length
    np.add.at(blocked, group[full], held[full])
    # The series is ordered by rank and stream: each stream's rows are one run.
    peak = np.maximum.reduceat(length, np.flatnonzero(first)) if n_groups else np.zeros(0, dtype=np.int64)
    spans = kernel_spans(df)
    span = np.array([spans.get(int(r), 0) for r in rank[first].tolist()], dtype=np.int64)
    with np.errstate(divide="ignore", invalid="ignore"):
        pct = np.where(span > 0, 100 * blocked / span, np.nan)
    return pd.DataFrame(
        {
            "rank": rank[first],
            "stream": stream[first],
            "limit_ops": np.full(n_groups, max_queue_length, dtype=np.int64),
            "peak_ops": peak,
            "blocked_ns": blocked,
            "kernel_span_ns": span,
            "blocked_pct": pct,
        },
        columns=BLOCKED_COLUMNS,
    )


def idle_interval_stats(
    df: pd.DataFrame,
    consecutive_delay_ns: int = CONSECUTIVE_KERNEL_DELAY_NS,
    *,
    launches: dict[int, LaunchCalls] | None = None,
    gaps: IdleGaps | None = None,
) -> pd.DataFrame:
    """Per rank, stream and idle category (host_wait, kernel_wait, other: the intervals
    ``breakdown.idle_time_breakdown`` sums, listed by ``breakdown.idle_intervals``), HTA's idle interval
    statistics: ``interval_count`` and the mean, std, min, 25th/50th/75th percentiles and max of the
    intervals' lengths in ns. Every stream with a GPU event has the three rows (count 0 and NaN where it
    has no interval of that kind; HTA lists only the kinds present, and "other" always). ``gaps`` takes
    breakdown.idle_gaps(df) already computed (with the same delay)."""
    _require(df, "rank", "kind", "stream", "start_ns", "dur_ns", "correlation")
    n = len(IDLE_CATEGORIES)
    ranks, streams, at, _, lengths, category = (
        idle_gaps(df, consecutive_delay_ns, launches=launches) if gaps is None else gaps
    )
    at, category = at.astype(np.int64), category.astype(np.int64)
    stats = _describe(at * n + category, lengths, len(ranks) * n)
    return pd.DataFrame(
        {
            "rank": np.repeat(ranks.astype(np.int64), n),
            "stream": np.repeat(streams.astype(np.int64), n),
            "idle_category": np.tile(np.array(IDLE_CATEGORIES, dtype=object), len(ranks)),
            "interval_count": stats["count"],
            **{f"{s}_ns": stats[s] for s in _STATS},
        },
        columns=IDLE_STATS_COLUMNS,
    )


def _copies(df: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per copy or set: (rank, index into BW_KINDS, start ns, duration ns, bytes)."""
    _require(df, "rank", "kind", "start_ns", "dur_ns", "bytes", "copy_kind")
    rows = kind_mask(df, "memcpy", "memset")
    copy_kind = df["copy_kind"]
    labels = copy_kind.cat.categories if isinstance(copy_kind.dtype, pd.CategoricalDtype) else None
    if labels is None:
        copy_kind = copy_kind.astype("category")
        labels = copy_kind.cat.categories
    unknown = BW_KINDS.index("unknown")
    # Per category code, the extra last slot for code -1 (no direction).
    per_code = np.array([BW_KINDS.index(c) if c in BW_KINDS[:5] else unknown for c in labels] + [unknown])
    kind = per_code[copy_kind.array.codes[rows]]
    kind[kind_mask(df, "memset")[rows]] = BW_KINDS.index("memset")
    rank, start, dur, nbytes = (df[c].to_numpy()[rows] for c in ("rank", "start_ns", "dur_ns", "bytes"))
    return rank, kind.astype(np.int64), start, dur, nbytes


def memory_bw_series(df: pd.DataFrame) -> pd.DataFrame:
    """Per rank and copy kind (BW_KINDS: HtoD, DtoH, DtoD, HtoH, PtoP, memset, unknown), the bandwidth
    of all its copies running at once, as change points (HTA's memory bandwidth time series):
    ``rank``, ``copy_kind``, ``time_ns``, ``bandwidth_gbps`` (GB/s from this row's time on: the sum of
    bytes/duration of the copies running), ``active_count`` (copies running). Two rows per copy of known
    bandwidth (one at its start, one at its end); copies without a byte count or a duration are left
    out, not counted as 0 GB/s (memory_bw_summary counts them)."""
    rank, kind, start, dur, nbytes = _copies(df)
    known = (nbytes > 0) & (dur > 0)
    rank, kind, start, dur = rank[known], kind[known], start[known], dur[known]
    bw = nbytes[known] / dur  # bytes per ns = GB/s
    n = rank.size
    rank, kind = np.concatenate([rank, rank]), np.concatenate([kind, kind])
    time = np.concatenate([start, start + dur])
    step = np.concatenate([np.ones(n, dtype=np.int64), -np.ones(n, dtype=np.int64)])
    order = np.lexsort((step, time, kind, rank))
    step, change = step[order], np.concatenate([bw, -bw])[order]
    active = np.cumsum(step)  # every group's steps sum to 0: the count restarts at 0 on each
    # The running sum restarts wherever nothing runs, so it is exactly 0 there, not a float residue.
    total = np.cumsum(change)
    idle_at = np.maximum.accumulate(np.where(active == 0, np.arange(active.size), -1)) if active.size else active
    level = total - np.where(idle_at >= 0, total[np.maximum(idle_at, 0)], 0.0)
    return pd.DataFrame(
        {
            "rank": rank[order].astype(np.int64),
            "copy_kind": pd.Categorical.from_codes(kind[order], categories=list(BW_KINDS)),
            "time_ns": time[order].astype(np.int64),
            "bandwidth_gbps": np.where(active == 0, 0.0, level),
            "active_count": active,
        },
        columns=BW_SERIES_COLUMNS,
        copy=False,
    )


def memory_bw_summary(df: pd.DataFrame, *, series: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per rank and copy kind with a copy, HTA's memory bandwidth summary: ``copy_count``,
    ``unknown_count`` (copies without a byte count or a duration: no bandwidth known), ``point_count``
    (rows of memory_bw_series with copies running) and the mean, std, min, 25th/50th/75th percentiles and
    max of the bandwidth over those rows in GB/s (NaN where no copy of the kind has a known bandwidth).
    ``series`` takes memory_bw_series(df) already computed."""
    rank, kind, _, dur, nbytes = _copies(df)
    series = memory_bw_series(df) if series is None else series
    keys = rank.astype(np.int64) * len(BW_KINDS) + kind
    groups, at, copy_count = np.unique(keys, return_inverse=True, return_counts=True)
    unknown = np.bincount(at[(nbytes <= 0) | (dur <= 0)], minlength=groups.size)
    running = series["active_count"].to_numpy() > 0
    s_keys = series["rank"].to_numpy().astype(np.int64) * len(BW_KINDS) + series["copy_kind"].array.codes
    stats = _describe(
        np.searchsorted(groups, s_keys[running]), series["bandwidth_gbps"].to_numpy()[running], groups.size
    )
    return pd.DataFrame(
        {
            "rank": (groups // len(BW_KINDS)),
            "copy_kind": pd.Categorical.from_codes(groups % len(BW_KINDS), categories=list(BW_KINDS)),
            "copy_count": copy_count,
            "unknown_count": unknown,
            "point_count": stats["count"],
            **{f"{s}_gbps": stats[s] for s in _STATS},
        },
        columns=BW_SUMMARY_COLUMNS,
    )
