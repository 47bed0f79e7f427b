"""The command line: ``python -m advisor SUBCOMMAND``. Every subcommand shares the setup flags."""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from advisor.errors import AdvisorError
from advisor.estimate.estimator import Estimate, estimate
from advisor.estimate.planner import DEFAULT_TIME_BUDGET_S, MAX_TIME_BUDGET_S
from advisor.present.export import EXPORT_TARGETS, export_setup
from advisor.present.report import format_estimate, format_run
from advisor.spec.defaults import DEFAULTS, PLAN_GLOBAL_BATCH, PROFILE_DEFAULTS, fit_seq
from advisor.spec.hf_config import load_hf_config
from advisor.spec.options import RunOptions
from advisor.spec.presets import HARDWARE, MODELS, get_model
from advisor.spec.setup import make_setup
from advisor.spec.specs import (
    FP8_RECIPES,
    FRAMEWORKS,
    OFFLOAD_MODES,
    OPTIMIZER_IMPLS,
    OPTIMIZERS,
    PRECISIONS,
    RECOMPUTE_MODES,
    Setup,
)
from advisor.store.runstore import RUN_ID_RE, STATUSES, RunStore, is_run_dir, read_metrics

CHILD_COMMAND = "_child"
"""The CLI command the profiling child runs (``advisor.run.launcher.CHILD_COMMAND``, the same string: the
runner, which imports torch, is imported only by the commands that run a step)."""


CLI_FLAGS: dict[str, str] = {key: "--" + key.replace("_", "-") for key in DEFAULTS}
CLI_FLAGS |= {"flash_attention": "--no-flash", "sequence_parallel": "--sp", "fp8_recipe": "--fp8-recipe"}
"""The flag of each front-end field (advisor.spec.defaults); --no-flash turns flash attention off."""


def add_setup_args(parser: argparse.ArgumentParser) -> None:
    """The flags that describe a Setup, shared by every subcommand; defaults from DEFAULTS (the app's)."""
    d = DEFAULTS
    g = parser.add_argument_group("model and device")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--model", default=d["model"], help=f"preset: {', '.join(MODELS)} (default: %(default)s)")
    src.add_argument(
        "--hf-config", metavar="PATH", help="a Hugging Face config.json file to import instead of a preset"
    )
    g.add_argument(
        "--rope-scaling",
        type=float,
        default=None,
        metavar="F",
        help="RoPE context extension (YaRN, linear): sequences up to F x the model's trained context (default: "
        "the config.json's rope_scaling, else 1)",
    )
    g.add_argument("--gpu", default=d["gpu"], help=f"device: {', '.join(HARDWARE)} (default: %(default)s)")
    g.add_argument(
        "--gpus",
        type=int,
        help=f"GPU count (default: {d['gpus']}, or dp x tp x pp x cp with --dp); dp = gpus / (tp x pp x cp)",
    )
    s = parser.add_argument_group("training step")
    s.add_argument(
        "--seq",
        type=int,
        default=None,
        help=f"sequence length in tokens (default: {d['seq']}, or the model's learned positions where fewer: 1024 for GPT-2)",
    )
    s.add_argument(
        "--micro-batch",
        type=int,
        default=d["micro_batch"],
        help="sequences per GPU per micro-batch (default: %(default)s)",
    )
    s.add_argument(
        "--global-batch",
        type=int,
        default=d["global_batch"],
        help="sequences per optimizer step (default: %(default)s, micro-batch x dp: no accumulation)",
    )
    s.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=d["precision"],
        help="default: %(default)s",
    )
    s.add_argument(
        "--fp8-recipe",
        choices=FP8_RECIPES,
        default=PROFILE_DEFAULTS["fp8_recipe"],
        help="with --precision fp8 on the eager step: torchao's scaling (default: %(default)s)",
    )
    s.add_argument("--optimizer", choices=OPTIMIZERS, default=d["optimizer"])
    s.add_argument(
        "--optimizer-impl",
        choices=OPTIMIZER_IMPLS,
        default=None,
        help=f"optimizer kernels (default: {d['optimizer_impl']}; foreach for adafactor, which has no fused kernel)",
    )
    s.add_argument(
        "--framework",
        choices=FRAMEWORKS,
        default=d["framework"],
        help="megatron: 16-bit weights + fp32 master, persistent grad buffers; pytorch: eager autocast step",
    )
    s.add_argument(
        "--recompute",
        choices=RECOMPUTE_MODES,
        default=d["recompute"],
        help="activation checkpointing: selective (Megatron's: attention core), selective-op (torchtitan's op "
        "policy: every other matmul output kept), full (block input only)",
    )
    s.add_argument(
        "--recompute-layers",
        type=int,
        default=d["recompute_layers"],
        metavar="N",
        help="with --recompute full: only N blocks per pipeline stage recompute (Megatron's block method); 0: all",
    )
    s.add_argument(
        "--offload-activations",
        type=int,
        default=d["offload_activations"],
        metavar="N",
        help="saved activations of N blocks per pipeline stage go to host memory and back (on a CPU device "
        "the copies run but save nothing)",
    )
    s.add_argument("--compile", action="store_true", help="torch.compile on the eager step (framework pytorch)")
    s.add_argument(
        "--fused-loss",
        action="store_true",
        help="a fused, in-place cross-entropy on the eager step (Liger, flash-attn)",
    )
    s.add_argument("--no-flash", action="store_true", help="attention without a fused (flash) kernel")
    s.add_argument("--dropout", action="store_true", help="dropout layers on")
    s.add_argument(
        "--fp32-grads",
        action=argparse.BooleanOptionalAction,
        default=d["fp32_grads"],
        help="fp32 gradients under bf16/fp16/fp8, Megatron-LM's default (the eager step's fp32 weights have fp32 "
        "gradients either way); --no-fp32-grads: 16-bit, as NeMo's performance recipes (default: on)",
    )
    p = parser.add_argument_group("parallelism")
    p.add_argument("--dp", type=int, help="data-parallel size (default: from --gpus)")
    for key in ("tp", "pp", "cp", "ep"):
        p.add_argument(f"--{key}", type=int, default=d[key], help="default: %(default)s")
    p.add_argument("--vpp", type=int, default=d["vpp"], help="virtual pipeline stages per rank (interleaving)")
    p.add_argument(
        "--zero", type=int, default=d["zero"], help="ZeRO stage 0-3, 3 = FSDP full shard (default: %(default)s)"
    )
    p.add_argument("--sp", action="store_true", help="Megatron sequence parallelism (needs --tp > 1)")
    p.add_argument("--offload", choices=OFFLOAD_MODES, default=d["offload"], help="CPU offload")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(default_gpus=d["gpus"])  # a command that runs one process sets None


