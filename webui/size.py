"""The Size tab: a training setup's memory per GPU, step time and MFU, re-estimated on every change."""

from __future__ import annotations

import tempfile
from pathlib import Path

import gradio as gr
import pandas as pd

from advisor.errors import SpecError
from advisor.estimate.estimator import estimate
from advisor.present.charts import memory_figure, time_figure
from advisor.present.export import EXPORT_TARGETS, export_setup
from advisor.present.views import MEMORY_COLUMNS, TIME_COLUMNS, export_summary, memory_table, size_summary, time_table
from advisor.spec.defaults import DEFAULTS, setup_value
from advisor.spec.presets import HARDWARE, MODELS
from advisor.spec.setup import make_setup
from advisor.spec.specs import FRAMEWORKS, OFFLOAD_MODES, OPTIMIZER_IMPLS, OPTIMIZERS, PRECISIONS, RECOMPUTE_MODES
from webui import common
from webui.common import as_int, block_count, degree_dropdown, guarded, refuse_empty, spec_number

SIZE_KEYS = ["model", "config_file", *list(DEFAULTS)[1:]]
"""The Size tab's inputs in the order of size_view's parameters (the /size endpoint's)."""
INT_KEYS = {"gpus", "seq", "micro_batch", "global_batch", "recompute_layers", "offload_activations"}
INT_KEYS |= {"tp", "pp", "vpp", "cp", "ep", "zero"}
BOOL_KEYS = {"flash_attention", "fp32_grads", "compile", "fused_loss", "sequence_parallel"}
DEGREES = [1, 2, 4, 8, 16, 32, 64]


def _empty_tables():
    return None, None, pd.DataFrame(columns=MEMORY_COLUMNS), pd.DataFrame(columns=TIME_COLUMNS)


def setup_from_size_inputs(*values, **named):
    """The Setup of the Size tab's widgets, in SIZE_KEYS order or by name (a loaded config.json wins
    over the preset)."""
    kw = dict(zip(SIZE_KEYS, values, strict=False)) | named
    if missing := [k for k in SIZE_KEYS if k not in kw]:
        raise TypeError(f"Size tab values missing: {', '.join(missing)}")
    kw["hf_config"] = kw.pop("config_file") or None
    kw |= {k: as_int(kw[k]) for k in INT_KEYS}
    # An emptied box is no number: make_setup would size its own default (4,096 tokens where the box
    # showed 8,192) without a word. (An empty GPU count means one replica: tp x pp x cp GPUs.)
    refuse_empty(seq=kw["seq"])
    if bad := next((k for k in sorted(BOOL_KEYS) if kw[k] is not None and not isinstance(kw[k], bool)), None):
        raise SpecError(bad, kw[bad], "must be true or false")
    kw |= {k: bool(kw[k]) for k in BOOL_KEYS}
    return make_setup(**kw)


@guarded("Invalid setup", "The estimate", _empty_tables)
def size_view(
    model: str,
    config_file: str | None,
    gpu: str,
    gpus: float,
    seq: float,
    micro_batch: float,
    global_batch: float,
    precision: str,
    optimizer: str,
    optimizer_impl: str,
    framework: str,
    recompute: str,
    flash_attention: bool,
    fp32_grads: bool,
    recompute_layers: float,
    offload_activations: float,
    compile: bool,
    fused_loss: bool,
    tp: int,
    pp: int,
    vpp: int,
    cp: int,
    ep: int,
    zero: int,
    sequence_parallel: bool,
    offload: str,
):
    """Size tab: (verdict markdown, memory figure, time figure, memory table, time table). The
    parameters, SIZE_KEYS in order, name the /size endpoint's."""
    est = estimate(setup_from_size_inputs(**locals()))  # locals(): exactly the parameters, here
    return size_summary(est), memory_figure(est), time_figure(est), memory_table(est), time_table(est)


@guarded("Cannot export this setup", "The export", lambda: (None,))
def export_view(target: str, *values) -> tuple[str, str | None]:
    """Size tab's Export: (what was written and its notes, the file to download) of the current setup
    (``values``: the Size tab's widgets in SIZE_KEYS order) for framework ``target``."""
    out = export_setup(setup_from_size_inputs(*values), target)
    path = Path(tempfile.mkdtemp(prefix="export-", dir=common.download_root()), out.filename)
    path.write_text(out.text, encoding="utf-8")
    return export_summary(out), str(path)


def size_values(setup) -> dict:
    """The Size tab's widget values (DEFAULTS keys) that describe ``setup``: degrees as the dropdowns'
    text; the model only where it is a preset (an imported config.json stays in its file widget), the
    device only where a preset has it."""
    values = {k: setup_value(setup, k) for k in DEFAULTS}
    values |= {k: str(values[k]) for k in ("tp", "pp", "vpp", "cp", "ep", "zero")}
    return {k: v for k, v in values.items() if not (k in ("model", "gpu") and v not in (MODELS | HARDWARE))}


def _model_inputs(d: dict) -> dict:
    gr.Markdown("#### Model and devices")
    w = {"model": gr.Dropdown(list(MODELS), value=d["model"], label="Model preset", elem_id="size-model")}
    w["config_file"] = gr.File(label="…or a Hugging Face config.json", file_types=[".json"], type="filepath")
    with gr.Row():
        w["gpu"] = gr.Dropdown(list(HARDWARE), value=d["gpu"], label="Device")
        # No bounds on these numbers (common.spec_number): the spec names the field and what is allowed,
        # and the verdict, charts and tables give way to that message.
        w["gpus"] = spec_number(d["gpus"], "GPUs", info="empty: tp x pp x cp x ep, one replica")
    return w


