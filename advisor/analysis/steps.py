"""Training steps and their phases in a trace of someone else's training loop.

Our own runs mark step/data/forward/backward/optimizer with ranges (``advisor.analysis.breakdown.
phase_breakdown`` reads them), and a loop that calls ``prof.step()`` leaves ``ProfilerStep#N``. A loop
profiled under a plain ``with profile():`` (a Hugging Face model trained for a few steps, a
notebook) leaves neither, yet PyTorch itself records what a step is made of:

- every ``torch.optim`` optimizer wraps its update in ``Optimizer.step#<Class>.step`` (and
  ``Optimizer.zero_grad#<Class>.zero_grad``): a step ends where its optimizer update ends;
- the autograd engine runs each backward node as ``autograd::engine::evaluate_function: ...``: the
  backward pass is the stretch from the first to the last of them in a step;
- the DataLoader's iterator records ``enumerate(DataLoader)#...__next__``: the data phase.

The steps come, in order of preference, from ``ProfilerStep#N``, from the user's own top-level range
that repeats once per optimizer update (``record_function("train_step")``), or from the optimizer
updates themselves (step k runs from the end of update k-1, or the rank's first host event, to the end
of update k). Forward is what the step spends on the host before its backward pass starts, less the
data and zero_grad ranges there.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from advisor.analysis.breakdown import PROFILER_STEP_RE, _per_name
from advisor.trace.table import kind_mask

OPTIMIZER_STEP_RE = re.compile(r"^Optimizer\.step#(\w+)\.step$")
ZERO_GRAD_RE = re.compile(r"^Optimizer\.zero_grad#\w+\.zero_grad$")
BACKWARD_RE = re.compile(r"^autograd::engine::evaluate_function: ")
DATA_RE = re.compile(r"^enumerate\(DataLoader\)#")
PHASE_COLUMNS = ("rank", "phase", "count", "total_ns", "mean_ns", "basis")
BASES = {
    "ranges": "the trace's own step/phase ranges",
    "profiler steps": "ProfilerStep#N ranges; phases from the optimizer, autograd and DataLoader ranges inside them",
    "user range": "the user's top-level range repeated once per optimizer update",
    "optimizer steps": "no step ranges: a step ends where each Optimizer.step range ends",
}
"""How the steps of a phases table were found (its ``basis`` column), for people."""


_MARKS = {
    "profiler": PROFILER_STEP_RE,
    "update": OPTIMIZER_STEP_RE,
    "zero_grad": ZERO_GRAD_RE,
    "data": DATA_RE,
    "backward": BACKWARD_RE,
}
"""What a host event's name may mark, by the pattern that says it."""


def _marks(names: pd.Series) -> dict[str, np.ndarray]:
    """Per row, for each of ``_MARKS``: whether the name matches. Each distinct name is judged once
    (``breakdown._per_name``), and a regex runs only where its first letter can start the mark (an
    nsys export's thousands of NVTX texts are mostly passed over)."""
    every = slice(None)
    return {
        mark: _per_name(names, every, lambda n, p=pattern: n[:1] == p.pattern[1] and bool(p.match(n)), bool)
        for mark, pattern in _MARKS.items()  # every pattern is anchored (^) and starts with a literal letter
    }


def _host(df: pd.DataFrame) -> pd.DataFrame:
    """Host ops and ranges of the table, with their end and what each name marks."""
    rows = kind_mask(df, "cpu_op", "annotation") & (df["device"].to_numpy() == -1)
    host = df.loc[rows, ["rank", "kind", "name", "start_ns", "dur_ns", "tid"]]
    ranged = (host["kind"] == "annotation").to_numpy()
    marks = _marks(host["name"])
    return host.assign(
        end_ns=host["start_ns"] + host["dur_ns"],
        profiler=marks["profiler"] & ranged,
        update=marks["update"] & ranged,
        before=(marks["data"] | marks["zero_grad"]) & ranged,
        data=marks["data"] & ranged,
        backward=marks["backward"],
    )


def _marks_any(df: pd.DataFrame, *marks: str) -> bool:
    """Whether any name in the table matches one of ``marks`` (a cheap test before ``_host``)."""
    names = df["name"]
    labels = names.cat.categories if names.dtype == "category" else names.unique()
    return any(_MARKS[m].match(str(c)) for c in labels for m in marks if str(c)[:1] == _MARKS[m].pattern[1])


