"""The Analyze tab: anyone's trace (Kineto JSON per rank, a zip of them, an Nsight Systems SQLite) or a
stored run's, broken down as HolisticTraceAnalysis does, with its roofline and collectives."""

from __future__ import annotations

import os
import tempfile
import threading
import time

import gradio as gr
import pandas as pd

from advisor.analysis.summary import format_report, load_trace
from advisor.errors import AdvisorError, TraceError
from advisor.present.charts import category_figure, roofline_figure, temporal_figure
from advisor.present.views import (
    COLLECTIVE_COLUMNS,
    ROOFLINE_HEADERS,
    ROOFLINE_ROWS,
    TABLE_COLUMNS,
    TABLE_NOTES,
    analysis_details,
    analysis_top_table,
    code_block,
    inline_code,
    roofline_rows,
    table_choices,
    table_view,
)
from advisor.run import analysis_child as isolated
from advisor.run.analysis_child import Analysis
from advisor.trace.export import write_chrome_trace
from webui import common
from webui.common import ROOFLINE_LABEL, TRACE_LABEL, TRACE_TYPES, guarded, run_dropdown

MAX_UPLOAD = "500mb"
STAGES = 3


class _Cancelled(AdvisorError):
    """The user cancelled the job (the analysis process is killed; a load in this process, for
    Perfetto, stops at its next block)."""


class _OverTime(AdvisorError):
    """The job ran past the wall-clock budget of one analysis (ADVISOR_ANALYZE_TIMEOUT_S)."""


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


def _stopper(cancel: threading.Event | None, timeout_s: float):
    """A check that raises once the user cancels or the analysis runs past ``timeout_s``: the loaders
    call it before each block they read, and each stage starts with it."""
    deadline = time.monotonic() + timeout_s

    def check() -> None:
        if cancel is not None and cancel.is_set():
            raise _Cancelled("cancelled by the user")
        if time.monotonic() > deadline:
            raise _OverTime(
                f"The analysis ran past its budget of {timeout_s:g} s (ADVISOR_ANALYZE_TIMEOUT_S on the server) "
                "and was stopped; analyze a shorter trace here, or the whole one with `python -m advisor analyze`."
            )

    return check


def _load(path: str, upload: str | None, limits: common.TraceLimits, check):
    """The upload's (or run's) event table within ``limits``; its errors without server paths."""
    try:
        return load_trace(path, max_bytes=limits.max_bytes, max_event_bytes=limits.max_event_bytes, check=check)
    except (_Cancelled, _OverTime):
        raise
    except AdvisorError as err:
        common.discard_upload(upload)  # refused: it would otherwise stay in the upload cache
        raise TraceError(common.without_server_paths(str(err), upload)) from None


