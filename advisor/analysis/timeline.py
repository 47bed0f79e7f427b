"""The timeline of one training step: rows for a Gantt chart of the step, its phases and its top work.

One step is a ``ProfilerStep#N`` range of one rank (torch.profiler's own step marker), or the whole
trace of that rank where it has none (nsys captures, traces without a schedule). Inside it:

- the phase ranges our profiled step emits (``data``, ``forward``, ``backward``, ``optimizer``: the
  record_function / NVTX ranges of advisor/run/step.py) and the same names written ``## forward ##``, as
  the ranges in HTA's sample traces are;
- on a GPU trace, the ``top_n`` kernels, copies and sets by total time inside the step, every
  occurrence of each, one lane per GPU stream;
- on a CPU trace, the ``top_n`` top-level framework ops (those not nested in another op of the same
  thread) by total time inside the step: their children repeat the same time and would bury them;
- the other ranges on the host (NVTX ranges of an nsys export, record_function ranges of a Kineto
  trace), one lane per nesting depth down to RANGE_DEPTHS, kind ``range``.

The step is a window of host time: an event belongs to it for the part of it that runs inside the
window, so GPU work queued by an earlier step but running now is shown, and the part of an event that
runs past the window's end is cut off (a kernel's total is its time inside the step).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pandas as pd

from advisor.analysis.breakdown import PROFILER_STEP_RE
from advisor.errors import AdvisorError
from advisor.trace.table import GPU_KINDS, kind_mask

COLUMNS = ["lane", "name", "start_ms", "dur_ms", "kind"]
STEP_LANE = "step"
PHASE_LANE = "phase"
CPU_LANE = "CPU ops"
WHOLE_TRACE = "whole trace (no ProfilerStep)"
# Our phase names (advisor/run/step.py PHASES) and HTA's sample traces' "data_load"; nested ranges such as
# offload_d2h stay out, as they would overlap their parent phase in the one phase lane.
PHASE_NAMES = frozenset({"data", "data_load", "forward", "backward", "optimizer"})
MAX_NAME_CHARS = 80  # longer kernel names (templates run to 300 characters) swamp the hover and legend
MAX_ROWS = 2000  # a browser draws a few thousand bars smoothly; GPU steps can hold 10^4 kernels
RANGE_DEPTHS = 3  # lanes of nested ranges: deeper ones (emit_nvtx's per-op ranges) crowd the chart
RANGE_SHARE = 4  # the ranges take at most 1/RANGE_SHARE of max_rows: the kernels are the point
RANGE_KIND = "range"


def _short(name: str, tag: str = "") -> str:
    """``name`` cut to MAX_NAME_CHARS with an ellipsis, ``tag`` kept at the end of a cut name."""
    return name if len(name) <= MAX_NAME_CHARS else name[: MAX_NAME_CHARS - 1 - len(tag)] + "…" + tag


def _short_names(names: list[str]) -> list[str]:
    """The names cut by _short, kept distinct: templated kernels often share their first 80 characters,
    so a cut that collides ends with the name's place in ``names`` instead (``…[3]``)."""
    cut = [_short(n) for n in names]
    seen = Counter(cut)
    return [c if seen[c] == 1 else _short(n, f"[{i + 1}]") for i, (n, c) in enumerate(zip(names, cut, strict=True))]


def _phase_key(name: str) -> str:
    """``## forward ##`` -> ``forward``: the name without the hashes some frameworks wrap it in."""
    return name.strip("# ").lower()


def profiler_steps(table: pd.DataFrame, rank: int) -> pd.DataFrame:
    """The ``ProfilerStep#N`` ranges of one rank on the host, by start: columns ``step`` (N),
    ``start_ns``, ``dur_ns`` and ``complete`` (whether the step ran to its end inside the capture)."""
    host_ranges = kind_mask(table, "annotation") & (table[["rank", "device"]].to_numpy() == (rank, -1)).all(axis=1)
    names = table["name"][host_ranges].astype(str)
    is_step = names.str.match(PROFILER_STEP_RE).to_numpy()
    ranges = table[host_ranges][is_step]
    out = pd.DataFrame(
        {
            "step": names[is_step].str.rsplit("#", n=1).str[1].astype(np.int64).to_numpy(),
            "start_ns": ranges["start_ns"].to_numpy(),
            "dur_ns": ranges["dur_ns"].to_numpy(),
        }
    )
    out = out.sort_values("start_ns", kind="stable").reset_index(drop=True)
    # As analyze() does (HTA's default window): a Kineto capture ends inside its last step, except in
    # our own runs, which stop the profiler after their last step.
    cut = table.attrs.get("source") == "kineto" and not table.attrs.get("own_run") and len(out) > 1
    out["complete"] = np.arange(len(out)) < len(out) - 1 if cut else True
    return out


