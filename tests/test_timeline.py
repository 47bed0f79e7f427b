"""The step timeline on real traces: which step, its phases, the top kernels or ops, hand-checked totals."""

import gzip
import json
from collections import defaultdict
from decimal import Decimal
from pathlib import Path

import pytest

from advisor.analysis.summary import load_trace
from advisor.analysis.timeline import MAX_NAME_CHARS, WHOLE_TRACE, step_timeline
from advisor.errors import AdvisorError
from advisor.present.charts import timeline_figure
from tests.shared import SHARED_TRACES, needs_shared_traces

ROOT = Path(__file__).resolve().parents[1]
TRACES = SHARED_TRACES
needs_traces = needs_shared_traces
SAMPLE_RUN = ROOT / "traces" / "20261130-165248-tiny-6bcb2f"
GPU_BOUND = TRACES / "kineto" / "ns_resolution_trace"


def _events(path: Path) -> list[dict]:
    """The raw events of a Kineto file, times as exact decimals: as floats, epoch microseconds with
    nanosecond fractions (1.7e15) round to 0.25 us, which shifts clipped totals by about a microsecond."""
    with gzip.open(path) as f:
        return json.load(f, parse_float=Decimal)["traceEvents"]


def _totals_in(events: list[dict], t0: Decimal, t1: Decimal) -> dict[str, Decimal]:
    """Time (us) per name of ``events`` inside [t0, t1), each event cut to the window."""
    totals: dict[str, Decimal] = defaultdict(Decimal)
    for e in events:
        a, b = max(e["ts"], t0), min(e["ts"] + e["dur"], t1)
        if b > a:
            totals[e["name"]] += b - a
    return totals


def _work(tl):
    return tl[~tl["lane"].isin(["step", "phase"]) & (tl["kind"] != "range")]


def _check_top(tl, reference: dict[str, Decimal], top_n: int = 12) -> None:
    """The timeline's names, in order, are the reference's top ``top_n`` by total, with the same totals."""
    expected = sorted(reference.items(), key=lambda kv: (-kv[1], kv[0]))[:top_n]
    got = _work(tl).groupby("name", sort=False)["dur_ms"].sum()
    assert len(got) == top_n
    assert list(got) == sorted(got, reverse=True)
    for (name, total_us), (cut, total_ms) in zip(expected, got.items(), strict=True):
        assert cut[:60] == name[:60] and len(cut) <= MAX_NAME_CHARS
        assert total_ms == pytest.approx(float(total_us) / 1e3, abs=1e-9)


def test_cpu_run_shows_its_last_step_phases_and_top_level_ops():
    tl = step_timeline(load_trace(SAMPLE_RUN))
    # Our own run stops the profiler after its last step, so ProfilerStep#5 is complete and chosen; its
    # "dur" in trace.json.gz is 66839.371 us.
    assert tl.attrs["step"] == 5 and not tl.attrs["whole_trace"] and tl.attrs["source"] == "cpu_ops"
    step = tl.iloc[0]
    assert (step["lane"], step["name"], step["start_ms"]) == ("step", "ProfilerStep#5", 0.0)
    assert step["dur_ms"] == pytest.approx(66.839371, abs=1e-9)
    phases = tl[tl["lane"] == "phase"]
    assert list(phases["name"]) == ["data", "forward", "backward", "optimizer"]
    assert (phases["start_ms"] >= 0).all() and (phases["start_ms"] + phases["dur_ms"] <= step["dur_ms"]).all()
    # backward: 42.304697 ms in the trace (ts 5200544552463.327, dur 42304.697 us).
    assert phases["dur_ms"].iloc[2] == pytest.approx(42.304697, abs=1e-9)
    ops = _work(tl)
    assert set(ops["lane"]) == {"CPU ops"} and set(ops["kind"]) == {"cpu_op"}
    # Top-level ops only: on the one thread none overlaps the next.
    ordered = ops.sort_values("start_ms")
    assert (
        ordered["start_ms"].iloc[1:].to_numpy() >= (ordered["start_ms"] + ordered["dur_ms"]).iloc[:-1].to_numpy()
    ).all()
    # Checked by hand on the JSON: 29 top-level MmBackward0 calls, 29.229638 ms in all, then aten::linear.
    first = ops[ops["name"] == "autograd::engine::evaluate_function: MmBackward0"]
    assert len(first) == 29 and first["dur_ms"].sum() == pytest.approx(29.229638, abs=1e-6)
    assert ops["name"].iloc[0] == first["name"].iloc[0] and "aten::linear" in set(ops["name"])

    events = _events(SAMPLE_RUN / "trace.json.gz")
    raw = next(e for e in events if e.get("name") == "ProfilerStep#5")
    t0, t1 = raw["ts"], raw["ts"] + raw["dur"]
    # Top level, found independently: per thread by start (longer first), an op that starts before the
    # latest end seen so far is nested.
    ops_raw, reach, top_level = (
        sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: (e["tid"], e["ts"], -e["dur"])),
        {},
        [],
    )
    for e in ops_raw:
        if e["tid"] not in reach or e["ts"] >= reach[e["tid"]]:
            top_level.append(e)
        reach[e["tid"]] = max(reach.get(e["tid"], e["ts"]), e["ts"] + e["dur"])
    _check_top(tl, _totals_in(top_level, t0, t1))


