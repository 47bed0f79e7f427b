"""The pipeline's split: how many transformer blocks each pipeline stage, and each pipeline rank, holds.

Owned by the spec stage because ``Setup`` checks per-stage block counts on construction
(``recompute_layers``, ``offload_activations``); the estimator and the eager step's pipeline
(``advisor.run.parallel``) read the same split from here.
"""

from __future__ import annotations

import functools
import itertools
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # specs.py imports this module: the type only, no import circle at run time
    from advisor.spec.specs import Setup


def head_in_blocks(setup: Setup) -> float:
    """The output head's training FLOPs in blocks: a block costs 6 x its matmul weights + 3 x its causal
    attention forward (4 s q, halved by flash attention's causal skip) per token, plus the forward it
    recomputes (all of it under full recompute, the attention under selective); the head 6 x vocab x
    hidden, never recomputed."""
    m, tr = setup.model, setup.train
    attn_fwd = 4.0 * tr.seq_len * m.q_dim * (0.5 if tr.flash_attention else 1.0)
    mm_fwd = 2.0 * (m.matmul_params_per_token() - m.vocab * m.hidden) / m.n_layers
    recomputed = {"full": mm_fwd + attn_fwd, "selective": attn_fwd, "selective-op": mm_fwd / 2}.get(tr.recompute, 0.0)
    return 6.0 * m.vocab * m.hidden / (3.0 * (mm_fwd + attn_fwd) + recomputed)


def pipeline_stage_layers(setup: Setup) -> tuple[int, ...]:
    """Blocks of each pipeline stage (pp x vpp of them, in stage order) as the eager step splits them
    (``advisor.run.parallel.split_pipeline``): balanced by training FLOPs with the output head counted on
    the last stage, each stage at least one block, as torchtitan's split counts the embedding and head
    as layers and Megatron-LM's ``--decoder-last-pipeline-num-layers`` lightens the last stage.

    A block costs 6 x its matmul weights + 3 x its causal attention forward (4 s q, halved by flash
    attention's causal skip) per token, plus the forward it recomputes (all of it under full recompute,
    the attention under selective); the head 6 x vocab x hidden (``head_in_blocks``), about 2.1 blocks
    for Llama-3.1-8B at sequence 8192 without recompute. The last stage takes the block count that
    minimises the largest stage's cost (ties: the larger count), the other stages share the rest
    evenly, the remainder going to the later ones (the first stages keep the most micro-batches'
    activations in flight under 1F1B)."""
    m, p = setup.model, setup.parallel
    n = p.pp * p.vpp
    if n == 1:
        return (m.n_layers,)
    return _balanced_stage_layers(m.n_layers, n, head_in_blocks(setup))


@functools.lru_cache(maxsize=4096)
def _balanced_stage_layers(n_layers: int, n: int, head: float) -> tuple[int, ...]:
    best: tuple[float, int] | None = None
    for last in range(1, n_layers - (n - 1) + 1):
        cost = max(-(-(n_layers - last) // (n - 1)), last + head)
        if best is None or cost <= best[0]:
            best = (cost, last)
    last = best[1]
    base, extra = divmod(n_layers - last, n - 1)
    return (*(base + (i >= n - 1 - extra) for i in range(n - 1)), last)


@functools.lru_cache(maxsize=4096)
def megatron_stage_layers(n_layers: int, n_stages: int) -> tuple[int, ...]:
    """Blocks of each of ``n_stages`` pipeline stages as Megatron-LM splits them: evenly where
    ``n_layers`` divides (its default), else the ends one block lighter, as Llama 3 405B trained (126
    blocks over 16 stages: 7, 8 x 14, 7; Megatron-LM's ``--decoder-first-pipeline-num-layers`` and
    ``--decoder-last-pipeline-num-layers``): the first stage keeps the most micro-batches in flight,
    the last the output head. The heavier stages are the middle ones, from the centre out."""
    base, extra = divmod(n_layers, n_stages)
    if extra == 0:
        return (base,) * n_stages
    middle = sorted(range(1, n_stages - 1), key=lambda i: (abs(2 * i - (n_stages - 1)), i))
    heavy = set(middle[:extra])
    if extra > len(middle):  # only with two stages, or nearly even splits: the last stage takes one
        heavy.add(n_stages - 1)
    return tuple(base + (i in heavy) for i in range(n_stages))


def stage_layers(setup: Setup) -> tuple[int, ...]:
    """Blocks of each pipeline stage (pp x vpp of them, in stage order): the eager step's cost-balanced
    split (``pipeline_stage_layers``) for framework 'pytorch', else Megatron-LM's
    (``megatron_stage_layers``)."""
    p = setup.parallel
    if setup.train.framework == "pytorch":
        return pipeline_stage_layers(setup)
    return megatron_stage_layers(setup.model.n_layers, p.pp * p.vpp)


@functools.lru_cache(maxsize=4096)
def blocks_per_rank(stages: tuple[int, ...], pp: int) -> tuple[float, ...]:
    """Blocks per pipeline rank: rank r holds stages r, r + pp, ..."""
    return tuple(float(sum(stages[r::pp])) for r in range(pp))


@functools.lru_cache(maxsize=4096)
def moe_blocks_per_rank(stages: tuple[int, ...], pp: int, step: int) -> tuple[float, ...]:
    """MoE blocks per pipeline rank: a stage of blocks [a, b) holds b // step - a // step of them (the
    multiples of ``step`` in (a, b])."""
    ends = tuple(itertools.accumulate(stages))
    per_stage = [end // step - (end - n) // step for n, end in zip(stages, ends, strict=True)]
    return tuple(float(sum(per_stage[r::pp])) for r in range(pp))
