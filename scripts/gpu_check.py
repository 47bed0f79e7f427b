"""GPU check: profiled steps on this machine's GPU beside the estimator's and the dry run's predictions.

``bash scripts/gpu_check.sh`` runs it (under 8 minutes on one H200): GPT-2 124M and Llama-3.2-1B,
fp32 vs bf16, activation checkpointing none / selective / full, each a real profiled step in a child
process. Writes ``bench/results/gpu_check_<gpu>.md`` and ``.json``: measured peak memory, the
estimator's and the dry run's predictions, step time, tokens/s and MFU. ``--device cpu --quick``
runs two tiny configurations on the CPU (the test suite does, so the script cannot rot).

First it measures the device's ceilings (``advisor.run.ceilings``: matmul FLOP/s per precision and copy
bandwidth), stores them in the check's run store, so every profiled run's roofline is judged against
them, and writes them to ``bench/results/gpu_check_<gpu>_ceilings.json``; each row carries its run's
roofline verdict and how close its GEMMs come to the measured matmul roof. Then it times the
estimator's GEMM shapes (bf16 and fp8) and flash attention forward and backward (FlashAttention-2 and
cuDNN, by sequence and head dim), ~30 s on an H200, and keeps the table as
``advisor/estimate/device_tables/<gpu>.json``: the estimator fits its rate model to it for this device
(``advisor.estimate.efficiency.fit_device_table``); the report says how well the fitted model reproduces it.

A short tiny run goes first (a fault that would fail every row fails once, and the grid is not
run); each child has ``--timeout`` seconds (240); the results are rewritten after every row, in
bench/results/ and in ``$OUT`` when set (the device machine's), so a run cut short keeps what it
finished, and a failed row carries the end of its run's log. The whole check keeps to ``--budget-s``
(450): a row it cannot start in time is filed as skipped, and the rows run in the order of what a
first GPU run needs most: the kernel rates, the techniques' model without and with full recompute, the
techniques, then the rest of the grid.

The techniques the advice is about (``technique_jobs``), on Llama-3.2-1B: bf16 vs fp8 (torchao,
tensorwise and rowwise), full recompute vs offloading half the blocks' activations vs recomputing only
half, and Unified Memory within the free memory, each with its host-link traffic beside the estimate;
a technique the machine cannot run is a row that says why, and the others run.

The distributed part (NCCL on GPUs, gloo on the CPU) profiles DDP, FSDP2 with resharding and tensor
parallel 2 with sequence parallel on every visible GPU under torchrun; with one GPU it is skipped
and says so. ``--distributed N`` sets the process count (0 skips it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from advisor.errors import AdvisorError
from advisor.estimate.estimator import estimate
from advisor.run.ceilings import measure_ceilings
from advisor.run.launcher import PROCESS_HOST_BYTES, local_device_type, on_this_machine, profile_run
from advisor.spec.options import RunOptions
from advisor.spec.presets import device_slug
from advisor.spec.setup import make_setup
from advisor.store.ceilings import store_ceilings
from advisor.store.runstore import RunFiles, RunStore

ROOT = Path(__file__).resolve().parents[1]

GiB = 2**30
FULL = [
    ("gpt2-124m", 1024, 8),
    ("llama-3.2-1b", 2048, 4),
]
QUICK = [("tiny", 128, 2)]


def _dry_run_peak(setup) -> tuple[float | None, str]:
    """The dry run's peak of ``setup``, or None and why there is none."""
    try:
        from advisor.run.dryrun import dry_run
    except ImportError as err:
        return None, f"the dry run cannot be imported: {err}"
    try:
        target = setup.hardware.kind if setup.hardware.kind == "cpu" else "cuda"
        return float(dry_run(setup, target=target).peak_bytes), ""
    except Exception as err:  # the check reports, it does not stop
        print(f"  dry run failed: {type(err).__name__}: {err}", file=sys.stderr)
        return None, f"{type(err).__name__}: {err}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--quick", action="store_true", help="two tiny configurations (CPU smoke test)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--traces", default=None, help="run store (default: a folder beside --out)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument(
        "--distributed", type=int, default=None, help="processes for the distributed part (default: every GPU; 0: skip)"
    )
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds each profiled child may take")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=450.0,
        help="seconds the whole check may take: rows it cannot start in time are filed as skipped (0: no limit)",
    )
    args = ap.parse_args()
    device = local_device_type(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = RunStore(args.traces or out / "gpu_check_traces")
    grid = QUICK if args.quick else FULL
    precisions = ("fp32", "bf16")
    recomputes = ("none", "full") if args.quick else ("none", "selective", "full")
    t_start = time.perf_counter()
    options = {"steps": args.steps, "warmup": 1, "timeout_s": args.timeout}
    # A large square matmul on the GPU (8192^3 = 1.1 TFLOP: ~2 ms in bf16 on an H200) reaches the
    # matrix units' real ceiling; 2048 leaves it launch- and tail-bound.
    cuda = device == "cuda"
    ceilings = measure_ceilings(
        device,
        ("fp32", "bf16", "fp16"),
        matmul_n=8192 if cuda else (512 if args.quick else 0),
        copy_mib=1024 if cuda else (32 if args.quick else 256),
        repeats=5 if not args.quick else 2,
    )
    store_ceilings(ceilings, store.root)
    print(f"[{time.perf_counter() - t_start:6.1f} s] ceilings: {ceilings.to_dict()}", flush=True)
    kernels = _kernel_rates(device, args.quick, out, t_start)
    report = _Report(out, args.quick, ceilings, device, t_start, kernels)
    if not args.quick:
        # A tiny run first (seconds): a fault that would fail every row fails here, once, with its log.
        setup = make_setup(model="tiny", gpu="cpu", seq=128, micro_batch=2, precision="bf16")
        row = _profile("smoke test: tiny s128 b2 bf16 none", setup, device, 1, options, store, t_start)
        report.add(row)
        if row["status"] != "ok":
            print("smoke test failed: the grid is not run", flush=True)
            return 1
    budget = _Budget(args.budget_s, t_start)
    grid_jobs = [
        (f"{model} s{seq} b{micro} {precision} {recompute}",
         make_setup(model=model, gpu="cpu", seq=seq, micro_batch=micro, precision=precision, recompute=recompute))
        for model, seq, micro in grid
        for precision in (precisions if not args.quick else ("fp32",))
        for recompute in recomputes
    ]  # fmt: skip
    # What a first GPU run needs most goes first: the techniques' model without and with full recompute
    # (what their rows compare against), then the techniques, then the rest of the grid, so a check cut
    # short by its budget loses rows of kinds measured before.
    model, seq, micro, precision = _technique_model(device, args.quick)
    baselines = {f"{model} s{seq} b{micro} {precision} {r}" for r in ("none", "full")}
    first = [j for j in grid_jobs if j[0] in baselines]
    for label, setup in first:
        report.add(budget.run(_profile, label, setup, device, 1, options, store, t_start))
    for label, setup, extra in technique_jobs(device, args.quick):
        report.add(budget.run(_profile, label, setup, device, 1, options | extra, store, t_start, dry=False))
    for label, setup in (j for j in grid_jobs if j[0] not in baselines):
        report.add(budget.run(_profile, label, setup, device, 1, options, store, t_start))
    for row in distributed_rows(device, store, args, t_start, options, budget):
        report.add(row)
    print(report.md_path.read_text(encoding="utf-8"))
    # A refused row is the machine saying what it cannot run (fp8 without fp8 units, Unified Memory on a
    # CPU), with the reason; a failed, crashed, oom or timed-out one is a fault.
    return 0 if all(r["status"] in ("ok", "skipped", "refused") for r in report.rows) else 1


class _Report:
    """The check's results, rewritten after every row (in bench/results/ and in $OUT when set), so a
    run cut short by a time limit still leaves every finished row behind."""

    def __init__(self, out: Path, quick: bool, ceilings, device: str, t_start: float, kernels: str = "") -> None:
        self.out, self.quick, self.ceilings, self.device, self.t_start = out, quick, ceilings, device, t_start
        self.kernels = kernels
        self.rows: list[dict] = []
        self.md_path = out / "gpu_check.md"

    def add(self, row: dict) -> None:
        self.rows.append(row)
        device_name = self.ceilings.device_name  # the device the ceilings were measured on, named once
        slug = device_slug(device_name)
        stem = self.out / f"gpu_check_{slug}{'_quick' if self.quick else ''}"
        files = {
            stem.with_suffix(".json"): json.dumps(self.rows, indent=2),
            Path(f"{stem}_ceilings.json"): json.dumps(self.ceilings.to_dict(), indent=2),
            stem.with_suffix(".md"): _markdown(self.rows, device_name, time.perf_counter() - self.t_start)
            + _ceilings_markdown(self.ceilings, self.device)
            + self.kernels,
        }
        extra = os.environ.get("OUT")
        for path, text in files.items():
            path.write_text(text, encoding="utf-8")
            if extra and Path(extra).is_dir():
                (Path(extra) / path.name).write_text(text, encoding="utf-8")
        self.md_path = stem.with_suffix(".md")


def _kernel_rates(device: str, quick: bool, out: Path, t_start: float) -> str:
    """Time the estimator's GEMM shapes and flash attention on this device (advisor.run.ceilings.
    measure_kernel_rates), save the table (bench/results/, $OUT, and on a GPU advisor/estimate/device_tables/,
    which the estimator then fits its rate model to for this device) and return its markdown section:
    the fitted constants and how well the model reproduces the measured shapes."""
    from advisor.estimate.efficiency import device_table_path, fit_device
    from advisor.run.ceilings import measure_kernel_rates
    from advisor.spec.presets import local_hardware

    table = measure_kernel_rates(device, quick=quick)
    hw = local_hardware(device)
    slug = device_slug(hw.name)
    text = json.dumps(table, indent=1)
    paths = [out / f"gpu_check_{slug}{'_quick' if quick else ''}_kernels.json"]
    if device == "cuda" and not quick:
        paths.append(device_table_path(hw.name))
    extra = os.environ.get("OUT")
    if extra and Path(extra).is_dir():
        paths.append(Path(extra) / paths[0].name)
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n", encoding="utf-8")
    fit = fit_device(table, hw)
    print(
        f"[{time.perf_counter() - t_start:6.1f} s] kernel rates: {len(table['gemm'])} GEMMs, {len(table['attention'])} attention rows",
        flush=True,
    )
    lines = [
        "",
        "## Kernel rates (the estimator's rate model fitted to this device)",
        "",
        f"{len(table['gemm'])} GEMM shapes and {len(table['attention'])} attention settings timed "
        f"({table['method']}); saved as {', '.join(p.name for p in paths)}.",
        "",
        "- large-GEMM share of the peak: "
        + ", ".join(f"{p} {100 * v:.1f} %" for p, v in fit.large_frac.items())
        + f"; small-k constant k_half {fit.k_half:.0f}; the fitted model reproduces the measured GEMM times "
        f"within {fit.gemm_error_pct:.1f} % on average",
    ]
    for impl, (fr, fs, br, bs) in fit.attention.items():
        lines.append(
            f"- attention {impl} (head dim 128): forward {100 * fr:.1f} % x s / (s + {fs:.0f}), backward "
            f"{100 * br:.1f} % x s / (s + {bs:.0f}) of the bf16 peak"
        )
    return "\n".join(lines) + "\n"


class _Budget:
    """The check's time budget: a row is run only while the time left covers the longest row so far
    (30 s before any), else filed as 'skipped' with why, so the whole check ends inside the budget and
    every row it did not reach is named."""

    def __init__(self, budget_s: float, t_start: float) -> None:
        self.budget_s, self.t_start, self.longest_s = budget_s, t_start, 30.0

    def run(self, profile, label: str, *args, **kwargs) -> dict:
        """``profile(label, *args, **kwargs)``'s row, or a 'skipped' row where the budget is spent."""
        elapsed = time.perf_counter() - self.t_start
        if self.budget_s and elapsed + self.longest_s > self.budget_s:
            why = (
                f"skipped: {elapsed:.0f} s of the check's {self.budget_s:.0f} s budget gone, and its longest row "
                f"took {self.longest_s:.0f} s (--budget-s)"
            )
            print(f"[{elapsed:6.1f} s] {label}: {why}", flush=True)
            return {"config": label, "status": "skipped", "message": why}
        row = profile(label, *args, **kwargs)
        self.longest_s = max(self.longest_s, time.perf_counter() - self.t_start - elapsed)
        return row


def _technique_model(device: str, quick: bool) -> tuple[str, int, int, str]:
    """(model, seq, micro-batch, precision) of the techniques' rows: Llama-3.2-1B in bf16 (tiny in
    fp32 on the CPU smoke test)."""
    model, seq, micro = ("tiny", 128, 2) if quick else ("llama-3.2-1b", 2048, 4)
    return model, seq, micro, "fp32" if device == "cpu" and quick else "bf16"


def technique_jobs(device: str, quick: bool) -> list[tuple[str, object, dict]]:
    """(label, setup, run options) of the techniques the advice is about, on one ~1B model
    (``_technique_model``), beside the grid's rows of the same model without and with full recompute:
    fp8 (torchao, tensorwise and rowwise), offloading half the blocks' activations, recomputing only
    half, both, and Unified Memory within the GPU's free memory. Each row is a profiled run beside the
    estimate; a technique this machine cannot run is a 'refused' row that says why (fp8 with no
    torchao or no fp8 units, Unified Memory on a CPU) and the other rows run."""
    model, seq, micro, precision = _technique_model(device, quick)
    half = make_setup(model=model, gpu="cpu").model.n_layers // 2
    jobs = []
    # The grid's rows of this model without and with full recompute run just before these: their baselines.
    configs = [
        (f"{precision} offload {half} blocks' activations", {"offload_activations": half}, {}),
        (f"{precision} recompute {half} blocks", {"recompute": "full", "recompute_layers": half}, {}),
        (f"{precision} offload {half} + recompute the rest", {"recompute": "full", "recompute_layers": half, "offload_activations": half}, {}),
        ("fp8 tensorwise (torchao)", {"precision": "fp8"}, {}),
        ("fp8 rowwise (torchao)", {"precision": "fp8", "fp8_recipe": "rowwise"}, {}),
        (f"{precision} Unified Memory", {}, {"unified_memory": True}),
    ]  # fmt: skip
    if quick:  # the CPU smoke test: each kind of row once
        configs = [configs[0], configs[2], configs[3], configs[5]]
    for label, train, extra in configs:
        kw = {"model": model, "seq": seq, "micro_batch": micro, "precision": precision} | train
        gpu = "h100" if kw["precision"] == "fp8" else "cpu"  # a placeholder: the run takes this machine's device
        jobs.append((f"{model} s{seq} b{micro} {label}", make_setup(gpu=gpu, **kw), extra))
    return jobs


def _profile(
    label: str, setup, device: str, nproc: int, options: dict, store: RunStore, t_start: float, *, dry: bool = True
) -> dict:
    """One configuration profiled in a child process: its result row (refused, or the run's row)."""
    print(f"[{time.perf_counter() - t_start:6.1f} s] {label}", flush=True)
    try:
        run = profile_run(setup, RunOptions(device=device, nproc=nproc, **options), store)
        if run.status == "refused":  # nothing ran: the reason is the row
            return {"config": label, "status": "refused", "message": run.record.get("message", "")}
        local = on_this_machine(setup, device, nproc)
        est = estimate(local)
    except AdvisorError as err:
        return {"config": label, "status": "refused", "message": str(err)}
    data_parallel = local.parallel.tp == 1 and local.parallel.pp == 1
    row = _row(label, run, est, *(_dry_run_peak(local) if data_parallel and dry else (None, "")))
    if row["status"] != "ok":
        log = RunFiles(run.path).log
        tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-25:] if log.is_file() else []
        row["log_tail"] = tail
        print(f"  {row['status']}: {row['message']}\n    " + "\n    ".join(tail), flush=True)
    elif device == "cuda" and row.get("device_name") in (None, "cpu"):
        row["message"] = "no GPU device name in the metrics: NVML or the CUDA trace is missing"
    return row


