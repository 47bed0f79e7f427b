"""Estimator speed: configurations per second on one core, against an earlier revision's whole package.

Run: ``.venv/bin/python bench/estimator_speed.py [--against REV]``. Prints figures measured side by
side in one run: the estimate alone over prebuilt setups, and a planner-like loop that also builds and
validates each Setup (dataclasses.replace over layouts) before estimating it; then the same two loops
with the package of git revision REV (default 85e1556, before the shape-by-shape rate model). REV's
``advisor/`` is extracted whole into a temporary folder and each side runs in its own worker process,
alternated round by round, so neither side borrows the other's modules and a change in the machine's
load hits both alike.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import replace
from io import BytesIO
from pathlib import Path

TARGET_PER_S = 20_000
BASELINE_REV = "85e1556"
ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 3  # worker runs per side, alternated; the median is reported


def layouts(gpus: int = 64) -> list[tuple[int, int, int, int, int]]:
    out = []
    for tp, pp, cp, zero, mb in itertools.product((1, 2, 4, 8), (1, 2, 4, 8), (1, 2), (0, 1, 2, 3), (1, 2, 4)):
        if gpus % (tp * pp * cp) == 0:
            out.append((tp, pp, cp, zero, mb))
    return out


def _package():
    """estimate, get_model, get_hardware and the spec classes of whichever ``advisor`` is on the path:
    the stage sub-packages, or the flat package of revisions before them."""
    try:
        est = importlib.import_module("advisor.estimate.estimator")
        presets = importlib.import_module("advisor.spec.presets")
        specs = importlib.import_module("advisor.spec.specs")
    except ModuleNotFoundError:
        est = importlib.import_module("advisor.estimator")
        presets = importlib.import_module("advisor.presets")
        specs = importlib.import_module("advisor.specs")
    return est.estimate, presets.get_model, presets.get_hardware, specs


def worker(seconds: float) -> dict[str, float]:
    """Both loops on this process's ``advisor``: configurations per second."""
    estimate, get_model, get_hardware, specs = _package()
    model, hw = get_model("llama-3.1-70b"), get_hardware("h200")
    base = specs.Setup(model, specs.TrainSpec(seq_len=8192, global_batch=512), specs.ParallelSpec(dp=64), hw)
    grid = layouts()

    def parallel(tp, pp, cp, zero):
        return specs.ParallelSpec(dp=64 // (tp * pp * cp), tp=tp, pp=pp, cp=cp, zero=zero, sequence_parallel=tp > 1)

    setups = [specs.Setup(model, replace(base.train, micro_batch=mb), parallel(*g), hw) for *g, mb in grid]

    def rate(body, n_each: int) -> float:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            body()
            n += n_each
        return n / (time.perf_counter() - t0)

    def estimate_only():
        for s in setups:
            estimate(s)

    def build_and_estimate():
        for *g, mb in grid:
            estimate(specs.Setup(model, replace(base.train, micro_batch=mb), parallel(*g), hw))

    return {"estimate": rate(estimate_only, len(setups)), "build": rate(build_and_estimate, len(grid))}


def extract(rev: str, into: Path) -> Path:
    """REV's ``advisor/`` package, whole, under ``into``."""
    archive = subprocess.run(["git", "archive", rev, "advisor"], cwd=ROOT, capture_output=True, check=False)
    if archive.returncode != 0:
        raise SystemExit(f"no advisor/ at revision {rev}: {archive.stderr.decode().strip()}")
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into


def run_worker(path: Path, seconds: float) -> dict[str, float]:
    """One worker process on the ``advisor`` package under ``path``: its two rates."""
    env = {**os.environ, "PYTHONPATH": str(path)}
    # -P keeps bench/ off the path; PYTHONPATH comes before the editable install's finder, and the
    # worker says which advisor it imported, checked here.
    cmd = [sys.executable, "-P", str(Path(__file__).resolve()), "--worker", str(seconds)]
    done = subprocess.run(cmd, env=env, cwd=path, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"worker on {path} failed:\n{done.stderr[-2000:]}")
    out = json.loads(done.stdout.splitlines()[-1])
    if Path(out.pop("package")).resolve() != (path / "advisor").resolve():
        raise SystemExit(f"the worker for {path} imported another advisor")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", default=BASELINE_REV, help="git revision of the package to compare with")
    ap.add_argument("--seconds", type=float, default=2.0, help="length of each loop in each worker run")
    ap.add_argument("--worker", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        rates = worker(args.worker)
        import advisor

        print(json.dumps({**rates, "package": str(Path(advisor.__file__).parent)}))
        return
    with tempfile.TemporaryDirectory() as tmp:
        old_tree = extract(args.against, Path(tmp))
        now, old = [], []
        for _ in range(ROUNDS):
            now.append(run_worker(ROOT, args.seconds))
            old.append(run_worker(old_tree, args.seconds))

    def median(runs, key):
        return statistics.median(r[key] for r in runs)

    est_rate, old_est = median(now, "estimate"), median(old, "estimate")
    full_rate, old_full = median(now, "build"), median(old, "build")
    print(f"layouts in the grid: {len(layouts())} (llama-3.1-70b, 64 x H200); median of {ROUNDS} alternated runs")
    print(
        f"estimate only:           {est_rate:10,.0f} configurations/s ({args.against}: {old_est:,.0f}; ratio {est_rate / old_est:.2f})"
    )
    print(
        f"build + validate + est.: {full_rate:10,.0f} configurations/s ({args.against}: {old_full:,.0f}; ratio {full_rate / old_full:.2f})"
    )
    print(f"ratio build+estimate / estimate: {full_rate / est_rate:.2f}")
    verdict = "meets" if full_rate >= TARGET_PER_S else "MISSES"
    print(f"target {TARGET_PER_S:,}/s on one core: {verdict} it ({full_rate / TARGET_PER_S:.1f}x)")


if __name__ == "__main__":
    main()
