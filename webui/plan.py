"""The Plan tab: every layout of a model on N devices searched, the best ranked by tokens/s."""

from __future__ import annotations

import functools

import gradio as gr
import pandas as pd

from advisor.advice.commlinks import link_for
from advisor.errors import AdvisorError, SpecError
from advisor.estimate.planner import PlanRequest, PlanResult, layout_label, plan
from advisor.present.charts import plan_scatter_figure
from advisor.present.views import PLAN_COLUMNS, plan_summary, plan_table
from advisor.spec.defaults import DEFAULTS, PLAN_GLOBAL_BATCH
from advisor.spec.presets import HARDWARE, MODELS, get_hardware, get_model
from advisor.spec.specs import PRECISIONS, Setup
from advisor.store.runstore import RunStore
from webui import common
from webui.common import as_int, guarded, refuse_empty, spec_number

PLAN_KEYS = ("model", "gpu", "gpus", "seq", "global_batch", "precision")
"""The Plan tab's widgets that follow the shared spec (``precision``: the precisions to try)."""


@functools.lru_cache(maxsize=16)
def _measured_link(store_root: str, hardware_name: str, newest_run: str):
    """The newest distributed run's measured collective bandwidth on this device (advisor.analysis.commbw),
    read once per store state (``newest_run`` changes when a run is added)."""
    return link_for(RunStore(store_root), get_hardware(hardware_name))


def _link(gpu: str):
    store = common.store()
    runs, _ = store.list_runs()
    return _measured_link(str(store.root), gpu, runs[0].run_id if runs else "")


def _no_plan():
    return pd.DataFrame(columns=PLAN_COLUMNS), "", None


@functools.lru_cache(maxsize=8)
def _planned(req: PlanRequest) -> PlanResult:
    """The plan of a request, kept for "Use this layout", which picks a row of the table on screen."""
    return plan(req)


def _request(model, gpu, gpus, seq, global_batch, precisions, offload, measured_comm=True) -> PlanRequest:
    """The PlanRequest of the Plan tab's widgets (plan_view's parameters)."""
    refuse_empty(gpus=gpus, seq_len=seq, global_batch=global_batch)
    return PlanRequest(
        model=get_model(model),
        hardware=get_hardware(gpu),
        measured_link=_link(gpu) if measured_comm else None,
        gpus=as_int(gpus),
        seq_len=as_int(seq),
        global_batch=as_int(global_batch),
        precisions=precisions or (),  # PlanRequest checks it and makes it a tuple
        allow_offload=bool(offload),
        time_budget_s=common.plan_time_budget(),
    )


@guarded("Cannot plan", "The planner", _no_plan)
def plan_view(
    model: str,
    gpu: str,
    gpus: float,
    seq: float,
    global_batch: float,
    precisions: list,
    offload: bool,
    measured_comm: bool = True,
):
    """Plan tab: (summary, ranked layouts, explanation, memory vs tokens/s figure of every layout that
    fits) for a model on N devices; with ``measured_comm``, collectives run at the bandwidth measured by
    this device's newest distributed run, where the store has one."""
    result = _planned(_request(model, gpu, gpus, seq, global_batch, precisions, offload, measured_comm))
    figure = plan_scatter_figure(result) if result.points else None
    return plan_summary(result), plan_table(result), result.explain(), figure


def layout_setup(rank: float | None, table: pd.DataFrame | None, *plan_inputs) -> Setup:
    """The setup of the layout ranked ``rank`` in ``table`` (the Plan tab's, as on screen), planned from
    ``plan_inputs`` (plan_view's parameters). Raises AdvisorError where there is no such row, or where
    the inputs changed since the table was made (its row would name another layout)."""
    if table is None or len(table) == 0:
        raise AdvisorError("there is no layout to use yet: press Plan first")
    n = as_int(rank)
    if not isinstance(n, int) or not 1 <= n <= len(table):
        raise SpecError("rank", rank, f"must be a rank of the table, 1 to {len(table)}")
    top = _planned(_request(*plan_inputs)).top
    if n > len(top) or layout_label(top[n - 1].setup) != table["layout"].iloc[n - 1]:
        raise AdvisorError("the Plan inputs changed since this table was made: press Plan again, then pick a rank")
    return top[n - 1].setup


def _inputs(d: dict) -> dict:
    w = {"model": gr.Dropdown(list(MODELS), value=d["model"], label="Model preset", elem_id="plan-model")}
    with gr.Row():
        w["gpu"] = gr.Dropdown(list(HARDWARE), value=d["gpu"], label="Device")
        w["gpus"] = spec_number(d["gpus"], "GPUs", low=1)
    with gr.Row():
        w["seq"] = spec_number(d["seq"], "Sequence length", low=1)
        # The planner needs a batch to split: the shared spec's 0 ("no accumulation") stays off this tab.
        w["global_batch"] = spec_number(PLAN_GLOBAL_BATCH, "Global batch (sequences)", low=1)
    w["precision"] = gr.CheckboxGroup(list(PRECISIONS), value=[d["precision"]], label="Precisions to try")
    w["offload"] = gr.Checkbox(value=True, label="Try CPU offload")
    w["measured"] = gr.Checkbox(
        value=True, label="Communication at the bandwidth a stored distributed run measured on this device"
    )
    return w


def build_plan_tab() -> tuple[dict, dict]:
    """The Plan tab; returns its widgets that follow the shared spec (PLAN_KEYS), starting on DEFAULTS,
    and its "Use this layout" controls (button, message, inputs of layout_setup) for webui.linking."""
    with gr.Row():
        with gr.Column(scale=1, min_width=300):
            w = _inputs(DEFAULTS)
            button = gr.Button("Plan", variant="primary", elem_id="plan-run")
        with gr.Column(scale=2):
            summary = gr.Markdown("Pick a model, a device and a GPU count, then press Plan.", elem_id="plan-summary")
            table = gr.Dataframe(
                pd.DataFrame(columns=PLAN_COLUMNS),
                label="Best layouts",
                interactive=False,
                elem_id="plan-table",
                wrap=True,
                column_widths=["7%", "43%", "11%", "10%", "9%", "11%", "9%"],
            )
            with gr.Row():
                rank = spec_number(1, "Layout rank", low=1, elem_id="plan-use-rank")
                use = gr.Button("Use this layout", elem_id="plan-use")
            used = gr.Markdown(elem_id="plan-use-msg")
            scatter = gr.Plot(label="Every layout that fits: memory per GPU vs tokens/s")
            explain = gr.Markdown()
    inputs = [w[k] for k in ("model", "gpu", "gpus", "seq", "global_batch", "precision", "offload", "measured")]
    button.click(plan_view, inputs, [summary, table, explain, scatter], api_name="plan")
    return {k: w[k] for k in PLAN_KEYS}, {"button": use, "message": used, "inputs": [rank, table, *inputs]}
