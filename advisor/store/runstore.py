"""The run store: one directory per profiled run under ``traces/``, written atomically.

A run is assembled in ``traces/.staging/<run-id>/`` and moved into ``traces/<run-id>/`` with one
``os.replace`` when it ends, whatever its status: a crash mid-write leaves no half run in the listing.
Run ids are validated against one pattern and resolved inside the store, so no id can reach a path
outside it. ``run.json`` holds the spec, options, status, message, environment and file list;
``metrics.json`` the StepMetrics. Every file a reader computes with is checked against its schema when
the store lists the run (types, finite numbers, the fields a profiled run always has, one entry per
rank in the per-rank lists, no symbolic links): a run that fails is listed as damaged, with the reason,
and never handed out as a run, so no store-wide reader (planner, calibration, history) meets it.

A process killed mid-run (SIGKILL, a lost node) cannot clean up its staging directory, so each one
records its owners (``.owner``: the process that staged it and the profiling child it starts, each
with its start time, and the machine: host, boot and PID namespace); opening the store for a new run
or listing it files the staging directories whose owners are all gone: one whose run.json says the run
was still running is committed with status ``interrupted`` (a user who killed it sees that it was), one
with no run.json yet (killed before the run was created) is removed. Only owners seen from the
same PID namespace of the same boot are judged: two containers sharing a store and a hostname do not
see each other's pids, and would otherwise remove each other's runs in progress.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import socket
import time
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

from advisor import CHECKOUT
from advisor.errors import AdvisorError, shown_value
from advisor.spec.metrics import StepMetrics
from advisor.spec.presets import recorded_cpu_flags

RUN_ID_RE = re.compile(r"^[0-9]{8}-[0-9]{6}-[a-z0-9][a-z0-9._-]{0,39}-[0-9a-f]{6}$")
STATUSES = ("running", "ok", "oom", "timeout", "crashed", "failed", "cancelled", "refused", "interrupted")
"""'refused': an option this machine cannot run (fp8 without fp8 units or torchao, Unified Memory beyond
what the GPU has free); the run holds the reason and no measurement. 'interrupted': the run was killed
from outside (its child by a signal it did not handle, or its launcher and child both died before the
run was filed); what it had written stays, its measurement (if any) is not trusted."""
INTERRUPTED_MESSAGE = (
    "interrupted: the process that profiled this run and its child both ended before the run was filed "
    "(killed, or the machine went down); what it wrote is kept, profile it again for a measurement"
)
DEFAULT_ROOT = CHECKOUT / "traces" if CHECKOUT else Path("traces")
"""The checkout's ``traces/``; for an installed package, ``traces/`` under the working directory."""
STAGING = ".staging"
RESERVED_DIRS = ("calibration", "verifications", "ceilings")
"""Folders beside the runs that are not runs: fitted calibrations, verification pairs, measured
ceilings."""
OWNER_FILE = ".owner"
"""In a staging directory: ``{"machine": {...}, "owners": [{"pid", "start"}, ...]}``, the processes
assembling the run (see ``add_owner``). Hidden, so the run's file list leaves it out; removed when the
run is committed."""
_REQUIRED_METRICS = tuple(f.name for f in fields(StepMetrics) if f.default is MISSING and f.default_factory is MISSING)
# str(): the annotations are strings under `from __future__ import annotations`, and types without it.
_METRIC_TYPES = {f.name: str(f.type) for f in fields(StepMetrics)}
_NUMERIC_METRICS = frozenset(k for k, t in _METRIC_TYPES.items() if t in ("int | None", "float | None"))
_PROFILED_METRICS = ("model_name", "device_type")
"""Fields the profiling child always writes for a run that finished (source 'profile', status 'ok'):
the run table, the Profile tab and the calibration read them."""
_RANK_LISTS = ("rank_step_time_ms", "rank_peak_memory_bytes")
"""A distributed run's per-rank figures: one number per process, world_size of them."""
MAX_WORLD_SIZE = 2**20
"""The most processes a stored run may claim (advisor.spec.specs.MAX_GPUS)."""


