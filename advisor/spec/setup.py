"""Build a Setup from plain values (CLI flags, app widgets): the one path both front ends share."""

from __future__ import annotations

from dataclasses import replace

from advisor.errors import SpecError
from advisor.spec.hf_config import load_hf_config
from advisor.spec.presets import get_hardware, get_model
from advisor.spec.specs import MAX_GPUS, ModelSpec, ParallelSpec, Setup, TrainSpec


def build_parallel(gpus: int | None, dp: int | None, **kw: object) -> ParallelSpec:
    """A ParallelSpec with dp derived from ``gpus`` when not given, and checked against it when both
    are: ``dp(2) * tp(4) * pp(2) * cp(1) = 16 != gpus(8)``."""
    if dp is not None and (not isinstance(dp, int) or isinstance(dp, bool) or not 1 <= dp <= MAX_GPUS):
        raise SpecError("parallel.dp", dp, f"must be an integer from 1 to {MAX_GPUS}")
    probe = ParallelSpec(**kw)  # type: ignore[arg-type]
    per_replica = probe.tp * probe.pp * probe.cp
    if gpus is not None:
        if not isinstance(gpus, int) or isinstance(gpus, bool) or not 1 <= gpus <= MAX_GPUS:
            raise SpecError("gpus", gpus, f"must be an integer from 1 to {MAX_GPUS}")
        if dp is None:
            if gpus % per_replica:
                raise SpecError("gpus", gpus, f"must be a multiple of tp x pp x cp = {per_replica}")
            dp = gpus // per_replica
        elif dp * per_replica != gpus:
            raise SpecError(
                "gpus",
                gpus,
                f"dp({dp}) * tp({probe.tp}) * pp({probe.pp}) * cp({probe.cp}) = {dp * per_replica} != gpus({gpus})",
            )
    return ParallelSpec(dp=1 if dp is None else dp, **kw)  # type: ignore[arg-type]


DEFAULT_SEQ = 4096


def default_seq(model: ModelSpec) -> int:
    """4096 tokens, or the longest sequence the model takes where that is shorter (GPT-2's 1024)."""
    return min(DEFAULT_SEQ, model.max_seq_len)


def make_setup(
    *,
    model: str | ModelSpec = "llama-3.1-8b",
    hf_config: str | None = None,
    gpu: str = "h100",
    gpus: int | None = None,
    dp: int | None = None,
    seq: int | None = None,
    micro_batch: int = 1,
    global_batch: int = 0,
    precision: str = "bf16",
    optimizer: str = "adamw",
    optimizer_impl: str | None = None,
    framework: str = "megatron",
    recompute: str = "none",
    flash_attention: bool = True,
    dropout: bool = False,
    fp32_grads: bool | None = None,
    recompute_layers: int = 0,
    offload_activations: int = 0,
    compile: bool = False,
    fused_loss: bool = False,
    fp8_recipe: str = "tensorwise",
    tp: int = 1,
    pp: int = 1,
    vpp: int = 1,
    cp: int = 1,
    ep: int = 1,
    zero: int = 0,
    sequence_parallel: bool = False,
    offload: str = "none",
    rope_scaling: float | None = None,
) -> Setup:
    """The Setup these values describe; a config.json path overrides the preset. Raises AdvisorError.

    Left out, ``seq`` is 4096, or the model's learned positions where it has fewer (GPT-2's 1024: 4096
    would only be refused), ``optimizer_impl`` is fused, or foreach for Adafactor (no fused kernel), and
    ``fp32_grads`` the framework's default (``TrainSpec.fp32_grads``). ``rope_scaling`` extends a RoPE
    model's context (``ModelSpec.rope_scaling``); None keeps the model's (a config.json's YaRN)."""
    if hf_config:
        model_spec = load_hf_config(hf_config)
    elif isinstance(model, ModelSpec):
        model_spec = model
    else:
        model_spec = get_model(model)
    if rope_scaling is not None and rope_scaling != model_spec.rope_scaling:
        model_spec = replace(model_spec, rope_scaling=rope_scaling)
    if seq is None:
        seq = default_seq(model_spec)
    if optimizer_impl is None:
        optimizer_impl = "foreach" if optimizer == "adafactor" else "fused"
    train = TrainSpec(
        seq_len=seq,
        micro_batch=micro_batch,
        global_batch=global_batch,
        precision=precision,
        optimizer=optimizer,
        optimizer_impl=optimizer_impl,
        framework=framework,
        recompute=recompute,
        flash_attention=flash_attention,
        dropout=dropout,
        fp32_grads=fp32_grads,
        recompute_layers=recompute_layers,
        offload_activations=offload_activations,
        compile=compile,
        fused_loss=fused_loss,
        fp8_recipe=fp8_recipe,
    )
    parallel = build_parallel(
        gpus, dp, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, zero=zero, sequence_parallel=sequence_parallel, offload=offload
    )
    return Setup(model=model_spec, train=train, parallel=parallel, hardware=get_hardware(gpu))
