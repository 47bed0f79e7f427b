"""The History tab: the run store filtered and searched, two runs compared, and this machine calibrated."""

from __future__ import annotations

import gradio as gr
import pandas as pd

from advisor.advice.calibrate import calibrate_machine, format_calibration
from advisor.present.charts import compare_phase_figure, predicted_measured_figure
from advisor.store.history import compare_runs, filter_choices, predicted_vs_measured, run_table
from webui import common
from webui.common import as_int, guarded, log, run_dropdown, spec_number

SHOWN = ["run_id", "started_utc", "status", "model", "device_type", "precision", "seq_len"]
SHOWN += ["micro_batch", "recompute", "step_time_ms", "estimate_step_time_ms", "tokens_per_s"]
SHOWN += ["mfu_pct", "peak_memory_gib"]
ANY = "any"
DIFF_COLUMNS = ["field", "a", "b"]
METRIC_COLUMNS = ["metric", "a", "b", "change_pct"]


def _pick(value: str | None) -> str | None:
    return None if value in (None, "", ANY) else value


def _no_runs():
    return pd.DataFrame(columns=SHOWN), None


@guarded("Cannot list runs", "Listing the runs", _no_runs)
def history_view(model: str | None, status: str | None, device: str | None, text: str | None):
    """History tab: (count line, runs table, predicted-vs-measured figure) for the filters ("any" or
    empty: no filter)."""
    store = common.store()
    table = run_table(store, model=_pick(model), status=_pick(status), device=_pick(device), text=_pick(text))
    pvm = predicted_vs_measured(store)
    line = f"**{len(table)} run{'s' * (len(table) != 1)}** in `{store.root.name}/` match"
    return line, table[SHOWN].round(3), predicted_measured_figure(pvm) if len(pvm) else None


def history_filters():
    """The filter dropdowns' choices from the store (models, statuses, device types)."""
    try:
        c = filter_choices(run_table(common.store()))
    except Exception:  # the filters stay at "any"; history_view reports what is wrong
        log.exception("history_filters failed")
        return tuple(gr.skip() for _ in range(3))
    return tuple(gr.Dropdown(choices=[ANY, *values], value=ANY) for values in (c.models, c.statuses, c.devices))


def _no_comparison():
    return pd.DataFrame(columns=DIFF_COLUMNS), pd.DataFrame(columns=METRIC_COLUMNS), None


@guarded("Cannot compare", "The comparison", _no_comparison)
def compare_view(run_a: str | None, run_b: str | None):
    """History tab: (summary, spec differences, metrics side by side, phase figure) of two runs."""
    if not run_a or not run_b:
        return ("Pick two runs to compare (A and B).", *_no_comparison())
    c = compare_runs(common.store(), run_a, run_b)
    diff = c.spec_diff.astype(str) if len(c.spec_diff) else c.spec_diff
    figure = compare_phase_figure(c.metrics_a, c.metrics_b, f"A {run_a}", f"B {run_b}")
    return f"### A `{run_a}` vs B `{run_b}`\n{c.summary}", diff, c.metrics.round(3), figure


def calibrate_view(sweep_runs: float, request: gr.Request | None = None):
    """History tab: calibrate this machine (a sweep of short profiled steps, then the fit), yielding
    progress, then the fitted calibration's report."""
    n = as_int(sweep_runs)
    yield "### Starting the calibration…"
    store = common.store()
    result = yield from common.in_background(
        "calibrate",
        request,
        lambda on_progress, cancel: calibrate_machine(store, n, on_progress=on_progress, cancel=cancel),
        lambda done, total, message: f"### Calibrating: {done} of {total} runs done\n{message}",
    )
    if isinstance(result, str):
        yield f"### Not calibrated\n{result}"
        return
    cal, path, sweep = result
    head = f"### Calibrated on {cal.n_runs} runs"
    if len(sweep) < n:
        head += f" (sweep cancelled: {len(sweep)} of {n} runs made, the last one cancelled)"
    yield f"{head}\n```\n{format_calibration(cal, path)}\n```"


def cancel_calibration(request: gr.Request | None = None) -> str:
    return common.cancel_message(
        "calibrate", request, "### Cancelling the run in flight…", "No calibration of yours is running here to cancel."
    )


def _filters() -> list:
    with gr.Row():
        model = gr.Dropdown([ANY], value=ANY, label="Model", elem_id="history-model")
        status = gr.Dropdown([ANY], value=ANY, label="Status")
        device = gr.Dropdown([ANY], value=ANY, label="Device")
        text = gr.Textbox(label="Search id, model, message", max_lines=1)
        refresh = gr.Button("Refresh", size="sm")
    return [model, status, device, text, refresh]


def _comparison() -> dict:
    w = {}
    with gr.Row():
        w["run_a"] = run_dropdown("Run A", elem_id="history-a")
        w["run_b"] = run_dropdown("Run B", elem_id="history-b")
        w["button"] = gr.Button("Compare", variant="primary", elem_id="history-compare")
    w["summary"] = gr.Markdown("Pick two runs and press Compare.", elem_id="history-summary")
    with gr.Row():
        w["diff"] = gr.Dataframe(
            pd.DataFrame(columns=DIFF_COLUMNS),
            label="Spec differences",
            interactive=False,
            wrap=True,
            elem_id="history-diff",
        )
        w["metrics"] = gr.Dataframe(
            pd.DataFrame(columns=METRIC_COLUMNS), label="Measured, side by side", interactive=False, wrap=True
        )
    with gr.Row():
        w["phases"] = gr.Plot(label="Step phases, A and B")
        w["pvm"] = gr.Plot(label="Predicted vs measured step time")
    return w


def _calibration() -> tuple:
    with gr.Accordion("Calibrate this machine", open=False):
        gr.Markdown(
            "Profiles short steps of small models on this machine, then fits the regression that corrects the "
            "estimator on every run of this device in the store (the Advice tab's *calibrated* column)."
        )
        with gr.Row():
            sweep_runs = spec_number(12, "Sweep runs (0: fit only)", low=0, high=200)
            calibrate = gr.Button("Calibrate", variant="primary", elem_id="history-calibrate")
            cancel = gr.Button("Cancel")
        calibration = gr.Markdown(elem_id="history-calibration")
    return sweep_runs, calibrate, cancel, calibration


def build_history_tab() -> dict:
    """The History tab; returns by name the widgets to fill on page load: the filters (model, status,
    device dropdowns, then the search box), the list's outputs and the two run pickers."""
    *filters, refresh = _filters()
    count = gr.Markdown(elem_id="history-count")
    table = gr.Dataframe(
        pd.DataFrame(columns=SHOWN),
        label="Runs (sort or filter with ⋮ on a column header)",
        interactive=False,
        wrap=True,
    )
    c = _comparison()
    sweep_runs, calibrate, cancel, calibration = _calibration()
    listed = [count, table, c["pvm"]]
    quiet = {"api_visibility": "undocumented"}
    calibrate.click(
        calibrate_view, sweep_runs, calibration, concurrency_limit=1, concurrency_id="device", api_name="calibrate"
    ).then(history_view, filters, listed, **quiet)
    cancel.click(cancel_calibration, None, calibration, queue=False, **quiet)
    model, status, device, text = filters
    gr.on(
        [model.change, status.change, device.change, text.submit, refresh.click], history_view, filters, listed, **quiet
    )
    compared = [c["summary"], c["diff"], c["metrics"], c["phases"]]
    c["button"].click(compare_view, [c["run_a"], c["run_b"]], compared, api_name="compare")
    return {"filters": filters, "outputs": listed, "run_a": c["run_a"], "run_b": c["run_b"]}
