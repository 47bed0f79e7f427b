"""Run history on the two shipped CPU runs: the table and its filters, the comparison, predicted vs
measured, the figures and the CLI. Expected figures are read off the runs' metrics.json by hand."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pandas as pd
import pytest

from advisor.cli import main
from advisor.errors import AdvisorError
from advisor.present.charts import compare_phase_figure, predicted_measured_figure
from advisor.store.history import (
    RUN_COLUMNS,
    VERIFICATIONS_DIR,
    compare_runs,
    filter_choices,
    predicted_vs_measured,
    run_table,
)
from advisor.store.runstore import RunStore

TRACES = Path(__file__).resolve().parent.parent / "traces"
RUN_A = "20261130-165248-tiny-6bcb2f"  # fp32, no recompute
RUN_B = "20261130-165253-tiny-617152"  # bf16, full recompute
OOM = "20261201-090000-gpt2-124m-abcdef"
STEP_A_MS, STEP_B_MS = 65.07040699989375, 59.98958349982786
ESTIMATE_A_MS, ESTIMATE_B_MS = 97.46653866666666, 112.14114133333334


@pytest.fixture
def store(tmp_path: Path) -> RunStore:
    """The two shipped runs, a newer run that ran out of memory on a GPU (no metrics), and a damaged entry."""
    for run_id in (RUN_A, RUN_B):
        shutil.copytree(TRACES / run_id, tmp_path / run_id, ignore=shutil.ignore_patterns("trace.json.gz"))
    record = json.loads((tmp_path / RUN_A / "run.json").read_text())
    record.update(run_id=OOM, status="oom", message="out of memory: CUDA out of memory. Tried to allocate 2.00 GiB")
    record["created_utc"] = "2026-12-01T09:00:00Z"
    record["setup"]["model"]["name"] = "gpt2-124m"
    record["setup"]["train"].update(micro_batch=4, global_batch=16)
    record["setup"]["hardware"].update(kind="gpu", name="NVIDIA H100 80GB HBM3")
    (tmp_path / OOM).mkdir()
    (tmp_path / OOM / "run.json").write_text(json.dumps(record))
    (tmp_path / "20261202-000000-x-000000").mkdir()
    (tmp_path / "20261202-000000-x-000000" / "run.json").write_text("{oops")
    return RunStore(tmp_path)


def _row(table: pd.DataFrame, run_id: str) -> pd.Series:
    return table.set_index("run_id").loc[run_id]


def test_run_table_lists_runs_newest_first_with_units(store):
    table = run_table(store)
    assert list(table.columns) == list(RUN_COLUMNS)
    assert list(table["run_id"]) == [OOM, RUN_B, RUN_A, "20261202-000000-x-000000"]
    assert list(table["status"]) == ["oom", "ok", "ok", "damaged"]
    a = _row(table, RUN_A)
    assert a["started_utc"] == "2026-11-30 16:52:48"
    assert (a["model"], a["device_type"], a["precision"], a["recompute"]) == ("tiny", "cpu", "fp32", "none")
    assert (a["seq_len"], a["micro_batch"], a["grad_accum"]) == (128, 2, 1)
    assert a["step_time_ms"] == pytest.approx(STEP_A_MS)
    assert a["estimate_step_time_ms"] == pytest.approx(ESTIMATE_A_MS)
    assert a["tokens_per_s"] == pytest.approx(3934.200073474537)
    assert a["mfu_pct"] == pytest.approx(64.65936504756871)
    assert a["peak_memory_gib"] == pytest.approx(107763888 / 2**30)
    assert _row(table, RUN_B)["step_time_ms"] == pytest.approx(STEP_B_MS)


def test_a_run_without_metrics_keeps_its_row_from_the_setup(store):
    oom = _row(run_table(store), OOM)
    # No metrics.json: the shape comes from run.json's setup; 16 sequences / (4 per micro-batch x dp 1).
    assert (oom["model"], oom["device_type"], oom["device_name"]) == ("gpt2-124m", "cuda", "NVIDIA H100 80GB HBM3")
    assert (oom["micro_batch"], oom["grad_accum"]) == (4, 4)
    assert all(math.isnan(oom[c]) for c in ("step_time_ms", "tokens_per_s", "mfu_pct", "peak_memory_gib"))
    assert oom["message"].startswith("out of memory")
    damaged = _row(run_table(store), "20261202-000000-x-000000")
    assert damaged["message"] == "run.json is unreadable (JSONDecodeError)" and math.isnan(damaged["step_time_ms"])


def test_filters_and_their_choices(store):
    def ids(**filters: str | None) -> list[str]:
        return list(run_table(store, **filters)["run_id"])

    assert ids(model="tiny") == [RUN_B, RUN_A]
    assert ids(status="oom") == [OOM]
    assert ids(device="cuda") == [OOM]
    assert ids(device="cpu", status="ok") == [RUN_B, RUN_A]
    assert ids(text="OUT OF MEMORY") == [OOM]
    assert ids(text="617152") == [RUN_B]
    assert ids(model="", status=None, text="  ") == ids()
    assert ids(model="llama-3.1-8b") == []
    choices = filter_choices(run_table(store))
    assert choices.models == ("gpt2-124m", "tiny")
    assert choices.statuses == ("damaged", "ok", "oom")
    assert choices.devices == ("cpu", "cuda")


def test_compare_two_runs(store):
    c = compare_runs(store, RUN_A, RUN_B)
    assert c.spec_diff.to_dict("records") == [
        {"field": "train.precision", "a": "fp32", "b": "bf16"},
        {"field": "train.recompute", "a": "none", "b": "full"},
    ]
    m = c.metrics.set_index("metric")
    assert list(m.columns) == ["a", "b", "change_pct"]
    assert m.loc["step time (ms)", "a"] == pytest.approx(STEP_A_MS)
    assert m.loc["step time (ms)", "b"] == pytest.approx(STEP_B_MS)
    # (59.990 - 65.070) / 65.070 = -7.81 %
    assert m.loc["step time (ms)", "change_pct"] == pytest.approx(-7.8082, abs=1e-3)
    # forward (15.785 - 20.930) / 20.930 = -24.58 %; peak memory (92,704,688 - 107,763,888) / 107,763,888 = -13.97 %
    assert m.loc["forward (ms)", "change_pct"] == pytest.approx(-24.585, abs=1e-3)
    assert m.loc["peak memory (GiB)", "change_pct"] == pytest.approx(-13.974, abs=1e-3)
    assert m.loc["peak memory (GiB)", "b"] == pytest.approx(92704688 / 2**30)
    # Same FLOPs per step and peak on both runs, so MFU moves exactly as tokens/s: +8.47 %.
    assert m.loc["tokens/s", "change_pct"] == pytest.approx(8.4695, abs=1e-3)
    assert m.loc["MFU (%)", "change_pct"] == pytest.approx(m.loc["tokens/s", "change_pct"])
    assert m.loc["MFU (%)", "a"] == pytest.approx(64.65936504756871)
    assert m.loc["estimate step time (ms)", "b"] == pytest.approx(ESTIMATE_B_MS)
    assert c.summary == (
        "B's step is 7.8 % shorter than A's (59.99 vs 65.07 ms); tokens/s +8.5 %; peak memory -14.0 %; "
        "2 fields differ: train.precision, train.recompute."
    )
    back = compare_runs(store, RUN_B, RUN_A)
    assert back.summary.startswith("B's step is 8.5 % longer than A's (65.07 vs 59.99 ms)")
    same = compare_runs(store, RUN_A, RUN_A)
    assert same.spec_diff.empty and same.summary.endswith("same setup and options.")


def test_compare_lists_changed_options_and_fields_one_record_lacks(store, capsys):
    path = store.root / RUN_B / "run.json"
    record = json.loads(path.read_text())
    record["options"]["num_workers"] = 2
    del record["options"]["inject"]  # as a record written before the field existed
    path.write_text(json.dumps(record))
    diff = compare_runs(store, RUN_A, RUN_B).spec_diff.set_index("field")
    # The record without inject ran with its default, "", which A has: no difference (an old run beside a
    # new one once listed 24 such fields). One it lacks whose other side is not the default is listed.
    assert list(diff.index) == ["train.precision", "train.recompute", "options.num_workers"]
    assert (diff.loc["options.num_workers", "a"], diff.loc["options.num_workers", "b"]) == (0, 2)
    record["options"]["nproc"] = 2
    path.write_text(json.dumps(record))
    (store.root / RUN_A / "run.json").write_text(
        json.dumps(json.loads((store.root / RUN_A / "run.json").read_text()) | {"options": {"nproc": 1}})
    )
    diff = compare_runs(store, RUN_A, RUN_B).spec_diff.set_index("field")
    assert (diff.loc["options.nproc", "a"], diff.loc["options.nproc", "b"]) == (1, 2)
    assert main(["compare", RUN_A, RUN_B, "--traces", str(store.root), "--json"]) == 0
    rows = {r["field"]: r for r in json.loads(capsys.readouterr().out)["spec_diff"]}
    assert rows["options.nproc"] == {"field": "options.nproc", "a": 1, "b": 2}
    assert rows["options.num_workers"]["a"] is None and rows["options.num_workers"]["b"] == 2  # A lacks it now


@pytest.mark.parametrize(
    ("run_id", "message"),
    [
        ("../etc", "is not valid"),
        ("20261130-165248-tiny-000000", "no run 20261130-165248-tiny-000000"),
        ("20261202-000000-x-000000", "is damaged"),
        (OOM, f"run {OOM} has no measured step to compare \\(status oom: out of memory"),
    ],
)
def test_compare_refuses_bad_unknown_and_failed_runs(store, run_id, message):
    with pytest.raises(AdvisorError, match=message):
        compare_runs(store, RUN_A, run_id)
    with pytest.raises(AdvisorError, match=message):
        compare_runs(store, run_id, RUN_A)


def _write_pairs(store: RunStore) -> None:
    folder = store.root / VERIFICATIONS_DIR
    folder.mkdir()
    pair = {"run_id": RUN_A, "new_run_id": RUN_B, "before": STEP_A_MS, "upper_bound": False}
    pairs = {
        "time": {**pair, "rule_id": "r-time", "target": "step_time_ms", "predicted_after": 50.0},
        "tokens": {**pair, "rule_id": "r-tokens", "target": "tokens_per_s", "predicted_after": 5000.0},
        "memory": {**pair, "rule_id": "r-mem", "target": "peak_memory_bytes", "predicted_after": 9e7},
    }
    pairs["time"]["measured_after"] = STEP_B_MS
    pairs["tokens"]["measured_after"] = 4267.407524186839
    pairs["memory"]["measured_after"] = 92704688
    for name, p in pairs.items():
        (folder / f"{RUN_A}--{name}--{RUN_B}.json").write_text(json.dumps(p))
    (folder / "broken.json").write_text("{")


def test_predicted_vs_measured(store):
    from advisor.advice.verify import VERIFY_DIR

    assert VERIFICATIONS_DIR == VERIFY_DIR
    df = predicted_vs_measured(store)
    assert list(df["kind"]) == ["run estimate", "run estimate"] and set(df["run_id"]) == {RUN_A, RUN_B}
    a = _row(df, RUN_A)
    assert (a["predicted_ms"], a["measured_ms"]) == pytest.approx((ESTIMATE_A_MS, STEP_A_MS))
    # The estimator over-predicts these CPU steps: 65.07 / 97.47 = 0.668.
    assert a["measured_over_predicted"] == pytest.approx(0.66762, abs=1e-4)
    _write_pairs(store)
    df = predicted_vs_measured(store)
    gains = df[df["kind"] == "verified gain"].set_index("rule_id")
    # The memory pair is not a time and the broken file is skipped.
    assert sorted(gains.index) == ["r-time", "r-tokens"]
    assert gains.loc["r-time", "predicted_ms"] == 50.0 and gains.loc["r-time", "measured_ms"] == STEP_B_MS
    assert (gains.loc["r-time", "run_id"], gains.loc["r-time", "base_run_id"]) == (RUN_B, RUN_A)
    # 256 tokens per step: 1000 * 256 / 5000 tokens/s = 51.2 ms predicted; 256 / 4267.4 = 59.99 ms measured.
    assert gains.loc["r-tokens", "predicted_ms"] == pytest.approx(51.2)
    assert gains.loc["r-tokens", "measured_ms"] == pytest.approx(STEP_B_MS)
    assert gains.loc["r-tokens", "model"] == "tiny" and gains.loc["r-tokens", "device_type"] == "cpu"


def test_figures(store):
    c = compare_runs(store, RUN_A, RUN_B)
    fig = compare_phase_figure(c.metrics_a, c.metrics_b, "A fp32", "B bf16")
    assert len(fig.data) == 2 and {t.name for t in fig.data} == {"A fp32", "B bf16"}
    a = next(t for t in fig.data if t.name == "A fp32")
    assert list(a.y) == ["data", "forward", "backward", "optimizer", "other"]
    assert a.x[1] == pytest.approx(20.930467000198405) and fig.layout.barmode == "group"

    _write_pairs(store)
    fig = predicted_measured_figure(predicted_vs_measured(store))
    assert [t.name for t in fig.data] == ["run estimate", "verified gain", "measured = predicted"]
    assert fig.data[2].line.dash == "dash" and fig.layout.xaxis.type == "linear"
    assert fig.data[0].customdata[0][0] in (RUN_A, RUN_B)
    wide = pd.DataFrame(
        {
            "kind": ["run estimate"] * 2,
            "run_id": ["a", "b"],
            "rule_id": ["", ""],
            "predicted_ms": [1.0, 900.0],
            "measured_ms": [2.0, 1000.0],
            "measured_over_predicted": [2.0, 1000 / 900],
        }
    )
    assert predicted_measured_figure(wide).layout.yaxis.type == "log"
    assert len(predicted_measured_figure(wide.iloc[:0]).data) == 0


def test_cli_compare_and_runs_filters(store, capsys):
    root = str(store.root)
    assert main(["compare", RUN_A, RUN_B, "--traces", root]) == 0
    out = capsys.readouterr().out
    assert "B's step is 7.8 % shorter than A's" in out
    assert "train.precision" in out and "fp32 -> bf16" in out and "-7.8 %" in out
    assert main(["compare", RUN_A, RUN_B, "--traces", root, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["spec_diff"][1] == {"field": "train.recompute", "a": "none", "b": "full"}
    assert data["metrics"][0]["change_pct"] == pytest.approx(-7.8082, abs=1e-3)
    assert main(["compare", RUN_A, OOM, "--traces", root]) == 2
    assert f"error: run {OOM} has no measured step to compare (status oom" in capsys.readouterr().err

    assert main(["runs", "--traces", root, "--status", "oom"]) == 0
    out = capsys.readouterr().out
    assert OOM in out and RUN_A not in out
    assert main(["runs", "--traces", root, "--device", "cpu", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["run_id"] for r in data["runs"]] == [RUN_B, RUN_A] and data["damaged"] == []
    assert main(["runs", "--traces", root, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["runs"][0]["step_time_ms"] is None
    assert data["damaged"] == [
        {"name": "20261202-000000-x-000000", "reason": "run.json is unreadable (JSONDecodeError)"}
    ]
    assert main(["runs", "--traces", root, "--model", "nope"]) == 0
    assert "no runs match these filters" in capsys.readouterr().out


def test_one_differing_field_is_singular():
    from advisor.store.history import _summary

    a = {"step_time_ms": 10.0}
    assert _summary(a, a, ["train.seq_len"]).endswith("; 1 field differs: train.seq_len.")
