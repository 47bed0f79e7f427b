"""The dry run against the measured CPU step, against hand-counted bytes, and against the estimator."""

import resource

import pytest
import torch

from advisor.dryrun import dry_run, format_dry_run
from advisor.errors import AdvisorError
from advisor.estimator import estimate
from advisor.memprobe import measure_step_peak_bytes
from advisor.presets import get_hardware
from advisor.sizing import make_setup
from advisor.step import build_trainer, make_loader

N_8B = 8_030_261_248
TINY_N = 4_999_424
TINY_TENSORS = 38  # embedding (tied head) + 4 blocks x (q, k, v, o, gate, up, down, 2 norms) + final norm
LLAMA_8B_TENSORS = 291  # embedding + 32 blocks x 9 + final norm + head


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
    # bf16: the estimator assumes 2-byte weights and gradients plus an fp32 master copy; the autocast
    # step keeps fp32 parameters and gradients and no master copy. Same 16 bytes per parameter in all.
    bf16 = tiny(seq=128, micro_batch=2, precision="bf16")
    dry, est = dry_run(bf16), estimate(bf16).memory
    assert (est.weights_bytes, est.grads_bytes, est.optimizer_bytes) == (2 * TINY_N, 2 * TINY_N, 12 * TINY_N)
    assert dry.params_bytes + dry.grads_bytes + dry.optimizer_bytes == 16 * TINY_N + 4 * TINY_TENSORS


def test_cuda_target_adds_the_runtime_allowance_and_keeps_offloaded_state_off_the_device():
    setup = make_setup(model="tiny", gpu="h100", seq=128, micro_batch=2, precision="bf16")
    cpu, cuda = dry_run(setup), dry_run(setup, target="cuda")
    assert cuda.peak_bytes == cpu.peak_bytes
    assert cuda.total_bytes == cpu.peak_bytes + get_hardware("h100").runtime_overhead_bytes + int(0.05 * cpu.peak_bytes)
    assert any("fake CPU tensors" in n for n in cuda.notes)
    off_cpu = dry_run(setup, offload_optimizer=True)
    off_cuda = dry_run(setup, offload_optimizer=True, target="cuda")
    # Host: fp32 master weights and their gradients (8 bytes) and AdamW's states (8 bytes + steps).
    assert off_cuda.host_bytes == off_cpu.host_bytes == 16 * TINY_N + 4 * TINY_TENSORS
    assert off_cuda.peak_phase == "backward"
    assert off_cuda.peak_bytes == off_cpu.peak_bytes - off_cpu.host_bytes
    assert off_cuda.optimizer_bytes == 0


def test_text_and_json_forms():
    dry = dry_run(tiny(seq=128, micro_batch=1, precision="bf16", recompute="full"))
    text = format_dry_run(dry)
    assert "Peak tensor memory" in text and "recompute full" in text and "autocast" in text
    d = dry.as_dict()
    assert d["peak_bytes"] == dry.peak_bytes and d["total_bytes"] == dry.peak_bytes  # no overhead on the CPU
    assert d["at_peak_bytes"] == dry.at_peak_bytes and isinstance(d["notes"], list)


@pytest.mark.parametrize(
    ("gpu", "precision", "target", "message"),
    [
        ("cpu", "bf16", "tpu", r"target='tpu': must be one of cpu, cuda"),
        ("cpu", "bf16", "cuda", r"target='cuda' takes its runtime allowance from a GPU spec"),
        ("h100", "fp8", "cpu", r"fp8 training needs NVIDIA TransformerEngine"),
    ],
)
def test_bad_input_raises_advisor_error(gpu, precision, target, message):
    setup = make_setup(model="tiny", gpu=gpu, seq=64, precision=precision)
    with pytest.raises(AdvisorError, match=message):
        dry_run(setup, target=target)


def test_non_setup_raises_advisor_error():
    with pytest.raises(AdvisorError, match=r"expected an advisor\.specs\.Setup"):
        dry_run("llama-3.1-8b")  # type: ignore[arg-type]
