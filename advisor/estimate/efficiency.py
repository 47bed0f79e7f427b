"""Achievable rates of a training step's kernels: GEMMs by shape and precision, flash attention by
implementation and sequence, and the fixed cost each kernel and each overlapped collective adds.

The estimator used to take every GEMM at one share of the datasheet peak (0.80 on Hopper) and
attention at half of it, which is right for an 8192^3 matmul and too fast for most training steps:
on 22 published H100-GB200 runs it was too fast on every one (issue 17). What this module models:

- GEMMs [tile]: a GEMM of m x n x k runs as output tiles spread over the SMs in waves. The rate is
  the device's large-GEMM share (``HardwareSpec.matmul_efficiency_frac``, measured: 790 of 989
  TFLOP/s for bf16 8192^3 on our H200) times the tile/wave utilisation of (m, n) for the best of
  three tile sizes, times a small-k factor k / (k + k_half), normalised to 1 at k = 8192 where the
  share was measured. fp8 GEMMs reach ``fp8_gemm_frac`` of the fp8 peak instead, fitted.
- Flash attention [FA3]: forward and backward rates per implementation, saturating in sequence
  length as r_max x s / (s + s_half), from the FlashAttention-3 paper's H100 SXM5 benchmarks (head
  dim 128, causal forward; backward): FlashAttention-2 (what PyTorch's SDPA runs) 191 -> 335 TFLOP/s
  forward and 214 -> 322 backward for s = 512 -> 16k; cuDNN (TransformerEngine's fused attention, what
  Megatron-LM and NeMo run) 315 -> 539 forward and 305 -> 516 backward (backward counted as 2.5
  forwards there, as 2 here). A100: FlashAttention-2 paper, "up to 73 % of the theoretical maximum
  FLOP/s" forward, taken with the H100 FA2 curve's shape.
- A per-kernel cost (launch gap, tail of a wave) paid by each of a block's kernels: what makes small
  models and eager PyTorch slow, fitted.
- Overlap: communication that runs beside compute still takes SMs and memory bandwidth from it;
  ``overlap_slowdown_frac`` of the hidden time is added back, fitted.

Sources:
- [tile] NVIDIA, "Matrix Multiplication Background User's Guide" (docs.nvidia.com/deeplearning/
  performance/dl-performance-matrix-multiplication): tile and wave quantization.
- [FA3] Shah et al. 2024, "FlashAttention-3" (arXiv 2407.08608), figures "Attention forward speed,
  head dim 128 (H100 80GB SXM5)" (causal) and "Attention backward speed, head dim 128".
- [SM] SM counts: H100 SXM5 132 (glennklockwood.com/garden/processors/h100, from NVIDIA's Hopper
  whitepaper), A100 108 (NVIDIA A100 whitepaper), B200 148 ("74 SMs per die, giving 148 SMs",
  chipsandcheese.com, "Nvidia's B200: Keeping the CUDA Juggernaut Rolling").

Fitted constants live in ``advisor/estimate/efficiency_fit.json``, written by ``bench/published_runs.py --fit``
from the published runs (once, for all devices), with the leave-one-source-out error beside them.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

FIT_PATH = Path(__file__).with_name("efficiency_fit.json")

# Output tiles cuBLAS/CUTLASS pick among, with the share of the large tile's rate each reaches
# (smaller tiles reuse less of what they load: an assumption, stated, not measured).
TILES: tuple[tuple[int, int, float], ...] = ((128, 256, 1.0), (128, 128, 0.9), (64, 128, 0.7))
# The k at which the large-GEMM share was measured (an 8192^3 matmul, DESIGN.md).
REFERENCE_K = 8192
# Flash attention rate curves, fractions of the bf16 dense peak (989 TFLOP/s on H100) [FA3]:
# (forward r_max, forward s_half, backward r_max, backward s_half). FA2 forward 345 x s / (s + 300)
# gives 217, 298, 330 at s = 512, 2k, 8k against the measured 191, 298, 333; cuDNN forward 560 x s /
# (s + 400) gives 314, 469, 534 against 315, 484, 529. The FlashAttention benchmarks count a backward
# pass as 2.5 forwards of FLOPs (benchmarks/benchmark_flash_attention.py: ``2.5 * f if mode ==
# "bwd"``) and the estimator 2 (three matmuls' worth of the forward's two, recompute of the scores
# included in neither), so the backward rates are their figures x 2 / 2.5: FA2 330 -> 264, cuDNN
# 545 -> 436 TFLOP/s at long sequences.
BWD_FLOPS_FA_TO_OURS = 2.0 / 2.5
ATTENTION_CURVES: dict[str, tuple[float, float, float, float]] = {
    "fa2": (345 / 989, 300.0, BWD_FLOPS_FA_TO_OURS * 330 / 989, 260.0),
    "cudnn": (560 / 989, 400.0, BWD_FLOPS_FA_TO_OURS * 545 / 989, 420.0),
    # FlashAttention-2 on A100: up to 73 % of peak forward (FA2 paper); backward as on H100, relative.
    "fa2-ampere": (0.73, 300.0, 0.73 * BWD_FLOPS_FA_TO_OURS * 330 / 345, 260.0),
}


@dataclass(frozen=True, slots=True)
class EfficiencyParams:
    """The fitted constants of the rate model (defaults: the prior before any fit)."""

    sustained_frac: float = 0.9
    """Share of its short-benchmark rate a GPU keeps over a training run's steps (clocks drop under
    sustained power and heat); scales GEMMs and attention."""
    gemm_k_half: float = 256.0
    """k at which a GEMM's small-k factor k / (k + k_half) is one half."""
    fp8_gemm_frac: float = 0.65
    """Share of the fp8 dense peak that large fp8 GEMMs reach, scaling casts included."""
    kernel_s: float = 2e-6
    """Fixed GPU-side cost of one kernel of a block (the gap before it, its last wave's tail), seconds."""
    eager_kernel_factor: float = 2.0
    """Kernels an eager PyTorch block launches for each one of a fused (Megatron-LM) block."""
    host_op_s: float = 10e-6
    """Host time eager PyTorch spends to dispatch and launch one op, seconds: the GPU waits where a
    block's ops take the host longer than the GPU takes to run them."""
    overlap_slowdown_frac: float = 0.15
    """Share of the communication hidden behind compute that still slows it (SMs and HBM it takes)."""
    memory_bound_scale: float = 1.0
    """Multiplier on the modelled memory-bound traffic (norms, activations, casts, residuals)."""
    eager_memory_factor: float = 1.5
    """Further multiplier on that traffic in eager PyTorch without torch.compile: unfused norms, RoPE
    and activations each read and write their tensors once per op."""

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


