"""The app over HTTP as an API client sees it: each public endpoint through gradio_client, then abuse
(concurrent requests, a profile queued behind another, malformed and oversized uploads, a crashing child).

One real server per module, launched as ``app.main()`` launches it, with its run store in a temporary folder.
"""

import gzip
import json
import os
import socket
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
app = pytest.importorskip("app")
gradio_client = pytest.importorskip("gradio_client")
httpx = pytest.importorskip("httpx")

from advisor.run.launcher import profile_run  # noqa: E402
from advisor.spec.defaults import DEFAULTS  # noqa: E402
from advisor.spec.options import RunOptions  # noqa: E402 (after the skips)
from advisor.spec.setup import make_setup  # noqa: E402
from advisor.store.runstore import RunStore  # noqa: E402
from tests.shared import SHARED_TRACES  # noqa: E402
from webui import common  # noqa: E402
from webui import size as size_tab  # noqa: E402

TRACES = SHARED_TRACES
KINETO_RANK0 = TRACES / "kineto" / "trace_filter" / "sampled_rank-0.json.gz"
TINY_CPU_RUN = {"model": "tiny", "seq": 64, "micro_batch": 1, "steps": 1, "device": "cpu"}
PROFILE_TIMEOUT_S = 180  # a generous bound on waiting, not a speed assertion: a tiny CPU step takes seconds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(demo, url, store, client) of the running app; closed after the module."""
    store = RunStore(tmp_path_factory.mktemp("runs"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(common, "store", lambda: store)
        demo = app.build_app()
        _, url, _ = demo.queue(default_concurrency_limit=16).launch(
            server_name="127.0.0.1",
            server_port=_free_port(),
            prevent_thread_lock=True,
            max_file_size=app.MAX_UPLOAD,
            allowed_paths=[str(store.root)],
            quiet=True,
        )
        try:
            client = gradio_client.Client(url, verbose=False, download_files=False)
            yield SimpleNamespace(demo=demo, url=url, store=store, client=client)
        finally:
            demo.close()


_DEGREE_WIDGETS = ("tp", "pp", "vpp", "cp", "ep", "zero")


def _size_values(**changes) -> list:
    """The Size tab's inputs in widget order (the config file second), as /size and /advise take them;
    parallel degrees as the text choices their dropdowns document."""
    values = {**DEFAULTS, **changes}
    values |= {k: str(values[k]) for k in _DEGREE_WIDGETS}
    return [values["model"], None, *[values[k] for k in list(DEFAULTS)[1:]]]


def _rows(table: dict) -> list[dict]:
    return [dict(zip(table["headers"], row, strict=True)) for row in table["data"]]


def _run_id(summary: str) -> str:
    return summary.split("`")[1]  # "### Run `<id>`: <status>"


def _fetch(file_data: dict) -> bytes:
    response = httpx.get(file_data["url"], timeout=30)
    response.raise_for_status()
    return response.content


def _still_serves(client) -> None:
    summary, *_ = client.predict(*_size_values(), api_name="/size")
    assert summary.startswith("### FITS")


@pytest.fixture(scope="module")
def profiled(served):
    """The intermediate and final outputs of one tiny CPU run profiled through /profile."""
    job = served.client.submit(**TINY_CPU_RUN, api_name="/profile")
    final = job.result(timeout=PROFILE_TIMEOUT_S)
    return job.outputs(), final


# --- Each endpoint ---


def test_the_client_sees_each_tabs_main_action(served):
    endpoints = served.client.view_api(print_info=False, return_format="dict")["named_endpoints"]
    assert set(endpoints) == {
        "/size", "/export", "/profile", "/open_run", "/analyze", "/perfetto", "/advise", "/verify", "/plan",
        "/compare", "/calibrate", "/report",
    }  # fmt: skip


def test_size_with_default_values(served):
    summary, mem_fig, time_fig, mem_table, time_table = served.client.predict(config_file=None, api_name="/size")
    assert summary.startswith("### FITS") and "tokens/s" in summary and "MFU" in summary
    assert summary == size_tab.size_view(**DEFAULTS, config_file=None)[0]  # the same answer as in process
    assert mem_fig["type"] == "plotly" and time_fig["type"] == "plotly"
    mem = _rows(mem_table)
    assert [r["component"] for r in mem][:4] == ["weights", "gradients", "optimizer states", "activations"]
    fits_gib = float(summary.split("FITS: ")[1].split(" GiB")[0])
    assert sum(r["GiB"] for r in mem) == pytest.approx(fits_gib, abs=0.1)
    assert sum(r["ms"] for r in _rows(time_table)) > 0


def test_size_reports_bad_input_as_a_message(served):
    summary, mem_fig, *_ = served.client.predict(*_size_values(tp=64), api_name="/size")
    assert summary.startswith("### Invalid setup") and "must be a multiple of tp x pp x cp = 64" in summary
    assert mem_fig is None


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        # Once refused by Gradio before the handler: "Value: 3 is not in the list of choices" (naming no
        # widget), or for text in a number field no message at all ({"error": null}); issue 22.
        ({"gpus": "abc"}, "gpus='abc': must be an integer from 1 to 1048576"),
        ({"gpus": [8]}, "gpus=[8]: must be an integer from 1 to 1048576"),
        ({"seq": "nan"}, "train.seq_len='nan': must be an integer from 1 to 16777216"),
        ({"micro_batch": 10**400}, "train.micro_batch=10000000000000000000...(401 digits): must be an integer"),
        ({"precision": "int8"}, "train.precision='int8': must be one of fp32, bf16, fp16, fp8"),
        ({"tp": "3"}, "gpus=8: must be a multiple of tp x pp x cp = 3"),
        ({"model": "nope"}, "model='nope': unknown preset"),
        ({"model": None}, "model=None: unknown preset"),
        ({"flash_attention": "x"}, "flash_attention='x': must be true or false"),
    ],
)
def test_hostile_api_values_reach_the_handler_and_are_refused_by_name(served, changes, words):
    summary, mem_fig, *_ = served.client.predict(*_size_values(**changes), api_name="/size")
    assert summary.startswith("### Invalid setup") and words in summary, summary
    assert mem_fig is None


