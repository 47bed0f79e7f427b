"""The Advice tab: ranked recommendations for a stored run, an uploaded trace or the Size tab's setup,
each with its predicted gain; Apply loads one into every tab, Verify re-runs a stored run with it."""

from __future__ import annotations

import os
import tempfile
from dataclasses import replace

import gradio as gr
import pandas as pd

from advisor.advice.advise import advice_markdown, advise, advise_run, advise_trace
from advisor.advice.verify import MAX_PAIRS, verification_diff, verify
from advisor.errors import AdvisorError, shown_value
from advisor.present.views import (
    ADVICE_COLUMNS,
    DIFF_CATEGORY_COLUMNS,
    DIFF_CHANGE_COLUMNS,
    VERIFY_COLUMNS,
    advice_summary,
    advice_table,
    applied_message,
    apply_label,
    diff_category_table,
    diff_changes_table,
    verify_message,
    verify_table,
)
from advisor.spec.query import query_text
from webui import common
from webui.common import TRACE_LABEL, TRACE_TYPES, guarded, run_dropdown
from webui.profile import profile_values
from webui.size import setup_from_size_inputs, size_values

SOURCES = ["stored run", "uploaded trace", "Size tab setup"]


def _report_files(advice) -> list[str]:
    """The advice as advice.md and advice.json in a fresh folder under common.download_root."""
    out_dir = tempfile.mkdtemp(prefix="advice-", dir=common.download_root())
    paths = [os.path.join(out_dir, "advice.md"), os.path.join(out_dir, "advice.json")]
    for path, text in zip(paths, (advice_markdown(advice), advice.to_json()), strict=True):
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return paths


def no_advice():
    return pd.DataFrame(columns=ADVICE_COLUMNS), "", None, None


@guarded("Cannot advise", "The advice", no_advice)
def advice_view(source: str, run_id: str | None, upload: str | None, *size_inputs):
    """Advice tab: (summary, ranked table, full report markdown, report files, Advice) for a stored
    run, an uploaded trace, or the setup on the Size tab. The Advice goes to a session State (which
    the API does not return), for Apply."""
    if source not in SOURCES:
        raise AdvisorError(f"source={shown_value(source, 60)}: must be one of {', '.join(SOURCES)}")
    if source == "stored run" and not run_id:
        return ("Pick a stored run (profile one on the Profile tab).", *no_advice())
    if source == "uploaded trace" and not upload:
        return ("Upload a trace (Kineto JSON / gzip / zip of ranks, or nsys SQLite).", *no_advice())
    if source == "stored run":
        advice = advise_run(run_id, common.store())
    elif source == "uploaded trace":
        # Named by the file's name: the server's temporary path meant nothing to the user.
        try:
            advised = advise_trace(upload)
        except AdvisorError:
            common.discard_upload(upload)  # refused: it would otherwise stay in the upload cache
            raise
        advice = replace(advised, source=f"the uploaded file {os.path.basename(upload)}")
    else:
        advice = advise(setup=setup_from_size_inputs(*size_inputs), source="the Size tab's setup")
    return advice_summary(advice), advice_table(advice), advice_markdown(advice), _report_files(advice), advice


def apply_choices(advice) -> gr.Dropdown:
    """The last advice's recommendations that change the setup, the first one selected."""
    labels = []
    if advice is not None:
        labels = [apply_label(i, r) for i, r in enumerate(advice.recommendations, 1) if r.after is not None]
    return gr.Dropdown(choices=labels, value=labels[0] if labels else None)


def stale_fields(advice, source: str, current: dict) -> list[str]:
    """The Size tab's fields (``current``: widget values by key) that differ from the setup ``advice``
    was made on, where that advice is of the Size tab's setup: applying it would put the whole old
    setup back, not only its change (a layout used from the Plan tab silently undone). Empty for
    advice on a stored run or a trace, whose setup Apply loads on purpose."""
    if source != "Size tab setup" or advice is None or advice.setup is None:
        return []
    then = size_values(advice.setup)
    return [k for k, v in then.items() if k in current and query_text(current[k]) != query_text(v)]


