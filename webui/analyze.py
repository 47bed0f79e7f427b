"""The Analyze tab: anyone's trace (Kineto JSON per rank, a zip of them, an Nsight Systems SQLite) or a
stored run's, broken down as HolisticTraceAnalysis does, with its roofline and collectives."""

from __future__ import annotations

import os
import threading

import gradio as gr
import pandas as pd

from advisor.analysis.summary import analyze, format_report, load_trace
from advisor.errors import AdvisorError
from advisor.present.charts import category_figure, roofline_figure, temporal_figure
from advisor.present.views import (
    COLLECTIVE_COLUMNS,
    ROOFLINE_HEADERS,
    ROOFLINE_ROWS,
    TABLE_COLUMNS,
    TABLE_NOTES,
    analysis_details,
    analysis_top_table,
    roofline_rows,
    table_choices,
    table_view,
)
from webui import common
from webui.common import ROOFLINE_LABEL, TRACE_LABEL, TRACE_TYPES, guarded, run_dropdown

MAX_UPLOAD = "500mb"
STAGES = 3


class _Cancelled(AdvisorError):
    """The user cancelled the job between two of its stages."""


def no_analysis():
    return (
        None,
        None,
        None,
        pd.DataFrame(columns=TABLE_COLUMNS),
        pd.DataFrame(),
        pd.DataFrame(columns=COLLECTIVE_COLUMNS),
        None,
        pd.DataFrame(columns=ROOFLINE_HEADERS),
        gr.Dropdown(choices=[], value=None),
        {},
        gr.Dataframe(value=pd.DataFrame(), label=TABLE_LABEL),
    )


def _default_table(tables: dict[str, pd.DataFrame]) -> str | None:
    names = [name for _, name in table_choices(tables)]
    for preferred in ("gpu_idle", "phases"):
        if preferred in names:
            return preferred
    return names[0] if names else None


TABLE_LABEL = "Times in ms (the CLI: analyze PATH --table NAME)"


def show_table(name: str | None, tables: dict | None):
    """The "All analyses" picker: the chosen table of the last analysis (times in ms), labelled with
    what it holds."""
    if not name or not tables or name not in tables:
        return gr.Dataframe(value=pd.DataFrame(), label=TABLE_LABEL)
    note = TABLE_NOTES.get(name)
    return gr.Dataframe(value=table_view(tables, name), label=f"{name}: {note}" if note else name)


def _stage_reporter(on_stage, cancel: threading.Event | None):
    def stage(done: int, message: str) -> None:
        if cancel is not None and cancel.is_set():
            raise _Cancelled("cancelled by the user")
        if on_stage is not None:
            on_stage(done, STAGES, message)

    return stage


def _views(report, table, roofline, label: str, skipped: str):
    t = report.tables
    gpu = not t["temporal_breakdown"].empty
    summary = "```\n" + format_report(report, label) + "\n```" + (f"\n\n{skipped}" if skipped else "")
    return (
        summary,
        temporal_figure(t["temporal_breakdown"]) if gpu else None,
        category_figure(t["kernel_categories"]) if gpu else None,
        common.timeline_of(table),
        analysis_top_table(report),
        analysis_details(report),
        t["collectives"][COLLECTIVE_COLUMNS].round(3),
        roofline_figure(roofline.table) if roofline else None,
        roofline_rows(roofline.table) if roofline else pd.DataFrame(columns=ROOFLINE_HEADERS),
        gr.Dropdown(choices=table_choices(t), value=(first := _default_table(t))),
        t,
        show_table(first, t),
    )


@guarded("Cannot analyze this trace", "The analysis", no_analysis)
def analyze_view(upload: str | None, run_id: str | None, on_stage=None, cancel: threading.Event | None = None):
    """Analyze tab: (summary, temporal figure, category figure, step-timeline figure, top table,
    details table, collectives table, roofline figure, roofline table, the "All analyses" picker, every
    table (its state), the picked table) of an uploaded trace, or else of a stored run's trace; outputs
    added later come last. ``on_stage(done, total, message)`` hears of
    each stage; a set ``cancel`` stops before the next one."""
    if not (upload or run_id):
        hint = "Upload a trace (Kineto .json / .json.gz, a .zip of rank files, or an nsys .sqlite) or pick a run."
        return (hint, *no_analysis())
    path, label = (upload, os.path.basename(upload)) if upload else (str(common.store().path(run_id)), run_id)
    stage = _stage_reporter(on_stage, cancel)
    try:
        stage(0, f"loading {label}")
        table = load_trace(path)
        stage(1, f"analyzing {len(table):,} events")
        roofline, skipped = common.roofline_of(table)
        report = analyze(table, run_id=label, roofline=roofline)
        stage(2, "drawing")
    except _Cancelled:
        return ("### Analysis cancelled", *no_analysis())
    return _views(report, table, roofline, label, skipped)