def test_hostile_plan_values_are_refused_by_name(served):
    for args, words in (
        (("tiny", "h100", "abc", 256, 64, ["bf16"], True, False), "gpus='abc': must be an integer"),
        (("tiny", "h100", 8, 256, str(10**18), ["bf16"], True, False), "global_batch=1000000000000000000: must be"),
        (("tiny", "h100", 8, 256, 64, ["bf17"], True, False), "precisions='bf17': unknown precision"),
        (("tiny", "nope", 8, 256, 64, ["bf16"], True, False), "gpu='nope': unknown device"),
    ):
        summary, *_ = served.client.predict(*args, api_name="/plan")
        assert summary.startswith("### Cannot plan") and words in summary, summary
    _still_serves(served.client)


def test_plan_ranks_layouts_by_throughput(served):
    summary, table, explain, scatter = served.client.predict(
        "llama-3.1-8b", "h100", 8, 4096, 64, ["bf16"], True, api_name="/plan"
    )
    assert summary.startswith("### ") and "layouts of" in summary and explain
    assert scatter["type"] == "plotly"
    rows = _rows(table)
    assert rows and [r["rank"] for r in rows] == list(range(1, len(rows) + 1))
    assert [r["tokens/s"] for r in rows] == sorted((r["tokens/s"] for r in rows), reverse=True)
    assert all(0 < r["memory %"] <= 100 for r in rows)


