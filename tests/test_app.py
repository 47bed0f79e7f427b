"""The app's Size tab handler: widget values in, verdict, plots and tables out; bad input shown, not raised."""

import asyncio
import inspect
import json
import os
import re
from pathlib import Path

import pytest

from advisor.errors import AdvisorError
from advisor.estimate.efficiency import ERROR_BAND
from advisor.present.views import layout_used_message
from tests.shared import SHARED_TRACES

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
app = pytest.importorskip("app")
gr = pytest.importorskip("gradio")

from advisor.spec.defaults import DEFAULTS  # noqa: E402 (after the skips)
from webui import advice as advice_tab  # noqa: E402
from webui import analyze as analyze_tab  # noqa: E402
from webui import common, linking  # noqa: E402
from webui import history as history_tab  # noqa: E402
from webui import plan as plan_tab  # noqa: E402
from webui import profile as profile_tab  # noqa: E402
from webui import size as size_tab  # noqa: E402

DATA = Path(__file__).parent / "data" / "hf"


def _view(**changes):
    values = {**DEFAULTS, "config_file": None, **changes}
    return size_tab.size_view(**values)


def test_default_view_is_useful():
    summary, mem_fig, time_fig, mem_table, time_table = _view()
    assert summary.startswith("### FITS")
    assert "tokens/s" in summary and "MFU" in summary
    assert list(mem_table["component"])[:4] == ["weights", "gradients", "optimizer states", "activations"]
    assert mem_table["GiB"].sum() == pytest.approx(float(summary.split("FITS: ")[1].split(" GiB")[0]), abs=0.1)
    stacked = [trace.name for trace in mem_fig.data]
    assert stacked == [
        "weights",
        "gradients",
        "optimizer states",
        "activations",
        "temp/comm buffers",
        "runtime + fragmentation",
    ]
    assert time_fig.data[0].orientation == "h"
    assert time_table["ms"].sum() > 0


def test_does_not_fit_is_said_plainly():
    summary, *_ = _view(model="llama-3.1-70b", gpus=8, zero=0)
    assert summary.startswith("### DOES NOT FIT")


def test_pipeline_shows_first_and_last_stage():
    _, mem_fig, *_ = _view(model="llama-3.1-70b", gpus=32, tp=4, pp=4, global_batch=64)
    assert list(mem_fig.data[0].x) == ["first stage", "last stage"]


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"tp": 64}, "gpus=8: must be a multiple of tp x pp x cp = 64"),
        ({"gpus": 64, "pp": 64}, "parallel.pp=64: pp x vpp=64 pipeline stages need at least one block each"),
        ({"seq": 0}, "train.seq_len=0"),
        ({"seq": 100.5}, "train.seq_len=100.5"),
        ({"global_batch": 7}, "train.global_batch=7"),
        ({"ep": 2}, "parallel.ep=2: expert parallelism needs a MoE model"),
        ({"precision": "fp8", "gpu": "a100-40gb"}, "has no fp8"),
    ],
)
def test_bad_widget_values_show_a_message(changes, words):
    summary, mem_fig, time_fig, mem_table, _ = _view(**changes)
    assert summary.startswith("### Invalid setup") and words in summary
    assert mem_fig is None and time_fig is None and mem_table.empty


def test_empty_gpu_count_means_one_replica():
    summary, *_ = _view(gpus=None, tp=2)
    assert "on 2 x H200" in summary and "dp1 tp2" in summary


def test_a_cpu_host_is_sized_per_process_not_per_gpu():
    # "0.1 GiB of 23.5 GiB per GPU" and "1 GPUs" for a CPU host (a browser review).
    summary, *_ = _view(model="tiny", gpu="cpu", gpus=1, seq=128, micro_batch=2)
    assert "GiB per process (" in summary and "· 1 process (dp 1)" in summary and "GPU" not in summary
    summary, *_ = _view(gpus=1)
    assert "GiB per GPU (" in summary and "· 1 GPU (dp 1)" in summary


def test_uploaded_config_overrides_the_preset(tmp_path):
    summary, *_ = _view(config_file=str(DATA / "mixtral-8x7b.json"), gpus=16, ep=8, zero=1)
    assert "mixtral-8x7b (46.70B params, 12.88B active)" in summary
    junk = tmp_path / "config.json"
    junk.write_text('{"model_type": "bert"}')
    summary, *_ = _view(config_file=str(junk))
    assert "model_type 'bert' is not supported" in summary


def test_unexpected_errors_stay_inside_the_handler(monkeypatch):
    def boom(_setup):
        raise RuntimeError("bug")

    monkeypatch.setattr(size_tab, "estimate", boom)
    summary, *_ = _view()
    assert summary.startswith("### Internal error")


def test_app_builds_with_a_size_endpoint():
    demo = app.build_app()
    names = [dep.get("api_name") for dep in demo.config["dependencies"]]
    assert "size" in names


# --- Profile tab ---


@pytest.fixture
def store(tmp_path, monkeypatch):
    from advisor.store.runstore import RunStore

    s = RunStore(tmp_path)
    monkeypatch.setattr(common, "store", lambda: s)
    return s


def _profile(**changes):
    values = {**profile_tab.PROFILE_INPUTS, "device": "cpu", "seq": 64, "micro_batch": 1, "steps": 1, **changes}
    return list(profile_tab.profile_view(**values))


@pytest.mark.slow  # starts a child process or runs seconds of real steps
def test_profile_tab_runs_offload_and_partial_recompute_and_files_refusals(store):
    summary = _profile(recompute="full", recompute_layers=1, offload_activations=2, precision="fp32")[-1][0]
    assert "`: ok" in summary and "Activation offload: 2 blocks" in summary and "ms not hidden" in summary
    fp8 = _profile(precision="fp8")[-1][0]
    assert "`: refused" in fp8 and "fp8" in fp8
    um = _profile(unified_memory=True)[-1][0]
    assert "`: refused" in um and "CUDA managed memory" in um
    bad = _profile(recompute="selective", offload_activations=1)[-1][0]
    assert bad.startswith("### ") and "offload" in bad and "recompute none, or full" in bad
    runs, damaged = store.list_runs()
    assert sorted(r.status for r in runs) == ["ok", "refused", "refused"] and damaged == []


