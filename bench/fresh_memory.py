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
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="array size, GiB (default 2)")
    ap.add_argument("--idle-s", type=float, default=5.0, help="seconds idle before the last fill (default 5)")
    args = ap.parse_args()
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
