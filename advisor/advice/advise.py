"""Advice: run the rules over one input (a profiled run, a trace, or a setup alone), price each fired
rule's action, rank them, and write the report (Markdown and JSON)."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from advisor.advice import rules as R
from advisor.advice.evidence import REFUTED, Evidence, best_evidence, evidence_of, setup_key
from advisor.advice.gains import GAINS, Gain, GainInput, improvement_pct
from advisor.errors import AdvisorError, SpecError
from advisor.estimate.estimator import estimate
from advisor.spec.metrics import StepMetrics
from advisor.spec.presets import current_hardware, recorded_cpu_flags
from advisor.spec.specs import Setup, setup_from_dict, spec_to_dict

log = logging.getLogger("advisor.advice.advise")
_SEVERITY_RANK = {s: i for i, s in enumerate(R.SEVERITIES)}
TARGET_LABELS = {"step_time_ms": "step time", "peak_memory_bytes": "peak memory", "tokens_per_s": "tokens/s"}


def gain_phrase(target: str, pct: float) -> str:
    """A gain (``gains.improvement_pct``: positive is better) in words whose direction reads right:
    "15.6 % less step time", "12.0 % more tokens/s". "+15.6 % step time" read as a slower step."""
    label = TARGET_LABELS.get(target, target)
    if round(pct, 1) == 0:
        return f"no change in {label}"
    up = (pct > 0) == (target == "tokens_per_s")
    return f"{abs(pct):.1f} % {'more' if up else 'less'} {label}"


@dataclass(frozen=True)
class Recommendation:
    """A fired rule, its message with the numbers filled in, and what its action would gain."""

    rule: R.Rule
    message: str
    gain: Gain | None
    after: Setup | None = None
    """The setup with the action applied (None: advice only, or the action cannot apply)."""
    options_after: dict[str, Any] | None = None
    action_note: str = ""
    """Why the action could not be applied to the setup, where it could not."""

    changes: dict[str, Any] = field(default_factory=dict)
    """The spec and option values the action sets, as 'section.field': value."""
    also: tuple[str, ...] = ()
    """Lower-ranked rules that fired with the same change (merged into this one)."""
    evidence: Evidence | None = None
    """What a re-run of this change on this setup measured on this machine (advisor.advice.evidence):
    a conclusive one has re-priced ``gain`` from the measurement."""

    def as_dict(self) -> dict[str, Any]:
        g = self.gain
        return {
            "id": self.rule.id,
            "group": self.rule.group,
            "severity": self.rule.severity,
            "title": self.rule.title,
            "message": self.message,
            "why": self.rule.why,
            "action": self.rule.action["describe"],
            "changes": self.changes,
            "action_note": self.action_note,
            "target": self.rule.target,
            "gain": None
            if g is None
            else {
                "target": g.target,
                "before": g.before,
                "after": g.after,
                "gain_pct": g.gain_pct,
                "basis": g.basis,
                "analytic_after": g.analytic_after,
                "calibrated_after": g.calibrated_after,
                "upper_bound": g.upper_bound,
            },
            "references": list(self.rule.references),
            "also_fired": list(self.also),
            "verification": None if self.evidence is None else self.evidence.as_dict(),
        }


@dataclass(frozen=True)
class Advice:
    """Ranked recommendations for one input, and the rules that did not apply to it."""

    source: str
    recommendations: list[Recommendation]
    not_applicable: list[R.Evaluation]
    n_rules: int
    context: dict[str, Any]
    setup: Setup | None = None
    calibrated: bool = False
    rejected: list[Recommendation] = field(default_factory=list)
    """Rules that fired but whose action is predicted not to help or would not fit, with the reason."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "n_rules": self.n_rules,
            "calibrated": self.calibrated,
            "setup": spec_to_dict(self.setup) if self.setup else None,
            "recommendations": [r.as_dict() for r in self.recommendations],
            "not_applicable": [{"id": e.rule.id, "missing": list(e.missing)} for e in self.not_applicable],
            "rejected": [{"id": r.rule.id, "reason": r.action_note} for r in self.rejected],
        }

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2, default=str)


