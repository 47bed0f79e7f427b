"""Published training runs with their layouts, the estimator's step time against them, and the fit of
the rate model's constants (``advisor.estimate.efficiency``) with its leave-one-source-out error.

The runs (``published_runs.json`` beside this file, each with its citation, the row as published and
what the source leaves out and was assumed; Korthikanti's below):

- korthikanti: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
  Models", table 4): one iteration of four GPT models on Selene (DGX A100 80 GB), fp16, sequence 2048,
  vocabulary 51200, full recompute and selective recompute + SP; the layouts Calculon (Isaev et al.
  2023) validates against (``calculon-ai/calculon``, ``validation/*.json``). Calculon's mean error on
  them: 3.7 %.
- torchtitan: pytorch/torchtitan's performance pages: Llama 3 and 2 on 64 A100 with FSDP2 (2024-04),
  Llama 3.1 on Grand Teton H100s (96 GB HBM2e, 500 W) with FSDP2, TP, compile and float8 (2024-12,
  2025-06).
- trainy: a third party's torchtitan run on 32 and 64 H200 (float8, compile), in torchtitan's repo.
- llm-foundry: MosaicML's MPT benchmarks (Composer FSDP, bf16 and TransformerEngine fp8, A100 and H100).
- nemo: NVIDIA NeMo's performance summaries 24.07 (H100), 25.02 (B200), 25.04 (GB200): fp8 Megatron-Core.
- megatron-bridge: NVIDIA Megatron-Bridge's performance archive, 25.11 (H100, B200, GB200, fp8).
- llama3-paper: "The Llama 3 Herd of Models" (Meta 2024), table 4: 405B on 8,192 and 16,384 H100.

Measured throughput is converted to a step time: tokens per step over tokens/s per GPU x GPUs, or,
where a source gives TFLOP/s per GPU, model FLOPs per step over it (PaLM's count).

Run ``python bench/published_runs.py`` for the table; ``--fit`` refits the constants.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
from dataclasses import dataclass, fields, replace
from pathlib import Path

from advisor.estimate.efficiency import FIT_NOISE, PARAM_BOUNDS, EfficiencyParams, prior_residuals
from advisor.estimate.estimator import Estimate, estimate
from advisor.spec.presets import get_hardware, get_model, gpt2_style
from advisor.spec.specs import ModelSpec, ParallelSpec, Setup, TrainSpec

RUNS_PATH = Path(__file__).with_name("published_runs.json")
KORTHIKANTI = "korthikanti"
KORTHIKANTI_CITATION = "Korthikanti et al. 2022, table 4 (Megatron-LM on DGX A100 80 GB)"

# MosaicML's MPT models as benchmarked (llm-foundry scripts/train/yamls/pretrain/mpt-*.yaml): GPT-2's
# block (LayerNorm, GELU MLP of 4h, biases), multi-head attention, vocabulary 50368, learned positions
# up to the sequence trained (the benchmark's NumParams grows with it), tied head.
MPT = {
    "mpt-125m": (12, 768, 12),
    "mpt-760m": (24, 1536, 12),
    "mpt-1b": (24, 2048, 16),
    "mpt-3b": (32, 2560, 20),
    "mpt-7b": (32, 4096, 32),
    "mpt-13b": (40, 5120, 40),
    "mpt-30b": (48, 7168, 56),
    "mpt-70b": (80, 8192, 64),
}


def megatron_gpt(name: str, n_layers: int, hidden: int, n_heads: int) -> ModelSpec:
    """A GPT of Megatron-LM's papers: GPT-2's block (LayerNorm, GELU MLP of 4h, biases, learned
    positions, tied head) at sequence 2048 and vocabulary 51200 (50257 padded to a multiple of 1024)."""
    return replace(gpt2_style(name, n_layers, hidden, n_heads), vocab=51200, max_positions=2048)


def published_model(name: str) -> ModelSpec:
    """A model of the published runs: a preset, an MPT model at its sequence ("mpt-7b@2048") or NeMo's
    GPT-3 175B (Megatron's GPT block, vocabulary 50257 padded to 51200 by Megatron's default)."""
    if name.startswith("mpt-"):
        size, seq = name.split("@")
        layers, hidden, heads = MPT[size]
        return replace(gpt2_style(size, layers, hidden, heads), vocab=50368, max_positions=int(seq))
    if name == "gpt3-175b-nemo":
        return megatron_gpt("gpt3-175b", 96, 12288, 96)
    return get_model(name)


@dataclass(frozen=True, slots=True)
class PublishedRun:
    """One published measurement: the setup as its source ran it, and its measured step time."""

    name: str
    setup: Setup
    measured_step_s: float
    source: str
    """The publisher, the unit of leave-one-source-out ('torchtitan', 'nemo', ...)."""
    citation: str = ""
    quote: str = ""
    """The row as published."""
    assumed: tuple[str, ...] = ()
    """What the source does not give, and what was taken."""
    measured_memory_gib: float | None = None
    """Peak memory per GPU where the source gives it (torchtitan: max over GPUs, GiB)."""
    excluded_because: str = ""
    """Why the run is kept out of the validation set (a layout value that sets the step is unknown)."""

    def compare(self, params: EfficiencyParams | None = None) -> PublishedComparison:
        return PublishedComparison(self, estimate(self.setup, params))

    @property
    def groups(self) -> dict[str, str]:
        """The run's group under each split of the results table."""
        s = self.setup
        n = s.model.n_active_params
        return {
            "precision": s.train.precision,
            "framework": "eager PyTorch" if s.train.framework == "pytorch" else "Megatron-style",
            "model": "< 10B" if n < 10e9 else "10-100B" if n < 100e9 else ">= 100B",
            "GPUs": "1-8" if s.gpus <= 8 else "9-256" if s.gpus <= 256 else "> 256",
            "device": s.hardware.name.split()[0],
        }


