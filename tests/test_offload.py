"""Activation offload, partial recompute and op-level checkpointing in the real step and the dry run.

On a CPU the offload hooks copy each saved tensor into a separate host buffer and back (pinned memory
needs an accelerator), so the whole path runs here although it saves nothing; the GPU test below runs
where CUDA is.
"""

import gzip
import json
import statistics
from dataclasses import replace

import pytest
import torch

from advisor.errors import SpecError
from advisor.estimate.estimator import estimate, offloaded_activation_bytes
from advisor.present.report import offload_line
from advisor.run.dryrun import DISTRIBUTED_MIN_TORCH, dry_run, torch_release
from advisor.run.launcher import profile_run
from advisor.run.memprobe import measure_step_peak_bytes
from advisor.run.model import build_model
from advisor.run.offload import ActivationOffloader, offloaded_blocks, parameter_derived
from advisor.run.step import build_trainer, make_loader
from advisor.spec.options import RunOptions
from advisor.spec.setup import make_setup
from advisor.store.runstore import RunStore

CPU = torch.device("cpu")
MiB = 2**20


def _setup(gpu="cpu", **kw):
    values = {"model": "tiny", "seq": 128, "micro_batch": 2, "precision": "fp32", "optimizer_impl": "foreach"}
    return make_setup(gpu=gpu, framework="pytorch", **(values | kw))


def _loss_and_grads(setup, device=CPU):
    trainer = build_trainer(setup, device)
    batch = next(iter(make_loader(setup, 1, 0, False, 0))).to(device)
    with trainer.autocast():
        loss = trainer.model(batch[:, :-1], batch[:, 1:])
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}
    return trainer, loss.detach(), grads


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", [{}, {"recompute": "full", "recompute_layers": 2}])
def test_offloaded_blocks_give_the_same_loss_and_gradients_bitwise(precision, recompute):
    _, loss, grads = _loss_and_grads(_setup(precision=precision, **recompute))
    trainer, loss_off, grads_off = _loss_and_grads(_setup(precision=precision, offload_activations=2, **recompute))
    assert torch.equal(loss, loss_off)
    assert grads.keys() == grads_off.keys() and all(torch.equal(grads[k], grads_off[k]) for k in grads)
    stats = trainer.offloader.stats()
    assert stats.bytes_restored == stats.bytes_offloaded > 0 and stats.blocks == 2
    assert not stats.pinned and stats.exposed_ms >= stats.copy_out_ms + stats.copy_in_ms > 0  # hooks run inline


@pytest.mark.parametrize(("precision", "tolerance"), [("fp32", 0.001), ("bf16", 0.01)])
def test_offloaded_bytes_equal_the_estimates_count_for_those_blocks(precision, tolerance):
    setup = _setup(precision=precision, offload_activations=2)
    trainer, _, _ = _loss_and_grads(setup)
    stats = trainer.offloader.stats()
    # Measured: fp32 +0.04 % (the RMSNorms' 4-byte inverse roots), bf16 +0.5 % (autocast's 16-bit
    # copies of the RoPE tables, made inside each block). Every saved tensor is moved once, however
    # many ops save it: without that, fp32 read +24 %.
    assert stats.bytes_offloaded == pytest.approx(offloaded_activation_bytes(setup), rel=tolerance)
    assert stats.host_bytes == stats.bytes_offloaded  # on a CPU the copies are freed as they come back


def test_offloaded_blocks_follow_the_recomputing_ones():
    assert offloaded_blocks(8, "none", 0, 3) == {0, 1, 2}
    assert offloaded_blocks(8, "full", 2, 3) == {2, 3, 4}
    assert offloaded_blocks(4, "none", 0, 9) == {0, 1, 2, 3}


def test_parameters_and_their_casts_stay_where_they_are():
    w = torch.nn.Parameter(torch.randn(4, 4))
    x = torch.randn(4, 4, requires_grad=True)
    assert parameter_derived(w) and parameter_derived(w.to(torch.bfloat16)) and parameter_derived(w.t())
    assert not parameter_derived(x * 2) and not parameter_derived(w @ x) and not parameter_derived(torch.randn(3))


