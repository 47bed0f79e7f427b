"""Calibration: recovers a known estimator error, round-trips through JSON exactly, refuses damaged
files and thin data, and reads real runs from the run store."""

import json
import math
import shutil
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from advisor.advice.calibrate import (
    FEATURES,
    MIN_RUNS,
    Calibration,
    calibration_path,
    device_key_for,
    fit_calibration,
    group_folds,
    load_calibration,
    record_of,
    run_sweep,
    sweep_setups,
    training_records,
)
from advisor.cli import main
from advisor.errors import AdvisorError
from advisor.estimate.estimator import estimate
from advisor.run.launcher import on_this_machine
from advisor.spec.metrics import StepMetrics
from advisor.spec.options import RunOptions
from advisor.spec.presets import cpu_host
from advisor.spec.setup import make_setup
from advisor.spec.specs import spec_to_dict
from advisor.store.runstore import RunStore, new_run_id, write_json_atomic
from tests.sample_cpu import pin_sample_cpu

# The synthetic truth: this "machine" runs bf16 at 0.4x and fp32 at 0.8x the estimated time, full
# recompute costs 1.25x more on top, and every step's peak memory is 1.1x the estimate.
BF16_TIME, FP32_TIME, FULL_RECOMPUTE_TIME, MEMORY = 0.4, 0.8, 1.25, 1.1


def _true_time_factor(setup):
    t = setup.train
    return (BF16_TIME if t.precision == "bf16" else FP32_TIME) * (FULL_RECOMPUTE_TIME if t.recompute == "full" else 1.0)


def _local(setups):
    """The setups on this machine's CPU, as the samples' CPU (``tests.sample_cpu``): this machine's own
    flags would change the estimator's bf16 rate 100-fold between CPUs (3.5x fp32 or 1/30), and with
    it the spread the synthetic truth is recovered from."""
    with pytest.MonkeyPatch.context() as mp:
        pin_sample_cpu(mp, cores=False)
        return [on_this_machine(s, "cpu") for s in setups]


def _synthetic_records(setups):
    rows = []
    for i, s in enumerate(setups):
        est = estimate(s)
        rows.append(
            record_of(s, est.step_time_ms * _true_time_factor(s), est.memory.total_bytes * MEMORY, run_id=f"r{i}")
        )
    return pd.DataFrame(rows)


@pytest.fixture(scope="module")
def setups():
    return _local(sweep_setups(24, seed=1))


@pytest.fixture(scope="module")
def calibration(setups):
    return fit_calibration(_synthetic_records(setups))


def test_recovers_a_known_multiplicative_error(setups, calibration, monkeypatch):
    pin_sample_cpu(monkeypatch, cores=False)  # the new setup below is on the training setups' CPU
    # The estimator's error is known exactly: |estimate - truth| / truth = |1 / factor - 1|.
    expected_time_pct = 100 * np.mean([abs(1 / _true_time_factor(s) - 1) for s in setups])
    assert calibration.cv["mape_step_time_estimator_pct"] == pytest.approx(expected_time_pct)
    assert calibration.cv["mape_peak_memory_estimator_pct"] == pytest.approx(100 * (1 - 1 / MEMORY))  # 9.09 %
    assert expected_time_pct > 50
    # The truth is linear in the log ratio, so cross-validation finds it almost exactly.
    assert calibration.cv["mape_step_time_calibrated_pct"] < 1.0
    assert calibration.cv["mape_peak_memory_calibrated_pct"] < 0.5
    assert calibration.step_time.kind == calibration.peak_memory.kind == "ridge"
    assert calibration.n_runs == 24 and calibration.device_key == device_key_for(cpu_host())
    # A setup outside the training set, inside its ranges, gets the true correction.
    new = on_this_machine(
        make_setup(model="tiny", gpu="cpu", seq=128, micro_batch=2, precision="bf16", recompute="full"), "cpu"
    )
    assert new not in setups
    pred = calibration.predict(new)
    est = estimate(new)
    assert pred.analytic_step_time_ms == est.step_time_ms
    assert pred.step_time_ms / est.step_time_ms == pytest.approx(BF16_TIME * FULL_RECOMPUTE_TIME, rel=0.02)
    assert pred.peak_memory_bytes / est.memory.total_bytes == pytest.approx(MEMORY, rel=0.01)
    assert not pred.outside_training_range


