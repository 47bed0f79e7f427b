"""Run history: the stored runs as one table, two runs side by side, and predicted against measured.

Reads the run store and the verification pairs beside it; returns DataFrames and frozen dataclasses.
Nothing here profiles, prints or plots (the figures are in ``advisor.present.charts``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import pandas as pd

from advisor.errors import AdvisorError, shown_value
from advisor.store.runstore import RunInfo, RunStore

GiB = 2**30
VERIFICATIONS_DIR = "verifications"
"""Where ``advisor.advice.verify`` files its pairs (its VERIFY_DIR); not imported from there because that
module loads torch, and listing runs should not."""

RUN_COLUMNS = (
    "run_id",
    "started_utc",
    "status",
    "model",
    "device_type",
    "device_name",
    "precision",
    "seq_len",
    "micro_batch",
    "grad_accum",
    "recompute",
    "step_time_ms",
    "estimate_step_time_ms",
    "tokens_per_s",
    "mfu_pct",
    "peak_memory_gib",
    "message",
)
COUNT_COLUMNS = ("seq_len", "micro_batch", "grad_accum")
"""Integer columns, pandas' nullable Int64 (<NA> where a damaged entry has no value)."""
NUMERIC_COLUMNS = frozenset(
    (
        *COUNT_COLUMNS,
        "step_time_ms",
        "estimate_step_time_ms",
        "tokens_per_s",
        "mfu_pct",
        "peak_memory_gib",
    )
)
"""Columns that hold numbers: NaN (or <NA> for counts) where a run has no figure."""
DAMAGED = "damaged"
"""The status shown for a store entry whose run.json cannot be read (not one of the run statuses)."""

# (label with unit, StepMetrics field, factor to the label's unit), in the order the comparison lists them.
COMPARED_METRICS = (
    ("step time (ms)", "step_time_ms", 1.0),
    ("data (ms)", "data_ms", 1.0),
    ("forward (ms)", "forward_ms", 1.0),
    ("backward (ms)", "backward_ms", 1.0),
    ("optimizer (ms)", "optimizer_ms", 1.0),
    ("other (ms)", "other_ms", 1.0),
    ("tokens/s", "tokens_per_s", 1.0),
    ("MFU (%)", "mfu_frac", 100.0),
    ("peak memory (GiB)", "peak_memory_bytes", 1.0 / GiB),
    ("estimate step time (ms)", "estimate_step_time_ms", 1.0),
)

RUN_ESTIMATE = "run estimate"
VERIFIED_GAIN = "verified gain"
PAIR_COLUMNS = (
    "kind",
    "run_id",
    "base_run_id",
    "rule_id",
    "model",
    "device_type",
    "predicted_ms",
    "measured_ms",
    "measured_over_predicted",
)