def _row(label: str, run, est, dry_run_peak: float | None, dry_run_message: str = "") -> dict:
    """One result row: the run's measurements beside the estimator's and the dry run's predictions
    (``dry_run_message``: why the dry run gave none)."""
    m = run.metrics() or {}
    return {
        "config": label,
        "status": run.status,
        "message": run.record.get("message", ""),
        "run_id": run.run_id,
        "measured_peak_bytes": m.get("peak_memory_bytes"),
        "rank_peak_bytes": m.get("rank_peak_memory_bytes"),
        "reserved_peak_bytes": m.get("reserved_memory_bytes"),
        "estimate_peak_bytes": est.memory.total_bytes,
        "estimate_allocated_bytes": est.memory.total_bytes - est.memory.overhead_bytes,
        "dry_run_peak_bytes": dry_run_peak,
        "dry_run_message": dry_run_message,
        "step_time_ms": m.get("step_time_ms"),
        "estimate_step_time_ms": est.step_time_ms,
        "tokens_per_s": m.get("tokens_per_s"),
        "mfu_frac": m.get("mfu_frac"),
        "device_name": m.get("device_name"),
        "roofline_bound": m.get("roofline_bound"),
        "roofline_gemm_roof_frac": m.get("roofline_gemm_roof_frac"),
        "roofline_roofs": m.get("roofline_roofs"),
        "activation_offload": m.get("activation_offload") or {},
        "unified_memory": m.get("unified_memory") or {},
        "estimate_host_bytes": est.memory.host_bytes,
        "host_peak_rss_bytes": m.get("host_peak_rss_bytes"),
    }


