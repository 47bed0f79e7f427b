"""Specs and presets: exact parameter counts and validation messages."""

import os
from dataclasses import replace

import pytest

from advisor.errors import SpecError
from advisor.spec.presets import HARDWARE, MODELS, get_hardware, get_model
from advisor.spec.setup import build_parallel, make_setup
from advisor.spec.specs import ParallelSpec, Setup, TrainSpec, setup_from_dict, spec_to_dict

# Published counts (model cards / sum of safetensors shapes); Llama-4 counts are the language model
# alone, summed from config.json shapes by hand (see presets.py docstrings).
EXACT_PARAMS = {
    "gpt2-124m": 124_439_808,
    "gpt2-355m": 354_823_168,
    "gpt2-774m": 774_030_080,
    "gpt2-1.5b": 1_557_611_200,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    # Llama 2: the sum of the shapes of their config.json (NeMo's Llama2Config*, the HF configs as quoted
    # in AI-Hypercomputer/torchprime); no published total was found. Llama 3 8B/70B: Llama 3.1's blocks.
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "llama-3.1-405b": 405_853_388_800,
    "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
    "llama-4-scout": 107_769_861_120,
    "llama-4-maverick": 400_711_848_960,
    "tiny": 4_999_424,
    "tiny-moe": 11_344_128,
}


@pytest.mark.parametrize("name", list(MODELS))
def test_every_preset_has_its_exact_parameter_count(name):
    assert get_model(name).n_params == EXACT_PARAMS[name]


def test_gpt2_count_by_hand():
    # wte 50257*768 + wpe 1024*768 + 12 blocks of 7,087,872 + final LayerNorm 2*768.
    assert get_model("gpt2-124m").n_params == 50257 * 768 + 1024 * 768 + 12 * 7_087_872 + 1536


def test_moe_active_parameters():
    # Mixtral: 12.9B active of 46.7B; Llama-4 Scout and Maverick: 17B active.
    assert get_model("mixtral-8x7b").n_active_params == 12_879_925_248
    assert round(get_model("llama-4-scout").n_active_params / 1e9, 1) == 17.2
    assert round(get_model("llama-4-maverick").n_active_params / 1e9, 1) == 17.2
    maverick = get_model("llama-4-maverick")
    assert (maverick.n_moe_layers, maverick.n_dense_layers) == (24, 24)


def test_hardware_presets_cite_datasheet_numbers():
    h100, h200, gh200 = get_hardware("h100"), get_hardware("h200"), get_hardware("gh200")
    assert h100.peak_bf16_flops == pytest.approx(989.5e12)
    assert h100.peak_fp8_flops == pytest.approx(2 * h100.peak_bf16_flops)
    assert h200.peak_bf16_flops == h100.peak_bf16_flops and h200.mem_bw_bytes_per_s == 4.8e12
    assert h200.memory_bytes > 1.75 * h100.memory_bytes
    assert gh200.host_link == "nvlink-c2c" and gh200.host_link_bw_bytes_per_s == 450e9
    assert h100.host_link_bw_bytes_per_s == 64e9  # PCIe Gen5 x16 per direction
    assert get_hardware("a100-80gb").peak_fp8_flops == 0
    assert get_hardware("cpu").kind == "cpu"
    assert set(HARDWARE) >= {"h100", "h200", "gh200", "b200", "gb200", "a100-80gb", "a100-40gb", "l40s", "cpu"}
    assert set(HARDWARE) >= {"mi250", "mi250x", "mi300x"}


