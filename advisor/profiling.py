"""The profiled step, as run inside the child process: torch.profiler + NVTX + NVML -> one run.

Schedule: one unprofiled warm-up step, ``steps`` unprofiled timed steps (the step time and phase
times reported come from these, free of profiler overhead), then ``warmup`` steps the profiler traces
but discards and ``steps`` active steps it keeps (torch.profiler.schedule wait/warmup/active); peak
memory and the trace come from the active steps. On a GPU the active steps are also wrapped in a CUDA
profiler capture range (cudaProfilerStart/Stop), so ``nsys profile --capture-range=cudaProfilerApi``
records only them. Writes into the run directory: trace.json.gz (Chrome trace, opens in Perfetto),
metrics.json (StepMetrics), nvml.json, environment.json.
"""

from __future__ import annotations

import gzip
import json
import os
import platform
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from advisor.errors import AdvisorError
from advisor.estimator import estimate
from advisor.memprobe import live_state_tensors, peak_from_memory_events, unique_storage_bytes
from advisor.metrics import StepMetrics
from advisor.model import model_flops_per_token
from advisor.nvml import NvmlSampler
from advisor.specs import Setup
from advisor.step import build_trainer, make_loader, resolve_device

INJECTIONS = ("oom", "crash", "hang", "error")


@dataclass(frozen=True)
class RunOptions:
    """How to run the profiled step (what is run is the Setup)."""

    device: str = "auto"
    """'auto' (CUDA where present), 'cpu' or 'cuda'."""
    steps: int = 3
    """Timed unprofiled steps, and as many profiled (active) steps."""
    warmup: int = 1
    """Steps the profiler traces and discards before the active ones."""
    num_workers: int = 0
    """DataLoader worker processes."""
    pin_memory: bool = False
    data_delay_ms: float = 0.0
    """Simulated loading latency per sample, in ms (reading and decoding that a real input pipeline
    pays; the synthetic tokens cost nothing). A scenario knob for the input-pipeline advice."""
    memory_budget_gib: float = 0.0
    """Treat the device as having this much memory (what-if for a smaller device: the capacity the
    estimate, the preflight and memory_frac use); 0 means the device's own."""
    compile: bool = False
    """torch.compile the model."""
    layers: int = 0
    """Proxy mode: run this many layers and extrapolate to the full depth (0: all layers)."""
    seed: int = 0
    record_shapes: bool = True
    profile_memory: bool = True
    with_stack: bool = False
    nvml_interval_s: float = 0.1
    nsys: bool = False
    """Run the child under ``nsys profile`` (needs Nsight Systems on the PATH)."""
    timeout_s: float = 600.0
    inject: str = ""
    """Test hook: make the child fail on purpose (oom, crash, hang, error)."""

    def __post_init__(self) -> None:
        checks = [
            (self.device in ("auto", "cpu", "cuda"), "device", "auto, cpu or cuda"),
            (isinstance(self.steps, int) and 1 <= self.steps <= 100, "steps", "an integer from 1 to 100"),
            (isinstance(self.warmup, int) and 0 <= self.warmup <= 20, "warmup", "an integer from 0 to 20"),
            (isinstance(self.num_workers, int) and 0 <= self.num_workers <= 32, "num_workers", "0 to 32"),
            (0 <= self.data_delay_ms <= 10_000, "data_delay_ms", "0 to 10000 ms per sample"),
            (0 <= self.memory_budget_gib <= 100_000, "memory_budget_gib", "0 (the device's own) to 100000 GiB"),
            (isinstance(self.layers, int) and self.layers >= 0, "layers", "an integer >= 0 (0 = all layers)"),
            (0 < self.timeout_s <= 24 * 3600, "timeout_s", "a number of seconds in (0, 86400]"),
            (self.inject in ("", *INJECTIONS), "inject", "one of " + ", ".join(INJECTIONS)),
            (0.01 <= self.nvml_interval_s <= 10, "nvml_interval_s", "0.01 to 10 seconds"),
        ]
        for ok, name, allowed in checks:
            if not ok:
                raise AdvisorError(f"{name}={getattr(self, name)!r}: must be {allowed}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def proxy_setup(setup: Setup, layers: int) -> Setup:
    """The setup with only ``layers`` blocks (proxy mode); the MoE interleave is kept."""
    m = setup.model
    if layers <= 0 or layers >= m.n_layers:
        return setup
    step = m.moe_layer_step if m.is_moe else 1
    if layers < step:
        raise AdvisorError(f"layers={layers}: proxy mode needs at least {step} layers to keep the MoE interleave")
    return replace(setup, model=replace(m, n_layers=layers, moe_layer_step=min(step, layers)))


def environment() -> dict[str, Any]:
    """Versions and devices this run saw."""
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cpu_count": os.cpu_count(),
        "cuda_available": torch.cuda.is_available(),
        "nsys_on_path": shutil.which("nsys") is not None,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu_name=props.name, gpu_memory_bytes=props.total_memory, gpu_count=torch.cuda.device_count())
    return env


def _progress(done: int, total: int, message: str) -> None:
    """A progress line for the parent, which reads the child's stdout."""
    print("@@progress " + json.dumps({"done": done, "total": total, "message": message}), flush=True)