@pytest.mark.slow  # starts a child process or runs seconds of real steps
def test_profile_tab_runs_a_step_and_shows_it(store):
    updates = _profile()
    assert updates[0][0].startswith("### Starting")
    assert any(u[0].startswith("### Running: step") for u in updates)
    assert {len(u) for u in updates} == {8}  # the progress updates skip every output but the summary
    summary, phases, memory, nvml, timeline, top, trace, roofline = updates[-1]
    assert "`: ok" in summary and "tokens/s" in summary and "nsys profile --capture-range=cudaProfilerApi" in summary
    assert phases.data[0].y == ("data", "forward", "backward", "optimizer", "other")
    assert list(memory.data[0].x) == ["measured peak", "estimated"]
    assert nvml is None  # CPU run: no NVML samples
    assert timeline.layout.title.text.startswith(
        "One traced step, ProfilerStep#"
    )  # one profiled step (steps=1, warmup 1)
    assert "aten::mm" in set(top["op"]) and trace.endswith("trace.json.gz")
    assert "aten::mm" in _points(roofline)  # the run records shapes: its matmuls sit on the roofline
    (run,) = store.list_runs()[0]
    reopened = profile_tab.open_run(run.run_id)
    assert reopened[0] == summary


def test_profile_tab_reports_bad_input_and_refusals(store):
    assert _profile(steps=0)[-1][0] == "### Invalid setup\nsteps=0: must be an integer from 1 to 100"
    refused = _profile(model="gpt2-1.5b", seq=1024)[-1][0]
    assert refused.startswith("### Not run") and "--layers" in refused
    assert store.list_runs() == ([], [])
    assert profile_tab.open_run("../../etc")[0].startswith("### Cannot open run\nrun id '../../etc' is not valid")


@pytest.mark.slow  # starts a child process or runs seconds of real steps
def test_profile_tab_opens_on_the_newest_run(store):
    assert common.run_choices().value is None  # empty store: nothing selected
    _profile()
    _profile(recompute="full")
    newest = store.list_runs()[0][0].run_id
    dropdown = common.run_choices()
    assert dropdown.value == newest and len(dropdown.choices) == 2
    # A newer failed run is listed, but the tabs open on the newest run that has something to show;
    # right after a profile the picker shows the run just made, failed or not.
    from advisor.run.launcher import profile_run
    from advisor.spec.options import RunOptions
    from advisor.spec.setup import make_setup

    failed = profile_run(
        make_setup(model="tiny", gpu="cpu", seq=64), RunOptions(device="cpu", steps=1, inject="oom"), store
    )
    assert failed.status != "ok"
    dropdown = common.run_choices()
    assert dropdown.value == newest and dropdown.choices[0] in (failed.run_id, (failed.run_id, failed.run_id))
    assert common.run_choices(measured=False).value == failed.run_id
    # After a Profile click the picker goes to the run the summary shows, whatever its status; after a
    # refusal (no run made) only its choices are refreshed, so the refusal stays on screen.
    assert profile_tab.picker_after_profile(f"### Run `{failed.run_id}`: oom").value == failed.run_id
    refused = profile_tab.picker_after_profile("### Not run\nneeds about 1314.2 GiB")
    assert "value" not in refused and len(refused["choices"]) == 3
    assert common.run_choices(1).value not in (newest, failed.run_id)  # History's run A: the second measured run
    assert common.run_choices(2).value == failed.run_id  # past the measured runs: the others, never one twice


SAMPLE_RUNS = ("20261130-165248-tiny-6bcb2f", "20261130-165253-tiny-617152")  # committed under traces/


@pytest.mark.parametrize("run_id", SAMPLE_RUNS)
def test_shipped_sample_runs_are_readable(run_id):
    from advisor.store.runstore import RunStore

    summary, phases, memory, _, timeline, top, trace, roofline = profile_tab.run_view(RunStore().load(run_id))
    assert f"`{run_id}`: ok" in summary and phases is not None and memory is not None and timeline is not None
    assert not top.empty and trace.endswith("trace.json.gz")
    assert roofline.layout.title.text.startswith("Roofline on CPU host")
    assert {"aten::mm", "aten::linear"} <= _points(roofline)


@pytest.fixture
def fresh_run_figures():
    """_run_trace_figures' cache emptied before and after: a test that breaks the roofline sees its own
    run drawn afresh, and leaves no broken figure behind for the next test."""
    profile_tab._run_trace_figures.cache_clear()
    yield
    profile_tab._run_trace_figures.cache_clear()


def test_a_run_whose_roofline_fails_still_shows_the_rest(monkeypatch, fresh_run_figures):
    from advisor.errors import TraceError
    from advisor.run import analysis_child as isolated
    from advisor.store.runstore import RunStore

    def no_roofline(*_args, **_kwargs):
        raise TraceError("trace.json.gz holds no cpu_op events to judge")

    monkeypatch.setattr(isolated, "trace_roofline", no_roofline)
    summary, phases, _, _, timeline, top, _, roofline = profile_tab.run_view(RunStore().load(SAMPLE_RUNS[0]))
    assert roofline is None
    assert "`: ok" in summary and phases is not None and timeline is not None and not top.empty


def _points(figure) -> set[str]:
    """The names of the ops or kernels a roofline figure plots (its marker traces' points)."""
    return {name for trace in figure.data if trace.mode == "markers" for name in trace.text}


def _roof_lines(figure) -> dict:
    """A roofline figure's roofs by legend name: the bandwidth diagonal and one line per peak."""
    return {trace.name: trace for trace in figure.data if trace.mode == "lines"}


# --- Analyze tab ---

TRACES = SHARED_TRACES


@pytest.mark.skipif(not TRACES.is_dir(), reason="real traces live in ../shared/traces (absent here)")
def test_analyze_tab_on_an_uploaded_real_trace():
    out = analyze_tab.analyze_view(str(TRACES / "nsys" / "nsysai_mfu_2gpu_before.sqlite"), None)
    summary, temporal, categories, timeline, top, details, collectives, roofline, roofline_table = out[:9]
    picker, tables, shown = out[9:]
    assert "2 rank(s), cuda" in summary
    assert [bar.name for bar in temporal.data] == ["compute", "communication + memory", "idle"]
    assert list(temporal.data[0].x) == ["rank 0", "rank 1"]
    assert "attention" in set(categories.data[0].y)
    assert top.iloc[0]["name"].startswith("void flash::flash_fwd_kernel") and top.iloc[0]["category"] == "attention"
    assert set(details["idle_category"]) == {"host_wait", "kernel_wait", "other"}
    assert "idle_ns" not in details and details["idle_ms"].between(0, 300).all()  # ms, as every time shown
    # nsys keeps no c10d ops: its 33 NCCL SendRecv kernels per GPU are named by the nccl:* NVTX range
    # around their launch (32 all-to-alls) or else by the kernel (1 send/recv), never "other".
    calls = collectives.groupby(["rank", "kind"])["calls"].sum().to_dict()
    assert calls == {(0, "all_to_all"): 32, (0, "send_recv"): 1, (1, "all_to_all"): 32, (1, "send_recv"): 1}
    # nsys captures have no ProfilerStep ranges: the timeline spans the whole capture of rank 0.
    assert timeline.layout.title.text == "whole trace (no ProfilerStep): 299.9 ms"
    # An nsys export records no shapes: every kernel is judged by its class, none is plotted.
    assert not _points(roofline) and "record_shapes=True" in roofline.layout.annotations[0].text
    assert set(roofline_table["basis"]) <= {"kernel class", "transfer"}
    # "All analyses": every non-empty table can be picked; the idle table shows first, in ms.
    assert ("gpu_idle (3 rows)", "gpu_idle") in picker.choices and picker.value == "gpu_idle"
    assert shown.label.startswith("gpu_idle: idle per device")
    assert shown.value["headers"][:4] == ["scope", "rank", "device", "span_ms"]
    assert shown.value["data"][2][:4] == ["all devices", -1, -1, 299.877]  # the reference's 299.877 ms span
    launch = analyze_tab.show_table("launch_stats", tables)
    assert launch.label.startswith("launch_stats: per rank") and len(launch.value["data"]) == 2
    assert analyze_tab.show_table("no_such_table", tables).value["data"] in ([], [[]])