def setup_from_args(args: argparse.Namespace) -> Setup:
    """The Setup the flags describe; raises AdvisorError on bad input. A left-out --seq is DEFAULTS',
    fitted to the model; a left-out --gpus DEFAULTS', unless --dp sets the count."""
    model = load_hf_config(args.hf_config) if args.hf_config else get_model(args.model)
    gpus = args.gpus if args.gpus is not None or args.dp is not None else args.default_gpus
    return make_setup(
        model=model,
        gpu=args.gpu,
        gpus=gpus,
        dp=args.dp,
        seq=args.seq if args.seq is not None else fit_seq(int(DEFAULTS["seq"]), model),
        rope_scaling=args.rope_scaling,
        micro_batch=args.micro_batch,
        global_batch=args.global_batch,
        precision=args.precision,
        optimizer=args.optimizer,
        optimizer_impl=args.optimizer_impl,
        framework=args.framework,
        recompute=args.recompute,
        flash_attention=not args.no_flash,
        dropout=args.dropout,
        fp32_grads=args.fp32_grads,
        recompute_layers=args.recompute_layers,
        offload_activations=args.offload_activations,
        compile=args.compile,
        fused_loss=args.fused_loss,
        fp8_recipe=args.fp8_recipe,
        tp=args.tp,
        pp=args.pp,
        vpp=args.vpp,
        cp=args.cp,
        ep=args.ep,
        zero=args.zero,
        sequence_parallel=args.sp,
        offload=args.offload,
    )


def _stderr_progress(args: argparse.Namespace, counts: bool = False):
    """A progress callback that prints to stderr (nothing under --json, which owns stdout's format)."""

    def progress(done: int, total: int, message: str) -> None:
        if not args.json:
            print(f"  [{done}/{total}] {message}" if counts else f"  {message}", file=sys.stderr, flush=True)

    return progress


def _existing_store(traces: str | None, *, required: bool = True) -> RunStore:
    """The run store a reading command looks in. A --traces that is a file is an error, and so is one
    that names no folder where the command needs the store (``required``): a mistyped path would
    otherwise read as an empty store. The default store (``traces/``) may not exist before the first run."""
    store = RunStore(traces)
    if store.root.exists() and not store.root.is_dir():
        raise AdvisorError(f"--traces {store.root} is a file; give the run store's folder")
    if required and traces is not None and not store.root.exists():
        raise AdvisorError(f"--traces {store.root}: no such folder (profile creates a run store there)")
    return store


MAX_TRACE_MB = 2**20
"""The largest --max-mb: 1 TiB of decompressed trace, beyond any machine's memory here."""


def _check_max_mb(max_mb: float) -> None:
    if not 0 < max_mb <= MAX_TRACE_MB:  # also refuses NaN and infinity
        raise AdvisorError(
            f"--max-mb={max_mb:g}: must be from 0 (excluded) to {MAX_TRACE_MB} (MiB of decompressed trace)"
        )


def _check_trace_path(path: Path, command: str) -> None:
    """AdvisorError unless ``path`` is a file or folder to analyze; for one of our run directories, also
    where its metrics.json is damaged (the roofline reads its parameter count there)."""
    if not path.exists():
        raise AdvisorError(f"{command} {path}: no such file or folder")
    if not (path.is_file() or path.is_dir()):
        raise AdvisorError(f"{command} {path}: not a regular file or folder; expected a trace file or folder")
    if is_run_dir(path):
        read_metrics(path)


def _cmd_size(args: argparse.Namespace) -> int:
    est: Estimate = estimate(setup_from_args(args))
    print(json.dumps(est.as_dict(), indent=2) if args.json else format_estimate(est))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    out = export_setup(setup_from_args(args), args.to)
    if args.out:
        Path(args.out).write_text(out.text, encoding="utf-8")
    if args.json:
        print(
            json.dumps(
                {"framework": out.framework, "filename": out.filename, "notes": list(out.notes), "text": out.text}
            )
        )
    elif not args.out:
        print(out.text, end="")
    if not args.json:
        for note in out.notes:
            print(f"note: {note}", file=sys.stderr)
        if args.out:
            print(f"wrote {args.out} ({out.framework}, {len(out.notes)} notes)", file=sys.stderr)
    return 0


def _options_from_args(args: argparse.Namespace) -> RunOptions:
    return RunOptions(
        device=args.device,
        steps=args.steps,
        warmup=args.warmup,
        num_workers=args.num_workers,
        pin_memory=args.pin_memory,
        data_delay_ms=args.data_delay_ms,
        memory_budget_gib=args.memory_budget_gib,
        unified_memory=args.unified_memory,
        um_host_budget_gib=args.um_host_budget_gib,
        compile=args.compile,
        layers=args.layers,
        timeout_s=args.timeout,
        nsys=args.nsys,
        nproc=args.nproc,
        nnodes=args.nnodes,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        inject=args.inject,
    )


def _cmd_profile(args: argparse.Namespace) -> int:
    from advisor.run.launcher import local_device_type, profile_run
    from advisor.spec.presets import fastest_precision, local_hardware

    if args.precision is None:
        args.precision = fastest_precision(local_hardware(local_device_type(args.device)))
    setup = setup_from_args(args)
    options = _options_from_args(args)

    run = profile_run(setup, options, RunStore(args.traces), on_progress=_stderr_progress(args))
    metrics = run.metrics()
    if args.json:
        out = {"run_id": run.run_id, "run_dir": str(run.path), "status": run.status, "message": run.record["message"]}
        out["metrics"] = metrics
        print(json.dumps(out, indent=2))
    else:
        print(format_run(run.record, metrics, run.path))
    return 0 if run.status == "ok" else 1


