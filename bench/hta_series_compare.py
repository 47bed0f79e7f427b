"""Queue length, time blocked on a full launch queue, idle intervals and copy bandwidth
(``advisor/analysis/queues.py``): ours beside HolisticTraceAnalysis' own outputs on the three shared
Kineto traces, then ours on the nsys exports (which HTA does not read), then what the analyses cost
beside the whole ``analyze()``.

Run: ``.venv/bin/python bench/hta_series_compare.py [--hta-python /tmp/hta/bin/python] [--out
bench/results/hta_series.md]``. HTA (0.5.0) lives in its own environment (``python3 -m venv /tmp/hta &&
/tmp/hta/bin/pip install HolisticTraceAnalysis``) and runs in a child process here, on the same files;
its 0.5.0 reference CSVs in ``../shared/traces/reference/<trace>/`` (made on another machine) are shown
beside it.

For HTA's definitions our tables are computed on the trace as HTA sees it: the last ProfilerStep cut
off (``drop_last_profiler_step``) and, on sub-microsecond traces, every event shrunk to whole
microseconds (``round_like_hta``); queue lengths with ``dequeue="start"``. Our own figures (what
``analyze()`` reports) keep nanoseconds and count an operation until it ends. Where the two differ the
script measures why: how many tied time stamps HTA's unstable sort ordered differently from our rule
(departures first), the float residues HTA counts as bandwidth points, and Kineto's bandwidth argument
against bytes over the recorded duration.
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

from advisor.analysis import queues as Q
from advisor.analysis.breakdown import drop_last_profiler_step, launch_calls, round_like_hta
from advisor.analysis.summary import analyze
from advisor.trace.kineto import load_kineto
from advisor.trace.load import load_trace
from advisor.trace.table import concat_tables, kind_mask

ROOT = Path(__file__).resolve().parents[1]

TRACES = ROOT.parent / "shared" / "traces"
KINETO = ("trace_filter", "nccl_parser_config", "ns_resolution_trace")
NSYS = ("nsysai_mfu_2gpu_before", "nsysai_mfu_2gpu_after", "pipit_cloverleaf_cuda")
# Queue limits to check the blocked time at: CUDA's 1024 (HTA's default) and one each trace reaches.
LIMITS = {"trace_filter": (1024, 50), "nccl_parser_config": (1024, 5), "ns_resolution_trace": (1024, 1020)}
STAT_COLS = ("count", "mean", "std", "min", "25%", "50%", "75%", "max")
OUR_STATS = ("mean", "std", "min", "p25", "p50", "p75", "max")
SYNTHETIC_RANKS = 64  # ranks of the replicated table the cost is also measured on

HTA_CHILD = r"""
import json, logging, sys
import numpy as np
import pandas as pd
logging.disable(logging.WARNING)
from hta.trace_analysis import TraceAnalysis
folder, limits = sys.argv[1], json.loads(sys.argv[2])
a = TraceAnalysis(trace_dir=folder)
ranks = a.t.get_ranks()
out = {"ranks": ranks}
def frame(df):
    df = df.reset_index()
    return json.loads(df.to_json(orient="records"))
ql = a.get_queue_length_time_series(ranks)
# HTA's own series with the events at each time re-sorted by our rule (departures first): the tie
# order alone, everything else HTA's. "ties": times at which a stream has both launches and departures.
ties, resorted = {}, []
for rank, series in ql.items():
    for stream, s in series.groupby("stream"):
        step = s["queue_length"].diff().fillna(s["queue_length"]).to_numpy()
        ts = s["ts"].to_numpy()
        order = np.lexsort((step, ts))
        values = np.cumsum(step[order])
        _, first, counts = np.unique(ts, return_index=True, return_counts=True)
        both = 0
        for f, c in zip(first.tolist(), counts.tolist()):
            st = step[f : f + c]
            both += int((st > 0).any() and (st < 0).any())
        ties[f"{rank}/{stream}"] = both
        d = pd.Series(values).describe()
        resorted.append({"rank": rank, "stream": int(stream), **{k: float(v) for k, v in d.items()}})
out["queue_ties"], out["queue_resorted"] = ties, resorted
out["queue"] = frame(a.get_queue_length_summary_from_time_series(ql).droplevel(0, axis=1))
out["blocked"] = {
    str(lim): frame(a.get_time_spent_blocked_on_full_queue(ql, max_queue_length=lim)) for lim in limits
}
out["trace_duration"] = {str(r): float(a.t.get_trace_duration(r)) for r in ranks}
idle = []
for r in ranks:
    _, stats = a.get_idle_time_breakdown(ranks=[r], visualize=False, show_idle_interval_stats=True)
    stats = stats.reset_index()
    stats["rank"] = r
    idle += frame(stats)
