"""Per-GPU memory of a Setup: model states, saved activations, buffers and the runtime allowance of
the pipeline ranks that matter (the first, the last, and the fullest), by pure arithmetic.

Sources, cited where each number is used:
- [ZeRO] Rajbhandari et al. 2019, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
  Models": 16 bytes per parameter for mixed-precision Adam (2 weight + 2 grad + 12 optimizer) and the
  sharded forms of stages 1-3.
- [Korthikanti] Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models": activation bytes per layer with TP, SP, selective and full recompute, and pipeline
  in-flight micro-batches. Generalised here to GQA, SwiGLU, MoE and runs without dropout by counting
  the saved tensors one by one; with their assumptions it reproduces their formulas exactly.

The step time (``advisor.estimate.steptime``) reads the parameters per GPU from here, and the
saved-activation bytes for its elementwise traffic and activation offload.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from advisor.spec.frozen import fast_init
from advisor.spec.specs import Setup
from advisor.spec.stages import blocks_per_rank, moe_blocks_per_rank, stage_layers

# Caching-allocator fragmentation: reserved minus allocated memory, as a share of allocated
# (PyTorch "CUDA semantics: memory management"; 3-8 % on steady training steps).
FRAGMENTATION_FRAC = 0.05
# The same for the eager PyTorch step (framework 'pytorch'), which allocates and frees every tensor on its
# own rather than in Megatron-LM's flat buffers. Fitted once on the nine published runs that give their
# peak (torchtitan's and Trainy's max reserved, bench/published_runs.py: the fraction that minimises the
# mean absolute error, 0.100; fitted on either source alone, 0.100 and 0.098, and the other source reads
# within 2.4 % but for torchtitan's 70B 2D run, 3.5 % low: the one with TP, whose sequence-parallel
# collectives' buffers, ``sp_collective_bytes``, are counted on their own).
EAGER_FRAGMENTATION_FRAC = 0.10
# PyTorch DDP's gradient buckets (torch/nn/parallel/distributed.py): bucket_cap_mb defaults to 25 MiB,
# and the bucket rebuilt after the first iteration for the gradients that arrive first is capped at
# dist._DEFAULT_FIRST_BUCKET_BYTES, 1 MiB. A bucket closes once it reaches its cap, so a tensor larger
# than the cap is a bucket of its own and ceil-counting by the cap bounds the number of buckets from above.
DDP_BUCKET_BYTES = 25 * 2**20
DDP_FIRST_BUCKET_BYTES = 2**20
# Gradient buffers a Megatron-LM / DeepSpeed-style step keeps in flight beside its gradients, as a
# number of DDP_BUCKET_BYTES buckets (never more than the gradients themselves).
BUCKETS_IN_FLIGHT = 2


@fast_init
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
    if optimizer == "adamw":
        states = 8.0
    elif optimizer == "sgd":
        states = 4.0
    elif optimizer == "adafactor":
        states = 8.0 / hidden
    else:
        raise KeyError(optimizer)
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


# One estimate asks the same questions of its setup for each pipeline rank it weighs and again for the
# step time: the split into stages and the saved bytes per token. The answers of the last setup asked
# about are kept here, keyed by the object itself (frozen: its answers never change): on the
# estimator_speed grid they were 2.7 activation counts and 8.5 stage splits per estimate. A thread that
# finds another setup's answers starts its own; the answers are the same either way.
_MEMO: tuple[object, dict] = (None, {})


def setup_memo(setup: Setup) -> dict:
    """The answers kept for ``setup`` (empty for a setup not asked about last)."""
    global _MEMO
    held = _MEMO
    if held[0] is not setup:
        held = _MEMO = (setup, {})
    return held[1]


def _stages(setup: Setup) -> tuple[int, ...]:
    """``stage_layers(setup)``, kept."""
    memo = setup_memo(setup)
    stages = memo.get("stages")
    if stages is None:
        stages = memo["stages"] = stage_layers(setup)
    return stages


def rank_blocks(setup: Setup) -> tuple[float, ...]:
    """``blocks_per_rank`` of the setup's stages, kept."""
    memo = setup_memo(setup)
    blocks = memo.get("blocks")
    if blocks is None:
        blocks = memo["blocks"] = blocks_per_rank(_stages(setup), setup.parallel.pp)
    return blocks


