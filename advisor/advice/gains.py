"""Gain arithmetic for the rules, registered by name: how much a rule's action would help.

Each function returns a ``Gain`` on the rule's target figure (step time, peak memory or tokens/s), or
None when it cannot say (the input lacks the figures it needs). Local gains are weighted by the share
of the step they touch (Nsight Compute's rule style): a 2x faster optimizer step that takes 5 % of
the step is worth 2.5 %, not 50 %. Where the action changes the spec, the gain is the estimator's
what-if of the change and, where this machine has a calibration (``advisor.advice.calibrate``), also the
calibrated what-if, which is the one used to rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from advisor.errors import AdvisorError
from advisor.estimate.estimator import estimate
from advisor.spec.metrics import StepMetrics
from advisor.spec.specs import Setup


@dataclass(frozen=True)
class Gain:
    """A predicted change of one figure. ``gain_pct`` is the improvement in percent (less step time,
    less memory, more tokens/s are positive)."""

    target: str
    before: float
    after: float
    gain_pct: float
    basis: str
    """How the figure was computed, in words."""
    analytic_after: float | None = None
    """The estimator's what-if (None where the gain is not an estimator what-if)."""
    calibrated_after: float | None = None
    """The calibrated regression's what-if (None without a calibration for this device)."""
    upper_bound: bool = False
    """The gain assumes the cause is removed entirely (e.g. all exposed communication hidden)."""
    side: dict[str, Any] | None = None
    """What-if gains only: both figures before and after ({'step_time_ms': (before, after),
    'peak_memory_bytes': (before, after)}), whether the changed setup fits, and its memory %."""


@dataclass(frozen=True)
class GainInput:
    """What a gain function may read."""

    ctx: dict[str, Any]
    metrics: StepMetrics | None
    setup: Setup | None
    after: Setup | None
    """The setup with the rule's action applied (None if the action has no spec change or cannot apply)."""
    options_after: dict[str, Any] | None
    calibration: Any = None
    """An advisor.advice.calibrate.Calibration for this device, or None."""
    before: Any = None
    """The estimate of ``setup``, made once per advice (None without a setup)."""

    def estimate_before(self) -> Any:
        return self.before if self.before is not None else estimate(self.setup)

    def ctx_options(self) -> dict[str, Any]:
        """The run options of the input, as the context holds them."""
        return {k: self.ctx.get(k) for k in ("num_workers", "pin_memory", "compile") if self.ctx.get(k) is not None}


GainFn = Callable[[str, GainInput], "Gain | None"]
GAINS: dict[str, GainFn] = {}


def register(name: str) -> Callable[[GainFn], GainFn]:
    def wrap(fn: GainFn) -> GainFn:
        GAINS[name] = fn
        return fn

    return wrap


def improvement_pct(target: str, before: float, after: float) -> float:
    """Relative improvement: fewer ms or bytes, more tokens/s, in percent of ``before``."""
    if before <= 0:
        return 0.0
    if target == "tokens_per_s":
        return 100.0 * (after - before) / before
    return 100.0 * (before - after) / before


def _make(target: str, before: float, after: float, basis: str, **kw: Any) -> Gain:
    return Gain(target, before, after, improvement_pct(target, before, after), basis, **kw)


def _measured_step_share(m: StepMetrics) -> float:
    """Share of the measured step the estimator models (forward, backward, optimizer): data loading and
    unattributed host time do not change with a spec change."""
    if m.step_time_ms and m.forward_ms is not None and m.backward_ms is not None and m.optimizer_ms is not None:
        return min(1.0, (m.forward_ms + m.backward_ms + m.optimizer_ms) / m.step_time_ms)
    return 1.0


def _memory_after(before: float, e0: float, e1: float) -> float:
    """The measured peak moved by the predicted difference; by the predicted ratio where the difference
    would leave less than a tenth of it (an estimate far above the measured peak)."""
    after = before - (e0 - e1)
    return after if after >= 0.1 * before else before * e1 / e0


