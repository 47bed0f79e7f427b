"""Trace diff: what changed between two traces (or two runs) of a training step, per step.

Three tables, every figure per step of the average rank, so that traces with different step or rank
counts compare: per kernel name and per host op name, the calls and the time in each trace, the
change and whether the name was added, removed, or ran slower, faster or unchanged; and per category
the time that makes up the step, whose changes sum to the change in step time.

Definitions follow HTA's ``TraceDiff.compare_traces`` (hta/trace_diff.py) where it has one: events
are grouped by name; a host event belongs to the step whose range holds its start, a GPU event to
the step of the runtime call that launched it (``add_iteration`` in hta/common/trace.py; a GPU event
with no launching call in the table, by its own start). HTA compares counts and summed durations
(in us) of one iteration of one rank; here every step of every rank is used, per step of the
average rank (a rank's totals over its step count, then the mean over ranks), and an op's time is
its self time (its inclusive time, HTA's ``total_duration``, is kept beside it): the self times add
up to the host's busy time, where an op and the ops inside it would count their shared stretch
twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from advisor.analysis import breakdown as A
from advisor.analysis.steps import BASES, step_windows
from advisor.errors import AdvisorError
from advisor.trace.kineto import DEFAULT_MAX_BYTES
from advisor.trace.load import load_trace
from advisor.trace.nsys import NVTX_OP_RE
from advisor.trace.table import COLUMNS, GPU_KINDS, kind_mask

NOISE_PCT = 5.0
"""A name's time per step has changed where it moved by more than this share of its time in A, by more
than ``MIN_DELTA_NS``, and (where both traces have two or more steps) beyond the step-to-step spread:
every step of B above every step of A, or below. Measured with ``bench/trace_diff.py``, which diffs the
first half of a trace's steps against the second (bench/results/trace_diff.md): GPU kernels repeat
closely (time-weighted p90 of the change 1.0 % on ns_resolution_trace, 2.6 % on nccl_parser_config;
at 5 % none, and 2.4 % of kernel time, are flagged), while host op times move far more (p90 16-35 %
between two steps of one CPU run on a shared machine): on CPU runs a flag says "look", and the
category table and the step-time change are the figures to trust."""
MIN_DELTA_NS = 1_000
"""Changes under 1 us per step are unchanged whatever their share: Kineto records whole
microseconds, so a 1-call op of a few us moves by 20-50 % on rounding alone."""
STATUSES = ("added", "removed", "slower", "faster", "unchanged")
CAPTURE_BASIS = "capture"
BASES_DIFF = {**BASES, CAPTURE_BASIS: "no step marks: each rank's whole capture counts as one step"}
"""How the steps of a trace were found (``TraceDiff.basis_a``/``basis_b``), for people."""
NAME_COLUMNS = [
    "name",
    "a_count",
    "b_count",
    "a_ns",
    "b_ns",
    "delta_ns",
    "delta_pct",
    "status",
    "a_mean_ns",
    "b_mean_ns",
]
KERNEL_COLUMNS = ["name", "category", *NAME_COLUMNS[1:]]
OP_COLUMNS = [*NAME_COLUMNS, "a_total_ns", "b_total_ns"]
CATEGORY_COLUMNS = ["category", "a_ns", "b_ns", "delta_ns", "a_pct", "b_pct"]
STEP_ROWS = ("overlap", "host", "idle", "residual")
"""The rows of the category table besides the kernel categories (see ``trace_diff``)."""
_W, _G, _H = 0, 1, 2  # interval types of the step-time sweep: step windows, GPU events, host ops


@dataclass(frozen=True)
class TraceDiff:
    """Two traces compared, per step of the average rank (see ``trace_diff`` for the tables)."""

    step_a_ns: float
    """Mean step time of A: each rank's mean step, then the mean over ranks (NaN without events)."""
    step_b_ns: float
    steps_a: int
    """Steps of A's rank with the fewest (0 without events)."""
    steps_b: int
    basis_a: str
    """How A's steps were found: a key of ``BASES_DIFF``."""
    basis_b: str
    ranks_a: int
    ranks_b: int
    categories: pd.DataFrame
    kernels: pd.DataFrame
    ops: pd.DataFrame
    noise_pct: float = NOISE_PCT
    notes: tuple[str, ...] = field(default=())
    """What the reader should know to trust the comparison (different step bases, rank counts)."""

    @property
    def step_delta_ns(self) -> float:
        return self.step_b_ns - self.step_a_ns

    def top(self, table: str, status: str, n: int = 10) -> pd.DataFrame:
        """The ``n`` rows of ``table`` ('kernels' or 'ops') with ``status``, largest change first."""
        t = getattr(self, table)
        return t[t["status"] == status].head(n)

    def to_dict(self) -> dict:
        """Everything as JSON-ready values (NaN as None), tables as lists of records."""

        def num(x: float) -> float | None:
            return None if x != x else float(x)  # x != x: NaN

        tables = {k: getattr(self, k) for k in ("categories", "kernels", "ops")}
        return {
            "step_a_ms": num(self.step_a_ns / 1e6),
            "step_b_ms": num(self.step_b_ns / 1e6),
            "step_delta_ms": num(self.step_delta_ns / 1e6),
            "steps_a": self.steps_a,
            "steps_b": self.steps_b,
            "basis_a": self.basis_a,
            "basis_b": self.basis_b,
            "ranks_a": self.ranks_a,
            "ranks_b": self.ranks_b,
            "noise_pct": self.noise_pct,
            "notes": list(self.notes),
            **{k: [{c: (num(v) if isinstance(v, float) else v) for c, v in r.items()} for r in t.to_dict("records")]
               for k, t in tables.items()},
        }  # fmt: skip


