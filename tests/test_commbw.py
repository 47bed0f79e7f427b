"""Measured communication: the bus bandwidth of a real 2-process gloo run, checked against the raw trace
read here; the run found for this host; the estimator and the planner using it; and no run, no change."""

import gzip
import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
import torch.distributed as dist

from advisor.advice.commlinks import link_for, measured_bus_bandwidth
from advisor.analysis.collectives import collective_calls, collective_sizes
from advisor.analysis.commbw import MIN_CALL_BYTES, MeasuredLink, bus_factor, matched_calls
from advisor.analysis.summary import load_trace
from advisor.cli import main
from advisor.errors import AdvisorError, SpecError
from advisor.estimate.estimator import COLLECTIVE_LATENCY_S, COMM_EFFICIENCY_FRAC, DDP_BUCKET_BYTES, estimate
from advisor.estimate.links import with_measured_link
from advisor.estimate.planner import PlanRequest, plan
from advisor.run.launcher import profile_run
from advisor.spec.options import RunOptions
from advisor.spec.presets import cpu_host, device_key_for, get_hardware, get_model
from advisor.spec.setup import make_setup
from advisor.store.runstore import RunStore
from tests.shared import SHARED_TRACES

NCCL_TRACE = SHARED_TRACES / "kineto" / "nccl_parser_config"
TINY_DDP = {"model": "tiny", "gpu": "cpu", "gpus": 2, "zero": 0, "seq": 64, "micro_batch": 2, "precision": "fp32"}
TINY_PARAMS = 4_999_424  # advisor.spec.presets.tiny
needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    store = RunStore(tmp_path_factory.mktemp("runs"))
    run = profile_run(make_setup(**TINY_DDP), RunOptions(device="cpu", nproc=2, steps=1, warmup=0), store)
    assert run.status == "ok", run.record["message"]
    return store, run


def _raw_all_reduces(run_dir: Path) -> dict[int, list[tuple[float, float]]]:
    """Per rank, (bytes, duration in s) of each gloo:all_reduce range in start order, from the raw JSON."""
    out = {}
    for f in sorted((run_dir / "ranks").glob("rank-*.trace.json.gz")):
        with gzip.open(f) as fh:
            data = json.load(fh)
        events = sorted(
            (e for e in data["traceEvents"] if e.get("ph") == "X" and e.get("name") == "gloo:all_reduce"),
            key=lambda e: e["ts"],
        )
        assert all(e["args"]["Input type"] == ["float"] for e in events)
        out[data["distributedInfo"]["rank"]] = [
            (4.0 * math.prod(e["args"]["Input Dims"][0]), e["dur"] / 1e6) for e in events
        ]
    return out


# --- the measurement ---------------------------------------------------------------------------------


def test_bus_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 2) == 1.0 and bus_factor("all_reduce", 8) == 1.75
    assert bus_factor("all_gather", 4) == 0.75 and bus_factor("reduce_scatter", 4) == 0.75
    assert bus_factor("send", 8) == bus_factor("recv", 8) == bus_factor("broadcast", 8) == 1.0
    assert math.isnan(bus_factor("barrier", 8)) and math.isnan(bus_factor("all_reduce", 1))


def test_calls_are_timed_by_their_last_rank_and_gloo_reduce_scatters_count_as_all_reduces():
    # Two ranks, three calls: each rank waits for the other once; the reduce-scatter ran as gloo:all_reduce.
    calls = pd.DataFrame(
        {
            "rank": [0, 0, 0, 1, 1, 1],
            "kind": ["all_gather", "reduce_scatter", "all_reduce"] * 2,
            "name": ["gloo:all_gather", "gloo:all_reduce", "gloo:all_reduce"] * 2,
            "start_ns": [0, 100, 200, 0, 100, 200],
            "dur_ns": [9_000, 2_000, 500, 3_000, 7_000, 400],
            "bytes": [8e6, 4e6, 4.0] * 2,
        }
    )
    m = matched_calls(calls, 2)
    assert m["kind"].tolist() == ["all_gather", "all_reduce", "all_reduce"]
    assert m["dur_ns"].tolist() == [3_000, 2_000, 400] and m["ranks"].tolist() == [2, 2, 2]
    assert m["bus_bytes"].tolist() == [4e6, 4e6, 4.0]  # (n-1)/n and 2(n-1)/n of n = 2
    assert m["bus_bytes_per_s"].iloc[0] == pytest.approx(4e6 / 3e-6)