def apply_recommendation(advice, choice: str | None, source: str):
    """(message, Size tab values, Profile tab values, rule id) that load a recommendation's change into
    the shared spec. Values are keyed like the tabs' widgets; empty dicts change nothing. Only a
    stored run can be re-run with the rule: its id goes to the re-run box, else None clears it (a rule
    of the Size tab's setup left there failed the next run's re-run: "did not fire")."""
    if advice is None:
        return "Press **Advise** first.", {}, {}, None
    picked = [r for i, r in enumerate(advice.recommendations, 1) if apply_label(i, r) == choice]
    if not picked:
        return "Pick a recommendation to apply (one that changes the setup).", {}, {}, None
    rec = picked[0]
    if rec.after is None:
        return f"`{rec.rule.id}` has no change to apply here: {rec.action_note or 'advice only'}", {}, {}, None
    stored = source == "stored run"
    profile = profile_values(rec.after, rec.options_after if stored else None)
    return applied_message(rec, source), size_values(rec.after), profile, rec.rule.id if stored else None


def _empty_verify():
    return tuple(pd.DataFrame(columns=c) for c in (VERIFY_COLUMNS, DIFF_CATEGORY_COLUMNS, DIFF_CHANGE_COLUMNS))


@guarded("Cannot verify", "The re-run", _empty_verify)
def verify_view(run_id: str | None, rule_id: str | None, pairs=1, progress=gr.Progress()):  # noqa: B008 (Gradio injects it)
    """Re-run a stored run with a recommendation applied (``pairs`` times each side, alternating):
    (message, predicted vs measured table, the trace diff of the first before and after runs:
    step-time categories, top changed kernels and ops)."""
    if not run_id:
        return "Verification re-runs a stored run: pick one first.", *_empty_verify()
    rule_id = (rule_id or "").strip() or None
    if pairs is None:
        pairs = 1
    if isinstance(pairs, float) and pairs.is_integer():
        pairs = int(pairs)  # a slider's value arrives as a float
    store = common.store()
    progress(0, desc=f"Re-running {run_id}: starting the child process (its steps follow once torch is loaded)")
    v = verify(run_id, rule_id, store, on_progress=lambda d, t, m: progress((d, t), desc=m), pairs=pairs)
    diff, note = verification_diff(v, store)
    tables = (diff_category_table(diff), diff_changes_table(diff)) if diff is not None else _empty_verify()[1:]
    return verify_message(v, diff, note), verify_table(v), *tables


AFTER_ADVICE = ("rule", "apply_msg", "verify_msg", "verify_table", "diff_categories", "diff_changes")
"""What a new advice makes stale: the rule carried to the re-run box, the last Apply's message and the
last re-run's results (all of an earlier advice's recommendation)."""


def cleared_after_advice():
    """AFTER_ADVICE's widgets emptied."""
    return "", "", "", *_empty_verify()


def _inputs() -> dict:
    w = {"source": gr.Radio(SOURCES, value="Size tab setup", label="Advise on", elem_id="advice-source")}
    w["runs"] = run_dropdown("Stored run", elem_id="advice-run-choice")
    w["upload"] = gr.File(label=TRACE_LABEL, file_types=TRACE_TYPES, type="filepath")
    w["button"] = gr.Button("Advise", variant="primary", elem_id="advice-run")
    gr.Markdown("#### Apply a recommendation")
    w["apply_choice"] = gr.Dropdown(choices=[], label="Recommendation", elem_id="advice-apply-choice")
    with gr.Row():
        w["apply"] = gr.Button("Apply to the current setup", elem_id="advice-apply")
        w["undo"] = gr.Button("Undo Apply", elem_id="advice-undo")
    gr.Markdown("#### Verify by re-running (stored runs)")
    w["rule"] = gr.Textbox(label="Rule id (empty: the top one that can re-run here)", max_lines=1)
    w["pairs"] = gr.Slider(
        1,
        MAX_PAIRS,
        value=1,
        step=1,
        label="Pairs: re-run as it was and with the change this many times each, alternating "
        "(more tells a small change from the machine's run-to-run noise; each pair is two runs)",
        elem_id="advice-pairs",
    )
    w["verify"] = gr.Button("Re-run with the recommendation applied", elem_id="advice-verify")
    return w


