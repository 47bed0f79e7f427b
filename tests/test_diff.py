"""Trace diff: hand-built pairs with hand-checked deltas, the shipped CPU runs against their raw JSON, the
nsys before/after pair against sqlite3, the CLI, and the Re-run view's before/after tables."""

from __future__ import annotations

import gzip
import json
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from advisor.analysis.diff import MIN_DELTA_NS, NVTX_OP_RE, diff_paths, format_diff, trace_diff
from advisor.cli import main
from advisor.errors import AdvisorError
from advisor.trace.table import concat_tables, empty_table, make_table
from tests.shared import SHARED_TRACES, needs_shared_traces

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_A, SAMPLE_B = "20261130-165248-tiny-6bcb2f", "20261130-165253-tiny-617152"  # shipped under traces/
NSYS = SHARED_TRACES / "nsys"
US = 1_000


def _trace(steps: int, step_us: int, per_step: list[tuple], rank: int = 0) -> pd.DataFrame:
    """A one-rank GPU trace of ``steps`` ProfilerStep ranges of ``step_us`` each. ``per_step``: the ops of
    one step as (op name, start us, dur us, kernel name or None, kernel start us, kernel dur us), each
    op launching its kernel from a runtime call 5 us into it."""
    cols = {k: [] for k in ("kind", "name", "start_ns", "dur_ns", "device", "stream", "tid", "correlation")}

    def add(kind, name, start, dur, device=-1, stream=-1, tid=-1, corr=-1):
        for k, v in zip(cols, (kind, name, start, dur, device, stream, tid, corr), strict=True):
            cols[k].append(v)

    corr = 0
    for s in range(steps):
        t0 = s * step_us * US
        add("annotation", f"ProfilerStep#{s + 1}", t0, step_us * US, tid=1)
        for op, start, dur, kernel, k_start, k_dur in per_step:
            add("cpu_op", op, t0 + start * US, dur * US, tid=1)
            if kernel:
                corr += 1
                add("runtime", "cudaLaunchKernel", t0 + (start + 5) * US, 5 * US, tid=1, corr=corr)
                add("kernel", kernel, t0 + k_start * US, k_dur * US, device=0, stream=7, corr=corr)
    return make_table({"rank": rank, **cols})


GEMM, ELEMENTWISE = "sm80_gemm_kernel", "vectorized_elementwise_kernel"
# Per step of A (1,000 us): aten::linear around aten::mm, which launches a 200 us GEMM; aten::add and
# an elementwise kernel of 100 us; aten::old and a 50 us softmax kernel.
A_OPS = [
    ("aten::linear", 0, 110, None, 0, 0),
    ("aten::mm", 0, 100, GEMM, 20, 200),
    ("aten::add", 300, 50, ELEMENTWISE, 320, 100),
    ("aten::old", 400, 20, "softmax_kernel", 430, 50),
]
# Per step of B (900 us): the GEMM made faster (100 us), aten::add called twice, aten::old gone, aten::new
# added with a 30 us flash-attention kernel.
B_OPS = [
    ("aten::linear", 0, 110, None, 0, 0),
    ("aten::mm", 0, 100, GEMM, 20, 100),
    ("aten::add", 300, 50, ELEMENTWISE, 320, 100),
    ("aten::add", 360, 50, ELEMENTWISE, 440, 100),
    ("aten::new", 600, 20, "flash_fwd_kernel", 620, 30),
]


@pytest.fixture(scope="module")
def pair():
    return trace_diff(_trace(2, 1000, A_OPS), _trace(3, 900, B_OPS))


def _rows(table: pd.DataFrame, key: str = "name") -> dict:
    return {r[key]: r for r in table.to_dict("records")}