def test_advise_on_the_size_setup_that_does_not_fit(served):
    summary, table, report, files = served.client.predict(
        "Size tab setup", None, None, *_size_values(model="llama-3.1-70b", gpus=8, zero=0), api_name="/advise"
    )
    assert "Out of memory, model states dominate" in summary
    top = _rows(table)[0]
    assert top["rule"] == "mem-oom-model-state" and top["severity"] == "critical" and top["predicted gain %"] > 0
    assert report.startswith("# Advice for the Size tab's setup")
    assert [f["orig_name"] for f in files] == ["advice.md", "advice.json"]
    assert _fetch(files[0]).decode().startswith("# Advice") and b'"recommendations"' in _fetch(files[1])


@pytest.mark.skipif(not KINETO_RANK0.is_file(), reason=f"real traces live in {TRACES} (absent here)")
def test_analyze_an_uploaded_real_trace(served):
    out = served.client.predict(gradio_client.handle_file(str(KINETO_RANK0)), None, api_name="/analyze")
    summary, temporal, categories, timeline, top, idle, collectives, roofline, roofline_table = out[:9]
    picker, picked = out[9:]  # the state of every table stays on the server
    # HTA's reference for this rank (../shared/traces/README.md): idle 53.56, compute 17.71,
    # non-compute 28.74 %, comm/comp overlap 11.81 %.
    assert "sampled_rank-0.json.gz: 1 rank(s), cuda" in summary
    assert "rank 0:  53.6 /  17.7 /  28.7" in summary and "overlapped by computation: 11.8 %" in summary
    assert temporal["type"] == "plotly" and categories["type"] == "plotly" and timeline["type"] == "plotly"
    first = _rows(top)[0]
    assert first["name"].startswith("ncclKernel_SendRecv") and first["category"] == "communication"
    assert {r["idle_category"] for r in _rows(idle)} <= {"host_wait", "kernel_wait", "other"}
    # The NCCL kernels of the one complete step kept (HTA drops the last, cut-off one): 2 all-reduces,
    # 1 all-gather, 2 all-to-alls, half of the two steps' counts in tests/test_collectives.py.
    calls = {r["kind"]: r["calls"] for r in _rows(collectives)}
    assert calls == {"all_reduce": 2, "all_gather": 1, "all_to_all": 2}
    assert all(0 <= r["exposed_ms"] <= r["time_ms"] for r in _rows(collectives))
    # Its GEMM kernels sit on the roofline (the trace was recorded with shapes) against an A100's roofs.
    assert roofline["type"] == "plotly" and "Roofline verdict: latency/launch-bound" in summary
    assert any("s1688gemm" in r["name"] for r in _rows(roofline_table))
    # "All analyses" shows the idle table first: HTA's 53.56 % idle of this rank, beside compute idle.
    assert picker["value"] == "gpu_idle" and ["gpu_idle (2 rows)", "gpu_idle"] in picker["choices"]
    assert picked["label"].startswith("gpu_idle: idle per device")
    device = _rows(picked["value"])[0]
    assert device["scope"] == "device" and round(device["idle_pct"], 2) == 53.56


def test_profile_runs_a_tiny_cpu_step_into_the_store(served, profiled):
    updates, (summary, phases, memory, nvml, timeline, top_ops, trace, roofline) = profiled
    assert updates[0][0].startswith("### Starting") and any(u[0].startswith("### Running: ") for u in updates)
    assert "`: ok" in summary and "tokens/s" in summary and nvml is None
    assert phases["type"] == "plotly" and memory["type"] == "plotly" and timeline["type"] == "plotly"
    assert roofline["type"] == "plotly"
    assert "aten::mm" in {r["op"] for r in _rows(top_ops)}
    assert trace["orig_name"] == "trace.json.gz" and json.loads(gzip.decompress(_fetch(trace)))["traceEvents"]
    run = served.store.load(_run_id(summary))
    assert run.status == "ok" and run.metrics()["model_name"] == "tiny"