def test_blackwell_presets_are_their_datasheets_per_gpu():
    # HGX B200: 8-GPU totals with sparsity (BF16 36, FP8 72, TF32 18 PFLOP/s; FP32 600 TFLOP/s dense),
    # 1.44 TB HBM3e at 64 TB/s: per GPU dense = total / 8 / 2.
    b200 = get_hardware("b200")
    assert (b200.peak_bf16_flops, b200.peak_fp8_flops, b200.peak_tf32_flops) == (36e15 / 16, 72e15 / 16, 18e15 / 16)
    assert b200.peak_fp32_flops == 600e12 / 8 and b200.mem_bw_bytes_per_s == 64e12 / 8
    assert b200.memory_bytes == 183359 * 2**20 and b200.gpus_per_node == 8  # the driver's 183,359 MiB
    assert (b200.host_link, b200.intra_node_bw_bytes_per_s) == ("pcie5", 900e9)  # NVLink 5: 1.8 TB/s both ways
    # GB200 NVL72: rack totals with sparsity (BF16 360, FP8 720, TF32 180 PFLOP/s; FP32 5,760 TFLOP/s),
    # 576 TB/s of HBM3e; one NVLink domain of 72 GPUs; 36 Graces of 480 GB, each over one 900 GB/s
    # NVLink-C2C to two GPUs.
    gb200 = get_hardware("gb200")
    assert (gb200.peak_bf16_flops, gb200.peak_fp8_flops, gb200.peak_tf32_flops) == (
        360e15 / 144,
        720e15 / 144,
        180e15 / 144,
    )
    assert gb200.peak_fp32_flops == 5760e12 / 72 and gb200.mem_bw_bytes_per_s == 576e12 / 72
    assert (gb200.gpus_per_node, gb200.host_link, gb200.host_link_bw_bytes_per_s) == (72, "nvlink-c2c", 900e9 / 4)
    assert gb200.host_memory_bytes == 36 * 480e9 and get_hardware("gb200-nvl72") == gb200


def test_amd_presets_are_their_datasheets_per_device():
    # MI250 (ROCm docs' table, OAM, dense): matrix FP32 90.5, FP16/BF16 362.1 TFLOP/s, 3.2 TB/s: a GCD,
    # the device PyTorch sees, has half of each. 1024 FLOP/clock/CU x 104 CUs x 1.7 GHz = 181.0 TFLOP/s.
    mi250 = get_hardware("mi250")
    assert (mi250.peak_fp32_flops, mi250.peak_bf16_flops, mi250.peak_fp16_flops) == (45.25e12, 181.05e12, 181.05e12)
    assert mi250.peak_bf16_flops == pytest.approx(1024 * 104 * 1.7e9, rel=1e-3)
    assert (mi250.peak_tf32_flops, mi250.peak_fp8_flops, mi250.mem_bw_bytes_per_s) == (0.0, 0.0, 1.6e12)
    assert mi250.memory_bytes == 68_702_699_520 and mi250.sm_count == 104  # HTA's MI250 trace: 65,520 MiB
    assert (mi250.gpus_per_node, mi250.intra_node_bw_bytes_per_s, mi250.host_link) == (8, 100e9, "pcie4")
    # MI250X: 110 CUs a GCD, AMD's OAM figures 95.7 / 383.0 halved; the rest is the MI250's.
    mi250x = get_hardware("mi250x")
    assert (mi250x.peak_fp32_flops, mi250x.peak_bf16_flops, mi250x.sm_count) == (47.85e12, 191.5e12, 110)
    assert mi250x.peak_bf16_flops == pytest.approx(1024 * 110 * 1.7e9, rel=1e-3)
    assert (mi250x.memory_bytes, mi250x.mem_bw_bytes_per_s) == (mi250.memory_bytes, mi250.mem_bw_bytes_per_s)
    # MI300X (ROCm docs' table, dense: 2048 FLOP/clock/CU x 304 CUs x 2.1 GHz = 1307.4 TFLOP/s bf16).
    mi300x = get_hardware("mi300x")
    assert (mi300x.peak_fp32_flops, mi300x.peak_tf32_flops) == (163.4e12, 653.7e12)
    assert (mi300x.peak_bf16_flops, mi300x.peak_fp16_flops, mi300x.peak_fp8_flops) == (1307.4e12, 1307.4e12, 2614.9e12)
    assert mi300x.peak_bf16_flops == pytest.approx(2048 * 304 * 2.1e9, rel=1e-3)
    assert (mi300x.mem_bw_bytes_per_s, mi300x.memory_bytes, mi300x.sm_count) == (5.3e12, 196_592 * 2**20, 304)
    # Seven xGMI links of 64 GB/s each way to the seven other GPUs; PCIe Gen5 x16 to the host.
    assert (mi300x.intra_node_bw_bytes_per_s, mi300x.host_link_bw_bytes_per_s) == (448e9, 64e9)
    from advisor.spec.presets import fastest_precision

    assert {fastest_precision(hw) for hw in (mi250, mi250x, mi300x)} == {"bf16"}


