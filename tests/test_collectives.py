"""Collectives per rank and the pipeline bubble, on real traces: three 2-rank gloo runs of the tiny model
made here with profile_run (DDP, FSDP2 ZeRO-3, a 2-stage pipeline; one profiled step each, about 6 s
apiece on 2 shared cores) and the NCCL traces in ../shared/traces/kineto.

Hand-checked facts the counts rest on (tiny: 4 blocks of 725,504 parameters, a root unit of 2,097,408
= the 8192 x 256 tied embedding and the final norm, 4,999,424 in all; fp32):
- DDP reduces gradients in buckets built in reverse parameter order; the first closes once past 1 MiB
  (262,144 floats): final norm (256) + blocks.3.mlp.down (176,128) + blocks.3.mlp.up (176,128) =
  352,512 floats; the second holds the other 4,646,912 (under the 25 MiB cap).
- FSDP2 ZeRO-3 gathers each of the 5 units before its forward and again before its backward, the
  root included (apply_fsdp passes reshard_after_forward=True to the root too, which overrides FSDP2's
  default of keeping the root unsharded), and reduce-scatters each unit's gradients once.
- Every layout's step then all-reduces its 0-dim loss (4 bytes) to log it, outside the step range.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from advisor.analysis.breakdown import comm_comp_overlap
from advisor.analysis.collectives import (
    KINDS,
    collective_calls,
    collective_kind,
    collective_sizes,
    collective_table,
    pipeline_bubble,
)
from advisor.analysis.summary import load_trace
from advisor.errors import AdvisorError
from advisor.run.launcher import profile_run
from advisor.spec.options import RunOptions
from advisor.spec.setup import make_setup
from advisor.spec.specs import setup_from_dict
from advisor.store.runstore import RunStore
from tests.shared import SHARED_TRACES

ROOT = Path(__file__).resolve().parents[1]
KINETO = SHARED_TRACES / "kineto"
needs_traces = pytest.mark.skipif(not KINETO.is_dir(), reason="real traces live in ../shared/traces (absent here)")
needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="needs torch.distributed with the gloo backend (this PyTorch build has none)",
)

TINY_N = 4_999_424
TINY_ROOT = 2_097_408
TINY_BLOCK = 725_504
FIRST_BUCKET = 256 + 2 * 176_128
ACTIVATION_BYTES = 2 * 64 * 256 * 4  # micro-batch 2 x seq 64 x hidden 256, fp32
BASE = {"model": "tiny", "gpu": "cpu", "seq": 64, "micro_batch": 2, "precision": "fp32", "gpus": 2}
LAYOUTS = {"ddp": {}, "zero3": {"zero": 3}, "pp": {"pp": 2, "global_batch": 4}}  # pp: 2 micro-batches


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """name -> (run directory, event table, calls with sizes, setup as recorded)."""
    store = RunStore(tmp_path_factory.mktemp("collective-runs"))
    out = {}
    for name, overrides in LAYOUTS.items():
        run = profile_run(make_setup(**BASE, **overrides), RunOptions(device="cpu", steps=1, warmup=0, nproc=2), store)
        assert run.status == "ok", run.record["message"]
        table = load_trace(run.path)
        out[name] = (run.path, table, collective_calls(table, collective_sizes(table)), run.record["setup"])
    return out


def _raw_events(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def _rank_events(run_dir: Path, rank: int) -> list[dict]:
    return _raw_events(run_dir / "ranks" / f"rank-{rank}.trace.json.gz")


def test_kinds_from_op_range_and_kernel_names():
    names = {
        "c10d::allreduce_": "all_reduce",
        "c10d::_reduce_scatter_base_": "reduce_scatter",
        "c10d::reduce_scatter_tensor_coalesced_": "reduce_scatter",
        "c10d::_allgather_base_": "all_gather",
        "c10d::allgather_into_tensor_coalesced_": "all_gather",
        "c10d::recv_": "recv",
        "c10d::send": "send",
        "c10d::alltoall_base_": "all_to_all",
        "c10d::broadcast_": "broadcast",
        "c10d::barrier": "barrier",
        "c10d::gather_": "other",
        "gloo:all_reduce": "all_reduce",
        "nccl:_all_gather_base": "all_gather",
        "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "reduce_scatter",
        "ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)": "all_reduce",
        "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)": "send_recv",
        "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<(unsigned long)4096>)": "send_recv",
        "nccl:all_to_all, op_id = 991144": "all_to_all",  # a PyTorch NVTX range in an Nsight Systems export
        "nccl:send": "send",
    }
    assert {n: collective_kind(n) for n in names} == names
    assert set(names.values()) <= set(KINDS)


@pytest.mark.slow  # starts a child process or runs seconds of real steps
@needs_gloo
def test_ddp_all_reduces_each_bucket_once_and_the_last_one_is_exposed(runs):
    run_dir, table, calls, _ = runs["ddp"]
    summary = collective_table(table, collective_sizes(table))
    assert summary["kind"].tolist() == ["all_reduce", "all_reduce"]  # DDP issues nothing else
    assert summary["calls"].tolist() == [3, 3]  # two buckets, then the logged loss
    assert summary["bytes"].tolist() == [4 * TINY_N + 4] * 2
    for rank in (0, 1):
        mine = calls[calls["rank"] == rank]
        assert mine["bytes"].tolist() == [4 * FIRST_BUCKET, 4 * (TINY_N - FIRST_BUCKET), 4]
        assert set(mine["op"]) == {"c10d::allreduce_"} and set(mine["name"]) == {"gloo:all_reduce"}
        # time_ms: the gloo ranges' durations, summed here from the JSON independently.
        raw = [e["dur"] for e in _rank_events(run_dir, rank) if e["name"] == "gloo:all_reduce"]
        assert summary.loc[summary["rank"] == rank, "time_ms"].item() == pytest.approx(sum(raw) / 1e3, abs=1e-3)
        # The second bucket holds the embedding, whose gradient comes last: it is issued when backward
        # has no compute left, and the training thread waits for it (measured 98.9 to 99.7 % on a quiet
        # machine; the bound leaves room for a loaded one, where the gloo thread may start late).
        last = mine.iloc[1]
        assert last["exposed_ns"] >= 0.5 * last["dur_ns"]
        assert (mine["exposed_ns"] <= mine["dur_ns"]).all()


@needs_gloo
def test_fsdp_zero3_gathers_every_unit_twice_and_scatters_once(runs):
    _, table, calls, _ = runs["zero3"]
    summary = collective_table(table, collective_sizes(table)).set_index(["rank", "kind"])
    for rank in (0, 1):
        assert summary.loc[(rank, "all_gather"), "calls"] == 10  # 5 units x (forward, backward)
        assert summary.loc[(rank, "reduce_scatter"), "calls"] == 5
        assert summary.loc[(rank, "all_reduce"), "calls"] == 1  # the logged loss
        assert summary.loc[(rank, "all_gather"), "bytes"] == 2 * 4 * TINY_N
        assert summary.loc[(rank, "reduce_scatter"), "bytes"] == 4 * TINY_N
        mine = calls[calls["rank"] == rank]
        gathers = mine[mine["kind"] == "all_gather"]["bytes"].tolist()
        assert sorted(gathers) == sorted([4 * TINY_ROOT] * 2 + [4 * TINY_BLOCK] * 8)
        # Gloo runs FSDP's reduce-scatter as an all-reduce of the whole unsharded gradient buffer.
        scatters = mine[mine["kind"] == "reduce_scatter"]
        assert set(scatters["op"]) == {"c10d::_reduce_scatter_base_"} and set(scatters["name"]) == {"gloo:all_reduce"}
        # On the CPU FSDP2 overlaps nothing: the training thread waits for each collective to finish
        # before its next op (measured: exposed = time to the nanosecond in the 4 launches so far).
        for kind in ("all_gather", "reduce_scatter"):
            row = summary.loc[(rank, kind)]
            assert row["exposed_ms"] == pytest.approx(row["time_ms"], rel=0.02)


@needs_gloo
def test_pipeline_sends_activations_and_measures_its_bubble(runs):
    run_dir, table, calls, recorded = runs["pp"]
    setup = setup_from_dict(recorded)
    assert (setup.parallel.pp, setup.grad_accum) == (2, 2)
    summary = collective_table(table).set_index(["rank", "kind"])
    for rank in (0, 1):
        # Two micro-batches: each rank sends 2 and receives 2 activations or their gradients, and
        # all-reduces the tied embedding's gradient (first and last stage) and the loss.
        assert summary.loc[(rank, "send"), "calls"] == 2 and summary.loc[(rank, "recv"), "calls"] == 2
        assert summary.loc[(rank, "all_reduce"), "calls"] == 2
        assert np.isnan(summary.loc[(rank, "send"), "bytes"])  # no sizes given: the table keeps no shapes
        mine = calls[calls["rank"] == rank]
        p2p = mine[mine["kind"].isin(["send", "recv"])]
        assert p2p["bytes"].tolist() == [ACTIVATION_BYTES] * 4
        assert sorted(mine.loc[mine["kind"] == "all_reduce", "bytes"]) == [4, 4 * 8192 * 256]
    bubble = pipeline_bubble(table, setup)
    assert bubble["stage"].tolist() == [0, 1] and (bubble["analytic_bubble_frac"] == 0.5).all()
    assert bubble["makespan_ms"].nunique() == 1  # one pipeline, one makespan
    for row in bubble.itertuples():
        # compute: the rank's forward/backward chunk ranges, summed here from the JSON (they do not nest).
        raw = [e["dur"] for e in _rank_events(run_dir, row.rank) if e["name"] in ("forward", "backward")]
        assert len(raw) == (4 if row.stage == 0 else 6)  # 2 forward + 2 backward chunks; the last stage's loss
        assert row.compute_ms == pytest.approx(sum(raw) / 1e3, abs=1e-3)
        assert row.bubble_ms == pytest.approx(row.makespan_ms - row.compute_ms)
        assert row.bubble_frac == pytest.approx(row.bubble_ms / row.compute_ms)
    with pytest.raises(AdvisorError, match=r"parallel.pp=1: the pipeline bubble needs"):
        pipeline_bubble(table, make_setup(**BASE))


@needs_traces
def test_nccl_sendrecv_kernels_take_their_kind_from_the_launching_op():
    path = KINETO / "trace_filter"
    table = load_trace(path)
    summary = collective_table(table, collective_sizes(table)).set_index(["rank", "kind"])
    # Every NCCL kernel in this trace is ncclKernel_SendRecv; the c10d op around each launch says what
    # it is: per rank 4 alltoall_base_, 4 allreduce_, 2 _allgather_base_ (counted in the JSON).
    assert summary["calls"].to_dict() == {
        (r, k): n for r in (0, 1) for k, n in (("all_gather", 2), ("all_reduce", 4), ("all_to_all", 4))
    }
    overlap = comm_comp_overlap(table).set_index("rank")
    for rank in (0, 1):
        raw = [
            e["dur"]
            for e in _raw_events(path / f"sampled_rank-{rank}.json.gz")
            if e.get("cat") == "kernel" and e["name"].startswith("ncclKernel_SendRecv")
        ]
        # 10 kernels per rank, summed by hand: 396,199 us on rank 0, 379,053 us on rank 1.
        assert len(raw) == 10 and sum(raw) == {0: 396_199, 1: 379_053}[rank]
        assert summary.loc[rank, "time_ms"].sum() == pytest.approx(sum(raw) / 1e3, abs=1e-6)
        # Exposed = communication not overlapped by computation: the overlap analysis' complement
        # (its kernels do not overlap one another here, so sum and union agree).
        comm, hidden = overlap.loc[rank, "comm_ns"], overlap.loc[rank, "overlap_ns"]
        assert summary.loc[rank, "exposed_ms"].sum() == pytest.approx((comm - hidden) / 1e6, abs=1e-6)
    # Sizes: the all-reduces' nccl:all_reduce ranges record 19,618,307 + 26,955,536 + 26,258,430 +
    # 5,716,654 floats on rank 0 (the c10d op records none); the all-gathers' c10d op 2 x 1 GiB of int8.
    assert summary.loc[(0, "all_reduce"), "bytes"] == 4 * (19_618_307 + 26_955_536 + 26_258_430 + 5_716_654)
    assert summary.loc[(0, "all_gather"), "bytes"] == 2 * 2**30


@needs_traces
def test_nccl_kernel_message_sizes_and_exposure_on_an_a100_trace():
    path = KINETO / "nccl_parser_config"
    table = load_trace(path)
    summary = collective_table(table, collective_sizes(table)).set_index("kind")
    raw = [e for e in _raw_events(path / "nccl_data.json.gz") if e.get("cat") == "kernel" and "ncclKernel" in e["name"]]
    for kind, prefix in (("all_reduce", "ncclKernel_AllReduce"), ("broadcast", "ncclKernel_Broadcast")):
        mine = [e for e in raw if e["name"].startswith(prefix)]
        assert summary.loc[kind, "calls"] == len(mine) == {"all_reduce": 15, "broadcast": 6}[kind]
        assert summary.loc[kind, "time_ms"] == pytest.approx(sum(e["dur"] for e in mine) / 1e3, abs=1e-6)
        size = {"Float": 4, "Long": 8}  # the dtypes its kernels carry
        assert summary.loc[kind, "bytes"] == sum(e["args"]["In msg nelems"] * size[e["args"]["dtype"]] for e in mine)
    assert summary["bytes"].tolist() == [306_684_384, 638_712]
    # HTA reference (reference/nccl_parser_config): 14.31 % of communication overlaps computation.
    exposed_frac = summary["exposed_ms"].sum() / summary["time_ms"].sum()
    assert 1 - exposed_frac == pytest.approx(0.1431, abs=0.02)