def test_the_estimator_alone_is_kept_where_a_correction_does_not_help(setups):
    rng = np.random.default_rng(0)
    rows = []
    for s in setups:
        est = estimate(s)
        # Memory exact up to +-1 % noise unrelated to the spec: nothing to learn, so no correction.
        rows.append(record_of(s, est.step_time_ms * 0.5, est.memory.total_bytes * rng.uniform(0.99, 1.01)))
    cal = fit_calibration(pd.DataFrame(rows))
    assert cal.peak_memory.kind == "none"
    assert cal.cv["mape_peak_memory_calibrated_pct"] == cal.cv["mape_peak_memory_estimator_pct"] < 1.0
    assert cal.predict(setups[0]).peak_memory_bytes == estimate(setups[0]).memory.total_bytes


def test_json_round_trip_predicts_identically(calibration, setups, tmp_path):
    path = calibration.save(tmp_path / "cal.json")
    loaded = Calibration.load(path)
    assert loaded == calibration
    extra = on_this_machine(make_setup(model="gpt2-124m", gpu="cpu", seq=1024, micro_batch=8), "cpu")
    for s in [*setups[:5], extra]:
        assert loaded.predict(s) == calibration.predict(s)
    assert calibration.predict(extra).outside_training_range  # far bigger than anything in the sweep
    data = json.loads(path.read_text())
    assert (
        data["features"] == list(FEATURES)
        and data["n_runs"] == 24
        and set(data["cv"])
        >= {
            "mape_step_time_calibrated_pct",
            "mape_step_time_estimator_pct",
        }
    )


def _tamper(d, how):
    st = d["models"]["step_time"]
    if how == "nan":
        st["coef"][0] = float("nan")
    elif how == "short":
        st["coef"] = st["coef"][:-1]
    elif how == "kind":
        st["kind"] = "pickle"
    elif how == "string":
        st["intercept"] = "__import__('os').system('echo hacked')"
    elif how == "extra_key":
        st["__reduce__"] = ["os.system", ["echo hacked"]]
    elif how == "features":
        d["features"] = ["log_n_params"]
    elif how == "format":
        d["format"] = "pickle"
    elif how == "scale":
        st["scale"][0] = 0.0
    elif how == "huge_correction":
        st["target_hi"] = 50.0
    elif how == "device_key":
        d["device_key"] = "../../etc"
    return d


