"""Calibration: a regression fitted on the runs measured on one device that corrects the estimator's bias.

The analytic estimator (:mod:`advisor.estimate.estimator`) assumes datasheet rates; a real device has its own
efficiencies, per-op overheads and allocator habits. Every ``ok`` profiled run in the run store is a
training example: the spec and the estimator's own predictions are the features, the measured step
time and peak memory the targets. The model predicts ``log(measured / estimated)``, a multiplicative
correction, so it learns the estimator's error on this machine rather than step time from scratch,
and a correction of zero (the estimator alone) is always a candidate.

Fitted parameters are stored as plain JSON (no pickle: a user may swap the file) under
``<store root>/calibration/<device-key>.json``; loading validates every field and rebuilds the
predictor from numbers only.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from advisor.errors import AdvisorError
from advisor.estimate.estimator import Estimate, estimate
from advisor.spec.options import RunOptions
from advisor.spec.presets import current_hardware, device_key_for, gpt2_style, recorded_cpu_flags, tiny, tiny_moe
from advisor.spec.specs import HardwareSpec, ModelSpec, Setup, setup_from_dict, spec_to_dict
from advisor.store.runstore import RunInfo, RunStore, write_json_atomic

FORMAT = "advisor-calibration"
FORMAT_VERSION = 1
MIN_RUNS = 8
"""Fewest different setups a fit accepts (re-runs of one setup count once): 5-fold cross-validation
needs more than one setup per fold, and a correction on fewer cannot tell one effect from another."""
CV_FOLDS = 5
CV_REPEATS = 5
"""Cross-validation is repeated over this many shuffles and averaged: with a few dozen runs one
shuffle's step-time MAPE ranged from 13.2 to 18.9 % over 20 seeds on the CPU sweep (mean 14.8 %)."""
MAX_FILE_BYTES = 4 * 2**20
"""A calibration file is a few KiB; anything far larger is not one of ours."""
RIDGE_ALPHAS = tuple(float(a) for a in np.logspace(-3, 3, 13))
"""Ridge penalties tried on the standardised features; leave-one-out CV picks one per fit."""

# Features of one run, all computable from a Setup and its RunOptions before running it. Kept few, each
# for a reason, because a sweep is a few dozen runs (on the CPU sweep a 30-feature set of raw sizes
# cross-validated at about 21 % step-time error, this set at 14-16 %, estimator alone 33 %):
# - the estimator's own predictions and its time mix: the model learns per-component efficiencies of
#   this device (matmul rate, memory-bound work, optimizer) instead of relearning the arithmetic;
# - choices the estimator treats as free or as datasheet rates (precision, recompute, optimizer and its
#   kernels, MoE routing), as one-hot columns against the baseline fp32 / no recompute / AdamW fused;
# - per-call overhead, which the estimator ignores and which weighs most in small eager steps on a CPU:
#   block forward calls (one per expert in our MoE) and micro-batches per estimated millisecond;
# - shape: small matrices run below the peak rate;
# - run options that change the step (DataLoader workers, torch.compile).
FEATURES = (
    "log_est_step_time_ms",
    "est_compute_frac",
    "est_memory_bound_frac",
    "est_optimizer_frac",
    "log_est_peak_memory_bytes",
    "est_activations_mem_frac",
    "precision_bf16",
    "precision_fp16",
    "recompute_selective",
    "recompute_full",
    "optimizer_sgd",
    "optimizer_adafactor",
    "optimizer_impl_for_loop",
    "optimizer_impl_foreach",
    "moe",
    "block_calls_per_est_ms",
    "micro_batches_per_est_ms",
    "log_micro_batch",
    "log_seq_len",
    "log_hidden",
    "num_workers",
    "compile",
)
TARGETS = ("step_time", "peak_memory")
"""Targets: ``log(step_time_ms / est_step_time_ms)`` and ``log(peak_memory_bytes / est_peak_memory_bytes)``."""

ProgressFn = Callable[[int, int, str], None]


# --- device keys ------------------------------------------------------------------------------------


# --- features ---------------------------------------------------------------------------------------


def features_of(setup: Setup, options: RunOptions | dict | None = None) -> dict[str, float]:
    """The feature values (see FEATURES, in that order) of ``setup`` run with ``options`` (default
    RunOptions)."""
    return _features(setup, options, estimate(setup))


