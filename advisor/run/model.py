"""The project's own decoder-only transformer, built from a ModelSpec: GPT-2 style, Llama style, MoE.

Parameter count equals ``ModelSpec.n_params`` exactly (tested for every preset on the meta device).
Attention is ``scaled_dot_product_attention`` (flash/efficient kernels where the device has them);
activation checkpointing is non-reentrant, per block ("full", optionally of only the first
``recompute_layers`` blocks: Megatron-LM's --recompute-method block), around the attention core
("selective", Korthikanti et al. 2022), or per block with torchtitan's op-level policy ("selective-op":
every other matmul output and the attention output saved, the rest recomputed). A ``block_runner``
(``advisor.run.offload.ActivationOffloader.block``) runs each block's forward, where the saved-tensor hooks
that move activations to the host go.
"""

from __future__ import annotations

import sys
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from advisor.spec.specs import RECOMPUTE_MODES, ModelSpec

INIT_STD = 0.02  # GPT-2 / Llama initialisation (normal, std 0.02)

# torchtitan's op-level selective checkpointing (torchtitan/models/llama3/infra/parallelize.py,
# _op_sac_save_list; torchtitan/distributed/activation_checkpoint.py, _custom_policy): the outputs of
# these ops are saved, except every second matmul, and everything else is recomputed in backward.
# torchtitan's models have no biases, so its list names aten.mm; GPT-2's biased linears run aten.addmm,
# counted here as the same matmul. The CPU's SDPA kernel stands beside the CUDA ones.
_aten = torch.ops.aten
_OP_SAC_MATMULS = (_aten.mm.default, _aten.addmm.default)
_OP_SAC_SAVE = {
    *_OP_SAC_MATMULS,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten.max.default,
}
if hasattr(torch.ops, "_c10d_functional"):
    _OP_SAC_SAVE.add(torch.ops._c10d_functional.reduce_scatter_tensor.default)


