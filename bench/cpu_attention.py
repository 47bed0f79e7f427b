"""What attention costs on this CPU beside its matmuls: PyTorch's fused CPU attention (SDPA, causal) and
unfused attention (scores materialised, as the profiled model writes it), against the dense matmuls.

The CPU estimator prices each op class at a share of this CPU's peak (``advisor.spec.presets.cpu_host``,
``advisor.estimate.steptime``): matmuls at ``matmul_efficiency_frac``, and attention at a share of
that matmul rate, fused (``CPU_ATTENTION_EFFICIENCY_FRAC``) or unfused, its score traffic included
(``CPU_UNFUSED_ATTENTION_EFFICIENCY_FRAC``). This measures those shares ("/ matmul median"), forward
and backward, at the head dims and sequence lengths of the profiled models (the tiny model: head dim
32, 8 query and 4 key/value heads).

Run: ``.venv/bin/python bench/cpu_attention.py [--dtype bf16 fp32] [--out FILE]``. One process; each
case runs 3 warm-up and 7 timed passes, the median kept, the cases interleaved so drift hits all alike.
Rates are FLOPs done per second: causal fused attention counted on the half of the scores it computes
(2 x 2 x b x h x s^2 x d / 2 forward, twice that backward), unfused on the whole s x s square, the
matmuls (m x k x n, forward and both gradients) on 2 m k n each. Prints a Markdown table; each row's
"share of peak" divides by the peak ``cpu_host`` assumes for the dtype.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from advisor.analysis.summary import reuse_freed_memory
from advisor.spec.presets import cpu_flags, cpu_host

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SHAPES = [  # (batch, query heads, key/value heads, sequence, head dim)
    (2, 8, 4, 512, 32),
    (2, 8, 4, 1024, 32),
    (1, 8, 4, 2048, 32),
    (2, 8, 8, 1024, 64),
]
MATMULS = [(2048, 256, 688), (2048, 688, 256), (2048, 256, 8192), (4096, 512, 1376)]  # (m, k, n)


def _timed(fn, passes: int = 7) -> float:
    """Median seconds of ``fn`` (forward and backward) over ``passes`` after 3 warm-up passes."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(passes):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def attention_cases(dtype: torch.dtype):
    """(name, shape, useful FLOPs, step function) of fused and unfused attention at SHAPES."""
    for b, h, hkv, s, d in SHAPES:
        q = torch.randn(b, h, s, d, dtype=dtype, requires_grad=True)
        k = torch.randn(b, hkv, s, d, dtype=dtype, requires_grad=True)
        v = torch.randn(b, hkv, s, d, dtype=dtype, requires_grad=True)
        g = torch.randn(b, h, s, d, dtype=dtype)
        mask = torch.ones(s, s, dtype=torch.bool).triu(1)
        square = 2 * 2 * b * h * s * s * d  # QK^T and AV over the whole square, forward

        def fused(q=q, k=k, v=v, g=g):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1]).backward(g)

        def unfused(q=q, k=k, v=v, g=g, mask=mask, d=d):
            kk = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            vv = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
            scores = (q @ kk.transpose(-2, -1)) * d**-0.5
            (scores.masked_fill(mask, float("-inf")).softmax(dim=-1) @ vv).backward(g)

        shape = f"b{b} h{h}/{hkv} s{s} d{d}"
        yield "fused (SDPA, causal)", shape, 3 * square / 2, fused
        yield "unfused (scores in memory)", shape, 3 * square, unfused


def matmul_cases(dtype: torch.dtype):
    for m, k, n in MATMULS:
        a = torch.randn(m, k, dtype=dtype, requires_grad=True)
        w = torch.randn(k, n, dtype=dtype, requires_grad=True)
        g = torch.randn(m, n, dtype=dtype)

        def mm(a=a, w=w, g=g):
            (a @ w).backward(g)

        yield "matmul", f"{m} x {k} x {n}", 3 * 2 * m * k * n, mm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp32"])
    ap.add_argument("--out", type=Path, help="also write the table to this file")
    args = ap.parse_args()
    reuse_freed_memory(trim=False)  # as the profiling child: no fresh pages per pass
    torch.manual_seed(0)
    hw = cpu_host()
    flags = sorted(f for f in cpu_flags() if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16"))
    lines = [
        f"CPU: {hw.name}, flags {' '.join(flags)}; torch {torch.__version__}, {torch.get_num_threads()} threads",
        "",
        "| dtype | op | shape | ms (fwd + bwd) | GFLOP/s | share of peak | / matmul median |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for name in args.dtype:
        dtype = DTYPES[name]
        peak = hw.peak_flops(name)
        rows = []
        cases = list(matmul_cases(dtype)) + list(attention_cases(dtype))
        for op, shape, flops, fn in cases:
            rows.append((op, shape, _timed(fn), flops))
        mm_rate = statistics.median(f / t for op, _, t, f in rows if op == "matmul")
        for op, shape, t, flops in rows:
            rate = flops / t
            lines.append(
                f"| {name} | {op} | {shape} | {t * 1e3:,.1f} | {rate / 1e9:,.0f} | {rate / peak:.2f} | "
                f"{rate / mm_rate:.2f} |"
            )
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
