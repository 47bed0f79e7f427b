"""How many configurations the estimator sizes per second on one core (target: at least 20,000/s).

Run: ``.venv/bin/python bench/estimator_speed.py [--against REV]``. Prints figures measured side by
side in one run: the estimate alone over prebuilt setups, and a planner-like loop that also builds and
validates each Setup (dataclasses.replace over layouts) before estimating it; then the same two loops
with the estimator of git revision REV (default 85e1556, before the shape-by-shape rate model), loaded
from git into this process, so the ratio holds on whatever machine runs it.
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
import time
import types
from dataclasses import replace
from pathlib import Path

from advisor.estimate.estimator import estimate
from advisor.spec.presets import get_hardware, get_model
from advisor.spec.specs import ParallelSpec, Setup, TrainSpec

TARGET_PER_S = 20_000


def layouts(gpus: int = 64) -> list[tuple[int, int, int, int, int]]:
    out = []
    for tp, pp, cp, zero, mb in itertools.product((1, 2, 4, 8), (1, 2, 4, 8), (1, 2), (0, 1, 2, 3), (1, 2, 4)):
        if gpus % (tp * pp * cp) == 0:
            out.append((tp, pp, cp, zero, mb))
    return out


BASELINE_REV = "85e1556"


def baseline_estimate(rev: str):
    """The ``estimate`` of the estimator at git revision ``rev``, as a separate module (before the stage
    sub-packages it was ``advisor/estimator.py`` and imported ``advisor.specs``: both are looked for)."""
    root = Path(__file__).resolve().parents[1]
    for where in ("advisor/estimate/estimator.py", "advisor/estimator.py"):
        shown = subprocess.run(["git", "show", f"{rev}:{where}"], cwd=root, capture_output=True, text=True)
        if shown.returncode == 0:
            break
    else:
        raise SystemExit(f"no estimator at revision {rev}")
    import advisor.spec.specs

    sys.modules.setdefault("advisor.specs", advisor.spec.specs)  # the flat package's name for the specs
    name = f"estimator_{rev}"
    mod = types.ModuleType(name)
    sys.modules[name] = mod  # dataclasses look their module up
    exec(compile(shown.stdout, f"{rev}:{where}", "exec"), mod.__dict__)
    return mod.estimate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", default=BASELINE_REV, help="git revision of the estimator to compare with")
    args = ap.parse_args()
    model = get_model("llama-3.1-70b")
    hw = get_hardware("h200")
    base = Setup(model, TrainSpec(seq_len=8192, global_batch=512), ParallelSpec(dp=64), hw)
    grid = layouts()
    setups = []
    for tp, pp, cp, zero, mb in grid:
        par = ParallelSpec(dp=64 // (tp * pp * cp), tp=tp, pp=pp, cp=cp, zero=zero, sequence_parallel=tp > 1)
        setups.append(Setup(model, replace(base.train, micro_batch=mb), par, hw))

    def bench_estimate(fn) -> float:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 2.0:
            for s in setups:
                fn(s)
            n += len(setups)
        return n / (time.perf_counter() - t0)

    def bench_build_and_estimate(fn) -> float:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 2.0:
            for tp, pp, cp, zero, mb in grid:
                par = ParallelSpec(dp=64 // (tp * pp * cp), tp=tp, pp=pp, cp=cp, zero=zero, sequence_parallel=tp > 1)
                fn(Setup(model, replace(base.train, micro_batch=mb), par, hw))
            n += len(grid)
        return n / (time.perf_counter() - t0)

    old = baseline_estimate(args.against)
    # Alternated, so a change in the machine's load hits both alike.
    est_rate, old_est = bench_estimate(estimate), bench_estimate(old)
    full_rate, old_full = bench_build_and_estimate(estimate), bench_build_and_estimate(old)
    print(f"layouts in the grid: {len(grid)} (llama-3.1-70b, 64 x H200)")
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
