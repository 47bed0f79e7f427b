"""A trace's load and every analysis in a child process that the caller can kill at any moment.

The app analyses users' uploads here, not in its own process: Cancel and the wall-clock budget then
stop the work at once, inside any stage (a long sort, a critical path), where a check between stages
would let the stage run on; the event table's memory goes back to the system when the child ends; and
a trace that exhausts memory takes down the child, not the server.

The child is a fresh interpreter (``python -m advisor.run.analysis_child``), not a fork of the caller's
threads. One is kept started and idle (``SPARE``) so that an analysis does not wait for the child's
imports; each child serves one analysis and exits. Requests and answers are pickled over two pipes of
their own (the child's stdout and stderr stay the server's log). A child whose parent is gone exits.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import pandas as pd

from advisor.analysis.roofline import Roofline, trace_roofline
from advisor.analysis.summary import TraceReport, analyze, load_trace
from advisor.analysis.timeline import step_timeline
from advisor.errors import AdvisorError
from advisor.store.ceilings import ceilings_lookup

log = logging.getLogger(__name__)

WORKER = "advisor.run.analysis_child:analysis_work"
"""The function a child runs by default (``module:function``; tests name others)."""
POLL_S = 0.05
"""How often the caller looks at its stop check while the child works."""
PARENT_CHECK_S = 0.5
"""How often a child looks for its parent; it exits once the parent is gone."""


@dataclass(frozen=True)
class Analysis:
    """What the Analyze view shows of one trace, with no event table: the report, its roofline (None
    where it could not be made, ``roofline_note`` saying why), the step timeline's rows (None where the
    trace has no step to draw) and the number of events read."""

    report: TraceReport
    roofline: Roofline | None
    roofline_note: str
    timeline: pd.DataFrame | None
    events: int


def roofline_or_reason(table: pd.DataFrame) -> tuple[Roofline | None, str]:
    """(Roofline, "") of a trace's event table, or (None, why) where it cannot be made. Our own runs are
    judged against the measured ceilings stored for their device where there are any (as ``advisor
    analyze`` does), other traces against the datasheet."""
    run = table.attrs.get("run")
    ceilings = ceilings_lookup(run["store_root"]) if run else None
    try:
        return trace_roofline(table, ceilings=ceilings), ""
    except AdvisorError as err:
        return None, f"Roofline skipped: {err}"
    except Exception:
        log.exception("roofline failed")
        return None, "Roofline skipped: it failed unexpectedly; see the server log."


def timeline_rows(table: pd.DataFrame) -> pd.DataFrame | None:
    """``step_timeline`` of rank 0's last step; None where the trace has none or it fails (logged)."""
    try:
        return step_timeline(table)
    except AdvisorError:
        return None
    except Exception:
        log.exception("step timeline failed")
        return None


def analysis_work(request: dict, stage: Callable[[int, str], None]) -> Analysis:
    """The child's work: load ``request["path"]`` within its limits, then every analysis; ``stage(done,
    message)`` as each of the three stages starts (load, analyses, drawing)."""
    label = request["label"]
    stage(0, f"loading {label}")
    limits = {"max_bytes": request["max_bytes"], "max_event_bytes": request["max_event_bytes"]}
    table = load_trace(request["path"], **limits, dedicated=True)  # the child serves one analysis and exits
    stage(1, f"analyzing {len(table):,} events")
    roofline, note = roofline_or_reason(table)
    report = analyze(table, run_id=label, roofline=roofline)
    stage(2, "drawing")
    return Analysis(report, roofline, note, timeline_rows(table), len(table))


class ChildFailed(AdvisorError):
    """The child ended without an answer: killed from outside (often for memory) or crashed."""


class StageError(AdvisorError):
    """An AdvisorError raised in the child, rebuilt here: ``kind`` is its class's name, ``stage`` the
    stage it was raised in (0: the load)."""

    def __init__(self, message: str, kind: str, stage: int) -> None:
        super().__init__(message)
        self.kind = kind
        self.stage = stage


# --- The caller's side ---------------------------------------------------------------------------


