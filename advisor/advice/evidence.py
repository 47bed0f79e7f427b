"""What re-runs on this machine measured for a recommendation: the verdict of each verification pair
(``advisor.advice.verify`` files them) and the evidence that re-prices or demotes the advice.

A prediction is a model's opinion; a side-by-side re-run on the same machine is a measurement of the
same change on the same setup. On an AMX Xeon fp32 -> bf16 was predicted to cut the tiny sample's step
by 80.6 % and the re-run measured it 104.6 % slower (bf16 elementwise ops 3.2x slower there): advice
that is offered again after that, at the old figure, is advice nobody should trust. So a conclusive
measurement replaces the prediction, a measured loss demotes the recommendation, and a measurement
smaller than the baseline's own step-to-step spread is reported as inconclusive, not as a verdict.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from advisor.spec.presets import device_key_for
from advisor.spec.specs import Setup, spec_to_dict

CONFIRMED = "confirmed"
FELL_SHORT = "fell short"
REFUTED = "refuted"
INCONCLUSIVE = "inconclusive"
UNKNOWN_SPREAD = (
    "the baseline's spread is unknown (one timed step, one pair), so no change can be told from noise: "
    "re-run with 2 or more steps, or 2 or more pairs"
)
"""Why a re-run whose baseline has no measured spread is inconclusive (``Verification.noise_unknown``)."""
VERDICTS = (CONFIRMED, FELL_SHORT, REFUTED, INCONCLUSIVE)
SHORT_FRAC = 0.5
"""A measured gain under this share of the predicted one "fell short": the prediction was far off
even though the change helped (and the advice is re-priced at the measured figure)."""
OPTION_KEYS = ("num_workers", "pin_memory", "compile")
"""Run options that change the measured step: a verification counts only for the same ones."""


def verdict(
    predicted_gain_pct: float, measured_gain_pct: float, noise_pct: float | None, upper_bound: bool = False
) -> str:
    """What a re-run says of a prediction, both gains in % (positive: better). Inconclusive where the
    measured change is no larger than the baseline's step-to-step spread (max - min over its timed
    steps, % of its median; one loaded machine's baseline spread 39.7 %); refuted where it measured no
    gain or a loss; fell short under SHORT_FRAC of a positive prediction, unless the prediction was an
    upper bound (a share of the step a change could at most remove), which any real gain bears out;
    else confirmed."""
    if noise_pct is not None and abs(measured_gain_pct) <= noise_pct:
        return INCONCLUSIVE
    if measured_gain_pct <= 0:
        return REFUTED
    if not upper_bound and predicted_gain_pct > 0 and measured_gain_pct < SHORT_FRAC * predicted_gain_pct:
        return FELL_SHORT
    return CONFIRMED


@dataclass(frozen=True)
class Evidence:
    """One verification of a recommendation on this machine, for the setup being advised."""

    rule_id: str
    changes: dict[str, Any]
    target: str
    verdict: str
    predicted_gain_pct: float
    measured_gain_pct: float
    measured_ratio: float
    """measured_after / before of the re-run pair, on the target figure (both measured side by side)."""
    noise_pct: float | None
    date: str
    """UTC date the pair was filed (YYYY-MM-DD), or '' where the file does not say."""
    run_id: str
    new_run_id: str

    @property
    def conclusive(self) -> bool:
        return self.verdict != INCONCLUSIVE

    def phrase(self) -> str:
        """ "measured -104.6 % on this machine on 2026-12-06"."""
        when = f" on {self.date}" if self.date else ""
        return f"measured {self.measured_gain_pct:+.1f} % on this machine{when}"

    def sentence(self) -> str:
        """The verdict in words, with both figures and the re-run that measured it."""
        pred = f"predicted {self.predicted_gain_pct:+.1f} %"
        if self.verdict == INCONCLUSIVE:
            spread = "" if self.noise_pct is None else f" of {self.noise_pct:.1f} %"
            return (
                f"inconclusive: {self.phrase()}, within the baseline's step-to-step spread{spread} "
                f"({pred}; re-run {self.new_run_id})"
            )
        return f"{self.verdict}: {self.phrase()} ({pred}; re-run {self.new_run_id})"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def setup_key(setup: Setup, options: dict[str, Any] | None = None) -> str:
    """One string equal for the same setup on the same device with the same step-changing options
    (the hardware's peaks are left out: they follow this machine's flags and presets over time)."""
    d = spec_to_dict(setup)
    d.pop("hardware")
    opts = {k: (options or {}).get(k) for k in OPTION_KEYS if (options or {}).get(k)}
    return device_key_for(setup) + "|" + json.dumps({"setup": d, "options": opts}, sort_keys=True, default=str)


def _number(value: object) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def evidence_of(pair: dict[str, Any]) -> Evidence | None:
    """A verification pair (the JSON ``verify`` files) as Evidence; None where it lacks a figure."""
    before, after = _number(pair.get("before")), _number(pair.get("measured_after"))
    predicted, measured = _number(pair.get("predicted_gain_pct")), _number(pair.get("measured_gain_pct"))
    if before is None or after is None or predicted is None or measured is None or before <= 0:
        return None
    noise = _number(pair.get("noise_pct"))
    changes = pair.get("changes") if isinstance(pair.get("changes"), dict) else {}
    return Evidence(
        rule_id=str(pair.get("rule_id", "")),
        changes=changes,
        target=str(pair.get("target", "")),
        # A pair filed without a measured spread (one timed step, one pair) proves nothing.
        verdict=INCONCLUSIVE
        if pair.get("noise_unknown") is True
        else verdict(predicted, measured, noise, pair.get("upper_bound") is True),
        predicted_gain_pct=predicted,
        measured_gain_pct=measured,
        measured_ratio=after / before,
        noise_pct=noise,
        date=str(pair.get("created_utc") or "")[:10],
        run_id=str(pair.get("run_id", "")),
        new_run_id=str(pair.get("new_run_id", "")),
    )


def best_evidence(evidence: Iterable[Evidence], rule_id: str, changes: dict[str, Any], target: str) -> Evidence | None:
    """The evidence that speaks for a recommendation (its rule, its change, its target figure): the
    latest conclusive verification, else the latest inconclusive one; None where there is none.
    ``evidence`` is oldest first."""
    mine = [e for e in evidence if e.rule_id == rule_id and e.changes == changes and e.target == target]
    conclusive = [e for e in mine if e.conclusive]
    return (conclusive or mine or [None])[-1]