def _inject(kind: str) -> None:
    if kind == "oom":
        raise torch.OutOfMemoryError("injected out-of-memory (test hook)")
    if kind == "crash":
        os.abort()
    if kind == "hang":
        time.sleep(10**6)
    if kind == "error":
        raise RuntimeError("injected error (test hook)")


def write_top_ops(prof, path: Path, device_type: str, limit: int = 30) -> None:
    """The ops with the most self time over the active steps (torch.profiler key averages), as JSON rows
    with times in microseconds and the profiler's own FLOP counts (mm/addmm only, see DESIGN.md)."""
    rows = []
    for e in prof.key_averages():
        if e.key.startswith("ProfilerStep") or e.key in ("step", "data", "forward", "backward", "optimizer"):
            continue
        rows.append(
            {
                "name": e.key,
                "calls": e.count,
                "self_cpu_us": e.self_cpu_time_total,
                "cpu_total_us": e.cpu_time_total,
                "self_device_us": getattr(e, "self_device_time_total", 0.0) if device_type == "cuda" else 0.0,
                "flops": e.flops,
            }
        )
    key = "self_device_us" if device_type == "cuda" else "self_cpu_us"
    rows.sort(key=lambda r: r[key], reverse=True)
    path.write_text(json.dumps(rows[:limit], indent=1), encoding="utf-8")