def _step_after(m: StepMetrics | None, step0: float, ratio: float, token_ratio: float) -> float:
    """The measured step with the modelled phases scaled by ``ratio``; loading scales with the tokens
    per step, other host time stays."""
    if m is None or not m.step_time_ms:
        return step0 * ratio
    share = _measured_step_share(m)
    data = (m.data_ms or 0.0) / step0 if m.data_ms else 0.0
    rest = max(0.0, 1 - share - data)
    return step0 * (share * ratio + data * token_ratio + rest)


@register("whatif")
def whatif(target: str, g: GainInput) -> Gain | None:
    """The estimator's (and the calibration's) prediction for the changed setup, applied to the measured
    figure: a time ratio on the share of the step the estimator models (loading scaled with the tokens
    per step), a memory difference on the measured peak, tokens/s from the new step time and tokens
    per step. The other figure's change is kept as a side effect (offload saves memory and costs time)."""
    if g.setup is None or g.after is None:
        return None
    e0, e1 = g.estimate_before(), estimate(g.after)
    m = g.metrics
    c0 = c1 = None
    if g.calibration is not None:
        try:
            c0, c1 = g.calibration.predict(g.setup, g.ctx_options()), g.calibration.predict(g.after, g.options_after)
        except AdvisorError:  # a calibration for another device: the estimator alone
            c0 = c1 = None
    tok0, tok1 = g.setup.tokens_per_step, g.after.tokens_per_step
    mem0 = float(m.peak_memory_bytes) if m and m.peak_memory_bytes else e0.memory.total_bytes
    mem_analytic = _memory_after(mem0, e0.memory.total_bytes, e1.memory.total_bytes)
    mem_cal = None if c0 is None else _memory_after(mem0, c0.peak_memory_bytes, c1.peak_memory_bytes)
    step0 = m.step_time_ms if m and m.step_time_ms else e0.step_time_ms
    ratio = e1.step_time_ms / e0.step_time_ms
    t_analytic = _step_after(m, step0, ratio, tok1 / tok0)
    t_cal = None if c0 is None else step0 * c1.step_time_ms / c0.step_time_ms
    t_best = t_cal if t_cal is not None else t_analytic
    mem_best = mem_cal if mem_cal is not None else mem_analytic
    side = {
        "step_time_ms": (step0, t_best),
        "peak_memory_bytes": (mem0, mem_best),
        "fits": bool(e1.fits),
        "memory_pct_after": 100.0 * e1.memory_frac,
    }
    if target == "peak_memory_bytes":
        before, analytic, calibrated = mem0, mem_analytic, mem_cal
        basis = (
            "measured peak minus the estimator's memory difference"
            if m and m.peak_memory_bytes
            else "the estimator's peak for the changed setup"
        )
    else:
        share = _measured_step_share(m) if m and m.step_time_ms else 1.0
        basis = (
            f"estimator's step-time ratio x{ratio:.2f} on the {100 * share:.0f} % of the step it models"
            if share < 1
            else f"estimator's step-time ratio x{ratio:.2f}"
        )
        if target == "tokens_per_s":
            before = m.tokens_per_s if m and m.tokens_per_s else e0.tokens_per_s
            # Tokens/s scale with tokens per step over step time.
            analytic = before * (tok1 / tok0) * step0 / t_analytic
            calibrated = None if t_cal is None else before * (tok1 / tok0) * step0 / t_cal
        else:
            before, analytic, calibrated = step0, t_analytic, t_cal
    if calibrated is not None:
        basis = f"calibrated regression on this machine's runs (the estimator alone: {analytic:,.4g})"
    after = calibrated if calibrated is not None else analytic
    return _make(target, before, after, basis, analytic_after=analytic, calibrated_after=calibrated, side=side)