def _number(value: object, factor: float = 1.0) -> float:
    """``value * factor`` as a float; NaN where the value is missing or not a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value) * factor


def _read_metrics(info: RunInfo) -> dict[str, Any] | None:
    """metrics.json, or None where it is missing or unreadable (the listing shows such a run without figures)."""
    try:
        return info.metrics()
    except AdvisorError:  # damaged since it was listed: the listing marks it when it is read next
        return None


def _started_utc(run_id: str, record: dict[str, Any]) -> str:
    """``YYYY-mm-dd HH:MM:SS`` (UTC) from run.json's created_utc, else from the id's leading stamp."""
    created = record.get("created_utc")
    if isinstance(created, str) and len(created) >= 19:
        return created[:19].replace("T", " ")
    d, t = run_id[:8], run_id[9:15]
    if d.isdigit() and t.isdigit():
        return f"{d[:4]}-{d[4:6]}-{d[6:]} {t[:2]}:{t[2:4]}:{t[4:]}"
    return ""


def _run_row(info: RunInfo) -> dict[str, Any]:
    """One run-table row; the step's shape comes from metrics.json (what ran) or else run.json's setup
    (what was asked), so a failed run still shows what it tried."""
    record = info.record
    m = _read_metrics(info) or {}
    setup = record.get("setup") if isinstance(record.get("setup"), dict) else {}
    model, train = setup.get("model") or {}, setup.get("train") or {}
    parallel, hardware = setup.get("parallel") or {}, setup.get("hardware") or {}
    grad_accum = m.get("grad_accum")
    if grad_accum is None and train.get("micro_batch"):
        # Setup.grad_accum on the raw dict: global_batch 0 means one micro-batch per data-parallel rank.
        per_step = train.get("micro_batch", 1) * parallel.get("dp", 1)
        grad_accum = (train.get("global_batch") or per_step) // per_step
    kind = hardware.get("kind")
    return {
        "run_id": info.run_id,
        "started_utc": _started_utc(info.run_id, record),
        "status": info.status,
        "model": m.get("model_name") or model.get("name") or "",
        "device_type": m.get("device_type") or record.get("device_type") or {"gpu": "cuda", "cpu": "cpu"}.get(kind, ""),
        "device_name": m.get("device_name") or hardware.get("name") or "",
        "precision": m.get("precision") or train.get("precision") or "",
        "seq_len": _number(m.get("seq_len", train.get("seq_len"))),
        "micro_batch": _number(m.get("micro_batch", train.get("micro_batch"))),
        "grad_accum": _number(grad_accum),
        "recompute": m.get("recompute") or train.get("recompute") or "",
        "step_time_ms": _number(m.get("step_time_ms")),
        "estimate_step_time_ms": _number(m.get("estimate_step_time_ms")),
        "tokens_per_s": _number(m.get("tokens_per_s")),
        "mfu_pct": _number(m.get("mfu_frac"), 100.0),
        "peak_memory_gib": _number(m.get("peak_memory_bytes"), 1.0 / GiB),
        "message": str(record.get("message") or ""),
    }


def _damaged_row(name: str, reason: str) -> dict[str, Any]:
    row = {col: math.nan if col in NUMERIC_COLUMNS else "" for col in RUN_COLUMNS}
    row.update(run_id=name, started_utc=_started_utc(name, {}), status=DAMAGED, message=reason)
    return row


def run_table(
    store: RunStore,
    model: str | None = None,
    status: str | None = None,
    device: str | None = None,
    text: str | None = None,
) -> pd.DataFrame:
    """One row per stored run, newest first, then the damaged entries (status 'damaged', the reason as
    message). Columns: RUN_COLUMNS; times in ms, memory in GiB, MFU in % (0 to 100). A run without
    metrics (failed, oom, ...) keeps its row with NaN figures.

    Filters (None or '' means all): ``model``, ``status`` and ``device`` (device_type: 'cpu' or
    'cuda') match exactly; ``text`` is a case-insensitive substring of run id, model or message.
    """
    runs, damaged = store.list_runs()
    rows = [_run_row(r) for r in runs] + [_damaged_row(name, why) for name, why in damaged]
    dtypes = {col: "Int64" if col in COUNT_COLUMNS else "float64" for col in NUMERIC_COLUMNS}
    table = pd.DataFrame(rows, columns=list(RUN_COLUMNS)).astype(dtypes)
    return filter_runs(table, model=model, status=status, device=device, text=text)


def filter_runs(
    table: pd.DataFrame,
    model: str | None = None,
    status: str | None = None,
    device: str | None = None,
    text: str | None = None,
) -> pd.DataFrame:
    """The rows of a run table that pass the filters (see :func:`run_table`), index reset. AdvisorError
    for a filter that is not text."""
    for name, value in (("model", model), ("status", status), ("device", device), ("text", text)):
        if value is not None and not isinstance(value, str):
            raise AdvisorError(f"{name}={shown_value(value, 60)}: a filter must be text (or empty for all)")
    keep = pd.Series(True, index=table.index)
    for col, value in (("model", model), ("status", status), ("device_type", device)):
        if value:
            keep &= table[col] == value
    if text and text.strip():
        needle = text.strip().lower()
        haystack = table["run_id"] + " " + table["model"] + " " + table["message"]
        keep &= haystack.str.lower().str.contains(needle, regex=False)
    return table[keep].reset_index(drop=True)


@dataclass(frozen=True)
class FilterChoices:
    """The distinct values of a run table's filter columns, sorted, for dropdowns."""

    models: tuple[str, ...]
    statuses: tuple[str, ...]
    devices: tuple[str, ...]
    """device_type values: 'cpu', 'cuda'."""


def filter_choices(table: pd.DataFrame) -> FilterChoices:
    """The models, statuses and device types present in ``table`` (empty values left out)."""

    def distinct(col: str) -> tuple[str, ...]:
        return tuple(sorted({v for v in table[col] if isinstance(v, str) and v}))

    return FilterChoices(models=distinct("model"), statuses=distinct("status"), devices=distinct("device_type"))


def flatten_spec(record: dict[str, Any]) -> dict[str, Any]:
    """run.json's setup and options as ``section.field`` -> value (``train.precision``,
    ``options.num_workers``), the same names a recommendation's changes use."""
    flat: dict[str, Any] = {}
    setup = record.get("setup") if isinstance(record.get("setup"), dict) else {}
    sections = [(name, value) for name, value in setup.items() if isinstance(value, dict)]
    if isinstance(record.get("options"), dict):
        sections.append(("options", record["options"]))
    for section, values in sections:
        for key, value in values.items():
            flat[f"{section}.{key}"] = value
    return flat


