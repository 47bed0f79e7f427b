"""The app's Size tab handler: widget values in, verdict, plots and tables out; bad input shown, not raised."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
app = pytest.importorskip("app")

DATA = Path(__file__).parent / "data" / "hf"


def _view(**changes):
    values = {**app.DEFAULTS, "config_file": None, **changes}
    return app.size_view(**values)


def test_default_view_is_useful():
    summary, mem_fig, time_fig, mem_table, time_table = _view()
    assert summary.startswith("### ✅ FITS")
    assert "tokens/s" in summary and "MFU" in summary
    assert list(mem_table["component"])[:4] == ["weights", "gradients", "optimizer states", "activations"]
    assert mem_table["GiB"].sum() == pytest.approx(float(summary.split("FITS: ")[1].split(" GiB")[0]), abs=0.1)
    stacked = [trace.name for trace in mem_fig.data]
    assert stacked == [
        "weights",
        "gradients",
        "optimizer states",
        "activations",
        "temp/comm buffers",
        "runtime + fragmentation",
    ]
    assert time_fig.data[0].orientation == "h"
    assert time_table["ms"].sum() > 0


def test_does_not_fit_is_said_plainly():
    summary, *_ = _view(model="llama-3.1-70b", gpus=8, zero=0)
    assert summary.startswith("### ❌ DOES NOT FIT")


def test_pipeline_shows_first_and_last_stage():
    _, mem_fig, *_ = _view(model="llama-3.1-70b", gpus=32, tp=4, pp=4, global_batch=64)
    assert list(mem_fig.data[0].x) == ["first stage", "last stage"]


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"tp": 64}, "gpus=8: must be a multiple of tp x pp x cp = 64"),
        ({"gpus": 64, "pp": 64}, "parallel.pp=64: model.n_layers=32 must be divisible by pp x vpp=64"),
        ({"seq": 0}, "train.seq_len=0"),
        ({"seq": 100.5}, "train.seq_len=100.5"),
        ({"global_batch": 7}, "train.global_batch=7"),
        ({"ep": 2}, "parallel.ep=2: expert parallelism needs a MoE model"),
        ({"precision": "fp8", "gpu": "a100-40gb"}, "has no fp8"),
    ],
)
def test_bad_widget_values_show_a_message(changes, words):
    summary, mem_fig, time_fig, mem_table, _ = _view(**changes)
    assert summary.startswith("### Invalid setup") and words in summary
    assert mem_fig is None and time_fig is None and mem_table.empty


def test_empty_gpu_count_means_one_replica():
    summary, *_ = _view(gpus=None, tp=2)
    assert "on 2 x H200" in summary and "dp1 tp2" in summary


def test_uploaded_config_overrides_the_preset(tmp_path):
    summary, *_ = _view(config_file=str(DATA / "mixtral-8x7b.json"), gpus=16, ep=8, zero=1)
    assert "mixtral-8x7b (46.70B params, 12.88B active)" in summary
    junk = tmp_path / "config.json"
    junk.write_text('{"model_type": "bert"}')
    summary, *_ = _view(config_file=str(junk))
    assert "model_type 'bert' is not supported" in summary


def test_unexpected_errors_stay_inside_the_handler(monkeypatch):
    def boom(_setup):
        raise RuntimeError("bug")

    monkeypatch.setattr(app, "estimate", boom)
    summary, *_ = _view()
    assert summary.startswith("### Internal error")


def test_app_builds_with_a_size_endpoint():
    demo = app.build_app()
    names = [dep.get("api_name") for dep in demo.config["dependencies"]]
    assert "size" in names