def test_steps_are_normalised_and_the_categories_sum_to_the_step_change(pair):
    assert (pair.steps_a, pair.steps_b, pair.basis_a, pair.basis_b) == (2, 3, "ranges", "ranges")
    assert pair.step_a_ns == 1_000 * US and pair.step_b_ns == 900 * US
    cat = {r["category"]: pytest.approx((r["a_ns"], r["b_ns"])) for r in pair.categories.to_dict("records")}
    # By hand, per step. A: GPU busy [20, 220] + [320, 420] + [430, 480] us; host ops [0, 110], [300, 350],
    # [400, 420]: the host busy while the GPU idles [0, 20] + [300, 320] = 40 us; neither busy 1000 - 390.
    # B: GPU [20, 120] + 2 x 100 + [620, 650]; host alone [0, 20] + [300, 320] + [600, 620] = 60 us;
    # neither 900 - (120 + 120 + 100 + 50) = 510 us.
    assert cat == {
        "attention": (0, 30 * US),
        "elementwise": (100 * US, 200 * US),
        "gemm": (200 * US, 100 * US),
        "reduction": (50 * US, 0),
        "host": (40 * US, 60 * US),
        "idle": (610 * US, 510 * US),
    }
    assert pair.categories["delta_ns"].sum() == pytest.approx(pair.step_delta_ns) == -100 * US
    assert list(pair.categories["delta_ns"].abs()) == sorted(pair.categories["delta_ns"].abs(), reverse=True)
    idle = pair.categories.set_index("category").loc["idle"]
    assert idle["a_pct"] == pytest.approx(61.0) and idle["b_pct"] == pytest.approx(100 * 510 / 900)


def test_kernels_faster_slower_added_removed(pair):
    k = _rows(pair.kernels)
    gemm = k[GEMM]
    assert (gemm["category"], gemm["a_count"], gemm["b_count"], gemm["status"]) == ("gemm", 1, 1, "faster")
    assert gemm["delta_ns"] == pytest.approx(-100 * US) and gemm["delta_pct"] == pytest.approx(-50.0)
    assert (gemm["a_mean_ns"], gemm["b_mean_ns"]) == pytest.approx((200 * US, 100 * US))
    elem = k[ELEMENTWISE]  # twice the calls, the same time per call
    assert (elem["a_count"], elem["b_count"], elem["delta_ns"]) == pytest.approx((1, 2, 100 * US))
    assert elem["status"] == "slower" and (elem["a_mean_ns"], elem["b_mean_ns"]) == pytest.approx((100 * US,) * 2)
    assert k["softmax_kernel"]["status"] == "removed" and k["softmax_kernel"]["b_count"] == 0
    flash = k["flash_fwd_kernel"]
    assert (flash["category"], flash["status"], flash["a_count"]) == ("attention", "added", 0)
    assert flash["b_ns"] == pytest.approx(30 * US)
    assert np.isnan(flash["delta_pct"]) and np.isnan(flash["a_mean_ns"])
    assert list(pair.kernels["delta_ns"].abs()) == sorted(pair.kernels["delta_ns"].abs(), reverse=True)


def test_ops_by_self_time_with_inclusive_beside(pair):
    o = _rows(pair.ops)
    # aten::linear's 110 us hold aten::mm's 100: 10 us of its own.
    assert (o["aten::linear"]["a_ns"], o["aten::linear"]["a_total_ns"]) == pytest.approx((10 * US, 110 * US))
    assert o["aten::linear"]["status"] == o["aten::mm"]["status"] == "unchanged"
    add = o["aten::add"]
    assert (add["a_count"], add["b_count"], add["a_ns"], add["b_ns"]) == pytest.approx((1, 2, 50 * US, 100 * US))
    assert add["status"] == "slower"
    assert o["aten::old"]["status"] == "removed" and o["aten::new"]["status"] == "added"
    assert {"cudaLaunchKernel", "ProfilerStep#1"}.isdisjoint(o)  # runtime calls and ranges are not ops


def test_noise_threshold_and_step_spread():
    # 4 % slower is within the default 5 %; 8 % is beyond it; a lower threshold flags the 4 %.
    base = _trace(1, 1000, [("aten::mm", 0, 100, GEMM, 20, 500)])
    for k_dur, noise, status in ((520, 5.0, "unchanged"), (540, 5.0, "slower"), (520, 3.0, "slower")):
        d = trace_diff(base, _trace(1, 1000, [("aten::mm", 0, 100, GEMM, 20, k_dur)]), noise_pct=noise)
        assert _rows(d.kernels)[GEMM]["status"] == status, (k_dur, noise)
    # Under MIN_DELTA_NS per step nothing changes, whatever the share: a 0.5 us op at 1.4 us.
    tiny = trace_diff(
        _trace(1, 100, [("aten::view", 0, 0.5, None, 0, 0)]), _trace(1, 100, [("aten::view", 0, 1.4, None, 0, 0)])
    )
    assert MIN_DELTA_NS == 1_000 and _rows(tiny.ops)["aten::view"]["status"] == "unchanged"

    # With two steps each, the means differ by 20 % but the steps overlap (A 400 and 600 us, B 560 and
    # 640 us): unchanged; B at 610 and 640 us is beyond every step of A: slower.
    def two(durs):
        t = _trace(2, 1000, [("aten::mm", 0, 10, GEMM, 20, durs[0])])
        second = (t["name"] == GEMM).to_numpy() & (t["start_ns"] > 1000 * US).to_numpy()
        t.loc[second, "dur_ns"] = durs[1] * US
        return t

    assert _rows(trace_diff(two((400, 600)), two((560, 640))).kernels)[GEMM]["status"] == "unchanged"
    assert _rows(trace_diff(two((400, 600)), two((610, 640))).kernels)[GEMM]["status"] == "slower"