def analyze_job(upload: str | None, run_id: str | None, request: gr.Request | None = None):
    """The Analyze tab's action: analyze_view in the background, its stages shown as they pass, and
    cancellable (the stage in progress finishes, the next does not start)."""
    result = yield from common.in_background(
        "analyze",
        request,
        lambda on_stage, cancel: analyze_view(upload, run_id, on_stage, cancel),
        lambda done, total, message: (
            f"### Analyzing: {message} ({done} of {total} stages done)",
            *(gr.skip() for _ in no_analysis()),
        ),
    )
    yield result if isinstance(result, tuple) else (f"### Cannot analyze this trace\n{result}", *no_analysis())


def cancel_analysis(request: gr.Request | None = None) -> str:
    return common.cancel_message(
        "analyze",
        request,
        "### Cancelling after the stage in progress…",
        "No analysis of yours is running here to cancel.",
    )


def _inputs():
    upload = gr.File(label=TRACE_LABEL, file_types=TRACE_TYPES, type="filepath", elem_id="analyze-upload")
    runs = run_dropdown("…or a stored run")
    with gr.Row():
        button = gr.Button("Analyze", variant="primary", elem_id="analyze-run")
        cancel = gr.Button("Cancel")
    return upload, runs, button, cancel


def _tables() -> dict:
    w = {}
    w["top"] = gr.Dataframe(
        pd.DataFrame(columns=TABLE_COLUMNS),
        label="Top kernels / ops",
        interactive=False,
        wrap=True,
        column_widths=["56%", "14%", "10%", "10%", "10%"],  # the numbers stay in view beside long names
        elem_id="analyze-top",
    )
    w["roofline"] = gr.Plot(label=ROOFLINE_LABEL, elem_id="analyze-roofline")
    w["roofline_table"] = gr.Dataframe(
        pd.DataFrame(columns=ROOFLINE_HEADERS),
        label=f"Roofline per op / kernel and shapes (top {ROOFLINE_ROWS} by time; headroom: the share "
        "of its time above the roof)",
        interactive=False,
        wrap=True,
        max_chars=40,  # a click on a cell shows the rest; the numbers stay in view beside the names
        pinned_columns=1,
        elem_id="analyze-roofline-table",
    )
    w["details"] = gr.Dataframe(
        pd.DataFrame(), label="Idle time by stream (GPU) / step phases (CPU)", interactive=False, wrap=True
    )
    w["collectives"] = gr.Dataframe(
        pd.DataFrame(columns=COLLECTIVE_COLUMNS),
        label="Collectives per rank: time, and exposed time with no compute beside it",
        interactive=False,
        wrap=True,
        elem_id="analyze-collectives",
    )
    with gr.Accordion("All analyses: every table of the analysis", open=False, elem_id="analyze-all"):
        w["picker"] = gr.Dropdown(choices=[], label="Table", elem_id="analyze-table-picker")
        w["state"] = gr.State({})
        w["table"] = gr.Dataframe(
            pd.DataFrame(), label=TABLE_LABEL, interactive=False, wrap=True, elem_id="analyze-table"
        )
    return w


def build_analyze_tab() -> gr.Dropdown:
    """The Analyze tab; returns its stored-run picker (filled on page load)."""
    with gr.Row():
        with gr.Column(scale=1, min_width=300):
            upload, runs, button, cancel = _inputs()
        with gr.Column(scale=2):
            summary = gr.Markdown("Upload a trace or pick a run.", elem_id="analyze-summary")
            with gr.Row():
                temporal = gr.Plot(label="GPU time per rank")
                categories = gr.Plot(label="Kernel categories")
            timeline = gr.Plot(label="One step on rank 0: phases and top kernels or ops")
            t = _tables()
    outputs = [summary, temporal, categories, timeline, t["top"], t["details"], t["collectives"]]
    outputs += [t["roofline"], t["roofline_table"], t["picker"], t["state"], t["table"]]
    t["picker"].change(show_table, [t["picker"], t["state"]], t["table"], api_visibility="undocumented")
    button.click(analyze_job, [upload, runs], outputs, api_name="analyze")
    upload.upload(analyze_job, [upload, runs], outputs, api_visibility="undocumented")
    cancel.click(cancel_analysis, None, summary, queue=False, api_visibility="undocumented")
    return runs