def spec_defaults() -> dict[str, Any]:
    """``section.field`` -> the default value of every spec and run-option field that has one."""
    from dataclasses import MISSING, fields

    from advisor.spec.options import RunOptions
    from advisor.spec.specs import HardwareSpec, ModelSpec, ParallelSpec, TrainSpec

    out: dict[str, Any] = {}
    for section, cls in (
        ("model", ModelSpec),
        ("train", TrainSpec),
        ("parallel", ParallelSpec),
        ("hardware", HardwareSpec),
        ("options", RunOptions),
    ):
        for f in fields(cls):
            if f.default is not MISSING:
                out[f"{section}.{f.name}"] = f.default
            elif f.default_factory is not MISSING:
                out[f"{section}.{f.name}"] = f.default_factory()
    return out


@dataclass(frozen=True)
class RunComparison:
    """Two runs side by side; A is the baseline and every change is B relative to A."""

    run_a: str
    run_b: str
    spec_diff: pd.DataFrame
    """Columns field, a, b: only the setup/option fields that differ; a field one run's record lacks
    (written by an older version) shows None on that side, and counts as its default (listed only where
    the other run's value is not the default)."""
    metrics: pd.DataFrame
    """Columns metric (label with its unit), a, b, change_pct = (b - a) / a * 100 (NaN where a is 0 or
    either side is missing); MFU in % and memory in GiB."""
    summary: str
    """One line: step time, tokens/s and peak memory change, and what differs."""
    metrics_a: dict[str, Any]
    """Run A's metrics.json (StepMetrics fields), for the phase figure."""
    metrics_b: dict[str, Any]


def _metrics_for_compare(store: RunStore, run_id: str) -> tuple[RunInfo, dict[str, Any]]:
    """The run and its metrics; AdvisorError for a bad id, an unknown run or one without metrics."""
    info = store.load(run_id)
    metrics = info.metrics()  # AdvisorError naming the file where it is damaged
    if metrics is None or metrics.get("step_time_ms") is None:
        why = info.record.get("message") or "no metrics were recorded"
        raise AdvisorError(f"run {run_id} has no measured step to compare (status {info.status}: {why})")
    return info, metrics


def _change_pct(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b) or a == 0:
        return math.nan
    return 100.0 * (b - a) / a


def _summary(a: dict[str, Any], b: dict[str, Any], differing: list[str]) -> str:
    step_a, step_b = _number(a.get("step_time_ms")), _number(b.get("step_time_ms"))
    change = _change_pct(step_a, step_b)
    if change < 0:
        head = f"B's step is {-change:.1f} % shorter than A's"
    elif change > 0:
        head = f"B's step is {change:.1f} % longer than A's"
    else:
        head = "B's step takes as long as A's"
    parts = [f"{head} ({step_b:,.2f} vs {step_a:,.2f} ms)"]
    for label, key in (("tokens/s", "tokens_per_s"), ("peak memory", "peak_memory_bytes")):
        c = _change_pct(_number(a.get(key)), _number(b.get(key)))
        if not math.isnan(c):
            parts.append(f"{label} {c:+.1f} %")
    tokens_a, tokens_b = a.get("tokens_per_step"), b.get("tokens_per_step")
    if tokens_a and tokens_b and tokens_a != tokens_b:
        # A step of a different size is not the same work: tokens/s is the fair figure then.
        parts.append(f"steps hold {tokens_a:,} vs {tokens_b:,} tokens, so compare tokens/s")
    if a.get("device_type") != b.get("device_type"):
        parts.append(f"devices differ ({a.get('device_type')} vs {b.get('device_type')})")
    if not differing:
        parts.append("same setup and options")
    else:
        shown = ", ".join(differing[:4]) + (f" and {len(differing) - 4} more" if len(differing) > 4 else "")
        parts.append(f"{len(differing)} field{'s differ' if len(differing) != 1 else ' differs'}: {shown}")
    return "; ".join(parts) + "."


