"""End to end in a real browser: Debian's chromium driven by Playwright, against the app served on a
free local port with a copy of the shipped sample runs as its store.

Each test is what a user does: size a model and read the verdict, profile a tiny step on the CPU,
upload a real trace, advise + apply + re-run, compare two runs, plan, and recover from bad input.
With ``ADVISOR_SCREENSHOTS=DIR`` set, each tab's finished state is saved as ``DIR/<tab>.jpg`` (the
README's pictures: ``scripts/screenshots.sh``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the torchtitan TOML is read back on 3.11+ only
    tomllib = None

from advisor.present.glossary import UNIT_TIPS
from tests.chromium import CHROMIUM, launch
from tests.sample_cpu import pin_sample_cpu
from tests.shared import SHARED_TRACES

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

REPO = Path(__file__).resolve().parents[1]
TRACES = SHARED_TRACES
V100_TRACE = TRACES / "kineto" / "ns_resolution_trace" / "rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz"
A100_TRACE = TRACES / "kineto" / "trace_filter" / "sampled_rank-0.json.gz"  # recorded with shapes
FP32_RUN = "20261130-165248-tiny-6bcb2f"  # a shipped sample run, profiled in fp32
SAMPLE_TRACE = Path(__file__).resolve().parents[1] / "traces" / FP32_RUN / "trace.json.gz"
SHOTS = os.environ.get("ADVISOR_SCREENSHOTS")

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason=f"needs Debian's chromium at {CHROMIUM} (apt install chromium; .ci/run does)"
)
sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright for Python (requirements-dev.txt)")
expect = sync_api.expect
LONG_MS = 240_000  # a profiled step in a child process on 2 busy cores, with its preflight


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The app on a free port, its store a copy of the shipped runs (the repo's traces/ stays as is),
    judging them on the CPU they were profiled on (``tests.sample_cpu``)."""
    import app

    with pytest.MonkeyPatch.context() as mp:
        pin_sample_cpu(mp)
        yield from _serve(app, tmp_path_factory)


def _serve(app, tmp_path_factory):
    store = tmp_path_factory.mktemp("browser") / "traces"
    shutil.copytree(REPO / "traces", store, ignore=shutil.ignore_patterns(".staging"))
    old = os.environ.get("ADVISOR_TRACES_DIR")
    os.environ["ADVISOR_TRACES_DIR"] = str(store)
    port = _free_port()
    demo = app.build_app().queue(default_concurrency_limit=16)
    demo.launch(
        server_name="127.0.0.1",
        server_port=port,
        prevent_thread_lock=True,
        quiet=True,
        max_file_size=app.MAX_UPLOAD,
        allowed_paths=[str(store)],
        css=app.CSS,
    )
    yield f"http://127.0.0.1:{port}", store
    demo.close()
    if old is None:
        os.environ.pop("ADVISOR_TRACES_DIR", None)
    else:
        os.environ["ADVISOR_TRACES_DIR"] = old


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = launch(p)
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    """A fresh page on the app, opened and showing the default setup's verdict."""
    pg = browser.new_page(viewport={"width": 1280, "height": 1000})  # issue 21: read at 1280 px
    pg.set_default_timeout(30_000)
    pg.goto(server[0], wait_until="load")
    # The first verdict comes with the page's other loads (run lists, a first advice): on 2 busy cores
    # that took up to 5 s, expect's default.
    expect(pg.locator("#size-verdict")).to_contain_text("FITS", timeout=30_000)
    yield pg
    pg.close()


def _tab(page, name: str) -> None:
    page.get_by_role("tab", name=name, exact=True).click()


def _choose(page, css: str, option: str) -> None:
    """Pick ``option`` in the dropdown ``css`` the way a user does: open it, click the option."""
    page.locator(f"{css} input").click()
    page.locator(css).get_by_role("option", name=option, exact=True).click()


def _set_number(page, label: str, value: int) -> None:
    box = page.get_by_label(label, exact=True)
    box.fill(str(value))
    box.press("Enter")
    box.blur()


def _shot(page, name: str, full_page: bool = True) -> None:
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        page.wait_for_timeout(500)  # let plots finish drawing
        page.screenshot(path=str(Path(SHOTS) / f"{name}.jpg"), full_page=full_page, type="jpeg", quality=70)