PARAM_BOUNDS: dict[str, tuple[float, float]] = {
    "sustained_frac": (0.5, 1.05),
    "gemm_k_half": (16.0, 2048.0),
    "fp8_gemm_frac": (0.3, 0.85),
    "kernel_s": (0.0, 10e-6),
    "host_op_s": (1e-6, 60e-6),
    "eager_kernel_factor": (1.0, 4.0),
    "overlap_slowdown_frac": (0.0, 0.6),
    "memory_bound_scale": (0.5, 6.0),
    "eager_memory_factor": (1.0, 4.0),
}


# What the constants are believed to be before the fit, and how firmly: (centre, width, scale). The
# fit pays (x - centre) / width, on log x for 'log', as much as one run's log step-time error over
# FIT_NOISE: a constant moves a width from its centre only where that buys a run's worth of error.
# The centres are the stated assumptions above; the widths say how far from them is still plausible.
PRIORS: dict[str, tuple[float, float, str]] = {
    "sustained_frac": (0.9, 0.1, "lin"),
    "gemm_k_half": (256.0, 1.0, "log"),
    "fp8_gemm_frac": (0.65, 0.1, "lin"),
    "kernel_s": (2e-6, 1.0, "log"),
    "eager_kernel_factor": (2.0, 0.5, "lin"),
    "host_op_s": (10e-6, 1.0, "log"),
    "overlap_slowdown_frac": (0.15, 0.1, "lin"),
    "memory_bound_scale": (1.0, 0.5, "log"),
    "eager_memory_factor": (1.5, 0.5, "lin"),
}
# The step-time error (log) one run is expected to keep whatever the constants: the spread of repeated
# measurements and what the model leaves out.
FIT_NOISE = 0.08