@register("data_overlap")
def data_overlap(target: str, g: GainInput) -> Gain | None:
    """DataLoader workers load the next batches while the step computes: the data phase hides behind
    compute as long as loading one step's batches with w workers takes no longer than the compute.
    Without workers the measured data time is the whole load; with w0 workers it is the wait left
    after overlap, so one worker's load per step is (wait + compute) x w0."""
    m = g.metrics
    if m is None or not m.step_time_ms or m.data_ms is None or not g.options_after:
        return None
    workers = max(1, int(g.options_after.get("num_workers") or 0))
    before_workers = int(g.ctx.get("num_workers") or 0)
    compute = m.step_time_ms - m.data_ms
    load = m.data_ms if before_workers == 0 else (m.data_ms + compute) * before_workers
    after = compute + max(0.0, load / workers - compute)
    return _make(
        "step_time_ms",
        m.step_time_ms,
        after,
        f"data loading ({m.data_ms:.1f} ms of {m.step_time_ms:.1f} ms) overlapped by {workers} workers",
    )


LOADER_BOUND_DATA_PCT = 10.0
"""With DataLoader workers, a step that waits this share of itself for data is paced by the workers
(the input rules' threshold: ``input-more-workers`` fires above it)."""


def _share_gain(target: str, g: GainInput, share_pct: float | None, basis: str) -> Gain | None:
    """Step time less ``share_pct`` of it (an upper bound: the cause removed entirely). A step paced by
    its DataLoader workers (they load in the background and it still waits for them) does not get
    faster by computing faster: its wait grows by what the compute saves (``data_overlap``'s model,
    whose load per step over w workers is the whole step)."""
    m = g.metrics
    if m is None or not m.step_time_ms or share_pct is None:
        return None
    share = min(max(share_pct, 0.0), 100.0) / 100.0
    workers = int(g.ctx.get("num_workers") or 0)
    if workers > 0 and m.data_ms is not None and 100.0 * m.data_ms / m.step_time_ms > LOADER_BOUND_DATA_PCT:
        basis += f"; but the step waits {m.data_ms:.1f} ms for its {workers} DataLoader workers, which set its pace"
        share = 0.0
    return _make("step_time_ms", m.step_time_ms, m.step_time_ms * (1 - share), basis, upper_bound=True)


@register("exposed_communication")
def exposed_communication(target: str, g: GainInput) -> Gain | None:
    """Communication not overlapped by computation, hidden: the non-compute share of the GPU span that is
    communication (the rest is copies)."""
    c = g.ctx
    if c.get("gpu_non_compute_pct") is None:
        return None
    comm, copies = c.get("communication_pct") or 0.0, c.get("memcpy_pct") or 0.0
    frac = comm / (comm + copies) if comm + copies > 0 else 1.0
    share = c["gpu_non_compute_pct"] * frac
    return _share_gain(target, g, share, f"{share:.1f} % of the GPU span is communication with no compute beside it")


@register("act_offload_exposed")
def act_offload_exposed(target: str, g: GainInput) -> Gain | None:
    """The activation-offload time the run measured as not hidden behind compute, removed. On a CPU,
    where the run also timed steps with the offload off beside steps with it on, their difference (the
    whole cost: the hooks' own timer misses part of it); else the time inside the hooks."""
    share = g.ctx.get("act_offload_exposed_pct")
    if share is None:
        return None
    m = g.metrics
    if g.ctx.get("act_offload_measured_by") == "reference" and m is not None:
        ao = m.activation_offload
        basis = (
            f"{share:.1f} % of the step is the offload's cost: steps with it on took {ao['step_with_ms']:.1f} ms, "
            f"with it off {ao['step_without_ms']:.1f} ms (median of {ao['reference_pairs']} alternating pairs "
            "in the same run)"
        )
    else:
        basis = (
            f"{share:.1f} % of the step is spent in the offload hooks (copies and bookkeeping; on a CPU the "
            "extra allocations they cause add more, so this is a floor)"
        )
    return _share_gain(target, g, share, basis)


def _measured_share(target: str, g: GainInput, field: str, basis: str) -> Gain | None:
    """The step less the measured share ``field`` (% of the step or GPU span), removed entirely;
    ``basis`` formats ``{share}``."""
    share = g.ctx.get(field)
    if share is None:
        return None
    return _share_gain(target, g, share, basis.format(share=share))