def _cmd_dryrun(args: argparse.Namespace) -> int:
    from advisor.run.dryrun import dry_run, dry_run_distributed, format_dry_run

    setup = setup_from_args(args)
    target = "cpu" if setup.hardware.kind == "cpu" else "cuda"
    if setup.gpus > 1:
        # Per rank, on a fake process group; this CLI process is already a child of its own (no default
        # process group to collide with), so it runs here rather than in a further child.
        result = dry_run_distributed(setup, target=target, isolate=False)
    else:
        result = dry_run(setup, offload_optimizer=setup.parallel.offload != "none", target=target)
    hw = setup.hardware
    if args.json:
        print(json.dumps(result.as_dict() | {"device": hw.name, "device_bytes": hw.memory_bytes}, indent=2))
        return 0
    print(format_dry_run(result))
    if target == "cuda":
        share = 100 * result.total_bytes / hw.memory_bytes
        said = "FITS" if result.total_bytes <= hw.memory_bytes else "DOES NOT FIT"
        print(
            f"\n{said}: {result.total_bytes / 2**30:.1f} GiB of {hw.memory_bytes / 2**30:.1f} GiB on the {hw.name} ({share:.0f} %)"
        )
    return 0


def _cmd_analyze(args: argparse.Namespace) -> int:
    from advisor.analysis.summary import analyze_path, format_report
    from advisor.spec.ceilings import load_ceilings
    from advisor.spec.presets import get_hardware
    from advisor.store.ceilings import ceilings_lookup, run_ceilings
    from advisor.trace.kineto import ANALYSIS_FILE, METRICS_SUFFIX, is_own_output

    store = _existing_store(args.traces, required=False)
    path = _trace_target(args.path, store, "analyze")
    _check_max_mb(args.max_mb)
    if args.max_event_mb is not None and not 0 < args.max_event_mb <= MAX_TRACE_MB:  # NaN and infinity too
        raise AdvisorError(
            f"--max-event-mb={args.max_event_mb:g}: must be from 0 (excluded) to {MAX_TRACE_MB} (MiB of one trace event)"
        )
    hardware = get_hardware(args.gpu) if args.gpu else None
    # Our own runs are judged against their device's stored roofs; --ceilings looks them up for any trace.
    ceilings = run_ceilings(path)
    if args.ceilings_file:
        ceilings = load_ceilings(args.ceilings_file)
    elif args.ceilings and ceilings is None:
        ceilings = ceilings_lookup(store.root)
    max_bytes = max(1, int(args.max_mb * 2**20))
    limits = {"max_bytes": max_bytes}
    if args.max_event_mb is not None:
        limits["max_event_bytes"] = max(1, int(args.max_event_mb * 2**20))
    report = analyze_path(
        path, path.name, **limits, hardware=hardware, ceilings=ceilings, dedicated=getattr(args, "program", False)
    )
    if path.is_dir() and not is_run_dir(path):
        own = sorted(f.name for f in path.iterdir() if is_own_output(f))
        if own:
            print(f"note: left out {', '.join(own)}: written by analyze --save, not traces", file=sys.stderr)
    roofs = report.metrics.roofline_roofs or ""
    if args.ceilings and "roofs measured" not in roofs:
        device = roofs.split(":")[0].split(",")[0]
        print(
            f"note: no ceilings measured for {device} are stored; datasheet roofs used "
            "(python -m advisor ceilings measures this machine's)",
            file=sys.stderr,
        )
    if args.save:
        target = path / ANALYSIS_FILE if path.is_dir() else path.with_name(path.name + METRICS_SUFFIX)
        try:
            report.metrics.save(target)
        except OSError as err:
            raise AdvisorError(f"analyze --save: cannot write {target} ({err.strerror or err})") from None
    if args.table:
        from advisor.present.views import TABLE_NOTES, table_view

        if args.table not in report.tables:
            raise AdvisorError(f"--table {args.table}: no such table; the analysis has: {', '.join(report.tables)}")
        shown = table_view(report.tables, args.table, rows=None)
        if args.json:
            print(shown.to_json(orient="records", indent=2))
        else:
            note = TABLE_NOTES.get(args.table)
            print(f"{args.table}" + (f": {note}" if note else "") + f" ({len(shown):,} rows)")
            print(shown.to_string(index=False) if len(shown) else "(empty for this trace)")
        return 0
    if args.json:
        out = {"metrics": report.metrics.to_dict(), "skipped_files": list(report.skipped_files)}
        out["tables"] = {k: json.loads(v.to_json(orient="records")) for k, v in report.tables.items()}
        print(json.dumps(out, indent=2))
    else:
        print(format_report(report, path.name))
    return 0


def _cmd_export_trace(args: argparse.Namespace) -> int:
    from advisor.trace.export import write_chrome_trace
    from advisor.trace.load import load_trace

    path = _trace_target(args.path, _existing_store(args.traces, required=False), "export-trace")
    _check_max_mb(args.max_mb)
    out = Path(args.out) if args.out else Path(path.name.split(".")[0] + ".perfetto.json.gz")
    if out.resolve() == path.resolve():
        raise AdvisorError(f"--out {out} is the trace itself; give another file")
    table = load_trace(path, max_bytes=max(1, int(args.max_mb * 2**20)))
    write_chrome_trace(table, out)
    print(f"wrote {out} ({len(table):,} events); open it at https://ui.perfetto.dev (Open trace file)")
    return 0


