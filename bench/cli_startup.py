"""Whole-process wall time of the commands that estimate and analyze, beside a bare interpreter start.

Users run the command, not the function: ``advisor size`` answers in milliseconds, so its process
start is the whole cost. These commands import no torch (tests/test_cli.py checks ``sys.modules``);
this prints each command's best-of-N wall time, the bare interpreter's and ``import torch``'s,
measured alternately in one run (the machine is shared: compare the ratios, not the seconds).

    .venv/bin/python bench/cli_startup.py [--repeats 5] [--hta-python /tmp/hta/bin/python]

With ``--hta-python`` (an interpreter with HolisticTraceAnalysis installed: ``python -m venv /tmp/hta &&
/tmp/hta/bin/pip install HolisticTraceAnalysis``), HTA's whole process on the same trace runs beside
``advisor analyze``: its four breakdowns (temporal, kernel, communication overlap, idle time), the
ones ``advisor analyze`` reports too.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "kineto" / "ns_resolution_trace"
COMMANDS = {
    "bare interpreter (python -c pass)": ["-c", "pass"],
    "import torch": ["-c", "import torch"],
    "advisor size --json (Llama-3.1-8B, H100)": ["-m", "advisor", "size", "--model", "llama-3.1-8b", "--gpu", "h100", "--json"],
    "advisor plan (8B on 8 H100)": ["-m", "advisor", "plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--gpus", "8", "--global-batch", "64", "--measured-comm", "off"],
    "advisor analyze --json (real A100 trace, 1.1 MB gz)": ["-m", "advisor", "analyze", str(TRACE), "--json"],
}  # fmt: skip
HTA_NAME = "HolisticTraceAnalysis, its 4 breakdowns (same trace)"
HTA_CODE = (
    "import logging, sys; from hta.trace_analysis import TraceAnalysis; logging.disable(logging.WARNING); "
    "a = TraceAnalysis(trace_dir=sys.argv[1]); a.get_temporal_breakdown(visualize=False); "
    "a.get_gpu_kernel_breakdown(visualize=False); a.get_comm_comp_overlap(visualize=False); "
    "a.get_idle_time_breakdown(visualize=False)"
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hta-python", help="an interpreter with HolisticTraceAnalysis, to time it beside analyze")
    args = ap.parse_args()
    commands = {name: [sys.executable, *argv] for name, argv in COMMANDS.items()}
    if args.hta_python and TRACE.is_dir():
        commands[HTA_NAME] = [args.hta_python, "-W", "ignore", "-c", HTA_CODE, str(TRACE)]
    names = [n for n in commands if "analyze" not in n or TRACE.is_dir()]
    best = dict.fromkeys(names, float("inf"))
    for _ in range(args.repeats):  # alternated: load on the machine hits every command alike
        for name in names:
            t0 = time.perf_counter()
            proc = subprocess.run(commands[name], cwd=ROOT, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if proc.returncode:
                print(f"{name}: exit {proc.returncode}: {proc.stderr[-500:]}")
                return 1
            best[name] = min(best[name], wall)
    bare = best[names[0]]
    print(f"best of {args.repeats}, {sys.executable}")
    print("| command | wall s | over a bare interpreter | of `import torch` |")
    print("|---|---:|---:|---:|")
    for name in names:
        print(f"| {name} | {best[name]:.2f} | {best[name] / bare:.1f}x | {best[name] / best['import torch']:.2f} |")
    if not TRACE.is_dir():
        print(f"(no analyze row: {TRACE} is not here)")
    elif HTA_NAME in best:
        analyze = next(n for n in names if n.startswith("advisor analyze"))
        print(f"advisor analyze / HTA, whole processes: {best[analyze] / best[HTA_NAME]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