def test_size_a_model_and_the_other_tabs_follow(page):
    verdict = page.locator("#size-verdict")
    # The default: Llama-3.1-8B on 8 H200s, ZeRO-1, Megatron's fp32 main gradients (the estimator: 99.9
    # GiB of 140.4 GiB), with the step time's error band.
    expect(verdict).to_contain_text("FITS: 99.9 GiB of 140.4 GiB per GPU")
    expect(verdict).to_contain_text(re.compile(r" ms ±\d+ % · "))
    _choose(page, "#size-model", "llama-3.1-70b")
    expect(verdict).to_contain_text("llama-3.1-70b (70.55B params)")
    expect(verdict).to_contain_text("DOES NOT FIT: 698.9 GiB")  # ZeRO-1 and seq 8192 without recompute
    # Full recompute, ZeRO-3 and the optimizer in host memory make it fit (the estimator: 42.0 GiB).
    page.get_by_role("radio", name="full", exact=True).check()
    _choose(page, "#size-zero", "3")
    page.get_by_role("radio", name="optimizer", exact=True).check()
    expect(verdict).to_contain_text("FITS: 42.0 GiB of 140.4 GiB per GPU")
    _shot(page, "size")
    _tab(page, "Plan")
    expect(page.locator("#plan-model input")).to_have_value("llama-3.1-70b")
    page.locator("#plan-run").click()
    expect(page.locator("#plan-summary")).to_contain_text("layouts of")
    _shot(page, "plan")


def _download(page, link) -> str:
    """Click a download link; the downloaded file's text."""
    with page.expect_download() as download:
        link.click()
    return Path(download.value.path()).read_text(encoding="utf-8")


@pytest.mark.skipif(tomllib is None, reason="reads the TOML back with Python 3.11's tomllib")
def test_plan_use_a_layout_then_size_and_export_it(page):
    # Issue 21 item 5: a Plan row becomes the current setup, which the Size tab estimates and exports.
    _tab(page, "Plan")
    page.locator("#plan-run").click()
    expect(page.locator("#plan-summary")).to_contain_text("layouts of")
    second = page.locator('#plan-table [data-testid="cell-1-1"]').inner_text().strip()  # row 2's layout
    dp, tp, pp, cp = map(int, re.match(r"DP(\d+) TP(\d+) PP(\d+)(?:x\dv)? CP(\d+)", second).groups())
    _set_number(page, "Layout rank", 2)
    page.locator("#plan-use").click()
    expect(page.locator("#plan-use-msg")).to_contain_text(f"Layout #2 is the current setup\n{second}")
    _tab(page, "Size")
    verdict = page.locator("#size-verdict")
    expect(verdict).to_contain_text(f"dp{dp} tp{tp} pp{pp}")  # describe_setup of the layout
    _shot(page, "plan-to-size")
    # Export it for torchtitan and for Megatron-LM: the downloaded files carry the layout's degrees.
    _choose(page, "#size-export-to", "torchtitan")
    page.locator("#size-export").click()
    expect(page.locator("#size-export-msg")).to_contain_text("Exported for torchtitan: llama-3.1-8b-torchtitan.toml")
    toml = tomllib.loads(_download(page, page.locator("#size-export-file a").first))
    degrees = ("tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree")
    assert [toml["parallelism"][k] for k in degrees] == [tp, pp, cp]
    assert toml["model"] == {"name": "llama3", "flavor": "8B"} and toml["training"]["global_batch_size"] == 64
    _choose(page, "#size-export-to", "megatron")
    page.locator("#size-export").click()
    expect(page.locator("#size-export-msg")).to_contain_text("Exported for megatron: llama-3.1-8b-megatron.sh")
    script = _download(page, page.locator("#size-export-file a").first)
    assert f"--tensor-model-parallel-size {tp} " in script and "--global-batch-size 64 " in script


