"""NVML sampling: degrades without a driver; decodes readings and throttle reasons (fake NVML)."""

from types import SimpleNamespace

import advisor.run.nvml as nvml_mod
from advisor.run.nvml import NvmlSampler, decode_throttle


class FakeNvml:
    NVML_CLOCK_SM = 1
    NVML_TEMPERATURE_GPU = 0
    NVML_PCIE_UTIL_TX_BYTES = 0
    NVML_PCIE_UTIL_RX_BYTES = 1
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = 138
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 139

    def __init__(self):
        self.reads = 0

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, i):
        return "h0"

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H200"

    def nvmlSystemGetDriverVersion(self):
        return "570.86"

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=90, memory=40)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=70 * 2**30)

    def nvmlDeviceGetPowerUsage(self, h):
        return 650_000  # mW

    def nvmlDeviceGetClockInfo(self, h, kind):
        return 1980

    def nvmlDeviceGetTemperature(self, h, kind):
        return 61

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        self.reads += 1
        return 0x4 if self.reads % 2 else 0x1  # power cap every other reading, idle otherwise

    def nvmlDeviceGetPcieThroughput(self, h, kind):
        return 1000  # KB/s

    def nvmlDeviceGetFieldValues(self, h, ids):
        raise RuntimeError("not supported on this fake")


def test_without_a_driver_it_says_why():
    s = NvmlSampler()
    s.start()
    s.stop()
    assert not s.available and s.samples == []
    assert s.unavailable_reason.startswith("NVML unavailable: NVMLError_LibraryNotFound")
    assert s.summary()["nvml_available"] is False


def test_readings_and_throttle_reasons_are_decoded(monkeypatch):
    monkeypatch.setattr(nvml_mod, "_load_pynvml", lambda: FakeNvml())
    s = NvmlSampler(interval_s=60)  # no reading of the thread's own within the test: four, taken here
    s.start()
    for _ in range(3):
        s.sample()
    s.stop()  # joins the thread and takes a final reading
    assert s.device_name == "NVIDIA H200" and s.driver_version == "570.86"
    row = s.samples[-1]
    assert row["gpu_util_pct"] == 90 and row["power_w"] == 650 and row["sm_clock_mhz"] == 1980
    assert row["mem_used_bytes"] == 70 * 2**30 and row["pcie_tx_bytes_per_s"] == 1000 * 1024
    # The fake reports a power cap (0x4) on odd readings and idle (0x1) on even ones.
    assert [r["throttle_reasons"] for r in s.samples] == [["sw_power_cap"], ["gpu_idle"]] * 2
    summary = s.summary()
    assert summary["nvml_available"] and summary["nvml_samples"] == 4 and summary["power_w_mean"] == 650
    assert summary["throttle_reasons"] == ["sw_power_cap"]  # gpu_idle is not a slowdown
    assert summary["throttled_frac"] == 0.5  # 2 of the 4 readings


def test_decode_throttle_bits():
    assert decode_throttle(0x4 | 0x40) == ["sw_power_cap", "hw_thermal_slowdown"]
    assert decode_throttle(0) == []


class TwoGpus(FakeNvml):
    """GPU 0 in PCI order is another card; the one the process runs on has UUID GPU-b."""

    def nvmlDeviceGetHandleByIndex(self, i):
        return ["ha", "hb"][i]

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return {"GPU-a": "ha", "GPU-b": "hb"}[uuid]

    def nvmlDeviceGetName(self, h):
        return {"ha": "NVIDIA A100-SXM4-80GB", "hb": "NVIDIA H200"}[h]


def test_the_gpu_is_found_by_uuid_not_by_index(monkeypatch):
    # CUDA numbers GPUs fastest first and under CUDA_VISIBLE_DEVICES, NVML in PCI order: the UUID
    # names the GPU torch runs on; an unknown UUID falls back to the index.
    monkeypatch.setattr(nvml_mod, "_load_pynvml", lambda: TwoGpus())
    by_uuid = NvmlSampler(device_index=0, device_uuid="GPU-b")
    by_uuid.start()
    by_uuid.stop()
    assert by_uuid.device_name == "NVIDIA H200"
    unknown = NvmlSampler(device_index=0, device_uuid="GPU-z")
    unknown.start()
    unknown.stop()
    assert unknown.device_name == "NVIDIA A100-SXM4-80GB"


class Nvlink(FakeNvml):
    """NVLink data counters (KiB) that grow by 1,000 (sent) and 3,000 (received) between readings, for
    the sum over links only: a field asked for link 0 (scopeId 0) would read a share of it."""

    def __init__(self):
        super().__init__()
        self.asked, self.n = [], 0

    def nvmlDeviceGetFieldValues(self, h, ids):
        self.asked.append(list(ids))
        self.n += 1
        kib = {138: 1000 * self.n, 139: 3000 * self.n}
        return [SimpleNamespace(nvmlReturn=0, value=SimpleNamespace(ullVal=kib[f])) for f, _ in ids]


def test_nvlink_rates_are_summed_over_every_link(monkeypatch):
    fake = Nvlink()
    monkeypatch.setattr(nvml_mod, "_load_pynvml", lambda: fake)
    s = NvmlSampler(interval_s=60)
    s.start()
    s.sample()
    s.stop()
    # Each reading asks for both fields summed over all links (scopeId UINT_MAX, nvml.h).
    assert fake.asked and all(a == [(138, 0xFFFFFFFF), (139, 0xFFFFFFFF)] for a in fake.asked)
    first, second = s.samples[-2:]
    dt = second["t_s"] - first["t_s"]
    assert second["nvlink_tx_bytes_per_s"] == 1000 * 1024 / dt
    assert second["nvlink_rx_bytes_per_s"] == 3000 * 1024 / dt
