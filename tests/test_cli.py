"""The command line: readable output, --json, clear errors with exit status 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from advisor.cli import main

DATA = Path(__file__).parent / "data" / "hf"


def test_size_prints_a_readable_breakdown(capsys):
    code = main(
        ["size", "--model", "llama-3.1-8b", "--gpu", "h200", "--gpus", "8", "--tp", "2", "--zero", "1", "--seq", "8192"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "llama-3.1-8b (8.03B params) on 8 x H200 141GB; dp4 tp2" in out
    assert out.count("FITS") == 1 and "GiB per GPU" in out
    for row in ("weights", "gradients", "optimizer states", "activations", "TP communication", "Throughput:", "MFU"):
        assert row in out


def test_size_json_is_machine_readable(capsys):
    code = main(["size", "--model", "gpt2-124m", "--gpu", "a100-80gb", "--seq", "1024", "--micro-batch", "8", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["n_params"] == 124_439_808
    assert data["setup"]["train"]["micro_batch"] == 8
    assert data["fits"] is True
    parts = ("weights_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "buffers_bytes", "overhead_bytes")
    assert sum(data["memory"][k] for k in parts) == pytest.approx(data["memory"]["total_bytes"])
    assert data["tokens_per_s"] == pytest.approx(8 * 1024 / (data["step_time_ms"] / 1e3))


def test_hf_config_flag(capsys):
    assert main(["size", "--hf-config", str(DATA / "qwen2-0.5b.json"), "--gpu", "l40s", "--seq", "2048", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["n_params"] == 494_032_768 and data["setup"]["model"]["name"] == "qwen2-0.5b"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tp", "3"], "error: parallel.tp=3: model.n_heads=32 must be divisible by tp"),
        (["--gpus", "8", "--dp", "2", "--tp", "2"], "error: gpus=8: dp(2) * tp(2) * pp(1) * cp(1) = 4 != gpus(8)"),
        (["--model", "gpt-9"], "error: model='gpt-9': unknown preset"),
        (["--hf-config", "/nonexistent/config.json"], "error: cannot read config file config.json"),
        (["--precision", "fp8", "--gpu", "a100"], "error: train.precision='fp8': A100 SXM 80GB has no fp8"),
    ],
)
def test_bad_input_exits_2_with_the_reason(argv, message, capsys):
    assert main(["size", *argv]) == 2
    assert message in capsys.readouterr().err


def test_presets_lists_models_and_devices(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "llama-4-maverick" in out and "400,711,848,960" in out and "GH200 96GB" in out


def test_module_entry_point_runs():
    cmd = [sys.executable, "-m", "advisor", "size", "--model", "tiny", "--gpu", "cpu", "--seq", "256", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["n_params"] == 4_999_424


def test_profile_prints_the_run_id_and_directory(tmp_path, capsys):
    argv = ["profile", "--model", "tiny", "--device", "cpu", "--seq", "64", "--micro-batch", "1"]
    code = main([*argv, "--steps", "1", "--warmup", "0", "--traces", str(tmp_path), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["status"] == "ok"
    assert Path(out["run_dir"]) == tmp_path / out["run_id"]
    assert out["metrics"]["tokens_per_step"] == 64
    assert main(["runs", "--traces", str(tmp_path)]) == 0
    assert out["run_id"] in capsys.readouterr().out


def test_profile_bad_input_and_failed_runs(tmp_path, capsys):
    assert main(["profile", "--model", "tiny", "--device", "cpu", "--steps", "0", "--traces", str(tmp_path)]) == 2
    assert "steps=0: must be an integer from 1 to 100" in capsys.readouterr().err
    argv = ["profile", "--model", "tiny", "--device", "cpu", "--seq", "64", "--steps", "1", "--warmup", "0"]
    assert main([*argv, "--traces", str(tmp_path), "--inject", "oom"]) == 1
    assert "oom - out of memory: injected" in capsys.readouterr().out


RUN = Path(__file__).resolve().parent.parent / "traces" / "20261130-165248-tiny-6bcb2f"


def test_ceilings_measure_store_show_and_feed_analyze(tmp_path, capsys):
    argv = ["ceilings", "--device", "cpu", "--dtypes", "fp32", "--matmul-n", "256", "--copy-mib", "16"]
    assert main([*argv, "--repeats", "1", "--traces", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "matmul fp32:" in out and "% of the datasheet's" in out and "stored in" in out
    assert main(["ceilings", "--show", "--json", "--traces", str(tmp_path)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["device_name"].startswith("CPU host") and shown["matmul_flops_per_s"]["fp32"] > 0
    stored = next((tmp_path / "ceilings").glob("*.json"))
    assert main(["analyze", str(RUN), "--ceilings-file", str(stored)]) == 0
    out = capsys.readouterr().out
    assert "Roofline verdict: compute-bound" in out and f"roofs measured {shown['measured_utc']}" in out


def test_ceilings_errors_are_clear(tmp_path, capsys):
    assert main(["ceilings", "--show", "--device", "cpu", "--traces", str(tmp_path)]) == 2
    assert "no ceilings stored for CPU host" in capsys.readouterr().err
    assert main(["ceilings", "--device", "cpu", "--repeats", "0", "--traces", str(tmp_path)]) == 2
    assert "--repeats=0: must be >= 1" in capsys.readouterr().err
    assert main(["analyze", str(RUN), "--ceilings-file", str(tmp_path / "none.json")]) == 2
    assert "ceilings file none.json cannot be read" in capsys.readouterr().err


def test_analyze_prints_the_roofline_against_a_chosen_gpu(capsys):
    assert main(["analyze", str(RUN), "--ceilings"]) == 0
    captured = capsys.readouterr()
    assert "Roofline verdict: compute-bound (compute 72.5 %, memory 17.9 %, latency 0.6 % of the step)" in captured.out
    assert "datasheet roofs used" in captured.err or "roofs measured" in captured.out


def test_help_lists_the_user_commands_only(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "{size,profile,dryrun,analyze,ceilings,runs,compare,presets,plan,calibrate,advise,rules,verify}" in out
    # The profiling child's command works but is not offered (no "_child", no "==SUPPRESS==" line).
    assert "_child" not in out and "SUPPRESS" not in out
    with pytest.raises(SystemExit) as exit_:
        main(["_child"])
    assert exit_.value.code == 2 and "--run-dir" in capsys.readouterr().err