def test_bad_input_shows_a_clear_message_and_the_app_keeps_working(page):
    verdict = page.locator("#size-verdict")
    _set_number(page, "Global batch (0 = no accum)", 60)  # 8 GPUs x micro-batch 1 do not divide 60
    expect(verdict).to_contain_text("Invalid setup")
    expect(verdict).to_contain_text("global_batch")
    _set_number(page, "Global batch (0 = no accum)", 64)
    expect(verdict).to_contain_text("FITS: 99.9 GiB")
    # Out of range (issue 21): the spec's message replaces the verdict, none of it is left on screen.
    for label, value, message in (
        ("Sequence length", 0, "train.seq_len=0: must be an integer from 1 to 16777216"),
        ("Sequence length", 1_000_000, "llama-3.1-8b was trained on sequences up to 131,072 tokens"),
        ("GPUs", -5, "gpus=-5"),
    ):
        _set_number(page, label, value)
        expect(verdict).to_contain_text(message)
        expect(verdict).not_to_contain_text("FITS")
        _set_number(page, label, 8192 if label == "Sequence length" else 8)
        expect(verdict).to_contain_text("FITS: 99.9 GiB")
    _tab(page, "Analyze")
    page.locator("#analyze-upload input[type=file]").set_input_files(
        files=[{"name": "broken.json", "mimeType": "application/json", "buffer": b"{not json"}]
    )
    expect(page.locator("#analyze-summary")).to_contain_text("Cannot analyze this trace")
    expect(page.locator("#analyze-summary")).to_contain_text("broken.json")


def test_profile_a_tiny_step_on_the_cpu(page, server):
    _tab(page, "Profile")
    _set_number(page, "Steps", 2)
    summary = page.locator("#profile-summary")
    expect(summary).to_contain_text("Run 2026")  # the tab opens on the newest stored run
    page.locator("#profile-run").click()
    # Progress while the child process works; its first step comes after it has imported torch and
    # built the model: 4-8 s on a 2-core machine.
    expect(summary).to_contain_text("Running: step", timeout=60_000)
    # The shipped runs are seq 128; this one is the tab's default seq 256 x micro-batch 2.
    expect(summary).to_contain_text("tiny: seq 256 x micro 2", timeout=LONG_MS)
    expect(summary).to_contain_text(": ok")
    expect(summary).to_contain_text("ms per step")
    expect(page.locator("#profile-top-ops")).to_contain_text("aten::")  # the top-ops table is filled
    roofline = page.locator("#profile-roofline")  # plotly drew the run's roofline: its points and roofs
    expect(roofline.locator(".js-plotly-plot .scatterlayer .point").first).to_be_visible()
    expect(roofline).to_contain_text("fp32 peak")
    run_id = summary.inner_text().split("Run ")[1].split(":")[0].strip()
    assert run_id not in {p.name for p in (REPO / "traces").iterdir()}
    assert (server[1] / run_id / "trace.json.gz").is_file()  # the new run landed in the store
    _shot(page, "profile")


def test_profile_with_activation_offload_and_partial_recompute_then_a_refusal(page, server):
    _tab(page, "Profile")
    _set_number(page, "Steps", 1)
    page.locator("#profile-recompute").get_by_label("full", exact=True).check()  # full, of 1 block only
    _set_number(page, "Blocks that recompute (full; 0 = all)", 1)
    _set_number(page, "Blocks' activations offloaded to host", 2)
    summary = page.locator("#profile-summary")
    page.locator("#profile-run").click()
    expect(summary).to_contain_text("recompute full", timeout=LONG_MS)
    expect(summary).to_contain_text("Activation offload: 2 blocks")
    expect(summary).to_contain_text("ms not hidden")
    run_id = summary.inner_text().split("Run ")[1].split(":")[0].strip()
    metrics = json.loads((server[1] / run_id / "metrics.json").read_text(encoding="utf-8"))
    assert metrics["offload_activations"] == 2 and metrics["recompute_layers"] == 1
    assert metrics["activation_offload"]["bytes_offloaded"] > 0
    # Unified Memory on this CPU: a run filed as refused, with the reason; the tab keeps working.
    _set_number(page, "Blocks' activations offloaded to host", 0)
    page.locator("#profile-unified-memory input").check()
    page.locator("#profile-run").click()
    expect(summary).to_contain_text(": refused", timeout=60_000)
    expect(summary).to_contain_text("CUDA managed memory")
    _shot(page, "profile-offload")


