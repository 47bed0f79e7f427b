"""What touching memory costs on this machine: fresh pages against pages the process freed a moment ago.

The scale benchmark's times (bench/scale.py) depend on it more than on anything the tool does: every
page a process touches for the first time is zeroed by the kernel, and on a VM whose freed memory goes
back to its host (free page reporting, a balloon) the host must back it again first. A 3.7 GB dense
nsys export's event table alone is about 3 GB, touched once at least.

Run: ``.venv/bin/python bench/fresh_memory.py [--gib 2] [--idle-s 5]``. One child process, in this
order: an array of ``--gib`` GiB filled (fresh pages), freed, filled again at once (the pages glibc
just gave back, still backed), freed, then filled again after ``--idle-s`` seconds idle (long enough
for a VM's page reporting to hand them back). Prints seconds and system seconds per GiB of each, and
the ratio fresh / reused, measured side by side in the one run.

``--by-gib N`` instead holds N GiB, filled one GiB at a time, in two children one after the other:
numpy's transparent huge pages on (its default on Linux: it madvises every array of 4 MiB or more)
and off (``NUMPY_MADVISE_HUGEPAGE=0``). It prints each GiB's seconds: on a VM whose host backs guest
memory on demand, the first GiB or so (pages the guest used a moment ago, still backed) are cheap and
the rest cost what the host charges, with huge pages or without.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CHILD = """
import json, resource, sys, time
import numpy as np
gib, idle = float(sys.argv[1]), float(sys.argv[2])
n = int(gib * 2**30) // 8

def fill():
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_stime, time.perf_counter()
    a = np.ones(n)
    wall, sys_s = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_stime - r0
    del a
    return {"s_per_gib": wall / gib, "sys_s_per_gib": sys_s / gib}

out = {"fresh": fill(), "reused at once": fill()}
time.sleep(idle)
out[f"after {idle:g} s idle"] = fill()
print(json.dumps(out))
"""


BY_GIB_CHILD = """
import json, resource, sys, time
import numpy as np
held, out = [], []
for _ in range(int(sys.argv[1])):
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_stime, time.perf_counter()
    held.append(np.ones(2**30 // 8))
    out.append([time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_stime - r0])
print(json.dumps(out))
"""


def by_gib(gib: int, pause_s: float) -> None:
    """Each GiB's cost as a child holds ``gib`` GiB, with numpy's huge pages on and off."""
    rows = {}
    for label, env in (("huge pages on (numpy's default)", "1"), ("huge pages off", "0")):
        proc = subprocess.run(
            [sys.executable, "-c", BY_GIB_CHILD, str(gib)],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "NUMPY_MADVISE_HUGEPAGE": env},
        )
        rows[label] = json.loads(proc.stdout)
        time.sleep(pause_s)  # the host takes the freed memory back before the next child
    print(f"{gib} GiB held by one child, filled with np.ones one GiB at a time (s, system s):\n")
    print("| GiB | " + " | ".join(rows) + " |")
    print("|---:|" + "---:|" * len(rows))
    for i in range(gib):
        cells = " | ".join(f"{r[i][0]:.2f} ({r[i][1]:.2f})" for r in rows.values())
        print(f"| {i + 1} | {cells} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="array size, GiB (default 2)")
    ap.add_argument("--idle-s", type=float, default=5.0, help="seconds idle before the last fill (default 5)")
    ap.add_argument("--by-gib", type=int, default=0, help="hold this many GiB, one at a time (see above)")
    args = ap.parse_args()
    if args.by_gib:
        if not 1 <= args.by_gib <= 64:
            raise SystemExit(f"--by-gib={args.by_gib} must be 1 to 64")
        by_gib(args.by_gib, args.idle_s)
        return
    if not 0 < args.gib <= 64 or not 0 <= args.idle_s <= 600:
        raise SystemExit(f"--gib={args.gib:g} must be in (0, 64]; --idle-s={args.idle_s:g} in [0, 600]")
    # One fresh child: the pages it touches first are new to it whatever this process did before.
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(args.gib), str(args.idle_s)], capture_output=True, text=True, check=True
    )
    rows = json.loads(proc.stdout)
    print(f"{args.gib:g} GiB filled with np.ones in one child process:\n")
    print("| pages | s per GiB | system s per GiB |")
    print("|---|---:|---:|")
    for label, r in rows.items():
        print(f"| {label} | {r['s_per_gib']:.2f} | {r['sys_s_per_gib']:.2f} |")
    ratio = rows["fresh"]["s_per_gib"] / max(rows["reused at once"]["s_per_gib"], 1e-9)
    print(f"\nfresh / reused at once: {ratio:.1f}x")


if __name__ == "__main__":
    main()