def step_timeline(
    table: pd.DataFrame, rank: int = 0, step: int | None = None, top_n: int = 12, max_rows: int = MAX_ROWS
) -> pd.DataFrame:
    """Gantt rows of one step of ``rank``: columns ``lane``, ``name`` (cut to 80 characters), ``start_ms``
    (from the step's start), ``dur_ms`` (the part inside the step), ``kind`` (the event kind; ``trace``
    for the whole-trace row). Rows: the step, its phases by start, then the ``top_n`` kernels (GPU) or
    top-level ops (CPU) by total time inside the step, largest first, each with all its occurrences by
    start; only the longest occurrences are kept when there are more than ``max_rows`` rows in all.

    ``step`` is the N of ``ProfilerStep#N``; by default the last complete one. Without ProfilerStep
    ranges on the rank the whole trace of that rank is the step. ``attrs`` say what was picked: ``rank``,
    ``step`` (N, or None for the whole trace), ``whole_trace``, ``step_start_ns`` (trace clock),
    ``step_ms``, ``source`` (``kernels`` or ``cpu_ops``) and ``dropped_rows`` (occurrences cut by
    ``max_rows``). Raises AdvisorError for a rank or step the trace does not have."""
    if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 0:
        raise AdvisorError(f"top_n={top_n!r}: must be an integer >= 0")
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
        raise AdvisorError(f"max_rows={max_rows!r}: must be an integer >= 1")
    ranks = sorted(int(r) for r in np.unique(table["rank"].to_numpy()))
    if not ranks:
        raise AdvisorError("the trace holds no events")
    if rank not in ranks:
        raise AdvisorError(f"rank={rank!r}: the trace has no such rank (it has rank {', '.join(map(str, ranks))})")
    in_rank = table["rank"].to_numpy() == rank
    steps = profiler_steps(table, rank)
    if step is not None and steps.empty:
        raise AdvisorError(
            f"step={step!r}: rank {rank} has no ProfilerStep ranges; leave the step unset to see the whole trace"
        )
    if step is not None and not (steps["step"] == step).any():
        have = ", ".join(map(str, steps["step"].tolist()))
        raise AdvisorError(f"step={step!r}: rank {rank} has no ProfilerStep#{step} (it has steps {have})")
    whole = steps.empty
    if whole:
        start = table["start_ns"].to_numpy()[in_rank]
        t0, t1 = int(start.min()), int((start + table["dur_ns"].to_numpy()[in_rank]).max())
        first = (STEP_LANE, WHOLE_TRACE, 0.0, (t1 - t0) / 1e6, "trace")
        number = None
    else:
        picked = steps[steps["complete"]].iloc[-1] if step is None else steps[steps["step"] == step].iloc[0]
        number = int(picked["step"])
        t0, t1 = int(picked["start_ns"]), int(picked["start_ns"] + picked["dur_ns"])
        first = (STEP_LANE, f"ProfilerStep#{number}", 0.0, (t1 - t0) / 1e6, "annotation")

    rows = [first, *_phase_rows(table, in_rank, t0, t1)]
    ranges, dropped_ranges = _range_rows(table, in_rank, t0, t1, max(max_rows // RANGE_SHARE, 1))
    rows += ranges
    gpu = _clip(table, np.flatnonzero(in_rank & kind_mask(table, *GPU_KINDS)), t0, t1)
    if gpu[0].size:
        source, work = "kernels", _top_rows(table, gpu, t0, top_n, _gpu_lanes)
    else:
        # Nesting is decided over the rank's whole trace: an op's parent may start before the step.
        ops = np.flatnonzero(in_rank & kind_mask(table, "cpu_op"))
        top_level = _clip(table, ops[_top_level(table, ops)], t0, t1)
        source, work = "cpu_ops", _top_rows(table, top_level, t0, top_n, _cpu_lanes)
    room = max(max_rows - len(rows), 0)
    dropped = max(len(work) - room, 0)
    if dropped:
        keep = work.sort_values(["dur_ms", "start_ms"], ascending=[False, True], kind="stable").index[:room]
        work = work.loc[np.sort(keep)]
    out = pd.concat([pd.DataFrame(rows, columns=COLUMNS), work], ignore_index=True)
    out = out.astype({"lane": str, "name": str, "kind": str})  # one text dtype, whether or not work is empty
    out.attrs.update(
        rank=rank,
        step=number,
        whole_trace=whole,
        step_start_ns=t0,
        step_ms=(t1 - t0) / 1e6,
        source=source,
        dropped_rows=dropped + dropped_ranges,
    )
    return out


def range_lane(depth: int, tid: int | None, source: str | None) -> str:
    """The lane of a host range at nesting ``depth`` (0: outermost) on thread ``tid`` (None: the only
    thread with ranges)."""
    prefix = "NVTX" if source == "nsys" else "ranges"
    return f"{prefix} {depth}" if tid is None else f"{prefix} thread {tid} {depth}"


def _range_rows(table: pd.DataFrame, in_rank: np.ndarray, t0: int, t1: int, limit: int) -> tuple[list[tuple], int]:
    """Host ranges of one rank inside [t0, t1) other than the step and its phases, with their nesting
    depth on their thread among those ranges (a range inside another that is still open), the outer
    RANGE_DEPTHS levels;
    beyond ``limit`` rows the outer and then the longer ones are kept. (rows, ranges dropped)."""
    host = np.flatnonzero(in_rank & kind_mask(table, "annotation") & (table["device"].to_numpy() == -1))
    names = table["name"].to_numpy()[host].astype(str)
    shown = PHASE_NAMES | {STEP_LANE}  # our own runs' "step" range is the step lane's
    other = np.array([not PROFILER_STEP_RE.match(n) and _phase_key(n) not in shown for n in names], dtype=bool)
    host, names = host[other], names[other]
    tid, start, dur = (table[c].to_numpy()[host] for c in ("tid", "start_ns", "dur_ns"))
    order = np.lexsort((-dur, start, tid))
    depth = np.zeros(host.size, dtype=np.int64)
    stack: list[int] = []  # ends of the ranges still open on the current thread
    last_tid = None
    for i in order.tolist():
        if tid[i] != last_tid:
            stack, last_tid = [], tid[i]
        while stack and stack[-1] <= start[i]:
            stack.pop()
        depth[i] = len(stack)
        stack.append(int(start[i] + dur[i]))
    s, e = np.maximum(start, t0), np.minimum(start + dur, t1)
    keep = np.flatnonzero((e > s) & (depth < RANGE_DEPTHS))
    dropped = int(((e > s) & (depth >= RANGE_DEPTHS)).sum())
    if keep.size > limit:
        dropped += keep.size - limit
        keep = keep[np.lexsort((-(e[keep] - s[keep]), depth[keep]))[:limit]]
    keep = keep[np.lexsort((s[keep], depth[keep]))]
    threads = np.unique(tid[keep])
    source = table.attrs.get("source")
    return [
        (
            range_lane(int(depth[i]), None if threads.size == 1 else int(tid[i]), source),
            _short(names[i]),
            (s[i] - t0) / 1e6,
            (e[i] - s[i]) / 1e6,
            RANGE_KIND,
        )
        for i in keep.tolist()
    ], dropped


def _clip(table: pd.DataFrame, rows: np.ndarray, t0: int, t1: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the rows, as positions, that overlap [t0, t1); their start and end cut to it, in ns)."""
    start = table["start_ns"].to_numpy()[rows]
    end = start + table["dur_ns"].to_numpy()[rows]
    s, e = np.maximum(start, t0), np.minimum(end, t1)
    inside = e > s
    return rows[inside], s[inside], e[inside]


def _phase_rows(table: pd.DataFrame, in_rank: np.ndarray, t0: int, t1: int) -> list[tuple]:
    """Phase ranges on the host of one rank inside [t0, t1), by start, cut to the window."""
    ranges = np.flatnonzero(in_rank & kind_mask(table, "annotation") & (table["device"].to_numpy() == -1))
    rows, s, e = _clip(table, ranges, t0, t1)
    names = table["name"].to_numpy()[rows].astype(str)
    is_phase = np.array([_phase_key(n) in PHASE_NAMES for n in names], dtype=bool)
    order = np.argsort(s[is_phase], kind="stable")
    return [
        (PHASE_LANE, _short(n), (a - t0) / 1e6, (b - a) / 1e6, "annotation")
        for n, a, b in zip(
            names[is_phase][order], s[is_phase][order].tolist(), e[is_phase][order].tolist(), strict=True
        )
    ]


def _top_level(table: pd.DataFrame, rows: np.ndarray) -> np.ndarray:
    """Which of the ops ``rows`` (positions) are nested in no other op of the same thread: those that
    start at or after the end of every op before them on that thread (longer first at equal starts)."""
    tid, start, dur = (table[c].to_numpy()[rows] for c in ("tid", "start_ns", "dur_ns"))
    order = np.lexsort((-dur, start, tid))
    tid, start, end = tid[order], start[order], (start + dur)[order]
    top = np.ones(rows.size, dtype=bool)
    bounds = np.flatnonzero(np.diff(tid)) + 1
    for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, rows.size], strict=True):
        reach = np.maximum.accumulate(end[lo:hi])  # the latest end of the ops seen so far on the thread
        top[lo + 1 : hi] = start[lo + 1 : hi] >= reach[:-1]
    out = np.empty(rows.size, dtype=bool)
    out[order] = top
    return out


def _gpu_lanes(table: pd.DataFrame, rows: np.ndarray) -> np.ndarray:
    device, stream = table["device"].to_numpy()[rows], table["stream"].to_numpy()[rows]
    if np.unique(device).size > 1:
        return np.array([f"GPU {d} stream {s}" for d, s in zip(device.tolist(), stream.tolist(), strict=True)])
    return np.array([f"GPU stream {s}" for s in stream.tolist()])


def _cpu_lanes(table: pd.DataFrame, rows: np.ndarray) -> np.ndarray:
    tid = table["tid"].to_numpy()[rows]
    if np.unique(tid).size > 1:
        return np.array([f"CPU thread {t}" for t in tid.tolist()])
    return np.full(rows.size, CPU_LANE, dtype=object)


def _top_rows(
    table: pd.DataFrame, clipped: tuple[np.ndarray, np.ndarray, np.ndarray], t0: int, top_n: int, lanes
) -> pd.DataFrame:
    """Every occurrence of the ``top_n`` names with the most time among ``clipped`` (from _clip; ties:
    by name), names largest first, occurrences by start, times in ms from ``t0``."""
    rows, s, e = clipped
    codes = table["name"].array.codes[rows]
    labels = table["name"].cat.categories
    uniq, inv = np.unique(codes, return_inverse=True)
    totals = np.zeros(uniq.size, dtype=np.int64)
    np.add.at(totals, inv, e - s)
    names = [str(labels[c]) if c >= 0 else "nan" for c in uniq.tolist()]
    best = sorted(range(uniq.size), key=lambda i: (-totals[i], names[i]))[:top_n]
    place = np.full(uniq.size, -1, dtype=np.int64)
    place[best] = np.arange(len(best))
    order = place[inv]
    sel = np.flatnonzero(order >= 0)
    sel = sel[np.lexsort((s[sel], order[sel]))]
    short = _short_names([names[i] for i in best])
    return pd.DataFrame(
        {
            "lane": lanes(table, rows[sel]),
            "name": [short[i] for i in order[sel].tolist()],
            "start_ms": (s[sel] - t0) / 1e6,
            "dur_ms": (e[sel] - s[sel]) / 1e6,
            "kind": table["kind"].to_numpy()[rows[sel]].astype(str),
        },
        columns=COLUMNS,
    )