def compare_runs(store: RunStore, run_a: str, run_b: str) -> RunComparison:
    """Run B against run A: differing setup/option fields, the measured figures with their change in %,
    and a one-line summary. Raises AdvisorError for a bad or unknown id, or a run without metrics
    (the message names the run and its status)."""
    info_a, m_a = _metrics_for_compare(store, run_a)
    info_b, m_b = _metrics_for_compare(store, run_b)
    flat_a, flat_b = flatten_spec(info_a.record), flatten_spec(info_b.record)
    keys = list(flat_a) + [k for k in flat_b if k not in flat_a]
    defaults = spec_defaults()
    # A field one record lacks (written before it existed) ran with its default: it differs only where
    # the other run's value is not that default (an old run beside a new one listed 24 "fields").
    diff = [
        (k, flat_a.get(k), flat_b.get(k))
        for k in keys
        if flat_a.get(k, defaults.get(k)) != flat_b.get(k, defaults.get(k))
    ]
    # object dtype keeps each value as recorded: an int stays an int and a missing one stays None, not NaN.
    spec_diff = pd.DataFrame(diff, columns=["field", "a", "b"], dtype=object)
    rows = []
    for label, key, factor in COMPARED_METRICS:
        a, b = _number(m_a.get(key), factor), _number(m_b.get(key), factor)
        rows.append((label, a, b, _change_pct(a, b)))
    metrics = pd.DataFrame(rows, columns=["metric", "a", "b", "change_pct"])
    summary = _summary(m_a, m_b, [k for k, _, _ in diff])
    return RunComparison(info_a.run_id, info_b.run_id, spec_diff, metrics, summary, m_a, m_b)


def verification_pairs(store: RunStore) -> list[dict[str, Any]]:
    """The verification files' contents (``advisor.advice.verify.Verification`` with ``created_utc``),
    oldest first; a file that is not a readable pair is skipped
    (they are written atomically, so only a hand-edited one can be)."""
    folder = store.root / VERIFICATIONS_DIR
    pairs = []
    for f in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            pair = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(pair, dict) and {"target", "predicted_after", "measured_after"} <= pair.keys():
            pairs.append(pair)
    return pairs


def _pair_row(pair: dict[str, Any], measured_runs: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """A verification pair as a step-time row, or None where its target is not a step figure, a value
    is not positive, or the re-run that a tokens/s pair needs is gone."""
    new = measured_runs.get(str(pair.get("new_run_id")))
    base = measured_runs.get(str(pair.get("run_id")), {})
    predicted, measured = _number(pair["predicted_after"]), _number(pair["measured_after"])
    if not (predicted > 0 and measured > 0) or pair["target"] not in ("step_time_ms", "tokens_per_s"):
        return None
    if pair["target"] == "tokens_per_s":
        # ms per step = tokens per step / tokens per s, with the re-run's step size (the setup the
        # prediction was made for).
        tokens = _number((new or {}).get("tokens_per_step"))
        if not tokens > 0:
            return None
        predicted, measured = 1e3 * tokens / predicted, 1e3 * tokens / measured
    about = new or base
    return {
        "kind": VERIFIED_GAIN,
        "run_id": str(pair.get("new_run_id", "")),
        "base_run_id": str(pair.get("run_id", "")),
        "rule_id": str(pair.get("rule_id", "")),
        "model": about.get("model_name") or "",
        "device_type": about.get("device_type") or "",
        "predicted_ms": predicted,
        "measured_ms": measured,
        "measured_over_predicted": measured / predicted,
    }


def predicted_vs_measured(store: RunStore) -> pd.DataFrame:
    """Every predicted step time beside its measurement, in ms. Columns: PAIR_COLUMNS.

    kind 'run estimate': each ok run's estimator prediction (estimate_step_time_ms) against its measured
    step_time_ms. kind 'verified gain': each verification pair's predicted_after against measured_after
    (run_id is the re-run, base_run_id the run the rule fired on); tokens/s pairs are turned into ms
    per step, peak-memory pairs are left out (not a time). measured_over_predicted > 1: slower than
    predicted.
    """
    runs, _ = store.list_runs()
    measured_runs = {}
    for info in runs:
        m = _read_metrics(info)
        if info.status == "ok" and m is not None:
            measured_runs[info.run_id] = m
    rows = []
    for run_id, m in measured_runs.items():
        predicted, measured = _number(m.get("estimate_step_time_ms")), _number(m.get("step_time_ms"))
        if predicted > 0 and measured > 0:
            rows.append(
                {
                    "kind": RUN_ESTIMATE,
                    "run_id": run_id,
                    "base_run_id": "",
                    "rule_id": "",
                    "model": m.get("model_name") or "",
                    "device_type": m.get("device_type") or "",
                    "predicted_ms": predicted,
                    "measured_ms": measured,
                    "measured_over_predicted": measured / predicted,
                }
            )
    for pair in verification_pairs(store):
        row = _pair_row(pair, measured_runs)
        if row is not None:
            rows.append(row)
    return pd.DataFrame(rows, columns=list(PAIR_COLUMNS))
