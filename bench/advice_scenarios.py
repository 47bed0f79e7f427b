"""Deliberately poor CPU-runnable setups: does the advisor's top recommendation help, and by as much as
it predicts?

For each scenario: profile the setup (a real step in a child process), advise on the run, take the top
recommendation that can be re-run on this machine, re-run with its action applied (advisor.advice.verify),
and set predicted beside measured on the rule's target figure (step time, peak memory or tokens/s).

    .venv/bin/python bench/advice_scenarios.py [--store DIR] [--calibration FILE] [--pairs N] [--only NAME ...]

Targets (issue 5): the top recommendation improves its measured target in at least 9 of 10 scenarios;
predicted gain within 35 % of the measured gain on average (mean of |predicted - measured| / |measured|).
The store defaults to a temporary folder (the repo's traces/ is left alone). ``--pairs N`` has each
verification re-run both sides N times in alternating order (``advisor.advice.verify``): a gain of a
few per cent is otherwise inside this machine's run-to-run noise.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from advisor.advice.advise import advise_run
from advisor.advice.verify import verifiable, verify
from advisor.errors import AdvisorError
from advisor.estimate.estimator import estimate
from advisor.run.launcher import on_this_machine, profile_run
from advisor.spec.options import RunOptions
from advisor.spec.presets import get_model
from advisor.spec.setup import make_setup
from advisor.store.runstore import RunStore

GiB = 2**30
# A model big enough for matmuls to dominate on 2 cores, small enough for a step in about a second.
SMALL = replace(get_model("tiny"), name="small-512", hidden=512, n_heads=8, n_kv_heads=4, head_dim=64, ffn_hidden=1376)
DEEP = replace(get_model("tiny"), name="tiny-8l", n_layers=8)


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    setup: dict
    options: dict = field(default_factory=dict)
    budget_frac: float = 0.0
    """Set the memory budget so the estimated peak is this share of it (0: no budget)."""
    designed_for: str = ""
    """The rule the scenario was built to trigger (reported beside what the advisor chose)."""


SCENARIOS = [
    Scenario(
        "fp32",
        "fp32 training on a CPU with AVX512-BF16",
        dict(model=SMALL, seq=256, micro_batch=4, precision="fp32"),
        designed_for="prec-fp32-to-bf16",
    ),
    Scenario(
        "fp16-on-cpu",
        "fp16 autocast on a CPU without a fast fp16 path",
        dict(model="tiny", seq=64, micro_batch=2, precision="fp16"),
        designed_for="prec-fp16-on-cpu",
    ),
    Scenario(
        "slow-data",
        "10 ms per sample to load, no DataLoader workers",
        dict(model="tiny", seq=128, micro_batch=8, precision="bf16"),
        dict(data_delay_ms=10.0),
        designed_for="input-dataloader-stall",
    ),
    Scenario(
        "few-workers",
        "40 ms per sample to load, one DataLoader worker",
        dict(model="tiny", seq=128, micro_batch=8, precision="bf16"),
        dict(data_delay_ms=40.0, num_workers=1),
        designed_for="input-more-workers",
    ),
    Scenario(
        "tiny-batch",
        "one sequence of 64 tokens per step",
        dict(model="tiny", seq=64, micro_batch=1, precision="bf16"),
        designed_for="launch-small-batch",
    ),
    Scenario(
        "unfused-optimizer",
        "AdamW as a per-parameter for-loop, 8 layers",
        dict(model=DEEP, seq=64, micro_batch=16, precision="bf16", optimizer_impl="for-loop"),
        designed_for="opt-unfused",
    ),
    Scenario(
        "needless-recompute",
        "full activation checkpointing with memory to spare",
        dict(model=SMALL, seq=256, micro_batch=4, precision="bf16", recompute="full"),
        designed_for="mem-headroom-drop-recompute",
    ),
    Scenario(
        "near-cap-activations",
        "activations near a memory budget (fused attention)",
        dict(model=DEEP, seq=512, micro_batch=8, precision="bf16"),
        budget_frac=0.92,
        designed_for="mem-near-oom-activations",
    ),
    Scenario(
        "near-cap-unfused-attention",
        "unfused attention near a memory budget",
        dict(model=DEEP, seq=512, micro_batch=8, precision="bf16", flash_attention=False),
        budget_frac=0.92,
        designed_for="mem-near-oom-flash-off",
    ),
    Scenario(
        "unfused-attention",
        "unfused attention at sequence length 1024",
        dict(model="tiny", seq=1024, micro_batch=2, precision="bf16", flash_attention=False),
        designed_for="kern-non-flash",
    ),
    Scenario(
        "offload-on-cpu",
        "all 8 blocks' activations offloaded on a CPU device (copies inline, nothing saved)",
        dict(model=DEEP, seq=256, micro_batch=4, precision="bf16", offload_activations=8),
        designed_for="mem-offload-activations-on-cpu",
    ),
    Scenario(
        "small-microbatch",
        "micro-batch 1 with 8 accumulation steps and plenty of memory",
        dict(model="tiny", seq=128, micro_batch=1, global_batch=8, precision="bf16"),
        designed_for="mem-headroom-raise-microbatch",
    ),
]


def _fmt(target: str, value: float) -> str:
    if target == "peak_memory_bytes":
        return f"{value / 2**20:,.0f} MiB"
    if target == "tokens_per_s":
        return f"{value:,.0f} tok/s"
    return f"{value:,.1f} ms"


def run_scenario(sc: Scenario, store: RunStore, steps: int, pairs: int = 1) -> dict:
    setup = make_setup(gpu="cpu", **sc.setup)
    opts = dict(device="cpu", steps=steps, **sc.options)
    if sc.budget_frac:
        need = estimate(on_this_machine(setup, "cpu")).memory.total_bytes
        opts["memory_budget_gib"] = round(need / sc.budget_frac / GiB, 4)
    base = profile_run(setup, RunOptions(**opts), store)
    if base.status != "ok":
        return {"scenario": sc.name, "error": f"baseline run {base.status}: {base.record.get('message')}"}
    advice = advise_run(base.run_id, store)
    fired = [r.rule.id for r in advice.recommendations]
    top = next((r for r in advice.recommendations if not verifiable(r, "cpu")), None)
    row = {"scenario": sc.name, "what": sc.what, "designed_for": sc.designed_for, "fired": fired}
    if top is None:
        return row | {"error": "no recommendation can be re-run here"}
    v = verify(base.run_id, top.rule.id, store, pairs=pairs)
    rel = abs(v.predicted_gain_pct - v.measured_gain_pct) / abs(v.measured_gain_pct) if v.measured_gain_pct else None
    return row | {
        "top": v.rule_id,
        "target": v.target,
        "before": v.before,
        "predicted_after": v.predicted_after,
        "measured_after": v.measured_after,
        "predicted_gain_pct": v.predicted_gain_pct,
        "measured_gain_pct": v.measured_gain_pct,
        "improved": v.measured_gain_pct > 0,
        "gain_rel_error": rel,
        "basis": v.basis,
        "noise_pct": v.noise_pct,
        "pair_gains_pct": list(v.pair_gains_pct),
        "runs": [base.run_id, *(r for pair in v.pair_run_ids for r in pair)],
    }


def table(rows: list[dict]) -> str:
    out = [
        "| scenario | top recommendation | target | before | predicted after | measured after | predicted gain | measured gain | improved | gain error | each pair |",
        "|---|---|---|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['scenario']} | error: {r['error']} | | | | | | | | | |")
            continue
        gains = r.get("pair_gains_pct") or []
        each = " / ".join(f"{g:+.1f}" for g in gains) if len(gains) > 1 else "-"
        t = r["target"]
        err = "-" if r["gain_rel_error"] is None else f"{100 * r['gain_rel_error']:.0f} %"
        top = r["top"] + ("" if r["top"] == r["designed_for"] else f" (built for {r['designed_for']})")
        out.append(
            f"| {r['scenario']} | {top} | {t} | {_fmt(t, r['before'])} | {_fmt(t, r['predicted_after'])} | "
            f"{_fmt(t, r['measured_after'])} | {r['predicted_gain_pct']:+.1f} % | {r['measured_gain_pct']:+.1f} % | "
            f"{'yes' if r['improved'] else 'NO'} | {err} | {each} |"
        )
    done = [r for r in rows if "error" not in r]
    improved = sum(r["improved"] for r in done)
    errors = [r["gain_rel_error"] for r in done if r["gain_rel_error"] is not None]
    out.append("")
    out.append(f"Top recommendation improved its measured target in {improved} of {len(done)} scenarios.")
    if errors:
        out.append(
            f"Predicted gain vs measured gain: mean relative error {100 * statistics.fmean(errors):.0f} %, "
            f"median {100 * statistics.median(errors):.0f} % (|predicted - measured| / |measured|)."
        )
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", help="run store folder (default: a temporary folder, deleted afterwards)")
    ap.add_argument(
        "--calibration",
        help="a calibration JSON to copy into the store (gains then use it; re-runs refit it only once the "
        "store holds as many runs as it was fitted on), or a calibrated store's folder: its runs and "
        "calibration are copied in, and each verification refits on them and the bench's runs together",
    )
    ap.add_argument("--only", nargs="*", help="scenario names")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=1, help="re-run pairs per verification (default 1)")
    ap.add_argument("--json", help="also write the rows as JSON here")
    args = ap.parse_args()
    tmp = None if args.store else tempfile.mkdtemp(prefix="advice-scenarios-")
    store = RunStore(args.store or tmp)
    store.root.mkdir(parents=True, exist_ok=True)
    if args.calibration and Path(args.calibration).is_dir():
        src = Path(args.calibration)
        if not any((src / "calibration").glob("*.json")):
            ap.error(f"--calibration {src}: a store folder needs a calibration/ with a calibration JSON in it")
        for item in src.iterdir():
            if item.is_dir() and not item.name.startswith(".") and not (store.root / item.name).exists():
                shutil.copytree(item, store.root / item.name)
    elif args.calibration:
        dest = store.root / "calibration" / Path(args.calibration).name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(args.calibration, dest)
    chosen = [s for s in SCENARIOS if not args.only or s.name in args.only]
    rows = []
    t0 = time.perf_counter()
    try:
        for sc in chosen:
            try:
                row = run_scenario(sc, store, args.steps, args.pairs)
            except AdvisorError as err:
                row = {"scenario": sc.name, "error": str(err)}
            rows.append(row)
            print(json.dumps(row, default=str), file=sys.stderr, flush=True)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    print(table(rows))
    print(f"\n{len(chosen)} scenarios, {time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2, default=str), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
