"""Step time of a Setup on its slowest GPU, part by part (compute at the layout's achievable rates,
elementwise traffic, kernel overheads, communication, the pipeline bubble, the optimizer step, host
offload), and its FLOPs, tokens/s and MFU, by pure arithmetic.

Sources, cited where each number is used:
- [Korthikanti] Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models": tensor- and sequence-parallel collectives per block.
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

The parameters each GPU holds come from the memory part (``advisor.estimate.memory.pipeline_memory``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

from advisor.estimate.efficiency import EfficiencyParams, attention_frac, attention_impl, device_fit, gemms_time_s
from advisor.estimate.memory import (
    DDP_BUCKET_BYTES,
    DDP_FIRST_BUCKET_BYTES,
    PipelineMemory,
    activation_bytes_per_token,
    kept_bytes_per_token,
    rank_blocks,
    setup_memo,
)
from advisor.spec.frozen import fast_init
from advisor.spec.specs import ModelSpec, Setup
from advisor.spec.stages import head_in_blocks

# Share of link bandwidth collectives reach (nccl-tests bus bandwidth on NVLink and InfiniBand is
# typically ~80 % of the per-direction link rate).
COMM_EFFICIENCY_FRAC = 0.80
# Share of memory bandwidth that elementwise kernels and the optimizer reach (a device-to-device copy
# measured 4.3 of 4.8 TB/s on our H200, DESIGN.md).
MEM_BW_EFFICIENCY_FRAC = 0.90
# Fixed cost of one NCCL collective (launch, ring set-up, protocol hand-offs): small-message
# all-reduce / all-gather times in nccl-tests on 8-GPU NVLink nodes are 10-30 us. Paid per bucket
# (DDP, ZeRO-1/2) or per layer and pass (ZeRO-3 / FSDP units).
COLLECTIVE_LATENCY_S = 20e-6
# Kernels one transformer block launches per micro-batch in a fused (Megatron-LM) step: forward norm,
# QKV, RoPE, attention, projection, residual, norm, MLP in, activation, MLP out, residual (about 12),
# backward twice as many; eager PyTorch launches ``eager_kernel_factor`` times as many.
KERNELS_PER_BLOCK = 36
# A CPU's attention as a share of its matmul rate, by dtype: fused (SDPA, causal) per FLOP it does
# (the half of the scores causal attention computes), unfused (scores materialised, softmax and mask
# in memory: its score traffic is in this share, not in the memory-bound time) per FLOP of the whole
# square. Measured by bench/cpu_attention.py on 2 cores of an AVX512-BF16 EPYC, torch 2.13: the median
# over four shapes (head dim 32 and 64, sequence 512 to 2,048), the mean of two runs
# (bench/results/cpu_attention.md). bf16: fused 0.08-0.16 of the matmuls' 805-901 GFLOP/s (medians
# 0.145, 0.145), unfused 0.19-0.34 (0.21, 0.20); fp32: fused 0.33-0.57 of 193-212 GFLOP/s (0.50,
# 0.47), unfused 0.35-0.66 (0.43, 0.395). fp16 (no fast CPU path) takes fp32's. Not measured on AMX or
# AVX2-only CPUs: the calibration corrects what differs there.
CPU_ATTENTION_EFFICIENCY_FRAC = {"bf16": 0.145, "fp32": 0.485, "fp16": 0.485}
CPU_UNFUSED_ATTENTION_EFFICIENCY_FRAC = {"bf16": 0.205, "fp32": 0.41, "fp16": 0.41}
# Elementwise traffic per saved activation byte: written and read in forward, read and its gradient
# written in backward.
ELEMENTWISE_TRAFFIC_PER_SAVED_BYTE = 4


@fast_init
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
    "kernel_overhead_ms": "per-kernel cost (launch gaps, tails)",
    "tp_comm_ms": "TP communication",
    "cp_comm_ms": "CP ring (exposed)",
    "ep_comm_ms": "EP all-to-all",
    "pp_comm_ms": "PP send/recv",
    "dp_comm_ms": "DP/ZeRO comm (exposed)",
    "bubble_ms": "pipeline bubble",
    "optimizer_ms": "optimizer step",
    "offload_ms": "host offload (exposed)",
}

# --- pipeline pace -------------------------------------------------------------------------------


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
    memo = setup_memo(setup)
    head = memo.get("head_in_blocks")
    if head is None:
        head = memo["head_in_blocks"] = head_in_blocks(setup)
    layers = rank_blocks(setup)
    # The slowest rank: the last with the head, or the one with the most blocks (the first such).
    most = max(layers[:-1])
    last = layers[-1] + head >= most
    cost, blocks = (layers[-1] + head, layers[-1]) if last else (most, most)
    return cost / ((n + head) / p.pp), blocks / (n / p.pp), last


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


# --- rates ---------------------------------------------------------------------------------------


def _matmul_params(setup: Setup) -> int:
    """``setup.model.matmul_params_per_token()``, kept for the setup (``memory.setup_memo``)."""
    memo = setup_memo(setup)
    n = memo.get("matmul_params")
    if n is None:
        n = memo["matmul_params"] = setup.model.matmul_params_per_token()
    return n


def _fp8_cast_elements(m: ModelSpec, t: int) -> float:
    """Elements per token one block casts to fp8 on one TP rank: each GEMM's input forward (QKV and
    MLP-in read the hidden state, the projection its q/t input, MLP-out its f/t input) and each GEMM's
    output gradient backward."""
    mats = 2 if m.mlp == "swiglu" else 1
    f = m.expert_ffn_hidden * (m.top_k + m.n_shared_experts) if m.is_moe else m.ffn_hidden
    forward = 2 * m.hidden + m.q_dim / t + f / t
    backward = (m.q_dim + 2 * m.kv_dim) / t + 2 * m.hidden + mats * f / t
    return forward + backward


# _rates by the objects' identity first: its lru_cache hashes the ModelSpec (30 fields), the HardwareSpec
# and the EfficiencyParams on every call, 15k of an estimate's 440k machine instructions on the
# estimator_speed grid. An entry keeps its objects, so their ids stay theirs while it is held.
_RATES_BY_ID: dict[tuple, tuple] = {}


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
    """``_rates_by_value``, looked up by the specs' identity before their value."""
    key = (id(m), id(hw), id(params), t, ep, tokens_mb, seq_attn, precision, framework, flash)
    hit = _RATES_BY_ID.get(key)
    if hit is not None and hit[0] is m and hit[1] is hw and hit[2] is params:
        return hit[3]
    out = _rates_by_value(m, t, ep, tokens_mb, seq_attn, precision, framework, flash, hw, params)
    if len(_RATES_BY_ID) >= 8192:
        _RATES_BY_ID.clear()
    _RATES_BY_ID[key] = (m, hw, params, out)
    return out