@pytest.mark.skipif(not V100_TRACE.is_file(), reason="real traces live in ../shared/traces (absent here)")
def test_upload_a_real_trace_and_read_the_breakdown(page):
    _tab(page, "Analyze")
    page.locator("#analyze-upload input[type=file]").set_input_files(str(V100_TRACE))
    summary = page.locator("#analyze-summary")
    expect(summary).to_contain_text("Tesla V100-SXM2-32GB", timeout=60_000)
    # Hand-checked in tests/test_analyze.py: GEMMs are 24.8 % of this trace's kernel time, all FP32 SIMT.
    expect(summary).to_contain_text("gemm 24.8 %")
    expect(page.locator("#analyze-top")).to_contain_text("volta_sgemm_64x64_tn")
    # Recorded without shapes: the roofline shows the V100's roofs and says why it has no points.
    roofline = page.locator("#analyze-roofline")
    expect(roofline.locator(".js-plotly-plot")).to_be_visible()
    expect(roofline).to_contain_text("record_shapes=True")
    # Every table of the analysis one pick away: the idle table first, then launch statistics.
    page.get_by_text("All analyses: every table of the analysis").click()
    table = page.locator("#analyze-table")
    expect(table).to_contain_text("compute_idle_pct")
    _choose(page, "#analyze-table-picker", "launch_stats (1 rows)")
    expect(table).to_contain_text("launch_stats: per rank")
    if A100_TRACE.is_file():  # a trace with shapes: its kernels placed against the A100's roofs
        page.locator("#analyze-upload").get_by_role("button", name="Clear").click()
        page.locator("#analyze-upload input[type=file]").set_input_files(str(A100_TRACE))
        expect(summary).to_contain_text("sampled_rank-0.json.gz", timeout=60_000)
        expect(roofline).to_contain_text("tf32 peak 156 TFLOP/s")
        expect(roofline.locator(".js-plotly-plot .scatterlayer .point").first).to_be_visible()
    _shot(page, "analyze")


def test_a_stored_run_picked_after_an_upload_is_what_is_analysed(page):
    # Issue 21: a leftover upload used to win silently over the run just picked.
    _tab(page, "Analyze")
    page.locator("#analyze-upload input[type=file]").set_input_files(str(SAMPLE_TRACE))
    summary = page.locator("#analyze-summary")
    expect(summary).to_contain_text("Analysed: the uploaded file trace.json.gz", timeout=60_000)
    _choose(page, "#analyze-run-choice", FP32_RUN)
    expect(page.locator("#analyze-upload")).not_to_contain_text("trace.json.gz")  # the upload gave way
    page.locator("#analyze-run").click()
    expect(summary).to_contain_text(f"Analysed: the stored run {FP32_RUN}", timeout=60_000)


NSYS_EXPORT = TRACES / "nsys" / "pipit_cloverleaf_cuda.sqlite"

# A stand-in for the Perfetto tab (no network here): records what the page opens and posts, and answers
# PING with PONG as ui.perfetto.dev does once it is ready.
FAKE_PERFETTO = """() => {
  window.__opened = [];
  window.open = (url) => {
    const fake = {closed: false, close() { this.closed = true; }, postMessage(message, origin) {
      if (message === "PING") {
        window.__pinged = origin;
        window.dispatchEvent(new MessageEvent("message", {data: "PONG"}));
      } else {
        window.__posted = {title: message.perfetto.title, bytes: Array.from(new Uint8Array(message.perfetto.buffer, 0, 2)),
                           length: message.perfetto.buffer.byteLength};
      }
    }};
    window.__opened.push(url);
    return fake;
  };
}"""


@pytest.mark.skipif(not NSYS_EXPORT.is_file(), reason="real traces live in ../shared/traces (absent here)")
def test_open_an_nsys_export_in_perfetto(page):
    _tab(page, "Analyze")
    page.locator("#analyze-upload input[type=file]").set_input_files(str(NSYS_EXPORT))
    expect(page.locator("#analyze-summary")).to_contain_text("pipit_cloverleaf_cuda.sqlite", timeout=60_000)
    page.evaluate(FAKE_PERFETTO)
    page.locator("#analyze-perfetto").click()
    expect(page.locator("#analyze-perfetto-msg")).to_contain_text("Opening in a new tab of ui.perfetto.dev")
    expect(page.locator("#analyze-perfetto-file")).to_contain_text("pipit_cloverleaf_cuda.perfetto.json")
    page.wait_for_function("() => window.__posted !== undefined", timeout=30_000)
    opened, pinged, posted = page.evaluate("() => [window.__opened, window.__pinged, window.__posted]")
    assert opened == ["https://ui.perfetto.dev/"] and pinged == "https://ui.perfetto.dev"
    # The nsys export, converted: a gzip file (magic 1f 8b), all of it posted.
    assert posted["title"] == "pipit_cloverleaf_cuda.perfetto.json.gz" and posted["bytes"] == [0x1F, 0x8B]
    assert posted["length"] > 10_000