def _action_values(rule: R.Rule, ctx: dict[str, Any]) -> dict[str, Any]:
    values = dict(rule.action.get("set") or {})
    for key, expr in (rule.action.get("compute") or {}).items():
        values[key] = R.evaluate_expression(str(expr), ctx)
    return values


def _rank_key(r: Recommendation) -> tuple:
    return (_SEVERITY_RANK[r.rule.severity], -(r.gain.gain_pct if r.gain is not None else float("-inf")), r.rule.id)


def _one_per_lever(recs: list[Recommendation]) -> list[Recommendation]:
    """Recommendations in rank order, one per lever: a rule whose action sets a field that a
    higher-ranked recommendation already sets (ZeRO-1 vs ZeRO-2, two TP changes) is listed under it as
    an alternative, not as advice of its own; the two cannot both be taken."""
    out: list[Recommendation] = []
    for r in sorted(recs, key=_rank_key):
        first = next((k for k in out if r.changes and set(k.changes) & set(r.changes)), None)
        if first is None:
            out.append(r)
        else:
            out[out.index(first)] = replace(first, also=(*first.also, r.rule.id))
    return out


def _already_in_place(values: dict[str, Any], setup: Setup | None, options: dict[str, Any] | None) -> str:
    """Why an action changes nothing (empty: it changes something): every value it sets is already the
    setup's or the run's (a compiled run that is still launch-bound is not told to compile). A value
    the input does not record (a trace's options) counts as a change."""
    if not values:
        return ""
    for key, value in values.items():
        section, _, name = key.partition(".")
        if section == "options":
            if not options or name not in options:
                return ""
            current = options[name]
        elif setup is not None and hasattr(getattr(setup, section, None), name):
            current = getattr(getattr(setup, section), name)
        else:
            return ""
        if current != value:
            return ""
    return "already in place: " + ", ".join(f"{k} = {v}" for k, v in values.items())


def _rejection(rec: Recommendation, est: Any) -> str:
    """Why a fired rule's action is not recommended (empty: it is): it is predicted not to help, or it
    would make a setup that fits no longer fit."""
    g, ev = rec.gain, rec.evidence
    if ev is not None and ev.verdict == REFUTED:
        return f"{ev.phrase()} (re-run {ev.new_run_id}), against a predicted {ev.predicted_gain_pct:+.1f} %"
    if g is None:
        return ""
    if round(g.gain_pct, 1) <= 0:  # what gain_phrase shows as "no change" is no gain either
        return f"predicted {gain_phrase(g.target, g.gain_pct)}: no gain"
    side = g.side or {}
    if side.get("fits") is False and (est is None or est.fits):
        return f"the changed setup would not fit: {side['memory_pct_after']:.0f} % of device memory (estimated)"
    if est is not None and not est.fits and g.target != "peak_memory_bytes" and side:
        mem_before, mem_after = side["peak_memory_bytes"]
        if mem_after >= mem_before:
            return "the setup does not fit and this change does not lower its memory: fix memory first"
    return ""


def repriced(gain: Gain, ev: Evidence) -> Gain:
    """``gain`` with its after-figure taken from a conclusive re-run: the measured ratio of the
    side-by-side pair applied to this input's before-figure. The models' own figures stay beside it."""
    after = gain.before * ev.measured_ratio
    basis = f"{ev.phrase()} (re-run {ev.new_run_id}; the prediction was {ev.predicted_gain_pct:+.1f} %)"
    return replace(
        gain, after=after, gain_pct=improvement_pct(gain.target, gain.before, after), basis=basis, upper_bound=False
    )


