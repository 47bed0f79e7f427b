"""One rank of the distributed dry run's check against the real step: runs data-parallel layouts of
the tiny model one after another in one torchrun launch and writes rank 0's measured peak per layout.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.dryrun_worker OUT_DIR LAYOUT...

The peak is measured as ``memprobe.measure_step_peak_bytes`` measures it on the CPU (the live state when
the step begins plus the profiler's running sum of allocations), with the state counted from each
tensor's local shard, which memprobe does not do for DTensors.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

from advisor.run.memprobe import peak_from_memory_events
from advisor.run.parallel import build_parallel_trainer, init_parallel, leave_rank, rank_loader
from advisor.run.step import Trainer
from advisor.spec.setup import make_setup

BASE = {"model": "tiny", "gpu": "cpu", "seq": 128, "micro_batch": 2, "gpus": 2}
LAYOUTS: dict[str, dict] = {
    "zero3_bf16": {"zero": 3, "precision": "bf16"},
    "zero2_fp32": {"zero": 2, "precision": "fp32"},
    "zero0_fp32": {"zero": 0, "precision": "fp32"},
}


def layout_setup(name: str):
    """The Setup of a layout."""
    return make_setup(**(BASE | LAYOUTS[name]))


def _state_bytes(trainer: Trainer) -> int:
    """Bytes of the distinct local storages of parameters, gradients, optimizer state and RoPE tables."""
    model = getattr(trainer.model, "module", trainer.model)  # DDP wraps; FSDP2 shards in place
    tensors = [t for p in model.parameters() for t in (p, p.grad)]
    tensors += [v for st in trainer.optimizer.state.values() for v in st.values()]
    tensors += list(model._rope or ())
    seen = {}
    for t in tensors:
        if torch.is_tensor(t):
            storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def main(out_dir: Path, names: list[str]) -> None:
    torch.set_num_threads(1)
    results = {}
    for name in names:
        setup = layout_setup(name)
        info = init_parallel(setup, "cpu")
        trainer = build_parallel_trainer(setup, torch.device("cpu"), info)
        batches = iter(rank_loader(setup, info, 2, 0, False, 0))
        trainer.step(batches)  # warm-up: creates the optimizer state
        baseline = _state_bytes(trainer)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            trainer.step(batches)
        peak, _ = peak_from_memory_events(prof.profiler.kineto_results.events(), "cpu")
        results[name] = baseline + peak
    if dist.get_rank() == 0:
        (out_dir / "peaks.json").write_text(json.dumps(results), encoding="utf-8")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
    leave_rank(0)  # as the profiling child's ranks do: no finalisation, where gloo can abort
