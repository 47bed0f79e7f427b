"""Trace load + full analysis: time and peak memory, ours beside HolisticTraceAnalysis (HTA), same files.

Targets: at least 5x faster than HTA, and our peak RSS below 2x the trace's size (decompressed bytes:
the sum over a folder's rank files for Kineto; the SQLite file for nsys).

Run: ``.venv/bin/python bench/analyze_speed.py [--size-gb 1.0] [--hta-python /tmp/hta/bin/python]``.
HTA lives in its own environment (``python3 -m venv /tmp/hta && /tmp/hta/bin/pip install
holistictraceanalysis``); without it only our figures are printed.

Inputs: the real traces in ../shared/traces (Kineto folders; nsys SQLite exports, which HTA does not
read) and a synthetic Kineto trace of at least ``--size-gb`` GiB written into a temporary folder: the
ns_resolution_trace's events replicated back to back, each copy shifted by the trace's span in time,
with its correlation, External id and flow ids offset and its ProfilerStep numbers continued, so the
result is one longer run of many steps. The copies are written compact (one event per line), denser
than Kineto's own indented layout: more events per byte, the harder case for time and memory per byte.

Each measurement runs in a fresh child process; time is ``time.perf_counter`` around load + analysis
only (imports excluded). On the real traces our child and HTA's take turns, best of ``--repeats`` each. Peak RSS is the larger of the child's ``ru_maxrss`` and the peak of the RSS
summed over its process tree, sampled every 20 ms (HTA forks one parser per rank file). The baseline
row is a child that only imports each tool, so memory can be read net of the interpreter and pandas.
Children run under an address-space cap (``--mem-cap-gib``) and a timeout, and are stopped when the
machine's available memory runs low; such runs are reported as "did not finish", not waited on.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import json
import math
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces"
KINETO_SOURCE = TRACES / "kineto" / "ns_resolution_trace"  # single-GPU, 5 ProfilerSteps, kernels + host ops
TARGET_SPEEDUP = 5.0
TARGET_RSS_PER_FILE_BYTE = 2.0
GIB = 2**30
MIB = 2**20
POLL_S = 0.02
LOW_MEMORY_BYTES = int(1.5 * GIB)  # stop a child when the machine has less than this available
STEP_GAP_US = 1000  # idle gap between replicated copies of the source trace

# Each child prints one JSON line: load and analysis seconds (imports excluded) and the event count.
# As the CLI's analyze and the app's analysis child do: a dedicated load (small pages, freed memory kept).
OURS_CHILD = """
import json, resource, sys, time
from advisor.analysis.summary import analyze, load_trace
t0 = time.perf_counter()
df = load_trace(sys.argv[1], dedicated=True)
t1 = time.perf_counter()
analyze(df)
t2 = time.perf_counter()
r = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"load_s": t1 - t0, "analysis_s": t2 - t1, "events": len(df), "user_s": r.ru_utime, "sys_s": r.ru_stime}))
"""
HTA_CHILD = """
import json, logging, sys, time
from hta.trace_analysis import TraceAnalysis
logging.disable(logging.WARNING)
t0 = time.perf_counter()
a = TraceAnalysis(trace_dir=sys.argv[1])
t1 = time.perf_counter()
a.get_temporal_breakdown(visualize=False)
a.get_gpu_kernel_breakdown(visualize=False)
a.get_comm_comp_overlap(visualize=False)
a.get_idle_time_breakdown(visualize=False)
t2 = time.perf_counter()
print(json.dumps({"load_s": t1 - t0, "analysis_s": t2 - t1, "events": int(sum(len(d) for d in a.t.traces.values()))}))
"""
OURS_BASELINE = "import advisor.analysis.summary"
HTA_BASELINE = "import hta.trace_analysis"


@dataclass(frozen=True)
class Run:
    """One child's outcome: seconds are load + analysis; ``error`` is set when it did not finish."""

    load_s: float | None
    analysis_s: float | None
    peak_rss_bytes: int
    wall_s: float
    events: int | None = None
    error: str | None = None
    user_s: float | None = None  # CPU seconds of all its threads, where the child reports them
    sys_s: float | None = None  # kernel time: mostly page faults, whose price a VM's memory sets

    @property
    def total_s(self) -> float | None:
        return None if self.load_s is None or self.analysis_s is None else self.load_s + self.analysis_s