def _views(result: Analysis, label: str, source: str = ""):
    report, roofline, t = result.report, result.roofline, result.report.tables
    gpu = not t["temporal_breakdown"].empty
    summary = (source and f"{source}\n\n") + code_block(format_report(report, label))
    summary += f"\n\n{result.roofline_note}" if result.roofline_note else ""
    return (
        summary,
        temporal_figure(t["temporal_breakdown"]) if gpu else None,
        category_figure(t["kernel_categories"]) if gpu else None,
        common.timeline_figure_of(result.timeline),
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
def analyze_view(
    upload: str | None,
    run_id: str | None,
    on_stage=None,
    cancel: threading.Event | None = None,
    worker: str = isolated.WORKER,
):
    """Analyze tab: (summary, temporal figure, category figure, step-timeline figure, top table,
    details table, collectives table, roofline figure, roofline table, the "All analyses" picker, every
    table (its state), the picked table) of an uploaded trace, or else of a stored run's trace; outputs
    added later come last. The load and the analyses run in a child process (advisor.run.analysis_child):
    ``on_stage(done, total, message)`` hears of each stage; a set ``cancel``, or the wall-clock budget
    (common.trace_limits), kills the child wherever it is and returns at once. ``worker`` names the
    child's function (tests)."""
    if not (upload or run_id):
        hint = "Upload a trace (Kineto .json / .json.gz, a .zip of rank files, or an nsys .sqlite) or pick a run."
        return (hint, *no_analysis())
    if upload and not os.path.exists(upload):
        # A refused upload is discarded at once (the upload cache), while the file box may still show it:
        # "no file or folder" replaced the reason the user had just read (a browser review).
        raise AdvisorError(
            f"{os.path.basename(upload)} was refused when it was uploaded (the reason was shown then) and is gone: "
            "upload another trace, or clear the box and pick a stored run"
        )
    path, label = (upload, os.path.basename(upload)) if upload else (str(common.store().path(run_id)), run_id)
    source = f"Analysed: the {'uploaded file' if upload else 'stored run'} {inline_code(label)}"
    limits = common.trace_limits()
    check = _stopper(cancel, limits.timeout_s)

    def stage(done: int, message: str) -> None:
        if on_stage is not None:
            on_stage(done, STAGES, message)
        check()  # a Cancel set while the stage was reported stops the child before it goes on

    request = {"path": path, "label": label, "max_bytes": limits.max_bytes, "max_event_bytes": limits.max_event_bytes}
    try:
        result = isolated.run_isolated(request, check=check, on_stage=stage, worker=worker)
    except _Cancelled:
        return ("### Analysis cancelled", *no_analysis())
    except isolated.StageError as err:
        if err.stage == 0:
            common.discard_upload(upload)  # refused: it would otherwise stay in the upload cache
        raise AdvisorError(common.without_server_paths(str(err), upload)) from None
    return _views(result, label, source)


PERFETTO = "https://ui.perfetto.dev"
# Opens Perfetto in a new tab on the click itself (a popup opened later, after the server's answer, is
# blocked), keeps the handle for PERFETTO_POST_JS, and passes the inputs on unchanged.
PERFETTO_OPEN_JS = f"""(upload, run) => {{
  window.__advisorPerfetto = window.open("{PERFETTO}/", "_blank");
  return [upload, run];
}}"""
# Perfetto's documented handshake: PING until the UI answers PONG, then post the trace's bytes.
PERFETTO_POST_JS = f"""async (file) => {{
  const win = window.__advisorPerfetto;
  if (!file || !file.url || !win) {{ if (win) win.close(); return; }}
  const buffer = await (await fetch(file.url)).arrayBuffer();
  const ping = setInterval(() => win.postMessage("PING", "{PERFETTO}"), 100);
  const onPong = (event) => {{
    if (event.data !== "PONG") return;
    clearInterval(ping);
    window.removeEventListener("message", onPong);
    win.postMessage({{perfetto: {{buffer: buffer, title: file.orig_name || "trace", fileName: file.orig_name}}}}, "{PERFETTO}");
  }};
  window.addEventListener("message", onPong);
}}"""


def _is_single_kineto_file(path: str) -> bool:
    return os.path.isfile(path) and path.endswith((".json", ".json.gz")) and not os.path.isdir(path)


PERFETTO_OPENED = (
    f"Opening in a new tab of [{PERFETTO.removeprefix('https://')}]({PERFETTO}) (allow pop-ups for this page); "
    "or download the file below and use Perfetto's *Open trace file*."
)


@guarded("Cannot open this trace in Perfetto", "The export", lambda: (None,))
def perfetto_file(upload: str | None, run_id: str | None) -> tuple[str, str | None]:
    """(message, the trace to open in Perfetto): an uploaded Kineto file as it is (with every arg it
    records), anything else (an nsys export, a zip or folder of ranks, a stored run) as one Chrome
    trace written from its event table (advisor.trace.export)."""
    if not (upload or run_id):
        return "Upload a trace or pick a run first.", None
    if upload and _is_single_kineto_file(upload):
        return PERFETTO_OPENED, upload
    path = upload if upload else str(common.store().path(run_id))
    name = os.path.basename(path.rstrip("/")).split(".")[0] or "trace"
    out = os.path.join(tempfile.mkdtemp(prefix="perfetto-", dir=common.download_root()), f"{name}.perfetto.json.gz")
    limits = common.trace_limits()
    return PERFETTO_OPENED, str(write_chrome_trace(_load(path, upload, limits, _stopper(None, limits.timeout_s)), out))


def analyze_job(upload: str | None, run_id: str | None, request: gr.Request | None = None):
    """The Analyze tab's action: analyze_view in the background, its stages shown as they pass, and
    cancellable (Cancel kills the analysis process wherever it is)."""
    result = yield from common.in_background(
        "analyze",
        request,
        lambda on_stage, cancel: analyze_view(upload, run_id, on_stage, cancel),
        lambda done, total, message: (
            f"### Analyzing: {message} ({done} of {total} stages done)",
            *no_analysis(),  # the last analysis's figures and tables go: they are not of this input
        ),
    )
    yield result if isinstance(result, tuple) else (f"### Cannot analyze this trace\n{result}", *no_analysis())


def cancel_analysis(request: gr.Request | None = None) -> str:
    return common.cancel_message(
        "analyze",
        request,
        "### Cancelling: the analysis process is being stopped…",
        "No analysis of yours is running here to cancel.",
    )


ANALYZE_CONCURRENCY = 2
"""Analyses the server runs at once (the others queue): a load's peak memory is about 1x to 1.3x its
decompressed events (bench/results/analyze_speed.md), so two at the default 4 GiB budget stay near
10 GiB on a 24 GiB machine, where the app's 16 concurrent requests could have asked for 64 GiB."""
ANALYZE_LIMIT = {"concurrency_limit": ANALYZE_CONCURRENCY, "concurrency_id": "analyze"}
"""Every event that loads a trace (Analyze, an upload, Open in Perfetto) shares the one limit."""


def _inputs():
    upload = gr.File(label=TRACE_LABEL, file_types=TRACE_TYPES, type="filepath", elem_id="analyze-upload")
    runs = run_dropdown("…or a stored run", elem_id="analyze-run-choice")
    with gr.Row():
        button = gr.Button("Analyze", variant="primary", elem_id="analyze-run")
        cancel = gr.Button("Cancel")
    return upload, runs, button, cancel


def _perfetto(upload, runs) -> None:
    """The "Open in Perfetto" button: the trace (converted where Perfetto cannot read it) in a new tab
    of ui.perfetto.dev, and offered for download."""
    button = gr.Button("Open in Perfetto", elem_id="analyze-perfetto")
    message = gr.Markdown(elem_id="analyze-perfetto-msg")
    file = gr.File(label="Trace for Perfetto (Chrome trace JSON)", interactive=False, elem_id="analyze-perfetto-file")
    button.click(
        perfetto_file, [upload, runs], [message, file], js=PERFETTO_OPEN_JS, api_name="perfetto", **ANALYZE_LIMIT
    ).then(None, file, None, js=PERFETTO_POST_JS)


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
            _perfetto(upload, runs)
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
    button.click(analyze_job, [upload, runs], outputs, api_name="analyze", **ANALYZE_LIMIT)
    # A stored run picked replaces a leftover upload: the upload would otherwise win silently.
    runs.input(lambda run: None if run else gr.skip(), runs, upload, api_visibility="undocumented")
    upload.upload(analyze_job, [upload, runs], outputs, api_visibility="undocumented", **ANALYZE_LIMIT)
    cancel.click(cancel_analysis, None, summary, queue=False, api_visibility="undocumented")
    return runs
