"""Specs: frozen, validated descriptions of a model, a training step, a parallel layout and hardware.

What the user asked for lives here; everything derived (parameter counts, per-GPU shards) is computed
from it. Each spec validates itself on construction and raises :class:`SpecError` naming the field,
the value and what is allowed. :class:`Setup` holds one of each and runs the cross-field checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from advisor.errors import SpecError
from advisor.spec.frozen import fast_init
from advisor.spec.stages import stage_layers

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
FP8_RECIPES = ("tensorwise", "rowwise")  # torchao's float8 scaling recipes (advisor.run.fp8)
OPTIMIZERS = ("adamw", "sgd", "adafactor")
RECOMPUTE_MODES = ("none", "selective", "selective-op", "full")
OFFLOAD_MODES = ("none", "optimizer", "optimizer+params")
OPTIMIZER_IMPLS = ("for-loop", "foreach", "fused")
FRAMEWORKS = ("megatron", "pytorch")
MLP_KINDS = ("gelu", "swiglu")
NORM_KINDS = ("layernorm", "rmsnorm")
MAX_SEQ_LEN = 2**24
"""16,777,216 tokens: longer than any model card's context (Llama 4 Scout: 10 M); beyond it a figure
only overflows (a sequence of 10^12 tokens read as 3 trillion days)."""
MAX_MICRO_BATCH = 2**16
MAX_GLOBAL_BATCH = 2**26
"""Sequences per step: 67 M, a thousand times the largest published pretraining batch (Llama 3: 16 M
tokens = 2,048 sequences of 8,192)."""
MAX_GPUS = 2**20
"""Devices in one job: 1,048,576, five times the largest cluster built (xAI's Colossus, 200,000 GPUs);
every parallel degree and their product stay within it, so no search or figure grows without bound."""
MAX_LAYERS = 2**16
"""Transformer blocks, heads and experts: 65,536, a hundred times any model card's (Llama 3.1 405B: 126
blocks, 128 heads; DeepSeek-V3: 256 experts)."""
MAX_WIDTH = 2**24
"""Hidden, FFN and head sizes, vocabulary and learned positions: 16,777,216, a hundred times any model
card's (Llama 3.1 405B: hidden 16,384, FFN 53,248; Gemma 3: vocabulary 262,144)."""
MAX_ROPE_SCALING = 256.0
POSITION_KINDS = ("learned", "rope")
HOST_LINKS = ("pcie3", "pcie4", "pcie5", "nvlink-c2c", "none")
DEVICE_KINDS = ("gpu", "cpu")


