"""Communication per communicator: bandwidth, sync skew apart from transfer, and stragglers by the late
start of communication kernels. Hand-built multi-rank tables with known skews, and the shared real
traces checked against figures computed here from their raw events (HTA has no per-communicator
analysis; see bench/results/comm_by_communicator.md for its straggler pick beside ours)."""

import gzip
import json
import math
import sqlite3
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from advisor.advice.rules import load_rules
from advisor.analysis import breakdown as A
from advisor.analysis.comm import comm_by_communicator, comm_calls, comm_skew, comm_stragglers
from advisor.analysis.summary import analyze, load_trace
from advisor.errors import AdvisorError
from advisor.trace.table import EventArgs, empty_table, make_table
from tests.shared import SHARED_TRACES, needs_shared_traces

KINETO = SHARED_TRACES / "kineto"
NSYS = SHARED_TRACES / "nsys"
ALL_REDUCE = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
ALL_GATHER = "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


def _nccl_table(kernels, steps=(), group="[0, 1, 2]", size=3, nelems=1_000_000):
    """An event table of NCCL kernels (rank, name, start_ns, dur_ns) with Kineto's NCCL arguments on
    each, and ProfilerStep#N host ranges (rank, N, start_ns, dur_ns)."""
    rows = [(r, "kernel", n, s, d, r) for r, n, s, d in kernels]
    rows += [(r, "annotation", f"ProfilerStep#{n}", s, d, -1) for r, n, s, d in steps]
    table = make_table(
        {
            "rank": [r[0] for r in rows],
            "kind": [r[1] for r in rows],
            "name": [r[2] for r in rows],
            "start_ns": [r[3] for r in rows],
            "dur_ns": [r[4] for r in rows],
            "device": [r[5] for r in rows],
            "stream": [7 if r[1] == "kernel" else -1 for r in rows],
        }
    )
    args = {
        "Process Group Name": "3",
        "Process Group Description": "dp",
        "Process Group Ranks": group,
        "Group size": size,
        "In msg nelems": nelems,
        "Out msg nelems": nelems,
        "dtype": "Float",
    }
    table.attrs["event_args"] = EventArgs({i: args for i in range(len(kernels))})
    return table


def _three_rank_all_reduces():
    starts = {0: (1_000, 21_000), 1: (1_500, 25_000), 2: (4_000, 22_000)}
    ends = (10_000, 30_000)
    return [(r, ALL_REDUCE, s, end - s) for r, ss in starts.items() for s, end in zip(ss, ends, strict=True)]


def test_three_ranks_split_each_kernel_into_the_wait_for_the_late_rank_and_the_transfer():
    # Two all-reduces over ranks 0-2, each kernel ending at 10 us (instance 1) and 30 us (instance 2).
    # Instance 1: starts 1, 1.5, 4 us: rank 2 is last; waits 3 / 2.5 / 0 us, transfers 6 us each.
    # Instance 2: starts 21, 25, 22 us: rank 1 is last; waits 4 / 0 / 3 us, transfers 5 us each.
    kernels = _three_rank_all_reduces()
    calls = comm_calls(_nccl_table(kernels))
    assert sorted(calls["instance"].unique().tolist()) == [0, 1]
    skew = comm_skew(calls).set_index("rank")
    assert skew["instances_count"].tolist() == [2, 2, 2]
    assert skew["wait_total_ms"].tolist() == pytest.approx([0.007, 0.0025, 0.003])
    assert skew["transfer_total_ms"].tolist() == pytest.approx([0.011, 0.011, 0.011])
    assert skew["wait_mean_ms"].tolist() == pytest.approx([0.0035, 0.00125, 0.0015])
    assert skew.loc[0, "wait_pct"] == pytest.approx(100 * 7 / 18)
    assert (skew["note"] == "").all()
    late = comm_stragglers(calls).set_index("rank")
    # Lateness after the earliest start: rank 0 (0, 0), rank 1 (0.5, 4), rank 2 (3, 1) us.
    assert late["late_median_ms"].tolist() == pytest.approx([0.0, 0.00225, 0.002])
    assert late["last_count"].tolist() == [0, 1, 1]
    assert late["last_pct"].tolist() == [0.0, 50.0, 50.0]
    # No steps and no rank_skew: no step time to weigh lateness against.
    assert late["late_of_step_pct"].isna().all() and not late["comm_straggler"].any()