def _cmd_ceilings(args: argparse.Namespace) -> int:
    import torch

    from advisor.run.ceilings import measure_ceilings
    from advisor.spec.presets import local_hardware
    from advisor.store.ceilings import store_ceilings, stored_ceilings
    from advisor.store.runstore import default_root

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise AdvisorError("ceilings --device cuda: CUDA is not available on this machine (use --device cpu)")
    hw = local_hardware(device)
    root = Path(args.traces) if args.traces else default_root()
    if root.exists() and not root.is_dir():
        raise AdvisorError(f"--traces {root} is a file; give the run store's folder (ceilings go in its ceilings/)")
    if args.show:
        c = stored_ceilings(hw.name, root)
        if c is None:
            raise AdvisorError(f"no ceilings stored for {hw.name} in {root}; run `python -m advisor ceilings`")
        path = None
    else:
        dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
        # Upper bounds: three fp32 matrices of 32768^2 take 12 GiB, a 64 GiB copy buffer twice that;
        # beyond, the allocation only fails (10^9: "tried to allocate 4000000000000000000 bytes").
        for name, value, lo, hi in (
            ("--matmul-n", args.matmul_n, 0, 32768),
            ("--copy-mib", args.copy_mib, 0, 65536),
            ("--repeats", args.repeats, 1, 1000),
        ):
            if not lo <= value <= hi:
                raise AdvisorError(f"{name}={value}: must be an integer from {lo} to {hi}")
        try:
            c = measure_ceilings(device, dtypes, matmul_n=args.matmul_n, copy_mib=args.copy_mib, repeats=args.repeats)
        except (RuntimeError, MemoryError) as err:  # torch's allocation failures (CPU or CUDA out of memory)
            raise AdvisorError(
                f"ceilings --device {device}: the buffers do not fit in memory ({str(err).splitlines()[0][:200]}); "
                "give a smaller --matmul-n or --copy-mib"
            ) from None
        path = store_ceilings(c, root)
    if args.json:
        print(json.dumps({**c.to_dict(), "path": str(path) if path else None}, indent=2))
        return 0
    print(f"{c.device_name} ({c.measured_utc}): {c.method}")
    if not args.show:
        from advisor.run.ceilings import slow_matmul_reason

        for d in dtypes:
            if why := slow_matmul_reason(torch.device(device), d):
                print(f"  not measured: {why}")
    for p, rate in c.matmul_flops_per_s.items():
        peak = hw.peak_flops(p)
        ratio = f" = {100 * rate / peak:.0f} % of the datasheet's {peak / 1e12:.3g} TFLOP/s" if peak else ""
        print(f"  matmul {p}: {rate / 1e12:.3f} TFLOP/s{ratio}")
    bw = hw.mem_bw_bytes_per_s
    print(
        f"  copy: {c.copy_bytes_per_s / 1e9:.1f} GB/s = {100 * c.copy_bytes_per_s / bw:.0f} % of the datasheet's {bw / 1e9:.0f} GB/s"
    )
    if path:
        print(f"stored in {path}; `analyze --ceilings` and this device's own runs use them")
    return 0


def _cmd_runs(args: argparse.Namespace) -> int:
    from advisor.store.history import DAMAGED, run_table

    table = run_table(_existing_store(args.traces), model=args.model, status=args.status, device=args.device)
    filtered = any((args.model, args.status, args.device))
    if args.json:
        cols = ["run_id", "status", "message", "model", "device_type", "step_time_ms", "tokens_per_s"]
        # to_json writes a missing figure (NaN) as null.
        rows = json.loads(table[table["status"] != DAMAGED][cols].to_json(orient="records"))
        damaged = [{"name": r.run_id, "reason": r.message} for r in table[table["status"] == DAMAGED].itertuples()]
        print(json.dumps({"runs": rows, "damaged": damaged}, indent=2))
        return 0
    if not table.empty:
        width = max(len("run"), *(len(r) for r in table["run_id"]))
        print(f"{'run':{width}s}  {'status':9s} {'dev':4s} {'step':>12s} {'tokens/s':>10s}  message")
    for r in table.itertuples():
        if r.status == DAMAGED:
            print(f"{r.run_id:{width}s}  {'DAMAGED':9s} {'':4s} {'':>12s} {'':>10s}  {r.message}")
            continue
        step = "" if math.isnan(r.step_time_ms) else f"{r.step_time_ms:,.1f} ms"
        rate = "" if math.isnan(r.tokens_per_s) else f"{r.tokens_per_s:,.0f}"
        print(f"{r.run_id:{width}s}  {r.status:9s} {r.device_type:4s} {step:>12s} {rate:>10s}  {r.message}".rstrip())
    if table.empty:
        print(
            "no runs match these filters"
            if filtered
            else "no runs yet: python -m advisor profile --model tiny --device cpu"
        )
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from advisor.store.history import compare_runs

    c = compare_runs(_existing_store(args.traces), args.run_a, args.run_b)
    if args.json:
        out = {"run_a": c.run_a, "run_b": c.run_b, "summary": c.summary}
        # to_json writes NaN (a figure one run lacks) as null.
        out["spec_diff"] = json.loads(c.spec_diff.to_json(orient="records"))
        out["metrics"] = json.loads(c.metrics.to_json(orient="records"))
        print(json.dumps(out, indent=2))
        return 0
    print(f"A = {c.run_a}\nB = {c.run_b}\n{c.summary}\n")
    if c.spec_diff.empty:
        print("Setup and options: identical")
    else:
        print("Setup and options that differ:")
        for r in c.spec_diff.itertuples():
            print(f"  {r.field:32s} {r.a!s:>16s} -> {r.b!s}")
    print(f"\n  {'metric':26s} {'A':>12s} {'B':>12s} {'change':>9s}")
    for r in c.metrics.itertuples():
        change = f"{'-':>9s}" if math.isnan(r.change_pct) else f"{r.change_pct:+7.1f} %"
        print(f"  {r.metric:26s} {r.a:12,.4g} {r.b:12,.4g} {change}")
    return 0


def _trace_target(target: str, store: RunStore, command: str) -> Path:
    """The trace a command's argument names: a run id of the store, else a trace file or folder."""
    if RUN_ID_RE.match(target) and (store.root / target).is_dir():
        return store.path(target)
    path = Path(target)
    if not path.exists() and os.sep not in target:  # a bare name: a run id or a file here; a path says itself
        raise AdvisorError(
            f"{command} {target!r}: not a run in {store.root} nor a trace file or folder "
            "(give a run id from `python -m advisor runs` or a trace path)"
        )
    _check_trace_path(path, command)
    return path


def _cmd_diff(args: argparse.Namespace) -> int:
    from advisor.analysis.diff import diff_paths, format_diff

    if not args.noise_pct >= 0:  # also refuses NaN
        raise AdvisorError(f"--noise-pct={args.noise_pct:g}: must be >= 0 (% of A's time per step)")
    if args.top < 0:
        raise AdvisorError(f"--top={args.top}: must be >= 0")
    store = _existing_store(args.traces, required=False)
    a, b = (_trace_target(t, store, "diff") for t in (args.a, args.b))
    d = diff_paths(a, b, noise_pct=args.noise_pct)
    if args.json:
        print(json.dumps({"a": str(a), "b": str(b), **d.to_dict()}, indent=2))
    else:
        print(format_diff(d, args.a, args.b, top=args.top))
    return 0