def _features(setup: Setup, options: RunOptions | dict | None, est: Estimate) -> dict[str, float]:
    opts = options.as_dict() if isinstance(options, RunOptions) else dict(options or {})
    m, t = setup.model, setup.train
    est_ms = est.step_time_ms
    block_calls = setup.grad_accum * m.n_layers * (1 + m.n_experts + m.n_shared_experts)
    return {
        "log_est_step_time_ms": math.log(est_ms),
        "est_compute_frac": est.time.compute_ms / est_ms,
        "est_memory_bound_frac": est.time.memory_bound_ms / est_ms,
        "est_optimizer_frac": est.time.optimizer_ms / est_ms,
        "log_est_peak_memory_bytes": math.log(est.memory.total_bytes),
        "est_activations_mem_frac": est.memory.activations_bytes / est.memory.total_bytes,
        "precision_bf16": float(t.precision == "bf16"),
        "precision_fp16": float(t.precision == "fp16"),
        "recompute_selective": float(t.recompute == "selective"),
        "recompute_full": float(t.recompute == "full"),
        "optimizer_sgd": float(t.optimizer == "sgd"),
        "optimizer_adafactor": float(t.optimizer == "adafactor"),
        "optimizer_impl_for_loop": float(t.optimizer_impl == "for-loop"),
        "optimizer_impl_foreach": float(t.optimizer_impl == "foreach"),
        "moe": float(m.is_moe),
        "block_calls_per_est_ms": block_calls / est_ms,
        "micro_batches_per_est_ms": setup.grad_accum / est_ms,
        "log_micro_batch": math.log(t.micro_batch),
        "log_seq_len": math.log(t.seq_len),
        "log_hidden": math.log(m.hidden),
        "num_workers": float(opts.get("num_workers", 0)),
        "compile": float(bool(opts.get("compile", False))),
    }


def record_of(
    setup: Setup,
    step_time_ms: float,
    peak_memory_bytes: float,
    options: RunOptions | dict | None = None,
    run_id: str = "",
) -> dict[str, Any]:
    """One training row: identity, features, the estimator's predictions and the measured targets.

    The estimate is recomputed from the setup now (not read from the run's metrics), so the
    correction is learned against the estimator that :meth:`Calibration.predict` will call.
    """
    est = estimate(setup)
    t = setup.train
    return {
        "run_id": run_id,
        "device_key": device_key_for(setup),
        "model_name": setup.model.name,
        "n_params": setup.model.n_params,
        "seq_len": t.seq_len,
        "micro_batch": t.micro_batch,
        "grad_accum": setup.grad_accum,
        "precision": t.precision,
        "recompute": t.recompute,
        "optimizer": t.optimizer,
        "optimizer_impl": t.optimizer_impl,
        **_features(setup, options, est),
        "est_step_time_ms": est.step_time_ms,
        "est_peak_memory_bytes": est.memory.total_bytes,
        "step_time_ms": float(step_time_ms),
        "peak_memory_bytes": float(peak_memory_bytes),
    }


def training_records(store: RunStore, device_key: str | None = None) -> pd.DataFrame:
    """One row per ``ok``, measured (not extrapolated) profiled run in ``store``, oldest first.

    ``device_key`` keeps the runs of one device (see :func:`device_key_for`); None keeps all, with
    their key in the ``device_key`` column. Columns: run_id, device_key, model_name, n_params, seq_len,
    micro_batch, grad_accum, precision, recompute, optimizer, optimizer_impl (what was run), the
    FEATURES, est_step_time_ms, est_peak_memory_bytes, step_time_ms, peak_memory_bytes. Runs whose
    files do not hold a usable setup or measurement are skipped.
    """
    rows = []
    runs, _damaged = store.list_runs()
    for run in reversed(runs):
        row = _row_of_run(run)
        if row is not None and (device_key is None or row["device_key"] == device_key):
            rows.append(row)
    return pd.DataFrame(rows, columns=_record_columns())


_DESCRIPTION = (
    "run_id",
    "device_key",
    "model_name",
    "n_params",
    "seq_len",
    "micro_batch",
    "grad_accum",
    "precision",
    "recompute",
    "optimizer",
    "optimizer_impl",
)


def _record_columns() -> list[str]:
    return [
        *_DESCRIPTION,
        *FEATURES,
        "est_step_time_ms",
        "est_peak_memory_bytes",
        "step_time_ms",
        "peak_memory_bytes",
        "setup_json",
    ]


def _row_of_run(run: RunInfo) -> dict[str, Any] | None:
    if run.status != "ok" or not isinstance(run.record.get("setup"), dict):
        return None
    try:
        metrics = run.metrics()
    except (AdvisorError, OSError, UnicodeDecodeError, json.JSONDecodeError):  # damaged since it was listed
        return None
    if not isinstance(metrics, dict) or metrics.get("source") != "profile" or metrics.get("extrapolated"):
        return None
    step_ms, peak = metrics.get("step_time_ms"), metrics.get("peak_memory_bytes")
    if not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in (step_ms, peak)):
        return None
    options = run.record.get("options") if isinstance(run.record.get("options"), dict) else {}
    # Proxy runs are extrapolated, injected failures are tests, and a simulated data delay is a
    # what-if on the input pipeline: none of them measures this machine's own step.
    if options.get("layers") or options.get("inject") or options.get("data_delay_ms"):
        return None
    try:
        setup = setup_from_dict(run.record["setup"])
    except AdvisorError:
        return None
    # Estimated with today's peaks for this device, as predict() will be (not those the run recorded).
    setup = replace(setup, hardware=current_hardware(setup.hardware, recorded_cpu_flags(run.record)))
    row = record_of(setup, step_ms, peak, options, run.run_id)
    row["setup_json"] = json.dumps(spec_to_dict(setup), sort_keys=True)
    return row


# --- the sweep -------------------------------------------------------------------------------------

