"""The profiled step, as run inside the child process: torch.profiler + NVTX + NVML -> one run.

Schedule: one unprofiled warm-up step; on a CPU device ``steps`` steps under a profiler whose trace is
discarded (the rehearsal: ``rehearsal_steps``); the batches DataLoader workers loaded ahead meanwhile
taken off (``prefetched_batches``: the timed steps start as a long run's do, with the workers loading
the batch that is needed next); ``steps`` unprofiled timed steps (the step time and
phase times reported come from these, free of profiler overhead: their median, or with DataLoader workers
the median of the loader's cycles, ``median_steps``), then ``warmup`` steps the profiler
traces but discards and ``steps`` active steps it keeps (torch.profiler.schedule wait/warmup/active);
peak memory and the trace come from the active steps. On a GPU the active steps are also wrapped in a CUDA
profiler capture range (cudaProfilerStart/Stop), so ``nsys profile --capture-range=cudaProfilerApi``
records only them. Writes into the run directory: trace.json.gz (Chrome trace, opens in Perfetto),
metrics.json (StepMetrics), nvml.json, environment.json.
"""

from __future__ import annotations

import gc
import gzip
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import time
import traceback
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from advisor.errors import AdvisorError
from advisor.estimate.estimator import estimate, offloaded_activation_bytes
from advisor.run.memprobe import ddp_bucket_bytes, live_state_tensors, peak_from_memory_events, unique_storage_bytes
from advisor.run.model import model_flops_per_token
from advisor.run.nvml import NvmlSampler
from advisor.run.step import build_trainer, make_loader, prefetched_batches, resolve_device, unwrap
from advisor.run.unified_memory import managed_memory
from advisor.spec.metrics import StepMetrics
from advisor.spec.options import RunOptions
from advisor.spec.presets import CPU_MATRIX_FLAGS, cpu_flags, cpu_model
from advisor.spec.specs import HardwareSpec, Setup
from advisor.store.runstore import RunFiles


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
        "cpu_model": cpu_model(),
        # The matrix units behind cpu_host()'s peaks, so a run's CPU MFU can be read later on any machine.
        "cpu_matrix_flags": sorted(CPU_MATRIX_FLAGS & cpu_flags()),
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