def _top_level(events: pd.DataFrame) -> pd.DataFrame:
    """The events not nested inside another event of the same thread."""
    keep = []
    for _, group in events.sort_values(["start_ns", "dur_ns"], ascending=[True, False]).groupby("tid", sort=False):
        reach = np.maximum.accumulate(group["end_ns"].to_numpy())
        starts = group["start_ns"].to_numpy()
        inside = np.zeros(len(group), dtype=bool)
        inside[1:] = starts[1:] < reach[:-1]
        keep.append(group[~inside])
    return pd.concat(keep) if keep else events.iloc[:0]


def _windows(rank_host: pd.DataFrame, updates: pd.DataFrame) -> tuple[list[tuple[int, int]], str]:
    """(start, end) of each step of one rank and how they were found; [] where nothing marks a step."""
    profiler = rank_host[rank_host["profiler"]]
    if len(profiler):
        return sorted(zip(profiler["start_ns"].tolist(), profiler["end_ns"].tolist(), strict=True)), "profiler steps"
    if updates.empty:
        return [], ""
    ends = updates["end_ns"].to_numpy()
    ranges = _top_level(rank_host[(rank_host["kind"] == "annotation").to_numpy() & ~rank_host["update"].to_numpy()])
    for _, group in ranges.groupby("name", observed=True):
        if len(group) < 2 or len(group) != len(updates):
            continue
        s, e = group["start_ns"].to_numpy(), group["end_ns"].to_numpy()
        if all(((ends > a) & (ends <= b)).sum() == 1 for a, b in zip(s, e, strict=True)):
            return sorted(zip(s.tolist(), e.tolist(), strict=True)), "user range"
    starts = [int(rank_host["start_ns"].min()), *ends[:-1].tolist()]
    return list(zip(starts, ends.tolist(), strict=True)), "optimizer steps"


def step_windows(df: pd.DataFrame) -> pd.DataFrame:
    """Each step the trace marks, per rank, as ``inferred_phases`` finds them: ``rank``, ``step`` (its
    position in the rank's steps, from 0), ``start_ns``, ``end_ns`` and ``basis`` (see ``BASES``).
    Empty where nothing marks a step."""
    rows = []
    if _marks_any(df, "profiler", "update"):
        for rank, rank_host in _host(df).groupby("rank"):
            windows, basis = _windows(rank_host, rank_host[rank_host["update"]].sort_values("start_ns"))
            rows.extend((int(rank), i, a, b, basis) for i, (a, b) in enumerate(windows))
    out = pd.DataFrame(rows, columns=["rank", "step", "start_ns", "end_ns", "basis"])
    return out.astype({"rank": "int32", "step": "int64", "start_ns": "int64", "end_ns": "int64"})


def inferred_phases(df: pd.DataFrame) -> pd.DataFrame:
    """Per rank and phase (step, data, forward, backward, optimizer): count of steps that have it,
    total and mean in ns, and the ``basis`` the steps were found on (see ``BASES``), for a trace whose
    loop marked no phases of its own. Empty where nothing in the trace marks a step."""
    if not _marks_any(df, "profiler", "update"):
        return pd.DataFrame(columns=list(PHASE_COLUMNS)).astype(
            {"rank": "int32", "count": "int64", "total_ns": "int64", "mean_ns": "float64"}
        )
    host = _host(df)
    rows = []
    for rank, rank_host in host.groupby("rank"):
        updates = rank_host[rank_host["update"]].sort_values("start_ns")
        windows, basis = _windows(rank_host, updates)
        # (start, end) arrays of what the phases are made of; per step only numpy on these.
        spans = {
            "optimizer": updates,
            "data": rank_host[rank_host["data"]],
            "backward": _top_level(rank_host[rank_host["backward"]]),
            "before": rank_host[rank_host["before"]],
        }
        spans = {k: (v["start_ns"].to_numpy(), v["end_ns"].to_numpy()) for k, v in spans.items()}
        per_phase: dict[str, list[int]] = {p: [] for p in ("step", "data", "forward", "backward", "optimizer")}
        for start, end in windows:
            per_phase["step"].append(end - start)

            def inside(kind: str, lo: int = start, hi: int = end, of=spans) -> tuple[np.ndarray, np.ndarray]:
                a, b = of[kind]
                keep = (a >= lo) & (b <= hi)
                return a[keep], b[keep]

            for kind in ("optimizer", "data"):
                a, b = inside(kind)
                if len(a):
                    per_phase[kind].append(int((b - a).sum()))
            a, b = inside("backward")
            if len(a):
                first = int(a.min())
                per_phase["backward"].append(int(b.max()) - first)
                ahead_a, ahead_b = inside("before", start, first)
                per_phase["forward"].append(first - start - int((ahead_b - ahead_a).sum()))
        for phase, values in per_phase.items():
            if values:
                total = int(sum(values))
                rows.append((int(rank), phase, len(values), total, total / len(values), basis))
    out = pd.DataFrame(rows, columns=list(PHASE_COLUMNS))
    return out.astype({"rank": "int32", "count": "int64", "total_ns": "int64", "mean_ns": "float64"})


