"""Importing Hugging Face config.json files: exact counts, clear errors."""

import json
from pathlib import Path

import pytest

from advisor.errors import ConfigImportError
from advisor.spec.hf_config import load_hf_config, model_from_hf_config
from advisor.spec.presets import get_model

DATA = Path(__file__).parent / "data" / "hf"

# Real configs of public checkpoints; counts as published (sum of the checkpoints' tensor sizes).
IMPORTED = {
    "gpt2.json": 124_439_808,
    "llama-3.1-8b.json": 8_030_261_248,
    "mistral-7b.json": 7_241_732_096,
    "mixtral-8x7b.json": 46_702_792_704,
    "qwen2-0.5b.json": 494_032_768,
    "qwen3-0.6b.json": 596_049_920,
}


@pytest.mark.parametrize(("file", "count"), list(IMPORTED.items()))
def test_imported_configs_have_exact_counts(file, count):
    assert load_hf_config(DATA / file).n_params == count


def test_import_matches_the_preset_shape():
    imported = load_hf_config(DATA / "llama-3.1-8b.json")
    preset = get_model("llama-3.1-8b")
    for field in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden", "vocab", "tied_embeddings"):
        assert getattr(imported, field) == getattr(preset, field), field
    qwen = load_hf_config(DATA / "qwen2-0.5b.json")
    assert qwen.qkv_bias and not qwen.attn_out_bias and qwen.tied_embeddings
    assert load_hf_config(DATA / "mixtral-8x7b.json").n_active_params == 12_879_925_248


def _cfg(**changes):
    cfg = json.loads((DATA / "llama-3.1-8b.json").read_text())
    cfg.update(changes)
    return cfg


@pytest.mark.parametrize(
    ("cfg", "words"),
    [
        (_cfg(model_type="t5"), "model_type 't5' is not supported; supported: llama, mistral"),
        (_cfg(num_experts=64), "field 'num_experts' is not supported for model_type 'llama'"),
        (_cfg(kv_lora_rank=512), "field 'kv_lora_rank' is not supported"),
        (_cfg(hidden_act="gelu"), "hidden_act 'gelu' not supported for llama; allowed: silu, swish"),
        (_cfg(hidden_size="4096"), "field 'hidden_size' must be an integer"),
        (_cfg(num_local_experts=8), "'num_local_experts' is not supported for model_type 'llama'"),
        (_cfg(num_key_value_heads=7), "invalid model: model.n_kv_heads=7"),
        ({"architectures": ["BertModel"]}, "no 'model_type' and no known 'architectures'"),
        ([1, 2], "must hold a JSON object"),
    ],
)
def test_unsupported_configs_fail_clearly(cfg, words):
    with pytest.raises(ConfigImportError, match=None) as info:
        model_from_hf_config(cfg)
    assert words in str(info.value)


def test_missing_field_is_named():
    cfg = _cfg()
    del cfg["intermediate_size"]
    with pytest.raises(ConfigImportError, match="required field 'intermediate_size' is missing"):
        model_from_hf_config(cfg)


def test_architectures_alone_are_enough():
    cfg = _cfg()
    del cfg["model_type"]
    assert model_from_hf_config(cfg).n_params == 8_030_261_248


def test_file_errors(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigImportError, match=r"config.json is not valid JSON \(line 1"):
        load_hf_config(bad)
    with pytest.raises(ConfigImportError, match=r"cannot read config file /.*/missing\.json: No such file"):
        load_hf_config(tmp_path / "missing.json")
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(ConfigImportError, match="not a text file"):
        load_hf_config(binary)


def test_model_is_named_after_its_folder(tmp_path):
    folder = tmp_path / "my-llama"
    folder.mkdir()
    cfg = _cfg()
    (folder / "config.json").write_text(json.dumps(cfg))
    assert load_hf_config(folder / "config.json").name == "my-llama"


def test_rope_scaling_of_the_config_extends_the_context(tmp_path):
    from advisor.spec.setup import make_setup

    # Llama 3.1 trained its 'llama3' scaling (factor 8 over 8,192) to 131,072 positions, which
    # max_position_embeddings already says: no further extension.
    assert load_hf_config(DATA / "llama-3.1-8b.json").rope_scaling == 1.0
    # YaRN at factor 4 over the original 32,768 serves 131,072 tokens.
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    cfg = json.loads((DATA / "mistral-7b.json").read_text()) | {"rope_scaling": yarn}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = load_hf_config(tmp_path / "config.json")
    assert (model.max_positions, model.rope_scaling, model.max_seq_len) == (32768, 4.0, 131072)
    setup = make_setup(hf_config=str(tmp_path / "config.json"), gpu="h100", gpus=8, cp=8, seq=131072)
    assert setup.model.rope_scaling == 4.0
    # A factor without the original length stretches the config's own; a flag still overrides it.
    model = model_from_hf_config(_cfg(rope_scaling={"rope_type": "linear", "factor": 2.0}))
    assert model.max_seq_len == 2 * 131072
    assert make_setup(model=model, gpu="h100", rope_scaling=1.0).model.rope_scaling == 1.0
    with pytest.raises(ConfigImportError, match=r"rope_scaling\.factor must be a number >= 1, got 'x'"):
        model_from_hf_config(_cfg(rope_scaling={"factor": "x"}))


def test_an_uploaded_config_is_named_by_its_family_and_size(tmp_path):
    # Gradio keeps an upload under the hash of its content: the model read "1838c146...(1.24B params)".
    folder = tmp_path / ("1838c146e47a2d35b79358be60cdebfeed78a8dd0c87bf46152ef631ab473eb8")
    folder.mkdir()
    cfg = json.loads((DATA / "qwen3-0.6b.json").read_text())
    cfg.pop("_name_or_path", None)
    (folder / "config.json").write_text(json.dumps(cfg))
    assert load_hf_config(folder / "config.json").name == "qwen3-0.60b"
    named = tmp_path / "my-model"
    named.mkdir()
    (named / "config.json").write_text(json.dumps(cfg))
    assert load_hf_config(named / "config.json").name == "my-model"  # a folder with a name keeps it