def _cmd_presets(args: argparse.Namespace) -> int:
    models = {k: {"n_params": f().n_params, "n_active_params": f().n_active_params} for k, f in MODELS.items()}
    hardware = {k: {"name": f().name, "memory_bytes": f().memory_bytes} for k, f in HARDWARE.items()}
    if args.json:
        print(json.dumps({"models": models, "hardware": hardware}, indent=2))
        return 0
    print("Models:")
    for k, v in models.items():
        active = "" if v["n_active_params"] == v["n_params"] else f" ({v['n_active_params'] / 1e9:.3g}B active)"
        print(f"  {k:18s} {v['n_params']:>18,d} parameters{active}")
    print("Devices:")
    for k, v in hardware.items():
        print(f"  {k:10s} {v['name']:24s} {v['memory_bytes'] / 2**30:7.1f} GiB")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from advisor.estimate.planner import PlanRequest, format_plan, plan
    from advisor.spec.hf_config import load_hf_config
    from advisor.spec.presets import get_hardware, get_model

    model = load_hf_config(args.hf_config) if args.hf_config else get_model(args.model)
    precisions = tuple(p.strip() for item in args.precision or ["bf16"] for p in item.split(",") if p.strip())
    hardware = get_hardware(args.gpu)
    link = None
    if args.measured_comm == "auto":
        from advisor.advice.commlinks import link_for

        # The store only refines the plan: a missing one is said, not an error.
        store = _existing_store(args.traces, required=False)
        link = link_for(store, hardware)
        missing = "" if store.root.is_dir() else " (no such folder)"
        found = (
            f"run {link.run_id}, {link.bus_bytes_per_s / 1e9:.2f} GB/s bus bandwidth"
            if link
            else f"no distributed run of {hardware.name} in {store.root}{missing}; using the datasheet link"
        )
        print(f"measured communication: {found}", file=sys.stderr)
    request = PlanRequest(
        model=model,
        hardware=hardware,
        gpus=args.gpus,
        seq_len=args.seq if args.seq is not None else fit_seq(DEFAULTS["seq"], model),
        global_batch=args.global_batch,
        precisions=precisions,
        allow_offload=not args.no_offload,
        top=args.top,
        max_memory_frac=args.max_memory_pct / 100,
        measured_link=link,
        time_budget_s=args.time_budget,
    )
    result = plan(request)
    print(json.dumps(result.as_dict(), indent=2) if args.json else format_plan(result))
    return 0 if result.top else 1


def add_diff_parser(sub: argparse._SubParsersAction) -> None:
    """``diff``: two traces or runs compared per step: categories, kernels and ops that changed."""
    from advisor.analysis.diff import NOISE_PCT

    d = sub.add_parser(
        "diff",
        help="two traces or runs per step: where the step time changed, kernels and ops added/removed/slower/faster",
    )
    d.add_argument("a", help="the baseline: a run id, or a trace file or folder (as analyze takes)")
    d.add_argument("b", help="the trace compared with it; changes are B relative to A")
    d.add_argument("--top", type=int, default=10, help="rows of each status to list (default: %(default)s)")
    d.add_argument(
        "--noise-pct",
        type=float,
        default=NOISE_PCT,
        help="a name's time per step changed where it moved by more than this %% of A's (default: %(default)s)",
    )
    d.add_argument("--traces", default=None, help="run store directory for run ids (default: traces/)")
    d.add_argument("--json", action="store_true", help="every table in full as JSON")
    d.set_defaults(func=_cmd_diff)


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    """``plan``: search parallel layouts for a GPU count and rank those that fit by tokens/s (exit 1: none fits)."""
    plan = sub.add_parser(
        "plan", help="search DP/TP/PP/CP/EP, ZeRO, recompute and micro-batch; rank what fits (exit 1 if nothing does)"
    )
    src = plan.add_mutually_exclusive_group()
    # Flags left out take the app's first screen (DEFAULTS, the Plan tab's batch), as size's do.
    src.add_argument("--model", default=DEFAULTS["model"], help=f"preset: {', '.join(MODELS)} (default: %(default)s)")
    src.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json file to import instead")
    plan.add_argument("--gpu", default=DEFAULTS["gpu"], help=f"device: {', '.join(HARDWARE)} (default: %(default)s)")
    plan.add_argument(
        "--gpus",
        type=int,
        default=DEFAULTS["gpus"],
        help="GPUs in the job; every layout uses all of them (default: %(default)s)",
    )
    plan.add_argument(
        "--seq",
        type=int,
        default=None,
        help=f"sequence length in tokens (default: {DEFAULTS['seq']}, or the model's learned positions where fewer: "
        "1024 for GPT-2)",
    )
    plan.add_argument(
        "--global-batch",
        type=int,
        default=PLAN_GLOBAL_BATCH,
        help="sequences per optimizer step (default: %(default)s)",
    )
    plan.add_argument(
        "--precision",
        action="append",
        metavar="P[,P]",
        help=f"precision(s) to try, repeatable or comma-separated: {', '.join(PRECISIONS)} (default: bf16)",
    )
    plan.add_argument("--no-offload", action="store_true", help="do not try CPU offload")
    plan.add_argument("--top", type=int, default=10, help="layouts to list (default: %(default)s)")
    plan.add_argument(
        "--max-memory-pct",
        type=float,
        default=90.0,
        help="list layouts up to this share of the GPU's memory; above 90 a layout is tight, within the "
        "memory estimate's error of not fitting (default: %(default)s)",
    )
    plan.add_argument(
        "--measured-comm",
        choices=("auto", "off"),
        default="auto",
        help="auto: communication at the bus bandwidth of the newest distributed run of this device in --traces, "
        "when there is one; off: the datasheet link (default: %(default)s)",
    )
    plan.add_argument(
        "--time-budget",
        type=float,
        default=DEFAULT_TIME_BUDGET_S,
        metavar="S",
        help="wall-clock seconds the search may take; past it the best layouts found so far are listed and the "
        f"plan says it is incomplete (above 0, at most {MAX_TIME_BUDGET_S:g}; default: %(default)g)",
    )
    plan.add_argument("--traces", default=None, help="run store directory (default: traces/)")
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    plan.set_defaults(func=_cmd_plan)


def _setup_flags_given(args: argparse.Namespace) -> list[str]:
    """The setup flags (``add_setup_args``) set to anything but their default, as --flag names."""
    defaults = argparse.ArgumentParser(add_help=False)
    add_setup_args(defaults)
    return [
        f"--{k.replace('_', '-')}"
        for k, v in vars(defaults.parse_args([])).items()
        if k not in ("json", "default_gpus") and getattr(args, k, v) != v
    ]


