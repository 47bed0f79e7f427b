"""The review report: one self-contained HTML page of a setup, its estimate and plan, a measured run,
its analysis, the advice on it and its verification, to read at a review without the app.

Self-contained: plotly's JavaScript is inlined once in the page's head and every figure draws from it,
so the file opens with no network (no CDN). Markdown is rendered with raw HTML off, so a file name or
a run's message cannot inject markup.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from datetime import datetime, timezone

import pandas as pd
import plotly.graph_objects as go
from markdown_it import MarkdownIt
from plotly.offline import get_plotlyjs

from advisor.advice.advise import advice_markdown
from advisor.analysis.summary import format_report
from advisor.present.charts import (
    category_figure,
    memory_figure,
    phase_figure,
    plan_scatter_figure,
    temporal_figure,
    time_figure,
)
from advisor.present.glossary import GLOSSARY
from advisor.present.report import verdict
from advisor.present.views import (
    advice_summary,
    advice_table,
    analysis_top_table,
    memory_table,
    plan_summary,
    plan_table,
    run_summary,
    size_summary,
    time_table,
)

STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #1f2328; }
h1 { border-bottom: 2px solid #d0d7de; padding-bottom: .3em; }
h2 { border-bottom: 1px solid #d0d7de; padding-bottom: .2em; margin-top: 2em; }
table { border-collapse: collapse; margin: .8em 0; font-size: 0.9em; display: block; overflow-x: auto; }
th, td { border: 1px solid #d0d7de; padding: .25em .6em; text-align: left; white-space: nowrap; }
th { background: #f6f8fa; }
h3 { font-size: 1.3em; } h4 { font-size: 1.15em; } h5 { font-size: 1.05em; }
section.verdict { border-left: 6px solid var(--verdict); padding-left: .8em; }
section.verdict h5:first-of-type { color: var(--verdict); }
pre { background: #f6f8fa; padding: .8em; overflow-x: auto; font-size: 0.85em; }
.caption { font-weight: 600; margin-top: 1.2em; }
.missing { color: #656d76; font-style: italic; }
nav a { margin-right: 1em; }
"""
_MARKDOWN = MarkdownIt("commonmark", {"html": False}).enable("table")
_SMALL = re.compile(r"</?small>")  # the app's small print: plain text here (raw HTML is off)
_HEADING = re.compile(r"<(/?)h([1-6])>")


def _demoted(match: re.Match) -> str:
    """A heading of a section's Markdown two levels down: under the section's own h2."""
    return f"<{match[1]}h{min(int(match[2]) + 2, 6)}>"


@dataclass(frozen=True)
class Section:
    """One part of the report: a title, Markdown, captioned tables and plotly figures (in that order)."""

    title: str
    markdown: str = ""
    tables: tuple[tuple[str, pd.DataFrame], ...] = ()
    figures: tuple[go.Figure, ...] = ()
    missing: str = ""
    """Why this part is absent from the review (shown instead of the rest), or empty."""
    colour: str = ""
    """A colour for the section's bar and first heading (the verdict's), or empty."""


def _anchor(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def _section_html(section: Section) -> str:
    parts = [f'<h2 id="{_anchor(section.title)}">{html.escape(section.title)}</h2>']
    if section.missing:
        return parts[0] + f'<p class="missing">{html.escape(section.missing)}</p>'
    if section.markdown:
        parts.append(_HEADING.sub(_demoted, _MARKDOWN.render(_SMALL.sub("", section.markdown))))
    for caption, table in section.tables:
        parts.append(f'<div class="caption">{html.escape(caption)}</div>')
        parts.append(table.to_html(index=False, border=0, na_rep="", escape=True))
    for figure in section.figures:
        parts.append(figure.to_html(full_html=False, include_plotlyjs=False, config={"displaylogo": False}))
    if section.colour:
        return f'<section class="verdict" style="--verdict: {section.colour}">' + "\n".join(parts) + "</section>"
    return "\n".join(parts)


def html_report(title: str, sections: list[Section], generated: datetime | None = None) -> str:
    """The whole report as one HTML string: the title, a contents line, then each section; plotly's
    JavaScript inlined once in the head (about 4.7 MB), every figure drawn by it."""
    when = (generated or datetime.now(timezone.utc)).strftime("%Y-%m-%d %H:%M UTC")
    nav = " ".join(f'<a href="#{_anchor(s.title)}">{html.escape(s.title)}</a>' for s in sections)
    body = "\n".join(_section_html(s) for s in sections)
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{STYLE}</style><script>{get_plotlyjs()}</script></head>\n<body>"
        f"<h1>{html.escape(title)}</h1><p>Generated {when} by the LLM training advisor.</p>"
        f"<nav>{nav}</nav>\n{body}\n</body></html>\n"
    )


