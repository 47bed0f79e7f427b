"""Measured machine ceilings: the matmul FLOP/s and copy bandwidth this device really reaches.

The roofline (``advisor.analysis.roofline``) judges each op against two roofs. Datasheet peaks are an upper
bound that plain PyTorch rarely meets (a CPU's fp32 GEMM reaches ~60-90 % of its FMA peak, an HBM
copy ~85-90 % of the datasheet bandwidth), so a short benchmark gives roofs the ops can reach:

* matmul: a square ``n x n`` by ``n x n`` product, ``2 n^3`` FLOPs, best of a few timed repeats after
  a warm-up (the best run is the ceiling; the others measure noise from other processes);
* copy: ``dst.copy_(src)`` of a >= 256 MiB buffer, far larger than any cache, counted as
  ``2 x size`` bytes (one read, one write), best of a few repeats.

On CUDA each timing is bracketed by CUDA events after a synchronise; on the CPU by
``time.perf_counter``. Results are saved as plain JSON in the run store (``traces/ceilings/<device>.json``,
one file per device name) and checked when loaded. Like ``advisor.run.child`` this module measures on
the device, so it touches CUDA; the CLI runs it in its own short-lived process, never in the app's.
"""

from __future__ import annotations

import math
import time
from datetime import datetime, timezone

from advisor.errors import AdvisorError
from advisor.spec.ceilings import _DTYPES, Ceilings


def _best_seconds(fn, device, repeats: int, budget_s: float) -> float:
    """Shortest of up to ``repeats`` timed calls of ``fn`` after one warm-up call; stops early once
    ``budget_s`` of wall time is spent (at least one timed call always runs)."""
    import torch

    cuda = device.type == "cuda"
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    best = math.inf
    start = time.perf_counter()
    for _ in range(repeats):
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, begin.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return best


