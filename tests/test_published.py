"""The estimator against published training runs (advisor/estimate/published.py, advisor/estimate/published_runs.json): the
setups are the sources', the FLOPs give their MFU, the fitted constants are the committed ones, and the
step-time error, fitted and held out one source at a time, meets issue 17's targets."""

from __future__ import annotations

import json
import statistics

import pytest

from advisor.estimate.efficiency import FIT_PATH, FITTED, PARAM_BOUNDS
from advisor.estimate.estimator import narayanan_flops_per_iteration
from advisor.estimate.memory import EAGER_FRAGMENTATION_FRAC
from advisor.estimate.published import (
    KORTHIKANTI,
    RUNS_PATH,
    all_published_runs,
    compare_published,
    fit_fragmentation,
    fit_params,
    fragmentation_leave_one_source_out,
    kendall_tau,
    leave_one_source_out,
    published_model,
    published_runs,
)


@pytest.fixture(scope="module")
def rows():
    return {c.run.name: c for c in compare_published()}


@pytest.fixture(scope="module")
def held_out():
    return {c.run.name: c for h in leave_one_source_out() for c in h.comparisons}


def test_the_published_setups_are_the_sources():
    runs = {r.name: r for r in published_runs()}
    gpt3 = runs["GPT 175B, full recompute"].setup
    # GPT-3 175B: 96 layers of h 12288, 96 heads; 174.6 B parameters with the 51200 vocabulary.
    assert gpt3.model.n_params == pytest.approx(174.6e9, rel=1e-3)
    p = gpt3.parallel
    assert (p.tp, p.pp, p.vpp, p.dp, gpt3.gpus, gpt3.grad_accum) == (8, 8, 3, 1, 64, 64)
    # MosaicML's MPT-70B as benchmarked: its table's NumParams column, 64,862,437,376 at sequence 2048
    # (learned positions, biases everywhere), is our count of the reconstructed model.
    assert published_model("mpt-70b@2048").n_params == 64_862_437_376
    # torchtitan's Llama 3 8B on 64 A100: 8,192 tokens a GPU a step at 2,973 tokens/s.
    titan = runs["Llama 3 8B, 64 A100, FSDP2, selective op AC"]
    assert titan.measured_step_s == pytest.approx(8192 / 2973)
    assert titan.setup.train.recompute == "selective-op" and titan.setup.parallel.zero == 3
    # Megatron-Bridge's 70B on 64 GB200: Megatron FSDP with 40 of 80 blocks' activations on the host.
    offload = runs[
        "Llama 3 70B, 64 GB200, Megatron FSDP, 40 blocks' activations offloaded, fp8-cs (Megatron-Bridge 25.11)"
    ]
    assert offload.setup.train.offload_activations == 40 and offload.setup.parallel.zero == 3


def test_every_run_cites_its_source_and_says_what_it_assumed():
    rows = json.loads(RUNS_PATH.read_text())
    for row in rows:
        assert row["citation"] and row["quote"], row["name"]
        assert set(row["measured"]) & {"tokens_per_s_per_gpu", "tflops_per_gpu", "step_time_s"}, row["name"]
    # The set the issue asks for: >= 30 runs from >= 6 sources, bf16 and fp8, Megatron-style and eager,
    # dense and MoE, 8 to more than 1,000 GPUs, A100 to GB200.
    runs = published_runs()
    assert len(runs) >= 30 and len({r.source for r in runs}) >= 6
    assert {r.setup.train.precision for r in runs} >= {"bf16", "fp8"}
    assert {r.setup.train.framework for r in runs} == {"megatron", "pytorch"}
    assert any(r.setup.model.is_moe for r in runs) and max(r.setup.gpus for r in runs) > 1000
    names = {r.setup.hardware.name.split()[0] for r in runs}
    assert names >= {"A100", "H100", "H200", "B200", "GB200"}
    # Runs kept out say why: Llama 3's 405B, whose interleaving and micro-batch the paper leaves out.
    excluded = [r for r in all_published_runs() if r.excluded_because]
    assert len(excluded) == 2 and all("interleaving" in r.excluded_because for r in excluded)


def test_our_flops_give_the_papers_mfu(rows):
    # Table 5 of Korthikanti et al. gives the selective runs' MFU: 41.5, 51.4, 56.0 and 56.3 %. Our model
    # FLOPs (PaLM's 6N + 12 L s q per token) over the measured time and 312 TFLOP/s per GPU agree within
    # 0.25 points.
    got = [rows[f"GPT {s}, selective recompute + SP"].measured_mfu_pct for s in ("22B", "175B", "530B", "1T")]
    assert got == pytest.approx([41.5, 51.4, 56.0, 56.3], abs=0.25)
    # torchtitan reports 58.2 and 51.7 %, counting the embedding table as 6 x its parameters of FLOPs
    # (a lookup: we do not): 6 x 525M more of 6.1e10 per token for 8B (+5.2 %), 6 x 1.05B of 4.5e11
    # for 70B (+1.3 %).
    names = ("Llama 3 8B, 64 A100, FSDP2, selective op AC", "Llama 3 70B, 64 A100, FSDP2, full AC")
    titan = [rows[n].measured_mfu_pct for n in names]
    assert titan == pytest.approx([55.2, 51.1], abs=0.1)
    assert [titan[0] * 1.052, titan[1] * 1.013] == pytest.approx([58.2, 51.7], abs=0.2)
    # And Narayanan's per-iteration count (eq. 3, no recompute) is ours for the 22B run.
    c = rows["GPT 22B, selective recompute + SP"]
    assert c.estimate.model_flops_per_step == pytest.approx(
        narayanan_flops_per_iteration(4, 2048, 48, 6144, 51200, full_recompute=False), rel=0.01
    )


