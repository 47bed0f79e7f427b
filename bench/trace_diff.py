"""Trace diff: ours beside HolisticTraceAnalysis' TraceDiff, the noise a diff must see past, and its cost.

Run: ``.venv/bin/python bench/trace_diff.py [--hta-python /tmp/hta/bin/python] [--profile-pair]``.

1. HTA (``hta.trace_diff.TraceDiff.compare_traces``, in its own environment, in a child process) and
   ``advisor.analysis.diff.trace_diff`` on the two ranks of ../shared/traces/kineto/trace_filter, rank 0
   as A and rank 1 as B, each in a folder of its own (HTA compares one rank of each trace). HTA
   compares the first ProfilerStep of each, which is the one complete step ``trace_diff`` keeps (the
   last is cut, as in ``analyze``): per GPU event name and per ``cpu_op`` name, counts and summed
   durations must agree. HTA's op time is inclusive: ours is compared through ``a_total_ns``.
2. Noise: each trace with two or more steps diffed against itself, the first half of its steps as A
   and the second as B (the other half's step ranges removed). Nothing changed between them, so every
   name flagged slower or faster is a false alarm at that threshold. With ``--profile-pair`` the same
   for two runs of one tiny CPU setup profiled one after the other (what the Re-run view diffs).
3. The nsys before/after pair of ../shared/traces/nsys, with its total kernel time checked against a
   plain sqlite3 query.
4. Cost: load, ``analyze`` and ``trace_diff`` of a trace with itself, in one process, as ratios.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from advisor.analysis import breakdown as A
from advisor.analysis.diff import MIN_DELTA_NS, NOISE_PCT, trace_diff
from advisor.analysis.summary import analyze
from advisor.trace.load import load_trace
from advisor.trace.table import kind_mask

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces"
FILTER = TRACES / "kineto" / "trace_filter"
NSYS = TRACES / "nsys"
HTA_CHILD = """
import json, logging, sys
logging.disable(logging.WARNING)
from hta.trace_diff import DeviceType, LabeledTrace, TraceDiff
a, b = LabeledTrace("A", trace_dir=sys.argv[1]), LabeledTrace("B", trace_dir=sys.argv[2])
gpu = TraceDiff.compare_traces(a, b, device_type=DeviceType.GPU)
changes = TraceDiff.ops_diff(a, b, device_type=DeviceType.GPU)
def cpu_ops(t):
    s = t.get_ops_summary(t.extract_ops(device_type=DeviceType.CPU))
    return s[s["cat"] == "cpu_op"].groupby("name")[["counts", "total_duration"]].sum()
ops = {k: cpu_ops(t).reset_index().to_dict("records") for k, t in (("A", a), ("B", b))}
print(json.dumps({"gpu": gpu.reset_index().to_dict("records"), "ops": ops, "ops_diff": changes,
                  "iterations": [a.iterations(), b.iterations()]}))
