"""The review report's download: the current setup, its estimate and plan, the advice in hand, the
run or trace it is on (measured and analysed) and the last re-run, as one self-contained HTML file."""

from __future__ import annotations

import os
import tempfile

import pandas as pd

from advisor.analysis.summary import analyze_path
from advisor.estimate.estimator import estimate
from advisor.estimate.planner import PlanRequest, plan
from advisor.present.html_report import html_report, review_sections
from advisor.store.ceilings import run_ceilings
from webui import common
from webui.common import guarded
from webui.size import setup_from_size_inputs

REPORT_NAME = "advisor-report.html"


def setup_plan(setup):
    """The planner's best layouts for the setup's job: its model, device, GPU count, sequence and
    global batch, at its precision."""
    req = PlanRequest(
        model=setup.model,
        hardware=setup.hardware,
        gpus=setup.gpus,
        seq_len=setup.train.seq_len,
        global_batch=setup.global_batch,
        precisions=(setup.train.precision,),
    )
    return plan(req)


def measured(source: str, run_id: str | None, upload: str | None):
    """(the stored run, the trace's analysis) the advice is on: a stored run and its trace, an uploaded
    trace alone, or (None, None) for the Size tab's setup."""
    if source == "stored run" and run_id:
        run = common.store().load(run_id)
        return run, analyze_path(str(run.path), run_id, ceilings=run_ceilings(str(run.path)))
    if source == "uploaded trace" and upload:
        name = os.path.basename(upload)
        return None, analyze_path(upload, name, ceilings=run_ceilings(upload))
    return None, None


def verification_part(message: str | None, *tables: pd.DataFrame):
    """The last re-run as the Advice tab shows it (its message and non-empty tables), or None."""
    if not message or not message.startswith("### Re-ran"):
        return None
    captions = ("Predicted vs measured", "Where the step time changed", "Kernels and ops that changed most")
    return message, [(c, t) for c, t in zip(captions, tables, strict=False) if t is not None and len(t)]


def _subject(setup, run, analysis) -> tuple[str, str]:
    """The report's title and the note heading its setup: where the measured part is another job than
    the Size tab's setup (a stored run of another model or device, an uploaded trace), both say so."""
    title = f"Training review: {setup.model.name} on {setup.gpus} x {setup.hardware.name}"
    if run is not None and isinstance(run.record.get("setup"), dict):
        ran = run.record["setup"]
        model, device = (ran.get("model") or {}).get("name", "?"), (ran.get("hardware") or {}).get("name", "?")
        if (model, device) == (setup.model.name, setup.hardware.name):
            return title, ""
        return f"{title}, and run {run.run_id} ({model} on {device})", (
            f"The setup and plan below are the Size tab's ({setup.model.name} on {setup.gpus} x "
            f"{setup.hardware.name}); the measured run, its analysis and the advice are run {run.run_id}'s, "
            f"another job ({model} on {device})."
        )
    if analysis is not None:
        return f"{title}, and trace {analysis.metrics.run_id}", (
            f"The setup and plan below are the Size tab's; the analysis and the advice are the uploaded trace's "
            f"({analysis.metrics.run_id}), which records no setup."
        )
    return title, ""


@guarded("Cannot make the report", "The report", lambda: (None,))
def report_view(advice, source, run_id, upload, verify_msg, verify_table, diff_categories, diff_changes, *size_inputs):
    """Advice tab: (message, the report file) of the Size tab's setup and the advice in hand."""
    setup = setup_from_size_inputs(*size_inputs)
    run, analysis = measured(source, run_id, upload) if advice is not None else (None, None)
    verification = verification_part(verify_msg, verify_table, diff_categories, diff_changes)
    title, note = _subject(setup, run, analysis)
    sections = review_sections(estimate(setup), setup_plan(setup), run, analysis, advice, verification, setup_note=note)
    page = html_report(title, sections)
    path = os.path.join(tempfile.mkdtemp(prefix="report-", dir=common.download_root()), REPORT_NAME)
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    present = [s.title for s in sections if not s.missing]
    return f"Report of {len(page) / 1e6:.1f} MB: {', '.join(present)}. It opens without the app or a network.", path


def wire_report(advice: dict, size_inputs: list) -> None:
    """The Advice tab's "HTML report" button."""
    inputs = [advice[k] for k in ("state", "source", "runs", "upload", "verify_msg", "verify_table")]
    inputs += [advice["diff_categories"], advice["diff_changes"], *size_inputs]
    outputs = [advice["report_msg"], advice["report_file"]]
    advice["report_button"].click(report_view, inputs, outputs, api_name="report")
