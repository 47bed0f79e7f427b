"""The rate model's device constants fitted to a measured kernel table (advisor.estimate.efficiency), and the
estimator using them for that device only."""

from __future__ import annotations

import json
import math

import pytest

from advisor.estimate import efficiency
from advisor.estimate.efficiency import attention_frac, device_table_path, fit_device_table, gemm_efficiency
from advisor.estimate.estimator import estimate
from advisor.spec.presets import get_hardware
from advisor.spec.setup import make_setup

H100 = get_hardware("h100")
PEAKS = {"bf16": H100.peak_bf16_flops, "fp8": H100.peak_fp8_flops}
SHAPES = [(m, n, k) for m in (2048, 8192, 32768) for n, k in ((6144, 4096), (8192, 1024), (4096, 14336))]


def _table(bf16: float, fp8: float, k_half: float, curve: tuple[float, float, float, float]) -> dict:
    """A kernel table a device following the model exactly would measure."""
    gemm = []
    for precision, frac in (("bf16", bf16), ("fp8", fp8)):
        for m, n, k in SHAPES:
            eff = gemm_efficiency(m, n, k, frac, H100.sm_count, k_half)
            gemm.append(
                {"precision": precision, "m": m, "n": n, "k": k, "seconds": 2 * m * n * k / (PEAKS[precision] * eff)}
            )
    attention = []
    for seq in (1024, 2048, 4096, 8192, 16384):
        fwd, bwd = attention_frac("cudnn", seq, 128, curve)
        flops = 2.0 * (16384 // seq) * 32 * seq * seq * 128
        peak = H100.peak_bf16_flops
        attention.append(
            {"impl": "cudnn", "seq": seq, "head_dim": 128, "fwd_flops": flops,
             "fwd_seconds": flops / (fwd * peak), "bwd_seconds": 2 * flops / (bwd * peak)}
        )  # fmt: skip
    return {"device_name": H100.name, "measured_utc": "2026-12-02T00:00:00+00:00", "gemm": gemm, "attention": attention}


def test_the_fit_recovers_the_constants_of_a_device_that_follows_the_model():
    curve = (0.62, 350.0, 0.45, 500.0)
    fit = fit_device_table(_table(0.74, 0.58, 180.0, curve), PEAKS, H100.sm_count)
    assert fit.large_frac == pytest.approx({"bf16": 0.74, "fp8": 0.58}, rel=1e-3)
    assert fit.k_half == pytest.approx(180.0, rel=1e-2) and fit.gemm_error_pct < 0.1
    assert fit.attention["cudnn"] == pytest.approx(curve, rel=1e-2)


def test_a_measured_table_replaces_the_datasheet_rates_for_its_device_only(tmp_path, monkeypatch):
    llama = {"model": "llama-3.1-8b", "gpus": 8, "seq": 8192, "global_batch": 16, "zero": 1}
    before = estimate(make_setup(gpu="h100", **llama))
    other = estimate(make_setup(gpu="h200", **llama))
    # This H100 reaches only 60 % of its bf16 peak on large GEMMs (the datasheet-and-prior model: 80 %).
    table = _table(0.60, 0.50, 256.0, (0.45, 400.0, 0.35, 420.0))
    monkeypatch.setattr(efficiency, "DEVICE_TABLES_DIR", tmp_path)
    device_table_path(H100.name, tmp_path).write_text(json.dumps(table))
    efficiency.device_fit.cache_clear()
    from advisor.estimate import steptime

    steptime._rates.cache_clear()
    try:
        after = estimate(make_setup(gpu="h100", **llama))
        assert after.gemm_frac == pytest.approx(before.gemm_frac * 0.60 / 0.80, rel=0.02)
        assert after.attention_frac < before.attention_frac and after.step_time_ms > before.step_time_ms
        # The H200 keeps its own (datasheet) rates: the table names another device.
        assert estimate(make_setup(gpu="h200", **llama)).step_time_ms == pytest.approx(other.step_time_ms)
        # A damaged table is ignored, with a message, and the datasheet rates stand.
        device_table_path(H100.name, tmp_path).write_text("{not json")
        efficiency.device_fit.cache_clear()
        steptime._rates.cache_clear()
        assert estimate(make_setup(gpu="h100", **llama)).step_time_ms == pytest.approx(before.step_time_ms)
    finally:
        efficiency.device_fit.cache_clear()
        steptime._rates.cache_clear()


def test_no_table_ships_for_a_device_that_was_not_measured():
    # Every committed table is a real GPU check's (scripts/gpu_check.sh): none on this CPU-only project
    # yet, and never a CPU's.
    tables = sorted(p.name for p in efficiency.DEVICE_TABLES_DIR.glob("*.json"))
    for name in tables:
        data = json.loads((efficiency.DEVICE_TABLES_DIR / name).read_text())
        assert data["gemm"] and not data["device_name"].startswith("CPU")
        assert all(math.isfinite(r["seconds"]) and r["seconds"] > 0 for r in data["gemm"])