def test_ranks_are_averaged_and_a_kineto_trace_loses_its_last_step():
    two_ranks = concat_tables([_trace(2, 1000, A_OPS, rank=0), _trace(3, 900, B_OPS, rank=1)])
    d = trace_diff(two_ranks, _trace(2, 1000, A_OPS))
    assert d.ranks_a == 2 and d.step_a_ns == 950 * US and d.steps_a == 2
    assert _rows(d.kernels)[GEMM]["a_ns"] == pytest.approx(150 * US)  # (200 + 100) / 2 per step of the average rank
    assert d.categories["a_ns"].sum() == pytest.approx(950 * US)
    assert any("2 rank(s), B 1" in n for n in d.notes)
    kineto = _trace(3, 900, B_OPS)
    kineto.attrs["source"] = "kineto"
    assert trace_diff(kineto, kineto).steps_a == 2 and trace_diff(kineto, kineto, trim_last_step=False).steps_a == 3


def test_a_trace_without_steps_is_one_capture_and_nvtx_ops_are_named_as_ops():
    assert NVTX_OP_RE.match("aten::mm, seq = 3, op_id = 17, sizes = [[2, 3], [3, 4]]").group(1) == "aten::mm"
    assert NVTX_OP_RE.match("FSDP::pre_forward (blocks.2), op_id = 9").group(1) == "FSDP::pre_forward (blocks.2)"
    assert NVTX_OP_RE.match("ncclSend") is None
    t = make_table(
        {
            "rank": 0,
            "kind": ["annotation", "annotation", "annotation", "kernel"],
            "name": ["aten::mm, seq = 3, op_id = 17", "aten::mm, op_id = 18", "ncclSend", GEMM],
            "start_ns": [0, 200 * US, 300 * US, 10 * US],
            "dur_ns": [100 * US, 100 * US, 50 * US, 390 * US],
            "device": [-1, -1, -1, 0],
            "stream": [-1, -1, -1, 7],
            "tid": [1, 1, 1, -1],
        }
    )
    d = trace_diff(t, t)
    assert (d.basis_a, d.steps_a, d.step_a_ns) == ("capture", 1, 400 * US)  # first start to last end
    assert _rows(d.ops)["aten::mm"]["a_count"] == 2 and set(_rows(d.ops)) == {"aten::mm"}
    assert any("whole capture" in n for n in d.notes)


def test_cpu_only_pair_and_bad_input():
    cpu = [("aten::mm", 0, 300, None, 0, 0), ("aten::add", 400, 100, None, 0, 0)]
    d = trace_diff(_trace(2, 1000, cpu), _trace(2, 1000, cpu[:1]))
    assert d.kernels.empty
    assert {r["category"]: r["delta_ns"] for r in d.categories.to_dict("records")} == {
        "host": -100 * US,
        "idle": 100 * US,
    }
    empty = trace_diff(empty_table(), empty_table())
    assert np.isnan(empty.step_a_ns) and empty.kernels.empty and empty.ops.empty and empty.steps_a == 0
    assert "Step: nan -> nan ms" in format_diff(empty, "a", "b")
    with pytest.raises(AdvisorError, match="needs the event table's column"):
        trace_diff(_trace(1, 10, cpu).drop(columns=["correlation"]), empty_table())


def _raw_steps(run: str) -> tuple[float, dict[str, int]]:
    """(mean 'step' range in ns, per-step count of each cpu_op name) read from a run's raw trace JSON."""
    events = json.loads(gzip.decompress((ROOT / "traces" / run / "trace.json.gz").read_bytes()))["traceEvents"]
    steps = [e for e in events if e.get("name") == "step" and e.get("cat") == "user_annotation"]
    counts: dict[str, int] = {}
    for e in events:
        if e.get("cat") == "cpu_op" and any(s["ts"] <= e["ts"] < s["ts"] + s["dur"] for s in steps):
            counts[e["name"]] = counts.get(e["name"], 0) + 1
    return 1000 * sum(s["dur"] for s in steps) / len(steps), {k: v / len(steps) for k, v in counts.items()}