out["idle"] = idle
out["bw"] = frame(a.get_memory_bw_summary(ranks).droplevel(0, axis=1))
# Bandwidth series: float residues (positive values under 1e-9 GB/s where HTA's sum should be 0), and
# HTA's series re-sorted by our rule (at one time, ends before starts) with residues set to 0.
resid, resorted_bw = {}, []
for rank, series in a.get_memory_bw_time_series(ranks).items():
    for name, s in series.groupby("name"):
        v = s["memory_bw_gbps"].to_numpy()
        resid[f"{rank}/{name}"] = int(((v > 0) & (v < 1e-9)).sum())
        step = np.diff(np.r_[0.0, v])
        order = np.lexsort((step, s["ts"].to_numpy()))
        level = np.cumsum(step[order])
        level[np.abs(level) < 1e-9] = 0.0
        d = pd.Series(level[level > 0]).describe()
        resorted_bw.append({"rank": rank, "name": name, **{k: float(x) for k, x in d.items()}})
out["bw_residues"], out["bw_resorted"] = resid, resorted_bw
print(json.dumps(out))
"""


def run_hta(python: str, folder: str) -> dict:
    proc = subprocess.run(
        [python, "-c", HTA_CHILD, str(TRACES / "kineto" / folder), json.dumps(LIMITS[folder])],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def reference(folder: str, name: str) -> pd.DataFrame:
    path = TRACES / "reference" / folder / f"{name}.csv"
    if name == "idle_interval_stats":
        return pd.read_csv(path)
    df = pd.read_csv(path, header=[0, 1], index_col=[0, 1])
    df.columns = df.columns.droplevel(0)
    return df.reset_index()


def md_table(df: pd.DataFrame, digits: int = 2) -> str:
    """A markdown table of ``df`` with floats to ``digits`` decimals."""
    cols = list(df.columns)
    lines = ["| " + " | ".join(map(str, cols)) + " |", "|" + "---|" * len(cols)]
    for row in df.itertuples(index=False):
        cells = []
        for v in row:
            if isinstance(v, float | np.floating):
                cells.append("" if np.isnan(v) else f"{v:.{digits}f}")
            else:
                cells.append(str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def kineto_bandwidth(folder: str) -> dict[tuple[int, int], float]:
    """Kineto's ``memory bandwidth (GB/s)`` argument of each copy and set, by (rank, correlation id)."""
    out = {}
    files = sorted((TRACES / "kineto" / folder).glob("*.json.gz"))
    for rank, f in enumerate(files):
        with gzip.open(f, "rt") as fh:
            trace = json.load(fh)
        rank = int((trace.get("distributedInfo") or {}).get("rank", rank))
        for e in trace["traceEvents"]:
            args = e.get("args") or {}
            if e.get("cat") in ("gpu_memcpy", "gpu_memset") and "memory bandwidth (GB/s)" in args:
                out[(rank, int(args["correlation"]))] = float(args["memory bandwidth (GB/s)"])
    return out


def queue_section(folder: str, hta: dict, hta_view: pd.DataFrame, ours_ns: pd.DataFrame) -> list[str]:
    ref = reference(folder, "queue_length_summary")
    here = pd.DataFrame(hta["queue"])
    theirs = Q.queue_length_summary(hta_view, dequeue="start")
    native_start = Q.queue_length_summary(ours_ns, dequeue="start")
    native = Q.queue_length_summary(ours_ns)
    rows = []
    for r in theirs.itertuples():
        key = (ref["rank"] == r.rank) & (ref["stream"] == r.stream)
        h = here[(here["rank"] == r.rank) & (here["stream"] == r.stream)]
        ties = hta["queue_ties"].get(f"{r.rank}/{r.stream}", 0)
        resorted = next(x for x in hta["queue_resorted"] if x["rank"] == r.rank and x["stream"] == r.stream)
        n = native[(native["rank"] == r.rank) & (native["stream"] == r.stream)].iloc[0]
        ns = native_start[(native_start["rank"] == r.rank) & (native_start["stream"] == r.stream)].iloc[0]
        for label, src in (
            ("HTA reference", ref[key].iloc[0]),
            ("HTA here", h.iloc[0]),
            ("HTA here, ties departures first", resorted),
        ):
            rows.append([r.rank, r.stream, label, *(float(src[c]) for c in STAT_COLS), "", ""])
        ours = [float(r.change_count), *(float(getattr(r, f"{s}_ops")) for s in OUR_STATS)]
        rows.append([r.rank, r.stream, "ours, HTA's view (start)", *ours, ties, ""])
        rows.append(
            [
                r.rank,
                r.stream,
                "ours, ns (start)",
                ns["change_count"],
                *(ns[f"{s}_ops"] for s in OUR_STATS),
                "",
                ns["time_mean_ops"],
            ]
        )
        rows.append(
            [
                r.rank,
                r.stream,
                "ours, ns (end): analyze()",
                n["change_count"],
                *(n[f"{s}_ops"] for s in OUR_STATS),
                "",
                n["time_mean_ops"],
            ]
        )
    table = pd.DataFrame(
        rows, columns=["rank", "stream", "source", *STAT_COLS, "tied times in HTA", "time-weighted mean"]
    )
    return [f"### {folder}: queue length (operations)", "", md_table(table, 3), ""]


