"""The setup in a page address (advisor.spec.query) and what Apply shows it changes (views.setup_diff)."""

from __future__ import annotations

from advisor.present.views import setup_diff
from advisor.spec.defaults import DEFAULTS, setup_value
from advisor.spec.query import setup_query, values_from_query
from advisor.spec.setup import make_setup

# Every field away from its default, and a valid setup: MoE for EP, TP for sequence parallel.
EVERY_FIELD = dict(
    model="mixtral-8x7b",
    gpu="h100",
    gpus=64,
    seq=4096,
    micro_batch=2,
    global_batch=256,
    precision="fp8",
    optimizer="adafactor",
    optimizer_impl="foreach",
    framework="pytorch",
    recompute="full",
    flash_attention=False,
    fp32_grads=False,
    recompute_layers=2,
    offload_activations=1,
    compile=True,
    fused_loss=True,
    tp=2,
    pp=2,
    vpp=2,
    cp=2,
    ep=2,
    zero=2,
    sequence_parallel=True,
    offload="optimizer",
)


def test_every_field_round_trips_through_the_query():
    assert set(EVERY_FIELD) == set(DEFAULTS)
    query = setup_query(EVERY_FIELD)
    assert list(query) == list(DEFAULTS)  # every field differs here, so every field travels
    assert query["flash_attention"] == "false" and query["tp"] == "2" and query["model"] == "mixtral-8x7b"
    values, problems = values_from_query(query)
    assert problems == [] and values == EVERY_FIELD
    setup = make_setup(**values)
    assert {k: setup_value(setup, k) for k in DEFAULTS} == EVERY_FIELD


def test_only_what_differs_from_the_defaults_travels():
    # As the widgets hold them: numbers as floats, degrees as the dropdowns' text.
    widgets = {**DEFAULTS, "gpus": 8.0, "tp": "1", "zero": "3", "seq": 4096.0}
    assert setup_query(widgets) == {"seq": "4096", "zero": "3"}
    assert setup_query(DEFAULTS) == {}
    # An emptied GPU count (one replica) is not the default 8: it travels as empty, and comes back None.
    assert setup_query({"gpus": None}) == {"gpus": ""}
    assert values_from_query({"gpus": ""}) == ({"gpus": None}, [])


def test_bad_parameters_are_named_with_what_is_allowed():
    values, problems = values_from_query({"seq": "8k", "compile": "maybe", "colour": "red", "tp": "4"})
    assert values == {"tp": 4}
    assert problems[0] == "`seq=8k`: must be a whole number"
    assert problems[1].startswith("`compile=maybe`: must be true or false (true/1/yes/on or false/0/no/off)")
    assert problems[2].startswith("`colour=red`: unknown field (known: model, gpu, gpus,")
    assert values_from_query({"compile": "ON", "fp32_grads": "0"}) == ({"compile": True, "fp32_grads": False}, [])


def test_setup_diff_lists_each_changed_field_from_and_to():
    before = {**DEFAULTS, "gpus": 8.0, "tp": "1", "model": "llama-3.1-70b"}
    after = {"model": "tiny", "gpus": 1, "tp": "1", "precision": "bf16", "fused_loss": True, "device": "cpu"}
    assert setup_diff(before, after) == (
        "It changes 3 fields of the Size tab:\n\n| field | before | after |\n|---|---|---|\n"
        "| model | llama-3.1-70b | tiny |\n| gpus | 8 | 1 |\n| fused_loss | false | true |"
    )
    assert (
        setup_diff(before, {"tp": 1, "gpus": 8})
        == "It changes no field of the Size tab: the setup there already has it."
    )
