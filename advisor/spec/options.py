"""How a profiled step is run (``RunOptions``), apart from the step itself: torch-free, so that the
commands that only estimate, plan, analyze or advise never import torch (``advisor.run.child``, the
child's code, re-exports it)."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

from advisor.errors import AdvisorError

INJECTIONS = ("oom", "crash", "hang", "error")
_ENDPOINT_RE = re.compile(r"^[A-Za-z0-9.\-]+:[0-9]{1,5}$")
_RDZV_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


@dataclass(frozen=True)
class RunOptions:
    """How to run the profiled step (what is run is the Setup)."""

    device: str = "auto"
    """'auto' (CUDA where present), 'cpu' or 'cuda'."""
    steps: int = 3
    """Timed unprofiled steps, and as many profiled (active) steps."""
    warmup: int = 1
    """Steps the profiler traces and discards before the active ones."""
    num_workers: int = 0
    """DataLoader worker processes."""
    pin_memory: bool = False
    data_delay_ms: float = 0.0
    """Simulated loading latency per sample, in ms (reading and decoding that a real input pipeline
    pays; the synthetic tokens cost nothing). A scenario knob for the input-pipeline advice."""
    memory_budget_gib: float = 0.0
    """Treat the device as having this much memory (what-if for a smaller device: the capacity the
    estimate, the preflight and memory_frac use); 0 means the device's own."""
    compile: bool = False
    """torch.compile the model."""
    layers: int = 0
    """Proxy mode: run this many layers and extrapolate to the full depth (0: all layers)."""
    seed: int = 0
    record_shapes: bool = True
    profile_memory: bool = True
    with_stack: bool = False
    nvml_interval_s: float = 0.1
    nsys: bool = False
    """Run the child under ``nsys profile`` (needs Nsight Systems on the PATH)."""
    timeout_s: float = 600.0
    nproc: int = 1
    """Processes on this node (torchrun --nproc-per-node); more than one runs the step on
    torch.distributed (gloo on a CPU, NCCL on GPUs) with the Setup's parallel layout."""
    nnodes: int = 1
    """Nodes in the job (torchrun --nnodes); each node runs the same command."""
    rdzv_endpoint: str = ""
    """host:port of the rendezvous when nnodes > 1 (torchrun --rdzv-endpoint); every node names the same."""
    rdzv_id: str = ""
    """Job id every node's torchrun shares (--rdzv-id); required when nnodes > 1 (each node's run has
    its own run id, so it cannot stand in)."""
    inject: str = ""
    """Test hook: make the child fail on purpose (oom, crash, hang, error)."""
    unified_memory: bool = False
    """Run the step's CUDA tensors from managed memory (advisor.run.unified_memory), capped at the GPU's
    free memory on a PCIe GPU; refused on a CPU."""
    um_host_budget_gib: float = 0.0
    """With unified_memory on a coherent GPU (GH200, GB200): host memory the managed bytes may use
    beyond the GPU's free memory."""

    def __post_init__(self) -> None:
        # Each check is a plain comparison, so a value of the wrong type (text from an API call) first
        # becomes NaN, which every range refuses.
        checks = [
            (self.device in ("auto", "cpu", "cuda"), "device", "auto, cpu or cuda"),
            (_count(self.steps) and 1 <= self.steps <= 100, "steps", "an integer from 1 to 100"),
            (_count(self.warmup) and 0 <= self.warmup <= 20, "warmup", "an integer from 0 to 20"),
            (_count(self.num_workers) and 0 <= self.num_workers <= 32, "num_workers", "0 to 32"),
            (0 <= _num(self.data_delay_ms) <= 10_000, "data_delay_ms", "0 to 10000 ms per sample"),
            (0 <= _num(self.memory_budget_gib) <= 100_000, "memory_budget_gib", "0 (the device's own) to 100000 GiB"),
            (_count(self.layers) and 0 <= self.layers <= 2**16, "layers", "an integer from 0 (all layers) to 65536"),
            (0 < _num(self.timeout_s) <= 24 * 3600, "timeout_s", "a number of seconds in (0, 86400]"),
            (self.inject in ("", *INJECTIONS), "inject", "one of " + ", ".join(INJECTIONS)),
            (0.01 <= _num(self.nvml_interval_s) <= 10, "nvml_interval_s", "0.01 to 10 seconds"),
            (_count(self.nproc) and 1 <= self.nproc <= 64, "nproc", "an integer from 1 to 64"),
            (_count(self.nnodes) and 1 <= self.nnodes <= 4096, "nnodes", "an integer from 1 to 4096"),
            (self.nnodes == 1 or _ENDPOINT_RE.match(self.rdzv_endpoint), "rdzv_endpoint", "host:port when nnodes > 1"),
            (self.nnodes == 1 or self.rdzv_id, "rdzv_id", "a job id shared by every node when nnodes > 1"),
            (not self.rdzv_id or _RDZV_ID_RE.match(self.rdzv_id), "rdzv_id", "letters, digits, '.', '_', '-'"),
            (0 <= _num(self.um_host_budget_gib) <= 100_000, "um_host_budget_gib", "0 to 100000 GiB"),
            (self.unified_memory or not self.um_host_budget_gib, "um_host_budget_gib", "0 without unified_memory"),
            (not (self.unified_memory and self.world_size > 1), "unified_memory", "off for a distributed run"),
        ]
        for ok, name, allowed in checks:
            if not ok:
                raise AdvisorError(f"{name}={getattr(self, name)!r}: must be {allowed}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def world_size(self) -> int:
        """Processes in the job: nproc x nnodes."""
        return self.nproc * self.nnodes


def _num(value: object) -> float:
    """``value`` as a float where it is a real number (not a bool), else NaN (outside every range)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