@needs_traces
def test_gpu_trace_picks_the_last_complete_step_and_ranks_kernels_by_time_inside_it():
    df = load_trace(GPU_BOUND)
    tl = step_timeline(df)
    # Steps 101-105; the last is cut by the end of the capture (HTA's rule, as analyze() applies), so 104.
    # Its "dur" in the JSON: 95551.087 us.
    assert tl.attrs["step"] == 104 and tl.attrs["source"] == "kernels"
    assert tl.iloc[0]["name"] == "ProfilerStep#104" and tl.iloc[0]["dur_ms"] == pytest.approx(95.551087, abs=1e-9)
    assert tl.attrs["step_ms"] == pytest.approx(95.551087, abs=1e-9)
    phases = tl[tl["lane"] == "phase"]
    assert list(phases["name"]) == ["## forward ##", "## backward ##", "## optimizer ##"]  # host ranges only
    assert (phases["start_ms"] >= 0).all() and (phases["start_ms"] + phases["dur_ms"] <= 95.551087 + 1e-9).all()
    work = _work(tl)
    assert set(work["lane"]) == {"GPU stream 7"}  # this trace has one stream
    assert ((work["start_ms"] >= 0) & (work["start_ms"] + work["dur_ms"] <= 95.551087 + 1e-9)).all()
    # Hand-checked on the JSON: the CUDAFunctor_add kernel leads with 32 runs, 5.260706 ms inside the step.
    lead = work[work["name"] == work["name"].iloc[0]]
    assert (
        lead["name"].iloc[0].startswith("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add")
    )
    assert len(lead) == 32 and lead["dur_ms"].sum() == pytest.approx(5.260706, abs=1e-9)

    (path,) = GPU_BOUND.glob("*.json.gz")
    events = _events(path)
    raw = next(e for e in events if e.get("name") == "ProfilerStep#104")
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    _check_top(tl, _totals_in(gpu, raw["ts"], raw["ts"] + raw["dur"]))

    # Any step can be asked for, the cut last one too.
    last = step_timeline(df, step=105, top_n=3)
    assert last.iloc[0]["dur_ms"] == pytest.approx(95.699037, abs=1e-9) and _work(last)["name"].nunique() == 3


@needs_traces
def test_row_cap_keeps_the_longest_occurrences():
    df = load_trace(GPU_BOUND)
    full, capped = step_timeline(df), step_timeline(df, max_rows=50)
    # 1 step, 3 phases, 10 other host ranges (DDP forward, the optimizer's, 5 all-reduces and 2
    # broadcasts on the NCCL thread), 259 kernel runs. The GPU copy of "## backward ##" (a
    # gpu_user_annotation on pid 0 = device 0, 26.944 us at 24.443 ms) is the GPU's, not a fourth host phase.
    assert len(full) == 273 and full.attrs["dropped_rows"] == 0
    ranges = full[full["kind"] == "range"]
    assert len(ranges) == 10 and (ranges["name"] == "nccl:all_reduce").sum() == 5
    assert len(capped) == 50 and capped.attrs["dropped_rows"] == 223
    kept, dropped_from = _work(capped)["dur_ms"], _work(full)["dur_ms"]
    assert sorted(kept, reverse=True) == sorted(dropped_from, reverse=True)[:36]  # 50 - 4 - 10
    assert capped.iloc[:14].equals(full.iloc[:14])  # step, phases and (here all) ranges are kept first