def test_open_analyze_and_verify_a_stored_run(served, profiled):
    summary = profiled[1][0]
    run_id = _run_id(summary)
    assert served.client.predict(run_id, api_name="/open_run")[0] == summary
    analysed = served.client.predict(None, run_id, api_name="/analyze")[0]
    assert f"{run_id}: 1 rank(s), cpu" in analysed
    message, table, categories, changes = served.client.predict(run_id, "no-such-rule", api_name="/verify")
    assert message.startswith(f"### Cannot verify\nrule 'no-such-rule' did not fire on run {run_id}")
    for empty in (table, categories, changes):
        assert empty["data"] == [] or empty["data"] == [[]]
    assert categories["headers"][:4] == ["category", "before ms", "after ms", "change ms"]
    bad = served.client.predict("../../etc", api_name="/open_run")[0]
    assert bad.startswith("### Cannot open run\nrun id '../../etc' is not valid")


# --- Abuse ---


def test_twenty_concurrent_size_requests_each_get_their_own_verdict(served):
    seqs = [512 * k for k in range(1, 21)]
    jobs = [served.client.submit(*_size_values(seq=s), api_name="/size") for s in seqs]
    answers = [job.result(timeout=120)[0] for job in jobs]
    assert all(a.startswith(("### FITS", "### DOES NOT FIT")) for a in answers)
    # Each answer belongs to its own request: no crossed or dropped replies under load.
    assert answers == [size_tab.size_view(*_size_values(seq=s))[0] for s in seqs]
    assert len(set(answers)) == len(seqs)


def test_a_second_profile_waits_for_the_first_and_both_are_filed(served):
    jobs = [served.client.submit(**TINY_CPU_RUN, api_name="/profile") for _ in range(2)]
    ids = [_run_id(job.result(timeout=2 * PROFILE_TIMEOUT_S)[0]) for job in jobs]
    assert len(set(ids)) == 2
    first, second = sorted((served.store.load(i).record for i in ids), key=lambda r: r["created_utc"])
    assert first["status"] == second["status"] == "ok"
    # One device, concurrency 1: the second run starts only after the first has finished.
    assert second["created_utc"] >= first["finished_utc"]


NOT_A_TRACE = "is not a trace this tool reads; expected Kineto JSON"


@pytest.mark.parametrize(
    ("name", "content", "words"),
    [
        ("garbage.json", b"\x00\xff{{ not a trace", NOT_A_TRACE),
        (
            "garbage.json.gz",
            gzip.compress(b'{"traceEvents": ['),
            "ends inside its traceEvents array: the file is truncated",
        ),
        ("garbage.gz", b"not gzip at all", NOT_A_TRACE),
        ("garbage.zip", b"PK\x03\x04 truncated", NOT_A_TRACE),
    ],
    ids=["binary-json", "truncated-json-gz", "not-gzip", "broken-zip"],
)
def test_a_malformed_upload_gets_a_clear_message(served, tmp_path, name, content, words):
    bad = tmp_path / name
    bad.write_bytes(content)
    summary, temporal, categories, *_ = served.client.predict(
        gradio_client.handle_file(str(bad)), None, api_name="/analyze"
    )
    assert summary.startswith(f"### Cannot analyze this trace\n{name} {words}"), summary
    assert temporal is None and categories is None
    _still_serves(served.client)


def test_an_upload_of_another_file_type_is_refused_before_the_handler(served, tmp_path):
    exe = tmp_path / "tool.exe"
    exe.write_bytes(b"MZ\x90\x00")
    with pytest.raises(gradio_client.exceptions.AppError, match=r"Invalid file type.*'\.json', '\.gz', '\.zip'"):
        served.client.predict(gradio_client.handle_file(str(exe)), None, api_name="/analyze")
    _still_serves(served.client)


