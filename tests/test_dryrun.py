"""The dry run against the measured CPU step, against hand-counted bytes, and against the estimator."""

import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from advisor.cli import main
from advisor.errors import AdvisorError
from advisor.estimate.estimator import estimate
from advisor.run.dryrun import DISTRIBUTED_MIN_TORCH, dry_run, dry_run_distributed, format_dry_run, torch_release
from advisor.run.memprobe import measure_step_peak_bytes
from advisor.run.model import build_model
from advisor.run.step import build_trainer, make_loader
from advisor.spec.presets import get_hardware, get_model
from advisor.spec.setup import make_setup
from tests import dryrun_worker

ROOT = Path(__file__).resolve().parent.parent
N_8B = 8_030_261_248
TINY_N = 4_999_424
TINY_TENSORS = 38  # embedding (tied head) + 4 blocks x (q, k, v, o, gate, up, down, 2 norms) + final norm
LLAMA_8B_TENSORS = 291  # embedding + 32 blocks x 9 + final norm + head


FSDP_TRACKER = pytest.mark.skipif(
    torch_release() < DISTRIBUTED_MIN_TORCH,
    reason=f"the distributed dry run needs torch >= {DISTRIBUTED_MIN_TORCH} (its FSDPMemTracker); this is {torch.__version__}",
)


def tiny(**kw):
    return make_setup(model=kw.pop("model", "tiny"), gpu="cpu", **kw)


@pytest.mark.parametrize(
    ("model", "precision", "recompute", "micro_batch", "seq"),
    [
        ("tiny", "fp32", "none", 2, 128),
        ("tiny", "bf16", "full", 2, 256),
        ("tiny", "fp32", "selective", 4, 128),
        ("tiny-moe", "bf16", "none", 2, 128),
    ],
)
def test_dry_run_peak_matches_the_measured_cpu_step(model, precision, recompute, micro_batch, seq):
    setup = tiny(model=model, seq=seq, micro_batch=micro_batch, precision=precision, recompute=recompute)
    measured = measure_step_peak_bytes(
        build_trainer(setup, torch.device("cpu")), iter(make_loader(setup, 2, 0, False, 0)), warmup_steps=1
    )
    dry = dry_run(setup)
    # Measured here: within 0.02 % (tiny-moe: balanced routing, still within 1e-5 %).
    assert dry.peak_bytes == pytest.approx(measured, rel=0.01)
    assert sum(dry.at_peak_bytes.values()) == dry.peak_bytes == max(dry.peak_by_phase_bytes.values())


@pytest.mark.slow  # starts a child process or runs seconds of real steps
def test_gradient_accumulation_and_cpu_offload_match_the_measured_step():
    for kw, offload in (({"global_batch": 4}, False), ({}, True)):
        setup = tiny(seq=128, micro_batch=2, precision="bf16", **kw)
        trainer = build_trainer(setup, torch.device("cpu"), offload_optimizer=offload)
        batches = iter(make_loader(setup, 2 * setup.grad_accum, 0, False, 0))
        measured = measure_step_peak_bytes(trainer, batches, warmup_steps=1)
        assert dry_run(setup, offload_optimizer=offload).peak_bytes == pytest.approx(measured, rel=0.01)


def test_checkpointing_lowers_the_saved_activations_by_the_hand_counted_bytes():
    b, s, h, heads, layers, vocab = 2, 128, 256, 8, 4, 8192
    acts = {
        mode: dry_run(tiny(seq=s, micro_batch=b, precision="fp32", recompute=mode)).activations_bytes
        for mode in ("none", "selective", "full")
    }
    # Selective recompute drops, per block, the attention output (b, heads, s, head_dim) and the fp32
    # log-sum-exp (b, heads, s) that the CPU flash kernel saves.
    assert acts["none"] - acts["selective"] == layers * (b * s * h * 4 + b * heads * s * 4) == 1_081_344
    # Full recompute keeps the token batch, each block's input plus the last block's output (5 x b*s*h
    # fp32), the final RMSNorm's normalized input and output, and the loss's fp32 log-softmax.
    kept = b * (s + 1) * 8 + 5 * b * s * h * 4 + 2 * b * s * h * 4 + b * s * vocab * 4
    assert acts["full"] == pytest.approx(kept, rel=1e-3)
    assert acts["full"] < acts["selective"] < acts["none"]


