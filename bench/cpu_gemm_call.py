"""The fixed cost of one GEMM call on this CPU, as the profiler records it: what stays of a GEMM's time
when its precision changes (``advisor.analysis.roofline.GEMM_CALL_FIXED_US``).

A linear layer of negligible size (m = k = n = 8: 1 kFLOP forward) runs forward and backward under
autocast, as the profiled step runs its model, and under ``torch.profiler`` as the profiled step is
recorded. Each call's recorded time is then almost all fixed cost: dispatch, autocast's cast, the
output's allocation, the oneDNN/BLAS call and its thread fork, and the profiler's own record. The
GEMM ops are read as the CPU roofline groups them (``aten::linear`` forward with what it calls;
``aten::mm`` in backward), per call, with the same loop unprofiled beside them.

Run: ``.venv/bin/python bench/cpu_gemm_call.py [--dtype fp32 bf16 fp16] [--size 8] [--calls 2000]``.
One process; the dtypes interleaved over 3 rounds, the median kept. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from advisor.spec.presets import cpu_flags

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
GEMM_OPS = ("aten::linear", "aten::mm", "aten::addmm", "aten::matmul")


def _loop(x: torch.Tensor, w: torch.Tensor, dtype: str, calls: int) -> None:
    cast = torch.autocast("cpu", dtype=DTYPES[dtype]) if dtype != "fp32" else nullcontext()
    for _ in range(calls):
        with cast:
            y = F.linear(x, w)
        y.float().sum().backward()


def one(dtype: str, size: int, calls: int) -> dict[str, float]:
    """Per-call µs: the unprofiled forward + backward, and each GEMM op's recorded time per call."""
    x = torch.randn(size, size, requires_grad=True)
    w = torch.randn(size, size, requires_grad=True)
    _loop(x, w, dtype, 50)  # warm: oneDNN primitives, autocast's cast cache
    t0 = time.perf_counter()
    _loop(x, w, dtype, calls)
    out = {"step_us": (time.perf_counter() - t0) / calls * 1e6}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _loop(x, w, dtype, calls)
    for e in prof.key_averages():
        if e.key in GEMM_OPS and e.count:
            out[e.key] = e.cpu_time_total / e.count  # inclusive: with what it calls, as the roofline groups
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--size", type=int, default=8)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    runs: dict[str, list[dict[str, float]]] = {d: [] for d in args.dtype}
    for _ in range(args.rounds):
        for d in args.dtype:
            runs[d].append(one(d, args.size, args.calls))
    flags = " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx512_bf16", "amx", "avx512_fp16"))))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, flags: {flags or 'avx2 only'}")
    print(f"linear {args.size}x{args.size}x{args.size}, {args.calls} calls, median of {args.rounds} rounds\n")
    keys = ["step_us", *GEMM_OPS]
    print(
        "| dtype | forward + backward, unprofiled (us) | " + " | ".join(f"{k} per call (us)" for k in GEMM_OPS) + " |"
    )
    print("|---|" + "---:|" * len(keys))
    for d in args.dtype:
        cells = []
        for k in keys:
            vals = [r[k] for r in runs[d] if k in r]
            cells.append(f"{statistics.median(vals):.1f}" if vals else "-")
        print(f"| {d} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