def blocked_section(folder: str, hta: dict, hta_view: pd.DataFrame, ours_ns: pd.DataFrame) -> list[str]:
    rows = []
    for limit in LIMITS[folder]:
        theirs = pd.DataFrame(hta["blocked"][str(limit)])
        ours = Q.blocked_on_full_queue(hta_view, limit, dequeue="start")
        native = Q.blocked_on_full_queue(ours_ns, limit)
        for r in ours.itertuples():
            h = theirs[(theirs["rank"] == r.rank) & (theirs["stream"] == r.stream)] if len(theirs) else theirs
            n = native[(native["rank"] == r.rank) & (native["stream"] == r.stream)].iloc[0]
            if r.blocked_ns == 0 and h.empty and n["blocked_ns"] == 0:
                continue
            duration = hta["trace_duration"][str(r.rank)]
            rows.append(
                [
                    limit,
                    r.rank,
                    r.stream,
                    float(h["duration_at_max_queue_length"].iloc[0]) if len(h) else float("nan"),
                    100 * float(h["relative_duration_at_max_queue_length"].iloc[0]) if len(h) else float("nan"),
                    r.blocked_ns / 1000,
                    100 * r.blocked_ns / 1000 / duration,
                    r.peak_ops,
                    n["blocked_ns"] / 1000,
                    n["blocked_pct"],
                    n["peak_ops"],
                ]
            )
    cols = [
        "limit",
        "rank",
        "stream",
        "HTA us",
        "HTA % of its trace span",
        "ours (start) us",
        "ours (start) % of HTA's span",
        "peak (start)",
        "ours ns (end) us",
        "ours % of kernel span",
        "peak (end)",
    ]
    out = [f"### {folder}: time at a full launch queue", ""]
    if rows:
        out += [md_table(pd.DataFrame(rows, columns=cols), 2), ""]
    unreached = [str(lim) for lim in LIMITS[folder] if lim not in {row[0] for row in rows}]
    if unreached:
        out += [f"No stream of this trace reaches a queue of {' or '.join(unreached)} (HTA: no rows either).", ""]
    return out


