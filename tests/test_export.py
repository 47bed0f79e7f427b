"""Any trace as one Chrome trace for Perfetto (advisor.trace.export): the CLI's export-trace and the
Analyze tab's "Open in Perfetto"."""

import gzip
import json

import numpy as np
import pandas as pd
import pytest

from advisor.analysis.breakdown import temporal_breakdown
from advisor.cli import main
from advisor.trace.export import GPU_PID_BASE, write_chrome_trace
from advisor.trace.load import load_trace
from advisor.trace.table import make_table
from tests.shared import SHARED_TRACES, needs_shared_traces

US = 1000


def _two_rank_table():
    # Per rank: a runtime call launching a kernel (correlation 5 on both ranks) and a memory event.
    return make_table(
        {
            "rank": [0, 0, 0, 1, 1],
            "kind": ["runtime", "kernel", "memory", "runtime", "kernel"],
            "name": ["cudaLaunchKernel", "gemm", "[memory]", "cudaLaunchKernel", "gemm"],
            "start_ns": np.array([1_700_000_000_000_000, 1_700_000_000_000_010, 1_700_000_000_000_020, 5, 15]) + 1,
            "dur_ns": [4 * US, 30 * US, 0, 4 * US, 30 * US],
            "device": [-1, 0, 0, -1, 1],
            "stream": [-1, 7, -1, -1, 7],
            "tid": [11, -1, 11, 12, -1],
            "correlation": [5, 5, -1, 5, 5],
            "bytes": [0, 0, 4096, 0, 0],
        }
    )


def test_layout_flows_and_times(tmp_path):
    out = write_chrome_trace(_two_rank_table(), tmp_path / "t.json.gz")
    events = json.loads(gzip.decompress(out.read_bytes()))["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {
        0: "rank 0 host",
        1: "rank 1 host",
        GPU_PID_BASE: "rank 0 GPU 0",
        GPU_PID_BASE + 1001: "rank 1 GPU 1",
    }
    kernel = next(e for e in events if e.get("cat") == "kernel" and e["pid"] == GPU_PID_BASE)
    # Microseconds from the first event (5 ns on rank 1's clock): the epoch start keeps its nanoseconds.
    assert kernel["ts"] == pytest.approx((1_700_000_000_000_011 - 6) / 1000, abs=1e-3)
    assert kernel["args"] == {"correlation": 5, "device": 0, "stream": 7} and kernel["tid"] == 7
    # One launch arrow per rank, ids distinct although the correlation ids are equal.
    starts = [e for e in events if e["ph"] == "s"]
    ends = [e for e in events if e["ph"] == "f"]
    assert len(starts) == len(ends) == 2 and len({e["id"] for e in starts}) == 2
    assert {e["id"] for e in starts} == {e["id"] for e in ends} == {5, (1 << 32) + 5}
    memory = next(e for e in events if e["name"] == "[memory]")
    assert memory["ph"] == "i" and memory["args"] == {"Bytes": 4096, "Device Type": 1, "Device Id": 0}


@needs_shared_traces
@pytest.mark.parametrize(
    "trace", ["nsys/pipit_cloverleaf_cuda.sqlite", "kineto/ns_resolution_trace"], ids=["nsys", "kineto"]
)
def test_a_one_rank_export_reads_back_as_the_same_table(tmp_path, trace):
    table = load_trace(SHARED_TRACES / trace)
    back = load_trace(write_chrome_trace(table, tmp_path / "rt.json.gz"))
    assert back["kind"].value_counts().to_dict() == table["kind"].value_counts().to_dict()
    shift = int(table["start_ns"].min())
    assert (back["start_ns"] + shift).tolist() == table["start_ns"].tolist()
    for col in ("dur_ns", "device", "stream", "correlation", "bytes"):
        assert back[col].tolist() == table[col].tolist(), col
    assert back["name"].astype(str).tolist() == table["name"].astype(str).tolist()
    pd.testing.assert_frame_equal(temporal_breakdown(back), temporal_breakdown(table), check_exact=True)


@needs_shared_traces
def test_cli_export_trace_and_its_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = SHARED_TRACES / "nsys" / "nsysai_mfu_2gpu_before.sqlite"
    assert main(["export-trace", str(src)]) == 0
    assert capsys.readouterr().out.startswith(
        "wrote nsysai_mfu_2gpu_before.perfetto.json.gz (32,249 events); open it at https://ui.perfetto.dev"
    )
    events = json.loads(gzip.decompress((tmp_path / "nsysai_mfu_2gpu_before.perfetto.json.gz").read_bytes()))
    kernels = [e for e in events["traceEvents"] if e.get("cat") == "kernel"]
    assert len(kernels) == 4010  # the export's KERNEL rows (../shared/traces/README.md)
    assert main(["export-trace", str(tmp_path / "missing.sqlite")]) == 2
    assert "export-trace " in capsys.readouterr().err
    assert main(["export-trace", str(src), "-o", str(tmp_path / "no" / "dir.json")]) == 2
    assert "cannot write" in capsys.readouterr().err


@needs_shared_traces
def test_the_analyze_tabs_perfetto_file(tmp_path):
    from webui import analyze as analyze_tab

    kineto = SHARED_TRACES / "kineto" / "trace_filter" / "sampled_rank-0.json.gz"
    message, path = analyze_tab.perfetto_file(str(kineto), None)
    assert path == str(kineto) and message.startswith("Opening in a new tab of [ui.perfetto.dev]")  # as it is
    _, path = analyze_tab.perfetto_file(str(SHARED_TRACES / "nsys" / "pipit_cloverleaf_cuda.sqlite"), None)
    assert path.endswith("pipit_cloverleaf_cuda.perfetto.json.gz")
    assert len(load_trace(path)) == 5951  # every event of the export (tests/test_trace_nsys.py)
    bogus = tmp_path / "notes.txt"
    bogus.write_text("hello")
    message, path = analyze_tab.perfetto_file(str(bogus), None)
    assert path is None and message.startswith("### Cannot open this trace in Perfetto\nnotes.txt is not a trace")
    assert analyze_tab.perfetto_file(None, None) == ("Upload a trace or pick a run first.", None)