def test_advice_a_rerun_refuted_is_demoted(page, server):
    """A failed verification injected into the store: fp32 -> bf16 measured 104.6 % slower side by side
    (the AMX Xeon's re-run of the sample). The advice on the run no longer recommends it and says what
    was measured, when. Runs before the real re-run below, and takes its pair away again."""
    before = 66.7
    pair = {
        "run_id": FP32_RUN,
        "rule_id": "prec-fp32-to-bf16",
        "target": "step_time_ms",
        "before": before,
        "predicted_after": before * (1 - 0.806),
        "measured_after": before * 2.046,
        "predicted_gain_pct": 80.6,
        "measured_gain_pct": -104.6,
        "new_run_id": "20261206-120000-tiny-aaaaaa",
        "changes": {"train.precision": "bf16"},
        "noise_pct": 2.1,
        "baseline_run_id": "20261206-115950-tiny-bbbbbb",
        "created_utc": "2026-12-06T12:00:05Z",
    }
    path = server[1] / "verifications" / f"{FP32_RUN}--prec-fp32-to-bf16--{pair['new_run_id']}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(pair))
    try:
        _tab(page, "Advice")
        page.get_by_role("radio", name="stored run").check()
        _choose(page, "#advice-run-choice", FP32_RUN)
        page.locator("#advice-run").click()
        summary = page.locator("#advice-summary")
        expect(summary).to_contain_text(f"for {FP32_RUN}")
        expect(summary).to_contain_text("No longer recommended: fp32 training where bf16 is faster")
        expect(summary).to_contain_text("measured -104.6 % on this machine on 2026-12-06")
        expect(page.locator("#advice-apply-choice input")).not_to_have_value(re.compile("prec-fp32-to-bf16"))
    finally:
        path.unlink()


def test_advise_apply_and_rerun(page, server):
    verifications = server[1] / "verifications"
    filed_before = set(verifications.glob("*.json")) if verifications.is_dir() else set()
    try:
        _advise_apply_and_rerun(page)
    finally:
        # The re-run's verdict is this machine's: on an AVX2-only CPU bf16 runs slower and the pair would
        # demote fp32 -> bf16 for the tests after this one, which apply it. They see the shipped store.
        for path in set(verifications.glob("*.json")) - filed_before:
            path.unlink()


def _advise_apply_and_rerun(page):
    _tab(page, "Advice")
    # The page opens on a first recommendation for the default setup.
    expect(page.locator("#advice-summary")).to_contain_text("for the Size tab's setup")
    page.get_by_role("radio", name="stored run").check()
    _choose(page, "#advice-run-choice", FP32_RUN)
    page.locator("#advice-run").click()
    expect(page.locator("#advice-summary")).to_contain_text(f"for {FP32_RUN}")
    expect(page.locator("#advice-summary")).to_contain_text("fp32 training where bf16 is faster")
    expect(page.locator("#advice-apply-choice input")).to_have_value(
        "#1 prec-fp32-to-bf16: fp32 training where bf16 is faster"
    )
    page.locator("#advice-apply").click()
    expect(page.locator("#advice-apply-result")).to_contain_text("train.precision = bf16")
    # Two pairs, alternating: the real path of a multi-pair re-run (four runs of the sample's tiny model).
    pairs = page.locator("#advice-pairs input[type='number']")
    expect(pairs).to_have_value("1")
    pairs.fill("2")
    pairs.press("Enter")
    page.locator("#advice-verify").click()
    result = page.locator("#advice-verify-result")
    expect(result).to_contain_text("Re-ran with train.precision = bf16", timeout=LONG_MS)
    expect(result).to_contain_text("2 pairs re-run just now in alternating order; the measured gain is the median")
    _shot(page, "advice")
    if "no longer recommends it" in result.inner_text():
        # Refuted on this CPU (an AVX2-only EPYC runs bf16 matmuls 30x slower than fp32; the server shows
        # the sample's flags): the advice learned it at once, and Apply still clears the re-run's results.
        expect(page.locator("#advice-apply-choice input")).not_to_have_value(re.compile("prec-fp32-to-bf16"))
        page.locator("#advice-apply").click()
        expect(result).not_to_contain_text("Re-ran")
        return
    page.locator("#advice-apply").click()  # again: the re-run's results were of the setup before it
    expect(result).not_to_contain_text("Re-ran")
    expect(page.locator("#advice-apply-result")).to_contain_text("It changes no field of the Size tab")
    _tab(page, "Size")  # the applied change is the current setup: the sample's tiny model in bf16 on the CPU
    expect(page.locator("#size-verdict")).to_contain_text("tiny")
    expect(page.locator("#size-verdict")).to_contain_text("bf16 adamw")


