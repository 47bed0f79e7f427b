"""Verify a recommendation by re-running: profile the run again as it was and with the action
applied, one right after the other, and set the predicted change beside the measured one. Each pair is
filed under ``<store>/verifications/`` and both new runs are ordinary runs, so the calibration learns
from them too.

The baseline is measured again because a shared machine's speed drifts between runs made at
different times. The shipped fp32 sample run (65.1 ms a step) re-ran in bf16 at 2,362 ms while a
test suite held both cores: a -3530 % "gain". Side by side on a quiet machine the same change measured
66.7 -> 46.9 ms (+29.8 %). Times measured minutes apart say more about the machine than the change.

Side by side is not enough for a small change: each process has its own speed. Six alternating pairs
of one CPU step (8-layer tiny model, seq 256 x 4, offloading 4 blocks' activations or not; a quiet
2-core EPYC) measured per-pair gains from -8.6 % to +14.4 % (+6.6 % over all six runs of each side),
while each run's own steps spread 1-16 %. ``pairs`` re-runs both sides that many times in alternating
order (as it was, with the change, with the change, as it was, ...: a drift that is linear in time
cancels), takes the median of the pairs' own gains (the mean of two; from three on, one run disturbed
by another process does not move it: one such baseline re-run took 1,042 ms against 214-228 ms), and
counts the spread between the baseline's re-runs as noise."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

from advisor.advice.advise import Recommendation, advise_run
from advisor.advice.evidence import INCONCLUSIVE, verdict
from advisor.advice.gains import improvement_pct
from advisor.analysis.diff import TraceDiff, diff_paths
from advisor.errors import AdvisorError
from advisor.run.launcher import ProgressFn, local_device_type, profile_run
from advisor.spec.options import RunOptions
from advisor.spec.specs import setup_from_dict
from advisor.store.runstore import RunStore, check_run_id, write_json_atomic

VERIFY_DIR = "verifications"
MAX_PAIRS = 10
"""The most re-run pairs one verification makes (each pair is two profiled runs)."""


@dataclass(frozen=True)
class Verification:
    """A recommendation's predicted change and the change measured by re-running, on its target figure."""

    run_id: str
    rule_id: str
    target: str
    before: float
    """Measured on the baseline: the original setup re-run just before the change (the original run's
    own figure with ``baseline=False``)."""
    predicted_after: float
    """The prediction on the baseline's scale: the predicted ratio to the original run's own figure,
    times ``before`` (so it compares with ``measured_after``, both measured now)."""
    measured_after: float
    predicted_gain_pct: float
    measured_gain_pct: float
    new_run_id: str
    changes: dict[str, Any]
    basis: str
    upper_bound: bool = False
    calibrated: bool = False
    """The prediction came from this machine's calibration (else the estimator alone)."""
    noise_pct: float | None = None
    """The baseline's step-time spread (max - min over its timed steps), % of its median; with
    several pairs the larger of the first baseline's and the spread between the baseline re-runs'
    figures (max - min, % of their median): a measured change smaller than this is within noise."""
    baseline_run_id: str | None = None
    """The (first) re-run of the original setup (None with ``baseline=False``)."""
    stored_before: float | None = None
    """The original run's own figure, measured when it was made."""
    pairs: int = 1
    """How many (baseline, change) pairs were re-run. With more than one, ``before`` is the median of
    the baseline re-runs and ``measured_after`` sits at the median of the pairs' gains from it."""
    pair_run_ids: tuple[tuple[str, str], ...] = ()
    """(baseline re-run, re-run with the change) of every pair, in the order of ``pair_gains_pct``
    (empty with ``baseline=False``)."""
    pair_gains_pct: tuple[float, ...] = ()
    """The measured gain of each pair on its own."""
    noise_unknown: bool = False
    """A step-time target whose spread nothing measured (one timed step, one pair): the machine's noise
    is unknown, so the verdict is inconclusive whatever the change."""

    @property
    def verdict(self) -> str:
        """confirmed, fell short, refuted or inconclusive (``advisor.advice.evidence.verdict``): a
        change no larger than the baseline's spread is inconclusive, not a verdict."""
        if self.noise_unknown:
            return INCONCLUSIVE
        return verdict(self.predicted_gain_pct, self.measured_gain_pct, self.noise_pct, self.upper_bound)

    @property
    def error_pct(self) -> float:
        """Predicted minus measured gain, in percentage points."""
        return self.predicted_gain_pct - self.measured_gain_pct

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "verdict": self.verdict}


def _measured(metrics: dict[str, Any], target: str) -> float:
    value = metrics.get(target)
    if value is None:
        raise AdvisorError(f"the re-run has no {target} to compare")
    return float(value)