def test_the_gradient_accumulating_step_offloads_each_micro_batch():
    setup = _setup(global_batch=4, offload_activations=1)
    trainer = build_trainer(setup, CPU)
    batches = iter(make_loader(setup, 4, 0, False, 0))
    trainer.step(batches)
    trainer.step(batches)
    assert len(trainer.offload_stats) == 2
    per_step = trainer.offload_stats[-1]
    assert per_step.bytes_offloaded == pytest.approx(2 * offloaded_activation_bytes(setup), rel=0.001)
    assert per_step.copy_out_ms > 0 and per_step.copy_in_ms > 0


@pytest.mark.slow  # starts a child process or runs seconds of real steps
@pytest.mark.parametrize(
    "kw",
    [
        {"offload_activations": 2},
        {"recompute": "full", "recompute_layers": 2, "offload_activations": 1},
        {"precision": "bf16", "global_batch": 4, "offload_activations": 3},
    ],
)
def test_dry_run_with_offload_matches_the_measured_step_and_leaves_the_device(kw):
    setup = _setup(seq=256, **kw)
    trainer = build_trainer(setup, CPU)
    measured = measure_step_peak_bytes(
        trainer, iter(make_loader(setup, 2 * setup.grad_accum, 0, False, 0)), warmup_steps=1
    )
    dry = dry_run(setup)
    assert dry.peak_bytes == pytest.approx(measured, rel=0.01)  # measured within 0.01 %
    # On a GPU target the same step leaves every offloaded byte off the device at its peak (backward
    # begins with nothing offloaded on the GPU), and the host holds one micro-batch's copies.
    gpu_setup = _setup(gpu="h100", seq=256, **kw)
    no_offload = _setup(gpu="h100", seq=256, **{k: v for k, v in kw.items() if k != "offload_activations"})
    on_gpu, without = dry_run(gpu_setup, target="cuda"), dry_run(no_offload, target="cuda")
    moved = trainer.offload_stats[-1].bytes_offloaded // setup.grad_accum
    # The CUDA target runs CUDA's fused RMSNorm, which does not save the fp32 x * rstd the CPU composite
    # keeps: 2 norms x 512 tokens x 256 units x 4 bytes less a block.
    blocks = kw["offload_activations"]
    assert moved - on_gpu.host_bytes == blocks * 2 * 512 * 256 * 4
    assert without.peak_bytes - on_gpu.peak_bytes == pytest.approx(on_gpu.host_bytes, rel=0.01)
    assert any("activation offload" in n for n in on_gpu.notes)
    # The estimator counts the same blocks' bytes (on this CPU within 1 %), and on the GPU moves its own
    # count for them (a GPU's fused RMSNorm keeps 8 bytes a token per norm less than the CPU's composite)
    # off the device and onto the host.
    assert offloaded_activation_bytes(setup) == pytest.approx(moved, rel=0.01)
    est, est_without = estimate(gpu_setup), estimate(no_offload)
    on_host = offloaded_activation_bytes(gpu_setup)
    assert on_gpu.host_bytes == pytest.approx(on_host, rel=0.01)  # 0.04, 0.04 and 0.6 % apart
    assert est.memory.host_bytes == pytest.approx(on_host)
    assert est_without.memory.activations_bytes - est.memory.activations_bytes == pytest.approx(on_host)


@pytest.mark.slow  # starts a child process or runs seconds of real steps
@pytest.mark.parametrize(
    ("recompute", "layers"),
    [("full", 2), ("selective-op", 0), ("full", 1)],
)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_partial_and_op_level_recompute_lower_the_peak_as_dry_run_and_estimate_say(recompute, layers, precision):
    base = _setup(seq=256, precision=precision)
    setup = _setup(seq=256, precision=precision, recompute=recompute, recompute_layers=layers)

    def measured(s):
        batches = iter(make_loader(s, 2, 0, False, 0))
        return measure_step_peak_bytes(build_trainer(s, CPU), batches, warmup_steps=1)

    m0, m1 = measured(base), measured(setup)
    d0, d1 = dry_run(base).peak_bytes, dry_run(setup).peak_bytes
    e0, e1 = estimate(base).memory.total_bytes, estimate(setup).memory.total_bytes
    assert m1 < m0
    # Measured on tiny: the dry run within 0.02 % of each peak, the estimate within 0.6 %; so their
    # drops agree with the measured one within 1 % of the peak (the dry run's target).
    assert d0 - d1 == pytest.approx(m0 - m1, abs=0.01 * m0)
    assert e0 - e1 == pytest.approx(m0 - m1, abs=0.01 * m0)
    assert d1 == pytest.approx(m1, rel=0.01) and e1 == pytest.approx(m1, rel=0.01)