def mem_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def tree_rss_bytes(pid: int) -> int:
    """RSS summed over ``pid`` and its descendants (0 once it is gone)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue
    return total


def run_child(python: str, code: str, path: Path | None, timeout_s: float, cap_bytes: int) -> Run:
    """Run ``code`` in a fresh ``python`` with an address-space cap; measure its peak RSS and outcome."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap_bytes, cap_bytes))

    args = [python, "-c", code, str(path or "")]  # `python -c` finds the checkout from its cwd, ROOT
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(args, stdout=out, stderr=err, cwd=ROOT, preexec_fn=limit, start_new_session=True)
        peak, stop_reason = 0, None
        done = threading.Event()

        def watch() -> None:
            nonlocal peak, stop_reason
            t0 = time.monotonic()
            while not done.wait(POLL_S):
                peak = max(peak, tree_rss_bytes(proc.pid))
                if time.monotonic() - t0 > timeout_s:
                    stop_reason = f"did not finish: over the {timeout_s:.0f} s timeout"
                elif mem_available_bytes() < LOW_MEMORY_BYTES:
                    stop_reason = f"did not finish: stopped with under {LOW_MEMORY_BYTES / GIB:.1f} GiB available"
                else:
                    continue
                with contextlib.suppress(ProcessLookupError):  # it may have ended just now
                    os.killpg(proc.pid, signal.SIGKILL)
                return

        watcher = threading.Thread(target=watch, daemon=True)
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        t0 = time.monotonic()
        watcher.start()
        proc.wait()
        wall_s = time.monotonic() - t0
        done.set()
        watcher.join()
        # ru_maxrss of children is the largest ever seen, so it only says something when it grew.
        after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        peak = max(peak, after * 1024 if after > before else 0)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if stop_reason:
        return Run(None, None, peak, wall_s, error=stop_reason)
    if proc.returncode != 0:
        if "MemoryError" in stderr:
            return Run(None, None, peak, wall_s, error=f"did not finish: out of its {cap_bytes / GIB:.1f} GiB cap")
        last = (stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        exc, _, message = last.partition(": ")  # "advisor.errors.TraceError: ..." -> "TraceError: ..."
        return Run(None, None, peak, wall_s, error=f"error: {exc.rpartition('.')[2]}: {message}"[:100])
    lines = stdout.strip().splitlines()
    if not lines:  # a baseline child: nothing measured but its memory
        return Run(None, None, peak, wall_s)
    result = json.loads(lines[-1])
    cpu = {k: result[k] for k in ("user_s", "sys_s") if k in result}
    return Run(result["load_s"], result["analysis_s"], peak, wall_s, result["events"], **cpu)


def best_of(children: list[tuple[str, str]], path: Path, repeats: int, timeout_s: float, cap_bytes: int) -> list[Run]:
    """For each (python, code) child, the fastest of ``repeats`` runs with the largest peak RSS seen;
    a child's first failure ends its runs. The children take turns, so that a busy spell on a shared
    machine slows all of them alike instead of one tool's whole series."""
    runs: list[list[Run]] = [[] for _ in children]
    for _ in range(repeats):
        for (python, code), done in zip(children, runs, strict=True):
            if not (done and done[-1].error):
                done.append(run_child(python, code, path, timeout_s, cap_bytes))
    out = []
    for done in runs:
        if done[-1].error:
            out.append(done[-1])
            continue
        fastest = min(done, key=lambda r: r.total_s or 0.0)
        peak = max(r.peak_rss_bytes for r in done)
        out.append(dataclasses.replace(fastest, peak_rss_bytes=peak))
    return out


def decompressed_bytes(path: Path) -> int:
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    total = 0
    for f in files:
        if f.name.endswith(".json.gz"):
            with gzip.open(f, "rb") as g:
                while chunk := g.read(16 * MIB):
                    total += len(chunk)
        elif f.name.endswith((".json", ".sqlite")):
            total += f.stat().st_size
    return total


def write_large_trace(source: Path, dest: Path, size_bytes: int) -> int:
    """Write a Kineto trace of at least ``size_bytes`` to ``dest`` from copies of ``source``'s events;
    return the number of copies (see the module docstring for how copies are shifted)."""
    (src,) = sorted(source.glob("*.json*"))
    with gzip.open(src, "rb") if src.name.endswith(".gz") else open(src, "rb") as f:
        trace = orjson.loads(f.read())
    events = trace.pop("traceEvents")
    timed = [e for e in events if isinstance(e.get("ts"), (int, float))]
    # Whole-microsecond shifts keep every float timestamp exact (they are multiples of 0.25 us here).
    span_us = math.ceil(max(e["ts"] + e.get("dur", 0) for e in timed) - min(e["ts"] for e in timed))
    period_us = span_us + STEP_GAP_US
    ids = [e.get("id", 0) for e in events] + [
        (e.get("args") or {}).get(k, 0) for e in events for k in ("correlation", "External id")
    ]
    id_stride = max(v for v in ids if isinstance(v, int)) + 1
    steps = [int(e["name"].split("#")[1]) for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
    step_stride = max(steps) - min(steps) + 1 if steps else 0
    plan = []  # (event, ts, id, correlation, External id, step number) of the source
    for e in events:
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        name = str(e.get("name", ""))
        plan.append(
            (
                e,
                e.get("ts"),
                e.get("id") if isinstance(e.get("id"), int) else None,
                args.get("correlation") if isinstance(args.get("correlation"), int) else None,
                args.get("External id") if isinstance(args.get("External id"), int) else None,
                int(name.split("#")[1]) if name.startswith("ProfilerStep#") else None,
            )
        )
    head = orjson.dumps(trace)[:-1] + b',"traceEvents":[\n'
    written, copies = 0, 0
    with open(dest, "wb") as f:
        f.write(head)
        while written < size_bytes or copies == 0:
            lines = []
            for e, ts, fid, corr, ext, step in plan:
                if copies and e.get("ph") == "M":
                    continue  # process/thread names once
                if isinstance(ts, (int, float)):
                    e["ts"] = ts + copies * period_us
                if fid is not None:
                    e["id"] = fid + copies * id_stride
                if corr is not None:
                    e["args"]["correlation"] = corr + copies * id_stride
                if ext is not None:
                    e["args"]["External id"] = ext + copies * id_stride
                if step is not None:
                    e["name"] = f"ProfilerStep#{step + copies * step_stride}"
                lines.append(orjson.dumps(e))
            block = (b",\n" if copies else b"") + b",\n".join(lines)
            f.write(block)
            written += len(block)
            copies += 1
        f.write(b"\n]}\n")
    return copies


def _seconds(r: Run | None) -> str:
    if r is None:
        return "n/a"
    if r.error:
        return r.error
    return f"{r.total_s:.2f} ({r.load_s:.2f} + {r.analysis_s:.2f})"


def _verdict(met: bool) -> str:
    return "met" if met else "not met"


def table_row(name: str, size: int, ours: Run, hta: Run | None, base_ours: Run) -> str:
    """One markdown row: times, their ratio, peak RSS and peak RSS per byte of trace."""
    if ours.error:  # nothing to compare: the trace was rejected
        return f"| {name} | {size / MIB:,.1f} | - | {ours.error} | {_seconds(hta)} | - | - | - | - | - |"
    ratio = "n/a"
    if hta and ours.total_s:
        # A run that did not finish still bounds HTA's time from below by its wall time.
        speedup = (hta.total_s or hta.wall_s) / ours.total_s
        ratio = f"{'' if hta.total_s else '> '}{speedup:.1f}x {_verdict(speedup >= TARGET_SPEEDUP)}"
    net = (ours.peak_rss_bytes - base_ours.peak_rss_bytes) / size
    cells = [
        name,
        f"{size / MIB:,.1f}",
        f"{ours.events:,}" if ours.events else "-",
        _seconds(ours),
        _seconds(hta),
        ratio,
        f"{ours.peak_rss_bytes / MIB:,.0f}",
        f"{hta.peak_rss_bytes / MIB:,.0f}" if hta else "n/a",
        f"{ours.peak_rss_bytes / size:.2f} ({net:.2f}) {_verdict(ours.peak_rss_bytes / size < TARGET_RSS_PER_FILE_BYTE)}",
        f"{hta.peak_rss_bytes / size:.2f}" if hta else "n/a",
    ]
    return "| " + " | ".join(cells) + " |"


TABLE_HEAD = (
    "| trace | size MiB | events (ours) | ours s (load + analysis) | HTA s (load + analysis) | HTA / ours time"
    " | ours peak RSS MiB | HTA peak RSS MiB | ours peak / size (net of baseline) | HTA peak / size |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def machine() -> str:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "?")
    return (
        f"{os.cpu_count()} cores ({model}), {total_memory_bytes() / GIB:.0f} GiB RAM, Python {sys.version.split()[0]}"
    )


def total_memory_bytes() -> int:
    with open("/proc/meminfo") as f:
        return int(f.readline().split()[1]) * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.0, help="synthetic trace size in GiB (0 skips it)")
    parser.add_argument("--hta-python", default="/tmp/hta/bin/python", help="a python with HTA installed")
    parser.add_argument("--repeats", type=int, default=5, help="runs per tool on each real trace (best time kept)")
    parser.add_argument("--timeout-min", type=float, default=20.0, help="per child run")
    parser.add_argument("--mem-cap-gib", type=float, default=16.0, help="address-space cap of each child")
    parser.add_argument("--out", type=Path, help="also write the table (markdown) here")
    args = parser.parse_args()
    timeout_s, cap = args.timeout_min * 60, int(args.mem_cap_gib * GIB)
    hta_python = args.hta_python if Path(args.hta_python).is_file() else None
    if hta_python is None:
        print(
            f"HTA python {args.hta_python} not found: printing our figures only. Install HTA with\n"
            "  python3 -m venv /tmp/hta && /tmp/hta/bin/pip install holistictraceanalysis"
        )
    elif subprocess.run([hta_python, "-c", HTA_BASELINE], capture_output=True).returncode != 0:
        print(f"{hta_python} cannot import hta.trace_analysis: printing our figures only.")
        hta_python = None

    base_ours = run_child(sys.executable, OURS_BASELINE, None, timeout_s, cap)
    base_hta = run_child(hta_python, HTA_BASELINE, None, timeout_s, cap) if hta_python else None
    hta_version = "not installed, not run"
    if hta_python:
        version = "import importlib.metadata as m; print(m.version('HolisticTraceAnalysis'))"
        hta_version = subprocess.run([hta_python, "-c", version], capture_output=True, text=True).stdout.strip()
    lines = [
        "Command: `" + " ".join([".venv/bin/python bench/analyze_speed.py", *sys.argv[1:]]) + "`",
        f"Machine: {machine()}; HTA: {hta_version} (own environment, its default json parser).",
        f"Times: best of {args.repeats} fresh child processes on the real traces (ours and HTA taking turns),"
        " one on the synthetic one.",
        f"Baseline RSS of a child that only imports the tool: ours {base_ours.peak_rss_bytes / MIB:,.0f} MiB"
        + (f", HTA {base_hta.peak_rss_bytes / MIB:,.0f} MiB." if base_hta else "."),
        "",
        TABLE_HEAD,
    ]
    print("\n".join(lines), flush=True)
    inputs = [(f"kineto/{d.name}", d, True) for d in sorted((TRACES / "kineto").iterdir()) if d.is_dir()]
    inputs += [(f"nsys/{f.name}", f, False) for f in sorted((TRACES / "nsys").glob("*.sqlite"))]
    for name, path, hta_reads in inputs:
        with_hta = bool(hta_python and hta_reads)
        children = [(sys.executable, OURS_CHILD), *([(hta_python, HTA_CHILD)] if with_hta else [])]
        runs = best_of(children, path, args.repeats, timeout_s, cap)
        ours, hta = runs[0], (runs[1] if with_hta else None)
        lines.append(table_row(name, decompressed_bytes(path), ours, hta, base_ours))
        print(lines[-1], flush=True)

    if args.size_gb > 0:
        with tempfile.TemporaryDirectory(prefix="analyze-speed-") as tmp:  # removed on exit, also on errors
            big = Path(tmp) / "rank-0.synthetic.pt.trace.json"
            copies = write_large_trace(KINETO_SOURCE, big, int(args.size_gb * GIB))
            size = big.stat().st_size
            ours = run_child(sys.executable, OURS_CHILD, Path(tmp), timeout_s, cap)
            hta = run_child(hta_python, HTA_CHILD, Path(tmp), timeout_s, cap) if hta_python else None
        lines.append(table_row(f"synthetic: {copies} x {KINETO_SOURCE.name}", size, ours, hta, base_ours))
        print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