def test_the_committed_constants_are_the_fit_of_these_runs():
    # bench/published_runs.py --fit wrote advisor/estimate/efficiency_fit.json from these runs: refitting gives
    # the same constants, none of them pinned at a bound.
    refit = fit_params(published_runs())
    for name, value in refit.as_dict().items():
        assert getattr(FITTED, name) == pytest.approx(value, rel=0.02), name
        lo, hi = PARAM_BOUNDS[name]
        assert lo < value < hi, name
    record = json.loads(FIT_PATH.read_text())
    assert record["fitted_on"].startswith(f"{len(published_runs())} runs of")


@pytest.mark.slow  # starts a child process or runs seconds of real steps
def test_step_time_error_fitted_and_held_out(rows, held_out):
    fitted = [c.error_pct for c in rows.values()]
    held = [held_out[name].error_pct for name in rows]
    # Issue 17's targets: mean <= 10 %, median <= 8 %, leave-one-source-out mean <= 12 %.
    assert statistics.mean(abs(e) for e in fitted) <= 10
    assert statistics.median(abs(e) for e in fitted) <= 8
    assert statistics.mean(abs(e) for e in held) <= 12
    # Neither side dominates: the old estimate was too fast on 9 of 10 A100 runs, and on every one of
    # 19 Hopper/Blackwell runs by 19-115 %.
    assert 0.3 < sum(e < 0 for e in fitted) / len(fitted) < 0.7
    # Korthikanti's Megatron-LM runs, Calculon's validation set (its error there: 3.7 %).
    megatron = [c.error_pct for c in rows.values() if c.run.source == KORTHIKANTI]
    assert statistics.mean(abs(e) for e in megatron) < 12.4  # the estimator before this model


def test_peak_memory_where_a_source_publishes_it(rows):
    # torchtitan's (Llama 3.1 8B and 70B on H100, December 2024) and Trainy's (8B on H200, June 2025)
    # max reserved memory, GiB; the estimate less the CUDA context.
    mem = {name: c for name, c in rows.items() if c.run.measured_memory_gib is not None}
    assert len(mem) == 9 and {c.run.source for c in mem.values()} == {"torchtitan", "trainy"}
    errors = {name: c.memory_error_pct for name, c in mem.items()}
    # All nine within 5 %: torchtitan's 70B on FSDP 32 x TP 8 (16 sequences of 8,192 a GPU) reads 3.5 % low
    # with its sequence-parallel collectives' buffers (9.7 % without them); the other eight within 2.4 %.
    tp = "Llama 3.1 70B, 256 H100-500W, FSDP2 32 x TP 8, compile + float8"
    assert [name for name, e in errors.items() if abs(e) > 2.4] == [tp]
    assert errors[tp] == pytest.approx(-3.5, abs=0.1)
    assert statistics.mean(abs(e) for e in errors.values()) == pytest.approx(1.0, abs=0.1)
    # The 8B on 8 GPUs: 82.4 GiB published, 81.9 estimated; the loss compiled (Trainy, 32 H200): 48.0 and 48.0.
    assert mem["Llama 3.1 8B, 8 H100-500W, FSDP2"].estimated_memory_gib == pytest.approx(81.9, abs=0.05)
    assert mem["Llama 3.1 8B, 32 H200, FSDP2 + compile + float8 (Trainy)"].estimated_memory_gib == pytest.approx(
        48.0, abs=0.05
    )


def test_the_eager_fragmentation_is_the_fit_and_holds_out_of_it(rows):
    # The committed fraction is the fit on the nine peaks; fitted on one source, the other reads as well.
    assert fit_fragmentation(rows.values()) == pytest.approx(EAGER_FRAGMENTATION_FRAC, abs=0.0005)
    held = fragmentation_leave_one_source_out(rows.values())
    assert held["torchtitan"][0] == pytest.approx(0.100) and held["trainy"][0] == pytest.approx(0.098)
    assert [round(e, 1) for e in held["trainy"][1]] == [-0.2, -2.4]
    assert statistics.mean(abs(e) for _, errs in held.values() for e in errs) == pytest.approx(1.1, abs=0.1)


def test_every_run_that_trained_fits(rows):
    assert [name for name, c in rows.items() if not c.estimate.fits] == []


def test_layouts_of_one_model_are_ordered_as_measured(rows):
    # Within each source, the runs of one model (layouts, knobs, GPU counts) ordered by tokens/s per
    # GPU: Kendall's tau of the estimate against the measurement is positive for every source.
    by_source: dict[str, dict[str, list]] = {}
    for c in rows.values():
        by_source.setdefault(c.run.source, {}).setdefault(c.run.setup.model.name, []).append(c)
    for source, models in by_source.items():
        taus = []
        for group in models.values():
            if len(group) < 2:
                continue
            est = [c.run.setup.tokens_per_step / c.estimated_step_s for c in group]
            meas = [c.run.setup.tokens_per_step / c.run.measured_step_s for c in group]
            taus.append(kendall_tau(est, meas))
        if taus:
            assert statistics.mean(taus) > 0.5, source
    # The claim is about sources with several runs of one model: there must be some to judge.
    judged = [s for s, models in by_source.items() if any(len(g) >= 2 for g in models.values())]
    assert len(judged) >= 3, sorted(by_source)


def test_kendall_tau_by_hand():
    assert kendall_tau([1, 2, 3], [10, 20, 30]) == 1.0
    assert kendall_tau([1, 2, 3], [30, 20, 10]) == -1.0
    # Pairs (1,2) concordant, (1,3) concordant, (2,3) discordant: (2 - 1) / 3.
    assert kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)
