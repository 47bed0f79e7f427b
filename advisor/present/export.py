"""Export: a Setup as the launch configuration of the framework that will run it.

Five targets, each written with the framework's own argument or key names (read from its source at
the commit in SOURCES; ``tests/data/export_names.json`` holds the names, written by
``scripts/export_names.py``, and the tests check every emitted name against it):

- ``megatron``: ``pretrain_gpt.py`` arguments of Megatron-LM, as a torchrun command line;
- ``nemo``: ConfigContainer overrides of Megatron-Bridge (NeMo's successor to NeMo 2 recipes), one
  ``section.field=value`` a line, as its ``scripts/training/run_recipe.py`` takes them;
- ``torchtitan``: a TOML job config (torchtitan's JobConfig up to February 2026; later releases take
  Python config functions, the same sections and names);
- ``deepspeed``: a DeepSpeed JSON config;
- ``accelerate``: an ``accelerate launch --config_file`` YAML (FSDP2, DDP or the DeepSpeed plugin).

A setting the framework cannot express is never dropped: it becomes a note, printed as a comment in
the file (a ``_advisor_notes`` list in DeepSpeed's JSON, which has no comments) and returned. A setup
that makes no sense for the framework (a CPU device; an optimizer or precision it lacks) is refused
with an AdvisorError naming the field, the value and what the framework takes.
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass

import yaml

from advisor.errors import SpecError
from advisor.estimate.planner import layout_label
from advisor.spec.specs import Setup, divisors_text
from advisor.spec.stages import megatron_stage_layers

EXPORT_TARGETS = ("megatron", "nemo", "torchtitan", "deepspeed", "accelerate")

SOURCES: dict[str, tuple[str, str, str]] = {
    "megatron": ("NVIDIA/Megatron-LM", "d98e8a64ddf34856e74b24714e3bedb2f5a39553", "megatron/training/arguments.py"),
    "nemo": (
        "NVIDIA-NeMo/Megatron-Bridge",
        "067f987df03b8355b03192d88d70f1709fedf51a",
        "src/megatron/bridge/training/config.py",
    ),
    "torchtitan": ("pytorch/torchtitan", "e347b1e5e6b6941d789d16d340145294d82dc71e", "torchtitan/config/job_config.py"),
    "deepspeed": ("deepspeedai/DeepSpeed", "edaa7221267243c7be7fb49c5d5f5c4fb97b4641", "deepspeed/runtime/config.py"),
    "accelerate": (
        "huggingface/accelerate",
        "16cb6eb80dd9aa8b4df1a63ef57863e455d53b83",
        "src/accelerate/commands/config/config_args.py",
    ),
}
"""Where each target's names were read: (repository, commit, main file)."""

_TITLES = {
    "megatron": "Megatron-LM pretrain_gpt.py arguments",
    "nemo": "Megatron-Bridge (NeMo) ConfigContainer overrides",
    "torchtitan": "torchtitan job config (TOML)",
    "deepspeed": "DeepSpeed config (JSON)",
    "accelerate": "HF Accelerate config (YAML)",
}
_SUFFIX = {"megatron": "sh", "nemo": "overrides", "torchtitan": "toml", "deepspeed": "json", "accelerate": "yaml"}

# torchtitan reads the architecture from its model registry (torchtitan/models/*/__init__.py at the
# SOURCES commit), not from the job config: the flavors whose shapes our presets have.
_TITAN_FLAVORS = {
    ("llama3", "8B"): {"hidden": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "ffn_hidden": 14336},
    ("llama3", "70B"): {"hidden": 8192, "n_layers": 80, "n_heads": 64, "n_kv_heads": 8, "ffn_hidden": 28672},
    ("llama3", "405B"): {"hidden": 16384, "n_layers": 126, "n_heads": 128, "n_kv_heads": 8, "ffn_hidden": 53248},
    ("llama4", "17bx16e"): {"hidden": 5120, "n_layers": 48, "n_heads": 40, "n_kv_heads": 8, "n_experts": 16},
    ("llama4", "17bx128e"): {"hidden": 5120, "n_layers": 48, "n_heads": 40, "n_kv_heads": 8, "n_experts": 128},
}
_TITAN_MOE_STEP = {"17bx16e": 1, "17bx128e": 2}  # interleave_moe_layer_step (17bx16e sets 1; the default is 2)


@dataclass(frozen=True)
class Export:
    """One setup written for one framework."""

    framework: str
    """One of EXPORT_TARGETS."""
    text: str
    """The file's content."""
    filename: str
    """A name to save it under: ``<model>-<framework>.<ext>``."""
    notes: tuple[str, ...]
    """What the framework cannot express or the file leaves to the user, each also in the file."""