@needs_traces
def test_two_ranks_several_streams_and_the_errors():
    df = load_trace(TRACES / "kineto" / "trace_filter")
    tl = step_timeline(df, rank=1)
    # Rank 1 holds ProfilerStep#551 and #552 (cut): #551, 607904 us in sampled_rank-1.json.gz.
    assert tl.attrs["rank"] == 1 and tl.attrs["step"] == 551
    assert tl.iloc[0]["dur_ms"] == pytest.approx(607.904, abs=1e-9)
    assert list(tl[tl["lane"] == "phase"]["name"]) == [
        "## data_load ##",
        "## forward ##",
        "## backward ##",
        "## optimizer ##",
    ]
    assert {"GPU stream 7", "GPU stream 84", "GPU stream 203"} <= set(tl["lane"])
    with pytest.raises(AdvisorError, match=r"^rank=3: the trace has no such rank \(it has rank 0, 1\)$"):
        step_timeline(df, rank=3)
    with pytest.raises(AdvisorError, match=r"^step=7: rank 0 has no ProfilerStep#7 \(it has steps 551, 552\)$"):
        step_timeline(df, step=7)
    with pytest.raises(AdvisorError, match=r"top_n=-1: must be an integer >= 0"):
        step_timeline(df, top_n=-1)


@needs_traces
def test_nsys_capture_without_profiler_steps_is_shown_whole():
    df = load_trace(TRACES / "nsys" / "nsysai_mfu_2gpu_before.sqlite")
    tl = step_timeline(df, rank=0)
    assert tl.attrs["whole_trace"] and tl.attrs["step"] is None
    assert (tl.iloc[0]["name"], tl.iloc[0]["kind"]) == (WHOLE_TRACE, "trace")
    mine = df[df["rank"] == 0]
    span_ms = ((mine["start_ns"] + mine["dur_ns"]).max() - mine["start_ns"].min()) / 1e6
    assert tl.iloc[0]["dur_ms"] == pytest.approx(span_ms)
    work = _work(tl)
    # flash_fwd dominates this capture (tests/test_analyze.py); over the whole trace nothing is cut, so its
    # total is the plain sum of its kernels on this rank.
    assert work["name"].iloc[0].startswith("void flash::flash_fwd_kernel")
    flash = mine[(mine["kind"] == "kernel") & mine["name"].astype(str).str.startswith("void flash::flash_fwd_kernel")]
    assert work[work["name"] == work["name"].iloc[0]]["dur_ms"].sum() == pytest.approx(flash["dur_ns"].sum() / 1e6)
    # Several elementwise kernels share their first 80 characters: their cut names stay distinct.
    assert work["name"].nunique() == 12 and work["name"].str.len().max() <= MAX_NAME_CHARS
    with pytest.raises(AdvisorError, match=r"step=3: rank 0 has no ProfilerStep ranges; leave the step unset"):
        step_timeline(df, step=3)


def test_timeline_figure_has_one_trace_per_name_and_lanes_in_order():
    tl = step_timeline(load_trace(SAMPLE_RUN), top_n=5)
    fig = timeline_figure(tl)
    assert len(fig.data) == 1 + 4 + 5 + 1  # the step, four phases, five ops, one lane of other ranges
    named, ranges = fig.data[:-1], fig.data[-1]
    # One trace per name, holding every occurrence of it: 29 MmBackward0 and 29 linear calls, 4 attention
    # backwards, one fused AdamW and one log-softmax backward (the timeline's own rows).
    assert [t.name for t in named] == list(dict.fromkeys(tl[tl["kind"] != "range"]["name"]))
    assert [len(t.x) for t in named] == [int((tl["name"] == t.name).sum()) for t in named]
    assert [len(t.x) for t in named][5:] == [29, 29, 4, 1, 1]
    # The loader's next(), the optimizer's step and zero_grad: one trace, out of the legend, named on hover.
    assert ranges.name == "ranges 0" and not ranges.showlegend and len(ranges.x) == 3
    assert list(ranges.hovertext) == [
        "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__",
        "Optimizer.step#AdamW.step",
        "Optimizer.zero_grad#AdamW.zero_grad",
    ]
    assert list(fig.layout.yaxis.categoryarray) == ["step", "phase", "ranges 0", "CPU ops"]
    bar = fig.data[0]
    assert bar.orientation == "h" and list(bar.base) == [0.0] and bar.x[0] == pytest.approx(66.839371)
    assert "ProfilerStep#5" in fig.layout.title.text


