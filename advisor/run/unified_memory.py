"""Unified Memory for the profiled step (``--unified-memory``): its tensors in CUDA managed memory.

``csrc/um_alloc.c`` is a malloc/free pair over ``cudaMallocManaged`` with ``cudaMemAdvise`` (preferred
location and accessed-by: the GPU) and a prefetch to the GPU, compiled here with the C compiler against
the CUDA runtime that torch itself loaded (no CUDA headers needed: pip's runtime wheels lack some), and
loaded through
``torch.cuda.memory.CUDAPluggableAllocator``. The step runs inside a ``torch.cuda.MemPool`` over that
allocator, so PyTorch's caching allocator still caches blocks and only its segments are managed memory
(without the pool every tensor would be a cudaMallocManaged call). Allocations of every thread go to the
pool (``torch._C._cuda_beginAllocateToPool``, as CUDA-graph capture routes them): backward allocates on
the autograd engine's thread, which ``torch.cuda.use_mem_pool`` (the current thread only) would miss. RAPIDS RMM's managed resource is
not used: one allocator, the same on every machine, recorded in the run.

The guard. On a GPU without a coherent host link (PCIe: H100, H200, A100) managed memory that
oversubscribes the GPU migrates pages back and forth over PCIe and can hang the GPU for every process
on it, so the allocator's cap is the memory the GPU has free when the run starts (less a reserve for
CUDA's own allocations outside the pool), and a run whose estimate needs more is refused before it
starts. On GH200 / GB200 (NVLink-C2C; the GPU reads host memory through the host's page tables, which
``cudaDevAttrPageableMemoryAccessUsesHostPageTables`` reports) the cap is the free GPU memory plus a
stated host budget (``--um-host-budget-gib``).

What is measured: managed bytes at their peak, segment allocations, allocations refused by the cap,
the step beside the same step without it (``verify`` and the GPU check). NVML exposes no Unified
Memory fault counters; Nsight Systems records CPU and GPU page faults, and ``--nsys`` turns those
traces on for a Unified Memory run.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from advisor.cbuild import build_shared
from advisor.errors import AdvisorError, Refused

SOURCE = Path(__file__).with_name("csrc") / "um_alloc.c"
_POOLS: list = []
RESERVE_BYTES = 2 * 2**30
"""Left out of the cap on a PCIe GPU: the CUDA context, cuBLAS/cuDNN workspaces and NCCL buffers are
allocated outside the pool."""
COHERENT_GPUS = ("GH200", "GB200", "GB300")
NSYS_UM_FLAGS = ("--cuda-um-cpu-page-faults=true", "--cuda-um-gpu-page-faults=true")
PAGE_FAULTS_NOTE = (
    "NVML exposes no Unified Memory fault or migration counters; profile with --nsys, which records CPU and "
    "GPU page faults of a Unified Memory run (" + " ".join(NSYS_UM_FLAGS) + ")"
)


def loaded_cudart() -> Path | None:
    """The CUDA runtime library this process loaded (torch's), read from /proc/self/maps."""
    try:
        maps = Path("/proc/self/maps").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in maps.splitlines():
        m = re.search(r"(/\S*libcudart\.so[.\d]*)$", line)
        if m:
            return Path(m[1])
    return None


def cudart_major(cudart: Path) -> int | None:
    """The CUDA major of a libcudart from its soname (libcudart.so.13 -> 13), else torch's CUDA
    version; None where neither says."""
    m = re.search(r"libcudart\.so\.(\d+)", cudart.name)
    if m:
        return int(m[1])
    version = torch.version.cuda or ""
    return int(version.split(".")[0]) if version.split(".")[0].isdigit() else None


def build_allocator(*, stub: bool = False, cudart: Path | None = None, out_dir: Path | None = None) -> Path:
    """Compile ``um_alloc.c`` into a shared library (cached by source and flags); returns its path.
    ``stub`` builds the CPU-test version (malloc/free). The CUDA build needs no CUDA headers: it links
    ``cudart`` (by default the one torch loaded) and declares the entry points with that major's ABI.
    AdvisorError names what is missing."""
    flags: list[str] = []
    libs = ["-lpthread"]
    if stub:
        flags.append("-DUM_STUB")
    else:
        cudart = cudart or loaded_cudart()
        if cudart is None:
            raise AdvisorError("--unified-memory: torch has not loaded a CUDA runtime (libcudart) in this process")
        major = cudart_major(cudart)
        if major is None:
            raise AdvisorError(
                f"--unified-memory: cannot tell which CUDA release {cudart} is (no major in its name, none in "
                "torch.version.cuda)"
            )
        flags.append(f"-DUM_CUDART_MAJOR={major}")
        libs = [str(cudart), f"-Wl,-rpath,{cudart.parent}", *libs]
    stem = "um_alloc-stub" if stub else "um_alloc"
    return build_shared(SOURCE, flags, libs, stem=stem, purpose="--unified-memory", out_dir=out_dir)


class ManagedAllocator:
    """The compiled allocator's controls and counters (ctypes)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        self.lib.um_configure.argtypes = [ctypes.c_size_t, ctypes.c_int]
        self.lib.um_malloc.restype = ctypes.c_void_p
        self.lib.um_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        self.lib.um_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        for name in ("um_in_use", "um_peak"):
            getattr(self.lib, name).restype = ctypes.c_size_t
        for name in ("um_allocs", "um_refused", "um_hint_failures"):
            getattr(self.lib, name).restype = ctypes.c_ulonglong

    def configure(self, cap_bytes: int, hints: bool = True) -> None:
        self.lib.um_configure(int(cap_bytes), int(hints))

    def counters(self) -> dict[str, int]:
        return {
            "in_use_bytes": int(self.lib.um_in_use()),
            "peak_bytes": int(self.lib.um_peak()),
            "allocations": int(self.lib.um_allocs()),
            "refused_allocations": int(self.lib.um_refused()),
            "hint_failures": int(self.lib.um_hint_failures()),
        }

    def coherent(self, device: int) -> int:
        return int(self.lib.um_coherent(device))


@dataclass(frozen=True)
class UMBudget:
    """How much managed memory a run may take on this GPU, and why."""

    gpu: str
    free_bytes: int
    total_bytes: int
    coherent: bool
    host_budget_bytes: int
    cap_bytes: int
    why: str

    def as_dict(self) -> dict:
        return asdict(self)


def um_budget(gpu: str, free: int, total: int, coherent: bool, host_budget_gib: float) -> UMBudget:
    """The cap: free GPU memory less a reserve on a PCIe GPU; free memory plus ``host_budget_gib`` of
    host memory on a coherent one (GH200, GB200)."""
    if coherent:
        host = int(host_budget_gib * 2**30)
        return UMBudget(
            gpu, free, total, True, host, free + host,
            f"{gpu} reads host memory coherently (NVLink-C2C, ATS): up to the free GPU memory plus a host budget "
            f"of {host_budget_gib:g} GiB",
        )  # fmt: skip
    cap = max(0, free - RESERVE_BYTES)
    return UMBudget(
        gpu, free, total, False, 0, cap,
        f"{gpu} reaches the host over PCIe: managed memory is capped at the {free / 2**30:.1f} GiB it has free, less "
        f"{RESERVE_BYTES / 2**30:.0f} GiB for CUDA's own buffers, since oversubscribing it over PCIe can hang the GPU",
    )  # fmt: skip


def is_coherent(gpu_name: str, attribute: int) -> bool:
    """ATS / NVLink-C2C: the driver's attribute where it answered (1 or 0), else the product name."""
    if attribute in (0, 1):
        return bool(attribute)
    return any(n in gpu_name.upper() for n in COHERENT_GPUS)


def um_refusal(device: torch.device, need_bytes: float, budget: UMBudget | None) -> str | None:
    """Why a Unified Memory run of a step that needs ``need_bytes`` (the estimate) cannot start."""
    if device.type != "cuda":
        return (
            "--unified-memory puts the step's tensors in CUDA managed memory; this run is on the CPU, where host and "
            "device memory are one already. Use a CUDA device"
        )
    if budget is not None and need_bytes > budget.cap_bytes:
        where = (
            "explicit offload (--offload optimizer, --offload-activations N) moves the same bytes without page faults"
            if not budget.coherent
            else f"raise --um-host-budget-gib above {budget.host_budget_bytes / 2**30:g}"
        )
        return (
            f"--unified-memory: the step needs about {need_bytes / 2**30:.1f} GiB and the cap is "
            f"{budget.cap_bytes / 2**30:.1f} GiB. {budget.why}. Use {where}"
        )
    return None


def current_budget(device: torch.device, host_budget_gib: float, allocator: ManagedAllocator | None = None) -> UMBudget:
    """This GPU's budget now (torch.cuda.mem_get_info)."""
    free, total = torch.cuda.mem_get_info(device)
    name = torch.cuda.get_device_name(device)
    attribute = allocator.coherent(device.index or 0) if allocator is not None else -1
    return um_budget(name, free, total, is_coherent(name, attribute), host_budget_gib)


@contextmanager
def managed_memory(device: torch.device, host_budget_gib: float, need_bytes: float) -> Iterator[dict]:
    """Run the block's CUDA allocations from managed memory under the guard; yields a dict that holds
    the budget and, when the block ends, the allocator's counters. Raises Refused before allocating."""
    if device.type != "cuda":
        raise Refused(um_refusal(device, need_bytes, None))
    allocator = ManagedAllocator(build_allocator())
    budget = current_budget(device, host_budget_gib, allocator)
    if reason := um_refusal(device, need_bytes, budget):
        raise Refused(reason)
    allocator.configure(budget.cap_bytes)
    plug = torch.cuda.memory.CUDAPluggableAllocator(str(allocator.path), "um_malloc", "um_free")
    pool = torch.cuda.MemPool(plug.allocator())
    record: dict = {
        "allocator": "cudaMallocManaged segments (CUDAPluggableAllocator in a torch.cuda.MemPool), preferred "
        "location and accessed-by the GPU, prefetched",
        "library": allocator.path.name,
        "budget": budget.as_dict(),
        "page_faults": PAGE_FAULTS_NOTE,
    }
    _POOLS.append(pool)  # the step's tensors outlive the block: the pool must too (the child then exits)
    index = device.index if device.index is not None else torch.cuda.current_device()
    # Every thread's allocations: backward allocates on the autograd engine's own thread, which
    # torch.cuda.use_mem_pool (this thread only) would leave in ordinary device memory.
    begin = getattr(torch._C, "_cuda_beginAllocateToPool", None)
    record["threads"] = "all" if begin is not None else "this thread only (backward's allocations not managed)"
    if begin is not None:
        begin(index, pool.id)
        context = nullcontext()
    else:
        context = torch.cuda.use_mem_pool(pool, device=device)
    try:
        with context:
            yield record
    finally:
        if begin is not None:
            torch._C._cuda_endAllocateToPool(index, pool.id)
            torch._C._cuda_releasePool(index, pool.id)
        torch.cuda.synchronize(device)
        record |= allocator.counters()
