"""GPU idle time under both definitions (HTA's, where a copy counts as busy, and compute-only) and over all
devices at once; which rule reads which (issue 20, defect 5)."""

import sqlite3

import numpy as np
import pytest

from advisor.advice.advise import advise
from advisor.analysis.breakdown import gpu_idle, temporal_breakdown
from advisor.analysis.summary import analyze, format_report, load_trace
from advisor.trace.table import make_table
from tests.shared import SHARED_TRACES, needs_shared_traces

US = 1000


def _copy_bound_capture():
    """One 100 us step: a 3 us compute kernel, then a 97 us host-to-device copy on another stream, as a
    capture of a job that mostly waits for its data to arrive."""
    return make_table(
        {
            "rank": 0,
            "kind": ["annotation", "runtime", "kernel", "runtime", "memcpy"],
            "name": ["ProfilerStep#1", "cudaLaunchKernel", "gemm_kernel", "cudaMemcpyAsync", "Memcpy HtoD"],
            "start_ns": np.array([0, 0, 0, 2, 3]) * US,
            "dur_ns": np.array([100, 1, 3, 1, 97]) * US,
            "device": [-1, -1, 0, -1, 0],
            "stream": [-1, -1, 7, -1, 8],
            "tid": [1, 1, -1, 1, -1],
            "correlation": [-1, 1, 1, 2, 2],
            "bytes": [0, 0, 0, 0, 97 * 2**20],
            "copy_kind": ["", "", "", "", "HtoD"],
            "host_mem": ["", "", "", "", "pinned"],
        }
    )


def test_a_capture_that_mostly_copies_is_idle_of_compute():
    row = temporal_breakdown(_copy_bound_capture()).loc[0]
    # By hand: span 0-100 us; a GPU event runs throughout (0 % idle in HTA's sense); a compute kernel
    # runs 3 us of it (97 % compute idle), the copy alone the other 97 us.
    assert row["idle_pct"] == pytest.approx(0.0)
    assert row["compute_idle_pct"] == pytest.approx(97.0)
    assert row["memory_alone_pct"] == pytest.approx(97.0)
    assert row["compute_idle_pct"] == pytest.approx(row["idle_pct"] + row["non_compute_pct"])


def test_the_rules_read_the_idle_figure_that_answers_their_question():
    report = analyze(_copy_bound_capture(), trim_last_step=False)
    m = report.metrics
    assert (m.gpu_idle_pct, m.gpu_compute_idle_pct, m.gpu_memory_alone_pct) == pytest.approx((0.0, 97.0, 97.0))
    text = format_report(report, "copies")
    assert "GPU idle: 0.0 % with copies counted busy (HTA), 97.0 % without a compute kernel" in text
    advice = advise(m)
    fired = {r.rule.id: r for r in advice.recommendations}
    # The copies are the cause: hiding them under compute is worth at most their 97 % of the 100 us step.
    copies = fired["input-exposed-copies"]
    assert (copies.gain.before, copies.gain.after) == pytest.approx((0.1, 0.1 * 0.03))
    assert copies.gain.upper_bound
    # Not launch-bound: a GPU that copies does not wait for the host to launch work.
    assert m.launch_bound is False and "launch-bound" not in fired


def test_the_low_utilisation_rule_reads_compute_idle_time():
    from advisor.advice.rules import build_context, evaluate, load_rules

    rule = next(r for r in load_rules() if r.id == "hw-low-utilisation")
    m = analyze(_copy_bound_capture(), trim_last_step=False).metrics
    ctx = build_context(m)
    ctx.update(nvml_available=True, nvml_gpu_util_mean_pct=3.0)  # NVML counts kernels, not copies
    # HTA's idle time (0 %) would keep the rule silent on a GPU whose SMs idle 97 % of the time.
    assert evaluate(rule, ctx).fired