@dataclass(frozen=True)
class _Side:
    """One trace reduced to per-step figures of the average rank."""

    step_ns: float
    steps: int
    basis: str
    ranks: int
    categories: dict[str, float]
    kernels: pd.DataFrame  # name, category, count, time_ns: per step
    ops: pd.DataFrame  # name, count, time_ns (self), total_ns: per step


def _groups(names: pd.Series, rows: np.ndarray, label) -> tuple[np.ndarray, list[str]]:
    """(each row's group id, the groups' labels): the rows ``rows`` of the categorical ``names`` grouped
    by ``label(name)``, evaluated once per distinct name; a row whose label is None gets id -1."""
    if not isinstance(names.dtype, pd.CategoricalDtype):
        names = names.astype("category")
    codes, categories = names.array.codes[rows], names.cat.categories
    labels: dict[str, int] = {}
    group_of = np.full(len(categories) + 1, -1, dtype=np.int64)  # the extra last slot serves code -1
    for c in np.unique(codes).tolist():
        text = label(A._label(categories, c))
        if text is not None:
            group_of[c] = labels.setdefault(text, len(labels))
    return group_of[codes], list(labels)


def _nvtx_op(ops: frozenset[str]) -> Callable[[str], str | None]:
    """The op name of an emit_nvtx range: its name where the loader named it by its op (``nvtx_ops``),
    else the op name in its whole text (NVTX_OP_RE); None for another range."""

    def op(name: str) -> str | None:
        if name in ops:
            return name
        m = NVTX_OP_RE.match(name)
        return m.group(1) if m else None

    return op


