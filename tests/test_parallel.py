"""The parallel step on gloo, really run: each layout's losses and updated weights equal the
single-process step's on the same samples, and its collectives show in the profiler.

Three torchrun launches run every layout (tests/parallel_worker.py): one with 2 processes (DDP, FSDP2
with and without resharding, TP, TP + SP, 1F1B and interleaved 1F1B pipelines), one with 3 (a
pipeline of 3 stages over 4 blocks) and one with 4 (FSDP x TP, PP x FSDP, PP x TP). Measured on 2
shared CPU cores: 40 to 75 s for the whole file, nearly all of it the launches, depending on the
machine's load.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from advisor.errors import AdvisorError, SpecError
from advisor.run.parallel import check_supported, stage_bounds
from advisor.run.step import build_trainer, make_loader
from advisor.spec.setup import make_setup
from advisor.spec.specs import Setup
from tests import parallel_worker as worker

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="needs torch.distributed with the gloo backend (this PyTorch build has none)",
)

ROOT = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")
TWO = [name for name, (n, _) in worker.LAYOUTS.items() if n == 2]
THREE = [name for name, (n, _) in worker.LAYOUTS.items() if n == 3]
FOUR = [name for name, (n, _) in worker.LAYOUTS.items() if n == 4]

# Which collectives each layout's step must issue (Shoeybi et al. 2019; Korthikanti et al. 2022;
# ZeRO: Rajbhandari et al. 2019). The pipelines also all-reduce the tied embedding's gradient.
EXPECTED_COMM = {
    "ddp": {"all_reduce"},
    "fsdp_zero3": {"all_gather", "reduce_scatter"},
    "fsdp_zero2": {"all_gather", "reduce_scatter"},
    "tp": {"all_reduce"},
    "tp_sp": {"all_gather", "reduce_scatter"},
    "tp_sp_gpt2": {"all_gather", "reduce_scatter", "all_reduce"},
    "tp_sp_sgd": {"all_gather", "reduce_scatter"},
    "fsdp_zero3_offload": {"all_gather", "reduce_scatter"},
    "tp_sp_offload": {"all_gather", "reduce_scatter"},
    "pp_1f1b": {"send", "recv", "all_reduce"},
    "pp_interleaved": {"send", "recv", "all_reduce"},
    "fsdp_tp": {"all_gather", "reduce_scatter"},
    "pp_fsdp": {"send", "recv", "all_gather", "reduce_scatter"},
    "pp_tp": {"send", "recv", "all_reduce"},
    "pp_uneven": {"send", "recv"},  # the middle stage holds neither copy of the tied embedding
}


def _launch(nproc: int, layouts: list[str], out_dir: Path) -> dict:
    """Run the worker under torchrun; the layouts' results as rank 0 wrote them."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += ["-m", "tests.parallel_worker", str(out_dir), *layouts]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((out_dir / "results.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, Path]:
    out_dir = tmp_path_factory.mktemp("parallel")
    results = _launch(2, TWO, out_dir) | _launch(3, THREE, out_dir) | _launch(4, FOUR, out_dir)
    return results, out_dir