def test_amd_device_names_find_their_presets():
    from advisor.spec.presets import hardware_for_gpu_name, hardware_for_trace

    # As ROCm names them (TraceLens's MI300X traces: "AMD Instinct MI300X", "... MI300X VF" in a VM).
    assert hardware_for_gpu_name("AMD Instinct MI300X", 206_141_652_992).name == "MI300X 192GB"
    assert hardware_for_gpu_name("AMD Instinct MI300X VF").name == "MI300X 192GB"
    assert hardware_for_gpu_name("AMD Instinct MI250X").name == "MI250X GCD 64GB"
    assert hardware_for_gpu_name("AMD Instinct MI250X / MI250").name == "MI250X GCD 64GB"
    assert hardware_for_gpu_name("AMD Instinct MI250").name == "MI250 GCD 64GB"
    assert hardware_for_gpu_name("AMD Instinct MI210") is None
    # ROCm's generic name: the Tensile kernels' ISA tells the architecture (HTA's MI250 trace).
    gfx90a = "Cijk_Alik_Bljk_SB_Bias_AS_SAV_UserArgs_MT64x16x32_MI16x16x1_SN_LDSB0_GSUAMB_ISA90a_IU1_K1"
    hw, how = hardware_for_trace([("AMD Radeon Graphics", 68_702_699_520)], ["reduce_kernel", gfx90a])
    assert (hw.name, hw.memory_bytes) == ("MI250 GCD 64GB", 68_702_699_520)
    assert "guessed from kernel names" in how and "'AMD Radeon Graphics'" in how
    gfx942 = "Cijk_Ailk_Bljk_S_B_Bias_HA_S_SAV_UserArgs_MT16x16x128_MI16x16x1_SN_GSUAMB_GLS0_ISA942_IU1_K1"
    assert hardware_for_trace([("AMD Radeon Graphics", 0)], [gfx942])[0].name == "MI300X 192GB"
    assert hardware_for_trace([("AMD Radeon Graphics", 0)], ["attn_fwd"]) == (
        None,
        "the trace names its device only 'AMD Radeon Graphics' and its kernel names give no GPU generation away",
    )
    # A named device without a preset is not guessed at from its kernels.
    assert hardware_for_trace([("AMD Instinct MI210", 0)], [gfx90a])[0] is None


def _llama(**kw):
    return replace(get_model("llama-3.1-8b"), **kw)


H100 = get_hardware("h100")

