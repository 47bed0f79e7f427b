"""How fast the layout planner searches, against estimating every valid combination of its grid.

Run: ``.venv/bin/python bench/planner_speed.py`` (add ``--no-brute`` to skip the exhaustive runs).
For each case it prints the combinations considered, how many were estimated, the planner's time
(best of three) and combinations per second. Side by side, in the same run: the estimator's own rate
on this machine, and an exhaustive search that builds and estimates every valid combination of the
same grid (no cuts), timed where it takes under a minute and projected from the measured rate
otherwise; the exhaustive search's best layout must be the planner's. Target: 405B on 1024 H100s,
sequence 8192, in about a second.
"""

from __future__ import annotations

import argparse
import time

from advisor.estimate.estimator import estimate
from advisor.estimate.planner import (
    PlanRequest,
    _layouts,
    _micro_batches,
    _offloads,
    _rank_key,
    layout_label,
    layout_parallel,
    layout_train,
    plan,
)
from advisor.spec.presets import get_hardware, get_model
from advisor.spec.specs import RECOMPUTE_MODES, Setup

TARGET_S = 1.0
CASES = [
    ("llama-3.1-405b", "h100", 1024, 8192, 2048, ("bf16",)),
    ("llama-3.1-405b", "h100", 1024, 8192, 2048, ("bf16", "fp8")),
    ("llama-3.1-70b", "h200", 64, 8192, 128, ("bf16",)),
    ("llama-3.1-70b", "h100", 8, 4096, 16, ("bf16",)),
    ("mixtral-8x7b", "h100", 256, 4096, 1024, ("bf16",)),
    ("llama-4-maverick", "h100", 1024, 8192, 2048, ("bf16",)),
]
BRUTE_LIMIT_S = 60.0


def exhaustive(req: PlanRequest) -> tuple[int, float, object]:
    """Build and estimate every valid combination of the planner's grid: (count, seconds, best)."""
    n, best, t0 = 0, None, time.perf_counter()
    for lay in _layouts(req):
        for b in _micro_batches(req, lay):
            for zero in range(4):
                for offload in _offloads(req, zero):
                    par = layout_parallel(lay, zero, offload)
                    for recompute in RECOMPUTE_MODES:
                        train = layout_train(req, lay, recompute, b)
                        est = estimate(Setup(req.model, train, par, req.hardware))
                        n += 1
                        if est.fits and (best is None or _rank_key(est) < _rank_key(best)):
                            best = est
    return n, time.perf_counter() - t0, best


def estimator_rate(req: PlanRequest, seconds: float = 1.0) -> float:
    """Estimates per second of one representative setup of this request (the planner's first pick)."""
    setup = plan(req).top[0].setup
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(200):
            estimate(setup)
        n += 200
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-brute", action="store_true", help="skip the exhaustive searches")
    args = ap.parse_args()
    print(
        "| case | considered | valid | estimated | planner s | considered/s | estimates/s | exhaustive s | "
        "exhaustive / planner | same best |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    bests = []
    for model, gpu, gpus, seq, gb, precisions in CASES:
        req = PlanRequest(get_model(model), get_hardware(gpu), gpus, seq, gb, precisions=precisions)
        runs = [plan(req) for _ in range(3)]
        res = min(runs, key=lambda r: r.elapsed_s)
        valid = res.considered - res.invalid
        rate = estimator_rate(req)
        projected_s = valid / rate
        name = f"{model}, {gpus} x {gpu}, seq {seq}, batch {gb}, {'+'.join(precisions)}"
        if args.no_brute or projected_s > BRUTE_LIMIT_S:
            brute, same = f"~{projected_s:,.1f} (projected)", "not run"
        else:
            count, brute_s, best = exhaustive(req)
            assert count == valid, (count, valid)
            top = res.top[0].estimate if res.top else None
            same = (
                "yes"
                if (best is None and top is None) or (best and top and _rank_key(best) == _rank_key(top))
                else "NO"
            )
            brute = f"{brute_s:,.2f}"
            projected_s = brute_s
        print(
            f"| {name} | {res.considered:,} | {valid:,} | {res.estimated:,} | {res.elapsed_s:.2f} | "
            f"{res.considered / res.elapsed_s:,.0f} | {rate:,.0f} | {brute} | {projected_s / res.elapsed_s:,.1f}x | {same} |"
        )
        bests.append(f"- {name}: " + (layout_label(res.top[0].setup) if res.top else "nothing fits"))
    print("\nBest layout per case:")
    print("\n".join(bests))
    big = plan(PlanRequest(get_model("llama-3.1-405b"), get_hardware("h100"), 1024, 8192, 2048))
    verdict = "meets" if big.elapsed_s <= TARGET_S else "MISSES"
    print(f"\n405B on 1024 x H100, seq 8192: {big.elapsed_s:.2f} s; target ~{TARGET_S:.0f} s: {verdict} it")


if __name__ == "__main__":
    main()
