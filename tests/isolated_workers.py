"""Functions the analysis child runs in tests (``analyze_view(..., worker="tests.isolated_workers:NAME")``):
what a monkeypatch cannot reach, since the child is another process."""

from __future__ import annotations

import os
import time

from advisor.errors import TraceError
from advisor.run import analysis_child as isolated


def no_roofline(request: dict, stage):
    """The real analysis, with a roofline that cannot be made."""

    def refuse(*_args, **_kwargs):
        raise TraceError("trace.json.gz holds no cpu_op events to judge")

    isolated.trace_roofline = refuse
    return isolated.analysis_work(request, stage)


def stuck_in_analysis(request: dict, stage):
    """Reports the first two stages, writes its pid beside the trace (``PATH.pid``), then computes forever:
    an analysis that never reaches the end of its stage."""
    stage(0, f"loading {request['label']}")
    stage(1, "analyzing 1 events")
    with open(request["path"] + ".pid", "w") as f:
        f.write(str(os.getpid()))
    while True:
        sum(range(10**6))


def dies(request: dict, stage):
    """Ends the process without an answer, as the kernel's out-of-memory killer would."""
    stage(0, "loading")
    os.kill(os.getpid(), 9)
    time.sleep(10)


def crashes(request: dict, stage):
    raise ZeroDivisionError("a bug in an analysis")