def _clear_rates() -> None:
    """Forget every rate (a device's kernel table changed): both caches."""
    _RATES_BY_ID.clear()
    _rates_by_value.cache_clear()


_rates.cache_clear = _clear_rates  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=8192)
def _rates_by_value(
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
    """(GEMM, attention) FLOP/s one device reaches on this layout's shapes (``advisor.estimate.efficiency``).

    Per micro-batch of ``tokens_mb`` tokens on one TP rank, Megatron's split: QKV (q/t + 2 kv/t wide),
    projection (q/t in), MLP in (f/t, twice for SwiGLU), MLP out; a MoE block's router, shared experts,
    and its local experts (n_experts / ep) with tokens x top_k x ep / n_experts tokens each; the head
    (vocab / t). Each forward, input-gradient and weight-gradient GEMM is timed at its shape. Under fp8
    the blocks' GEMMs run at the fp8 peak and ``fp8_gemm_frac``; the head, the router and attention stay
    16-bit (TransformerEngine and torchao convert the blocks' linears only)."""
    if hw.kind != "gpu":
        # A CPU keeps one matmul share, and attention at its measured share of it (fused or not): its
        # calibration (``advisor.advice.calibrate``) fits this machine's real rates.
        rate = hw.peak_flops(precision) * hw.matmul_efficiency_frac
        shares = CPU_ATTENTION_EFFICIENCY_FRAC if flash else CPU_UNFUSED_ATTENTION_EFFICIENCY_FRAC
        return rate, rate * shares.get(precision, shares["fp32"])
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


# --- the step's parts ------------------------------------------------------------------------------


def _flops_per_token(setup: Setup) -> tuple[float, float, float, float, float]:
    """(model FLOPs, hardware FLOPs before recompute, recomputed FLOPs, attention forward FLOPs as
    executed, share of a rank's blocks that recompute) per token of the whole model."""
    m, tr = setup.model, setup.train
    nmm = _matmul_params(setup)
    attn_fwd_full = 4.0 * tr.seq_len * m.q_dim * m.n_layers  # QK^T and AV over the full s x s, per token [Narayanan]
    model_flops_tok = 6.0 * nmm + 3.0 * attn_fwd_full  # = 6N + 12*L*s*q [PaLM]
    attn_fwd_exec = attn_fwd_full * (0.5 if tr.flash_attention else 1.0)  # causal flash skips the masked half
    hw_flops_tok = 6.0 * nmm + 3.0 * attn_fwd_exec
    # Share of a rank's blocks that recompute: recompute_layers of each of its vpp chunks, or all.
    layers_rank = m.n_layers / setup.parallel.pp
    recompute_share = min(1.0, tr.recompute_layers * setup.parallel.vpp / layers_rank) if tr.recompute_layers else 1.0
    if tr.recompute == "full":
        recompute_tok = (2.0 * (nmm - m.vocab * m.hidden) + attn_fwd_exec) * recompute_share
    elif tr.recompute == "selective":
        recompute_tok = attn_fwd_exec
    elif tr.recompute == "selective-op":
        recompute_tok = nmm - m.vocab * m.hidden  # half of the blocks' matmul forward
    else:
        recompute_tok = 0.0
    return model_flops_tok, hw_flops_tok, recompute_tok, attn_fwd_exec, recompute_share


def _memory_bound_s(
    setup: Setup,
    layers_stage: float,
    recompute_share: float,
    last_slowest: bool,
    mb: int,
    tokens_mb: float,
    params: EfficiencyParams,
) -> float:
    """Seconds of the slowest rank's memory-bound work in one step: elementwise ops over the saved
    activations, softmax scores without flash attention, the loss, fp8 casts."""
    m, tr, p, hw = setup.model, setup.train, setup.parallel, setup.hardware
    t, cp, s = p.tp, p.cp, tr.seq_len
    e = 4.0 if tr.precision == "fp32" else 2.0
    mem_rate = hw.mem_bw_bytes_per_s * MEM_BW_EFFICIENCY_FRAC
    moe_frac = m.n_moe_layers / m.n_layers
    saved_tok = (1 - moe_frac) * activation_bytes_per_token(setup, False, "none")[1]
    if m.is_moe:
        saved_tok += moe_frac * activation_bytes_per_token(setup, True, "none")[1]
    # The per-layer elementwise traffic (norms, activations, residuals, RoPE), counted as passes over the
    # saved activations; on a GPU scaled by the fitted ``memory_bound_scale`` (and in eager PyTorch by
    # ``eager_memory_factor``): the byte count is the model's weakest, and the fit says by how much.
    # The traffic counted tensor by tensor below (softmax scores, loss, fp8 casts) is not scaled.
    elementwise_bytes = ELEMENTWISE_TRAFFIC_PER_SAVED_BYTE * saved_tok * layers_stage * tokens_mb * mb
    if tr.recompute == "full":
        elementwise_bytes *= 1 + 0.25 * recompute_share  # the forward half (1 of 4 passes) runs again
    elif tr.recompute == "selective-op":
        elementwise_bytes *= 1.25  # every elementwise op of the forward runs again
    if hw.kind == "gpu":
        elementwise_bytes *= params.memory_bound_scale
        if tr.framework == "pytorch" and not tr.compile:
            elementwise_bytes *= params.eager_memory_factor
    if not tr.flash_attention and hw.kind == "gpu":
        # Softmax over the s x s scores: written by QK^T, read and written by softmax, read by AV,
        # and as many passes again backward; once more forward where full recompute replays it. (A
        # CPU's unfused attention rate, CPU_UNFUSED_ATTENTION_EFFICIENCY_FRAC, was measured with it.)
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
    return elementwise_bytes / mem_rate


def _kernel_overhead_s(
    setup: Setup, layers_stage: float, recompute_share: float, mb: int, busy_s: float, params: EfficiencyParams
) -> float:
    """Seconds of fixed per-kernel cost in one step on the GPU (the gap before each kernel starts, its
    last wave's tail), and in eager PyTorch the host's: it dispatches and launches every op
    (``eager_kernel_factor`` times the fused step's kernels), and where that takes longer than the
    GPU's ``busy_s`` of work the GPU waits for it. torch.compile fuses the elementwise ops and cuts the
    dispatch; full recompute replays the forward's third. 0 on a CPU."""
    tr = setup.train
    kernel_overhead_s = 0.0
    if setup.hardware.kind == "gpu":
        replay = recompute_share if tr.recompute == "full" else 1.0 if tr.recompute == "selective-op" else 0.0
        kernels = KERNELS_PER_BLOCK * (1.0 + replay / 3.0) * layers_stage * mb
        if tr.framework == "pytorch" and not tr.compile:
            kernels *= params.eager_kernel_factor
            host_s = kernels * params.host_op_s
            kernel_overhead_s = max(0.0, host_s - busy_s)
        kernel_overhead_s += params.kernel_s * kernels
    return kernel_overhead_s


def _model_parallel_comm_s(
    setup: Setup,
    layers_stage: float,
    recompute_share: float,
    mb: int,
    tokens_mb: float,
    attn_fwd_exec: float,
    attn_rate: float,
    slowdown: float,
) -> tuple[float, float, float, float]:
    """Exposed seconds of (tensor-parallel, context-parallel, expert-parallel, pipeline) communication
    in one step on the slowest rank."""
    m, tr, p = setup.model, setup.train, setup.parallel
    t, pp, v, cp = p.tp, p.pp, p.vpp, p.cp
    e = 4.0 if tr.precision == "fp32" else 2.0
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
        cp_s = max(0.0, ring_s - attn_s) + (slowdown * min(ring_s, attn_s) if setup.hardware.kind == "gpu" else 0.0)

    # Expert parallel: dispatch and combine all-to-alls, forward and backward.
    ep_s = 0.0
    if p.ep > 1:
        moe_frac = m.n_moe_layers / m.n_layers
        tok = tokens_mb / (t if p.sequence_parallel else 1)
        a2a = tok * m.top_k * m.hidden * e * (p.ep - 1) / p.ep
        ep_s = mb * layers_stage * moe_frac * 4 * a2a / _group_bw(setup, t * cp, p.ep, channels=False)

    # Pipeline point-to-point: activation forward and its gradient backward, per micro-batch and chunk.
    pp_s = 0.0
    if pp > 1:
        p2p = tokens_mb * m.hidden * e / (t if p.sequence_parallel else 1)
        pp_s = mb * v * 2 * p2p / _group_bw(setup, t * cp * p.dp, pp, channels=False)
    return tp_s, cp_s, ep_s, pp_s


def _dp_comm_needs_s(
    setup: Setup, dense_gpu: float, expert_gpu: float, layers_stage: float, mb: int
) -> tuple[float, float, float, float]:
    """Seconds of data-parallel communication in one step, by the window it can hide behind: (the first
    micro-batch's forward, the last one's backward, the whole step's work, none)."""
    tr, p = setup.train, setup.parallel
    t = p.tp
    dense_shard = p.dp * p.cp
    expert_shard = dense_shard // p.ep
    lat = COLLECTIVE_LATENCY_S
    in_bwd_window = 0.0  # needs the last backward's window
    in_step_window = 0.0  # needs the whole step's work as its window
    in_fwd_window = 0.0  # needs the first micro-batch's forward as its window
    dp_fixed_s = 0.0  # never overlapped
    if dense_shard > 1 or expert_shard > 1:
        grad_e = 4.0 if tr.precision == "fp32" or tr.fp32_grads or tr.autocast else 2.0
        bw_dense = _group_bw(setup, t, dense_shard)
        gbytes_d, gbytes_e = dense_gpu * grad_e, expert_gpu * grad_e
        wbytes_d, wbytes_e = dense_gpu * 2.0, expert_gpu * 2.0
        buckets = _ddp_bucket_count(gbytes_d + gbytes_e)
        # Without routed experts their terms are 0.0, and x + 0.0 is x: skipped.
        bw_exp = _expert_dp_bw(setup) if expert_gpu > 0 else 0.0
        if p.zero == 0:
            in_bwd_window = _ring_all_reduce_s(gbytes_d, dense_shard, bw_dense)
            if expert_gpu > 0:
                in_bwd_window += _ring_all_reduce_s(gbytes_e, expert_shard, bw_exp)
            in_bwd_window += buckets * lat
        else:
            reduce_s = _ring_gather_s(gbytes_d, dense_shard, bw_dense)
            gather_s = _ring_gather_s(wbytes_d, dense_shard, bw_dense)
            if expert_gpu > 0:
                reduce_s += _ring_gather_s(gbytes_e, expert_shard, bw_exp)
                gather_s += _ring_gather_s(wbytes_e, expert_shard, bw_exp)
            if p.zero == 1 and p.offload == "none":
                # Gradients accumulate unsharded; one reduce-scatter per step, then the updated shards
                # are all-gathered after the optimizer step: exposed in the eager step, overlapped with
                # the next step's first forward in Megatron-Core (--overlap-param-gather, on in NeMo's and
                # Megatron-Bridge's performance recipes: its forward pre-hooks wait bucket by bucket).
                in_bwd_window = reduce_s + buckets * lat
                if tr.framework == "pytorch":
                    dp_fixed_s = gather_s + buckets * lat
                else:
                    in_fwd_window = gather_s + buckets * lat
            elif p.zero <= 2:
                # Gradients are sharded, so every micro-batch reduce-scatters its own (DeepSpeed ZeRO-2,
                # FSDP SHARD_GRAD_OP without no_sync), hidden behind the backward passes. ZeRO-1 with the
                # optimizer offloaded too: its gradients leave for the host as they are produced
                # (ZeRO-Offload accumulates them there, Ren et al. 2021), so none stay on the GPU to
                # accumulate, as the memory part counts. Reduced once per step instead, the 405B plan
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
    return in_fwd_window, in_bwd_window, in_step_window, dp_fixed_s


def _optimizer_s(setup: Setup, dense_gpu: float, expert_gpu: float, mb: int) -> tuple[float, float, float, float]:
    """Seconds of (the optimizer step on the GPU, host work never overlapped, gradients out to the
    host, weights streamed in) in one step; the last two hide behind the step's work."""
    tr, p, hw = setup.train, setup.parallel, setup.hardware
    dense_shard = p.dp * p.cp
    expert_shard = dense_shard // p.ep
    # Optimizer step: memory-bound, ~28 bytes per parameter for AdamW (read grad, master, m, v; write
    # master, m, v, 16-bit weight), 20 for SGD, 12 for Adafactor.
    opt_bytes_per_param = {"adamw": 28.0, "sgd": 20.0, "adafactor": 12.0}[tr.optimizer]
    opt_params = dense_gpu / (dense_shard if p.zero >= 1 else 1) + expert_gpu / (expert_shard if p.zero >= 1 else 1)
    if p.offload == "none":
        return opt_params * opt_bytes_per_param / (hw.mem_bw_bytes_per_s * MEM_BW_EFFICIENCY_FRAC), 0.0, 0.0, 0.0
    link = hw.host_link_bw_bytes_per_s * COMM_EFFICIENCY_FRAC
    host_bw = hw.host_mem_bw_bytes_per_s / hw.gpus_per_node * MEM_BW_EFFICIENCY_FRAC
    cpu_step_s = opt_params * opt_bytes_per_param / host_bw
    # Each micro-batch's gradient partitions go out as its backward makes them (accumulated on the
    # host: the GPU keeps none), overlapped with the step's work, as DeepSpeed's ZeRO-Offload and
    # FSDP2's CPUOffloadPolicy do. The profiled one-device step (advisor.run.step's HostOffloadOptimizer)
    # is simpler: it copies the accumulated gradients once, in its exposed offload phase.
    grad_e = 4.0 if tr.precision == "fp32" or tr.fp32_grads or tr.autocast else 2.0
    d2h_s = mb * opt_params * grad_e / link
    h2d_s = opt_params * 2.0 / link  # updated 16-bit weights back
    stream_s = 0.0
    if p.offload == "optimizer+params":
        stream_s = mb * 2 * opt_params * 2.0 / link  # weight shards in, forward and backward
    return 0.0, cpu_step_s + h2d_s, d2h_s, stream_s


def _activation_offload_s(setup: Setup, step_work_s: float, mb: int, tokens_mb: float, slowdown: float) -> float:
    """Exposed seconds of activation offload in one step: each micro-batch's offloaded activations go
    out during its forward and come back during its backward on the host link (PCIe, or NVLink-C2C on
    GH200/GB200: one direction each, so they do not share it), overlapped with that pass's work (a
    third and two thirds of the stage's). The host link is not the network, so this competes with no
    DP traffic."""
    m, tr, p = setup.model, setup.train, setup.parallel
    link = setup.hardware.host_link_bw_bytes_per_s * COMM_EFFICIENCY_FRAC
    act_offload_s = 0.0
    if tr.offload_activations and link > 0:
        moe_frac = m.n_moe_layers / m.n_layers
        per_block = (1 - moe_frac) * kept_bytes_per_token(setup, False)
        if m.is_moe:
            per_block += moe_frac * kept_bytes_per_token(setup, True)
        blocks_off = min(m.n_layers / p.pp, tr.offload_activations * p.vpp)  # of the rank's blocks
        copy_s = mb * blocks_off * per_block * tokens_mb / link
        for window in (step_work_s / 3.0, 2.0 * step_work_s / 3.0):
            act_offload_s += max(0.0, copy_s - window) + slowdown * min(copy_s, window)
    return act_offload_s


# A NamedTuple for the reason ``advisor.estimate.memory.PipelineMemory`` is one.
class StepTime(NamedTuple):
    """One optimizer step of a Setup: its time on the slowest GPU, its FLOPs, throughput and MFU, and
    the rates its kernels run at."""

    time: TimeBreakdown
    model_flops_per_step: float
    """Global, PaLM/Narayanan convention: 6N + 12*L*s*q per token, no recompute, full attention."""
    hardware_flops_per_step: float
    """Global FLOPs executed: recompute included, causal flash attention counted at half."""
    tokens_per_s: float
    mfu_frac: float
    """Model FLOPs per GPU per second over the precision's peak [PaLM]."""
    hfu_frac: float
    """The same with the hardware FLOPs."""
    gemm_frac: float
    """Share of the precision's peak this layout's GEMMs reach (``advisor.estimate.efficiency``)."""
    attention_frac: float
    """Share of the 16-bit peak its attention reaches, forward and backward together."""


def step_time(setup: Setup, memory: PipelineMemory, params: EfficiencyParams) -> StepTime:
    """Step time in milliseconds, part by part, FLOPs, tokens/s and MFU of one optimizer step of
    ``setup``, whose GPUs hold the parameters ``memory`` counts; ``params`` are the rate model's
    constants."""
    m, tr, p, hw = setup.model, setup.train, setup.parallel, setup.hardware
    t, pp, v, cp = p.tp, p.pp, p.vpp, p.cp
    mb = setup.grad_accum
    slowdown = params.overlap_slowdown_frac
    tokens_mb = tr.micro_batch * tr.seq_len / cp  # tokens one GPU processes per micro-batch
    model_flops_tok, hw_flops_tok, recompute_tok, attn_fwd_exec, recompute_share = _flops_per_token(setup)
    tokens_step = setup.tokens_per_step
    rate, attn_rate = _rates(
        m, t, p.ep, int(tokens_mb), int(tr.seq_len // cp), tr.precision, tr.framework, tr.flash_attention, hw, params
    )

    shard = t * pp * cp
    tokens_gpu_step = mb * tr.micro_batch * tr.seq_len  # per model replica; divided by the model-parallel shards
    attn_exec_tok = 3.0 * attn_fwd_exec
    compute_s = ((hw_flops_tok - attn_exec_tok) / rate + attn_exec_tok / attn_rate) * tokens_gpu_step / shard
    recompute_attn_tok = attn_fwd_exec * (recompute_share if tr.recompute == "full" else 1.0)
    if tr.recompute in ("none", "selective-op"):
        recompute_attn_tok = 0.0
    recompute_s = (
        ((recompute_tok - recompute_attn_tok) / rate + recompute_attn_tok / attn_rate) * tokens_gpu_step / shard
    )
    # 1F1B runs at the pace of its slowest stage, so what is per stage is the slowest rank's: its FLOPs
    # (blocks and the head, stage_imbalance) and its blocks (layers_stage: per-block recompute, traffic
    # and collectives). An even split would hold n_layers / pp blocks and an even share of the head.
    lag, layer_lag, last_slowest = _slowest_rank(setup)
    layers_stage = m.n_layers / pp * layer_lag
    compute_s *= lag
    recompute_s *= layer_lag
    memory_bound_s = _memory_bound_s(setup, layers_stage, recompute_share, last_slowest, mb, tokens_mb, params)
    busy_s = compute_s + recompute_s + memory_bound_s
    kernel_overhead_s = _kernel_overhead_s(setup, layers_stage, recompute_share, mb, busy_s, params)
    tp_s, cp_s, ep_s, pp_s = _model_parallel_comm_s(
        setup, layers_stage, recompute_share, mb, tokens_mb, attn_fwd_exec, attn_rate, slowdown
    )

    # Data parallel. Communication hides behind windows: the first micro-batch's forward (the weight
    # gather of Megatron's ZeRO-1), the last micro-batch's backward (the gradient reduction of DDP and
    # ZeRO-1) and the whole step's work (per-micro-batch collectives of ZeRO-2/3, offloaded gradients'
    # copy out and streamed offloaded weights). What shares a window competes for it: exposed =
    # max(0, everything hidden there - the window).
    step_work_s = compute_s + recompute_s + memory_bound_s + tp_s + kernel_overhead_s
    bwd_last_mb_s = (2.0 / 3.0) * (compute_s + memory_bound_s) / mb
    dense_gpu, expert_gpu = memory.dense_params_per_gpu, memory.expert_params_per_gpu
    in_fwd_window, in_bwd_window, in_step_window, dp_fixed_s = _dp_comm_needs_s(
        setup, dense_gpu, expert_gpu, layers_stage, mb
    )
    # Pipeline bubble: (p-1)/(v*m) of the ideal per-stage time [Narayanan].
    bubble_s = (pp - 1) / (v * mb) * step_work_s if pp > 1 else 0.0
    optimizer_s, offload_fixed_s, d2h_s, stream_s = _optimizer_s(setup, dense_gpu, expert_gpu, mb)
    act_offload_s = (
        _activation_offload_s(setup, step_work_s, mb, tokens_mb, slowdown) if tr.offload_activations else 0.0
    )
    # Each window's exposed time, split between DP communication and offload by their share of it.
    gpu = hw.kind == "gpu"
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
    model_flops = model_flops_tok * tokens_step
    hw_flops = (hw_flops_tok + recompute_tok) * tokens_step
    gpus = setup.gpus
    peak = hw.peak_flops(tr.precision)
    return StepTime(
        time,
        model_flops,
        hw_flops,
        tokens_step / step_s,
        model_flops / gpus / step_s / peak,
        hw_flops / gpus / step_s / peak,
        rate / peak,
        attn_rate / hw.peak_flops("bf16" if tr.precision == "fp8" else tr.precision),
    )


def narayanan_flops_per_iteration(
    batch: int, seq: int, layers: int, hidden: int, vocab: int, full_recompute: bool
) -> float:
    """FLOPs per iteration of a GPT model [Narayanan eq. 3]: 72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h)),
    or 96*... with V/(16*l*h) under full recompute."""
    if full_recompute:
        return 96.0 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    return 72.0 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))