# Small models that run a step in well under a second on two CPU cores, chosen to vary what the
# estimator's arithmetic depends on: depth against width, GELU against SwiGLU, learned positions,
# a vocabulary-heavy model (the logits and the loss dominate) and a mixture of experts.
SWEEP_MODELS: tuple[ModelSpec, ...] = (
    tiny(),
    tiny_moe(),
    replace(gpt2_style("sweep-gelu-6l", n_layers=6, hidden=384, n_heads=6), vocab=8192),
    ModelSpec(
        name="sweep-deep-8l",
        n_layers=8,
        hidden=192,
        n_heads=6,
        n_kv_heads=2,
        ffn_hidden=512,
        vocab=4096,
        tied_embeddings=True,
        max_positions=2048,
    ),
    ModelSpec(
        name="sweep-wide-2l", n_layers=2, hidden=512, n_heads=8, ffn_hidden=1376, vocab=16384, max_positions=2048
    ),
)
SWEEP_SEQ_LENS = (64, 128, 256, 512)
SWEEP_MICRO_BATCHES = (1, 2, 4)
SWEEP_GRAD_ACCUM = (1, 1, 2)
"""Drawn uniformly: accumulation in a third of the runs."""
SWEEP_MAX_FLOPS = 40e9
"""Cap on 6 * params * tokens per step: at most about 0.3 s a step on two CPU cores (measured)."""
SWEEP_RUNS = 36
MAX_SWEEP_RUNS = 200
"""A bound on one sweep's runs (each a few seconds on two cores)."""


def sweep_setups(
    n_runs: int = SWEEP_RUNS,
    seed: int = 0,
    models: Sequence[ModelSpec] = SWEEP_MODELS,
    precisions: Sequence[str] = ("fp32", "bf16"),
) -> list[Setup]:
    """``n_runs`` setups drawn reproducibly from the sweep grid (models, sequence, micro-batch, gradient
    accumulation, ``precisions``, recompute, optimizer and its kernels), each under SWEEP_MAX_FLOPS.

    The hardware is the CPU preset; :func:`advisor.run.launcher.profile_run` maps each to this machine.
    """
    from advisor.spec.setup import make_setup

    rng = random.Random(seed)
    out: list[Setup] = []
    while len(out) < n_runs:
        model = models[len(out) % len(models)]  # round robin: every model gets its share
        seq = rng.choice([s for s in SWEEP_SEQ_LENS if s <= model.max_positions])
        micro, accum = rng.choice(SWEEP_MICRO_BATCHES), rng.choice(SWEEP_GRAD_ACCUM)
        optimizer = rng.choice(("adamw", "adamw", "sgd"))
        setup = make_setup(
            model=model,
            gpu="cpu",
            seq=seq,
            micro_batch=micro,
            global_batch=micro * accum,
            precision=rng.choice(tuple(precisions)),
            optimizer=optimizer,
            optimizer_impl=rng.choice(("for-loop", "foreach", "fused")),
            framework="pytorch",
            recompute=rng.choice(("none", "selective", "full")),
        )
        if 6.0 * model.n_params * setup.tokens_per_step <= SWEEP_MAX_FLOPS and setup not in out:
            out.append(setup)
    return out


def sweep_precisions(hw: HardwareSpec) -> tuple[str, ...]:
    """The precisions a sweep on ``hw`` measures: fp32, and bf16 where it is no slower. On a CPU without
    AVX512-BF16 or AMX bf16 autocast ran the tiny step 23x slower than fp32 (``presets.cpu_host``): a
    sweep of it would spend most of its time on steps the advice tells users not to take."""
    return ("fp32", "bf16") if hw.peak_bf16_flops >= hw.peak_fp32_flops else ("fp32",)


MAX_OTHER_CPU_FRAC = 0.25
"""A sweep run during which other processes used more than this share of the machine's CPU time is
discarded and repeated: on a shared two-core machine a neighbour's job slowed steps 3-13x (measured
while building this sweep), which no regression of this machine's own behaviour can learn."""
QUIET_WAIT_S = 60.0
"""Default longest wait for the machine to quieten before each run."""


@dataclass(frozen=True)
class SweepRun:
    """One filed sweep run and how busy the machine was with other work while it ran."""

    run: RunInfo
    other_cpu_frac: float | None
    """Share of the machine's CPU time other processes used during the run (None where unknown)."""
    attempts: int
    """Runs made for this setup; the disturbed ones before the last were deleted."""


