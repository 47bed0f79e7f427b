"""Import a Hugging Face ``config.json`` (a file the user has; no hub access) into a ModelSpec.

Supported families: Llama (1-3), Mistral, Mixtral, Qwen2, Qwen3 and GPT-2. Fields that would change
the parameter count in ways the spec cannot express raise ConfigImportError naming the field.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from advisor.errors import ConfigImportError, SpecError, shown_value
from advisor.spec.specs import ModelSpec

_LLAMA_LIKE = ("llama", "mistral", "mixtral", "qwen2", "qwen3")
SUPPORTED_MODEL_TYPES = (*_LLAMA_LIKE, "gpt2")
_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GPT2LMHeadModel": "gpt2",
}
# Fields of other families (MoE variants, multimodal, latent attention) that change the parameter
# count: present in a config of a supported type they mean a variant this importer does not model.
_UNSUPPORTED_FIELDS = (
    "num_experts",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "n_routed_experts",
    "kv_lora_rank",
    "q_lora_rank",
    "vision_config",
    "text_config",
    "cross_attention_layers",
)
_SWIGLU_ACTS = ("silu", "swish")
_GELU_ACTS = ("gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh")


def _get(cfg: dict[str, Any], key: str, kind: type = int, default: Any = None) -> Any:
    if key not in cfg or cfg[key] is None:
        if default is not None:
            return default
        raise ConfigImportError(f"config.json: required field '{key}' is missing")
    value = cfg[key]
    if kind is int and (not isinstance(value, int) or isinstance(value, bool)):
        raise ConfigImportError(f"config.json: field '{key}' must be an integer, got {value!r}")
    if kind is bool and not isinstance(value, bool):
        raise ConfigImportError(f"config.json: field '{key}' must be true or false, got {value!r}")
    return value


def model_type_of(cfg: dict[str, Any]) -> str:
    """The config's family, from ``model_type`` or else ``architectures``."""
    mt = cfg.get("model_type")
    if mt is None:
        for arch in cfg.get("architectures") or []:
            if arch in _ARCHITECTURES:
                return _ARCHITECTURES[arch]
        raise ConfigImportError("config.json: no 'model_type' and no known 'architectures' entry")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ConfigImportError(
            f"config.json: model_type '{mt}' is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return mt


def model_from_hf_config(cfg: dict[str, Any], name: str | None = None) -> ModelSpec:
    """A ModelSpec from a parsed config.json dictionary; parameter count exact for supported families."""
    if not isinstance(cfg, dict):
        raise ConfigImportError("config.json must hold a JSON object")
    mt = model_type_of(cfg)
    for key in _UNSUPPORTED_FIELDS:
        if cfg.get(key):
            raise ConfigImportError(f"config.json: field '{key}' is not supported for model_type '{mt}'")
    name = name or cfg.get("_name_or_path") or mt
    try:
        if mt == "gpt2":
            return _gpt2(cfg, name)
        return _llama_like(cfg, mt, name)
    except SpecError as err:
        raise ConfigImportError(f"config.json describes an invalid model: {err}") from err


def _gpt2(cfg: dict[str, Any], name: str) -> ModelSpec:
    act = cfg.get("activation_function", "gelu_new")
    if act not in _GELU_ACTS:
        raise ConfigImportError(
            f"config.json: activation_function '{act}' not supported; allowed: {', '.join(_GELU_ACTS)}"
        )
    hidden = _get(cfg, "n_embd")
    return ModelSpec(
        name=name,
        n_layers=_get(cfg, "n_layer"),
        hidden=hidden,
        n_heads=_get(cfg, "n_head"),
        ffn_hidden=cfg.get("n_inner") or 4 * hidden,
        vocab=_get(cfg, "vocab_size"),
        mlp="gelu",
        norm="layernorm",
        norm_bias=True,
        position="learned",
        max_positions=_get(cfg, "n_positions"),
        tied_embeddings=True,
        qkv_bias=True,
        attn_out_bias=True,
        mlp_bias=True,
    )


def _rope_scaling(cfg: dict[str, Any], max_positions: int) -> float:
    """The context extension a config's ``rope_scaling`` gives beyond ``max_position_embeddings``, as
    ``ModelSpec.rope_scaling`` (1.0: none). Transformers' RoPE types (modeling_rope_utils): a YaRN,
    linear or dynamic factor stretches ``original_max_position_embeddings`` (else the config's own
    length): YaRN at factor 4 over 32,768 serves 131,072 tokens. Llama 3.1's 'llama3' type (factor 8 over
    8,192) was trained at 131,072, which its max_position_embeddings already says: 1.0."""
    rs = cfg.get("rope_scaling")
    if not rs:
        return 1.0
    if not isinstance(rs, dict):
        raise ConfigImportError(f"config.json: field 'rope_scaling' must be an object or null, got {rs!r}")
    factor = rs.get("factor", 1.0)
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not factor >= 1.0:
        raise ConfigImportError(f"config.json: rope_scaling.factor must be a number >= 1, got {factor!r}")
    original = rs.get("original_max_position_embeddings") or max_positions
    if not isinstance(original, int) or isinstance(original, bool) or original < 1:
        raise ConfigImportError(
            f"config.json: rope_scaling.original_max_position_embeddings must be a positive integer, got {original!r}"
        )
    return max(1.0, factor * original / max_positions)


def _llama_like(cfg: dict[str, Any], mt: str, name: str) -> ModelSpec:
    act = cfg.get("hidden_act", "silu")
    if act not in _SWIGLU_ACTS:
        raise ConfigImportError(
            f"config.json: hidden_act '{act}' not supported for {mt}; allowed: {', '.join(_SWIGLU_ACTS)}"
        )
    heads = _get(cfg, "num_attention_heads")
    attention_bias = bool(cfg.get("attention_bias", False))
    experts = cfg.get("num_local_experts", 0) or 0
    if experts and mt != "mixtral":
        raise ConfigImportError(f"config.json: field 'num_local_experts' is not supported for model_type '{mt}'")
    max_positions = _get(cfg, "max_position_embeddings", int, 131072)
    return ModelSpec(
        name=name,
        n_layers=_get(cfg, "num_hidden_layers"),
        hidden=_get(cfg, "hidden_size"),
        n_heads=heads,
        n_kv_heads=_get(cfg, "num_key_value_heads", int, heads),
        head_dim=cfg.get("head_dim") or 0,
        ffn_hidden=_get(cfg, "intermediate_size"),
        vocab=_get(cfg, "vocab_size"),
        mlp="swiglu",
        norm="rmsnorm",
        position="rope",
        max_positions=max_positions,
        rope_scaling=_rope_scaling(cfg, max_positions),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases and no output bias; Llama's attention_bias covers all four.
        qkv_bias=mt == "qwen2" or attention_bias,
        attn_out_bias=attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=mt == "qwen3",
        n_experts=experts,
        top_k=_get(cfg, "num_experts_per_tok") if experts else 0,
    )


MAX_CONFIG_BYTES = 2**20
"""The largest config.json read: Hugging Face's are a few KB (Llama 3.1 405B's: 1 KB)."""


def load_hf_config(path: str | Path) -> ModelSpec:
    """Read a config.json file and import it; the model is named after its folder or file."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ConfigImportError(f"hf_config={shown_value(path, 60)}: expected the path of a config.json file")
    p = Path(path)
    try:
        with p.open("rb") as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)  # bounded: a path like /dev/zero never ends
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigImportError(
                f"config file {p.name} is over {MAX_CONFIG_BYTES // 2**20} MiB; a config.json is a few KB"
            )
        text = raw.decode("utf-8")
    except OSError as err:
        raise ConfigImportError(f"cannot read config file {p}: {err.strerror or err}") from err
    except UnicodeDecodeError:
        raise ConfigImportError(f"{p.name} is not a text file; expected a Hugging Face config.json") from None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigImportError(f"{p.name} is not valid JSON (line {err.lineno}: {err.msg})") from None
    default = p.parent.name if p.name == "config.json" and p.parent.name else p.stem
    if re.fullmatch(r"[0-9a-f]{32,}", default):
        # An upload's folder (Gradio keeps each file under the hash of its content): no name a user
        # would know; the family and the size say which model it is.
        default = ""
    name = cfg.get("_name_or_path") if isinstance(cfg, dict) else None
    model = model_from_hf_config(cfg, name or default or "config")
    if not (name or default):
        model = replace(model, name=f"{model_type_of(cfg)}-{model.n_params / 1e9:.2f}b")
    return model