def test_analyze_tab_on_a_stored_cpu_run_and_on_bad_input(tmp_path):
    summary, temporal, categories, timeline, top, details, collectives, *_ = analyze_tab.analyze_view(
        None, SAMPLE_RUNS[0]
    )
    assert "1 rank(s), cpu" in summary and temporal is None and categories is None
    assert top.iloc[0]["name"] == "aten::mm" and "forward" in set(details["phase"])
    assert collectives.empty  # one process: nothing to communicate
    # The run's last step, ProfilerStep#5, lasted 66.839 ms in its trace; its phases have a lane.
    assert timeline.layout.title.text == "One traced step, ProfilerStep#5: 66.8 ms"
    assert [t.name for t in timeline.data if set(t.y) == {"phase"}] == ["data", "forward", "backward", "optimizer"]
    bogus = tmp_path / "bogus.json"
    bogus.write_text('{"not": "a trace"}')
    assert analyze_tab.analyze_view(str(bogus), None)[0].startswith(
        "### Cannot analyze this trace\nbogus.json is JSON without a traceEvents"
    )
    assert analyze_tab.analyze_view(None, "../etc")[0].startswith(
        "### Cannot analyze this trace\nrun id '../etc' is not valid"
    )
    # A refused upload is discarded; pressing Analyze again says so, not "no file or folder".
    assert analyze_tab.analyze_view(str(tmp_path / "gone.json"), None)[0] == (
        "### Cannot analyze this trace\ngone.json was refused when it was uploaded (the reason was shown then) "
        "and is gone: upload another trace, or clear the box and pick a stored run"
    )
    assert analyze_tab.analyze_view(None, None)[0].startswith("Upload a trace")


def test_analyze_tab_draws_the_roofline_of_a_stored_cpu_run():
    from advisor.analysis.roofline import trace_roofline
    from advisor.analysis.summary import load_trace
    from advisor.store.ceilings import ceilings_lookup
    from advisor.store.runstore import RunStore

    updates = list(analyze_tab.analyze_job(None, SAMPLE_RUNS[0]))
    assert {len(u) for u in updates} == {12}  # stages as progress, then the view: every output each time
    summary, *_, roofline, table = updates[-1][:9]
    run_dir = RunStore().path(SAMPLE_RUNS[0])
    backend = trace_roofline(load_trace(run_dir), ceilings=ceilings_lookup(run_dir.parent)).table
    assert "Roofline verdict: compute-bound" in summary
    assert {"aten::mm", "aten::linear"} <= _points(roofline)
    # The head's weight gradient, aten::mm [256, 8192] x [8192, 256] twice: 2 x 2*256*8192*256 FLOPs
    # over 4 bytes x (256*8192 + 8192*256 + 256*256) per call = 63.0 FLOP/byte, in 11.2305 ms = 191.2 GFLOP/s.
    compute = next(t for t in roofline.data if t.name == "compute")
    i = next(i for i, h in enumerate(compute.hovertext) if "shapes: [[256, 8192], [8192, 256]]" in h)
    assert compute.x[i] == pytest.approx(63.015, abs=1e-3) and compute.y[i] == pytest.approx(191.2e9, rel=1e-3)
    # The roofs are the backend table's: the fp32 peak, and the bandwidth diagonal that meets it.
    roofs = backend.attrs["roofs"]
    peak, bandwidth = roofs["peak_flops_per_s"]["fp32"], roofs["bytes_per_s"]
    lines = _roof_lines(roofline)
    (peak_line,) = [line for name, line in lines.items() if name.startswith("fp32 peak")]
    (diagonal,) = [line for name, line in lines.items() if name.startswith("memory")]
    assert set(peak_line.y) == {peak} and peak_line.x[0] == pytest.approx(peak / bandwidth)
    assert diagonal.y[0] / diagonal.x[0] == pytest.approx(bandwidth) and diagonal.y[-1] == pytest.approx(peak)
    # The table shows the backend's rows, most time first: the head's forward linear, 14.125 ms.
    first, expected = table.iloc[0], backend.iloc[0]
    assert (first["name"], first["input shapes"]) == ("aten::linear", "[[2, 128, 256], [8192, 256], []]")
    assert (first["name"], first["input shapes"]) == (expected["name"], expected["input_dims"])
    assert first["ms over trace"] == round(expected["time_ms"], 3) == 14.125
    assert first["achieved GFLOP/s"] == round(expected["achieved_flops_per_s"] / 1e9, 2) == 152.04
    assert first["headroom %"] == round(100 * expected["headroom_frac"], 1)
    assert len(table) == 30 and list(table["ms over trace"]) == sorted(table["ms over trace"], reverse=True)


def test_a_trace_whose_roofline_fails_is_still_analyzed(monkeypatch):
    from advisor.analysis.summary import load_trace
    from advisor.errors import TraceError
    from advisor.run import analysis_child as isolated

    def no_roofline(*_args, **_kwargs):
        raise TraceError("trace.json.gz holds no cpu_op events to judge")

    monkeypatch.setattr(isolated, "trace_roofline", no_roofline)
    run_trace = load_trace(Path(__file__).parents[1] / "traces" / SAMPLE_RUNS[0])
    assert common.roofline_of(run_trace)[1].endswith("holds no cpu_op events to judge")
    # The app analyses in a child process, where the same refusal is made (tests/isolated_workers.py).
    worker = "tests.isolated_workers:no_roofline"
    summary, _, _, timeline, top, *_, roofline, table = analyze_tab.analyze_view(None, SAMPLE_RUNS[0], worker=worker)[
        :9
    ]
    assert summary.endswith("Roofline skipped: trace.json.gz holds no cpu_op events to judge")
    assert "1 rank(s), cpu" in summary and timeline is not None and top.iloc[0]["name"] == "aten::mm"
    assert roofline is None and table.empty and "headroom %" in table.columns


