"""The estimator: per-GPU memory, step time, tokens/s and MFU of a Setup, by pure arithmetic.

An estimate is two parts composed: the memory of the pipeline ranks (``advisor.estimate.memory``:
model states [ZeRO], saved activations [Korthikanti], buffers, runtime allowance) and the time of one
optimizer step on the slowest GPU (``advisor.estimate.steptime``: FLOPs [Narayanan], the rates of
``advisor.estimate.efficiency``, communication, bubble, optimizer and offload), which reads the
parameters per GPU from the first. Each part's docstring cites its sources. MFU follows [PaLM]
appendix B: tokens/s x (6N + 12*L*H*Q*T) / peak.

The names other modules import from here (the breakdowns, the constants, the per-token and per-stage
helpers) live in those two parts and ``advisor.spec.stages``, and are re-exported.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from advisor.estimate.efficiency import ERROR_BAND, FITTED, MEMORY_BAND_SCOPE, EfficiencyParams, memory_band_applies
from advisor.estimate.memory import (
    BUCKETS_IN_FLIGHT,
    DDP_BUCKET_BYTES,
    DDP_FIRST_BUCKET_BYTES,
    EAGER_FRAGMENTATION_FRAC,
    FRAGMENTATION_FRAC,
    MemoryBreakdown,
    PipelineMemory,
    activation_bytes_per_token,
    bytes_per_param,
    offloaded_activation_bytes,
    pipeline_memory,
    stage_memory,
    zero_model_state_bytes,
)
from advisor.estimate.steptime import (
    COLLECTIVE_LATENCY_S,
    COMM_EFFICIENCY_FRAC,
    CPU_ATTENTION_EFFICIENCY_FRAC,
    CPU_UNFUSED_ATTENTION_EFFICIENCY_FRAC,
    ELEMENTWISE_TRAFFIC_PER_SAVED_BYTE,
    KERNELS_PER_BLOCK,
    MEM_BW_EFFICIENCY_FRAC,
    TIME_LABELS,
    StepTime,
    TimeBreakdown,
    narayanan_flops_per_iteration,
    stage_imbalance,
    step_time,
)
from advisor.spec.frozen import fast_init
from advisor.spec.specs import Setup
from advisor.spec.stages import megatron_stage_layers, pipeline_stage_layers, stage_layers

__all__ = [
    "BUCKETS_IN_FLIGHT",
    "COLLECTIVE_LATENCY_S",
    "COMM_EFFICIENCY_FRAC",
    "CPU_ATTENTION_EFFICIENCY_FRAC",
    "CPU_UNFUSED_ATTENTION_EFFICIENCY_FRAC",
    "DDP_BUCKET_BYTES",
    "DDP_FIRST_BUCKET_BYTES",
    "EAGER_FRAGMENTATION_FRAC",
    "ELEMENTWISE_TRAFFIC_PER_SAVED_BYTE",
    "FRAGMENTATION_FRAC",
    "KERNELS_PER_BLOCK",
    "MEM_BW_EFFICIENCY_FRAC",
    "TIGHT_FRAC",
    "TIME_LABELS",
    "Estimate",
    "MemoryBreakdown",
    "PipelineMemory",
    "StepTime",
    "TimeBreakdown",
    "activation_bytes_per_token",
    "bytes_per_param",
    "estimate",
    "megatron_stage_layers",
    "narayanan_flops_per_iteration",
    "offloaded_activation_bytes",
    "pipeline_memory",
    "pipeline_stage_layers",
    "stage_imbalance",
    "stage_layers",
    "stage_memory",
    "step_time",
    "zero_model_state_bytes",
]

# Above this share of the device's memory a setup that fits is 'tight' (issue 17): allocation spikes,
# fragmentation and the memory estimate's error can tip it over. That error is 1 % on the published
# eager FSDP peaks (``advisor.estimate.efficiency.ERROR_BAND``); no source checks the other kinds.
TIGHT_FRAC = 0.90


@fast_init
@dataclass(frozen=True, slots=True)
class Estimate:
    """What a Setup costs: memory of the fullest GPU, step time, throughput and MFU."""

    setup: Setup
    memory: MemoryBreakdown
    """The pipeline rank with the most memory (``memory_rank``): the first, the last, or with uneven
    stages a middle one that holds more blocks (weights, or activations in flight) than the first."""
    memory_first_stage: MemoryBreakdown
    memory_last_stage: MemoryBreakdown
    time: TimeBreakdown
    params_per_gpu: float
    """Parameters held by the fullest GPU before ZeRO sharding."""
    model_flops_per_step: float
    """Global, PaLM/Narayanan convention: 6N + 12*L*s*q per token, no recompute, full attention."""
    hardware_flops_per_step: float
    """Global FLOPs executed: recompute included, causal flash attention counted at half."""
    tokens_per_s: float
    mfu_frac: float
    hfu_frac: float
    host_bytes_per_node: float
    host_fits: bool
    memory_rank: int = 0
    """The pipeline rank whose memory ``memory`` is (0 without a pipeline)."""
    gemm_frac: float = 0.0
    """Share of the precision's peak this layout's GEMMs reach (``advisor.estimate.efficiency``)."""
    attention_frac: float = 0.0
    """Share of the 16-bit peak its attention reaches, forward and backward together."""

    @property
    def capacity_bytes(self) -> int:
        return self.setup.hardware.memory_bytes

    @property
    def tight(self) -> bool:
        """Fits, but above TIGHT_FRAC of the device, where what the estimate does not see can tip it over."""
        return self.fits and self.memory_frac > TIGHT_FRAC

    @property
    def fits(self) -> bool:
        """The fullest GPU's memory, allowance included, is within the device and host memory fits."""
        return self.memory.total_bytes <= self.capacity_bytes and self.host_fits

    @property
    def memory_frac(self) -> float:
        """Fullest GPU's memory over device capacity."""
        return self.memory.total_bytes / self.capacity_bytes

    @property
    def step_time_ms(self) -> float:
        return self.time.total_ms

    def as_dict(self) -> dict:
        """JSON-ready summary (the CLI's --json)."""
        from advisor.spec.specs import spec_to_dict

        s = self.setup
        return {
            "setup": spec_to_dict(s),
            "gpus": s.gpus,
            "grad_accum": s.grad_accum,
            "global_batch": s.global_batch,
            "n_params": s.model.n_params,
            "n_active_params": s.model.n_active_params,
            "params_per_gpu": self.params_per_gpu,
            "fits": self.fits,
            "memory_frac": self.memory_frac,
            "capacity_bytes": self.capacity_bytes,
            "memory": self.memory.as_dict(),
            "peak_moment": self.memory.moment,
            "memory_rank": self.memory_rank,
            "memory_first_stage": self.memory_first_stage.as_dict(),
            "memory_last_stage": self.memory_last_stage.as_dict(),
            "host_bytes_per_node": self.host_bytes_per_node,
            "host_fits": self.host_fits,
            "time": self.time.as_dict(),
            "step_time_ms": self.step_time_ms,
            "tokens_per_s": self.tokens_per_s,
            "model_flops_per_step": self.model_flops_per_step,
            "hardware_flops_per_step": self.hardware_flops_per_step,
            "mfu_frac": self.mfu_frac,
            "hfu_frac": self.hfu_frac,
            "tight": self.tight,
            "gemm_frac": self.gemm_frac,
            "attention_frac": self.attention_frac,
            # The memory band where published peaks measured this kind of setup, None elsewhere.
            "error_band": None
            if ERROR_BAND is None
            else asdict(ERROR_BAND)
            | {"memory_scope": MEMORY_BAND_SCOPE}
            | ({} if memory_band_applies(self.setup) else {"memory_pct": None}),
        }