@dataclass(frozen=True)
class RunFiles:
    """The files of one run directory, by what they hold: the only place their names are spelled. The
    launcher and the profiling child write them through this, the store and the readers read them
    through it."""

    dir: Path

    @property
    def record(self) -> Path:
        """run.json: spec, options, status, message, environment, file list (the launcher's)."""
        return self.dir / "run.json"

    @property
    def request(self) -> Path:
        """request.json: what the child is asked to run (run id, setup, options)."""
        return self.dir / "request.json"

    @property
    def metrics(self) -> Path:
        """metrics.json: the StepMetrics record."""
        return self.dir / "metrics.json"

    @property
    def environment(self) -> Path:
        """environment.json: the child's versions, device and host."""
        return self.dir / "environment.json"

    @property
    def child_status(self) -> Path:
        """child_status.json: a handled failure's status and message, written by the child."""
        return self.dir / "child_status.json"

    @property
    def log(self) -> Path:
        """log.txt: the child's stdout and stderr."""
        return self.dir / "log.txt"

    @property
    def top_ops(self) -> Path:
        """top_ops.json: ops by self time."""
        return self.dir / "top_ops.json"

    @property
    def nvml(self) -> Path:
        """nvml.json: NVML samples over the step and their summary."""
        return self.dir / "nvml.json"

    @property
    def trace(self) -> Path:
        """trace.json.gz: a single-process run's Kineto trace (opens in Perfetto)."""
        return self.dir / "trace.json.gz"

    @property
    def ranks(self) -> Path:
        """ranks/: a distributed run's traces, one per rank."""
        return self.dir / "ranks"

    def rank_trace(self, rank: int) -> Path:
        """ranks/rank-<r>.trace.json.gz: rank ``rank``'s trace."""
        return self.ranks / f"rank-{rank}.trace.json.gz"

    @property
    def nsys(self) -> Path:
        """nsys: the output stem of an Nsight Systems capture (nsys adds .nsys-rep and .sqlite)."""
        return self.dir / "nsys"