def test_compare_two_runs(page):
    _tab(page, "History")
    expect(page.locator("#history-count")).to_contain_text("match")
    _choose(page, "#history-a", FP32_RUN)
    _choose(page, "#history-b", "20261130-165253-tiny-617152")
    page.locator("#history-compare").click()
    summary = page.locator("#history-summary")
    # The two shipped runs differ in precision (fp32 -> bf16) and recompute (none -> full); their
    # metrics.json give 65.07 and 59.99 ms per step.
    expect(summary).to_contain_text("65.07")
    expect(summary).to_contain_text("59.99")
    expect(page.locator("#history-diff")).to_contain_text("train.precision")
    _shot(page, "history")


# --- Issue 21: reliable state, one report, readable ---

LAYOUT_70B = "?model=llama-3.1-70b&recompute=full&zero=3&offload=optimizer"  # fits: 42.0 GiB (see above)


def test_the_page_address_reproduces_the_setup(page, browser, server):
    verdict = page.locator("#size-verdict")
    _choose(page, "#size-model", "llama-3.1-70b")
    page.get_by_role("radio", name="full", exact=True).check()
    _choose(page, "#size-zero", "3")
    page.get_by_role("radio", name="optimizer", exact=True).check()
    expect(verdict).to_contain_text("FITS: 42.0 GiB of 140.4 GiB per GPU")
    # Only what differs from the defaults, in the order it was changed.
    expect(page).to_have_url(f"{server[0]}/{LAYOUT_70B}")
    other = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        other.goto(page.url)  # the link, opened afresh: the same setup, estimated
        expect(other.locator("#size-verdict")).to_contain_text("FITS: 42.0 GiB of 140.4 GiB per GPU")
        expect(other.locator("#size-verdict")).to_contain_text("llama-3.1-70b (70.55B params)")
        expect(other.locator("#size-zero input")).to_have_value("3")
        _tab(other, "Plan")
        expect(other.locator("#plan-model input")).to_have_value("llama-3.1-70b")
        # A link's parameters that cannot be used are named, with why; the rest apply.
        other.goto(f"{server[0]}/?seq=8k&precision=fp64&colour=red&gpus=16&zero=7")
        note = other.locator("#link-note")
        expect(note).to_contain_text("seq=8k: must be a whole number")
        expect(note).to_contain_text("precision=fp64: not one of this field's choices")
        # ZeRO has stages 0 to 3 only: 7 is not added to its dropdown (a review saw it loaded as "7").
        expect(note).to_contain_text("zero=7: not one of this field's choices")
        expect(other.locator("#size-zero input")).to_have_value("1")
        expect(note).to_contain_text("colour=red: unknown field")
        expect(other.locator("#size-verdict")).to_contain_text("16 GPUs (dp 16)")
    finally:
        other.close()


def _apply_the_samples_advice(page):
    """Advise on the fp32 sample run, apply its top recommendation (fp32 -> bf16); the Apply result."""
    _tab(page, "Advice")
    page.get_by_role("radio", name="stored run").check()
    _choose(page, "#advice-run-choice", FP32_RUN)
    page.locator("#advice-run").click()
    expect(page.locator("#advice-summary")).to_contain_text(f"for {FP32_RUN}")
    expect(page.locator("#advice-apply-choice input")).to_have_value(re.compile("prec-fp32-to-bf16"))
    page.locator("#advice-apply").click()
    return page.locator("#advice-apply-result")