def apply_action(
    rule: R.Rule, ctx: dict[str, Any], setup: Setup | None, options: dict[str, Any] | None
) -> tuple[Setup | None, dict[str, Any] | None, dict[str, Any], str]:
    """The setup and run options with ``rule``'s action applied, the values set, and a note where the
    action cannot apply (SpecError text, or no setup to change)."""
    values = _action_values(rule, ctx)
    if not values:
        return None, None, values, ""
    spec_changes: dict[str, dict[str, Any]] = {}
    opts = dict(options or {})
    for key, value in values.items():
        section, _, name = key.partition(".")
        if section == "options":
            opts[name] = value
            if name == "compile" and setup is not None:
                # A run compiles as its options say and its setup says the same (the launcher makes it so),
                # so the Size tab, the Plan tab and the estimate of the changed setup see it too.
                spec_changes.setdefault("train", {})["compile"] = bool(value)
        else:
            spec_changes.setdefault(section, {})[name] = value
    if not spec_changes:
        return setup, opts, values, _step_conflict(setup, opts)
    if setup is None:
        return None, opts, values, "no setup to change: the input is a trace without a spec"
    try:
        after = replace(
            setup,
            model=replace(setup.model, **spec_changes.get("model", {})),
            train=replace(setup.train, **spec_changes.get("train", {})),
            parallel=replace(setup.parallel, **spec_changes.get("parallel", {})),
        )
    except SpecError as err:
        return None, opts, values, f"cannot apply: {err}"
    return after, opts, values, _step_conflict(after, opts)


def _step_conflict(setup: Setup | None, opts: dict[str, Any]) -> str:
    """Why the profiled step could not run the changed setup and options together (empty: it could)."""
    if setup is not None and opts.get("compile") and setup.train.offload_activations:
        return (
            "cannot apply: the profiled step offloads activations in eager mode only, and torch.compile would "
            "trace through its hooks (turn activation offload off first)"
        )
    return ""


def advise(
    metrics: StepMetrics | None = None,
    setup: Setup | None = None,
    options: dict[str, Any] | None = None,
    *,
    rules: list[R.Rule] | None = None,
    calibration: Any = None,
    source: str = "",
    evidence: Sequence[Evidence] = (),
) -> Advice:
    """Fire every rule on this input and rank the recommendations: critical before warning before info,
    then by predicted gain (largest first; rules without a figure last). ``evidence``: verifications
    of this setup on this machine, oldest first (``verifications_for``); a conclusive one re-prices
    its recommendation from the measurement, and one that measured a loss demotes it to the rejected."""
    if metrics is None and setup is None:
        raise AdvisorError("advice needs a profiled run, a trace's metrics or a setup")
    rules = rules if rules is not None else R.load_rules()
    est = estimate(setup) if setup is not None else None
    ctx = R.build_context(metrics, setup, est, options)
    recs: list[Recommendation] = []
    rejected: list[Recommendation] = []
    not_applicable: list[R.Evaluation] = []
    for rule in rules:
        ev = R.evaluate(rule, ctx)
        if ev.missing:
            not_applicable.append(ev)
            continue
        if not ev.fired:
            continue
        try:
            after, opts_after, values, note = apply_action(rule, ctx, setup, options)
            gain = None
            if not note:
                g_in = GainInput(ctx, metrics, setup, after, opts_after, calibration, est)
                gain = GAINS[rule.gain](rule.target, g_in)
        except Exception as err:  # one faulty rule or gain must not take the whole advice down
            log.exception("rule %s: action or gain failed", rule.id)
            after, opts_after, values, gain = None, None, {}, None
            note = f"gain not computed: {type(err).__name__}: {err}"
        proof = best_evidence(evidence, rule.id, values, rule.target) if gain is not None else None
        if proof is not None and proof.conclusive:
            gain = repriced(gain, proof)
        rec = Recommendation(rule, ev.message, gain, after, opts_after, note, values, evidence=proof)
        why_not = _already_in_place(values, setup, options) or _rejection(rec, est)
        if why_not:
            rejected.append(replace(rec, action_note=why_not))
        else:
            recs.append(rec)
    return Advice(
        source=source or (metrics.run_id if metrics else "setup"),
        recommendations=_one_per_lever(recs),
        not_applicable=not_applicable,
        rejected=sorted(rejected, key=_rank_key),
        n_rules=len(rules),
        context=ctx,
        setup=setup,
        calibrated=calibration is not None,
    )