@register("exposed_collectives")
def exposed_collectives(target: str, g: GainInput) -> Gain | None:
    """Collective time with no compute beside it on its rank (measured per rank, CPU or GPU), hidden."""
    return _measured_share(target, g, "comm_exposed_pct", "{share:.1f} % of the step waits for collectives")


@register("host_idle")
def host_idle(target: str, g: GainInput) -> Gain | None:
    """GPU idle time spent waiting for the host to launch work, removed (CUDA graphs, torch.compile)."""
    c = g.ctx
    if c.get("gpu_idle_pct") is None or c.get("idle_host_wait_pct") is None:
        return None
    share = c["gpu_idle_pct"] * c["idle_host_wait_pct"] / 100.0
    return _share_gain(target, g, share, f"{share:.1f} % of the GPU span idles waiting for kernel launches")


def _roofline_share(g: GainInput, frac_name: str) -> float | None:
    """A roofline share (of the GPU span, or of the CPU step) as % of the step."""
    frac = g.ctx.get(frac_name)
    return None if frac is None else 100.0 * frac


@register("roofline_latency")
def roofline_latency(target: str, g: GainInput) -> Gain | None:
    """Latency-bound time removed: ops or kernels too short to reach either roof (and, on a GPU, its
    idle wait for the host to launch them) replaced by fewer, larger ones. An upper bound."""
    share = _roofline_share(g, "roofline_latency_frac")
    if share is None:
        return None
    return _share_gain(target, g, share, f"{share:.1f} % of the step is latency-bound (short ops, launch waits)")


FUSION_SPEEDUP = 2.0
"""Memory-bound elementwise chains fused: the chain reads its inputs and writes its output once, not
once per op; chains in a transformer block (bias + activation, residual + norm, softmax + loss) are
two to five ops long, so 2x fewer bytes is the conservative end."""


@register("fusion")
def fusion(target: str, g: GainInput) -> Gain | None:
    """Memory-bound elementwise, reduction and normalisation ops fused by compiling the model: the ones
    outside the optimizer step (it stays eager) run at the memory roof and move FUSION_SPEEDUP times
    fewer bytes, so each costs its roof time / FUSION_SPEEDUP. Eager ops can sit far below the roof
    (bf16 elementwise ops on a CPU convert element by element: 4 to 10 GB/s against the fp32 ops' 20
    on the AMX Xeon), so the gain is larger than the byte cut alone. On a CPU, unfused attention's
    score chain is left out (``roofline_score_chain_frac``: Inductor's CPU softmax kernels run it at
    eager's pace, ``advisor.analysis.roofline.cpu_score_chain``). Without the roof split (an older run)
    the whole fusable time at FUSION_SPEEDUP."""
    model = _roofline_share(g, "roofline_compile_fusable_frac")
    roof = _roofline_share(g, "roofline_compile_fusable_roof_frac")
    if model is not None and roof is not None:
        cut = model - min(roof, model) / FUSION_SPEEDUP
        basis = (
            f"memory-bound elementwise/norm ops outside the optimizer ({model:.1f} % of the step) fused: "
            f"at the memory roof ({roof:.1f} %) with {FUSION_SPEEDUP:g}x fewer bytes"
        )
        chain = _roofline_share(g, "roofline_score_chain_frac")
        if chain:
            basis += f"; attention's score chain ({chain:.1f} %) left as it is (not faster compiled on a CPU)"
        return _share_gain(target, g, cut, basis)
    share = _roofline_share(g, "roofline_fusable_frac")
    if share is None:
        return None
    cut = share * (1 - 1 / FUSION_SPEEDUP)
    return _share_gain(
        target,
        g,
        cut,
        f"memory-bound elementwise/norm ops ({share:.1f} % of the step) {FUSION_SPEEDUP:g}x faster fused",
    )


@register("kernel_chains")
def kernel_chains(target: str, g: GainInput) -> Gain | None:
    """The repeated memory-bound kernel chains fused: each costs its longest kernel (the saving the
    trace analysis measured, advisor.analysis.sequences), the GPU span taken as the step."""
    basis = "repeated elementwise/norm chains fused: {share:.1f} % of the GPU span"
    return _measured_share(target, g, "fusion_chain_saving_pct", basis)


