"""The GPU check script in its CPU smoke mode (so it cannot rot), and the GPU-only checks."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from advisor.run.dryrun import DISTRIBUTED_MIN_TORCH, torch_release
from advisor.run.launcher import profile_run
from advisor.spec.options import RunOptions
from advisor.spec.setup import make_setup
from advisor.store.runstore import RunStore

ROOT = Path(__file__).resolve().parents[1]


def _script():
    """scripts/gpu_check.py as a module, loaded from its file (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_quick_mode_on_the_cpu_with_its_distributed_part(tmp_path):
    # One run of the script (each costs 25-85 s on 2 cores): the single-process rows, the ceilings, and
    # the distributed part on gloo, the same code path as the NCCL part on several GPUs (DDP, FSDP2
    # ZeRO-3, TP 2 + SP).
    cmd = [sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--quick", "--steps", "1"]
    cmd += ["--distributed", "2", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (result,) = tmp_path.glob("gpu_check_*_quick.json")
    all_rows = json.loads(result.read_text())
    single, techniques, rows = all_rows[:2], all_rows[2:6], all_rows[6:]
    assert [r["config"] for r in single] == ["tiny s128 b2 fp32 none", "tiny s128 b2 fp32 full"]
    for r in single:
        assert r["status"] == "ok"
        # On the CPU the dry run reproduces the measured peak (see bench/results/dryrun_accuracy_cpu.md).
        assert r["dry_run_peak_bytes"] == pytest.approx(r["measured_peak_bytes"], rel=0.01)
        # Each run's roofline is judged against the ceilings the check measured first.
        assert r["roofline_bound"] in ("compute", "memory", "latency") and "roofs measured" in r["roofline_roofs"]
    # The techniques' rows: offload and partial recompute run (the offloaded bytes are the estimate's
    # count for those blocks), fp8 and Unified Memory are refused on a CPU with the reason.
    offload, combined, fp8, um = techniques
    assert [r["config"] for r in techniques] == [
        "tiny s128 b2 fp32 offload 2 blocks' activations",
        "tiny s128 b2 fp32 offload 2 + recompute the rest",
        "tiny s128 b2 fp8 tensorwise (torchao)",
        "tiny s128 b2 fp32 Unified Memory",
    ]
    for r in (offload, combined):
        moved = r["activation_offload"]
        assert r["status"] == "ok" and moved["bytes_offloaded"] == pytest.approx(moved["estimate_bytes"], rel=0.01)
    assert combined["measured_peak_bytes"] < offload["measured_peak_bytes"]  # the other 2 blocks recompute
    assert fp8["status"] == "refused" and ("no fp8 units" in fp8["message"] or "torchao" in fp8["message"])
    assert um["status"] == "refused" and "CUDA managed memory" in um["message"]
    md = (tmp_path / result.name.replace(".json", ".md")).read_text()
    assert "Host-link traffic" in md and "| tiny s128 b2 fp32 offload 2 blocks' activations | 0.0" in md
    assert md.count("| ok |") == 7 and "## Ceilings of CPU host" in md and "| matmul fp32 |" in md
    # The kernel-rate table the estimator's rate model is fitted to (three small fp32 GEMMs on the CPU),
    # kept beside the results; only a GPU's goes to advisor/estimate/device_tables/.
    kernels = json.loads((tmp_path / result.name.replace(".json", "_kernels.json")).read_text())
    assert [(r["m"], r["n"], r["k"]) for r in kernels["gemm"]] == [
        (256, 256, 256),
        (1024, 1024, 256),
        (1024, 1024, 1024),
    ]
    assert all(r["precision"] == "fp32" and r["seconds"] > 0 for r in kernels["gemm"]) and kernels["attention"] == []
    assert "## Kernel rates" in md and "large-GEMM share of the peak: fp32" in md
    assert not list((ROOT / "advisor" / "device_tables").glob("cpu-host*"))
    ceilings = json.loads((tmp_path / result.name.replace(".json", "_ceilings.json")).read_text())
    assert ceilings["device_name"].startswith("CPU host") and ceilings["matmul_flops_per_s"]["fp32"] > 0
    assert [r["config"] for r in rows] == [
        "DDP x2 tiny s128 b2 fp32",
        "FSDP2 ZeRO-3 x2 tiny s128 b2 fp32",
        "TP2+SP FSDP2 x2 tiny s128 b2 fp32",
    ]
    assert all(r["status"] == "ok" and len(r["rank_peak_bytes"]) == 2 for r in rows)
    ddp, fsdp, _ = rows
    assert fsdp["measured_peak_bytes"] < ddp["measured_peak_bytes"]  # sharded states take less per rank
    if torch_release() < DISTRIBUTED_MIN_TORCH:  # the dry run refuses this torch: the row says why
        assert fsdp["dry_run_peak_bytes"] is None and "needs torch 2.13 or newer" in fsdp["dry_run_message"]
        assert "No dry run for:\n- DDP x2 tiny" in md
        return
    # Within the 8 %, or off by the root unit (tiny's embedding and final norm, fp32), whose
    # gathered buffer is alive at the measured peak or not depending on gloo's thread timing.
    off = abs(fsdp["dry_run_peak_bytes"] - fsdp["measured_peak_bytes"])
    root = 4 * (8192 * 256 + 256)
    assert min(off, abs(off - root)) <= 0.08 * fsdp["measured_peak_bytes"]


def test_rows_past_the_checks_time_budget_are_filed_as_skipped():
    gpu_check = _script()
    ran = []

    def profile(label, *args):
        ran.append((label, args))
        return {"config": label, "status": "ok"}

    # 100 s into a 120 s budget: a row is started while the time left covers the longest row so far
    # (30 s before any), so this one is not.
    late = gpu_check._Budget(120.0, gpu_check.time.perf_counter() - 100.0)
    row = late.run(profile, "llama-3.2-1b s2048 b4 fp32 full", 1, 2)
    assert ran == [] and row["config"] == "llama-3.2-1b s2048 b4 fp32 full" and row["status"] == "skipped"
    assert row["message"].startswith("skipped: 100 s of the check's 120 s budget gone, and its longest row took 30 s")
    # Early on, or with no budget (0), the row runs with its arguments.
    assert gpu_check._Budget(120.0, gpu_check.time.perf_counter()).run(profile, "a", 1, 2)["status"] == "ok"
    assert gpu_check._Budget(0.0, gpu_check.time.perf_counter() - 1e6).run(profile, "b")["status"] == "ok"
    assert ran == [("a", (1, 2)), ("b", ())]
    # The skipped row renders in the results table beside a measured one.
    md = gpu_check._markdown([row], "NVIDIA H200", 120.0)
    assert "llama-3.2-1b s2048 b4 fp32 full" in md and "skipped" in md


def test_the_distributed_part_runs_on_the_cpu_only_when_asked():
    # Without --distributed N the script's distributed row says why it did not run on the CPU.
    gpu_check = _script()

    assert gpu_check._processes("cpu", None) == (0, "skipped: on the CPU only with --distributed N")
    assert gpu_check._processes("cpu", 2) == (2, "")
    assert gpu_check._processes("cpu", 0) == (0, "skipped: --distributed 0")


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks the message of a machine with fewer than 2 GPUs")
def test_the_nccl_part_says_why_it_is_skipped_with_fewer_than_two_gpus():
    gpu_check = _script()

    n, why = gpu_check._processes("cuda", None)
    assert n == 0 and why.startswith("skipped: the NCCL part needs 2 or more GPUs and this machine has")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; the CPU path is tested above")
def test_cuda_profiled_step_has_nvml_and_allocator_peak(tmp_path):
    setup = make_setup(model="gpt2-124m", gpu="h100", seq=512, micro_batch=4, precision="bf16")
    run = profile_run(setup, RunOptions(device="cuda", steps=2), RunStore(tmp_path))
    assert run.status == "ok", run.record["message"]
    m = run.metrics()
    assert m["device_type"] == "cuda" and m["reserved_memory_bytes"] >= m["peak_memory_bytes"] > 0
    assert m["nvml"]["nvml_available"] and m["nvml"]["nvml_samples"] >= 1
    assert 0 < m["mfu_frac"] < 1
    # The roofline links each kernel to the op that launched it; our profiler records shapes, so most
    # kernel time (the GEMMs and flash attention) has FLOPs, judged against the H100/H200 roofs.
    assert m["roofline_modelled_frac"] > 0.5 and m["roofline_gemm_roof_frac"] is not None
    assert m["roofline_bound"] in ("compute", "memory", "latency")


def test_a_failed_row_carries_its_log_and_every_row_is_written_at_once(tmp_path, monkeypatch):
    # On the GPU box the check may be cut short by its time limit: each row is written (to --out and
    # to $OUT) as soon as it is done, and a failed row carries the end of its run's log.
    gpu_check = _script()

    from advisor.spec.ceilings import Ceilings

    out, extra = tmp_path / "results", tmp_path / "device-out"
    out.mkdir()
    extra.mkdir()
    monkeypatch.setenv("OUT", str(extra))
    ceilings = Ceilings("CPU host (2 cores)", {"fp32": 1e11}, 2e10, "2026-12-01T00:00:00+00:00", "test")
    report = gpu_check._Report(out, False, ceilings, "cpu", 0.0)
    setup = make_setup(model="tiny", gpu="cpu", seq=32, micro_batch=1)
    options = {"steps": 1, "warmup": 0, "timeout_s": 120, "inject": "error"}
    row = gpu_check._profile("tiny injected", setup, "cpu", 1, options, RunStore(tmp_path / "runs"), 0.0)
    assert row["status"] == "failed" and any("RuntimeError: injected error" in line for line in row["log_tail"])
    report.add(row)
    for folder in (out, extra):
        rows = json.loads((folder / "gpu_check_cpu-host-2-cores.json").read_text())
        assert [r["config"] for r in rows] == ["tiny injected"]
        assert "| tiny injected | failed: " in (folder / "gpu_check_cpu-host-2-cores.md").read_text()
