"""Critical path of a step: ours beside HolisticTraceAnalysis' (HTA) critical_path_analysis, same files.

For each case HTA runs ``TraceAnalysis(trace_dir).critical_path_analysis(rank, annotation,
instance_id)`` in its own environment and sums ``get_critical_path_breakdown()`` by ``bound_by``; we run
``advisor.analysis.critical_path.critical_path`` on the same step three ways: ``hta_compatible`` on the
table rounded as HTA rounds sub-microsecond traces (``breakdown.round_like_hta``: should equal HTA),
our own model on that rounded table (the model's choices alone), and our own model on the table as
loaded (what ``analyze`` reports). Kineto tables are cut to their complete steps first, as ``analyze``
does. Times: HTA's critical_path_analysis call and our critical_path call, each best of ``--repeats``,
as a ratio.

HTA 0.5.0's critical path needs pandas 2: under pandas 3 ``DataFrame.drop(axis=1, columns=...)`` raises
("Cannot specify both 'axis' and 'index'/'columns'"). Make its environment with
``python3 -m venv /tmp/hta-pd2 && /tmp/hta-pd2/bin/pip install HolisticTraceAnalysis==0.5.0 'pandas<3'``;
``--check-python`` names another HTA environment whose failure (or success) is printed.

Run: ``.venv/bin/python bench/critical_path_compare.py [--hta-python /tmp/hta-pd2/bin/python]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from advisor.analysis.breakdown import drop_last_profiler_step, round_like_hta
from advisor.analysis.critical_path import critical_path
from advisor.analysis.summary import load_trace

ROOT = Path(__file__).resolve().parents[1]
KINETO = ROOT.parent / "shared" / "traces" / "kineto"
ALEXNET = ROOT / "tests" / "data" / "hta" / "alexnet_benchmark_result_2869224_1695835535_trace.json.gz"
ALEXNET_RANGE = "[param|pytorch.model.alex_net|0|0|0|measure|forward]"
# (label, trace folder or file, rank, HTA annotation, HTA instance_id, our step, our annotation)
CASES = [
    ("ns_resolution_trace", KINETO / "ns_resolution_trace", 0, "ProfilerStep", 1, 102, None),
    ("nccl_parser_config", KINETO / "nccl_parser_config", 0, "ProfilerStep", 1, 5, None),
    ("trace_filter rank 0", KINETO / "trace_filter", 0, "ProfilerStep", 0, 551, None),
    ("trace_filter rank 1", KINETO / "trace_filter", 1, "ProfilerStep", 0, 551, None),
    ("trace_filter rank 0, instance 1", KINETO / "trace_filter", 0, "ProfilerStep", 1, 552, None),
    ("alexnet (HTA's test trace)", ALEXNET, 0, ALEXNET_RANGE, 1, 1, ALEXNET_RANGE),
]
HTA_CLASSES = {
    "cpu_bound": "host",
    "gpu_compute_bound": "gpu",
    "gpu_communication_bound": "comm",
    "gpu_kernel_kernel_overhead": "idle",
    "gpu_kernel_launch_overhead": "launch",
}
OURS_CLASSES = {"compute": "gpu", "memcpy": "gpu", "memset": "gpu", "communication": "comm"}
COLUMNS = ("host", "gpu", "comm", "idle", "launch", "sync")

HTA_CHILD = """
import json, logging, sys, time
logging.disable(logging.WARNING)
import warnings; warnings.simplefilter("ignore")
from hta.trace_analysis import TraceAnalysis
folder, rank, annotation, instance, repeats = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
a = TraceAnalysis(trace_dir=folder)
best = None
try:
    for _ in range(repeats):
        t0 = time.perf_counter()
        graph, ok = a.critical_path_analysis(rank=rank, annotation=annotation, instance_id=instance)
        best = min(best or 1e9, time.perf_counter() - t0)
    edges = graph.get_critical_path_breakdown()
    by = edges.groupby("bound_by")["duration"].sum()
    print(json.dumps({"ok": ok, "seconds": best, "by": {k: float(v) for k, v in by.items() if k}}))
except Exception as err:
    print(json.dumps({"ok": False, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}))
"""


def run_hta(python: str, folder: Path, rank: int, annotation: str, instance: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        if folder.is_file():  # HTA reads folders of rank files
            shutil.copy(folder, tmp)
            folder = Path(tmp)
        proc = subprocess.run(
            [python, "-c", HTA_CHILD, str(folder), str(rank), annotation, str(instance), str(repeats)],
            capture_output=True,
            text=True,
            timeout=1800,
        )
    lines = [s for s in proc.stdout.splitlines() if s.startswith("{")]
    if not lines:
        return {"ok": False, "error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:160]}
    return json.loads(lines[-1])


def ours(df, rank: int, step: int, annotation: str | None, hta: bool, repeats: int) -> tuple[dict, float]:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        path = critical_path(df, rank=rank, step=step, annotation=annotation, hta_compatible=hta)
        best = min(best, time.perf_counter() - t0)
    kinds = path["kind"].astype(str).map(lambda k: OURS_CLASSES.get(k, k))
    return {k: float(v) / 1000 for k, v in path.groupby(kinds)["dur_ns"].sum().items()}, best


def row(label: str, by: dict) -> str:
    cells = [f"{by.get(c, 0.0) / 1000:.3f}" for c in COLUMNS]
    return f"| {label} | {sum(by.values()) / 1000:.3f} | " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hta-python", default="/tmp/hta-pd2/bin/python")
    parser.add_argument("--check-python", default="/tmp/hta/bin/python", help="another HTA env to try once")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print("Path length and its parts in ms (HTA's bound_by classes: host = cpu_bound, gpu = compute")
    print("incl. copies, comm = communication, idle = kernel-kernel delay, launch = launch delay).\n")
    if Path(args.check_python).exists():
        label, folder, rank, annotation, instance, _, _ = CASES[0]
        got = run_hta(args.check_python, folder, rank, annotation, instance, 1)
        version = subprocess.run(
            [args.check_python, "-c", "import pandas; print(pandas.__version__)"], capture_output=True, text=True
        ).stdout.strip()
        print(f"{args.check_python} (pandas {version}) on {label}: {got.get('error') or 'ran'}\n")
    print("| case | path | " + " | ".join(COLUMNS) + " |")
    print("|---|---:|" + "---:|" * len(COLUMNS))
    timing = []
    for label, folder, rank, annotation, instance, step, our_annotation in CASES:
        hta = run_hta(args.hta_python, folder, rank, annotation, instance, args.repeats)
        if not hta.get("ok"):
            print(f"| {label}: HTA fails: {hta.get('error', 'no critical path')} | | " + "| " * len(COLUMNS))
            continue
        df = load_trace(folder)
        if df.attrs.get("source") == "kineto":
            df = drop_last_profiler_step(df)
        rounded = round_like_hta(df)
        compat, seconds = ours(rounded, rank, step, our_annotation, True, args.repeats)
        own_rounded, _ = ours(rounded, rank, step, our_annotation, False, 1)
        own, _ = ours(df, rank, step, our_annotation, False, 1)
        print(row(f"{label}: HTA", {HTA_CLASSES[k]: v for k, v in hta["by"].items()}))
        print(row("ours, hta_compatible, HTA's rounding", compat))
        print(row("ours, HTA's rounding", own_rounded))
        print(row("ours (analyze)", own))
        timing.append((label, hta["seconds"] / seconds))
    print("\nTime of one critical path, HTA / ours: " + ", ".join(f"{label} {r:.0f}x" for label, r in timing))


if __name__ == "__main__":
    main()