def _outputs() -> dict:
    w = {"summary": gr.Markdown("Pick what to advise on and press Advise.", elem_id="advice-summary")}
    w["table"] = gr.Dataframe(pd.DataFrame(columns=ADVICE_COLUMNS), label="Recommendations", interactive=False)
    w["apply_msg"] = gr.Markdown(elem_id="advice-apply-result")
    w["verify_msg"] = gr.Markdown(elem_id="advice-verify-result")
    w["verify_table"] = gr.Dataframe(
        pd.DataFrame(columns=VERIFY_COLUMNS), label="Predicted vs measured", interactive=False
    )
    w["diff_categories"] = gr.Dataframe(
        pd.DataFrame(columns=DIFF_CATEGORY_COLUMNS),
        label="Before vs after, per step: where the step time changed (rows sum to the step)",
        interactive=False,
    )
    w["diff_changes"] = gr.Dataframe(
        pd.DataFrame(columns=DIFF_CHANGE_COLUMNS),
        label="Before vs after, per step: kernels and ops that changed most",
        interactive=False,
    )
    w["files"] = gr.File(label="Report (Markdown, JSON)", file_count="multiple", interactive=False)
    w["report_button"] = gr.Button("HTML report for a review (setup to verification)", elem_id="advice-report")
    w["report_msg"] = gr.Markdown(elem_id="advice-report-msg")
    w["report_file"] = gr.File(
        label="Review report (HTML, plots inside)", interactive=False, elem_id="advice-report-file"
    )
    with gr.Accordion("Full report", open=False):
        w["report"] = gr.Markdown()
    return w


def build_advice_tab(size_inputs: list) -> dict:
    """The Advice tab; returns its parts by name for the app to wire across tabs."""
    with gr.Row():
        with gr.Column(scale=1, min_width=300):
            parts = _inputs()
        with gr.Column(scale=2):
            parts |= _outputs()
    parts["state"] = gr.State(None)
    parts["undo_state"] = gr.State(None)  # the widgets' values before the last Apply
    parts["advise_inputs"] = [parts["source"], parts["runs"], parts["upload"], *size_inputs]
    parts["outputs"] = [parts[k] for k in ("summary", "table", "report", "files", "state")]
    # Cleared first, in the browser's own turn: an Apply pressed as the new advice shows must not be
    # cleared after it.
    quiet = {"api_visibility": "undocumented", "queue": False, "show_progress": "hidden"}
    parts["button"].click(cleared_after_advice, None, [parts[k] for k in AFTER_ADVICE], **quiet).then(
        advice_view, parts["advise_inputs"], parts["outputs"], api_name="advise"
    ).then(apply_choices, parts["state"], parts["apply_choice"], api_visibility="undocumented")
    parts["verify"].click(
        verify_view,
        [parts["runs"], parts["rule"], parts["pairs"]],
        [parts[k] for k in ("verify_msg", "verify_table", "diff_categories", "diff_changes")],
        api_name="verify",
        concurrency_limit=1,
        concurrency_id="device",
    ).then(  # the advice again, learned from the re-run: its table, summary and report quote the measurement
        advice_view, parts["advise_inputs"], parts["outputs"], api_visibility="undocumented"
    ).then(apply_choices, parts["state"], parts["apply_choice"], api_visibility="undocumented")
    return parts