def _rank_layers(setup: Setup, first: bool, last: bool, rank: int | None = None) -> float:
    """Blocks held by pipeline rank ``rank`` (default: the first, or the last with ``last`` and not
    ``first``); a rank holds every pp-th stage under interleaving (``stage_layers``)."""
    p = setup.parallel
    if p.pp == 1:
        return float(setup.model.n_layers)
    if rank is None:
        rank = 0 if first else p.pp - 1
    return rank_blocks(setup)[rank]


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
    return moe_blocks_per_rank(_stages(setup), p.pp, m.moe_layer_step)[rank]


def _last_chunk_layers(setup: Setup) -> float:
    """Blocks of the last pipeline stage (the last rank's last chunk under interleaving)."""
    return float(_stages(setup)[-1])


def _block_params(setup: Setup) -> tuple[float, float, float, float, float, float, float]:
    """Parameters of one block on one GPU after TP and EP, the same on every pipeline rank: (a dense
    block's, a dense block's that enter a matmul, an MoE block's outside its routed experts, its local
    routed experts (a count), one routed expert's, an MoE block's that enter a matmul, an MoE block's in
    all); the MoE ones 0 for a dense model."""
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
    dense_layer = attn + mlp(m.ffn_hidden) + norms
    dense_mm = attn_mm + mats * h * m.ffn_hidden / t
    if not m.is_moe:
        return dense_layer, dense_mm, 0.0, 0.0, 0.0, 0.0, 0.0
    local_experts = m.n_experts / p.ep
    moe_shared = attn + m.router_params + m.n_shared_experts * mlp(m.expert_ffn_hidden) + norms
    expert_mlp = mlp(m.expert_ffn_hidden)
    expert_mm = (local_experts + m.n_shared_experts) * mats * h * m.expert_ffn_hidden / t
    moe_mm = attn_mm + m.router_params + expert_mm
    moe_block = moe_shared + local_experts * expert_mlp
    return dense_layer, dense_mm, moe_shared, local_experts, expert_mlp, moe_mm, moe_block


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
    t, h = p.tp, m.hidden
    memo = setup_memo(setup)
    per_block = memo.get("block_params")
    if per_block is None:
        per_block = memo["block_params"] = _block_params(setup)
    dense_layer, dense_mm, moe_shared, local_experts, expert_mlp, moe_mm, moe_block = per_block
    moe_layers = _rank_moe_layers(setup, first, last, rank)
    dense_layers = _rank_layers(setup, first, last, rank) - moe_layers
    dense = dense_layers * dense_layer
    matmul = dense_layers * dense_mm
    expert = 0.0
    block = dense_layer
    if m.is_moe:
        dense += moe_layers * moe_shared
        expert = moe_layers * local_experts * expert_mlp
        matmul += moe_layers * moe_mm
        # The largest block this rank holds (ZeRO-3 gathers one at a time): a rank of dense blocks only
        # (Maverick's stages of one block) never gathers an MoE block.
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
    """Saved-activation bytes per token for one block on one GPU: (total, elementwise part), as
    ``_activation_bytes_per_token`` counts them, kept for the setup's other ranks and its step time."""
    memo = setup_memo(setup)
    key = (moe, recompute)
    out = memo.get(key)
    if out is None:
        out = memo[key] = _activation_bytes_per_token(setup, moe, recompute)
    return out


