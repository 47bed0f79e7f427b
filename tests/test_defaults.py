"""One defaults table for the CLI and the app: every flag and every Size-tab widget maps to the same
Setup field, a value set either way gives the same Setup, and the Setup reads back as that value."""

from __future__ import annotations

import argparse
import os

import pytest

from advisor.cli import CLI_FLAGS, build_parser, setup_from_args
from advisor.spec.defaults import DEFAULTS, PROFILE_DEFAULTS, SETUP_FIELDS, fit_seq, setup_value
from advisor.spec.options import RunOptions
from advisor.spec.presets import get_model
from advisor.spec.setup import make_setup

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

# One case per field: the field's new value, with what it needs beside it (recompute_layers needs
# full recompute, vpp a pipeline, sequence parallelism TP, expert parallelism a MoE model).
CASES = {
    "model": {"model": "llama-3.2-1b"},
    "gpu": {"gpu": "b200"},
    "gpus": {"gpus": 16},
    "seq": {"seq": 4096},
    "micro_batch": {"micro_batch": 2},
    "global_batch": {"global_batch": 64},
    "precision": {"precision": "fp8"},
    "optimizer": {"optimizer": "sgd"},
    "optimizer_impl": {"optimizer_impl": "foreach"},
    "framework": {"framework": "pytorch"},
    "recompute": {"recompute": "selective"},
    "flash_attention": {"flash_attention": False},
    "fp32_grads": {"fp32_grads": False},
    "recompute_layers": {"recompute": "full", "recompute_layers": 4},
    "offload_activations": {"offload_activations": 2},
    "compile": {"framework": "pytorch", "compile": True},
    "fused_loss": {"framework": "pytorch", "fused_loss": True},
    "tp": {"tp": 2},
    "pp": {"pp": 2},
    "vpp": {"pp": 2, "vpp": 2, "global_batch": 8},
    "cp": {"cp": 2},
    "ep": {"model": "mixtral-8x7b", "ep": 2},
    "zero": {"zero": 3},
    "sequence_parallel": {"tp": 2, "sequence_parallel": True},
    "offload": {"offload": "optimizer"},
}


def _parser() -> argparse.ArgumentParser:
    return build_parser()._subparsers._group_actions[0].choices["size"]  # type: ignore[union-attr]


def _argv(changes: dict) -> list[str]:
    """The `advisor size` flags that set ``changes``, each as its action takes it."""
    actions = {a.option_strings[0]: a for a in _parser()._actions if a.option_strings}
    argv = []
    for key, value in changes.items():
        flag = CLI_FLAGS[key]
        action = actions[flag]
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(action, argparse._StoreTrueAction):
            assert value is (flag != "--no-flash"), (key, value)  # the flag sets what the default is not
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv


def _cli_setup(changes: dict):
    return setup_from_args(_parser().parse_args(_argv(changes)))


def test_every_field_has_a_flag_a_home_and_a_case():
    assert set(CASES) == set(DEFAULTS) <= set(CLI_FLAGS) and set(DEFAULTS) <= set(SETUP_FIELDS)
    flags = {s for a in _parser()._actions for s in a.option_strings}
    assert {CLI_FLAGS[k] for k in DEFAULTS} <= flags
    # The flags that are not a DEFAULTS field: a config.json instead of a preset, dp instead of the
    # GPU count, dropout, fp8's scaling recipe (a profiled step's), RoPE context extension (a model
    # field, not yet on the app's tabs), and the output format.
    others = {"--hf-config", "--dp", "--dropout", "--fp8-recipe", "--rope-scaling", "--json", "-h", "--help"}
    others.add("--no-fp32-grads")
    assert flags - {CLI_FLAGS[k] for k in DEFAULTS} == others


def test_no_flags_is_the_apps_first_screen():
    cli = _cli_setup({})
    assert cli == make_setup(**DEFAULTS)
    assert {k: setup_value(cli, k) for k in DEFAULTS} == DEFAULTS
    assert (cli.hardware.name, cli.gpus, cli.train.seq_len, cli.parallel.zero) == ("H200 141GB", 8, 8192, 1)


def test_the_default_sequence_fits_a_model_with_learned_positions():
    # GPT-2 has 1024 learned positions: 8192 would only be refused, so both front ends take 1024.
    assert fit_seq(8192, get_model("gpt2-124m")) == 1024 and fit_seq(8192, get_model("llama-3.1-8b")) == 8192
    assert _cli_setup({"model": "gpt2-124m"}).train.seq_len == 1024


def test_a_dp_flag_sets_the_gpu_count_instead_of_the_default():
    assert _cli_setup({}).gpus == 8
    args = _parser().parse_args(["--dp", "2", "--tp", "2"])
    assert setup_from_args(args).gpus == 4


@pytest.mark.parametrize("key", list(CASES))
def test_flag_and_widget_give_the_same_setup_and_read_back(key):
    pytest.importorskip("gradio")
    from webui.size import SIZE_KEYS, setup_from_size_inputs, size_values

    changes = CASES[key]
    cli = _cli_setup(changes)
    widgets = {**DEFAULTS, "config_file": None} | {
        k: str(v) if k in ("tp", "pp", "vpp", "cp", "ep", "zero") else v for k, v in changes.items()
    }
    app = setup_from_size_inputs(*[widgets[k] for k in SIZE_KEYS])
    assert cli == app
    assert setup_value(cli, key) == changes[key] != DEFAULTS[key]
    back = size_values(cli)
    assert back[key] == widgets[key]  # the widget shows what set it
    assert setup_from_size_inputs(*[back.get(k, widgets[k]) for k in SIZE_KEYS]) == cli


def test_every_size_widget_starts_on_the_table():
    gr = pytest.importorskip("gradio")
    from webui.size import SIZE_KEYS, build_size_tab

    with gr.Blocks():
        widgets, _ = build_size_tab()
    assert set(widgets) == set(SIZE_KEYS)
    for key, value in DEFAULTS.items():  # dropdowns hold text (the parallel degrees)
        assert widgets[key].value == (str(value) if isinstance(widgets[key], gr.Dropdown) else value), key


def test_the_profile_defaults_are_the_clis_and_the_tabs():
    gr = pytest.importorskip("gradio")
    from webui.profile import PROFILE_INPUTS, PROFILE_KEYS, build_profile_tab

    args = build_parser().parse_args(["profile"])
    for key in ("model", "seq", "micro_batch", "global_batch", "recompute", "optimizer", "optimizer_impl", "zero"):
        assert getattr(args, key) == PROFILE_DEFAULTS[key] == PROFILE_INPUTS[key], key
    assert args.precision is None and args.default_gpus is None  # this device's fastest, one process
    options = {k: getattr(args, k) for k in ("device", "steps", "layers", "num_workers", "nproc")}
    assert options == {k: PROFILE_DEFAULTS[k] for k in options}
    assert RunOptions().steps == PROFILE_DEFAULTS["steps"]
    with gr.Blocks():
        widgets, _ = build_profile_tab()
    assert set(widgets) == set(PROFILE_KEYS)
    for key in PROFILE_KEYS:
        value = PROFILE_INPUTS[key]
        assert widgets[key].value == (str(value) if key in ("tp", "pp", "zero") else value), key
