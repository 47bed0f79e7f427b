"""One rank of the parallel-step correctness test: runs several layouts one after another in one
torchrun launch (process start-up dominates on a small CPU) and writes, per layout, the step losses,
the collectives the profiler saw and the updated parameters.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.parallel_worker OUT_DIR LAYOUT...
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

from advisor.run.parallel import build_parallel_trainer, init_parallel, leave_rank, rank_loader, stage_bounds
from advisor.spec.presets import gpt2_style
from advisor.spec.setup import make_setup

STEPS = 3
SEED = 0
BASE = {"model": "tiny", "gpu": "cpu", "seq": 32, "micro_batch": 2, "precision": "fp32"}

# GPT-2 shaped (learned positions, LayerNorm, GELU, tied head) with a vocabulary that splits unevenly
# over 2 TP ranks: under SP its embedding is all-reduced and then cut into sequence shards.
GPT2_ODD = replace(gpt2_style("gpt2-odd", n_layers=2, hidden=64, n_heads=4), vocab=1001)

# name -> (processes, make_setup overrides). global_batch fixes grad_accum: 2 micro-batches per step
# on each data-parallel rank (DDP's no_sync path), 4 through the pipeline (1F1B's steady state).
LAYOUTS: dict[str, tuple[int, dict]] = {
    "ddp": (2, {"gpus": 2, "global_batch": 8}),
    "fsdp_zero3": (2, {"gpus": 2, "global_batch": 8, "zero": 3}),
    "fsdp_zero2": (2, {"gpus": 2, "global_batch": 8, "zero": 2}),
    "tp": (2, {"gpus": 2, "tp": 2, "global_batch": 4}),
    "tp_sp": (2, {"gpus": 2, "tp": 2, "sequence_parallel": True, "global_batch": 4}),
    "tp_sp_gpt2": (2, {"model": GPT2_ODD, "gpus": 2, "tp": 2, "sequence_parallel": True, "global_batch": 4}),
    # SGD moves each weight by lr x its gradient, so a gradient off by a factor (a missing or doubled
    # reduction over TP ranks) shows in the weights; AdamW's update is nearly blind to a uniform scale.
    "tp_sp_sgd": (
        2,
        {
            "gpus": 2,
            "tp": 2,
            "sequence_parallel": True,
            "global_batch": 4,
            "optimizer": "sgd",
            "optimizer_impl": "foreach",
        },
    ),
    # Activation offload under FSDP2 (its gathered weights stay put, the activations move) and under
    # TP with sequence parallelism (DTensor activations: their local shards move), beside partial recompute.
    "fsdp_zero3_offload": (2, {"gpus": 2, "global_batch": 8, "zero": 3, "offload_activations": 2}),
    "tp_sp_offload": (
        2,
        {
            "gpus": 2,
            "tp": 2,
            "sequence_parallel": True,
            "global_batch": 4,
            "recompute": "full",
            "recompute_layers": 1,
            "offload_activations": 2,
        },
    ),
    "pp_1f1b": (2, {"gpus": 2, "pp": 2, "global_batch": 8}),
    "pp_interleaved": (2, {"gpus": 2, "pp": 2, "vpp": 2, "global_batch": 8}),
    "fsdp_tp": (4, {"gpus": 4, "tp": 2, "zero": 3, "sequence_parallel": True, "global_batch": 8}),
    "pp_fsdp": (4, {"gpus": 4, "pp": 2, "zero": 3, "global_batch": 8}),
    "pp_tp": (4, {"gpus": 4, "pp": 2, "tp": 2, "global_batch": 4}),
    # 3 stages of tiny's 4 blocks (1, 2, 1: stages need not divide the blocks).
    "pp_uneven": (3, {"gpus": 3, "pp": 3, "global_batch": 6}),
}

# Substrings of profiler event names per kind of communication (gloo and NCCL name them differently:
# "gloo:all_reduce", "c10d::allreduce_", "FSDP::all_gather", "nccl:_reduce_scatter_base", "c10d::send").
COMM_KINDS = {
    "all_reduce": ("all_reduce", "allreduce"),
    "all_gather": ("all_gather", "allgather"),
    "reduce_scatter": ("reduce_scatter",),
    "send": ("send",),
    "recv": ("recv",),
}


def layout_setup(name: str):
    """The Setup of a layout."""
    return make_setup(**(BASE | LAYOUTS[name][1]))


def reference_setup(name: str):
    """The single-process Setup that sees the same samples: micro_batch x dp, the same global batch."""
    setup = layout_setup(name)
    kw = BASE | {
        "model": setup.model,
        "optimizer": setup.train.optimizer,
        "optimizer_impl": setup.train.optimizer_impl,
        "micro_batch": BASE["micro_batch"] * setup.parallel.dp,
        "global_batch": setup.global_batch,
    }
    return make_setup(**kw)


def _canonical_params(trainer, setup) -> dict[str, torch.Tensor]:
    """Full (gathered) parameters under the single-process model's names; collective over the layout's
    dp/tp groups, so every rank of a stage calls it."""
    if hasattr(trainer, "stage_models"):
        first_block = stage_bounds(setup)
        stages = [(trainer.info.pp_rank + v * setup.parallel.pp, m) for v, m in enumerate(trainer.stage_models)]
    else:
        stages = [(0, getattr(trainer.model, "module", trainer.model))]
        first_block = [0]
    out = {}
    for index, model in stages:
        for name, p in model.named_parameters(remove_duplicate=False):
            full = p.full_tensor() if isinstance(p, DTensor) else p
            parts = name.split(".")
            if parts[0] == "blocks":
                parts[1] = str(first_block[index] + int(parts[1]))
            out[".".join(parts)] = full.detach().cpu().clone()
    return out


def _comm_events(prof) -> dict[str, list[str]]:
    """Names of the communication events inside the "step" range, by kind: the loss all-reduce for
    logging comes after the range and must not count as the layout's gradient all-reduce."""
    events = prof.events()
    step = next(e for e in events if e.name == "step")
    inside = [e for e in events if step.time_range.start <= e.time_range.start <= step.time_range.end]
    names = {e.name for e in inside}
    return {kind: sorted(n for n in names if any(k in n.lower() for k in keys)) for kind, keys in COMM_KINDS.items()}