def _activation_bytes_per_token(setup: Setup, moe: bool, recompute: str | None) -> tuple[float, float]:
    """Saved-activation bytes per token for one block on one GPU: (total, elementwise part), the
    elementwise part being the s^2-free tensors the block's elementwise ops write (the step time's
    traffic): without the s x s scores, and without DTensor SP's gathered linear inputs.

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
            if eager and tr.compile and len(order) % 2:
                # Compiled, the policy tags the graph and AOTAutograd's partitioner saves only what the
                # backward reads (torch/_functorch/partitioners.py): the block's last matmul output (the
                # SwiGLU down projection's, the 7th) feeds only the residual add, whose backward reads no
                # input, so it is not kept; eager SAC caches every saved op's output. Measured by
                # torchtitan: 82.4 -> 77.0 GiB and 67.0 -> 62.0 GiB with torch.compile on Llama 3.1 8B.
                kept = kept[:-1]
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
    total = base + scores / t
    if p.sequence_parallel and eager:
        # DTensor's sequence parallelism (the eager step: torchtitan 9dec370 torchtitan/parallelisms/
        # parallelize_llama.py:177,186, PrepareModuleInput(input_layouts=Shard(1),
        # desired_input_layouts=Replicate()) on attention and feed_forward; advisor.run.parallel.apply_tp)
        # all-gathers the norm output before q/k/v and gate/up, and F.linear saves the gathered, whole
        # sequence; Megatron-LM saves its shard and gathers it again in backward. The norms' own inputs
        # stay sharded. Written by the all-gather and read by matmuls only, these bytes are left out of
        # the elementwise part.
        total += linear_inputs * (1 - 1 / t)
    return total, base


def loss_bytes_per_logit(setup: Setup) -> tuple[float, float]:
    """(saved from the forward, added during the loss backward) bytes per logit of one GPU's cross-entropy.

    - Megatron-LM's vocab-parallel cross-entropy keeps its fp32 softmax and writes the gradient in place
      over it: (4, 0).
    - A fused loss on the eager step (flash-attn's, Liger's, ``fused_loss``) keeps the 16-bit logits and
      writes their gradient in place: (e, 0).
    - A compiled loss (``TrainSpec.loss_compiled``: F.cross_entropy over ``logits.float()`` under
      torch.compile) keeps the 16-bit logits, its graph input, and a log-sum-exp per row; its backward is
      one fused kernel that writes the 16-bit gradient (inductor turns the one-hot scatter into a select,
      post_grad.py ``scatter_upon_const_tensor``): (e, e).
    - PyTorch's eager cross-entropy keeps the fp32 log-softmax; its backward holds the fp32 gradient of the
      log-softmax and of the logits: (4, 8) in every precision (measured, bench/results/dryrun_accuracy_cpu.md).
    - Under tensor parallelism the eager step's loss is DTensor's loss_parallel, whose backward
      (torch/distributed/tensor/parallel/loss.py, ``_nll_loss_and_log_softmax_backward``) builds
      ``(zeros_like(x) + exp(x)) * grad``: three fp32 temporaries beside the saved log-softmax, (4, 12).

    e is the logits' element size (4 under fp32, else 2).
    """
    tr = setup.train
    if tr.framework != "pytorch":
        return 4.0, 0.0
    e = 4.0 if tr.precision == "fp32" else 2.0
    if tr.fused_loss:
        return e, 0.0
    if tr.loss_compiled:
        return e, e
    return 4.0, 12.0 if setup.parallel.tp > 1 else 8.0


def kept_bytes_per_token(setup: Setup, moe: bool) -> float:
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
    per_block = dense_layers * kept_bytes_per_token(setup, moe=False)
    if moe_layers:
        per_block += moe_layers * kept_bytes_per_token(setup, moe=True)
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
) -> tuple[float, float, float]:
    """(saved, working, offloaded) activation bytes of one stage: what is saved for backward over all
    micro-batches in flight, and, under full recompute, the one block being recomputed (alive after the
    loss backward has freed its buffers, so the two never add up); and what activation offload keeps
    on the host. The last stage's head and loss hold one micro-batch (1F1B runs its backward right after
    its forward), or every one in flight under GPipe."""
    m, tr, p = setup.model, setup.train, setup.parallel
    moe_layers = _rank_moe_layers(setup, first, last, rank)
    dense_layers = _rank_layers(setup, first, last, rank) - moe_layers
    dense_tok, _ = activation_bytes_per_token(setup, moe=False)
    moe_tok, _ = activation_bytes_per_token(setup, moe=True) if m.is_moe else (0.0, 0.0)
    kept_dense, kept_moe = dense_tok, moe_tok
    if tr.recompute == "full" and tr.recompute_layers:  # the other blocks keep every tensor
        kept_dense = kept_bytes_per_token(setup, moe=False)
        kept_moe = kept_bytes_per_token(setup, moe=True) if m.is_moe else 0.0
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
        # Final norm input and head input, plus what the loss saves per logit (``loss_bytes_per_logit``).
        head_mb = in_flight if _gpipe(setup) else 1.0
        per_logit = loss_bytes_per_logit(setup)[0]
        sp = p.tp if p.sequence_parallel else 1
        # Under DTensor TP (the eager step, as torchtitan's plan and advisor.run.parallel.apply_tp) the
        # head's ColwiseParallel all-gathers the sequence-sharded norm output before F.linear, which saves
        # the gathered input; Megatron-LM saves its shard and gathers it again in backward.
        head_in = e * m.hidden / (1 if tr.framework == "pytorch" else sp)
        acts += (resid * m.hidden / sp + head_in + per_logit * m.vocab / p.tp) * tokens_mb * head_mb
    return acts, working, max(0.0, offloaded)


# --- one stage, and the pipeline ---------------------------------------------------------------


def _model_state_bytes(
    setup: Setup, dense: float, expert: float, fsdp2: bool
) -> tuple[float, float, float, float, float]:
    """(weights, grads, optimizer, host, shard_params) of one GPU holding ``dense`` and ``expert``
    parameters: bytes on the GPU after ZeRO sharding and CPU offload, bytes offloaded to the host, and
    the parameters this GPU's optimizer updates (its ZeRO shard). ``fsdp2``: ``_eager_fsdp2(setup)``."""
    m, tr, p = setup.model, setup.train, setup.parallel
    dense_shard = p.dp * p.cp
    expert_shard = dense_shard // p.ep
    # FSDP2 shards weights, gradients and optimizer states at every stage (ZeRO-1 runs as ZeRO-2).
    # zero_model_state_bytes of the dense and the expert parameters, its arithmetic inlined.
    zero = 3 if fsdp2 else p.zero
    w, g, o = bytes_per_param(tr.precision, tr.optimizer, m.hidden, tr.fp32_grads, tr.autocast)
    weights = dense * w / (dense_shard if zero >= 3 else 1) + expert * w / (expert_shard if zero >= 3 else 1)
    grads = dense * g / (dense_shard if zero >= 2 else 1) + expert * g / (expert_shard if zero >= 2 else 1)
    opt = dense * o / (dense_shard if zero >= 1 else 1) + expert * o / (expert_shard if zero >= 1 else 1)
    shard_params = dense / (dense_shard if p.zero else 1) + expert / (expert_shard if p.zero else 1)
    host = 0.0
    if p.offload != "none":
        # ZeRO-Offload: fp32 master, states and gradients live on the host; the GPU keeps only
        # gradient buckets on their way out.
        host += opt + shard_params * 4.0
        opt, grads = 0.0, 0.0
    if p.offload == "optimizer+params":
        host += weights
        weights = 0.0
    return weights, grads, opt, host, shard_params