def _host_ops(df: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(rows of the table that are host ops, ascending; each one's group id; the groups' op names): the
    ``cpu_op`` events, and the emit_nvtx ranges of an nsys export (its ``nvtx_ops``, or ranges whose
    whole text NVTX_OP_RE reads) named without their sequence and op ids."""
    host = df["device"].to_numpy() == -1
    ops = np.flatnonzero(kind_mask(df, "cpu_op") & host)
    ranges = np.flatnonzero(kind_mask(df, "annotation") & host)
    op_ids, op_labels = _groups(df["name"], ops, lambda n: n)
    range_ids, range_labels = _groups(df["name"], ranges, _nvtx_op(frozenset(df.attrs.get("nvtx_ops", ()))))
    keep = range_ids >= 0
    rows = np.concatenate([ops, ranges[keep]])
    ids = np.concatenate([op_ids, range_ids[keep] + len(op_labels)])  # a name in both is summed later
    order = np.argsort(rows, kind="stable")
    return rows[order], ids[order], op_labels + range_labels


def _step_of(starts: np.ndarray, ends: np.ndarray, t: np.ndarray) -> np.ndarray:
    """The index of the step window [start, end) that holds each time ``t``; -1 where none does."""
    i = np.searchsorted(starts, t, side="right") - 1
    inside = (i >= 0) & (t < ends[np.maximum(i, 0)])
    return np.where(inside, i, -1)


def _capture(df: pd.DataFrame, rank: int) -> tuple[np.ndarray, np.ndarray, str]:
    """A rank's whole capture as its one step: its first event's start to its last one's end."""
    mine = df["rank"].to_numpy() == rank
    start = df["start_ns"].to_numpy()[mine]
    return np.array([start.min()]), np.array([(start + df["dur_ns"].to_numpy()[mine]).max()]), CAPTURE_BASIS


def _totals(ids: np.ndarray, n_groups: int, weight: np.ndarray, *values: np.ndarray) -> list[np.ndarray]:
    """Per group id: the sum of ``weight``, then the weighted sum of each of ``values``."""
    out = [np.bincount(ids, weights=weight, minlength=n_groups)]
    return out + [np.bincount(ids, weights=weight * v, minlength=n_groups) for v in values]


def _spread(ids: np.ndarray, n_groups: int, sample: np.ndarray, values: np.ndarray, samples: int) -> np.ndarray:
    """Per group: the least and the most time (ns) it took in one sample (a step of a rank), a step
    without it counting 0; NaN for both with fewer than 2 samples."""
    out = np.full((n_groups, 2), np.nan)
    if samples < 2 or n_groups == 0:
        return out
    keep = sample >= 0
    per = np.bincount(ids[keep] * samples + sample[keep], weights=values[keep], minlength=n_groups * samples)
    per = per.reshape(n_groups, samples)
    out[:, 0], out[:, 1] = per.min(axis=1), per.max(axis=1)
    return out


def _side(df: pd.DataFrame) -> _Side:
    """Per-step figures of one trace (see ``trace_diff``): each event's weight is 1 / (its rank's step
    count x the rank count) where it belongs to a step of its rank, else 0."""
    ranks = np.unique(df["rank"].to_numpy()).tolist()
    windows = step_windows(df) if ranks else {}
    windows |= {r: _capture(df, r) for r in ranks if r not in windows}
    rank, tid, start, dur, corr = (df[c].to_numpy() for c in ("rank", "tid", "start_ns", "dur_ns", "correlation"))
    end = start + dur
    gpu = np.flatnonzero(kind_mask(df, *GPU_KINDS))
    cat = A._per_name(df["name"], gpu, lambda n: A.CATEGORIES.index(A.kernel_category(n)), np.int64)
    cat[kind_mask(df, "memcpy")[gpu]] = A.CATEGORIES.index("memcpy")
    cat[kind_mask(df, "memset")[gpu]] = A.CATEGORIES.index("memset")
    ops, op_ids, op_labels = _host_ops(df)
    busy = np.union1d(ops, np.flatnonzero(kind_mask(df, "runtime") & (df["device"].to_numpy() == -1)))
    launches = A.launch_calls(df)
    n_ranks = max(len(ranks), 1)
    k_weight, op_weight, op_self = np.zeros(gpu.size), np.zeros(ops.size), np.zeros(ops.size)
    # Each event's sample: its (rank, step) pair numbered across the ranks; -1 outside the steps.
    k_sample, op_sample = np.full(gpu.size, -1), np.full(ops.size, -1)
    cats, rows = np.zeros(len(A.CATEGORIES)), dict.fromkeys(STEP_ROWS, 0.0)
    step_ns, bases, samples = 0.0, [], 0
    for r in ranks:
        w_start, w_end, basis = windows[r]
        share = 1.0 / (w_start.size * n_ranks)  # of a rank's total: its part of the average rank's step
        bases.append(basis)
        step_ns += float((w_end - w_start).sum()) * share
        # GPU events by the step of the call that launched them (HTA's rule), else by their own start.
        mine = np.flatnonzero(rank[gpu] == r)
        at = start[gpu[mine]]
        calls = launches.get(r, A._NO_CALLS)
        found, pos = calls.find(corr[gpu[mine]])
        at[found] = calls.start_ns[pos[found]]
        step = _step_of(w_start, w_end, at)
        stepped = mine[step >= 0]
        k_weight[stepped] = share
        k_sample[stepped] = samples + step[step >= 0]
        cats += np.bincount(cat[stepped], weights=dur[gpu[stepped]], minlength=cats.size) * share
        own = gpu[stepped]
        own_busy = A.union_ns(start[own], end[own])
        # Host ops by their own start; self times within the rank (thread ids repeat across ranks).
        mine_ops = np.flatnonzero(rank[ops] == r)
        o = ops[mine_ops]
        op_self[mine_ops] = A._self_ns(tid[o], start[o], dur[o])
        step = _step_of(w_start, w_end, start[o])
        op_weight[mine_ops[step >= 0]] = share
        op_sample[mine_ops[step >= 0]] = samples + step[step >= 0]
        samples += w_start.size
        # One sweep over the step windows, every GPU event of the rank and its host's busy time.
        g, h = gpu[mine], busy[rank[busy] == r]
        per_mask = A._sweep(
            np.concatenate([w_start, start[g], start[h]]),
            np.concatenate([w_end, end[g], end[h]]),
            np.concatenate([np.full(w_start.size, _W), np.full(g.size, _G), np.full(h.size, _H)]),
        )
        gpu_in_steps = int(sum(per_mask[m] for m in range(8) if m & (1 << _W) and m & (1 << _G)))
        rows["overlap"] -= (float(dur[own].sum()) - own_busy) * share
        rows["host"] += int(per_mask[(1 << _W) | (1 << _H)]) * share
        rows["idle"] += int(per_mask[1 << _W]) * share
        rows["residual"] += (gpu_in_steps - own_busy) * share
    k_ids, k_labels = _groups(df["name"], gpu, lambda n: n)
    key = k_ids * len(A.CATEGORIES) + cat  # a name is one kernel per category (a copy is not a kernel)
    keys, inverse = np.unique(key, return_inverse=True)
    k_count, k_time = _totals(inverse, keys.size, k_weight, dur[gpu].astype(float))
    kernels = pd.DataFrame(
        {
            "name": [k_labels[k // len(A.CATEGORIES)] for k in keys.tolist()],
            "category": [A.CATEGORIES[k % len(A.CATEGORIES)] for k in keys.tolist()],
            "count": k_count,
            "time_ns": k_time,
        }
    )
    kernels[["min_ns", "max_ns"]] = _spread(inverse, keys.size, k_sample, dur[gpu], samples)
    o_count, o_self, o_total = _totals(op_ids, len(op_labels), op_weight, op_self, dur[ops].astype(float))
    op_table = pd.DataFrame({"name": op_labels, "count": o_count, "time_ns": o_self, "total_ns": o_total})
    op_table[["min_ns", "max_ns"]] = _spread(op_ids, len(op_labels), op_sample, op_self, samples)
    # An nsys op also named as a cpu_op is summed (its spread then bounds each part's: wider, never narrower).
    op_table = op_table.groupby("name", as_index=False, sort=False).agg(
        {"count": "sum", "time_ns": "sum", "total_ns": "sum", "min_ns": "min", "max_ns": "sum"}
    )
    return _Side(
        step_ns=step_ns if ranks else float("nan"),
        steps=min((w[0].size for w in windows.values()), default=0),
        basis=" / ".join(sorted(set(bases))),
        ranks=len(ranks),
        categories={**{A.CATEGORIES[i]: float(v) for i, v in enumerate(cats.tolist()) if v}, **rows},
        kernels=kernels[kernels["count"] > 0],
        ops=op_table[op_table["count"] > 0],
    )


def _compare(a: pd.DataFrame, b: pd.DataFrame, keys: list[str], noise_pct: float) -> pd.DataFrame:
    """Side A and B joined by name: A's and B's figures, the change and the status of each name."""
    on = ["name", "category"] if "category" in keys else ["name"]
    both = pd.merge(a, b, on=on, how="outer", suffixes=("_a", "_b"))
    out = both[on].astype(str)
    for col, name in (("count", "count"), ("time_ns", "ns")):
        out[f"a_{name}"] = both[f"{col}_a"].fillna(0.0).to_numpy()
        out[f"b_{name}"] = both[f"{col}_b"].fillna(0.0).to_numpy()
    out["delta_ns"] = out["b_ns"] - out["a_ns"]
    with np.errstate(divide="ignore", invalid="ignore"):
        out["delta_pct"] = np.where(out["a_ns"] > 0, 100 * out["delta_ns"] / out["a_ns"], np.nan)
    changed = (out["delta_ns"].abs() > MIN_DELTA_NS) & (out["delta_ns"].abs() > noise_pct / 100 * out["a_ns"])
    # Where both traces have two or more steps, a change must also clear the step-to-step spread: every
    # step of B beyond every step of A (a comparison with no spread known is judged by the threshold).
    a_min, a_max, b_min, b_max = (both[c].to_numpy() for c in ("min_ns_a", "max_ns_a", "min_ns_b", "max_ns_b"))
    with np.errstate(invalid="ignore"):
        apart = (b_min > a_max) | (b_max < a_min)
    changed &= apart | np.isnan(a_min) | np.isnan(b_min)
    status = np.select(
        [out["a_count"] == 0, out["b_count"] == 0, changed & (out["delta_ns"] > 0), changed],
        ["added", "removed", "slower", "faster"],
        "unchanged",
    )
    out["status"] = status
    with np.errstate(divide="ignore", invalid="ignore"):
        out["a_mean_ns"] = np.where(out["a_count"] > 0, out["a_ns"] / out["a_count"], np.nan)
        out["b_mean_ns"] = np.where(out["b_count"] > 0, out["b_ns"] / out["b_count"], np.nan)
    if "total_ns" in keys:
        out["a_total_ns"] = both["total_ns_a"].fillna(0.0).to_numpy()
        out["b_total_ns"] = both["total_ns_b"].fillna(0.0).to_numpy()
    order = np.lexsort((out["name"].to_numpy(), -out["delta_ns"].abs().to_numpy()))
    return out.iloc[order].reset_index(drop=True)


def _category_table(a: _Side, b: _Side) -> pd.DataFrame:
    names = [c for c in A.CATEGORIES if c in a.categories or c in b.categories]
    names += [r for r in STEP_ROWS if r in ("host", "idle") or a.categories.get(r) or b.categories.get(r)]
    out = pd.DataFrame(
        {
            "category": names,
            "a_ns": [a.categories.get(c, 0.0) for c in names],
            "b_ns": [b.categories.get(c, 0.0) for c in names],
        }
    )
    out["delta_ns"] = out["b_ns"] - out["a_ns"]
    with np.errstate(divide="ignore", invalid="ignore"):
        out["a_pct"] = 100 * out["a_ns"] / a.step_ns
        out["b_pct"] = 100 * out["b_ns"] / b.step_ns
    order = np.lexsort((out["category"].to_numpy(), -out["delta_ns"].abs().to_numpy()))
    return out.iloc[order].reset_index(drop=True)


def _prepared(df: pd.DataFrame, trim_last_step: bool) -> pd.DataFrame:
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise AdvisorError(f"trace diff needs the event table's column(s) {', '.join(missing)}")
    if trim_last_step and df.attrs.get("source") == "kineto" and not df.attrs.get("own_run"):
        return A.drop_last_profiler_step(df)  # as analyze() does: the last step is cut by the capture's end
    return df


def trace_diff(
    a: pd.DataFrame, b: pd.DataFrame, *, noise_pct: float = NOISE_PCT, trim_last_step: bool = True
) -> TraceDiff:
    """B compared with A (two event tables), per step of the average rank.

    Steps are those of the phases table (``advisor.analysis.steps.step_windows``: the trace's step or
    ProfilerStep ranges, else the optimizer updates); a rank that nothing marks a step in counts its
    whole capture as one step (basis 'capture': then "per step" means "per capture", and two captures
    compare only if they cover the same work). Kineto traces are cut to their complete profiler steps
    as ``analyze`` cuts them (``trim_last_step``).

    Tables (every time in ns per step, every count in calls per step, both floats):

    - ``kernels``: per GPU event name (kernels, copies, sets): ``name``, ``category``
      (``breakdown.kernel_category``), ``a_count``, ``b_count``, ``a_ns``, ``b_ns``, ``delta_ns`` (B - A),
      ``delta_pct`` (of A; NaN where A has none) and ``status``: 'added' (not in A), 'removed' (not in
      B), 'slower'/'faster' (moved by more than ``noise_pct`` % of A's time, by more than
      ``MIN_DELTA_NS`` and, where both traces have two or more steps, beyond the step-to-step spread:
      see ``NOISE_PCT``), else 'unchanged'; then ``a_mean_ns``, ``b_mean_ns``, the time per call (NaN
      without calls: per call is what compares where the steps are whole captures, which may hold
      different amounts of work); largest change first.
    - ``ops``: the same per host op name (self time), with ``a_total_ns``, ``b_total_ns`` (inclusive
      time, HTA's total_duration). An nsys export's emit_nvtx ranges count as ops, named without their
      ``seq``/``op_id`` suffixes.
    - ``categories``: what the step time is made of, per ``category``: ``a_ns``, ``b_ns``,
      ``delta_ns``, and each one's share of its trace's step (``a_pct``, ``b_pct``). The rows: the time
      of the steps' GPU events per kernel category; ``overlap``, minus the time those events ran at
      the same time as each other (counted once in the step); ``host``, the steps' time when the GPU
      was idle and the host ran ops or runtime calls (in a CPU-only trace: all of the host's op time);
      ``idle``, the steps' time when neither did; ``residual``, the GPU time inside the step windows
      minus the steps' own GPU time (work launched in one step that runs outside it, or from outside
      the steps inside them). The rows sum to the step time of each trace, and their changes to the
      change in step time, exactly (to float rounding): the residual is the one row that is not a
      kind of work, and it is reported on its own rather than spread over the others."""
    a, b = _prepared(a, trim_last_step), _prepared(b, trim_last_step)
    sa, sb = _side(a), _side(b)
    notes = []
    if sa.basis != sb.basis:
        notes.append(
            f"A's steps are {BASES_DIFF.get(sa.basis, sa.basis)}; B's are {BASES_DIFF.get(sb.basis, sb.basis)}"
        )
    if sa.ranks != sb.ranks:
        notes.append(f"A has {sa.ranks} rank(s), B {sb.ranks}: figures are per step of the average rank")
    if CAPTURE_BASIS in (sa.basis, sb.basis):
        notes.append(
            "a trace without step marks counts its whole capture as one step: compare time per call "
            "(a_mean_ns, b_mean_ns) where the captures may hold different amounts of work"
        )
    return TraceDiff(
        step_a_ns=sa.step_ns,
        step_b_ns=sb.step_ns,
        steps_a=sa.steps,
        steps_b=sb.steps,
        basis_a=sa.basis,
        basis_b=sb.basis,
        ranks_a=sa.ranks,
        ranks_b=sb.ranks,
        categories=_category_table(sa, sb),
        kernels=_compare(sa.kernels, sb.kernels, ["category"], noise_pct)[KERNEL_COLUMNS],
        ops=_compare(sa.ops, sb.ops, ["total_ns"], noise_pct)[OP_COLUMNS],
        noise_pct=noise_pct,
        notes=tuple(notes),
    )


def diff_paths(
    path_a: str | Path, path_b: str | Path, *, noise_pct: float = NOISE_PCT, max_bytes: int = DEFAULT_MAX_BYTES
) -> TraceDiff:
    """``trace_diff`` of the traces at two paths (any file or folder ``advisor.trace.load`` reads, or
    one of our run directories)."""
    return trace_diff(
        load_trace(path_a, max_bytes=max_bytes), load_trace(path_b, max_bytes=max_bytes), noise_pct=noise_pct
    )


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.3f}"


def format_diff(d: TraceDiff, name_a: str, name_b: str, top: int = 10) -> str:
    """The CLI's readable diff: both step times, the category rows, the ``top`` kernels and ops of
    each status that changed."""
    out = []
    for label, name, steps, basis, ranks in (
        ("A", name_a, d.steps_a, d.basis_a, d.ranks_a),
        ("B", name_b, d.steps_b, d.basis_b, d.ranks_b),
    ):
        out.append(f"{label} = {name}: {ranks} rank(s), {steps} step(s) ({BASES_DIFF.get(basis, basis)})")
    pct = 100 * d.step_delta_ns / d.step_a_ns if d.step_a_ns else float("nan")
    out.append(
        f"Step: {_ms(d.step_a_ns)} -> {_ms(d.step_b_ns)} ms ({d.step_delta_ns / 1e6:+.3f} ms, {pct:+.1f} %), per step"
        + (" of the average rank" if max(d.ranks_a, d.ranks_b) > 1 else "")
    )
    out.extend(f"note: {n}" for n in d.notes)
    out.append("Where the step time went (ms per step; the rows sum to the step time):")
    out.append(f"  {'category':14s} {'A':>10s} {'B':>10s} {'change':>10s}")
    for r in d.categories.itertuples():
        out.append(f"  {r.category:14s} {_ms(r.a_ns):>10s} {_ms(r.b_ns):>10s} {r.delta_ns / 1e6:>+10.3f}")
    out.append(f"  {'step':14s} {_ms(d.step_a_ns):>10s} {_ms(d.step_b_ns):>10s} {d.step_delta_ns / 1e6:>+10.3f}")
    for table, what in (("kernels", "GPU kernels, copies and sets"), ("ops", "host ops, self time")):
        t = getattr(d, table)
        if t.empty:
            continue
        counts = t["status"].value_counts()
        summary = ", ".join(f"{counts.get(s, 0)} {s}" for s in STATUSES)
        out.append(f"{what[0].upper()}{what[1:]} ({summary}; changed: beyond {d.noise_pct:g} % and the step spread):")
        for status in STATUSES[:-1]:
            rows = d.top(table, status, top)
            if rows.empty:
                continue
            out.append(f"  {status}:")
            for r in rows.itertuples():
                per_call = (
                    f", {r.a_mean_ns / 1e3:.1f} -> {r.b_mean_ns / 1e3:.1f} us a call"
                    if status in ("slower", "faster")
                    else ""
                )
                out.append(
                    f"    {r.delta_ns / 1e6:+10.3f} ms  ({_ms(r.a_ns)} -> {_ms(r.b_ns)} ms, "
                    f"{r.a_count:g} -> {r.b_count:g} calls{per_call})  {str(r.name)[:100]}"
                )
    return "\n".join(out)