@pytest.mark.slow  # starts a child process or runs seconds of real steps
def test_llama_8b_dry_run_allocates_nothing_and_counts_adamw_state_exactly():
    before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    setup = make_setup(model="llama-3.1-8b", gpu="h100", seq=1024, micro_batch=1, precision="bf16")
    dry = dry_run(setup, optimizer_impl="foreach")
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_kib
    assert grown_kib < 2**20  # under 1 GiB of host memory (measured: ~30 MiB) for a 150 GiB step
    # Autocast keeps fp32 parameters: 4-byte parameters and gradients, AdamW's two fp32 moments plus
    # a 4-byte step counter per parameter tensor.
    assert dry.params_bytes == 4 * N_8B
    assert dry.grads_bytes == 4 * N_8B
    assert dry.optimizer_bytes == 8 * N_8B + 4 * LLAMA_8B_TENSORS
    # The peak is the foreach AdamW step: parameters, gradients, states and one fp32 scratch list
    # (the square root of exp_avg_sq), plus the RoPE tables (2 x 1024 x 64 fp32), the token batch
    # (1 x 1025 int64) and the loss.
    assert dry.peak_phase == "optimizer"
    assert dry.peak_bytes == 20 * N_8B + 4 * LLAMA_8B_TENSORS + 2 * 1024 * 64 * 4 + 1025 * 8 + 4
    assert dry.temporaries_bytes == 4 * N_8B


def test_state_bytes_agree_with_the_estimator():
    fp32 = tiny(seq=128, micro_batch=2, precision="fp32")
    dry, est = dry_run(fp32), estimate(fp32).memory
    assert (dry.params_bytes, dry.grads_bytes) == (est.weights_bytes, est.grads_bytes) == (4 * TINY_N, 4 * TINY_N)
    assert dry.optimizer_bytes == est.optimizer_bytes + 4 * TINY_TENSORS
    # bf16: the estimator's Megatron-style step with 16-bit gradients keeps 2-byte weights and gradients
    # plus an fp32 master copy; the autocast step keeps fp32 parameters and gradients and no master
    # copy. Same 16 bytes per parameter in all. (Megatron's default fp32 main gradients make it 18.)
    bf16 = tiny(seq=128, micro_batch=2, precision="bf16", fp32_grads=False)
    dry, est = dry_run(bf16), estimate(bf16).memory
    assert (est.weights_bytes, est.grads_bytes, est.optimizer_bytes) == (2 * TINY_N, 2 * TINY_N, 12 * TINY_N)
    assert dry.params_bytes + dry.grads_bytes + dry.optimizer_bytes == 16 * TINY_N + 4 * TINY_TENSORS
    assert estimate(tiny(seq=128, micro_batch=2, precision="bf16")).memory.grads_bytes == 4 * TINY_N


@pytest.mark.slow  # starts a child process or runs seconds of real steps
def test_cuda_target_adds_the_runtime_allowance_and_keeps_offloaded_state_off_the_device():
    setup = make_setup(model="tiny", gpu="h100", seq=128, micro_batch=2, precision="bf16")
    cpu, cuda = dry_run(setup), dry_run(setup, target="cuda")
    # CUDA's fused RMSNorm saves its input and rstd; the CPU composite also the fp32 product x * rstd
    # for the weight's gradient: one fp32 (256 tokens x 256) tensor per norm, 9 norms (2 a block, final).
    assert cpu.peak_bytes - cuda.peak_bytes == 9 * 256 * 256 * 4
    # The eager step's fragmentation allowance, 10 % (fitted on torchtitan's and Trainy's published peaks).
    hw = get_hardware("h100")
    assert cuda.total_bytes == cuda.peak_bytes + hw.runtime_overhead_bytes + int(0.10 * cuda.peak_bytes)
    assert any("fake CPU tensors" in n for n in cuda.notes)
    off_cpu = dry_run(setup, offload_optimizer=True)
    off_cuda = dry_run(setup, offload_optimizer=True, target="cuda")
    # Host: fp32 master weights and their gradients (8 bytes) and AdamW's states (8 bytes + steps).
    assert off_cuda.host_bytes == off_cpu.host_bytes == 16 * TINY_N + 4 * TINY_TENSORS
    assert off_cuda.peak_phase == "backward"
    assert off_cuda.peak_bytes == off_cpu.peak_bytes - off_cpu.host_bytes - 9 * 256 * 256 * 4  # and the norms
    assert off_cuda.optimizer_bytes == 0


