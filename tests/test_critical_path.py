"""The critical path of a step: hand-built steps whose path is known by hand, and HTA's own figures."""

import numpy as np
import pandas as pd
import pytest

from advisor.analysis.breakdown import drop_last_profiler_step, round_like_hta
from advisor.analysis.critical_path import CATEGORIES, critical_path, critical_path_summary, step_window
from advisor.analysis.summary import analyze, format_report, load_trace
from advisor.errors import AdvisorError
from advisor.trace.table import make_table
from tests.shared import SHARED_TRACES, needs_shared_traces

ALEXNET = "tests/data/hta/alexnet_benchmark_result_2869224_1695835535_trace.json.gz"
ALEXNET_RANGE = "[param|pytorch.model.alex_net|0|0|0|measure|forward]"  # HTA's own test of it, instance 1


def _table(events: list[tuple], rank: int = 0) -> pd.DataFrame:
    """Events as (kind, name, start_ns, dur_ns, tid or stream, correlation); GPU kinds and sync
    records go on device 0 at that stream, the rest on that host thread."""
    on_gpu = [e[0] in ("kernel", "memcpy", "memset", "sync") for e in events]
    return make_table(
        {
            "rank": rank,
            "kind": [e[0] for e in events],
            "name": [e[1] for e in events],
            "start_ns": [e[2] for e in events],
            "dur_ns": [e[3] for e in events],
            "device": [0 if g else -1 for g in on_gpu],
            "stream": [e[4] if g else -1 for e, g in zip(events, on_gpu, strict=True)],
            "tid": [-1 if g else e[4] for e, g in zip(events, on_gpu, strict=True)],
            "correlation": [e[5] for e in events],
        }
    )


def _segments(path: pd.DataFrame) -> list[tuple]:
    return list(zip(path["kind"].astype(str), path["name"], path["start_ns"], path["dur_ns"], strict=True))


STEP = ("annotation", "ProfilerStep#1", 0, 100, 1, -1)
GPU_BOUND = [
    STEP,
    ("cpu_op", "aten::mm", 0, 10, 1, -1),
    ("runtime", "cudaLaunchKernel", 2, 3, 1, 1),
    ("cpu_op", "aten::add", 10, 10, 1, -1),
    ("runtime", "cudaLaunchKernel", 12, 3, 1, 2),
    ("runtime", "cudaDeviceSynchronize", 20, 75, 1, 3),
    ("kernel", "gemm", 10, 40, 7, 1),
    ("kernel", "add", 52, 38, 7, 2),
]


def test_a_gpu_bound_step_runs_through_its_kernels():
    path = critical_path(_table(GPU_BOUND))
    # By hand: 2 ns of aten::mm up to the launch; the stream was empty, so gemm waits on its launch
    # (2 -> 10); add was queued behind gemm, so it follows gemm after a 2 ns gap; the device sync
    # returns 5 ns after add ends. The host alone covers 10 + 10 ns (the sync's wait weighs nothing).
    assert _segments(path) == [
        ("host", "aten::mm", 0, 2),
        ("launch", "gemm", 2, 8),
        ("compute", "gemm", 10, 40),
        ("idle", "add", 50, 2),
        ("compute", "add", 52, 38),
        ("sync", "cudaDeviceSynchronize", 90, 5),
    ]
    assert path["stream"].tolist() == [-1, 7, 7, 7, 7, 7] and path["tid"].tolist() == [1, 1, -1, -1, -1, 1]
    assert path.attrs["window"] == {
        "rank": 0,
        "step": "ProfilerStep#1",
        "start_ns": 0,
        "end_ns": 100,
        "host_traced": True,
    }
    summary = critical_path_summary(path).set_index("category")
    assert summary.index.tolist() == [*CATEGORIES, "total"]
    assert summary.loc["total", "time_ms"] == pytest.approx(95e-6)
    assert summary.loc["compute", "share_pct"] == pytest.approx(100 * 78 / 95)
    assert summary.loc["idle", "time_ms"] == pytest.approx(2e-6)
    assert summary.loc["host", "share_pct"] == pytest.approx(100 * 2 / 95)
    assert summary.loc["total", "step_pct"] == pytest.approx(95.0)
    # HTA draws sync edges only from cuda_sync records (none here): the path stops where add ends.
    assert critical_path(_table(GPU_BOUND), hta_compatible=True)["dur_ns"].sum() == 90