@pytest.mark.skipif(not NCCL_TRACE.is_dir(), reason="real traces live in ../shared/traces (absent here)")
def test_nccl_all_reduces_of_a_real_a100_trace_match_their_kernels_args():
    # One rank of two (HTA's nccl_parser_config): every NCCL kernel records its message and group size.
    with gzip.open(NCCL_TRACE / "nccl_data.json.gz") as fh:
        data = json.load(fh)
    kernels = [e for e in data["traceEvents"] if e.get("cat") == "kernel" and e["name"].startswith("ncclKernel_")]
    big = [e for e in kernels if "AllReduce" in e["name"] and 4 * e["args"]["In msg nelems"] >= MIN_CALL_BYTES]
    assert {e["args"]["Group size"] for e in kernels} == {2} and len(big) == 15
    expected = sum(4.0 * e["args"]["In msg nelems"] for e in big) / sum(e["dur"] / 1e6 for e in big)

    events = load_trace(NCCL_TRACE)
    m = matched_calls(collective_calls(events, collective_sizes(events)), 2)
    used = m[(m["bytes"] >= MIN_CALL_BYTES) & (m["kind"] == "all_reduce")]
    assert len(used) == 15
    assert used["bus_bytes"].sum() / (used["dur_ns"].sum() / 1e9) == pytest.approx(expected, rel=1e-6)
    assert expected == pytest.approx(6.56e9, rel=0.01)  # ring LL on this A100 pair, waits for the peer included


@pytest.mark.slow  # starts a child process or runs seconds of real steps
@needs_gloo
def test_measured_bandwidth_of_a_gloo_ddp_run_matches_the_raw_trace(ddp_run):
    _, run = ddp_run
    link = measured_bus_bandwidth(run.path)
    raw = _raw_all_reduces(run.path)
    assert sorted(raw) == [0, 1]
    # The same all-reduces, in the same order, on both ranks (DDP's buckets and the loss average).
    assert [b for b, _ in raw[0]] == [b for b, _ in raw[1]]
    pairs = [(b0, min(t0, t1)) for (b0, t0), (_, t1) in zip(raw[0], raw[1], strict=True) if b0 >= MIN_CALL_BYTES]
    assert pairs and len(pairs) < len(raw[0])  # the 4-byte loss all-reduces are left out
    # 2 ranks: an all-reduce's bus bytes are 2(n-1)/n = 1 x its bytes.
    expected = sum(b for b, _ in pairs) / sum(t for _, t in pairs)

    assert link.bus_bytes_per_s == pytest.approx(expected, rel=1e-6)
    assert link.n_calls == len(pairs) and link.world_size == 2 and link.run_id == run.run_id
    assert link.device_key == device_key_for(run.record)
    assert f"{len(pairs)} collectives of 2 ranks ({len(pairs)} all_reduce" in link.basis
    assert 1e8 < link.bus_bytes_per_s < 1e11  # loopback gloo; not a timing assertion


@needs_gloo
def test_link_for_finds_the_run_for_this_hosts_cpu_and_not_for_a_gpu(ddp_run):
    store, run = ddp_run
    # The run's hardware is the host split over 2 processes; the link is the host's.
    assert device_key_for(run.record) == device_key_for(cpu_host()) + "-2-processes"
    assert link_for(store, cpu_host()) == measured_bus_bandwidth(run.path)
    assert link_for(store, get_hardware("h100")) is None


# --- the estimator and the planner -------------------------------------------------------------------


@needs_gloo
def test_with_measured_link_makes_the_dp_all_reduce_run_at_the_measured_rate(ddp_run):
    _, run = ddp_run
    link = measured_bus_bandwidth(run.path)
    hw = with_measured_link(cpu_host(), link)
    assert hw.intra_node_bw_bytes_per_s == pytest.approx(link.bus_bytes_per_s / COMM_EFFICIENCY_FRAC)
    assert hw.inter_node_bw_bytes_per_s == 0.0 and hw.name == cpu_host().name
    # Little compute per step (b1, 16 tokens), so the gradient all-reduce outlasts its window.
    setup = replace(make_setup(**{**TINY_DDP, "seq": 16, "micro_batch": 1}), hardware=hw)
    est = estimate(setup)
    assert est.params_per_gpu == TINY_PARAMS
    # By hand (estimator: DDP's ring all-reduce of the fp32 gradients, 2(n-1)/n x bytes / bus bandwidth,
    # plus a latency per bucket; hidden behind the last micro-batch's backward, 2/3 of its compute and
    # memory-bound time): n = 2.
    grad_bytes = 4.0 * TINY_PARAMS
    buckets = 1 + math.ceil((grad_bytes - 2**20) / DDP_BUCKET_BYTES)
    need_s = 2 * (2 - 1) / 2 * grad_bytes / link.bus_bytes_per_s + buckets * COLLECTIVE_LATENCY_S
    window_s = 2 / 3 * (est.time.compute_ms + est.time.memory_bound_ms) / 1e3 / setup.grad_accum
    assert need_s > window_s
    assert est.time.dp_comm_ms == pytest.approx((need_s - window_s) * 1e3, rel=1e-9)
    with pytest.raises(AdvisorError, match="not gpu-h100"):
        with_measured_link(get_hardware("h100"), link)


