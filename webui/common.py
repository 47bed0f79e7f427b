"""What every tab shares: the run store, widget coercion, the long jobs and their Cancel, one error
decorator for every handler, and the figures two tabs draw (a step timeline, a roofline)."""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import logging
import math
import os
import queue
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import gradio as gr

from advisor.errors import AdvisorError, SpecError, shown_value
from advisor.estimate.planner import MAX_TIME_BUDGET_S
from advisor.present.charts import timeline_figure
from advisor.run.analysis_child import roofline_or_reason, timeline_rows
from advisor.store.runstore import RunStore

log = logging.getLogger("advisor.app")

TRACE_TYPES = [".json", ".gz", ".zip", ".sqlite"]
TRACE_LABEL = "Trace: Kineto .json/.json.gz, .zip of rank files, or nsys .sqlite"
ROOFLINE_LABEL = "Roofline: achieved FLOP/s against FLOP/byte (log-log; marker area: time)"


def store() -> RunStore:
    """The run store (``$ADVISOR_TRACES_DIR`` or ``traces/``), read afresh on each call."""
    return RunStore()


# --- Errors --------------------------------------------------------------------------------------


def guarded(title: str, what: str, rest: Callable[[], tuple] | None = None) -> Callable:
    """Decorate a handler so no exception reaches the server: an AdvisorError (bad input, a damaged
    file) shows as ``### {title}`` and its message, anything else is logged with its traceback and
    shows as an internal error naming ``what`` failed. ``rest()`` gives the handler's other outputs
    in their empty state (None: the message is the only output). Works on generator handlers too."""

    def shown(message: str):
        return (message, *rest()) if rest is not None else message

    def on_error(fn: Callable, err: Exception):
        if isinstance(err, AdvisorError):
            log.warning("%s rejected: %s", fn.__name__, shown_value(str(err), 300))  # one line, no traceback
            return shown(f"### {title}\n{err}")
        log.error("%s failed", fn.__name__, exc_info=err)
        return shown(f"### Internal error\n{what} failed unexpectedly; see the server log.")

    def wrap(fn: Callable) -> Callable:
        if inspect.isgeneratorfunction(fn):

            @functools.wraps(fn)
            def gen_handler(*args, **kwargs):
                try:
                    yield from fn(*args, **kwargs)
                except Exception as err:
                    yield on_error(fn, err)

            return gen_handler

        @functools.wraps(fn)
        def handler(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as err:
                return on_error(fn, err)

        return handler

    return wrap


# --- Limits on one request ----------------------------------------------------------------------


@dataclass(frozen=True)
class TraceLimits:
    """What one Analyze request may spend, from the environment (README, "Safe by default")."""

    max_bytes: int
    """Decompressed bytes of the trace, all files of a zip together (ADVISOR_MAX_TRACE_MB)."""
    max_event_bytes: int
    """Bytes of one Kineto event (ADVISOR_MAX_EVENT_MB)."""
    timeout_s: float
    """Wall-clock seconds for the load and the analysis together (ADVISOR_ANALYZE_TIMEOUT_S)."""


# A 500 MB upload of gzipped Kineto JSON unpacks to about 4 GiB (compressed 8-12x); the CLI's 8 GiB
# for each of the app's 16 concurrent requests could have asked for 128 GiB. The Analyze tab also runs
# at most webui.analyze.ANALYZE_CONCURRENCY at once. One event: see advisor.trace.kineto.
TRACE_LIMIT_DEFAULTS = {
    "ADVISOR_MAX_TRACE_MB": 4096.0,
    "ADVISOR_MAX_EVENT_MB": 16.0,
    "ADVISOR_ANALYZE_TIMEOUT_S": 600.0,
}


def trace_limits() -> TraceLimits:
    """The limits of one Analyze request, read afresh from the environment; AdvisorError naming the
    variable and its value where one is not a number > 0."""
    values = {}
    for var, default in TRACE_LIMIT_DEFAULTS.items():
        raw = os.environ.get(var, "")
        try:
            value = float(raw) if raw.strip() else default
        except ValueError:
            value = math.nan
        if not (value > 0 and math.isfinite(value)):
            raise AdvisorError(f"{var}={raw!r}: must be a number > 0 (the server's setting; default {default:g})")
        values[var] = value
    return TraceLimits(
        max_bytes=max(1, int(values["ADVISOR_MAX_TRACE_MB"] * 2**20)),
        max_event_bytes=max(1, int(values["ADVISOR_MAX_EVENT_MB"] * 2**20)),
        timeout_s=values["ADVISOR_ANALYZE_TIMEOUT_S"],
    )


PLAN_TIMEOUT_DEFAULT_S = 60.0
"""The Plan tab's search budget where ADVISOR_PLAN_TIMEOUT_S is unset: every plan of the bench cases
takes under 20 s on a loaded 2-core box; the largest grids the spec admits 2-4 minutes (advisor.estimate.planner)."""


def plan_time_budget() -> float:
    """Wall-clock seconds one Plan request may search (ADVISOR_PLAN_TIMEOUT_S), read afresh from the
    environment; AdvisorError naming the variable and its value where it is not a number from above 0
    to the planner's MAX_TIME_BUDGET_S."""
    raw = os.environ.get("ADVISOR_PLAN_TIMEOUT_S", "")
    try:
        value = float(raw) if raw.strip() else PLAN_TIMEOUT_DEFAULT_S
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_TIME_BUDGET_S:  # NaN fails too
        raise AdvisorError(
            f"ADVISOR_PLAN_TIMEOUT_S={raw!r}: must be a number of seconds above 0, at most {MAX_TIME_BUDGET_S:g} "
            f"(the server's setting; default {PLAN_TIMEOUT_DEFAULT_S:g})"
        )
    return value


def without_server_paths(message: str, upload: str | None) -> str:
    """``message`` with the upload's server path cut to its file name (Gradio keeps uploads under
    a temporary folder whose name says nothing to the user and something to an attacker)."""
    if not upload:
        return message
    folder = os.path.dirname(upload)
    return message.replace(upload, os.path.basename(upload)).replace(folder + os.sep, "").replace(folder, "")


# --- Widgets -------------------------------------------------------------------------------------

CHECKED_WIDGETS = (gr.Number, gr.Radio, gr.Dropdown, gr.CheckboxGroup)
"""Widgets whose value Gradio checks before a handler runs (a number in range, one of the choices)."""


def validate_in_handlers(demo: gr.Blocks) -> None:
    """Hand every number and choice widget's value to the handlers as the caller sent it. Gradio refuses
    an out-of-range number or an unknown choice itself, before any handler runs, with a message that
    names no widget ("Value: 3 is not in the list of choices"), and text where a number belongs with
    none at all ({"error": null}); the handlers turn every value into a spec (``as_int``, ``make_setup``,
    ``PlanRequest``), whose validation names the field, the value and what is allowed. The browser's
    widgets keep their ranges and choices: this changes only what an API caller sees."""
    for block in demo.blocks.values():
        if isinstance(block, CHECKED_WIDGETS):
            block.preprocess = _as_sent  # type: ignore[method-assign]


def _as_sent(payload):
    return payload


class _Empty:
    """A box the user emptied, as a field's message shows it ("seq=empty: give a number")."""

    def __repr__(self) -> str:
        return "empty"


EMPTY = _Empty()


def refuse_empty(**values) -> None:
    """SpecError naming the first of ``values`` (field -> widget value) that is an emptied box."""
    if field := next((k for k, v in values.items() if v is None), None):
        raise SpecError(field, EMPTY, "give a number")


def as_int(value: float | str | None) -> int | None:
    """Gradio numbers arrive as float or None and dropdown degrees as text; integral values become ints,
    the rest stay for the spec's validation to reject with a clear message."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: a 400-digit number as text
        return value  # type: ignore[return-value]
    return int(number) if number.is_integer() and not isinstance(value, bool) else value  # type: ignore[return-value]


def degree_dropdown(choices: list[int], value: int, label: str, **kwargs) -> gr.Dropdown:
    """A parallel degree as text choices: gradio_client documents dropdown values as strings, and
    as_int turns them back into integers (an integer from a Python caller works too)."""
    return gr.Dropdown([str(c) for c in choices], value=str(value), label=label, **kwargs)


def spec_number(
    value: float | None, label: str, *, low: float | None = None, high: float | None = None, **kwargs
) -> gr.Number:
    """A number the handler validates (a spec field or a run option): no minimum, maximum or precision.
    With them Gradio checks the value itself before any handler runs, with a message that names no
    field ("Value 0 is less than minimum value 1", seen on the Plan tab with a traceback in the log),
    and precision 0 rounds 1.5 GPUs to 2 without a word (seen on the Size tab). ``validate_in_handlers``
    lifts the same checks for API callers, but a widget a link or Apply updates is rebuilt by Gradio
    without it; a widget with no bounds needs no lifting. The handler's spec names the field, the value
    and what is allowed. ``low`` and ``high`` bound only what another tab's value may copy in
    (``follow_value``: the Size tab's global batch 0, "no accumulation", is no Plan tab batch)."""
    number = gr.Number(value=value, label=label, **kwargs)
    number.follow_range = (low, high)
    return number


def block_count(value: int, label: str, *, info: str | None = None, elem_id: str | None = None) -> gr.Number:
    """A count of transformer blocks (recompute or offload N blocks a stage), as the Size and Profile
    tabs both ask for it."""
    return spec_number(value, label, low=0, info=info, elem_id=elem_id)


def run_dropdown(label: str, **kwargs) -> gr.Dropdown:
    """A stored-run picker. Its choices are filled per browser session on page load, so without a custom
    value an API caller (who never loads the page) or a run profiled after the load would be refused
    as "not in the list of choices"; the handlers validate every run id against the store instead."""
    return gr.Dropdown(choices=[], label=label, interactive=True, allow_custom_value=True, **kwargs)


def run_choices(index: int = 0, measured: bool = True) -> gr.Dropdown:
    """The stored runs, newest first, with the ``index``-th newest selected (0: the tab opens on the
    latest run; 1 on the History tab's run A, so A and B start as the two latest). ``measured``: count
    only runs that finished ok (where there are enough), so a tab does not open on a cancelled or
    failed run with nothing to show ("has no trace", "cannot compare")."""
    runs, _ = store().list_runs()
    ids = [r.run_id for r in runs]
    # Measured runs first, newest first, then the others: the index-th differs for every index.
    ok = [r.run_id for r in runs if r.status == "ok"]
    pool = ok + [r.run_id for r in runs if r.status != "ok"] if measured else ids
    return gr.Dropdown(choices=ids, value=pool[index] if len(pool) > index else None)


def refresh_runs(current: str | None) -> gr.Dropdown:
    """A run picker's choices read again when its tab is opened, so a run profiled since the page
    loaded is listed (a user review: profiled on the Profile tab, it was missing from Analyze, Advice
    and History until a reload). The pick stays where it is; with none, the newest run that finished."""
    runs, _ = store().list_runs()
    ids = [r.run_id for r in runs]
    if current in ids:
        return gr.Dropdown(choices=ids, value=current)
    ok = [r.run_id for r in runs if r.status == "ok"]
    return gr.Dropdown(choices=ids, value=(ok or ids or [None])[0])


def follow_value(component: gr.components.Component, value):
    """``value`` as ``component`` takes it, or gr.skip() where it has no such choice (fp8 on the
    Profile tab) or is out of its range (a global batch of 0 on the Plan tab)."""
    if value is None or not isinstance(value, str | int | float):  # a list or a dict from an API caller
        return gr.skip()
    if isinstance(component, gr.CheckboxGroup):
        value = [value]
    choices = getattr(component, "choices", None)
    if choices is not None and isinstance(component, gr.Radio | gr.Dropdown | gr.CheckboxGroup):
        allowed = {v for _, v in choices}
        if not set(value if isinstance(value, list) else [value]) <= allowed:
            return gr.skip()
    if isinstance(component, gr.Number):
        if isinstance(value, str | bool) or not math.isfinite(value):
            return gr.skip()
        low, high = getattr(component, "follow_range", (component.minimum, component.maximum))
        if (low is not None and value < low) or (high is not None and value > high):
            return gr.skip()
    return value


# --- Long jobs -----------------------------------------------------------------------------------


class Jobs:
    """The long jobs in flight, one per (kind, browser session), each with its own cancel Event: a
    Cancel reaches only the caller's own job, never another user's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: dict[tuple[str, str], threading.Event] = {}

    @staticmethod
    def _key(kind: str, request: gr.Request | None) -> tuple[str, str]:
        return kind, getattr(request, "session_hash", None) or "local"

    def start(self, kind: str, request: gr.Request | None) -> threading.Event:
        """A fresh cancel Event for the caller's new job of this kind."""
        event = threading.Event()
        with self._lock:
            self._events[self._key(kind, request)] = event
        return event

    def finish(self, kind: str, request: gr.Request | None, event: threading.Event) -> None:
        with self._lock:
            if self._events.get(self._key(kind, request)) is event:
                del self._events[self._key(kind, request)]

    def cancel(self, kind: str, request: gr.Request | None) -> bool:
        """Cancel the caller's running job of this kind; False when it has none."""
        with self._lock:
            event = self._events.get(self._key(kind, request))
        if event is None:
            return False
        event.set()
        return True


JOBS = Jobs()


def _run_job(job, updates: queue.Queue, cancel: threading.Event, result: dict) -> None:
    """The worker thread's body: the job's value, or a message where it raised (an AdvisorError's own,
    or a short one for a crash, whose traceback goes to the log)."""
    try:
        result["value"] = job(lambda *p: updates.put(p), cancel)
    except AdvisorError as err:
        result["value"] = str(err)
    except Exception:
        log.exception("background job failed")
        result["value"] = "Internal error: the job failed unexpectedly; see the server log."
    finally:
        updates.put(None)


def in_background(kind: str, request: gr.Request | None, job, progress_view):
    """Run ``job(on_progress, cancel)`` in a thread as the caller's job of this ``kind`` (its Cancel
    button sets ``cancel``: see Jobs), yielding ``progress_view(done, total, message)`` for each
    progress report; returns the job's result, or a message where it raised. The server never sees
    the raise. If the page goes away (Gradio stops the generator), the job is cancelled and waited
    for. Gradio may free the queue's slot before that (a client's job.cancel(): bench/cancel_queue.py),
    so a profile also waits for the device in the launcher (advisor.run.launcher._DEVICE)."""
    updates: queue.Queue = queue.Queue()
    result: dict = {}
    cancel = JOBS.start(kind, request)
    thread = threading.Thread(target=_run_job, args=(job, updates, cancel, result), daemon=True)
    thread.start()
    try:
        while (item := updates.get()) is not None:
            yield progress_view(*item)
    except GeneratorExit:
        cancel.set()
        thread.join()
        raise
    finally:
        JOBS.finish(kind, request, cancel)
    return result["value"]


def cancel_message(kind: str, request: gr.Request | None, cancelling: str, nothing: str) -> str:
    """What a Cancel button shows: ``cancelling`` when the caller has a job of this kind running."""
    return cancelling if JOBS.cancel(kind, request) else nothing


# --- Figures two tabs draw -----------------------------------------------------------------------


DOWNLOAD_MAX_AGE_S = 3600
PROCESS_FOLDER_RE = re.compile(r"^advisor-(reports|uploads)-([0-9]+)$")
"""The temporary folders an app process owns, by kind and pid: its reports to download, and Gradio's
upload cache (app.py points GRADIO_TEMP_DIR there)."""
_REMOVE_AT_EXIT: set[str] = set()


def process_folder(kind: str, pid: int | None = None) -> str:
    """``<tmp>/advisor-<kind>-<pid>``: process ``pid``'s (this one's) folder of that kind (not created)."""
    return os.path.join(tempfile.gettempdir(), f"advisor-{kind}-{pid or os.getpid()}")


def remove_at_exit(folder: str) -> None:
    """Remove ``folder`` when this process exits normally (a kill -9 leaves it to remove_dead_folders)."""
    if not _REMOVE_AT_EXIT:
        atexit.register(lambda: [shutil.rmtree(f, ignore_errors=True) for f in sorted(_REMOVE_AT_EXIT)])
    _REMOVE_AT_EXIT.add(folder)


def remove_dead_folders() -> list[str]:
    """Remove the process folders (see PROCESS_FOLDER_RE) of app processes that are gone (killed, so
    their exit handlers never ran); returns the folders removed. A folder whose pid is alive is kept,
    even where the pid was reused by another program: leaving a folder is the safe mistake."""
    removed = []
    tmp = tempfile.gettempdir()
    for name in sorted(os.listdir(tmp)):
        m = PROCESS_FOLDER_RE.match(name)
        path = os.path.join(tmp, name)
        if not m or os.path.islink(path) or not os.path.isdir(path) or _pid_alive(int(m.group(2))):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append(path)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process; a pid beyond the platform's
        return True
    return True


def discard_upload(upload: str | None) -> None:
    """Remove a rejected upload (and its folder, once empty) from Gradio's upload cache, so a refused
    file takes no disk; a path outside the cache is never touched."""
    if not upload:
        return
    cache = os.path.realpath(os.environ.get("GRADIO_TEMP_DIR") or os.path.join(tempfile.gettempdir(), "gradio"))
    path = os.path.realpath(upload)
    if os.path.commonpath([cache, path]) != cache or path == cache:
        return
    with contextlib.suppress(OSError):
        os.remove(path)
        os.rmdir(os.path.dirname(path))  # Gradio keeps each upload in a folder of its own; fails if not empty


def download_root() -> str:
    """One folder per app process for files made to download (reports, traces for Perfetto), removed
    when the process exits; folders in it older than an hour are removed."""
    root = process_folder("reports")
    os.makedirs(root, exist_ok=True)
    remove_at_exit(root)
    cutoff = time.time() - DOWNLOAD_MAX_AGE_S
    for entry in os.scandir(root):
        if entry.is_dir() and entry.stat().st_mtime < cutoff:
            shutil.rmtree(entry.path, ignore_errors=True)
    return root


def timeline_of(table):
    """The step-timeline figure of an event table's last step on rank 0; None where it has none
    (a trace with no events) or it fails (logged: the rest of the view still shows)."""
    return timeline_figure_of(timeline_rows(table))


def timeline_figure_of(rows):
    """The step-timeline figure of ``advisor.run.analysis_child.timeline_rows``; None for None."""
    return None if rows is None else timeline_figure(rows)


def roofline_of(table):
    """(Roofline, "") of a trace's event table, or (None, why) where it cannot be made; the rest of a
    view still shows (advisor.run.analysis_child.roofline_or_reason)."""
    return roofline_or_reason(table)