def test_text_and_json_forms():
    dry = dry_run(tiny(seq=128, micro_batch=1, precision="bf16", recompute="full"))
    text = format_dry_run(dry)
    assert "Peak tensor memory" in text and "recompute full" in text and "autocast" in text
    d = dry.as_dict()
    assert d["peak_bytes"] == dry.peak_bytes and d["total_bytes"] == dry.peak_bytes  # no overhead on the CPU
    assert d["at_peak_bytes"] == dry.at_peak_bytes and d["notes"] == list(dry.notes)
    assert any(n.startswith("bf16 runs as torch.autocast over fp32 parameters") for n in d["notes"])
    assert json.loads(json.dumps(d)) == d  # plain JSON, as `dryrun --json` prints it


@pytest.mark.parametrize(
    ("gpu", "precision", "target", "message"),
    [
        ("cpu", "bf16", "tpu", r"target='tpu': must be one of cpu, cuda"),
        ("cpu", "bf16", "cuda", r"target='cuda' takes its runtime allowance from a GPU spec"),
        ("h100", "fp8", "cpu", r"the dry run does not trace torchao.s float8 linears"),
    ],
)
def test_bad_input_raises_advisor_error(gpu, precision, target, message):
    setup = make_setup(model="tiny", gpu=gpu, seq=64, precision=precision)
    with pytest.raises(AdvisorError, match=message):
        dry_run(setup, target=target)


def test_non_setup_raises_advisor_error():
    with pytest.raises(AdvisorError, match=r"expected an advisor\.spec\.specs\.Setup"):
        dry_run("llama-3.1-8b")  # type: ignore[arg-type]


# --- the distributed dry run: data parallelism at any world size on a fake process group -----------

TINY_ROOT_PARAMS = 8192 * 256 + 256  # embedding (tied head) and final norm: the root FSDP unit
TINY_BLOCK_PARAMS = 2 * 256 * 256 + 2 * 128 * 256 + 3 * 688 * 256 + 2 * 256