def prior_residuals(params: EfficiencyParams) -> list[float]:
    """Each constant's distance from its prior centre in widths (``PRIORS``)."""
    out = []
    for name, (centre, width, kind) in PRIORS.items():
        x = getattr(params, name)
        out.append((math.log(max(x, 1e-12) / centre) if kind == "log" else x - centre) / width)
    return out


def _fit_record(path: Path = FIT_PATH) -> dict:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def load_fitted(path: Path = FIT_PATH) -> EfficiencyParams:
    """The fitted constants (the prior where the file is absent or names unknown fields)."""
    data = _fit_record(path).get("params")
    if not isinstance(data, dict):
        return EfficiencyParams()
    names = {f.name for f in fields(EfficiencyParams)}
    return EfficiencyParams(**{k: float(v) for k, v in data.items() if k in names})


@dataclass(frozen=True, slots=True)
class ErrorBand:
    """How far the estimate lands from runs it was not fitted on (``bench/published_runs.py --fit``)."""

    step_pct: float
    """Mean absolute step-time error over the published runs, each held out of the fit (leave one
    source out); MFU and tokens/s carry the same relative error."""
    step_p90_pct: float
    """90 % of those runs are within this."""
    memory_pct: float | None
    """Mean absolute peak-memory error where a source publishes the peak (None: no such run)."""
    fitted_on: str


def load_error_band(path: Path = FIT_PATH) -> ErrorBand | None:
    """The error band of the fitted constants (None before any fit)."""
    record = _fit_record(path)
    try:
        step = record["step_time_error_pct"]
        memory = record.get("memory_error_pct", {}).get("mean_abs")
        return ErrorBand(
            float(step["loso_mean_abs"]),
            float(step["loso_p90_abs"]),
            None if memory is None else float(memory),
            str(record.get("fitted_on", "")),
        )
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


FITTED = load_fitted()
ERROR_BAND = load_error_band()


@functools.lru_cache(maxsize=65536)
def _tile_utilisation(m: int, n: int, sms: int) -> float:
    """Best share of the SMs' tile work that is useful for an m x n output [tile]: wave quantization
    (the last wave partly idle) times tile quantization (edge tiles partly empty), by tile size."""
    if sms <= 0:
        return 1.0
    best = 0.0
    for tm, tn, tile_eff in TILES:
        tiles = math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(tiles / sms)
        best = max(best, tile_eff * (m * n) / (waves * sms * tm * tn))
    return best


def gemm_efficiency(m: int, n: int, k: int, large_frac: float, sms: int, k_half: float) -> float:
    """Share of the peak an m x n x k GEMM reaches: the large-GEMM share x tile/wave utilisation x
    small-k factor (1 at k = 8192)."""
    m, n, k = max(1, int(m)), max(1, int(n)), max(1, int(k))
    k_factor = (k / (k + k_half)) / (REFERENCE_K / (REFERENCE_K + k_half))
    return large_frac * _tile_utilisation(m, n, sms) * min(1.0, k_factor)


def gemms_time_s(shapes: list[tuple[float, int, int, int]], peak: float, large_frac: float, sms: int, k_half: float):
    """(FLOPs, seconds) of forward and backward of the GEMMs ``(count, m, n, k)``: the forward
    m x n x k, the input gradient m x k x n, the weight gradient k x n x m (each 2mnk FLOPs)."""
    flops = seconds = 0.0
    for count, m, n, k in shapes:
        f = 2.0 * m * n * k
        for a, b, c in ((m, n, k), (m, k, n), (k, n, m)):
            flops += count * f
            seconds += count * f / (peak * gemm_efficiency(a, b, c, large_frac, sms, k_half))
    return flops, seconds


