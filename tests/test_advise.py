"""Advice end to end: which rules fire on real GPU traces, on setups, on our own runs; ranking, merged
duplicates, actions that cannot apply, the report, the CLI."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from advisor.advice import gains as gains_module
from advisor.advice import rules as R
from advisor.advice.advise import advice_markdown, advise, advise_run, advise_trace, apply_action
from advisor.cli import main
from advisor.errors import AdvisorError
from advisor.spec.metrics import StepMetrics
from advisor.spec.setup import make_setup
from advisor.store.runstore import RunStore
from tests.shared import SHARED_TRACES, needs_shared_traces

REPO = Path(__file__).resolve().parents[1]
TRACES = SHARED_TRACES
needs_traces = needs_shared_traces
SAMPLE_RUN = "20261130-165248-tiny-6bcb2f"


def fired(advice) -> list[str]:
    return [r.rule.id for r in advice.recommendations]


@needs_traces
def test_host_bound_and_gpu_bound_traces_get_different_advice():
    # nccl_parser_config: A100, 78 % idle, 99.8 % of it host wait (HTA reference): launch-bound.
    # The roofline's verdict leads: latency-bound, the host-wait idle (77.2 % x 99.8 % = 77.1 %) plus
    # the busy time in kernels too short to reach a roof; launch-bound (same lever) is its alternative.
    host = advise_trace(TRACES / "kineto" / "nccl_parser_config")
    assert fired(host)[0] == "roof-latency-bound" and host.recommendations[0].also == ("launch-bound",)
    g = host.recommendations[0].gain
    assert g.upper_bound and g.gain_pct == pytest.approx(77.4, abs=0.5)
    assert "prec-tf32-gemm" in fired(host)  # its A100 GEMMs are cutlass s1688 (TF32) kernels
    # Its 8 synchronising calls a step leave the GPU idle for 0.0 % of it: the rule fires, but a change
    # predicted to gain nothing is not advice (it once ranked second, as a warning).
    assert "launch-sync-in-loop" not in fired(host)
    (sync,) = [r for r in host.rejected if r.rule.id == "launch-sync-in-loop"]
    assert sync.action_note == "predicted no change in step time: no gain"
    head = advice_markdown(host).splitlines()[2]
    assert head.startswith(f"{len(host.recommendations) + 1} of {host.n_rules} rules fired (1 not recommended); ")
    assert head.endswith("Gains are upper bounds from the trace's time shares (there is no setup to estimate).")
    # ns_resolution_trace: V100, GPU-bound (idle 1.7 %, launch queue ~812), training in fp32: its GEMMs
    # are volta_sgemm kernels (24.8 % of GPU time) that never touch the tensor cores. Nothing
    # launch-related fires; the top advice is mixed precision, then fusing its memory-bound
    # elementwise and batch-norm kernels (31.5 % of the span, at 2x: 15.7 %).
    gpu = advise_trace(TRACES / "kineto" / "ns_resolution_trace")
    assert fired(gpu) == ["prec-fp32-gemm", "roof-fuse-memory-bound"]
    # 24.84 % of GPU time x 98.3 % busy x (1 - 1/4) = 18.3 % of the step.
    assert gpu.recommendations[0].gain.gain_pct == pytest.approx(18.3, abs=0.1)


@needs_traces
def test_communication_heavy_trace_gets_communication_advice():
    # trace_filter: 2 ranks of a 128-rank NCCL job; 60 % of GPU time communication, 16 % overlapped.
    advice = advise_trace(TRACES / "kineto" / "trace_filter")
    assert fired(advice) == ["roof-latency-bound", "comm-exposed", "comm-low-overlap"]
    assert advice.recommendations[0].also == ("launch-bound",)
    comm = advice.recommendations[1]
    assert comm.gain.gain_pct == pytest.approx(25.5, abs=0.5)  # non-compute 25.7 % x comm/(comm+memcpy)
    assert "spec" not in comm.message


@needs_traces
def test_nsys_exports_flag_pageable_copies_that_cost_time():
    # CloverLeaf: 279 pageable copies, 225 MB in 9.39 ms, 3.09 % of GPU time; 74 % tiny kernels. The
    # nsys-ai fixture's 34 pageable copies moved 272 bytes in 0.027 ms (0.005 %): it once ranked first,
    # priced on every copy's share (1.05 %), above a fusion worth ~22 % (a user review).
    before = advise_trace(TRACES / "nsys" / "nsysai_mfu_2gpu_before.sqlite")
    assert before.context["pageable_copies"] == 34 and before.context["pageable_copy_bytes"] == 272
    assert before.context["pageable_copy_pct"] == pytest.approx(0.0049, abs=1e-4)
    assert "input-pageable-copies" not in fired(before)
    clover = advise_trace(TRACES / "nsys" / "pipit_cloverleaf_cuda.sqlite")
    assert clover.context["pageable_copy_pct"] == pytest.approx(3.09, abs=0.01)
    assert {"input-pageable-copies", "launch-tiny-kernels"} <= set(fired(clover))
    messages = {r.rule.id: r.message for r in clover.recommendations}
    assert messages["input-pageable-copies"].startswith("279 copies moved 225,116,952 bytes from pageable host")
    assert messages["launch-tiny-kernels"].startswith("74% of kernels are shorter than 10 us")
    # A trace with no step marks: the share cannot become a step time, and the advice says why.
    chains = next(r for r in before.recommendations if r.rule.id == "kern-fuse-chains")
    assert chains.gain is None
    assert "- **Gain:** not predicted: the trace marks no training steps" in advice_markdown(before)


def test_a_trace_without_a_spec_lists_spec_rules_as_not_applicable():
    m = StepMetrics(run_id="t", source="trace", gpu_idle_pct=80.0, idle_host_wait_pct=90.0, launch_bound=True)
    advice = advise(m)
    skipped = {e.rule.id: e.missing for e in advice.not_applicable}
    assert "train_precision" in skipped["prec-fp32-to-bf16"]
    assert fired(advice)[0] == "launch-bound"


def test_seventy_b_on_eight_h100_without_zero_is_critical():
    setup = make_setup(model="llama-3.1-70b", gpu="h100", gpus=8, seq=4096)
    advice = advise(setup=setup)
    top = advice.recommendations[0]
    assert top.rule.id == "mem-oom-model-state" and top.rule.severity == "critical"
    assert top.changes == {"parallel.zero": 1}
    # ZeRO-1 over 8 ranks: 12 bytes/param of optimizer state become 1.5; the estimator's difference.
    # Megatron's bf16 weights (2 bytes), fp32 main gradients (4) and Adam (12) of 70.55e9 parameters
    # are 131.4 + 262.8 + 788.5 GiB, with 85.9 GiB of activations, 5 % fragmentation and 1 GiB of
    # CUDA context: 1,333.1 GiB; with the optimizer over 8 ranks 98.6 GiB: 608.7 GiB.
    n = 70_553_706_496 / 2**30
    assert top.gain.before / 2**30 == pytest.approx((18 * n + 85.96) * 1.05 + 1, abs=0.5)
    assert top.gain.after / 2**30 == pytest.approx((6 * n + 1.5 * n + 85.96) * 1.05 + 1, abs=0.5)
    assert top.gain.before / 2**30 == pytest.approx(1333.1, abs=0.1)
    # par-zero1-shard-optimizer fires with the same change: merged, not repeated.
    assert top.also == ("par-zero1-shard-optimizer",)
    assert "par-zero1-shard-optimizer" not in fired(advice)


def test_severity_ranks_before_gain():
    setup = make_setup(model="llama-3.1-70b", gpu="h100", gpus=16, tp=16, seq=4096, zero=1)
    advice = advise(setup=setup)
    recs = advice.recommendations
    # Ranked by severity, then by gain within a severity.
    keys = [(R.SEVERITIES.index(r.rule.severity), -r.gain.gain_pct) for r in recs]
    assert keys == sorted(keys)
    # Severity wins over a larger gain: the critical TP fix (measured 53.6 % less step time) ranks above
    # the warning that offloads the optimizer (66.6 % less peak memory).
    assert recs[0].rule.severity == "critical" and recs[1].rule.severity == "warning"
    assert recs[1].gain.gain_pct > recs[0].gain.gain_pct
    assert "par-tp-across-nodes" in fired(advice)
    tp = next(r for r in advice.recommendations if r.rule.id == "par-tp-across-nodes")
    assert tp.changes == {"parallel.tp": 8, "parallel.pp": 2}
    assert tp.gain.gain_pct > 0  # NVLink instead of the NIC for TP traffic


def test_gh200_offload_is_advised_over_c2c_and_not_over_pcie():
    kw = dict(model="llama-3.1-8b", gpus=1, seq=8192, micro_batch=1, precision="bf16")
    gh = fired(advise(setup=make_setup(gpu="gh200", **kw)))
    h100 = fired(advise(setup=make_setup(gpu="h100", **kw)))
    assert "mem-offload-c2c" in gh and "mem-offload-c2c" not in h100


def test_tp_that_does_not_tile_a_72_gpu_rack_is_flagged():
    # GB200 NVL72: TP 16 on two racks puts ranks 64-79 in one TP group across both (72 is no multiple
    # of 16): capped at 8, the factor moves to pipeline stages. Inside one rack (64 GPUs) TP 16 is fine.
    kw = dict(model="llama-3.1-70b", gpu="gb200", tp=16, sequence_parallel=True, seq=4096, recompute="full")
    two = advise(setup=make_setup(gpus=144, global_batch=144, **kw))
    rec = next(r for r in two.recommendations if r.rule.id == "par-tp-across-nodes")
    assert rec.changes == {"parallel.tp": 8, "parallel.pp": 2} and rec.gain.gain_pct > 0
    assert "par-tp-across-nodes" not in fired(advise(setup=make_setup(gpus=64, global_batch=64, **kw)))


def test_an_action_that_breaks_the_spec_says_why():
    setup = make_setup(model="tiny", gpu="cpu", seq=128, micro_batch=2, global_batch=6)  # accum 3
    rule = next(r for r in R.load_rules() if r.id == "mem-headroom-raise-microbatch")
    ctx = R.build_context(None, setup, None, None)
    after, _, values, note = apply_action(rule, ctx, setup, None)
    assert after is None and values == {"train.micro_batch": 4}
    assert "train.global_batch" in note and "multiple of micro_batch x dp=4" in note


def test_compile_applied_reaches_the_setup_and_other_run_options_stay_run_options():
    # Apply of a torch.compile rule said the Size tab had it, and the Size tab did not: the run option
    # now goes into the setup too, as the launcher does for a run. A loader option stays a run option.
    from types import SimpleNamespace

    from advisor.present.views import applied_message

    setup = make_setup(model="tiny", gpu="cpu", seq=128, micro_batch=2)
    compile_rule = next(r for r in R.load_rules() if r.id == "launch-bound")
    after, opts, values, note = apply_action(compile_rule, {}, setup, {"compile": False, "steps": 3})
    assert values == {"options.compile": True} and note == ""
    assert opts == {"compile": True, "steps": 3} and after.train.compile and not setup.train.compile
    assert (after.model, after.parallel) == (setup.model, setup.parallel)
    assert apply_action(compile_rule, {}, None, None)[:2] == (None, {"compile": True})  # a trace: no setup
    workers = next(r for r in R.load_rules() if r.id == "input-more-workers")
    after, opts, values, _ = apply_action(workers, {"num_workers": 1}, setup, {"num_workers": 1})
    assert after is setup and set(values) == {"options.num_workers"}

    def msg(changes):
        rec = SimpleNamespace(rule=SimpleNamespace(title="T"), changes=changes, gain=None)
        return applied_message(rec, "stored run").split("\n", 1)[1]

    assert msg({"options.compile": True}).startswith(
        "`options.compile = True` is now the current setup on the Size, Profile and Plan tabs."
    )
    assert msg({"options.num_workers": 2}).startswith(
        "`options.num_workers = 2`: a run option, set on the Profile tab (the Size tab's estimate has no such field)."
    )
    both = msg({"train.micro_batch": 4, "options.pin_memory": True})
    assert both.startswith("`train.micro_batch = 4` is now the current setup on the Size, Profile and Plan tabs. ")
    assert "`options.pin_memory = True`: a run option, set on the Profile tab" in both


def test_apply_says_which_figure_is_which(monkeypatch):
    # Three step times for one change (a browser review): the prediction (65.1 -> 36.8 ms, the run's
    # roofline), the table's "estimator says" (26.5 ms, the estimator's ratio on the measured step) and
    # the Size tab's own estimate (40.1 ms). The Apply message now names each.
    from advisor.present.views import applied_message
    from tests.sample_cpu import pin_sample_cpu

    pin_sample_cpu(monkeypatch)
    advice = advise_run(SAMPLE_RUN, RunStore(REPO / "traces"))
    rec = next(r for r in advice.recommendations if r.rule.id == "prec-fp32-to-bf16")
    msg = applied_message(rec, "stored run")
    assert "Predicted: 65.1 ms → 36.8 ms (43.4 % less step time)." in msg
    assert "starts from the run's measured 65.1 ms (priced per op class from this run's roofline)" in msg
    assert "the estimator's ratio alone gives 26.5 ms (the table's 'estimator says')" in msg
    assert "The Size tab shows the estimator's own figure for the changed setup, 40.1 ms, not scaled" in msg


def test_our_sample_run_advice_and_report():
    advice = advise_run(SAMPLE_RUN, RunStore(REPO / "traces"))
    # 256 tokens per step (micro-batch 2 x seq 128) on a CPU: the tiny-batch rule fires.
    assert "launch-small-batch" in fired(advice)
    rec = next(r for r in advice.recommendations if r.rule.id == "launch-small-batch")
    assert rec.changes == {"train.micro_batch": 8}
    assert rec.gain.target == "tokens_per_s" and rec.gain.before == pytest.approx(3934.2, abs=0.1)
    md = advice_markdown(advice)
    assert "launch-small-batch" in md and "Predicted gain" in md
    data = json.loads(advice.to_json())
    assert data["recommendations"][0]["id"] == fired(advice)[0]


@pytest.mark.parametrize(
    "flags, fp32_top, bf16_top",
    [
        # AVX512-BF16 (the EPYC the samples ran on): bf16 matmuls at 3.5x fp32, so the fp32 sample is
        # told to use bf16 and the bf16 sample is not told to leave it.
        ({"avx2", "avx512f", "avx512_bf16"}, "prec-fp32-to-bf16", None),
        # AVX2 only: bf16 at 1/30 of fp32, so the bf16 sample is told to train in fp32, first (a
        # warning, and the estimator's what-if of the change removes most of the step), and the fp32
        # sample hears nothing of bf16.
        ({"avx2"}, "launch-small-batch", "prec-16bit-on-cpu-without-fast-path"),
    ],
)
def test_precision_advice_on_a_cpu_follows_its_16_bit_path(monkeypatch, flags, fp32_top, bf16_top):
    from advisor.spec import presets

    monkeypatch.setattr(presets, "cpu_flags", lambda: flags)
    monkeypatch.setattr(presets, "cpu_cores", lambda: 2)  # the samples' name: "CPU host (2 cores)"
    store = RunStore(REPO / "traces")
    fp32, bf16 = advise_run(SAMPLE_RUN, store), advise_run("20261130-165253-tiny-617152", store)
    assert fired(fp32)[0] == fp32_top
    assert "prec-16bit-on-cpu-without-fast-path" not in fired(fp32)
    if fp32_top == "prec-fp32-to-bf16":  # the ratio as it is (it once read "4x" for 3.5x)
        assert fp32.recommendations[0].message.endswith("whose bf16 peak is 3.5x its fp32 peak.")
    if bf16_top is None:
        assert "prec-16bit-on-cpu-without-fast-path" not in fired(bf16)
    else:
        assert "prec-fp32-to-bf16" not in fired(fp32)
        top = bf16.recommendations[0]
        assert top.rule.id == bf16_top and top.changes == {"train.precision": "fp32"}
        # Priced per op class from the run's roofline: its GEMMs are 28.8 % of the step, 73.1 % of their
        # time on the bf16 roof; that part 30x faster in fp32, the rest of theirs unchanged (3.4x in
        # all); elementwise/norm ops and the other 45 % unchanged on a CPU:
        # 1 - (0.288 x (0.731 / 30 + 0.269) + 0.712) = 20.4 % less step time.
        assert top.gain.gain_pct == pytest.approx(20.4, abs=0.1)
        assert top.gain.basis.startswith("priced per op class from this run's roofline: gemm (29 % of the step)")


def test_precision_is_priced_per_op_class_from_the_runs_roofline(monkeypatch):
    from advisor.spec import presets

    # The AMX Xeon's flags: bf16 matmul peak 16x fp32. The estimator's what-if applies that rate to the
    # whole modelled step but its fused attention, which it takes at a smaller share of the matmul rate
    # in bf16 than in fp32 (CPU_ATTENTION_EFFICIENCY_FRAC): 80.2 % less. The fp32 sample's roofline: GEMMs 66.8 % of the step, 91.0 % of
    # their time on the fp32 roof (that part 16x faster, the rest unchanged: 6.8x in all); memory-bound
    # elementwise/norm ops (12.9 %) and the other 20.4 % unchanged on a CPU:
    # 0.668 x (0.910 / 16 + 0.090) + 0.129 + 0.204 = 0.430 of the step, 57.0 % less.
    monkeypatch.setattr(presets, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
    monkeypatch.setattr(presets, "cpu_cores", lambda: 2)
    rec = next(
        r for r in advise_run(SAMPLE_RUN, RunStore(REPO / "traces")).recommendations if r.rule.id == "prec-fp32-to-bf16"
    )
    g = rec.gain
    assert g.gain_pct == pytest.approx(57.0, abs=0.1)
    assert g.basis == (
        "priced per op class from this run's roofline: gemm (67 % of the step) 6.8x faster, "
        "elementwise (13 % of the step) unchanged; the rest unchanged"
    )
    assert 100 * (1 - g.analytic_after / g.before) == pytest.approx(80.2, abs=0.1)  # the estimator beside it
    # A setup alone has no roofline: the estimator's what-if prices it.
    setup = make_setup(model="tiny", gpu="cpu", seq=128, micro_batch=2, precision="fp32")
    alone = next(r for r in advise(setup=setup).recommendations if r.rule.id == "prec-fp32-to-bf16")
    assert alone.gain.basis.startswith("estimator's step-time ratio")


def test_advise_needs_some_input():
    with pytest.raises(AdvisorError, match="needs a profiled run"):
        advise()


def test_cli_advise_setup_trace_and_bad_target(tmp_path, capsys):
    assert main(["advise", "--model", "llama-3.1-70b", "--gpu", "h100", "--gpus", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recommendations"][0]["id"] == "mem-oom-model-state"
    md = tmp_path / "advice.md"
    assert main(["advise", SAMPLE_RUN, "--traces", str(REPO / "traces"), "--markdown", str(md)]) == 0
    assert "# Advice for 20261130-165248-tiny-6bcb2f" in md.read_text()
    assert main(["advise", "no-such-thing"]) == 2
    assert "not a run in" in capsys.readouterr().err


def test_fp16_overflow_rule_fires_from_metrics():
    setup = make_setup(model="tiny", gpu="h100", seq=128, micro_batch=2, precision="fp16")
    m = StepMetrics(run_id="r", source="profile", steps_measured=10, step_time_ms=100.0, fp16_skipped_steps=2)
    advice = advise(m, setup)
    rec = next(r for r in advice.recommendations if r.rule.id == "prec-fp16-overflow")
    # 2 of 10 steps skipped: 125 ms per useful step, back to 100 ms.
    assert rec.gain.before == pytest.approx(125.0) and rec.gain.after == pytest.approx(100.0)
    assert "prec-fp16-overflow" not in fired(advise(replace(m, fp16_skipped_steps=0), setup))


def test_cli_rules_lists_and_checks(tmp_path, capsys):
    assert main(["rules"]) == 0
    out = capsys.readouterr().out
    assert "mem-oom-activations" in out and out.rstrip().endswith(f"{len(R.load_rules())} rules")
    assert main(["rules", "--fields"]) == 0
    assert "memory_pct" in capsys.readouterr().out
    (tmp_path / "memory.yaml").write_text("- id: x\n  title: t\n")
    assert main(["rules", "--dir", str(tmp_path)]) == 2
    assert "missing keys" in capsys.readouterr().err


def test_vocab_alignment_on_a_gpu_setup_is_priced():
    # GPT-2's vocabulary 50257: the LM head is 31 % of its matmul FLOPs, nanoGPT's padding measured
    # ~25 % on this very model; the gain is capped there.
    advice = advise(setup=make_setup(model="gpt2-124m", gpu="h100", gpus=8, seq=1024, global_batch=64))
    rec = next(r for r in advice.recommendations if r.rule.id == "kern-vocab-multiple")
    assert rec.changes == {"model.vocab": 50304}
    assert rec.gain.gain_pct == pytest.approx(25.0) and rec.gain.upper_bound


def test_actions_that_would_not_fit_or_not_help_are_rejected_with_the_reason():
    # 70B with ZeRO-3 and full recompute. On 64 L40S (48 GB, PCIe) the gathers are exposed, and ZeRO-2
    # would replicate the 141 GB of bf16 weights: 366 % of the memory. On 64 H100 with TP 4 the dp group
    # has 2 members a node (2 NICs) and ZeRO-1 would need 155 % (Megatron's fp32 main gradients stay
    # whole under ZeRO-1: 4 bytes of 17.6e9 parameters a GPU): both fired, neither recommended.
    kw = {"model": "llama-3.1-70b", "zero": 3, "recompute": "full", "seq": 4096}
    l40s = advise(setup=make_setup(gpu="l40s", gpus=64, global_batch=64, **kw))
    assert {r.rule.id: r.action_note for r in l40s.rejected}["comm-zero3-gathers"] == (
        "the changed setup would not fit: 366 % of device memory (estimated)"
    )
    h100 = advise(setup=make_setup(gpu="h100", gpus=64, tp=4, global_batch=32, **kw))
    rejected = {r.rule.id: r.action_note for r in h100.rejected}
    assert rejected["par-zero3-unneeded"] == "the changed setup would not fit: 155 % of device memory (estimated)"
    assert "comm-zero3-gathers" not in fired(l40s) and "par-zero3-unneeded" not in fired(h100)
    # On 64 H100 without TP, FSDP's gathers use all 8 NICs of a node and hide behind the step, but the
    # compute they share the GPU with slows by overlap_slowdown_frac of them: 13 % of the step, under
    # comm-zero3-gathers' 15 %. par-zero3-unneeded fires on it, and its ZeRO-1 (548 %) is rejected.
    flat = advise(setup=make_setup(gpu="h100", gpus=64, global_batch=64, **kw))
    assert "comm-zero3-gathers" not in ({r.rule.id for r in flat.rejected} | set(fired(flat)))
    assert {r.rule.id: r.action_note for r in flat.rejected}["par-zero3-unneeded"] == (
        "the changed setup would not fit: 548 % of device memory (estimated)"
    )
    # 8B with TP=16: going to TP=1 is predicted 4x slower, so it is not advice; TP inside a node is.
    tp16 = advise(setup=make_setup(model="llama-3.1-8b", gpu="h100", gpus=16, tp=16, seq=4096))
    assert fired(tp16)[0] == "par-tp-across-nodes"
    assert "no gain" in {r.rule.id: r.action_note for r in tp16.rejected}["par-tp-unneeded"]
    md = advice_markdown(tp16)
    assert "## Fired but not recommended" in md and "`par-tp-unneeded`" in md


def test_memory_advice_shows_its_step_time_cost():
    # 8B on one H100 does not fit; offloading the optimizer over PCIe makes it fit at a large time cost.
    advice = advise(setup=make_setup(model="llama-3.1-8b", gpu="h100", gpus=1, seq=4096))
    top = advice.recommendations[0]
    assert top.rule.id == "mem-offload-pcie-last-resort" and top.gain.target == "peak_memory_bytes"
    t0, t1 = top.gain.side["step_time_ms"]
    assert t1 > 5 * t0
    assert "**Also changes step time:**" in advice_markdown(advice)
    # A speed-up that raises memory is not offered while the setup does not fit.
    assert "fix memory first" in {r.rule.id: r.action_note for r in advice.rejected}["prec-fp8-hopper"]


def test_one_recommendation_per_setting():
    advice = advise(setup=make_setup(model="llama-3.1-70b", gpu="h100", gpus=8, seq=4096))
    zero = [r for r in advice.recommendations if any(k == "parallel.zero" for k in r.changes)]
    assert len(zero) == 1


def test_a_faulty_gain_does_not_take_the_advice_down(monkeypatch):
    from advisor.advice import gains

    def broken(target, g):
        raise ZeroDivisionError("boom")

    monkeypatch.setitem(gains.GAINS, "whatif", broken)
    advice = advise(setup=make_setup(model="llama-3.1-70b", gpu="h100", gpus=8, seq=4096))
    notes = [r.action_note for r in advice.recommendations if r.rule.gain == "whatif"]
    assert notes and all(n == "gain not computed: ZeroDivisionError: boom" for n in notes)


def test_fp32_on_a_v100_is_advised_fp16_not_bf16():
    # V100: no bf16 math, fp16 tensor cores at 125 against 15.7 TFLOP/s fp32.
    setup = make_setup(model="gpt2-124m", gpu="v100", seq=1024, micro_batch=8, precision="fp32")
    advice = advise(setup=setup, source="setup")
    top = advice.recommendations[0]
    assert top.rule.id == "prec-fp32-to-fp16-no-bf16" and top.after.train.precision == "fp16"
    assert "prec-fp32-to-bf16" not in fired(advice) and top.gain.gain_pct > 50


def test_an_action_already_in_place_is_rejected_not_advised():
    # A CPU step that is 60 % latency-bound: compile is the lever of roof-latency-bound. A run that
    # already compiles is not told to compile; one that does not, is.
    setup = make_setup(model="tiny", gpu="cpu", seq=128, micro_batch=2)
    m = StepMetrics(
        run_id="r",
        source="profile",
        steps_measured=3,
        step_time_ms=100.0,
        roofline_bound="latency",
        roofline_latency_frac=0.6,
        roofline_roofs="CPU; measured roofs",
    )
    eager = advise(m, setup, {"compile": False})
    assert "roof-latency-bound" in fired(eager)
    compiled = advise(m, setup, {"compile": True})
    assert "roof-latency-bound" not in fired(compiled)
    reasons = {r.rule.id: r.action_note for r in compiled.rejected}
    assert reasons["roof-latency-bound"] == "already in place: options.compile = True"
    # A trace records no options: the lever is not known to be in place.
    assert "roof-latency-bound" in fired(advise(m, setup))
    # A setup value counts too: an action setting the recompute mode the setup already has.
    latency = next(r for r in R.load_rules() if r.id == "roof-latency-bound")
    eager_rule = replace(latency, action={"set": {"train.recompute": "none"}})
    reasons = {r.rule.id: r.action_note for r in advise(m, setup, {}, rules=[eager_rule]).rejected}
    assert reasons["roof-latency-bound"] == "already in place: train.recompute = none"


def test_a_gain_reads_in_the_direction_it_goes():
    from advisor.advice.advise import gain_phrase

    # gains.improvement_pct: positive is better, fewer ms or bytes, more tokens/s.
    assert gain_phrase("step_time_ms", 15.6) == "15.6 % less step time"
    assert gain_phrase("peak_memory_bytes", 59.5) == "59.5 % less peak memory"
    assert gain_phrase("tokens_per_s", 12.04) == "12.0 % more tokens/s"
    assert gain_phrase("step_time_ms", -3.0) == "3.0 % more step time"
    assert gain_phrase("tokens_per_s", -3.0) == "3.0 % less tokens/s"
    assert gain_phrase("step_time_ms", 0.01) == "no change in step time"


def test_a_setup_that_does_not_fit_points_to_the_planner(capsys):
    import shlex

    from advisor.advice.advise import advice_markdown, advise
    from advisor.cli import main
    from advisor.spec.setup import make_setup

    # 70B on 8 H100s at ZeRO-0: 1,333 GiB a GPU; the one recommendation (ZeRO-1) still leaves 609 GiB.
    md = advice_markdown(advise(setup=make_setup(model="llama-3.1-70b", gpu="h100", gpus=8)))
    assert "**The setup does not fit** (1,333.1 GiB of 79.6 GiB per GPU)" in md
    command = md.split("`python -m advisor ")[1].split("`")[0]
    assert command == "plan --model llama-3.1-70b --gpu h100 --gpus 8 --seq 4096 --global-batch 8 --precision bf16"
    assert main(shlex.split(command)) == 0 and "combinations" in capsys.readouterr().out  # the command it gives runs
    assert "does not fit" not in advice_markdown(
        advise(setup=make_setup(model="llama-3.1-8b", gpu="h100", gpus=8, zero=3))
    )


# --- learning from verification ------------------------------------------------------------------

BF16_RUN = "20261130-165253-tiny-617152"


def _store_with_pair(tmp_path, run_id=SAMPLE_RUN, measured_gain_pct=-104.6, noise_pct=2.0, predicted=80.6):
    """A copy of the sample runs with one verification pair filed as ``verify`` files it: fp32 -> bf16
    on ``run_id``, measured side by side (before 66.7 ms)."""
    import shutil

    root = tmp_path / "traces"
    shutil.copytree(REPO / "traces", root)
    before = 66.7
    pair = {
        "run_id": run_id,
        "rule_id": "prec-fp32-to-bf16",
        "target": "step_time_ms",
        "before": before,
        "predicted_after": before * (1 - predicted / 100),
        "measured_after": before * (1 - measured_gain_pct / 100),
        "predicted_gain_pct": predicted,
        "measured_gain_pct": measured_gain_pct,
        "new_run_id": "20261206-120000-tiny-aaaaaa",
        "changes": {"train.precision": "bf16"},
        "basis": "estimator",
        "noise_pct": noise_pct,
        "baseline_run_id": "20261206-115950-tiny-bbbbbb",
        "stored_before": 65.07,
        "created_utc": "2026-12-06T12:00:05Z",
    }
    (root / "verifications").mkdir()
    (root / "verifications" / f"{run_id}--prec-fp32-to-bf16--{pair['new_run_id']}.json").write_text(json.dumps(pair))
    return RunStore(root)


@pytest.mark.parametrize(
    "predicted, measured, noise, expected",
    [
        (80.6, -104.6, 2.0, "refuted"),  # the AMX Xeon's fp32 -> bf16 re-run
        (80.6, -104.6, None, "refuted"),
        (30.0, 25.0, 39.7, "inconclusive"),  # the loaded machine's baseline spread
        (30.0, -25.0, 39.7, "inconclusive"),
        (30.0, 10.0, 2.0, "fell short"),
        (30.0, 20.0, 2.0, "confirmed"),
        (30.0, 0.0, None, "refuted"),
    ],
)
def test_a_rerun_verdict_needs_a_change_beyond_the_baseline_spread(predicted, measured, noise, expected):
    from advisor.advice.evidence import verdict

    assert verdict(predicted, measured, noise) == expected
    # An upper bound (a share of the step a change could at most remove) is borne out by any real gain:
    # it does not "fall short"; a loss or noise reads the same as for a point prediction.
    assert verdict(predicted, measured, noise, upper_bound=True) == expected.replace("fell short", "confirmed")


def test_advice_a_rerun_refuted_is_demoted_and_says_what_was_measured(tmp_path, monkeypatch):
    from tests.sample_cpu import pin_sample_cpu

    pin_sample_cpu(monkeypatch)  # AVX512-BF16: fp32 -> bf16 is advised before any re-run
    assert "prec-fp32-to-bf16" in fired(advise_run(SAMPLE_RUN, RunStore(REPO / "traces")))
    advice = advise_run(SAMPLE_RUN, _store_with_pair(tmp_path))
    assert "prec-fp32-to-bf16" not in fired(advice)
    demoted = next(r for r in advice.rejected if r.rule.id == "prec-fp32-to-bf16")
    assert demoted.evidence.verdict == "refuted"
    assert demoted.gain.gain_pct == pytest.approx(-104.6)  # re-priced from the measurement
    phrase = "measured -104.6 % on this machine on 2026-12-06"
    assert demoted.action_note.startswith(phrase)
    md = advice_markdown(advice)
    assert f"`prec-fp32-to-bf16` (fp32 training where bf16 is faster): {phrase}" in md
    assert {"id": "prec-fp32-to-bf16", "reason": demoted.action_note} in json.loads(advice.to_json())["rejected"]


def test_advice_a_rerun_that_fell_short_is_repriced_and_an_inconclusive_one_is_noted(tmp_path, monkeypatch):
    from tests.sample_cpu import pin_sample_cpu

    pin_sample_cpu(monkeypatch)
    short = advise_run(SAMPLE_RUN, _store_with_pair(tmp_path / "a", measured_gain_pct=10.0))
    rec = next(r for r in short.recommendations if r.rule.id == "prec-fp32-to-bf16")
    assert rec.evidence.verdict == "fell short"
    assert rec.gain.gain_pct == pytest.approx(10.0)
    assert rec.gain.after == pytest.approx(rec.gain.before * 0.9)
    assert rec.gain.basis.startswith("measured +10.0 % on this machine on 2026-12-06")
    assert "- **Re-run on this machine:** fell short: measured +10.0 %" in advice_markdown(short)
    # The loaded machine: a change smaller than the baseline's spread is no verdict.
    noisy = advise_run(SAMPLE_RUN, _store_with_pair(tmp_path / "b", measured_gain_pct=-20.0, noise_pct=39.7))
    rec = next(r for r in noisy.recommendations if r.rule.id == "prec-fp32-to-bf16")
    assert rec.evidence.verdict == "inconclusive" and rec.gain.gain_pct > 0
    assert not rec.gain.basis.startswith("measured")  # the prediction stands, with the re-run beside it
    assert "inconclusive: measured -20.0 % on this machine on 2026-12-06" in advice_markdown(noisy)


def test_a_rerun_of_another_setup_does_not_speak_for_this_one(tmp_path, monkeypatch):
    from tests.sample_cpu import pin_sample_cpu

    pin_sample_cpu(monkeypatch)
    # The pair names the bf16 sample (recompute full) as its run: not the fp32 sample's setup.
    advice = advise_run(SAMPLE_RUN, _store_with_pair(tmp_path, run_id=BF16_RUN))
    rec = next(r for r in advice.recommendations if r.rule.id == "prec-fp32-to-bf16")
    assert rec.evidence is None and rec.gain.gain_pct > 0


def test_a_setup_alone_gets_the_levers_users_pull():
    """70B on 256 H200s, TP8 x PP4 x DP8 with sequence parallelism and selective recompute: TP
    communication is a fifth of the estimated step and 72 % of the memory is unused. Each lever is
    priced by the estimate of the changed setup."""
    from advisor.estimate.estimator import estimate

    setup = make_setup(
        model="llama-3.1-70b", gpu="h200", gpus=256, seq=8192, micro_batch=1, global_batch=1024, tp=8, pp=4,
        recompute="selective", sequence_parallel=True, precision="bf16", framework="megatron", zero=1,
    )  # fmt: skip
    est = estimate(setup)
    assert 100 * est.time.tp_comm_ms / est.step_time_ms == pytest.approx(19.6, abs=0.1)
    assert 100 * est.memory_frac == pytest.approx(28, abs=1)
    advice = advise(setup=setup)
    recs = {r.rule.id: r for r in advice.recommendations}
    # Smaller TP (more DP ranks), with "more PP" as the alternative on the same lever.
    tp = recs["par-tp-halve"]
    assert tp.changes == {"parallel.tp": 4, "parallel.dp": 16} and tp.also == ("par-tp-to-pp",)
    whatif = 100 * (1 - estimate(tp.after).step_time_ms / est.step_time_ms)
    assert tp.gain.gain_pct == pytest.approx(whatif) and tp.gain.gain_pct == pytest.approx(10.9, abs=0.2)
    # Less recompute: selective -> none fits in the unused memory.
    assert recs["mem-headroom-drop-recompute"].gain.gain_pct > 0
    rejected = {r.rule.id: r.action_note for r in advice.rejected}
    # A larger micro-batch halves the micro-batches, so the 4-stage bubble grows: priced, and turned down.
    assert rejected["mem-headroom-larger-microbatch"].endswith("more step time: no gain")
    assert rejected["par-tp-unneeded"].startswith("the changed setup would not fit")
    # Without sequence parallelism, turning it on is its own lever.
    no_sp = advise(setup=replace(setup, parallel=replace(setup.parallel, sequence_parallel=False)))
    sp = next(r for r in no_sp.recommendations if r.rule.id == "par-tp-sequence-parallel")
    assert sp.changes == {"parallel.sequence_parallel": True} and sp.gain.gain_pct > 5


def _fusable_step(**kw) -> StepMetrics:
    # A CPU step of 200 ms: 40 % in memory-bound elementwise/norm ops, 30 % of the step outside the
    # optimizer step, whose bytes at the memory roof would take 10 % of the step.
    base = dict(run_id="r", source="profile", steps_measured=5, step_time_ms=200.0, data_ms=1.0)
    base |= dict(roofline_fusable_frac=0.4, roofline_compile_fusable_frac=0.3, roofline_compile_fusable_roof_frac=0.1)
    return StepMetrics(**(base | kw))


def test_fusion_is_priced_at_the_memory_roof_outside_the_optimizer():
    setup = make_setup(model="tiny", gpu="cpu", seq=128, micro_batch=8)

    def fuse(m: StepMetrics):
        recs = advise(m, setup, {"compile": False, "num_workers": 0}).recommendations
        return next(r for r in recs if r.rule.id == "roof-fuse-memory-bound")

    # 30 % of the step fused down to its roof time over 2 (the chain moves its bytes once): 30 - 10 / 2.
    rec = fuse(_fusable_step())
    assert rec.gain.gain_pct == pytest.approx(25.0) and rec.gain.after == pytest.approx(150.0)
    # A run from before the roof split: the whole fusable share 2x faster.
    old = _fusable_step(roofline_compile_fusable_frac=None, roofline_compile_fusable_roof_frac=None)
    assert fuse(old).gain.gain_pct == pytest.approx(20.0)
    # A CPU step with unfused attention: its score chain (15 % of the step) is part of the fusable
    # share but not of what compiling reaches; the gain stays 25 % and its basis says why.
    chain = fuse(_fusable_step(roofline_fusable_frac=0.55, roofline_score_chain_frac=0.15))
    assert chain.gain.gain_pct == pytest.approx(25.0)
    assert "attention's score chain (15.0 %) left as it is" in chain.gain.basis
    assert "score chain" not in rec.gain.basis


def test_a_step_paced_by_its_loader_workers_gains_nothing_from_faster_compute():
    # few-workers on the AMX Xeon: 130 of 315 ms waiting for one worker. Its pace is the worker's:
    # compiling the model left the steady step where it was, and more workers are the lever.
    setup = make_setup(model="tiny", gpu="cpu", seq=128, micro_batch=8)
    m = _fusable_step(step_time_ms=315.0, data_ms=130.0)
    advice = advise(m, setup, {"compile": False, "num_workers": 1})
    reasons = {r.rule.id: r.action_note for r in advice.rejected}
    assert reasons["roof-fuse-memory-bound"] == "predicted no change in step time: no gain"
    # data_overlap: one worker loads a step's batches in the whole 315 ms; two take 157.5 ms, under
    # the 185 ms of compute.
    more = next(r for r in advice.recommendations if r.rule.id == "input-more-workers")
    assert more.gain.after == pytest.approx(185.0)
    # Without workers the load is inline: a faster compute shortens the step.
    inline = advise(m, setup, {"compile": False, "num_workers": 0})
    fuse = next(r for r in inline.recommendations if r.rule.id == "roof-fuse-memory-bound")
    assert fuse.gain.gain_pct == pytest.approx(25.0)


@pytest.mark.parametrize(
    "flags, rule, to",
    [
        ({"avx2", "fma"}, "prec-16bit-on-cpu-without-fast-path", "fp32"),
        ({"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16"}, "prec-fp16-on-cpu", "bf16"),
    ],
)
def test_fp16_on_a_cpu_is_priced_at_fp32_pace_or_slower(monkeypatch, flags, rule, to):
    from advisor.spec import presets

    # fp16 matmuls have no fast path on x86 CPUs short of AMX-FP16: a scalar loop without AVX512-FP16
    # (1/50 of fp32), fp32's pace with it (a Sapphire Rapids Xeon: 2048^3 at 109 against 106 GFLOP/s).
    monkeypatch.setattr(presets, "cpu_flags", lambda: flags)
    setup = make_setup(model="tiny", gpu="cpu", seq=64, micro_batch=2, precision="fp16")
    m = StepMetrics(
        run_id="r",
        source="profile",
        steps_measured=5,
        step_time_ms=50.0,
        roofline_gemm_frac=0.4,
        roofline_gemm_roof_frac=0.85,
        roofline_fusable_frac=0.22,
        roofline_attention_frac=0.13,
    )
    advice = advise(m, setup, {"compile": False})
    rec = advice.recommendations[0]
    assert rec.rule.id == rule and rec.changes == {"train.precision": to}
    hw = setup.hardware
    speed = hw.peak_flops(to) / hw.peak_fp16_flops  # AVX2: 1 / (1/50); AMX: 16 / 1
    assert speed == pytest.approx(16.0 if to == "bf16" else 50.0)
    # GEMMs 85 % on their fp16 roof: that part at the peaks' ratio, the rest unchanged; elementwise
    # and attention unchanged on a CPU: AMX 1 - (0.4 x (0.85 / 16 + 0.15) + 0.6) = 31.9 % less step
    # time, AVX2 1 - (0.4 x (0.85 / 50 + 0.15) + 0.6) = 33.3 %.
    assert rec.gain.gain_pct == pytest.approx(31.9 if to == "bf16" else 33.3, abs=0.05)


def test_a_cpu_precision_change_keeps_only_the_gemms_fixed_cost(monkeypatch):
    from advisor.spec import presets

    # bench/advice_scenarios.py's fp16-on-cpu on an AVX512-BF16 EPYC (12-07): a 763 ms fp16 step, 96.5 %
    # of it GEMMs at 70.2 % of the 1/50-of-fp32 roof. Re-run in bf16 the step took 22 ms, its GEMMs 7 ms
    # (105x). Priced with the time above the roof kept, 3.3x faster GEMMs: 67.4 % less step time.
    monkeypatch.setattr(presets, "cpu_flags", lambda: {"avx2", "fma", "avx512f", "avx512_bf16"})
    setup = make_setup(model="tiny", gpu="cpu", seq=64, micro_batch=2, precision="fp16")
    fields = dict(run_id="r", source="profile", steps_measured=5, step_time_ms=763.0, roofline_gemm_frac=0.965)
    fields |= dict(roofline_gemm_roof_frac=0.702, roofline_fusable_frac=0.0084, roofline_attention_frac=0.0092)
    old = advise(StepMetrics(**fields), setup, {"compile": False}).recommendations[0]
    assert old.rule.id == "prec-fp16-on-cpu" and old.gain.gain_pct == pytest.approx(67.36, abs=0.01)
    # With the GEMMs' fixed per-call share known (0.1 %), the rest moves at the peaks' ratio, bf16 3.5 x
    # fp32 over fp16 1/50 = 175x: GEMMs 1 / (0.001 + 0.999 / 175) = 149x faster; the step keeps its
    # other 3.5 %, elementwise and attention 1.8 %: 1 - (0.035 + 0.965 / 149.06) = 95.85 % less.
    new = advise(StepMetrics(**fields, roofline_gemm_fixed_frac=0.001), setup, {"compile": False}).recommendations[0]
    assert new.rule.id == "prec-fp16-on-cpu" and new.gain.gain_pct == pytest.approx(95.85, abs=0.01)
    assert "gemm (96 % of the step) 149x faster" in new.gain.basis
    # From fp32, a native path, the time above the roof (packing, reorders, small tiles) stays, fixed
    # share known or not: bf16 3.5x fp32 at half the roof, 1 / (0.5 / 3.5 + 0.5) = 1.56x.
    cpu = setup.hardware
    for fixed in (None, 0.001):
        assert gains_module._class_speedups(cpu, "fp32", "bf16", 0.5, fixed)["gemm"] == pytest.approx(1.5556, abs=1e-4)
    # So on a GPU, whose time above the roof is tiles and waves.
    gpu = make_setup(model="tiny", gpu="h100", seq=64, micro_batch=2, precision="fp32").hardware
    ratio = gpu.peak_flops("bf16") / gpu.peak_flops("fp32")
    assert gains_module._class_speedups(gpu, "fp32", "bf16", 0.5, 0.001)["gemm"] == pytest.approx(
        1 / (0.5 / ratio + 0.5)
    )


def test_offload_on_a_cpu_is_priced_by_the_steps_timed_without_it():
    # tiny offloading all 4 blocks on a CPU, a 200 ms step. The hooks timed 17 ms inside themselves;
    # steps with the offload off beside steps with it on (3 alternating pairs) took 38 ms less.
    setup = make_setup(model="tiny", gpu="cpu", seq=256, micro_batch=4, offload_activations=4)
    hooks = dict(blocks=4, exposed_ms=17.0, copy_out_ms=6.0, copy_in_ms=8.0)
    reference = dict(step_with_ms=200.0, step_without_ms=162.0, step_cost_ms=38.0, pair_costs_ms=[40, 38, 30])

    def offload_off(**offload):
        m = StepMetrics(
            run_id="r", source="profile", steps_measured=5, step_time_ms=200.0, data_ms=0.5, activation_offload=offload
        )
        recs = advise(m, setup, {"compile": False, "num_workers": 0}).recommendations
        return next(r for r in recs if r.rule.id == "mem-offload-activations-on-cpu")

    measured = offload_off(**hooks, **reference, reference_pairs=3)
    assert measured.gain.gain_pct == pytest.approx(19.0) and measured.gain.after == pytest.approx(162.0)
    assert "took 200.0 ms, with it off 162.0 ms (median of 3 alternating pairs" in measured.gain.basis
    # An older run (or another device) without the reference: the hooks' own time, a floor.
    floor = offload_off(**hooks)
    assert floor.gain.gain_pct == pytest.approx(8.5) and "this is a floor" in floor.gain.basis