def divisors_text(n: int) -> str:
    """The divisors of ``n``, increasing, as "1, 2, 4, 8" (what an error message allows)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return ", ".join(str(d) for d in small + [n // d for d in reversed(small) if d * d != n])


def _check_int(name: str, value: object, lo: int, hi: int | None = None) -> None:
    if value.__class__ is int and lo <= value and (hi is None or value <= hi):  # type: ignore[operator]
        return  # the common case, in the fewest instructions: every planner candidate comes through here
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        rng = f"an integer >= {lo}" if hi is None else f"an integer from {lo} to {hi}"
        raise SpecError(name, value, f"must be {rng}")


def _check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise SpecError(name, value, f"must be one of {', '.join(allowed)}")


def _check_spec(name: str, value: object, kind: type, hint: str) -> None:
    if not isinstance(value, kind):
        got = "None" if value is None else f"a {type(value).__name__}"
        raise SpecError(name, value, f"must be a {kind.__name__}, got {got} ({hint})")


def _check_positive(name: str, value: object, *, zero_ok: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (value >= 0 if zero_ok else value > 0)
    if not ok:
        raise SpecError(name, value, "must be a number >= 0" if zero_ok else "must be a number > 0")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A decoder-only transformer: GPT-2 style, Llama style, or mixture-of-experts.

    Counts are exact for the architectures the presets and the config importer cover: every weight
    matrix, bias and norm scale is counted, as ``sum(p.numel() for p in model.parameters())`` would.
    """

    name: str
    n_layers: int
    """Transformer blocks."""
    hidden: int
    """Model width h (residual stream size)."""
    n_heads: int
    """Query heads a."""
    ffn_hidden: int
    """Intermediate size of the dense MLP (4h for GPT-2; 14336 for Llama-3.1-8B)."""
    vocab: int
    """Vocabulary size V as the embedding stores it (GPT-2: 50257, not padded)."""
    n_kv_heads: int = 0
    """Key/value heads (GQA); 0 means the same as n_heads (multi-head attention)."""
    head_dim: int = 0
    """Size of one head; 0 means hidden // n_heads."""
    mlp: str = "swiglu"
    """'gelu' (two matrices, GPT-2) or 'swiglu' (gate, up and down matrices, Llama)."""
    norm: str = "rmsnorm"
    """'layernorm' or 'rmsnorm' (scale only)."""
    norm_bias: bool = False
    """LayerNorm has a bias (GPT-2)."""
    position: str = "rope"
    """'learned' absolute position embeddings (GPT-2) or 'rope' (no parameters)."""
    max_positions: int = 131072
    """Longest sequence the model was trained on (a Hugging Face config's max_position_embeddings, which
    already counts the RoPE scaling it was trained with); the size of the learned position table."""
    rope_scaling: float = 1.0
    """Context extension of RoPE positions beyond max_positions (YaRN, linear or NTK scaling, chosen for
    this run): sequences up to max_positions x rope_scaling are accepted. 1.0: none. Learned positions
    cannot be extended."""
    tied_embeddings: bool = False
    """The output head shares the input embedding matrix."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (GPT-2, Qwen2)."""
    attn_out_bias: bool = False
    """Bias on the attention output projection (GPT-2)."""
    mlp_bias: bool = False
    """Biases on the MLP matrices (GPT-2)."""
    qk_norm: bool = False
    """Learned RMSNorm over each query and key head (Qwen3): 2 * head_dim scales per layer."""
    n_experts: int = 0
    """Routed experts per MoE layer; 0 for a dense model."""
    top_k: int = 0
    """Routed experts each token visits."""
    n_shared_experts: int = 0
    """Experts every token visits (Llama-4: 1)."""
    expert_ffn_hidden: int = 0
    """Intermediate size of one expert; 0 means ffn_hidden."""
    moe_layer_step: int = 1
    """Every moe_layer_step-th block is MoE, the others dense (Llama-4 Maverick: 2)."""

    def __post_init__(self) -> None:
        _check_int("model.n_layers", self.n_layers, 1, MAX_LAYERS)
        _check_int("model.hidden", self.hidden, 1, MAX_WIDTH)
        _check_int("model.n_heads", self.n_heads, 1, MAX_LAYERS)
        _check_int("model.ffn_hidden", self.ffn_hidden, 1, MAX_WIDTH)
        _check_int("model.vocab", self.vocab, 1, MAX_WIDTH)
        _check_int("model.n_kv_heads", self.n_kv_heads, 0, MAX_LAYERS)
        _check_int("model.head_dim", self.head_dim, 0, MAX_WIDTH)
        _check_int("model.max_positions", self.max_positions, 1, MAX_WIDTH)
        ok = isinstance(self.rope_scaling, (int, float)) and not isinstance(self.rope_scaling, bool)
        if not ok or not 1.0 <= self.rope_scaling <= MAX_ROPE_SCALING:
            raise SpecError("model.rope_scaling", self.rope_scaling, f"must be a number from 1 to {MAX_ROPE_SCALING:g}")
        _check_choice("model.mlp", self.mlp, MLP_KINDS)
        _check_choice("model.norm", self.norm, NORM_KINDS)
        _check_choice("model.position", self.position, POSITION_KINDS)
        if self.n_kv_heads == 0:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.head_dim == 0:
            if self.hidden % self.n_heads:
                raise SpecError(
                    "model.n_heads",
                    self.n_heads,
                    f"must divide hidden={self.hidden} when head_dim is not given (allowed: {divisors_text(self.hidden)})",
                )
            object.__setattr__(self, "head_dim", self.hidden // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise SpecError(
                "model.n_kv_heads",
                self.n_kv_heads,
                f"must divide n_heads={self.n_heads} (allowed: {divisors_text(self.n_heads)})",
            )
        if self.norm_bias and self.norm != "layernorm":
            raise SpecError("model.norm_bias", True, "only a LayerNorm has a bias; set norm='layernorm'")
        _check_int("model.n_experts", self.n_experts, 0, MAX_LAYERS)
        _check_int("model.n_shared_experts", self.n_shared_experts, 0, MAX_LAYERS)
        _check_int("model.expert_ffn_hidden", self.expert_ffn_hidden, 0, MAX_WIDTH)
        _check_int("model.moe_layer_step", self.moe_layer_step, 1, self.n_layers)
        if self.n_experts:
            _check_int("model.top_k", self.top_k, 1, self.n_experts)
            if self.expert_ffn_hidden == 0:
                object.__setattr__(self, "expert_ffn_hidden", self.ffn_hidden)
        elif self.top_k or self.n_shared_experts:
            raise SpecError("model.n_experts", 0, "must be >= 1 when top_k or n_shared_experts is set")

    # --- derived sizes -------------------------------------------------------------------------

    @property
    def max_seq_len(self) -> int:
        """The longest sequence this model takes: its learned positions, or its RoPE positions times the
        chosen rope_scaling."""
        if self.position == "learned":
            return self.max_positions
        return int(self.max_positions * self.rope_scaling)

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def q_dim(self) -> int:
        """Width of all query heads together (n_heads * head_dim)."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of all key (or value) heads together (n_kv_heads * head_dim)."""
        return self.n_kv_heads * self.head_dim

    @property
    def n_moe_layers(self) -> int:
        """Blocks whose MLP is a mixture of experts (Llama-4: layers step-1, 2*step-1, ...)."""
        return self.n_layers // self.moe_layer_step if self.is_moe else 0

    @property
    def n_dense_layers(self) -> int:
        return self.n_layers - self.n_moe_layers

    def mlp_params(self, ffn: int) -> int:
        """Parameters of one MLP (or one expert) of intermediate size ``ffn``."""
        h = self.hidden
        if self.mlp == "swiglu":
            return 3 * h * ffn + (2 * ffn + h if self.mlp_bias else 0)
        return 2 * h * ffn + (ffn + h if self.mlp_bias else 0)

    @property
    def attn_params(self) -> int:
        """Parameters of one attention block: q, k, v, output projections and optional q/k norms."""
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        n = h * (q + 2 * kv) + q * h
        if self.qkv_bias:
            n += q + 2 * kv
        if self.attn_out_bias:
            n += h
        if self.qk_norm:
            n += 2 * self.head_dim
        return n

    @property
    def norm_params(self) -> int:
        """Parameters of one norm over the hidden size."""
        return self.hidden * (2 if self.norm_bias else 1)

    @property
    def router_params(self) -> int:
        return self.hidden * self.n_experts

    @property
    def dense_layer_params(self) -> int:
        return self.attn_params + self.mlp_params(self.ffn_hidden) + 2 * self.norm_params

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert."""
        return self.mlp_params(self.expert_ffn_hidden) if self.is_moe else 0

    @property
    def moe_layer_params(self) -> int:
        """One MoE block in full: attention, router, all routed and shared experts, norms."""
        if not self.is_moe:
            return 0
        experts = (self.n_experts + self.n_shared_experts) * self.expert_params
        return self.attn_params + self.router_params + experts + 2 * self.norm_params

    @property
    def embedding_params(self) -> int:
        """Token embedding plus learned positions (if any)."""
        pos = self.max_positions * self.hidden if self.position == "learned" else 0
        return self.vocab * self.hidden + pos

    @property
    def head_params(self) -> int:
        """The output projection; 0 when tied to the embedding."""
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    @property
    def n_params(self) -> int:
        """All parameters, as ``sum(p.numel() for p in model.parameters())``."""
        return (
            self.embedding_params
            + self.n_dense_layers * self.dense_layer_params
            + self.n_moe_layers * self.moe_layer_params
            + self.norm_params
            + self.head_params
        )

    @property
    def n_expert_params(self) -> int:
        """Parameters in routed experts (sharded by expert parallelism)."""
        return self.n_moe_layers * self.n_experts * self.expert_params

    @property
    def n_active_params(self) -> int:
        """Parameters one token touches: routed experts counted top_k times out of n_experts."""
        return self.n_params - self.n_moe_layers * (self.n_experts - self.top_k) * self.expert_params

    def matmul_params_per_token(self) -> int:
        """Weight elements that take part in a matrix multiply for one token (biases, norms and the
        embedding lookup excluded; the output head included, tied or not). 2 FLOPs each forward."""
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        attn = h * (q + 2 * kv) + q * h
        per_mlp = (3 if self.mlp == "swiglu" else 2) * h
        dense = attn + per_mlp * self.ffn_hidden
        moe = attn + self.router_params + per_mlp * self.expert_ffn_hidden * (self.top_k + self.n_shared_experts)
        return self.n_dense_layers * dense + self.n_moe_layers * moe + self.vocab * h


@fast_init
@dataclass(frozen=True, slots=True)
class TrainSpec:
    """One optimizer step: batch shape, precision, optimizer, recompute."""

    seq_len: int = 2048
    """Tokens per sequence s."""
    micro_batch: int = 1
    """Sequences per GPU per forward/backward b."""
    global_batch: int = 0
    """Sequences per optimizer step across all data-parallel ranks; 0 means micro_batch * dp
    (no gradient accumulation)."""
    precision: str = "bf16"
    """Compute precision: fp32, bf16 or fp16 (mixed, fp32 master weights), fp8 (TransformerEngine
    GEMMs, bf16 elsewhere)."""
    optimizer: str = "adamw"
    """adamw (2 fp32 states), sgd (momentum, 1 state) or adafactor (factored second moment)."""
    recompute: str = "none"
    """Activation checkpointing: none, selective (Megatron-LM's: the attention core recomputed),
    selective-op (torchtitan's op-level policy: every other matmul output and the attention output
    kept, the rest recomputed) or full (each block keeps only its input)."""
    recompute_layers: int = 0
    """With recompute='full': blocks per pipeline stage that recompute, the others keep everything
    (Megatron-LM's --recompute-method block --recompute-num-layers N); 0 means every block."""
    offload_activations: int = 0
    """Blocks per pipeline stage whose saved activations go to host memory during forward and come
    back for backward, overlapped with compute (NeMo/Megatron-LM's cpu_offloading_num_layers); 0: none."""
    flash_attention: bool = True
    """Fused attention that never stores the s x s score matrix."""
    dropout: bool = False
    """Dropout layers on (stores 1-byte masks); modern LLM pretraining runs without."""
    fp32_grads: bool | None = None
    """Keep and reduce gradients in fp32 (4 bytes) under 16-bit precision: Megatron-LM's default with
    bf16 and fp16 (its main_grad buffers; arguments.py sets accumulate_allreduce_grads_in_fp32 for bf16)
    and DeepSpeed's bf16 optimizer. False: 16-bit gradients, as in the ZeRO paper and in NeMo's
    performance recipes (grad_reduce_in_fp32 = False). None (the default) takes the framework's:
    True for 'megatron' at 16-bit precision, False for the eager step (its fp32 parameters' gradients
    are fp32 anyway, counted as such)."""
    optimizer_impl: str = "fused"
    """Optimizer kernels: fused (one kernel, no scratch: Megatron, DeepSpeed, torchtitan), foreach
    (PyTorch's default on GPUs: one fp32 scratch copy of the parameters during the step) or for-loop."""
    framework: str = "megatron"
    """How the step is implemented. 'megatron': 16-bit weights with fp32 master copies, persistent
    gradient buffers, fused norms and attention (Megatron-LM, DeepSpeed). 'pytorch': this project's
    eager step, torch.autocast over fp32 parameters, gradients freed after each step (set_to_none),
    an extra 16-bit input copy per linear under autocast; fp8 there is torchao's float8 training."""
    fused_loss: bool = False
    """A fused cross-entropy on the eager step (flash-attn's, Liger's): it keeps the 16-bit logits and
    writes their gradient in place, instead of PyTorch's fp32 log-softmax and gradient copies (10 bytes
    a logit less). Megatron-LM's vocab-parallel loss is in place already."""
    compile: bool = False
    """torch.compile (or CUDA graphs) on the eager step: elementwise ops fused, no per-op launch
    overhead. Megatron-LM's step is fused already."""
    compile_loss: bool | None = None
    """With compile: whether the loss is compiled too. None (the default) follows ``compile``: this
    project's step compiles the model with its loss, and torchtitan compiles the loss function under
    --training.compile since 2025 (torchtitan/components/loss.py); its December 2024 benchmarks compiled
    the blocks only ("compiling loss function causes CUDA errors, turning off for now", train.py)."""
    fp8_recipe: str = "tensorwise"
    """With precision='fp8' on the eager step: torchao's scaling, 'tensorwise' (one scale per tensor)
    or 'rowwise' (a scale per row: more accurate, somewhat slower)."""

    def __post_init__(self) -> None:
        _check_int("train.seq_len", self.seq_len, 1, MAX_SEQ_LEN)
        _check_int("train.micro_batch", self.micro_batch, 1, MAX_MICRO_BATCH)
        _check_int("train.global_batch", self.global_batch, 0, MAX_GLOBAL_BATCH)
        _check_choice("train.precision", self.precision, PRECISIONS)
        _check_choice("train.fp8_recipe", self.fp8_recipe, FP8_RECIPES)
        _check_choice("train.optimizer", self.optimizer, OPTIMIZERS)
        _check_choice("train.recompute", self.recompute, RECOMPUTE_MODES)
        if self.fp32_grads is None:
            object.__setattr__(self, "fp32_grads", self.framework == "megatron" and self.precision != "fp32")
        _check_int("train.recompute_layers", self.recompute_layers, 0, MAX_LAYERS)
        _check_int("train.offload_activations", self.offload_activations, 0, MAX_LAYERS)
        if self.recompute_layers and self.recompute != "full":
            raise SpecError(
                "train.recompute_layers",
                self.recompute_layers,
                f"recomputes N whole blocks: it needs recompute='full' (got recompute={self.recompute!r})",
            )
        _check_choice("train.optimizer_impl", self.optimizer_impl, OPTIMIZER_IMPLS)
        _check_choice("train.framework", self.framework, FRAMEWORKS)
        if self.optimizer == "adafactor" and self.optimizer_impl == "fused":
            raise SpecError("train.optimizer_impl", "fused", "Adafactor has no fused kernel; use foreach or for-loop")

    @property
    def loss_compiled(self) -> bool:
        """Whether the eager step's loss runs under torch.compile: ``compile_loss``, else ``compile``."""
        return self.compile if self.compile_loss is None else self.compile_loss

    @property
    def autocast(self) -> bool:
        """Low-precision compute over fp32 parameters (the eager PyTorch step): torch.autocast for bf16
        and fp16, torchao's float8 linears (bf16 autocast around them) for fp8."""
        return self.framework == "pytorch" and self.precision in ("bf16", "fp16", "fp8")


@fast_init
@dataclass(frozen=True, slots=True)
class ParallelSpec:
    """How the step is spread over GPUs. Rank order, innermost first: TP, CP, DP, PP (Megatron-LM);
    EP is carved out of DP x CP."""

    dp: int = 1
    """Data-parallel replicas."""
    tp: int = 1
    """Tensor-parallel degree (Megatron column/row split of every block)."""
    pp: int = 1
    """Pipeline stages."""
    vpp: int = 1
    """Virtual stages per pipeline rank (interleaved 1F1B); 1 means plain 1F1B."""
    cp: int = 1
    """Context-parallel degree: the sequence is split, attention runs as a ring."""
    ep: int = 1
    """Expert-parallel degree: routed experts are split over ep ranks of the DP x CP group."""
    zero: int = 0
    """ZeRO stage: 0 none, 1 optimizer states, 2 + gradients (FSDP SHARD_GRAD_OP), 3 + weights (FSDP
    FULL_SHARD)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: norms and dropout split over TP ranks too (needs tp > 1)."""
    offload: str = "none"
    """CPU offload: none, optimizer (states and step on the host, ZeRO-Offload) or optimizer+params
    (ZeRO-Infinity / FSDP CPUOffload: weights stream in per layer)."""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "vpp", "cp", "ep"):
            value = getattr(self, name)
            if value.__class__ is not int or not 1 <= value <= MAX_GPUS:  # the field's name built on failure only
                _check_int(f"parallel.{name}", value, 1, MAX_GPUS)
        if self.gpus > MAX_GPUS:
            name = max(("dp", "tp", "pp", "cp"), key=lambda n: getattr(self, n))  # the degree that overshoots most
            raise SpecError(
                f"parallel.{name}",
                getattr(self, name),
                f"dp({self.dp}) x tp({self.tp}) x pp({self.pp}) x cp({self.cp}) = {self.gpus:,} GPUs; "
                f"at most {MAX_GPUS:,} in all",
            )
        _check_int("parallel.zero", self.zero, 0, 3)
        _check_choice("parallel.offload", self.offload, OFFLOAD_MODES)
        if self.vpp > 1 and self.pp == 1:
            raise SpecError("parallel.vpp", self.vpp, "virtual stages need pp > 1; use vpp=1 with pp=1")
        if self.sequence_parallel and self.tp == 1:
            raise SpecError("parallel.sequence_parallel", True, "needs tp > 1 (it splits norms over TP ranks)")
        if self.offload == "optimizer+params" and self.zero < 3:
            raise SpecError(
                "parallel.offload", self.offload, f"offloading parameters needs zero=3 (got zero={self.zero})"
            )
        if self.offload == "optimizer" and self.zero < 1:
            raise SpecError("parallel.offload", self.offload, "optimizer offload needs zero >= 1 (ZeRO-Offload)")

    @property
    def gpus(self) -> int:
        """World size: dp * tp * pp * cp."""
        return self.dp * self.tp * self.pp * self.cp


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    """One accelerator (or a CPU host) and the links around it. Bandwidths are per device, per
    direction, in bytes/s; FLOP/s are dense (no sparsity). Presets cite their datasheets."""

    name: str
    memory_bytes: int
    """Device memory as the driver reports it (nvidia-smi total)."""
    peak_fp32_flops: float
    """Plain FP32 (no tensor cores): PyTorch's default for fp32 matmuls (TF32 off)."""
    peak_tf32_flops: float
    peak_bf16_flops: float
    """0 where the device has no bf16 math (V100)."""
    peak_fp16_flops: float
    peak_fp8_flops: float
    """0 where the device has no fp8 tensor cores."""
    mem_bw_bytes_per_s: float
    """HBM (or DRAM) bandwidth."""
    gpus_per_node: int = 8
    intra_node_bw_bytes_per_s: float = 0.0
    """Per GPU per direction inside a node (NVLink, or PCIe where there is none)."""
    inter_node_bw_bytes_per_s: float = 0.0
    """Per GPU per direction across nodes (one NIC per GPU)."""
    host_link: str = "pcie5"
    host_link_bw_bytes_per_s: float = 0.0
    """GPU <-> host memory, per direction."""
    host_memory_bytes: int = 0
    """Host memory of one node, shared by its GPUs."""
    host_mem_bw_bytes_per_s: float = 0.0
    """Host DRAM bandwidth of one node (CPU optimizer steps are bound by it)."""
    matmul_efficiency_frac: float = 0.75
    """Share of peak FLOP/s large GEMMs reach in practice (measured ceiling / datasheet)."""
    kind: str = "gpu"
    """'gpu' or 'cpu'."""
    runtime_overhead_bytes: int = 0
    """Memory the framework never sees: CUDA context, cuBLAS/NCCL workspaces."""
    sm_count: int = 0
    """Streaming multiprocessors a GEMM's tiles spread over (wave quantization); 0: unknown, no
    quantization modelled."""

    def __post_init__(self) -> None:
        _check_int("hardware.memory_bytes", self.memory_bytes, 1)
        _check_int("hardware.gpus_per_node", self.gpus_per_node, 1)
        _check_int("hardware.host_memory_bytes", self.host_memory_bytes, 0)
        _check_int("hardware.runtime_overhead_bytes", self.runtime_overhead_bytes, 0)
        _check_int("hardware.sm_count", self.sm_count, 0)
        for f in ("peak_fp32_flops", "mem_bw_bytes_per_s"):
            _check_positive(f"hardware.{f}", getattr(self, f))
        for f in (
            "peak_tf32_flops",
            "peak_bf16_flops",
            "peak_fp16_flops",
            "peak_fp8_flops",
            "intra_node_bw_bytes_per_s",
            "inter_node_bw_bytes_per_s",
            "host_link_bw_bytes_per_s",
            "host_mem_bw_bytes_per_s",
        ):
            _check_positive(f"hardware.{f}", getattr(self, f), zero_ok=True)
        _check_choice("hardware.host_link", self.host_link, HOST_LINKS)
        _check_choice("hardware.kind", self.kind, DEVICE_KINDS)
        if not 0 < self.matmul_efficiency_frac <= 1:
            raise SpecError("hardware.matmul_efficiency_frac", self.matmul_efficiency_frac, "must be in (0, 1]")

    @property
    def tp_tile_max(self) -> int:
        """The largest power of two dividing a node's GPUs: the largest TP whose groups tile every node
        (8 on 8- and 72-GPU nodes); a larger or non-dividing TP straddles nodes once a job spans them."""
        return self.gpus_per_node & -self.gpus_per_node

    def peak_flops(self, precision: str) -> float:
        """Dense peak FLOP/s for a training precision (0 if the device lacks it)."""
        return {
            "fp32": self.peak_fp32_flops,
            "bf16": self.peak_bf16_flops,
            "fp16": self.peak_fp16_flops,
            "fp8": self.peak_fp8_flops,
        }[precision]


@fast_init
@dataclass(frozen=True, slots=True)
class Setup:
    """A model trained with a step spec under a parallel layout on hardware; cross-field checks run here.

    All four are required: what a setup costs depends on each, so none is filled in silently (a
    default device would size every estimate for one the user may not have). Build one from plain
    values with ``advisor.spec.setup.make_setup``; the defaults there are the front ends' own.
    """

    model: ModelSpec
    train: TrainSpec
    parallel: ParallelSpec
    hardware: HardwareSpec
    """The device; ``advisor.spec.presets.get_hardware`` builds one from a preset name."""

    def __post_init__(self) -> None:
        m, t, p, hw = self.model, self.train, self.parallel, self.hardware
        # One test on the way every planner candidate takes; the field-by-field messages only on failure.
        kinds_ok = (
            isinstance(m, ModelSpec)
            and isinstance(t, TrainSpec)
            and isinstance(p, ParallelSpec)
            and isinstance(hw, HardwareSpec)
        )
        if not kinds_ok:
            _check_spec("model", m, ModelSpec, "get_model('llama-3.1-8b') from advisor.spec.presets builds one")
            _check_spec("train", t, TrainSpec, "TrainSpec() takes the defaults")
            _check_spec("parallel", p, ParallelSpec, "ParallelSpec() is one GPU")
            _check_spec("hardware", hw, HardwareSpec, "get_hardware('h100') from advisor.spec.presets builds one")
        if m.n_heads % p.tp:
            raise SpecError(
                "parallel.tp",
                p.tp,
                f"model.n_heads={m.n_heads} must be divisible by tp (allowed: {divisors_text(m.n_heads)})",
            )
        if m.n_kv_heads % p.tp and p.tp % m.n_kv_heads:
            raise SpecError(
                "parallel.tp",
                p.tp,
                f"model.n_kv_heads={m.n_kv_heads} must divide or be divisible by tp (KV heads are replicated when tp > n_kv_heads)",
            )
        if m.ffn_hidden % p.tp or (m.is_moe and m.expert_ffn_hidden % p.tp):
            raise SpecError("parallel.tp", p.tp, f"model.ffn_hidden={m.ffn_hidden} must be divisible by tp")
        if p.pp * p.vpp > m.n_layers:
            raise SpecError(
                "parallel.pp",
                p.pp,
                f"pp x vpp={p.pp * p.vpp} pipeline stages need at least one block each; model.n_layers={m.n_layers} "
                f"allows pp x vpp up to {m.n_layers} (stages need not divide the blocks evenly)",
            )
        if p.ep > 1 and not m.is_moe:
            raise SpecError("parallel.ep", p.ep, f"expert parallelism needs a MoE model; {m.name} is dense (use ep=1)")
        if m.is_moe and m.n_experts % p.ep:
            raise SpecError(
                "parallel.ep",
                p.ep,
                f"must divide model.n_experts={m.n_experts} (allowed: {divisors_text(m.n_experts)})",
            )
        if (p.dp * p.cp) % p.ep:
            raise SpecError(
                "parallel.ep",
                p.ep,
                f"must divide dp x cp={p.dp * p.cp}: experts are spread over the data-parallel ranks",
            )
        if p.cp > 1 and t.seq_len % (2 * p.cp):
            raise SpecError(
                "train.seq_len", t.seq_len, f"must be divisible by 2 x cp={2 * p.cp} (load-balanced ring attention)"
            )
        if m.position == "learned" and t.seq_len > m.max_positions:
            raise SpecError("train.seq_len", t.seq_len, f"{m.name} has learned positions up to {m.max_positions}")
        if t.seq_len > m.max_seq_len:
            need = math.ceil(t.seq_len / m.max_positions)
            scaled = f" with rope_scaling={m.rope_scaling:g}" if m.rope_scaling > 1 else ""
            raise SpecError(
                "train.seq_len",
                t.seq_len,
                f"{m.name} was trained on sequences up to {m.max_positions:,} tokens{scaled}; a longer one needs "
                f"RoPE context extension (rope_scaling >= {need}, e.g. YaRN: --rope-scaling {need} on the command "
                "line) or a model with a longer context",
            )
        if t.global_batch and t.global_batch % (t.micro_batch * p.dp):
            raise SpecError(
                "train.global_batch",
                t.global_batch,
                f"must be a multiple of micro_batch x dp={t.micro_batch * p.dp}",
            )
        if p.vpp > 1 and self.grad_accum % p.pp:
            raise SpecError(
                "train.global_batch",
                self.global_batch,
                f"interleaved pipelines need a multiple of pp={p.pp} micro-batches per step "
                f"(got {self.grad_accum} = global_batch / (micro_batch x dp))",
            )
        if hw.peak_flops(t.precision) <= 0:
            have = ", ".join(q for q in PRECISIONS if hw.peak_flops(q) > 0)
            raise SpecError("train.precision", t.precision, f"{hw.name} has no {t.precision} math (use {have})")
        if t.recompute_layers or t.offload_activations:
            self._check_stage_blocks()
        if p.offload != "none" and hw.kind == "cpu":
            raise SpecError(
                "parallel.offload",
                p.offload,
                "offload moves state from a GPU to the host; the device is already the CPU",
            )

    def _check_stage_blocks(self) -> None:
        """recompute_layers and offload_activations count blocks per pipeline stage: each at most the
        smallest stage's, and offload only of blocks that do not recompute."""
        m, t, p = self.model, self.train, self.parallel
        fewest = min(stage_layers(self))  # the pipeline's split (advisor.spec.stages)
        for name, n in (
            ("train.recompute_layers", t.recompute_layers),
            ("train.offload_activations", t.offload_activations),
        ):
            if n > fewest:
                raise SpecError(
                    name,
                    n,
                    f"counts blocks per pipeline stage: at most {fewest}, the blocks of the smallest of "
                    f"pp x vpp={p.pp * p.vpp} stages of {m.n_layers}",
                )
        # On a CPU device the copies go to another buffer in the same memory: allowed (the profiled
        # step runs the offload path there), estimated as saving nothing.
        if t.offload_activations:
            if t.recompute == "full" and t.recompute_layers in (0, fewest):
                raise SpecError(
                    "train.offload_activations",
                    t.offload_activations,
                    "every block recomputes (recompute='full'), so none keeps activations to offload; set "
                    "recompute_layers below the stage's blocks or recompute to none/selective",
                )
            if t.recompute == "full" and t.recompute_layers + t.offload_activations > fewest:
                raise SpecError(
                    "train.offload_activations",
                    t.offload_activations,
                    f"offloads blocks that do not recompute: at most {fewest - t.recompute_layers} "
                    f"({fewest} blocks a stage, {t.recompute_layers} recompute)",
                )

    @property
    def gpus(self) -> int:
        return self.parallel.gpus

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.train.global_batch or self.train.micro_batch * self.parallel.dp

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step on each data-parallel rank (m)."""
        return self.global_batch // (self.train.micro_batch * self.parallel.dp)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.train.seq_len


def spec_to_dict(spec: object) -> dict:
    """A spec as plain JSON-ready values (nested for Setup)."""
    out = {}
    for f in fields(spec):  # type: ignore[arg-type]
        v = getattr(spec, f.name)
        out[f.name] = spec_to_dict(v) if hasattr(v, "__dataclass_fields__") else v
    return out


def setup_from_dict(d: dict) -> Setup:
    """Inverse of spec_to_dict for a Setup (validated again on the way in)."""
    try:
        return Setup(
            model=ModelSpec(**d["model"]),
            train=TrainSpec(**d["train"]),
            parallel=ParallelSpec(**d["parallel"]),
            hardware=HardwareSpec(**d["hardware"]),
        )
    except (KeyError, TypeError) as err:
        raise SpecError("setup", type(err).__name__, f"not a setup dictionary ({err})") from None