def _cmd_advise(args: argparse.Namespace) -> int:
    from advisor.advice.advise import advice_markdown, advise, advise_run, advise_trace

    store = _existing_store(args.traces, required=bool(args.target and RUN_ID_RE.match(args.target)))
    if args.target is not None and (given := _setup_flags_given(args)):
        print(
            f"note: {', '.join(given)} ignored: a run or trace is advised on as it was recorded "
            "(drop the target to advise on a setup from the flags)",
            file=sys.stderr,
        )
    if args.target is None:
        advice = advise(setup=setup_from_args(args), source="setup")
    elif RUN_ID_RE.match(args.target) and (store.root / args.target).is_dir():
        advice = advise_run(args.target, store)
    elif Path(args.target).exists():
        _check_trace_path(Path(args.target), "advise")
        advice = advise_trace(args.target)
    else:
        raise AdvisorError(
            f"advise {args.target!r}: not a run in {store.root} nor a trace file or folder "
            "(give a run id from `python -m advisor runs`, a trace path, or no argument and setup flags)"
        )
    md = advice_markdown(advice)
    if args.markdown:
        try:
            Path(args.markdown).write_text(md, encoding="utf-8")
        except OSError as err:
            raise AdvisorError(f"advise --markdown {args.markdown}: cannot write it ({err.strerror or err})") from None
    print(advice.to_json() if args.json else md, end="" if not args.json else "\n")
    return 0


def _cmd_rules(args: argparse.Namespace) -> int:
    from advisor.advice.rules import FIELDS, load_rules

    if args.fields:
        for name, doc in FIELDS.items():
            print(f"{name:28s} {doc}")
        return 0
    rules = load_rules(args.dir)
    if args.json:
        rows = [
            {"id": r.id, "group": r.group, "severity": r.severity, "title": r.title, "when": r.when, "gain": r.gain}
            for r in rules
        ]
        print(json.dumps(rows, indent=2))
        return 0
    for r in rules:
        print(f"{r.id:30s} {r.group:14s} {r.severity:9s} {r.title}")
    print(f"{len(rules)} rules")
    return 0


def _target_figure(target: str):
    """How a verified figure prints: step time in ms, throughput in tokens/s, memory in GiB."""
    if target == "tokens_per_s":
        return lambda x: f"{x:,.0f} tokens/s"
    if target == "peak_memory_bytes":
        return lambda x: f"{x / 2**30:,.3f} GiB"
    if target.endswith("_ms"):
        return lambda x: f"{x:,.1f} ms"
    return lambda x: f"{x:,.4g}"


def _cmd_verify(args: argparse.Namespace) -> int:
    from advisor.advice.advise import gain_phrase
    from advisor.advice.evidence import UNKNOWN_SPREAD
    from advisor.advice.verify import verify

    v = verify(
        args.run_id,
        args.rule,
        _existing_store(args.traces),
        on_progress=_stderr_progress(args),
        baseline=not args.no_baseline,
        pairs=args.pairs,
    )
    if args.json:
        print(json.dumps(v.as_dict(), indent=2))
        return 0
    bound = " (predicted as an upper bound)" if v.upper_bound else ""
    change = ", ".join(f"{k} = {val}" for k, val in v.changes.items())
    print(f"{v.rule_id} on {v.run_id}: re-ran as {v.new_run_id} with {change}")
    if v.baseline_run_id:
        print(
            f"  baseline: the original setup re-ran as {v.baseline_run_id} just before (stored run: "
            f"{_target_figure(v.target)(v.stored_before)})"
        )
    if v.pairs > 1:
        gains = ", ".join(f"{g:+.1f} %" for g in v.pair_gains_pct)
        print(f"  {v.pairs} pairs in alternating order; measured: the median of their gains (each pair: {gains})")
    fig = _target_figure(v.target)
    print(f"  {v.target}: before {fig(v.before)}, predicted {fig(v.predicted_after)}, measured {fig(v.measured_after)}")
    predicted, measured = gain_phrase(v.target, v.predicted_gain_pct), gain_phrase(v.target, v.measured_gain_pct)
    print(f"  predicted {predicted}{bound}; measured {measured}")
    what = "spread over its steps and re-runs" if v.pairs > 1 else "step-to-step spread"
    if v.noise_unknown:
        spread = f" ({UNKNOWN_SPREAD})"
    else:
        spread = "" if v.noise_pct is None else f" (baseline {what} {v.noise_pct:.1f} %)"
    print(f"  verdict: {v.verdict}{spread}")
    print(f"  basis: {v.basis}")
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from advisor.advice.calibrate import calibrate_machine, format_calibration

    try:
        cal, path, sweep = calibrate_machine(
            RunStore(args.traces),
            args.sweep_runs if args.sweep else 0,
            device=args.device,
            on_progress=_stderr_progress(args, counts=True),
        )
    except AdvisorError as err:
        # Its advice to sweep must sweep into the same store, or the next calibrate finds nothing new.
        if args.traces is None or "calibrate --sweep`" not in str(err):
            raise
        raise AdvisorError(
            str(err).replace("calibrate --sweep`", f"calibrate --sweep --traces {shlex.quote(args.traces)}`")
        ) from None
    if args.json:
        out = {"device_key": cal.device_key, "n_runs": cal.n_runs, "cv": cal.cv, "cv_method": cal.cv_method}
        out["models"] = {"step_time": cal.step_time.kind, "peak_memory": cal.peak_memory.kind}
        out["path"] = str(path)
        out["sweep"] = [
            {"run_id": s.run.run_id, "status": s.run.status, "other_cpu_frac": s.other_cpu_frac} for s in sweep
        ]
        print(json.dumps(out, indent=2))
    else:
        print(format_calibration(cal, path))
    return 0