def op_sac_context():
    """A fresh context pair for one checkpointed block under torchtitan's op-level policy: matmul
    outputs counted separately in forward and in recompute, the odd ones saved."""
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func in _OP_SAC_MATMULS:
            counts[mode] += 1
        save = func in _OP_SAC_SAVE and not (func in _OP_SAC_MATMULS and counts[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _norm(spec: ModelSpec, dim: int) -> nn.Module:
    if spec.norm == "layernorm":
        return nn.LayerNorm(dim, bias=spec.norm_bias)
    return nn.RMSNorm(dim, eps=1e-5)


def rope_tables(seq_len: int, head_dim: int, theta: float = 500000.0, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (seq_len, head_dim/2) for rotary position embeddings (Su et al. 2021)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of the last dimension of x (batch, heads, seq, head_dim)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, selective_recompute: bool = False, flash: bool = True) -> None:
        super().__init__()
        h, q, kv = spec.hidden, spec.q_dim, spec.kv_dim
        self.flash = flash
        self.head_dim = spec.head_dim
        self.q_proj = nn.Linear(h, q, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(h, kv, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(h, kv, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(q, h, bias=spec.attn_out_bias)
        self.q_norm = nn.RMSNorm(spec.head_dim, eps=1e-6) if spec.qk_norm else None
        self.k_norm = nn.RMSNorm(spec.head_dim, eps=1e-6) if spec.qk_norm else None
        self.rope = spec.position == "rope"
        self.selective_recompute = selective_recompute

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # Head counts come from the tensors: under tensor parallelism each rank holds n_heads / tp query
        # and n_kv_heads / tp key/value heads (parallel.apply_tp), the same grouping ratio.
        n_heads, n_kv = q.shape[1], k.shape[1]
        if self.flash:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=n_kv != n_heads)
        # Unfused ("math") attention as models without SDPA write it: the s x s scores and
        # probabilities of every head are materialised and saved for backward.
        if n_kv != n_heads:
            k = k.repeat_interleave(n_heads // n_kv, dim=1)
            v = v.repeat_interleave(n_heads // n_kv, dim=1)
        s = q.shape[-2]
        scores = (q @ k.transpose(-2, -1)) * self.head_dim**-0.5
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        return scores.masked_fill(mask, float("-inf")).softmax(dim=-1) @ v

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope and rope is not None:
            cos, sin = rope
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.selective_recompute and self.training:
            y = checkpoint(self._core, q, k, v, use_reentrant=False)
        else:
            y = self._core(q, k, v)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """GELU (two matrices, GPT-2's tanh approximation) or SwiGLU (gate, up, down)."""

    def __init__(self, spec: ModelSpec, ffn: int) -> None:
        super().__init__()
        h, bias = spec.hidden, spec.mlp_bias
        self.swiglu = spec.mlp == "swiglu"
        if self.swiglu:
            self.gate = nn.Linear(h, ffn, bias=bias)
        self.up = nn.Linear(h, ffn, bias=bias)
        self.down = nn.Linear(ffn, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class MoE(nn.Module):
    """Top-k routed experts plus shared experts; the Switch-Transformer load-balancing loss
    (Fedus et al. 2021: n_experts * sum_i f_i * P_i) is kept in ``aux_loss`` after each forward."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.top_k, self.n_experts = spec.top_k, spec.n_experts
        self.router = nn.Linear(spec.hidden, spec.n_experts, bias=False)
        self.experts = nn.ModuleList(MLP(spec, spec.expert_ffn_hidden) for _ in range(spec.n_experts))
        self.shared = nn.ModuleList(MLP(spec, spec.expert_ffn_hidden) for _ in range(spec.n_shared_experts))
        self.aux_loss = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        probs = F.softmax(self.router(flat), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if rows.numel():
                out.index_add_(0, rows, expert(flat[rows]) * weights[rows, slot, None])
        for expert in self.shared:
            out = out + expert(flat)
        routed_frac = F.one_hot(chosen, self.n_experts).sum(dim=1).float().mean(dim=0) / self.top_k
        self.aux_loss = self.n_experts * (routed_frac * probs.mean(dim=0)).sum()
        return out.view(b, s, h)


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, moe: bool, selective_recompute: bool, flash: bool = True) -> None:
        super().__init__()
        self.norm1 = _norm(spec, spec.hidden)
        self.attn = Attention(spec, selective_recompute, flash)
        self.norm2 = _norm(spec, spec.hidden)
        self.mlp: nn.Module = MoE(spec) if moe else MLP(spec, spec.ffn_hidden)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope)
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    """Decoder-only language model; ``forward(tokens, targets)`` returns the mean cross-entropy loss
    (plus 0.01 x the MoE load-balancing loss) or, without targets, the logits."""

    MOE_AUX_WEIGHT = 0.01  # Switch Transformer's alpha

    def __init__(self, spec: ModelSpec, recompute: str = "none", flash: bool = True, recompute_layers: int = 0) -> None:
        super().__init__()
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute={recompute!r}: must be one of {', '.join(RECOMPUTE_MODES)}")
        if recompute_layers < 0 or (recompute_layers and recompute != "full"):
            raise ValueError(f"recompute_layers={recompute_layers}: a count >= 0 of blocks, with recompute='full'")
        self.spec, self.recompute, self.recompute_layers = spec, recompute, recompute_layers
        self.block_runner = None
        """Called with a block's index within this stage, returns a function that runs the block's
        forward (given as a thunk) and returns its output (``advisor.run.offload.ActivationOffloader.block``);
        None runs the blocks plainly."""
        self.embed = nn.Embedding(spec.vocab, spec.hidden)
        self.pos = nn.Embedding(spec.max_positions, spec.hidden) if spec.position == "learned" else None
        # Llama-4 style interleaving: block i is MoE when (i + 1) % moe_layer_step == 0.
        self.blocks = nn.ModuleList(
            Block(spec, spec.is_moe and (i + 1) % spec.moe_layer_step == 0, recompute == "selective", flash)
            for i in range(spec.n_layers)
        )
        self.norm = _norm(spec, spec.hidden)
        self.head = nn.Linear(spec.hidden, spec.vocab, bias=False)
        if spec.tied_embeddings:
            self.head.weight = self.embed.weight
        self.apply(self._init)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def recomputes(self, i: int) -> bool:
        """Whether the stage's block ``i`` recomputes its whole forward in backward (full recompute of
        every block, or of the first ``recompute_layers``)."""
        return self.recompute == "full" and (not self.recompute_layers or i < self.recompute_layers)

    def _block_forward(self, i: int, block: nn.Module, x: torch.Tensor, rope) -> torch.Tensor:
        if not self.training:
            return block(x, rope)
        if self.recomputes(i):
            return checkpoint(block, x, rope, use_reentrant=False)
        if self.recompute == "selective-op":
            return checkpoint(block, x, rope, use_reentrant=False, context_fn=op_sac_context)
        return block(x, rope)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            if module.weight.device.type != "meta":
                nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
            if getattr(module, "bias", None) is not None and module.bias.device.type != "meta":
                nn.init.zeros_(module.bias)

    def rope_for(self, s: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The RoPE (cos, sin) tables for ``s`` positions (None without RoPE), cached on the model and
        rebuilt only for a longer sequence or another device."""
        if self.spec.position != "rope":
            return None
        if self._rope is None or self._rope[0].shape[0] < s or self._rope[0].device != device:
            self._rope = rope_tables(s, self.spec.head_dim, device=device)
        cos, sin = self._rope
        return cos[:s], sin[:s]

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        # A pipeline stage is a Transformer with the parts of other stages set to None
        # (parallel.split_pipeline): without the embedding its input is the previous stage's hidden
        # states (batch, seq, hidden), without the head it returns its own.
        s = tokens.shape[1]
        if self.embed is None:
            x = tokens
        else:
            x = self.embed(tokens)
            if self.pos is not None:
                x = x + self.pos(torch.arange(s, device=tokens.device))
        rope = self.rope_for(s, tokens.device)
        for i, block in enumerate(self.blocks):
            forward = partial(self._block_forward, i, block, x, rope)
            x = self.block_runner(i)(forward) if self.block_runner is not None and self.training else forward()
        if self.head is None:
            return x
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        loss = lm_loss(logits, targets)
        if self.spec.is_moe:
            aux = sum(b.mlp.aux_loss for b in self.blocks if isinstance(b.mlp, MoE))
            loss = loss + self.MOE_AUX_WEIGHT * aux
        return loss


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (computed in fp32) of logits (batch, seq, vocab) against targets.
    Vocab-sharded DTensor logits (tensor parallelism, under ``loss_parallel``) give the same loss as a
    plain tensor, replicated on every TP rank."""
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.reshape(-1))
    return local_tensor(loss)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's local part of ``t`` if it is a DTensor (FSDP and TP parameters, vocab-sharded
    logits), else ``t``. DTensors exist only once FSDP or TP has imported torch.distributed.tensor,
    which is not imported here: it adds about a second to every profiling child's start."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return t.to_local() if dtensor is not None and isinstance(t, dtensor) else t


def build_model(
    spec: ModelSpec,
    recompute: str = "none",
    device: str | torch.device | None = None,
    flash: bool = True,
    recompute_layers: int = 0,
) -> Transformer:
    """The model for ``spec``; on ``device="meta"`` nothing is allocated (for counting and dry runs).
    ``flash=False`` materialises the attention scores (unfused attention); ``recompute_layers`` limits
    full recompute to the first N blocks of the stage."""
    if device is None:
        return Transformer(spec, recompute, flash, recompute_layers)
    with torch.device(device):
        return Transformer(spec, recompute, flash, recompute_layers)


def count_parameters(model: nn.Module) -> int:
    """Unique parameters (a tied head counted once)."""
    return sum(p.numel() for p in model.parameters())


def model_flops_per_token(spec: ModelSpec, seq_len: int) -> float:
    """Training FLOPs per token, PaLM convention: 6 x matmul weights + 12 x L x s x q (full attention)."""
    return 6.0 * spec.matmul_params_per_token() + 12.0 * spec.n_layers * seq_len * spec.q_dim