def step_phases(df: pd.DataFrame, ranged: pd.DataFrame) -> pd.DataFrame:
    """The phases table of a trace: the trace's own ranges (``ranged``, ``phase_breakdown``), and for
    each rank the phases they lack taken from ``inferred_phases``; the ``basis`` column says where
    each row came from ('ranges', or how the inferred steps were found)."""
    ranged = ranged.assign(basis="ranges")
    if {"forward", "backward", "optimizer"} <= set(ranged["phase"]):
        return ranged
    inferred = inferred_phases(df)
    if inferred.empty:
        return ranged
    have = set(zip(ranged["rank"].tolist(), ranged["phase"].tolist(), strict=True))
    missing = [(r, p) not in have for r, p in zip(inferred["rank"].tolist(), inferred["phase"].tolist(), strict=True)]
    return pd.concat([ranged, inferred[missing]], ignore_index=True) if ranged.size else inferred


def optimizer_of(df: pd.DataFrame) -> str | None:
    """The optimizer the trace ran and its implementation, as our runs label it: 'adamw (for-loop)',
    'adamw (foreach)', 'sgd (fused)'; None where the trace has no ``Optimizer.step`` range. The
    implementation is read from the ops inside the update: ``_fused_*`` kernels (fused=True),
    ``_foreach_*`` ops (foreach=True, PyTorch's default on CUDA), else one small op set per parameter
    tensor (the for-loop)."""
    if not _marks_any(df, "update"):
        return None
    host = _host(df)
    updates = host[host["update"]]
    if updates.empty:
        return None
    name = OPTIMIZER_STEP_RE.match(str(updates["name"].iloc[0])).group(1).lower()
    ops = host[host["kind"] == "cpu_op"]
    start, end = ops["start_ns"].to_numpy(), ops["end_ns"].to_numpy()
    within = np.zeros(len(ops), dtype=bool)
    for a, b in zip(updates["start_ns"].tolist(), updates["end_ns"].tolist(), strict=True):
        within |= (start >= a) & (end <= b)
    names = {str(n) for n in ops.loc[within, "name"].unique()}
    if any(n.startswith("aten::_fused_") for n in names):
        impl = "fused"
    elif any(n.startswith("aten::_foreach_") for n in names):
        impl = "foreach"
    else:
        impl = "for-loop"
    return f"{name} ({impl})"


FUSED_ATTENTION_RE = re.compile(
    r"^aten::_(scaled_dot_product_(flash|efficient|cudnn|fused)_attention\w*|flash_attention_forward|efficient_attention_forward)$"
)
"""The fused attention ops SDPA dispatches to (flash, memory-efficient, cuDNN, the CPU's flash kernel)."""


def fused_attention(df: pd.DataFrame) -> bool | None:
    """True where the trace's ops include a fused attention kernel; None where it shows none (an
    unfused attention is not told apart from a model without attention here)."""
    names = df.loc[kind_mask(df, "cpu_op"), "name"]
    used = names.cat.remove_unused_categories().cat.categories if names.dtype == "category" else names.unique()
    return True if any(FUSED_ATTENTION_RE.match(str(n)) for n in used) else None