@dataclass(frozen=True, slots=True)
class PublishedComparison:
    run: PublishedRun
    estimate: Estimate

    @property
    def estimated_step_s(self) -> float:
        return self.estimate.step_time_ms / 1e3

    @property
    def error_pct(self) -> float:
        """Estimated over measured step time, minus one, in percent: negative is an estimate too fast."""
        return 100.0 * (self.estimated_step_s / self.run.measured_step_s - 1.0)

    @property
    def measured_mfu_pct(self) -> float:
        """The measured step's MFU by this tool's convention (PaLM's: attention counted in full)."""
        return 100.0 * self.estimate.mfu_frac * self.estimated_step_s / self.run.measured_step_s

    @property
    def estimated_memory_gib(self) -> float:
        """The estimated peak as PyTorch's allocator reserves it (what torchtitan reports): the total
        less the CUDA context and library workspaces the allocator never sees."""
        return (self.estimate.memory.total_bytes - self.run.setup.hardware.runtime_overhead_bytes) / 2**30

    @property
    def memory_error_pct(self) -> float | None:
        """``estimated_memory_gib`` over the published peak, minus one, in percent (None: none published)."""
        if self.run.measured_memory_gib is None:
            return None
        return 100.0 * (self.estimated_memory_gib / self.run.measured_memory_gib - 1.0)