"""


def hta_compare(hta_python: str) -> list[str]:
    """Section 1: per name, our counts and times against HTA's, on trace_filter rank 0 vs rank 1."""
    with tempfile.TemporaryDirectory() as tmp:
        dirs = []
        for r in (0, 1):
            d = Path(tmp) / f"rank{r}"
            d.mkdir()
            (d / f"sampled_rank-{r}.json.gz").symlink_to(FILTER / f"sampled_rank-{r}.json.gz")
            dirs.append(str(d))
        proc = subprocess.run([hta_python, "-c", HTA_CHILD, *dirs], capture_output=True, text=True, check=True)
    hta = json.loads(proc.stdout.strip().splitlines()[-1])
    ours = trace_diff(*(load_trace(FILTER / f"sampled_rank-{r}.json.gz") for r in (0, 1)))
    out = [
        "## 1. Against HTA: trace_filter rank 0 (A) vs rank 1 (B)",
        "",
        f"HTA compares iteration {hta['iterations'][0][0]} of each (of {hta['iterations'][0]}); ours keeps "
        f"{ours.steps_a} step per rank (the last, cut-off one dropped).",
        "",
        "| table | names (HTA / ours) | only in one | counts equal | max abs count diff | time equal (1 ns) | max abs time diff us |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    gpu = pd.DataFrame(hta["gpu"]).set_index("name")
    kernels = ours.kernels.groupby("name")[["a_count", "b_count", "a_ns", "b_ns"]].sum()
    out.append(_row("GPU events", gpu, kernels, "ns"))
    ops_h = pd.concat(
        [pd.DataFrame(hta["ops"][k]).set_index("name").add_prefix(f"{k}_") for k in ("A", "B")], axis=1
    ).fillna(0)
    ops = ours.ops.set_index("name")[["a_count", "b_count", "a_total_ns", "b_total_ns"]]
    out.append(_row("cpu_op (inclusive time)", ops_h, ops, "total_ns"))
    # HTA's ops_diff judges by count only; ours by time. Where the counts say a name was added or removed,
    # both must agree.
    added = set(hta["ops_diff"]["added"])
    deleted = set(hta["ops_diff"]["deleted"])
    by_status = {s: set(g) for s, g in ours.kernels.groupby("status")["name"]}
    out += [
        "",
        f"GPU names HTA's ops_diff calls added / deleted: {len(added)} / {len(deleted)}; ours added / removed: "
        f"{len(by_status.get('added', set()))} / {len(by_status.get('removed', set()))}; the same names: "
        f"{added == by_status.get('added', set()) and deleted == by_status.get('removed', set())}.",
        f"Step time: A {ours.step_a_ns / 1e6:.3f} ms, B {ours.step_b_ns / 1e6:.3f} ms; the category rows sum to "
        f"{ours.categories['a_ns'].sum() / 1e6:.3f} / {ours.categories['b_ns'].sum() / 1e6:.3f} ms.",
        "",
    ]
    return out


def _row(label: str, hta: pd.DataFrame, ours: pd.DataFrame, time_col: str) -> str:
    """One table row: names, counts and times of HTA's table (us) against ours (ns per step, 1 step)."""
    names_h, names_o = set(hta.index), set(ours.index)
    both = sorted(names_h & names_o)
    h, o = hta.loc[both], ours.loc[both]
    a_t, b_t = (f"a_{time_col}", f"b_{time_col}") if time_col != "ns" else ("a_ns", "b_ns")
    count_diff = np.maximum(
        (h["A_counts"].to_numpy() - o["a_count"].to_numpy()).__abs__(),
        (h["B_counts"].to_numpy() - o["b_count"].to_numpy()).__abs__(),
    )
    time_diff = np.maximum(
        np.abs(h["A_total_duration"].to_numpy() * 1000 - o[a_t].to_numpy()),
        np.abs(h["B_total_duration"].to_numpy() * 1000 - o[b_t].to_numpy()),
    )
    return (
        f"| {label} | {len(names_h)} / {len(names_o)} | {len(names_h ^ names_o)} | {(count_diff < 1e-9).sum()} of "
        f"{len(both)} | {count_diff.max():g} | {(time_diff < 1).sum()} of {len(both)} | {time_diff.max() / 1000:g} |"
    )


def _without_steps(df: pd.DataFrame, keep: slice) -> pd.DataFrame:
    """The table with the step ranges (``step`` and ``ProfilerStep#N``) outside ``keep`` removed, per rank."""
    marks = kind_mask(df, "annotation") & (df["device"].to_numpy() == -1)
    marks[marks] = A._per_name(df["name"], marks, lambda n: n == "step" or bool(A.PROFILER_STEP_RE.match(n)), bool)
    drop = np.zeros(len(df), dtype=bool)
    for r in np.unique(df["rank"].to_numpy()).tolist():
        for name in ("step", "profiler"):
            rows = np.flatnonzero(marks & (df["rank"].to_numpy() == r))
            texts = df["name"].to_numpy()[rows].astype(str)
            rows = rows[(texts == "step") if name == "step" else (texts != "step")]
            order = rows[np.argsort(df["start_ns"].to_numpy()[rows], kind="stable")]
            keep_rows = set(order[keep].tolist())
            drop[[i for i in order.tolist() if i not in keep_rows]] = True
    out = df[~drop]
    out.attrs = dict(df.attrs)
    return out


def _halves(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    """(the first half of a trace's complete steps, the second half), or None with fewer than 2 steps."""
    if df.attrs.get("source") == "kineto" and not df.attrs.get("own_run"):
        df = A.drop_last_profiler_step(df)
    n = min(
        (
            len(df[(df["rank"] == r).to_numpy() & (df["kind"] == "annotation").to_numpy()]["name"]
                .astype(str).pipe(lambda s: s[s.str.match(A.PROFILER_STEP_RE.pattern)]))
            for r in np.unique(df["rank"].to_numpy()).tolist()
        ),
        default=0,
    )  # fmt: skip
    if n < 2:
        return None
    half = n // 2
    return _without_steps(df, slice(0, half)), _without_steps(df, slice(half, 2 * half))


def noise_rows(name: str, a: pd.DataFrame, b: pd.DataFrame) -> list[str]:
    """Section 2's rows for one pair: how far the time per step of each name moved between halves."""
    d = trace_diff(a, b, trim_last_step=False)
    out = []
    for label, t in (("kernels", d.kernels), ("ops", d.ops)):
        if t.empty:
            continue
        both = t[(t["a_count"] > 0) & (t["b_count"] > 0) & (t["a_ns"] > MIN_DELTA_NS)]
        moved = both["delta_pct"].abs().to_numpy()
        weight = both["a_ns"].to_numpy() / both["a_ns"].sum()
        order = np.argsort(moved)
        cum = np.cumsum(weight[order])
        p = {q: moved[order][np.searchsorted(cum, q / 100)] for q in (50, 90, 99)}
        flagged = t["status"].isin(("slower", "faster"))
        flagged_time = (t.loc[flagged, "a_ns"].sum() / t["a_ns"].sum()) * 100
        out.append(
            f"| {name} | {label} | {d.steps_a} vs {d.steps_b} | {len(both)} | {p[50]:.2f} | {p[90]:.2f} | {p[99]:.2f} | "
            f"{flagged.sum()} ({flagged_time:.1f} % of time) | {d.step_delta_ns / max(d.step_a_ns, 1) * 100:+.2f} |"
        )
    return out


def noise_section(profile_pair: bool) -> list[str]:
    out = [
        "## 2. Noise: a trace's first half of steps (A) against its second half (B)",
        "",
        f"Percentiles are of |delta_pct| over the names in both halves with over {MIN_DELTA_NS} ns per step, "
        f"weighted by their time; flagged: names the default threshold ({NOISE_PCT:g} %) calls slower or faster.",
        "",
        "| trace | table | steps | names | p50 % | p90 % | p99 % | flagged at the default | step change % |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    sources = [TRACES / "kineto" / n for n in ("ns_resolution_trace", "nccl_parser_config")]
    sources += sorted(p for p in (ROOT / "traces").iterdir() if (p / "trace.json.gz").is_file())
    for path in sources:
        halves = _halves(load_trace(path))
        if halves is not None:
            out += noise_rows(path.name, *halves)
    if profile_pair:
        out += _profiled_pair()
    return [*out, ""]


def _profiled_pair() -> list[str]:
    """Two runs of one tiny CPU setup, one after the other: the run-to-run noise the Re-run view sees."""
    from advisor.run.launcher import profile_run
    from advisor.spec.options import RunOptions
    from advisor.spec.setup import make_setup
    from advisor.store.runstore import RunStore

    with tempfile.TemporaryDirectory() as tmp:
        store = RunStore(tmp)
        setup = make_setup(model="tiny", gpu="cpu", seq=128, micro_batch=4, precision="fp32")
        runs = [profile_run(setup, RunOptions(device="cpu", steps=2), store) for _ in range(2)]
        if any(r.status != "ok" for r in runs):
            return [f"| profiled pair | - | - | - | - | - | - | runs failed: {[r.status for r in runs]} | - |"]
        return noise_rows("two runs of tiny, seq 128 x 4, fp32 (CPU)", *(load_trace(r.path) for r in runs))


def nsys_section() -> list[str]:
    """Section 3: the nsys pair, with its kernel time checked against sqlite3."""
    before, after = NSYS / "nsysai_mfu_2gpu_before.sqlite", NSYS / "nsysai_mfu_2gpu_after.sqlite"
    d = trace_diff(load_trace(before), load_trace(after))
    out = ["## 3. The nsys before/after pair (nsysai_mfu_2gpu)", ""]
    for label, path, ours in (("before", before, d.kernels["a_ns"]), ("after", after, d.kernels["b_ns"])):
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
            total, gpus = db.execute(
                "SELECT SUM(end - start), COUNT(DISTINCT deviceId) FROM CUPTI_ACTIVITY_KIND_KERNEL"
            ).fetchone()
        kernels = d.kernels[~d.kernels["category"].isin(("memcpy", "memset"))]
        mine = kernels["a_ns" if label == "before" else "b_ns"].sum()
        out.append(
            f"- {label}: kernel time per capture of the average rank {mine / 1e6:.3f} ms; sqlite3 "
            f"SUM(end - start) over KERNEL / {gpus} GPUs = {total / gpus / 1e6:.3f} ms (all GPU events: {ours.sum() / 1e6:.3f} ms)"
        )
    cat = d.categories.assign(**{c: d.categories[c] / 1e6 for c in ("a_ns", "b_ns", "delta_ns")})
    total = cat[["a_ns", "b_ns", "delta_ns"]].sum()
    cat = cat.round(3)
    out += [
        f"- step (the capture: {d.basis_a}): {d.step_a_ns / 1e6:.3f} -> {d.step_b_ns / 1e6:.3f} ms; categories (ms):",
        "",
        "| category | A ms | B ms | delta ms |",
        "|---|---:|---:|---:|",
        *(f"| {r.category} | {r.a_ns} | {r.b_ns} | {r.delta_ns:+} |" for r in cat.itertuples()),
        f"| sum | {total['a_ns']:.3f} | {total['b_ns']:.3f} | {total['delta_ns']:+.3f} |",
        "",
        "Status counts, kernels: "
        + ", ".join(f"{k} {v}" for k, v in d.kernels["status"].value_counts().items())
        + "; ops: "
        + ", ".join(f"{k} {v}" for k, v in d.ops["status"].value_counts().items()),
        "",
    ]
    return out


def cost_section(repeats: int) -> list[str]:
    out = [
        "## 4. Cost: trace_diff of a trace with itself, against loading it and analyze()",
        "",
        f"Best of {repeats} in one process; ratios only (the machine is shared).",
        "",
        "| trace | events | diff / load | diff / analyze |",
        "|---|---:|---:|---:|",
    ]
    paths = [TRACES / "kineto" / n for n in ("ns_resolution_trace", "nccl_parser_config", "trace_filter")]
    paths += [NSYS / "nsysai_mfu_2gpu_before.sqlite"]
    for path in paths:
        times = {"load": [], "analyze": [], "diff": []}
        for _ in range(repeats):
            t0 = time.perf_counter()
            df = load_trace(path)
            t1 = time.perf_counter()
            analyze(df)
            t2 = time.perf_counter()
            trace_diff(df, df)
            t3 = time.perf_counter()
            times["load"].append(t1 - t0)
            times["analyze"].append(t2 - t1)
            times["diff"].append(t3 - t2)
        best = {k: min(v) for k, v in times.items()}
        out.append(
            f"| {path.name} | {len(df):,} | {best['diff'] / best['load']:.2f} | {best['diff'] / best['analyze']:.2f} |"
        )
    return [*out, ""]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hta-python", default="/tmp/hta/bin/python", help="HTA's interpreter (default: %(default)s)")
    parser.add_argument("--profile-pair", action="store_true", help="also profile two tiny CPU runs and diff them")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not TRACES.is_dir():
        print(f"the shared traces are not at {TRACES}", file=sys.stderr)
        return 1
    lines = ["# Trace diff: ours vs HTA's TraceDiff, noise, cost", ""]
    if Path(args.hta_python).exists():
        lines += hta_compare(args.hta_python)
    else:
        lines += [f"HTA not found at {args.hta_python}: section 1 skipped.", ""]
    lines += noise_section(args.profile_pair) + nsys_section() + cost_section(args.repeats)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
