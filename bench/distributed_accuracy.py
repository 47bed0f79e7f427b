"""Distributed runs on 2 CPU processes: predicted per-rank memory, communication and pipeline bubble
against what the runs measured (targets: dry run within 8 % of the measured peak, communication bytes
within 5 % of the analytic count).

Run: ``.venv/bin/python bench/distributed_accuracy.py`` (about 3 minutes on 2 shared cores). For each
model and layout (DDP, FSDP2 ZeRO-2 and ZeRO-3, TP 2 with and without SP, PP 2 with 4 micro-batches
(1F1B), PP 3 with 2 (torch's GPipe, which the eager step runs with fewer micro-batches than stages))
it profiles one step on gloo with ``profile_run`` (2 or 3 processes under torchrun), then compares,
rank by rank:

- memory: ``rank_peak_memory_bytes`` against ``estimate(setup)`` (the first or last stage's breakdown
  for a pipeline rank, a middle one's where it is the fullest) and ``dry_run_distributed(setup)``
  (data-parallel layouts only), on the setup as the run recorded it in run.json;
- communication: calls and bytes per step of the collectives the layout's formula counts, measured
  from the trace (``collectives.collective_calls`` with sizes from ``collective_sizes``: the
  tensor shapes record_shapes wrote), against the formula (module docstring of ``analytic_comm``);
- bubble: ``collectives.pipeline_bubble`` against (p-1)/m.

Writes the tables to ``bench/results/distributed_accuracy_cpu.md``; everything below the line
``<!-- analysis -->`` there is written by hand and kept when the script reruns.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd
import torch

from advisor.analysis.collectives import collective_calls, collective_sizes, pipeline_bubble
from advisor.analysis.summary import load_trace
from advisor.estimate.estimator import estimate
from advisor.run.dryrun import dry_run_distributed
from advisor.run.launcher import profile_run
from advisor.spec.options import RunOptions
from advisor.spec.presets import gpt2_style
from advisor.spec.setup import make_setup
from advisor.spec.specs import ModelSpec, Setup, setup_from_dict
from advisor.store.runstore import RunStore

DRY_RUN_TARGET_PCT = 8.0
COMM_TARGET_PCT = 5.0
MiB = 2**20
RESULTS = Path(__file__).resolve().parent / "results" / "distributed_accuracy_cpu.md"
MARKER = "<!-- analysis -->"
COMMAND = ".venv/bin/python bench/distributed_accuracy.py"

# A GPT-2 shaped model a little larger than tiny (16.3M parameters, 79 % of them the 50257 x 256
# embedding, whose odd row count FSDP pads).
GPT2_16M = gpt2_style("gpt2-16m", n_layers=4, hidden=256, n_heads=4)
MODELS: list[str | ModelSpec] = ["tiny", GPT2_16M]
BASE = {"gpu": "cpu", "seq": 64, "micro_batch": 2, "precision": "fp32"}
# global_batch 8 with micro_batch 2 on one data-parallel rank: 4 micro-batches through the pipeline.
LAYOUTS: dict[str, dict] = {
    "DDP": {"gpus": 2},
    "FSDP2 ZeRO-2": {"gpus": 2, "zero": 2},
    "FSDP2 ZeRO-3": {"gpus": 2, "zero": 3},
    "TP 2": {"gpus": 2, "tp": 2},
    "TP 2 + SP": {"gpus": 2, "tp": 2, "sequence_parallel": True},
    "PP 2, m=4": {"gpus": 2, "pp": 2, "global_batch": 8},
    # 2 micro-batches through 3 stages: every forward before any backward, so the last rank holds both.
    "PP 3, m=2 (GPipe)": {"gpus": 3, "pp": 3, "global_batch": 4},
}
OPTIONS = RunOptions(device="cpu", steps=1, warmup=0, nproc=2)
# Bytes each rank sends per byte of a collective's full buffer under the ring algorithms, n ranks
# (nccl-tests doc/PERFORMANCE.md, "bus bandwidth"); a recv sends nothing.
WIRE = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "send": lambda n: 1.0,
    "recv": lambda n: 0.0,
}


@dataclass
class Result:
    model: str
    layout: str
    setup: Setup
    wall_s: float
    metrics: dict
    memory: list[dict] = field(default_factory=list)
    comm: dict = field(default_factory=dict)
    bubble: pd.DataFrame | None = None
    error: str = ""


def analytic_comm(setup: Setup) -> dict:
    """Per rank and step: the kinds the layout's formula counts, their calls and full-buffer bytes.

    DDP: one ring all-reduce of the gradients per step (no_sync on earlier micro-batches); its call
    count is the number of DDP buckets, which the formula leaves open (None). FSDP (Rajbhandari et al.
    2019; every block and the root are units): per micro-batch an all-gather of the parameters in
    forward, again in backward under ZeRO-3, and a reduce-scatter of the gradients.

    TP (Shoeybi et al. 2019), per micro-batch: each block all-reduces b x s x h activations twice in
    forward (after attention and after the MLP) and twice in backward (the inputs' gradients of the
    q/k/v and gate/up projections); the vocabulary-parallel embedding all-reduces its output and the
    column-parallel head its input's gradient; ``loss_parallel`` all-reduces three b x s fp32 vectors
    (the max and the sum of exponentials of each token's logits, and the target's logit). With SP
    every activation all-reduce is an all-gather plus a reduce-scatter of the same volume (Korthikanti
    et al. 2022): the embedding reduce-scatters into sequence shards, except with learned positions,
    where it all-reduces and the first block's input is cut (its gradient all-gathered in backward);
    the head all-gathers the final norm's output and reduce-scatters its gradient. SP also all-reduces
    the norms' weight (and bias) gradients, once per step (advisor.run.parallel.apply_tp).

    PP: per micro-batch the activation (b x s x h) sent forward and its gradient sent back over each
    of the pp - 1 stage boundaries: 2 (pp - 1) m sends and as many receives, 2 (pp - 1) m / pp of each
    per rank on average (m each on a 2-stage pipeline). Element size: 4 bytes (fp32 weights, gradients
    and activations in these runs).
    """
    m, p, t = setup.model, setup.parallel, setup.train
    e = 4
    mb = setup.grad_accum
    act = t.micro_batch * t.seq_len * m.hidden * e
    params = m.n_params * e
    units = m.n_layers + 1
    if p.pp > 1:
        calls = 2 * (p.pp - 1) * mb / p.pp
        return {"send": (calls, calls * act), "recv": (calls, calls * act)}
    if p.tp > 1:
        edges = 4 * m.n_layers + 2  # the blocks' four, the embedding's and the head's
        loss = 3 * mb, 3 * mb * t.micro_batch * t.seq_len * 4
        if not p.sequence_parallel:
            return {"all_reduce": (edges * mb + loss[0], edges * mb * act + loss[1])}
        learned = int(m.position == "learned")
        norms = (2 * m.n_layers + 1) * (2 if m.norm_bias else 1)
        all_reduce = (learned * mb + loss[0] + norms, learned * mb * act + loss[1] + norms * m.hidden * e)
        return {
            "all_gather": (edges * mb, edges * mb * act),
            "reduce_scatter": ((edges - learned) * mb, (edges - learned) * mb * act),
            "all_reduce": all_reduce,
        }
    if p.zero == 0:
        return {"all_reduce": (None, params)}
    passes = 2 if p.zero == 3 else 1
    return {"all_gather": (passes * units * mb, passes * params * mb), "reduce_scatter": (units * mb, params * mb)}


def run_layout(model: str | ModelSpec, layout: str, store: RunStore) -> Result:
    setup = make_setup(model=model, **BASE, **LAYOUTS[layout])
    start = time.perf_counter()
    run = profile_run(setup, replace(OPTIONS, nproc=setup.gpus), store)
    name = setup.model.name
    if run.status != "ok":
        return Result(name, layout, setup, time.perf_counter() - start, {}, error=run.record["message"])
    recorded = setup_from_dict(run.record["setup"])
    result = Result(name, layout, recorded, time.perf_counter() - start, run.metrics() or {})
    result.memory = memory_rows(recorded, result.metrics)
    table = load_trace(run.path)
    calls = collective_calls(table, collective_sizes(table))
    result.comm = comm_summary(recorded, table, calls)
    if recorded.parallel.pp > 1:
        result.bubble = pipeline_bubble(table, recorded)
    return result


def memory_rows(setup: Setup, metrics: dict) -> list[dict]:
    """Per rank: measured peak (DDP's bucket buffers included: advisor.run.memprobe.ddp_bucket_bytes),
    estimate (None for a middle pipeline rank that is not the fullest: the estimate reports the first,
    the last and the fullest rank), and dry run (None for tp/pp)."""
    est = estimate(setup)
    p = setup.parallel
    dry = dry_run_distributed(setup).peak_bytes if p.tp == 1 and p.pp == 1 else None
    rows = []
    for rank, measured in enumerate(metrics["rank_peak_memory_bytes"]):
        stage = rank // (p.dp * p.tp)
        if p.pp == 1:
            mem = est.memory
        else:
            by_stage = {est.memory_rank: est.memory, 0: est.memory_first_stage, p.pp - 1: est.memory_last_stage}
            mem = by_stage.get(stage)
        total = None if mem is None else mem.total_bytes
        rows.append({"rank": rank, "measured": measured, "estimate": total, "dry": dry})
    return rows


def comm_summary(setup: Setup, table: pd.DataFrame, calls: pd.DataFrame) -> dict:
    """Measured per rank (mean over ranks) and step for the kinds the formula counts, and the rest."""
    n = setup.gpus
    steps = int(table["name"].astype(str).str.fullmatch(r"ProfilerStep#\d+").sum()) // n or 1
    in_step = _inside_step(table, calls)
    formula = analytic_comm(setup)
    counted = calls[in_step & calls["kind"].isin(list(formula))]
    extra = calls[in_step & ~calls["kind"].isin(list(formula))]
    measured_calls = len(counted) / n / steps
    measured_bytes = counted["bytes"].sum() / n / steps
    # What gloo ran on the wire: a reduce-scatter runs as an all-reduce of its whole input.
    ran = counted["name"].str.removeprefix("gloo:")
    wire_ran = sum(WIRE[k](n) * b for k, b in zip(ran, counted["bytes"], strict=True)) / n / steps
    wire_formula = sum(WIRE[k](n) * b for k, (_, b) in formula.items())
    analytic_calls = sum(c for c, _ in formula.values()) if all(c is not None for c, _ in formula.values()) else None
    return {
        "kinds": ", ".join(formula),
        "calls": measured_calls,
        "analytic_calls": analytic_calls,
        "bytes": measured_bytes,
        "analytic_bytes": sum(b for _, b in formula.values()),
        "wire_ran": wire_ran,
        "wire_formula": wire_formula,
        "extra": ", ".join(
            f"{k} {len(g) / n / steps:g} x ({g['bytes'].sum() / len(g) / 1024:.1f} KiB)"
            for k, g in extra.groupby("kind")
        ),
        "exposed_frac": counted["exposed_ns"].sum() / max(int(counted["dur_ns"].sum()), 1),
    }


def _inside_step(table: pd.DataFrame, calls: pd.DataFrame) -> pd.Series:
    """Whether each call started inside its rank's ``step`` range (the loss all-reduce that logs the
    step's loss comes after it)."""
    steps = table[(table["kind"] == "annotation") & (table["name"] == "step") & (table["device"] == -1)]
    inside = pd.Series(False, index=calls.index)
    for row in steps.itertuples():
        end = row.start_ns + row.dur_ns
        inside |= (calls["rank"] == row.rank) & (calls["start_ns"] >= row.start_ns) & (calls["start_ns"] < end)
    return inside


def _err(predicted: float | None, measured: float) -> str:
    return "n/a" if predicted is None else f"{100 * (predicted - measured) / measured:+.1f}"


def memory_table(results: list[Result]) -> list[str]:
    out = [
        "| model | layout | rank | measured peak (MiB) | estimate (MiB) | estimate error (%) | dry run (MiB) "
        "| dry run error (%) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        for row in r.memory:
            dry = "n/a (tp/pp)" if row["dry"] is None else f"{row['dry'] / MiB:.2f}"
            estimated = "n/a (middle)" if row["estimate"] is None else f"{row['estimate'] / MiB:.2f}"
            out.append(
                f"| {r.model} | {r.layout} | {row['rank']} | {row['measured'] / MiB:.2f} | {estimated} "
                f"| {_err(row['estimate'], row['measured'])} | {dry} | {_err(row['dry'], row['measured'])} |"
            )
    return out


def comm_table(results: list[Result]) -> list[str]:
    out = [
        "| model | layout | kinds counted | calls measured / analytic | bytes measured (MiB) | bytes analytic (MiB) "
        "| bytes ratio | wire as gloo ran / formula | exposed share | other collectives in the step (per rank) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        c = r.comm
        if not c:
            continue
        calls = f"{c['calls']:g} / {'buckets' if c['analytic_calls'] is None else format(c['analytic_calls'], 'g')}"
        out.append(
            f"| {r.model} | {r.layout} | {c['kinds']} | {calls} | {c['bytes'] / MiB:.3f} | {c['analytic_bytes'] / MiB:.3f} "
            f"| {c['bytes'] / c['analytic_bytes']:.4f} | {c['wire_ran'] / c['wire_formula']:.3f} "
            f"| {100 * c['exposed_frac']:.0f} % | {c['extra'] or '-'} |"
        )
    return out


def bubble_table(results: list[Result]) -> list[str]:
    out = [
        "| model | rank (stage) | compute (ms) | makespan (ms) | bubble (ms) | bubble / compute | analytic (p-1)/m "
        "| modelled from stage times | bubble / step |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if r.bubble is None:
            continue
        for b in r.bubble.itertuples():
            out.append(
                f"| {r.model} | {b.rank} ({b.stage}) | {b.compute_ms:.1f} | {b.makespan_ms:.1f} | {b.bubble_ms:.1f} "
                f"| {b.bubble_frac:.3f} | {b.analytic_bubble_frac:.3f} | {b.modelled_bubble_frac:.3f} "
                f"| {b.bubble_of_step_frac:.3f} |"
            )
    return out


def summary(results: list[Result]) -> list[str]:
    out = []
    dry = [(r, row) for r in results for row in r.memory if row["dry"] is not None]
    errs = [abs(100 * (row["dry"] - row["measured"]) / row["measured"]) for _, row in dry]
    over = [
        f"{r.model} {r.layout} rank {row['rank']}"
        for (r, row), e in zip(dry, errs, strict=True)
        if e > DRY_RUN_TARGET_PCT
    ]
    out.append(
        f"- dry run vs measured peak ({len(errs)} ranks of data-parallel layouts): max |error| {max(errs):.1f} %, "
        f"target <= {DRY_RUN_TARGET_PCT:g} %: " + ("meets" if not over else f"misses ({', '.join(over)})")
    )
    est = [
        abs(100 * (row["estimate"] - row["measured"]) / row["measured"])
        for r in results
        for row in r.memory
        if row["estimate"] is not None
    ]
    out.append(f"- estimator vs measured peak ({len(est)} ranks estimated): max |error| {max(est):.1f} % (no target)")
    ratios = [(r, r.comm["bytes"] / r.comm["analytic_bytes"]) for r in results if r.comm]
    over = [f"{r.model} {r.layout} ({100 * (x - 1):+.1f} %)" for r, x in ratios if abs(x - 1) * 100 > COMM_TARGET_PCT]
    out.append(
        f"- communication bytes vs the analytic count ({len(ratios)} runs): max |error| "
        f"{max(abs(x - 1) for _, x in ratios) * 100:.2f} %, target <= {COMM_TARGET_PCT:g} %: "
        + ("meets" if not over else f"misses ({', '.join(over)})")
    )
    return out


def main() -> None:
    load_before = os.getloadavg()
    start = time.perf_counter()
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="advisor-dist-bench-") as tmp:
        store = RunStore(Path(tmp))
        for model in MODELS:
            for layout in LAYOUTS:
                r = run_layout(model, layout, store)
                results.append(r)
                note = r.error or (f"bytes ratio {r.comm['bytes'] / r.comm['analytic_bytes']:.4f}" if r.comm else "")
                print(f"{r.model:10s} {layout:18s} {r.wall_s:5.1f} s  {note}", flush=True)
    failed = [r for r in results if r.error]
    results = [r for r in results if not r.error]
    load_after = os.getloadavg()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    lines = [
        "# Distributed runs on the CPU: predicted memory, communication and bubble against measured",
        "",
        f"Command: `{COMMAND}`  ",
        f"Date: {stamp}; {time.perf_counter() - start:.0f} s for {len(results)} runs of 2 or 3 gloo processes "
        f"(steps=1, warmup=0: one profiled step)  ",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{platform.platform()}; load average (1/5/15 min) before {'/'.join(f'{x:.2f}' for x in load_before)}, "
        f"after {'/'.join(f'{x:.2f}' for x in load_after)}  ",
        f"Setups: {', '.join(str(m if isinstance(m, str) else m.name) for m in MODELS)}; seq 64, micro-batch 2, fp32, "
        "AdamW (fused); PP 2: 4 micro-batches (global batch 8), 1F1B; PP 3: 2 micro-batches (global batch 4), "
        "GPipe.",
        "",
        "## Per-rank peak memory",
        "",
        "Measured = `metrics.json` `rank_peak_memory_bytes` (live state at the profiled step's start plus the",
        "profiler's running sum of allocations). Error = (predicted - measured) / measured.",
        "",
        *memory_table(results),
        "",
        "## Communication per rank and step",
        "",
        "Measured = collectives that start inside the rank's `step` range, of the kinds the formula counts,",
        "with bytes = the full buffer of each call from the shapes in the trace (`collective_sizes`), mean",
        "over the ranks. Bytes ratio = measured / analytic (`analytic_comm`). Wire = bytes a rank sends under",
        "ring algorithms (all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n of the full buffer, send 1),",
        "with the algorithm gloo ran (its range's name) against the formula's. Exposed share = exposed time /",
        "collective time of the counted calls (`collective_calls`).",
        "",
        *comm_table(results),
        "",
        "## Pipeline bubble",
        "",
        *bubble_table(results),
        "",
        "## Summary",
        "",
        *summary(results),
        *(f"- FAILED: {r.model} {r.layout}: {r.error}" for r in failed),
        "",
    ]
    print(
        "\n".join(
            ["", *memory_table(results), "", *comm_table(results), "", *bubble_table(results), "", *summary(results)]
        )
    )
    analysis = ""
    if RESULTS.exists() and MARKER in RESULTS.read_text():
        analysis = RESULTS.read_text().split(MARKER, 1)[1]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines) + "\n" + MARKER + analysis)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
