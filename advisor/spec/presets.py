"""Presets: the models and devices people size most often, as plain functions returning specs.

Model shapes come from each model's published ``config.json``; parameter counts are exact and tested.
Device numbers come from vendor datasheets (dense FLOP/s, no sparsity), cited beside each preset.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from advisor.errors import AdvisorError, SpecError
from advisor.spec.metrics import StepMetrics
from advisor.spec.specs import HardwareSpec, ModelSpec, Setup

GB = 10**9
MiB = 2**20
GiB = 2**30
TFLOPS = 1e12

# CUDA context, cuBLAS and NCCL workspaces: memory outside PyTorch's allocator. A CUDA 12 context with
# lazy module loading takes ~0.5 GiB on Hopper; NCCL communicators add a few hundred MiB each
# (PyTorch "CUDA semantics" notes; NCCL_BUFFSIZE default 4 MiB per channel and peer).
_GPU_RUNTIME_OVERHEAD_BYTES = 1 * GiB


# --- models -----------------------------------------------------------------------------------


def gpt2_style(name: str, n_layers: int, hidden: int, n_heads: int) -> ModelSpec:
    """A GPT-2 shaped model (GELU MLP of 4h, LayerNorm with bias, learned positions to 1024, tied head,
    biases everywhere, vocabulary 50257); variants through dataclasses.replace."""
    # openai-community/gpt2*/config.json: n_positions 1024, vocab 50257, tied head, biases everywhere.
    return ModelSpec(
        name=name,
        n_layers=n_layers,
        hidden=hidden,
        n_heads=n_heads,
        ffn_hidden=4 * hidden,
        vocab=50257,
        mlp="gelu",
        norm="layernorm",
        norm_bias=True,
        position="learned",
        max_positions=1024,
        tied_embeddings=True,
        qkv_bias=True,
        attn_out_bias=True,
        mlp_bias=True,
    )


def gpt2_124m() -> ModelSpec:
    """GPT-2 small: 124,439,808 parameters."""
    return gpt2_style("gpt2-124m", 12, 768, 12)


def gpt2_355m() -> ModelSpec:
    """GPT-2 medium: 354,823,168 parameters."""
    return gpt2_style("gpt2-355m", 24, 1024, 16)


def gpt2_774m() -> ModelSpec:
    """GPT-2 large: 774,030,080 parameters."""
    return gpt2_style("gpt2-774m", 36, 1280, 20)


def gpt2_1_5b() -> ModelSpec:
    """GPT-2 XL: 1,557,611,200 parameters."""
    return gpt2_style("gpt2-1.5b", 48, 1600, 25)


def _llama(name: str, n_layers: int, hidden: int, n_heads: int, n_kv: int, ffn: int, vocab: int, **kw) -> ModelSpec:
    return ModelSpec(
        name=name,
        n_layers=n_layers,
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        ffn_hidden=ffn,
        vocab=vocab,
        mlp="swiglu",
        norm="rmsnorm",
        position="rope",
        **kw,
    )


def llama_3_2_1b() -> ModelSpec:
    """meta-llama/Llama-3.2-1B: 1,235,814,400 parameters (tied embeddings)."""
    return _llama("llama-3.2-1b", 16, 2048, 32, 8, 8192, 128256, head_dim=64, tied_embeddings=True)


def llama_3_2_3b() -> ModelSpec:
    """meta-llama/Llama-3.2-3B: 3,212,749,824 parameters (tied embeddings)."""
    return _llama("llama-3.2-3b", 28, 3072, 24, 8, 8192, 128256, head_dim=128, tied_embeddings=True)


def llama_3_1_8b() -> ModelSpec:
    """meta-llama/Llama-3.1-8B: 8,030,261,248 parameters."""
    return _llama("llama-3.1-8b", 32, 4096, 32, 8, 14336, 128256)


def llama_3_1_70b() -> ModelSpec:
    """meta-llama/Llama-3.1-70B: 70,553,706,496 parameters."""
    return _llama("llama-3.1-70b", 80, 8192, 64, 8, 28672, 128256)


def llama_3_1_405b() -> ModelSpec:
    """meta-llama/Llama-3.1-405B: 405,853,388,800 parameters."""
    return _llama("llama-3.1-405b", 126, 16384, 128, 8, 53248, 128256)


def llama_2_7b() -> ModelSpec:
    """meta-llama/Llama-2-7b-hf: 6,738,415,616 parameters (multi-head attention, 4,096 positions)."""
    return _llama("llama-2-7b", 32, 4096, 32, 32, 11008, 32000, max_positions=4096)


def llama_2_13b() -> ModelSpec:
    """meta-llama/Llama-2-13b-hf: 13,015,864,320 parameters."""
    return _llama("llama-2-13b", 40, 5120, 40, 40, 13824, 32000, max_positions=4096)


def llama_2_70b() -> ModelSpec:
    """meta-llama/Llama-2-70b-hf: 68,976,648,192 parameters (8 KV heads)."""
    return _llama("llama-2-70b", 80, 8192, 64, 8, 28672, 32000, max_positions=4096)


def llama_3_8b() -> ModelSpec:
    """meta-llama/Meta-Llama-3-8B: Llama 3.1 8B's blocks and vocabulary at 8,192 positions."""
    return replace(llama_3_1_8b(), name="llama-3-8b", max_positions=8192)


def llama_3_70b() -> ModelSpec:
    """meta-llama/Meta-Llama-3-70B: Llama 3.1 70B's blocks and vocabulary at 8,192 positions."""
    return replace(llama_3_1_70b(), name="llama-3-70b", max_positions=8192)


def mistral_7b() -> ModelSpec:
    """mistralai/Mistral-7B-v0.1: 7,241,732,096 parameters."""
    return _llama("mistral-7b", 32, 4096, 32, 8, 14336, 32000, max_positions=32768)