A100_TRACE = TRACES / "kineto" / "trace_filter" / "sampled_rank-0.json.gz"


@pytest.mark.skipif(not A100_TRACE.is_file(), reason="real traces live in ../shared/traces (absent here)")
def test_analyze_tab_places_an_uploaded_gpu_traces_gemms_on_the_roofline():
    *_, roofline, table = analyze_tab.analyze_view(str(A100_TRACE), None)[:9]
    # No device in the trace: its cutlass_80 kernels give an A100 away, judged by the A100 SXM datasheet
    # (19.5 TFLOP/s fp32, 156 TFLOP/s tf32, 2,039 GB/s).
    assert set(_roof_lines(roofline)) == {
        "memory 2.04 TB/s (datasheet)",
        "fp32 peak 19.5 TFLOP/s (datasheet)",
        "tf32 peak 156 TFLOP/s (datasheet)",
    }
    points = _points(roofline)
    assert any("s1688gemm" in p for p in points) and any(p.startswith("ampere_sgemm") for p in points)
    assert not any(p.startswith("ncclKernel") for p in points)  # collectives have no FLOPs to plot
    # aten::mm [8192, 512] x [512, 8192] on TF32 tensor cores, twice: 2 x 2*8192*512*8192 FLOPs over
    # 4 bytes x (2*8192*512 + 8192*8192) per call = 227.6 FLOP/byte, in 2.503 ms = 54.9 TFLOP/s.
    compute = next(t for t in roofline.data if t.name == "compute")
    i = next(i for i, h in enumerate(compute.hovertext) if "shapes: [[8192, 512], [512, 8192]]" in h)
    assert compute.x[i] == pytest.approx(227.56, abs=0.01) and compute.y[i] == pytest.approx(54.91e12, rel=1e-3)
    assert compute.text[i].startswith("void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_128x128")
    assert "&lt;cutlass_80" in compute.hovertext[i]  # template brackets escaped, not read as markup
    # The NCCL kernels, recorded without shapes, hold most of the time: the title says it is not plotted.
    assert "ms with no shapes recorded" in roofline.layout.title.text
    assert table.iloc[0]["name"].startswith("ncclKernel_SendRecv") and table.iloc[0]["bound"] == "communication"
    assert table["name"].str.len().max() <= 90


V100_TRACES = sorted((TRACES / "kineto" / "ns_resolution_trace").glob("*.json.gz"))


@pytest.mark.skipif(not V100_TRACES, reason="real traces live in ../shared/traces (absent here)")
def test_a_trace_recorded_without_shapes_says_so_on_its_roofline():
    *_, roofline, table = analyze_tab.analyze_view(str(V100_TRACES[0]), None)[:9]
    assert not _points(roofline)
    (note,) = roofline.layout.annotations
    assert note.text.startswith("no op in this trace has recorded shapes: profile with record_shapes=True")
    # The V100 SXM2 datasheet's roofs still show where the kernels would fall.
    assert set(_roof_lines(roofline)) == {"memory 900 GB/s (datasheet)", "fp32 peak 15.7 TFLOP/s (datasheet)"}
    assert set(table["basis"]) == {"kernel class"} and table["FLOP/byte"].isna().all()  # its top 30: kernels


# --- Advice and Plan tabs ---


def _size_values(**changes):
    values = {**DEFAULTS, **changes}
    return [values["model"], None, *[values[k] for k in list(DEFAULTS)[1:]]]


def test_advice_tab_on_the_size_setup_gives_a_ranked_table_and_files():
    summary, table, report, files, advice = advice_tab.advice_view(
        "Size tab setup", None, None, *_size_values(model="llama-3.1-70b", gpus=8, zero=0, global_batch=8)
    )
    assert summary.startswith("### ") and "Out of memory, model states dominate" in summary
    assert table.iloc[0]["rule"] == "mem-oom-model-state" and table.iloc[0]["severity"] == "critical"
    assert table.iloc[0]["predicted gain %"] > 0
    assert "# Advice for the Size tab's setup" in report
    md, js = files
    assert Path(md).read_text().startswith("# Advice") and '"recommendations"' in Path(js).read_text()
    assert advice.recommendations[0].rule.id == "mem-oom-model-state"


def test_advice_of_an_older_size_setup_is_not_applied(monkeypatch):
    # A browser review: advice made on the page's first setup, applied after a layout from the Plan tab,
    # put the whole first setup back (5 fields) for a change of precision alone. Apply now refuses it.
    from webui.advice import stale_fields
    from webui.size import size_values

    *_, advice = advice_tab.advice_view("Size tab setup", None, None, *_size_values())
    now = size_values(advice.setup)
    assert stale_fields(advice, "Size tab setup", now) == []
    moved = now | {"micro_batch": 4, "tp": "2"}
    assert stale_fields(advice, "Size tab setup", moved) == ["micro_batch", "tp"]
    assert stale_fields(advice, "stored run", moved) == []  # a run's setup is loaded on purpose


def test_advice_tab_on_a_stored_run_and_bad_input(tmp_path, monkeypatch):
    from advisor.store.runstore import RunStore

    monkeypatch.setattr(common, "store", lambda: RunStore(Path(__file__).resolve().parents[1] / "traces"))
    _, table, *_ = advice_tab.advice_view("stored run", "20261130-165248-tiny-6bcb2f", None, *_size_values())
    assert "launch-small-batch" in set(table["rule"])
    assert advice_tab.advice_view("stored run", None, None, *_size_values())[0].startswith("Pick a stored run")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert advice_tab.advice_view("uploaded trace", None, str(bad), *_size_values())[0].startswith("### Cannot advise")
    assert advice_tab.advice_view("Size tab setup", None, None, *_size_values(tp=3))[0].startswith("### Cannot advise")


def test_the_report_says_when_the_setup_and_the_run_are_two_jobs(monkeypatch):
    # The Size tab's Llama-3.1-8B on 8 H200s beside the tiny CPU run advised: a browser review found the
    # report's title and setup say one job and its run, analysis and advice another, with no word of it.
    from advisor.store.runstore import RunStore
    from webui import report as report_tab

    monkeypatch.setattr(common, "store", lambda: RunStore(Path(__file__).resolve().parents[1] / "traces"))
    run = "20261130-165248-tiny-6bcb2f"
    *_, advice = advice_tab.advice_view("stored run", run, None, *_size_values())
    msg, path = report_tab.report_view(advice, "stored run", run, None, "", None, None, None, *_size_values())
    page = Path(path).read_text()
    assert msg.startswith("Report of ") and "Setup and estimate, Plan, Measured run, Analysis, Advice" in msg
    assert f"Training review: llama-3.1-8b on 8 x H200 141GB, and run {run} (tiny on CPU host (2 cores))" in page
    assert f"the measured run, its analysis and the advice are run {run}'s, another job (tiny on CPU" in page


