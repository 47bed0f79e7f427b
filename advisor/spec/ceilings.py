"""Measured machine ceilings as data: the matmul FLOP/s and copy bandwidth one device reached
(``advisor.run.ceilings`` measures them, ``advisor.store.ceilings`` keeps them in the run store), and
their loading with every value checked. Pure, no torch."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from advisor.errors import AdvisorError

CEILINGS_DIR = "ceilings"
"""The run store's folder of measured ceilings (a reserved name: ``advisor.store.runstore.RESERVED_DIRS``)."""
_DTYPES = ("fp32", "bf16", "fp16")
_KEYS = ("device_name", "matmul_flops_per_s", "copy_bytes_per_s", "measured_utc", "method")


@dataclass(frozen=True, slots=True)
class Ceilings:
    """What one device reached in the benchmark; all rates are per device."""

    device_name: str
    matmul_flops_per_s: dict[str, float] = field(default_factory=dict)
    """Best square-matmul FLOP/s per precision ('fp32', 'bf16', 'fp16'); a precision the device
    lacks (or runs through a slow fallback that was not measured) is absent."""
    copy_bytes_per_s: float = 0.0
    """Best ``tensor.copy_`` rate of a large buffer, read plus write bytes per second."""
    measured_utc: str = ""
    """ISO 8601 time of the measurement."""
    method: str = ""
    """How the numbers were taken: sizes, repeats, timer."""

    def __post_init__(self) -> None:
        _check_ceilings(
            {
                "device_name": self.device_name,
                "matmul_flops_per_s": self.matmul_flops_per_s,
                "copy_bytes_per_s": self.copy_bytes_per_s,
                "measured_utc": self.measured_utc,
                "method": self.method,
            },
            "Ceilings",
        )

    def to_dict(self) -> dict:
        return {
            "device_name": self.device_name,
            "matmul_flops_per_s": dict(self.matmul_flops_per_s),
            "copy_bytes_per_s": self.copy_bytes_per_s,
            "measured_utc": self.measured_utc,
            "method": self.method,
        }

    def save(self, path: str | Path) -> Path:
        """Write the ceilings as JSON to ``path``; returns the path."""
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1), encoding="utf-8")
        return path


def _finite_positive(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _check_ceilings(d: object, where: str) -> None:
    if not isinstance(d, dict):
        raise AdvisorError(f"{where}: expected a JSON object, got {type(d).__name__}")
    missing = [k for k in _KEYS if k not in d]
    if missing:
        raise AdvisorError(f"{where}: missing keys {missing} (expected {list(_KEYS)})")
    if not isinstance(d["device_name"], str) or not d["device_name"]:
        raise AdvisorError(f"{where}: device_name={d['device_name']!r} must be a non-empty string")
    mm = d["matmul_flops_per_s"]
    if not isinstance(mm, dict) or not mm:
        raise AdvisorError(f"{where}: matmul_flops_per_s={mm!r} must map at least one of {_DTYPES} to FLOP/s")
    for k, v in mm.items():
        if k not in _DTYPES:
            raise AdvisorError(f"{where}: matmul_flops_per_s has precision {k!r}; allowed: {_DTYPES}")
        if not _finite_positive(v):
            raise AdvisorError(f"{where}: matmul_flops_per_s[{k!r}]={v!r} must be a finite number > 0")
    if not _finite_positive(d["copy_bytes_per_s"]):
        raise AdvisorError(f"{where}: copy_bytes_per_s={d['copy_bytes_per_s']!r} must be a finite number > 0")
    for k in ("measured_utc", "method"):
        if not isinstance(d[k], str):
            raise AdvisorError(f"{where}: {k}={d[k]!r} must be a string")


def load_ceilings(path: str | Path) -> Ceilings:
    """Ceilings from a JSON file written by ``Ceilings.save``; raises AdvisorError naming the file
    and the bad key when the file is unreadable, not JSON, lacks a key or holds a rate that is not a
    finite number > 0."""
    path = Path(path)
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise AdvisorError(f"ceilings file {path.name} cannot be read ({err})") from None
    except json.JSONDecodeError as err:
        raise AdvisorError(f"ceilings file {path.name} is not valid JSON ({err})") from None
    _check_ceilings(d, f"ceilings file {path.name}")
    return Ceilings(
        device_name=d["device_name"],
        matmul_flops_per_s={k: float(v) for k, v in d["matmul_flops_per_s"].items()},
        copy_bytes_per_s=float(d["copy_bytes_per_s"]),
        measured_utc=d["measured_utc"],
        method=d["method"],
    )
