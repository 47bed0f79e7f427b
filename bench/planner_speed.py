"""How fast the layout planner searches, against estimating every valid combination of its grid.

Run: ``.venv/bin/python bench/planner_speed.py`` (add ``--no-brute`` to skip the exhaustive runs).
For each case it prints the combinations considered, how many were estimated, the planner's time
(best of three) and combinations per second. Side by side, in the same run: the estimator's own rate
on this machine, and an exhaustive search that builds and estimates every valid combination of the
same grid (no cuts), timed where it takes under a minute and projected from the measured rate
otherwise; the exhaustive search's best layout must be the planner's. Target: 405B on 1024 H100s,
sequence 8192, in about a second.

``--budgets``: for each case, the complete plan beside plans cut by a time budget of a tenth, a quarter
and a half of the complete plan's time: is the best layout found so far the best? ``--slowest``: the
slowest request found (Maverick on 262,144 H100s, batch 2^26, four precisions), complete (budget
3600 s) and under the default budget.
"""

from __future__ import annotations

import argparse
import time

from advisor.estimate.estimator import estimate
from advisor.estimate.planner import (
    DEFAULT_TIME_BUDGET_S,
    MAX_TIME_BUDGET_S,
    PlanRequest,
    _layouts,
    _micro_batches,
    _offloads,
    _rank_key,
    _techniques,
    layout_label,
    layout_parallel,
    layout_train,
    plan,
)
from advisor.spec.presets import get_hardware, get_model
from advisor.spec.specs import Setup

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
        lay.micro_batches = _micro_batches(req, lay)  # as plan() sets them, for the stages' techniques
        if not lay.micro_batches:
            continue
        techniques = _techniques(req, lay)
        for b in lay.micro_batches:
            for zero in range(4):
                for offload in _offloads(req, zero):
                    par = layout_parallel(lay, zero, offload)
                    for technique in techniques:  # recompute modes, partial recompute, offload
                        train = layout_train(req, lay, technique, b)
                        est = estimate(Setup(req.model, train, par, req.hardware))
                        n += 1
                        # The planner's listing rule: fits, within max_memory_frac of the GPU (90 %).
                        listed = est.fits and est.memory_frac <= req.max_memory_frac
                        if listed and (best is None or _rank_key(est) < _rank_key(best)):
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


SLOWEST = ("llama-4-maverick", "h100", 262144, 8192, 2**26, ("fp32", "bf16", "fp16", "fp8"))
BUDGET_FRACTIONS = (0.1, 0.25, 0.5)


def _request(case: tuple, budget: float = DEFAULT_TIME_BUDGET_S) -> PlanRequest:
    model, gpu, gpus, seq, gb, precisions = case
    return PlanRequest(get_model(model), get_hardware(gpu), gpus, seq, gb, precisions=precisions, time_budget_s=budget)


def _name(case: tuple) -> str:
    model, gpu, gpus, seq, gb, precisions = case
    return f"{model}, {gpus:,} x {gpu}, seq {seq}, batch {gb:,}, {'+'.join(precisions)}"


def _cut_row(case: tuple, full, budget: float, label: str) -> str:
    """One table row: the plan of ``case`` under ``budget`` against the complete one, ``full``."""
    cut = plan(_request(case, budget))
    best, got = full.top[0].estimate, cut.top[0].estimate if cut.top else None
    same = "yes" if got is not None and _rank_key(got) == _rank_key(best) else "NO"
    speed = f"{got.tokens_per_s / best.tokens_per_s:.4f}" if got is not None else "nothing listed"
    in_top = sum(layout_label(e.setup) in {layout_label(f.setup) for f in full.top} for e in cut.top)
    return (
        f"| {_name(case)} | {label} | {cut.elapsed_s:.2f} | {'yes' if cut.complete else 'no'} | "
        f"{cut.layouts - cut.layouts_unsearched:,} / {cut.layouts:,} | {same} | {speed} | {in_top} of {len(cut.top)} |"
    )


def budgets() -> None:
    """The best found so far under a budget of a fraction of the complete plan's time, per case."""
    print(
        "| case | budget | s | complete | layouts searched | same #1 | #1 tokens/s vs complete | top-10 in complete top-10 |"
    )
    print("|---|---|---:|---|---:|---|---:|---|")
    for case in CASES:
        full = plan(_request(case, MAX_TIME_BUDGET_S))
        print(_cut_row(case, full, MAX_TIME_BUDGET_S, f"complete, {full.elapsed_s:.2f} s"))
        for frac in BUDGET_FRACTIONS:
            print(_cut_row(case, full, frac * full.elapsed_s, f"{frac:g} x"), flush=True)


def slowest() -> None:
    """The slowest request found, complete and under the default budget."""
    full = plan(_request(SLOWEST, MAX_TIME_BUDGET_S))
    print(
        f"{_name(SLOWEST)}: complete in {full.elapsed_s:.1f} s, {full.estimated:,} estimates; "
        f"#1 {layout_label(full.top[0].setup)}, {full.top[0].estimate.tokens_per_s:,.0f} tokens/s"
    )
    print(
        "| case | budget | s | complete | layouts searched | same #1 | #1 tokens/s vs complete | top-10 in complete top-10 |"
    )
    print("|---|---|---:|---|---:|---|---:|---|")
    print(_cut_row(SLOWEST, full, DEFAULT_TIME_BUDGET_S, f"default, {DEFAULT_TIME_BUDGET_S:g} s"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-brute", action="store_true", help="skip the exhaustive searches")
    ap.add_argument("--budgets", action="store_true", help="only the best found under a fraction of the time")
    ap.add_argument("--slowest", action="store_true", help="only the slowest request, complete and under the default")
    args = ap.parse_args()
    if args.budgets or args.slowest:
        if args.budgets:
            budgets()
        if args.slowest:
            slowest()
        return
    print(
        "| case | considered | valid | estimated | planner s | considered/s | estimates/s | exhaustive s | "
        "exhaustive / planner | same best |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    bests = []
    for model, gpu, gpus, seq, gb, precisions in CASES:
        req = _request((model, gpu, gpus, seq, gb, precisions), MAX_TIME_BUDGET_S)
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