# GEMM speed-ups taken for the trace rules, deliberately below the datasheet ratios because real GEMMs
# reach a smaller share of the tensor-core peak than of the FP32 peak: FP32 SIMT -> 16-bit tensor
# cores at 4x (datasheets: 8x on V100, 16x on A100), TF32 -> bf16 at 1.6x (datasheet 2x).
FP32_TO_16BIT_GEMM_SPEEDUP = 4.0
TF32_TO_16BIT_GEMM_SPEEDUP = 1.6


def _gemm_gain(g: GainInput, field: str, speedup: float, what: str) -> Gain | None:
    share = g.ctx.get(field)
    busy = 100.0 - (g.ctx.get("gpu_idle_pct") or 0.0)
    if share is None:
        return None
    # The share is of summed GPU time; on the step it is that share of the busy part of the span.
    cut = share * busy / 100.0 * (1 - 1 / speedup)
    return _share_gain(
        "step_time_ms", g, cut, f"{what} GEMMs ({share:.1f} % of GPU time) {speedup:g}x faster in 16-bit"
    )


@register("fp32_gemm")
def fp32_gemm(target: str, g: GainInput) -> Gain | None:
    """FP32 (SIMT) GEMM time at a conservative tensor-core speed-up."""
    return _gemm_gain(g, "fp32_gemm_pct", FP32_TO_16BIT_GEMM_SPEEDUP, "FP32")


@register("tf32_gemm")
def tf32_gemm(target: str, g: GainInput) -> Gain | None:
    """TF32 GEMM time at bf16's (conservative) speed-up."""
    return _gemm_gain(g, "tf32_gemm_pct", TF32_TO_16BIT_GEMM_SPEEDUP, "TF32")


@register("sync_time")
def sync_time(target: str, g: GainInput) -> Gain | None:
    """Host time blocked in synchronising calls costs the step only where the GPU then idles for want
    of queued work: the blocked share, bounded by the GPU's host-wait idle share where it is known."""
    m = g.metrics
    if m is None or m.sync_time_ms is None or not m.steps_measured or not m.step_time_ms:
        return None
    share = 100.0 * m.sync_time_ms / m.steps_measured / m.step_time_ms
    idle, host = g.ctx.get("gpu_idle_pct"), g.ctx.get("idle_host_wait_pct")
    if idle is not None and host is not None:
        share = min(share, idle * host / 100.0)
    return _share_gain(target, g, share, f"{share:.1f} % of the step: the GPU idles while the host is blocked")


@register("straggler")
def straggler(target: str, g: GainInput) -> Gain | None:
    """Every rank waits for the slowest: removing the wait removes its share of the step. Measured at the
    collectives (``comm_late_pct``: the wait per step is the share) where the trace allows, else from
    step time (bringing the slowest step to the median's)."""
    late, skew = g.ctx.get("comm_late_pct"), g.ctx.get("step_skew_pct")
    if late is not None:
        return _share_gain(target, g, late, f"the earliest rank waits {late:.1f} % of each step for the latest one")
    if skew is None:
        return None
    share = 100.0 * skew / (100.0 + skew)
    return _share_gain(target, g, share, f"the slowest rank's step is {skew:.1f} % above the median rank's")


@register("clock_throttle")
def clock_throttle(target: str, g: GainInput) -> Gain | None:
    """Clocks held below their maximum: compute-bound time scales with the clock."""
    m = g.metrics
    nv = (m.nvml if m else None) or {}
    mean, peak = nv.get("sm_clock_mhz_mean"), nv.get("sm_clock_mhz_max")
    if not mean or not peak:
        return None
    share = 100.0 * (1 - mean / peak)
    return _share_gain(target, g, share, f"SM clock averaged {mean:.0f} MHz against {peak:.0f} MHz seen")


