"""The estimator: per-GPU memory, FLOPs, step time, tokens/s and MFU of a Setup, by pure arithmetic.

Sources, cited where each number is used:
- [ZeRO] Rajbhandari et al. 2019, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
  Models": 16 bytes per parameter for mixed-precision Adam (2 weight + 2 grad + 12 optimizer) and the
  sharded forms of stages 1-3.
- [Korthikanti] Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models": activation bytes per layer with TP, SP, selective and full recompute, and pipeline
  in-flight micro-batches. Generalised here to GQA, SwiGLU, MoE and runs without dropout by counting
  the saved tensors one by one; with their assumptions it reproduces their formulas exactly.
- [Narayanan] Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM": FLOPs per iteration, pipeline bubble (p-1)/m and (p-1)/(v*m).
- [PaLM] Chowdhery et al. 2022, appendix B: MFU = tokens/s x (6N + 12*L*H*Q*T) / peak.
- [NCCL] ring all-reduce moves 2(n-1)/n of the buffer per GPU, all-gather and reduce-scatter (n-1)/n.

Rates come from ``advisor.estimate.efficiency``: GEMMs by the shape each rank runs (tile and wave quantization,
small k) and precision, flash attention by implementation and sequence, a fixed cost per kernel, and
the compute that overlapped communication slows; its fitted constants are fitted once on published
runs (bench/published_runs.py --fit) and reported leave-one-source-out.

Overlap assumptions (stated, not measured): tensor-parallel collectives, expert all-to-alls and pipeline
point-to-point transfers are exposed; the data-parallel gradient reduction overlaps the backward
pass of the last micro-batch (bucketed, as DDP and Megatron's overlap_grad_reduce); ZeRO-3 weight
gathers and parameter streaming from the host overlap compute (prefetch); the ring exchange of
context parallelism overlaps the attention it feeds; the ZeRO-1/2 weight all-gather after the
optimizer step is exposed. What hides still costs: ``overlap_slowdown_frac`` of it is added back.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import asdict, dataclass

from advisor.estimate.efficiency import (
    ERROR_BAND,
    FITTED,
    EfficiencyParams,
    attention_frac,
    attention_impl,
    device_fit,
    gemms_time_s,
)
from advisor.spec.specs import ModelSpec, Setup
from advisor.spec.stages import head_in_blocks, stage_layers
from advisor.spec.stages import megatron_stage_layers as megatron_stage_layers  # re-exported
from advisor.spec.stages import pipeline_stage_layers as pipeline_stage_layers  # re-exported

# Share of link bandwidth collectives reach (nccl-tests bus bandwidth on NVLink and InfiniBand is
# typically ~80 % of the per-direction link rate).
COMM_EFFICIENCY_FRAC = 0.80
# Share of memory bandwidth that elementwise kernels and the optimizer reach (a device-to-device copy
# measured 4.3 of 4.8 TB/s on our H200, DESIGN.md).
MEM_BW_EFFICIENCY_FRAC = 0.90
# Caching-allocator fragmentation: reserved minus allocated memory, as a share of allocated
# (PyTorch "CUDA semantics: memory management"; 3-8 % on steady training steps).
FRAGMENTATION_FRAC = 0.05
# PyTorch DDP's gradient buckets (torch/nn/parallel/distributed.py): bucket_cap_mb defaults to 25 MiB,
# and the bucket rebuilt after the first iteration for the gradients that arrive first is capped at
# dist._DEFAULT_FIRST_BUCKET_BYTES, 1 MiB. A bucket closes once it reaches its cap, so a tensor larger
# than the cap is a bucket of its own and ceil-counting by the cap bounds the number of buckets from above.
DDP_BUCKET_BYTES = 25 * 2**20
DDP_FIRST_BUCKET_BYTES = 2**20
# Gradient buffers a Megatron-LM / DeepSpeed-style step keeps in flight beside its gradients, as a
# number of DDP_BUCKET_BYTES buckets (never more than the gradients themselves).
BUCKETS_IN_FLIGHT = 2
# Fixed cost of one NCCL collective (launch, ring set-up, protocol hand-offs): small-message
# all-reduce / all-gather times in nccl-tests on 8-GPU NVLink nodes are 10-30 us. Paid per bucket
# (DDP, ZeRO-1/2) or per layer and pass (ZeRO-3 / FSDP units).
COLLECTIVE_LATENCY_S = 20e-6
# Kernels one transformer block launches per micro-batch in a fused (Megatron-LM) step: forward norm,
# QKV, RoPE, attention, projection, residual, norm, MLP in, activation, MLP out, residual (about 12),
# backward twice as many; eager PyTorch launches ``eager_kernel_factor`` times as many.
KERNELS_PER_BLOCK = 36
# Above this share of the device's memory a setup that fits is 'tight': the memory estimate's own error
# (``advisor.estimate.efficiency.ERROR_BAND``) is of that size.
TIGHT_FRAC = 0.90
# A CPU's attention at half its matmul rate (its calibration corrects both).
CPU_ATTENTION_EFFICIENCY_FRAC = 0.50
# Elementwise traffic per saved activation byte: written and read in forward, read and its gradient
# written in backward.
ELEMENTWISE_TRAFFIC_PER_SAVED_BYTE = 4


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """Memory of one GPU (one pipeline stage), in bytes."""

    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    """Optimizer states plus fp32 master weights where precision is mixed."""
    activations_bytes: float
    """Saved for backward, for all micro-batches in flight on this stage."""
    buffers_bytes: float
    """Temporary and communication buffers: DDP buckets, ZeRO-3 gathers, logits and their gradient."""
    overhead_bytes: float
    """Allowance outside the model: CUDA context and library workspaces, allocator fragmentation."""
    host_bytes: float
    """Offloaded state this GPU keeps in host memory."""
    moment: str = "backward"
    """When the peak happens: 'backward' (activations alive) or 'optimizer step' (all gradients and
    the optimizer's scratch alive, activations freed)."""

    @property
    def total_bytes(self) -> float:
        return (
            self.weights_bytes
            + self.grads_bytes
            + self.optimizer_bytes
            + self.activations_bytes
            + self.buffers_bytes
            + self.overhead_bytes
        )

    def as_dict(self) -> dict[str, float]:
        return {
            "weights_bytes": self.weights_bytes,
            "grads_bytes": self.grads_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "activations_bytes": self.activations_bytes,
            "buffers_bytes": self.buffers_bytes,
            "overhead_bytes": self.overhead_bytes,
            "total_bytes": self.total_bytes,
            "host_bytes": self.host_bytes,
        }


@dataclass(frozen=True, slots=True)
class TimeBreakdown:
    """One optimizer step on the slowest GPU, in milliseconds; components add up to total_ms."""

    compute_ms: float
    """GEMMs and attention at the device's achievable matmul rate."""
    recompute_ms: float
    """Forward work repeated by activation checkpointing."""
    memory_bound_ms: float
    """Norms, activations, residual adds, RoPE: bound by memory bandwidth."""
    tp_comm_ms: float
    cp_comm_ms: float
    """Exposed part of the context-parallel ring exchange."""
    ep_comm_ms: float
    pp_comm_ms: float
    dp_comm_ms: float
    """Exposed part of gradient reduction and weight gathers."""
    bubble_ms: float
    optimizer_ms: float
    offload_ms: float
    """Exposed host transfers (offloaded optimizer state, streamed weights, offloaded activations) and
    the host optimizer step."""
    kernel_overhead_ms: float = 0.0
    """Fixed cost of each kernel launched (launch gaps, wave tails): what small models pay most."""

    @property
    def total_ms(self) -> float:
        return (
            self.kernel_overhead_ms
            + self.compute_ms
            + self.recompute_ms
            + self.memory_bound_ms
            + self.tp_comm_ms
            + self.cp_comm_ms
            + self.ep_comm_ms
            + self.pp_comm_ms
            + self.dp_comm_ms
            + self.bubble_ms
            + self.optimizer_ms
            + self.offload_ms
        )

    def as_dict(self) -> dict[str, float]:
        d = {k: getattr(self, k) for k in self.__slots__}
        d["total_ms"] = self.total_ms
        return d


# How each time field of an Estimate reads in a table.
TIME_LABELS = {
    "compute_ms": "compute (GEMM + attention)",
    "recompute_ms": "recompute",
    "memory_bound_ms": "memory-bound ops",
    "tp_comm_ms": "TP communication",
    "cp_comm_ms": "CP ring (exposed)",
    "ep_comm_ms": "EP all-to-all",
    "pp_comm_ms": "PP send/recv",
    "dp_comm_ms": "DP/ZeRO comm (exposed)",
    "bubble_ms": "pipeline bubble",
    "optimizer_ms": "optimizer step",
    "offload_ms": "host offload (exposed)",
}


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
        """Fits, but above TIGHT_FRAC of the device: within the memory estimate's error of not fitting."""
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
            "error_band": None if ERROR_BAND is None else asdict(ERROR_BAND),
        }