def review_sections(
    estimate,
    plan=None,
    run=None,
    analysis=None,
    advice=None,
    verification: tuple[str, list[tuple[str, pd.DataFrame]]] | None = None,
    setup_note: str = "",
) -> list[Section]:
    """The report's sections in review order: the setup and its estimate (``advisor.estimate``), the
    planner's layouts for the same job (a PlanResult), the measured run (a ``RunInfo`` of the store),
    the trace's analysis (a TraceReport), the advice (an Advice) and its verification (the re-run's
    message and tables as the Advice tab shows them), then the glossary. A part that is None says why
    it is absent. ``setup_note`` heads the setup's section (where the measured part is another job)."""
    sections = [
        Section(
            "Setup and estimate",
            (f"**{setup_note}**\n\n" if setup_note else "") + size_summary(estimate),
            (("Memory per GPU", memory_table(estimate)), ("Step time", time_table(estimate))),
            (memory_figure(estimate), time_figure(estimate)),
            colour=verdict_colour(estimate),
        )
    ]
    if plan is None:
        sections.append(Section("Plan", missing="No plan: the planner was not run for this setup."))
    else:
        figures = (plan_scatter_figure(plan),) if plan.points else ()
        sections.append(Section("Plan", plan_summary(plan), (("Best layouts", plan_table(plan)),), figures))
    sections.append(_run_section(run))
    sections.append(_analysis_section(analysis))
    if advice is None:
        sections.append(Section("Advice", missing="No advice: press Advise first."))
    else:
        table = (("Recommendations", advice_table(advice)),)
        sections.append(Section("Advice", f"{advice_summary(advice)}\n\n{advice_markdown(advice)}", table))
    if verification is None:
        sections.append(Section("Verification", missing="No verification: no recommendation was re-run."))
    else:
        sections.append(Section("Verification", verification[0], tuple(verification[1])))
    terms = "\n".join(f"- **{term}**: {meaning}" for term, meaning in GLOSSARY.items())
    return [*sections, Section("Glossary", terms)]


VERDICT_COLOURS = {"DOES NOT FIT": "#cf222e", "TIGHT": "#9a6700", "FITS": "#1a7f37"}
"""The verdict's colour by its first word, in the app and the report: red, amber, green."""


def verdict_colour(estimate) -> str:
    """The colour of an estimate's verdict (VERDICT_COLOURS)."""
    text = verdict(estimate)
    return next(c for word, c in VERDICT_COLOURS.items() if text.startswith(word))


def _run_section(run) -> Section:
    if run is None:
        return Section("Measured run", missing="No measured run: the advice is on an estimate or an uploaded trace.")
    metrics = run.metrics()
    if metrics is None:
        return Section("Measured run", f"Run `{run.run_id}`: {run.record.get('status')}, no metrics.")
    return Section("Measured run", run_summary(run.run_id, run.record, metrics), figures=(phase_figure(metrics),))


def _analysis_section(report) -> Section:
    if report is None:
        return Section("Analysis", missing="No trace analysed: the advice is on the Size tab's estimate.")
    t = report.tables
    gpu = not t["temporal_breakdown"].empty
    figures = (temporal_figure(t["temporal_breakdown"]), category_figure(t["kernel_categories"])) if gpu else ()
    text = f"```\n{format_report(report, report.metrics.run_id)}\n```"
    return Section("Analysis", text, (("Top kernels / ops", analysis_top_table(report)),), figures)