def measure_ceilings(
    device: str = "cpu",
    dtypes: tuple[str, ...] = ("fp32", "bf16"),
    *,
    matmul_n: int = 0,
    copy_mib: int = 0,
    repeats: int = 5,
) -> Ceilings:
    """Measure this device's matmul FLOP/s per precision and its large-copy bandwidth (bytes/s).

    ``matmul_n`` 0 picks 8192 on CUDA (1.1 TFLOP a product, ~1.5 ms in bf16 on an H200: smaller
    squares leave the matrix units launch- and tail-bound) and 1024 on the CPU (2.1 GFLOP a product:
    ~15 ms on two cores, so five repeats stay well under a second). ``copy_mib`` 0 picks 1024 MiB on
    CUDA (far past an H100/H200's 50-60 MiB L2) and 256 on the CPU. bf16 is
    measured where ``torch`` supports it (CUDA with compute capability >= 8, or a CPU with
    AVX512-BF16/AMX; elsewhere PyTorch's CPU bf16 GEMM is a slow fallback that is not a ceiling and
    is skipped). Takes about 2-5 s on two CPU cores.
    """
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise AdvisorError("measure_ceilings(device='cuda'): CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise AdvisorError(f"measure_ceilings: device={device!r}; allowed: 'cpu', 'cuda'")
    for d in dtypes:
        if d not in _DTYPES:
            raise AdvisorError(f"measure_ceilings: dtype {d!r}; allowed: {_DTYPES}")
    n = matmul_n or (8192 if dev.type == "cuda" else 1024)
    copy_mib = copy_mib or (1024 if dev.type == "cuda" else 256)
    torch_dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    mm: dict[str, float] = {}
    slow = {d: why for d in dtypes if (why := slow_matmul_reason(dev, d))}
    if dtypes and len(slow) == len(set(dtypes)):
        raise AdvisorError(f"no precision asked for has a fast matmul to measure here: {'; '.join(slow.values())}")
    for d in dtypes:
        if d in slow:
            continue
        a = torch.randn(n, n, device=dev, dtype=torch_dtypes[d])
        b = torch.randn(n, n, device=dev, dtype=torch_dtypes[d])
        sec = _best_seconds(lambda a=a, b=b: torch.mm(a, b), dev, repeats, budget_s=2.0)
        mm[d] = 2 * n**3 / sec
        del a, b
    numel = copy_mib * 2**20 // 4
    src = torch.ones(numel, device=dev, dtype=torch.float32)
    dst = torch.empty_like(src)
    sec = _best_seconds(lambda src=src, dst=dst: dst.copy_(src), dev, repeats, budget_s=2.0)
    copy_rate = 2 * numel * 4 / sec
    del src, dst
    if dev.type == "cuda":
        # Hand the buffers back to the driver: a caller that goes on to profile (the GPU check) would
        # otherwise keep ~3 GiB cached in its own process, beside its children's.
        torch.cuda.empty_cache()
    from advisor.spec.presets import local_hardware

    name = local_hardware(dev.type).name  # the name runs on this device record, so lookups match
    if dev.type == "cuda":
        timer = f"CUDA events after a synchronise on {torch.cuda.get_device_name(dev)}"
    else:
        timer = f"time.perf_counter, {torch.get_num_threads()} threads"
    return Ceilings(
        device_name=name,
        matmul_flops_per_s=mm,
        copy_bytes_per_s=copy_rate,
        measured_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        method=(
            f"torch {torch.__version__}: matmul {n}x{n}x{n} (2n^3 FLOPs) and copy_ of {copy_mib} MiB fp32 "
            f"(2 x size bytes), best of {repeats} after one warm-up, timed with {timer}"
        ),
    )


def slow_matmul_reason(dev, precision: str) -> str:
    """Why ``precision`` has no fast GEMM on ``dev`` ('' where it has one): the slow fallbacks are not
    ceilings, so they are not measured."""
    import torch

    if precision == "fp32":
        return ""
    if dev.type == "cuda":
        need = 8 if precision == "bf16" else 7
        major = torch.cuda.get_device_capability(dev)[0]
        return "" if major >= need else f"{precision}: compute capability {major}.x has no {precision} tensor cores"
    from advisor.spec.presets import cpu_flags

    units = ("avx512_bf16", "amx_bf16") if precision == "bf16" else ("avx512_fp16", "amx_fp16")
    if set(units) & cpu_flags():
        return ""
    return (
        f"{precision}: this CPU has neither {' nor '.join(u.upper() for u in units)}, and PyTorch's fallback "
        "GEMM is not a ceiling"
    )


# --- kernel rates by shape: what the estimator's rate model assumes (advisor.estimate.efficiency) -------------

# GEMM shapes (m, n, k) timed by the GPU check: the tokens of a micro-batch (m) against the widths of
# Llama-class projections, QKV and MLP in and out of 8B and 70B on one GPU and on a TP 4 rank, down to
# the small k that TP leaves (1,024). Attention: causal flash attention at 16k tokens a batch.
GEMM_SHAPES = tuple(
    (m, n, k)
    for m in (2048, 8192, 32768)
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (2048, 8192), (8192, 1024), (10240, 8192))
)
QUICK_GEMM_SHAPES = ((256, 256, 256), (1024, 1024, 256), (1024, 1024, 1024))
ATTENTION_SEQS = (1024, 2048, 4096, 8192, 16384)