def _with_autocast_copies(
    setup: Setup, saved: float, working: float, matmul: float, first: bool, last: bool, rank: int | None
) -> tuple[float, float, float]:
    """(saved, working, head copy) bytes with autocast's 16-bit copies of fp32 weights added (autocast
    over fp32 parameters, not FSDP2's 16-bit gathers): saved by every linear for its backward; under
    full recompute only the head's survives the forward, and the recomputed block makes its own; so
    under op-level recompute, whose policy saves no cast (measured with the dry run)."""
    m, tr, p = setup.model, setup.train, setup.parallel
    head_cast = 2.0 * m.vocab * m.hidden / p.tp if last else 0.0
    block_cast = 2.0 * (matmul - m.vocab * m.hidden / p.tp * last)
    if tr.recompute in ("full", "selective-op"):
        # Partial recompute: the blocks that keep their activations keep their casts too.
        n_layers = _rank_layers(setup, first, last, rank)
        recomputing = min(n_layers, tr.recompute_layers * p.vpp) if tr.recompute_layers else n_layers
        saved += block_cast * (n_layers - recomputing) / n_layers if n_layers else 0.0
        working += block_cast / n_layers if n_layers else 0.0
    else:
        saved += block_cast
    return saved, working, head_cast


def _buffer_bytes(
    setup: Setup, dense: float, expert: float, block: float, root: float, last: bool, fsdp2: bool
) -> tuple[float, float, float]:
    """Communication buffers of one GPU, in bytes: (when backward begins, later in backward, at the
    optimizer step). ``block`` and ``root`` are parameters as ``_stage_params`` counts them."""
    m, tr, p = setup.model, setup.train, setup.parallel
    grad_e = 4.0 if tr.precision == "fp32" or tr.fp32_grads or tr.autocast else 2.0
    dense_shard = p.dp * p.cp
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
        # FSDP2 gathers fp32 weights, or 16-bit ones under its MixedPrecisionPolicy; unsharded gradients
        # come in the gathered weights' dtype and are reduce-scattered from an fp32 copy (reduce_dtype).
        gather_e = 2.0 if tr.autocast else 4.0
        reduce_scatter = block * 4.0
        begin = (root + block) * gather_e if p.zero >= 3 else (dense + expert) * gather_e
        late = begin + (block * gather_e if p.zero >= 3 else 0.0) + reduce_scatter
        if setup.hardware.kind == "gpu":
            # The flat all-gather outputs live in the all-gather copy-in stream's pool, beside the gathered
            # parameters the copy-out writes on the compute stream; FSDP2 holds the previous group's output
            # until the next all-gather has waited on it (AllGatherState, _fsdp_param_group.py), so that
            # pool peaks at the root's and a block's, or two blocks'.
            pool = (max(root, block) + block) * gather_e
            begin += pool
            late += pool
        late_extra = gather_e * m.vocab * m.hidden / p.tp if last else 0.0
        at_step = 0.0
    elif tr.framework == "pytorch" and p.zero == 0 and dense_shard > 1:
        # torch DDP (the eager step's ZeRO-0, as advisor.run.parallel runs it) allocates every bucket's
        # flat gradient buffer up front and keeps it: with the default gradient_as_bucket_view=False that
        # is a second copy of all gradients ("the saved memory size will be equal to the total gradients
        # size", DistributedDataParallel docs).
        begin = late = at_step = grad_bytes
    elif p.zero >= 3 or p.offload == "optimizer+params":
        begin = late = at_step = 2 * block * 2.0 + block * grad_e  # two gathered blocks (prefetch) + one grad block
    elif dense_shard > 1 or p.offload != "none":
        begin = late = at_step = min(BUCKETS_IN_FLIGHT * DDP_BUCKET_BYTES, grad_bytes)
    else:
        begin = late = at_step = 0.0
    return begin, late + late_extra, at_step