def _processes(device: str, requested: int | None) -> tuple[int, str]:
    """(processes for the distributed part, why it is skipped when 0)."""
    if requested == 0:
        return 0, "skipped: --distributed 0"
    if device == "cuda":
        import torch

        n = torch.cuda.device_count() if requested is None else requested
        if torch.cuda.device_count() < max(n, 2):
            have = torch.cuda.device_count()
            return 0, f"skipped: the NCCL part needs 2 or more GPUs and this machine has {have}"
        return n, ""
    return (requested, "") if requested else (0, "skipped: on the CPU only with --distributed N")


def distributed_rows(
    device: str, store: RunStore, args, t_start: float, options: dict, budget: _Budget | None = None
) -> list[dict]:
    """The distributed part: DDP, FSDP2 ZeRO-3 and TP 2 + SP on n processes, measured beside the
    estimator (and the dry run for the data-parallel layouts); one 'skipped' row saying why when it
    cannot run here."""
    n, why = _processes(device, args.distributed)
    if not n:
        print(f"distributed part {why}", flush=True)
        return [{"config": "distributed (NCCL / gloo)", "status": "skipped", "message": why}]
    model, seq, micro, precision = ("tiny", 128, 2, "fp32") if args.quick else ("gpt2-124m", 1024, 4, "bf16")
    layouts = [("DDP", {"zero": 0}), ("FSDP2 ZeRO-3", {"zero": 3})]
    if n % 2 == 0:
        layouts.append(("TP2+SP FSDP2", {"zero": 3, "tp": 2, "sequence_parallel": True}))
    rows = []
    for name, layout in layouts:
        setup = make_setup(model=model, gpu="cpu", gpus=n, seq=seq, micro_batch=micro, precision=precision, **layout)
        label = f"{name} x{n} {model} s{seq} b{micro} {precision}"
        args = (label, setup, device, n, options, store, t_start)
        rows.append(budget.run(_profile, *args) if budget else _profile(*args))
    return rows


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / GiB:.2f}"


