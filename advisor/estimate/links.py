"""A measured communication link: the bus bandwidth one distributed run's collectives reached
(``advisor.analysis.commbw`` measures it and finds it in the run store), and the
hardware with its intra-node link set to it, so that the estimator and the planner use what was measured."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from advisor.errors import AdvisorError, SpecError
from advisor.estimate.estimator import COMM_EFFICIENCY_FRAC
from advisor.spec.presets import device_key_for
from advisor.spec.specs import HardwareSpec

# On a CPU, runner.on_this_machine names each process's share of the host "<host> / N processes" (its
# FLOP/s are split, so the calibration keys it apart); the loopback link is the whole host's.
_PER_PROCESS_KEY = re.compile(r"^(cpu-.+)-\d+-processes$")


@dataclass(frozen=True)
class MeasuredLink:
    """The bus bandwidth one distributed run's collectives reached (see the module docstring)."""

    run_id: str
    device_key: str
    """``advisor.spec.presets.device_key_for`` of the run, as the calibration names its device."""
    world_size: int
    """Ranks in the run; every counted collective spanned them all."""
    bus_bytes_per_s: float
    """nccl-tests bus bandwidth, total bus bytes / total time of the counted calls."""
    n_calls: int
    """Calls counted: matched across ranks, at least MIN_CALL_BYTES, of a kind with a bus factor."""
    basis: str
    """How it was measured, in words: the calls, their sizes and time."""

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 2:
            raise SpecError("measured_link.world_size", self.world_size, "must be an integer >= 2 (a distributed run)")
        bw = self.bus_bytes_per_s
        if not (isinstance(bw, float | int) and math.isfinite(bw) and bw > 0):
            raise SpecError("measured_link.bus_bytes_per_s", self.bus_bytes_per_s, "must be a finite number > 0")
        if not isinstance(self.n_calls, int) or self.n_calls < 1:
            raise SpecError("measured_link.n_calls", self.n_calls, "must be an integer >= 1")


def same_device(link: MeasuredLink, hardware: HardwareSpec) -> bool:
    """Whether ``link`` was measured on ``hardware``'s device (on a CPU: on this host)."""
    return _host_key(link.device_key) == _host_key(_device_key_of(hardware))


def with_measured_link(hardware: HardwareSpec, link: MeasuredLink) -> HardwareSpec:
    """``hardware`` with its intra-node bandwidth set so that the estimator's collectives inside one node
    run at the measured bus bandwidth: ``_group_bw`` multiplies the link by COMM_EFFICIENCY_FRAC, so the
    link becomes bus bandwidth / COMM_EFFICIENCY_FRAC. Groups that span nodes keep the inter-node link
    (one node was measured); on hardware without one (a CPU host) every group is inside the node.
    The name is kept, so the device key and calibration still match. AdvisorError for another device."""
    if not same_device(link, hardware):
        raise AdvisorError(
            f"the measured link of run {link.run_id} is for device {link.device_key}, "
            f"not {_device_key_of(hardware)} ({hardware.name})"
        )
    return replace(hardware, intra_node_bw_bytes_per_s=link.bus_bytes_per_s / COMM_EFFICIENCY_FRAC)


def describe_link(link: MeasuredLink, hardware: HardwareSpec) -> str:
    """One sentence: the measured bus bandwidth, its run, and the datasheet figure it replaces."""
    sheet = (hardware.intra_node_bw_bytes_per_s or hardware.inter_node_bw_bytes_per_s) * COMM_EFFICIENCY_FRAC
    return (
        f"Communication inside a node runs at {link.bus_bytes_per_s / 1e9:.2f} GB/s, the bus bandwidth measured "
        f"on run {link.run_id}, instead of the datasheet link's {sheet / 1e9:.2f} GB/s: {link.basis}."
    )


def _device_key_of(hardware: HardwareSpec) -> str:
    return device_key_for(hardware)


def _host_key(key: str) -> str:
    m = _PER_PROCESS_KEY.match(key)
    return m.group(1) if m else key