def test_a_host_bound_step_runs_through_ops_and_launches():
    events = [
        ("annotation", "ProfilerStep#1", 0, 70, 1, -1),
        ("cpu_op", "aten::a", 0, 30, 1, -1),
        ("runtime", "cudaLaunchKernel", 25, 3, 1, 1),
        ("cpu_op", "aten::b", 35, 30, 1, -1),
        ("runtime", "cudaLaunchKernel", 60, 3, 1, 2),
        ("kernel", "k1", 31, 2, 7, 1),
        ("kernel", "k2", 66, 2, 7, 2),
    ]
    path = critical_path(_table(events))
    # aten::a all through (its launch call inside it), the gap to aten::b jumped at no gain, aten::b
    # up to its launch, the launch delay (the stream was idle) and k2.
    assert _segments(path) == [
        ("host", "aten::a", 0, 25),
        ("host", "cudaLaunchKernel", 25, 3),
        ("host", "aten::a", 28, 2),
        ("host", "aten::b", 35, 25),
        ("launch", "k2", 60, 6),
        ("compute", "k2", 66, 2),
    ]
    summary = critical_path_summary(path).set_index("category")
    assert summary.loc["host", "time_ms"] == pytest.approx(55e-6)
    assert summary.loc["total", "step_pct"] == pytest.approx(100 * 63 / 70)


SYNC_STEP = [
    STEP,
    ("runtime", "cudaLaunchKernel", 1, 1, 1, 1),
    ("runtime", "cudaLaunchKernel", 3, 1, 1, 2),
    ("runtime", "cudaStreamSynchronize", 10, 42, 1, 3),
    ("runtime", "cudaLaunchKernel", 60, 2, 1, 4),
    ("kernel", "a", 5, 40, 7, 1),
    ("kernel", "b", 6, 44, 8, 2),
    ("kernel", "c", 64, 6, 7, 4),
]
STREAM_SYNC_RECORD = ("sync", "Stream Sync", 11, 40, 7, 3)  # Kineto cuda_sync: it waited on stream 7


def test_a_sync_makes_the_host_wait_on_the_stream_it_names():
    path = critical_path(_table([*SYNC_STEP, STREAM_SYNC_RECORD]))
    # The record says the call waited on stream 7: the host resumes 7 ns after a ends (45 -> 52), then
    # launches c. Through b (stream 8) the path would end at b's end, 48 ns long.
    assert _segments(path) == [
        ("launch", "a", 1, 4),
        ("compute", "a", 5, 40),
        ("sync", "cudaStreamSynchronize", 45, 7),
        ("launch", "c", 60, 4),
        ("compute", "c", 64, 6),
    ]
    assert path.loc[path["kind"] == "sync", "stream"].tolist() == [7]
    # Without the record the stream is unknown: the call waited for the GPU event that ended last
    # inside it, b at 50.
    path = critical_path(_table(SYNC_STEP))
    assert _segments(path) == [
        ("host", "cudaLaunchKernel", 1, 1),
        ("launch", "b", 3, 3),
        ("compute", "b", 6, 44),
        ("sync", "cudaStreamSynchronize", 50, 2),
        ("launch", "c", 60, 4),
        ("compute", "c", 64, 6),
    ]


CROSS_STREAM = [
    STEP,
    ("runtime", "cudaLaunchKernel", 0, 2, 1, 1),
    ("runtime", "cudaEventRecord", 3, 1, 1, -1),
    ("runtime", "cudaStreamWaitEvent", 5, 1, 1, 3),
    ("runtime", "cudaLaunchKernel", 7, 2, 1, 2),
    ("kernel", "producer", 10, 40, 7, 1),
    ("kernel", "consumer", 52, 8, 8, 2),
]
STREAM_WAIT_RECORD = ("sync", "Stream Wait Event", 5, 0, 8, 3)  # stream 8 waits on an event


def test_a_stream_wait_is_a_cross_stream_dependency():
    path = critical_path(_table([*CROSS_STREAM, STREAM_WAIT_RECORD]))
    # consumer (stream 8) waited for producer (stream 7), then started 2 ns after it ended.
    assert _segments(path) == [
        ("launch", "producer", 0, 10),
        ("compute", "producer", 10, 40),
        ("idle", "consumer", 50, 2),
        ("compute", "consumer", 52, 8),
    ]
    assert path["stream"].tolist() == [7, 7, 8, 8]
    assert critical_path(_table([*CROSS_STREAM, STREAM_WAIT_RECORD]), hta_compatible=True)["dur_ns"].sum() == 58
    # Without the record nothing ties the streams: consumer hangs on its launch, 45 ns after it,
    # behind 4 ns of host calls.
    path = critical_path(_table(CROSS_STREAM))
    assert path["dur_ns"].sum() == 2 + 1 + 1 + 45 + 8
    assert _segments(path)[-2:] == [("launch", "consumer", 7, 45), ("compute", "consumer", 52, 8)]