def idle_section(folder: str, hta: dict, hta_view: pd.DataFrame) -> list[str]:
    ref = reference(folder, "idle_interval_stats")
    here = pd.DataFrame(hta["idle"])
    ours = Q.idle_interval_stats(hta_view)
    worst = {c: 0.0 for c in STAT_COLS}
    extra = []
    for r in ours.itertuples():
        key = (ref["rank"] == r.rank) & (ref["stream"] == r.stream) & (ref["idle_category"] == r.idle_category)
        if not key.any():
            extra.append(f"{r.rank}/{r.stream}/{r.idle_category} ({r.interval_count})")
            continue
        src = ref[key].iloc[0]
        mine = [float(r.interval_count), *(getattr(r, f"{s}_ns") / 1000 for s in OUR_STATS)]
        for c, v in zip(STAT_COLS, mine, strict=True):
            if not (np.isnan(v) and np.isnan(src[c])):
                worst[c] = max(worst[c], abs(v - float(src[c])))
    rows = []
    for r in ours[ours["interval_count"] > 0].itertuples():
        h = here[(here["rank"] == r.rank) & (here["stream"] == r.stream) & (here["idle_category"] == r.idle_category)]
        ref_row = ref[(ref["rank"] == r.rank) & (ref["stream"] == r.stream) & (ref["idle_category"] == r.idle_category)]
        rows.append(
            [
                r.rank,
                r.stream,
                r.idle_category,
                float(ref_row["count"].iloc[0]) if len(ref_row) else float("nan"),
                float(h["count"].iloc[0]) if len(h) else float("nan"),
                r.interval_count,
                float(ref_row["mean"].iloc[0]) if len(ref_row) else float("nan"),
                float(h["mean"].iloc[0]) if len(h) else float("nan"),
                r.mean_ns / 1000,
                float(ref_row["50%"].iloc[0]) if len(ref_row) else float("nan"),
                r.p50_ns / 1000,
                float(ref_row["max"].iloc[0]) if len(ref_row) else float("nan"),
                r.max_ns / 1000,
            ]
        )
    cols = [
        "rank",
        "stream",
        "category",
        "count ref",
        "count HTA here",
        "count ours",
        "mean us ref",
        "mean us HTA here",
        "mean us ours",
        "median ref",
        "median ours",
        "max ref",
        "max ours",
    ]
    return [
        f"### {folder}: idle intervals (HTA's view; us)",
        "",
        md_table(pd.DataFrame(rows, columns=cols), 2),
        "",
        "Largest difference from the reference CSV over all its rows (it prints two decimals): "
        + ", ".join(f"{c} {v:.4f}" for c, v in worst.items())
        + ". Rows only we list (count 0): "
        + (", ".join(extra) or "none")
        + ".",
        "",
    ]


HTA_NAMES = {
    "HtoD": "Memcpy HtoD",
    "DtoH": "Memcpy DtoH",
    "DtoD": "Memcpy DtoD",
    "PtoP": "Memcpy PtoP",
    "memset": "Memset",
}


def bw_section(folder: str, hta: dict, ours_ns: pd.DataFrame) -> list[str]:
    ref = reference(folder, "memory_bw_summary")
    here = pd.DataFrame(hta["bw"])
    ours = Q.memory_bw_summary(ours_ns)
    # Kineto's argument against bytes over the recorded duration, per copy.
    arg = kineto_bandwidth(folder)
    copies = ours_ns[kind_mask(ours_ns, "memcpy", "memset")]
    keys = list(zip(copies["rank"].tolist(), copies["correlation"].tolist(), strict=True))
    kineto = np.array([arg.get(k, np.nan) for k in keys])
    ratio = (copies["bytes"].to_numpy() / copies["dur_ns"].to_numpy()) / kineto
    # Our summary again with each copy's duration set to what Kineto's argument implies.
    implied = ours_ns.copy()
    at = np.flatnonzero(kind_mask(ours_ns, "memcpy", "memset"))
    ok = np.isfinite(kineto) & (kineto > 0)
    implied.iloc[at[ok], implied.columns.get_loc("dur_ns")] = np.rint(
        copies["bytes"].to_numpy()[ok] / kineto[ok]
    ).astype(np.int64)
    with_arg = Q.memory_bw_summary(implied)
    rows = []
    for r in ours.itertuples():
        name = HTA_NAMES.get(str(r.copy_kind), str(r.copy_kind))
        ref_row = ref[(ref["rank"] == r.rank) & (ref["name"] == name)]
        h = here[(here["rank"] == r.rank) & (here["name"] == name)]
        w = with_arg[(with_arg["rank"] == r.rank) & (with_arg["copy_kind"] == r.copy_kind)].iloc[0]
        resorted = pd.DataFrame([x for x in hta["bw_resorted"] if x["rank"] == r.rank and x["name"] == name])
        for label, src in (
            ("HTA reference", ref_row),
            ("HTA here", h),
            ("HTA here, ends first, no residue", resorted),
        ):
            if len(src):
                rows.append([r.rank, name, label, *(float(src[c].iloc[0]) for c in STAT_COLS)])
        rows.append(
            [r.rank, name, "ours (ns): analyze()", float(r.point_count), *(getattr(r, f"{s}_gbps") for s in OUR_STATS)]
        )
        rows.append(
            [r.rank, name, "ours, Kineto's bandwidth", float(w["point_count"]), *(w[f"{s}_gbps"] for s in OUR_STATS)]
        )
    table = pd.DataFrame(rows, columns=["rank", "kind", "source", *STAT_COLS])
    resid = sum(hta["bw_residues"].values())
    return [
        f"### {folder}: copy bandwidth (GB/s)",
        "",
        md_table(table, 4),
        "",
        f"Bytes over recorded duration / Kineto's argument, per copy: {np.nanmin(ratio):.4f} to {np.nanmax(ratio):.4f}. "
        f"In HTA's series here: {resid} float residue point(s) (0 < GB/s < 1e-9, counted as bandwidth). "
        "'HTA here, ends first, no residue' is HTA's own series with the events at each time re-sorted by our "
        "rule and its residues set to 0.",
        "",
    ]