def mixtral_8x7b() -> ModelSpec:
    """mistralai/Mixtral-8x7B-v0.1: 46,702,792,704 parameters, 8 experts, top-2 (12.9B active)."""
    return _llama("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, max_positions=32768, n_experts=8, top_k=2)


def llama_4_scout() -> ModelSpec:
    """meta-llama/Llama-4-Scout-17B-16E, language model only: 107,769,861,120 parameters.

    16 routed experts (top-1) plus one shared expert in every block, expert size 8192; 17.2B active.
    The vision encoder (the rest of the 109B) is not modelled.
    """
    return _llama(
        "llama-4-scout",
        48,
        5120,
        40,
        8,
        16384,
        202048,
        head_dim=128,
        max_positions=10485760,
        n_experts=16,
        top_k=1,
        n_shared_experts=1,
        expert_ffn_hidden=8192,
    )


def llama_4_maverick() -> ModelSpec:
    """meta-llama/Llama-4-Maverick-17B-128E, language model only: 400,711,848,960 parameters.

    MoE in every other block (interleave_moe_layer_step 2): 128 routed experts (top-1) plus a shared
    expert of size 8192; dense blocks have an MLP of 16384. 17.2B active.
    """
    return _llama(
        "llama-4-maverick",
        48,
        5120,
        40,
        8,
        16384,
        202048,
        head_dim=128,
        max_positions=1048576,
        n_experts=128,
        top_k=1,
        n_shared_experts=1,
        expert_ffn_hidden=8192,
        moe_layer_step=2,
    )


def tiny() -> ModelSpec:
    """A Llama-style model of 4,999,424 parameters for tests and demos on a CPU."""
    return _llama("tiny", 4, 256, 8, 4, 688, 8192, tied_embeddings=True, max_positions=2048)


def tiny_moe() -> ModelSpec:
    """A tiny mixture-of-experts model (4 experts, top-2) for tests and demos on a CPU."""
    return _llama("tiny-moe", 4, 256, 8, 4, 688, 8192, tied_embeddings=True, max_positions=2048, n_experts=4, top_k=2)


MODELS: dict[str, Callable[[], ModelSpec]] = {
    "tiny": tiny,
    "tiny-moe": tiny_moe,
    "gpt2-124m": gpt2_124m,
    "gpt2-355m": gpt2_355m,
    "gpt2-774m": gpt2_774m,
    "gpt2-1.5b": gpt2_1_5b,
    "llama-3.2-1b": llama_3_2_1b,
    "llama-3.2-3b": llama_3_2_3b,
    "llama-2-7b": llama_2_7b,
    "llama-2-13b": llama_2_13b,
    "llama-2-70b": llama_2_70b,
    "llama-3-8b": llama_3_8b,
    "llama-3-70b": llama_3_70b,
    "llama-3.1-8b": llama_3_1_8b,
    "llama-3.1-70b": llama_3_1_70b,
    "llama-3.1-405b": llama_3_1_405b,
    "mistral-7b": mistral_7b,
    "mixtral-8x7b": mixtral_8x7b,
    "llama-4-scout": llama_4_scout,
    "llama-4-maverick": llama_4_maverick,
}


def get_model(name: str) -> ModelSpec:
    """The preset model called ``name`` (see MODELS)."""
    try:
        return MODELS[name.lower()]()
    except (KeyError, AttributeError):  # AttributeError: not a name at all (None, a number, a list)
        raise SpecError(
            "model", name, f"unknown preset; choose one of {', '.join(MODELS)} or import a config.json"
        ) from None


# --- hardware ---------------------------------------------------------------------------------


def h100_sxm() -> HardwareSpec:
    """NVIDIA H100 SXM5 80 GB in an HGX/DGX H100 node.

    Datasheet (nvidia.com/en-us/data-center/h100; dense = half the sparsity figures): FP32 67,
    TF32 494.5, BF16/FP16 989.5, FP8 1979 TFLOP/s; HBM3 3.35 TB/s; NVLink 4 900 GB/s total (450 per direction); PCIe Gen5 x16
    64 GB/s per direction. DGX H100: 8 GPUs, 8x ConnectX-7 400 Gb/s (50 GB/s per GPU), 2 TB host
    memory, 2x Xeon 8480C (8 channels DDR5-4800 each: 2 x 307 GB/s).
    """
    return HardwareSpec(
        name="H100 SXM 80GB",
        memory_bytes=81559 * MiB,  # nvidia-smi total
        peak_fp32_flops=67 * TFLOPS,
        peak_tf32_flops=494.5 * TFLOPS,
        peak_bf16_flops=989.5 * TFLOPS,
        peak_fp16_flops=989.5 * TFLOPS,
        peak_fp8_flops=1979 * TFLOPS,
        mem_bw_bytes_per_s=3.35e12,
        gpus_per_node=8,
        intra_node_bw_bytes_per_s=450 * GB,
        inter_node_bw_bytes_per_s=50 * GB,
        host_link="pcie5",
        host_link_bw_bytes_per_s=64 * GB,
        host_memory_bytes=2048 * GB,
        host_mem_bw_bytes_per_s=614 * GB,
        # H200 measured here: bf16 8192^3 matmul ~790 TFLOP/s of 989 (DESIGN.md); same SMs as H100.
        matmul_efficiency_frac=0.80,
        runtime_overhead_bytes=_GPU_RUNTIME_OVERHEAD_BYTES,
        sm_count=132,  # H100 SXM5: 132 SMs (efficiency.py [SM]); H200 and GH200 the same GPU
    )


def h200() -> HardwareSpec:
    """NVIDIA H200 SXM 141 GB (HGX H200): H100 compute, HBM3e 4.8 TB/s.

    Datasheet (nvidia.com/en-us/data-center/h200): BF16 989 dense, FP8 1979 dense TFLOP/s; 141 GB HBM3e
    at 4.8 TB/s; NVLink 900 GB/s; PCIe Gen5. Measured on our H200: bf16 matmul ~790 TFLOP/s (0.80).
    """
    return replace(h100_sxm(), name="H200 141GB", memory_bytes=143771 * MiB, mem_bw_bytes_per_s=4.8e12)


def h100_pcie() -> HardwareSpec:
    """NVIDIA H100 PCIe 80 GB: the PCIe card of the H100 (114 of the SXM5's 132 SMs, HBM2e, 350 W).

    NVIDIA's H100 launch table, SXM and PCIe columns (reproduced at
    archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html; tensor figures there with sparsity, dense is
    half): PCIe FP32 51, TF32 378, BF16/FP16 756.5, FP8 1,513 TFLOP/s; 80 GB HBM2e at 2,000 GB/s;
    NVLink bridge 600 GB/s between two cards; PCIe Gen5 128 GB/s (64 per direction); 114 SMs. NVIDIA's
    product brief (PB-11133-001_v02, Nov 2022): "unconstrained up to its maximum thermal design power
    (TDP) level of 350 W", memory bandwidth "greater than 2,000 gigabytes per second". A node is
    modelled as one bridged pair (300 GB/s per direction); past it, traffic goes over PCIe or the NICs
    (50 GB/s per GPU, as the HGX nodes).
    """
    return replace(
        h100_sxm(),
        name="H100 PCIe 80GB",
        peak_fp32_flops=51 * TFLOPS,
        peak_tf32_flops=378 * TFLOPS,
        peak_bf16_flops=756.5 * TFLOPS,
        peak_fp16_flops=756.5 * TFLOPS,
        peak_fp8_flops=1513 * TFLOPS,
        mem_bw_bytes_per_s=2.0e12,
        gpus_per_node=2,
        intra_node_bw_bytes_per_s=300 * GB,
        sm_count=114,
    )


def h100_96gb_500w() -> HardwareSpec:
    """NVIDIA H100 96 GB HBM2e at a 500 W power limit: Meta's Grand Teton servers, where torchtitan
    measured its H100 benchmarks (pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md:
    "Each H100 GPU is equipped with 96GB HBM2e with 2.4 TB/sec peak memory bandwidth", "default 500W
    power limit"; 8 GPUs a host on NVLink, 400 Gb/s RDMA per GPU). Its peak is "between SXM and NVL,
    and we don't know its exact value" (torchtitan docs/performance.md, footnote 1): the midpoint of the
    SXM's 989.5 and the NVL's 835.5 dense bf16 TFLOP/s is taken, 912.5, fp8 twice that.
    """
    return replace(
        h100_sxm(),
        name="H100 96GB HBM2e 500W",
        memory_bytes=96 * GiB,
        peak_bf16_flops=912.5 * TFLOPS,
        peak_fp16_flops=912.5 * TFLOPS,
        peak_fp8_flops=1825 * TFLOPS,
        peak_tf32_flops=456.25 * TFLOPS,
        mem_bw_bytes_per_s=2.4e12,
    )


def h200_nvl() -> HardwareSpec:
    """NVIDIA H200 NVL 141 GB: the PCIe card of the H200, at a lower power limit (up to 600 W).

    Datasheet (nvidia.com/en-us/data-center/h200, H200 NVL column; dense = half the sparsity figures):
    FP32 60, TF32 417.5, BF16/FP16 835.5, FP8 1670.5 TFLOP/s; 141 GB HBM3e at 4.8 TB/s; NVLink bridge
    900 GB/s between 2 or 4 cards; PCIe Gen5 128 GB/s (64 per direction). A node is modelled as one
    4-card NVLink domain (450 GB/s per direction); past it, traffic goes over PCIe or the NICs
    (50 GB/s per GPU, as the HGX nodes).
    """
    return replace(
        h200(),
        name="H200 NVL 141GB",
        peak_fp32_flops=60 * TFLOPS,
        peak_tf32_flops=417.5 * TFLOPS,
        peak_bf16_flops=835.5 * TFLOPS,
        peak_fp16_flops=835.5 * TFLOPS,
        peak_fp8_flops=1670.5 * TFLOPS,
        gpus_per_node=4,
    )


def gh200() -> HardwareSpec:
    """NVIDIA GH200 Grace Hopper Superchip (96 GB HBM3 version), in a 4-superchip node.

    Datasheet (nvidia.com/en-us/data-center/grace-hopper-superchip): H100-class GPU, 96 GB HBM3 at
    4 TB/s; Grace CPU with up to 480 GB LPDDR5X at up to 512 GB/s; NVLink-C2C 900 GB/s total
    (450 per direction) between CPU and GPU, 7x PCIe Gen5. Node layout of the HPE Cray EX254n (Alps,
    JUPITER): 4 superchips, NVLink 4 between GPUs (150 GB/s per direction per pair), one 200 Gb/s
    Slingshot NIC per superchip (25 GB/s).
    """
    return HardwareSpec(
        name="GH200 96GB",
        memory_bytes=97871 * MiB,
        peak_fp32_flops=67 * TFLOPS,
        peak_tf32_flops=494.5 * TFLOPS,
        peak_bf16_flops=989.5 * TFLOPS,
        peak_fp16_flops=989.5 * TFLOPS,
        peak_fp8_flops=1979 * TFLOPS,
        mem_bw_bytes_per_s=4.0e12,
        gpus_per_node=4,
        intra_node_bw_bytes_per_s=150 * GB,
        inter_node_bw_bytes_per_s=25 * GB,
        host_link="nvlink-c2c",
        host_link_bw_bytes_per_s=450 * GB,
        host_memory_bytes=4 * 480 * GB,
        host_mem_bw_bytes_per_s=4 * 512 * GB,
        matmul_efficiency_frac=0.80,
        runtime_overhead_bytes=_GPU_RUNTIME_OVERHEAD_BYTES,
        sm_count=132,  # the H100 GPU of the superchip (efficiency.py [SM])
    )


def b200() -> HardwareSpec:
    """NVIDIA B200 180 GB (Blackwell) in an HGX/DGX B200 node.

    Datasheet (nvidia.com/en-us/data-center/hgx, HGX B200 column: 8-GPU totals with sparsity, so per
    GPU dense = total / 8 / 2): FP32 75 (600 / 8, no sparsity), TF32 1,125, BF16/FP16 2,250, FP8 4,500
    TFLOP/s; 180 GB HBM3e per GPU (1.44 TB), 8 TB/s (64 TB/s); NVLink 5 1.8 TB/s total per GPU (900
    per direction) through NVSwitch; PCIe Gen5 x16 to the host. DGX B200: 8x ConnectX-7 400 Gb/s
    (50 GB/s per GPU), 2 TB host memory, 2x Xeon Platinum 8570 (8 channels DDR5-5600 each: 2 x 358
    GB/s). The driver reports 183,359 MiB. The GEMM efficiency is the Hopper one measured on our H200
    (0.80), not yet measured on Blackwell: ``python -m advisor calibrate`` and ``ceilings`` on a B200
    correct it.
    """
    return HardwareSpec(
        name="B200 180GB",
        memory_bytes=183359 * MiB,  # nvidia-smi total
        peak_fp32_flops=75 * TFLOPS,
        peak_tf32_flops=1125 * TFLOPS,
        peak_bf16_flops=2250 * TFLOPS,
        peak_fp16_flops=2250 * TFLOPS,
        peak_fp8_flops=4500 * TFLOPS,
        mem_bw_bytes_per_s=8.0e12,
        gpus_per_node=8,
        intra_node_bw_bytes_per_s=900 * GB,
        inter_node_bw_bytes_per_s=50 * GB,
        host_link="pcie5",
        host_link_bw_bytes_per_s=64 * GB,
        host_memory_bytes=2048 * GB,
        host_mem_bw_bytes_per_s=717 * GB,
        matmul_efficiency_frac=0.80,
        runtime_overhead_bytes=_GPU_RUNTIME_OVERHEAD_BYTES,
        sm_count=148,  # 74 SMs per die, two dies (efficiency.py [SM])
    )


def gb200_nvl72() -> HardwareSpec:
    """NVIDIA GB200 NVL72: 72 Blackwell GPUs (186 GB, 1,200 W) and 36 Grace CPUs in one NVLink domain.

    Datasheet (nvidia.com/en-us/data-center/gb200-nvl72: rack totals, tensor figures with sparsity, so
    per GPU dense = total / 72 / 2): FP32 80 (5,760 / 72), TF32 1,250, BF16/FP16 2,500, FP8 5,000
    TFLOP/s; 13.4 TB HBM3e (186 GB per GPU) at 576 TB/s (8 TB/s per GPU); NVLink 5 130 TB/s (1.8 TB/s
    per GPU, 900 per direction) across the whole rack, so the rack is one "node" here: TP, EP and FSDP
    inside it run on NVLink. Each Grace (480 GB LPDDR5X, 512 GB/s; 17 TB and 18.4 TB/s per rack) feeds
    two GPUs over one NVLink-C2C of 900 GB/s total: 225 GB/s per GPU per direction. Across racks, one
    ConnectX-7 400 Gb/s NIC per GPU (4 per compute tray): 50 GB/s. The driver reports 189,471 MiB.
    GEMM efficiency as for the B200 (Hopper's measured 0.80, an assumption until measured).
    """
    return HardwareSpec(
        name="GB200 NVL72 186GB",
        memory_bytes=189471 * MiB,  # nvidia-smi total
        peak_fp32_flops=80 * TFLOPS,
        peak_tf32_flops=1250 * TFLOPS,
        peak_bf16_flops=2500 * TFLOPS,
        peak_fp16_flops=2500 * TFLOPS,
        peak_fp8_flops=5000 * TFLOPS,
        mem_bw_bytes_per_s=8.0e12,
        gpus_per_node=72,
        intra_node_bw_bytes_per_s=900 * GB,
        inter_node_bw_bytes_per_s=50 * GB,
        host_link="nvlink-c2c",
        host_link_bw_bytes_per_s=225 * GB,
        host_memory_bytes=36 * 480 * GB,
        host_mem_bw_bytes_per_s=36 * 512 * GB,
        matmul_efficiency_frac=0.80,
        runtime_overhead_bytes=_GPU_RUNTIME_OVERHEAD_BYTES,
        sm_count=148,  # the B200 GPU (efficiency.py [SM]), assumed the same in GB200
    )


def _a100(name: str, memory_bytes: int, mem_bw: float) -> HardwareSpec:
    # Datasheet (nvidia.com/en-us/data-center/a100, dense): FP32 19.5, TF32 156, BF16/FP16 312 TFLOP/s,
    # no FP8; NVLink 3 600 GB/s total (300 per direction); PCIe Gen4 x16 32 GB/s per direction.
    # DGX A100: 8 GPUs, 8x ConnectX-6 200 Gb/s (25 GB/s per GPU), 1 TB (2 TB option) host memory,
    # 2x EPYC 7742 (8 channels DDR4-3200: 2 x 205 GB/s).
    return HardwareSpec(
        name=name,
        memory_bytes=memory_bytes,
        peak_fp32_flops=19.5 * TFLOPS,
        peak_tf32_flops=156 * TFLOPS,
        peak_bf16_flops=312 * TFLOPS,
        peak_fp16_flops=312 * TFLOPS,
        peak_fp8_flops=0.0,
        mem_bw_bytes_per_s=mem_bw,
        gpus_per_node=8,
        intra_node_bw_bytes_per_s=300 * GB,
        inter_node_bw_bytes_per_s=25 * GB,
        host_link="pcie4",
        host_link_bw_bytes_per_s=32 * GB,
        host_memory_bytes=1024 * GB,
        host_mem_bw_bytes_per_s=410 * GB,
        # Large bf16 GEMMs reach ~250-270 of 312 TFLOP/s on A100 (cuBLAS, NVIDIA Megatron reports).
        matmul_efficiency_frac=0.82,
        runtime_overhead_bytes=_GPU_RUNTIME_OVERHEAD_BYTES,
        sm_count=108,  # A100: 108 SMs (efficiency.py [SM])
    )


def a100_80gb() -> HardwareSpec:
    """NVIDIA A100 SXM4 80 GB: HBM2e 2.039 TB/s."""
    return _a100("A100 SXM 80GB", 81920 * MiB, 2.039e12)


def a100_40gb() -> HardwareSpec:
    """NVIDIA A100 SXM4 40 GB: HBM2 1.555 TB/s."""
    return _a100("A100 SXM 40GB", 40960 * MiB, 1.555e12)


def v100() -> HardwareSpec:
    """NVIDIA Tesla V100 SXM2 32 GB (Volta, 2017).

    Datasheet (images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf,
    SXM2): FP32 15.7, FP16 tensor cores 125 TFLOP/s; no TF32, BF16 or FP8 math (bf16 is refused, as
    on the real card where PyTorch emulates it); HBM2 900 GB/s; NVLink 2 300 GB/s total (150 per
    direction); PCIe Gen3 x16 16 GB/s per direction. DGX-1: 8 GPUs, 4x 100 Gb/s InfiniBand for 8 GPUs
    (~6 GB/s per GPU), 512 GB host memory, 2x Xeon E5-2698 v4 (4 channels DDR4-2400: 2 x 77 GB/s).
    """
    return HardwareSpec(
        name="V100 SXM2 32GB",
        memory_bytes=32510 * MiB,
        peak_fp32_flops=15.7 * TFLOPS,
        peak_tf32_flops=0.0,
        peak_bf16_flops=0.0,
        peak_fp16_flops=125 * TFLOPS,
        peak_fp8_flops=0.0,
        mem_bw_bytes_per_s=900 * GB,
        gpus_per_node=8,
        intra_node_bw_bytes_per_s=150 * GB,
        inter_node_bw_bytes_per_s=6.25 * GB,
        host_link="pcie3",
        host_link_bw_bytes_per_s=16 * GB,
        host_memory_bytes=512 * GB,
        host_mem_bw_bytes_per_s=154 * GB,
        # fp16 GEMMs on V100 reach ~80-90 of 125 TFLOP/s (cuBLAS; NVIDIA's Megatron-LM V100 reports).
        matmul_efficiency_frac=0.70,
        runtime_overhead_bytes=_GPU_RUNTIME_OVERHEAD_BYTES,
    )


def l40s() -> HardwareSpec:
    """NVIDIA L40S 48 GB (PCIe card, no NVLink).

    Datasheet (nvidia.com/en-us/data-center/l40s, dense = half the sparse figures): FP32 91.6,
    TF32 183, BF16/FP16 362, FP8 733 TFLOP/s; GDDR6 864 GB/s; PCIe Gen4 x16 32 GB/s per direction,
    which is also the GPU-to-GPU path. Typical 8-GPU server with 200 Gb/s per GPU across nodes.
    """
    return HardwareSpec(
        name="L40S 48GB",
        memory_bytes=46068 * MiB,
        peak_fp32_flops=91.6 * TFLOPS,
        peak_tf32_flops=183 * TFLOPS,
        peak_bf16_flops=362 * TFLOPS,
        peak_fp16_flops=362 * TFLOPS,
        peak_fp8_flops=733 * TFLOPS,
        mem_bw_bytes_per_s=864 * GB,
        gpus_per_node=8,
        intra_node_bw_bytes_per_s=32 * GB,
        inter_node_bw_bytes_per_s=25 * GB,
        host_link="pcie4",
        host_link_bw_bytes_per_s=32 * GB,
        host_memory_bytes=1024 * GB,
        host_mem_bw_bytes_per_s=307 * GB,
        matmul_efficiency_frac=0.70,
        runtime_overhead_bytes=_GPU_RUNTIME_OVERHEAD_BYTES,
    )


def mi250() -> HardwareSpec:
    """One GCD of an AMD Instinct MI250 (CDNA 2), in a node of four OAMs: eight GCDs.

    PyTorch sees each of the package's two GCDs (graphics compute dies) as a device of its own, with
    half the package's figures, so the preset is one GCD. AMD's ROCm docs, "AMD Instinct MI250
    microarchitecture" (rocm.docs.amd.com/en/latest/conceptual/gpu-arch/mi250.html; ROCm/ROCm @ e396b489
    docs/conceptual/gpu-arch/mi250.md), peaks of the OAM (dense: CDNA 2 has no sparsity; FLOPS/clock/CU x
    208 CUs x 1.7 GHz): matrix FP64 90.5, vector FP64 45.3, matrix and packed FP32 90.5, vector FP32 45.3,
    matrix FP16/BF16 362.1 TFLOP/s; no TF32 or FP8 math. A GCD: 104 CUs, half of each (FP32 45.25 on the
    matrix cores, where rocBLAS/hipBLASLt run fp32 GEMMs; FP16/BF16 181.05); HBM2e 1.6 TB/s a GCD, 64 GiB
    (the driver reports 65,520 MiB: HTA's MI250 trace). Infinity Fabric links of 50 GB/s per direction:
    four between the package's two GCDs (200 GB/s), one or two between GCDs of different OAMs; a ring
    over a node's eight GCDs crosses OAMs, so the two-link 100 GB/s per direction is taken. Each GCD
    has its own PCIe Gen4 x16 to the host (32 GB/s per direction). Node as Frontier's and LUMI's (OLCF
    Frontier User Guide, summarised at glennklockwood.com/garden/systems/frontier): four 200 Gb/s
    Slingshot NICs for eight GCDs (12.5 GB/s a GCD), 512 GB DDR4 at 205 GB/s. No GEMM share measured
    on CDNA here: the default stands until ``python -m advisor calibrate`` or ``ceilings`` measure it.
    """
    return HardwareSpec(
        name="MI250 GCD 64GB",
        memory_bytes=65520 * MiB,
        peak_fp32_flops=90.5 / 2 * TFLOPS,
        peak_tf32_flops=0.0,
        peak_bf16_flops=362.1 / 2 * TFLOPS,
        peak_fp16_flops=362.1 / 2 * TFLOPS,
        peak_fp8_flops=0.0,
        mem_bw_bytes_per_s=1.6e12,
        gpus_per_node=8,
        intra_node_bw_bytes_per_s=100 * GB,
        inter_node_bw_bytes_per_s=12.5 * GB,
        host_link="pcie4",
        host_link_bw_bytes_per_s=32 * GB,
        host_memory_bytes=512 * GB,
        host_mem_bw_bytes_per_s=205 * GB,
        runtime_overhead_bytes=_GPU_RUNTIME_OVERHEAD_BYTES,
        sm_count=104,  # compute units play the SMs' part in the wave model
    )


def mi250x() -> HardwareSpec:
    """One GCD of an AMD Instinct MI250X: the MI250's GCD with 110 CUs instead of 104 (ROCm docs, "GPU
    hardware specifications": 220 CUs, 110 per GCD; ROCm/ROCm @ e396b489 docs/reference/gpu-arch-specs.rst)
    at the same per-CU rates and 1.7 GHz: AMD's MI250X figures (OAM, dense) matrix FP64/FP32 95.7,
    vector FP64/FP32 47.9, FP16/BF16 383.0 TFLOP/s, 128 GB HBM2e at 3.2 TB/s, halved for a GCD. The node,
    links and memory system are the MI250's (Frontier and LUMI run MI250X nodes of that layout)."""
    return replace(
        mi250(),
        name="MI250X GCD 64GB",
        peak_fp32_flops=95.7 / 2 * TFLOPS,
        peak_bf16_flops=383.0 / 2 * TFLOPS,
        peak_fp16_flops=383.0 / 2 * TFLOPS,
        sm_count=110,
    )


def mi300x() -> HardwareSpec:
    """AMD Instinct MI300X 192 GB (CDNA 3) in an 8-GPU OAM platform.

    AMD's ROCm docs, "AMD Instinct MI300 series microarchitecture" (rocm.docs.amd.com/en/latest/
    conceptual/gpu-arch/mi300.html; ROCm/ROCm @ e396b489 docs/conceptual/gpu-arch/mi300.md), peaks as
    FLOPS/clock/CU x 304 CUs x 2.1 GHz, so dense (AMD's datasheet doubles the FP16/BF16/FP8 figures
    "with structured sparsity"; those are not used): matrix FP64 163.4, vector FP64 81.7, matrix and
    vector FP32 163.4, TF32 653.7, FP16/BF16 1307.4, FP8 2614.9 TFLOP/s; HBM3 5.3 TB/s; 192 GB (the
    driver reports 196,592 MiB: AMD-AGI/TraceLens's MI300X trace). Seven Infinity Fabric (xGMI) links
    connect each GPU to the other seven, each "rated up to 64 GB/s" (AMD ROCm blog, "Understanding RCCL
    Bandwidth and xGMI Performance on AMD Instinct MI300X", 2025: about 48 usable): 448 GB/s per
    direction. PCIe Gen5 x16 to the host (64 GB/s per direction). Node: AMD's MLPerf system
    (mlcommons/inference_results_v4.1 closed/AMD/systems/8xMI300X_2xEPYC-9374F.json: 1.5 TiB of
    24 x 64 GB DDR5-4800 on 2x EPYC 9374F, 12 channels each: 2 x 460.8 GB/s) with the 400 Gb/s NIC
    per GPU of Azure's ND MI300X v5 ("8x400 Gigabit NDR", MicrosoftDocs azure-docs
    nd-mi300x-v5-series.md): 50 GB/s a GPU. No GEMM share measured on CDNA here: the default stands
    until ``python -m advisor calibrate`` or ``ceilings`` measure it.
    """
    return HardwareSpec(
        name="MI300X 192GB",
        memory_bytes=196592 * MiB,
        peak_fp32_flops=163.4 * TFLOPS,
        peak_tf32_flops=653.7 * TFLOPS,
        peak_bf16_flops=1307.4 * TFLOPS,
        peak_fp16_flops=1307.4 * TFLOPS,
        peak_fp8_flops=2614.9 * TFLOPS,
        mem_bw_bytes_per_s=5.3e12,
        gpus_per_node=8,
        intra_node_bw_bytes_per_s=7 * 64 * GB,
        inter_node_bw_bytes_per_s=50 * GB,
        host_link="pcie5",
        host_link_bw_bytes_per_s=64 * GB,
        host_memory_bytes=24 * 64 * GiB,
        host_mem_bw_bytes_per_s=2 * 460.8 * GB,
        runtime_overhead_bytes=_GPU_RUNTIME_OVERHEAD_BYTES,
        sm_count=304,  # compute units play the SMs' part in the wave model
    )


def _cpuinfo(key: str) -> str:
    """The value of the first ``key`` line of /proc/cpuinfo ('' where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> set[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where it cannot be read)."""
    return set(_cpuinfo("flags").split())


# The CPU features that set this machine's matrix peaks in cpu_host(): recorded with each run, since a
# CPU host's name carries only its core count.
CPU_MATRIX_FLAGS = frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16"})


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it ('' where it cannot be read)."""
    return _cpuinfo("model name")


def cpu_cores() -> int:
    """This machine's logical CPU count (1 where the OS does not say)."""
    return os.cpu_count() or 1


def cpu_host(flags: Iterable[str] | None = None) -> HardwareSpec:
    """This machine's CPU as the training device (the profiled step's fallback without a GPU).

    Memory is read from the OS. FLOP/s assume AVX2 with two FMA units: 2 x 8 fp32 lanes x 2 FLOP per
    cycle at ~3 GHz = 96 GFLOP/s per core (a 1024^3 fp32 matmul measured 176 GFLOP/s on 2 cores of our
    EPYC). With AVX512_BF16 (VDPBF16PS: two bf16 products per 32-bit lane, Intel SDM vol. 2) a bf16
    matmul measured 3.5x fp32 there (oneDNN: 625 GFLOP/s), the factor taken; AMX-BF16 sixteen times
    (1024 FLOP per cycle per core against 64, Intel's AMX overview). fp16 has no fast GEMM on these CPUs:
    without AVX512_FP16 PyTorch's CPU build falls back to a scalar loop, measured at 1/70 of fp32 (512^3
    matmul on an AVX512-BF16 EPYC: 2.5 vs 176 GFLOP/s; bf16 625), taken as 1/50; with AVX512_FP16 (a
    Sapphire Rapids Xeon with AMX-BF16, torch 2.13) it runs at fp32's pace, 0.8 to 1.4x over 512^3 to
    2048^3 matmuls (2048^3: fp32 106, fp16 109, bf16 610 GFLOP/s), taken as 1x. Only AMX-FP16 (Granite
    Rapids, not measured here) has fp16 tiles at the AMX-BF16 rate. Without AVX512_BF16 or AMX, bf16 is no faster path either: on an AVX2-only EPYC a linear
    layer's forward and backward under bf16 autocast (1024 x 256 x 688) ran at 1/31 of fp32 (3.2 vs
    100 GFLOP/s; fp16 1/40), the tiny model's whole step 1/23 (10.7 s against 0.47 s), taken as 1/30.
    DRAM ~10 GB/s per core. Processes on one host talk through gloo over loopback: a 2-process
    all-reduce of 4-64 MiB measured 1.2-1.5 GB/s bus bandwidth here, taken as 1.6 GB/s of link (the
    estimator applies its 0.8 collective efficiency). These are rough: the calibration (``python -m
    advisor calibrate``) learns this machine's real rates.

    ``flags``: the CPU features to assume instead of this machine's (a stored run's recorded
    ``cpu_matrix_flags``, so a run is judged by the matrix units of the machine that ran it).
    """
    cores = cpu_cores()
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 16 * GiB
    peak = 96e9 * cores
    flags = cpu_flags() if flags is None else set(flags)
    bf16 = 16 if "amx_bf16" in flags else 3.5 if "avx512_bf16" in flags else 1 / 30
    fp16 = 16 if "amx_fp16" in flags else 1 if "avx512_fp16" in flags else 1 / 50
    return HardwareSpec(
        name=f"CPU host ({cores} cores)",
        memory_bytes=int(memory),
        peak_fp32_flops=peak,
        peak_tf32_flops=0.0,
        peak_bf16_flops=peak * bf16,
        peak_fp16_flops=peak * fp16,
        peak_fp8_flops=0.0,
        mem_bw_bytes_per_s=10 * GB * cores,
        gpus_per_node=cores,  # ranks on this host share it; gloo connects them over loopback
        intra_node_bw_bytes_per_s=1.6 * GB,
        host_link="none",
        host_memory_bytes=int(memory),
        host_mem_bw_bytes_per_s=10 * GB * cores,
        matmul_efficiency_frac=0.5,
        kind="cpu",
    )


HARDWARE: dict[str, Callable[[], HardwareSpec]] = {
    "h100": h100_sxm,
    "h100-pcie": h100_pcie,
    "h100-96gb-500w": h100_96gb_500w,
    "h200": h200,
    "h200-nvl": h200_nvl,
    "gh200": gh200,
    "b200": b200,
    "gb200": gb200_nvl72,
    "a100-80gb": a100_80gb,
    "a100-40gb": a100_40gb,
    "l40s": l40s,
    "v100": v100,
    "mi300x": mi300x,
    "mi250x": mi250x,
    "mi250": mi250,
    "cpu": cpu_host,
}

_HARDWARE_ALIASES = {"h100-sxm": "h100", "a100": "a100-80gb", "gb200-nvl72": "gb200"}


def get_hardware(name: str) -> HardwareSpec:
    """The preset device called ``name`` (see HARDWARE)."""
    try:
        key = name.lower()
        return HARDWARE[_HARDWARE_ALIASES.get(key, key)]()
    except (KeyError, AttributeError):  # AttributeError: not a name at all (None, a number, a list)
        raise SpecError("gpu", name, f"unknown device; choose one of {', '.join(HARDWARE)}") from None


def hardware_key(hw: HardwareSpec) -> str | None:
    """The HARDWARE key of a device spec: "cpu" for any CPU host (its name carries the core count of
    the machine that ran it), else the preset of the same name; None for a device the presets lack."""
    if hw.kind == "cpu":
        return "cpu"
    return next((key for key, make in HARDWARE.items() if make().name == hw.name), None)


def device_slug(name: str) -> str:
    """A device (or any) name as a file-name part: lower case, runs of other characters as one '-'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


# GPU names as the driver reports them -> presets, most specific first ("B200" is in "GB200").
_GPU_NAME_PRESETS = (
    ("GB200", "gb200"),
    ("B200", "b200"),
    ("GH200", "gh200"),
    ("H200 NVL", "h200-nvl"),
    ("H200", "h200"),
    ("H100 PCIe", "h100-pcie"),
    # The H100 NVL (94 GB, a PCIe card with an NVLink bridge) has no preset: its datasheet roofs were not
    # read from a source here, and the SXM's would overstate a PCIe card's. Named, it is "unknown".
    ("H100 NVL", None),
    ("H100", "h100"),
    ("A100-SXM4-40GB", "a100-40gb"),
    ("A100-PCIE-40GB", "a100-40gb"),
    ("A100", "a100-80gb"),
    ("L40S", "l40s"),
    ("V100", "v100"),
    # ROCm: "AMD Instinct MI300X" (and "... MI300X VF" in a VM), "AMD Instinct MI250X"; some ROCm
    # versions name both MI200 OAMs "AMD Instinct MI250X / MI250", read as the MI250X.
    ("MI300X", "mi300x"),
    ("MI250X", "mi250x"),
    ("MI250", "mi250"),
)
# What ROCm calls any AMD GPU whose marketing name it cannot look up (ROCm/TheRock#4693: "If it can't
# find the amdgpu.ids file..."; HTA's MI250 trace): the kernel names then tell the architecture.
_GENERIC_GPU_NAMES = ("AMD Radeon Graphics",)
# Kernel names that give a GPU generation away when a trace names no device: (pattern, preset).
_KERNEL_ARCH_PRESETS = (
    # Tensile GEMMs (rocBLAS, hipBLASLt) name their ISA: gfx90a is CDNA 2 (MI210/MI250/MI250X: the MI250,
    # whose GCD the MI210 also has), gfx942 CDNA 3 (MI300X; also the MI300A and MI325X).
    (re.compile(r"_ISA90a_", re.IGNORECASE), "mi250"),
    (re.compile(r"_ISA942_", re.IGNORECASE), "mi300x"),
    # Blackwell's cuBLAS/CUTLASS kernels name their target (sm100_xmma_..., cutlass3x_sm100_...) and its
    # MMA (tcgen05); tried before Hopper's, since nvjet kernels exist on both.
    (re.compile(r"sm_?100|tcgen05|blackwell", re.IGNORECASE), "b200"),
    (re.compile(r"sm90|wgmma|nvjet|hopper", re.IGNORECASE), "h100"),
    (re.compile(r"sm80|ampere_|cutlass_80", re.IGNORECASE), "a100-80gb"),
    (re.compile(r"sm70|volta_", re.IGNORECASE), "v100"),
)


def hardware_for_gpu_name(name: str, memory_bytes: int = 0) -> HardwareSpec | None:
    """The preset matching a GPU name as the driver reports it ('NVIDIA A100-PG509-200'), with the
    driver's memory where given; an A100 with under 50 GB is the 40 GB part (HBM2, 1.555 TB/s).
    None for a GPU with no preset."""
    for key, preset in _GPU_NAME_PRESETS:
        if key.lower() in name.lower():
            if preset is None:
                return None
            if preset == "a100-80gb" and 0 < memory_bytes < 50 * GiB:
                preset = "a100-40gb"
            hw = HARDWARE[preset]()
            return replace(hw, memory_bytes=int(memory_bytes)) if memory_bytes > 0 else hw
    return None


def hardware_for_trace(
    gpus: Sequence[tuple[str, int]], kernel_names: Iterable[str] = ()
) -> tuple[HardwareSpec | None, str]:
    """The device a GPU trace ran on, and how it was found: by the device (name, memory bytes or 0)
    the trace records, else by the GPU generation its kernel names give away (cuBLAS/CUTLASS name their
    target: ``ampere_sgemm``, ``cutlass_80_tensorop``, ``volta_sgemm``, ``sm90_xmma``; Tensile its ISA:
    ``_ISA90a_``, ``_ISA942_``), also where the trace names only ROCm's generic "AMD Radeon Graphics"
    (with the memory it records). (None, reason) when neither tells."""
    for name, memory in gpus:
        hw = hardware_for_gpu_name(name, memory)
        if hw is not None:
            return hw, f"{hw.name}: the trace's device is {name}"
    named = [name for name, _ in gpus if name.strip() not in _GENERIC_GPU_NAMES]
    if named:
        return None, f"no preset for {named[0]}; pass the GPU to use its datasheet roofs"
    memory = max((int(m) for _, m in gpus), default=0)
    why = f"the trace names its device only {gpus[0][0]!r}" if gpus else "the trace names no device"
    kernel_names = list(kernel_names)
    for pattern, preset in _KERNEL_ARCH_PRESETS:
        hit = next((k for k in kernel_names if pattern.search(k)), None)
        if hit is not None:
            hw = HARDWARE[preset]()
            hw = replace(hw, memory_bytes=memory) if memory > 0 else hw
            return hw, f"{hw.name}, guessed from kernel names ({hit[:40]}...): {why}"
    return None, f"{why} and its kernel names give no GPU generation away"


def local_hardware(device_type: str) -> HardwareSpec:
    """This machine's device as a HardwareSpec: the CPU host, or the visible GPU matched to a preset by
    name (memory taken from the driver). An unknown GPU keeps the H100 datasheet peaks, and says so."""
    if device_type != "cuda":
        return cpu_host()
    import torch

    props = torch.cuda.get_device_properties(0)
    hw = hardware_for_gpu_name(props.name, int(props.total_memory))
    if hw is not None:
        return hw
    return replace(
        h100_sxm(), name=f"{props.name} (peaks unknown: H100 datasheet used)", memory_bytes=int(props.total_memory)
    )


def fastest_precision(hw: HardwareSpec) -> str:
    """The training precision with the highest peak on ``hw`` among fp32, bf16 and fp16 autocast (fp8
    needs TransformerEngine): bf16 on Ampere and newer and on CPUs with AVX512-BF16 or AMX, fp16 on a
    V100, fp32 on a CPU without a 16-bit matrix unit (bf16 runs at 1/30 of fp32 there). Ties go to
    bf16 (no GradScaler, fp32's range), then fp32."""
    return max(("fp32", "fp16", "bf16"), key=lambda p: (hw.peak_flops(p), p == "bf16", p == "fp32"))


def recorded_cpu_flags(record: dict) -> list[str] | None:
    """The CPU matrix units a run record's environment names (None for a run that predates them)."""
    env = record.get("environment") if isinstance(record, dict) else None
    flags = env.get("cpu_matrix_flags") if isinstance(env, dict) else None
    return [f for f in flags if isinstance(f, str)] if isinstance(flags, list) else None


def current_hardware(hw: HardwareSpec, cpu_matrix_flags: Iterable[str] | None = None) -> HardwareSpec:
    """The spec this version of the advisor gives the device a stored run recorded as ``hw``: a CPU
    host of the same name with the matrix units the run recorded (``cpu_matrix_flags``, from its
    environment.json; this machine's where it recorded none), or the preset of the same name (with the
    memory the run recorded), so that stored runs are estimated with the current peaks. A device it
    does not know is returned unchanged."""
    if hw.kind == "cpu":
        cpu = cpu_host(cpu_matrix_flags)
        return cpu if hw.name == cpu.name else hw
    for make in HARDWARE.values():
        preset = make()
        if preset.name == hw.name:
            return replace(preset, memory_bytes=hw.memory_bytes)
    return hw


def device_key_for(obj: Setup | HardwareSpec | StepMetrics | dict) -> str:
    """A file-name-safe key naming one device, e.g. ``cpu-cpu-host-2-cores`` or ``gpu-h200-141gb``.

    Accepts a Setup (its hardware), a HardwareSpec, a StepMetrics, a metrics dict (``device_type``,
    ``device_name``) or a run.json record (its ``setup``). Runs and setups that name the same device
    give the same key; on a GPU a metrics record names the device as NVML does, so runs are keyed by
    the hardware in their recorded setup instead.
    """
    if isinstance(obj, Setup):
        obj = obj.hardware
    if isinstance(obj, HardwareSpec):
        return device_slug(f"{obj.kind}-{obj.name}")
    if isinstance(obj, StepMetrics):
        obj = {"device_type": obj.device_type, "device_name": obj.device_name}
    if isinstance(obj, dict):
        if isinstance(obj.get("setup"), dict) and isinstance(obj["setup"].get("hardware"), dict):
            hw = obj["setup"]["hardware"]
            return device_slug(f"{hw.get('kind', 'gpu')}-{hw.get('name', '')}")
        if obj.get("device_type") and obj.get("device_name"):
            kind = "gpu" if obj["device_type"] == "cuda" else "cpu"
            return device_slug(f"{kind}-{obj['device_name']}")
    raise AdvisorError(f"cannot name a device from {type(obj).__name__}: need a Setup, HardwareSpec or StepMetrics")
