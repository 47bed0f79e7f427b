"""The measured links in the run store: the bus bandwidth of the newest distributed run on a device,
for the planner and the estimate (``advisor.estimate.links``). The measurement itself is the pure
``advisor.analysis.commbw.run_link``; this module finds the runs and loads their traces."""

from __future__ import annotations

from pathlib import Path

from advisor.analysis.commbw import run_device_key, run_link
from advisor.analysis.summary import load_trace
from advisor.errors import AdvisorError, TraceError
from advisor.estimate.links import MeasuredLink, _device_key_of, _host_key
from advisor.spec.specs import HardwareSpec
from advisor.store.runstore import RunStore, read_run


def measured_bus_bandwidth(run_dir: str | Path) -> MeasuredLink | None:
    """``run_link`` of the run directory ``run_dir`` (None where it is not a finished distributed run
    with sized collectives; see there). Raises TraceError for a damaged trace."""
    d = Path(run_dir)
    record, metrics = read_run(d)
    if record is None or metrics is None or record.get("status") != "ok":
        return None
    if int(metrics.get("world_size") or 1) < 2:
        return None
    return run_link(load_trace(d), record, metrics, d.name)


def link_for(store: RunStore, hardware: HardwareSpec) -> MeasuredLink | None:
    """The measured link of the newest distributed run in ``store`` on ``hardware``'s device (same
    device key; on a CPU, any process count on this host); None when there is none. Runs that cannot be
    measured (see :func:`measured_bus_bandwidth`) or whose trace is damaged are passed over."""
    want = _host_key(_device_key_of(hardware))
    runs, _damaged = store.list_runs()
    for run in runs:  # newest first
        if run.status != "ok":
            continue
        try:
            metrics = run.metrics()
        except AdvisorError:  # damaged since it was listed: an older run may still measure the link
            continue
        if not metrics or int(metrics.get("world_size") or 1) < 2:
            continue
        if _host_key(run_device_key(run.record, metrics)) != want:
            continue
        try:
            link = measured_bus_bandwidth(run.path)
        except TraceError:  # a damaged trace: an older run may still measure the link
            continue
        if link is not None:
            return link
    return None