def test_bandwidths_use_the_bytes_the_kernels_record_and_nccls_bus_factor():
    kernels = _three_rank_all_reduces()
    row = comm_by_communicator(comm_calls(_nccl_table(kernels))).iloc[0]
    assert (row["communicator"], row["pg_desc"], row["pg_ranks"], row["group_size"]) == ("3", "dp", "[0, 1, 2]", 3)
    assert (row["kind"], row["nccl_algo"], row["scope"], row["nodes_count"]) == (
        "all_reduce",
        "RING_LL",
        "intra_node",
        1,
    )
    assert (row["ranks_count"], row["calls_count"], row["matched_calls_count"]) == (3, 6, 6)
    # 6 calls of 1e6 floats = 24e6 bytes in 9+8.5+6+9+5+8 = 45.5 us of kernel time.
    assert row["bytes"] == 24e6 and row["time_ms"] == pytest.approx(0.0455)
    assert row["algbw_gbps"] == pytest.approx(24e6 / 45.5e-6 / 1e9)
    assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * 2 * 2 / 3)  # all-reduce: 2(n-1)/n
    # After every rank has joined: 3 x 6 us + 3 x 5 us = 33 us of transfer for the same bus bytes.
    assert row["wait_ms"] == pytest.approx(0.0125) and row["transfer_ms"] == pytest.approx(0.033)
    assert row["transfer_busbw_gbps"] == pytest.approx(24e6 * 4 / 3 / 33e-6 / 1e9)


def test_a_communicator_across_nodes_is_inter_node_by_the_node_size():
    kernels = [(0, ALL_GATHER, 0, 1_000), (8, ALL_GATHER, 100, 900)]
    for per_node, scope, nodes in ((8, "inter_node", 2), (16, "intra_node", 1)):
        calls = comm_calls(_nccl_table(kernels, group="[0, 8]", size=2), gpus_per_node=per_node)
        row = comm_by_communicator(calls).iloc[0]
        assert (row["scope"], row["nodes_count"], row["kind"]) == (scope, nodes, "all_gather")
    assert comm_by_communicator(comm_calls(_nccl_table(kernels, group="", size=0)))["scope"].item() == "unknown"
    with pytest.raises(AdvisorError, match=r"gpus_per_node=0"):
        comm_calls(_nccl_table(kernels), gpus_per_node=0)


def test_calls_that_cannot_be_one_collective_are_not_matched():
    # Rank 0's first all-reduce ends (at 5 us) before rank 1's starts (at 6 us): no rank can finish an
    # all-reduce before the last one joins, so these are not one instance (a call missing from one
    # rank's trace, as in a sampled trace) and are left out. Their second calls overlap and pair.
    kernels = [(0, ALL_REDUCE, 0, 5_000), (1, ALL_REDUCE, 6_000, 4_000), (0, ALL_REDUCE, 20_000, 5_000)]
    kernels.append((1, ALL_REDUCE, 21_000, 4_000))
    calls = comm_calls(_nccl_table(kernels, group="[0, 1]", size=2))
    assert calls["rank"].tolist() == [0, 0, 1, 1]
    assert (calls["instance"] >= 0).tolist() == [False, True, False, True]
    assert comm_skew(calls)["wait_total_ms"].tolist() == pytest.approx([0.001, 0.0])


def test_profiler_steps_keep_a_missing_call_from_shifting_the_next_steps_pairs():
    # Rank 1's trace lacks its step-1 call. Without steps its step-2 call would pair with rank 0's
    # step-1 call; within steps, the step-2 calls pair: rank 1 is 2 us late.
    steps = [(r, n, 1_000 * (100 * n - 100), 100_000) for r in (0, 1) for n in (1, 2)]
    kernels = [(0, ALL_REDUCE, 10_000, 5_000), (0, ALL_REDUCE, 110_000, 5_000), (1, ALL_REDUCE, 112_000, 3_000)]
    calls = comm_calls(_nccl_table(kernels, steps=steps, group="[0, 1]", size=2))
    assert calls["step"].tolist() == [1, 2, 2]
    assert (calls["instance"] >= 0).tolist() == [False, True, True]
    skew = A.rank_skew(_nccl_table(kernels, steps=steps))
    late = comm_stragglers(calls, skew).set_index("rank")
    assert late.loc[1, "late_median_ms"] == pytest.approx(0.002) and late.loc[1, "instances_per_step"] == 1
    assert late.loc[1, "late_of_step_pct"] == pytest.approx(100 * 2 / 100)  # 2 us of a 100 us step
    assert not late["comm_straggler"].any()  # 2 % < 5 %
    assert late["step_ms"].tolist() == [0.1, 0.1]