def _err(pred: float | None, meas: float | None) -> str:
    return "-" if not pred or not meas else f"{100 * (pred - meas) / meas:+.1f} %"


def _markdown(rows: list[dict], device_name: str, wall_s: float) -> str:
    lines = [
        f"# GPU check on {device_name}",
        "",
        f"`bash scripts/gpu_check.sh` ({wall_s:.0f} s). Memory in GiB; errors are prediction vs measured peak",
        "allocated (torch.cuda.max_memory_allocated); the estimate's allocated part excludes its runtime allowance.",
        "",
        "| config | status | measured peak | estimate (alloc.) | err | dry run | err | step ms | est. ms | tokens/s | MFU "
        "| roofline | GEMMs at roof |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] != "ok":
            message = r.get("message", "")
            said = message if message.startswith(r["status"]) else f"{r['status']}: {message}"
            lines.append(f"| {r['config']} | {said} | | | | | | | | | | | |")
            continue
        gemm = r.get("roofline_gemm_roof_frac")
        meas = r["measured_peak_bytes"]
        lines.append(
            f"| {r['config']} | ok | {_gib(meas)} | {_gib(r['estimate_allocated_bytes'])} | "
            f"{_err(r['estimate_allocated_bytes'], meas)} | {_gib(r['dry_run_peak_bytes'])} | "
            f"{_err(r['dry_run_peak_bytes'], meas)} | {r['step_time_ms']:.1f} | {r['estimate_step_time_ms']:.1f} | "
            f"{r['tokens_per_s']:,.0f} | {100 * r['mfu_frac']:.1f} % | {r.get('roofline_bound') or '-'} | "
            f"{'-' if gemm is None else f'{100 * gemm:.0f} %'} |"
        )
    moved = [r for r in rows if r.get("activation_offload") or r.get("unified_memory")]
    if moved:
        lines += [
            "",
            "Host-link traffic (activation offload: per step, copies on a side stream; Unified Memory: managed bytes):",
            "",
            "| config | offloaded GiB | est. GiB | out ms | back ms | not hidden ms | GB/s out / back | host GiB "
            "| managed peak GiB | segments | refused by cap |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in moved:
            o, u = r.get("activation_offload") or {}, r.get("unified_memory") or {}
            off = (
                f"{_gib(o['bytes_offloaded'])} | {_gib(o['estimate_bytes'])} | {o['copy_out_ms']:.1f} | "
                f"{o['copy_in_ms']:.1f} | {o['exposed_ms']:.1f} | {o['out_gb_per_s']:.1f} / {o['in_gb_per_s']:.1f} | "
                f"{_gib(o['host_bytes'])}"
                if o
                else "- | - | - | - | - | - | -"
            )
            um = f"{_gib(u.get('peak_bytes'))} | {u.get('allocations', '-')} | {u.get('refused_allocations', '-')}"
            lines.append(f"| {r['config']} | {off} | {um if u else '- | - | -'} |")
    rss = [r["host_peak_rss_bytes"] for r in rows if r["status"] == "ok" and r.get("host_peak_rss_bytes")]
    if rss:
        lines += [
            "",
            f"Host footprint of one profiling process (peak RSS; the launcher's host preflight reads it): "
            f"{_gib(min(rss))} to {_gib(max(rss))} GiB over {len(rss)} runs, against "
            f"{_gib(PROCESS_HOST_BYTES)} GiB assumed for a CPU process.",
        ]
    missing = [r for r in rows if r.get("dry_run_message")]
    if missing:
        lines += ["", "No dry run for:"] + [f"- {r['config']}: {r['dry_run_message']}" for r in missing]
    return "\n".join(lines) + "\n"


def _ceilings_markdown(c, device: str) -> str:
    """The measured ceilings beside the datasheet's."""
    from advisor.spec.presets import local_hardware

    hw = local_hardware(device)
    lines = [
        "",
        f"## Ceilings of {c.device_name}",
        "",
        c.method,
        "",
        "| roof | measured | datasheet | share |",
        "|---|---|---|---|",
    ]
    for p, rate in c.matmul_flops_per_s.items():
        peak = hw.peak_flops(p)
        share = f"{100 * rate / peak:.0f} %" if peak else "-"
        lines.append(f"| matmul {p} | {rate / 1e12:.2f} TFLOP/s | {peak / 1e12:.2f} TFLOP/s | {share} |")
    bw = hw.mem_bw_bytes_per_s
    lines.append(
        f"| copy | {c.copy_bytes_per_s / 1e9:.0f} GB/s | {bw / 1e9:.0f} GB/s | {100 * c.copy_bytes_per_s / bw:.0f} % |"
    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
