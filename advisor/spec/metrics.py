"""StepMetrics: the one record per run that the rules and the regression read; saved as metrics.json.

Every field carries its unit in its name. Fields a source cannot provide are None (a CPU run has no
NVML readings; a foreign trace has no spec). The trace analysis adds its own figures to the same
record.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class StepMetrics:
    """Measured figures of one training step (means over the profiled steps unless said otherwise)."""

    run_id: str
    source: str
    """'profile' (our own step) or 'trace' (an imported trace)."""
    device_type: str | None = None
    """'cpu' or 'cuda'."""
    device_name: str | None = None
    model_name: str | None = None
    n_params: int | None = None
    n_layers_run: int | None = None
    """Layers actually executed (fewer than the model's in proxy mode)."""
    seq_len: int | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    precision: str | None = None
    recompute: str | None = None
    optimizer: str | None = None
    """The optimizer and its implementation, 'adamw (for-loop)' (for a trace: from its Optimizer.step
    range and the ops inside it)."""
    attention_fused: bool | None = None
    """For a trace: True where its ops include a fused attention kernel (SDPA's flash, memory-efficient
    or cuDNN attention); None where it shows none."""
    fp16_skipped_steps: int | None = None
    """Optimizer steps the fp16 GradScaler skipped for inf/NaN gradients among the steps_measured timed
    steps (the warm-up step, where the scaler calibrates from 2**16, is not counted; None unless fp16)."""
    tokens_per_step: int | None = None
    steps_measured: int | None = None
    step_time_ms: float | None = None
    """Median wall time of one optimizer step (all micro-batches)."""
    step_time_min_ms: float | None = None
    step_time_max_ms: float | None = None
    profiled_step_time_ms: float | None = None
    """Median step time under the profiler (its overhead shows against step_time_ms)."""
    profiler_rehearsal_steps: int | None = None
    """Steps run under a profiler whose trace was discarded before the timed steps (on a CPU device,
    so the profiled steps do not take fresh pages: advisor.run.child.rehearsal_steps); None in runs
    from before it."""
    page_faults_per_step: float | None = None
    """Median page faults (minor: fresh pages the kernel hands out) the host process took in a timed
    step, the busiest rank's."""
    profiled_page_faults_per_step: float | None = None
    """The same in a profiled step: far above page_faults_per_step, the profiled steps paid for fresh
    pages that the timed ones did not, in the ops that allocate."""
    data_ms: float | None = None
    forward_ms: float | None = None
    backward_ms: float | None = None
    optimizer_ms: float | None = None
    other_ms: float | None = None
    """Step time not inside a data/forward/backward/optimizer range."""
    tokens_per_s: float | None = None
    model_flops_per_step: float | None = None
    """6N + 12*L*s*q per token (PaLM appendix B), no recompute."""
    hardware_flops_per_step: float | None = None
    """Executed FLOPs incl. recompute (causal flash attention at half)."""
    achieved_flops_per_s: float | None = None
    peak_flops_per_s: float | None = None
    """Datasheet peak of this device for the precision used."""
    mfu_frac: float | None = None
    hfu_frac: float | None = None
    peak_memory_bytes: int | None = None
    """Peak bytes allocated on the training device during a profiled step (for a trace: the peak of
    tensor memory allocated while the profiler ran, from its memory events; what was allocated before
    it started, such as the weights, is not seen)."""
    reserved_memory_bytes: int | None = None
    """CUDA caching allocator reservation at its peak (None on a CPU)."""
    memory_capacity_bytes: int | None = None
    memory_frac: float | None = None
    params_bytes: int | None = None
    optimizer_device_bytes: int | None = None
    optimizer_host_bytes: int | None = None
    estimate_step_time_ms: float | None = None
    """The analytic estimator's prediction for the same setup on this device."""
    estimate_peak_memory_bytes: float | None = None
    extrapolated: bool = False
    """Proxy mode: figures scaled from n_layers_run to the full depth (see proxy_note)."""
    proxy_note: str | None = None
    nvml: dict[str, Any] = field(default_factory=dict)
    """NVML summary: means/maxima of utilisation, power, clocks, throttle share; or why unavailable."""
    world_size: int | None = None
    """Processes that ran the step (1: a single process; more: torch.distributed under torchrun)."""
    layout: str | None = None
    """The parallel layout that ran: 'dp2 tp1 pp1, ZeRO-3 (FSDP2, reshard after forward)'."""
    rank_step_time_ms: list = field(default_factory=list)
    """Median unprofiled step time of each rank, by rank."""
    rank_peak_memory_bytes: list = field(default_factory=list)
    """Peak memory of each rank, by rank (peak_memory_bytes is the largest)."""
    losses: list = field(default_factory=list)
    """Training loss after each step, where the step records it (the distributed step does)."""
    fp8: dict = field(default_factory=dict)
    """With precision fp8: the backend ('torchao' float8 linears or 'transformer_engine'), the scaling
    recipe, and how many linears run in fp8. Empty otherwise."""
    recompute_layers: int | None = None
    """Blocks per stage that recompute under recompute='full' (0: all)."""
    offload_activations: int | None = None
    """Blocks per stage whose saved activations went to the host and back."""
    host_peak_rss_bytes: int | None = None
    """The largest rank process's peak resident memory on the host (/proc's VmHWM, read after the last
    step): Python, torch and the device runtime's libraries, and the state it keeps on the host.
    The launcher's host preflight reads it (advisor.run.launcher.process_host_bytes)."""
    unified_memory: dict = field(default_factory=dict)
    """With --unified-memory (advisor.run.unified_memory): the allocator, the budget (free and total GPU
    memory, coherent link or not, the cap and why), managed bytes at their peak, segment allocations,
    allocations the cap refused, and where page faults can be read. Empty without it."""
    activation_offload: dict = field(default_factory=dict)
    """Activation offload, mean over the timed steps (advisor.run.offload.OffloadStats): blocks, tensors,
    bytes_offloaded and bytes_restored per step, copy_out_ms, copy_in_ms, exposed_ms (copy time not
    hidden behind compute), host_bytes, pinned, out_gb_per_s and in_gb_per_s (host-link bandwidth
    achieved), and estimate_bytes (the estimator's count for the same blocks). A single-process run on
    a CPU device also has step_with_ms, step_without_ms, pair_costs_ms, step_cost_ms and
    reference_pairs: steps with the offload on and off in alternation after the profiled ones, and the
    median of their differences, its whole cost (advisor.run.child._offload_reference). Empty without
    offload."""
    # --- from the trace analysis (advisor.analysis.breakdown); None where the trace has no GPU events ---
    n_ranks: int | None = None
    gpu_idle_pct: float | None = None
    """Share of the GPU kernel span with no kernel, copy or set running (mean over ranks; HTA's idle time,
    copies count as busy). The launch rules read this one: the host-wait split divides it, and a GPU
    that copies is not waiting for the host to launch work."""
    gpu_compute_idle_pct: float | None = None
    """Share of the GPU kernel span with no computation kernel running: copies, sets and communication
    kernels count as idle (mean over ranks; gpu_idle_pct + gpu_non_compute_pct). The utilisation rule
    reads this one: it is the time the SMs have no math to do, whatever else the GPU does."""
    gpu_memory_alone_pct: float | None = None
    """Share of the GPU kernel span where a copy or set runs and no computation does (mean over ranks):
    the copy time compute does not hide."""
    gpu_idle_all_devices_pct: float | None = None
    """Share of the whole trace's GPU span (first GPU event of any device to the last) in which no
    device runs anything: the union over all devices (advisor.analysis.breakdown.gpu_idle)."""
    gpu_compute_pct: float | None = None
    gpu_non_compute_pct: float | None = None
    """Communication and memory kernels not overlapped by computation."""
    comm_overlap_pct: float | None = None
    """Share of communication time overlapped by computation (None without communication)."""
    comm_time_pct: float | None = None
    """Collectives' own time (NCCL kernels, gloo ranges) as % of the step, mean over ranks."""
    comm_exposed_pct: float | None = None
    """Collective time with no compute beside it on its rank, % of the step, mean over ranks (see
    advisor.analysis.collectives.collective_table)."""
    pipeline_wait_ms: float | None = None
    """Pipeline parallel: time a stage waits in the schedule (the bubble and its peers' sends), mean
    over ranks."""
    idle_host_wait_pct: float | None = None
    """Of the GPU's idle time: waiting for the host to launch work."""
    idle_kernel_wait_pct: float | None = None
    idle_other_pct: float | None = None
    fusion_chain_saving_pct: float | None = None
    """What fusing the repeated chains of elementwise/reduction/norm kernels would save, % of the GPU
    kernel span, mean over ranks: each chain costing its longest kernel (advisor.analysis.sequences)."""
    kernel_category_pct: dict = field(default_factory=dict)
    """Share of summed GPU-event time per category: gemm, attention, elementwise, reduction,
    normalization, optimizer, communication, memcpy, memset, convolution, other."""
    fp32_gemm_pct: float | None = None
    """GEMMs on plain FP32 (SIMT) cores, % of summed GPU-event time (no tensor cores used)."""
    tf32_gemm_pct: float | None = None
    """GEMMs on TF32 tensor cores, % of summed GPU-event time (16-bit runs them 2x faster)."""
    tiny_kernel_frac: float | None = None
    """Share of kernels shorter than 10 us."""
    launch_bound: bool | None = None
    """The GPU is idle at least 30 % of its span, mostly (over half of that) waiting for the host to
    launch work: the host, not the GPU, sets the pace."""
    launch_delay_mean_us: float | None = None
    pageable_copies: int | None = None
    """Host<->device copies from or to pageable host memory."""
    pageable_copy_bytes: int | None = None
    pageable_copy_pct: float | None = None
    """Those copies' time, % of summed GPU-event time (the share pinning can speed up; 34 copies of 272
    bytes in all read 0.005 %)."""
    sync_calls: int | None = None
    """Blocking host calls: device/stream/event synchronize, blocking cudaMemcpy/cudaMemset, each wait
    once (a call and the synchronization record CUPTI writes for it are one); summed over ranks.
    Stream waits (cudaStreamWaitEvent) do not block the host and are not counted."""
    sync_time_ms: float | None = None
    """Host time blocked in them: per rank the union of its blocking waits (at most its capture span),
    mean over ranks (``advisor.analysis.breakdown.sync_time``)."""
    step_skew_pct: float | None = None
    """Slowest rank's step time above the median rank's."""
    stragglers: list = field(default_factory=list)
    comm_late_pct: float | None = None
    """How long per step the earliest rank waits for the latest-starting one at the collectives matched
    across ranks, % of its step (the largest ``late_of_step_pct`` of
    ``advisor.analysis.comm.comm_stragglers``); None where it cannot be measured (one rank's trace, no
    collective matched across ranks)."""
    comm_stragglers: list = field(default_factory=list)
    """Ranks whose communication kernels typically start late (``comm_stragglers``' ``comm_straggler``)."""
    top_ops: list = field(default_factory=list)
    """The ops or kernels with the most time: [{name, time_ms, share_pct}]."""
    # --- the roofline (advisor.analysis.roofline.step_roofline_summary) ---
    roofline_bound: str | None = None
    """Where most of the step's time is bound: 'compute', 'memory', 'latency' (too short to reach
    either roof, or the GPU waiting for the host to launch work) or 'communication'."""
    roofline_compute_frac: float | None = None
    """Share of the step bound by the compute roof: of the profiled step (CPU; the rest is outside
    modelled ops: data loading, Python, unmodelled ops) or of the GPU span."""
    roofline_memory_frac: float | None = None
    roofline_latency_frac: float | None = None
    roofline_communication_frac: float | None = None
    roofline_headroom_ms: float | None = None
    """Time per step above the roofline, summed over ops/kernels with known work: what reaching every
    roof would save (an upper bound; overlapped kernels count in full)."""
    roofline_modelled_frac: float | None = None
    """Share of op time (CPU) or kernel time (GPU) whose FLOPs or bytes are known; the rest is judged
    by kernel class and length."""
    roofline_gemm_frac: float | None = None
    """Share of the step in GEMMs that are not latency-bound (same base as roofline_compute_frac)."""
    roofline_gemm_roof_frac: float | None = None
    """How close those GEMMs come to their roof: roof time / measured time, weighted by time (1: on the
    roof; None where no GEMM has shapes)."""
    roofline_gemm_fixed_frac: float | None = None
    """CPU: the share of those GEMMs' time that is a fixed cost per call (dispatch, output allocation,
    the thread fork; ``advisor.analysis.roofline.GEMM_CALL_FIXED_US``), at most their time above the
    roof; what a faster precision leaves as it is. None on a GPU and where no GEMM has shapes."""
    roofline_fusable_frac: float | None = None
    """Share of the step in memory-bound elementwise, reduction and normalisation ops: the time
    kernel fusion (torch.compile) cuts."""
    roofline_compile_fusable_frac: float | None = None
    """The part of roofline_fusable_frac outside the optimizer step: what torch.compile of the model
    reaches (the optimizer step stays eager)."""
    roofline_compile_fusable_roof_frac: float | None = None
    """Those ops' time at the memory roof, same base: their bytes at the bandwidth the run's own big
    streams reached (at most the roof; ``advisor.analysis.roofline.streaming_bytes_per_s``). Fused,
    they stream at that rate and the chain moves its bytes once."""
    roofline_score_chain_frac: float | None = None
    """CPU: the share of the step in unfused attention's score chain (the scale, the mask's copy, the
    softmax and their backwards on the s x s scores), part of roofline_fusable_frac but not of
    roofline_compile_fusable_frac: compiling does not speed it up on a CPU
    (``advisor.analysis.roofline.cpu_score_chain``). 0 without it; None on a GPU."""
    roofline_attention_frac: float | None = None
    """Share of the step in attention ops or kernels that are not latency-bound (same base as
    roofline_gemm_frac): with it and roofline_fusable_frac, a precision change is priced per op class."""
    roofline_roofs: str | None = None
    """The device and roofs the verdicts used (datasheet or measured ceilings)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepMetrics:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2), encoding="utf-8")

    @classmethod
    def load(cls, path: Path) -> StepMetrics:
        return cls.from_dict(json.loads(path.read_text(encoding="utf-8")))