def run_trace(run_dir: Path) -> Path:
    """Where a run directory keeps its trace: ``ranks/`` (one file per rank) for a distributed run,
    else ``trace.json.gz`` (the path may not exist: a run that failed before tracing)."""
    files = RunFiles(Path(run_dir))
    return files.ranks if files.ranks.is_dir() else files.trace


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` is one of our run directories (it holds a run.json)."""
    return RunFiles(Path(path)).record.is_file()


def _json_object(f: Path) -> dict[str, Any] | None:
    """The JSON object in ``f``; None where it is missing, unreadable or not an object."""
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def read_run(run_dir: Path) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """A run directory's run.json and metrics.json as dicts; None for each that is missing, unreadable
    or fails its schema (the listing's checks, see :meth:`RunStore.list_runs`). Never raises: a caller
    that scans runs passes a damaged one over."""
    d = Path(run_dir)
    record = _read_record(d)
    if isinstance(record, str):
        return None, None
    metrics = _load_metrics(RunFiles(d).metrics)
    return record, None if isinstance(metrics, str) else metrics


def run_context(run_dir: Path) -> dict[str, Any]:
    """What an analysis of a run's trace needs to know of the run beyond the trace: ``hardware``, the
    HardwareSpec fields of the device it ran on (request.json's setup; None where unreadable), and
    ``optimizer_params``, the parameter elements its optimizer updated on rank 0 (metrics.json's
    parameter bytes over 4, fp32 master weights, else its parameter count; 0 where unreadable: fused
    optimizer steps stay unmodelled), and ``cpu_matrix_flags``, the CPU matrix units the run recorded
    (environment.json; None for a run that predates them). A damaged file gives the fallback, never an
    error."""
    d = Path(run_dir)
    files = RunFiles(d)
    setup = (_json_object(files.request) or {}).get("setup")
    hardware = setup.get("hardware") if isinstance(setup, dict) else None
    hardware = hardware if isinstance(hardware, dict) else None
    m = _json_object(files.metrics) or {}
    try:
        params = int(m["params_bytes"]) // 4 if m.get("params_bytes") else int(m.get("n_params") or 0)
    except (ValueError, TypeError):  # a damaged count (text, a list)
        params = 0
    flags = recorded_cpu_flags({"environment": _json_object(files.environment)})
    return {"hardware": hardware, "optimizer_params": params, "store_root": str(d.parent), "cpu_matrix_flags": flags}


def default_root() -> Path:
    """``$ADVISOR_TRACES_DIR``, else the checkout's ``traces/`` (``./traces`` for an installed package), absolute."""
    return Path(os.environ.get("ADVISOR_TRACES_DIR", DEFAULT_ROOT)).absolute()


def new_run_id(model_name: str, now: float | None = None) -> str:
    """``YYYYmmdd-HHMMSS-<model>-<6 hex>``, UTC; the model name is reduced to [a-z0-9._-]."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))
    slug = re.sub(r"[^a-z0-9._-]+", "-", model_name.lower()).strip("-._")[:40] or "model"
    return f"{stamp}-{slug}-{secrets.token_hex(3)}"


def check_run_id(run_id: object) -> str:
    """The id if it is well formed; AdvisorError otherwise."""
    if not isinstance(run_id, str) or not RUN_ID_RE.match(run_id):
        raise AdvisorError(
            f"run id {shown_value(run_id, 60)} is not valid: expected YYYYmmdd-HHMMSS-<model>-<6 hex digits>"
        )
    return run_id


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON to a temporary file beside ``path`` and rename it over ``path``."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str), encoding="utf-8")
    os.replace(tmp, path)


@dataclass(frozen=True)
class RunInfo:
    """One run as listed: its id, directory and run.json contents."""

    run_id: str
    path: Path
    record: dict[str, Any]

    @property
    def status(self) -> str:
        return self.record.get("status", "unknown")

    def metrics(self) -> dict[str, Any] | None:
        """metrics.json (StepMetrics fields), or None where the run has none (failed runs). AdvisorError
        naming the file and the fault where it cannot be read or is not a StepMetrics record."""
        return read_metrics(self.path)

    def top_ops(self) -> list[dict[str, Any]]:
        """top_ops.json's rows (ops by self time, as the child wrote them); [] where the run has none.
        AdvisorError naming the file where it is damaged."""
        return _checked_file(RunFiles(self.path).top_ops, _top_ops_fault) or []

    def nvml_samples(self) -> list[dict[str, Any]]:
        """nvml.json's samples (utilisation, power, memory over the step); [] where the run has none.
        AdvisorError naming the file where it is damaged."""
        data = _checked_file(RunFiles(self.path).nvml, _nvml_fault)
        return data["samples"] if data else []

    def trace_file(self) -> Path | None:
        """The one trace file to offer for download: the run's own, or rank 0's of a distributed run;
        None where the run has no trace (it failed before tracing)."""
        files = RunFiles(self.path)
        for f in (files.trace, files.rank_trace(0)):
            if f.is_file():
                return f
        return None


def read_metrics(run_dir: Path) -> dict[str, Any] | None:
    """A run directory's metrics.json, checked; None where it has none; AdvisorError naming the file and
    what is wrong with it (the listing calls such a run damaged: see :meth:`RunStore.list_runs`)."""
    f = RunFiles(Path(run_dir)).metrics
    if not f.is_file():
        return None
    metrics = _load_metrics(f)
    if isinstance(metrics, str):
        raise AdvisorError(f"{f} {metrics}; the run is damaged (profile it again, or delete it)")
    return metrics


def _load_metrics(f: Path) -> dict[str, Any] | str:
    """metrics.json as a dict, or what is wrong with it: it must be a JSON object holding StepMetrics'
    required fields, and its numeric fields numbers or null (the rules and the regression compute
    with them)."""
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return f"is unreadable ({type(err).__name__})"
    if not isinstance(data, dict):
        return f"is a JSON {type(data).__name__}, not an object of StepMetrics fields"
    missing = [k for k in _REQUIRED_METRICS if not isinstance(data.get(k), str)]
    if missing:
        return f"lacks the field(s) {', '.join(missing)} (a string each)"
    for k in sorted(_METRIC_TYPES.keys() & data.keys()):
        if (fault := _field_fault(k, data[k], _METRIC_TYPES[k])) is not None:
            return f"has {k}={shown_value(data[k], 60)}: expected {fault}"
    world = data.get("world_size")
    if world is not None and not 1 <= world <= MAX_WORLD_SIZE:
        return f"has world_size={world!r}: expected an integer from 1 to {MAX_WORLD_SIZE} or null"
    if world is not None and world > 1:
        for k in _RANK_LISTS:
            v = data.get(k)
            if not isinstance(v, list) or len(v) != world or not all(_finite(x) and x >= 0 for x in v):
                return f"has world_size={world} but {k} is not a list of {world} numbers >= 0"
    return data


def _finite(v: object) -> bool:
    """A real, finite number (JSON's NaN and Infinity, which Python's parser accepts, are not)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _field_fault(name: str, v: object, kind: str) -> str | None:
    """What a StepMetrics field of annotation ``kind`` should hold, or None where ``v`` holds it."""
    if v is None and kind.endswith("| None"):
        return None
    base = kind.removesuffix(" | None")
    if base == "int" and name == "world_size":  # a count of processes that sizes the per-rank lists
        return None if isinstance(v, int) and not isinstance(v, bool) else "an integer or null"
    if base in ("float", "int"):  # other counts only enter arithmetic (a peak in bytes may come as 1.5e10)
        return None if _finite(v) else "a finite number or null"
    if base == "bool":
        return None if isinstance(v, bool) else "true or false"
    if base == "str":
        return None if isinstance(v, str) else "a string"
    if base.startswith("dict"):
        return None if isinstance(v, dict) else "an object"
    if base == "list":
        return None if isinstance(v, list) else "a list"
    return None


def _rows_fault(rows: object, what: str, key: str, key_kind: type, numbers_only: bool) -> str | None:
    """Why ``rows`` is not a list of objects, each with ``key`` of ``key_kind`` and finite numbers
    elsewhere (``numbers_only``), or wherever a number is given (else: NVML's decoded throttle reasons
    are text)."""
    if not isinstance(rows, list):
        return f"holds a JSON {type(rows).__name__}, not a list of {what}"
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            return f"row {i} is a JSON {type(row).__name__}, not an object"
        if not isinstance(row.get(key), key_kind) or isinstance(row.get(key), bool):
            return f"row {i} has no {key} ({'a string' if key_kind is str else 'a number'})"
        for k, v in row.items():
            number = isinstance(v, (int, float)) and not isinstance(v, bool)
            if k != key and v is not None and (number or numbers_only) and not _finite(v):
                return f"row {i} has {k}={shown_value(v, 40)}: expected a finite number"
    return None


def _top_ops_fault(data: object) -> str | None:
    return _rows_fault(data, "ops", "name", str, numbers_only=True)


def _nvml_fault(data: object) -> str | None:
    if not isinstance(data, dict) or not isinstance(data.get("samples"), list):
        return "is not an object with a list of samples"
    if not isinstance(data.get("summary", {}), dict):
        return "has a summary that is not an object"
    return _rows_fault(data["samples"], "samples", "t_s", (int, float), numbers_only=False)


def _json_file_fault(f: Path, check) -> tuple[Any, str | None]:
    """(the JSON in ``f``, None) where ``check`` finds nothing wrong with it, else (None, the fault)."""
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return None, f"is unreadable ({type(err).__name__})"
    fault = check(data)
    return (None, fault) if fault else (data, None)


def _checked_file(f: Path, check) -> Any:
    """The checked JSON of an optional run file; None where the run has none; AdvisorError where the
    file is damaged (it was sound when the run was listed, or it would not have been handed out)."""
    if not f.is_file():
        return None
    data, fault = _json_file_fault(f, check)
    if fault:
        raise AdvisorError(f"{f} {fault}; the run is damaged (profile it again, or delete it)")
    return data


def _symlink_in(d: Path) -> str | None:
    """The first symbolic link inside run directory ``d`` (relative path), or None. A run's files are
    all written by the store's own code, never as links: one may point anywhere outside the store."""
    for top, dirs, files in os.walk(d):  # os.walk does not follow links to folders
        for name in sorted(dirs + files):
            if (Path(top) / name).is_symlink():
                return str((Path(top) / name).relative_to(d))
    return None


class RunStore:
    """Runs under one root directory."""

    def __init__(self, root: str | Path | None = None) -> None:
        # Absolute: the profiling child runs in the repository root, where a relative store (--traces
        # mytraces from another folder) would name another folder.
        self.root = (Path(root) if root is not None else default_root()).absolute()

    def check_root(self) -> None:
        """AdvisorError where the store's root is a file: said before a run waits for its device."""
        if self.root.exists() and not self.root.is_dir():
            raise AdvisorError(f"run store {self.root} is a file, not a folder; give --traces a folder")

    def staging_dir(self, run_id: str) -> Path:
        """A fresh directory where a run is assembled before it is committed, owned by this process
        (see OWNER_FILE); staging directories of dead processes are removed first. AdvisorError where
        the store cannot be created or written."""
        d = self.root / STAGING / check_run_id(run_id)
        self.check_root()
        self.remove_orphans()
        try:
            d.mkdir(parents=True, exist_ok=False)
            write_json_atomic(d / OWNER_FILE, {"machine": _machine(), "owners": [_owner(os.getpid())]})
        except OSError as err:
            raise AdvisorError(
                f"cannot create the staging folder {d} for a run: {err.strerror or err}; "
                "give --traces a folder this user can write"
            ) from None
        return d

    def commit(self, run_id: str) -> Path:
        """Move the staged run into the store in one rename; returns its final directory."""
        src = self.root / STAGING / check_run_id(run_id)
        dst = self.root / run_id
        if not RunFiles(src).record.is_file():
            raise AdvisorError(f"run {run_id} has no run.json; refusing to commit a half-written run")
        (src / OWNER_FILE).unlink(missing_ok=True)
        os.replace(src, dst)
        return dst

    def remove_orphans(self) -> list[str]:
        """File the staging directories whose owning processes, on this host, are all gone (a run
        killed before its commit); returns their names. One whose run.json says ``running`` is committed
        as ``interrupted`` (see :func:`_file_interrupted`); one without a run.json is removed. A directory
        without a readable owner (written before owners were recorded), or owned on another host (a
        store shared between nodes), is left alone, as is anything that cannot be moved or removed (a
        read-only store)."""
        staging = self.root / STAGING
        removed: list[str] = []
        try:
            entries = [d for d in staging.iterdir() if d.is_dir() and not d.is_symlink()]
        except OSError:  # no staging folder yet, or an unreadable one
            return removed
        machine = _machine()
        for d in entries:
            try:
                record = json.loads((d / OWNER_FILE).read_text(encoding="utf-8"))
                if record["machine"] != machine:
                    continue  # another node, boot or PID namespace: its pids mean nothing here
                owners = [(int(o["pid"]), o.get("start")) for o in record["owners"]]
            except (OSError, ValueError, TypeError, KeyError, AttributeError):
                continue  # no readable owner (staged before owners were recorded): left alone
            if owners and not any(_alive(pid, start) for pid, start in owners):
                if self._file_interrupted(d):
                    removed.append(d.name)
                    continue
                shutil.rmtree(d, ignore_errors=True)
                if not d.exists():
                    removed.append(d.name)
        return removed

    def _file_interrupted(self, d: Path) -> bool:
        """Commit the dead staging directory ``d`` as an interrupted run where its run.json holds a run
        that was still running (a child that finished on its own after its launcher died counts too:
        nobody checked and filed its result). False where there is no such record, or ``d`` cannot be
        filed (its id is malformed, the store is read-only, a run of that id exists): then it is removed."""
        files = RunFiles(d)
        record = _json_object(files.record)
        if record is None or record.get("status") != "running" or not RUN_ID_RE.match(d.name):
            return False
        record.update(
            status="interrupted",
            message=INTERRUPTED_MESSAGE,
            finished_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            files=sorted(p.name for p in d.iterdir() if not p.name.startswith(".")),
        )
        try:
            write_json_atomic(files.record, record)
            (d / OWNER_FILE).unlink(missing_ok=True)
            if (self.root / d.name).exists():
                return False
            os.replace(d, self.root / d.name)
        except OSError:
            return False
        return True

    def path(self, run_id: str) -> Path:
        """The directory of a committed run; AdvisorError if the id is invalid or unknown."""
        d = (self.root / check_run_id(run_id)).resolve()
        if d.parent != self.root.resolve() or not d.is_dir():
            raise AdvisorError(f"no run {run_id} in {self.root}")
        return d

    def load(self, run_id: str) -> RunInfo:
        d = self.path(run_id)
        record = _read_record(d)
        if isinstance(record, str):
            raise AdvisorError(f"run {run_id} is damaged: {record}")
        return RunInfo(run_id, d, record)

    def list_runs(self) -> tuple[list[RunInfo], list[tuple[str, str]]]:
        """(runs newest first, damaged entries as (name, reason)); staging and hidden entries skipped,
        staging directories of dead processes filed as interrupted or removed (see :meth:`remove_orphans`)."""
        runs: list[RunInfo] = []
        damaged: list[tuple[str, str]] = []
        if not self.root.is_dir():
            return runs, damaged
        self.remove_orphans()
        for d in sorted(self.root.iterdir(), reverse=True):
            if d.name.startswith(".") or not d.is_dir() or d.name in RESERVED_DIRS:
                continue
            if not RUN_ID_RE.match(d.name):
                damaged.append((d.name, "name is not a run id"))
                continue
            if d.is_symlink():
                damaged.append((d.name, "is a symbolic link; a run must be a folder inside the store"))
                continue
            record = _read_record(d)
            if isinstance(record, str):
                damaged.append((d.name, record))
            else:
                runs.append(RunInfo(d.name, d, record))
        return runs, damaged

    def delete(self, run_id: str) -> None:
        shutil.rmtree(self.path(run_id))


def _read_record(d: Path) -> dict[str, Any] | str:
    """run.json as a dict, or the reason it cannot be read."""
    files = RunFiles(d)
    f = files.record
    if not f.is_file():
        return "run.json is missing"
    try:
        record = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return f"run.json is unreadable ({type(err).__name__})"
    if not isinstance(record, dict) or record.get("status") not in STATUSES:
        return "run.json has no valid status"
    if (fault := _record_fault(record)) is not None:
        return f"run.json {fault}"
    if record["status"] == "ok" and not files.metrics.is_file():
        return "status ok but metrics.json is missing"
    if (link := _symlink_in(d)) is not None:
        return f"{link} is a symbolic link; a run's files must be inside its folder"
    if files.metrics.is_file():
        metrics = _load_metrics(files.metrics)
        if isinstance(metrics, str):
            return f"metrics.json {metrics}"
        if record["status"] == "ok" and metrics["source"] == "profile":
            missing = [k for k in _PROFILED_METRICS if not isinstance(metrics.get(k), str)]
            if missing:
                return f"metrics.json lacks {', '.join(missing)} (a string each, as every profiled run has)"
    for f, check in ((files.top_ops, _top_ops_fault), (files.nvml, _nvml_fault)):
        if f.is_file() and (fault := _json_file_fault(f, check)[1]):
            return f"{f.name} {fault}"
    return record


def _record_fault(record: dict[str, Any]) -> str | None:
    """What is wrong with run.json's fields that readers use, or None: a setup of four objects, text
    where text is expected."""
    setup = record.get("setup")
    if setup is not None:
        if not isinstance(setup, dict):
            return "has a setup that is not an object"
        for part in ("model", "train", "parallel", "hardware"):
            if not isinstance(setup.get(part, {}), dict):
                return f"has setup.{part} that is not an object"
    for k in ("message", "created_utc", "run_id"):
        if record.get(k) is not None and not isinstance(record[k], str):
            return f"has {k}={shown_value(record[k], 40)}: expected a string"
    if record.get("options") is not None and not isinstance(record["options"], dict):
        return "has options that are not an object"
    return None


def add_owner(run_dir: Path, pid: int) -> None:
    """Record ``pid`` (the profiling child) as an owner of the staging directory ``run_dir`` too: the
    directory stays while any owner lives, so a child outliving a killed parent keeps its run."""
    f = Path(run_dir) / OWNER_FILE
    try:
        record = json.loads(f.read_text(encoding="utf-8"))
        record["owners"].append(_owner(pid))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return  # no owner record to add to: the directory is never removed anyway
    write_json_atomic(f, record)


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _machine() -> dict[str, Any]:
    """What makes a pid mean the same process: the host, this boot and this PID namespace (Linux's
    /proc; empty elsewhere, where the hostname alone decides)."""
    try:
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pidns = 0
    return {"host": socket.gethostname(), "boot": _read("/proc/sys/kernel/random/boot_id"), "pidns": pidns}


def _start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/<pid>/stat), so a reused
    pid is not taken for the owner; None where /proc does not say."""
    stat = _read(f"/proc/{pid}/stat")
    fields_after_name = stat.rpartition(")")[2].split()  # the name in parentheses may hold spaces
    return fields_after_name[19] if len(fields_after_name) > 19 else None


def _owner(pid: int) -> dict[str, Any]:
    return {"pid": pid, "start": _start(pid)}


def _alive(pid: int, start: str | None = None) -> bool:
    """Whether process ``pid`` exists here (signal 0 checks without sending anything) and, where its
    start time was recorded, is still the process that started then."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's process
        pass
    return start is None or _start(pid) in (None, start)