def test_lanes_read_step_phase_then_streams_by_number():
    from advisor.present.charts import _lane_key

    lanes = ["GPU stream 23", "GPU stream 7", "step", "phase", "GPU stream -1", "CPU ops"]
    assert sorted(lanes, key=_lane_key) == [
        "step",
        "phase",
        "CPU ops",
        "GPU stream -1",
        "GPU stream 7",
        "GPU stream 23",
    ]


def test_nvtx_ranges_of_an_nsys_capture_get_lanes_by_depth():
    import numpy as np

    from advisor.analysis.timeline import RANGE_DEPTHS
    from advisor.trace.table import make_table

    us = 1000
    # One thread: "train" 0-100 us holds "fwd" 0-40 holding "attn" 5-20 holding "softmax" 6-8 (depth 3:
    # too deep); "bwd" 40-90 sits beside "fwd"; one kernel. A second thread's range gets its own lanes.
    table = make_table(
        {
            "rank": 0,
            "kind": ["annotation"] * 6 + ["kernel"],
            "name": ["train", "fwd", "attn", "softmax", "bwd", "loader", "k"],
            "start_ns": np.array([0, 0, 5, 6, 40, 10, 1]) * us,
            "dur_ns": np.array([100, 40, 15, 2, 50, 5, 30]) * us,
            "device": [-1] * 6 + [0],
            "stream": [-1] * 6 + [7],
            "tid": [1, 1, 1, 1, 1, 2, -1],
        }
    )
    table.attrs["source"] = "nsys"
    tl = step_timeline(table)
    ranges = tl[tl["kind"] == "range"][["lane", "name", "start_ms", "dur_ms"]]
    assert RANGE_DEPTHS == 3
    assert ranges.values.tolist() == [
        ["NVTX thread 1 0", "train", 0.0, 0.1],
        ["NVTX thread 2 0", "loader", 0.01, 0.005],
        ["NVTX thread 1 1", "fwd", 0.0, 0.04],
        ["NVTX thread 1 1", "bwd", 0.04, 0.05],
        ["NVTX thread 1 2", "attn", 0.005, 0.015],
    ]
    assert tl.attrs["dropped_rows"] == 1  # softmax, at depth 3
    # A cap on rows keeps the outer ranges first, then the longer ones.
    capped = step_timeline(table.iloc[:5], max_rows=8)  # room for 8 // 4 = 2 ranges
    assert capped[capped["kind"] == "range"]["name"].tolist() == ["train", "bwd"]


@needs_traces
def test_nsys_capture_shows_its_nvtx_ranges():
    import sqlite3

    path = TRACES / "nsys" / "nsysai_mfu_2gpu_before.sqlite"
    tl = step_timeline(load_trace(path), rank=0)
    nvtx = tl[tl["kind"] == "range"]
    # 9,443 NVTX ranges on rank 0's thread (emit_nvtx's per-op ranges): the 500 the cap allows
    # (2,000 rows / 4), the outermost first.
    assert len(nvtx) == 500 and set(nvtx["lane"]) == {"NVTX 0"}
    with sqlite3.connect(path) as db:
        texts = {
            t
            for (t,) in db.execute(
                "SELECT COALESCE(e.text, s.value) FROM NVTX_EVENTS e LEFT JOIN StringIds s ON e.textId = s.id"
            )
        }
    # Named by their op: "aten::linear" for "aten::linear, seq = 45330, op_id = 990360".
    from advisor.trace.nsys import NVTX_OP_RE

    assert set(nvtx["name"]) <= {m.group(1) if (m := NVTX_OP_RE.match(t)) else t for t in texts}
    assert "aten::linear" in set(nvtx["name"])
    assert "NVTX 0" in timeline_figure(tl).layout.yaxis.categoryarray