@register("pageable_copies")
def pageable_copies(target: str, g: GainInput) -> Gain | None:
    """Pinned memory roughly doubles host-to-device copy bandwidth and lets copies overlap compute: the
    pageable copies' share of GPU time is the bound (not every copy's: pinned ones gain nothing)."""
    share = g.ctx.get("pageable_copy_pct")
    if share is None:
        return None
    idle = (g.ctx.get("gpu_idle_pct") or 0.0) / 100.0
    busy_share = share * (1 - idle)
    return _share_gain(
        target, g, busy_share / 2, f"half of the {busy_share:.1f} % pageable-copy share (pinned ~2x faster)"
    )


@register("exposed_copies")
def exposed_copies(target: str, g: GainInput) -> Gain | None:
    """Copies and sets that run with no computation beside them, hidden under compute."""
    basis = "{share:.1f} % of the GPU span is copies with no compute beside them"
    return _measured_share(target, g, "gpu_memory_alone_pct", basis)


@register("fragmentation")
def fragmentation(target: str, g: GainInput) -> Gain | None:
    """Reserved memory down to the peak allocation plus the 5 % fragmentation the estimator allows
    (estimator.FRAGMENTATION_FRAC)."""
    from advisor.estimate.estimator import FRAGMENTATION_FRAC

    m = g.metrics
    if m is None or not m.reserved_memory_bytes or not m.peak_memory_bytes:
        return None
    after = min(m.reserved_memory_bytes, m.peak_memory_bytes * (1 + FRAGMENTATION_FRAC))
    return _make(
        "peak_memory_bytes", float(m.reserved_memory_bytes), after, "reservation down to the peak allocation + 5 %"
    )


# Fused AdamW's time over the for-loop and foreach implementations, measured side by side on this
# project's CPU machines (tiny and gpt2-124m, median of 7 steps each, /tmp-free script in
# bench/advice_scenarios.py's notes): 0.18-0.34 of for-loop, 0.28-0.30 of foreach. On GPUs the
# for-loop's per-tensor launches make the ratio smaller still; 0.3 is the conservative figure.
FUSED_OVER_UNFUSED_TIME = {"for-loop": 0.3, "foreach": 0.3, "fused": 1.0}


@register("optimizer_impl")
def optimizer_impl(target: str, g: GainInput) -> Gain | None:
    """The measured optimizer phase at the fused kernel's speed (the calibrated what-if where this
    machine has one, since it has seen every implementation run here)."""
    if g.calibration is not None and g.setup is not None and g.after is not None:
        return whatif(target, g)
    m, impl = g.metrics, g.ctx.get("optimizer_impl")
    if m is None or m.optimizer_ms is None or not m.step_time_ms or impl not in FUSED_OVER_UNFUSED_TIME:
        return None
    saved = m.optimizer_ms * (1 - FUSED_OVER_UNFUSED_TIME[impl])
    return _make(
        "step_time_ms",
        m.step_time_ms,
        m.step_time_ms - saved,
        f"optimizer phase {m.optimizer_ms:.1f} ms at {FUSED_OVER_UNFUSED_TIME[impl]:.1f}x its time when fused",
    )


# nanoGPT's vocabulary padding (50257 -> 50304) sped GPT-2 124M training up by about 25 % on A100s
# (A. Karpathy, 2023); the LM head is 31 % of that model's matmul FLOPs. The vocabulary gain scales that
# measured effect by this model's LM-head share of matmul FLOPs.
_VOCAB_GAIN_PER_HEAD_SHARE = 0.25 / 0.31
TENSOR_CORE_TILE = 64


def _before_step(g: GainInput) -> float | None:
    m, s = g.metrics, g.setup
    if m and m.step_time_ms:
        return m.step_time_ms
    return g.estimate_before().step_time_ms if s is not None else None


@register("vocab_alignment")
def vocab_alignment(target: str, g: GainInput) -> Gain | None:
    """The LM head's share of matmul FLOPs at the speed-up nanoGPT measured from padding the vocabulary."""
    s = g.setup
    before = _before_step(g)
    if s is None or before is None:
        return None
    md = s.model
    share = md.vocab * md.hidden / md.matmul_params_per_token()
    cut = min(0.25, _VOCAB_GAIN_PER_HEAD_SHARE * share)  # never more than nanoGPT's whole-model figure
    return _make(
        "step_time_ms",
        before,
        before * (1 - cut),
        f"the LM head is {100 * share:.0f} % of matmul FLOPs; nanoGPT's padding gain scaled to that share",
        upper_bound=True,
    )