def attention_frac(
    impl: str, seq: int, head_dim: int, curve: tuple[float, float, float, float] | None = None
) -> tuple[float, float]:
    """(forward, backward) share of the 16-bit peak flash attention reaches at sequence ``seq``
    [FA3], or on ``curve`` (a device's measured one, ``DeviceFit.attention``). Head dims under 128 run
    slower: cuDNN's causal forward at 16k reads 413 TFLOP/s with head dim 64 against 539 with 128
    [FA3], taken as 0.8 for both passes."""
    fr, fs, br, bs = curve or ATTENTION_CURVES[impl]
    hd = 1.0 if head_dim >= 128 else 0.8
    return hd * fr * seq / (seq + fs), hd * br * seq / (seq + bs)


def attention_impl(framework: str, hardware_name: str) -> str:
    """Which flash attention a framework runs: TransformerEngine's cuDNN kernels under Megatron-LM/
    NeMo on Hopper and Blackwell, FlashAttention-2 under eager PyTorch (SDPA) and on Ampere."""
    ampere = hardware_name.startswith(("A100", "A10", "L40", "V100"))
    if ampere:
        return "fa2-ampere"
    return "fa2" if framework == "pytorch" else "cudnn"


# --- measured kernel tables: the rate model fitted to one device's own GEMMs and attention ----------

DEVICE_TABLES_DIR = Path(__file__).with_name("device_tables")


@dataclass(frozen=True, slots=True)
class DeviceFit:
    """The rate model's device constants fitted to a kernel table measured on that device
    (``advisor.run.ceilings.measure_kernel_rates``, run by scripts/gpu_check.sh): they replace the
    datasheet-and-prior values for it."""

    device_name: str
    large_frac: dict[str, float]
    """Per precision ('bf16', 'fp8'...): the share of the peak the largest GEMMs reach."""
    k_half: float
    attention: dict[str, tuple[float, float, float, float]]
    """Per implementation ('fa2', 'cudnn'): the curve as ``ATTENTION_CURVES`` holds it."""
    gemm_error_pct: float
    """Mean absolute error of the fitted GEMM times against the measured ones."""
    measured_utc: str


def fit_device_table(table: dict, peaks: dict[str, float], sms: int) -> DeviceFit:
    """Fit the GEMM model (a large-GEMM share per precision and one k_half) and the attention curves
    (r_max and s_half, forward and backward, head dim 128) to a measured table; ``peaks`` are the
    device's dense FLOP/s per precision. Raises ValueError on a table without GEMM rows."""
    from scipy.optimize import least_squares

    rows = [r for r in table.get("gemm", []) if r.get("precision") in peaks and r.get("seconds", 0) > 0]
    if not rows:
        raise ValueError(f"{table.get('device_name', '?')}: no GEMM rows for {', '.join(peaks)}")
    precisions = sorted({r["precision"] for r in rows})

    def gemm_residuals(x) -> list[float]:
        k_half, fracs = x[0], dict(zip(precisions, x[1:], strict=True))
        out = []
        for r in rows:
            eff = gemm_efficiency(r["m"], r["n"], r["k"], fracs[r["precision"]], sms, k_half)
            predicted = 2.0 * r["m"] * r["n"] * r["k"] / (peaks[r["precision"]] * eff)
            out.append(math.log(predicted / r["seconds"]))
        return out

    x0 = [256.0] + [0.7] * len(precisions)
    fit = least_squares(
        gemm_residuals, x0, bounds=([1.0] + [0.05] * len(precisions), [8192.0] + [1.2] * len(precisions))
    )
    errors = [abs(math.expm1(e)) for e in gemm_residuals(fit.x)]
    attention: dict[str, tuple[float, float, float, float]] = {}
    peak16 = peaks.get("bf16", 0.0)
    for impl in sorted({r["impl"] for r in table.get("attention", [])}):
        att = [r for r in table["attention"] if r["impl"] == impl and r["head_dim"] >= 128]
        if len(att) < 2 or peak16 <= 0:
            continue
        curve = []
        for key, flops_per_fwd in (("fwd_seconds", 1.0), ("bwd_seconds", 2.0)):
            seqs = [r["seq"] for r in att]
            fracs = [flops_per_fwd * r["fwd_flops"] / r[key] / peak16 for r in att]

            def curve_residuals(x, seqs=seqs, fracs=fracs) -> list[float]:
                return [math.log(x[0] * s / (s + x[1]) / f) for s, f in zip(seqs, fracs, strict=True)]

            c = least_squares(curve_residuals, [max(fracs), 300.0], bounds=([0.01, 1.0], [1.5, 1e5]))
            curve += [float(c.x[0]), float(c.x[1])]
        attention[impl] = tuple(curve)  # type: ignore[assignment]
    return DeviceFit(
        device_name=str(table.get("device_name", "")),
        large_frac={p: float(v) for p, v in zip(precisions, fit.x[1:], strict=True)},
        k_half=float(fit.x[0]),
        attention=attention,
        gemm_error_pct=100.0 * sum(errors) / len(errors),
        measured_utc=str(table.get("measured_utc", "")),
    )