def _korthikanti(
    size: str, model: ModelSpec, gpus: int, tp: int, pp: int, vpp: int, micro: int, batch: int, times: tuple
) -> list[PublishedRun]:
    runs = []
    for mode, seconds in zip(("full", "selective"), times, strict=True):
        train = TrainSpec(
            seq_len=2048,
            micro_batch=micro,
            global_batch=batch,
            precision="fp16",
            recompute=mode,
            flash_attention=False,  # 2022: Megatron's fused softmax over the s x s scores
            dropout=True,  # GPT-3's 0.1 on attention and hidden states
        )
        par = ParallelSpec(dp=gpus // (tp * pp), tp=tp, pp=pp, vpp=vpp, sequence_parallel=mode == "selective")
        label = "full recompute" if mode == "full" else "selective recompute + SP"
        setup = Setup(model, train, par, get_hardware("a100-80gb"))
        runs.append(PublishedRun(f"GPT {size}, {label}", setup, seconds, KORTHIKANTI, KORTHIKANTI_CITATION))
    return runs


def _from_row(row: dict) -> PublishedRun:
    """A run of ``published_runs.json``: its setup, and its measurement as a step time."""
    setup = Setup(
        published_model(row["model"]),
        TrainSpec(**row["train"]),
        ParallelSpec(**row["layout"]),
        get_hardware(row["gpu"]),
    )
    measured = row["measured"]
    if "tokens_per_s_per_gpu" in measured:
        step_s = setup.tokens_per_step / (measured["tokens_per_s_per_gpu"] * setup.gpus)
    elif "tflops_per_gpu" in measured:
        step_s = estimate(setup).model_flops_per_step / (measured["tflops_per_gpu"] * 1e12 * setup.gpus)
    else:
        step_s = measured["step_time_s"]
    return PublishedRun(
        row["name"],
        setup,
        step_s,
        row["source"],
        row["citation"],
        row["quote"],
        tuple(row.get("assumed", ())),
        row.get("peak_memory_gib"),
        row.get("excluded_because", ""),
    )


@functools.cache
def all_published_runs() -> tuple[PublishedRun, ...]:
    """Every run: Korthikanti's in the paper's order, then ``published_runs.json``'s."""
    rows = json.loads(RUNS_PATH.read_text())
    return (
        *_korthikanti("22B", megatron_gpt("gpt-22b", 48, 6144, 64), 8, 8, 1, 1, 4, 4, (1.42, 1.10)),
        *_korthikanti("175B", megatron_gpt("gpt-175b", 96, 12288, 96), 64, 8, 8, 3, 1, 64, (18.13, 13.75)),
        *_korthikanti("530B", megatron_gpt("gpt-530b", 105, 20480, 128), 280, 8, 35, 3, 1, 280, (49.05, 37.83)),
        *_korthikanti("1T", megatron_gpt("gpt-1t", 128, 25600, 160), 512, 8, 64, 1, 1, 512, (94.42, 71.49)),
        *(_from_row(r) for r in rows),
    )


def published_runs() -> tuple[PublishedRun, ...]:
    """The validation set: every run whose layout sets its step time (``excluded_because`` empty)."""
    return tuple(r for r in all_published_runs() if not r.excluded_because)


def compare_published(params: EfficiencyParams | None = None) -> list[PublishedComparison]:
    return [run.compare(params) for run in published_runs()]


# --- fitting the rate model ------------------------------------------------------------------------


def _log_errors(params: EfficiencyParams, runs) -> list[float]:
    return [math.log(run.compare(params).estimated_step_s / run.measured_step_s) for run in runs]


def fit_params(runs, start: EfficiencyParams | None = None) -> EfficiencyParams:
    """The constants of ``EfficiencyParams`` that minimise the squared log step-time error over
    ``runs`` (in units of FIT_NOISE) plus each constant's distance from its prior (``PRIORS``): scipy's
    bounded least squares, one set for all devices."""
    from scipy.optimize import least_squares

    start = start or EfficiencyParams()
    names = [f.name for f in fields(EfficiencyParams)]
    lo = [PARAM_BOUNDS[n][0] for n in names]
    hi = [PARAM_BOUNDS[n][1] for n in names]
    scale = [max(abs(getattr(start, n)), 1e-6) for n in names]
    x0 = [min(max(getattr(start, n), a), b) / s for n, a, b, s in zip(names, lo, hi, scale, strict=True)]

    def params_of(x) -> EfficiencyParams:
        return EfficiencyParams(**{n: float(v * s) for n, v, s in zip(names, x, scale, strict=True)})

    def residuals(x) -> list[float]:
        p = params_of(x)
        return [e / FIT_NOISE for e in _log_errors(p, runs)] + prior_residuals(p)

    result = least_squares(
        residuals,
        x0,
        bounds=([a / s for a, s in zip(lo, scale, strict=True)], [b / s for b, s in zip(hi, scale, strict=True)]),
        diff_step=1e-3,
        xtol=1e-6,
        ftol=1e-6,
    )
    return params_of(result.x)


@dataclass(frozen=True, slots=True)
class HeldOut:
    """One source's runs estimated with constants fitted on every other source."""

    source: str
    params: EfficiencyParams
    comparisons: tuple[PublishedComparison, ...]

    @property
    def mean_abs_error_pct(self) -> float:
        return statistics.mean(abs(c.error_pct) for c in self.comparisons)


def leave_one_source_out(runs=None, start: EfficiencyParams | None = None) -> list[HeldOut]:
    """For each source: fit on all the others, estimate its runs."""
    runs = list(runs or published_runs())
    out = []
    for source in sorted({r.source for r in runs}):
        train = [r for r in runs if r.source != source]
        params = fit_params(train, start)
        held = tuple(r.compare(params) for r in runs if r.source == source)
        out.append(HeldOut(source, params, held))
    return out


# --- fitting the eager step's allocator fragmentation ----------------------------------------------


def _allocated_and_measured(comparisons) -> list[tuple[float, float]]:
    """(estimated bytes the allocator hands out, published peak in bytes) of each comparison that has a
    published peak: the estimate less its overhead (the CUDA context and the fragmentation allowance)."""
    out = []
    for c in comparisons:
        if c.run.measured_memory_gib is not None:
            m = c.estimate.memory
            out.append((m.total_bytes - m.overhead_bytes, c.run.measured_memory_gib * 2**30))
    return out


def fit_fragmentation(comparisons) -> float:
    """The reserved-over-allocated fraction f, to 0.001 in [0, 0.5), that minimises the mean absolute error
    of ``allocated x (1 + f)`` against the published peaks of ``comparisons`` (the runs giving none are
    skipped): the fit behind ``advisor.estimate.memory.EAGER_FRAGMENTATION_FRAC``."""
    pairs = _allocated_and_measured(comparisons)
    if not pairs:
        raise ValueError("no comparison has a published peak memory to fit on")

    def mean_abs(f: float) -> float:
        return statistics.mean(abs(a * (1 + f) / m - 1) for a, m in pairs)

    return min((i / 1000 for i in range(500)), key=mean_abs)


def memory_errors_pct(comparisons, frag: float) -> list[float]:
    """Peak memory error, in percent, of each comparison with a published peak, with fragmentation ``frag``."""
    return [100.0 * (a * (1 + frag) / m - 1) for a, m in _allocated_and_measured(comparisons)]


def fragmentation_leave_one_source_out(comparisons) -> dict[str, tuple[float, list[float]]]:
    """For each source that publishes peaks: (the fraction fitted on the other sources, this source's
    peak memory errors in percent with it)."""
    comparisons = [c for c in comparisons if c.run.measured_memory_gib is not None]
    out = {}
    for source in sorted({c.run.source for c in comparisons}):
        frag = fit_fragmentation([c for c in comparisons if c.run.source != source])
        out[source] = (frag, memory_errors_pct([c for c in comparisons if c.run.source == source], frag))
    return out


def kendall_tau(xs: list[float], ys: list[float]) -> float:
    """Kendall's tau-a of two equally long sequences: (concordant - discordant) pairs over all pairs."""
    n = len(xs)
    pairs = n * (n - 1) / 2
    if pairs == 0:
        return float("nan")
    score = 0
    for i in range(n):
        for j in range(i + 1, n):
            a, b = xs[i] - xs[j], ys[i] - ys[j]
            score += (a > 0) - (a < 0) if b > 0 else -((a > 0) - (a < 0)) if b < 0 else 0
    return score / pairs