def _step_inputs(d: dict) -> dict:
    gr.Markdown("#### Training step")
    w = {}
    with gr.Row():
        w["seq"] = spec_number(d["seq"], "Sequence length")
        w["micro_batch"] = spec_number(d["micro_batch"], "Micro-batch")
        w["global_batch"] = spec_number(d["global_batch"], "Global batch (0 = no accum)")
    w["precision"] = gr.Radio(list(PRECISIONS), value=d["precision"], label="Precision")
    with gr.Row():
        w["optimizer"] = gr.Radio(list(OPTIMIZERS), value=d["optimizer"], label="Optimizer")
        w["optimizer_impl"] = gr.Radio(list(OPTIMIZER_IMPLS), value=d["optimizer_impl"], label="Optimizer kernels")
    w["framework"] = gr.Radio(
        list(FRAMEWORKS),
        value=d["framework"],
        label="Implementation",
        info="megatron: bf16 weights + fp32 master, grad buffers; pytorch: eager autocast over fp32 weights",
    )
    return w


def _memory_inputs(d: dict) -> dict:
    w = {}
    w["recompute"] = gr.Radio(
        list(RECOMPUTE_MODES),
        value=d["recompute"],
        label="Activation checkpointing",
        info="selective: Megatron's (attention core); selective-op: torchtitan's (every other matmul kept)",
    )
    with gr.Row():
        w["recompute_layers"] = block_count(
            d["recompute_layers"],
            "Blocks that recompute per stage",
            info="with full: 0 = all (Megatron's recompute_num_layers)",
        )
        w["offload_activations"] = block_count(
            d["offload_activations"], "Blocks' activations offloaded", info="per stage, to host memory and back"
        )
    with gr.Row():
        w["flash_attention"] = gr.Checkbox(value=d["flash_attention"], label="Flash attention")
        w["fp32_grads"] = gr.Checkbox(value=d["fp32_grads"], label="fp32 gradients (Megatron default)")
    with gr.Row():
        w["compile"] = gr.Checkbox(value=d["compile"], label="torch.compile (eager step)")
        w["fused_loss"] = gr.Checkbox(value=d["fused_loss"], label="Fused loss (eager step)")
    return w


def _parallel_inputs(d: dict) -> dict:
    gr.Markdown("#### Parallelism (dp = GPUs / (tp·pp·cp))")
    w = {}
    with gr.Row():
        w["tp"] = degree_dropdown(DEGREES, d["tp"], "TP")
        w["pp"] = degree_dropdown(DEGREES, d["pp"], "PP")
        w["vpp"] = degree_dropdown([1, 2, 3, 4, 6, 8], d["vpp"], "Virtual stages")
    with gr.Row():
        w["cp"] = degree_dropdown(DEGREES, d["cp"], "CP")
        w["ep"] = degree_dropdown(DEGREES, d["ep"], "EP")
        w["zero"] = degree_dropdown([0, 1, 2, 3], d["zero"], "ZeRO / FSDP stage", elem_id="size-zero")
    w["sequence_parallel"] = gr.Checkbox(value=d["sequence_parallel"], label="Sequence parallel (with TP)")
    w["offload"] = gr.Radio(list(OFFLOAD_MODES), value=d["offload"], label="CPU offload")
    return w


def _outputs() -> list:
    summary = gr.Markdown(elem_id="size-verdict")
    with gr.Row():
        mem_plot = gr.Plot(label="Memory per GPU")
        time_plot = gr.Plot(label="Step time")
    with gr.Row():
        mem = gr.Dataframe(pd.DataFrame(columns=MEMORY_COLUMNS), label="Memory breakdown", interactive=False, wrap=True)
        tim = gr.Dataframe(
            pd.DataFrame(columns=TIME_COLUMNS), label="Step-time breakdown", interactive=False, wrap=True
        )
    return [summary, mem_plot, time_plot, mem, tim]


def build_size_tab() -> tuple[dict, list]:
    """The Size tab: its input widgets by SIZE_KEYS name (starting on DEFAULTS), and its outputs."""
    with gr.Row():
        with gr.Column(scale=1, min_width=320):
            widgets = _model_inputs(DEFAULTS) | _step_inputs(DEFAULTS)
            widgets |= _memory_inputs(DEFAULTS) | _parallel_inputs(DEFAULTS)
        with gr.Column(scale=2):
            outputs = _outputs()
    inputs = [widgets[k] for k in SIZE_KEYS]
    gr.on([c.change for c in inputs], size_view, inputs, outputs, api_name="size", show_progress="hidden")
    _export_controls(inputs)
    return widgets, outputs


def _export_controls(inputs: list) -> None:
    """Export: the current setup as a framework's launch config, to download."""
    gr.Markdown("#### Export: launch config of this setup")
    with gr.Row():
        target = gr.Dropdown(list(EXPORT_TARGETS), value=EXPORT_TARGETS[0], label="Framework", elem_id="size-export-to")
        button = gr.Button("Export", elem_id="size-export")
    message = gr.Markdown(elem_id="size-export-msg")
    file = gr.File(label="Launch config", interactive=False, elem_id="size-export-file")
    button.click(export_view, [target, *inputs], [message, file], api_name="export")