def test_verify_view_without_a_run_or_with_an_unknown_rule(store):
    assert advice_tab.verify_view(None, None)[0].startswith("Verification re-runs a stored run")
    msg, table, categories, changes = advice_tab.verify_view("20261130-165248-tiny-6bcb2f", "no-such-rule")
    assert msg.startswith("### Cannot") and table.empty and categories.empty and changes.empty
    # The slider's pairs: a whole number from 1 to 10 (its float arrives as an int); anything else is
    # refused by name before a run starts.
    for bad in (2.5, 0, 11):
        msg, table, *_ = advice_tab.verify_view("20261130-165248-tiny-6bcb2f", None, bad)
        assert msg.startswith("### Cannot verify\npairs must be a whole number from 1 to 10, got"), msg
        assert table.empty


def test_plan_tab_ranks_layouts_and_rejects_bad_input():
    summary, table, explain, scatter = plan_tab.plan_view("llama-3.1-8b", "h100", 8, 4096, 64, ["bf16"], True)
    assert summary.startswith("### ") and len(table) > 0
    fits, top = scatter.data  # every fitting layout, then the ranked ones highlighted
    assert len(top.x) == len(table) and len(fits.x) >= len(table)
    assert abs(max(top.y) - table["tokens/s"].iloc[0]) <= 0.5  # the table rounds to whole tokens/s
    assert max(fits.y) <= max(top.y)  # no setting left out of the top beats its best
    assert list(table["tokens/s"]) == sorted(table["tokens/s"], reverse=True)
    assert explain.startswith("## Layout plan: llama-3.1-8b on 8 x H100 SXM 80GB")
    assert f"\n### Best: {table['layout'].iloc[0]}\n" in explain  # the table's first row, explained
    bad = plan_tab.plan_view("llama-3.1-8b", "h100", 0, 4096, 64, ["bf16"], True)
    assert bad[0].startswith("### Cannot plan") and "gpus" in bad[0]
    none = plan_tab.plan_view("llama-3.1-8b", "h100", 8, 4096, 64, [], True)
    assert none[0].startswith("### Cannot plan") and "precisions" in none[0]


def test_plan_tab_searches_within_the_servers_time_budget(monkeypatch):
    # ADVISOR_PLAN_TIMEOUT_S bounds each Plan request; past it the summary says the search is incomplete.
    args = ("llama-3.1-405b", "h100", 65536, 8192, 2**26, ["bf16"], True, False)
    monkeypatch.setenv("ADVISOR_PLAN_TIMEOUT_S", "0.05")
    summary, table, explain, _ = plan_tab.plan_view(*args)
    assert "(incomplete search)" in summary and "Stopped at the time budget of 0.05 s: " in summary
    assert len(table) > 0 and "**Incomplete.** Stopped at the time budget of 0.05 s" in explain
    for bad in ("0", "-1", "nan", "inf", "4000", "soon"):
        monkeypatch.setenv("ADVISOR_PLAN_TIMEOUT_S", bad)
        msg = plan_tab.plan_view(*args)[0]
        assert (
            msg.startswith("### Cannot plan") and f"ADVISOR_PLAN_TIMEOUT_S={bad!r}: must be a number of seconds" in msg
        )
    monkeypatch.delenv("ADVISOR_PLAN_TIMEOUT_S")
    assert common.plan_time_budget() == common.PLAN_TIMEOUT_DEFAULT_S == 60.0


def test_trace_loads_share_one_small_concurrency_limit():
    # Issue 22: 16 concurrent requests at a 4 GiB budget each could ask for 64 GiB of a 24 GiB host.
    # Every event that loads a trace (Analyze, an upload, Open in Perfetto) queues on one limit of 2.
    fns = app.build_app().fns.values()
    loads = [(f.name, f.concurrency_id, f.concurrency_limit) for f in fns if f.name in ("analyze_job", "perfetto_file")]
    assert sorted(loads) == [("analyze_job", "analyze", 2)] * 2 + [("perfetto_file", "analyze", 2)]


def test_the_public_api_is_each_tabs_main_action():
    deps = app.build_app().config["dependencies"]
    public = {d["api_name"] for d in deps if d.get("api_visibility") == "public"}
    # Everything else (refreshes, cancel, page-load fills) is undocumented, not "false_1"-style names.
    assert public == {
        "size",
        "export",
        "profile",
        "open_run",
        "analyze",
        "perfetto",
        "advise",
        "verify",
        "plan",
        "compare",
        "calibrate",
        "report",
    }
    assert not any(str(d.get("api_name")).startswith("false") for d in deps)


def test_login_comes_from_the_environment(monkeypatch):
    assert app.auth_from_env(None) is None and app.auth_from_env("") is None
    assert app.auth_from_env("ana:s3cret, bo:pw:with:colons") == [("ana", "s3cret"), ("bo", "pw:with:colons")]
    for bad in ("ana", "ana:", ":pw", "ana:pw,,"):
        with pytest.raises(ValueError, match=r"ADVISOR_AUTH entry \d is not user:password") as err:
            app.auth_from_env(bad)
        assert "pw" not in str(err.value)
    seen = {}

    class FakeBlocks:
        def queue(self, **kw):
            return self

        def launch(self, **kw):
            seen.update(kw)

    monkeypatch.setattr(app, "build_app", lambda: FakeBlocks())
    monkeypatch.setenv("ADVISOR_AUTH", "ana:s3cret")
    app.main([])
    assert seen["server_name"] == "127.0.0.1" and inspect.iscoroutinefunction(seen["auth"])  # rate limited
    assert asyncio.run(seen["auth"]("ana", "s3cret")) is True
    monkeypatch.setenv("ADVISOR_AUTH", "broken")
    with pytest.raises(SystemExit, match="ADVISOR_AUTH entry 1"):
        app.main([])


# --- One spec across tabs, and Apply ---


def test_size_values_describe_the_setup_they_came_from():
    from advisor.spec.setup import make_setup

    setup = make_setup(
        model="llama-3.1-70b", gpu="gh200", gpus=64, seq=4096, global_batch=256, tp=4, pp=2, vpp=2,
        recompute="selective", offload="optimizer", zero=2, sequence_parallel=True, precision="fp8",
    )  # fmt: skip
    values = size_tab.size_values(setup)
    assert values["model"] == "llama-3.1-70b" and values["gpu"] == "gh200" and values["tp"] == "4"
    assert values["gpus"] == 64 and values["zero"] == "2" and values["offload"] == "optimizer"
    assert size_tab.setup_from_size_inputs(*[values.get(k) for k in size_tab.SIZE_KEYS]) == setup


