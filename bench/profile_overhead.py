"""Profiler overhead: step time under the default profiler settings vs the same step unprofiled.

Run: ``.venv/bin/python bench/profile_overhead.py [--model gpt2-124m] [--seq 256] [--micro-batch 2]``.
Alternates unprofiled and profiled steps of one trainer in one process (so machine noise hits both
alike) and prints the ratio of the medians; target at most 1.10 with the default RunOptions
(record_shapes, profile_memory, with_flops on; NVTX and record_function ranges always on).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from advisor.run.launcher import on_this_machine
from advisor.run.step import build_trainer, make_loader, resolve_device
from advisor.spec.options import RunOptions
from advisor.spec.setup import make_setup

TARGET = 1.10


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2-124m")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    device = resolve_device(args.device)
    opts = RunOptions()
    setup = on_this_machine(
        make_setup(model=args.model, gpu="cpu", seq=args.seq, micro_batch=args.micro_batch, precision=args.precision),
        device.type,
    )
    trainer = build_trainer(setup, device)
    batches = iter(make_loader(setup, 2 * args.pairs + 2, 0, False, 0))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for _ in range(2):  # warm up both paths
        trainer.step(batches)
    plain, profiled = [], []
    for _ in range(args.pairs):
        t0 = time.perf_counter()
        trainer.step(batches)
        plain.append(time.perf_counter() - t0)
        with profile(
            activities=activities,
            record_shapes=opts.record_shapes,
            profile_memory=opts.profile_memory,
            with_stack=opts.with_stack,
            with_flops=True,
        ):
            t0 = time.perf_counter()
            trainer.step(batches)
            profiled.append(time.perf_counter() - t0)
        if device.type == "cuda":
            torch.cuda.synchronize()
    p, q = statistics.median(plain) * 1e3, statistics.median(profiled) * 1e3
    print(f"{setup.model.name} on {setup.hardware.name}: seq {args.seq} x micro {args.micro_batch}, {args.precision}")
    print(f"unprofiled step (median of {args.pairs}): {p:9.1f} ms")
    print(f"profiled step   (median of {args.pairs}): {q:9.1f} ms")
    verdict = "meets" if q / p <= TARGET else "MISSES"
    print(f"ratio profiled / unprofiled: {q / p:.3f} (target <= {TARGET}: {verdict})")


if __name__ == "__main__":
    main()