class _Child:
    """One started child: its process and the two ends of its pipes that are ours."""

    def __init__(self) -> None:
        req_r, req_w = os.pipe()
        ans_r, ans_w = os.pipe()
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # the folder holding the advisor package
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        # One heap for all its threads from its start (summary.share_one_heap, which load_trace calls too
        # late where a thread of the child has taken a heap of its own already).
        env["MALLOC_ARENA_MAX"] = "1"
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "advisor.run.analysis_child", str(req_r), str(ans_w)],
                stdin=subprocess.DEVNULL,
                pass_fds=(req_r, ans_w),
                env=env,
            )
        finally:
            os.close(req_r)
            os.close(ans_w)
        self.requests = Connection(req_w, readable=False)
        self.answers = Connection(ans_r, writable=False)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def end(self) -> None:
        """Kill the child (where it still runs) and wait for it: nothing of it runs after this."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.requests.close()
        self.answers.close()


class _Spare:
    """One idle child kept started, so that the next analysis finds its imports done."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._child: _Child | None = None
        self._registered = False

    def take(self) -> _Child:
        """The idle child (or a new one where it has died), and a new idle one started behind it."""
        with self._lock:
            child = self._child
            if child is None or not child.alive():
                if child is not None:
                    child.end()  # died idle (killed from outside): reaped, its pipes closed
                child = _Child()
            self._child = _Child()
            if not self._registered:
                atexit.register(self.stop)
                self._registered = True
        return child

    def start(self) -> None:
        """Start the idle child now (the app calls this as it starts), where none is waiting."""
        with self._lock:
            if self._child is None or not self._child.alive():
                if self._child is not None:
                    self._child.end()
                self._child = _Child()
            if not self._registered:
                atexit.register(self.stop)
                self._registered = True

    def stop(self) -> None:
        with self._lock:
            if self._child is not None:
                self._child.end()
                self._child = None


SPARE = _Spare()


def run_isolated(
    request: dict,
    *,
    check: Callable[[], None],
    on_stage: Callable[[int, str], None] | None = None,
    worker: str = WORKER,
    on_start: Callable[[int], None] | None = None,
):
    """``worker(request, stage)`` run in a child process; its result. ``check()`` is called every
    POLL_S and after each stage: when it raises (a Cancel, a time budget), the child is killed at once,
    waited for, and the raise goes on. The child's AdvisorError comes back as a StageError with its
    message; a child that dies without an answer, as ChildFailed; any other exception in the child as
    a RuntimeError (its traceback logged). ``on_start(pid)`` hears the child's pid."""
    child = SPARE.take()
    if on_start is not None:
        on_start(child.proc.pid)
    try:
        try:
            child.requests.send({**request, "worker": worker})
        except OSError:  # the idle child died between the check and the request
            child.proc.wait()
            raise ChildFailed(_death(child.proc.returncode)) from None
        while True:
            check()
            if not child.answers.poll(POLL_S):
                if not child.alive() and not child.answers.poll(0):
                    raise ChildFailed(_death(child.proc.returncode))
                continue
            try:
                kind, *rest = child.answers.recv()
            except (EOFError, OSError):
                child.proc.wait()
                raise ChildFailed(_death(child.proc.returncode)) from None
            if kind == "stage":
                if on_stage is not None:
                    on_stage(*rest)
            elif kind == "done":
                return rest[0]
            elif kind == "error":
                message, name, stage = rest
                raise StageError(message, name, stage)
            else:  # "crash": the child's traceback, for the server's log
                log.error("the analysis process failed:\n%s", rest[0])
                raise RuntimeError("the analysis process failed; see the server log")
    finally:
        child.end()


def _death(code: int | None) -> str:
    if code is not None and code < 0:
        why = f"killed by signal {-code}" + (": often the system running out of memory" if code == -9 else "")
    else:
        why = f"exit status {code}"
    return f"The analysis process ended without an answer ({why}); try a smaller trace, or `python -m advisor analyze`."


# --- The child's side ----------------------------------------------------------------------------


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(PARENT_CHECK_S)
        if os.getppid() != parent:
            os._exit(3)  # the parent is gone: nobody will read the answer


def _child_main(req_fd: int, ans_fd: int) -> int:
    requests, answers = Connection(req_fd, writable=False), Connection(ans_fd, readable=False)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    try:
        request = requests.recv()
    except (EOFError, OSError):
        return 0  # an idle child whose caller ended
    module, _, name = request["worker"].partition(":")
    work = getattr(importlib.import_module(module), name)
    at = [0]

    def stage(done: int, message: str) -> None:
        at[0] = done
        answers.send(("stage", done, message))

    try:
        answers.send(("done", work(request, stage)))
    except AdvisorError as err:
        answers.send(("error", str(err), type(err).__name__, at[0]))
    except BaseException:
        answers.send(("crash", traceback.format_exc()))
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(int(sys.argv[1]), int(sys.argv[2])))