def export_setup(setup: Setup, framework: str) -> Export:
    """``setup`` written as ``framework``'s launch configuration. Raises SpecError where the framework
    cannot run the setup at all (the message names the field, the value and what it takes)."""
    if framework not in EXPORT_TARGETS:
        raise SpecError("export.to", framework, f"must be one of {', '.join(EXPORT_TARGETS)}")
    if setup.hardware.kind == "cpu":
        raise SpecError("gpu", "cpu", f"{framework} trains on GPUs; pick a GPU device to export a launch config")
    notes: list[str] = []
    if setup.train.framework == "pytorch" and framework in ("megatron", "nemo"):
        notes.append(
            "the setup was sized for the eager PyTorch step (framework pytorch); Megatron's step keeps 16-bit "
            "weights with fp32 master copies: size it with --framework megatron to compare"
        )
    body = _WRITERS[framework](setup, notes)
    name = "".join(c if c.isalnum() or c in ".-" else "-" for c in setup.model.name.lower())
    return Export(framework, body, f"{name}-{framework}.{_SUFFIX[framework]}", tuple(notes))


def _header(setup: Setup, framework: str, notes: list[str], extra: tuple[str, ...] = ()) -> list[str]:
    """Comment lines: what this is, the setup, where the names come from, then every note."""
    repo, commit, path = SOURCES[framework]
    lines = [
        f"{_TITLES[framework]} for {setup.model.name} on {setup.gpus} x {setup.hardware.name}",
        f"written by the LLM training advisor (advisor export --to {framework}); layout: {layout_label(setup)}",
        f"names as read from {repo} at {commit[:12]} ({path})",
        *extra,
    ]
    lines += [f"NOTE: {n}" for n in notes]
    return lines


def _nodes(setup: Setup, notes: list[str]) -> tuple[int, int]:
    """(processes per node, nodes) for ``setup.gpus`` GPUs on nodes of ``gpus_per_node``."""
    per_node = setup.hardware.gpus_per_node
    if setup.gpus <= per_node:
        return setup.gpus, 1
    if setup.gpus % per_node:
        notes.append(f"{setup.gpus} GPUs do not fill nodes of {per_node}: launch {per_node} per node on the nodes")
    return per_node, math.ceil(setup.gpus / per_node)


def _refuse_optimizer(setup: Setup, framework: str, allowed: dict[str, str]) -> str:
    opt = setup.train.optimizer
    if opt not in allowed:
        raise SpecError(
            "train.optimizer", opt, f"{framework} has no {opt} optimizer; export takes {', '.join(allowed)}"
        )
    return allowed[opt]


def _stage_split(setup: Setup, notes: list[str]) -> tuple[int, int] | None:
    """(first, last) stage blocks where Megatron's split is uneven (ends lighter, middles even); None
    where every stage holds the same count."""
    m, p = setup.model, setup.parallel
    stages = megatron_stage_layers(m.n_layers, p.pp * p.vpp)
    if len(set(stages)) == 1:
        return None
    if len(stages) > 2 and len(set(stages[1:-1])) > 1:
        notes.append(
            f"the {len(stages)} pipeline stages split {m.n_layers} blocks as {list(stages)}; first/last-stage "
            "counts cannot express that middle split: set --pipeline-model-parallel-layout by hand"
        )
        return None
    return stages[0], stages[-1]


def _moe_pattern(setup: Setup) -> list[int]:
    """1 for a MoE block, 0 for a dense one: every moe_layer_step-th block (ModelSpec.n_moe_layers)."""
    step = setup.model.moe_layer_step
    return [1 if (i + 1) % step == 0 else 0 for i in range(setup.model.n_layers)]


# --- Megatron-LM and Megatron-Bridge: one mapping, two spellings ---------------------------------


