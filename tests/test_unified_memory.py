"""Unified Memory: the managed-memory allocator, its guard, and the refusals that keep the GPU safe.

The allocator's C code runs here built with -DUM_STUB (malloc in place of cudaMallocManaged): its cap
and counters are the real code. The CUDA build is compiled where CUDA's headers are, and run where a
GPU is.
"""

import ctypes

import pytest
import torch

from advisor.errors import AdvisorError, Refused
from advisor.run import unified_memory
from advisor.run.launcher import nsys_prefix, profile_cli_args, profile_run
from advisor.run.unified_memory import (
    RESERVE_BYTES,
    ManagedAllocator,
    build_allocator,
    is_coherent,
    managed_memory,
    um_budget,
    um_refusal,
)
from advisor.spec.options import RunOptions
from advisor.spec.setup import make_setup
from advisor.store.runstore import RunStore

GiB = 2**30


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
        "hint_failures": 0,
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


# A stand-in libcudart of each major: each entry point the allocator calls records its arguments, with
# the signatures of cuda_runtime_api.h 12.9 (an int device) and 13.0 (a struct cudaMemLocation by value).
FAKE_CUDART = r"""
#include <stdlib.h>
#include <stddef.h>
struct loc { int type; int id; };
long rec[32];
int n_advise = 0, fail_prefetch = 0, last_error_reads = 0;
int cudaMallocManaged(void **p, size_t n, unsigned int flags) { rec[0] = flags; *p = malloc(n); return *p ? 0 : 2; }
int cudaFree(void *p) { free(p); return 0; }
int cudaGetLastError(void) { last_error_reads++; return 0; }
int cudaDeviceGetAttribute(int *v, int attr, int device) { rec[1] = attr; rec[2] = device; *v = 1; return 0; }
#if MAJOR >= 13
int cudaMemAdvise(const void *p, size_t n, int advice, struct loc l) {
    long *r = rec + 4 + 3 * n_advise++; r[0] = advice; r[1] = l.type; r[2] = l.id; return 0; }
int cudaMemPrefetchAsync(const void *p, size_t n, struct loc l, unsigned int flags, void *s) {
    rec[10] = l.type; rec[11] = l.id; rec[12] = flags; rec[13] = (long)s; return fail_prefetch; }
#else
int cudaMemAdvise(const void *p, size_t n, int advice, int device) {
    long *r = rec + 4 + 3 * n_advise++; r[0] = advice; r[1] = -1; r[2] = device; return 0; }
int cudaMemPrefetchAsync(const void *p, size_t n, int device, void *s) {
    rec[10] = -1; rec[11] = device; rec[12] = -1; rec[13] = (long)s; return fail_prefetch; }
#endif
"""


@pytest.mark.parametrize("major", [12, 13])
def test_the_cuda_allocator_builds_without_cuda_headers_and_calls_each_majors_abi(tmp_path, major):
    # The GPU image's runtime (pip's nvidia-cuda-runtime, beside torch) ships cuda_runtime_api.h without
    # the crt/ headers it includes: a build against it failed. The CUDA build now needs no header; this
    # links it against a stand-in libcudart.so.<major> and checks every call's arguments.
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler (cc or gcc)")
    src, fake = tmp_path / "fake.c", tmp_path / f"libcudart.so.{major}"
    src.write_text(FAKE_CUDART)
    subprocess.run([cc, "-shared", "-fPIC", f"-DMAJOR={major}", f"-Wl,-soname,{fake.name}", str(src), "-o", str(fake)],
                   check=True)  # fmt: skip
    allocator = ManagedAllocator(build_allocator(cudart=fake, out_dir=tmp_path))
    cuda = ctypes.CDLL(str(fake))
    rec = (ctypes.c_long * 32).in_dll(cuda, "rec")
    p = allocator.lib.um_malloc(2**20, 3, 0x1234)
    assert p and rec[0] == 1  # cudaMemAttachGlobal
    loc_type = 1 if major >= 13 else -1  # cudaMemLocationTypeDevice, or no location (an int device)
    # SetPreferredLocation (3), then SetAccessedBy (5), both for device 3; the prefetch to it on the stream.
    assert list(rec[4:10]) == [3, loc_type, 3, 5, loc_type, 3]
    assert list(rec[10:14]) == [loc_type, 3, 0 if major >= 13 else -1, 0x1234]
    assert allocator.counters()["hint_failures"] == 0 and ctypes.c_int.in_dll(cuda, "last_error_reads").value == 0
    # A failed prefetch (no concurrent managed access): counted, its error read off so the next kernel
    # launch's check does not raise it; the memory is still handed out.
    ctypes.c_int.in_dll(cuda, "fail_prefetch").value = 1
    q = allocator.lib.um_malloc(2**20, 3, 0x1234)
    assert q and allocator.counters()["hint_failures"] == 1 and allocator.counters()["allocations"] == 2
    assert ctypes.c_int.in_dll(cuda, "last_error_reads").value == 1
    # Coherence: cudaDevAttrPageableMemoryAccessUsesHostPageTables (100) of the device asked.
    assert allocator.coherent(5) == 1 and (rec[1], rec[2]) == (100, 5)
    allocator.lib.um_free(p, 2**20, 3, None)
    allocator.lib.um_free(q, 2**20, 3, None)
    assert allocator.counters()["in_use_bytes"] == 0


def test_a_runtime_of_unknown_major_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(AdvisorError, match=r"cannot tell which CUDA release .*libcudart\.so is"):
        build_allocator(cudart=tmp_path / "libcudart.so", out_dir=tmp_path)


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