def run_profile(setup: Setup, options: RunOptions, run_dir: Path, run_id: str) -> StepMetrics | None:
    """Run the profiled step of ``setup`` and write trace, metrics and NVML samples into ``run_dir``;
    returns the run's StepMetrics (None on the ranks other than 0 of a distributed run, whose rank 0
    writes the merged metrics).

    ``setup.hardware`` must describe this machine's device (its peaks give the MFU). Under torchrun
    (WORLD_SIZE > 1) every rank runs the step of its part of the layout and writes its trace to
    ``ranks/rank-<r>.trace.json.gz``.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return _run_distributed(setup, options, run_dir, run_id)
    files = RunFiles(run_dir)
    full = setup
    setup = proxy_setup(setup, options.layers)
    device = resolve_device(options.device)
    managed = (
        managed_memory(device, options.um_host_budget_gib, estimate(setup).memory.total_bytes)
        if options.unified_memory
        else nullcontext({})
    )
    with managed as um_record:
        trainer = build_trainer(
            setup,
            device,
            offload_optimizer=setup.parallel.offload != "none",
            compile_model=options.compile,
            seed=options.seed,
        )
        drain = prefetched_batches(options.num_workers)
        pairs = offload_reference_pairs(setup, device.type)
        loader = make_loader(
            setup,
            (_total_steps(options, device.type) + (2 * pairs + 1 if pairs else 0)) * trainer.grad_accum + drain,
            options.num_workers,
            options.pin_memory,
            options.seed,
            delay_ms=options.data_delay_ms,
        )
        sampler = _sampler(options, device)
        batches = iter(loader)
        measured = _profile_steps(trainer, batches, options, device, files.trace, progress=True, drain=drain)
        reference = _offload_reference(trainer, batches, pairs)
        sampler.stop()
    write_top_ops(measured.prof, files.top_ops, device.type)
    files.nvml.write_text(
        json.dumps({"summary": sampler.summary(), "samples": sampler.samples}, indent=1), encoding="utf-8"
    )
    ranks = [_rank_result(trainer, measured, options)]
    if reference:
        ranks[0]["offload"] = ranks[0]["offload"] | reference
    metrics = _metrics(full, setup, options, ranks, sampler.summary(), sampler.device_name, run_id, device)
    if um_record:
        metrics = replace(metrics, unified_memory=um_record)
    metrics = with_trace_analysis(metrics, files.trace, setup.hardware)
    metrics.save(files.metrics)
    return metrics


def _run_distributed(setup: Setup, options: RunOptions, run_dir: Path, run_id: str) -> StepMetrics | None:
    """One rank of a torchrun job: its part of the layout under the same schedule, its trace in
    ``ranks/``; rank 0 gathers every rank's measurements, merges them with the analysis of all the
    ranks' traces it can see (this node's, or all on a shared file system) and writes metrics.json."""
    import torch.distributed as dist

    from advisor.run.parallel import build_parallel_trainer, init_parallel, rank_loader

    if options.layers:
        raise AdvisorError("layers: proxy mode is for a single process; profile the full depth with --nproc")
    device_type = resolve_device(options.device).type
    files = RunFiles(run_dir)
    info = init_parallel(setup, device_type)
    try:
        device = info.device
        trainer = build_parallel_trainer(setup, device, info, seed=options.seed, compile_model=options.compile)
        # Only the stages that read data have a loader to take prefetched batches off.
        drain = prefetched_batches(options.num_workers) if info.is_first_stage or info.is_last_stage else 0
        loader = rank_loader(
            setup, info, _total_steps(options, device_type), options.num_workers, options.pin_memory, options.seed,
            delay_ms=options.data_delay_ms, extra_micro_batches=drain,
        )  # fmt: skip
        sampler = _sampler(options, device)
        files.ranks.mkdir(exist_ok=True)
        trace = files.rank_trace(info.rank)
        measured = _profile_steps(trainer, iter(loader), options, device, trace, progress=info.rank == 0, drain=drain)
        sampler.stop()
        mine = _rank_result(trainer, measured, options, info.rank) | {"nvml": sampler.summary()}
        gathered: list[Any] = [None] * info.world_size if info.rank == 0 else []
        dist.gather_object(mine, gathered if info.rank == 0 else None, dst=0)
        if info.rank != 0:
            # Wait for rank 0 to file the run before tearing the group down: a rank that exits while
            # gloo still has work in flight with a peer can abort ("terminate called without an
            # active exception", seen once in CI on FSDP2).
            dist.barrier()
            return None
        write_top_ops(measured.prof, files.top_ops, device.type)
        files.nvml.write_text(
            json.dumps(
                {"summary": sampler.summary(), "samples": sampler.samples, "ranks": [r["nvml"] for r in gathered]}
            ),
            encoding="utf-8",
        )
        metrics = _metrics(setup, setup, options, gathered, sampler.summary(), sampler.device_name, run_id, device)
        metrics = with_trace_analysis(metrics, files.ranks, setup.hardware)
        metrics.save(files.metrics)
        dist.barrier()
        return metrics
    finally:
        dist.destroy_process_group()


def rehearsal_steps(options: RunOptions, device_type: str) -> int:
    """Steps run under a profiler whose trace is discarded, after the warm-up step: ``steps`` on a CPU
    device, none on a GPU.

    The profiler keeps a weak reference to every tensor its records name, which pins each tensor's
    ``TensorImpl`` until it stops. On a CPU those small objects share glibc's heap with the tensors'
    data: the first profiled steps' pinned objects split the blocks the step freed, so each step's
    tensors took fresh pages from the top of the heap. Measured in one process, the 1-layer tiny model
    with unfused attention at seq 1,024 x 2 on 2 cores of our EPYC VM took 213-295 K page faults,
    0.3-0.5 s of system time and about 1 GiB more resident memory per profiled step: 478-624 ms against
    279-294 ms unprofiled. The profile read the ops that allocate (copies, products, softmax: the
    memory-bound ops the fusion rule prices) at 2-3x. A second profiler session of as many steps took
    0-2 faults a step, at 284-306 ms, provided the first session's profiler was collected and the heap
    it grew was kept (``reuse_freed_memory(trim=False)`` in the child): that room is what the next
    session needs. The rehearsal is that first session. A GPU step's tensors live in the caching
    allocator, apart from the pinned objects."""
    return options.steps if device_type == "cpu" else 0


def _total_steps(options: RunOptions, device_type: str) -> int:
    """One untimed warm-up step, the rehearsal, the timed steps, the profiler's warm-up and active steps."""
    return 1 + rehearsal_steps(options, device_type) + options.steps + options.warmup + options.steps