def test_apply_shows_what_it_changes_and_undo_puts_it_back(page, server):
    page.goto(server[0] + "/" + LAYOUT_70B)
    verdict = page.locator("#size-verdict")
    expect(verdict).to_contain_text("FITS: 42.0 GiB")
    result = _apply_the_samples_advice(page)
    # Issue 21: Apply named one field while the 70B layout became the sample's tiny CPU run. Now every
    # changed field is listed, from and to (the sample: tiny, seq 128, micro-batch 2, on the CPU).
    expect(result).to_contain_text("It changes 10 fields of the Size tab")
    rows = result.locator("table tbody tr")
    expect(rows.filter(has_text="model")).to_contain_text("llama-3.1-70b")
    expect(rows.filter(has_text="model")).to_contain_text("tiny")
    expect(rows.filter(has_text="zero")).to_contain_text("3")
    expect(rows.filter(has_text="offload")).to_contain_text("optimizer")
    expect(page).to_have_url(re.compile(r"model=tiny"))
    page.locator("#advice-undo").click()
    expect(result).to_contain_text("Undone")
    _tab(page, "Size")
    expect(verdict).to_contain_text("FITS: 42.0 GiB of 140.4 GiB per GPU")
    expect(verdict).to_contain_text("llama-3.1-70b")
    assert parse_qs(urlsplit(page.url).query) == parse_qs(LAYOUT_70B[1:])  # the address, as it was
    _tab(page, "Advice")
    page.locator("#advice-undo").click()  # once: the setup before the last Apply
    expect(result).to_contain_text("Nothing to undo")


def test_a_new_action_clears_what_the_last_one_left(page):
    result = _apply_the_samples_advice(page)
    expect(result).to_contain_text("train.precision = bf16")
    rule = page.get_by_label("Rule id (empty: the top one that can re-run here)")
    expect(rule).to_have_value("prec-fp32-to-bf16")
    # A new advice: the last Apply's message and the rule it carried belong to the old one.
    page.get_by_role("radio", name="Size tab setup").check()
    page.locator("#advice-run").click()
    expect(page.locator("#advice-summary")).to_contain_text("for the Size tab's setup")
    expect(result).not_to_contain_text("train.precision")
    expect(rule).to_have_value("")
    # A new analysis: the last one's tables go, even when the new input fails.
    _tab(page, "Analyze")
    _choose(page, "#analyze-run-choice", FP32_RUN)
    page.locator("#analyze-run").click()
    expect(page.locator("#analyze-top")).to_contain_text("aten::mm", timeout=60_000)
    page.locator("#analyze-upload input[type=file]").set_input_files(
        files=[{"name": "broken.json", "mimeType": "application/json", "buffer": b"{not json"}]
    )
    expect(page.locator("#analyze-summary")).to_contain_text("Cannot analyze this trace")
    expect(page.locator("#analyze-top")).not_to_contain_text("aten::mm")


def test_the_review_report_opens_without_the_app_with_its_plots(page, browser, tmp_path):
    _tab(page, "Advice")
    page.get_by_role("radio", name="stored run").check()
    _choose(page, "#advice-run-choice", FP32_RUN)
    page.locator("#advice-run").click()
    expect(page.locator("#advice-summary")).to_contain_text(f"for {FP32_RUN}")
    page.locator("#advice-report").click()
    expect(page.locator("#advice-report-msg")).to_contain_text(
        "Setup and estimate, Plan, Measured run, Analysis, Advice, Glossary", timeout=60_000
    )
    with page.expect_download() as download:
        page.locator("#advice-report-file").get_by_role("link").first.click()
    report = tmp_path / "advisor-report.html"
    download.value.save_as(report)
    viewer = browser.new_page(viewport={"width": 1280, "height": 900})
    fetched = []

    def no_network(route):  # the file itself, and nothing else
        fetched.append(route.request.url)
        route.continue_() if route.request.url == report.as_uri() else route.abort()

    viewer.route("**/*", no_network)
    try:
        viewer.goto(report.as_uri())
        # Memory and step-time bars, the plan's scatter, the run's phases: drawn by the inlined plotly.
        expect(viewer.locator(".js-plotly-plot .main-svg").first).to_be_visible()
        assert viewer.locator(".js-plotly-plot").count() == 4
        expect(viewer.locator("#measured-run")).to_be_visible()
        expect(viewer.locator("body")).to_contain_text("FITS: 99.9 GiB of 140.4 GiB per GPU")
        expect(viewer.locator("body")).to_contain_text("prec-fp32-to-bf16")
        assert fetched == [report.as_uri()]
        viewer.set_viewport_size({"width": 1280, "height": 1800})
        _shot(viewer, "report", full_page=False)  # its first part: setup, estimate, plan
    finally:
        viewer.close()