def test_a_shared_value_follows_only_where_the_other_tab_allows_it():
    import gradio as gr

    with gr.Blocks():
        precision = gr.Radio(["fp32", "bf16", "fp16"], value="bf16")
        precisions = gr.CheckboxGroup(["fp32", "bf16", "fp8"], value=["bf16"])
        batch = gr.Number(value=64, minimum=1)
        # The Plan tab's own batch: no minimum for Gradio to check (spec_number), a range for links.
        plan_batch = common.spec_number(64, "Global batch (sequences)", low=1)
    assert plan_batch.minimum is None and plan_batch.follow_range == (1, None)
    assert common.follow_value(plan_batch, 128) == 128
    assert isinstance(common.follow_value(plan_batch, 0), type(gr.skip()))
    assert common.follow_value(precision, "fp16") == "fp16"
    assert isinstance(common.follow_value(precision, "fp8"), type(gr.skip()))  # the profiler has no fp8
    assert common.follow_value(precisions, "fp8") == ["fp8"]
    assert common.follow_value(batch, 128) == 128
    assert isinstance(common.follow_value(batch, 0), type(gr.skip()))  # "no accumulation" is no plan batch


def test_apply_loads_the_recommended_change_everywhere(monkeypatch):
    from advisor.store.runstore import RunStore
    from tests.sample_cpu import pin_sample_cpu

    pin_sample_cpu(monkeypatch)  # bf16 is the samples' CPU's fast path, not an AVX2-only one's
    monkeypatch.setattr(common, "store", lambda: RunStore(Path(__file__).resolve().parents[1] / "traces"))
    *_, advice = advice_tab.advice_view("stored run", "20261130-165248-tiny-6bcb2f", None, *_size_values())
    choices = advice_tab.apply_choices(advice).choices
    first = choices[0][0]
    assert first.startswith("#1 prec-fp32-to-bf16")  # the shipped sample ran in fp32
    msg, size, profile, rule = advice_tab.apply_recommendation(advice, first, "stored run")
    assert rule == "prec-fp32-to-bf16" and "`train.precision = bf16`" in msg and "Re-run" in msg
    # A CPU run maps to the "cpu" device whatever host recorded it (the name carries its core count).
    assert size["precision"] == "bf16" and size["model"] == "tiny" and size["gpu"] == "cpu"
    assert size["seq"] == 128 and size["micro_batch"] == 2
    assert profile["precision"] == "bf16" and profile["device"] == "cpu" and profile["steps"] == 2
    assert advice_tab.apply_recommendation(None, first, "stored run")[0] == "Press **Advise** first."
    assert advice_tab.apply_recommendation(advice, "#9 nothing", "stored run")[1:] == ({}, {}, None)
    # Applied on the Size tab, the widgets rebuild the recommended setup (on this machine's CPU).
    rebuilt = size_tab.setup_from_size_inputs(*[size.get(k) for k in size_tab.SIZE_KEYS])
    after = advice.recommendations[0].after
    assert (rebuilt.model, rebuilt.train, rebuilt.parallel) == (after.model, after.train, after.parallel)
    assert rebuilt.hardware.kind == "cpu"
    # Advice on the Size tab's setup loads its change but no rule to re-run (none fired on a run).
    *_, on_size = advice_tab.advice_view("Size tab setup", None, None, *_size_values())
    size_first = advice_tab.apply_choices(on_size).choices[0][0]
    msg, size, _, rule = advice_tab.apply_recommendation(on_size, size_first, "Size tab setup")
    assert size and rule is None


def test_number_widgets_leave_their_checks_to_the_handlers_even_after_an_update():
    # A user review: on the Plan tab GPUs 0 got Gradio's "Value 0 is less than minimum value 1" (no field
    # named, a traceback in the log) and on the Size tab 1.5 GPUs sized 2. validate_in_handlers lifted
    # those checks per instance, but Gradio rebuilds a widget a handler updates (a link between tabs,
    # Apply) as block.__class__(**kwargs), which brought them back. The numbers now have none to lift.
    demo = app.build_app()
    numbers = [b for b in demo.blocks.values() if isinstance(b, gr.Number)]
    assert len(numbers) >= 15
    for block in numbers:
        rebuilt = block.__class__(**{**block.constructor_args, "render": False})
        assert (rebuilt.minimum, rebuilt.maximum, rebuilt.precision) == (None, None, None), block.label
        assert rebuilt.preprocess(1.5) == 1.5 and rebuilt.preprocess(0) == 0 and rebuilt.preprocess(-8) == -8
    # What another tab copies in keeps the old ranges: the Size tab's global batch 0 ("no accumulation")
    # is no Plan tab batch, and stays off it.
    plan_batch = next(b for b in numbers if b.label == "Global batch (sequences)")
    assert isinstance(common.follow_value(plan_batch, 0), type(gr.skip())) and common.follow_value(plan_batch, 8) == 8
    # The handler names the field: 1.5 GPUs on the Size tab, 0 on the Plan tab.
    assert "gpus=1.5" in str(size_tab.size_view(*_size_values(gpus=1.5))[0])
    out = plan_tab.plan_view("llama-3.1-8b", "h100", 0, 8192, 512, ["bf16"], True, False)
    assert out[0] == "### Cannot plan\ngpus=0: must be an integer from 1 to 1048576"
    # An emptied box is named as empty: the Size tab once sized 4,096 tokens for an emptied 8,192 without a
    # word, and the Plan tab said "seq_len=None".
    assert "seq=empty: give a number" in str(size_tab.size_view(*_size_values(seq=None))[0])
    out = plan_tab.plan_view("llama-3.1-8b", "h100", 8, None, 512, ["bf16"], True, False)
    assert out[0] == "### Cannot plan\nseq_len=empty: give a number"


def test_a_tab_opened_after_a_run_lists_it(tmp_path, monkeypatch):
    # A user review: a run profiled on the Profile tab was missing from the Analyze and Advice pickers
    # and the History table until the page was reloaded. Opening those tabs reads the store again.
    import shutil

    from advisor.store.runstore import RunStore

    store_dir = tmp_path / "traces"
    shutil.copytree(Path(__file__).resolve().parents[1] / "traces", store_dir)
    monkeypatch.setattr(common, "store", lambda: RunStore(store_dir))
    old, new = "20261130-165248-tiny-6bcb2f", "20261130-165253-tiny-617152"
    assert common.refresh_runs(old).value == old  # the pick stays
    assert common.refresh_runs(None).value == new and common.refresh_runs("gone").value == new  # else the newest
    made = "20261207-120000-tiny-abcdef"
    shutil.copytree(store_dir / new, store_dir / made)
    record = json.loads((store_dir / made / "run.json").read_text())
    (store_dir / made / "run.json").write_text(json.dumps(record | {"run_id": made}))
    refreshed = common.refresh_runs(old)
    assert refreshed.value == old and [c[0] for c in refreshed.choices] == [made, new, old]
    # Wired: selecting Analyze, Advice or History refreshes its pickers (History its table too).
    demo = app.build_app()
    ids = {c._id: c for c in demo.blocks.values()}
    on_select = [d for d in demo.config["dependencies"] if d["targets"] and d["targets"][0][1] == "select"]
    by_tab = {}
    for d in on_select:
        tab = ids[d["targets"][0][0]]
        if isinstance(tab, gr.Tab):
            by_tab.setdefault(tab.label, set()).update(ids[o].elem_id or ids[o].label for o in d["outputs"])
    assert {"Analyze", "Advice", "History"} <= set(by_tab)
    assert "advice-run-choice" in by_tab["Advice"] and {"history-a", "history-b"} <= by_tab["History"]