def test_uploads_over_the_limit_are_refused(served, monkeypatch):
    # The launched app advertises app.MAX_UPLOAD; the client refuses larger files before sending.
    assert served.client.config["max_file_size"] == 500 * 2**20
    # Sending 500 MB to prove the server refuses it too would cost seconds and disk, so the server's
    # limit (read from the Blocks on each upload) is lowered while a raw upload bypasses the client.
    monkeypatch.setattr(served.demo, "max_file_size", 1024)
    upload_url = f"{served.url}gradio_api/upload"
    big = httpx.post(upload_url, files={"files": ("big.json", b"x" * 4096)}, timeout=30)
    assert big.status_code == 413 and "maximum allowed size of 1024 bytes" in big.text
    small = httpx.post(upload_url, files={"files": ("small.json", b"{}")}, timeout=30)
    assert small.status_code == 200 and small.json()[0].endswith("small.json")
    _still_serves(served.client)


def test_a_crashing_child_leaves_the_app_serving_and_the_store_consistent(served):
    # The app does not expose the child's failure hook, so the crash is filed into the same store by
    # the runner directly, while a run requested through the app is in flight.
    served_job = served.client.submit(**TINY_CPU_RUN, api_name="/profile")
    crash = {}
    crasher = threading.Thread(
        target=lambda: crash.update(
            run=profile_run(
                make_setup(model="tiny", gpu="cpu", seq=64, micro_batch=1),
                RunOptions(device="cpu", steps=1, warmup=0, inject="crash", timeout_s=PROFILE_TIMEOUT_S),
                served.store,
            )
        )
    )
    crasher.start()
    crasher.join(timeout=PROFILE_TIMEOUT_S)
    crashed = crash["run"]
    assert crashed.status == "crashed" and "SIGABRT" in crashed.record["message"] and crashed.metrics() is None
    served_id = _run_id(served_job.result(timeout=PROFILE_TIMEOUT_S)[0])

    runs, damaged = served.store.list_runs()
    assert damaged == []
    statuses = {r.run_id: r.status for r in runs}
    assert statuses[crashed.run_id] == "crashed" and statuses[served_id] == "ok"
    assert list((served.store.root / ".staging").iterdir()) == []
    opened = served.client.predict(crashed.run_id, api_name="/open_run")[0]
    assert opened.startswith(f"### Run `{crashed.run_id}`: crashed\nthe child died with SIGABRT")
    _still_serves(served.client)


def test_compare_two_stored_runs(served):
    import shutil

    samples = ("20261130-165248-tiny-6bcb2f", "20261130-165253-tiny-617152")  # shipped under traces/
    for run_id in samples:
        shutil.copytree(Path(app.__file__).parent / "traces" / run_id, served.store.root / run_id)
    summary, diff, metrics, figure = served.client.predict(*samples, api_name="/compare")
    # Their metrics.json: 65.07 ms per step in fp32 without recompute, 59.99 ms in bf16 with full recompute.
    assert "(59.99 vs 65.07 ms)" in summary
    fields = {r["field"]: (r["a"], r["b"]) for r in _rows(diff)}
    assert fields["train.precision"] == ("fp32", "bf16") and fields["train.recompute"] == ("none", "full")
    step = next(r for r in _rows(metrics) if r["metric"] == "step time (ms)")
    assert step["change_pct"] == pytest.approx(100 * (59.99 - 65.07) / 65.07, abs=0.02)
    assert figure["type"] == "plotly"
    bad = served.client.predict(samples[0], "../../etc", api_name="/compare")[0]
    assert bad.startswith("### Cannot compare\nrun id '../../etc' is not valid")


def test_calibrate_says_why_it_cannot_fit_on_too_few_runs(served):
    # With no sweep, the fit uses the store's runs of this device: a handful of tiny setups at most.
    message = served.client.predict(0, api_name="/calibrate")
    assert message.startswith("### Not calibrated\ncalibration needs measured runs of at least 8 different setups")
    # Beyond the widget's bound: refused by the calibration, naming the field (no longer by Gradio, unnamed).
    message = served.client.predict(500, api_name="/calibrate")
    assert message == "### Not calibrated\nsweep_runs=500: must be an integer from 0 to 200", message
    _still_serves(served.client)
