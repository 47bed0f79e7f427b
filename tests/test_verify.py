"""Verify by re-running: a real CPU run with slow data loading, the advice, the re-run with workers."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

import advisor.advice.verify as verify_module
from advisor.advice.advise import advise_run
from advisor.advice.verify import VERIFY_DIR, verify
from advisor.cli import main
from advisor.errors import AdvisorError
from advisor.run.launcher import profile_run
from advisor.spec import presets
from advisor.spec.options import RunOptions
from advisor.spec.setup import make_setup
from advisor.store.runstore import RunStore


@pytest.fixture(scope="module")
def slow_data_run(tmp_path_factory):
    store = RunStore(tmp_path_factory.mktemp("store"))
    # 8 samples x 150 ms of simulated I/O per step against a ~500 ms step of the tiny model (1024
    # tokens, so the tiny-batch rule stays silent). The rule needs loading over 10 % of the step: with
    # 50 ms a sample a CI machine loaded 7x (a 4,485 ms step) read 9.0 % and the rule stayed silent;
    # 1,200 ms keeps it over 10 % up to a step of 12 s. fp32, the fast path of every CPU: in bf16 an
    # AVX2-only CPU took 10.7 s a step (no 16-bit matrix unit), and the loading read under 10 %.
    setup = make_setup(model="tiny", gpu="cpu", seq=128, micro_batch=8, precision="fp32")
    run = profile_run(setup, RunOptions(device="cpu", steps=2, data_delay_ms=150.0), store)
    assert run.status == "ok", run.record
    return store, run


def _verification(measured_gain_pct: float, noise_pct: float | None) -> verify_module.Verification:
    before = 66.7
    return verify_module.Verification(
        run_id="20261130-165248-tiny-6bcb2f",
        rule_id="prec-fp32-to-bf16",
        target="step_time_ms",
        before=before,
        predicted_after=before * (1 - 0.806),
        measured_after=before * (1 - measured_gain_pct / 100),
        predicted_gain_pct=80.6,
        measured_gain_pct=measured_gain_pct,
        new_run_id="20261206-120000-tiny-aaaaaa",
        changes={"train.precision": "bf16"},
        basis="estimator",
        noise_pct=noise_pct,
        baseline_run_id="20261206-115950-tiny-bbbbbb",
        stored_before=65.07,
    )


def test_a_change_within_the_baseline_spread_is_inconclusive_not_a_verdict():
    from advisor.present.views import VERIFY_COLUMNS, verify_message, verify_table

    # The loaded machine: the baseline's steps spread 39.7 %, more than the 25 % measured.
    noisy = _verification(-25.0, 39.7)
    assert noisy.verdict == "inconclusive" and noisy.as_dict()["verdict"] == "inconclusive"
    msg = verify_message(noisy)
    assert "step time inconclusive: the change is within the baseline's step-to-step spread of 39.7 %" in msg
    assert "Not a verdict" in msg and "did NOT improve" not in msg
    row = verify_table(noisy).iloc[0]
    assert list(verify_table(noisy).columns) == VERIFY_COLUMNS and row["verdict"] == "inconclusive"
    # The AMX Xeon's re-run on a quiet machine: a verdict, and the advice no longer recommends it.
    wrong = _verification(-104.6, 2.0)
    assert wrong.verdict == "refuted" and verify_table(wrong).iloc[0]["measured gain %"] == -104.6
    assert "did NOT improve" in verify_message(wrong) and "no longer recommends it" in verify_message(wrong)


def test_cli_verify_prints_the_verdict(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(verify_module, "verify", lambda *a, **kw: _verification(-25.0, 39.7))
    assert main(["verify", "20261130-165248-tiny-6bcb2f", "--traces", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "  predicted 80.6 % less step time; measured 25.0 % more step time\n" in out
    assert "  verdict: inconclusive (baseline step-to-step spread 39.7 %)\n" in out


def test_a_verification_refits_only_a_calibration_that_exists(tmp_path):
    setup = make_setup(model="tiny", gpu="cpu", seq=128, micro_batch=2, precision="fp32")
    assert verify_module.refit_calibration(RunStore(tmp_path), setup) is False
    assert not (tmp_path / "calibration").exists()


@pytest.mark.slow  # starts a child process or runs seconds of real steps
def test_slow_loading_is_advised_and_the_rerun_measures_it(slow_data_run, monkeypatch):
    store, run = slow_data_run
    # The advice is taken on a CPU without a fast bf16 path. Where bf16 is fast (AVX512-BF16, AMX) "train
    # in bf16" competes with the loading fix by a margin that follows how loaded the machine is: on an
    # AVX512-BF16 EPYC under load, a 3,674 ms step of which 1,207 ms loading read bf16 44.6 % against
    # workers 32.9 %, and an AMX Xeon's flags 58.0 %. Fusing the elementwise ops competes the same way:
    # under load average 6 on the AMX Xeon's 2 cores the compute took 3.7 to 5 s of a 4.9 to 6.3 s step,
    # its elementwise ops at 0.05-0.6 GB/s, and compiling outranked the loading fix (before the fusion
    # was priced at the memory roof too: 24.8 % against 19.2 %). This test is about the loading lever
    # and its re-run, so it names the rule; that it leads on a quiet machine is the bench's to show
    # (bench/advice_scenarios.py, slow-data).
    monkeypatch.setattr(presets, "cpu_flags", lambda: {"avx2", "fma"})
    advice = advise_run(run.run_id, store)
    stall = next(r for r in advice.recommendations if r.rule.id == "input-dataloader-stall")
    stored = json.loads((store.path(run.run_id) / "metrics.json").read_text())
    # data_overlap: without workers the load is inline; two workers load a step's batches in half of it
    # while the rest of the step computes.
    compute = stored["step_time_ms"] - stored["data_ms"]
    assert stall.gain.after == pytest.approx(compute + max(0.0, stored["data_ms"] / 2 - compute))
    steps = []
    v = verify(run.run_id, "input-dataloader-stall", store, on_progress=lambda d, t, m: steps.append(m))
    assert v.rule_id == "input-dataloader-stall" and v.changes == {"options.num_workers": 2}
    base = json.loads((store.path(v.baseline_run_id) / "metrics.json").read_text())
    new = json.loads((store.path(v.new_run_id) / "metrics.json").read_text())
    # The baseline re-runs the original setup as it was, first; then the change.
    assert store.load(v.baseline_run_id).record["options"]["num_workers"] == 0
    assert store.load(v.new_run_id).record["options"]["num_workers"] == 2
    assert v.baseline_run_id < v.new_run_id  # run ids begin with their start time
    assert any(m.startswith("as it was: ") for m in steps) and steps[-1].startswith("with the change: ")
    # 1,200 ms of sleeping per step in the main process before; workers prefetch it during the step after.
    assert stored["data_ms"] >= 1200 and base["data_ms"] >= 1200
    assert new["data_ms"] < base["data_ms"] / 2
    # The pair compares the baseline's measurement with the re-run's, and keeps the stored run's.
    assert v.before == pytest.approx(base["step_time_ms"]) and v.measured_after == pytest.approx(new["step_time_ms"])
    assert v.stored_before == pytest.approx(stored["step_time_ms"])
    # The prediction keeps its ratio to the stored run and is set on the baseline's scale.
    g = stall.gain
    assert v.predicted_after == pytest.approx(g.after / g.before * v.before) and v.predicted_gain_pct == g.gain_pct
    spread = 100 * (base["step_time_max_ms"] - base["step_time_min_ms"]) / base["step_time_ms"]
    assert v.noise_pct == pytest.approx(spread) and v.calibrated is False
    assert v.pairs == 1 and v.pair_run_ids == ((v.baseline_run_id, v.new_run_id),)
    assert v.pair_gains_pct == pytest.approx((v.measured_gain_pct,))
    pairs = list((store.root / VERIFY_DIR).glob("*.json"))
    assert len(pairs) == 1 and json.loads(pairs[0].read_text())["new_run_id"] == v.new_run_id
    runs, damaged = store.list_runs()
    assert damaged == [] and {r.run_id for r in runs} == {run.run_id, v.baseline_run_id, v.new_run_id}
    # The next advice on the run has learned from the pair: it quotes the re-run, and a conclusive one
    # sets the figure (the fix measured a gain here, 150 ms a sample against a sub-second step).
    assert json.loads(pairs[0].read_text())["verdict"] == v.verdict
    again = next(r for r in advise_run(run.run_id, store).recommendations if r.rule.id == "input-dataloader-stall")
    assert again.evidence.verdict == v.verdict and again.evidence.new_run_id == v.new_run_id
    if v.verdict != "inconclusive":
        assert again.gain.gain_pct == pytest.approx(v.measured_gain_pct)


def test_verify_refuses_what_it_cannot_rerun(slow_data_run):
    store, run = slow_data_run
    with pytest.raises(AdvisorError, match="rule 'par-tp-across-nodes' did not fire"):
        verify(run.run_id, "par-tp-across-nodes", store)
    with pytest.raises(AdvisorError, match="is not valid"):
        verify("../x", None, store)


@pytest.mark.slow  # starts a child process or runs seconds of real steps
def test_cli_verify_json(slow_data_run, capsys, monkeypatch):
    store, run = slow_data_run
    # --no-baseline measures against the stored run's own figure: one re-run, no baseline (the re-run
    # with a baseline is the test above: the CLI hands the flag's opposite to the same verify()).
    argv = ["verify", run.run_id, "--rule", "input-dataloader-stall", "--traces", str(store.root)]
    assert main([*argv, "--no-baseline", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rule_id"] == "input-dataloader-stall" and out["target"] == "step_time_ms"
    assert out["new_run_id"] not in (None, run.run_id) and store.load(out["new_run_id"]).status == "ok"
    stored = json.loads((store.path(run.run_id) / "metrics.json").read_text())["step_time_ms"]
    assert out["baseline_run_id"] is None and out["before"] == pytest.approx(stored) == out["stored_before"]
    assert out["pairs"] == 1 and out["pair_run_ids"] == [] and out["pair_gains_pct"] == []
    assert main(["verify", run.run_id, "--rule", "nope", "--traces", str(store.root)]) == 2
    # Without the flag the CLI asks verify() for a baseline.
    asked = {}

    def fake(*a, **kw):
        asked.update(kw)
        raise AdvisorError("stop here")

    monkeypatch.setattr(verify_module, "verify", fake)
    assert main(argv) == 2 and asked["baseline"] is True


class _FakeRun:
    """What verify reads of a re-run: its id and metrics."""

    def __init__(self, run_id: str, step_ms: float):
        self.run_id, self.status = run_id, "ok"
        self._m = {"step_time_ms": step_ms, "step_time_min_ms": step_ms * 0.99, "step_time_max_ms": step_ms * 1.01}

    def metrics(self):
        return self._m


def test_a_demoted_rule_can_be_named_and_measured_again(tmp_path, monkeypatch):
    """After a refuted re-run the rule is no longer recommended, so verify's default skips it; named, it
    is re-run again, its earlier measurement standing as the prediction."""
    from tests.sample_cpu import pin_sample_cpu
    from tests.test_advise import SAMPLE_RUN, _store_with_pair

    pin_sample_cpu(monkeypatch)
    store = _store_with_pair(tmp_path)
    runs = iter([_FakeRun("20261206-130000-tiny-cccccc", 66.0), _FakeRun("20261206-130010-tiny-dddddd", 138.6)])
    monkeypatch.setattr(verify_module, "_rerun", lambda *a, **kw: next(runs))
    v = verify(SAMPLE_RUN, "prec-fp32-to-bf16", store)
    assert v.predicted_gain_pct == pytest.approx(-104.6)
    assert v.measured_gain_pct == pytest.approx(-110.0) and v.verdict == "refuted"
    assert v.baseline_run_id == "20261206-130000-tiny-cccccc" and v.new_run_id == "20261206-130010-tiny-dddddd"


def test_a_one_step_baseline_has_no_spread_and_gives_no_verdict(tmp_path, monkeypatch, capsys):
    # A user review: a run of 1 timed step re-verified as "confirmed (baseline step-to-step spread
    # 0.0 %)": max = min of one step is no spread, and the stored and fresh baselines were 34 % apart.
    from advisor.advice.evidence import UNKNOWN_SPREAD
    from advisor.present.views import verify_message
    from tests.sample_cpu import pin_sample_cpu
    from tests.test_advise import SAMPLE_RUN, _store_with_pair

    pin_sample_cpu(monkeypatch)
    store = _store_with_pair(tmp_path)

    def one_step(run_id, step_ms):
        run = _FakeRun(run_id, step_ms)
        run._m |= {"steps_measured": 1, "step_time_min_ms": step_ms, "step_time_max_ms": step_ms}
        return run

    runs = iter([one_step("20261206-130000-tiny-cccccc", 100.0), one_step("20261206-130010-tiny-dddddd", 20.0)])
    monkeypatch.setattr(verify_module, "_rerun", lambda *a, **kw: next(runs))
    v = verify(SAMPLE_RUN, "prec-fp32-to-bf16", store)
    assert v.measured_gain_pct == pytest.approx(80.0)  # would be "confirmed" against a 0 % spread
    assert v.noise_pct is None and v.noise_unknown and v.verdict == "inconclusive"
    assert f"step time inconclusive: {UNKNOWN_SPREAD}" in verify_message(v)
    # As evidence for the advice, the filed pair is inconclusive too (it does not reprice the gain).
    from advisor.advice.evidence import evidence_of

    assert evidence_of(v.as_dict()).verdict == "inconclusive"
    assert evidence_of(v.as_dict() | {"noise_unknown": False}).verdict == "confirmed"
    monkeypatch.setattr(verify_module, "verify", lambda *a, **kw: v)
    assert main(["verify", SAMPLE_RUN, "--traces", str(tmp_path)]) == 0
    assert f"  verdict: inconclusive ({UNKNOWN_SPREAD})\n" in capsys.readouterr().out
    # Two steps or more, or a memory target: as before.
    assert not _verification(25.0, 2.0).noise_unknown and _verification(25.0, 2.0).verdict == "fell short"
    bounded = replace(_verification(25.0, 2.0), upper_bound=True)
    assert bounded.verdict == "confirmed" and evidence_of(bounded.as_dict()).verdict == "confirmed"


def test_pairs_alternate_and_take_the_median_gain(tmp_path, monkeypatch):
    """Three pairs re-run as AB BA AB; the measured gain is the median of the pairs' gains, each pair's gain
    is kept, and the noise is the larger of the first baseline's step spread and the baselines' spread."""
    import shutil

    from tests.sample_cpu import pin_sample_cpu
    from tests.test_advise import REPO, SAMPLE_RUN

    pin_sample_cpu(monkeypatch)
    shutil.copytree(REPO / "traces", tmp_path / "traces")
    store = RunStore(tmp_path / "traces")
    values = {"as it was": iter([100.0, 110.0, 105.0]), "with the change": iter([90.0, 92.0, 97.0])}
    order = []

    def rerun(setup, options, store, on_progress, label):
        order.append(label)
        return _FakeRun(f"20261206-1300{len(order):02d}-tiny-{len(order):06x}", next(values[label.split(" (")[0]]))

    monkeypatch.setattr(verify_module, "_rerun", rerun)
    v = verify(SAMPLE_RUN, "prec-fp32-to-bf16", store, pairs=3)
    a, b = "as it was (pair {} of 3)", "with the change (pair {} of 3)"
    assert order == [a.format(1), b.format(1), b.format(2), a.format(2), a.format(3), b.format(3)]
    ids = [f"20261206-1300{n:02d}-tiny-{n:06x}" for n in range(1, 7)]
    assert v.pair_run_ids == ((ids[0], ids[1]), (ids[3], ids[2]), (ids[4], ids[5]))
    assert v.baseline_run_id == ids[0] and v.new_run_id == ids[1] and v.pairs == 3
    # Each pair alone: 10 / 100, 18 / 110, 8 / 105; their median 10 %, set on the median before (105 of
    # 100, 110, 105 ms): 94.5 ms after. (The medians of each side alone, 105 and 92 ms, read 12.4 %.)
    assert v.pair_gains_pct == pytest.approx((10.0, 16.363636, 7.619048))
    assert v.before == pytest.approx(105.0) and v.measured_after == pytest.approx(94.5)
    assert v.measured_gain_pct == pytest.approx(10.0)
    # The baselines spread 100-110 ms over their 105 ms mean (9.52 %), more than a run's own 2 %
    # (_FakeRun's steps spread +-1 %); 10.0 % is beyond it, so a verdict: it fell short of 80.6 %.
    assert v.noise_pct == pytest.approx(9.523810) and v.verdict == "fell short"
    filed = json.loads(next((store.root / VERIFY_DIR).glob(f"*--{ids[1]}.json")).read_text())
    assert filed["pairs"] == 3 and filed["pair_run_ids"][1] == [ids[3], ids[2]]
    assert filed["pair_gains_pct"] == pytest.approx([10.0, 16.363636, 7.619048])
    from advisor.present.views import verify_message

    msg = verify_message(v)
    assert "3 pairs re-run just now in alternating order; the measured gain is the median of theirs" in msg
    assert "(+10.0 %, +16.4 %, +7.6 %), from the median before: 105.0 ms" in msg


@pytest.mark.parametrize("pairs", [0, 11, 2.5, True, "2"])
def test_pairs_out_of_range_are_refused_before_any_run(pairs):
    with pytest.raises(AdvisorError, match=r"pairs must be a whole number from 1 to 10, got"):
        verify("20261130-165248-tiny-6bcb2f", None, RunStore("/nonexistent"), pairs=pairs)


def test_pairs_need_the_baseline():
    with pytest.raises(AdvisorError, match="pairs = 2 needs the baseline re-runs"):
        verify("20261130-165248-tiny-6bcb2f", None, RunStore("/nonexistent"), pairs=2, baseline=False)


def test_cli_verify_pairs(monkeypatch, capsys, tmp_path):
    asked = {}

    def fake(*a, **kw):
        asked.update(kw)
        return replace(_verification(11.4, 9.5), pairs=3, pair_gains_pct=(10.0, 16.4, 7.6))

    monkeypatch.setattr(verify_module, "verify", fake)
    assert main(["verify", "20261130-165248-tiny-6bcb2f", "--pairs", "3", "--traces", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert asked["pairs"] == 3
    assert (
        "  3 pairs in alternating order; measured: the median of their gains (each pair: +10.0 %, +16.4 %, +7.6 %)\n"
        in out
    )
    assert "  verdict: fell short (baseline spread over its steps and re-runs 9.5 %)\n" in out
    # Figures in the target's unit: 66.7 ms before, 80.6 % predicted off, 11.4 % measured off.
    assert "  step_time_ms: before 66.7 ms, predicted 12.9 ms, measured 59.1 ms\n" in out
    monkeypatch.undo()  # the real verify refuses 0 pairs before it re-runs anything
    assert main(["verify", "20261130-165248-tiny-6bcb2f", "--pairs", "0", "--traces", str(tmp_path)]) == 2
    assert "pairs must be a whole number from 1 to 10, got 0" in capsys.readouterr().err
