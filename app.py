"""The web app (Gradio). Thin: widgets to values, one core call, results to plots and tables.

Run ``python app.py`` (binds 127.0.0.1:7860; set ADVISOR_HOST / ADVISOR_PORT to change).
"""

from __future__ import annotations

import logging
import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr
import pandas as pd

from advisor.charts import memory_figure, time_figure
from advisor.errors import AdvisorError
from advisor.estimator import estimate
from advisor.presets import HARDWARE, MODELS
from advisor.report import describe_setup, memory_rows, time_rows, verdict
from advisor.sizing import make_setup
from advisor.specs import OFFLOAD_MODES, OPTIMIZERS, PRECISIONS, RECOMPUTE_MODES

log = logging.getLogger("advisor.app")

DEFAULTS = {
    "model": "llama-3.1-8b",
    "gpu": "h200",
    "gpus": 8,
    "seq": 8192,
    "micro_batch": 1,
    "global_batch": 64,
    "precision": "bf16",
    "optimizer": "adamw",
    "recompute": "none",
    "flash_attention": True,
    "fp32_grads": False,
    "tp": 1,
    "pp": 1,
    "vpp": 1,
    "cp": 1,
    "ep": 1,
    "zero": 1,
    "sequence_parallel": False,
    "offload": "none",
}
_DEGREES = [1, 2, 4, 8, 16, 32, 64]
_EMPTY_MEMORY = pd.DataFrame(columns=["component", "GiB", "share %"])
_EMPTY_TIME = pd.DataFrame(columns=["component", "ms", "share %"])


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
    recompute: str,
    flash_attention: bool,
    fp32_grads: bool,
    tp: int,
    pp: int,
    vpp: int,
    cp: int,
    ep: int,
    zero: int,
    sequence_parallel: bool,
    offload: str,
):
    """Size tab: (verdict markdown, memory figure, time figure, memory table, time table)."""
    try:
        setup = make_setup(
            model=model,
            hf_config=config_file or None,
            gpu=gpu,
            gpus=_as_int(gpus),
            seq=_as_int(seq),
            micro_batch=_as_int(micro_batch),
            global_batch=_as_int(global_batch),
            precision=precision,
            optimizer=optimizer,
            recompute=recompute,
            flash_attention=bool(flash_attention),
            fp32_grads=bool(fp32_grads),
            tp=int(tp),
            pp=int(pp),
            vpp=int(vpp),
            cp=int(cp),
            ep=int(ep),
            zero=int(zero),
            sequence_parallel=bool(sequence_parallel),
            offload=offload,
        )
        est = estimate(setup)
    except AdvisorError as err:
        return f"### Invalid setup\n{err}", None, None, _EMPTY_MEMORY, _EMPTY_TIME
    except Exception:  # the server stays up; the log keeps the traceback
        log.exception("size_view failed")
        return (
            "### Internal error\nThe estimate failed unexpectedly; see the server log.",
            None,
            None,
            _EMPTY_MEMORY,
            _EMPTY_TIME,
        )
    icon = "✅" if est.fits else "❌"
    summary = (
        f"### {icon} {verdict(est)}\n"
        f"**{est.tokens_per_s:,.0f} tokens/s** · step {est.step_time_ms:,.0f} ms · "
        f"**MFU {100 * est.mfu_frac:.1f} %** · {est.setup.gpus} GPUs (dp {est.setup.parallel.dp})\n\n"
        f"<small>{describe_setup(est)}</small>"
    )
    mem = pd.DataFrame(memory_rows(est), columns=["component", "GiB", "share %"]).round(2)
    tim = pd.DataFrame(time_rows(est), columns=["component", "ms", "share %"]).round(1)
    return summary, memory_figure(est), time_figure(est), mem, tim


def _as_int(value: float | None) -> int | None:
    """Gradio numbers arrive as float or None; integral floats become ints, the rest stay for the
    spec's validation to reject with a clear message."""
    if value is None:
        return None
    return int(value) if float(value).is_integer() else value  # type: ignore[return-value]