def test_partial_recompute_checkpoints_the_first_blocks_and_op_level_is_exact():
    spec = _setup().model
    model = build_model(spec, "full", recompute_layers=3)
    assert [model.recomputes(i) for i in range(4)] == [True, True, True, False]
    with pytest.raises(ValueError, match="recompute_layers=2"):
        build_model(spec, "selective", recompute_layers=2)
    # Recomputing replays the same kernels on the same inputs: gradients bitwise equal.
    _, loss, grads = _loss_and_grads(_setup())
    for kw in ({"recompute": "selective-op"}, {"recompute": "full", "recompute_layers": 2}):
        _, loss_r, grads_r = _loss_and_grads(_setup(**kw))
        assert torch.equal(loss, loss_r) and all(torch.equal(grads[k], grads_r[k]) for k in grads)


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"recompute": "selective", "offload_activations": 1}, "recompute='selective' keeps them in checkpointed"),
        ({"recompute": "selective-op", "offload_activations": 1}, "recompute='selective-op'"),
        ({"compile": True, "offload_activations": 1}, "offload runs in eager mode only"),
    ],
)
def test_offload_where_the_hooks_cannot_work_is_refused_before_a_run(tmp_path, kw, words):
    setup = _setup(**kw)
    with pytest.raises(SpecError, match=words):
        build_trainer(setup, CPU)
    with pytest.raises(SpecError, match=words):
        dry_run(setup)
    store = RunStore(tmp_path)
    with pytest.raises(SpecError, match=words):
        profile_run(setup, RunOptions(device="cpu", steps=1, warmup=0, compile=setup.train.compile), store)
    assert store.list_runs() == ([], [])


def test_a_loss_compiled_apart_from_the_model_is_estimated_only():
    # torchtitan's December 2024 step compiled its blocks, not its loss; this project's step compiles both.
    setup = _setup(compile=True)
    blocks_only = replace(setup, train=replace(setup.train, compile_loss=False))
    with pytest.raises(
        SpecError, match=r"train.compile_loss=False: the profiled step compiles the model with its loss"
    ):
        build_trainer(blocks_only, CPU)
    with pytest.raises(SpecError, match="estimated only"):
        dry_run(replace(setup, train=replace(setup.train, compile=False, compile_loss=True)))


@pytest.mark.slow  # starts a child process or runs seconds of real steps
def test_a_profiled_run_reports_the_offload_it_measured(tmp_path):
    setup = _setup(offload_activations=2, recompute="full", recompute_layers=1)
    run = profile_run(setup, RunOptions(device="cpu", steps=2, warmup=0), RunStore(tmp_path))
    assert run.status == "ok", run.record["message"]
    m = run.metrics()
    off = m["activation_offload"]
    assert (m["offload_activations"], m["recompute_layers"], off["blocks"]) == (2, 1, 2)
    assert off["bytes_offloaded"] == off["bytes_restored"] == pytest.approx(off["estimate_bytes"], rel=0.001)
    assert off["copy_out_ms"] > 0 and off["out_gb_per_s"] > 0 and off["host_bytes"] > 0
    assert "--offload-activations 2" in run.record["command"] and "--recompute-layers 1" in run.record["command"]
    # On a CPU the run also timed 3 pairs of steps with the offload on and off: its whole cost.
    assert off["reference_pairs"] == 3 and len(off["pair_costs_ms"]) == 3
    assert off["step_cost_ms"] == pytest.approx(statistics.median(off["pair_costs_ms"]))
    assert off["step_with_ms"] > 0 and off["step_without_ms"] > 0
    line = offload_line(off)
    # The cost is the median of the pairs' differences, which need not be the medians' difference.
    assert f"it costs {off['step_cost_ms']:.1f} ms a step (median of 3 alternating pairs' differences; " in line
    assert f"without {off['step_without_ms']:.1f} ms)" in line
    assert "it costs" not in offload_line({k: v for k, v in off.items() if k != "step_cost_ms"})
    # Their losses are not the run's: one per step of its schedule (warm-up, rehearsal, timed, profiled).
    assert len(m["losses"]) == 1 + 2 + 2 + 0 + 2
    with gzip.open(run.path / "trace.json.gz", "rt") as f:
        names = {e["name"] for e in json.load(f)["traceEvents"] if e.get("cat") == "user_annotation"}
    assert {"act_offload", "act_reload"} <= names  # the copies' ranges, as Nsight Systems sees them too


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: pinned copies on a side stream")
def test_on_a_gpu_the_copies_are_pinned_overlapped_and_exact():
    device = torch.device("cuda")
    setup = _setup(gpu="h100", precision="bf16", seq=512, micro_batch=4, offload_activations=2)
    _, loss, grads = _loss_and_grads(_setup(gpu="h100", precision="bf16", seq=512, micro_batch=4), device)
    trainer, loss_off, grads_off = _loss_and_grads(setup, device)
    torch.cuda.synchronize()
    assert torch.equal(loss, loss_off) and all(torch.equal(grads[k], grads_off[k]) for k in grads)
    stats = trainer.offloader.stats()
    assert stats.pinned and stats.bytes_offloaded == stats.bytes_restored > 0
    assert stats.copy_out_ms > 0 and stats.exposed_ms >= 0 and stats.host_bytes >= stats.bytes_offloaded
    assert isinstance(trainer.offloader, ActivationOffloader)