def add_calibrate_parser(sub: argparse._SubParsersAction) -> None:
    """``calibrate``: fit the estimator's correction for this machine's device on the stored runs."""
    cal = sub.add_parser(
        "calibrate", help="fit a regression on this device's measured runs that corrects the estimator; CV error"
    )
    cal.add_argument("--sweep", action="store_true", help="first profile the calibration sweep (a few minutes)")
    cal.add_argument("--sweep-runs", type=int, default=36, help="runs in the sweep (default: %(default)s)")
    cal.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="device to calibrate")
    cal.add_argument("--runs-dir", "--traces", dest="traces", default=None, help="run store (default: traces/)")
    cal.add_argument("--json", action="store_true", help="machine-readable output")
    cal.set_defaults(func=_cmd_calibrate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m advisor", description="LLM training optimization advisor")
    sub = parser.add_subparsers(dest="command", required=True)
    size = sub.add_parser("size", help="memory per GPU, step time and MFU of a training setup, instantly")
    add_setup_args(size)
    size.set_defaults(func=_cmd_size)
    exp = sub.add_parser("export", help="write a setup as a framework's launch config (flags, TOML, JSON, YAML)")
    add_setup_args(exp)
    exp.add_argument("--to", required=True, choices=EXPORT_TARGETS, help="the framework that will run it")
    exp.add_argument("--out", metavar="FILE", help="write the config here (default: print it)")
    exp.set_defaults(func=_cmd_export)
    prof = sub.add_parser("profile", help="profile a short real training step in a child process; files a run")
    add_setup_args(prof)
    # PROFILE_DEFAULTS' setup, as the Profile tab's; --precision: this machine's fast path unless given.
    flags = {k: CLI_FLAGS[k][2:].replace("-", "_") for k in PROFILE_DEFAULTS if k in CLI_FLAGS and k != "gpus"}
    # (--no-flash sets the opposite of its field: PROFILE_DEFAULTS leaves flash attention to DEFAULTS.)
    prof.set_defaults(**{dest: PROFILE_DEFAULTS[k] for k, dest in flags.items() if k != "flash_attention"})
    prof.set_defaults(default_gpus=PROFILE_DEFAULTS["gpus"], func=None)
    for action in prof._actions:  # argparse keeps no public way to change one flag's help
        if action.dest == "precision":
            action.help = "default: this device's fastest (bf16 on a GPU; fp32 on a CPU without AVX512-BF16 or AMX)"
    pd_ = PROFILE_DEFAULTS
    r = prof.add_argument_group("run")
    r.add_argument("--device", choices=("auto", "cpu", "cuda"), default=pd_["device"])
    r.add_argument(
        "--steps", type=int, default=pd_["steps"], help="timed steps, then as many profiled (default: %(default)s)"
    )
    r.add_argument("--warmup", type=int, default=1, help="profiler warm-up steps, discarded (default: %(default)s)")
    r.add_argument("--num-workers", type=int, default=pd_["num_workers"], help="DataLoader workers")
    r.add_argument("--pin-memory", action="store_true")
    r.add_argument(
        "--data-delay-ms", type=float, default=0.0, help="simulated loading latency per sample (input-pipeline what-if)"
    )
    r.add_argument(
        "--memory-budget-gib", type=float, default=0.0, help="treat the device as having this much memory (0: its own)"
    )
    r.add_argument(
        "--unified-memory",
        action="store_true",
        help="the step's CUDA tensors in managed memory (capped at the GPU's free memory on PCIe GPUs)",
    )
    r.add_argument(
        "--um-host-budget-gib",
        type=float,
        default=0.0,
        help="with --unified-memory on GH200/GB200: host memory it may use beyond the GPU's free memory",
    )
    r.add_argument(
        "--layers", type=int, default=pd_["layers"], help="proxy mode: run N layers, extrapolate to the full depth"
    )
    r.add_argument("--timeout", type=float, default=600.0, help="seconds before the child is stopped")
    r.add_argument("--nsys", action="store_true", help="run the child under nsys profile (Nsight Systems)")
    r.add_argument(
        "--nproc",
        type=int,
        default=pd_["nproc"],
        help="processes on this node: torchrun --nproc-per-node (default: %(default)s)",
    )
    r.add_argument("--nnodes", type=int, default=1, help="nodes in the job; each runs the same command")
    r.add_argument("--rdzv-endpoint", default="", help="host:port every node's torchrun meets at (nnodes > 1)")
    r.add_argument("--rdzv-id", default="", help="job id all nodes share (required when nnodes > 1)")
    r.add_argument("--traces", default=None, help="run store directory (default: traces/)")
    r.add_argument("--inject", default="", help=argparse.SUPPRESS)
    dry = sub.add_parser("dryrun", help="exact memory of the real step under fake tensors: any size, no allocation")
    add_setup_args(dry)
    # The same setup as `size` for the same flags (8 GPUs unless --gpus or --dp): the ranks run on a fake
    # process group in this process; --gpus 1 runs the single-device step (with optimizer offload too).
    dry.set_defaults(func=_cmd_dryrun)
    an = sub.add_parser("analyze", help="analyze a trace: Kineto JSON (file, folder, zip) or Nsight Systems SQLite")
    an.add_argument("path", help="a run id, or a trace file, folder of rank files, .zip, .sqlite, or a run directory")
    an.add_argument("--traces", default=None, help="run store directory, for run ids and --ceilings (default: traces/)")
    an.add_argument("--json", action="store_true", help="StepMetrics and every table as JSON")
    an.add_argument(
        "--table",
        metavar="NAME",
        help="print one analysis table in full (times in ms; with --json as records): temporal_breakdown, "
        "gpu_idle, idle_time_breakdown, launch_stats, memcpy, phases, collectives, roofline, ... "
        "(a wrong name lists them all)",
    )
    an.add_argument(
        "--save",
        action="store_true",
        help="write the StepMetrics beside the trace: FILE.metrics.json for a file, analysis.json inside a "
        "folder (later analyses of the folder leave both out)",
    )
    an.add_argument(
        "--max-mb",
        type=float,
        default=8192,
        help="refuse traces larger than this (MiB, decompressed, all files of a folder or zip together; > 0)",
    )
    an.add_argument(
        "--max-event-mb",
        type=float,
        default=None,
        help="refuse a Kineto trace with one event larger than this (MiB; > 0; default: 16)",
    )
    an.add_argument(
        "--gpu",
        default=None,
        help=f"judge the roofline against this device's datasheet: {', '.join(HARDWARE)} "
        "(default: the device the trace names, or its kernel names give away)",
    )
    roofs = an.add_mutually_exclusive_group()
    roofs.add_argument(
        "--ceilings",
        action="store_true",
        help="judge the roofline against the ceilings `ceilings` measured and stored for the trace's device "
        "instead of its datasheet (our own runs use them by default)",
    )
    roofs.add_argument("--ceilings-file", metavar="FILE", help="judge the roofline against this ceilings JSON file")
    an.set_defaults(func=_cmd_analyze)
    ex = sub.add_parser(
        "export-trace",
        help="write any trace (nsys SQLite, Kineto folder or zip) as one Chrome trace JSON that Perfetto opens",
    )
    ex.add_argument("path", help="a run id, or a trace file, folder of rank files, .zip, .sqlite, or a run directory")
    ex.add_argument("--traces", default=None, help="run store directory for run ids (default: traces/)")
    ex.add_argument(
        "-o", "--out", default=None, help="output file (default: NAME.perfetto.json.gz in the current folder)"
    )
    ex.add_argument("--max-mb", type=float, default=8192, help="refuse traces larger than this (MiB; > 0)")
    ex.set_defaults(func=_cmd_export_trace)
    ce = sub.add_parser(
        "ceilings", help="measure this machine's matmul FLOP/s and copy bandwidth (the roofline's measured roofs)"
    )
    ce.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: cuda when present")
    ce.add_argument("--dtypes", default="fp32,bf16,fp16", help="matmul precisions (default: %(default)s)")
    ce.add_argument("--matmul-n", type=int, default=0, help="square matmul size (default: 8192 on CUDA, 1024 on CPU)")
    ce.add_argument("--copy-mib", type=int, default=0, help="copy buffer in MiB (default: 1024 on CUDA, 256 on CPU)")
    ce.add_argument("--repeats", type=int, default=5, help="timed repeats, best kept (default: %(default)s)")
    ce.add_argument("--show", action="store_true", help="print the stored ceilings of this device, measure nothing")
    ce.add_argument("--traces", default=None, help="run store directory (default: traces/)")
    ce.add_argument("--json", action="store_true")
    ce.set_defaults(func=_cmd_ceilings)
    runs = sub.add_parser("runs", help="list the runs in the run store, newest first")
    runs.add_argument("--traces", default=None)
    runs.add_argument("--model", help="only runs of this model (exact name, e.g. tiny)")
    runs.add_argument(
        "--status",
        choices=(*STATUSES, "damaged"),
        help="only runs with this status (damaged: entries that cannot be read)",
    )
    runs.add_argument("--device", choices=("cpu", "cuda"), help="only runs on this device type")
    runs.add_argument("--json", action="store_true")
    runs.set_defaults(func=_cmd_runs)
    cmp = sub.add_parser("compare", help="two runs side by side: differing setup fields, figures and their change")
    cmp.add_argument("run_a", help="the baseline run id")
    cmp.add_argument("run_b", help="the run compared against it; changes are B relative to A")
    cmp.add_argument("--traces", default=None, help="run store directory (default: traces/)")
    cmp.add_argument("--json", action="store_true")
    cmp.set_defaults(func=_cmd_compare)
    add_diff_parser(sub)
    presets = sub.add_parser("presets", help="list the model and device presets")
    presets.add_argument("--json", action="store_true")
    presets.set_defaults(func=_cmd_presets)
    add_plan_parser(sub)
    add_calibrate_parser(sub)
    adv = sub.add_parser(
        "advise", help="ranked recommendations with predicted gains for a run, a trace, or a setup (flags)"
    )
    adv.add_argument("target", nargs="?", help="a run id, a trace file or folder; omit to advise on the setup flags")
    add_setup_args(adv)
    adv.add_argument("--traces", default=None, help="run store directory (default: traces/)")
    adv.add_argument("--markdown", metavar="FILE", help="also write the report as Markdown to FILE")
    adv.set_defaults(func=_cmd_advise)
    rl = sub.add_parser("rules", help="list the advice rules (checked on load), or the fields a condition may use")
    rl.add_argument("--fields", action="store_true", help="the names conditions and messages may use")
    rl.add_argument("--dir", default=None, help="a folder of rule files to check (default: rules/)")
    rl.add_argument("--json", action="store_true")
    rl.set_defaults(func=_cmd_rules)
    ver = sub.add_parser("verify", help="re-run a profiled run with a recommendation applied; predicted vs measured")
    ver.add_argument("run_id")
    ver.add_argument("--rule", help="rule id (default: the top recommendation that can be re-run here)")
    ver.add_argument(
        "--no-baseline",
        action="store_true",
        help="compare with the stored run's figure instead of re-running it first (half the time; "
        "exposed to the machine's drift since that run)",
    )
    ver.add_argument(
        "--pairs",
        type=int,
        default=1,
        metavar="N",
        help="re-run the original setup and the change N times each, in alternating order, and take the "
        "median of the pairs' gains (for a change smaller than the machine's run-to-run noise; 1 to 10, "
        "default 1)",
    )
    ver.add_argument("--traces", default=None)
    ver.add_argument("--json", action="store_true")
    ver.set_defaults(func=_cmd_verify)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (2 on bad input, with the reason on stderr). Called without
    ``argv`` it is the program (``python -m advisor``, the ``advisor`` script), a process of its own
    that exits after the command (``analyze`` then lets its analyses reuse the memory they free)."""
    program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    child = argv[:1] == [CHILD_COMMAND]  # the profiling child (advisor.run.launcher), kept out of the help
    if child:
        parser = argparse.ArgumentParser(prog=f"python -m advisor {CHILD_COMMAND}")
        parser.add_argument("--run-dir", required=True)
        args = parser.parse_args(argv[1:])
    else:
        args = build_parser().parse_args(argv)
        args.program = program
    try:
        if child:
            from advisor.run.launcher import child_main

            return child_main(Path(args.run_dir))
        code = _cmd_profile(args) if args.command == "profile" else args.func(args)
        sys.stdout.flush()  # here, so a closed pipe is caught below rather than at the interpreter's exit
        return code
    except AdvisorError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`... | head`): stop quietly. stdout is pointed at devnull so the
        # interpreter's own flush at exit cannot raise again (the Python docs' recipe for SIGPIPE).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as err:
        if child:  # the child's traceback goes to the run's log.txt, where it explains a crash
            raise
        # A file the command had to read or write: the path and the system's reason, not a traceback.
        where = f" {err.filename}" if err.filename else ""
        print(f"error: {args.command}: cannot use{where}: {err.strerror or err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