@functools.cache
def _reference(setup: Setup) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and final weights of the single-process step over the same samples."""
    trainer = build_trainer(setup, CPU, seed=worker.SEED)
    batches = iter(make_loader(setup, worker.STEPS * setup.grad_accum, 0, False, worker.SEED))
    for _ in range(worker.STEPS):
        trainer.step(batches)
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters(remove_duplicate=False)}
    return trainer.losses, params


def _reference_for(name: str):
    return _reference(worker.reference_setup(name))


def _gathered_params(out_dir: Path, name: str) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for path in sorted(out_dir.glob(f"params-{name}-rank*.pt")):
        merged |= torch.load(path)
    return merged


@pytest.mark.parametrize("name", TWO + THREE + FOUR)
def test_layout_losses_and_weights_equal_the_single_process_step(runs, name):
    results, out_dir = runs
    ref_losses, ref_params = _reference_for(name)
    # fp32 on the same samples: only the summation order differs (gradient averaging, sharded
    # matmuls), measured below 1e-6 relative.
    assert results[name]["losses"] == pytest.approx(ref_losses, rel=1e-4)
    params = _gathered_params(out_dir, name)
    assert params.keys() == ref_params.keys()
    for key, ref in ref_params.items():
        diff = (params[key] - ref).abs()
        # 3 AdamW steps (lr 3e-4) move a weight by up to ~1e-3. AdamW moves each weight by about
        # lr x sign(grad) at first, so a weight whose gradient is near zero (comparable to eps=1e-8)
        # moves differently when the summation order changes: measured, at most 0.01 % of a tensor's
        # weights differ by more than 1e-6, none by more than 2e-5. A wrong or missing gradient
        # reduction shifts most weights of a tensor.
        assert diff.max() <= 5e-5, f"{name} {key}: max difference {diff.max():.2e}"
        if key.endswith("k_proj.bias"):
            # Its gradient is zero in exact arithmetic (q.(k + b) shifts every score of a query by the
            # same q.b, and softmax ignores shifts): only rounding noise g is left, which AdamW turns
            # into steps of about lr x |g| / eps that follow the summation order, so only the bound above
            # applies.
            continue
        off = int((diff > 1e-6).sum())
        assert off <= max(2, ref.numel() // 1000), f"{name} {key}: {off} of {ref.numel()} weights differ by > 1e-6"


def test_offload_moves_activations_under_fsdp2_and_tensor_parallelism(runs):
    # The two offload layouts' losses and weights equal the single-process step's (the test above);
    # here, their steps moved activations: FSDP2's plain tensors, TP+SP's DTensor shards.
    results, _ = runs
    assert results["fsdp_zero3_offload"]["offloaded_bytes"] > 0 and results["tp_sp_offload"]["offloaded_bytes"] > 0
    assert all(results[n]["offloaded_bytes"] == 0 for n in results if "offload" not in n)


def test_offload_in_a_pipeline_is_refused_with_the_reason():
    setup = make_setup(model="tiny", gpu="cpu", gpus=2, pp=2, global_batch=4, offload_activations=1)
    with pytest.raises(SpecError, match=r"pipelined step .* does not offload them yet"):
        check_supported(setup, "cpu")


@pytest.mark.parametrize("name", TWO + THREE + FOUR)
def test_layout_collectives_show_in_the_profiler(runs, name):
    results, _ = runs
    processes, _ = worker.LAYOUTS[name]
    assert len(results[name]["comm"]) == processes  # one record per rank of the layout, none missing
    for rank, comm in enumerate(results[name]["comm"]):
        seen = {kind for kind, names in comm.items() if names}
        assert EXPECTED_COMM[name] <= seen, f"{name} rank {rank}: saw {sorted(seen)}"


def test_single_layouts_issue_no_other_collectives(runs):
    results, _ = runs
    # Plain DDP never gathers or scatters; plain TP (no SP) never reduce-scatters; PP alone moves
    # activations point to point and sends nothing over FSDP's collectives.
    assert not any(results["ddp"]["comm"][0][k] for k in ("all_gather", "reduce_scatter", "send", "recv"))
    assert not results["tp"]["comm"][0]["reduce_scatter"]
    assert not any(results["pp_1f1b"]["comm"][0][k] for k in ("all_gather", "reduce_scatter"))


def test_uneven_pipeline_stages_hold_their_blocks(runs):
    # Tiny's 4 blocks on 3 stages: the balanced split gives the middle stage two. Only the ends hold
    # the tied embedding (the first as embedding, the last as head) and all-reduce its gradient.
    results, out_dir = runs
    setup = worker.layout_setup("pp_uneven")
    assert stage_bounds(setup) == [0, 1, 3, 4]
    # What each rank's stage held after its steps (params-pp_uneven-rank<r>.pt, under the single-process
    # model's names): blocks 0, then 1 and 2, then 3; the embedding on the first, the head on the last.
    held = [torch.load(out_dir / f"params-pp_uneven-rank{r}.pt") for r in range(3)]
    blocks = [sorted({int(k.split(".")[1]) for k in h if k.startswith("blocks.")}) for h in held]
    assert blocks == [[0], [1, 2], [3]]
    outside = [sorted({k.split(".")[0] for k in h} - {"blocks"}) for h in held]
    assert outside[0] == ["embed"] and outside[1] == [] and "head" in outside[2] and "embed" not in outside[2]
    comm = results["pp_uneven"]["comm"]
    assert [bool(c["all_reduce"]) for c in comm] == [True, False, True]


def test_pipeline_reports_its_wait_phase(runs):
    results, _ = runs
    assert results["pp_1f1b"]["phases"] == sorted(["data", "forward", "backward", "pipeline_wait", "optimizer"])
    assert results["ddp"]["phases"] == sorted(["data", "forward", "backward", "optimizer"])


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"gpus": 2, "cp": 2}, "parallel.cp"),
        ({"model": "tiny-moe", "gpus": 2, "ep": 2}, "parallel.ep"),
        ({"gpus": 4, "tp": 2}, "parallel.zero"),
        ({"gpus": 2, "pp": 2, "tp": 1, "global_batch": 4, "precision": "fp16"}, "train.precision"),
        ({"gpus": 2, "zero": 3, "offload": "optimizer+params"}, "parallel.offload"),
        ({"gpus": 2, "zero": 3, "optimizer": "sgd"}, "train.optimizer_impl"),  # fused SGD on DTensors
        ({"gpus": 4, "pp": 2, "tp": 2, "sequence_parallel": True}, "parallel.sequence_parallel"),
        ({"model": "tiny-moe", "gpus": 2, "zero": 3}, "parallel.zero"),
        ({"model": "tiny-moe", "gpus": 2, "pp": 2}, "parallel.pp"),
    ],
)
def test_unsupported_layouts_are_refused_before_any_process_group(overrides, field):
    from advisor.run.parallel import check_supported

    setup = make_setup(**(worker.BASE | {"gpu": "h100"} | overrides))
    with pytest.raises(AdvisorError, match=field):
        check_supported(setup, "cpu")


def test_heads_must_split_evenly_over_tp():
    from advisor.run.parallel import check_supported
    from advisor.spec.presets import get_model

    spec = get_model("tiny")  # 8 query heads, 4 key/value heads
    setup = make_setup(**(worker.BASE | {"model": spec, "gpus": 8, "tp": 8, "zero": 3}))
    with pytest.raises(AdvisorError, match=r"parallel.tp=8: model.n_kv_heads=4 must be divisible by tp"):
        check_supported(setup, "cpu")


def test_init_parallel_outside_torchrun_says_how_to_launch(monkeypatch):
    from advisor.run.parallel import init_parallel

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(AdvisorError, match=r"RANK is not set: .*torchrun"):
        init_parallel(make_setup(**(worker.BASE | {"gpus": 2})), "cpu")


def test_init_parallel_checks_the_world_size(monkeypatch):
    from advisor.run.parallel import init_parallel

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(AdvisorError, match=r"= 2 processes, but torchrun started WORLD_SIZE=4"):
        init_parallel(make_setup(**(worker.BASE | {"gpus": 2})), "cpu")


def test_rank_loaders_partition_the_single_process_batches():
    from advisor.run.parallel import rank_loader

    setup = worker.layout_setup("ddp")  # dp 2, micro_batch 2, grad_accum 2
    ref = worker.reference_setup("ddp")
    single = list(make_loader(ref, 2 * ref.grad_accum, 0, False, seed=5))
    ranks = [list(rank_loader(setup, _info(dp=2, dp_rank=r), 2, 0, False, seed=5)) for r in range(2)]
    assert len(single) == len(ranks[0]) == len(ranks[1]) == 4
    for j, batch in enumerate(single):
        assert torch.equal(torch.cat([ranks[0][j], ranks[1][j]]), batch)


def test_middle_pipeline_stages_read_no_data():
    from advisor.run.parallel import rank_loader

    setup = make_setup(**(worker.BASE | {"gpus": 4, "pp": 4, "global_batch": 8}))
    loaders = [rank_loader(setup, _info(pp=4, pp_rank=r), 1, 0, False, seed=0) for r in range(4)]
    assert [len(loader) for loader in loaders] == [4, 0, 0, 4]


def _info(*, pp=1, dp=1, tp=1, pp_rank=0, dp_rank=0, tp_rank=0):
    """A ParallelInfo for the data helpers, which read only its coordinates (no process group)."""
    from advisor.run.parallel import ParallelInfo

    world = pp * dp * tp
    rank = (pp_rank * dp + dp_rank) * tp + tp_rank
    return ParallelInfo(
        rank=rank,
        world_size=world,
        local_rank=rank,
        device=CPU,
        backend="gloo",
        mesh=None,
        pp=pp,
        dp=dp,
        tp=tp,
        pp_rank=pp_rank,
        dp_rank=dp_rank,
        tp_rank=tp_rank,
    )


def test_a_vocabulary_too_small_for_tp_is_refused():
    # 5 rows over 4 TP ranks split as torch.chunk does: 2, 2, 1, 0; the last rank would hold none.
    from dataclasses import replace

    from advisor.run.parallel import check_supported
    from advisor.spec.presets import get_model

    setup = make_setup(**(worker.BASE | {"model": replace(get_model("tiny"), vocab=5), "gpus": 4, "tp": 4, "zero": 3}))
    with pytest.raises(AdvisorError, match=r"model.vocab=5 leaves the last TP rank no vocabulary rows .* use tp <= 3"):
        check_supported(setup, "cpu")
