"""The review report (advisor.present.html_report): one self-contained HTML page, every part of a review
in order, plotly inlined once, and Markdown rendered without raw HTML."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from plotly.offline import get_plotlyjs

from advisor.advice.advise import advise_run
from advisor.analysis.summary import analyze_path
from advisor.estimate.estimator import estimate
from advisor.estimate.planner import PlanRequest, plan
from advisor.present.html_report import Section, html_report, review_sections
from advisor.spec.defaults import DEFAULTS
from advisor.spec.setup import make_setup
from advisor.store.runstore import RunStore
from tests.sample_cpu import pin_sample_cpu

TRACES = Path(__file__).resolve().parents[1] / "traces"
FP32_RUN = "20261130-165248-tiny-6bcb2f"  # a shipped sample run, profiled in fp32


@pytest.fixture(scope="module")
def default_estimate():
    return estimate(make_setup(**DEFAULTS))


def test_a_whole_review_in_one_page(default_estimate, monkeypatch):
    pin_sample_cpu(monkeypatch)
    store = RunStore(TRACES)
    run = store.load(FP32_RUN)
    setup = default_estimate.setup
    layouts = plan(PlanRequest(setup.model, setup.hardware, setup.gpus, setup.train.seq_len, 64))
    analysis = analyze_path(str(run.path), FP32_RUN)
    advice = advise_run(FP32_RUN, store)
    verification = ("### Re-ran with `train.precision = bf16`", [("Predicted vs measured", pd.DataFrame({"x": [1]}))])
    sections = review_sections(default_estimate, layouts, run, analysis, advice, verification)
    assert [s.title for s in sections] == [
        "Setup and estimate",
        "Plan",
        "Measured run",
        "Analysis",
        "Advice",
        "Verification",
        "Glossary",
    ]
    assert not any(s.missing for s in sections)
    page = html_report("Training review", sections)
    # Plotly's JavaScript once, in the page; around it, no script or stylesheet fetched from anywhere.
    assert page.count(get_plotlyjs()) == 1
    rest = page.replace(get_plotlyjs(), "")
    assert "<script src" not in rest and "cdn.plot.ly" not in rest and "<link" not in rest
    # Memory and step-time bars, the plan's scatter, the run's phases (a CPU trace: no GPU figures).
    assert page.count('class="plotly-graph-div"') == 4
    # The numbers the app shows (tests/test_browser.py): the default's verdict, the sample run's step.
    assert "FITS: 99.9 GiB of 140.4 GiB per GPU" in page
    assert '<section class="verdict" style="--verdict: #1a7f37">' in page  # FITS, in green
    assert "65.1 ms per step" in page
    assert "prec-fp32-to-bf16" in page and "Re-ran with <code>train.precision = bf16</code>" in page
    # The advice's own headings sit under the section's h2.
    assert "<h1>" not in page.split("</h1>", 1)[1]
    assert "<strong>Bubble</strong>: Pipeline bubble" in page


def test_absent_parts_say_why(default_estimate):
    sections = review_sections(default_estimate)
    missing = {s.title: s.missing for s in sections if s.missing}
    assert list(missing) == ["Plan", "Measured run", "Analysis", "Advice", "Verification"]
    page = html_report("Review", sections)
    assert "No advice: press Advise first." in page
    assert page.count('class="plotly-graph-div"') == 2


def test_markdown_cannot_inject_markup():
    page = html_report("a <b>title</b>", [Section("<i>x</i>", "<script>alert(1)</script> and <small>note</small>")])
    body = page.split("</head>", 1)[1]
    assert "<script>alert(1)</script>" not in body and "&lt;script&gt;alert(1)&lt;/script&gt;" in body
    assert "a &lt;b&gt;title&lt;/b&gt;" in body and "&lt;i&gt;x&lt;/i&gt;" in body
    assert "and note" in body  # the app's small print is plain text here