OFFLOAD_REFERENCE_PAIRS = 3
"""On a CPU device, pairs of extra steps with the activation offload on and off (``_offload_reference``)."""


def offload_reference_pairs(setup: Setup, device_type: str) -> int:
    """Pairs of reference steps to take after the profiled ones: ``OFFLOAD_REFERENCE_PAIRS`` on a CPU
    device with activation offload on, else 0 (offload runs eager: build_trainer refuses compile)."""
    return OFFLOAD_REFERENCE_PAIRS if device_type == "cpu" and setup.train.offload_activations else 0


def _offload_reference(trainer, batches, pairs: int) -> dict[str, Any]:
    """What activation offload costs this process's step on a CPU, measured: ``pairs`` pairs of steps
    with the offloader on and off, in alternating order (on-off, off-on, ...: a linear drift cancels),
    after the profiled steps. On a CPU the hooks run inline and their own timer (``exposed_ms``) misses
    part of their cost: tiny-8l (seq 256 x 4, bf16, 2 cores) offloading 4 or 8 of its blocks timed
    9.7 / 20.9 ms inside the hooks against 16.8 / 41.2 ms a step beside the same steps without them.
    One untimed step with the offload on goes first: the first step after the profiler (which has
    just exported and compressed its trace) runs slow. Without it, the first pair cost the most in 10
    of 12 runs, median 49.1 ms against 19.7 ms for the later pairs. Returns ``step_with_ms`` and ``step_without_ms`` (medians),
    ``pair_costs_ms`` (each pair's difference), ``step_cost_ms`` (their median) and
    ``reference_pairs``; {} when ``pairs`` is 0."""
    if not pairs or trainer.offloader is None:
        return {}
    model = unwrap(trainer.model)
    offloader, runner = trainer.offloader, model.block_runner
    times: dict[bool, list[float]] = {True: [], False: []}
    n_losses = len(trainer.losses)
    try:
        trainer.step(batches)  # untimed: the first step after the profiler's export runs slow
        for k in range(pairs):
            for on in (True, False) if k % 2 == 0 else (False, True):
                trainer.offloader, model.block_runner = (offloader, runner) if on else (None, None)
                t0 = time.perf_counter()
                trainer.step(batches)
                times[on].append((time.perf_counter() - t0) * 1e3)
    finally:
        trainer.offloader, model.block_runner = offloader, runner
        del trainer.losses[n_losses:]  # the run's losses stay those of its schedule's steps
    costs = [a - b for a, b in zip(times[True], times[False], strict=True)]
    return {
        "step_with_ms": statistics.median(times[True]),
        "step_without_ms": statistics.median(times[False]),
        "step_cost_ms": statistics.median(costs),
        "pair_costs_ms": costs,
        "reference_pairs": pairs,
    }


def _sampler(options: RunOptions, device: torch.device) -> NvmlSampler:
    sampler = NvmlSampler(interval_s=options.nvml_interval_s, device_index=device.index or 0)
    if device.type == "cuda":
        # CUDA's device order (fastest first, under CUDA_VISIBLE_DEVICES) need not be NVML's (PCI order):
        # the UUID names the GPU this process runs on.
        uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", "") or "")
        sampler.device_uuid = uuid if not uuid or uuid.startswith("GPU-") else f"GPU-{uuid}"
        sampler.start()
    else:
        sampler.unavailable_reason = "NVML unavailable: the run is on the CPU"
    return sampler


@dataclass
class _Measured:
    """What the step loop measured: unprofiled and profiled step times (ms), peak memory, the profiler."""

    step_ms: list[float]
    profiled_ms: list[float]
    faults: list[int]
    """Page faults the process took in each timed step (fresh pages: minor faults, all threads)."""
    profiled_faults: list[int]
    timed: slice
    """Which of the trainer's steps (its per-step records: phases, offload figures) were timed."""
    peak_bytes: int
    reserved_bytes: int | None
    skipped_timed: int
    prof: Any