def run_layout(name: str, out_dir: Path) -> dict:
    """Three steps of the layout (the last under torch.profiler); writes this rank's parameters where
    it holds a stage's first data- and tensor-parallel shard. Returns the layout's record."""
    setup = layout_setup(name)
    start = time.perf_counter()
    info = init_parallel(setup, "cpu")
    trainer = build_parallel_trainer(setup, info.device, info, seed=SEED)
    batches = iter(rank_loader(setup, info, STEPS, num_workers=0, pin_memory=False, seed=SEED))
    for _ in range(STEPS - 1):
        trainer.step(batches)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.step(batches)
    params = _canonical_params(trainer, setup)
    if info.dp_rank == 0 and info.tp_rank == 0:
        torch.save(params, out_dir / f"params-{name}-rank{info.rank}.pt")
    comm = [None] * info.world_size
    dist.all_gather_object(comm, _comm_events(prof))
    return {
        "losses": trainer.losses,
        "offloaded_bytes": trainer.offload_stats[-1].bytes_offloaded if trainer.offload_stats else 0,
        "phases": sorted(trainer.phase_ms),
        "comm": comm,
        "seconds": time.perf_counter() - start,
    }


def main(argv: list[str]) -> None:
    out_dir = Path(argv[0])
    results = {name: run_layout(name, out_dir) for name in argv[1:]}
    if dist.get_rank() == 0:
        (out_dir / "results.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
    leave_rank(0)  # as the profiling child's ranks do: no finalisation, where gloo can abort
