"""Roofline of the shipped CPU run and measured ceilings: FLOPs checked by hand and against the profiler."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from advisor.advice.advise import advise_trace
from advisor.analysis.roofline import (
    kernel_roofline,
    op_category,
    op_roofline,
    op_shapes,
    op_work,
    step_roofline_summary,
    streaming_bytes_per_s,
    total_flops,
    trace_roofline,
    trace_work,
)
from advisor.analysis.summary import analyze_path, load_trace
from advisor.errors import AdvisorError, TraceError
from advisor.run.ceilings import measure_ceilings
from advisor.spec.ceilings import Ceilings, load_ceilings
from advisor.spec.presets import get_hardware, hardware_for_trace, tiny
from advisor.spec.specs import HardwareSpec
from advisor.store.ceilings import ceilings_lookup, ceilings_path, store_ceilings, stored_ceilings
from tests.shared import SHARED_TRACES, needs_shared_traces

RUN = Path(__file__).resolve().parent.parent / "traces" / "20261130-165248-tiny-6bcb2f"
MATMUL_OPS = ("aten::mm", "aten::linear", "aten::matmul")


@pytest.fixture(scope="module")
def ops():
    return op_shapes(load_trace(RUN / "trace.json.gz"))


@pytest.fixture(scope="module")
def hardware() -> HardwareSpec:
    return HardwareSpec(**json.loads((RUN / "request.json").read_text())["setup"]["hardware"])


@pytest.fixture(scope="module")
def roofline(ops, hardware):
    n_params = json.loads((RUN / "metrics.json").read_text())["n_params"]
    return op_roofline(ops, hardware, optimizer_params=n_params)


def tiny_cpu() -> HardwareSpec:
    from advisor.spec.presets import cpu_host

    return cpu_host()


def _first(ops, name, dims):
    row = ops[(ops["name"] == name) & (ops["input_dims"].map(lambda d: d == dims))].iloc[0]
    return op_work(row["name"], row["input_dims"], row["input_types"], row["concrete_inputs"])


def test_mm_flops_from_shapes_by_hand(ops):
    # MLP up/gate projection: x [256 tokens, 256] @ W^T [256, 688] -> 2*M*N*K.
    flops, nbytes = _first(ops, "aten::mm", [[256, 256], [256, 688]])
    assert flops == 2 * 256 * 688 * 256 == 90_177_536
    assert nbytes == 4 * (256 * 256 + 256 * 688 + 256 * 688)
    # Tied output head, weight gradient: dY^T [8192, 256] @ X [256, 256].
    flops, _ = _first(ops, "aten::mm", [[8192, 256], [256, 256]])
    assert flops == 2 * 8192 * 256 * 256 == 1_073_741_824


def test_mm_flops_equal_the_profilers_own_count(ops):
    # This trace's events carry no per-call flops (the column is NaN); the profiler's count lives in
    # top_ops.json, summed over the same 174 calls of the two profiled steps.
    assert ops["flops"].isna().all() and ops.attrs["profiler_steps"] == 2
    mm = ops[ops["name"] == "aten::mm"]
    ours = sum(
        op_work("aten::mm", d, t, c)[0]
        for d, t, c in zip(mm["input_dims"], mm["input_types"], mm["concrete_inputs"], strict=True)
    )
    top = {r["name"]: r for r in json.loads((RUN / "top_ops.json").read_text())}["aten::mm"]
    assert len(mm) == top["calls"] == 174
    assert ours == top["flops"] == 15_351_152_640


def test_matmul_flops_per_step_match_6n_tokens(roofline):
    # Each weight element of a matmul costs 2 FLOPs per token forward and 4 backward (input grad and
    # weight grad): 6 per token. Tiny: attention 256*(256+2*128) + 256*256 = 196,608 and SwiGLU
    # 3*256*688 = 528,384 per layer, x 4 layers, plus the tied head 8192*256 (it still multiplies):
    # 4,997,120 weights. Attention scores run inside SDPA and are not in this count. 256 tokens a step.
    model, tokens = tiny(), 2 * 128
    assert model.matmul_params_per_token() == 4_997_120
    expected = 6 * model.matmul_params_per_token() * tokens  # 7,675,822,080
    per_step = total_flops(roofline, MATMUL_OPS) / roofline.attrs["profiler_steps"]
    assert per_step == pytest.approx(expected, rel=0.02)
    assert per_step == 7_675_576_320  # the profiler's count / 2 (wrappers moved onto linear, not lost)


def test_attention_flops_causal(roofline):
    # q [2, 8, 128, 32], causal: 4*b*h*s*s*d / 2 forward, 2.5x that backward.
    fwd = roofline[roofline["name"] == "aten::scaled_dot_product_attention"].iloc[0]
    bwd = roofline[roofline["name"] == "aten::_scaled_dot_product_flash_attention_for_cpu_backward"].iloc[0]
    assert fwd["calls"] == bwd["calls"] == 8
    assert fwd["flops"] / 8 == 4 * 2 * 8 * 128 * 128 * 32 / 2 == 16_777_216
    assert bwd["flops"] / 8 == 2.5 * 16_777_216


def test_verdicts(roofline):
    # The head's forward: [256, 256] @ [256, 8192], 7 ms a call at 63 FLOP/byte: compute side.
    head = roofline[(roofline["name"] == "aten::linear") & (roofline["calls"] == 2)].iloc[0]
    assert head["bound"] == "compute" and head["mean_call_us"] > 5000
    assert head["intensity_flops_per_byte"] == pytest.approx(2 * 256 * 8192 * 256 / (4 * (256 * 256 + 2 * 256 * 8192)))
    assert (roofline.loc[roofline["flops"] > 1e8, "bound"] != "latency").all()
    # add_ of 4 us per call on 8 floats (grad-norm scalars) reaches < 0.1 % of its roof: latency.
    tiny_adds = roofline[(roofline["name"] == "aten::add_") & (roofline["bound"] == "latency")]
    assert len(tiny_adds) and (tiny_adds["mean_call_us"] < 20).all()
    # AdamW over 4,999,424 fp32 params: 7 accesses of 4 bytes each, 0.5 FLOP/byte: memory side.
    adam = roofline[roofline["name"] == "aten::_fused_adamw_"].iloc[0]
    assert adam["bytes"] == 2 * 28 * 4_999_424 and adam["bound"] == "memory"


def test_step_summary_shares(roofline):
    s = step_roofline_summary(roofline)
    assert s["compute_frac"] + s["memory_frac"] + s["latency_frac"] == pytest.approx(1.0)
    # Measured on this trace: matmuls and attention ~80 % of modelled op time, latency under 1 %.
    assert s["compute_frac"] == pytest.approx(0.797, abs=0.002)
    # The op classes a precision change prices apart: GEMMs 73.4 % and the fused attention (forward and
    # backward SDPA) 6.3 %, together the compute-bound time; elementwise/norm ops 14.2 %.
    assert s["gemm_frac"] == pytest.approx(0.734, abs=0.002)
    assert s["attention_frac"] == pytest.approx(0.063, abs=0.002)
    assert s["gemm_frac"] + s["attention_frac"] == pytest.approx(s["compute_frac"])
    assert s["fusable_frac"] == pytest.approx(0.142, abs=0.002)
    assert s["latency_frac"] < 0.01
    assert 0.9 < s["modelled_frac"] <= 1.0
    assert s["per_step_ms"] == pytest.approx(s["modelled_ms"] / 2)


def test_the_fixed_share_of_the_gemms_is_their_calls_cost_at_most_their_time_above_the_roof(roofline):
    from advisor.analysis.roofline import GEMM_CALL_FIXED_US

    s = step_roofline_summary(roofline)
    # Row by row: each GEMM's calls x GEMM_CALL_FIXED_US, capped at its time above the roof.
    gemm = roofline[(roofline["category"] == "gemm") & (roofline["bound"] != "latency")]
    fixed = total = 0.0
    for r in gemm.itertuples():
        fixed += min(r.time_ms * r.headroom_frac, r.calls * GEMM_CALL_FIXED_US / 1e3)
        total += r.time_ms
    assert s["gemm_fixed_frac"] == pytest.approx(fixed / total)
    # The sample's GEMMs: 174 calls of 0.1-7 ms in 87.8 ms (fp32, 2 cores). At most 174 x 10 us = 1.74
    # ms (2.0 %) is fixed; less where a GEMM runs closer to its roof than that (16 calls of aten::mm
    # on it: none), 1.48 % in all.
    assert gemm["calls"].sum() == 174 and total == pytest.approx(87.80, abs=0.01)
    assert s["gemm_fixed_frac"] == pytest.approx(0.0148, abs=0.0001)


def test_compile_reaches_the_fusable_ops_outside_the_optimizer(ops, roofline, hardware):
    s = step_roofline_summary(roofline)
    fus = roofline[roofline["category"].isin(["elementwise", "reduction", "normalization"])]
    fus = fus[fus["bound"] == "memory"]
    # The sample run's optimizer is fused AdamW (an "optimizer" op, not a fusable one): compiling the
    # model reaches every fusable op.
    assert ops["in_optimizer"].sum() > 0 and s["compile_fusable_frac"] == pytest.approx(s["fusable_frac"])
    # Fused, they stream at the rate this run's big streams reached (the fastest group with 1 % of
    # their bytes or more), at most the roof: this small model's tensors stay in cache, and its
    # fastest group (203 GB/s) beats the 20 GB/s datasheet roof, which is taken.
    big = fus[fus["bytes"] >= 0.01 * fus["bytes"].sum()]
    fastest = float((big["bytes"] / (big["time_ms"] / 1e3)).max())
    assert fastest == pytest.approx(203e9, rel=0.01) and streaming_bytes_per_s(fus, 1e12) == pytest.approx(fastest)
    bw = roofline.attrs["roofs"]["bytes_per_s"]
    assert streaming_bytes_per_s(fus, bw) == bw == 20e9
    fused_ms = np.minimum(fus["time_ms"], fus["bytes"] / bw * 1e3).sum()
    assert s["compile_fusable_roof_frac"] == pytest.approx(fused_ms / s["modelled_ms"])
    assert 0 < s["compile_fusable_roof_frac"] < s["compile_fusable_frac"]
    # Had every aten::mul run inside the optimizer step (a for-loop AdamW's updates are muls and adds),
    # compiling the model would leave those eager: their time and fused time come off.
    eager = ops.assign(in_optimizer=ops["name"] == "aten::mul")
    n_params = json.loads((RUN / "metrics.json").read_text())["n_params"]
    moved = op_roofline(eager, hardware, optimizer_params=n_params)
    muls = fus[fus["name"] == "aten::mul"]
    opt = moved.attrs["optimizer_fusable"]
    assert opt["time_ms"] == pytest.approx(muls["time_ms"].sum()) and opt["unknown_ms"] == 0
    assert opt["bytes"] == pytest.approx(muls["bytes"].sum())
    s2 = step_roofline_summary(moved)
    assert s2["fusable_frac"] == pytest.approx(s["fusable_frac"])
    assert s2["compile_fusable_frac"] == pytest.approx(s["fusable_frac"] - muls["time_ms"].sum() / s["modelled_ms"])
    assert 0 < muls["time_ms"].sum() / s["modelled_ms"] < s["fusable_frac"]
    mul_fused = min(muls["time_ms"].sum(), muls["bytes"].sum() / bw * 1e3)
    assert s2["compile_fusable_roof_frac"] == pytest.approx((fused_ms - mul_fused) / s["modelled_ms"])


def test_measured_ceilings_override_the_spec(ops, hardware):
    c = Ceilings("test", {"fp32": 1e11}, 1e10, "", "")
    r = op_roofline(ops, hardware, c)
    assert r["roof_flops_per_s"].max() == 1e11


def test_damaged_trace_is_refused(tmp_path):
    bad = tmp_path / "trace.json.gz"
    bad.write_bytes(b"\x1f\x8b" + b"not gzip after its magic")
    with pytest.raises(TraceError, match=r"trace\.json\.gz is damaged or not gzip"):
        load_trace(bad)


def test_cpu_ceilings_measure_and_round_trip(tmp_path):
    c = measure_ceilings("cpu", ("fp32",), matmul_n=512, copy_mib=256, repeats=2)
    for v in (c.matmul_flops_per_s["fp32"], c.copy_bytes_per_s):
        assert math.isfinite(v) and v > 0
    path = c.save(tmp_path / "ceilings.json")
    assert load_ceilings(path) == c


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"device_name": "cpu", "matmul_flops_per_s": {"fp32": 1e11', "not valid JSON"),
        ('{"device_name": "cpu"}', "missing keys"),
        (
            '{"device_name": "cpu", "matmul_flops_per_s": {"fp32": 1e11}, "copy_bytes_per_s": -1,'
            ' "measured_utc": "", "method": ""}',
            r"copy_bytes_per_s=-1 must be a finite number > 0",
        ),
        (
            '{"device_name": "cpu", "matmul_flops_per_s": {"fp32": NaN}, "copy_bytes_per_s": 1e10,'
            ' "measured_utc": "", "method": ""}',
            r"matmul_flops_per_s\['fp32'\]=nan",
        ),
    ],
)
def test_damaged_ceilings_are_refused(tmp_path, text, message):
    path = tmp_path / "ceilings.json"
    path.write_text(text)
    with pytest.raises(AdvisorError, match=message):
        load_ceilings(path)


def test_all_flops_of_a_cpu_step_match_the_analytic_count():
    # Everything the roofline attributes to one step of the shipped tiny run (matmuls, attention,
    # elementwise, norms, the fused AdamW) against 6 N x tokens plus causal flash attention: forward
    # 4 s q L / 2 per token, backward 2.5x forward (5 matmuls with the recompute of QK^T): 3.5x.
    report = analyze_path(RUN)
    table, steps = report.tables["roofline"], report.tables["roofline"].attrs["profiler_steps"]
    model, tokens = tiny(), 256
    attn_fwd = 4 * 128 * model.q_dim * model.n_layers / 2 * tokens  # 67,108,864
    analytic = 6 * model.matmul_params_per_token() * tokens + 3.5 * attn_fwd  # 7,910,703,104
    assert table["flops"].sum() / steps == pytest.approx(analytic, rel=0.02)  # measured +1.37 %
    by_cat = table.groupby("category")["flops"].sum() / steps
    assert by_cat["gemm"] + by_cat["attention"] == pytest.approx(analytic, rel=1e-4)  # -0.003 %


def test_own_run_uses_its_device_and_stored_ceilings(tmp_path):
    events = load_trace(RUN)
    r = trace_roofline(events)
    assert r.hardware.kind == "cpu" and "the device the run used" in r.roofs_note and r.ceilings is None
    c = Ceilings(r.hardware.name, {"fp32": 1e11}, 5e10, "2026-11-30T00:00:00+00:00", "test")
    store_ceilings(c, tmp_path)
    assert stored_ceilings(r.hardware.name, tmp_path) == c
    measured = trace_roofline(events, ceilings=ceilings_lookup(tmp_path))
    assert measured.ceilings == c and "roofs measured 2026-11-30" in measured.roofs_note
    assert measured.table.attrs["roofs"] == {
        "peak_flops_per_s": {"fp32": 1e11},
        "bytes_per_s": 5e10,
        "measured": True,
        "measured_peaks": ["fp32"],
        "device": r.hardware.name,
    }
    # Against a lower compute roof (1e11 against the datasheet's 1.92e11) the GEMMs have less headroom.
    gemm = r.table["category"] == "gemm"
    assert (measured.table.loc[gemm, "headroom_frac"] <= r.table.loc[gemm, "headroom_frac"]).all()
    assert measured.table.loc[gemm, "headroom_frac"].sum() < r.table.loc[gemm, "headroom_frac"].sum()


def test_stored_ceilings_of_another_device_are_refused(tmp_path):
    c = Ceilings("H200 SXM 141GB", {"bf16": 7e14}, 4e12, "", "")
    path = store_ceilings(c, tmp_path)
    path.rename(ceilings_path("CPU host (2 cores)", tmp_path))
    with pytest.raises(AdvisorError, match="is for 'H200 SXM 141GB', not 'CPU host"):
        stored_ceilings("CPU host (2 cores)", tmp_path)


# --- GPU traces (real, from ../shared/traces) --------------------------------------------------------

TRACES = SHARED_TRACES
needs_traces = needs_shared_traces
A100_SHAPES = TRACES / "kineto" / "trace_filter" / "sampled_rank-0.json.gz"  # rank 0 of 128, record_shapes
V100 = TRACES / "kineto" / "ns_resolution_trace" / "rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz"
A100_HOST_BOUND = TRACES / "kineto" / "nccl_parser_config" / "nccl_data.json.gz"


@needs_traces
def test_kernels_link_to_their_launching_ops():
    # Every kernel's correlation id leads to a runtime call inside an op on the same thread.
    for path, share in ((V100, 1.0), (A100_HOST_BOUND, 1.0), (A100_SHAPES, 0.98)):
        work = trace_work(load_trace(path))
        assert (work.kernels["launch_op"] >= 0).mean() >= share, path.name
    assert trace_work(load_trace(V100)).gpus == [("Tesla V100-SXM2-32GB", 34079637504)]


@needs_traces
def test_gemm_kernels_take_flops_from_their_ops_shapes():
    work = trace_work(load_trace(A100_SHAPES))
    hw, how = hardware_for_trace(work.gpus, work.kernels["name"])
    assert hw.name == "A100 SXM 80GB" and "guessed from kernel names" in how  # no deviceProperties here
    table = kernel_roofline(work, hw)
    # aten::mm [8192, 512] @ [512, 8192] on a CUTLASS TF32 kernel: 2*M*N*K per call.
    mm = table[(table["op"] == "aten::mm") & (table["input_dims"] == "[[8192, 512], [512, 8192]]")].iloc[0]
    assert mm["basis"] == "shapes" and "s1688gemm" in mm["name"] and mm["precision"] == "tf32"
    assert mm["flops"] / mm["calls"] == 2 * 8192 * 8192 * 512 == 68_719_476_736
    assert mm["bytes"] / mm["calls"] == 4 * (8192 * 512 * 2 + 8192 * 8192)
    assert mm["intensity_flops_per_byte"] == pytest.approx(227.56, abs=0.01)  # compute side of A100's TF32 ridge
    assert mm["bound"] == "compute"
    # aten::addmm bias [3906] + [2048, 512] @ [512, 3906]: the bias add is not counted.
    addmm = table[
        (table["op"] == "aten::addmm") & (table["input_dims"] == "[[3906], [2048, 512], [512, 3906], [], []]")
    ]
    assert (addmm["flops"] / addmm["calls"] == 2 * 2048 * 3906 * 512).all()  # 8,191,475,712
    # TF32 kernels are judged against the TF32 peak, fp32 SIMT (ampere_sgemm) ones against FP32's.
    sgemm = table[table["name"].str.startswith("ampere_sgemm") & (table["basis"] == "shapes")]
    assert len(sgemm) and (sgemm["precision"] == "fp32").all()
    assert (sgemm["roof_flops_per_s"] <= hw.peak_fp32_flops).all()


@needs_traces
def test_gpu_bound_v100_trace_is_compute_and_memory_bound():
    # GPU-bound ResNet on one V100 (HTA: idle 2.63 %); recorded without shapes, so the kernels are
    # judged by class and length.
    report = analyze_path(V100)
    m = report.metrics
    assert "V100 SXM2 32GB" in m.roofline_roofs
    assert m.roofline_compute_frac + m.roofline_memory_frac > 0.95
    assert m.roofline_latency_frac < 0.05 and m.roofline_bound in ("compute", "memory")
    assert m.roofline_modelled_frac < 0.02  # only copies and sets have bytes
    cudnn_conv = report.tables["roofline"]
    conv = cudnn_conv[cudnn_conv["op"] == "aten::cudnn_convolution"]
    assert (conv.loc[conv["category"].isin(["gemm", "convolution"]), "bound"] != "memory").all()
    # cuDNN's implicit-GEMM kernels (scudnn_*) name no class: their launching convolution gives it.
    scudnn = cudnn_conv[cudnn_conv["name"].str.contains("scudnn") & (cudnn_conv["mean_call_us"] > 10)]
    assert len(scudnn) and (scudnn["bound"] == "compute").all()
    # With no shapes the precision is unknown, and no peak line is drawn for it.
    assert (cudnn_conv.loc[cudnn_conv["basis"] == "kernel class", "precision"] == "?").all()
    assert set(cudnn_conv.attrs["roofs"]["peak_flops_per_s"]) == {"fp32"}


@needs_traces
def test_host_bound_a100_trace_is_latency_bound():
    # README of ../shared/traces: idle 77.78 %, 99 % of it host wait: the launch queue runs dry.
    m = analyze_path(A100_HOST_BOUND).metrics
    assert m.roofline_bound == "latency"
    assert m.roofline_latency_frac == pytest.approx(m.gpu_idle_pct / 100 * m.idle_host_wait_pct / 100, abs=0.03)
    assert m.roofline_latency_frac > 0.7
    assert "A100 SXM 40GB" in m.roofline_roofs  # A100-PG509-200 with 40 GB: the HBM2 part


@needs_traces
def test_nsys_export_is_judged_by_kernel_class():
    report = analyze_path(TRACES / "nsys" / "pipit_cloverleaf_cuda.sqlite")
    m, table = report.metrics, report.tables["roofline"]
    assert "A100 SXM 80GB" in m.roofline_roofs
    assert set(table["basis"]) <= {"kernel class", "transfer"}
    assert m.roofline_bound == "memory"  # CloverLeaf's stencils: no GEMMs


@needs_traces
def test_roofline_rules_fire_on_the_real_traces():
    top = advise_trace(A100_HOST_BOUND).recommendations[0]
    assert top.rule.id == "roof-latency-bound" and "launch-bound" in top.also
    v100 = {r.rule.id: r for r in advise_trace(V100).recommendations}
    assert "roof-fuse-memory-bound" in v100
    assert v100["roof-fuse-memory-bound"].gain.gain_pct == pytest.approx(100 * 0.315 / 2, abs=0.5)


def test_the_roofline_reads_no_file_the_loader_did_not(tmp_path):
    # Parse once: the loader keeps the modelled ops' arguments beside the table, so the roofline of a
    # trace whose file is gone after loading is the same as the one made while it was there.
    copy = tmp_path / "trace.json.gz"
    copy.write_bytes((RUN / "trace.json.gz").read_bytes())
    events = load_trace(copy)
    before = trace_roofline(events).table
    copy.unlink()
    after = trace_roofline(events)
    pd.testing.assert_frame_equal(after.table, before)
    assert len(events.attrs["event_args"]) > 0 and (after.table["basis"] == "shapes").any()
    # A table loaded without the arguments says how to load it, rather than judging no shapes.
    from advisor.trace.load import load_trace as bare_load

    with pytest.raises(TraceError, match=r"load it with advisor\.analysis\.summary\.load_trace"):
        trace_roofline(bare_load(RUN))


def test_a_trace_whose_roofline_cannot_be_made_is_still_analyzed(monkeypatch, capsys):
    import advisor.analysis.summary as summary

    def refuse(*args, **kwargs):
        raise TraceError("trace.json.gz holds no cpu_op events to judge")

    whole = analyze_path(RUN)
    monkeypatch.setattr(summary, "trace_roofline", refuse)
    report = analyze_path(RUN)
    assert "roofline" not in report.tables and report.metrics.roofline_bound is None
    # The rest of the analysis is there, as it is with the roofline: the step, its phases, the top ops.
    assert whole.metrics.roofline_bound == "compute"
    assert report.metrics.step_time_ms == whole.metrics.step_time_ms and report.metrics.step_time_ms > 0
    assert report.metrics.top_ops == whole.metrics.top_ops
    assert set(report.tables) == set(whole.tables) - {"roofline"}
    err = capsys.readouterr().err
    assert "roofline skipped: trace.json.gz holds no cpu_op events to judge" in err
    # On stderr: analyze --json keeps its standard output JSON.
    from advisor.cli import main

    assert main(["analyze", str(RUN), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["metrics"]["roofline_bound"] is None and "roofline skipped" in captured.err


def test_convolution_flops_equal_the_profilers_own_count(tmp_path):
    import torch
    from torch.profiler import ProfilerActivity, profile

    conv = torch.nn.Conv2d(16, 32, 3, stride=2, padding=1)
    x = torch.randn(4, 16, 32, 32, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
        conv(x).sum().backward()
    prof.export_chrome_trace(str(tmp_path / "conv.json"))
    own = {e.key: e.flops for e in prof.key_averages() if e.flops}
    table = op_roofline(op_shapes(load_trace(tmp_path / "conv.json")), tiny_cpu())
    fwd = table[table["name"] == "aten::conv2d"].iloc[0]
    bwd = table[table["name"] == "aten::convolution_backward"].iloc[0]
    # Output 16x16 (stride 2, padding 1): 2 x N x 16 x 16 x numel(weight) = 2*4*256*(32*16*9).
    assert fwd["flops"] == own["aten::conv2d"] == 2 * 4 * 16 * 16 * 32 * 16 * 9 == 9_437_184
    assert fwd["category"] == "convolution" and fwd["bytes"] == 4 * (
        4 * 16 * 32 * 32 + 32 * 16 * 9 + 32 + 4 * 32 * 16 * 16
    )
    # Backward: input and weight gradients, each a forward's worth.
    assert bwd["flops"] == 2 * 9_437_184


def test_the_profilers_own_flop_count_wins_where_present():
    ops = op_shapes(load_trace(RUN / "trace.json.gz")).head(0).copy()
    row = {"name": "aten::mm", "tid": 1, "start_us": 0.0, "dur_us": 100.0, "input_dims": [[8, 4], [4, 2]]}
    row |= {"input_types": ["float", "float"], "concrete_inputs": ["", ""], "flops": 999.0, "in_optimizer": False}
    ops.loc[0] = row
    r = op_roofline(ops, tiny_cpu())
    assert r["flops"].iloc[0] == 999.0 and r["bytes"].iloc[0] == 4 * (32 + 8 + 16)  # bytes still by shapes


@needs_traces
def test_a_zip_of_rank_files_gives_rank_0s_roofline(tmp_path):
    import zipfile

    archive = tmp_path / "ranks.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for f in sorted((TRACES / "kineto" / "trace_filter").glob("*.json.gz")):
            z.write(f, f"job/{f.name}")
    zipped, plain = trace_work(load_trace(archive)), trace_work(load_trace(A100_SHAPES))
    assert zipped.file == "sampled_rank-0.json.gz"
    assert zipped.ops.drop(columns="tid").equals(plain.ops.drop(columns="tid"))
    assert zipped.kernels.equals(plain.kernels)


def test_cpu_shares_are_of_the_step_when_its_time_is_known(roofline):
    # A step with 400 ms of data loading outside any op: the ops' shares shrink to their part of it,
    # so a roofline rule cannot outrank the loading stall on the ops' share alone.
    s = step_roofline_summary(roofline, step_ms=465.72)
    base = 465.72 * 2
    assert s["compute_frac"] == pytest.approx(s["compute_ms"] / base)
    assert s["other_frac"] == pytest.approx(1 - s["modelled_ms"] / base) and s["other_frac"] > 0.85
    assert s["fusable_frac"] < 0.03 and s["verdict"] == "compute"
    # Ops on several threads can add up to more than the wall time: the base never drops below them.
    assert step_roofline_summary(roofline, step_ms=1.0)["compute_frac"] == pytest.approx(
        step_roofline_summary(roofline)["compute_frac"]
    )


def _kineto(tmp_path, events, name="synthetic.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    return path


def _op(name, ts, dur, dims=(), types=(), concrete=(), tid=1):
    args = {"Input Dims": list(dims), "Input type": list(types), "Concrete Inputs": list(concrete)}
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _launch(corr, ts, cat="cuda_runtime", tid=1):
    return {
        "ph": "X",
        "cat": cat,
        "name": "cudaLaunchKernel",
        "pid": 1,
        "tid": tid,
        "ts": ts,
        "dur": 2,
        "args": {"correlation": corr},
    }


def _kernel(name, corr, ts, dur):
    return {
        "ph": "X",
        "cat": "kernel",
        "name": name,
        "pid": 0,
        "tid": 7,
        "ts": ts,
        "dur": dur,
        "args": {"correlation": corr, "stream": 7},
    }


def test_an_op_and_the_modelled_op_it_calls_are_counted_once(tmp_path):
    # nll_loss_backward zeroes its [N, V] gradient through fill_ (a modelled op) and then launches its
    # own kernel: the two kernels share the outer op's bytes by time, not each take a full copy.
    n, v = 8192, 1000
    dims = [[], [n, v], [n], [], [], [], []]
    types = ["float", "float", "long int", "", "Scalar", "Scalar", "float"]
    events = [
        _op("aten::nll_loss_backward", 0, 100, dims, types),
        _op("aten::fill_", 10, 40, [[n, v], []], ["float", "Scalar"]),
        _launch(1, 20),
        _launch(2, 60),
        _kernel("void at::native::vectorized_elementwise_kernel<4, FillFunctor<float>>", 1, 200, 300),
        _kernel("void nll_loss_backward_reduce_cuda_kernel_2d<float, long>", 2, 510, 10),
    ]
    work = trace_work(load_trace(_kineto(tmp_path, events)))
    assert work.kernels["launch_op"].tolist() == [1, 0]  # innermost op around each launch
    table = kernel_roofline(work, get_hardware("h100"))
    outer_bytes = n * v * 4 + n * 8  # the full gradient written once, the targets read
    assert table["bytes"].sum() == pytest.approx(outer_bytes)
    assert set(table["op"]) == {"aten::nll_loss_backward"}
    fill = table[table["name"].str.contains("Fill")].iloc[0]
    assert fill["bytes"] == pytest.approx(outer_bytes * 300 / 310)  # its share of the op's kernel time


def test_triton_kernels_launched_through_the_driver_api_are_linked(tmp_path):
    # torch.compile's Triton kernels go through cuLaunchKernel, recorded as cuda_driver.
    events = [
        _op("aten::mm", 0, 50, [[4096, 4096], [4096, 4096]], ["float", "float"]),
        _launch(9, 10, cat="cuda_driver"),
        _kernel("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", 9, 100, 500),
    ]
    table = kernel_roofline(trace_work(load_trace(_kineto(tmp_path, events))), get_hardware("h100"))
    row = table.iloc[0]
    assert row["basis"] == "shapes" and row["flops"] == 2 * 4096**3
    # fp32 tensors on a tensor-core kernel run as TF32: judged against H100's TF32 roof, not FP32's.
    assert row["precision"] == "tf32" and row["roof_flops_per_s"] == get_hardware("h100").peak_tf32_flops


def test_fp32_tensile_gemms_are_judged_against_the_fp32_roof(tmp_path):
    # hipBLASLt's SB kernel (fp32 A/B; the MI250 trace in tests/data/hta) multiplies fp32 on the matrix
    # cores at the fp32 rate, not as TF32: it was judged against the TF32 roof.
    events = [
        _op("aten::mm", 0, 50, [[1024, 1024], [1024, 1024]], ["float", "float"]),
        _launch(9, 10, cat="cuda_runtime"),
        _kernel("Cijk_Alik_Bljk_SB_Bias_AS_SAV_UserArgs_MT64x16x32_MI16x16x1_SN_LDSB0_AFC1", 9, 100, 500),
    ]
    row = kernel_roofline(trace_work(load_trace(_kineto(tmp_path, events))), get_hardware("h100")).iloc[0]
    assert (row["basis"], row["precision"], row["category"]) == ("shapes", "fp32", "gemm")
    assert row["roof_flops_per_s"] == pytest.approx(min(67e12, row["intensity_flops_per_byte"] * 3.35e12))


def test_fp32_convolutions_keep_the_math_their_kernel_names(tmp_path):
    # A 3x3 fp32 convolution run by cuDNN's TF32 implicit GEMM and by its FP32 scudnn kernel (names from
    # HTA's AlexNet trace): the first is judged as TF32, the second as FP32, now that both are
    # convolutions rather than a GEMM and an unnamed kernel.
    dims = [[4, 16, 32, 32], [32, 16, 3, 3], [32], [], [], [], []]
    types = ["float", "float", "float", "ScalarList", "ScalarList", "ScalarList", "Scalar"]
    concrete = ["", "", "", "[1, 1]", "[1, 1]", "[1, 1]", "1"]
    tf32 = (
        "sm80_xmma_fprop_implicit_gemm_indexed_tf32f32_tf32f32_f32_nhwckrsc_nchw_tilesize128x128x16_stage4_"
        "warpsize2x2x1_g1_tensor16x8x8_alignc4_execute_kernel_cudnn"
    )
    events = [
        _op("aten::conv2d", 0, 100, dims, types, concrete),
        _launch(1, 10),
        _kernel(tf32, 1, 200, 300),
        _op("aten::conv2d", 1000, 100, dims, types, concrete),
        _launch(2, 1010),
        _kernel("cudnn_ampere_scudnn_128x64_relu_xregs_large_nn_v1", 2, 1200, 300),
    ]
    table = kernel_roofline(trace_work(load_trace(_kineto(tmp_path, events))), get_hardware("a100-80gb"))
    math_of = dict(zip(table["name"], table["precision"], strict=True))
    assert math_of == {tf32: "tf32", "cudnn_ampere_scudnn_128x64_relu_xregs_large_nn_v1": "fp32"}
    assert set(table["category"]) == {"convolution"} and set(table["basis"]) == {"shapes"}


def test_a_real_mi250_trace_is_judged_on_mi250_roofs():
    # HTA's ROCm trace names its device "AMD Radeon Graphics"; its hipBLASLt kernels say _ISA90a_ (CDNA
    # 2): one MI250 GCD (FP32 45.25 TFLOP/s, HBM 1.6 TB/s), not the H100 datasheet it was judged on.
    path = Path(__file__).parent / "data" / "hta" / "mi250_minitoy_train_ROCm6_2_kineto.json.gz"
    report = analyze_path(path)
    roofs = report.tables["roofline"].attrs["roofs"]
    assert (roofs["device"], roofs["peak_flops_per_s"], roofs["bytes_per_s"]) == (
        "MI250 GCD 64GB",
        {"fp32": 45.25e12},
        1.6e12,
    )
    assert "guessed from kernel names" in report.metrics.roofline_roofs


def test_a_copy_of_unknown_size_is_not_called_compute_bound(tmp_path):
    events = [{"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "pid": 0, "tid": 7,
               "ts": 0, "dur": 500, "args": {"correlation": 3, "bytes": 0}}]  # fmt: skip
    table = kernel_roofline(trace_work(load_trace(_kineto(tmp_path, events))), get_hardware("h100"))
    assert table["bound"].iloc[0] == "memory" and math.isnan(table["headroom_frac"].iloc[0])


def test_autocast_matmuls_are_judged_in_the_precision_they_run_in():
    # Under autocast aten::linear records its fp32 inputs; the aten::mm it calls runs in bf16, and
    # the linear is counted (and judged) as the bf16 GEMM it is.
    table = analyze_path(RUN.parent / "20261130-165253-tiny-617152").tables["roofline"]
    gemm = table[table["category"] == "gemm"]
    assert len(gemm) and (gemm["precision"] == "bf16").all()


@pytest.mark.parametrize(
    ("name", "dims", "types", "concrete", "expected"),
    [
        # A batch of 4 against one [64, 128] matrix: 2 * 4 * 64 * 128 * 32.
        ("aten::matmul", [[64, 128], [4, 128, 32]], ["float"] * 2, ["", ""], 2 * 4 * 64 * 128 * 32),
        ("aten::bmm", [[4, 64, 128], [4, 128, 32]], ["float"] * 2, ["", ""], 2 * 4 * 64 * 128 * 32),
        # No literal arguments recorded: a convolution's output size is unknown.
        ("aten::conv2d", [[1, 3, 32, 32], [8, 3, 3, 3]], ["float"] * 2, [], None),
        # 3x3, stride 1, no padding: a 30x30 output.
        ("aten::conv2d", [[1, 3, 32, 32], [8, 3, 3, 3], [], [], [], [], []], ["float"] * 2,
         ["", "", "", "[1, 1]", "[0, 0]", "[1, 1]", "1"], 2 * 30 * 30 * 8 * 27),
        # Odd arguments are not modelled rather than raised.
        ("aten::conv2d", [[1, 3, 32, 32], [8, 3, 3, 3], [], [], [], [], []], ["float"] * 2,
         ["", "", "", "[0, 0]", "[0, 0]", "[1, 1]", "1"], None),
        ("aten::conv2d", [[1, 3, 32, 32], [8, 3, 3, 3], [], [], [], [], []], ["float"] * 2,
         ["", "", "", "[1, 1]", "[]", "[1, 1]", "1"], None),
        ("aten::embedding_dense_backward", [[], [4]], ["float", "long int"], ["", "", "100"], None),
    ],
)  # fmt: skip
def test_op_work_by_hand(name, dims, types, concrete, expected):
    work = op_work(name, dims, types, concrete)
    assert (work is None) if expected is None else (work[0] == expected)


def test_the_causal_masks_fill_is_counted_by_hand():
    # Unfused attention's mask: bf16 scores [2, 8, 128, 128] (262,144 elements), a bool [128, 128]
    # mask, a scalar. One FLOP an element; bytes: the scores read (2 B each), the mask read (1 B), the
    # output written (2 B): 524,288 + 16,384 + 524,288. The in-place form moves the same.
    dims, types, concrete = [[2, 8, 128, 128], [128, 128], []], ["c10::BFloat16", "bool", "Scalar"], ["", "", "-inf"]
    for name in ("aten::masked_fill", "aten::masked_fill_"):
        assert op_work(name, dims, types, concrete) == (262_144.0, 1_064_960.0)
        assert op_category(name) == "elementwise"


@needs_traces
def test_the_cli_summary_lists_copies_by_their_bandwidth():
    from advisor.analysis.summary import format_report

    text = format_report(analyze_path(V100), "v100")
    assert "Roofline verdict: compute-bound (compute 62.4 %, memory 34.9 %, latency 1.3 % of the GPU span)" in text
    copy = next(line for line in text.splitlines() if "Memcpy DtoD" in line)
    assert "GB/s" in copy and "memory" in copy


@pytest.mark.parametrize("flash", [False, True])
def test_unfused_attentions_score_chain_is_left_out_of_compiles_reach_on_a_cpu(tmp_path, flash):
    # One step of the model's own attention layer (tiny: 8 heads, seq 128) under bf16 autocast, as the
    # profiled step runs it. Unfused, the scale, the causal mask and the softmax run on [2, 8, 128, 128]
    # scores, forward and backward: those rows are the score chain, and compiling leaves their time as
    # it is on a CPU (bench/results/cpu_fusion.md). Fused (SDPA), there is no chain.
    import torch
    from torch.profiler import ProfilerActivity, profile

    from advisor.analysis.roofline import cpu_score_chain
    from advisor.run.model import Transformer

    torch.manual_seed(0)
    model = Transformer(tiny(), flash=flash)
    tokens = torch.randint(0, tiny().vocab, (2, 128))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(tokens).float().mean()
            loss.backward()
            prof.step()
    prof.export_chrome_trace(str(tmp_path / "attn.json"))
    table = op_roofline(op_shapes(load_trace(tmp_path / "attn.json")), tiny_cpu())
    chain = cpu_score_chain(table)
    rows = table[chain]
    s = step_roofline_summary(table)
    if flash:
        assert not chain.any() and s["score_chain_frac"] == 0
        assert s["compile_fusable_frac"] == pytest.approx(s["fusable_frac"])
        return
    scores = [2, 8, 128, 128]
    assert {json.dumps(json.loads(d)[0]) for d in rows["input_dims"]} == {json.dumps(scores)}
    # The scale (mul), the causal mask (masked_fill, forward and backward: its clone and in-place fill
    # sit under it), the softmax and its backward; the probs @ v (matmul) too, which is a GEMM and not
    # fusable.
    assert set(rows["name"]) == {
        "aten::mul",
        "aten::masked_fill",
        "aten::_softmax",
        "aten::_softmax_backward_data",
        "aten::matmul",
    }
    # Every op on a [2, 8, 128, 128] input is in the chain; nothing else is (q, k, v are [2, 8, 128, 32]).
    first = [json.loads(d)[0] if d else None for d in table["input_dims"]]
    assert list(chain) == [f == scores for f in first]
    fusable = table["category"].isin(["elementwise", "reduction", "normalization"]) & (table["bound"] == "memory")
    in_chain = float(table.loc[chain & fusable.to_numpy(), "time_ms"].sum())
    assert in_chain > 0 and s["score_chain_frac"] == pytest.approx(in_chain / s["modelled_ms"])
    # No optimizer here: compiling reaches every fusable op but the chain's.
    assert s["compile_fusable_frac"] == pytest.approx(s["fusable_frac"] - s["score_chain_frac"])
    # A GPU table keeps its chain: fused kernels there stream at the memory roof.
    gpu = table.copy()
    gpu.attrs = {**table.attrs, "device": "gpu"}
    assert not cpu_score_chain(gpu).any() and math.isnan(step_roofline_summary(gpu)["score_chain_frac"])


def test_a_stored_cpu_run_is_judged_by_the_matrix_units_it_recorded(tmp_path, monkeypatch):
    # A CPU host is named by its core count; its bf16 roof is 3.5x fp32 with AVX512-BF16, 1/30 without.
    # A run records its CPU's matrix units (environment.json), and its roofline takes those, not the
    # analysing machine's: here an AMX machine (16x) analyses runs of an AVX2 and an AVX512-BF16 CPU.
    import shutil

    from advisor.spec import presets

    monkeypatch.setattr(presets, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
    monkeypatch.setattr(presets, "cpu_cores", lambda: 2)  # the samples' host: "CPU host (2 cores)"
    fp32 = 2 * 96e9
    for flags, bf16 in ((["avx2"], fp32 / 30), (["avx2", "avx512_bf16", "avx512f"], 3.5 * fp32), (None, 16 * fp32)):
        run = tmp_path / f"run-{len(flags or [])}"
        shutil.copytree(RUN.parent / "20261130-165253-tiny-617152", run)
        if flags is not None:
            (run / "environment.json").write_text(json.dumps({"cpu_matrix_flags": flags}))
        roofs = analyze_path(run).tables["roofline"].attrs["roofs"]
        assert roofs["peak_flops_per_s"]["bf16"] == pytest.approx(bf16)  # None: no record, this machine's


@needs_shared_traces
def test_kernels_that_would_beat_the_peak_lose_their_shapes():
    # HTA's trace_filter sample keeps some kernels of each op: an aten::linear's 1.6 TFLOP given to its
    # 0.3 ms of kernels read 5.4 PFLOP/s on an A100 (a user review saw points 145x above the roof).
    # Such kernels are judged by their class, and the roofs' note says how many and how far.
    rl = trace_roofline(load_trace(SHARED_TRACES / "kineto" / "trace_filter" / "sampled_rank-0.json.gz"))
    bad = rl.table.attrs["implausible"]
    assert bad["kernels"] == 25 and bad["max_ratio"] == pytest.approx(145, abs=1)
    assert "25 kernels (1.8 ms) would run up to 145x above the roofs" in rl.roofs_note
    t = rl.table
    shaped = t[t["basis"] == "shapes"]
    peak = t.attrs["roofs"]["peak_flops_per_s"]
    assert (shaped["achieved_flops_per_s"] <= 1.5 * shaped["precision"].map(peak)).all()
    # A full trace keeps every kernel: nothing is dropped there.
    full = trace_roofline(load_trace(SHARED_TRACES / "kineto" / "nccl_parser_config" / "nccl_data.json.gz"))
    assert full.table.attrs["implausible"]["kernels"] == 0
