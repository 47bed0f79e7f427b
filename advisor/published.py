"""Published training runs with every layout detail given, and the estimator's step time against them.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", table 4)
timed one iteration of four GPT models on Selene (DGX A100 80 GB, 8 GPUs per node on NVLink, 8 x 200
Gb/s InfiniBand), fp16, sequence 2048, vocabulary 51200, each with full recompute and with selective
recompute plus sequence parallelism. The layouts (tensor and pipeline sizes, interleaving, batch and
micro-batch) are those Calculon (Isaev et al. 2023) validates against the same eight times
(``calculon-ai/calculon``, ``validation/*.json`` and ``calculon/megatron/validation.py``); Calculon's
mean error on them is 3.7 %.

torchtitan's performance page (``pytorch/torchtitan``, ``docs/performance.md``, 2024) gives tokens/s
per GPU of Llama 3 8B and 70B on 64 A100 80 GB with FSDP2 alone (ZeRO-3 over all 64), bf16, sequence
8192, local batch 1: 8B with selective op checkpointing (taken here as selective recompute: with flash
attention both recompute little), 70B with full checkpointing. Its MFU counts the embedding table as
6N FLOPs, which ours leaves out (a lookup), so its MFU reads 5 % (8B) and 1 % (70B) above ours.

Run ``python bench/published_runs.py`` for the table; ``tests/test_published.py`` keeps the figures.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from advisor.estimator import Estimate, estimate
from advisor.presets import get_hardware, get_model, gpt2_style
from advisor.specs import ModelSpec, ParallelSpec, Setup, TrainSpec

KORTHIKANTI = "Korthikanti et al. 2022, table 4 (Megatron-LM on DGX A100 80 GB)"
TORCHTITAN = "torchtitan docs/performance.md, Llama 3 on 64 A100 80 GB, FSDP2 (2024)"


def megatron_gpt(name: str, n_layers: int, hidden: int, n_heads: int) -> ModelSpec:
    """A GPT of Megatron-LM's papers: GPT-2's block (LayerNorm, GELU MLP of 4h, biases, learned
    positions, tied head) at sequence 2048 and vocabulary 51200 (50257 padded to a multiple of 1024)."""
    return replace(gpt2_style(name, n_layers, hidden, n_heads), vocab=51200, max_positions=2048)


@dataclass(frozen=True, slots=True)
class PublishedRun:
    """One published measurement: the setup as the paper ran it, and its measured step time."""

    name: str
    setup: Setup
    measured_step_s: float
    source: str

    def compare(self) -> PublishedComparison:
        return PublishedComparison(self, estimate(self.setup))


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
        runs.append(
            PublishedRun(f"{size}, {label}", Setup(model, train, par, get_hardware("a100-80gb")), seconds, KORTHIKANTI)
        )
    return runs


def _torchtitan(name: str, model: str, recompute: str, tokens_per_s_gpu: float) -> PublishedRun:
    train = TrainSpec(
        seq_len=8192, micro_batch=1, global_batch=64, precision="bf16", recompute=recompute, framework="pytorch"
    )
    setup = Setup(get_model(model), train, ParallelSpec(dp=64, zero=3), get_hardware("a100-80gb"))
    # Tokens/s per GPU at local batch 1: each GPU's 8192 tokens a step.
    return PublishedRun(name, setup, 8192 / tokens_per_s_gpu, TORCHTITAN)


def published_runs() -> list[PublishedRun]:
    """The runs: Korthikanti's in the paper's order, then torchtitan's."""
    return [
        *_korthikanti("GPT 22B", megatron_gpt("gpt-22b", 48, 6144, 64), 8, 8, 1, 1, 4, 4, (1.42, 1.10)),
        *_korthikanti("GPT 175B", megatron_gpt("gpt-175b", 96, 12288, 96), 64, 8, 8, 3, 1, 64, (18.13, 13.75)),
        *_korthikanti("GPT 530B", megatron_gpt("gpt-530b", 105, 20480, 128), 280, 8, 35, 3, 1, 280, (49.05, 37.83)),
        *_korthikanti("GPT 1T", megatron_gpt("gpt-1t", 128, 25600, 160), 512, 8, 64, 1, 1, 512, (94.42, 71.49)),
        _torchtitan("Llama 3 8B, FSDP2, selective op AC", "llama-3.1-8b", "selective", 2973),
        _torchtitan("Llama 3 70B, FSDP2, full AC", "llama-3.1-70b", "full", 331),
    ]


def compare_published() -> list[PublishedComparison]:
    return [run.compare() for run in published_runs()]
