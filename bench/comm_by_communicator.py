"""Communication per communicator on the shared multi-rank traces: our tables beside figures computed
here from the raw events, HTA's straggler pick beside ours, and the tables' cost in analyze().

HTA has no per-communicator, bandwidth or wait/transfer analysis, so the reference for those is the
hand computation printed under each trace: the k-th NCCL kernel of each rank read straight from the
JSON / SQLite, its wait (last start - own start) and transfer (own end - last start). HTA does pick
stragglers (``TraceAnalysis.get_potential_stragglers``: the ranks whose last long communication kernel
of a step starts latest); its pick is printed beside our ``comm_stragglers``.

Run: ``.venv/bin/python bench/comm_by_communicator.py [--hta-python /tmp/hta/bin/python]``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sqlite3
import subprocess
import time
from pathlib import Path

import pandas as pd

from advisor.analysis.comm import comm_by_communicator, comm_calls, comm_skew, comm_stragglers
from advisor.analysis.summary import analyze, load_trace

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
HTA_CHILD = """
import json, logging, sys
logging.disable(logging.WARNING)
from hta.trace_analysis import TraceAnalysis
t = TraceAnalysis(trace_dir=sys.argv[1])
print(json.dumps({"steps": [int(s) for s in t.get_profiler_steps()],
                  "pick": [int(r) for r in t.get_potential_stragglers(num_candidates=1)]}))
