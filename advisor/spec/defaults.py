"""The front ends' defaults, one table: what ``advisor size`` with no flags and the app's first screen
both show, and what a profiled step on this machine starts from.

Every key is a keyword of ``advisor.spec.setup.make_setup`` (the app's widgets and the CLI's flags are
named after them), mapped by SETUP_FIELDS to the Setup attribute it ends up in. ``make_setup``'s own
keyword defaults say what a field left out means to a library caller (one replica, no sharding);
the front ends pass every field from here instead, so they cannot disagree.
"""

from __future__ import annotations

from advisor.spec.presets import hardware_key
from advisor.spec.specs import ModelSpec, Setup

DEFAULTS: dict[str, object] = {
    "model": "llama-3.1-8b",
    "gpu": "h200",
    "gpus": 8,
    "seq": 8192,
    "micro_batch": 1,
    "global_batch": 0,
    "precision": "bf16",
    "optimizer": "adamw",
    "optimizer_impl": "fused",
    "framework": "megatron",
    "recompute": "none",
    "flash_attention": True,
    "fp32_grads": True,
    "recompute_layers": 0,
    "offload_activations": 0,
    "compile": False,
    "fused_loss": False,
    "tp": 1,
    "pp": 1,
    "vpp": 1,
    "cp": 1,
    "ep": 1,
    "zero": 1,
    "sequence_parallel": False,
    "offload": "none",
}
"""A Llama-3.1-8B job on one 8-GPU H200 node at sequence 8192, bf16 with Megatron-LM's distributed optimizer (ZeRO 1) and no gradient accumulation
(``global_batch`` 0: micro-batch x dp): it fits, so the first screen shows a step, not a refusal.
A model with fewer learned positions than ``seq`` gets its own count (``fit_seq``)."""

PLAN_GLOBAL_BATCH = 64
"""The planner's starting global batch (the Plan tab's, ``advisor plan``'s default): 8 sequences per
data-parallel rank on DEFAULTS' 8 GPUs. The planner splits a batch it is given, where the shared
spec's 0 means "no accumulation" and leaves the Plan tab's value alone."""

SETUP_FIELDS: dict[str, str] = {
    "model": "model.name",
    "gpu": "hardware",
    "gpus": "gpus",
    "seq": "train.seq_len",
    "micro_batch": "train.micro_batch",
    "global_batch": "train.global_batch",
    "precision": "train.precision",
    "optimizer": "train.optimizer",
    "optimizer_impl": "train.optimizer_impl",
    "framework": "train.framework",
    "recompute": "train.recompute",
    "flash_attention": "train.flash_attention",
    "fp32_grads": "train.fp32_grads",
    "recompute_layers": "train.recompute_layers",
    "offload_activations": "train.offload_activations",
    "compile": "train.compile",
    "fused_loss": "train.fused_loss",
    "tp": "parallel.tp",
    "pp": "parallel.pp",
    "vpp": "parallel.vpp",
    "cp": "parallel.cp",
    "ep": "parallel.ep",
    "zero": "parallel.zero",
    "sequence_parallel": "parallel.sequence_parallel",
    "offload": "parallel.offload",
    "fp8_recipe": "train.fp8_recipe",
}
"""Each front-end field's home in a Setup (``gpu``: the device, read back as its preset's key)."""

PROFILE_DEFAULTS: dict[str, object] = {
    "model": "tiny",
    "seq": 256,
    "micro_batch": 2,
    "global_batch": 0,
    "precision": None,
    "recompute": "none",
    "optimizer": "adamw",
    "optimizer_impl": "foreach",
    "gpus": None,
    "tp": 1,
    "pp": 1,
    "zero": 0,
    "sequence_parallel": False,
    "offload": "none",
    "recompute_layers": 0,
    "offload_activations": 0,
    "fp8_recipe": "tensorwise",
    "device": "auto",
    "steps": 3,
    "layers": 0,
    "num_workers": 0,
    "pin_memory": False,
    "compile": False,
    "unified_memory": False,
    "nproc": 1,
}
"""A profiled step on this machine (``advisor profile``, the Profile tab): a tiny model that runs in
seconds on a laptop CPU, three timed steps; ``precision`` None is this device's fastest (bf16 on a GPU,
fp32 on a CPU without AVX512-BF16 or AMX, where bf16 runs at 1/30 of fp32), ``gpus`` None one process
(``nproc`` more: torchrun), ZeRO 0 plain DDP. Keys beyond DEFAULTS' are RunOptions fields."""


def fit_seq(seq: int, model: ModelSpec) -> int:
    """``seq``, or the longest sequence the model takes where that is shorter (GPT-2's 1024 learned
    positions against 8192, the tiny model's 2048 against 4096, which would only be refused)."""
    return min(seq, model.max_seq_len)


def setup_value(setup: Setup, key: str) -> object:
    """The value of front-end field ``key`` in ``setup`` (SETUP_FIELDS' path followed); for ``gpu`` the
    device's preset key (None for a device no preset has)."""
    value: object = setup
    for part in SETUP_FIELDS[key].split("."):
        value = getattr(value, part)
    return hardware_key(value) if key == "gpu" else value  # type: ignore[arg-type]