def _megatron_settings(setup: Setup, notes: list[str], framework: str) -> dict[str, object]:
    """The Megatron-Core settings of a setup by TransformerConfig/ParallelConfig name (True: a flag),
    shared by the Megatron-LM and Megatron-Bridge writers."""
    m, t, p = setup.model, setup.train, setup.parallel
    if t.recompute == "selective-op":
        raise SpecError(
            "train.recompute",
            t.recompute,
            f"is torchtitan's op-level policy, which {framework} lacks; use selective (attention core) or full",
        )
    s: dict[str, object] = {
        "num_layers": m.n_layers,
        "hidden_size": m.hidden,
        "ffn_hidden_size": m.ffn_hidden,
        "num_attention_heads": m.n_heads,
    }
    if m.head_dim != m.hidden // m.n_heads:
        s["kv_channels"] = m.head_dim
    if m.n_kv_heads != m.n_heads:
        if m.n_kv_heads % p.tp:
            # Megatron-Core's attention takes divide(config.num_query_groups, tp size), which asserts an even
            # split; the estimate replicates KV heads over TP ranks where they do not divide, Megatron cannot.
            raise SpecError(
                "parallel.tp",
                p.tp,
                f"{framework} splits the model's {m.n_kv_heads} KV groups (num_query_groups) over the TP ranks "
                f"and needs TP to divide them: use TP {divisors_text(m.n_kv_heads)}",
            )
        s["group_query_attention"] = True
        s["num_query_groups"] = m.n_kv_heads
    s["seq_length"] = t.seq_len
    s["max_position_embeddings"] = m.max_seq_len  # RoPE scaled (arguments.py: it must cover seq_length)
    s["vocab_size"] = m.vocab
    s["position_embedding_type"] = "rope" if m.position == "rope" else "learned_absolute"
    if m.rope_scaling > 1:
        # The setup's context extension beyond the trained positions, as linear position interpolation
        # (an integer in Megatron); --use-rope-scaling is Llama 3.x's own trained scaling, not this.
        s["rotary_seq_len_interpolation_factor"] = math.ceil(m.rope_scaling)
        if m.rope_scaling != math.ceil(m.rope_scaling):
            notes.append(
                f"Megatron interpolates positions by an integer: {m.rope_scaling:g} -> {math.ceil(m.rope_scaling)}"
            )
    if m.position == "rope":
        notes.append(
            "the RoPE base (theta) and any RoPE scaling the model was trained with are not in the setup: add the "
            "model's own (--rotary-base from its config's rope_theta; --use-rope-scaling for Llama 3.1's)"
        )
    s["normalization"] = "RMSNorm" if m.norm == "rmsnorm" else "LayerNorm"
    if m.norm == "layernorm" and not m.norm_bias:
        notes.append("Megatron's LayerNorm has a bias; the model's has none")
    s["swiglu"] = m.mlp == "swiglu"
    if m.attn_out_bias != m.mlp_bias:
        notes.append("Megatron sets linear biases for attention output and MLP together; the model differs")
    s["add_bias_linear"] = m.attn_out_bias or m.mlp_bias
    s["add_qkv_bias"] = m.qkv_bias
    s["qk_layernorm"] = m.qk_norm
    s["untie_embeddings_and_output_weights"] = not m.tied_embeddings
    if m.is_moe:
        s["num_experts"] = m.n_experts
        s["moe_router_topk"] = m.top_k
        s["moe_ffn_hidden_size"] = m.expert_ffn_hidden
        if m.n_shared_experts:
            s["moe_shared_expert_intermediate_size"] = m.n_shared_experts * m.expert_ffn_hidden
        if m.moe_layer_step > 1:
            s["moe_layer_freq"] = _moe_pattern(setup)
    if t.dropout:
        notes.append("dropout is on in the setup but its rate is not: Megatron's default is 0.1")
    else:
        s["attention_dropout"] = 0.0
        s["hidden_dropout"] = 0.0
    s["attention_backend"] = "flash" if t.flash_attention else "unfused"
    s["micro_batch_size"] = t.micro_batch
    s["global_batch_size"] = setup.global_batch
    s |= _megatron_precision(setup, notes)
    s["optimizer"] = _refuse_optimizer(setup, framework, {"adamw": "adam", "sgd": "sgd"})
    if t.recompute == "none":
        s["recompute_granularity"] = None  # a Bridge recipe may set one; Megatron-LM's default is none
    elif t.recompute == "selective":
        s["recompute_granularity"] = "selective"
    elif t.recompute == "full":
        s["recompute_granularity"] = "full"
        s["recompute_method"] = "block" if t.recompute_layers else "uniform"
        s["recompute_num_layers"] = t.recompute_layers or 1
    if t.offload_activations:
        s["cpu_offloading_num_layers"] = t.offload_activations
    s["tensor_model_parallel_size"] = p.tp
    s["pipeline_model_parallel_size"] = p.pp
    if p.vpp > 1:
        s["num_virtual_stages_per_pipeline_rank"] = p.vpp
    if split := _stage_split(setup, notes):
        s["decoder_first_pipeline_num_layers"], s["decoder_last_pipeline_num_layers"] = split
    s["context_parallel_size"] = p.cp
    if m.is_moe:
        s["expert_model_parallel_size"] = p.ep
    s["sequence_parallel"] = p.sequence_parallel
    s |= _megatron_sharding(setup, notes)
    return s