def sp_collective_bytes(setup: Setup, tokens_mb: float) -> float:
    """Bytes of the full-sequence buffers a block's collectives take under DTensor sequence parallelism
    (the eager step with tp > 1 and sequence parallelism; 0 otherwise), for ``tokens_mb`` tokens.

    A row-parallel projection (o_proj, down: RowwiseParallel(output_layouts=Shard(1)), torchtitan 9dec370
    torchtitan/parallelisms/parallelize_llama.py:184,191; advisor.run.parallel.apply_tp) writes its
    partial sum for the whole sequence, and DTensor's Partial -> Shard(1) redistribute calls funcol's
    reduce_scatter_tensor, which first copies it with the scatter dim first
    (torch/distributed/_functional_collectives.py, reduce_scatter_tensor: ``if scatter_dim != 0:
    torch.cat(torch.chunk(self, group_size, dim=scatter_dim))``, as in the torch 2.5-2.6 of December
    2024): two 16-bit (fp32 under fp32) tensors of the micro-batch's whole sequence, hidden wide, t times
    the size of the sharded activations around them. Backward starts each block with the mirror image:
    the output gradient all-gathered (the gathered buffer and its cat along the sequence). Under float8
    the matmul still writes bf16 (torchao's Float8RowwiseParallel reduce-scatters its bf16 output).
    Megatron-LM's sequence-first layout scatters dim 0 without the copy, and its buffers are not counted
    here."""
    tr, p = setup.train, setup.parallel
    if tr.framework != "pytorch" or p.tp == 1 or not p.sequence_parallel:
        return 0.0
    e = 4.0 if tr.precision == "fp32" else 2.0
    return 2.0 * e * setup.model.hidden * tokens_mb