def run_sweep(
    store: RunStore,
    setups: Sequence[Setup] | None = None,
    *,
    device: str = "auto",
    steps: int = 3,
    retries: int = 2,
    max_other_cpu_frac: float = MAX_OTHER_CPU_FRAC,
    quiet_wait_s: float = QUIET_WAIT_S,
    on_progress: ProgressFn | None = None,
    cancel: threading.Event | None = None,
) -> list[SweepRun]:
    """Profile each setup (default: :func:`sweep_setups`) once on this machine and file the runs in
    ``store``; returns them whatever their status. ``on_progress(done, total, message)`` after each,
    and while one runs (``done`` the runs before it): its wait for a quiet CPU, then each of its steps.
    Setting ``cancel`` stops the run in flight (filed as cancelled) and starts no other.

    Each run is a short profiled step (``steps`` timed and as many profiled, no profiler warm-up). Before
    each run the sweep waits (up to ``quiet_wait_s``) for other processes to leave the CPU; a run they
    disturbed anyway (over ``max_other_cpu_frac``) is deleted and made again, up to ``retries`` times,
    and the last attempt is kept whatever the load.
    """
    from advisor.run.launcher import profile_run

    setups = list(sweep_setups() if setups is None else setups)
    options = RunOptions(device=device, steps=steps, warmup=0, timeout_s=300.0)
    out = []
    for i, setup in enumerate(setups):
        if cancel is not None and cancel.is_set():
            break
        t = setup.train
        what = f"{setup.model.name} seq {t.seq_len} x {t.micro_batch} x {setup.grad_accum} {t.precision}"
        # Which run and which step, from its first second: the quiet wait alone can take a minute a try
        # (on a busy machine the first line came after 195 s).
        during = None if on_progress is None else _run_progress(on_progress, i, len(setups), what)
        for attempt in range(1, retries + 2):
            if during and quiet_wait_s > 0:
                during(0, 0, f"waiting up to {quiet_wait_s:.0f} s for other processes to leave the CPU")
            _wait_for_quiet(max_other_cpu_frac, quiet_wait_s)
            meter = _CpuMeter()
            run = profile_run(setup, options, store, on_progress=during, cancel=cancel)
            other = meter.other_frac()
            if run.status != "ok" or other is None or other <= max_other_cpu_frac or attempt > retries:
                break
            store.delete(run.run_id)
        out.append(SweepRun(run, other, attempt))
        if on_progress:
            load = "" if other is None else f", others used {other:.0%} of the CPU"
            tries = f", attempt {attempt}" if attempt > 1 else ""
            msg = f"{what} recompute {t.recompute} {t.optimizer_impl}: {run.status}{load}{tries}"
            on_progress(i + 1, len(setups), msg)
    return out


def _run_progress(on_progress: ProgressFn, i: int, n: int, what: str) -> ProgressFn:
    """A profiled run's own progress (its steps) as the sweep's: ``i`` runs done of ``n``, the message
    naming the run in flight ("run 3 of 12, tiny seq 64 x 1 x 1 bf16: step 2/6 (timed 1/2)")."""
    return lambda _done, _total, message: on_progress(i, n, f"run {i + 1} of {n}, {what}: {message}")


def calibrate_machine(
    store: RunStore,
    sweep_runs: int = 0,
    *,
    device: str = "auto",
    on_progress: ProgressFn | None = None,
    cancel: threading.Event | None = None,
) -> tuple[Calibration, Path, list[SweepRun]]:
    """Calibrate this machine's device: first a sweep of ``sweep_runs`` short profiled steps (0: none),
    then a fit on every ok run of the device in ``store``, saved beside the runs. Returns (the
    calibration, its file, the sweep's runs). AdvisorError when too few setups were measured."""
    from advisor.run.launcher import local_device_type
    from advisor.spec.presets import local_hardware

    if not isinstance(sweep_runs, int) or isinstance(sweep_runs, bool) or not 0 <= sweep_runs <= MAX_SWEEP_RUNS:
        raise AdvisorError(f"sweep_runs={sweep_runs!r}: must be an integer from 0 to {MAX_SWEEP_RUNS}")
    hw = local_hardware(local_device_type(device))
    key = device_key_for(hw)
    sweep = []
    if sweep_runs:
        setups = sweep_setups(sweep_runs, precisions=sweep_precisions(hw))
        sweep = run_sweep(store, setups, device=device, on_progress=on_progress, cancel=cancel)
    cal = fit_calibration(training_records(store, key))
    return cal, cal.save(calibration_path(store, key)), sweep


class _CpuMeter:
    """CPU time other processes take from this machine between its creation and ``other_frac()``:
    machine-wide busy time (Linux /proc/stat) minus this process's and its reaped children's."""

    def __init__(self) -> None:
        self.start = _machine_cpu_s(), _own_cpu_s()

    def other_frac(self) -> float | None:
        """Share of the machine's CPU time (all cores) used by other processes; None off Linux."""
        (m0, own0), m1 = self.start, _machine_cpu_s()
        if m0 is None or m1 is None or m1[1] <= m0[1]:
            return None
        other = (m1[0] - m0[0]) - (_own_cpu_s() - own0)
        return min(1.0, max(0.0, other / (m1[1] - m0[1])))


def _machine_cpu_s() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of all cores since boot, from /proc/stat; None where it is missing."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    idle = ticks[3] + ticks[4]  # idle + iowait; user, nice, system, irq, softirq, steal are busy
    return (sum(ticks) - idle) / hz, sum(ticks) / hz


def _own_cpu_s() -> float:
    import resource

    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def _wait_for_quiet(max_other_cpu_frac: float, max_wait_s: float, window_s: float = 1.0) -> None:
    """Return once other processes used at most ``max_other_cpu_frac`` of the CPU over ``window_s``,
    or after ``max_wait_s`` (at once when it is 0)."""
    deadline = time.monotonic() + max_wait_s
    while max_wait_s > 0:
        meter = _CpuMeter()
        time.sleep(window_s)
        other = meter.other_frac()
        if other is None or other <= max_other_cpu_frac or time.monotonic() >= deadline:
            return


