"""Multi-GB traces, side by side in one run: an Nsight Systems export of ``--nsys-gb`` in two real
layouts and a Kineto JSON of ``--kineto-gb``, each loaded and fully analysed (``analyze``) in a fresh
child process: seconds (load + analysis) and peak RSS against the file's size.

Targets (issue 20): the nsys export analysed in at most 30 s cold with peak RSS at most 2x the file;
the Kineto JSON streamed with peak RSS at most 1.5x the file.

Layouts of the nsys export (bench/make_nsys.py copies a real export's schema and events until the size):

- ``dense``: nsysai_mfu_2gpu_before (2x H100, PyTorch under emit_nvtx): every byte is an event this tool
  reads (NVTX per op 60 % of the rows, each with an op id of its own, kernels, runtime calls, copies):
  ~12,700 events per MB (47.0 M in 3.7 GB).
- ``sampled``: pipit_cloverleaf_cuda (A100, CloverLeaf, nsys' default capture: CPU sampling and OS
  runtime calls traced beside CUDA): half the bytes are call stacks and samples the tool skips.

"Cold": a fresh child process after the page cache is dropped (``/proc/sys/vm/drop_caches``, where this
user may write it; else the row says the file may have been cached).

Run: ``.venv/bin/python bench/scale.py --nsys-gb 3.7 --kineto-gb 4 --workdir /tmp/scale --out
bench/results/scale.md`` (about 20 GB of disk; files are kept in --workdir for reruns).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path


def _sibling(name: str):
    """A module of this folder (the bench scripts are not a package), loaded from its file."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_speed = _sibling("analyze_speed")
GIB, KINETO_SOURCE, MIB, TRACES = _speed.GIB, _speed.KINETO_SOURCE, _speed.MIB, _speed.TRACES
OURS_BASELINE, OURS_CHILD = _speed.OURS_BASELINE, _speed.OURS_CHILD
decompressed_bytes, machine, run_child = _speed.decompressed_bytes, _speed.machine, _speed.run_child
write_large_trace = _speed.write_large_trace
_make_nsys = _sibling("make_nsys")
make = _make_nsys.make

LAYOUTS = {
    "dense": TRACES / "nsys" / "nsysai_mfu_2gpu_before.sqlite",
    "sampled": TRACES / "nsys" / "pipit_cloverleaf_cuda.sqlite",
}
NSYS_SECONDS = 30.0
NSYS_RSS = 2.0
KINETO_RSS = 1.5


def drop_caches() -> bool:
    """Drop the page cache so the next read is cold; False where this user may not."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nsys-gb", type=float, default=3.7, help="nsys export size, GB (1e9 bytes); 0 skips")
    ap.add_argument("--kineto-gb", type=float, default=4.0, help="Kineto JSON size, GiB; 0 skips")
    ap.add_argument("--layouts", default="dense,sampled", help=f"nsys layouts: {', '.join(LAYOUTS)}")
    ap.add_argument("--workdir", default="/tmp/scale", help="where the large files are written and kept")
    ap.add_argument("--timeout-s", type=float, default=1200)
    ap.add_argument("--out", default=None, help="append the Markdown table here (default: print only)")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    files: list[tuple[str, Path, float, float | None]] = []  # (row, file, rss target, seconds target)
    if args.nsys_gb > 0:
        for layout in args.layouts.split(","):
            path = work / f"nsys_{layout}_{args.nsys_gb:g}gb_g{_make_nsys.GENERATION}.sqlite"
            if not path.exists():
                t0 = time.perf_counter()
                made = make(LAYOUTS[layout], path, int(args.nsys_gb * 1e9))
                print(f"wrote {path}: {made['copies']} copies in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            files.append((f"nsys {layout} ({LAYOUTS[layout].name} x copies)", path, NSYS_RSS, NSYS_SECONDS))
    if args.kineto_gb > 0:
        folder = work / f"kineto_{args.kineto_gb:g}gib"
        if not folder.exists():
            folder.mkdir()
            t0 = time.perf_counter()
            write_large_trace(KINETO_SOURCE, folder / "rank-0.json", int(args.kineto_gb * GIB))
            print(f"wrote {folder}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        files.append((f"Kineto ({KINETO_SOURCE.name} x copies)", folder, KINETO_RSS, None))
    python = sys.executable
    cap = int(0.9 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    base = run_child(python, OURS_BASELINE, None, 120, cap)
    rows = []
    for label, path, rss_target, seconds_target in files:
        cold = drop_caches()
        run = run_child(python, OURS_CHILD, path, args.timeout_s, cap)
        size = decompressed_bytes(path)
        rows.append((label, path, size, run, cold, rss_target, seconds_target))
        print(f"{label}: {run}", file=sys.stderr)
    lines = [
        f"Command: `.venv/bin/python bench/scale.py --nsys-gb {args.nsys_gb:g} --kineto-gb {args.kineto_gb:g} "
        f"--layouts {args.layouts}`",
        f"Machine: {machine()}; nsys reader: {_nsys_reader()}. "
        f"Baseline RSS of a child that only imports the tool: {base.peak_rss_bytes / MIB:.0f} MiB.",
        "",
        "| trace | size MB | events | cold | ours s (load + analysis) | target s | CPU user / sys s "
        "| peak RSS MB | RSS / size | target |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, _path, size, run, cold, rss_target, seconds_target in rows:
        if run.error:
            lines.append(f"| {label} | {size / 1e6:,.0f} | - | {cold} | {run.error} | | | | | |")
            continue
        ratio = run.peak_rss_bytes / size
        time_ok = "" if seconds_target is None else (" met" if run.total_s <= seconds_target else " not met")
        lines.append(
            f"| {label} | {size / 1e6:,.0f} | {run.events:,} | {'yes' if cold else 'maybe cached'} "
            f"| {run.total_s:.1f} ({run.load_s:.1f} + {run.analysis_s:.1f}) "
            f"| {'-' if seconds_target is None else f'{seconds_target:g}{time_ok}'} "
            f"| {'-' if run.user_s is None else f'{run.user_s:.1f} / {run.sys_s:.1f}'} "
            f"| {run.peak_rss_bytes / 1e6:,.0f} | {ratio:.2f} | {rss_target:g} {'met' if ratio <= rss_target else 'not met'} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "a", encoding="utf-8") as f:
            f.write("\n" + text + "\n")


def _nsys_reader() -> str:
    """Which reader loads nsys exports here: the C page reader, else connectorx, else sqlite3's rows."""
    from advisor.trace import nsys, pages

    if pages.library() is not None:
        return "C page reader (advisor/trace/csrc/sqlite_pages.c)"
    return "connectorx" if nsys._cx is not None else "sqlite3 rows"


if __name__ == "__main__":
    main()
