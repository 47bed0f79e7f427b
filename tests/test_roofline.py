"""Roofline of the shipped CPU run and measured ceilings: FLOPs checked by hand and against the profiler."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from advisor.ceilings import Ceilings, load_ceilings, measure_ceilings
from advisor.errors import AdvisorError, TraceError
from advisor.presets import tiny
from advisor.roofline import op_roofline, op_work, read_op_shapes, step_roofline_summary, total_flops
from advisor.specs import HardwareSpec

RUN = Path(__file__).resolve().parent.parent / "traces" / "20261130-165248-tiny-6bcb2f"
MATMUL_OPS = ("aten::mm", "aten::linear", "aten::matmul")


@pytest.fixture(scope="module")
def ops():
    return read_op_shapes(RUN / "trace.json.gz")


@pytest.fixture(scope="module")
def hardware() -> HardwareSpec:
    return HardwareSpec(**json.loads((RUN / "request.json").read_text())["setup"]["hardware"])


@pytest.fixture(scope="module")
def roofline(ops, hardware):
    n_params = json.loads((RUN / "metrics.json").read_text())["n_params"]
    return op_roofline(ops, hardware, optimizer_params=n_params)


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
    assert s["latency_frac"] < 0.01
    assert 0.9 < s["modelled_frac"] <= 1.0
    assert s["per_step_ms"] == pytest.approx(s["modelled_ms"] / 2)


def test_measured_ceilings_override_the_spec(ops, hardware):
    c = Ceilings("test", {"fp32": 1e11}, 1e10, "", "")
    r = op_roofline(ops, hardware, c)
    assert r["roof_flops_per_s"].max() == 1e11


def test_damaged_trace_is_refused(tmp_path):
    bad = tmp_path / "trace.json.gz"
    bad.write_bytes(b"not gzip")
    with pytest.raises(TraceError, match="cannot be read"):
        read_op_shapes(bad)


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