def test_the_app_links_tabs_and_opens_on_a_recommendation():
    demo = app.build_app()
    deps = demo.config["dependencies"]
    ids = {c._id: c for c in demo.blocks.values()}
    links = [d for d in deps if d["targets"] and d["targets"][0][1] == "input"]
    links = [d for d in links if not any(isinstance(ids[o], gr.File) for o in d["outputs"])]  # not the config clear
    # Each shared widget copies to the same widget on the other tabs: model, gpu/gpus, seq, batches,
    # precision, recompute, optimizer and its kernels; 23 one-way links (checkbox groups do not lead).
    assert len(links) == 23
    for d in links:
        source = ids[d["targets"][0][0]]
        assert all(type(ids[o]) is type(source) or isinstance(ids[o], gr.CheckboxGroup) for o in d["outputs"])
    # A widget on two tabs (GPUs and device: Size and Plan) has one target, which takes the bare value:
    # a list there reached the Plan tab as "[64]" and failed its planner.
    one = [d for d in links if len(d["outputs"]) == 1]
    assert {ids[d["targets"][0][0]].label for d in one} >= {"GPUs", "Device"}
    for d in one:
        source = ids[d["targets"][0][0]]
        value = 64 if source.label == "GPUs" else "h100" if source.label == "Device" else source.value
        copied = demo.fns[d["id"]].fn(value)
        assert copied == value or isinstance(copied, dict), (source.label, copied)  # dict: gr.skip()
    # On a page load, or chained after one (the setup in the page address is read first).
    by_id = {d["id"]: d for d in deps}

    def on_load(d) -> bool:
        if d["targets"] and d["targets"][0][1] == "load":
            return True
        return d.get("trigger_after") is not None and on_load(by_id[d["trigger_after"]])

    loads = [d for d in deps if on_load(d)]
    advice_load = [d for d in loads if any(ids[o].elem_id == "advice-summary" for o in d["outputs"] if o in ids)]
    assert len(advice_load) == 1  # the Advice tab opens on a first recommendation
    url_load = [d for d in loads if any(ids[o].elem_id == "link-note" for o in d["outputs"] if o in ids)]
    # The address's setup and its verdict in one answer, then the advice on that setup.
    assert len(url_load) == 1 and advice_load[0]["trigger_after"] == url_load[0]["id"]
    assert any(ids[o].elem_id == "size-verdict" for o in url_load[0]["outputs"] if o in ids)


# --- Calibration (History tab) ---


@pytest.mark.slow  # starts a child process or runs seconds of real steps
def test_calibrate_reports_progress_then_says_why_it_cannot_fit_yet(store):
    assert (
        list(history_tab.calibrate_view(-1))[-1]
        == "### Not calibrated\nsweep_runs=-1: must be an integer from 0 to 200"
    )
    updates = list(history_tab.calibrate_view(2))  # two short profiled steps: too few setups to fit on
    assert updates[0] == "### Starting the calibration…"
    # From the first second, which run and what it does (the quiet wait for the CPU, then its steps).
    assert updates[1].startswith("### Calibrating: 0 of 2 runs done\nrun 1 of 2, ")
    assert any(u.startswith("### Calibrating: 0 of 2 runs done\nrun 1 of 2, ") and ": step 1/" in u for u in updates)
    assert any(u.startswith("### Calibrating: 1 of 2 runs done\n") for u in updates)
    assert updates[-1].startswith("### Not calibrated\ncalibration needs measured runs of at least 8 different setups")
    assert "there are 2 runs of 2 setups" in updates[-1]
    assert len(store.list_runs()[0]) == 2  # the sweep's runs stay in the store for the next fit


def test_a_cancelled_sweep_starts_no_further_run(store):
    import threading

    from advisor.advice.calibrate import run_sweep, sweep_setups

    cancel = threading.Event()
    cancel.set()
    assert run_sweep(store, sweep_setups(3), cancel=cancel) == []
    assert store.list_runs() == ([], [])


def test_cancel_reaches_only_the_callers_own_job():
    from types import SimpleNamespace

    ana, bo = SimpleNamespace(session_hash="ana"), SimpleNamespace(session_hash="bo")
    jobs = common.Jobs()
    mine, theirs = jobs.start("profile", ana), jobs.start("profile", bo)
    assert jobs.cancel("profile", ana) and mine.is_set() and not theirs.is_set()
    assert not jobs.cancel("calibrate", bo)  # bo has no calibration running
    jobs.finish("profile", bo, theirs)
    assert not jobs.cancel("profile", bo)  # finished: nothing left to cancel
    assert history_tab.cancel_calibration() == "No calibration of yours is running here to cancel."


def test_a_picked_preset_brings_what_it_allows():
    skip = gr.skip()
    # GPT-2 has 1024 learned positions: the default 8192 would fail the estimate at once.
    assert linking.fit_seq_to_model("gpt2-124m", 8192) == 1024
    assert linking.fit_seq_to_model("gpt2-124m", 512) == skip
    assert linking.fit_seq_to_model("llama-3.1-8b", 131072) == skip  # RoPE: no table to run past
    assert linking.fit_seq_to_model(None, 8192) == skip
    summary, *_ = _view(model="gpt2-124m", seq=linking.fit_seq_to_model("gpt2-124m", 8192))
    assert "gpt2-124m" in summary and "Invalid" not in summary
    # Adafactor has no fused kernel: the default fused choice becomes foreach, not an error.
    assert linking.fit_impl_to_optimizer("adafactor", "fused") == "foreach"
    assert linking.fit_impl_to_optimizer("adafactor", "for-loop") == skip
    assert linking.fit_impl_to_optimizer("adamw", "fused") == skip
    # Wired on every tab with a model; on Size, a picked preset also clears a loaded config.json.
    demo = app.build_app()
    fns = [f.fn for f in demo.fns.values()]
    assert (
        sum(f is linking.fit_seq_to_model for f in fns) == 3
        and sum(f is linking.fit_impl_to_optimizer for f in fns) == 2
    )
    deps = demo.config["dependencies"]
    ids = {c._id: c for c in demo.blocks.values()}
    clears = [
        d
        for d in deps
        if d["targets"][0][1] == "input"
        and [type(ids[o]) for o in d["outputs"]] == [gr.File]
        and ids[d["outputs"][0]].label.startswith("…or a Hugging Face config.json")
    ]
    # A preset picked on any of the three tabs clears it (the copy to Size fires no .input there).
    assert len(clears) == 3 and "size-model" in {ids[c["targets"][0][0]].elem_id for c in clears}
    assert all(demo.fns[c["id"]].fn() is None for c in clears)