# (what to build, the field the message must name, words the message must contain)
BAD_INPUTS = [
    (lambda: _llama(n_layers=0), "model.n_layers=0", "integer from 1 to 65536"),
    (lambda: _llama(hidden=-4096), "model.hidden=-4096", "integer from 1 to 16777216"),
    # Issue 22: every count has an upper bound, so no figure or search grows without one.
    (lambda: _llama(hidden=10**400), "model.hidden=10000000000000000000...(401 digits)", "integer from 1 to 16777216"),
    (lambda: _llama(n_layers=2**17), "model.n_layers=131072", "integer from 1 to 65536"),
    (lambda: _llama(vocab=2**25), "model.vocab=33554432", "integer from 1 to 16777216"),
    (lambda: ParallelSpec(dp=2**21), "parallel.dp=2097152", "integer from 1 to 1048576"),
    (
        lambda: ParallelSpec(tp=1024, pp=1024, cp=2),
        "parallel.tp=1024",
        "dp(1) x tp(1024) x pp(1024) x cp(2) = 2,097,152 GPUs; at most 1,048,576 in all",
    ),
    (lambda: make_setup(gpus=10**18), "gpus=1000000000000000000", "integer from 1 to 1048576"),
    (lambda: make_setup(gpus=8, dp="8"), "parallel.dp='8'", "integer from 1 to 1048576"),
    (lambda: make_setup(micro_batch=10**18), "train.micro_batch=1000000000000000000", "from 1 to 65536"),
    (lambda: _llama(n_kv_heads=5), "model.n_kv_heads=5", "must divide n_heads=32"),
    (lambda: replace(_llama(), head_dim=0, n_heads=30), "model.n_heads=30", "must divide hidden=4096"),
    (lambda: _llama(mlp="relu"), "model.mlp='relu'", "one of gelu, swiglu"),
    (lambda: _llama(norm_bias=True), "model.norm_bias=True", "norm='layernorm'"),
    (lambda: _llama(n_experts=8, top_k=9), "model.top_k=9", "from 1 to 8"),
    (lambda: _llama(top_k=2), "model.n_experts=0", "top_k"),
    (lambda: TrainSpec(seq_len=0), "train.seq_len=0", "integer from 1 to 16777216"),
    # A sequence of 10^12 tokens was sized at 3,176,655,986,390.6 days (issue 21): refused above 2^24.
    (lambda: TrainSpec(seq_len=10**12), "train.seq_len=1000000000000", "integer from 1 to 16777216"),
    (lambda: TrainSpec(micro_batch=2.5), "train.micro_batch=2.5", "integer from 1 to 65536"),
    (lambda: TrainSpec(global_batch=2**27), "train.global_batch=134217728", "integer from 0 to 67108864"),
    (lambda: _llama(rope_scaling=0.5), "model.rope_scaling=0.5", "number from 1 to 256"),
    # Beyond the trained context (Llama 3.1: 131,072) only with RoPE scaling chosen.
    (
        lambda: make_setup(model="llama-3.1-8b", seq=1_000_000),
        "train.seq_len=1000000",
        "trained on sequences up to 131,072 tokens; a longer one needs RoPE context extension (rope_scaling >= 8",
    ),
    (
        lambda: make_setup(model="llama-2-7b", seq=16384, rope_scaling=2),
        "train.seq_len=16384",
        "up to 4,096 tokens with rope_scaling=2; a longer one needs RoPE context extension (rope_scaling >= 4",
    ),
    (lambda: TrainSpec(precision="int8"), "train.precision='int8'", "fp32, bf16, fp16, fp8"),
    (lambda: TrainSpec(optimizer="lion"), "train.optimizer='lion'", "adamw, sgd, adafactor"),
    (lambda: TrainSpec(recompute="some"), "train.recompute='some'", "none, selective, selective-op, full"),
    (
        lambda: TrainSpec(recompute="selective", recompute_layers=4),
        "train.recompute_layers=4",
        "needs recompute='full'",
    ),
    (lambda: TrainSpec(offload_activations=-1), "train.offload_activations=-1", "integer from 0 to 65536"),
    # Llama-3.1-8B's 32 blocks over 4 stages: 8 a stage, so 9 blocks per stage cannot recompute.
    (
        lambda: make_setup(
            model="llama-3.1-8b", gpu="h100", pp=4, global_batch=4, recompute="full", recompute_layers=9
        ),
        "train.recompute_layers=9",
        "at most 8, the blocks of the smallest of pp x vpp=4 stages of 32",
    ),
    (
        lambda: make_setup(model="llama-3.1-8b", gpu="h100", offload_activations=33),
        "train.offload_activations=33",
        "at most 32",
    ),
    (
        lambda: make_setup(model="llama-3.1-8b", gpu="h100", recompute="full", offload_activations=4),
        "train.offload_activations=4",
        "every block recomputes",
    ),
    (
        lambda: make_setup(
            model="llama-3.1-8b", gpu="h100", recompute="full", recompute_layers=20, offload_activations=20
        ),
        "train.offload_activations=20",
        "at most 12 (32 blocks a stage, 20 recompute)",
    ),
    (lambda: ParallelSpec(zero=4), "parallel.zero=4", "from 0 to 3"),
    (lambda: ParallelSpec(pp=1, vpp=2), "parallel.vpp=2", "pp > 1"),
    (lambda: ParallelSpec(sequence_parallel=True), "parallel.sequence_parallel=True", "tp > 1"),
    (lambda: ParallelSpec(offload="optimizer+params", zero=2), "parallel.offload='optimizer+params'", "zero=3"),
    (lambda: ParallelSpec(offload="optimizer"), "parallel.offload='optimizer'", "zero >= 1"),
    (lambda: ParallelSpec(offload="disk", zero=3), "parallel.offload='disk'", "one of none, optimizer"),
    (
        lambda: Setup(_llama(), TrainSpec(), ParallelSpec(tp=3), H100),
        "parallel.tp=3",
        "n_heads=32 must be divisible by tp",
    ),
    (
        lambda: Setup(get_model("llama-3.2-3b"), TrainSpec(), ParallelSpec(tp=3), H100),
        "parallel.tp=3",
        "n_kv_heads=8 must divide",
    ),
    (
        lambda: Setup(_llama(), TrainSpec(), ParallelSpec(pp=33), H100),
        "parallel.pp=33",
        "pp x vpp=33 pipeline stages need at least one block each; model.n_layers=32 allows pp x vpp up to 32",
    ),
    (lambda: Setup(_llama(), TrainSpec(), ParallelSpec(pp=4, vpp=9), H100), "parallel.pp=4", "pp x vpp=36"),
    (lambda: Setup(_llama(), TrainSpec(), ParallelSpec(dp=8, ep=2), H100), "parallel.ep=2", "needs a MoE model"),
    (
        lambda: Setup(get_model("mixtral-8x7b"), TrainSpec(), ParallelSpec(dp=12, ep=3), H100),
        "parallel.ep=3",
        "n_experts=8",
    ),
    (
        lambda: Setup(get_model("mixtral-8x7b"), TrainSpec(), ParallelSpec(dp=2, ep=4), H100),
        "parallel.ep=4",
        "dp x cp=2",
    ),
    (lambda: Setup(_llama(), TrainSpec(seq_len=4097), ParallelSpec(cp=2), H100), "train.seq_len=4097", "2 x cp=4"),
    (
        lambda: Setup(get_model("gpt2-124m"), TrainSpec(seq_len=2048), ParallelSpec(), H100),
        "train.seq_len=2048",
        "positions up to 1024",
    ),
    (
        lambda: Setup(_llama(), TrainSpec(global_batch=10), ParallelSpec(dp=4), H100),
        "train.global_batch=10",
        "micro_batch x dp=4",
    ),
    (
        lambda: Setup(_llama(), TrainSpec(global_batch=6), ParallelSpec(dp=1, pp=4, vpp=2), H100),
        "train.global_batch=6",
        "multiple of pp=4",
    ),
    (
        lambda: Setup(_llama(), TrainSpec(precision="fp8"), ParallelSpec(), get_hardware("a100")),
        "train.precision='fp8'",
        "no fp8",
    ),
    (
        lambda: Setup(_llama(), TrainSpec(), ParallelSpec(), None),
        "hardware=None",
        "must be a HardwareSpec, got None (get_hardware('h100')",
    ),
    (lambda: Setup(_llama(), TrainSpec(), ParallelSpec(), "h100"), "hardware='h100'", "HardwareSpec, got a str"),
    (lambda: Setup("llama-3.1-8b", TrainSpec(), ParallelSpec(), H100), "model='llama-3.1-8b'", "must be a ModelSpec"),
    (lambda: build_parallel(8, 2, tp=2, pp=1), "gpus=8", "dp(2) * tp(2) * pp(1) * cp(1) = 4 != gpus(8)"),
    (lambda: build_parallel(6, None, tp=4), "gpus=6", "multiple of tp x pp x cp = 4"),
    (lambda: get_model("gpt-5"), "model='gpt-5'", "unknown preset"),
    (lambda: get_hardware("b300"), "gpu='b300'", "unknown device; choose one of h100"),
    (
        lambda: make_setup(model="tiny", gpu="cpu", zero=1, offload="optimizer"),
        "parallel.offload='optimizer'",
        "already the CPU",
    ),
]