def sp_cached_bytes(setup: Setup, tokens_mb: float, last: bool) -> float:
    """Bytes the caching allocator keeps reserved for the sequence-parallel collectives' buffers
    (``sp_collective_bytes``) when the loss's backward begins, on a GPU's last pipeline rank; 0 elsewhere.

    It releases nothing short of an out-of-memory retry or empty_cache, and serves a request only from a
    free block at least as large (c10/cuda/CUDACachingAllocator.cpp), so the segments the forward's
    reduce-scatters took stay reserved while the loss runs: its tensors, vocab/t logits a token, are
    larger than those hidden-wide rows and cannot reuse them (where vocab/t is not larger, they could,
    and nothing is counted). The published evidence: torchtitan's Llama 3.1 70B 2D run
    (benchmarks/llama3_h100_202412_torchtitan.md Table 4) takes 71.9 GiB, and 67.6 GiB with async TP,
    whose fused matmul-reduce-scatter never makes these buffers; the term is 2 x 2 bytes x 8,192 x
    131,072 tokens = 4.0 GiB there, 4.4 GiB with the fragmentation allowance."""
    m = setup.model
    if setup.hardware.kind != "gpu" or not last or m.vocab / setup.parallel.tp <= m.hidden:
        return 0.0
    return sp_collective_bytes(setup, tokens_mb)


def stage_memory(
    setup: Setup, first: bool, last: bool, in_flight: float, rank: int | None = None
) -> tuple[MemoryBreakdown, float, float]:
    """(memory, dense parameters, expert parameters) of one GPU of a pipeline rank: the first (or the
    only) with ``first``, the last with ``last``, else rank ``rank``, holding ``in_flight``
    micro-batches' activations. The memory is the rank's at its fullest moment: when backward begins
    (activations and loss buffers alive), later in backward (loss buffers freed: a recomputed block,
    FSDP2's gathers and reduce-scatters) or during the optimizer step (all gradients and the
    optimizer's scratch)."""
    m, tr, p, hw = setup.model, setup.train, setup.parallel, setup.hardware
    t = p.tp
    tokens_mb = tr.micro_batch * tr.seq_len / p.cp  # tokens one GPU processes per micro-batch
    fsdp2 = _eager_fsdp2(setup)
    dense, expert, block, matmul, root = _stage_params(setup, first, last, rank)
    weights, grads, opt, host, shard_params = _model_state_bytes(setup, dense, expert, fsdp2)
    saved, working, offloaded_acts = _activation_memory(setup, tokens_mb, in_flight, first, last, rank)
    host += offloaded_acts
    head_cast = 0.0
    if tr.autocast and not fsdp2:
        saved, working, head_cast = _with_autocast_copies(setup, saved, working, matmul, first, last, rank)
    begin, late, at_step = _buffer_bytes(setup, dense, expert, block, root, last, fsdp2)
    eager = tr.framework == "pytorch"
    loss = loss_bytes_per_logit(setup)[1] * m.vocab / t * tokens_mb if last else 0.0
    # foreach kernels build one fp32 temporary the size of the parameters they update (the
    # sqrt of exp_avg_sq for AdamW); fused kernels none; a for-loop one tensor at a time.
    scratch = {"foreach": 4.0 * shard_params, "fused": 0.0, "for-loop": 4.0 * m.vocab * m.hidden / t}
    opt_scratch = 0.0 if p.offload != "none" else scratch[tr.optimizer_impl]
    # Gradients outlive the step where a framework keeps gradient buffers (Megatron's main_grad) or
    # micro-batches accumulate into them; the eager step frees them (zero_grad(set_to_none=True)), under
    # DDP and FSDP2 too (DDP's own copy in its buckets is counted with the buffers). On a GPU, FSDP2's
    # gradient shards are views of the reduce-scatter output, allocated on its reduce-scatter stream
    # (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, foreach_reduce); the caching allocator
    # reuses a block only on the stream it was allocated on, so once freed the shards' bytes stay
    # reserved in that stream's pool through the next forward and backward.
    persistent_grads = not eager or setup.grad_accum > 1 or (fsdp2 and hw.kind == "gpu")
    # Backward begins with the loss buffers; a recomputed block comes after they are freed.
    g = grads if persistent_grads else 0.0
    # The sequence-parallel collectives' buffers: live while a block runs its backward; when the loss's
    # backward begins, still reserved (``sp_cached_bytes``).
    sp_buffers = sp_collective_bytes(setup, tokens_mb)
    cached = sp_cached_bytes(setup, tokens_mb, last)
    backward_begins = (weights, g, opt, saved + head_cast, begin + loss + cached)
    backward_later = (weights, g, opt, saved + working, late + sp_buffers)
    step = (weights, grads, opt, 0.0, at_step + opt_scratch)
    backward = backward_begins if sum(backward_begins) >= sum(backward_later) else backward_later
    w, g, o, a, buf = backward if sum(backward) >= sum(step) else step
    moment = "backward" if (w, g, o, a, buf) == backward else "optimizer step"
    frag = EAGER_FRAGMENTATION_FRAC if eager else FRAGMENTATION_FRAC
    overhead = hw.runtime_overhead_bytes + (frag * (w + g + o + a + buf) if hw.kind == "gpu" else 0.0)
    return MemoryBreakdown(w, g, o, a, buf, overhead, host, moment), dense, expert


