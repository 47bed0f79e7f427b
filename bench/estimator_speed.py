"""How many configurations the estimator sizes per second on one core (target: at least 20,000/s).

Run: ``.venv/bin/python bench/estimator_speed.py``. Prints two figures measured side by side: the
estimate alone over prebuilt setups, and a planner-like loop that also builds and validates each
Setup (dataclasses.replace over layouts) before estimating it.
"""

from __future__ import annotations

import itertools
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.estimator import estimate
from advisor.presets import get_hardware, get_model
from advisor.specs import ParallelSpec, Setup, TrainSpec

TARGET_PER_S = 20_000


def layouts(gpus: int = 64) -> list[tuple[int, int, int, int, int]]:
    out = []
    for tp, pp, cp, zero, mb in itertools.product((1, 2, 4, 8), (1, 2, 4, 8), (1, 2), (0, 1, 2, 3), (1, 2, 4)):
        if gpus % (tp * pp * cp) == 0:
            out.append((tp, pp, cp, zero, mb))
    return out


def main() -> None:
    model = get_model("llama-3.1-70b")
    hw = get_hardware("h200")
    base = Setup(model, TrainSpec(seq_len=8192, global_batch=512), ParallelSpec(dp=64), hw)
    grid = layouts()
    setups = []
    for tp, pp, cp, zero, mb in grid:
        par = ParallelSpec(dp=64 // (tp * pp * cp), tp=tp, pp=pp, cp=cp, zero=zero, sequence_parallel=tp > 1)
        setups.append(Setup(model, replace(base.train, micro_batch=mb), par, hw))

    def bench_estimate() -> float:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 2.0:
            for s in setups:
                estimate(s)
            n += len(setups)
        return n / (time.perf_counter() - t0)

    def bench_build_and_estimate() -> float:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 2.0:
            for tp, pp, cp, zero, mb in grid:
                par = ParallelSpec(dp=64 // (tp * pp * cp), tp=tp, pp=pp, cp=cp, zero=zero, sequence_parallel=tp > 1)
                estimate(Setup(model, replace(base.train, micro_batch=mb), par, hw))
            n += len(grid)
        return n / (time.perf_counter() - t0)

    est_rate = bench_estimate()
    full_rate = bench_build_and_estimate()
    print(f"layouts in the grid: {len(grid)} (llama-3.1-70b, 64 x H200)")
    print(f"estimate only:           {est_rate:10,.0f} configurations/s")
    print(f"build + validate + est.: {full_rate:10,.0f} configurations/s")
    print(f"ratio build+estimate / estimate: {full_rate / est_rate:.2f}")
    verdict = "meets" if full_rate >= TARGET_PER_S else "MISSES"
    print(f"target {TARGET_PER_S:,}/s on one core: {verdict} it ({full_rate / TARGET_PER_S:.1f}x)")


if __name__ == "__main__":
    main()