def test_the_window_is_the_longest_step_of_the_slowest_rank():
    steps = [("annotation", f"ProfilerStep#{n}", s, d, 1, -1) for n, s, d in ((1, 0, 50), (2, 50, 80), (3, 130, 60))]
    ops = [("cpu_op", "aten::x", s + 1, 5, 1, -1) for _, _, s, _, _, _ in steps]
    both = pd.concat([_table(steps + ops, rank=0), _table(steps[:1] + ops[:1], rank=1)], ignore_index=True)
    assert step_window(both) == step_window(both, rank=0) == step_window(both, rank=0, step=2)
    assert step_window(both).step == "ProfilerStep#2" and step_window(both).end_ns == 130
    assert step_window(both, step=1).rank == 0  # equal lengths: the lower rank
    with pytest.raises(AdvisorError, match="no step with rank=1, step=3"):
        critical_path(both, rank=1, step=3)
    with pytest.raises(AdvisorError, match="no host range named like 'forward'"):
        critical_path(both, annotation="forward")
    # No step marks at all: the whole trace of the rank that spans longest.
    plain = pd.concat([_table(ops, rank=0), _table(ops[:1], rank=1)], ignore_index=True)
    assert step_window(plain).step == "whole trace" and (step_window(plain).start_ns, step_window(plain).end_ns) == (
        1,
        136,
    )


def test_whole_trace_spans_read_in_blocks_equal_the_grouped_ones(monkeypatch):
    """A trace without step marks is graphed whole: each rank's first start and last end, read a block
    of rows at a time (no copy of the table); blocks of 3 rows over ranks that interleave, a rank whose
    last end is not its last start's, and ranks numbered far apart (the grouped path) agree by hand."""
    from advisor.analysis import breakdown as B

    # rank 0: starts 50, 10, 30 (durations 5, 100, 1) -> 10 .. 110; rank 2: 20 .. 45; rank 1: absent.
    events = make_table(
        {
            "rank": [0, 2, 0, 2, 0, 2, 2],
            "kind": "cpu_op",
            "name": "aten::x",
            "start_ns": [50, 20, 10, 40, 30, 25, 44],
            "dur_ns": [5, 1, 100, 5, 1, 2, 1],
        }
    )
    monkeypatch.setattr(B, "SPAN_BLOCK", 3)
    spans = B.rank_spans(events)
    assert spans.to_dict("list") == {"rank": [0, 2], "start_ns": [10, 20], "end_ns": [110, 45]}
    assert spans["rank"].dtype == events["rank"].dtype
    # One rank alone (an nsys export), and ranks over 2**16 apart (the grouped path).
    one = events[events["rank"] == 2]
    assert B.rank_spans(one).to_dict("list") == {"rank": [2], "start_ns": [20], "end_ns": [45]}
    far = events.assign(rank=np.where(events["rank"] == 2, 70_000, 0).astype(np.int32))
    assert B.rank_spans(far).to_dict("list") == {"rank": [0, 70_000], "start_ns": [10, 20], "end_ns": [110, 45]}
    # Over the rows a mask keeps (the kernel span takes the GPU events): rank 0 without its 10 .. 110.
    kept = B.rank_spans(events, events["start_ns"].to_numpy() != 10).to_dict("list")
    assert kept == {"rank": [0, 2], "start_ns": [30, 20], "end_ns": [55, 45]}
    alone = B.rank_spans(events, events["rank"].to_numpy() == 0).to_dict("list")
    assert alone == {"rank": [0], "start_ns": [10], "end_ns": [110]}
    assert B.rank_spans(far, far["rank"].to_numpy() == 70_000).to_dict("list") == {
        "rank": [70_000],
        "start_ns": [20],
        "end_ns": [45],
    }
    # sync_time's spans are these.
    assert B.sync_time(events)[["rank", "span_ns"]].to_dict("list") == {"rank": [0, 2], "span_ns": [100, 25]}


def test_bad_input_gives_empty_tables():
    empty = make_table({"rank": [], "kind": [], "name": [], "start_ns": [], "dur_ns": []})
    path = critical_path(empty)
    assert path.empty and list(path.columns) == ["rank", "step", "kind", "name", "start_ns", "dur_ns", "stream", "tid"]
    assert critical_path_summary(path).empty
    # A CPU-only step: the longest thread's ops.
    cpu = _table([STEP, ("cpu_op", "aten::mm", 0, 30, 1, -1), ("cpu_op", "aten::add", 5, 60, 2, -1)])
    assert _segments(critical_path(cpu)) == [("host", "aten::add", 5, 60)]
    # Only range events: nothing to graph.
    assert critical_path(_table([STEP])).empty