def run_profile(setup: Setup, options: RunOptions, run_dir: Path, run_id: str) -> StepMetrics:
    """Run the profiled step of ``setup`` and write trace, metrics and NVML samples into ``run_dir``.

    ``setup.hardware`` must describe this machine's device (its peaks give the MFU).
    """
    full = setup
    setup = proxy_setup(setup, options.layers)
    device = resolve_device(options.device)
    cuda = device.type == "cuda"
    trainer = build_trainer(
        setup,
        device,
        offload_optimizer=setup.parallel.offload != "none",
        compile_model=options.compile,
        seed=options.seed,
    )
    timed = 1 + options.steps  # the first unprofiled step warms up and is not timed
    total_steps = timed + options.warmup + options.steps
    loader = make_loader(
        setup,
        total_steps * trainer.grad_accum,
        options.num_workers,
        options.pin_memory,
        options.seed,
        delay_ms=options.data_delay_ms,
    )
    batches = iter(loader)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    trace_path = run_dir / "trace.json"
    step_ms: list[float] = []
    profiled_ms: list[float] = []
    skipped_timed = 0
    baseline_bytes = 0
    first_active = timed + options.warmup

    sampler = NvmlSampler(interval_s=options.nvml_interval_s)
    if cuda:
        sampler.start()
    else:
        sampler.unavailable_reason = "NVML unavailable: the run is on the CPU"
    with profile(
        activities=activities,
        schedule=schedule(wait=timed, warmup=options.warmup, active=options.steps, repeat=1),
        record_shapes=options.record_shapes,
        profile_memory=options.profile_memory,
        with_stack=options.with_stack,
        with_flops=True,
        on_trace_ready=lambda p: p.export_chrome_trace(str(trace_path)),
    ) as prof:
        for i in range(total_steps):
            if i == first_active:
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    torch.cuda.profiler.start()
                baseline_bytes = unique_storage_bytes(live_state_tensors(trainer), device.type)
                if options.inject:
                    _inject(options.inject)
            t0 = time.perf_counter()
            skipped = trainer.skipped_steps
            trainer.step(batches)
            elapsed_ms = (time.perf_counter() - t0) * 1e3
            if 1 <= i < timed:
                step_ms.append(elapsed_ms)
                # fp16: only skips in the timed steps count (the scaler calibrates from 2**16 early on).
                skipped_timed += trainer.skipped_steps - skipped
            elif i >= first_active:
                profiled_ms.append(elapsed_ms)
            prof.step()
            _progress(i + 1, total_steps, f"step {i + 1}/{total_steps}")
        if cuda:
            torch.cuda.profiler.stop()
    sampler.stop()

    if cuda:
        peak_bytes = torch.cuda.max_memory_allocated()
        reserved = torch.cuda.max_memory_reserved()
    else:
        rise, _ = peak_from_memory_events(prof.profiler.kineto_results.events(), "cpu")
        peak_bytes, reserved = baseline_bytes + rise, None
    write_top_ops(prof, run_dir / "top_ops.json", device.type)
    with open(trace_path, "rb") as src, gzip.open(run_dir / "trace.json.gz", "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst)
    trace_path.unlink()
    (run_dir / "nvml.json").write_text(
        json.dumps({"summary": sampler.summary(), "samples": sampler.samples}, indent=1), encoding="utf-8"
    )
    metrics = _metrics(
        full, setup, options, trainer, step_ms, profiled_ms, peak_bytes, reserved, sampler, run_id, device
    )
    if metrics.fp16_skipped_steps is not None:
        metrics = replace(metrics, fp16_skipped_steps=skipped_timed)
    metrics = with_trace_analysis(metrics, run_dir / "trace.json.gz")
    metrics.save(run_dir / "metrics.json")
    return metrics


# The figures the trace analysis adds to a profiled run's metrics (step and phase times stay those of
# the unprofiled timed steps).
_ANALYSIS_FIELDS = (
    "n_ranks",
    "gpu_idle_pct",
    "gpu_compute_pct",
    "gpu_non_compute_pct",
    "comm_overlap_pct",
    "idle_host_wait_pct",
    "idle_kernel_wait_pct",
    "idle_other_pct",
    "kernel_category_pct",
    "tiny_kernel_frac",
    "fp32_gemm_pct",
    "tf32_gemm_pct",
    "launch_bound",
    "launch_delay_mean_us",
    "pageable_copies",
    "pageable_copy_bytes",
    "sync_calls",
    "sync_time_ms",
    "step_skew_pct",
    "stragglers",
    "top_ops",
)


def with_trace_analysis(metrics: StepMetrics, trace: Path) -> StepMetrics:
    """The metrics with the analysis of the run's own trace filled in (unchanged if it cannot be read)."""
    from advisor.analyze import analyze, load_trace

    try:
        found = analyze(load_trace(trace), run_id=metrics.run_id, trim_last_step=False).metrics
    except AdvisorError as err:
        print(f"trace analysis skipped: {err}", flush=True)
        return metrics
    return replace(metrics, **{f: getattr(found, f) for f in _ANALYSIS_FIELDS})


def _metrics(
    full, setup, options, trainer, step_ms, profiled_ms, peak_bytes, reserved, sampler, run_id, device
) -> StepMetrics:
    hw, t = setup.hardware, setup.train
    phases = {k: statistics.fmean(v[1 : 1 + options.steps]) for k, v in trainer.phase_ms.items()}
    profiled = statistics.median(profiled_ms)
    step = statistics.median(step_ms)
    tokens = setup.tokens_per_step
    est_run = estimate(setup)
    model_flops = model_flops_per_token(setup.model, t.seq_len) * tokens
    hw_flops = est_run.hardware_flops_per_step
    peak = hw.peak_flops(t.precision)
    state = trainer.state_bytes()
    note = None
    extrapolated = setup is not full
    if extrapolated:
        # Scale by the estimator's full/proxy ratios: the measured proxy keeps this machine's
        # efficiency, the estimator supplies how time and memory grow with depth.
        est_full = estimate(full)
        time_scale = est_full.step_time_ms / est_run.step_time_ms
        mem_scale = est_full.memory.total_bytes / est_run.memory.total_bytes
        note = (
            f"extrapolated: measured on {setup.model.n_layers} of {full.model.n_layers} layers, scaled by the "
            f"estimator's full/proxy ratios (time x{time_scale:.2f}, memory x{mem_scale:.2f})"
        )
        step *= time_scale
        profiled *= time_scale
        phases = {k: v * time_scale for k, v in phases.items()}
        step_ms = [s * time_scale for s in step_ms]
        peak_bytes = int(peak_bytes * mem_scale)
        model_flops = model_flops_per_token(full.model, t.seq_len) * tokens
        hw_flops = est_full.hardware_flops_per_step
        est_run = est_full
    step_s = step / 1e3
    return StepMetrics(
        run_id=run_id,
        source="profile",
        device_type=device.type,
        device_name=sampler.device_name or hw.name,
        model_name=full.model.name,
        n_params=full.model.n_params,
        n_layers_run=setup.model.n_layers,
        seq_len=t.seq_len,
        micro_batch=t.micro_batch,
        grad_accum=setup.grad_accum,
        precision=t.precision,
        recompute=t.recompute,
        optimizer=f"{t.optimizer} ({t.optimizer_impl})",
        fp16_skipped_steps=trainer.skipped_steps if t.precision == "fp16" else None,
        tokens_per_step=tokens,
        steps_measured=len(step_ms),
        step_time_ms=step,
        step_time_min_ms=min(step_ms),
        step_time_max_ms=max(step_ms),
        profiled_step_time_ms=profiled,
        data_ms=phases["data"],
        forward_ms=phases["forward"],
        backward_ms=phases["backward"],
        optimizer_ms=phases["optimizer"],
        other_ms=max(0.0, step - sum(phases.values())),
        tokens_per_s=tokens / step_s,
        model_flops_per_step=model_flops,
        hardware_flops_per_step=hw_flops,
        achieved_flops_per_s=model_flops / step_s,
        peak_flops_per_s=peak,
        mfu_frac=model_flops / step_s / peak,
        hfu_frac=hw_flops / step_s / peak,
        peak_memory_bytes=int(peak_bytes),
        reserved_memory_bytes=reserved,
        memory_capacity_bytes=hw.memory_bytes,
        memory_frac=peak_bytes / hw.memory_bytes,
        params_bytes=state["params_bytes"],
        optimizer_device_bytes=state["optimizer_device_bytes"],
        optimizer_host_bytes=state["optimizer_host_bytes"],
        estimate_step_time_ms=est_run.step_time_ms,
        estimate_peak_memory_bytes=est_run.memory.total_bytes,
        extrapolated=extrapolated,
        proxy_note=note,
        nvml=sampler.summary(),
    )