# --- the correction model ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Correction:
    """``log(measured / estimated)`` as a function of the features: ridge regression on standardised
    features, or none (the estimator alone). Only numbers, so it round-trips through JSON exactly."""

    kind: str
    """'ridge' or 'none' (always 0: the estimator alone)."""
    alpha: float
    """Ridge penalty chosen by leave-one-out cross-validation on the standardised features."""
    mean: tuple[float, ...]
    scale: tuple[float, ...]
    coef: tuple[float, ...]
    """Per standardised feature."""
    intercept: float
    feature_lo: tuple[float, ...]
    feature_hi: tuple[float, ...]
    """Range of each feature in training: inputs are clipped into it, so a setup far outside the
    sweep gets the correction of the nearest setups seen rather than a linear extrapolation."""
    target_lo: float
    target_hi: float
    """Range of log(measured / estimated) in training; predictions are clipped into it."""

    def log_ratio(self, x: np.ndarray) -> np.ndarray:
        """Predicted log(measured / estimated) for rows of features ``x`` (n, len(FEATURES))."""
        x = np.atleast_2d(np.asarray(x, dtype=float))
        if self.kind == "none":
            return np.zeros(len(x))
        z = (np.clip(x, self.feature_lo, self.feature_hi) - np.asarray(self.mean)) / np.asarray(self.scale)
        return np.clip(z @ np.asarray(self.coef) + self.intercept, self.target_lo, self.target_hi)

    def outside(self, x: np.ndarray) -> bool:
        """Whether a feature row lies outside the training range (the prediction is then clipped)."""
        x = np.asarray(x, dtype=float)
        return self.kind != "none" and bool(np.any(x < self.feature_lo) or np.any(x > self.feature_hi))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: object, n_features: int) -> Correction:
        """Validated: every number finite, every vector ``n_features`` long; AdvisorError otherwise."""
        keys = {f.name for f in fields(cls)}
        if not isinstance(d, dict) or set(d) != keys:
            raise AdvisorError(f"must have exactly the keys {', '.join(sorted(keys))}")
        if d["kind"] not in ("ridge", "none"):
            raise AdvisorError(f"kind={d['kind']!r} is unknown (allowed: ridge, none)")
        vectors = {}
        for name in ("mean", "scale", "coef", "feature_lo", "feature_hi"):
            v = d[name]
            if not isinstance(v, list) or len(v) != n_features or not all(_is_finite(x) for x in v):
                raise AdvisorError(f"{name} must be a list of {n_features} finite numbers")
            vectors[name] = tuple(float(x) for x in v)
        scalars = {}
        for name in ("alpha", "intercept", "target_lo", "target_hi"):
            if not _is_finite(d[name]):
                raise AdvisorError(f"{name}={d[name]!r} must be a finite number")
            scalars[name] = float(d[name])
        if any(s <= 0 for s in vectors["scale"]):
            raise AdvisorError("scale must be positive")
        if any(lo > hi for lo, hi in zip(vectors["feature_lo"], vectors["feature_hi"], strict=True)):
            raise AdvisorError("feature_lo must not exceed feature_hi")
        if not -MAX_LOG_RATIO <= scalars["target_lo"] <= scalars["target_hi"] <= MAX_LOG_RATIO:
            raise AdvisorError(f"target_lo..target_hi must lie within +-{MAX_LOG_RATIO:.2f} (a factor of 1000)")
        return cls(kind=d["kind"], **vectors, **scalars)


MAX_LOG_RATIO = math.log(1000.0)
"""A stored correction beyond a factor of 1000 is not a calibration of this estimator."""


def _is_finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _fit_correction(kind: str, x: np.ndarray, y: np.ndarray) -> Correction:
    """Fit one candidate on features ``x`` and targets ``y`` (log ratios)."""
    n = x.shape[1]
    lo, hi = tuple(float(v) for v in x.min(axis=0)), tuple(float(v) for v in x.max(axis=0))
    if kind == "none":
        zeros = (0.0,) * n
        return Correction("none", 0.0, zeros, (1.0,) * n, zeros, 0.0, lo, hi, 0.0, 0.0)
    from sklearn.linear_model import RidgeCV

    mean = x.mean(axis=0)
    scale = x.std(axis=0)
    scale[scale == 0] = 1.0  # a feature constant in training carries no information
    ridge = RidgeCV(alphas=RIDGE_ALPHAS).fit((x - mean) / scale, y)
    return Correction(
        kind="ridge",
        alpha=float(ridge.alpha_),
        mean=tuple(float(v) for v in mean),
        scale=tuple(float(v) for v in scale),
        coef=tuple(float(v) for v in ridge.coef_),
        intercept=float(ridge.intercept_),
        feature_lo=lo,
        feature_hi=hi,
        target_lo=float(max(y.min(), -MAX_LOG_RATIO)),
        target_hi=float(min(y.max(), MAX_LOG_RATIO)),
    )


# --- fitting and cross-validation -------------------------------------------------------------------