def _after_for_gain(target: str, before: float, gain_pct: float) -> float:
    """The figure after a change that gains ``gain_pct`` on ``before`` (``improvement_pct``'s inverse)."""
    return before * (1 + gain_pct / 100) if target == "tokens_per_s" else before * (1 - gain_pct / 100)


def _rerun(setup, options: RunOptions, store: RunStore, on_progress: ProgressFn | None, label: str):
    """One profiled re-run, its progress messages prefixed with ``label``; raises AdvisorError unless ok."""
    relay = None if on_progress is None else (lambda d, t, m: on_progress(d, t, f"{label}: {m}"))
    run = profile_run(setup, options, store, on_progress=relay)
    if run.status != "ok" or run.metrics() is None:
        raise AdvisorError(
            f"the re-run {label} ({run.run_id}) ended with status {run.status!r}: {run.record.get('message', '')}"
        )
    return run


def verification_diff(v: Verification, store: RunStore) -> tuple[TraceDiff | None, str]:
    """(the trace diff of a verification's before run, the baseline re-run or else the stored run, and
    its re-run; ""), or (None, why there is none: a run without a trace, one removed since)."""
    before = v.baseline_run_id or v.run_id
    try:
        return diff_paths(store.path(before), store.path(v.new_run_id)), ""
    except AdvisorError as err:  # TraceError is one: a run whose trace is missing or damaged
        return None, f"no trace diff of {before} and {v.new_run_id}: {err}"


def verifiable(rec: Recommendation, device_type: str) -> str:
    """Empty if ``rec`` can be re-run on this machine, else why not."""
    if rec.gain is None:
        return "it has no predicted gain to compare"
    if rec.after is None and not rec.options_after:
        return rec.action_note or "its action changes nothing the profiled step can run (advice only)"
    if rec.after is not None and rec.after.gpus > 1:
        return f"the changed layout needs {rec.after.gpus} GPUs; this step runs one process"
    if rec.after is not None and rec.after.parallel.offload != "none" and device_type == "cpu":
        return "offload moves state from a GPU to the host; this run is on the CPU"
    return ""