def advise_run(run_id: str, store: Any = None, *, calibration: Any = None) -> Advice:
    """Advice for a stored profiled run: its metrics, its setup and its run options."""
    from advisor.store.runstore import RunStore

    store = store or RunStore()
    info = store.load(run_id)
    m = info.metrics()
    if info.status != "ok" or m is None:
        raise AdvisorError(f"run {run_id} has status {info.status!r} and no metrics to advise on; profile it again")
    record = info.record
    setup = setup_from_dict(record["setup"]) if "setup" in record else None
    if setup is not None:
        # Today's peaks for the device the run recorded (the calibration is fitted against them too).
        setup = replace(setup, hardware=current_hardware(setup.hardware, recorded_cpu_flags(record)))
    if calibration is None and setup is not None:
        calibration = _calibration_for(store, setup)
    options = record.get("options") or {}
    return advise(
        StepMetrics.from_dict(m),
        setup,
        options,
        calibration=calibration,
        source=run_id,
        evidence=verifications_for(store, setup, options) if setup is not None else (),
    )


def verifications_for(store: Any, setup: Setup, options: dict[str, Any] | None = None) -> list[Evidence]:
    """The verifications filed in ``store`` whose original run had this setup, on this device, with the
    same step-changing options (``evidence.setup_key``), oldest first. A pair whose run is gone is
    matched by its baseline re-run (the same setup, run again)."""
    from advisor.store.history import verification_pairs

    key, out, keys = setup_key(setup, options), [], {}
    for pair in sorted(verification_pairs(store), key=lambda p: str(p.get("created_utc") or "")):
        ids = [r for r in (pair.get("run_id"), pair.get("baseline_run_id")) if isinstance(r, str)]
        for run_id in ids:
            if run_id not in keys:
                keys[run_id] = _run_setup_key(store, run_id)
        found = next((keys[r] for r in ids if keys[r] is not None), None)
        if found == key and (e := evidence_of(pair)) is not None:
            out.append(e)
    return out


def _run_setup_key(store: Any, run_id: str) -> str | None:
    """setup_key of a stored run, or None where it is gone or holds no setup."""
    try:
        record = store.load(run_id).record
        return setup_key(setup_from_dict(record["setup"]), record.get("options") or {})
    except (AdvisorError, KeyError, TypeError, ValueError):
        return None


def advise_trace(path: str | Path) -> Advice:
    """Advice for a trace file or folder (no spec: rules that need one are listed as not applicable)."""
    from advisor.analysis.summary import analyze_path
    from advisor.store.ceilings import run_ceilings

    report = analyze_path(path, Path(path).name, ceilings=run_ceilings(path))
    return advise(report.metrics, source=str(path))


def _calibration_for(store: Any, setup: Setup) -> Any:
    try:
        from advisor.advice.calibrate import device_key_for, load_calibration
    except ImportError:
        return None
    try:
        return load_calibration(store, device_key_for(setup))
    except AdvisorError:
        return None


# --- the report ----------------------------------------------------------------------------------


def fmt_value(target: str, value: float | None) -> str:
    """A target figure for people: GiB, tok/s or ms."""
    if value is None:
        return "-"
    if target == "peak_memory_bytes":
        return f"{value / 2**30:.3f} GiB"
    if target == "tokens_per_s":
        return f"{value:,.0f} tok/s"
    return f"{value:,.1f} ms"


def _plan_pointer(setup: Setup | None) -> str:
    """For a setup that does not fit: where to find one that does. Each recommendation is one change
    (70B on 8 H100s: ZeRO-1 takes 1,218 GiB to 493 GiB, still 6x the device), while the planner
    searches every layout of the model on its GPUs."""
    if setup is None:
        return ""
    est = estimate(setup)
    if est.fits:
        return ""
    from advisor.spec.presets import HARDWARE, MODELS

    gpu = next((k for k, make in HARDWARE.items() if make().name == setup.hardware.name), None)
    where = "the Plan tab"
    if gpu and setup.model.name in MODELS:
        where += (
            f", or `python -m advisor plan --model {setup.model.name} --gpu {gpu} --gpus {setup.gpus} "
            f"--seq {setup.train.seq_len} --global-batch {setup.global_batch} --precision {setup.train.precision}`"
        )
    return (
        f"**The setup does not fit** ({est.memory.total_bytes / 2**30:,.1f} GiB of "
        f"{setup.hardware.memory_bytes / 2**30:.1f} GiB per GPU) and each recommendation below is one change. "
        f"To search every layout of this model on {setup.gpus} GPUs for those that fit: {where}."
    )