def fit_device(table: dict, hw) -> DeviceFit:
    """``fit_device_table`` on ``hw``'s dense peaks of every precision it has, and its SM count."""
    peaks = {p: hw.peak_flops(p) for p in ("fp32", "bf16", "fp16", "fp8") if hw.peak_flops(p) > 0}
    return fit_device_table(table, peaks, hw.sm_count)


def device_table_path(device_name: str, root: Path = DEVICE_TABLES_DIR) -> Path:
    """Where the measured kernel table of ``device_name`` is kept (one JSON file a device)."""
    from advisor.spec.presets import device_slug

    return root / f"{device_slug(device_name)}.json"


@functools.lru_cache(maxsize=64)
def device_fit(hw) -> DeviceFit | None:
    """The rate model fitted to ``hw``'s measured kernel table, None where none was measured (or the
    file is damaged: the model's datasheet values stand, and a message says so on stderr)."""
    path = device_table_path(hw.name, DEVICE_TABLES_DIR)
    if not path.is_file():
        return None
    import sys

    try:
        return fit_device(json.loads(path.read_text()), hw)
    except (OSError, ValueError, KeyError, TypeError, ImportError) as err:  # ImportError: no scipy to fit with
        print(f"advisor: ignoring the kernel table {path.name}: {err}", file=sys.stderr)
        return None


MEMORY_BAND_SCOPE = "eager PyTorch with FSDP (ZeRO-3), dense, no pipeline, context or expert parallelism, no offload"
"""The setups whose peak memory a source publishes (torchtitan's and Trainy's Llama 3.1 8B and 70B runs,
``bench/results/published_runs.md``): the memory band is measured on these and shown only for them. No
source in the set publishes the peak of a Megatron-style, pipelined, MoE or offloading run."""


def memory_band_applies(setup) -> bool:
    """Whether ``setup`` is of the kind the memory band was measured on (``MEMORY_BAND_SCOPE``)."""
    p, t = setup.parallel, setup.train
    return (
        setup.hardware.kind == "gpu"
        and t.framework == "pytorch"
        and p.zero == 3
        and p.pp == 1
        and p.cp == 1
        and p.ep == 1
        and not setup.model.n_experts
        and p.offload == "none"
        and not t.offload_activations
    )


def band_note() -> str:
    """Where the error bands come from, said once under the figures."""
    if ERROR_BAND is None:
        return ""
    mem = (
        f"; memory ±{ERROR_BAND.memory_pct:.0f} % where sources publish the peak, shown for those setups only "
        f"({MEMORY_BAND_SCOPE})"
        if ERROR_BAND.memory_pct is not None
        else ""
    )
    return (
        f"Error bands: step time, tokens/s and MFU ±{ERROR_BAND.step_pct:.0f} % on average (90 % of runs within "
        f"±{ERROR_BAND.step_p90_pct:.0f} %), measured on published runs each held out of the fit "
        f"({ERROR_BAND.fitted_on}){mem}; bench/results/published_runs.md."
    )