@register("hidden_alignment")
def hidden_alignment(target: str, g: GainInput) -> Gain | None:
    """Tile quantisation: every GEMM with the hidden size as a dimension computes padded tiles of 64; the
    padded fraction of the GEMM time is the bound."""
    s = g.setup
    before = _before_step(g)
    if s is None or before is None:
        return None
    h = s.model.hidden
    padded = -(-h // TENSOR_CORE_TILE) * TENSOR_CORE_TILE
    waste = (padded - h) / padded
    gemm = (g.ctx.get("gemm_pct") or 100.0) / 100.0
    return _make(
        "step_time_ms",
        before,
        before * (1 - gemm * waste),
        f"hidden {h} computes {padded}-wide tiles: {100 * waste:.1f} % of GEMM work is padding",
        upper_bound=True,
    )


@register("skipped_steps")
def skipped_steps(target: str, g: GainInput) -> Gain | None:
    """Each skipped fp16 step is a whole step's work thrown away: the time per step that updated the
    weights, before and after."""
    m = g.metrics
    if m is None or not m.fp16_skipped_steps or not m.steps_measured or not m.step_time_ms:
        return None
    total = m.steps_measured
    useful = total - m.fp16_skipped_steps
    if useful <= 0:
        return None  # every measured step was skipped: training is not progressing at all
    before = m.step_time_ms * total / useful  # time per step that updated the weights
    return _make(
        "step_time_ms",
        before,
        m.step_time_ms,
        f"{m.fp16_skipped_steps} of {total} measured steps skipped: time per useful step back to the step time",
        upper_bound=True,
    )


# How much faster memory-bound elementwise, reduction and normalisation ops run in 16-bit than in fp32.
# GPUs: they are bound by HBM traffic and 16-bit halves the bytes, so 2x (the roofline's own model).
# CPUs: unchanged. A standalone bf16 elementwise multiply of 4M elements ran 3.2x slower than fp32 on
# an AMX Xeon (../shared/DESIGN.md), but under autocast only the matmuls' outputs are bf16 and much of
# the elementwise work stays fp32: for the 512-wide bench model (seq 256 x 4) on that Xeon, two fp32 /
# bf16 pairs profiled side by side moved its memory-bound elementwise/norm time 0.95x and 1.19x (a
# loaded machine: load average 8 on 2 cores), nowhere near 3.2x.
ELEMENTWISE_16BIT_SPEEDUP = {"gpu": 2.0, "cpu": 1.0}
# Attention in 16-bit: FlashAttention's two GEMMs run on the tensor cores, so on a GPU it moves with the
# matmul rate. On a CPU the fused attention mixes small GEMMs with an fp32 softmax and has not been
# measured here: it is left at its fp32 time rather than given a guess.
_SIXTEEN = ("bf16", "fp16")


def _class_speedups(
    hw: Any, old: str, new: str, gemm_roof_frac: float | None, gemm_fixed_frac: float | None = None
) -> dict[str, float] | None:
    """Time in ``old`` over time in ``new`` per op class (gemm, elementwise, attention) on ``hw``; None
    where this pricing does not cover the change (fp8, TF32).

    GEMMs: only their time on the roof scales with the peaks' ratio; the share above it (``1 -
    gemm_roof_frac``: packing and reorders, small tiles, a GPU's waves) stays, so small GEMMs gain less
    than the peaks say (1 where the run has no GEMM shapes). Except on a CPU leaving a precision slower
    than its fp32 (fp16 without AVX512-FP16, bf16 without AVX512-BF16 or AMX): PyTorch runs those
    GEMMs in a scalar loop, and their time above the roof is that loop running slower than the peak
    taken for it, not an overhead. There only the fixed per-call share (``gemm_fixed_frac``, from the
    run) stays and the rest scales. fp16 on an AVX512-BF16 EPYC ran its GEMMs at 70 % of the 1/50-of-
    fp32 roof taken for it; in bf16 the same GEMMs went from 736 to 7 ms a step (105x; the peaks'
    ratio is 175x), where keeping the time above the roof priced 3.3x and this prices 149x."""
    if {old, new} - {"fp32", *_SIXTEEN} or old == new:
        return None
    p_old, p_new = hw.peak_flops(old), hw.peak_flops(new)
    if not p_old or not p_new:
        return None
    ew = ELEMENTWISE_16BIT_SPEEDUP[hw.kind]
    ew = ew if new in _SIXTEEN and old == "fp32" else 1 / ew if old in _SIXTEEN and new == "fp32" else 1.0
    peak = p_new / p_old
    if gemm_fixed_frac is not None and hw.kind != "gpu" and p_old < hw.peak_flops("fp32"):
        fixed = min(max(gemm_fixed_frac, 0.0), 1.0)
        gemm = 1.0 / (fixed + (1.0 - fixed) / peak)
    else:
        roof = 1.0 if gemm_roof_frac is None else min(max(gemm_roof_frac, 0.0), 1.0)
        gemm = 1.0 / (roof / peak + (1.0 - roof))
    return {"gemm": gemm, "elementwise": ew, "attention": peak if hw.kind == "gpu" else 1.0}


def _pace(speedup: float) -> str:
    if math.isclose(speedup, 1.0):
        return "unchanged"
    factor = speedup if speedup > 1 else 1 / speedup
    x = f"{factor:,.0f}x" if factor >= 10 else f"{factor:.2g}x"  # 149x, not 1.5e+02x
    return f"{x} faster" if speedup > 1 else f"{x} slower"


@register("precision")
def precision(target: str, g: GainInput) -> Gain | None:
    """A precision change priced per op class from the run's roofline split of the step: its GEMMs'
    time on their roof at the ratio of the two precisions' peaks (the time above the roof unchanged),
    its memory-bound elementwise/reduction/norm ops at ELEMENTWISE_16BIT_SPEEDUP, its attention at the
    peaks' ratio on a GPU (unchanged on a CPU), the rest of the step (latency-bound ops, copies, the
    fp32 optimizer, Python, loading) unchanged. Without a
    run that has the split (a setup alone, an old run) it is the estimator's what-if (``whatif``), which
    prices the whole modelled step at the matmul rate: on the tiny CPU sample that put 99 % of the step
    at the matmul speed-up, and an AMX re-run measured bf16 104.6 % slower than fp32."""
    base = whatif(target, g)
    m = g.metrics
    if base is None or target != "step_time_ms" or m is None or not m.step_time_ms:
        return base
    shares = {"gemm": m.roofline_gemm_frac, "elementwise": m.roofline_fusable_frac}
    shares["attention"] = m.roofline_attention_frac or 0.0
    old, new = g.setup.train.precision, g.after.train.precision
    speed = _class_speedups(g.setup.hardware, old, new, m.roofline_gemm_roof_frac, m.roofline_gemm_fixed_frac)
    if speed is None or shares["gemm"] is None or shares["elementwise"] is None:
        return base
    total = sum(shares.values())
    if total > 1.0:  # ops on several threads can add up to more than the step: keep their proportions
        shares = {k: v / total for k, v in shares.items()}
    ratio = 1.0 - sum(shares.values()) + sum(shares[k] / speed[k] for k in shares)
    after = m.step_time_ms * ratio
    parts = ", ".join(f"{k} ({100 * shares[k]:.0f} % of the step) {_pace(speed[k])}" for k in shares if shares[k] > 0)
    side = dict(base.side or {}, step_time_ms=(m.step_time_ms, after))
    return _make(
        target,
        m.step_time_ms,
        after,
        f"priced per op class from this run's roofline: {parts}; the rest unchanged",
        analytic_after=base.analytic_after,
        side=side,
    )