def test_all_devices_union_and_per_device_rows():
    # One process drives two GPUs (as one nsys capture of a single-process job): device 0 runs a kernel
    # 0-30 us, device 1 a kernel 50-100 us and a copy 100-110 us. By hand: each device is busy over its
    # own span (0 % idle); no device runs anything 30-50 us: 20 of 110 us.
    table = make_table(
        {
            "rank": 0,
            "kind": ["kernel", "kernel", "memcpy"],
            "name": ["k0", "k1", "Memcpy DtoH"],
            "start_ns": np.array([0, 50, 100]) * US,
            "dur_ns": np.array([30, 50, 10]) * US,
            "device": [0, 1, 1],
            "stream": [7, 7, 8],
        }
    )
    out = gpu_idle(table)
    assert out["scope"].tolist() == ["device", "device", "all devices"]
    assert out["span_ns"].tolist() == [30 * US, 60 * US, 110 * US]
    assert out["idle_pct"].tolist() == pytest.approx([0.0, 0.0, 100 * 20 / 110])
    assert out["compute_idle_pct"].tolist() == pytest.approx([0.0, 100 * 10 / 60, 100 * 30 / 110])
    # temporal_breakdown unions the process's devices into its one rank: idle 20 of 110 us there too.
    assert temporal_breakdown(table).loc[0, "idle_pct"] == pytest.approx(100 * 20 / 110)


def test_no_gpu_events_no_idle_rows():
    table = make_table({"rank": 0, "kind": ["cpu_op"], "name": ["aten::mm"], "start_ns": [0], "dur_ns": [5]})
    assert gpu_idle(table).empty
    assert analyze(table).metrics.gpu_idle_all_devices_pct is None


def _union(intervals: list[tuple[int, int]]) -> int:
    total, end = 0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total, end = total + e - s, e
        elif e > end:
            total, end = total + e - end, e
    return total


@needs_shared_traces
def test_all_devices_idle_of_a_two_gpu_nsys_capture_by_sqlite():
    path = SHARED_TRACES / "nsys" / "nsysai_mfu_2gpu_before.sqlite"
    # Independently of our loader: every kernel, copy and set of the export, straight from SQLite.
    with sqlite3.connect(path) as db:
        events = [
            (s, e, d)
            for table in ("CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET")
            for s, e, d in db.execute(f"SELECT start, end, deviceId FROM {table}")
        ]
    span = max(e for _, e, _ in events) - min(s for s, _, _ in events)
    idle_all = 100 * (span - _union([(s, e) for s, e, _ in events])) / span
    out = analyze(load_trace(path)).tables["gpu_idle"]
    everything = out[out["scope"] == "all devices"].iloc[0]
    assert everything["span_ns"] == span == 299_877_006  # the reference's span (README: 299.877 ms)
    assert everything["idle_pct"] == pytest.approx(idle_all, abs=1e-9)
    # The reference's kernel-only union reads 4.89 % idle; counting copies and sets as busy can only
    # lower it.
    assert idle_all == pytest.approx(4.18, abs=0.01) and idle_all < 4.89
    for device in (0, 1):
        mine = [(s, e) for s, e, d in events if d == device]
        span_d = max(e for _, e in mine) - min(s for s, _ in mine)
        row = out[(out["scope"] == "device") & (out["device"] == device)].iloc[0]
        assert row["idle_pct"] == pytest.approx(100 * (span_d - _union(mine)) / span_d, abs=1e-9)


@needs_shared_traces
def test_cli_prints_one_table_in_full_and_names_the_tables_on_a_typo(capsys):
    from advisor.cli import main

    path = str(SHARED_TRACES / "nsys" / "nsysai_mfu_2gpu_before.sqlite")
    assert main(["analyze", path, "--table", "gpu_idle"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("gpu_idle: idle per device") and lines[0].endswith("(3 rows)")
    assert lines[1].split() == [
        "scope",
        "rank",
        "device",
        "span_ms",
        "idle_ms",
        "idle_pct",
        "compute_idle_ms",
        "compute_idle_pct",
    ]
    assert lines[-1].split()[:6] == ["all", "devices", "-1", "-1", "299.877", "12.536"]
    assert main(["analyze", path, "--table", "gpu_idel"]) == 2
    err = capsys.readouterr().err
    assert "--table gpu_idel: no such table; the analysis has: temporal_breakdown," in err and "gpu_idle" in err