# --- model states --------------------------------------------------------------------------------


def bytes_per_param(
    precision: str, optimizer: str, hidden: int, fp32_grads: bool = False, autocast: bool = False
) -> tuple[float, float, float]:
    """(weight, gradient, optimizer) bytes per parameter before sharding.

    Mixed precision [ZeRO]: 2-byte weights and gradients (4 with ``fp32_grads``, Megatron-LM's bf16
    default: 6 + 12/d bytes under its distributed optimizer), fp32 master copy (4) plus fp32 states
    (AdamW 8, SGD momentum 4, Adafactor's factored second moment ~ 4*(rows+cols) per matrix, about
    8/hidden per parameter). fp32: 4-byte weights and gradients, no master copy. fp8 keeps bf16
    weights and adds a 1-byte fp8 copy of each weight (TransformerEngine's cached cast). ``autocast``
    (torch.autocast over fp32 parameters, PyTorch AMP): 4-byte weights and gradients, no master copy.
    """
    states = {"adamw": 8.0, "sgd": 4.0, "adafactor": 8.0 / hidden}[optimizer]
    if precision == "fp32" or autocast:
        return 4.0, 4.0, states
    weight = 3.0 if precision == "fp8" else 2.0
    return weight, 4.0 if fp32_grads else 2.0, 4.0 + states