# Lines a text takes against its words: a header or table cell broken inside a word takes more lines
# than it has words ("tok / ens / /s").
WRAPPED_INSIDE_WORDS = """() => {
  const bad = [];
  for (const el of document.querySelectorAll("th .text, .prose table th, .prose table td")) {
    if (!el.offsetParent) continue;
    const range = document.createRange();
    range.selectNodeContents(el);
    const tops = new Set(Array.from(range.getClientRects()).map((r) => Math.round(r.top)));
    const words = el.textContent.trim().split(/\\s+/).filter(Boolean).length;
    if (tops.size > Math.max(words, 1)) bad.push(el.textContent.trim());
  }
  return bad;
}"""


# Visible column headers whose text ends in a unit (UNIT_TIPS' endings), as [text, title] pairs.
UNIT_HEADERS = """(endings) => {
  const out = [];
  for (const th of document.querySelectorAll("th")) {
    const text = th.textContent.replace("⋮", "").trim();
    if (th.offsetParent && endings.some((e) => text.length > e.length && text.endsWith(e))) out.push([text, th.title]);
  }
  return out;
}"""


def test_every_tab_reads_at_1280_px(page):
    page.set_viewport_size({"width": 1280, "height": 900})
    verdict = page.locator("#size-verdict h3")
    expect(verdict).to_have_css("color", "rgb(26, 127, 55)")  # FITS, in green: a word, no emoji
    assert not re.search(r"[\u2600-\u27bf\U0001f300-\U0001faff]", verdict.inner_text())
    _set_number(page, "Micro-batch", 8)
    expect(page.locator("#size-verdict")).to_contain_text("DOES NOT FIT")
    expect(verdict).to_have_css("color", "rgb(207, 34, 46)")
    _set_number(page, "Micro-batch", 1)
    page.locator("#glossary summary").click()
    expect(page.locator("#glossary")).to_contain_text("Pipeline bubble: time a pipeline stage idles")
    assert page.evaluate(WRAPPED_INSIDE_WORDS) == []
    _tab(page, "Plan")
    page.locator("#plan-run").click()
    expect(page.locator("#plan-summary")).to_contain_text("layouts of")
    expect(page.locator("th", has_text="MFU %").first).to_have_attribute("title", re.compile("Model FLOPs utilisation"))
    assert page.evaluate(WRAPPED_INSIDE_WORDS) == []
    _tab(page, "Analyze")
    _choose(page, "#analyze-run-choice", FP32_RUN)
    page.locator("#analyze-run").click()
    expect(page.locator("#analyze-roofline-table")).to_contain_text("headroom", timeout=60_000)
    assert page.evaluate(WRAPPED_INSIDE_WORDS) == []
    # Every header that names a unit says it in its tooltip, known to COLUMN_TIPS or not: the "All
    # analyses" tables keep the analyses' own column names (the CPU run's first: phases, total_ms).
    page.get_by_text("All analyses: every table of the analysis").click()
    expect(page.locator("#analyze-table")).to_contain_text("total_ms")
    page.wait_for_timeout(500)
    headers = page.evaluate(UNIT_HEADERS, list(UNIT_TIPS))
    assert len(headers) >= 5 and [text for text, title in headers if not title] == []
    assert ["total_ms", "total_ms: in milliseconds"] in headers, headers
    for name in ("Profile", "Advice", "History"):
        _tab(page, name)
        page.wait_for_timeout(500)
        assert page.evaluate(WRAPPED_INSIDE_WORDS) == [], name