def test_the_shipped_cpu_runs_against_their_raw_json():
    d = diff_paths(ROOT / "traces" / SAMPLE_A, ROOT / "traces" / SAMPLE_B)
    (step_a, count_a), (step_b, count_b) = _raw_steps(SAMPLE_A), _raw_steps(SAMPLE_B)
    assert d.step_a_ns == pytest.approx(step_a, abs=1) and d.step_b_ns == pytest.approx(step_b, abs=1)
    assert d.categories["a_ns"].sum() == pytest.approx(d.step_a_ns)
    assert d.categories["b_ns"].sum() == pytest.approx(d.step_b_ns)
    assert set(d.categories["category"]) == {"host", "idle"}  # CPU-only: no kernel rows
    ops = _rows(d.ops)
    for name in ("aten::mm", "aten::copy_", "aten::add"):
        assert (ops[name]["a_count"], ops[name]["b_count"]) == (count_a[name], count_b[name]), name
    # fp32 -> bf16 (with full recompute): the matmuls ran 43.5 -> 15.3 ms a step on the AMX machine that
    # recorded them, more calls (recompute) in less time.
    assert ops["aten::mm"]["status"] == "faster" and ops["aten::mm"]["b_count"] > ops["aten::mm"]["a_count"]


def _sqlite(path: Path, query: str) -> tuple:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        return db.execute(query).fetchone()


def _capture_ns(path: Path) -> float:
    """Mean over processes of first start to last end of their events, straight from the export (ids:
    bits 24 and up of globalPid / globalTid are the process)."""
    tables = {"KERNEL": "globalPid", "MEMCPY": "globalPid", "MEMSET": "globalPid", "RUNTIME": "globalTid"}
    parts = [f"SELECT ({c} >> 24) AS p, start AS s, end AS e FROM CUPTI_ACTIVITY_KIND_{t}" for t, c in tables.items()]
    parts += ["SELECT (globalPid >> 24), start, end FROM CUPTI_ACTIVITY_KIND_SYNCHRONIZATION"]
    parts += ["SELECT (globalTid >> 24), start, COALESCE(end, start) FROM NVTX_EVENTS"]
    return _sqlite(
        path, f"SELECT AVG(span) FROM (SELECT MAX(e) - MIN(s) AS span FROM ({' UNION ALL '.join(parts)}) GROUP BY p)"
    )[0]