@pytest.mark.slow  # the distributed dry run starts a child process
@pytest.mark.skipif(
    torch_release() < DISTRIBUTED_MIN_TORCH, reason=f"the distributed dry run needs torch >= {DISTRIBUTED_MIN_TORCH}"
)
def test_the_distributed_dry_run_offloads_as_the_real_run_does():
    # FSDP2 over 8 ranks (a fake process group): the offloaded blocks leave each rank's device at the
    # peak and sit on the host, one micro-batch's worth; on a CPU target nothing is saved.
    kw = {"gpus": 8, "zero": 3, "seq": 256, "precision": "bf16", "global_batch": 32}
    on, off = _setup(gpu="h100", offload_activations=2, **kw), _setup(gpu="h100", **kw)
    dry_on, dry_off = dry_run(on, target="cuda"), dry_run(off, target="cuda")
    assert dry_on.host_bytes > 0 and any("activation offload: 2 blocks" in n for n in dry_on.notes)
    assert dry_off.peak_bytes - dry_on.peak_bytes == pytest.approx(dry_on.host_bytes, rel=0.02)
    cpu_on, cpu_off = _setup(offload_activations=2, **kw), _setup(**kw)
    assert dry_run(cpu_on).peak_bytes == pytest.approx(dry_run(cpu_off).peak_bytes, rel=0.01)


def test_the_offloads_cost_on_a_cpu_is_timed_against_steps_without_it(monkeypatch):
    # A stub trainer whose step takes 10 ms with the offloader attached and 7 ms without, the off steps
    # drifting slower (a fake clock): after one untimed step, the pairs alternate on-off, off-on, on-off;
    # the cost is the median of the pairs' differences; the
    # offloader and the block runner are put back and the reference steps' losses dropped.
    import advisor.run.child as child

    clock = [0.0]
    monkeypatch.setattr(child.time, "perf_counter", lambda: clock[0])

    class Model:
        block_runner = "runner"

    class Trainer:
        def __init__(self):
            self.model, self.offloader, self.losses, self.order = Model(), "offloader", [1.0, 2.0], []

        def step(self, batches):
            on = self.offloader is not None
            assert (self.model.block_runner is not None) == on
            self.order.append(on)
            clock[0] += 0.010 if on else 0.007 + 0.001 * len(self.order)  # off steps drift slower
            clock[0] += 0.050 if len(self.order) == 1 else 0.0  # the first step after the profiler: slow
            self.losses.append(0.0)

    t = Trainer()
    out = child._offload_reference(t, iter(()), 3)
    # An untimed step with the offload on first: its 60 ms count nowhere.
    assert t.order == [True, True, False, False, True, True, False]
    # Off steps took 10, 11 and 14 ms (the drift); the pairs' differences 0, -1 and -4 ms.
    assert out["pair_costs_ms"] == pytest.approx([0.0, -1.0, -4.0])
    assert out["step_cost_ms"] == pytest.approx(-1.0) and out["step_with_ms"] == pytest.approx(10.0)
    assert out["step_without_ms"] == pytest.approx(11.0) and out["reference_pairs"] == 3
    assert (t.offloader, t.model.block_runner, t.losses) == ("offloader", "runner", [1.0, 2.0])
    assert child._offload_reference(t, iter(()), 0) == {}
