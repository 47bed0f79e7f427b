"""StepMetrics: the one record per run that the rules and the regression read; saved as metrics.json.

Every field carries its unit in its name. Fields a source cannot provide are None (a CPU run has no
NVML readings; a foreign trace has no spec). The trace analysis adds its own figures to the same
record.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class StepMetrics:
    """Measured figures of one training step (means over the profiled steps unless said otherwise)."""

    run_id: str
    source: str
    """'profile' (our own step) or 'trace' (an imported trace)."""
    device_type: str
    """'cpu' or 'cuda'."""
    device_name: str
    model_name: str
    n_params: int
    n_layers_run: int
    """Layers actually executed (fewer than the model's in proxy mode)."""
    seq_len: int
    micro_batch: int
    grad_accum: int
    precision: str
    recompute: str
    optimizer: str
    tokens_per_step: int
    steps_measured: int
    step_time_ms: float
    """Median wall time of one optimizer step (all micro-batches)."""
    step_time_min_ms: float
    step_time_max_ms: float
    profiled_step_time_ms: float
    """Median step time under the profiler (its overhead shows against step_time_ms)."""
    data_ms: float
    forward_ms: float
    backward_ms: float
    optimizer_ms: float
    other_ms: float
    """Step time not inside a data/forward/backward/optimizer range."""
    tokens_per_s: float
    model_flops_per_step: float
    """6N + 12*L*s*q per token (PaLM appendix B), no recompute."""
    hardware_flops_per_step: float
    """Executed FLOPs incl. recompute (causal flash attention at half)."""
    achieved_flops_per_s: float
    peak_flops_per_s: float
    """Datasheet peak of this device for the precision used."""
    mfu_frac: float
    hfu_frac: float
    peak_memory_bytes: int
    """Peak bytes allocated on the training device during a profiled step."""
    reserved_memory_bytes: int | None
    """CUDA caching allocator reservation at its peak (None on a CPU)."""
    memory_capacity_bytes: int
    memory_frac: float
    params_bytes: int
    optimizer_device_bytes: int
    optimizer_host_bytes: int
    estimate_step_time_ms: float
    """The analytic estimator's prediction for the same setup on this device."""
    estimate_peak_memory_bytes: float
    extrapolated: bool = False
    """Proxy mode: figures scaled from n_layers_run to the full depth (see proxy_note)."""
    proxy_note: str | None = None
    nvml: dict[str, Any] = field(default_factory=dict)
    """NVML summary: means/maxima of utilisation, power, clocks, throttle share; or why unavailable."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepMetrics:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2), encoding="utf-8")

    @classmethod
    def load(cls, path: Path) -> StepMetrics:
        return cls.from_dict(json.loads(path.read_text(encoding="utf-8")))