def _megatron_precision(setup: Setup, notes: list[str]) -> dict[str, object]:
    t = setup.train
    s: dict[str, object] = {"bf16": t.precision in ("bf16", "fp8"), "fp16": t.precision == "fp16"}
    if t.precision == "fp8":
        s["fp8_format"] = "hybrid"  # e4m3 forward, e5m2 gradients: TransformerEngine's training default
        s["fp8_recipe"] = "tensorwise" if t.fp8_recipe == "tensorwise" else "blockwise"
        if t.fp8_recipe == "rowwise":
            notes.append("torchao's rowwise fp8 scaling has no TransformerEngine twin: blockwise (subchannel) scaling")
    if t.precision in ("bf16", "fp8") and not t.fp32_grads:
        s["grad_reduce_in_bf16"] = True
    if t.precision == "fp16" and t.fp32_grads:
        s["accumulate_allreduce_grads_in_fp32"] = True
    return s


def _megatron_sharding(setup: Setup, notes: list[str]) -> dict[str, object]:
    """ZeRO and offload: 1 is the distributed optimizer, 2 and 3 Megatron-FSDP's sharding strategies."""
    p = setup.parallel
    s: dict[str, object] = {}
    if p.zero == 1:
        s["use_distributed_optimizer"] = True
    elif p.zero >= 2:
        s["use_megatron_fsdp"] = True
        s["data_parallel_sharding_strategy"] = "optim_grads" if p.zero == 2 else "optim_grads_params"
        s["ckpt_format"] = "fsdp_dtensor"  # arguments.py: Megatron-FSDP requires it
    if p.offload != "none":
        s["optimizer_cpu_offload"] = True
        s["optimizer_offload_fraction"] = 1.0
        s["use_precision_aware_optimizer"] = True  # arguments.py: required by optimizer_cpu_offload
    if p.offload == "optimizer+params":
        notes.append("Megatron offloads the optimizer only: the parameters stay on the GPU (no ZeRO-Infinity)")
    return s


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


_MEGATRON_OFF = {"add_bias_linear": "--disable-bias-linear"}
"""Settings on by default in Megatron-LM, turned off by a flag of another name."""


def _write_megatron(setup: Setup, notes: list[str]) -> str:
    s = _megatron_settings(setup, notes, "megatron")
    padded = 128 * setup.parallel.tp  # --make-vocab-size-divisible-by 128, times TP (arguments.py)
    if setup.model.vocab % padded:
        notes.append(
            f"Megatron pads the vocabulary to a multiple of {padded}: {setup.model.vocab:,} -> "
            f"{-(-setup.model.vocab // padded) * padded:,} rows"
        )
    argv: list[str] = []
    for key, value in s.items():
        if key in _MEGATRON_OFF:
            argv += [] if value else [_MEGATRON_OFF[key]]
            continue
        if value is False or value is None:
            continue
        if value is True:
            argv.append(_flag(key))
        elif isinstance(value, list):
            argv.append(f"{_flag(key)} {shlex.quote(str(value).replace(' ', ''))}")
        else:
            argv.append(f"{_flag(key)} {value}")
    nproc, nnodes = _nodes(setup, notes)
    extra = ("add your data and tokenizer arguments (--data-path, --tokenizer-type, ...) and the node rendezvous",)
    lines = ["#!/usr/bin/env bash", *(f"# {h}" for h in _header(setup, "megatron", notes, extra))]
    p = setup.parallel
    if (p.tp > 1 or p.cp > 1) and p.zero < 2:
        # arguments.py asserts it for TP or CP before Blackwell; Megatron-FSDP asserts the opposite
        lines.append("export CUDA_DEVICE_MAX_CONNECTIONS=1")
    lines.append(f"torchrun --nproc-per-node {nproc} --nnodes {nnodes} pretrain_gpt.py \\")
    lines += [f"    {a} \\" for a in argv[:-1]] + [f"    {argv[-1]}"]
    return "\n".join(lines) + "\n"


_BRIDGE_MODEL = {
    "micro_batch_size": "train",
    "global_batch_size": "train",
    "optimizer": "optimizer",
    "use_distributed_optimizer": "ddp",
    "use_megatron_fsdp": "ddp",
    "data_parallel_sharding_strategy": "ddp",
    "ckpt_format": "checkpoint",
    "optimizer_cpu_offload": "optimizer",
    "optimizer_offload_fraction": "optimizer",
    "use_precision_aware_optimizer": "optimizer",
}
"""Megatron settings that live outside ``model`` in Megatron-Bridge's ConfigContainer."""
_BRIDGE_RENAME = {
    "swiglu": "gated_linear_unit",
    "untie_embeddings_and_output_weights": "share_embeddings_and_output_weights",
    "num_experts": "num_moe_experts",
    "num_virtual_stages_per_pipeline_rank": "virtual_pipeline_model_parallel_size",
    "decoder_first_pipeline_num_layers": "num_layers_in_first_pipeline_stage",
    "decoder_last_pipeline_num_layers": "num_layers_in_last_pipeline_stage",
    "rotary_seq_len_interpolation_factor": "seq_len_interpolation_factor",
}
_BRIDGE_PRECISION = {
    ("bf16", "tensorwise"): "bf16_mixed",
    ("fp16", "tensorwise"): "fp16_mixed",
    ("fp8", "tensorwise"): "bf16_with_fp8_current_scaling_mixed",
    ("fp8", "rowwise"): "bf16_with_fp8_subchannel_scaling_mixed",
}
_BRIDGE_SKIP = {"bf16", "fp16", "fp8_format", "fp8_recipe", "max_position_embeddings", "group_query_attention"}
_BRIDGE_SKIP |= {"grad_reduce_in_bf16", "accumulate_allreduce_grads_in_fp32"}