def nsys_section() -> list[str]:
    out = ["## Nsight Systems exports (no HTA reference: HTA reads Kineto JSON only)", ""]
    for name in NSYS:
        df = load_trace(TRACES / "nsys" / f"{name}.sqlite")
        report = analyze(df, name)
        out += [f"### {name}", ""]
        q = report.tables["queue_length"]
        out += [md_table(q, 2), ""]
        b = report.tables["blocked_on_full_queue"]
        out += [md_table(b, 2), ""]
        idle = report.tables["idle_intervals"]
        out += [
            md_table(
                idle.assign(**{c: idle[c] / 1000 for c in idle.columns if c.endswith("_ns")}).rename(
                    columns={c: c[:-3] + "_us" for c in idle.columns if c.endswith("_ns")}
                ),
                2,
            ),
            "",
        ]
        out += [md_table(report.tables["memory_bw"], 3), ""]
    return out


def cost_section() -> list[str]:
    """Time of the five tables (queue series once, its summary and blocked time, idle interval stats,
    bandwidth summary) as a share of the whole analyze() on each trace, best of 3."""

    def best(fn, repeats=3) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    def ours(df: pd.DataFrame) -> None:
        launches = launch_calls(df)
        series = Q.queue_length_series(df, launches=launches)
        Q.queue_length_summary(df, series=series)
        Q.blocked_on_full_queue(df, series=series)
        Q.idle_interval_stats(df, launches=launches)
        Q.memory_bw_summary(df)

    tables = {f: drop_last_profiler_step(load_kineto(TRACES / "kineto" / f)) for f in KINETO}
    tables |= {n: load_trace(TRACES / "nsys" / f"{n}.sqlite") for n in NSYS}
    base = tables["nccl_parser_config"]
    span = int((base["start_ns"] + base["dur_ns"]).max() - base["start_ns"].min())
    # One table of SYNTHETIC_RANKS ranks: the 1-rank A100 trace repeated per rank (ids stay per rank).
    tables[f"nccl_parser_config x {SYNTHETIC_RANKS} ranks"] = concat_tables(
        [
            base.assign(rank=np.int32(r), start_ns=base["start_ns"] + (r % 4) * span // 100)
            for r in range(SYNTHETIC_RANKS)
        ]
    )
    rows = []
    for name, df in tables.items():
        ratio = best(lambda df=df: ours(df)) / best(lambda df=df: analyze(df, trim_last_step=False))
        rows.append([name, len(df), ratio])
    return [
        "## Cost",
        "",
        "Time of the new tables (queue series, its summary, blocked time, idle interval statistics, bandwidth "
        "summary) over the time of the whole `analyze()` that includes them, best of 3 each, same process:",
        "",
        md_table(pd.DataFrame(rows, columns=["trace", "events", "new tables / analyze()"]), 3),
        "",
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hta-python", default="/tmp/hta/bin/python")
    p.add_argument("--out", type=Path, help="also write the report here (markdown)")
    p.add_argument("--no-cost", action="store_true", help="skip the timing section")
    args = p.parse_args(argv)
    lines = [
        "# Queue length, full-queue time, idle intervals, copy bandwidth: ours vs HTA 0.5.0",
        "",
        f"`{' '.join(['.venv/bin/python', 'bench/hta_series_compare.py', *(argv if argv is not None else sys.argv[1:])])}`",
        "",
    ]
    for folder in KINETO:
        hta = run_hta(args.hta_python, folder)
        ours_ns = drop_last_profiler_step(load_kineto(TRACES / "kineto" / folder))
        hta_view = round_like_hta(ours_ns)
        lines += [f"## {folder}", ""]
        lines += queue_section(folder, hta, hta_view, ours_ns)
        lines += blocked_section(folder, hta, hta_view, ours_ns)
        lines += idle_section(folder, hta, hta_view)
        lines += bw_section(folder, hta, ours_ns)
    lines += nsys_section()
    if not args.no_cost:
        lines += cost_section()
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