# Candidates per target, chosen by cross-validated MAPE. Ridge (a linear model of the log ratio on
# standardised features, penalty by leave-one-out CV) matched gradient boosting and beat a random forest
# on the CPU sweep (step time 14.4 % against 15.9 % and 17.1 %, estimator alone 32.9 %:
# bench/results/calibration_cpu.md) with a handful of numbers to store and no piecewise jumps between
# sweep points. 'none' wins where the estimator is as good as the data is noisy (peak memory on the CPU:
# 3.9 % alone, 4.3 % corrected), so a correction is only stored where it helps.
CANDIDATES = ("none", "ridge")


@dataclass(frozen=True)
class CalibratedPrediction:
    """The calibrated and the analytic prediction of one setup on the calibrated device."""

    step_time_ms: float
    peak_memory_bytes: float
    analytic_step_time_ms: float
    analytic_peak_memory_bytes: float
    outside_training_range: bool
    """Some feature lies outside the range of the runs the calibration was fitted on (the correction
    is then that of the nearest setups seen, clipped to the corrections seen)."""


@dataclass(frozen=True)
class Calibration:
    """A fitted correction of the estimator for one device, with its cross-validated error."""

    device_key: str
    n_runs: int
    cv: dict[str, float]
    """Cross-validated mean absolute percentage errors: mape_step_time_calibrated_pct,
    mape_step_time_estimator_pct, mape_peak_memory_calibrated_pct, mape_peak_memory_estimator_pct."""
    step_time: Correction
    peak_memory: Correction
    created_utc: str = ""
    cv_method: str = ""
    features: tuple[str, ...] = FEATURES
    checks: tuple[dict, ...] = ()
    """A few training setups with the estimator's figures for them at fit time: when the estimator or
    the device's preset changes, they no longer match and the calibration is stale (see is_stale)."""

    def stale_reason(self) -> str:
        """Empty while the estimator still gives the fitted figures for the check setups, else why not."""
        for check in self.checks:
            try:
                est = estimate(setup_from_dict(json.loads(check["setup_json"])))
            except (AdvisorError, ValueError, TypeError, KeyError) as err:
                return f"a check setup no longer builds ({err})"
            for name, now in (
                ("est_step_time_ms", est.step_time_ms),
                ("est_peak_memory_bytes", est.memory.total_bytes),
            ):
                then = check[name]
                if not math.isclose(now, then, rel_tol=1e-6):
                    return (
                        f"the estimator changed since the fit ({name.removeprefix('est_')} of a check setup: "
                        f"{then:.6g} then, {now:.6g} now)"
                    )
        return ""

    def predict(self, setup: Setup, options: RunOptions | dict | None = None) -> CalibratedPrediction:
        """Step time (ms) and peak memory (bytes) of ``setup`` on this device, corrected; with the
        estimator's own figures beside them. ``setup.hardware`` must be the calibrated device (see
        :func:`advisor.run.launcher.on_this_machine`)."""
        key = device_key_for(setup)
        if key != self.device_key:
            raise AdvisorError(
                f"this calibration is for device {self.device_key}; the setup runs on {key} "
                "(map it to this machine with advisor.run.launcher.on_this_machine)"
            )
        est = estimate(setup)
        row = _features(setup, options, est)
        x = np.array([[row[k] for k in self.features]])
        t_ratio = float(self.step_time.log_ratio(x)[0])
        m_ratio = float(self.peak_memory.log_ratio(x)[0])
        return CalibratedPrediction(
            step_time_ms=est.step_time_ms * math.exp(t_ratio),
            peak_memory_bytes=est.memory.total_bytes * math.exp(m_ratio),
            analytic_step_time_ms=est.step_time_ms,
            analytic_peak_memory_bytes=est.memory.total_bytes,
            outside_training_range=self.step_time.outside(x[0]) or self.peak_memory.outside(x[0]),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "device_key": self.device_key,
            "n_runs": self.n_runs,
            "created_utc": self.created_utc,
            "cv_method": self.cv_method,
            "cv": dict(self.cv),
            "features": list(self.features),
            "models": {"step_time": self.step_time.to_dict(), "peak_memory": self.peak_memory.to_dict()},
            "checks": [dict(c) for c in self.checks],
        }

    def save(self, path: str | Path) -> Path:
        """Write the calibration as JSON (atomically); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, self.to_dict())
        return path

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        """Read and validate a calibration file; AdvisorError naming the file and the fault if it is
        not one (numbers only are read: nothing in the file is executed)."""
        path = Path(path)
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                raise AdvisorError(f"larger than {MAX_FILE_BYTES // 2**20} MiB")
            d = json.loads(path.read_text(encoding="utf-8"), parse_constant=_reject_constant)
            return cls.from_dict(d)
        except AdvisorError as err:
            raise AdvisorError(
                f"calibration file {path} is not valid: {err}; refit with `python -m advisor calibrate`"
            ) from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
            raise AdvisorError(
                f"calibration file {path} cannot be read ({type(err).__name__}: {err}); "
                "refit with `python -m advisor calibrate`"
            ) from None

    @classmethod
    def from_dict(cls, d: object) -> Calibration:
        """Inverse of to_dict, validating every field; AdvisorError on the first fault."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise AdvisorError(f"not an {FORMAT} file")
        if d.get("version") != FORMAT_VERSION:
            raise AdvisorError(f"version {d.get('version')!r} is not {FORMAT_VERSION}")
        if d.get("features") != list(FEATURES):
            raise AdvisorError("it was fitted on other features than this version of the advisor computes")
        key = d.get("device_key")
        if not isinstance(key, str) or not DEVICE_KEY_RE.match(key):
            raise AdvisorError(f"device_key={key!r} is not a device key")
        n = d.get("n_runs")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise AdvisorError(f"n_runs={n!r} must be a positive integer")
        cv = d.get("cv")
        if not isinstance(cv, dict) or set(cv) != set(CV_KEYS) or not all(_is_finite(v) for v in cv.values()):
            raise AdvisorError(f"cv must hold the finite numbers {', '.join(CV_KEYS)}")
        for name in ("created_utc", "cv_method"):
            if not isinstance(d.get(name), str):
                raise AdvisorError(f"{name} must be a string")
        models = d.get("models")
        if not isinstance(models, dict) or set(models) != set(TARGETS):
            raise AdvisorError(f"models must hold exactly {', '.join(TARGETS)}")
        corrections = {}
        for target in TARGETS:
            try:
                corrections[target] = Correction.from_dict(models[target], len(FEATURES))
            except AdvisorError as err:
                raise AdvisorError(f"models.{target}: {err}") from None
        checks = d.get("checks", [])
        if not isinstance(checks, list) or len(checks) > MAX_CHECKS:
            raise AdvisorError(f"checks must be a list of at most {MAX_CHECKS}")
        for c in checks:
            if (
                not isinstance(c, dict)
                or set(c) != {"setup_json", "est_step_time_ms", "est_peak_memory_bytes"}
                or not isinstance(c["setup_json"], str)
                or not all(_is_finite(c[k]) for k in ("est_step_time_ms", "est_peak_memory_bytes"))
            ):
                raise AdvisorError("each check must hold setup_json (text) and two finite estimates")
        return cls(
            device_key=key,
            n_runs=n,
            cv={k: float(cv[k]) for k in CV_KEYS},
            step_time=corrections["step_time"],
            peak_memory=corrections["peak_memory"],
            created_utc=d["created_utc"],
            cv_method=d["cv_method"],
            checks=tuple(checks),
        )