# A NamedTuple, not a frozen dataclass: one is built for every estimate, in the planner's inner loop,
# and building and reading eight fields takes 5.7k machine instructions as a NamedTuple against 13.7k
# as a frozen slots dataclass (Python 3.11, counted with valgrind's cachegrind).
class PipelineMemory(NamedTuple):
    """Memory of the pipeline ranks an estimate reports, and the parameters the ranks hold (after TP,
    PP and EP, before ZeRO sharding): the largest count of any rank, of each kind."""

    fullest: MemoryBreakdown
    """The rank with the most memory: the first, the last, or with uneven stages a middle one that
    holds more blocks (weights, or activations in flight) than the first."""
    fullest_rank: int
    """The pipeline rank ``fullest`` is (0 without a pipeline)."""
    first: MemoryBreakdown
    last: MemoryBreakdown
    params_per_gpu: float
    """Parameters of the rank holding the most."""
    dense_params_per_gpu: float
    """Parameters outside the routed experts (all of a dense model's), sharded over DP x CP."""
    expert_params_per_gpu: float
    """Routed experts' parameters, sharded over the expert data-parallel group."""
    host_bytes_per_node: float
    """Host memory the offloaded state of one node's GPUs takes (the rank offloading most, times
    the GPUs of a node the job uses)."""


def pipeline_memory(setup: Setup) -> PipelineMemory:
    """Per-GPU memory, in bytes, of the first, the last and the fullest pipeline rank of ``setup``, with
    the parameters they hold; one rank without a pipeline."""
    m, p = setup.model, setup.parallel
    pp, v, mb = p.pp, p.vpp, setup.grad_accum
    # 1F1B: stage 0 holds min(pp, m) micro-batches; interleaving adds (p-1)/(p*v) [Korthikanti 4.2.3].
    in_flight_first = min(pp, mb) * ((1 + (pp - 1) / (pp * v)) if v > 1 else 1.0)
    mem_first, dense_first, expert_first = stage_memory(setup, True, pp == 1, in_flight_first)
    gpipe = _gpipe(setup)
    if pp > 1:
        # The last rank runs each micro-batch's backward right after its forward through the last
        # chunk; interleaved, it first runs (v-1) x pp warm-up forwards of its earlier chunks (torch's
        # and Megatron-LM's schedules), so at its first backward it holds min(pp, m) micro-batches of
        # those chunks and one of the last. Under GPipe it holds all m.
        held, last_chunk = _rank_layers(setup, False, True), _last_chunk_layers(setup)
        in_flight_last = float(mb) if gpipe else (min(pp, mb) * (held - last_chunk) + last_chunk) / held
        mem_last, dense_last, expert_last = stage_memory(setup, False, True, in_flight_last)
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
        stages = _stages(setup)
        moe_ranks = moe_blocks_per_rank(stages, pp, m.moe_layer_step) if m.is_moe else (0.0,) * pp
        kinds = list(zip(blocks_per_rank(stages, pp), moe_ranks, strict=True))
        for kind in sorted(set(kinds[1:-1]) - {kinds[0]}):
            r = kinds.index(kind, 1)
            in_flight = ((v + 1) * pp - 2 * r - 1) / v if v > 1 else mb if gpipe else min(pp - r, mb)
            mem_mid, dense_mid, expert_mid = stage_memory(setup, False, False, in_flight, r)
            if mem_mid.total_bytes > worst.total_bytes:
                worst, worst_rank = mem_mid, r
            params_gpu = max(params_gpu, dense_mid + expert_mid)
            dense_gpu, expert_gpu = max(dense_gpu, dense_mid), max(expert_gpu, expert_mid)
            host_rank = max(host_rank, mem_mid.host_bytes)
    host_node = host_rank * min(setup.gpus, setup.hardware.gpus_per_node)
    return PipelineMemory(worst, worst_rank, mem_first, mem_last, params_gpu, dense_gpu, expert_gpu, host_node)
