"""NVML sampling: a background thread that reads GPU utilisation, memory, power, clocks, temperature,
throttle reasons and PCIe/NVLink throughput while a step runs. Without a driver it reports why.

Uses the ``pynvml`` module of the ``nvidia-ml-py`` package. ``nvmlInit`` raises
``NVMLError_LibraryNotFound`` where there is no driver (every CPU machine): the sampler then stays
empty and ``unavailable_reason`` says so.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any

# nvmlClocksEventReasons bits (nvml.h: nvmlClocksEventReason*), in bit order.
THROTTLE_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
# Reasons that mean the GPU ran slower than it could while busy (idle and app settings are benign).
SLOWDOWN_MASK = 0x4 | 0x8 | 0x20 | 0x40 | 0x80

NVML_ALL_LINKS = 0xFFFFFFFF
"""scopeId that sums an NVLink field over every link (nvml.h, nvmlFieldValue_t)."""


def decode_throttle(bits: int) -> list[str]:
    """Names of the clock-event (throttle) reasons set in ``bits``."""
    return [name for bit, name in THROTTLE_REASONS.items() if bits & bit]


def _load_pynvml():
    import pynvml

    return pynvml


@dataclass
class NvmlSampler:
    """Samples one GPU every ``interval_s`` seconds on a daemon thread; use as a context manager."""

    device_index: int = 0
    """NVML's index of the GPU (PCI order, blind to CUDA_VISIBLE_DEVICES): used without ``device_uuid``."""
    interval_s: float = 0.1
    samples: list[dict[str, Any]] = field(default_factory=list)
    unavailable_reason: str | None = None
    device_name: str | None = None
    driver_version: str | None = None
    device_uuid: str | None = None
    """The GPU's UUID ("GPU-..."): names the same GPU as torch's device whatever the index orders."""

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml: Any = None
        self._handle: Any = None
        self._nvlink_prev: tuple[float, int, int] | None = None

    @property
    def available(self) -> bool:
        return self.unavailable_reason is None and self._handle is not None

    def __enter__(self) -> NvmlSampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        try:
            nvml = _load_pynvml()
            nvml.nvmlInit()
            self._handle = self._device_handle(nvml)
            self._nvml = nvml
            self.device_name = _text(nvml.nvmlDeviceGetName(self._handle))
            self.driver_version = _text(nvml.nvmlSystemGetDriverVersion())
        except Exception as err:  # NVMLError_LibraryNotFound, DriverNotLoaded, ImportError, ...
            self.unavailable_reason = f"NVML unavailable: {type(err).__name__}: {err}"
            return
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
        self._thread.start()

    def _device_handle(self, nvml: Any) -> Any:
        if self.device_uuid:
            try:
                return nvml.nvmlDeviceGetHandleByUUID(self.device_uuid)
            except Exception:  # an old driver or a UUID form it does not take: the index below
                pass
        return nvml.nvmlDeviceGetHandleByIndex(self.device_index)

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None
            self.sample()  # one last reading at the end
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
            self._nvml = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        """Take one reading now (fields that this GPU or driver does not support are left out)."""
        if self._nvml is None:
            return
        nvml, h = self._nvml, self._handle
        row: dict[str, Any] = {"t_s": time.perf_counter() - self._t0}
        readers = {
            "utilization": lambda: nvml.nvmlDeviceGetUtilizationRates(h),
            "memory": lambda: nvml.nvmlDeviceGetMemoryInfo(h),
            "power_w": lambda: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
            "sm_clock_mhz": lambda: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM),
            "temperature_c": lambda: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU),
            "throttle_bits": lambda: nvml.nvmlDeviceGetCurrentClocksThrottleReasons(h),
            "pcie_tx_bytes_per_s": lambda: nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_TX_BYTES) * 1024,
            "pcie_rx_bytes_per_s": lambda: nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_RX_BYTES) * 1024,
        }
        try:  # cumulative NVLink data counters (KiB); the rate is their difference
            ids = (nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX)
            # Summed over all links: nvml.h says these fields take the link in scopeId and UINT_MAX for the
            # sum; a bare field id leaves scopeId 0, link 0 alone (1 of an H200's 18).
            values = nvml.nvmlDeviceGetFieldValues(h, [(i, NVML_ALL_LINKS) for i in ids])
            counters = [int(v.value.ullVal) * 1024 for v in values if v.nvmlReturn == 0]
            if len(counters) == 2:
                if self._nvlink_prev is not None:
                    dt = row["t_s"] - self._nvlink_prev[0]
                    if dt > 0:
                        row["nvlink_tx_bytes_per_s"] = (counters[0] - self._nvlink_prev[1]) / dt
                        row["nvlink_rx_bytes_per_s"] = (counters[1] - self._nvlink_prev[2]) / dt
                self._nvlink_prev = (row["t_s"], counters[0], counters[1])
        except Exception:
            pass
        for key, read in readers.items():
            try:
                value = read()
            except Exception:
                continue
            if key == "utilization":
                row["gpu_util_pct"], row["mem_util_pct"] = float(value.gpu), float(value.memory)
            elif key == "memory":
                row["mem_used_bytes"] = int(value.used)
            elif key == "throttle_bits":
                row["throttle_bits"] = int(value)
                row["throttle_reasons"] = decode_throttle(int(value))
            else:
                row[key] = float(value)
        self.samples.append(row)

    def summary(self) -> dict[str, Any]:
        """Means and maxima over the samples, and the share of samples with a slowdown reason set."""
        if not self.samples:
            return {"nvml_available": False, "nvml_reason": self.unavailable_reason or "no samples"}
        out: dict[str, Any] = {"nvml_available": True, "nvml_samples": len(self.samples)}
        for key in (
            "gpu_util_pct",
            "power_w",
            "sm_clock_mhz",
            "temperature_c",
            "pcie_tx_bytes_per_s",
            "pcie_rx_bytes_per_s",
            "nvlink_tx_bytes_per_s",
            "nvlink_rx_bytes_per_s",
        ):
            vals = [s[key] for s in self.samples if key in s]
            if vals:
                out[f"{key}_mean"] = sum(vals) / len(vals)
                out[f"{key}_max"] = max(vals)
        bits = [s["throttle_bits"] for s in self.samples if "throttle_bits" in s]
        if bits:
            out["throttled_frac"] = sum(1 for b in bits if b & SLOWDOWN_MASK) / len(bits)
            seen = sorted({r for b in bits for r in decode_throttle(b & SLOWDOWN_MASK)})
            out["throttle_reasons"] = seen
        return out


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