@pytest.mark.parametrize(
    ("how", "words"),
    [
        ("nan", "NaN is not a number"),
        ("short", "coef must be a list of"),
        ("kind", "kind='pickle' is unknown"),
        ("string", "intercept="),
        ("extra_key", "must have exactly the keys"),
        ("features", "other features"),
        ("format", "not an advisor-calibration file"),
        ("scale", "scale must be positive"),
        ("huge_correction", "factor of 1000"),
        ("device_key", "is not a device key"),
    ],
)
def test_tampered_files_are_refused_with_a_clear_error(calibration, tmp_path, how, words):
    path = calibration.save(tmp_path / "cal.json")
    path.write_text(json.dumps(_tamper(json.loads(path.read_text()), how)))
    with pytest.raises(AdvisorError, match="is not valid") as err:
        Calibration.load(path)
    assert words in str(err.value) and "python -m advisor calibrate" in str(err.value)


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe\x00", b"[" * 100_000, b"null", b'"text"'])
def test_corrupt_files_are_refused_with_a_clear_error(tmp_path, content):
    path = tmp_path / "cal.json"
    path.write_bytes(content)
    with pytest.raises(AdvisorError, match=r"calibration file .*cal\.json"):
        Calibration.load(path)


def test_load_calibration_from_the_store(calibration, tmp_path):
    store = RunStore(tmp_path)
    key = calibration.device_key
    assert load_calibration(store, key) is None
    calibration.save(calibration_path(store, key))
    assert load_calibration(store, key) == calibration
    assert calibration_path(store, key) == tmp_path / "calibration" / f"{key}.json"
    shutil.copy(calibration_path(store, key), tmp_path / "calibration" / "gpu-h200-141gb.json")
    with pytest.raises(AdvisorError, match="is for device cpu-"):
        load_calibration(store, "gpu-h200-141gb")
    with pytest.raises(AdvisorError, match="not valid"):
        load_calibration(store, "../../etc/passwd")


def test_predict_refuses_another_device(calibration):
    gpu_setup = make_setup(model="tiny", gpu="h100", seq=128, micro_batch=2)
    with pytest.raises(AdvisorError, match="the setup runs on gpu-h100-sxm-80gb"):
        calibration.predict(gpu_setup)


def test_too_few_runs_says_how_many_it_has_and_needs(setups):
    few = _synthetic_records(setups[:5])
    with pytest.raises(AdvisorError, match=f"at least {MIN_RUNS} different setups.*5 runs of 5 setups"):
        fit_calibration(few)
    # Re-runs of one setup are not new information: 10 runs of 2 setups are still too few.
    reruns = _synthetic_records([setups[0]] * 5 + [setups[1]] * 5)
    with pytest.raises(AdvisorError, match="10 runs of 2 setups"):
        fit_calibration(reruns)
    with pytest.raises(AdvisorError, match="0 runs of 0 setups"):
        fit_calibration(training_records(RunStore("/nonexistent/store")))


def test_records_of_two_devices_are_refused(setups):
    records = _synthetic_records(setups)
    records.loc[0, "device_key"] = "gpu-h100-sxm-80gb"
    with pytest.raises(AdvisorError, match="2 devices"):
        fit_calibration(records)


def test_device_keys_agree_between_setups_and_cpu_metrics(setups):
    key = device_key_for(setups[0])
    metrics = StepMetrics(run_id="x", source="profile", device_type="cpu", device_name=cpu_host().name)
    assert key == device_key_for(metrics) == device_key_for(metrics.to_dict()) == device_key_for(cpu_host())
    assert key == device_key_for({"setup": spec_to_dict(setups[0])})
    assert device_key_for(make_setup(model="tiny", gpu="h200")) == "gpu-h200-141gb"


def _file_synthetic_run(store, setup, step_ms, peak_bytes, status="ok", options=None, extrapolated=False):
    """A committed run with run.json and metrics.json as profile_run writes them (no child process)."""
    run_id = new_run_id(setup.model.name)
    d = store.staging_dir(run_id)
    opts = RunOptions(device="cpu", steps=2, warmup=0).as_dict() | (options or {})
    write_json_atomic(
        d / "run.json", {"run_id": run_id, "status": status, "setup": spec_to_dict(setup), "options": opts}
    )
    if status == "ok":
        m = StepMetrics(
            run_id=run_id,
            source="profile",
            model_name=setup.model.name,
            device_type="cpu",
            device_name=setup.hardware.name,
            step_time_ms=step_ms,
            peak_memory_bytes=peak_bytes,
            extrapolated=extrapolated,
        )
        m.save(d / "metrics.json")
    store.commit(run_id)
    return run_id


def _synthetic_store(path, setups):
    store = RunStore(path)
    for s in setups:
        est = estimate(s)
        _file_synthetic_run(store, s, est.step_time_ms * _true_time_factor(s), int(est.memory.total_bytes * MEMORY))
    return store


def test_training_records_keep_only_measured_runs_of_this_machine(setups, tmp_path, monkeypatch):
    pin_sample_cpu(monkeypatch, cores=False)  # records re-estimate on this machine's CPU: the setups' one
    store = RunStore(tmp_path)
    factors = {}
    for s in setups[:3]:
        est = estimate(s)
        run_id = _file_synthetic_run(store, s, est.step_time_ms * _true_time_factor(s), est.memory.total_bytes)
        factors[run_id] = _true_time_factor(s)
    s = setups[0]
    _file_synthetic_run(store, s, 1.0, 1, status="failed")
    _file_synthetic_run(store, s, 1.0, 1, extrapolated=True)
    _file_synthetic_run(store, s, 1.0, 1, options={"layers": 2})
    _file_synthetic_run(store, s, 1.0, 1, options={"data_delay_ms": 5.0})
    (tmp_path / "not-a-run").mkdir()
    records = training_records(store, device_key_for(s))
    assert len(records) == 3 and list(records.columns[:3]) == ["run_id", "device_key", "model_name"]
    assert set(records["run_id"]) == set(factors)
    for row in records.itertuples():
        assert row.step_time_ms / row.est_step_time_ms == pytest.approx(factors[row.run_id])
        assert row.peak_memory_bytes == pytest.approx(row.est_peak_memory_bytes)
    assert len(training_records(store, "gpu-h100-sxm-80gb")) == 0


@pytest.mark.slow  # starts a child process or runs seconds of real steps
def test_real_sweep_runs_feed_the_records(tmp_path):
    """REAL RUNS: three tiny profiled steps in child processes (about 15 s on 2 cores)."""
    store = RunStore(tmp_path)
    base = {"model": "tiny", "gpu": "cpu", "seq": 64, "micro_batch": 1}
    real = [
        make_setup(**base),
        make_setup(**base, precision="fp32", recompute="full", optimizer_impl="foreach"),
        make_setup(**base, global_batch=2, optimizer="sgd"),
    ]
    progress = []
    sweep = run_sweep(
        store, real, device="cpu", steps=1, retries=0, quiet_wait_s=0, on_progress=lambda *p: progress.append(p)
    )
    assert [s.run.status for s in sweep] == ["ok"] * 3, [s.run.record["message"] for s in sweep]
    finished = [p for p in progress if not p[2].startswith("run ")]
    assert [p[:2] for p in finished] == [(1, 3), (2, 3), (3, 3)] and "tiny seq 64 x 1 x 2 bf16" in finished[2][2]
    # While each runs: which run, which step (one step: warm-up, profiler rehearsal, timed, profiled = 4).
    during = [p for p in progress if p[2].startswith("run ")]
    assert during[0] == (0, 3, "run 1 of 3, tiny seq 64 x 1 x 1 bf16: step 1/4 (warm-up)")
    assert during[1][2].endswith("step 2/4 (profiler rehearsal 1/1)")
    assert [p[:2] for p in during] == [(0, 3)] * 4 + [(1, 3)] * 4 + [(2, 3)] * 4
    records = training_records(store, device_key_for(on_this_machine(real[0], "cpu")))
    assert len(records) == 3
    by_id = records.set_index("run_id")
    for s in sweep:
        m = s.run.metrics()
        row = by_id.loc[s.run.run_id]
        assert row["step_time_ms"] == m["step_time_ms"] and row["peak_memory_bytes"] == m["peak_memory_bytes"]
        # The estimate is recomputed from the recorded setup and equals what the run recorded.
        assert row["est_step_time_ms"] == pytest.approx(m["estimate_step_time_ms"])
        assert row["est_peak_memory_bytes"] == pytest.approx(m["estimate_peak_memory_bytes"])
        assert row["micro_batches_per_est_ms"] * row["est_step_time_ms"] == pytest.approx(m["grad_accum"])
        assert math.exp(row["log_seq_len"]) == pytest.approx(m["seq_len"])
    assert records["precision_bf16"].tolist() == [1.0, 0.0, 1.0] and records["optimizer_sgd"].tolist() == [0, 0, 1]


def test_cli_calibrate_on_a_store(setups, tmp_path, capsys, monkeypatch):
    pin_sample_cpu(monkeypatch, cores=False)  # the fit re-estimates on the CPU the synthetic truth used
    _synthetic_store(tmp_path, setups[:12])
    assert main(["calibrate", "--runs-dir", str(tmp_path), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "12 measured runs" in out and "estimator alone" in out and "step time" in out and "peak memory" in out
    key = device_key_for(setups[0])
    assert (tmp_path / "calibration" / f"{key}.json").is_file()
    assert main(["calibrate", "--traces", str(tmp_path), "--device", "cpu", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["n_runs"] == 12 and data["device_key"] == key and data["sweep"] == []
    assert data["cv"]["mape_step_time_calibrated_pct"] < data["cv"]["mape_step_time_estimator_pct"] / 2
    assert load_calibration(RunStore(tmp_path), key).n_runs == 12


def test_cli_calibrate_with_too_few_runs_exits_2(setups, tmp_path, capsys):
    _synthetic_store(tmp_path, setups[:3])
    assert main(["calibrate", "--runs-dir", str(tmp_path), "--device", "cpu"]) == 2
    assert "3 runs of 3 setups" in capsys.readouterr().err


def test_group_folds_keep_reruns_together_and_test_every_row_once():
    groups = np.array(["a", "b", "a", "c", "d", "e", "f", "b", "g", "h"])
    folds = group_folds(groups, seed=3)
    assert len(folds) == 5
    tested = np.concatenate([test for _, test in folds])
    assert sorted(tested) == list(range(10))
    for train, test in folds:
        assert not set(groups[train]) & set(groups[test])
    assert len(group_folds(groups[:4], seed=0)) == 3  # three setups: three folds


def test_a_calibration_goes_stale_when_the_estimator_changes(setups, tmp_path, monkeypatch):
    pin_sample_cpu(monkeypatch, cores=False)  # the fit re-estimates on the CPU the synthetic truth used
    store = _synthetic_store(tmp_path, setups[:10])
    cal = fit_calibration(training_records(store, device_key_for(setups[0])))
    assert len(cal.checks) == 3 and cal.stale_reason() == ""
    key = cal.device_key
    cal.save(calibration_path(store, key))
    assert load_calibration(store, key) == cal
    # Stored runs are estimated with today's device peaks: the runs recorded the same CPU.
    assert json.loads(cal.checks[0]["setup_json"])["hardware"] == spec_to_dict(cpu_host())
    # A changed estimator (here: a 10 % slower step for everything) makes the stored fit stale.
    import advisor.advice.calibrate as C

    real = C.estimate

    def slower(setup):
        e = real(setup)
        return replace(e, time=replace(e.time, compute_ms=e.time.compute_ms * 1.1))

    monkeypatch.setattr(C, "estimate", slower)
    assert "the estimator changed since the fit (step_time_ms of a check setup" in cal.stale_reason()
    with pytest.raises(AdvisorError, match=r"is stale: .*refit with `python -m advisor calibrate`"):
        load_calibration(store, key)


def test_a_sweep_measures_only_the_precisions_the_device_runs_fast(monkeypatch):
    from advisor.advice.calibrate import sweep_precisions
    from advisor.spec import presets

    # bf16 autocast ran the tiny step 23x slower than fp32 on an AVX2-only CPU: the sweep leaves it out.
    monkeypatch.setattr(presets, "cpu_flags", lambda: {"avx2"})
    assert sweep_precisions(presets.cpu_host()) == ("fp32",)
    assert {s.train.precision for s in sweep_setups(12, precisions=sweep_precisions(presets.cpu_host()))} == {"fp32"}
    monkeypatch.setattr(presets, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    assert sweep_precisions(presets.cpu_host()) == ("fp32", "bf16")
    assert sweep_precisions(presets.get_hardware("h100")) == ("fp32", "bf16")
    assert {s.train.precision for s in sweep_setups(12)} == {"fp32", "bf16"}


def test_a_verification_refits_the_calibration_on_its_reruns(setups, tmp_path, monkeypatch):
    """The calibration learns from verification re-runs: they are ordinary runs in the store, and
    ``verify`` refits a stored calibration right after filing them."""
    from advisor.advice.verify import refit_calibration

    pin_sample_cpu(monkeypatch, cores=False)
    store = _synthetic_store(tmp_path, setups)
    key = device_key_for(setups[0])
    path = calibration_path(store, key)
    before = fit_calibration(training_records(store, key))
    before.save(path)
    # A verification of fp32 -> bf16 on one setup: the bf16 re-run measured 3x slower than the synthetic
    # truth says (the AMX Xeon's elementwise-heavy tiny model), its baseline as the truth says.
    fp32 = next(s for s in setups if s.train.precision == "fp32")
    bf16 = replace(fp32, train=replace(fp32.train, precision="bf16"))
    est32, est16 = estimate(fp32), estimate(bf16)
    truth16 = est16.step_time_ms * _true_time_factor(bf16)
    _file_synthetic_run(store, fp32, est32.step_time_ms * _true_time_factor(fp32), int(est32.memory.total_bytes))
    _file_synthetic_run(store, bf16, 3 * truth16, int(est16.memory.total_bytes * MEMORY))
    assert refit_calibration(store, fp32) is True
    after = load_calibration(store, key)
    assert after.n_runs == before.n_runs + 2
    # The refitted correction moves the bf16 step towards the measurement.
    assert after.predict(bf16).step_time_ms > before.predict(bf16).step_time_ms
    # Copied into a store without its runs, the calibration is not refitted on the fewer runs there
    # (enough for a fit of their own): that would forget the sweep (a bench's copy predicted 68 ms for
    # a 220-232 ms step after it).
    other = RunStore(tmp_path / "other")
    for s in setups[:MIN_RUNS]:
        e = estimate(s)
        _file_synthetic_run(other, s, e.step_time_ms * _true_time_factor(s), int(e.memory.total_bytes * MEMORY))
    assert after.n_runs > MIN_RUNS
    copied = calibration_path(other, key)
    copied.parent.mkdir(parents=True)
    copied.write_bytes(path.read_bytes())
    assert refit_calibration(other, fp32) is False and copied.read_bytes() == path.read_bytes()
    # A damaged file is replaced by a fit on what there is.
    copied.write_text("{not json")
    assert refit_calibration(other, fp32) is True and load_calibration(other, key).n_runs == MIN_RUNS