def estimate(setup: Setup, params: EfficiencyParams | None = None) -> Estimate:
    """Memory per GPU, step time, tokens/s and MFU of ``setup``: the memory part, then the time part
    on the parameters it counts (see the module docstring). ``params`` replaces the fitted rate
    constants (``advisor.estimate.efficiency.FITTED``): the fit's search."""
    mem = pipeline_memory(setup)
    step = step_time(setup, mem, FITTED if params is None else params)
    offloads = setup.parallel.offload != "none" or setup.train.offload_activations
    return Estimate(
        setup=setup,
        memory=mem.fullest,
        memory_first_stage=mem.first,
        memory_last_stage=mem.last,
        time=step.time,
        params_per_gpu=mem.params_per_gpu,
        model_flops_per_step=step.model_flops_per_step,
        hardware_flops_per_step=step.hardware_flops_per_step,
        tokens_per_s=step.tokens_per_s,
        mfu_frac=step.mfu_frac,
        hfu_frac=step.hfu_frac,
        host_bytes_per_node=mem.host_bytes_per_node,
        host_fits=mem.host_bytes_per_node <= setup.hardware.host_memory_bytes or not offloads,
        memory_rank=mem.fullest_rank,
        gemm_frac=step.gemm_frac,
        attention_frac=step.attention_frac,
    )