def advice_markdown(advice: Advice) -> str:
    """The report users download: ranked recommendations with numbers, then what did not apply."""
    lines = [f"# Advice for {advice.source}", ""]
    lines.append(
        f"{len(advice.recommendations) + len(advice.rejected)} of {advice.n_rules} rules fired"
        + (f" ({len(advice.rejected)} not recommended)" if advice.rejected else "")
        + "; "
        f"{len(advice.not_applicable)} did not apply (their input is missing). "
        + (
            "Gains use this machine's calibrated regression."
            if advice.calibrated
            else "Gains use the estimator."
            if advice.setup is not None
            else "Gains are upper bounds from the trace's time shares (there is no setup to estimate)."
        )
    )
    lines.append("")
    if note := _plan_pointer(advice.setup):
        lines += [note, ""]
    if not advice.recommendations:
        lines.append("Nothing to recommend: no rule fired on this input.")
    for i, r in enumerate(advice.recommendations, 1):
        lines.append(f"## {i}. [{r.rule.severity}] {r.rule.title} (`{r.rule.id}`)")
        lines.append("")
        lines.append(r.message)
        lines.append("")
        lines.append(f"- **Action:** {r.rule.action['describe']}")
        if r.changes:
            lines.append("- **Changes:** " + ", ".join(f"`{k}` = {v!r}" for k, v in r.changes.items()))
        g = r.gain
        if g is not None:
            bound = " (upper bound)" if g.upper_bound else ""
            lines.append(
                f"- **Predicted gain:** {gain_phrase(g.target, g.gain_pct)}{bound}: {fmt_value(g.target, g.before)} -> "
                f"{fmt_value(g.target, g.after)}; {g.basis}"
            )
            if g.side:
                other = "peak_memory_bytes" if g.target != "peak_memory_bytes" else "step_time_ms"
                b, a = g.side[other]
                if b and abs(a - b) / b > 0.01:
                    lines.append(
                        f"- **Also changes {TARGET_LABELS[other]}:** {fmt_value(other, b)} -> {fmt_value(other, a)} "
                        f"({100 * (a - b) / b:+.0f} %)"
                    )
            if g.calibrated_after is not None and g.analytic_after is not None:
                lines.append(
                    f"- **Analytic vs calibrated:** {fmt_value(g.target, g.analytic_after)} vs "
                    f"{fmt_value(g.target, g.calibrated_after)}"
                )
            if r.evidence is not None:
                lines.append(f"- **Re-run on this machine:** {r.evidence.sentence()}")
        elif r.action_note:
            lines.append(f"- **Gain:** not computed ({r.action_note})")
        elif advice.setup is None and advice.context.get("step_time_ms") is None:
            lines.append(
                "- **Gain:** not predicted: the trace marks no training steps (ProfilerStep or NVTX step ranges), "
                "so the share above is of the GPU span, with no step time to take it from"
            )
        else:
            lines.append("- **Gain:** not predicted for this input")
        lines.append(f"- **Why:** {r.rule.why}")
        if r.also:
            lines.append("- **Alternatives that change the same setting:** " + ", ".join(f"`{a}`" for a in r.also))
        if r.rule.references:
            lines.append("- **References:** " + "; ".join(r.rule.references))
        lines.append("")
    if advice.rejected:
        lines.append("## Fired but not recommended")
        lines.append("")
        for r in advice.rejected:
            lines.append(f"- `{r.rule.id}` ({r.rule.title}): {r.action_note}")
        lines.append("")
    if advice.not_applicable:
        lines.append("## Rules that did not apply")
        lines.append("")
        for e in advice.not_applicable:
            lines.append(f"- `{e.rule.id}`: needs {', '.join(e.missing)}")
    return "\n".join(lines) + "\n"