def _step_role(i: int, timed: int, first_active: int, total: int, rehearsal: int = 0) -> str:
    """What step ``i`` of the schedule is for, in the progress message: "--steps 2" on a GPU runs 6
    steps (1 warm-up, 2 timed, 1 profiler warm-up, 2 profiled), which "step 3/6" alone did not
    explain. The timed steps are ``rehearsal + 1`` to ``timed - 1``."""
    if i == 0:
        return "warm-up"
    if i <= rehearsal:
        return f"profiler rehearsal {i}/{rehearsal}"
    if i < timed:
        return f"timed {i - rehearsal}/{timed - 1 - rehearsal}"
    if i < first_active:
        return "profiler warm-up"
    return f"profiled {i - first_active + 1}/{total - first_active}"


def _profile_steps(
    trainer, batches, options: RunOptions, device: torch.device, trace_gz: Path, *, progress: bool, drain: int = 0
):
    """The schedule of the module docstring on ``trainer``; writes the active steps' trace to ``trace_gz``.
    ``drain``: batches taken off ``batches`` before the timed steps (``prefetched_batches``)."""
    cuda = device.type == "cuda"
    rehearsal = rehearsal_steps(options, device.type)
    before = 1 + rehearsal  # the first unprofiled step warms up; then the rehearsal; none is timed
    timed = before + options.steps
    total_steps = _total_steps(options, device.type)
    first_active = timed + options.warmup
    trace_path = trace_gz.with_suffix("")  # the profiler writes plain JSON; gzipped below
    settings = dict(
        activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
        record_shapes=options.record_shapes,
        profile_memory=options.profile_memory,
        with_stack=options.with_stack,
        with_flops=True,
    )
    step_ms: list[float] = []
    profiled_ms: list[float] = []
    faults: list[int] = []
    profiled_faults: list[int] = []
    skipped_timed = 0
    baseline_bytes = 0

    def report(i: int) -> None:
        if progress:
            role = _step_role(i, timed, first_active, total_steps, rehearsal)
            _progress(i + 1, total_steps, f"step {i + 1}/{total_steps} ({role})")

    trainer.step(batches)
    report(0)
    if rehearsal:
        with profile(**settings):
            for i in range(1, before):
                trainer.step(batches)
                report(i)
        # The profiler object sits in a reference cycle: collected now, its results go before the
        # profiled steps, not in the middle of the room they need (rehearsal_steps says why).
        gc.collect()
    # DataLoader workers load ahead while the untimed steps run (the rehearsal's are slower): taken by
    # the timed steps, those batches would hide a loader that cannot keep up. One worker loading 8
    # samples of 40 ms (320 ms a batch) against ~130 ms of compute timed a median step of 162-275 ms
    # with 2-160 ms of data wait, its slowest step 326-349 ms; a long run waits every step.
    for _ in range(drain):
        next(batches)
    with profile(
        schedule=schedule(wait=options.steps, warmup=options.warmup, active=options.steps, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(str(trace_path)),
        **settings,
    ) as prof:
        for i in range(before, total_steps):
            if i == first_active:
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    torch.cuda.profiler.start()
                baseline_bytes = unique_storage_bytes(live_state_tensors(trainer), device.type)
                baseline_bytes += ddp_bucket_bytes(trainer.model)  # allocated before the profiler saw them
                if options.inject:
                    _inject(options.inject)
            f0, t0 = _page_faults(), time.perf_counter()
            skipped = trainer.skipped_steps
            trainer.step(batches)
            elapsed_ms, step_faults = (time.perf_counter() - t0) * 1e3, _page_faults() - f0
            if i < timed:
                step_ms.append(elapsed_ms)
                faults.append(step_faults)
                # fp16: only skips in the timed steps count (the scaler calibrates from 2**16 early on).
                skipped_timed += trainer.skipped_steps - skipped
            elif i >= first_active:
                profiled_ms.append(elapsed_ms)
                profiled_faults.append(step_faults)
            prof.step()
            report(i)
        if cuda:
            torch.cuda.profiler.stop()
    if cuda:
        peak_bytes, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    else:
        rise, _ = peak_from_memory_events(prof.profiler.kineto_results.events(), "cpu")
        peak_bytes, reserved = baseline_bytes + rise, None
    with open(trace_path, "rb") as src, gzip.open(trace_gz, "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst)
    trace_path.unlink()
    return _Measured(
        step_ms,
        profiled_ms,
        faults,
        profiled_faults,
        slice(before, timed),
        int(peak_bytes),
        reserved,
        skipped_timed,
        prof,
    )


def _page_faults() -> int:
    """The minor page faults this process has taken so far (all its threads)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# The figures the trace analysis adds to a profiled run's metrics (step and phase times stay those of
# the unprofiled timed steps).
_ANALYSIS_FIELDS = (
    "n_ranks",
    "gpu_idle_pct",
    "gpu_compute_idle_pct",
    "gpu_memory_alone_pct",
    "gpu_idle_all_devices_pct",
    "gpu_compute_pct",
    "gpu_non_compute_pct",
    "comm_overlap_pct",
    "comm_time_pct",
    "comm_exposed_pct",
    "idle_host_wait_pct",
    "idle_kernel_wait_pct",
    "idle_other_pct",
    "kernel_category_pct",
    "tiny_kernel_frac",
    "fusion_chain_saving_pct",
    "fp32_gemm_pct",
    "tf32_gemm_pct",
    "launch_bound",
    "launch_delay_mean_us",
    "pageable_copies",
    "pageable_copy_bytes",
    "pageable_copy_pct",
    "sync_calls",
    "sync_time_ms",
    "step_skew_pct",
    "stragglers",
    "comm_late_pct",
    "comm_stragglers",
    "top_ops",
    "roofline_bound",
    "roofline_compute_frac",
    "roofline_memory_frac",
    "roofline_latency_frac",
    "roofline_communication_frac",
    "roofline_headroom_ms",
    "roofline_modelled_frac",
    "roofline_gemm_frac",
    "roofline_gemm_roof_frac",
    "roofline_gemm_fixed_frac",
    "roofline_fusable_frac",
    "roofline_compile_fusable_frac",
    "roofline_compile_fusable_roof_frac",
    "roofline_score_chain_frac",
    "roofline_attention_frac",
    "roofline_roofs",
)


def with_trace_analysis(metrics: StepMetrics, trace: Path, hardware: HardwareSpec | None = None) -> StepMetrics:
    """The metrics with the analysis of the run's own trace filled in (unchanged if it cannot be read),
    its roofline judged against ``hardware`` (the device the step ran on) with the ceilings measured
    on it when there are (a single process: the ceilings are measured with the whole device).

    The measured step is worth more than its analysis: any failure here (a missing optional package
    such as orjson, a trace shape the analysis has not met) is printed with its traceback to the run's
    log and the measured metrics are kept."""
    try:
        return _with_trace_analysis(metrics, trace, hardware)
    except Exception:
        print(f"trace analysis failed; the measured metrics are kept:\n{traceback.format_exc()}", flush=True)
        return metrics


def _with_trace_analysis(metrics: StepMetrics, trace: Path, hardware: HardwareSpec | None) -> StepMetrics:
    from advisor.analysis.roofline import trace_roofline
    from advisor.analysis.summary import analyze, load_trace
    from advisor.store.ceilings import ceilings_lookup

    try:
        table = load_trace(trace)
    except AdvisorError as err:
        print(f"trace analysis skipped: {err}", flush=True)
        return metrics
    try:
        store_root = trace.parent.parent.parent  # <store>/.staging/<run id>/{trace.json.gz, ranks}
        roofline = trace_roofline(
            table,
            hardware=hardware,
            ceilings=ceilings_lookup(store_root) if (metrics.world_size or 1) == 1 else None,
            optimizer_params=(metrics.params_bytes or 0) // 4,
        )
    except AdvisorError as err:
        print(f"roofline skipped: {err}", flush=True)
        roofline = None
    try:
        found = analyze(table, run_id=metrics.run_id, trim_last_step=False, roofline=roofline).metrics
    except AdvisorError as err:
        print(f"trace analysis skipped: {err}", flush=True)
        return metrics
    return replace(metrics, **{f: getattr(found, f) for f in _ANALYSIS_FIELDS})


def median_steps(step_ms: list[float], workers: int = 0) -> list[int]:
    """The indices of the timed steps the step time is read from: the middle one of ``step_ms``, or
    the two middle ones for an even count (``statistics.median``); with two or more DataLoader
    ``workers``, the middle one or two of the loader's cycles instead: runs of ``workers`` consecutive
    steps after the first. Workers that start together deliver their batches together, so a step paced
    by them alternates: with 2 workers loading a batch in 320 ms beside ~120 ms of compute, the steps
    ran 446, 120, 209, 126, 205, 120, 186, 118, 202 ms. Their median (186) is no step's pace; a cycle
    of 2 steps takes one load (320 ms), and the cycles' median, 162 ms a step, is the pace. The first
    timed step is left out there: the workers begin a round as the prefetched batches are taken off,
    and it waits a whole load (446 ms = one load + one step's compute). Fewer steps than a cycle after
    it: all of them (a pace no faster than the loader's, the first step's wait in it)."""
    n = len(step_ms)
    if workers < 2:
        order = sorted(range(n), key=step_ms.__getitem__)
        return order[(n - 1) // 2 : n // 2 + 1]
    cycles = [list(range(i, i + workers)) for i in range(1, n - workers + 1, workers)]
    if not cycles:
        return list(range(n))
    order = sorted(cycles, key=lambda c: sum(step_ms[i] for i in c))
    return [i for c in order[(len(order) - 1) // 2 : len(order) // 2 + 1] for i in c]


def typical_step_ms(step_ms: list[float], workers: int = 0) -> float:
    """The step time of a run: the mean of its ``median_steps`` (``statistics.median`` without
    workers)."""
    return statistics.fmean(step_ms[i] for i in median_steps(step_ms, workers))


def median_step_phases(step_ms: list[float], phase_ms: dict[str, list[float]], workers: int = 0) -> dict[str, float]:
    """Phase times (ms) of the steps the step time is read from (``median_steps``), averaged, so they
    add up to the step time they are shown beside. ``phase_ms[k][i]`` belongs to step ``i``. The mean
    over all steps mixed in the outlier the median leaves out: on a loaded machine forward + backward
    read 2,261 ms beside an 831 ms median step."""
    middle = median_steps(step_ms, workers)
    return {k: statistics.fmean(v[i] for i in middle) for k, v in phase_ms.items()}


def _rank_result(trainer, measured: _Measured, options: RunOptions, rank: int = 0) -> dict[str, Any]:
    """One rank's measurements as plain values (what a distributed run gathers on rank 0)."""
    return {
        "rank": rank,
        "step_ms": measured.step_ms,
        "profiled_ms": measured.profiled_ms,
        "faults": measured.faults,
        "profiled_faults": measured.profiled_faults,
        "phases": median_step_phases(
            measured.step_ms, {k: v[measured.timed] for k, v in trainer.phase_ms.items()}, options.num_workers
        ),
        "peak_bytes": measured.peak_bytes,
        "reserved_bytes": measured.reserved_bytes,
        "state": trainer.state_bytes(),
        "skipped_timed": measured.skipped_timed,
        "skipped_total": trainer.skipped_steps,
        "losses": list(getattr(trainer, "losses", [])),
        "offload": _mean_offload(getattr(trainer, "offload_stats", [])[measured.timed]),
        "fp8": _fp8_summary(trainer),
        "host_rss": peak_rss_bytes(),
    }


def proc_kib_bytes(path: str, key: str) -> int | None:
    """A ``key: N kB`` field of a /proc file (``/proc/meminfo``, ``/proc/self/status``) in bytes; None
    where the file or the field cannot be read."""
    try:
        with open(path, encoding="ascii") as fh:
            for line in fh:
                if line.startswith(f"{key}:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (bytes): /proc's VmHWM, the high-water mark of this
    process image. Not getrusage's ru_maxrss: Linux carries that over fork and exec, so a child started
    by a 2.4 GB test runner read 2.4 GB there. ru_maxrss (KiB) only where /proc has no VmHWM."""
    hwm = proc_kib_bytes("/proc/self/status", "VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _fp8_summary(trainer) -> dict[str, Any]:
    """Which fp8 backend ran, its recipe and how many linears it converted ({} without fp8), as the
    conversion reported them."""
    return dict(getattr(trainer, "fp8", {}))


def _mean_offload(stats: list) -> dict[str, Any]:
    """The timed steps' activation offload figures, averaged field by field ({} without offload)."""
    if not stats:
        return {}
    rows = [s.as_dict() for s in stats]
    return {k: (statistics.fmean(r[k] for r in rows) if not isinstance(v, bool) else v) for k, v in rows[0].items()}


def _metrics(
    full: Setup,
    setup: Setup,
    options: RunOptions,
    ranks: list[dict[str, Any]],
    nvml_summary: dict,
    device_name: str | None,
    run_id: str,
    device: torch.device,
) -> StepMetrics:
    """The run's StepMetrics from every rank's measurements (one entry for a single process). The
    slowest rank sets the step time (the ranks synchronise every step); phase times are those of each
    rank's median step, averaged over ranks; peak memory the largest rank's; MFU divides by every
    rank's peak."""
    hw, t = setup.hardware, setup.train
    world = len(ranks)
    workers = options.num_workers
    step_ms = max((r["step_ms"] for r in ranks), key=lambda s: typical_step_ms(s, workers))
    step = typical_step_ms(step_ms, workers)
    profiled = max(statistics.median(r["profiled_ms"]) for r in ranks)
    phases = {k: statistics.fmean(r["phases"][k] for r in ranks) for k in ranks[0]["phases"]}
    peak_bytes = max(r["peak_bytes"] for r in ranks)
    reserved = None if ranks[0]["reserved_bytes"] is None else max(r["reserved_bytes"] for r in ranks)
    tokens = setup.tokens_per_step
    est_run = estimate(setup)
    model_flops = model_flops_per_token(setup.model, t.seq_len) * tokens
    hw_flops = est_run.hardware_flops_per_step
    peak = hw.peak_flops(t.precision) * world
    state = ranks[0]["state"]
    note = None
    time_scale = 1.0
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
        device_name=device_name or hw.name,
        model_name=full.model.name,
        n_params=full.model.n_params,
        n_layers_run=setup.model.n_layers,
        seq_len=t.seq_len,
        micro_batch=t.micro_batch,
        grad_accum=setup.grad_accum,
        precision=t.precision,
        recompute=t.recompute,
        optimizer=f"{t.optimizer} ({t.optimizer_impl})",
        fp16_skipped_steps=ranks[0]["skipped_timed"] if t.precision == "fp16" else None,
        tokens_per_step=tokens,
        steps_measured=len(step_ms),
        step_time_ms=step,
        step_time_min_ms=min(step_ms),
        step_time_max_ms=max(step_ms),
        profiled_step_time_ms=profiled,
        profiler_rehearsal_steps=rehearsal_steps(options, device.type),
        page_faults_per_step=max(statistics.median(r["faults"]) for r in ranks),
        profiled_page_faults_per_step=max(statistics.median(r["profiled_faults"]) for r in ranks),
        data_ms=phases["data"],
        forward_ms=phases["forward"],
        backward_ms=phases["backward"],
        optimizer_ms=phases["optimizer"],
        pipeline_wait_ms=phases.get("pipeline_wait"),
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
        nvml=nvml_summary,
        world_size=world,
        layout=_layout(setup),
        rank_step_time_ms=[typical_step_ms(r["step_ms"], workers) * time_scale for r in ranks],
        rank_peak_memory_bytes=[int(r["peak_bytes"]) for r in ranks],
        losses=ranks[-1]["losses"],
        recompute_layers=t.recompute_layers,
        offload_activations=t.offload_activations,
        activation_offload=_offload_summary(setup, ranks[0].get("offload") or {}),
        fp8=ranks[0].get("fp8") or {},
        host_peak_rss_bytes=max((r.get("host_rss") or 0 for r in ranks), default=0) or None,
    )


def _offload_summary(setup: Setup, measured: dict[str, Any]) -> dict[str, Any]:
    """The measured offload figures (rank 0's) with the estimator's byte count for the same blocks."""
    if not measured:
        return {}
    return measured | {"estimate_bytes": offloaded_activation_bytes(setup) * setup.grad_accum}


def _layout(setup: Setup) -> str:
    """The parallel layout in words: 'dp2 tp1 pp1, ZeRO-3 (FSDP2, reshard after forward)'."""
    p = setup.parallel
    text = f"dp{p.dp} tp{p.tp}{' (sequence parallel)' if p.sequence_parallel else ''} pp{p.pp}"
    if p.vpp > 1:
        text += f" x{p.vpp} virtual"
    if p.dp > 1:
        text += ", DDP" if p.zero == 0 else f", ZeRO-{p.zero} (FSDP2{', reshard after forward' * (p.zero == 3)})"
    return text