def sharded_bytes(n: int) -> int:
    """fp32 bytes of rank 0's shards of the tiny model's parameters (the tied head once): FSDP2 splits
    each parameter's dim 0 into n chunks of ceil(dim0 / n) rows, padding the last ones."""
    shapes = [p.shape for p in build_model(get_model("tiny"), device="meta").parameters()]
    assert len(shapes) == TINY_TENSORS
    return 4 * sum(-(-shape[0] // n) * math.prod(shape[1:]) for shape in shapes)


def dp_setup(gpus: int, zero: int, **kw):
    return tiny(seq=128, micro_batch=2, precision=kw.pop("precision", "fp32"), gpus=gpus, zero=zero, **kw)


@FSDP_TRACKER
@pytest.mark.parametrize(("n", "hand_count"), [(8, 2_499_712), (64, 314_512), (1024, 43_812)])
def test_zero3_shards_parameters_gradients_and_adamw_state_by_the_padded_count(n, hand_count):
    # 8 divides every dim 0: 4 x TINY_N / 8. At 64 gate's and up's 688 rows pad to 11 x 64; at 1024 every
    # matrix keeps 1 row on rank 0 (the embedding 8).
    assert sharded_bytes(n) == hand_count
    start = time.perf_counter()
    dry = dry_run_distributed(dp_setup(n, 3), isolate=False)
    print(f"\n{n} ranks, ZeRO-3: {time.perf_counter() - start:.2f} s, peak {dry.peak_bytes / 2**20:.2f} MiB per rank")
    assert (dry.world_size, dry.zero) == (n, 3)
    assert dry.params_bytes == dry.grads_bytes == hand_count
    assert dry.optimizer_bytes == 2 * hand_count + 4 * TINY_TENSORS  # exp_avg, exp_avg_sq, 4-byte step


@pytest.mark.slow  # starts a child process or runs seconds of real steps
@FSDP_TRACKER
def test_zero3_peak_holds_the_root_and_one_gathered_block_and_falls_with_world_size():
    single = dry_run(tiny(seq=128, micro_batch=2, precision="fp32"))
    by_n = {n: dry_run_distributed(dp_setup(n, 3), isolate=False) for n in (8, 64)}
    for dry in by_n.values():
        # Backward begins: the root's parameters are still gathered (FSDP2 keeps the root's after
        # forward), the last block's are being gathered again (the flat all-gather buffer), and the
        # loss's gradient buffers are alive (2 x fp32 logits, b x s x vocab).
        assert dry.peak_phase == "backward"
        assert dry.at_peak_bytes["unsharded_params"] == 4 * TINY_ROOT_PARAMS == 8_389_632
        assert dry.at_peak_bytes["temporaries"] == 2 * 2 * 128 * 8192 * 4
        # Each rank runs a full micro-batch: the saved activations are those of one device.
        assert dry.activations_bytes == single.activations_bytes
    assert by_n[8].at_peak_bytes["all_gather"] == 4 * TINY_BLOCK_PARAMS == 2_902_016
    # 64 ranks: gate's and up's 688 rows (dim 0) pad to 704, so the gather buffer grows by 2 x 16 x 256.
    assert by_n[64].at_peak_bytes["all_gather"] == 4 * (TINY_BLOCK_PARAMS + 2 * 16 * 256)
    # Per-rank memory falls by the shards' difference (parameters and AdamW's two moments), less the
    # larger padded gather buffer.
    d8, d64 = by_n[8], by_n[64]
    saved = 3 * (sharded_bytes(8) - sharded_bytes(64)) - 4 * 2 * 16 * 256
    assert d8.peak_bytes - d64.peak_bytes == saved == 6_522_832


@pytest.mark.slow  # starts a child process or runs seconds of real steps
@FSDP_TRACKER
def test_zero2_keeps_every_gathered_parameter_and_peaks_above_zero3():
    z3, z2, z1 = (dry_run_distributed(dp_setup(8, zero), isolate=False) for zero in (3, 2, 1))
    # reshard_after_forward=False: every block's fp32 parameters stay gathered until its backward.
    assert z2.at_peak_bytes["unsharded_params"] == 4 * TINY_N
    assert z2.params_bytes == z3.params_bytes == sharded_bytes(8)
    assert z2.peak_bytes - z3.peak_bytes == 4 * (TINY_N - TINY_ROOT_PARAMS) - 4 * TINY_BLOCK_PARAMS > 0
    # FSDP2 has no ZeRO-1 (gradients are always reduce-scattered): zero 1 runs as zero 2, and says so.
    assert z1.peak_bytes == z2.peak_bytes and any("zero 1 runs as zero 2" in n for n in z1.notes)


@FSDP_TRACKER
def test_zero0_replicates_the_state_and_holds_a_second_parameter_copy():
    single = dry_run(tiny(seq=128, micro_batch=2, precision="fp32"))
    dry = dry_run_distributed(dp_setup(8, 0), isolate=False)
    assert (dry.params_bytes, dry.grads_bytes) == (4 * TINY_N, 4 * TINY_N)
    assert dry.optimizer_bytes == 8 * TINY_N + 4 * TINY_TENSORS
    # The one-device step plus replicate()'s gathered copy of the parameters (DDP's flat gradient
    # buckets in the real run: the same 4 x TINY_N, measured equal below).
    assert dry.peak_bytes == single.peak_bytes + 4 * TINY_N


@pytest.mark.slow  # starts a child process or runs seconds of real steps
@FSDP_TRACKER
def test_distributed_state_and_peak_agree_with_the_estimator():
    for precision in ("fp32", "bf16"):
        for zero in (3, 2, 0):
            setup = dp_setup(8, zero, framework="pytorch", precision=precision)  # the estimator's eager step
            dry, est = dry_run_distributed(setup, isolate=False), estimate(setup).memory
            # FSDP2 keeps only the shard of every parameter between uses, for ZeRO-2 too (8 divides every
            # dim 0: no padding); DDP the whole. Backward begins after zero_grad(set_to_none=True): no
            # gradients in either, and the estimator's moment is the dry run's peak.
            assert est.weights_bytes == dry.params_bytes == (4 * TINY_N / 8 if zero else 4 * TINY_N)
            assert est.moment == "backward" and dry.peak_phase == "backward"
            assert est.grads_bytes == dry.at_peak_bytes["grads"] == 0
            assert dry.optimizer_bytes == est.optimizer_bytes + 4 * TINY_TENSORS
            # The estimator's buffers: the loss's fp32 buffers (8 x b x s x vocab = 16 MiB) plus DDP's
            # buckets (a second copy of all gradients, 4 x TINY_N), or FSDP2's gathered weights (ZeRO-2: all
            # of them; ZeRO-3: the root and the block prefetched for backward), 2 bytes each under bf16's
            # MixedPrecisionPolicy.
            gather = 2 if precision == "bf16" else 4
            gathered = {0: 4 * TINY_N, 2: gather * TINY_N, 3: gather * (TINY_ROOT_PARAMS + TINY_BLOCK_PARAMS)}
            assert est.buffers_bytes == 8 * 2 * 128 * 8192 + gathered[zero]
            if zero:
                in_dry = dry.at_peak_bytes["unsharded_params"] + dry.at_peak_bytes["all_gather"]
            else:
                in_dry = dry.at_peak_bytes["unsharded_params"]  # replicate()'s copy stands for DDP's buckets
            assert in_dry == gathered[zero]
            # Measured (est / dry run): fp32 0.996, 0.996, 0.998 and bf16 0.991, 0.992, 0.997 for ZeRO-3, 2
            # and 0, the rest being small activations the estimator leaves out (RoPE casts, norm statistics).
            # Llama-3.1-8B, seq 4096, bf16, ZeRO-3: 0.870 at 8 and 0.836 at 64 ranks on the H100 spec, 0.997 at
            # both with the CPU's composite RMSNorm terms (12 h bytes per layer and token) that the dry run's
            # CPU tensors have and the estimator leaves out on GPUs.
            est_tensor = est.total_bytes - est.overhead_bytes
            print(
                f"\ntiny, 8 ranks, {precision}, ZeRO-{zero}: dry run {dry.peak_bytes / 2**20:.2f} MiB, estimator "
                f"{est_tensor / 2**20:.2f} MiB, ratio {est_tensor / dry.peak_bytes:.3f}"
            )
            assert est_tensor == pytest.approx(dry.peak_bytes, rel=0.01)


@pytest.mark.slow  # starts a child process or runs seconds of real steps
@FSDP_TRACKER
@pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="needs torch.distributed with the gloo backend",
)
def test_distributed_dry_run_matches_the_real_two_rank_gloo_step(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "tests.dryrun_worker", str(tmp_path), *dryrun_worker.LAYOUTS]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    measured = json.loads((tmp_path / "peaks.json").read_text(encoding="utf-8"))
    assert sorted(measured) == sorted(dryrun_worker.LAYOUTS)  # every layout measured, none left out
    for name, peak in measured.items():
        dry = dry_run_distributed(dryrun_worker.layout_setup(name), isolate=False)
        print(f"\n{name}: measured {peak} B, dry run {dry.peak_bytes} B, {100 * (dry.peak_bytes / peak - 1):+.4f} %")
        # Measured over 17 launches: equal to within 8 bytes for all three (ZeRO-0: the real run's DDP
        # against the dry run's replicate), except 4 in which the real peak moved by one tensor the size
        # of the root unit (embedding and final norm, fp32): up under ZeRO-3 bf16, down under DDP. The
        # collectives run on gloo's threads, so whether that buffer is alive at the peak depends on
        # timing; the dry run has one order, the usual one.
        # Under load (the full suite on 2 cores) other buffers can move too, so the test holds the
        # issue's target, 8 %, and prints the exact offset.
        assert abs(dry.peak_bytes / peak - 1) <= 0.08


@pytest.mark.slow  # starts a child process or runs seconds of real steps
@FSDP_TRACKER
def test_isolated_run_and_dry_run_dispatch_leave_no_process_group_and_report_errors():
    setup = dp_setup(8, 3)
    here = dry_run_distributed(setup, isolate=False)
    assert not torch.distributed.is_initialized()
    start = time.perf_counter()
    child = dry_run(setup)  # several GPUs: per rank, in a child process
    print(
        f"\nisolated in a child process: {time.perf_counter() - start:.2f} s (in process: {here.wall_ms / 1e3:.2f} s)"
    )
    assert (child.peak_bytes, child.at_peak_bytes, child.world_size) == (here.peak_bytes, here.at_peak_bytes, 8)
    with pytest.raises(AdvisorError, match=r"optimizer_impl='bogus': must be one of"):
        dry_run_distributed(setup, optimizer_impl="bogus")  # raised in the child, reported here
    with pytest.raises(AdvisorError, match=r"optimizer_impl='bogus'"):
        dry_run_distributed(setup, optimizer_impl="bogus", isolate=False)
    assert not torch.distributed.is_initialized()  # destroyed on the error too


@FSDP_TRACKER
def test_in_process_run_refuses_a_caller_that_has_a_process_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(AdvisorError, match="a default process group is already initialized"):
            dry_run_distributed(dp_setup(8, 3), isolate=False)
        assert torch.distributed.get_world_size() == 2  # the caller's group is untouched
    finally:
        torch.distributed.destroy_process_group()


@FSDP_TRACKER
def test_distributed_text_and_json_forms():
    dry = dry_run_distributed(dp_setup(8, 3, precision="bf16", recompute="full"), isolate=False)
    text = format_dry_run(dry)
    assert "Per rank of 8 data-parallel ranks (FSDP2, ZeRO-3)" in text and "unsharded_params" in text
    assert "MixedPrecisionPolicy" in text  # bf16 gathers: autocast makes no unsharded 16-bit weight copies
    d = dry.as_dict()
    assert (d["world_size"], d["zero"], d["params_bytes"]) == (8, 3, sharded_bytes(8))
    assert sum(d["at_peak_bytes"].values()) == d["peak_bytes"]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"gpus": 16, "tp": 2}, r"supports dp \(any world size, zero 0 to 3\) only; the layout has tp=2"),
        ({"gpus": 16, "pp": 2, "cp": 2}, r"the layout has pp=2, cp=2"),
        ({"gpus": 8, "zero": 3, "precision": "fp16"}, r"precision='fp16' with zero=3: .* use bf16"),
        ({"gpus": 8, "zero": 3, "precision": "fp8"}, r"the dry run does not trace torchao.s float8 linears"),
        ({"gpus": 8, "zero": 3, "offload": "optimizer"}, r"offload='optimizer': the distributed dry run runs FSDP2"),
    ],
)
def test_unsupported_layouts_raise_advisor_error(kw, message):
    setup = make_setup(model="tiny", gpu="h100", seq=64, **({"precision": "bf16"} | kw))
    with pytest.raises(AdvisorError, match=message):
        dry_run_distributed(setup)


