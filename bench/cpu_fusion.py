"""What torch.compile (Inductor) gains on this CPU's memory-bound chains, by chain and size: the
evidence behind the fusion gain's CPU pricing (``advisor.advice.gains.fusion``).

Each chain runs forward and backward, as the profiled step runs it (bf16 inputs under CPU autocast),
eager and compiled (``torch.compile(dynamic=False)``), over a range of sizes from inside the L2 cache
to well past the L3:

- ``attention-scores``: the unfused attention core's score chain of ``advisor.run.model`` (scale, causal
  ``masked_fill``, softmax; its backward: softmax backward, the mask's and the scale's), with the
  ``@ v`` left out: only the s x s memory-bound ops;
- ``rmsnorm``: RMSNorm as the model writes it (fp32 upcast, mean of squares, rsqrt, weight);
- ``swiglu``: ``silu(gate) * up``;
- ``cross-entropy``: log-softmax and NLL over the vocabulary (the loss).

Run: ``.venv/bin/python bench/cpu_fusion.py [--rounds 5]``. One process; eager and compiled
interleaved per round, the median kept. Prints a Markdown table (ratio eager / compiled: above 1 the
compiled chain is faster).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from advisor.spec.presets import cpu_flags


def attention_scores(s: int, heads: int = 8, batch: int = 2):
    x = torch.randn(batch, heads, s, s, dtype=torch.bfloat16, requires_grad=True)

    def f(x):
        scores = x * 32**-0.5
        mask = torch.ones(s, s, dtype=torch.bool).triu(1)
        return scores.masked_fill(mask, float("-inf")).softmax(dim=-1)

    return f, (x,), x.numel() * 2


def rmsnorm(tokens: int, hidden: int = 256):
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(hidden, requires_grad=True)

    def f(x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w

    return f, (x,), x.numel() * 2


def swiglu(tokens: int, ffn: int = 688):
    g = torch.randn(tokens, ffn, dtype=torch.bfloat16, requires_grad=True)
    u = torch.randn(tokens, ffn, dtype=torch.bfloat16, requires_grad=True)
    return (lambda g, u: F.silu(g) * u), (g, u), g.numel() * 2


def cross_entropy(tokens: int, vocab: int = 8192):
    x = torch.randn(tokens, vocab, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, vocab, (tokens,))
    return (lambda x: F.cross_entropy(x.float(), y)), (x,), x.numel() * 2


CHAINS = {
    "attention-scores": (attention_scores, (128, 256, 512, 1024)),
    "rmsnorm": (rmsnorm, (256, 2048, 16384, 65536)),
    "swiglu": (swiglu, (256, 2048, 8192, 32768)),
    "cross-entropy": (cross_entropy, (64, 512, 2048)),
}


def _time(f, args, reps: int) -> float:
    """Median seconds of forward + backward."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = f(*args)
        y.float().sum().backward()
        out.append(time.perf_counter() - t0)
        for a in args:
            a.grad = None
    return statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", nargs="*", choices=list(CHAINS))
    args = ap.parse_args()
    torch.manual_seed(0)
    flags = (
        " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx512_bf16", "amx", "avx512_fp16"))))
        or "AVX2/AVX512 only"
    )
    print(f"CPU flags: {flags}; {torch.get_num_threads()} threads; torch {torch.__version__}\n")
    print("| chain | size | input MiB | eager ms | compiled ms | eager / compiled |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (make, sizes) in CHAINS.items():
        if args.only and name not in args.only:
            continue
        for size in sizes:
            f, inputs, nbytes = make(size)
            compiled = torch.compile(f, dynamic=False)
            for fn in (f, compiled):  # warm: compile, oneDNN, the allocator
                _time(fn, inputs, 2)
            eager_s, comp_s = [], []
            for _ in range(args.rounds):
                eager_s.append(_time(f, inputs, 3))
                comp_s.append(_time(compiled, inputs, 3))
            e, c = statistics.median(eager_s), statistics.median(comp_s)
            print(
                f"| {name} | {size} | {nbytes / 2**20:.1f} | {e * 1e3:.2f} | {c * 1e3:.2f} | {e / c:.2f} |", flush=True
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