def measure_kernel_rates(device: str = "cuda", *, quick: bool = False, repeats: int = 3) -> dict:
    """Time the GEMM shapes (bf16, and fp8 through ``torch._scaled_mm`` where the device has fp8 units,
    compute capability 8.9 and up) and causal flash attention forward and backward (PyTorch's flash
    kernel, FlashAttention-2, and cuDNN's where the build has it) on this device; returns the table
    ``advisor.estimate.efficiency.fit_device_table`` fits the rate model to, as plain JSON-ready data.

    Attention FLOPs follow the estimator: a causal forward 2 b s^2 H d (half of 4 b s^2 H d), a
    backward twice that. ``quick`` (the CPU smoke test) times three small fp32 GEMMs and no attention.
    On an H200 the whole table takes about 30 s."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise AdvisorError("measure_kernel_rates(device='cuda'): CUDA is not available on this machine")
    gemm: list[dict] = []
    shapes = QUICK_GEMM_SHAPES if quick else GEMM_SHAPES
    precisions = ["fp32"] if dev.type == "cpu" else ["bf16"]
    if dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (8, 9) and hasattr(torch, "_scaled_mm"):
        precisions.append("fp8")
    for precision in precisions:
        for m, n, k in shapes:
            sec = _time_gemm(dev, precision, m, n, k, repeats)
            if sec is not None:
                gemm.append({"precision": precision, "m": m, "n": n, "k": k, "seconds": sec})
    attention: list[dict] = []
    if dev.type == "cuda" and not quick:
        for impl in ("fa2", "cudnn"):
            for head_dim in (64, 128):
                for seq in ATTENTION_SEQS:
                    row = _time_attention(dev, impl, seq, head_dim, repeats)
                    if row is not None:
                        attention.append(row)
        torch.cuda.empty_cache()
    from advisor.spec.presets import local_hardware

    return {
        "device_name": local_hardware(dev.type).name,
        "measured_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "method": f"torch {torch.__version__}: best of {repeats} after one warm-up (CUDA events / perf_counter)",
        "gemm": gemm,
        "attention": attention,
    }


def _time_gemm(dev, precision: str, m: int, n: int, k: int, repeats: int) -> float | None:
    """Seconds of one m x n x k GEMM, None where it cannot run. fp8: per-tensor scales, bf16 output,
    and the mix torchao's float8 training runs: of a linear's three GEMMs the forward's accumulates
    fast (``Float8LinearConfig.gemm_config_output``: use_fast_accum=True, torchao 0.18 float8/config.py
    line 215) and the two backward ones do not (the default, False); the time is their mean,
    weighted 1 : 2."""
    import torch

    try:
        if precision == "fp8":
            a = torch.randn(m, k, device=dev).to(torch.float8_e4m3fn)
            b = torch.randn(n, k, device=dev).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
            one = torch.tensor(1.0, device=dev)

            def mm(fast: bool):
                return lambda: torch._scaled_mm(
                    a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=fast
                )

            fast, exact = (_best_seconds(mm(f), dev, repeats, 2.0) for f in (True, False))
            return (fast + 2 * exact) / 3
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
        a = torch.randn(m, k, device=dev, dtype=dtype)
        b = torch.randn(k, n, device=dev, dtype=dtype)
        return _best_seconds(lambda: torch.mm(a, b), dev, repeats, 2.0)
    except (RuntimeError, TypeError) as err:  # no fp8 GEMM in this build or on this device
        print(f"  gemm {precision} {m}x{n}x{k} skipped: {err}".splitlines()[0])
        return None


def _time_attention(dev, impl: str, seq: int, head_dim: int, repeats: int) -> dict | None:
    """Forward and backward seconds of causal SDPA at ``seq`` (16k tokens a batch, 4,096-wide heads)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"fa2": SDPBackend.FLASH_ATTENTION, "cudnn": getattr(SDPBackend, "CUDNN_ATTENTION", None)}[impl]
    if backend is None:
        return None
    batch, heads = max(1, 16384 // seq), 4096 // head_dim
    shape = (batch, heads, seq, head_dim)
    q, k, v = (torch.randn(shape, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    try:
        with sdpa_kernel(backend):
            fwd = _best_seconds(
                lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), dev, repeats, 2.0
            )
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            grad = torch.ones_like(out)
            both = _best_seconds(
                lambda: torch.autograd.grad(
                    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), grad
                ),
                dev,
                repeats,
                2.0,
            )
    except RuntimeError as err:  # the backend cannot run this shape here
        print(f"  attention {impl} s={seq} d={head_dim} skipped: {err}".splitlines()[0])
        return None
    fwd_flops = 2.0 * batch * heads * seq * seq * head_dim  # causal: half of 4 b s^2 H d
    return {
        "impl": impl,
        "seq": seq,
        "head_dim": head_dim,
        "fwd_seconds": fwd,
        "bwd_seconds": max(both - fwd, 1e-9),
        "fwd_flops": fwd_flops,
    }