@needs_shared_traces
def test_cli_on_the_nsys_before_after_pair(capsys):
    before, after = NSYS / "nsysai_mfu_2gpu_before.sqlite", NSYS / "nsysai_mfu_2gpu_after.sqlite"
    assert main(["diff", str(before), str(after), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["basis_a"] == out["basis_b"] == "capture" and out["ranks_a"] == 2
    # The step is each process's capture (299.875 / 299.867 ms before, 299.251 / 299.269 after).
    assert out["step_a_ms"] == pytest.approx(_capture_ns(before) / 1e6, abs=1e-6)
    assert out["step_b_ms"] == pytest.approx(_capture_ns(after) / 1e6, abs=1e-6)
    for side, path in (("a", before), ("b", after)):
        kernels = [k for k in out["kernels"] if k["category"] not in ("memcpy", "memset")]
        total, gpus = _sqlite(path, "SELECT SUM(end - start), COUNT(DISTINCT deviceId) FROM CUPTI_ACTIVITY_KIND_KERNEL")
        assert sum(k[f"{side}_ns"] for k in kernels) == pytest.approx(total / gpus)  # 267.600 / 244.418 ms
        flash = _sqlite(
            path,
            "SELECT COUNT(*) FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s ON k.demangledName = s.id "
            "WHERE s.value LIKE '%flash_fwd_kernel%'",
        )[0]
        assert sum(k[f"{side}_count"] for k in kernels if "flash_fwd_kernel" in k["name"]) == flash / gpus  # 34, 30
        assert sum(c[f"{side}_ns"] for c in out["categories"]) == pytest.approx(out[f"step_{side}_ms"] * 1e6)
    ops = {o["name"]: o for o in out["ops"]}
    assert "aten::copy_" in ops and not any("op_id" in name for name in ops)  # emit_nvtx ranges as ops
    assert main(["diff", str(before), str(after), "--top", "2"]) == 0
    text = capsys.readouterr().out
    assert "Step: 299.871 -> 299.260 ms (-0.611 ms, -0.2 %), per step of the average rank" in text
    assert "  attention         136.159    120.378    -15.781" in text  # the flash kernels, 34 -> 30 calls
    assert "whole capture" in text


def test_cli_resolves_run_ids_and_refuses_what_it_cannot_read(tmp_path, capsys):
    for run in (SAMPLE_A, SAMPLE_B):
        shutil.copytree(ROOT / "traces" / run, tmp_path / run)
    assert main(["diff", SAMPLE_A, SAMPLE_B, "--traces", str(tmp_path), "--top", "1"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"A = {SAMPLE_A}: 1 rank(s), 2 step(s) (the trace's own step/phase ranges)")
    assert "  step               65.721     63.759     -1.962" in text  # (65,034,138 + 66,407,135) / 2 ns
    assert main(["diff", "nope", SAMPLE_B, "--traces", str(tmp_path)]) == 2
    assert "diff 'nope': not a run in" in capsys.readouterr().err
    assert main(["diff", SAMPLE_A, SAMPLE_B, "--traces", str(tmp_path), "--noise-pct", "-1"]) == 2


def _verification(new_run_id: str):
    from advisor.advice.verify import Verification

    return Verification(
        run_id=SAMPLE_A,
        rule_id="prec-amp",
        target="step_time_ms",
        before=65.07,
        predicted_after=50.0,
        measured_after=59.99,
        predicted_gain_pct=23.2,
        measured_gain_pct=7.8,
        new_run_id=new_run_id,
        changes={"train.precision": "bf16"},
        basis="test",
        baseline_run_id=SAMPLE_A,
        stored_before=65.07,
    )


def test_the_rerun_view_shows_the_before_and_after_diff(tmp_path, monkeypatch):
    # The re-run itself is replaced by the pair of shipped runs (fp32, then bf16 with full recompute),
    # filed as a verification's baseline and re-run: the view diffs their traces.
    pytest.importorskip("gradio")
    from advisor.store.runstore import RunStore
    from webui import advice as advice_tab
    from webui import common

    for run in (SAMPLE_A, SAMPLE_B):
        shutil.copytree(ROOT / "traces" / run, tmp_path / run)
    store = RunStore(tmp_path)
    monkeypatch.setattr(common, "store", lambda: store)
    monkeypatch.setattr(advice_tab, "verify", lambda run_id, rule_id, s, on_progress, pairs=1: _verification(SAMPLE_B))
    msg, table, categories, changes = advice_tab.verify_view(SAMPLE_A, None, progress=lambda *a, **k: None)
    assert table.iloc[0]["re-run"] == SAMPLE_B
    (step_a, _), (step_b, _) = _raw_steps(SAMPLE_A), _raw_steps(SAMPLE_B)
    step = categories.set_index("category").loc["step"]
    assert (step["before ms"], step["after ms"]) == pytest.approx((step_a / 1e6, step_b / 1e6), abs=1e-3)
    others = categories[categories["category"] != "step"]
    assert others["change ms"].sum() == pytest.approx(step["change ms"], abs=2e-3)  # the rows sum to the step
    assert set(others["category"]) == {"host", "idle"}
    assert f"Trace diff, per step: {step_a / 1e6:,.1f} → {step_b / 1e6:,.1f} ms" in msg
    mm = changes[(changes["what"] == "op") & (changes["name"] == "aten::mm")].iloc[0]
    assert mm["status"] == "faster" and mm["change ms"] < 0
    assert (changes["status"] != "unchanged").all() and len(changes[changes["what"] == "op"]) == 10
    # A re-run whose trace is gone still shows its verification, with the reason instead of the diff.
    (tmp_path / SAMPLE_B / "trace.json.gz").unlink(missing_ok=True)
    msg, table, categories, changes = advice_tab.verify_view(SAMPLE_A, None, progress=lambda *a, **k: None)
    assert msg.startswith("### Re-ran with `train.precision = bf16`") and len(table) == 1
    assert f"no trace diff of {SAMPLE_A} and {SAMPLE_B}: run {SAMPLE_B} has no trace" in msg
    assert categories.empty and changes.empty