def test_a_rank_late_at_every_collective_is_a_straggler_though_its_step_is_normal():
    # Two ranks, 10 us steps, one all-gather per step; rank 1 starts it 1 us late each time (10 %).
    steps = [(r, n, 10_000 * n, 10_000) for r in (0, 1) for n in range(4)]
    kernels = [(r, ALL_GATHER, 10_000 * n + 2_000 + 1_000 * r, 5_000 - 1_000 * r) for r in (0, 1) for n in range(4)]
    table = _nccl_table(kernels, steps=steps, group="[0, 1]", size=2)
    skew = A.rank_skew(table)
    assert skew["above_median_pct"].tolist() == [0.0, 0.0]  # step time sees nothing
    late = comm_stragglers(comm_calls(table), skew).set_index("rank")
    assert late["comm_straggler"].tolist() == [False, True]
    assert late.loc[1, "late_of_step_pct"] == pytest.approx(10.0)
    assert late["step_straggler"].tolist() == [False, False]


def test_p2p_pairs_a_send_with_its_peers_recv_in_a_group_of_two():
    # Calls at the collective_calls level: rank 0 sends twice, rank 1 receives twice; rank 1 posts its
    # first recv 3 us after rank 0's send. In a group of 4 the peer is not known: nothing pairs.
    def calls(group_size):
        return pd.DataFrame(
            {
                "rank": [0, 0, 1, 1],
                "kind": ["send", "send", "recv", "recv"],
                "op": ["c10d::send", "c10d::send", "c10d::recv_", "c10d::recv_"],
                "name": ["ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"] * 4,
                "start_ns": [0, 20_000, 3_000, 21_000],
                "dur_ns": [5_000, 5_000, 2_000, 4_000],
                "exposed_ns": [0] * 4,
                "bytes": [4e6] * 4,
                "launch_ns": [0, 20_000, 3_000, 21_000],
                "pg_name": ["1"] * 4,
                "pg_desc": ["pp"] * 4,
                "pg_ranks": ["[0, 1]" if group_size == 2 else "[0, 1, 2, 3]"] * 4,
                "group_size": [group_size] * 4,
            }
        )

    paired = comm_calls(empty_table(), calls(2))
    assert paired["instance"].tolist() == [0, 1, 0, 1]
    assert paired["wait_ns"].tolist() == [3_000, 1_000, 0, 0]
    assert (comm_calls(empty_table(), calls(4))["instance"] == -1).all()


def test_one_ranks_trace_cannot_measure_skew_and_says_so():
    calls = comm_calls(_nccl_table([(0, ALL_REDUCE, 0, 1_000), (0, ALL_REDUCE, 5_000, 1_000)]))
    for table in (comm_skew(calls), comm_stragglers(calls)):
        assert len(table) == 1 and table["instances_count"].item() == 0
        assert table["note"].item().startswith("one rank's trace")
    assert math.isnan(comm_skew(calls)["wait_mean_ms"].item())
    assert math.isnan(comm_stragglers(calls)["late_median_ms"].item())
    row = comm_by_communicator(calls).iloc[0]
    assert row["busbw_gbps"] == pytest.approx(8e6 / 2e-6 / 1e9 * 4 / 3)  # bandwidth needs one rank only
    assert math.isnan(row["wait_ms"]) and math.isnan(row["transfer_busbw_gbps"])


def test_no_communication_gives_empty_tables():
    table = make_table({"rank": [0], "kind": ["kernel"], "name": ["ampere_sgemm"], "start_ns": [0], "dur_ns": [9]})
    for t in (empty_table(), table):
        calls = comm_calls(t)
        assert calls.empty
        assert comm_by_communicator(calls).empty and comm_skew(calls).empty and comm_stragglers(calls).empty
    report = analyze(table)
    assert {"comm_by_communicator", "comm_skew", "comm_stragglers"} <= set(report.tables)
    assert report.metrics.comm_late_pct is None and report.metrics.comm_stragglers == []


# --- the shared real traces ----------------------------------------------------------------------------