def build_size_tab() -> None:
    d = DEFAULTS
    with gr.Row():
        with gr.Column(scale=1, min_width=320):
            gr.Markdown("#### Model and devices")
            model = gr.Dropdown(list(MODELS), value=d["model"], label="Model preset")
            config_file = gr.File(label="…or a Hugging Face config.json", file_types=[".json"], type="filepath")
            with gr.Row():
                gpu = gr.Dropdown(list(HARDWARE), value=d["gpu"], label="Device")
                gpus = gr.Number(value=d["gpus"], precision=0, minimum=1, label="GPUs")
            gr.Markdown("#### Training step")
            with gr.Row():
                seq = gr.Number(value=d["seq"], precision=0, minimum=1, label="Sequence length")
                micro_batch = gr.Number(value=d["micro_batch"], precision=0, minimum=1, label="Micro-batch")
                global_batch = gr.Number(
                    value=d["global_batch"], precision=0, minimum=0, label="Global batch (0 = no accum)"
                )
            precision = gr.Radio(list(PRECISIONS), value=d["precision"], label="Precision")
            optimizer = gr.Radio(list(OPTIMIZERS), value=d["optimizer"], label="Optimizer")
            recompute = gr.Radio(list(RECOMPUTE_MODES), value=d["recompute"], label="Activation checkpointing")
            with gr.Row():
                flash = gr.Checkbox(value=d["flash_attention"], label="Flash attention")
                fp32_grads = gr.Checkbox(value=d["fp32_grads"], label="fp32 gradients (Megatron default)")
            gr.Markdown("#### Parallelism (dp = GPUs / (tp·pp·cp))")
            with gr.Row():
                tp = gr.Dropdown(_DEGREES, value=d["tp"], label="TP")
                pp = gr.Dropdown(_DEGREES, value=d["pp"], label="PP")
                vpp = gr.Dropdown([1, 2, 3, 4, 6, 8], value=d["vpp"], label="Virtual stages")
            with gr.Row():
                cp = gr.Dropdown(_DEGREES, value=d["cp"], label="CP")
                ep = gr.Dropdown(_DEGREES, value=d["ep"], label="EP")
                zero = gr.Dropdown([0, 1, 2, 3], value=d["zero"], label="ZeRO / FSDP stage")
            sp = gr.Checkbox(value=d["sequence_parallel"], label="Sequence parallel (with TP)")
            offload = gr.Radio(list(OFFLOAD_MODES), value=d["offload"], label="CPU offload")
        with gr.Column(scale=2):
            summary = gr.Markdown(elem_id="size-verdict")
            with gr.Row():
                mem_plot = gr.Plot(label="Memory per GPU")
                time_plot = gr.Plot(label="Step time")
            with gr.Row():
                mem_table = gr.Dataframe(_EMPTY_MEMORY, label="Memory breakdown", interactive=False)
                time_table = gr.Dataframe(_EMPTY_TIME, label="Step-time breakdown", interactive=False)
    inputs = [
        model,
        config_file,
        gpu,
        gpus,
        seq,
        micro_batch,
        global_batch,
        precision,
        optimizer,
        recompute,
        flash,
        fp32_grads,
    ]
    inputs += [tp, pp, vpp, cp, ep, zero, sp, offload]
    outputs = [summary, mem_plot, time_plot, mem_table, time_table]
    gr.on(
        triggers=[c.change for c in inputs],
        fn=size_view,
        inputs=inputs,
        outputs=outputs,
        api_name="size",
        show_progress="hidden",
    )
    return inputs, outputs


def build_app() -> gr.Blocks:
    """The whole app; tabs are added here as the product grows."""
    with gr.Blocks(title="LLM training advisor") as demo:
        gr.Markdown("# LLM training advisor\nSize a training setup instantly: memory per GPU, step time, MFU.")
        with gr.Tab("Size"):
            inputs, outputs = build_size_tab()
        demo.load(size_view, inputs=inputs, outputs=outputs, api_name=False)
    return demo


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    host = os.environ.get("ADVISOR_HOST", "127.0.0.1")
    port = int(os.environ.get("ADVISOR_PORT", "7860"))
    build_app().queue(default_concurrency_limit=16).launch(server_name=host, server_port=port, max_file_size="5mb")


if __name__ == "__main__":
    main()