@pytest.mark.parametrize(("build", "field", "words"), BAD_INPUTS, ids=[b[1] for b in BAD_INPUTS])
def test_bad_input_names_field_value_and_allowed_range(build, field, words):
    with pytest.raises(SpecError) as info:
        build()
    message = str(info.value)
    assert message.startswith(field + ":"), message
    assert words in message, message


def test_specs_are_frozen():
    m = get_model("tiny")
    with pytest.raises(AttributeError):
        m.n_layers = 8  # type: ignore[misc]


def test_setup_needs_hardware_no_device_is_assumed():
    # A setup without hardware used to be sized for an H100 unasked; now it is not a setup at all.
    with pytest.raises(TypeError, match="'hardware'"):
        Setup(_llama())  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'hardware'"):
        Setup(_llama(), TrainSpec(), ParallelSpec())  # type: ignore[call-arg]


def test_setup_round_trips_through_a_dict_hardware_included():
    s = Setup(
        get_model("mixtral-8x7b"), TrainSpec(seq_len=4096), ParallelSpec(dp=8, ep=4, zero=1), get_hardware("gb200")
    )
    d = spec_to_dict(s)
    assert d["hardware"]["name"] == s.hardware.name and setup_from_dict(d) == s
    with pytest.raises(SpecError, match=r"^setup='KeyError': not a setup dictionary"):
        setup_from_dict({k: v for k, v in d.items() if k != "hardware"})


