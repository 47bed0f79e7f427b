"""Measured peak memory of a training step, on a CPU from profiler memory events, on a GPU from the
CUDA caching allocator.

On a CPU there are no allocator statistics: torch.profiler's ``[memory]`` events carry the bytes of
each allocation (negative on free). Their running sum gives the step's peak above what was alive when
the profiler started; the ``Total Allocated`` field is wrong under non-reentrant checkpointing
(observed twice the true value, DESIGN.md), so it is not used. What was alive at the start (weights,
gradients, optimizer state, cached RoPE tables) is counted from the live tensors themselves.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.profiler import ProfilerActivity, profile

from advisor.run.model import Transformer, local_tensor
from advisor.run.step import HostOffloadOptimizer, Trainer, unwrap


def unique_storage_bytes(tensors: Iterable[torch.Tensor | None], device_type: str) -> int:
    """Bytes of the distinct storages behind ``tensors`` on ``device_type`` (shared storages once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or not torch.is_tensor(t) or t.device.type != device_type:
            continue
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def live_state_tensors(trainer: Trainer) -> list[torch.Tensor | None]:
    """Tensors that outlive a step: parameters, gradients, optimizer state, cached RoPE tables (this
    rank's shards under a parallel layout)."""
    model = unwrap(trainer.model)
    out: list[torch.Tensor | None] = []
    for p in model.parameters():
        out += [p, p.grad]
    opt = trainer.optimizer
    if isinstance(opt, HostOffloadOptimizer):
        out += opt.state_tensors()
    else:
        for st in opt.state.values():
            out += [v for v in st.values() if torch.is_tensor(v)]
    # The model may sit under DDP or be several pipeline stages (advisor.run.parallel), each with its tables.
    for m in model.modules():
        if isinstance(m, Transformer) and m._rope is not None:
            out += list(m._rope)
    # FSDP and TP hold DTensors, whose own storage is not this rank's memory: count the local shards.
    return [None if t is None else local_tensor(t) for t in out]


def ddp_bucket_bytes(model: torch.nn.Module) -> int:
    """Bytes of DDP's gradient buckets (its Reducer keeps one flat buffer per bucket for the run's
    life, outside the parameters and their gradients); 0 for a model not under DDP. The sizes come
    from DDP's own logging data (``_get_ddp_logging_data``, private: 0 where a torch version lacks it)."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return 0
    try:
        sizes = str(model._get_ddp_logging_data().get("bucket_sizes", ""))
    except (AttributeError, RuntimeError):
        return 0
    return sum(int(x) for x in sizes.split(",") if x.strip().isdigit())


def peak_from_memory_events(events: Iterable, device_type: str) -> tuple[int, int]:
    """(peak, final) of the running sum of allocation events on one device type, in bytes."""
    wanted = {"cpu": torch.autograd.DeviceType.CPU, "cuda": torch.autograd.DeviceType.CUDA}[device_type]
    mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and e.device_type() == wanted)
    running = peak = 0
    for _, nbytes in mem:
        running += nbytes
        peak = max(peak, running)
    return peak, running


def measure_step_peak_bytes(trainer: Trainer, batches, warmup_steps: int = 1) -> int:
    """Peak bytes on the trainer's device during one steady-state step (after ``warmup_steps``, so the
    optimizer state exists). GPU: max_memory_allocated; CPU: live state + profiler running-sum peak."""
    for _ in range(warmup_steps):
        trainer.step(batches)
    device = trainer.device.type
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        trainer.step(batches)
        return torch.cuda.max_memory_allocated()
    baseline = unique_storage_bytes(live_state_tensors(trainer), "cpu")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer.step(batches)
    peak, _ = peak_from_memory_events(prof.profiler.kineto_results.events(), "cpu")
    return baseline + peak
