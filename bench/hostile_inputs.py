"""Hostile traces (issue 22) beside a plain trace of the same event count: load time and peak RSS.

Inputs, generated into a temporary folder by tests/hostile.py (nothing large is committed):

- plain: ``--events`` Kineto events (launch + kernel pairs), one per line as Kineto writes them;
- the issue's tiny upload: one event whose name is 16, 32 or 64 MiB of "a" with no end (65 KB of gzip
  at 64 MiB), read with the default event cap (refused at 16 MiB) and with the cap raised to 128 MiB
  (the whole name read, then refused as truncated): time must grow linearly with the bytes;
- the same names closed, followed by the plain events: loaded;
- the plain events followed by ``--pad-mib`` (1 GiB) of blanks, in a zip and in a gzip: loaded, with
  memory as for the plain trace; and the gzip again under a 512 MiB budget: refused at the budget.

Each load runs in a fresh child process; time is ``time.perf_counter`` (wall) and ``time.process_time``
(CPU: steadier on a shared machine) around ``load_trace`` only (the imports excluded), the run with the
least CPU kept; peak RSS the child's VmHWM less that of a child that only imports, best of
``--repeats``. Targets: time linear in bytes (MiB/s about constant down a column),
net RSS at most 1.5x the decompressed event bytes, and never more than the configured budget.

Run: ``.venv/bin/python bench/hostile_inputs.py [--events 200000] [--pad-mib 1024] [--out FILE]``.
``--baseline DIR`` also runs every row with another checkout's loader (e.g. ``/work/main`` before a
change), for the before/after columns; ``--old-baseline`` limits it to the rows a loader without an
event cap can run (names up to 32 MiB: 64 MiB took the loader before issue 22 78 s).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _generators():
    """tests/hostile.py, the generators the reliability tests use, loaded from its file (neither
    folder is an installed package)."""
    spec = importlib.util.spec_from_file_location("hostile", ROOT / "tests" / "hostile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


H = _generators()

MIB = 2**20
# Peak RSS is the child's VmHWM: ru_maxrss from wait4 or getrusage also counts the image the child was
# forked from before its exec (Linux keeps that high-water mark), here the generator's hundreds of MiB.
HWM = "int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]) / 1024"
CHILD = f"""
import json, sys, time
from advisor.analysis.summary import load_trace
path, kwargs = sys.argv[1], json.loads(sys.argv[2])
start, cpu = time.perf_counter(), time.process_time()
try:
    table = load_trace(path, **kwargs)
    outcome = f"loaded {{len(table):,}} events"
except Exception as err:
    outcome = f"{{type(err).__name__}}: {{str(err)[:90]}}"
wall, cpu = time.perf_counter() - start, time.process_time() - cpu
print(json.dumps({{"s": wall, "cpu_s": cpu, "outcome": outcome, "rss_mib": {HWM}}}))
"""
IMPORT_ONLY = f"""
import json
import advisor.analysis.summary
print(json.dumps({{"rss_mib": {HWM}}}))
"""


def _child(code: str, args: list[str], tree: Path, timeout_s: float) -> dict:
    """The JSON line ``code`` printed, run in a child with ``tree`` first on the path."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=out, cwd=tree, env=env)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            nan = float("nan")
            return {"s": nan, "cpu_s": nan, "outcome": f"did not finish in {timeout_s:g} s", "rss_mib": nan}
        out.seek(0)
        return json.loads(out.read().decode().strip())


def _measure(path: Path, kwargs: dict, tree: Path, repeats: int, timeout_s: float) -> dict:
    runs = [_child(CHILD, [str(path), json.dumps(kwargs)], tree, timeout_s) for _ in range(repeats)]
    return {**min(runs, key=lambda r: r["cpu_s"]), "rss_mib": min(r["rss_mib"] for r in runs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--pad-mib", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout to run the rows with")
    ap.add_argument(
        "--old-baseline", action="store_true", help="the baseline takes no event cap: only the rows it can run"
    )
    ap.add_argument("--timeout-s", type=float, default=300)
    ap.add_argument("--out", type=Path, default=None, help="also write the Markdown table here")
    args = ap.parse_args()
    evs = H.events(args.events)
    event_mib = len(H.event_bytes(evs)) / MIB
    tmp = Path(tempfile.mkdtemp(prefix="hostile-"))
    # label, file, load kwargs, decompressed MiB, MiB of it in events (what RSS is judged against)
    rows: list[tuple[str, Path, dict, float, float]] = []
    plain_mib = len(H.trace_bytes(evs)) / MIB
    rows.append(("plain", H.kineto_file(tmp / "plain.json", evs), {}, plain_mib, event_mib))
    for mib in (16, 32, 64):
        path = H.long_name(tmp / f"name{mib}.json.gz", mib * MIB)
        rows.append((f"{mib} MiB name, no end (default cap)", path, {}, mib, mib))
        rows.append((f"{mib} MiB name, no end (cap 128 MiB)", path, {"max_event_bytes": 128 * MIB}, mib, mib))
    for mib in (16, 64):
        path = H.long_name(tmp / f"closed{mib}.json.gz", mib * MIB, closed=True, n_events=args.events)
        label = f"{mib} MiB name + plain events"
        rows.append((label, path, {"max_event_bytes": 128 * MIB}, mib + plain_mib, mib + event_mib))
    pad = args.pad_mib * MIB
    zipped = H.padded(tmp / "padded.zip", evs, pad)
    rows.append((f"plain + {args.pad_mib} MiB blanks, zip", zipped, {}, plain_mib + args.pad_mib, event_mib))
    gz = H.padded(tmp / "padded.json.gz", evs, pad)
    rows.append((f"plain + {args.pad_mib} MiB blanks, gzip", gz, {}, plain_mib + args.pad_mib, event_mib))
    # A zip's header gives its size away and is refused at once; a gzip's is found out by reading it.
    rows.append(("the gzip, 512 MiB budget", gz, {"max_bytes": 512 * MIB}, 512, event_mib))
    trees = {"now": ROOT} | ({"before": args.baseline} if args.baseline else {})
    base = {name: min(_child(IMPORT_ONLY, [], tree, 60)["rss_mib"] for _ in range(2)) for name, tree in trees.items()}
    lines = [
        f"Plain events: {args.events:,} ({event_mib:.1f} MiB of JSON). Net RSS: peak RSS less an import-only "
        f"child's ({base['now']:.0f} MiB). Best of {args.repeats}.",
        "",
        "| input | file KiB | decompressed MiB | loader | wall s | CPU s | MiB per CPU s | net RSS MiB | RSS / event bytes | outcome |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for label, path, kwargs, mib, events_mib in rows:
        for name, tree in trees.items():
            # The loader before issue 22 takes no event cap, and 78 s on the 64 MiB name.
            if name != "now" and args.old_baseline and (kwargs or (mib > 32 and events_mib == mib)):
                continue
            r = _measure(path, kwargs, tree, args.repeats, args.timeout_s)
            net = r["rss_mib"] - base[name]
            line = (
                f"| {label} | {path.stat().st_size / 1024:,.0f} | {mib:,.1f} | {name} | {r['s']:.2f} | {r['cpu_s']:.2f} | "
                f"{mib / r['cpu_s']:,.0f} | {net:,.0f} | {net / events_mib:.2f} | {r['outcome']} |"
            )
            print(line, flush=True)
            lines.append(line)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