def test_setup_derives_batch_and_accumulation():
    s = Setup(_llama(), TrainSpec(micro_batch=2, global_batch=64), ParallelSpec(dp=4, tp=2), H100)
    assert (s.gpus, s.grad_accum, s.tokens_per_step) == (8, 8, 64 * 2048)
    assert Setup(_llama(), TrainSpec(micro_batch=2), ParallelSpec(dp=4), H100).global_batch == 8


@pytest.mark.parametrize(
    "flags, bf16, fp16",
    [
        # AVX2 only: bf16 and fp16 autocast ran a linear layer's forward and backward at 1/31 and 1/40 of
        # fp32 on an AVX2-only EPYC; fp16's scalar fallback 1/70 on an AVX512-BF16 one.
        ({"avx2"}, 1 / 30, 1 / 50),
        (set(), 1 / 30, 1 / 50),
        ({"avx2", "avx512f", "avx512_bf16"}, 3.5, 1 / 50),  # measured on our EPYC: 3.5x fp32
        ({"avx2", "avx512f"}, 1 / 30, 1 / 50),
        ({"avx512_fp16", "amx_bf16"}, 16.0, 1.0),  # fp16 matmuls at fp32 pace on a Sapphire Rapids Xeon
        ({"amx_bf16", "amx_fp16"}, 16.0, 16.0),
    ],
)
def test_cpu_host_peaks_follow_the_cpu_flags(monkeypatch, flags, bf16, fp16):
    from advisor.spec import presets

    monkeypatch.setattr(presets, "cpu_flags", lambda: flags)
    cpu = presets.cpu_host()
    assert cpu.peak_bf16_flops / cpu.peak_fp32_flops == pytest.approx(bf16)
    assert cpu.peak_fp16_flops / cpu.peak_fp32_flops == pytest.approx(fp16)
    assert cpu.peak_fp32_flops == 96e9 * (os.cpu_count() or 1)


def test_gpu_names_from_traces_find_their_presets():
    from advisor.spec.presets import hardware_for_gpu_name, hardware_for_trace

    # Meta's A100-PG509-200 reports 40 GB: the HBM2 part at 1.555 TB/s, not the 80 GB one.
    assert hardware_for_gpu_name("NVIDIA A100-PG509-200", 42297524224).mem_bw_bytes_per_s == 1.555e12
    assert hardware_for_gpu_name("NVIDIA A100-SXM4-80GB").mem_bw_bytes_per_s == 2.039e12
    v100 = hardware_for_gpu_name("Tesla V100-SXM2-32GB", 34079637504)
    assert (v100.peak_fp16_flops, v100.peak_fp32_flops, v100.peak_bf16_flops) == (125e12, 15.7e12, 0.0)
    assert v100.memory_bytes == 34079637504
    assert hardware_for_gpu_name("Some Future GPU") is None
    # The PCIe H200 NVL (600 W) has 835.5 dense bf16 TFLOP/s against the SXM part's 989.5: its MFU
    # would read 16 % low against the SXM peaks.
    nvl, sxm = hardware_for_gpu_name("NVIDIA H200 NVL"), hardware_for_gpu_name("NVIDIA H200")
    assert (nvl.name, nvl.peak_bf16_flops, nvl.peak_fp32_flops) == ("H200 NVL 141GB", 835.5e12, 60e12)
    assert (sxm.name, sxm.peak_bf16_flops, nvl.mem_bw_bytes_per_s) == ("H200 141GB", 989.5e12, sxm.mem_bw_bytes_per_s)
    # The H100 PCIe card (114 SMs, 350 W, HBM2e): 756.5 dense bf16 TFLOP/s against the SXM's 989.5, so
    # an MFU read against the SXM peaks would be 24 % low. The driver's "NVIDIA H100 PCIe" finds it; the
    # SXM part's "NVIDIA H100 80GB HBM3" does not.
    pcie = hardware_for_gpu_name("NVIDIA H100 PCIe", 85520809984)
    assert (pcie.name, pcie.peak_bf16_flops, pcie.peak_fp8_flops, pcie.sm_count) == (
        "H100 PCIe 80GB",
        756.5e12,
        1513e12,
        114,
    )
    assert (pcie.mem_bw_bytes_per_s, pcie.memory_bytes) == (2.0e12, 85520809984)
    assert hardware_for_gpu_name("NVIDIA H100 80GB HBM3").name == "H100 SXM 80GB"
    # The H100 NVL has no preset: unknown, not the SXM's roofs; the profiled step says which it used.
    assert hardware_for_gpu_name("NVIDIA H100 NVL", 99_857_989_632) is None
    assert (
        hardware_for_trace([("NVIDIA H100 NVL", 0)])[1]
        == "no preset for NVIDIA H100 NVL; pass the GPU to use its datasheet roofs"
    )
    # "B200" is part of "GB200": the Grace Blackwell part is matched first.
    assert hardware_for_gpu_name("NVIDIA GB200", 189471 * 2**20).name == "GB200 NVL72 186GB"
    assert hardware_for_gpu_name("NVIDIA B200", 183359 * 2**20).name == "B200 180GB"
    # Blackwell's kernels name sm100 (cuBLAS, CUTLASS 3); nvjet ones alone read as Hopper.
    hw, _ = hardware_for_trace([], ["nvjet_tst_128x256_64x4_2x1_v_bz_TNT", "sm100_xmma_gemm_bf16bf16_bf16f32_f32_tn_n"])
    assert hw.name == "B200 180GB"
    assert hardware_for_trace([], ["nvjet_tst_128x256_64x4_2x1_v_bz_TNT"])[0].name == "H100 SXM 80GB"
    hw, how = hardware_for_trace([], ["volta_sgemm_128x64_nn"])
    assert hw.name == "V100 SXM2 32GB" and "guessed from kernel names" in how
    assert hardware_for_trace([], ["my_kernel"]) == (
        None,
        "the trace names no device and its kernel names give no GPU generation away",
    )


