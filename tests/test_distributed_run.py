"""A distributed profiled run end to end: the parent launches torchrun, every rank traces its step,
rank 0 merges; plus the launch lines for one node and for several, and the errors that stop a
mismatched request before any process starts."""

import os
import sys

import pytest
import torch.distributed as dist

from advisor.errors import AdvisorError
from advisor.run.launcher import launcher, profile_cli_args, profile_run
from advisor.spec.options import RunOptions
from advisor.spec.setup import make_setup
from advisor.store.runstore import RunStore

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)
TINY_FSDP = {"model": "tiny", "gpu": "cpu", "gpus": 2, "zero": 3, "seq": 64, "micro_batch": 2, "precision": "fp32"}


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    store = RunStore(tmp_path_factory.mktemp("runs"))
    run = profile_run(make_setup(**TINY_FSDP), RunOptions(device="cpu", nproc=2, steps=1, warmup=0), store)
    return store, run


def test_two_processes_file_one_run_with_every_ranks_trace(fsdp_run):
    store, run = fsdp_run
    assert run.status == "ok", run.record["message"]
    assert sorted(p.name for p in (run.path / "ranks").iterdir()) == ["rank-0.trace.json.gz", "rank-1.trace.json.gz"]
    m = run.metrics()
    assert m["world_size"] == 2 and m["layout"] == "dp2 tp1 pp1, ZeRO-3 (FSDP2, reshard after forward)"
    assert len(m["rank_peak_memory_bytes"]) == 2 and m["peak_memory_bytes"] == max(m["rank_peak_memory_bytes"])
    assert m["step_time_ms"] == pytest.approx(max(m["rank_step_time_ms"]))
    # The trace analysis merged both ranks: two ranks, a skew between them.
    assert m["n_ranks"] == 2 and m["step_skew_pct"] is not None
    # One warm-up, one profiler rehearsal (a CPU run), one timed, one active step: four losses, a tiny
    # model's near ln(8192) = 9.01.
    assert m["profiler_rehearsal_steps"] == 1
    assert len(m["losses"]) == 4 and all(8.5 < x < 9.5 for x in m["losses"])
    # Global batch = micro-batch x dp = 4 sequences of 64 tokens.
    assert m["tokens_per_step"] == 4 * 64
    assert store.list_runs()[1] == []  # nothing damaged
    assert "--gpus 2" in run.record["command"] and "--nproc 2" in run.record["command"]


def test_the_run_folder_loads_as_every_rank(fsdp_run):
    from advisor.analysis.summary import load_trace

    _, run = fsdp_run
    table = load_trace(run.path)
    assert sorted(table["rank"].unique()) == [0, 1] and table.attrs["own_run"]
    # FSDP2 all-gathers parameters through gloo on its own threads: they show in both ranks' traces.
    names = set(table["name"].astype(str))
    assert "gloo:all_gather" in names and any(n.startswith("FSDP::all_gather") for n in names)


def test_the_app_shows_the_ranks(fsdp_run):
    pytest.importorskip("gradio")
    from webui import profile as profile_tab

    _, run = fsdp_run
    summary, *_, trace, _roofline = profile_tab.run_view(run)
    assert "**2 processes: dp2 tp1 pp1, ZeRO-3 (FSDP2, reshard after forward).**" in summary
    assert trace.endswith(os.path.join("ranks", "rank-0.trace.json.gz"))


def test_a_layout_that_does_not_match_the_processes_is_refused_before_launch(tmp_path):
    store = RunStore(tmp_path)
    with pytest.raises(AdvisorError, match=r"the layout needs 2 processes .* nproc\(1\) x nnodes\(1\) = 1"):
        profile_run(make_setup(**TINY_FSDP), RunOptions(device="cpu"), store)
    assert store.list_runs() == ([], [])


def test_launch_lines_for_one_node_and_for_several():
    assert launcher(RunOptions()) == [sys.executable]
    one = launcher(RunOptions(nproc=4))
    assert one[1:] == ["-m", "torch.distributed.run", "--nproc-per-node", "4", "--standalone"]
    many = RunOptions(nproc=8, nnodes=2, rdzv_endpoint="node0:29500", rdzv_id="job42")
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:29500", "--rdzv-id", "job42"]
    assert launcher(many)[4:] == ["8", "--nnodes", "2", *rdzv]
    setup = make_setup(model="tiny", gpu="h100", gpus=16, tp=2, zero=3, sequence_parallel=True)
    args = profile_cli_args(setup, many)
    assert args[args.index("--gpus") + 1] == "16" and "--sp" in args and args[args.index("--tp") + 1] == "2"
    assert args[-6:] == ["--nnodes", "2", "--rdzv-endpoint", "node0:29500", "--rdzv-id", "job42"]
    with pytest.raises(AdvisorError, match=r"rdzv_endpoint='': must be host:port when nnodes > 1"):
        RunOptions(nproc=8, nnodes=2)
    with pytest.raises(AdvisorError, match=r"rdzv_id='': must be a job id shared by every node"):
        RunOptions(nproc=8, nnodes=2, rdzv_endpoint="node0:29500")
    with pytest.raises(AdvisorError, match=r"nproc=0: must be an integer from 1 to 64"):
        RunOptions(nproc=0)


def test_the_profile_tab_runs_a_layout_on_several_processes(tmp_path, monkeypatch):
    pytest.importorskip("gradio")
    from webui import common
    from webui import profile as profile_tab

    monkeypatch.setattr(common, "store", lambda: RunStore(tmp_path))
    values = {**profile_tab.PROFILE_INPUTS, "device": "cpu", "seq": 64, "steps": 1, "precision": "fp32"}
    values |= {"nproc": 2, "zero": "0"}  # DDP over 2 processes
    summary = list(profile_tab.profile_view(**values))[-1][0]
    assert "**2 processes: dp2 tp1 pp1, DDP.**" in summary and "`: ok" in summary
    bad = list(profile_tab.profile_view(**{**values, "tp": "4"}))[-1][0]
    assert bad.startswith("### Invalid setup") and "multiple of tp x pp x cp = 4" in bad


def test_the_plan_tab_uses_the_measured_collective_bandwidth(fsdp_run, monkeypatch):
    pytest.importorskip("gradio")
    from webui import common
    from webui import plan as plan_tab

    store, run = fsdp_run
    monkeypatch.setattr(common, "store", lambda: store)
    _, table, explain, _ = plan_tab.plan_view("tiny", "cpu", 2, 64, 4, ["fp32"], False, True)
    assert len(table) > 0 and f"measured on run {run.run_id}" in explain
    _, _, plain, _ = plan_tab.plan_view("tiny", "cpu", 2, 64, 4, ["fp32"], False, False)
    assert "measured on run" not in plain


def test_a_rank_leaves_without_the_interpreters_finalisation(tmp_path, monkeypatch):
    """A rank's gloo process group outlives destroy_process_group (FSDP and the mesh hold it) and
    aborted the process when freed in finalisation: a rank now leaves by os._exit with its code;
    a single process returns normally."""
    from advisor.run import launcher as launcher_mod
    from advisor.run import parallel

    exits = []
    monkeypatch.setattr(launcher_mod, "_child_run", lambda run_dir: 3)
    monkeypatch.setattr(parallel.os, "_exit", lambda code: exits.append(code))
    monkeypatch.setenv("WORLD_SIZE", "2")
    launcher_mod.child_main(tmp_path)
    assert exits == [3]
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert launcher_mod.child_main(tmp_path) == 3 and exits == [3]