"""
BY_COMM = ["communicator", "pg_ranks", "group_size", "scope", "kind", "nccl_algo", "ranks_count", "calls_count"]
BY_COMM += ["bytes", "time_ms", "algbw_gbps", "busbw_gbps", "matched_calls_count", "wait_ms", "transfer_ms"]
SKEW = ["rank", "instances_count", "wait_mean_ms", "transfer_mean_ms", "wait_pct"]
LATE = ["rank", "instances_count", "late_median_ms", "late_mean_ms", "last_count", "late_of_step_pct"]
LATE += ["comm_straggler", "step_above_median_pct", "step_straggler"]


def show(frame: pd.DataFrame, cols: list[str]) -> str:
    return frame[cols].to_string(index=False, float_format=lambda x: f"{x:.4g}")


def kineto_kernels(path: Path) -> list[tuple[float, float]]:
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    return sorted((e["ts"], e["dur"]) for e in events if e.get("cat") == "kernel" and "ncclKernel" in e["name"])


def hand_trace_filter() -> list[str]:
    """The first all-gather (1 GiB, the 5th NCCL kernel of each rank; c10d::_allgather_base_)."""
    k = {r: kineto_kernels(TRACES / "kineto/trace_filter" / f"sampled_rank-{r}.json.gz")[4] for r in (0, 1)}
    last = max(s for s, _ in k.values())
    end = max(s + d for s, d in k.values())
    return [
        f"  all-gather of 2^30 bytes, step 551: rank 0 ts {k[0][0]:.0f} us dur {k[0][1]:.0f}, rank 1 ts {k[1][0]:.0f} dur {k[1][1]:.0f}",
        f"  skew {last - min(s for s, _ in k.values()):.0f} us; rank 0 waits {last - k[0][0]:.0f} us, "
        f"transfers {k[0][0] + k[0][1] - last:.0f} us; instance transfer (last start to last end) {end - last:.0f} us",
        f"  algbw per rank = 2^30 B / dur: rank 0 {2**30 / k[0][1] / 1e3:.2f} GB/s, rank 1 {2**30 / k[1][1] / 1e3:.2f} GB/s; "
        f"after the last start {2**30 / (end - last) / 1e3:.2f} GB/s (group size not recorded: no bus bandwidth)",
    ]


def hand_nccl_parser_config() -> list[str]:
    with gzip.open(TRACES / "kineto/nccl_parser_config/nccl_data.json.gz") as f:
        events = json.load(f)["traceEvents"]
    ar = [e for e in events if e.get("cat") == "kernel" and e["name"].startswith("ncclKernel_AllReduce")]
    nbytes, dur = sum(4 * e["args"]["In msg nelems"] for e in ar), sum(e["dur"] for e in ar)
    a = ar[0]["args"]
    return [
        f"  {len(ar)} all-reduce kernels of group '{a['Process Group Name']}' ({a['Process Group Description']}, "
        f"ranks {a['Process Group Ranks']}, size {a['Group size']}): {nbytes:,} B in {dur / 1e3:.3f} ms",
        f"  algbw {nbytes / dur / 1e3:.3f} GB/s; busbw x 2(n-1)/n = x 1 for n = 2: {nbytes / dur / 1e3:.3f} GB/s "
        "(all steps; analyze() drops the last)",
    ]


def hand_nsys(path: Path) -> list[str]:
    with sqlite3.connect(path) as db:
        rows = db.execute(
            "SELECT k.deviceId, k.start, k.end FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s"
            " ON k.shortName = s.id WHERE s.value LIKE 'ncclDevKernel%' ORDER BY k.start"
        ).fetchall()
    per = {d: [(s, e) for dev, s, e in rows if dev == d] for d in (0, 1)}
    wait, transfer, late = {0: 0, 1: 0}, {0: 0, 1: 0}, {0: 0, 1: 0}
    for pair in zip(per[0], per[1], strict=True):
        last = max(s for s, _ in pair)
        for d, (s, e) in enumerate(pair):
            wait[d] += last - s
            transfer[d] += e - last
            late[d] += last == s
    n = len(per[0])
    return [
        f"  {n} ncclDevKernel_SendRecv per GPU, k-th with k-th: waits {wait[0] / 1e6:.3f} / {wait[1] / 1e6:.3f} ms, "
        f"transfers {transfer[0] / 1e6:.3f} / {transfer[1] / 1e6:.3f} ms (GPU 0 / 1); GPU 1 starts last in "
        f"{late[1]} of {n}",
    ]


def hta_pick(hta_python: str | None, trace: Path) -> str:
    if hta_python is None or not Path(hta_python).is_file():
        return "  HTA: not installed, not run"
    out = subprocess.run([hta_python, "-c", HTA_CHILD, str(trace)], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        return f"  HTA failed: {out.stderr.strip().splitlines()[-1]}"
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return f"  HTA get_potential_stragglers(num_candidates=1) over steps {got['steps']}: ranks {got['pick']}"


def cost_ratio(df: pd.DataFrame, repeats: int = 3) -> float:
    """Time of the comm tables (comm_calls from collective_calls, as analyze() does) over all of analyze()."""
    from advisor.analysis import breakdown as A
    from advisor.analysis.collectives import collective_calls, collective_sizes

    calls, skew = collective_calls(df, collective_sizes(df)), A.rank_skew(df)
    whole = part = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        analyze(df)
        t1 = time.perf_counter()
        c = comm_calls(df, calls)
        comm_by_communicator(c), comm_skew(c), comm_stragglers(c, skew)
        t2 = time.perf_counter()
        whole, part = whole + t1 - t0, part + t2 - t1
    return part / whole


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hta-python", default="/tmp/hta/bin/python", help="a python with HTA installed")
    args = parser.parse_args()
    cases = [
        ("kineto/trace_filter", hand_trace_filter),
        ("kineto/nccl_parser_config", hand_nccl_parser_config),
        ("nsys/nsysai_mfu_2gpu_before.sqlite", lambda: hand_nsys(TRACES / "nsys/nsysai_mfu_2gpu_before.sqlite")),
        ("nsys/nsysai_mfu_2gpu_after.sqlite", lambda: hand_nsys(TRACES / "nsys/nsysai_mfu_2gpu_after.sqlite")),
    ]
    for name, hand in cases:
        df = load_trace(TRACES / name)
        report = analyze(df)
        t = report.tables
        cut = "cut to its complete profiler steps" if name.startswith("kineto") else "used whole"
        print(f"== {name} (analyze(): {cut})")
        print(show(t["comm_by_communicator"], BY_COMM))
        print(show(t["comm_skew"], SKEW))
        notes = set(t["comm_skew"]["note"]) - {""}
        print("".join(f"  note: {n}\n" for n in notes), end="")
        print(show(t["comm_stragglers"], LATE))
        m = report.metrics
        print(
            f"  metrics: comm_late_pct {m.comm_late_pct}, comm_stragglers {m.comm_stragglers}, "
            f"step_skew_pct {m.step_skew_pct}, stragglers {m.stragglers}"
        )
        print("  by hand from the raw events:")
        print("\n".join(hand()))
        if name == "kineto/trace_filter":
            print(hta_pick(args.hta_python, TRACES / name))
        print(f"  cost: comm tables / whole analyze() = {cost_ratio(df):.2f}\n")


if __name__ == "__main__":
    main()