def _raw(path):
    with gzip.open(path) as f:
        return json.load(f)["traceEvents"]


@needs_shared_traces
def test_trace_filter_skew_and_bandwidth_match_the_raw_kernels():
    path = KINETO / "trace_filter"
    calls = comm_calls(load_trace(path))
    # The NCCL kernels of the 1 GiB all-gathers (c10d::_allgather_base_, 2**30 int8), from the JSON:
    # step 551 rank 0 at ts 1682725898585321 us for 42496 us, rank 1 at ...585405 for 42744 us.
    raw = {
        r: sorted(
            (e["ts"], e["dur"])
            for e in _raw(path / f"sampled_rank-{r}.json.gz")
            if e.get("cat") == "kernel" and e["name"].startswith("ncclKernel_SendRecv")
        )
        for r in (0, 1)
    }
    gather = {0: [raw[0][4], raw[0][9]], 1: [raw[1][4], raw[1][9]]}  # 5th and 10th kernels of each rank
    assert gather[0][0] == (1682725898585321, 42496.0) and gather[1][0] == (1682725898585405, 42744.0)
    ag = calls[calls["kind"] == "all_gather"].sort_values(["rank", "start_ns"])
    assert (ag["instance"] >= 0).all() and ag["bytes"].tolist() == [2.0**30] * 4
    for k in (0, 1):
        (s0, d0), (s1, d1) = gather[0][k], gather[1][k]
        last = max(s0, s1)
        for rank, (s, d) in ((0, (s0, d0)), (1, (s1, d1))):
            mine = ag[ag["rank"] == rank].iloc[k]
            assert mine["wait_ns"] == (last - s) * 1000 and mine["transfer_ns"] == (s + d - last) * 1000
    # Step 551: rank 1 starts 84 us late; step 552: 1292 us late. Rank 0 waits, rank 1 never does.
    by = comm_by_communicator(calls).set_index("kind")
    assert by.loc["all_gather", "time_ms"] == pytest.approx((42496 + 63644 + 42744 + 62163) / 1e3)
    assert by.loc["all_gather", "wait_ms"] == pytest.approx((84 + 1292) / 1e3)
    assert by.loc["all_gather", "algbw_gbps"] == pytest.approx(4 * 2**30 / 211.047e-3 / 1e9)  # 20.35 GB/s
    # No process group recorded (a 2022 trace): communicator, group size and bus bandwidth unknown.
    assert set(by["communicator"]) == {"unknown"} and by["busbw_gbps"].isna().all()
    # The sampled trace dropped events: its all-to-alls (sizes differ by rank, so matched by order
    # alone) pair calls that do not overlap and are all left out; 2 all-reduce pairs share a size.
    assert by.loc["all_to_all", "matched_calls_count"] == 0 and by.loc["all_reduce", "matched_calls_count"] == 4
    late = comm_stragglers(calls, A.rank_skew(load_trace(path))).set_index("rank")
    # Rank 1 starts last in all 4 instances, 3302, 84, 22328 and 1292 us late: median 2297 us.
    assert late.loc[1, "last_count"] == 4 and late.loc[1, "late_median_ms"] == pytest.approx(2.297)
    assert late.loc[1, "late_mean_ms"] == pytest.approx((3302 + 84 + 22328 + 1292) / 4e3)
    assert not late["comm_straggler"].any()


@needs_shared_traces
def test_nccl_parser_config_has_one_communicator_of_two_ranks_and_one_ranks_trace():
    report = analyze(load_trace(KINETO / "nccl_parser_config"), trim_last_step=False)
    by = report.tables["comm_by_communicator"].set_index("kind")
    assert set(by["communicator"]) == {"0"} and set(by["pg_desc"]) == {"default_pg"}
    assert set(by["pg_ranks"]) == {"[0, 1]"} and set(by["scope"]) == {"intra_node"}
    assert set(by["nccl_algo"]) == {"RING_LL"}
    # collective_table's figures (tests/test_collectives.py sums them from the JSON): 15 all-reduces,
    # 306,684,384 bytes; 46.762159 ms summed here from the kernels' durations.
    raw = [e for e in _raw(KINETO / "nccl_parser_config" / "nccl_data.json.gz") if e.get("cat") == "kernel"]
    ar = [e for e in raw if e["name"].startswith("ncclKernel_AllReduce")]
    assert by.loc["all_reduce", "bytes"] == sum(4 * e["args"]["In msg nelems"] for e in ar) == 306_684_384
    assert by.loc["all_reduce", "time_ms"] == pytest.approx(sum(e["dur"] for e in ar) / 1e3)
    # Two ranks: the all-reduce's bus factor 2(n-1)/n is 1, so busbw = algbw = 6.558 GB/s.
    assert by.loc["all_reduce", "busbw_gbps"] == pytest.approx(306_684_384 / 46.762159e-3 / 1e9, rel=1e-6)
    assert by.loc["all_reduce", "busbw_gbps"] == by.loc["all_reduce", "algbw_gbps"]
    skew = report.tables["comm_skew"]
    assert skew["rank"].tolist() == [0] and np.isnan(skew["wait_mean_ms"].item())
    assert "one rank's trace" in skew["note"].item()
    assert report.metrics.comm_late_pct is None