def _bridge_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, list):
        return "[" + ",".join(str(v) for v in value) + "]"
    return str(value)


def _write_nemo(setup: Setup, notes: list[str]) -> str:
    t, p = setup.train, setup.parallel
    s = _megatron_settings(setup, notes, "nemo")
    over: dict[str, object] = {}
    for key, value in s.items():
        if key in _BRIDGE_SKIP:
            continue
        if key == "untie_embeddings_and_output_weights":
            value = not value
        over[f"{_BRIDGE_MODEL.get(key, 'model')}.{_BRIDGE_RENAME.get(key, key)}"] = value
    over["dataset.seq_length"] = t.seq_len  # run_recipe.py copies it to model.seq_length
    over["model.virtual_pipeline_model_parallel_size"] = p.vpp if p.vpp > 1 else None  # recipes may set one
    over["model.expert_model_parallel_size"] = p.ep
    if "model.cpu_offloading_num_layers" in over:
        over["model.cpu_offloading"] = True
    if p.zero >= 1:
        over["optimizer.use_distributed_optimizer"] = True
        over["ddp.use_distributed_optimizer"] = True
    if t.precision in ("bf16", "fp16", "fp8"):
        over["ddp.grad_reduce_in_fp32"] = bool(t.fp32_grads)
    recipe = _BRIDGE_PRECISION.get((t.precision, t.fp8_recipe if t.precision == "fp8" else "tensorwise"))
    over["mixed_precision"] = recipe
    run = (
        "run: torchrun ... scripts/training/run_recipe.py --recipe <your model's pretrain recipe> $(grep -v '^#' FILE)"
    )
    lines = [f"# {h}" for h in _header(setup, "nemo", notes, (run,))]
    lines += [f"{k}={_bridge_value(v)}" for k, v in over.items()]
    return "\n".join(lines) + "\n"


# --- torchtitan ----------------------------------------------------------------------------------


def _titan_flavor(setup: Setup, notes: list[str]) -> tuple[str, str]:
    m = setup.model
    other = [
        what
        for what, differs in (
            ("LayerNorm" + (" with bias" if m.norm_bias else ""), m.norm != "rmsnorm"),
            ("a GELU MLP", m.mlp != "swiglu"),
            ("learned positions", m.position != "rope"),
        )
        if differs
    ]
    if other:
        # A flavor sets sizes, not the block: torchtitan's llama3 and llama4 blocks are RMSNorm, SwiGLU, RoPE.
        raise SpecError(
            "model",
            m.name,
            f"has {', '.join(other)}; torchtitan's llama3 and llama4 models are RMSNorm, SwiGLU and RoPE blocks, "
            "and a flavor changes only their sizes: no torchtitan model trains it (export --to megatron, "
            "deepspeed or accelerate instead)",
        )
    notes.append(
        "a flavor fixes the RoPE base and scaling to its family's (Llama 3's: base 500,000): a model trained "
        "with another base (its config's rope_theta) needs a flavor of its own"
    )
    shape_ok = not m.tied_embeddings
    for (name, flavor), want in _TITAN_FLAVORS.items():
        fields = {k: getattr(m, k) for k in want}
        moe_ok = not m.is_moe or _TITAN_MOE_STEP.get(flavor) == m.moe_layer_step
        if shape_ok and moe_ok and fields == want and (m.is_moe == ("n_experts" in want)):
            notes.append(f"the vocabulary ({m.vocab:,}) comes from the tokenizer in model.hf_assets_path")
            return name, flavor
    notes.append(
        f"torchtitan takes the architecture from its model registry: register a flavor for {m.name} (dim "
        f"{m.hidden}, n_layers {m.n_layers}, n_heads {m.n_heads}, n_kv_heads {m.n_kv_heads}, FFN {m.ffn_hidden}, "
        f"vocab {m.vocab}" + (f", {m.n_experts} experts top-{m.top_k}" if m.is_moe else "") + ") and name it here"
    )
    return ("llama4" if m.is_moe else "llama3"), "custom"


