"""The GPU check script in its CPU smoke mode (so it cannot rot), and the GPU-only checks."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from advisor.profiling import RunOptions
from advisor.runner import profile_run
from advisor.runstore import RunStore
from advisor.sizing import make_setup

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_quick_mode_on_the_cpu(tmp_path):
    cmd = [sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--quick", "--steps", "1", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (result,) = tmp_path.glob("gpu_check_*_quick.json")
    rows = json.loads(result.read_text())
    assert [r["config"] for r in rows] == ["tiny s128 b2 fp32 none", "tiny s128 b2 fp32 full"]
    for r in rows:
        assert r["status"] == "ok"
        # On the CPU the dry run reproduces the measured peak (see bench/results/dryrun_accuracy_cpu.md).
        assert r["dry_run_peak_bytes"] == pytest.approx(r["measured_peak_bytes"], rel=0.01)
    assert (tmp_path / result.name.replace(".json", ".md")).read_text().count("| ok |") == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; the CPU path is tested above")
def test_cuda_profiled_step_has_nvml_and_allocator_peak(tmp_path):
    setup = make_setup(model="gpt2-124m", gpu="h100", seq=512, micro_batch=4, precision="bf16")
    run = profile_run(setup, RunOptions(device="cuda", steps=2), RunStore(tmp_path))
    assert run.status == "ok", run.record["message"]
    m = run.metrics()
    assert m["device_type"] == "cuda" and m["reserved_memory_bytes"] >= m["peak_memory_bytes"] > 0
    assert m["nvml"]["nvml_available"] and m["nvml"]["nvml_samples"] >= 1
    assert 0 < m["mfu_frac"] < 1