@needs_shared_traces
def test_nsys_two_gpus_waits_match_the_kernels_in_the_export():
    path = NSYS / "nsysai_mfu_2gpu_before.sqlite"
    with sqlite3.connect(path) as db:
        rows = db.execute(
            "SELECT k.deviceId, k.start, k.end FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s"
            " ON k.shortName = s.id WHERE s.value = 'ncclDevKernel_SendRecv' ORDER BY k.start"
        ).fetchall()
    per = {d: [(s, e) for dev, s, e in rows if dev == d] for d in (0, 1)}
    assert len(per[0]) == len(per[1]) == 33
    # The k-th kernel of each GPU is one all-to-all (PyTorch's nccl:all_to_all NVTX range around its
    # launch; the first pair's launch lies before the capture: send_recv). Every pair overlaps.
    waits = {0: 0, 1: 0}
    for (s0, e0), (s1, e1) in zip(per[0], per[1], strict=True):
        assert min(e0, e1) >= max(s0, s1)
        waits[0] += max(s0, s1) - s0
        waits[1] += max(s0, s1) - s1
    calls = comm_calls(load_trace(path))
    assert calls["kind"].value_counts().to_dict() == {"all_to_all": 64, "send_recv": 2}
    skew = comm_skew(calls).set_index("rank")
    assert skew["instances_count"].tolist() == [33, 33]
    assert skew["wait_total_ms"].tolist() == pytest.approx([waits[0] / 1e6, waits[1] / 1e6])  # 10.90, 2.48
    first = calls[calls["kind"] == "all_to_all"].sort_values("start_ns").groupby("rank").head(1)
    # The first all-to-all: GPU 0 at 60127005302 ns for 753440, GPU 1 at 60127479662: 474.36 us late.
    assert first["wait_ns"].tolist() == [474_360, 0] and first["transfer_ns"].tolist() == [279_080, 256_735]
    late = comm_stragglers(calls).set_index("rank")
    assert late.loc[1, "last_count"] == 22 and late.loc[0, "last_count"] == 11


def test_the_straggler_rule_reads_the_late_start_of_communication_where_measured():
    from advisor.advice.advise import advise
    from advisor.spec.metrics import StepMetrics

    rule = [r for r in load_rules() if r.id == "par-straggler"]
    # Rank 3 makes the others wait 20 % of each step at the collectives, though every step is as long.
    comm = StepMetrics(
        run_id="t",
        source="trace",
        n_ranks=8,
        step_time_ms=100.0,
        step_skew_pct=0.5,
        stragglers=[],
        comm_late_pct=20.0,
        comm_stragglers=[3],
    )
    rec = advise(comm, rules=rule).recommendations[0]
    assert rec.message == (
        "A rank straggles, measured by the start of communication kernels: the earliest rank waits 20.0 % "
        "of each step for the latest one (1 flagged)."
    )
    assert rec.gain.after == pytest.approx(80.0)  # the wait removed
    # One rank's trace (or nothing matched): step time decides, as before.
    steps = StepMetrics(run_id="t", source="trace", n_ranks=8, step_time_ms=100.0, step_skew_pct=25.0, stragglers=[5])
    rec = advise(steps, rules=rule).recommendations[0]
    assert rec.message == (
        "A rank straggles, measured by step time: the slowest rank's step is 25.0 % above the median rank's (1 flagged)."
    )
    assert rec.gain.after == pytest.approx(100 * (1 - 25 / 125))
    assert not advise(replace(comm, comm_late_pct=2.0), rules=rule).recommendations