def verify(
    run_id: str,
    rule_id: str | None = None,
    store: RunStore | None = None,
    *,
    on_progress: ProgressFn | None = None,
    baseline: bool = True,
    pairs: int = 1,
) -> Verification:
    """Re-run ``run_id`` as it was (``baseline``) and then with the action of ``rule_id`` (default: the
    top recommendation that can be re-run here), and file the predicted/measured pair. With
    ``baseline=False`` the change is measured against the original run's own figure (half the time,
    but exposed to the machine's drift since). ``pairs`` > 1 re-runs both sides that many times in
    alternating order and takes the median of the pairs' gains (a small change on a noisy machine). Raises
    AdvisorError when nothing can be re-run or ``pairs`` is out of range."""
    if isinstance(pairs, bool) or not isinstance(pairs, int) or not 1 <= pairs <= MAX_PAIRS:
        raise AdvisorError(f"pairs must be a whole number from 1 to {MAX_PAIRS}, got {pairs!r}")
    if pairs > 1 and not baseline:
        raise AdvisorError(
            f"pairs = {pairs} needs the baseline re-runs: without them there is one stored figure to compare"
        )
    store = store or RunStore()
    check_run_id(run_id)
    info = store.load(run_id)
    record = info.record
    advice = advise_run(run_id, store)
    device_type = local_device_type(record.get("options", {}).get("device", "auto"))
    recs = advice.recommendations
    if rule_id is not None:
        # Named, a rule an earlier re-run demoted can be measured again (a quieter machine, a new
        # version): its "prediction" is then that earlier measurement.
        demoted = [r for r in advice.rejected if r.evidence is not None and r.gain is not None]
        recs = [r for r in (*recs, *demoted) if r.rule.id == rule_id]
        if not recs:
            fired = ", ".join(r.rule.id for r in advice.recommendations) or "none"
            raise AdvisorError(f"rule {rule_id!r} did not fire on run {run_id} (fired: {fired})")
    reasons = {r.rule.id: verifiable(r, device_type) for r in recs}
    runnable = [r for r in recs if not reasons[r.rule.id]]
    if not runnable:
        why = "; ".join(f"{k}: {v}" for k, v in reasons.items()) or "no rule fired"
        raise AdvisorError(f"nothing to re-run for {run_id}: {why}")
    rec = runnable[0]
    setup = rec.after or setup_from_dict(record["setup"])
    known = {f.name for f in fields(RunOptions)}
    opts = {k: v for k, v in {**record.get("options", {}), **(rec.options_after or {})}.items() if k in known}
    options = RunOptions(**opts)
    g = rec.gain
    target = g.target
    original = info.metrics() or {}
    # The original run's own measurement (a gain may restate it, e.g. per useful fp16 step).
    stored = _measured(original, target) if original.get(target) is not None else float(g.before)
    reference, base_run = original, None
    bases, news = [], []
    if baseline:
        base_opts = {k: v for k, v in record.get("options", {}).items() if k in known}
        base_setup, base_options = setup_from_dict(record["setup"]), RunOptions(**base_opts)
        for i in range(pairs):
            of = f" (pair {i + 1} of {pairs})" if pairs > 1 else ""
            # Alternating order (AB BA AB ...): a drift linear in time falls on both sides alike.
            for side in ("base", "new") if i % 2 == 0 else ("new", "base"):
                if side == "base":
                    bases.append(_rerun(base_setup, base_options, store, on_progress, f"as it was{of}"))
                else:
                    news.append(_rerun(setup, options, store, on_progress, f"with the change{of}"))
    else:
        news.append(_rerun(setup, options, store, on_progress, "with the change"))
    new = news[0]
    base_metrics = [r.metrics() or {} for r in bases]  # each run's metrics.json read once
    if bases:
        base_run, reference = bases[0], base_metrics[0]
    after_values = [_measured(r.metrics() or {}, target) for r in news]
    before_values = [_measured(m, target) for m in base_metrics]
    # Without a baseline there is one re-run and no pair.
    paired = list(zip(bases, news, strict=True)) if bases else []
    gains = [improvement_pct(target, b, a) for b, a in zip(before_values, after_values[: len(bases)], strict=True)]
    if len(gains) > 1:
        # Paired: the median of the pairs' own gains, each measured side by side (an unpaired median of
        # each side can cancel: pairs of +6.3, -5.0 and +3.2 % read -0.0 %), set on the median before.
        before = statistics.median(before_values)
        measured = _after_for_gain(target, before, statistics.median(gains))
    else:
        measured = after_values[0]
        before = before_values[0] if bases else stored
    spread = None
    # One timed step has no spread (max = min): 0 % would call any change beyond noise.
    several = (reference.get("steps_measured") or 2) >= 2
    if (
        several
        and reference.get("step_time_max_ms")
        and reference.get("step_time_min_ms")
        and reference.get("step_time_ms")
    ):
        spread = 100.0 * (reference["step_time_max_ms"] - reference["step_time_min_ms"]) / reference["step_time_ms"]
    if len(before_values) > 1 and before > 0:
        between = 100.0 * (max(before_values) - min(before_values)) / before
        spread = between if spread is None else max(spread, between)
    result = Verification(
        run_id=run_id,
        rule_id=rec.rule.id,
        target=target,
        before=before,
        predicted_after=g.after * before / stored if base_run is not None and stored > 0 else g.after,
        measured_after=measured,
        predicted_gain_pct=g.gain_pct,
        measured_gain_pct=improvement_pct(target, before, measured),
        new_run_id=new.run_id,
        changes=rec.changes,
        basis=g.basis,
        upper_bound=g.upper_bound,
        calibrated=g.calibrated_after is not None,
        noise_pct=spread if target != "peak_memory_bytes" else None,
        noise_unknown=spread is None and target != "peak_memory_bytes",
        baseline_run_id=base_run.run_id if base_run is not None else None,
        stored_before=stored,
        pairs=len(bases) or 1,
        pair_run_ids=tuple((b.run_id, n.run_id) for b, n in paired),
        pair_gains_pct=tuple(gains),
    )
    out = store.root / VERIFY_DIR / f"{run_id}--{rec.rule.id}--{new.run_id}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, {**result.as_dict(), "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    refit_calibration(store, setup)
    return result


def refit_calibration(store: RunStore, setup) -> bool:
    """Refit this device's stored calibration on every ok run, the re-runs just made among them, so the
    next advice's calibrated figures have learned from the measurement; True where one was refitted.
    Nothing happens where the device has no calibration (one is made on purpose, with a sweep), where
    the store now holds fewer of its runs than the calibration was fitted on (a refit would forget
    what the sweep taught it: a calibration copied in without its runs, or runs deleted since), and a
    refit that fails leaves the old file as it was.

    The guard's case, measured: bench/advice_scenarios.py copied a 36-run sweep's calibration into a
    fresh store, and the first re-runs refitted it on 10-20 of the bench's own runs; for the 512-wide
    model at seq 256 x 4 without recompute it then predicted 68 ms, where the sweep's calibration
    said 222 ms and the step measured 220-232 ms."""
    from advisor.advice.calibrate import Calibration, calibration_path, fit_calibration, training_records
    from advisor.spec.presets import device_key_for

    key = device_key_for(setup)
    path = calibration_path(store, key)
    if not path.is_file():
        return False
    try:
        fitted_on = Calibration.load(path).n_runs
    except AdvisorError:
        fitted_on = 0  # a damaged file: the refit replaces it
    try:
        records = training_records(store, key)
        if len(records) < fitted_on:
            return False
        fit_calibration(records).save(path)
    except AdvisorError:
        return False
    return True
