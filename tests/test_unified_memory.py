"""Unified Memory: the managed-memory allocator, its guard, and the refusals that keep the GPU safe.

The allocator's C code runs here built with -DUM_STUB (malloc in place of cudaMallocManaged): its cap
and counters are the real code. The CUDA build is compiled where CUDA's headers are, and run where a
GPU is.
"""

import ctypes
from pathlib import Path

import pytest
import torch

from advisor.errors import AdvisorError, Refused
from advisor.run import unified_memory
from advisor.run.launcher import nsys_prefix, profile_cli_args, profile_run
from advisor.run.unified_memory import (
    RESERVE_BYTES,
    ManagedAllocator,
    build_allocator,
    cuda_include_for,
    is_coherent,
    managed_memory,
    um_budget,
    um_refusal,
)
from advisor.spec.options import RunOptions
from advisor.spec.setup import make_setup
from advisor.store.runstore import RunStore

GiB = 2**30
CUDART = next(iter(sorted(Path("/usr/local/cuda/lib64").glob("libcudart.so.*"))), None)


@pytest.fixture
def stub(tmp_path):
    return ManagedAllocator(build_allocator(stub=True, out_dir=tmp_path))


def test_the_cap_refuses_an_allocation_past_it_and_counts(stub):
    stub.configure(10 * 2**20)
    a = stub.lib.um_malloc(6 * 2**20, 0, None)
    assert a and not stub.lib.um_malloc(6 * 2**20, 0, None)  # 12 MiB > 10 MiB: refused, nothing taken
    assert stub.counters() == {
        "in_use_bytes": 6 * 2**20,
        "peak_bytes": 6 * 2**20,
        "allocations": 1,
        "refused_allocations": 1,
    }
    stub.lib.um_free(a, 6 * 2**20, 0, None)
    b = stub.lib.um_malloc(8 * 2**20, 0, None)
    assert b and stub.counters()["in_use_bytes"] == 8 * 2**20 and stub.counters()["peak_bytes"] == 8 * 2**20
    ctypes.memset(b, 1, 8 * 2**20)  # the memory is real and writable
    stub.lib.um_free(b, 8 * 2**20, 0, None)
    stub.configure(0)  # 0: no cap
    c = stub.lib.um_malloc(64 * 2**20, 0, None)
    assert c and stub.counters()["allocations"] == 3
    stub.lib.um_free(c, 64 * 2**20, 0, None)


def test_the_build_is_reused_and_rebuilt_when_its_source_changes(tmp_path, monkeypatch):
    first = build_allocator(stub=True, out_dir=tmp_path)
    built_ns = first.stat().st_mtime_ns
    # The same source and flags: the library already built, not compiled again.
    assert build_allocator(stub=True, out_dir=tmp_path) == first and first.stat().st_mtime_ns == built_ns
    assert len(list(tmp_path.glob("*.so"))) == 1
    # An edited source is another key: a second library beside the first.
    edited = tmp_path / "um_alloc.c"
    edited.write_text(unified_memory.SOURCE.read_text() + "\n/* edited */\n")
    monkeypatch.setattr(unified_memory, "SOURCE", edited)
    second = build_allocator(stub=True, out_dir=tmp_path)
    assert second != first and sorted(tmp_path.glob("*.so")) == sorted([first, second])


@pytest.mark.skipif(
    CUDART is None or cuda_include_for(CUDART) is None, reason="needs CUDA's headers and libcudart (/usr/local/cuda)"
)
def test_the_cuda_allocator_compiles_against_the_runtime(tmp_path):
    lib = build_allocator(cudart=CUDART, out_dir=tmp_path)
    assert lib.is_file() and lib.stat().st_size > 0