def test_command_line_flags_and_help_start_no_server(monkeypatch, capsys):
    monkeypatch.setattr(app, "build_app", lambda: pytest.fail("--help must not build or launch the app"))
    with pytest.raises(SystemExit) as done:
        app.main(["--help"])
    assert done.value.code == 0 and "--traces" in capsys.readouterr().out
    monkeypatch.setenv("ADVISOR_PORT", "7999")
    args = app.parse_args(["--host", "0.0.0.0", "--traces", "/tmp/x"])
    assert (args.host, args.port, args.traces) == ("0.0.0.0", 7999, "/tmp/x")
    assert app.parse_args(["--port", "8000"]).port == 8000
    with pytest.raises(SystemExit) as bad:
        app.parse_args(["--port", "70000"])
    assert bad.value.code == 2 and "--port 70000: must be from 1 to 65535" in capsys.readouterr().err
    monkeypatch.setenv("ADVISOR_PORT", "web")
    with pytest.raises(SystemExit):
        app.parse_args([])
    assert "ADVISOR_PORT='web': must be a port number" in capsys.readouterr().err


def test_step_times_read_in_a_unit_that_fits_them():
    from advisor.present.report import fmt_duration

    assert fmt_duration(669.9) == "670 ms" and fmt_duration(9_999) == "9,999 ms"
    assert fmt_duration(80_271) == "80.3 s"
    assert fmt_duration(168_600) == "2.8 min"
    assert fmt_duration(3 * 3600e3) == "3.0 h"
    assert fmt_duration(1_570_584_263_385) == "18,178.1 days"
    summary, *_ = _view(seq=8192)
    # The step time with its error band (the estimate's held-out error on published runs).
    assert re.search(r" · step [\d,]+ ms ±\d+ % · ", summary), summary


def test_the_estimated_mfu_says_it_is_an_ideal_and_how_it_counts():
    from advisor.estimate.estimator import estimate
    from advisor.present.report import mfu_note
    from advisor.spec.setup import make_setup

    summary, *_ = _view()  # Llama-3.1-8B on 8 H200s, flash attention, no recompute
    est = estimate(size_tab.setup_from_size_inputs(*_size_values()))
    # What the MFU rests on: this layout's GEMMs and attention at the rates the model gives their shapes,
    # and the band measured on published runs held out of the fit (advisor/estimate/efficiency_fit.json).
    band = ERROR_BAND.step_pct
    assert (
        f"MFU {100 * est.mfu_frac:.1f} % (±{band:.0f} %): this layout's GEMMs at {100 * est.gemm_frac:.0f} %" in summary
    )
    assert f"attention at {100 * est.attention_frac:.0f} % of the 16-bit peak" in summary
    assert 0.55 < est.gemm_frac < 0.80 and 0.3 < est.attention_frac < 0.6
    assert f"±{band:.0f} % on average (90 % of runs within ±{ERROR_BAND.step_p90_pct:.0f} %)" in summary
    assert "held out of the fit" in summary
    assert "exceeds HFU" in summary  # causal flash executes half the attention the PaLM count has
    full = estimate(make_setup(model="llama-3.1-8b", gpu="h200", gpus=8, seq=2048, recompute="full"))
    assert full.hfu_frac > full.mfu_frac and "adds the recomputed FLOPs" in mfu_note(full)
    assert mfu_note(estimate(make_setup(model="tiny", gpu="cpu"))) == ""  # no GPU datasheet ideal to state


def test_size_tab_export_writes_the_setup_for_download(tmp_path):
    values = _size_values(model="llama-3.1-70b", gpus=64, tp=8, pp=2, recompute="selective", global_batch=64)
    message, path = size_tab.export_view("deepspeed", *values)
    assert message.startswith("### Exported for deepspeed: `llama-3.1-70b-deepspeed.json`")
    assert "DeepSpeed's pipeline needs the model as a PipelineModule(num_stages=2)" in message
    written = json.loads(Path(path).read_text(encoding="utf-8"))
    # 64 GPUs / (tp 8 x pp 2) = dp 4: 64 sequences = micro 1 x 16 micro-batches x 4 ranks.
    assert (written["train_batch_size"], written["gradient_accumulation_steps"]) == (64, 16)
    assert written["tensor_parallel"] == {"autotp_size": 8} and Path(path).name == "llama-3.1-70b-deepspeed.json"
    bad = size_tab.export_view("megatron", *_size_values(optimizer="adafactor", optimizer_impl="foreach"))
    assert bad[0].startswith("### Cannot export this setup") and "train.optimizer='adafactor'" in bad[0]
    assert bad[1] is None


def test_plan_use_this_layout_gives_the_size_tab_the_rows_setup():
    inputs = ("llama-3.1-70b", "h100", 64, 4096, 64, ["bf16"], True, False)
    _, table, _, _ = plan_tab.plan_view(*inputs)
    setup = plan_tab.layout_setup(2, table, *inputs)
    assert layout_used_message(2, setup).startswith(f"### Layout #2 is the current setup\n{table['layout'][1]}")
    # The Size tab's widgets, set from it, describe that very setup (dropdown degrees as text).
    values = size_tab.size_values(setup)
    assert size_tab.setup_from_size_inputs(*[values.get(k) for k in size_tab.SIZE_KEYS]) == setup
    with pytest.raises(AdvisorError, match="rank=0: must be a rank of the table, 1 to 10"):
        plan_tab.layout_setup(0, table, *inputs)
    with pytest.raises(AdvisorError, match="the Plan inputs changed since this table was made"):
        plan_tab.layout_setup(1, table, "llama-3.1-70b", "h100", 128, 4096, 64, ["bf16"], True, False)
    with pytest.raises(AdvisorError, match="press Plan first"):
        plan_tab.layout_setup(1, None, *inputs)


def test_a_degree_the_dropdown_lacks_is_added_to_its_choices():
    with gr.Blocks():
        pp = common.degree_dropdown([1, 2, 4, 8], 1, "PP")
    shown = linking._shown(pp, "5")  # the planner splits 80 blocks over 5 stages; the dropdown has no 5
    assert shown.value == "5" and [c for _, c in shown.choices] == ["1", "2", "4", "8", "5"]
    assert linking._shown(pp, "4") == "4"