def test_analyze_reports_the_critical_path():
    report = analyze(_table(GPU_BOUND))
    assert report.tables["critical_path"]["dur_ns"].sum() == 95
    assert set(report.tables["critical_path_summary"]["category"]) == {*CATEGORIES, "total"}
    line = [s for s in format_report(report, "t").splitlines() if s.startswith("Critical path")]
    assert line == [
        "Critical path (rank 0, ProfilerStep#1): 0.0 ms, 95 % of the step: compute 82.1 %, idle 2.1 %, "
        "launch 8.4 %, sync 5.3 %, host 2.1 %"
    ]


def _by_hta_category(path: pd.DataFrame) -> dict[str, int]:
    """Path time in us in HTA's bound_by classes (memcpy and memset are gpu_compute_bound there)."""
    hta = {"compute": "gpu", "memcpy": "gpu", "memset": "gpu", "communication": "comm", "idle": "kernel_kernel"}
    hta |= {"launch": "launch", "host": "cpu"}
    per = path.groupby(path["kind"].astype(str).map(hta))["dur_ns"].sum() // 1000
    return {k: int(v) for k, v in per.items() if v}


def test_alexnet_matches_hta():
    # HTA 0.5 (pandas 2.3) on this trace, TraceAnalysis.critical_path_analysis(rank=0,
    # annotation=ALEXNET_RANGE, instance_id=1), get_critical_path_breakdown() summed by bound_by:
    # cpu_bound 32042, gpu_compute_bound 3712, kernel_kernel 50, launch 30 us; 35834 in all. The trace
    # has cuda_sync records: stream syncs, context syncs and stream waits (bench/critical_path_compare.py).
    df = load_trace(ALEXNET)
    path = critical_path(df, step=1, annotation=ALEXNET_RANGE, hta_compatible=True)
    assert _by_hta_category(path) == {"cpu": 32042, "gpu": 3712, "kernel_kernel": 50, "launch": 30}
    # Our own choices add 8 us of sync (the host's wake-up after the waits) and 1 us of stream wait.
    ours = critical_path(df, step=1, annotation=ALEXNET_RANGE)
    assert _by_hta_category(ours) == {"cpu": 32042, "gpu": 3712, "kernel_kernel": 51, "launch": 30}
    assert ours.loc[ours["kind"] == "sync", "dur_ns"].sum() == 8000


@needs_shared_traces
@pytest.mark.parametrize(
    ("folder", "rank", "step", "expected"),
    [
        # HTA 0.5 critical_path_analysis(rank, "ProfilerStep", instance_id), bound_by sums in us;
        # instance 1 of ns_resolution_trace is ProfilerStep#102, of nccl_parser_config #5.
        ("ns_resolution_trace", 0, 102, {"gpu": 93692, "kernel_kernel": 2043}),
        ("nccl_parser_config", 0, 5, {"cpu": 101398}),
        ("trace_filter", 0, 551, {"cpu": 266597, "gpu": 948, "kernel_kernel": 30, "launch": 6}),
        ("trace_filter", 1, 551, {"cpu": 255413, "gpu": 220, "kernel_kernel": 17099, "launch": 4}),
    ],
)
def test_shared_traces_match_hta(folder, rank, step, expected):
    df = round_like_hta(drop_last_profiler_step(load_trace(SHARED_TRACES / "kineto" / folder)))
    path = critical_path(df, rank=rank, step=step, hta_compatible=True)
    assert _by_hta_category(path) == expected


@needs_shared_traces
def test_a_short_path_of_an_nsys_export_says_what_it_cannot_see():
    # An nsys export has CUDA calls but no framework ops: the path jumps the host code between calls.
    # nsys-ai's "after" capture: 40.5 ms of a 299 ms window, "host 69.8 %" beside a GPU busy 76 % of
    # the time (a user review read it as a contradiction). The report now says why it is short.
    report = analyze(load_trace(SHARED_TRACES / "nsys" / "nsysai_mfu_2gpu_after.sqlite"))
    cp = report.tables["critical_path_summary"]
    total = cp[cp["category"] == "total"].iloc[0]
    assert total["time_ms"] == pytest.approx(40.5, abs=0.05) and total["step_pct"] < 50
    text = format_report(report, "after")
    assert "an Nsight Systems export traces the host only inside CUDA calls" in text
    assert f"covers {total['step_pct']:.0f} % of the window" in text
    # CloverLeaf's path covers 93 % of its window: no note. A Kineto trace never gets one.
    clover = analyze(load_trace(SHARED_TRACES / "nsys" / "pipit_cloverleaf_cuda.sqlite"))
    assert "traces the host only inside CUDA calls" not in format_report(clover, "clover")
    path = critical_path(load_trace(SHARED_TRACES / "nsys" / "nsysai_mfu_2gpu_after.sqlite"))
    assert path.attrs["window"]["host_traced"] is False