DEVICE_KEY_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,119}$")
CV_KEYS = (
    "mape_step_time_calibrated_pct",
    "mape_step_time_estimator_pct",
    "mape_peak_memory_calibrated_pct",
    "mape_peak_memory_estimator_pct",
)


def _reject_constant(name: str) -> float:
    raise AdvisorError(f"{name} is not a number a calibration holds")


MAX_CHECKS = 8


def _checks(records: pd.DataFrame) -> tuple[dict, ...]:
    """Up to three distinct training setups and their estimates, spread over the records."""
    if "setup_json" not in records:
        return ()
    rows = records.drop_duplicates("setup_json")
    picks = rows.iloc[np.linspace(0, len(rows) - 1, num=min(3, len(rows))).astype(int)] if len(rows) else rows
    return tuple(
        {
            "setup_json": str(r.setup_json),
            "est_step_time_ms": float(r.est_step_time_ms),
            "est_peak_memory_bytes": float(r.est_peak_memory_bytes),
        }
        for r in picks.itertuples()
    )


def fit_calibration(records: pd.DataFrame) -> Calibration:
    """Fit the step-time and peak-memory corrections on ``records`` (from :func:`training_records`, one
    device), choosing per target between the candidates by cross-validated MAPE; the stored model is
    then refitted on all runs. AdvisorError when the records hold several devices or too few runs."""
    keys = sorted(set(records["device_key"])) if len(records) else []
    if len(keys) > 1:
        raise AdvisorError(
            f"the records hold runs of {len(keys)} devices ({', '.join(keys)}): calibrate one at a time, "
            "training_records(store, device_key)"
        )
    groups = setup_groups(records)
    n_setups = len(set(groups))
    if n_setups < MIN_RUNS:
        where = f" on {keys[0]}" if keys else ""
        raise AdvisorError(
            f"calibration needs measured runs of at least {MIN_RUNS} different setups{where}; there are "
            f"{len(records)} runs of {n_setups} setups. Run `python -m advisor calibrate --sweep` "
            "(about 36 short profiled steps) or profile more setups first"
        )
    cv = cross_validate(records)
    x = records[list(FEATURES)].to_numpy(float)
    chosen = {}
    for target in TARGETS:
        scores = {kind: cv[f"{target}_{kind}"] for kind in CANDIDATES}
        kind = min(CANDIDATES, key=lambda k: (scores[k], k != "none"))  # ties go to no correction
        chosen[target] = _fit_correction(kind, x, log_ratio(records, target))
    return Calibration(
        device_key=keys[0],
        n_runs=len(records),
        cv={
            "mape_step_time_calibrated_pct": cv[f"step_time_{chosen['step_time'].kind}"],
            "mape_step_time_estimator_pct": cv["step_time_none"],
            "mape_peak_memory_calibrated_pct": cv[f"peak_memory_{chosen['peak_memory'].kind}"],
            "mape_peak_memory_estimator_pct": cv["peak_memory_none"],
        },
        step_time=chosen["step_time"],
        peak_memory=chosen["peak_memory"],
        checks=_checks(records),
        created_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        cv_method=f"{min(CV_FOLDS, n_setups)}-fold cross-validation over {n_setups} setups, {CV_REPEATS} shuffles "
        "averaged; re-runs of a setup kept in one fold",
    )