def _titan_ac(setup: Setup, notes: list[str]) -> dict[str, object]:
    t = setup.train
    if t.recompute == "selective":
        notes.append(
            "torchtitan has no attention-core-only recompute (Megatron's selective): its op-level policy "
            "(selective_ac_option 'op') recomputes more and keeps less"
        )
    if t.recompute in ("selective", "selective-op"):
        return {"mode": "selective", "selective_ac_option": "op"}
    if t.recompute == "full" and t.recompute_layers:
        blocks = max(megatron_stage_layers(setup.model.n_layers, setup.parallel.pp * setup.parallel.vpp))
        every = blocks // t.recompute_layers
        if blocks % t.recompute_layers == 0:
            return {"mode": "selective", "selective_ac_option": str(every)}  # every n-th block in full
        notes.append(
            f"torchtitan recomputes every n-th block, not {t.recompute_layers} of {blocks}: every {every}-th instead"
        )
        return {"mode": "selective", "selective_ac_option": str(every)}
    return {"mode": t.recompute}


def _write_torchtitan(setup: Setup, notes: list[str]) -> str:
    t, p = setup.train, setup.parallel
    if t.precision == "fp16":
        raise SpecError("train.precision", "fp16", "torchtitan trains in bf16, fp8 or fp32 (mixed_precision_param)")
    name, flavor = _titan_flavor(setup, notes)
    model: dict[str, object] = {"name": name, "flavor": flavor}
    if t.precision == "fp8":
        model["converters"] = ["quantize.linear.float8"]
    training = {"seq_len": t.seq_len, "global_batch_size": setup.global_batch}
    # Without PP local_batch_size is the micro-batch and torchtitan accumulates global / (local x dp);
    # with PP it is the per-rank batch that the schedule splits into micro-batches.
    training["local_batch_size"] = t.micro_batch * (setup.grad_accum if p.pp > 1 else 1)
    training["mixed_precision_param"] = "float32" if t.precision == "fp32" else "bfloat16"
    training["mixed_precision_reduce"] = "float32"
    if not t.fp32_grads and t.precision != "fp32":
        notes.append("torchtitan reduces gradients in float32 (mixed_precision_reduce takes float32 only)")
    training["enable_cpu_offload"] = p.offload == "optimizer+params"
    if p.offload == "optimizer":
        notes.append("torchtitan's CPU offload moves parameters, gradients and optimizer states together")
    if t.offload_activations:
        notes.append(f"torchtitan has no activation offload: {t.offload_activations} blocks' activations stay")
    if setup.model.rope_scaling > 1:
        notes.append(f"torchtitan sets RoPE scaling in the model flavor: extend it {setup.model.rope_scaling:g}x there")
    parallelism = _titan_parallelism(setup, notes)
    sections: dict[str, dict[str, object]] = {"model": model, "training": training, "parallelism": parallelism}
    sections["activation_checkpoint"] = _titan_ac(setup, notes)
    sections["compile"] = {"enable": t.compile}
    impl = t.optimizer_impl
    sections["optimizer"] = {"name": _refuse_optimizer(setup, "torchtitan", {"adamw": "AdamW"}), "implementation": impl}
    if t.precision == "fp8":
        sections["quantize.linear.float8"] = {"recipe_name": t.fp8_recipe}
    lines = [f"# {h}" for h in _header(setup, "torchtitan", notes)]
    for section, values in sections.items():
        lines += ["", f"[{section}]"] + [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def _titan_parallelism(setup: Setup, notes: list[str]) -> dict[str, object]:
    m, t, p = setup.model, setup.train, setup.parallel
    out: dict[str, object] = {}
    if p.zero == 0:
        out |= {"data_parallel_replicate_degree": p.dp, "data_parallel_shard_degree": 1}
    else:
        out |= {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": p.dp}
        out["fsdp_reshard_after_forward"] = "always" if p.zero == 3 else "never"
    if p.zero == 1:
        notes.append("torchtitan's FSDP has no ZeRO-1: gradients are sharded too (ZeRO-2, reshard never)")
    out["tensor_parallel_degree"] = p.tp
    if p.tp > 1 and not p.sequence_parallel:
        notes.append("torchtitan's tensor parallelism always shards norms and dropout (sequence parallel)")
    out["pipeline_parallel_degree"] = p.pp
    if p.pp > 1:
        out["pipeline_parallel_schedule"] = "Interleaved1F1B" if p.vpp > 1 else "1F1B"
        out["pipeline_parallel_microbatch_size"] = t.micro_batch
        stages = p.pp * p.vpp
        if m.n_layers % stages == 0:
            # Stages = (layers + first_less + last_less) / layers_per_stage (pipeline_parallel.py):
            # the embedding and head are not counted as layers here, as Megatron's even split.
            out["pipeline_parallel_layers_per_stage"] = m.n_layers // stages
            out["pipeline_parallel_first_stage_less_layers"] = 0
            out["pipeline_parallel_last_stage_less_layers"] = 0
        else:
            notes.append(f"{m.n_layers} blocks do not split evenly over {stages} stages: torchtitan picks the split")
    out["context_parallel_degree"] = p.cp
    if m.is_moe:
        out["expert_parallel_degree"] = p.ep
    return out


# --- DeepSpeed -----------------------------------------------------------------------------------


def _write_deepspeed(setup: Setup, notes: list[str]) -> str:
    t, p = setup.train, setup.parallel
    cfg: dict[str, object] = {
        "train_batch_size": setup.global_batch,
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": _accum_over(setup, p.dp * p.cp, "deepspeed", "parallel.cp", p.cp),
    }
    if t.precision in ("bf16", "fp8"):
        cfg["bf16"] = {"enabled": True}
    elif t.precision == "fp16":
        cfg["fp16"] = {"enabled": True}
    if t.precision == "fp8":
        notes.append("DeepSpeed has no fp8 setting: fp8 GEMMs come from TransformerEngine layers in the model code")
    if t.precision in ("bf16", "fp16", "fp8"):
        cfg["data_types"] = {
            "grad_accum_dtype": "fp32" if t.fp32_grads else ("fp16" if t.precision == "fp16" else "bf16")
        }
    zero: dict[str, object] = {"stage": p.zero}
    if p.offload != "none":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if p.offload == "optimizer+params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    cfg["zero_optimization"] = zero
    opt = _refuse_optimizer(setup, "deepspeed", {"adamw": "adamw", "sgd": "", "adafactor": ""})
    if opt:
        cfg["optimizer"] = {"type": opt, "params": {}}
    else:
        notes.append(f"DeepSpeed has no built-in {t.optimizer}: pass torch's to deepspeed.initialize(optimizer=...)")
    if p.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": p.tp}
    if p.pp > 1:
        cfg["pipeline"] = {"stages": p.pp}
        notes.append(f"DeepSpeed's pipeline needs the model as a PipelineModule(num_stages={p.pp})")
    _deepspeed_cannot(setup, notes)
    script = f"the training script builds {setup.model.name} and feeds sequences of {t.seq_len} tokens"
    if setup.model.rope_scaling > 1:
        script += f" (RoPE extended {setup.model.rope_scaling:g}x in the model's config)"
    cfg["_advisor_notes"] = [*_header(setup, "deepspeed", notes, (script,)), "DeepSpeed ignores this key"]
    return json.dumps(cfg, indent=2) + "\n"


def _accum_over(setup: Setup, dp: int, framework: str, field: str, value: int) -> int:
    """Micro-batches a step when ``dp`` ranks (the setup's dp times degrees the framework turns into data
    parallelism) share the global batch; SpecError where they cannot."""
    per_step = setup.train.micro_batch * dp
    if setup.global_batch % per_step:
        raise SpecError(
            field,
            value,
            f"{framework} runs these ranks as data parallel: global_batch={setup.global_batch} must then be a "
            f"multiple of micro_batch x {dp} ranks = {per_step}",
        )
    return setup.global_batch // per_step


def _deepspeed_cannot(setup: Setup, notes: list[str]) -> None:
    m, t, p = setup.model, setup.train, setup.parallel
    if p.vpp > 1:
        notes.append(f"DeepSpeed's pipeline has no interleaving: {p.vpp} virtual stages per rank are lost")
    if p.cp > 1:
        notes.append(
            f"DeepSpeed has no context (ring attention) parallelism: the cp={p.cp} ranks join data parallelism "
            f"(dp {p.dp * p.cp}, fewer micro-batches a step for the same global batch); memory and speed differ"
        )
    if p.sequence_parallel:
        notes.append("DeepSpeed has no Megatron sequence parallelism for AutoTP: norms stay replicated")
    if m.is_moe:
        notes.append(f"DeepSpeed sets expert parallelism in the model code: deepspeed.moe.layer.MoE(ep_size={p.ep})")
    if t.recompute != "none":
        notes.append(
            f"DeepSpeed leaves recompute ({t.recompute}"
            + (f", {t.recompute_layers} blocks a stage" if t.recompute_layers else "")
            + ") to the model code: deepspeed.checkpointing.checkpoint or gradient_checkpointing_enable()"
        )
    if t.offload_activations:
        notes.append(f"DeepSpeed offloads only checkpointed activations: {t.offload_activations} blocks' stay")


# --- HF Accelerate -------------------------------------------------------------------------------


def _write_accelerate(setup: Setup, notes: list[str]) -> str:
    t, p = setup.train, setup.parallel
    _, nnodes = _nodes(setup, notes)
    dp = p.dp * p.pp  # no pipeline in Accelerate: the pp ranks join data parallelism
    accum = _accum_over(setup, dp, "accelerate", "parallel.pp", p.pp)
    mixed = {"fp32": "no", "bf16": "bf16", "fp16": "fp16", "fp8": "fp8"}[t.precision]
    cfg: dict[str, object] = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU"}
    cfg |= {"mixed_precision": mixed, "num_machines": nnodes, "num_processes": setup.gpus, "machine_rank": 0}
    cfg |= {"main_training_function": "main", "rdzv_backend": "static", "same_network": True, "use_cpu": False}
    if t.precision == "fp8":
        cfg["fp8_config"] = {"backend": "AO"}  # torchao's float8 training, the eager step's (advisor.run.fp8)
    deepspeed_plugin = p.tp == 1 and p.cp == 1 and (p.zero == 1 or p.offload == "optimizer")
    if deepspeed_plugin:
        cfg["distributed_type"] = "DEEPSPEED"
        cfg["deepspeed_config"] = {
            "zero_stage": p.zero,
            "offload_optimizer_device": "cpu" if p.offload != "none" else "none",
            "offload_param_device": "cpu" if p.offload == "optimizer+params" else "none",
            "gradient_accumulation_steps": accum,
        }
    elif p.zero >= 1 or p.tp > 1 or p.cp > 1:
        cfg["distributed_type"] = "FSDP"
        cfg["fsdp_config"] = _accelerate_fsdp(setup, notes)
        parallel = {"dp_replicate_size": 1 if p.zero else dp, "dp_shard_size": dp if p.zero else 1}
        parallel |= {"tp_size": p.tp, "cp_size": p.cp}
        cfg["parallelism_config"] = {f"parallelism_config_{k}": v for k, v in parallel.items()}
    elif setup.gpus == 1:
        cfg["distributed_type"] = "NO"
    _accelerate_cannot(setup, notes, deepspeed_plugin)
    extra = (
        f"in the script: the model {setup.model.name}"
        + (f" (RoPE extended {setup.model.rope_scaling:g}x in its config)" if setup.model.rope_scaling > 1 else "")
        + f", DataLoader batch_size={t.micro_batch} (micro-batch per GPU), "
        f"Accelerator(gradient_accumulation_steps={accum}), sequences of {t.seq_len} tokens",
    )
    head = "\n".join(f"# {h}" for h in _header(setup, "accelerate", notes, extra))
    return head + "\n" + yaml.safe_dump(cfg, sort_keys=False)


def _accelerate_fsdp(setup: Setup, notes: list[str]) -> dict[str, object]:
    t, p = setup.train, setup.parallel
    if p.zero == 1:
        notes.append("FSDP has no ZeRO-1 with tp/cp: gradients are sharded too (ZeRO-2, no reshard after forward)")
    if p.offload == "optimizer":
        notes.append("FSDP's CPU offload moves parameters, gradients and optimizer states together: left off")
    return {
        "fsdp_version": 2,
        "fsdp_reshard_after_forward": p.zero == 3,
        "fsdp_offload_params": p.offload == "optimizer+params",
        "fsdp_activation_checkpointing": t.recompute == "full",
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
    }


def _accelerate_cannot(setup: Setup, notes: list[str], deepspeed_plugin: bool) -> None:
    m, t, p = setup.model, setup.train, setup.parallel
    if p.pp > 1:
        notes.append(
            f"Accelerate has no pipeline parallelism for training: the pp={p.pp} ranks join data parallelism "
            f"(dp {p.dp * p.pp}); memory and speed differ from the setup's"
        )
    if m.is_moe and p.ep > 1:
        notes.append(f"Accelerate has no expert parallelism: ep={p.ep} cannot be set")
    if p.sequence_parallel:
        notes.append("Accelerate's tensor parallelism follows the model's tp_plan: sequence parallel is not set here")
    if t.recompute in ("selective", "selective-op"):
        notes.append(f"Accelerate checkpoints whole blocks only: {t.recompute} recompute cannot be set")
    if t.recompute == "full" and t.recompute_layers:
        notes.append(f"Accelerate checkpoints every block: recompute of {t.recompute_layers} blocks cannot be set")
    if t.recompute == "full" and deepspeed_plugin:
        notes.append("with the DeepSpeed plugin, turn recompute on in the model: gradient_checkpointing_enable()")
    if t.offload_activations:
        notes.append(f"Accelerate has no activation offload: {t.offload_activations} blocks' activations stay")


_WRITERS = {
    "megatron": _write_megatron,
    "nemo": _write_nemo,
    "torchtitan": _write_torchtitan,
    "deepspeed": _write_deepspeed,
    "accelerate": _write_accelerate,
}
