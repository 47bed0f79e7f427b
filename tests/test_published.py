"""The estimator's step time against published runs whose every layout detail is known
(advisor/published.py: Korthikanti et al. 2022, table 4, the eight runs Calculon validates on, and
torchtitan's Llama 3 8B and 70B on 64 A100 with FSDP2)."""

from __future__ import annotations

import statistics

import pytest

from advisor.estimator import narayanan_flops_per_iteration
from advisor.published import KORTHIKANTI, compare_published

# Measured step (s), estimated step (s) as of this estimator; the error is the estimate's.
EXPECTED = {
    "GPT 22B, full recompute": (1.42, 1.154),
    "GPT 22B, selective recompute + SP": (1.10, 0.832),
    "GPT 175B, full recompute": (18.13, 16.00),
    "GPT 175B, selective recompute + SP": (13.75, 11.13),
    "GPT 530B, full recompute": (49.05, 49.63),
    "GPT 530B, selective recompute + SP": (37.83, 32.94),
    "GPT 1T, full recompute": (94.42, 91.15),
    "GPT 1T, selective recompute + SP": (71.49, 65.90),
    # torchtitan: 8192 tokens a GPU a step at 2973 and 331 tokens/s.
    "Llama 3 8B, FSDP2, selective op AC": (2.7555, 2.015),
    "Llama 3 70B, FSDP2, full AC": (24.749, 20.67),
}


@pytest.fixture(scope="module")
def rows():
    return {c.run.name: c for c in compare_published()}


def test_the_published_setups_are_the_papers(rows):
    assert list(rows) == list(EXPECTED)
    gpt3 = rows["GPT 175B, full recompute"].run.setup
    # GPT-3 175B: 96 layers of h 12288, 96 heads; 174.6 B parameters with the 51200 vocabulary.
    assert gpt3.model.n_params == pytest.approx(174.6e9, rel=1e-3)
    p = gpt3.parallel
    assert (p.tp, p.pp, p.vpp, p.dp, gpt3.gpus, gpt3.grad_accum) == (8, 8, 3, 1, 64, 64)
    # Every run fits the 80 GB its paper ran on.
    assert all(c.estimate.fits for c in rows.values())


def test_our_flops_give_the_papers_mfu(rows):
    # Table 5 of the paper gives the selective runs' MFU: 41.5, 51.4, 56.0 and 56.3 %. Our model FLOPs
    # (PaLM's 6N + 12 L s q per token) over the measured time and 312 TFLOP/s per GPU agree within 0.2
    # points: the FLOPs are right, what the estimate misses is time.
    got = [rows[f"GPT {s}, selective recompute + SP"].measured_mfu_pct for s in ("22B", "175B", "530B", "1T")]
    assert got == pytest.approx([41.5, 51.4, 56.0, 56.3], abs=0.25)
    # torchtitan reports 58.2 and 51.7 %, counting the embedding table as 6 x its parameters of FLOPs
    # (a lookup: we do not): 6 x 525M more of 6.1e10 per token for 8B (+5.2 %), 6 x 1.05B of 4.5e11
    # for 70B (+1.3 %).
    titan = [rows[n].measured_mfu_pct for n in ("Llama 3 8B, FSDP2, selective op AC", "Llama 3 70B, FSDP2, full AC")]
    assert titan == pytest.approx([55.2, 51.1], abs=0.1)
    assert [titan[0] * 1.052, titan[1] * 1.013] == pytest.approx([58.2, 51.7], abs=0.2)
    # And Narayanan's per-iteration count (eq. 3, no recompute) is ours for the 22B run.
    c = rows["GPT 22B, selective recompute + SP"]
    assert c.estimate.model_flops_per_step == pytest.approx(
        narayanan_flops_per_iteration(4, 2048, 48, 6144, 51200, full_recompute=False), rel=0.01
    )


@pytest.mark.parametrize("name", list(EXPECTED))
def test_estimated_step_time_against_the_published_one(rows, name):
    measured, estimated = EXPECTED[name]
    c = rows[name]
    assert c.run.measured_step_s == pytest.approx(measured, abs=1e-3)
    assert c.estimated_step_s == pytest.approx(estimated, rel=2e-3)


def test_the_error_overall(rows):
    errors = [c.error_pct for c in rows.values()]
    megatron = [c.error_pct for c in rows.values() if c.run.source == KORTHIKANTI]
    # On the Megatron-LM runs: mean absolute error 12.4 % (Calculon's on the same runs: 3.7 %), from
    # +1.2 % to -24.3 %, fast on 7 of 8: the smallest model (22B, TP 8 only) misses most, the GEMMs of
    # one TP rank there being the smallest. torchtitan's FSDP2 runs: -26.9 and -16.5 %.
    assert statistics.mean(abs(e) for e in megatron) == pytest.approx(12.4, abs=0.1)
    assert sum(e < 0 for e in megatron) == 7
    assert min(megatron) == pytest.approx(-24.3, abs=0.1) and max(megatron) == pytest.approx(1.2, abs=0.1)
    assert statistics.mean(abs(e) for e in errors) == pytest.approx(14.3, abs=0.1)
    assert sum(e < 0 for e in errors) == 9