def zero_model_state_bytes(
    n_params: float,
    precision: str,
    optimizer: str,
    zero: int,
    shard: int,
    hidden: int = 4096,
    fp32_grads: bool = False,
    autocast: bool = False,
) -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes per GPU for ``n_params`` under ZeRO ``zero`` over ``shard``
    data-parallel ranks [ZeRO]: stage 1 shards the optimizer, 2 also gradients, 3 also weights."""
    w, g, o = bytes_per_param(precision, optimizer, hidden, fp32_grads, autocast)
    return (
        n_params * w / (shard if zero >= 3 else 1),
        n_params * g / (shard if zero >= 2 else 1),
        n_params * o / (shard if zero >= 1 else 1),
    )


def _rank_layers(setup: Setup, first: bool, last: bool, rank: int | None = None) -> float:
    """Blocks held by pipeline rank ``rank`` (default: the first, or the last with ``last`` and not
    ``first``); a rank holds every pp-th stage under interleaving (``stage_layers``)."""
    p = setup.parallel
    if p.pp == 1:
        return float(setup.model.n_layers)
    if rank is None:
        rank = 0 if first else p.pp - 1
    return _per_rank(stage_layers(setup), p.pp)[rank]


@functools.lru_cache(maxsize=4096)
def _per_rank(stages: tuple[int, ...], pp: int) -> tuple[float, ...]:
    """Blocks per pipeline rank: rank r holds stages r, r + pp, ..."""
    return tuple(float(sum(stages[r::pp])) for r in range(pp))


def _rank_moe_layers(setup: Setup, first: bool, last: bool, rank: int | None = None) -> float:
    """MoE blocks held by pipeline rank ``rank`` (as ``_rank_layers``). Block i is MoE when (i + 1) is a
    multiple of ``moe_layer_step`` (``advisor.run.model``), so a stage's count depends on where its blocks
    start: Llama-4 Maverick (MoE every other block) over 16 stages of 3 blocks puts 1, 2, 1, 2, ... MoE
    blocks on consecutive ranks, not 1.5 each."""
    m, p = setup.model, setup.parallel
    if not m.is_moe:
        return 0.0
    if p.pp == 1:
        return float(m.n_moe_layers)
    if rank is None:
        rank = 0 if first else p.pp - 1
    return _moe_per_rank(stage_layers(setup), p.pp, m.moe_layer_step)[rank]


@functools.lru_cache(maxsize=4096)
def _moe_per_rank(stages: tuple[int, ...], pp: int, step: int) -> tuple[float, ...]:
    """MoE blocks per pipeline rank: a stage of blocks [a, b) holds b // step - a // step of them (the
    multiples of ``step`` in (a, b])."""
    ends = tuple(itertools.accumulate(stages))
    per_stage = [end // step - (end - n) // step for n, end in zip(stages, ends, strict=True)]
    return tuple(float(sum(per_stage[r::pp])) for r in range(pp))


def _last_chunk_layers(setup: Setup) -> float:
    """Blocks of the last pipeline stage (the last rank's last chunk under interleaving)."""
    return float(stage_layers(setup)[-1])


def stage_imbalance(setup: Setup) -> float:
    """How much longer the slowest pipeline rank's share of a step takes than an even share (1.0 with
    one stage): 1F1B runs at the pace of its slowest stage. A rank's cost is its blocks plus, on the
    last rank, the output head, weighed as ``pipeline_stage_layers`` does; Megatron-LM's even split
    leaves the head on top of the last stage's blocks (Llama-3.1-8B at sequence 8192 over 4 stages:
    8 + 2.09 blocks against 8.52 on average, 1.18)."""
    return _slowest_rank(setup)[0]


def _slowest_rank(setup: Setup) -> tuple[float, float, bool]:
    """(``stage_imbalance``, the slowest rank's blocks over the even share n_layers / pp, whether it is
    the last rank): the first scales the step's FLOPs, the second what is per block (recompute,
    elementwise traffic, TP, CP and EP collectives), the third whether the loss's traffic is on it."""
    p = setup.parallel
    if p.pp == 1:
        return 1.0, 1.0, True
    n = setup.model.n_layers
    head = head_in_blocks(setup)
    layers = _per_rank(stage_layers(setup), p.pp)
    # The slowest rank: the last with the head, or the one with the most blocks (the first such).
    most = max(layers[:-1])
    last = layers[-1] + head >= most
    cost, blocks = (layers[-1] + head, layers[-1]) if last else (most, most)
    return cost / ((n + head) / p.pp), blocks / (n / p.pp), last


def _stage_params(
    setup: Setup, first: bool, last: bool, rank: int | None = None
) -> tuple[float, float, float, float, float]:
    """(dense, expert, block, matmul, root) parameters one GPU of a stage holds after TP/PP/EP.

    Megatron split: attention heads and MLP columns by tp (KV heads replicated when tp > n_kv_heads),
    vocabulary-parallel embedding and head, norms, routers and row-parallel biases replicated, routed
    experts split by ep and each by tp. The first stage holds the embedding, the last the final norm
    and the head (a copy of the embedding when tied and pp > 1). ``block`` is one block's weights
    gathered in full over DP (ZeRO-3 buffers); ``matmul`` the weights that enter a matrix multiply
    (what autocast keeps 16-bit copies of); ``root`` the stage's weights outside the blocks (embedding,
    final norm, head: the root FSDP unit of ``advisor.run.parallel.apply_fsdp``), included in ``dense``.
    """
    m, p = setup.model, setup.parallel
    t = p.tp
    kv_heads_rank = max(m.n_kv_heads // t, 1)
    h, q = m.hidden, m.q_dim
    kv_rank = kv_heads_rank * m.head_dim
    attn_mm = h * (q // t + 2 * kv_rank) + (q // t) * h
    attn = attn_mm
    if m.qkv_bias:
        attn += q // t + 2 * kv_rank
    if m.attn_out_bias:
        attn += h
    if m.qk_norm:
        attn += 2 * m.head_dim
    mats = 3 if m.mlp == "swiglu" else 2

    def mlp(ffn: int) -> float:
        return (m.mlp_params(ffn) - (h if m.mlp_bias else 0)) / t + (h if m.mlp_bias else 0)

    norms = 2 * m.norm_params
    moe_layers = _rank_moe_layers(setup, first, last, rank)
    dense_layers = _rank_layers(setup, first, last, rank) - moe_layers
    dense_layer = attn + mlp(m.ffn_hidden) + norms
    dense = dense_layers * dense_layer
    matmul = dense_layers * (attn_mm + mats * h * m.ffn_hidden / t)
    expert = 0.0
    block = dense_layer
    if m.is_moe:
        local_experts = m.n_experts / p.ep
        moe_shared = attn + m.router_params + m.n_shared_experts * mlp(m.expert_ffn_hidden) + norms
        dense += moe_layers * moe_shared
        expert = moe_layers * local_experts * mlp(m.expert_ffn_hidden)
        expert_mm = (local_experts + m.n_shared_experts) * mats * h * m.expert_ffn_hidden / t
        matmul += moe_layers * (attn_mm + m.router_params + expert_mm)
        # The largest block this rank holds (ZeRO-3 gathers one at a time): a rank of dense blocks only
        # (Maverick's stages of one block) never gathers an MoE block.
        moe_block = moe_shared + local_experts * mlp(m.expert_ffn_hidden)
        block = max(dense_layer if dense_layers else 0.0, moe_block if moe_layers else 0.0)
    root = 0.0
    if first:
        root += m.vocab * h / t + (m.max_positions * h if m.position == "learned" else 0)
    if last:
        root += m.norm_params
        matmul += m.vocab * h / t
        if not m.tied_embeddings or (p.pp > 1 and not first):
            root += m.vocab * h / t
    return dense + root, expert, block, matmul, root


def _eager_fsdp2(setup: Setup) -> bool:
    """Whether the step is the eager PyTorch one on FSDP2 (``advisor.run.parallel.apply_fsdp``): framework
    'pytorch', ZeRO >= 1, several GPUs. Under bf16/fp16 its MixedPrecisionPolicy gathers 16-bit weights,
    so forward and backward run on them: no autocast weight copies, a 16-bit residual stream."""
    return setup.train.framework == "pytorch" and setup.parallel.zero >= 1 and setup.gpus > 1


# --- activations ---------------------------------------------------------------------------------


def activation_bytes_per_token(setup: Setup, moe: bool, recompute: str | None = None) -> tuple[float, float]:
    """Saved-activation bytes per token for one block on one GPU: (total, s^2-free part).

    Counted tensor by tensor [Korthikanti sec. 4]: with e the activation element size, each norm saves
    its input (e*h), each linear its input, attention saves Q, K, V and the output-projection input,
    a GELU MLP saves its two f-wide tensors, SwiGLU four (gate, up, silu(gate), product), dropout a
    1-byte mask per element. Without flash attention the s x s scores are kept (softmax output, plus
    dropout mask and output when dropout is on): e*a*s, or (2e+1)*a*s, bytes per token. Flash
    attention keeps only its fp32 log-sum-exp per head. With tp but no sp the norm inputs, linear
    inputs and dropout masks are replicated; with sp everything is split over tp. Context parallelism
    is applied by the caller (tokens per GPU). Full recompute keeps only the block input.

    The eager PyTorch step (framework 'pytorch') saves more, measured tensor by tensor with
    saved_tensors_hooks (bench/results/dryrun_accuracy_cpu.md): under autocast over fp32 parameters the
    residual stream and the norm inputs stay fp32 (4h) and every linear saves its own 16-bit copy of its
    input (q, k, v, and gate/up: 5 per Llama block instead of 2); SDPA saves its output besides the
    o_proj input (+e*q); on a CPU nn.RMSNorm is a composite that keeps the fp32 upcast of its input and
    its fp32 normalised input (8h per norm). On FSDP2 with 16-bit gathered weights (``_eager_fsdp2``)
    the residual stream and the norm outputs are 16-bit, so q, k, v share one input copy and gate/up
    another, as in Megatron (measured the same way on the tiny block).
    """
    m, tr, p = setup.model, setup.train, setup.parallel
    t = p.tp
    e = 4.0 if tr.precision == "fp32" else 2.0
    h, q, kv, f = m.hidden, m.q_dim, m.kv_dim, m.ffn_hidden
    drop = 1.0 if tr.dropout else 0.0
    mode = tr.recompute if recompute is None else recompute
    eager = tr.framework == "pytorch"
    casts = tr.autocast and not _eager_fsdp2(setup)  # autocast over fp32 parameters
    resid = 4.0 if casts else e  # bytes of one residual-stream element

    if mode == "full":
        x = resid * h
        return (x / t if p.sequence_parallel else x), 0.0
    if mode == "selective-op":
        # torchtitan's op-level policy (torchtitan/distributed/activation_checkpoint.py, _custom_policy:
        # "Saves output of all compute ops, except every second mm", over the save list of
        # torchtitan/models/llama3/infra/parallelize.py, _op_sac_save_list: mm, the SDPA kernels,
        # reduce-scatter, max): every other matmul output and the attention output are saved, the
        # rest is recomputed from them and the block input. Of a block's matmul outputs (QKV q+2kv
        # wide, projection h, MLP in f or 2f, MLP out h) half the width is kept on average.
        # A dense block's matmuls run in a fixed order, so the saved ones are known exactly: q, k, v,
        # o, then gate, up, down (SwiGLU) or up, down (GELU); the 1st, 3rd, 5th... are kept. An MoE
        # block's count depends on the routing: half of each width on average.
        if moe:
            mats = 2 if m.mlp == "swiglu" else 1
            fe = m.expert_ffn_hidden * (m.top_k + m.n_shared_experts)
            split_mm, repl_mm = 0.5 * e * (q + 2 * kv + mats * fe), 0.5 * e * 2 * h
        else:
            order = [("s", q), ("s", kv), ("s", kv), ("r", h)]
            order += [("s", f), ("s", f), ("r", h)] if m.mlp == "swiglu" else [("s", f), ("r", h)]
            kept = order[::2]
            split_mm = e * sum(w for kind, w in kept if kind == "s")
            repl_mm = e * sum(w for kind, w in kept if kind == "r")  # o and down outputs: h wide, whole
        split = e * q + 4.0 * m.n_heads + split_mm  # attention output, fp32 log-sum-exp, kept matmuls
        replicated = resid * h + repl_mm  # the block input, kept by the checkpoint
        base = (replicated + split) / t if p.sequence_parallel else replicated + split / t
        return base, base

    # Linear inputs saved for the weight gradient: TransformerEngine's fp8 linears keep their fp8 cast
    # of it (1 byte), Megatron-LM / NeMo recipes' fp8 [TE: transformer_engine.pytorch Linear and
    # LayerNormLinear save the quantized input for wgrad].
    li = 1.0 if tr.precision == "fp8" and not eager else e
    # Norm inputs, norm outputs feeding linears, output dropout masks.
    mlp_inputs = 2 if m.mlp == "swiglu" else 1
    linear_inputs = (3 + mlp_inputs) * e * h if casts else 2 * li * h
    replicated = 2 * resid * h + linear_inputs + 2 * drop * h
    if eager and m.norm == "rmsnorm" and setup.hardware.kind == "cpu":
        replicated += 2 * (4.0 - resid) * h + 2 * 4.0 * h
    split = e * (q + kv) + e * kv + li * q  # Q and K for QK^T, V, output-projection input
    if eager:
        split += e * q  # SDPA's own saved output
    # The MLP's f-wide tensors: GELU's input and the second linear's input; eager SwiGLU four (gate, up,
    # silu(gate), their product), Megatron's fused SwiGLU two (its 2f input, recomputed in backward)
    # and the second linear's input [Megatron-Core bias_swiglu_impl].
    per_f = (4 * e if eager else 2 * e + li) if m.mlp == "swiglu" else e + li
    if moe:
        fe = m.expert_ffn_hidden
        replicated += 8.0 * m.n_experts + m.top_k * e * h  # router logits and probs (fp32), dispatched copies
        split += per_f * fe * (m.top_k + m.n_shared_experts)
    else:
        split += per_f * f
    scores = 0.0
    if tr.flash_attention:
        split += 4.0 * m.n_heads  # log-sum-exp, fp32 per head
    elif mode != "selective":
        scores = m.n_heads * (setup.train.seq_len / p.cp) * (e + drop * (1 + e))
    base = (replicated + split) / t if p.sequence_parallel else replicated + split / t
    return base + scores / t, base


def _kept_bytes_per_token(setup: Setup, moe: bool) -> float:
    """Saved bytes per token of a block that keeps its activations (and so may offload them): the
    recompute mode's, or every tensor where only ``recompute_layers`` blocks of a stage recompute."""
    tr = setup.train
    mode = "none" if tr.recompute == "full" and tr.recompute_layers else None
    return activation_bytes_per_token(setup, moe, mode)[0]


def offloaded_activation_bytes(setup: Setup, first: bool = True, last: bool = True) -> float:
    """Bytes one micro-batch's offloaded blocks save for backward on one GPU: what activation offload
    moves to the host and back (``offload_activations`` blocks of the stage, each keeping every tensor
    its recompute mode keeps). Counted the same on a CPU device, where the copies save nothing."""
    tr, p = setup.train, setup.parallel
    if not tr.offload_activations:
        return 0.0
    tokens_mb = tr.micro_batch * tr.seq_len / p.cp
    moe_layers = _rank_moe_layers(setup, first, last, None)
    dense_layers = _rank_layers(setup, first, last, None) - moe_layers
    layers = dense_layers + moe_layers
    if not layers:
        return 0.0
    per_block = dense_layers * _kept_bytes_per_token(setup, moe=False)
    if moe_layers:
        per_block += moe_layers * _kept_bytes_per_token(setup, moe=True)
    per_block /= layers
    return min(layers, tr.offload_activations * p.vpp) * per_block * tokens_mb


def _gpipe(setup: Setup) -> bool:
    """Whether the step runs torch's GPipe schedule: the eager step does where there are fewer
    micro-batches than stages (torch's 1F1B needs as many; ``advisor.run.parallel``). It runs every forward
    before any backward, so every rank, the last included, holds all m micro-batches."""
    p = setup.parallel
    return setup.train.framework == "pytorch" and p.pp > 1 and p.vpp == 1 and setup.grad_accum < p.pp


def _activation_memory(
    setup: Setup, tokens_mb: float, in_flight: float, first: bool, last: bool, rank: int | None = None
) -> tuple[float, float]:
    """(saved, working) activation bytes of one stage: what is saved for backward over all micro-batches
    in flight, and, under full recompute, the one block being recomputed (alive after the loss
    backward has freed its buffers, so the two never add up). The last stage's head and loss hold one
    micro-batch (1F1B runs its backward right after its forward), or every one in flight under GPipe."""
    m, tr, p = setup.model, setup.train, setup.parallel
    moe_layers = _rank_moe_layers(setup, first, last, rank)
    dense_layers = _rank_layers(setup, first, last, rank) - moe_layers
    dense_tok, _ = activation_bytes_per_token(setup, moe=False)
    moe_tok, _ = activation_bytes_per_token(setup, moe=True) if m.is_moe else (0.0, 0.0)
    kept_dense, kept_moe = dense_tok, moe_tok
    if tr.recompute == "full" and tr.recompute_layers:  # the other blocks keep every tensor
        kept_dense = _kept_bytes_per_token(setup, moe=False)
        kept_moe = _kept_bytes_per_token(setup, moe=True) if m.is_moe else 0.0
    layers = dense_layers + moe_layers
    per_block = (dense_layers * kept_dense + moe_layers * kept_moe) / layers if layers else 0.0
    per_block_min = (dense_layers * dense_tok + moe_layers * moe_tok) / layers if layers else 0.0
    acts = (dense_layers * dense_tok + moe_layers * moe_tok) * tokens_mb * in_flight
    chunks = setup.parallel.vpp
    if tr.recompute == "full" and tr.recompute_layers:
        keep = max(0.0, layers - tr.recompute_layers * chunks)
        acts = (keep * per_block + (layers - keep) * per_block_min) * tokens_mb * in_flight
    offloaded = 0.0
    if tr.offload_activations and setup.hardware.kind != "cpu":  # on a CPU the host is the device memory
        # The offloaded blocks' activations live on the host; the GPU keeps one block's worth being
        # copied out and one being brought back (double buffering), for one micro-batch.
        n = min(layers, tr.offload_activations * chunks)
        offloaded = n * per_block * tokens_mb * in_flight
        acts -= offloaded
        if tr.framework != "pytorch":
            acts += min(n, 2.0) * per_block * tokens_mb
            offloaded -= min(n, 2.0) * per_block * tokens_mb
    working = 0.0
    if tr.recompute == "full":
        # The block being recomputed holds its full activations during its backward [Korthikanti 4.1].
        work_dense, _ = activation_bytes_per_token(setup, moe=False, recompute="none")
        work_moe = activation_bytes_per_token(setup, moe=True, recompute="none")[0] if m.is_moe else 0.0
        working = max(work_dense, work_moe) * tokens_mb
    if tr.offload_activations and setup.hardware.kind != "cpu" and tr.framework == "pytorch":
        # The eager step's offload (advisor.run.offload) frees each tensor once its copy out has passed, so
        # nothing offloaded is on the GPU when backward begins; later one offloaded block comes back
        # while the block above runs its backward, after the loss buffers are freed (the dry run on
        # the CUDA target shows the peak lower by every offloaded byte).
        working = max(working, per_block * tokens_mb)
    e = 4.0 if tr.precision == "fp32" else 2.0
    resid = 4.0 if tr.autocast and not _eager_fsdp2(setup) else e
    if first and tr.dropout:
        acts += m.hidden * tokens_mb * in_flight / (p.tp if p.sequence_parallel else 1)  # embedding dropout mask
    if last:
        # Final norm input and head input, plus what the loss saves per logit: the fp32 log-softmax
        # (PyTorch's cross-entropy; Megatron-LM's vocab-parallel one keeps its fp32 softmax), or the
        # 16-bit logits a fused loss writes its gradient into (``fused_loss``).
        head_mb = in_flight if _gpipe(setup) else 1.0
        per_logit = e if tr.fused_loss and tr.framework == "pytorch" else 4.0
        acts += (
            ((resid + e) * m.hidden / (p.tp if p.sequence_parallel else 1) + per_logit * m.vocab / p.tp)
            * tokens_mb
            * head_mb
        )
    return acts, working, max(0.0, offloaded)


# --- communication helpers --------------------------------------------------------------------


def _group_bw(setup: Setup, stride: int, size: int, channels: bool = True) -> float:
    """Per-GPU bus bandwidth of a process group whose members are ``stride`` ranks apart.

    Ranks fill nodes in order TP, CP, DP, PP (Megatron); a group inside one node uses the intra-node
    link. A collective (``channels``: all-reduce, all-gather, reduce-scatter) of a group spanning
    nodes with k members in each node runs k rings at once (NCCL's channels), each crossing nodes on
    its own GPU's NIC (one per GPU, rail-optimised as in DGX and HGX systems), so it reaches k NICs'
    bandwidth, capped by the intra-node link every ring also crosses: one member per node (TP 8, then
    DP) gets one NIC, all eight of a node (FSDP over whole nodes) eight. Point-to-point rings (context
    parallel attention, pipeline sends) and all-to-alls are held to one NIC: a ring's node crossing,
    or each GPU's own traffic leaving the node, goes through one GPU's NIC. So is tensor parallelism
    across nodes: its per-layer all-reduces sit on the critical path, where Megatron-LM measured TP
    beyond a server to collapse throughput (Narayanan et al. 2021, section 3.2, takeaway #1), far below
    what the channels' bandwidth alone predicts; the estimate keeps the NIC's speed for it.

    A group whose span (``stride * size`` consecutive ranks) does not divide the node, as TP 16 in a
    72-GPU NVL72 rack, straddles a node boundary somewhere once the job spans nodes. The straddling
    group sets the pace of the step and its smaller side may hold a single member, so it is given one
    NIC.
    """
    g, span = setup.hardware.gpus_per_node, stride * size
    if span <= g < setup.gpus and g % span:
        return _link_bw(setup, True, 1)
    per_node = min(size, max(1, g // stride)) if channels else 1
    return _link_bw(setup, span > g, per_node)


def _link_bw(setup: Setup, spans_nodes: bool, per_node: int) -> float:
    """Bus bandwidth of a collective with ``per_node`` members in each node (``_group_bw``)."""
    hw = setup.hardware
    if not spans_nodes or hw.inter_node_bw_bytes_per_s <= 0:
        bw = hw.intra_node_bw_bytes_per_s or hw.inter_node_bw_bytes_per_s
    else:
        bw = per_node * hw.inter_node_bw_bytes_per_s
        if hw.intra_node_bw_bytes_per_s > 0:
            bw = min(bw, hw.intra_node_bw_bytes_per_s)
    return bw * COMM_EFFICIENCY_FRAC


def _expert_dp_bw(setup: Setup) -> float:
    """Bandwidth of the expert data-parallel group: the ranks of DP x CP holding the same experts. EP
    groups are consecutive in DP x CP (the all-to-all's stride is tp x cp), so the group takes every
    CP member (stride tp) and every ep-th DP replica (stride tp x cp x ep), and spans tp x cp x dp
    ranks. Mixtral on 256 H100s at DP 256 EP 2 has 4 members a node; Maverick at DP 512 CP 2 EP 32, 2
    (its CP pair)."""
    p, g = setup.parallel, setup.hardware.gpus_per_node
    t, cp = p.tp, p.cp
    size = p.dp * cp // p.ep
    cp_in = min(cp, max(1, g // t))
    dp_in = max(1, g // (t * cp * p.ep)) if t * cp <= g else 1
    return _link_bw(setup, t * cp * p.dp > g, min(size, cp_in * dp_in))


def _ring_all_reduce_s(nbytes: float, n: int, bw: float) -> float:
    return 0.0 if n <= 1 or nbytes <= 0 or bw <= 0 else 2 * (n - 1) / n * nbytes / bw


def _ring_gather_s(nbytes: float, n: int, bw: float) -> float:
    """All-gather or reduce-scatter of a buffer of ``nbytes`` (the full, gathered size)."""
    return 0.0 if n <= 1 or nbytes <= 0 or bw <= 0 else (n - 1) / n * nbytes / bw


def _ddp_bucket_count(grad_bytes: float) -> int:
    """Gradient buckets (one collective each) of ``grad_bytes``: a first bucket of
    DDP_FIRST_BUCKET_BYTES, then DDP_BUCKET_BYTES each (an upper bound, see DDP_BUCKET_BYTES)."""
    if grad_bytes <= 0:
        return 0
    return 1 + math.ceil(max(grad_bytes - DDP_FIRST_BUCKET_BYTES, 0.0) / DDP_BUCKET_BYTES)


# --- the estimate -------------------------------------------------------------------------------


def _fp8_cast_elements(m: ModelSpec, t: int) -> float:
    """Elements per token one block casts to fp8 on one TP rank: each GEMM's input forward (QKV and
    MLP-in read the hidden state, the projection its q/t input, MLP-out its f/t input) and each GEMM's
    output gradient backward."""
    mats = 2 if m.mlp == "swiglu" else 1
    f = m.expert_ffn_hidden * (m.top_k + m.n_shared_experts) if m.is_moe else m.ffn_hidden
    forward = 2 * m.hidden + m.q_dim / t + f / t
    backward = (m.q_dim + 2 * m.kv_dim) / t + 2 * m.hidden + mats * f / t
    return forward + backward


@functools.lru_cache(maxsize=8192)
def _rates(
    m: ModelSpec,
    t: int,
    ep: int,
    tokens_mb: int,
    seq_attn: int,
    precision: str,
    framework: str,
    flash: bool,
    hw,
    params: EfficiencyParams,
) -> tuple[float, float]:
    """(GEMM, attention) FLOP/s one GPU reaches on this layout's shapes (``advisor.estimate.efficiency``).

    Per micro-batch of ``tokens_mb`` tokens on one TP rank, Megatron's split: QKV (q/t + 2 kv/t wide),
    projection (q/t in), MLP in (f/t, twice for SwiGLU), MLP out; a MoE block's router, shared experts,
    and its local experts (n_experts / ep) with tokens x top_k x ep / n_experts tokens each; the head
    (vocab / t). Each forward, input-gradient and weight-gradient GEMM is timed at its shape. Under fp8
    the blocks' GEMMs run at the fp8 peak and ``fp8_gemm_frac``; the head, the router and attention stay
    16-bit (TransformerEngine and torchao convert the blocks' linears only)."""
    h, hd = m.hidden, m.head_dim
    q = m.q_dim // t
    kv = max(m.n_kv_heads // t, 1) * hd
    mats = 2 if m.mlp == "swiglu" else 1
    T = tokens_mb
    attn = [(1, T, q + 2 * kv, h), (1, T, h, q)]

    def mlp(count: float, tokens: int, f: int) -> list:
        return [(count, tokens, mats * f // t, h), (count, tokens, h, max(f // t, 1))]

    blocks = [(c * m.n_dense_layers, a, b_, k) for c, a, b_, k in attn + mlp(1, T, m.ffn_hidden)]
    router = []
    if m.is_moe:
        local = m.n_experts / ep
        per_expert = max(1, round(T * m.top_k * ep / m.n_experts))
        moe = attn + mlp(m.n_shared_experts, T, m.expert_ffn_hidden) + mlp(local, per_expert, m.expert_ffn_hidden)
        blocks += [(c * m.n_moe_layers, a, b_, k) for c, a, b_, k in moe if c > 0]
        router = [(m.n_moe_layers, T, m.n_experts, h)]
    head = [(1, T, -(-m.vocab // t), h), *router]
    half = "bf16" if precision == "fp8" else precision
    peak16 = hw.peak_flops(half)
    # A kernel table measured on this device (scripts/gpu_check.sh) replaces the datasheet share, the
    # prior k_half and the published attention curves for it.
    measured = device_fit(hw)
    k_half = measured.k_half if measured else params.gemm_k_half
    large16 = measured.large_frac.get(half, hw.matmul_efficiency_frac) if measured else hw.matmul_efficiency_frac
    if precision == "fp8":
        fp8 = measured.large_frac.get("fp8", params.fp8_gemm_frac) if measured else params.fp8_gemm_frac
        peak_b, large_b = hw.peak_flops("fp8"), fp8
    else:
        peak_b, large_b = peak16, large16
    f1, s1 = gemms_time_s(blocks, peak_b, large_b, hw.sm_count, k_half)
    f2, s2 = gemms_time_s(head, peak16, large16, hw.sm_count, k_half)
    gemm_rate = params.sustained_frac * (f1 + f2) / (s1 + s2)
    if not flash or precision == "fp32":
        return gemm_rate, gemm_rate
    impl = attention_impl(framework, hw.name)
    fwd, bwd = attention_frac(impl, seq_attn, hd, measured.attention.get(impl) if measured else None)
    return gemm_rate, params.sustained_frac * peak16 * 3.0 / (1.0 / fwd + 2.0 / bwd)


def estimate(setup: Setup, params: EfficiencyParams | None = None) -> Estimate:
    """Memory per GPU, step time, tokens/s and MFU of ``setup``; see the module docstring for sources.
    ``params`` replaces the fitted rate constants (``advisor.estimate.efficiency.FITTED``): the fit's search."""
    params = FITTED if params is None else params
    slowdown = params.overlap_slowdown_frac
    m, tr, p, hw = setup.model, setup.train, setup.parallel, setup.hardware
    t, pp, v, cp = p.tp, p.pp, p.vpp, p.cp
    mb = setup.grad_accum
    s, b = tr.seq_len, tr.micro_batch
    e = 4.0 if tr.precision == "fp32" else 2.0
    grad_e = 4.0 if tr.precision == "fp32" or tr.fp32_grads or tr.autocast else 2.0
    dense_shard = p.dp * cp
    expert_shard = dense_shard // p.ep
    tokens_mb = b * s / cp  # tokens one GPU processes per micro-batch
    offload_opt = p.offload != "none"
    offload_params = p.offload == "optimizer+params"

    # --- memory of the first and the last stage ---
    # The eager step (framework 'pytorch') runs data parallelism as advisor.run.parallel does: torch DDP for
    # ZeRO-0, FSDP2 for ZeRO-1/2/3 (_eager_fsdp2), whose ranks keep only their shards between uses.
    eager = tr.framework == "pytorch"
    fsdp2 = _eager_fsdp2(setup)
    ddp = eager and p.zero == 0 and dense_shard > 1
    # Gradients outlive the step where a framework keeps gradient buffers (Megatron's main_grad) or
    # micro-batches accumulate into them; the eager step frees them (zero_grad(set_to_none=True)), under
    # DDP and FSDP2 too (DDP's own copy in its buckets is counted with the buffers).
    persistent_grads = not eager or mb > 1
    # FSDP2 gathers fp32 weights, or 16-bit ones under its MixedPrecisionPolicy; unsharded gradients
    # come in the gathered weights' dtype and are reduce-scattered from an fp32 copy (reduce_dtype).
    gather_e = 2.0 if tr.autocast else 4.0

    def stage_memory(
        first: bool, last: bool, in_flight: float, rank: int | None = None
    ) -> tuple[MemoryBreakdown, float, float]:
        """The stage's memory at its fullest moment: when backward begins (activations and loss
        buffers alive), later in backward (loss buffers freed: a recomputed block, FSDP2's gathers and
        reduce-scatters) or during the optimizer step (all gradients and the optimizer's scratch)."""
        dense, expert, block, matmul, root = _stage_params(setup, first, last, rank)
        # FSDP2 shards weights, gradients and optimizer states at every stage (ZeRO-1 runs as ZeRO-2).
        state = (tr.precision, tr.optimizer, 3 if fsdp2 else p.zero)
        dw, dg, do = zero_model_state_bytes(dense, *state, dense_shard, m.hidden, tr.fp32_grads, tr.autocast)
        ew, eg, eo = zero_model_state_bytes(expert, *state, expert_shard, m.hidden, tr.fp32_grads, tr.autocast)
        weights, grads, opt = dw + ew, dg + eg, do + eo
        shard_params = dense / (dense_shard if p.zero else 1) + expert / (expert_shard if p.zero else 1)
        host = 0.0
        if offload_opt:
            # ZeRO-Offload: fp32 master, states and gradients live on the host; the GPU keeps only
            # gradient buckets on their way out.
            host += opt + shard_params * 4.0
            opt, grads = 0.0, 0.0
        if offload_params:
            host += weights
            weights = 0.0
        saved, working, offloaded_acts = _activation_memory(setup, tokens_mb, in_flight, first, last, rank)
        host += offloaded_acts
        # autocast's 16-bit copies of fp32 weights: saved by every linear for its backward; under full
        # recompute only the head's survives the forward, and the recomputed block makes its own; so
        # under op-level recompute, whose policy saves no cast (measured with the dry run).
        casts = tr.autocast and not fsdp2
        head_cast = 2.0 * m.vocab * m.hidden / t if casts and last else 0.0
        block_cast = 2.0 * (matmul - m.vocab * m.hidden / t * last) if casts else 0.0
        if tr.recompute in ("full", "selective-op"):
            # Partial recompute: the blocks that keep their activations keep their casts too.
            n_layers = _rank_layers(setup, first, last, rank)
            recomputing = min(n_layers, tr.recompute_layers * p.vpp) if tr.recompute_layers else n_layers
            saved += block_cast * (n_layers - recomputing) / n_layers if n_layers else 0.0
            working += block_cast / n_layers if n_layers else 0.0
        else:
            saved += block_cast
        # Communication buffers when backward begins, later in backward, and at the optimizer step.
        grad_bytes = dense * grad_e + expert * grad_e
        late_extra = 0.0
        if fsdp2:
            # fully_shard on the root keeps the root's weights gathered from forward to the end of
            # backward (FSDP2 never reshards the root after forward), and the head's unsharded gradient
            # from its backward to then. ZeRO-3 regathers each block for backward: the last one is
            # prefetched when backward begins; later a block is gathered and the next one prefetched.
            # ZeRO-1/2 keep every gathered block until its backward. Later in backward the previous
            # block's gradients are reduce-scattered from an fp32 buffer (the block's own unsharded
            # gradients take the place of its freed activations). Measured in the distributed dry run.
            reduce_scatter = block * 4.0
            begin = (root + block) * gather_e if p.zero >= 3 else (dense + expert) * gather_e
            late = begin + (block * gather_e if p.zero >= 3 else 0.0) + reduce_scatter
            late_extra = gather_e * m.vocab * m.hidden / t if last else 0.0
            at_step = 0.0
        elif ddp:
            # torch DDP allocates every bucket's flat gradient buffer up front and keeps it: with the
            # default gradient_as_bucket_view=False that is a second copy of all gradients ("the saved
            # memory size will be equal to the total gradients size", DistributedDataParallel docs).
            begin = late = at_step = grad_bytes
        elif p.zero >= 3 or offload_params:
            begin = late = at_step = 2 * block * 2.0 + block * grad_e  # two gathered blocks (prefetch) + one grad block
        elif dense_shard > 1 or offload_opt:
            begin = late = at_step = min(BUCKETS_IN_FLIGHT * DDP_BUCKET_BYTES, grad_bytes)
        else:
            begin = late = at_step = 0.0
        # PyTorch's loss backward holds the fp32 gradient of the log-softmax and of the logits: 8 bytes
        # per logit in every precision (measured, bench/results/dryrun_accuracy_cpu.md). Megatron-LM's
        # vocab-parallel cross-entropy and the fused losses (flash-attn's, Liger's) write the gradient
        # in place over what they saved: nothing more.
        in_place = tr.fused_loss or not eager
        loss = 8.0 * m.vocab / t * tokens_mb if last and not in_place else 0.0
        # foreach kernels build one fp32 temporary the size of the parameters they update (the
        # sqrt of exp_avg_sq for AdamW); fused kernels none; a for-loop one tensor at a time.
        scratch = {"foreach": 4.0 * shard_params, "fused": 0.0, "for-loop": 4.0 * m.vocab * m.hidden / t}
        opt_scratch = 0.0 if offload_opt else scratch[tr.optimizer_impl]
        # Backward begins with the loss buffers; a recomputed block comes after they are freed.
        g = grads if persistent_grads else 0.0
        backward_begins = (weights, g, opt, saved + head_cast, begin + loss)
        backward_later = (weights, g, opt, saved + working, late + late_extra)
        step = (weights, grads, opt, 0.0, at_step + opt_scratch)
        backward = backward_begins if sum(backward_begins) >= sum(backward_later) else backward_later
        w, g, o, a, buf = backward if sum(backward) >= sum(step) else step
        moment = "backward" if (w, g, o, a, buf) == backward else "optimizer step"
        overhead = hw.runtime_overhead_bytes + (FRAGMENTATION_FRAC * (w + g + o + a + buf) if hw.kind == "gpu" else 0.0)
        return MemoryBreakdown(w, g, o, a, buf, overhead, host, moment), dense, expert

    # 1F1B: stage 0 holds min(pp, m) micro-batches; interleaving adds (p-1)/(p*v) [Korthikanti 4.2.3].
    in_flight_first = min(pp, mb) * ((1 + (pp - 1) / (pp * v)) if v > 1 else 1.0)
    mem_first, dense_first, expert_first = stage_memory(True, pp == 1, in_flight_first)
    gpipe = _gpipe(setup)
    if pp > 1:
        # The last rank runs each micro-batch's backward right after its forward through the last
        # chunk; interleaved, it first runs (v-1) x pp warm-up forwards of its earlier chunks (torch's
        # and Megatron-LM's schedules), so at its first backward it holds min(pp, m) micro-batches of
        # those chunks and one of the last. Under GPipe it holds all m.
        held, last_chunk = _rank_layers(setup, False, True), _last_chunk_layers(setup)
        in_flight_last = float(mb) if gpipe else (min(pp, mb) * (held - last_chunk) + last_chunk) / held
        mem_last, dense_last, expert_last = stage_memory(False, True, in_flight_last)
    else:
        mem_last, dense_last, expert_last = mem_first, dense_first, expert_first
    worst, worst_rank = (mem_first, 0) if mem_first.total_bytes >= mem_last.total_bytes else (mem_last, pp - 1)
    params_gpu = max(dense_first + expert_first, dense_last + expert_last)
    dense_gpu = max(dense_first, dense_last)
    expert_gpu = max(expert_first, expert_last)
    host_rank = max(mem_first.host_bytes, mem_last.host_bytes)
    if pp > 2:
        # With uneven stages (lighter ends) a middle rank may hold more than the first: more blocks'
        # weights, and activations of fewer micro-batches. Rank r keeps pp - r micro-batches in flight
        # under 1F1B; interleaved, 2(pp - r - 1) + (v - 1) pp + 1 chunk-micro-batches (Megatron-LM's
        # and torch's warm-up), ((v + 1) pp - 2r - 1) / v of its blocks' worth. Of the ranks holding
        # as many blocks (and MoE blocks), the earliest keeps the most, so one rank per distinct pair
        # is weighed.
        stages = stage_layers(setup)
        moe_ranks = _moe_per_rank(stages, pp, m.moe_layer_step) if m.is_moe else (0.0,) * pp
        kinds = list(zip(_per_rank(stages, pp), moe_ranks, strict=True))
        for kind in sorted(set(kinds[1:-1]) - {kinds[0]}):
            r = kinds.index(kind, 1)
            in_flight = ((v + 1) * pp - 2 * r - 1) / v if v > 1 else mb if gpipe else min(pp - r, mb)
            mem_mid, dense_mid, expert_mid = stage_memory(False, False, in_flight, r)
            if mem_mid.total_bytes > worst.total_bytes:
                worst, worst_rank = mem_mid, r
            params_gpu = max(params_gpu, dense_mid + expert_mid)
            dense_gpu, expert_gpu = max(dense_gpu, dense_mid), max(expert_gpu, expert_mid)
            host_rank = max(host_rank, mem_mid.host_bytes)

    # --- FLOPs ---
    nmm = m.matmul_params_per_token()
    attn_fwd_full = 4.0 * s * m.q_dim * m.n_layers  # QK^T and AV over the full s x s, per token [Narayanan]
    model_flops_tok = 6.0 * nmm + 3.0 * attn_fwd_full  # = 6N + 12*L*s*q [PaLM]
    attn_fwd_exec = attn_fwd_full * (0.5 if tr.flash_attention else 1.0)  # causal flash skips the masked half
    hw_flops_tok = 6.0 * nmm + 3.0 * attn_fwd_exec
    # Share of a rank's blocks that recompute: recompute_layers of each of its vpp chunks, or all.
    layers_rank = m.n_layers / pp
    recompute_share = min(1.0, tr.recompute_layers * v / layers_rank) if tr.recompute_layers else 1.0
    if tr.recompute == "full":
        recompute_tok = (2.0 * (nmm - m.vocab * m.hidden) + attn_fwd_exec) * recompute_share
    elif tr.recompute == "selective":
        recompute_tok = attn_fwd_exec
    elif tr.recompute == "selective-op":
        recompute_tok = nmm - m.vocab * m.hidden  # half of the blocks' matmul forward
    else:
        recompute_tok = 0.0
    tokens_step = setup.tokens_per_step
    model_flops = model_flops_tok * tokens_step
    hw_flops = (hw_flops_tok + recompute_tok) * tokens_step

    # --- time ---
    peak = hw.peak_flops(tr.precision)
    gpu = hw.kind == "gpu"
    if gpu:
        rate, attn_rate = _rates(
            m, t, p.ep, int(tokens_mb), int(s // cp), tr.precision, tr.framework, tr.flash_attention, hw, params
        )
    else:
        # A CPU keeps one matmul share and half of it for attention: its calibration
        # (``advisor.advice.calibrate``) fits this machine's real rates.
        rate = peak * hw.matmul_efficiency_frac
        attn_rate = peak * CPU_ATTENTION_EFFICIENCY_FRAC if tr.flash_attention else rate
    shard = t * pp * cp
    tokens_gpu_step = mb * b * s  # per model replica; divided by the model-parallel shards below
    attn_exec_tok = 3.0 * attn_fwd_exec
    compute_s = ((hw_flops_tok - attn_exec_tok) / rate + attn_exec_tok / attn_rate) * tokens_gpu_step / shard
    recompute_attn_tok = attn_fwd_exec * (recompute_share if tr.recompute == "full" else 1.0)
    if tr.recompute in ("none", "selective-op"):
        recompute_attn_tok = 0.0
    recompute_s = (
        ((recompute_tok - recompute_attn_tok) / rate + recompute_attn_tok / attn_rate) * tokens_gpu_step / shard
    )
    mem_rate = hw.mem_bw_bytes_per_s * MEM_BW_EFFICIENCY_FRAC
    moe_frac = m.n_moe_layers / m.n_layers
    saved_tok = (1 - moe_frac) * activation_bytes_per_token(setup, False, "none")[1]
    if m.is_moe:
        saved_tok += moe_frac * activation_bytes_per_token(setup, True, "none")[1]
    # 1F1B runs at the pace of its slowest stage, so what is per stage is the slowest rank's: its FLOPs
    # (blocks and the head, stage_imbalance) and its blocks (layers_stage: per-block recompute, traffic
    # and collectives). An even split would hold n_layers / pp blocks and an even share of the head.
    lag, layer_lag, last_slowest = _slowest_rank(setup)
    layers_stage = m.n_layers / pp * layer_lag
    compute_s *= lag
    recompute_s *= layer_lag
    # The per-layer elementwise traffic (norms, activations, residuals, RoPE), counted as passes over the
    # saved activations; on a GPU scaled by the fitted ``memory_bound_scale`` (and in eager PyTorch by
    # ``eager_memory_factor``): the byte count is the model's weakest, and the fit says by how much.
    # The traffic counted tensor by tensor below (softmax scores, loss, fp8 casts) is not scaled.
    elementwise_bytes = ELEMENTWISE_TRAFFIC_PER_SAVED_BYTE * saved_tok * layers_stage * tokens_mb * mb
    if tr.recompute == "full":
        elementwise_bytes *= 1 + 0.25 * recompute_share  # the forward half (1 of 4 passes) runs again
    elif tr.recompute == "selective-op":
        elementwise_bytes *= 1.25  # every elementwise op of the forward runs again
    if gpu:
        elementwise_bytes *= params.memory_bound_scale
        if tr.framework == "pytorch" and not tr.compile:
            elementwise_bytes *= params.eager_memory_factor
    if not tr.flash_attention:
        # Softmax over the s x s scores: written by QK^T, read and written by softmax, read by AV,
        # and as many passes again backward; once more forward where full recompute replays it.
        scores_tok = m.n_heads / t * (s / cp) * e
        passes = 8 + (2 * recompute_share if tr.recompute == "full" else 0)
        elementwise_bytes += passes * scores_tok * layers_stage * tokens_mb * mb
    # Cross-entropy over the logits on the last stage: logits written, upcast, softmax read and written,
    # gradient written and read by the head backward; counted where the last rank sets the pace.
    elementwise_bytes += 6 * (e + 4.0) / 2 * m.vocab / t * tokens_mb * mb if last_slowest else 0.0
    if tr.precision == "fp8":
        # Each block GEMM's input is cast to fp8 (read 2 bytes, write 1) forward, and each output
        # gradient backward (TransformerEngine and torchao fuse the amax into the cast).
        elementwise_bytes += 3.0 * _fp8_cast_elements(m, t) * layers_stage * tokens_mb * mb
    memory_bound_s = elementwise_bytes / mem_rate
    # Each kernel's fixed cost on the GPU (the gap before it starts, its last wave's tail), and in eager
    # PyTorch the host's: it dispatches and launches every op (``eager_kernel_factor`` times the fused
    # step's kernels), and where that takes longer than the GPU's work the GPU waits for it. torch.compile
    # fuses the elementwise ops and cuts the dispatch; full recompute replays the forward's third.
    kernel_overhead_s = 0.0
    if gpu:
        replay = recompute_share if tr.recompute == "full" else 1.0 if tr.recompute == "selective-op" else 0.0
        kernels = KERNELS_PER_BLOCK * (1.0 + replay / 3.0) * layers_stage * mb
        if tr.framework == "pytorch" and not tr.compile:
            kernels *= params.eager_kernel_factor
            host_s = kernels * params.host_op_s
            kernel_overhead_s = max(0.0, host_s - (compute_s + recompute_s + memory_bound_s))
        kernel_overhead_s += params.kernel_s * kernels

    # Tensor parallel: 2 all-reduces forward, 2 backward per block (+2 when full recompute replays the
    # forward); with sp each is an all-gather + reduce-scatter of the same volume [Korthikanti 4.2.2].
    # The vocab-parallel embedding all-reduces its output and the head its input's gradient: both on
    # one stage without a pipeline, else one each on the first and the last stage.
    tp_bw = _group_bw(setup, 1, t, channels=False)
    n_tp_collectives = 4 + (2 * recompute_share if tr.recompute == "full" else 0)
    edge_collectives = (2 if pp == 1 else 1) if t > 1 else 0
    tp_s = (
        mb
        * (layers_stage * n_tp_collectives + edge_collectives)
        * _ring_all_reduce_s(tokens_mb * m.hidden * e, t, tp_bw)
    )

    # Context parallel ring: each rank receives cp-1 K/V chunks forward, K/V and dK/dV backward.
    cp_s = 0.0
    if cp > 1:
        kv_heads_rank = max(m.n_kv_heads // t, 1)
        kv_bytes = 2 * kv_heads_rank * m.head_dim * e * tokens_mb * (cp - 1)
        ring_s = mb * layers_stage * 3 * kv_bytes / _group_bw(setup, t, cp, channels=False)
        attn_s = 3.0 * attn_fwd_exec / m.n_layers * layers_stage * tokens_mb * mb / t / attn_rate
        cp_s = max(0.0, ring_s - attn_s) + (slowdown * min(ring_s, attn_s) if gpu else 0.0)

    # Expert parallel: dispatch and combine all-to-alls, forward and backward.
    ep_s = 0.0
    if p.ep > 1:
        tok = tokens_mb / (t if p.sequence_parallel else 1)
        a2a = tok * m.top_k * m.hidden * e * (p.ep - 1) / p.ep
        ep_s = mb * layers_stage * moe_frac * 4 * a2a / _group_bw(setup, t * cp, p.ep, channels=False)

    # Pipeline point-to-point: activation forward and its gradient backward, per micro-batch and chunk.
    pp_s = 0.0
    if pp > 1:
        p2p = tokens_mb * m.hidden * e / (t if p.sequence_parallel else 1)
        pp_s = mb * v * 2 * p2p / _group_bw(setup, t * cp * p.dp, pp, channels=False)

    # Data parallel. Communication hides behind two windows: the last micro-batch's backward (the
    # gradient reduction of DDP and ZeRO-1) and the whole step's work (per-micro-batch collectives of
    # ZeRO-2/3, offloaded gradients' copy out and streamed offloaded weights). What shares a
    # window competes for it: exposed = max(0, everything hidden there - the window).
    step_work_s = compute_s + recompute_s + memory_bound_s + tp_s + kernel_overhead_s
    bwd_last_mb_s = (2.0 / 3.0) * (compute_s + memory_bound_s) / mb
    lat = COLLECTIVE_LATENCY_S
    in_bwd_window = 0.0  # needs the last backward's window
    in_step_window = 0.0  # needs the whole step's work as its window
    in_fwd_window = 0.0  # needs the first micro-batch's forward as its window
    dp_fixed_s = 0.0  # never overlapped
    if dense_shard > 1 or expert_shard > 1:
        bw_dense = _group_bw(setup, t, dense_shard)
        bw_exp = _expert_dp_bw(setup)
        gbytes_d, gbytes_e = dense_gpu * grad_e, expert_gpu * grad_e
        wbytes_d, wbytes_e = dense_gpu * 2.0, expert_gpu * 2.0
        buckets = _ddp_bucket_count(gbytes_d + gbytes_e)
        if p.zero == 0:
            in_bwd_window = (
                _ring_all_reduce_s(gbytes_d, dense_shard, bw_dense)
                + _ring_all_reduce_s(gbytes_e, expert_shard, bw_exp)
                + buckets * lat
            )
        else:
            reduce_s = _ring_gather_s(gbytes_d, dense_shard, bw_dense) + _ring_gather_s(gbytes_e, expert_shard, bw_exp)
            gather_s = _ring_gather_s(wbytes_d, dense_shard, bw_dense) + _ring_gather_s(wbytes_e, expert_shard, bw_exp)
            if p.zero == 1 and not offload_opt:
                # Gradients accumulate unsharded; one reduce-scatter per step, then the updated shards
                # are all-gathered after the optimizer step: exposed in the eager step, overlapped with
                # the next step's first forward in Megatron-Core (--overlap-param-gather, on in NeMo's and
                # Megatron-Bridge's performance recipes: its forward pre-hooks wait bucket by bucket).
                in_bwd_window = reduce_s + buckets * lat
                if eager:
                    dp_fixed_s = gather_s + buckets * lat
                else:
                    in_fwd_window = gather_s + buckets * lat
            elif p.zero <= 2:
                # Gradients are sharded, so every micro-batch reduce-scatters its own (DeepSpeed ZeRO-2,
                # FSDP SHARD_GRAD_OP without no_sync), hidden behind the backward passes. ZeRO-1 with the
                # optimizer offloaded too: its gradients leave for the host as they are produced
                # (ZeRO-Offload accumulates them there, Ren et al. 2021), so none stay on the GPU to
                # accumulate, as the memory above counts. Reduced once per step instead, the 405B plan
                # on 1,024 H100s kept 47 GiB of bf16 gradients a GPU that its 73.7 GiB left out.
                in_step_window = mb * (reduce_s + buckets * lat)
                dp_fixed_s = gather_s + buckets * lat
            else:
                # ZeRO-3 / FSDP FULL_SHARD: per micro-batch, each layer is gathered before its forward
                # and backward (and recompute) and its gradients reduce-scattered after; prefetch hides
                # all but the first gather and the last reduce-scatter of the step.
                passes = 3 if tr.recompute == "full" else 2
                units = layers_stage + 1  # the blocks and the embedding/head unit
                in_step_window = mb * (passes * gather_s + reduce_s + (passes + 1) * units * lat)
                dp_fixed_s = (gather_s + reduce_s) / units + 2 * lat

    # Pipeline bubble: (p-1)/(v*m) of the ideal per-stage time [Narayanan].
    bubble_s = (pp - 1) / (v * mb) * step_work_s if pp > 1 else 0.0

    # Optimizer step: memory-bound, ~28 bytes per parameter for AdamW (read grad, master, m, v; write
    # master, m, v, 16-bit weight), 20 for SGD, 12 for Adafactor.
    opt_bytes_per_param = {"adamw": 28.0, "sgd": 20.0, "adafactor": 12.0}[tr.optimizer]
    opt_params = dense_gpu / (dense_shard if p.zero >= 1 else 1) + expert_gpu / (expert_shard if p.zero >= 1 else 1)
    optimizer_s = 0.0
    offload_fixed_s = d2h_s = stream_s = 0.0
    link = hw.host_link_bw_bytes_per_s * COMM_EFFICIENCY_FRAC
    act_offload_s = 0.0
    if tr.offload_activations and link > 0:
        # Each micro-batch's offloaded activations go out during its forward and come back during its
        # backward on the host link (PCIe, or NVLink-C2C on GH200/GB200: one direction each, so they
        # do not share it), overlapped with that pass's work (a third and two thirds of the stage's).
        # The host link is not the network, so this competes with no DP traffic.
        per_block = (1 - moe_frac) * _kept_bytes_per_token(setup, False)
        if m.is_moe:
            per_block += moe_frac * _kept_bytes_per_token(setup, True)
        blocks_off = min(layers_rank, tr.offload_activations * v)
        copy_s = mb * blocks_off * per_block * tokens_mb / link
        for window in (step_work_s / 3.0, 2.0 * step_work_s / 3.0):
            act_offload_s += max(0.0, copy_s - window) + slowdown * min(copy_s, window)
    if offload_opt:
        host_bw = hw.host_mem_bw_bytes_per_s / hw.gpus_per_node * MEM_BW_EFFICIENCY_FRAC
        cpu_step_s = opt_params * opt_bytes_per_param / host_bw
        # Each micro-batch's gradient partitions go out as its backward makes them (accumulated on the
        # host: the GPU keeps none), overlapped with the step's work, as DeepSpeed's ZeRO-Offload and
        # FSDP2's CPUOffloadPolicy do. The profiled one-device step (advisor.run.step's HostOffloadOptimizer)
        # is simpler: it copies the accumulated gradients once, in its exposed offload phase.
        d2h_s += mb * opt_params * grad_e / link
        h2d_s = opt_params * 2.0 / link  # updated 16-bit weights back
        offload_fixed_s = cpu_step_s + h2d_s
        if offload_params:
            stream_s = mb * 2 * opt_params * 2.0 / link  # weight shards in, forward and backward
    else:
        optimizer_s = opt_params * opt_bytes_per_param / mem_rate
    # Each window's exposed time, split between DP communication and offload by their share of it.
    dp_s, offload_s = dp_fixed_s, offload_fixed_s + act_offload_s
    for dp_need, off_need, window in (
        (in_fwd_window, 0.0, bwd_last_mb_s / 2.0),
        (in_bwd_window, 0.0, bwd_last_mb_s),
        (in_step_window, d2h_s + stream_s, step_work_s),
    ):
        need = dp_need + off_need
        if need > 0:
            exposed = max(0.0, need - window) + (slowdown * min(need, window) if gpu else 0.0)
            dp_s += exposed * dp_need / need
            offload_s += exposed * off_need / need

    time = TimeBreakdown(
        kernel_overhead_ms=kernel_overhead_s * 1e3,
        compute_ms=compute_s * 1e3,
        recompute_ms=recompute_s * 1e3,
        memory_bound_ms=memory_bound_s * 1e3,
        tp_comm_ms=tp_s * 1e3,
        cp_comm_ms=cp_s * 1e3,
        ep_comm_ms=ep_s * 1e3,
        pp_comm_ms=pp_s * 1e3,
        dp_comm_ms=dp_s * 1e3,
        bubble_ms=bubble_s * 1e3,
        optimizer_ms=optimizer_s * 1e3,
        offload_ms=offload_s * 1e3,
    )
    step_s = time.total_ms / 1e3
    gpus = setup.gpus
    per_node = min(gpus, hw.gpus_per_node)
    host_node = host_rank * per_node
    return Estimate(
        setup=setup,
        memory=worst,
        memory_first_stage=mem_first,
        memory_last_stage=mem_last,
        time=time,
        params_per_gpu=params_gpu,
        model_flops_per_step=model_flops,
        hardware_flops_per_step=hw_flops,
        tokens_per_s=tokens_step / step_s,
        mfu_frac=model_flops / gpus / step_s / peak,
        hfu_frac=hw_flops / gpus / step_s / peak,
        host_bytes_per_node=host_node,
        host_fits=host_node <= hw.host_memory_bytes or not (offload_opt or tr.offload_activations),
        memory_rank=worst_rank,
        gemm_frac=rate / peak,
        attention_frac=attn_rate / hw.peak_flops("bf16" if tr.precision == "fp8" else tr.precision),
    )


def narayanan_flops_per_iteration(
    batch: int, seq: int, layers: int, hidden: int, vocab: int, full_recompute: bool
) -> float:
    """FLOPs per iteration of a GPT model [Narayanan eq. 3]: 72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h)),
    or 96*... with V/(16*l*h) under full recompute."""
    if full_recompute:
        return 96.0 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    return 72.0 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))