def test_a_pcie_gpu_is_capped_at_its_free_memory_and_a_coherent_one_may_use_the_host():
    h200 = um_budget("NVIDIA H200", free=138 * GiB, total=141 * GiB, coherent=False, host_budget_gib=100)
    assert h200.cap_bytes == 138 * GiB - RESERVE_BYTES and h200.host_budget_bytes == 0 and "PCIe" in h200.why
    gh200 = um_budget("NVIDIA GH200 480GB", free=94 * GiB, total=96 * GiB, coherent=True, host_budget_gib=200)
    assert gh200.cap_bytes == 294 * GiB and "NVLink-C2C" in gh200.why
    assert is_coherent("NVIDIA GH200 480GB", -1) and not is_coherent("NVIDIA H200", -1)
    assert not is_coherent("NVIDIA GH200 480GB", 0) and is_coherent("some future GPU", 1)  # the driver decides


def test_oversubscribing_a_pcie_gpu_is_refused_with_the_alternative():
    cuda = torch.device("cuda")
    h100 = um_budget("NVIDIA H100 80GB HBM3", free=79 * GiB, total=80 * GiB, coherent=False, host_budget_gib=0)
    reason = um_refusal(cuda, 120 * GiB, h100)
    assert "needs about 120.0 GiB" in reason and "can hang the GPU" in reason and "--offload-activations" in reason
    assert um_refusal(cuda, 60 * GiB, h100) is None
    gh200 = um_budget("NVIDIA GH200", free=94 * GiB, total=96 * GiB, coherent=True, host_budget_gib=10)
    assert "--um-host-budget-gib" in um_refusal(cuda, 120 * GiB, gh200)
    assert "on the CPU" in um_refusal(torch.device("cpu"), 0, None)


@pytest.mark.slow  # starts a child process or runs seconds of real steps
def test_unified_memory_on_the_cpu_is_a_refused_run_beside_the_others(tmp_path):
    store = RunStore(tmp_path)
    setup = make_setup(model="tiny", gpu="cpu", seq=64)
    ok = profile_run(setup, RunOptions(device="cpu", steps=1, warmup=0), store)
    refused = profile_run(setup, RunOptions(device="cpu", steps=1, warmup=0, unified_memory=True), store)
    assert ok.status == "ok" and refused.status == "refused" and "CUDA managed memory" in refused.record["message"]
    runs, damaged = store.list_runs()
    assert sorted(r.status for r in runs) == ["ok", "refused"] and damaged == []
    with pytest.raises(Refused, match="CUDA device"), managed_memory(torch.device("cpu"), 0, 0):
        pass


def test_the_options_and_commands_carry_unified_memory():
    with pytest.raises(AdvisorError, match="um_host_budget_gib"):
        RunOptions(um_host_budget_gib=8)
    with pytest.raises(AdvisorError, match="unified_memory"):
        RunOptions(unified_memory=True, nproc=2)
    opts = RunOptions(unified_memory=True, um_host_budget_gib=64)
    args = profile_cli_args(make_setup(model="tiny", gpu="cpu"), opts)
    assert "--unified-memory" in args and args[args.index("--um-host-budget-gib") + 1] == "64"
    assert "--cuda-um-gpu-page-faults=true" in nsys_prefix("x", unified_memory=True)
    assert not any("cuda-um" in a for a in nsys_prefix("x"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: managed memory within its free memory")
def test_a_step_in_managed_memory_stays_under_the_cap():
    from advisor.run.step import build_trainer, make_loader

    setup = make_setup(model="tiny", gpu="h100", seq=256, micro_batch=2, framework="pytorch")
    device = torch.device("cuda")
    with managed_memory(device, 0, 2 * GiB) as record:
        trainer = build_trainer(setup, device)
        batches = iter(make_loader(setup, 2, 0, False, 0))
        trainer.step(batches)
        trainer.step(batches)
    assert record["allocations"] > 0 and record["refused_allocations"] == 0
    assert 0 < record["peak_bytes"] <= record["budget"]["cap_bytes"]
    # Backward allocates on the autograd engine's thread: its memory must be managed too, so nearly all
    # the step's reserved memory is the allocator's segments.
    assert record["threads"] == "all" and record["peak_bytes"] >= 0.9 * torch.cuda.max_memory_reserved()