def setup_groups(records: pd.DataFrame) -> np.ndarray:
    """One label per row, equal for rows of the same setup and options (re-runs), so that
    cross-validation never tests on a setup it trained on."""
    return records[list(FEATURES)].round(9).astype(str).agg("|".join, axis=1).to_numpy()


def log_ratio(records: pd.DataFrame, target: str) -> np.ndarray:
    """log(measured / estimated) of each row for a target (step_time or peak_memory)."""
    measured, estimated = {
        "step_time": ("step_time_ms", "est_step_time_ms"),
        "peak_memory": ("peak_memory_bytes", "est_peak_memory_bytes"),
    }[target]
    return np.log(records[measured].to_numpy(float) / records[estimated].to_numpy(float))


def cross_validate(records: pd.DataFrame, candidates: Sequence[str] = CANDIDATES) -> dict[str, float]:
    """Cross-validated MAPE (%) of each candidate for each target, keyed ``<target>_<candidate>``;
    'none' is the estimator alone. Folds group re-runs of one setup (see setup_groups); the figure is
    the mean over CV_REPEATS shuffles."""
    groups = setup_groups(records)
    x = records[list(FEATURES)].to_numpy(float)
    splits = [group_folds(groups, seed) for seed in range(CV_REPEATS)]
    out = {}
    for target in TARGETS:
        y = log_ratio(records, target)
        for kind in candidates:
            errors = []
            for folds in splits:
                pred = np.zeros(len(y))
                for train, test in folds:
                    pred[test] = _fit_correction(kind, x[train], y[train]).log_ratio(x[test])
                errors.append(mape_pct(np.exp(y), np.exp(pred)))
            out[f"{target}_{kind}"] = float(np.mean(errors))
    return out


def group_folds(groups: np.ndarray, seed: int, n_splits: int = CV_FOLDS) -> list[tuple[np.ndarray, np.ndarray]]:
    """(train, test) row indices of ``n_splits`` folds (fewer where there are fewer groups): the groups
    shuffled with ``seed`` and dealt round robin, so every row of a group lands in the same fold."""
    labels = np.unique(groups)
    n_splits = min(n_splits, len(labels))
    order = np.random.default_rng(seed).permutation(len(labels))
    fold_of = {labels[j]: i % n_splits for i, j in enumerate(order)}
    fold = np.array([fold_of[g] for g in groups])
    return [(np.flatnonzero(fold != k), np.flatnonzero(fold == k)) for k in range(n_splits)]


def mape_pct(measured_over_estimated: np.ndarray, predicted_over_estimated: np.ndarray) -> float:
    """Mean absolute percentage error of predictions against measurements, both given as ratios to
    the estimate (the estimate cancels): mean |pred - measured| / measured x 100."""
    m, p = np.asarray(measured_over_estimated), np.asarray(predicted_over_estimated)
    return float(np.mean(np.abs(p - m) / m) * 100.0)


# --- the store's calibration files ------------------------------------------------------------------


def calibration_path(store: RunStore, device_key: str) -> Path:
    """``<store root>/calibration/<device_key>.json``; AdvisorError for a malformed key."""
    if not isinstance(device_key, str) or not DEVICE_KEY_RE.match(device_key):
        raise AdvisorError(f"device key {device_key!r} is not valid: lower-case letters, digits and '-'")
    return store.root / "calibration" / f"{device_key}.json"


def load_calibration(store: RunStore, device_key: str) -> Calibration | None:
    """The stored calibration of a device, or None where there is none; AdvisorError if the file is
    damaged, tampered with, or names another device."""
    path = calibration_path(store, device_key)
    if not path.is_file():
        return None
    cal = Calibration.load(path)
    if cal.device_key != device_key:
        raise AdvisorError(f"calibration file {path} is for device {cal.device_key}, not {device_key}")
    stale = cal.stale_reason()
    if stale:
        raise AdvisorError(f"calibration file {path} is stale: {stale}; refit with `python -m advisor calibrate`")
    return cal


def format_calibration(cal: Calibration, path: Path | None = None) -> str:
    """A readable summary: runs, cross-validated MAPE of the estimator alone and calibrated, per target."""
    names = {"ridge": "ridge correction", "none": "no correction: the estimator alone is as good"}
    lines = [
        f"Calibration for {cal.device_key}: {cal.n_runs} measured runs",
        f"  {cal.cv_method}",
        f"  {'mean abs. % error':20s} {'estimator alone':>16s} {'calibrated':>12s}",
    ]
    for target, label in (("step_time", "step time"), ("peak_memory", "peak memory")):
        est, calibrated = cal.cv[f"mape_{target}_estimator_pct"], cal.cv[f"mape_{target}_calibrated_pct"]
        kind = getattr(cal, target).kind
        lines.append(f"  {label:20s} {est:15.1f}% {calibrated:11.1f}%   {names[kind]}")
    if path is not None:
        lines.append(f"Saved to {path}")
    return "\n".join(lines)
