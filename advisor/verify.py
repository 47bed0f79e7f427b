"""Verify a recommendation by re-running: profile the run again with the action applied, and set the
predicted change beside the measured one. Each pair is filed under ``<store>/verifications/`` and
the new run is an ordinary run, so the calibration learns from it too."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, fields
from typing import Any

from advisor.advise import Recommendation, advise_run
from advisor.errors import AdvisorError
from advisor.gains import improvement_pct
from advisor.profiling import RunOptions
from advisor.runner import ProgressFn, local_device_type, profile_run
from advisor.runstore import RunStore, check_run_id, write_json_atomic
from advisor.specs import setup_from_dict

VERIFY_DIR = "verifications"


@dataclass(frozen=True)
class Verification:
    """A recommendation's predicted change and the change measured by re-running, on its target figure."""

    run_id: str
    rule_id: str
    target: str
    before: float
    """Measured on the original run."""
    predicted_after: float
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
    """The original run's step-time spread (max - min over its timed steps), % of its median: a
    measured change smaller than this is within noise."""

    @property
    def error_pct(self) -> float:
        """Predicted minus measured gain, in percentage points."""
        return self.predicted_gain_pct - self.measured_gain_pct

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _measured(metrics: dict[str, Any], target: str) -> float:
    value = metrics.get(target)
    if value is None:
        raise AdvisorError(f"the re-run has no {target} to compare")
    return float(value)


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
) -> Verification:
    """Re-run ``run_id`` with the action of ``rule_id`` (default: the top recommendation that can be
    re-run here) and file the predicted/measured pair. Raises AdvisorError when nothing can be re-run."""
    store = store or RunStore()
    check_run_id(run_id)
    info = store.load(run_id)
    record = info.record
    advice = advise_run(run_id, store)
    device_type = local_device_type(record.get("options", {}).get("device", "auto"))
    recs = advice.recommendations
    if rule_id is not None:
        recs = [r for r in recs if r.rule.id == rule_id]
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
    new = profile_run(setup, options, store, on_progress=on_progress)
    metrics = new.metrics()
    if new.status != "ok" or metrics is None:
        raise AdvisorError(f"the re-run {new.run_id} ended with status {new.status!r}: {new.record.get('message', '')}")
    g = rec.gain
    target = g.target
    measured = _measured(metrics, target)
    original = info.metrics() or {}
    # The original run's own measurement (a gain may restate it, e.g. per useful fp16 step).
    before = _measured(original, target) if original.get(target) is not None else float(g.before)
    spread = None
    if original.get("step_time_max_ms") and original.get("step_time_min_ms") and original.get("step_time_ms"):
        spread = 100.0 * (original["step_time_max_ms"] - original["step_time_min_ms"]) / original["step_time_ms"]
    result = Verification(
        run_id=run_id,
        rule_id=rec.rule.id,
        target=target,
        before=before,
        predicted_after=g.after,
        measured_after=measured,
        predicted_gain_pct=g.gain_pct,
        measured_gain_pct=improvement_pct(target, before, measured),
        new_run_id=new.run_id,
        changes=rec.changes,
        basis=g.basis,
        upper_bound=g.upper_bound,
        calibrated=g.calibrated_after is not None,
        noise_pct=spread if target != "peak_memory_bytes" else None,
    )
    out = store.root / VERIFY_DIR / f"{run_id}--{rec.rule.id}--{new.run_id}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, {**result.as_dict(), "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    return result