def _request(**kw) -> PlanRequest:
    return PlanRequest(get_model("tiny"), cpu_host(), 2, 64, 4, precisions=("fp32",), top=3, **kw)


@needs_gloo
def test_the_plan_uses_the_measured_link_and_names_its_run(ddp_run):
    _, run = ddp_run
    link = measured_bus_bandwidth(run.path)
    result = plan(_request(measured_link=link))
    text = result.explain()
    assert f"runs at {link.bus_bytes_per_s / 1e9:.2f} GB/s, the bus bandwidth measured on run {run.run_id}" in text
    assert "instead of the datasheet link's 1.28 GB/s" in text  # cpu_host: 1.6 GB/s x 0.8
    assert result.as_dict()["request"]["measured_link"]["run_id"] == run.run_id
    for e in result.top:
        assert e.setup.hardware == with_measured_link(cpu_host(), link)
    assert result.top[0].estimate == estimate(result.top[0].setup)
    with pytest.raises(SpecError, match=r"measured_link=.*was measured on cpu-cpu-host"):
        PlanRequest(get_model("tiny"), get_hardware("h100"), 2, 64, 4, measured_link=link)


@needs_gloo
def test_the_plan_command_uses_the_newest_run_of_this_host(ddp_run, capsys):
    store, run = ddp_run
    argv = ["plan", "--gpu", "cpu", "--model", "tiny", "--gpus", "2", "--seq", "64", "--global-batch", "4"]
    argv += ["--precision", "fp32", "--top", "2", "--traces", str(store.root)]
    assert main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    assert f"measured communication: run {run.run_id}" in captured.err
    assert json.loads(captured.out)["request"]["measured_link"]["run_id"] == run.run_id
    assert main([*argv, "--json", "--measured-comm", "off"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and json.loads(captured.out)["request"]["measured_link"] is None


# --- no distributed run ------------------------------------------------------------------------------


def test_without_a_distributed_run_there_is_no_link_and_the_plan_is_unchanged(tmp_path, capsys):
    empty = RunStore(tmp_path / "runs")
    assert link_for(empty, cpu_host()) is None
    same = plan(_request(measured_link=link_for(empty, cpu_host())))
    base = plan(_request())
    assert "measured" not in same.explain()
    assert same.table().equals(base.table())
    assert all(e.setup.hardware == cpu_host() for e in same.top)
    argv = ["plan", "--gpu", "cpu", "--model", "tiny", "--gpus", "2", "--seq", "64", "--global-batch", "4"]
    assert main([*argv, "--precision", "fp32", "--traces", str(empty.root)]) == 0
    assert "measured communication: no distributed run of CPU host" in capsys.readouterr().err


@needs_gloo
def test_single_process_and_multi_group_runs_are_not_measured(ddp_run, tmp_path):
    _, run = ddp_run
    one = tmp_path / run.run_id
    shutil.copytree(run.path, one)
    metrics = json.loads((one / "metrics.json").read_text())
    (one / "metrics.json").write_text(json.dumps({**metrics, "world_size": 1}))
    assert measured_bus_bandwidth(one) is None
    # dp2 x tp2: a call's group (2 of 4 ranks) is not in a gloo trace, so it is not measured.
    four = {k: metrics[k] * 2 for k in ("rank_step_time_ms", "rank_peak_memory_bytes")}
    (one / "metrics.json").write_text(json.dumps({**metrics, **four, "world_size": 4}))
    record = json.loads((one / "run.json").read_text())
    record["setup"]["parallel"].update(dp=2, tp=2)
    (one / "run.json").write_text(json.dumps(record))
    assert measured_bus_bandwidth(one) is None


def test_a_measured_link_is_validated():
    with pytest.raises(SpecError, match=r"measured_link\.bus_bytes_per_s=0\.0"):
        MeasuredLink("r", "cpu-x", 2, 0.0, 1, "")
    with pytest.raises(SpecError, match=r"measured_link\.world_size=1"):
        MeasuredLink("r", "cpu-x", 1, 1e9, 1, "")