@FSDP_TRACKER
def test_cli_dryrun_reports_per_rank_bytes_for_several_gpus(capsys):
    argv = ["dryrun", "--model", "tiny", "--gpu", "h100", "--gpus", "64", "--zero", "3", "--seq", "128"]
    assert main([*argv, "--micro-batch", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["world_size"], out["zero"], out["target"]) == (64, 3, "cuda")
    assert out["params_bytes"] == sharded_bytes(64) and out["total_bytes"] > out["peak_bytes"]
    assert not torch.distributed.is_initialized()
    assert main([*argv[:-2], "--tp", "2", "--seq", "128"]) == 2
    assert "the layout has tp=2" in capsys.readouterr().err


def test_a_torch_older_than_2_13_is_refused_with_the_reason(monkeypatch):
    # torch 2.11's FSDPMemTracker (the GPU image's torch) read 0.084 GiB at the optimizer step for this
    # layout against 0.037 GiB in backward on 2.13 and on the real gloo step: refused, not misreported.
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    assert torch_release() == (2, 11)
    with pytest.raises(
        AdvisorError, match=r"needs torch 2\.13 or newer and this is torch 2\.11\.0\+cu130.*advisor size"
    ):
        dry_run_distributed(dp_setup(8, 3), isolate=False)
    # Layout errors still come first: they say what to change in the setup.
    with pytest.raises(AdvisorError, match="the layout has tp=2"):
        dry_run_distributed(make_setup(model="tiny", gpu="h100", seq=64, gpus=16, tp=2))
    monkeypatch.setattr(torch, "__version__", "2.13.0.dev20260901+cpu")
    assert torch_release() == (2, 13)


@FSDP_TRACKER
def test_cuda_target_keeps_the_saved_tensors_of_cudas_fused_rmsnorm():
    # Under FSDP2's bf16 parameters the residual stream is bf16. CUDA's _fused_rms_norm saves that input
    # (2 bytes a unit) and the fp32 rstd; the CPU composite saves the fp32 upcast and the fp32 x * rstd
    # (8 bytes): 6 bytes a hidden unit more, at 9 norms x 256 tokens x 256 units.
    setup = make_setup(model="tiny", gpu="h100", gpus=2, seq=128, micro_batch=2, precision="bf16", zero=3)
    cpu, cuda = dry_run_distributed(setup, isolate=False), dry_run_distributed(setup, target="cuda", isolate=False)
    assert cpu.activations_bytes - cuda.activations_bytes == 9 * 256 * 256 * 6
    assert cpu.peak_bytes - cuda.peak_bytes == 9 * 256 * 256 * 6


def test_fused_rmsnorm_matches_torchs_on_real_tensors():
    from advisor.run.dryrun import use_cuda_norms

    torch.manual_seed(0)
    ref, ours = torch.nn.RMSNorm(64, eps=1e-5), torch.nn.RMSNorm(64, eps=1e-5)
    ours.load_state_dict(ref.state_dict())
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5), ours.weight.copy_(ref.weight)
    assert use_cuda_norms(torch.nn.Sequential(ours)) == 1
    x = torch.randn(3, 5, 64, dtype=torch.float32, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        y = ours(x2)
    assert saved == [(3, 5, 64), (3, 5, 1), (64,)]  # input, rstd, weight: what CUDA's kernel saves
    y_ref = ref(x)
    torch.testing.assert_close(y, y_ref)
    (y * y_ref.detach()).sum().backward()
    (y_ref * y_ref.detach()).sum().backward()
    torch.testing.assert_close(x2.grad, x.grad)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad)


def test_notes_name_only_what_the_step_ignores():
    # --no-flash runs the unfused attention (it is not ignored); dropout is. Activation offload alone
    # puts no optimizer state on the host.
    notes = dry_run(tiny(seq=64, micro_batch=1, flash_attention=False), target="cpu").notes
    assert not any("flag" in n for n in notes)
    notes = dry_run(tiny(seq=64, micro_batch=1, dropout=True)).notes
    assert "the step runs attention and its blocks without dropout: the dropout flag is ignored" in notes
    setup = make_setup(model="tiny", gpu="h100", gpus=1, seq=64, micro_batch=1, offload_activations=2)
    notes = dry_run(setup, target="cuda").notes
    assert any(n.startswith("activation offload: 2 blocks") for n in notes)
    assert not any("optimizer states are host_bytes" in n for n in notes)