def test_bf16_on_a_gpu_without_it_is_refused():
    from advisor.spec.setup import make_setup

    with pytest.raises(SpecError, match="bf16"):
        make_setup(model="gpt2-124m", gpu="v100", seq=1024, precision="bf16")
    assert make_setup(model="gpt2-124m", gpu="v100", seq=1024, precision="fp16").hardware.name == "V100 SXM2 32GB"


def test_the_fastest_precision_of_each_device(monkeypatch):
    from advisor.spec import presets

    # bf16 on Ampere and newer (ties with fp16 go to bf16: no GradScaler), fp16 on a V100 (no bf16 math:
    # 125 against 15.7 TFLOP/s fp32), on a CPU what its flags give.
    assert {k: presets.fastest_precision(get_hardware(k)) for k in ("a100-80gb", "h100", "b200", "v100")} == {
        "a100-80gb": "bf16",
        "h100": "bf16",
        "b200": "bf16",
        "v100": "fp16",
    }
    monkeypatch.setattr(presets, "cpu_flags", lambda: {"avx2"})
    assert presets.fastest_precision(presets.cpu_host()) == "fp32"
    monkeypatch.setattr(presets, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    assert presets.fastest_precision(presets.cpu_host()) == "bf16"


def test_rope_scaling_extends_the_context_it_names():
    # Llama 2 was trained on 4,096 positions: 16,384 tokens need a 4x extension, and size like any
    # other sequence then (RoPE has no parameters: the parameter count is unchanged).
    plain = make_setup(model="llama-2-7b", seq=4096)
    scaled = make_setup(model="llama-2-7b", seq=16384, rope_scaling=4)
    assert scaled.model.max_seq_len == 16384 and scaled.model.n_params == plain.model.n_params
    assert make_setup(model="llama-2-7b", rope_scaling=4).train.seq_len == 4096  # the default seq
    assert make_setup(model="tiny").train.seq_len == 2048  # the default 4096 fitted to its context


def test_recorded_cpu_flags_are_read_defensively():
    from advisor.spec.presets import recorded_cpu_flags

    assert recorded_cpu_flags({"environment": {"cpu_matrix_flags": ["avx2", 3, "amx_bf16"]}}) == ["avx2", "amx_bf16"]
    for record in ({}, {"environment": None}, {"environment": {"cpu_matrix_flags": "avx2"}}, []):
        assert recorded_cpu_flags(record) is None
