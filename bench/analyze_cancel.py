"""Cancel during an analysis in the app: how long from the click to the answer, and what is left running.

Run: ``.venv/bin/python bench/analyze_cancel.py [--size-mb 300] [--trials 3] [--out FILE]``.

A Kineto trace of about ``--size-mb`` is written from copies of a real one (bench/analyze_speed.py's
``write_large_trace``) and analysed through the Analyze tab's function (webui.analyze.analyze_view):
once whole (the reference duration of each stage), then ``--trials`` times cancelled at a point inside
the load and inside the analyses' stage (half-way through each, from the whole run's stage times). For
each: seconds from Cancel to the answer, whether the child process was still alive after it, and the
app process's RSS before and after (the event table lives in the child). Ratios, not absolute times, are
the figures to compare: the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from analyze_speed import TRACES as SHARED_TRACES  # a sibling: python puts bench/ on the path
from analyze_speed import write_large_trace


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=300)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from advisor.run import analysis_child as isolated
    from webui import analyze as tab

    pids: list[int] = []
    run = isolated.run_isolated
    tab.isolated.run_isolated = lambda *a, **k: run(*a, **k, on_start=pids.append)
    source = SHARED_TRACES / "kineto" / "ns_resolution_trace"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "large.json"
        copies = write_large_trace(source, path, int(args.size_mb * 2**20))
        size_mb = path.stat().st_size / 2**20
        isolated.SPARE.start()
        time.sleep(2)  # the idle child's imports
        marks: list[tuple[int, float]] = []
        start = time.perf_counter()
        rss0 = rss_mib()
        summary = tab.analyze_view(
            str(path), None, on_stage=lambda done, *_: marks.append((done, time.perf_counter()))
        )[0]
        whole = time.perf_counter() - start
        assert "Cannot" not in summary, summary
        stage_s = {done: t - start for done, t in marks}
        load_s, analysis_s = stage_s[1] - stage_s[0], stage_s[2] - stage_s[1]
        rows = [("whole analysis", whole, None, rss0, rss_mib(), None)]
        for stage, at in ((0, stage_s[0] + load_s / 2), (1, stage_s[1] + analysis_s / 2)):
            name = "load" if stage == 0 else "analyses"
            for _ in range(args.trials):
                time.sleep(2)  # the next idle child's imports
                cancel = threading.Event()
                clicked: list[float] = []
                t0 = time.perf_counter()

                def click(at=at, t0=t0, cancel=cancel, clicked=clicked):
                    time.sleep(max(0.0, at - (time.perf_counter() - t0)))
                    clicked.append(time.perf_counter())
                    cancel.set()

                threading.Thread(target=click, daemon=True).start()
                before = rss_mib()
                out = tab.analyze_view(str(path), None, cancel=cancel)[0]
                answered = time.perf_counter()
                assert out == "### Analysis cancelled", out[:200]
                rows.append((f"cancelled in the {name}", answered - clicked[0], alive(pids[-1]), before, rss_mib(), at))
    lines = [
        f"Trace: {copies} copies of ns_resolution_trace, {size_mb:,.0f} MiB of Kineto JSON. Whole analysis "
        f"{whole:.1f} s (load {load_s:.1f} s, analyses {analysis_s:.1f} s).",
        "",
        "| run | Cancel at s | Cancel to answer s | answer / whole | child alive after | app RSS MiB before -> after |",
        "|---|---:|---:|---:|---|---|",
    ]
    for name, secs, child, before, after, at in rows:
        at_s = "-" if at is None else f"{at:.1f}"
        lines.append(
            f"| {name} | {at_s} | {secs:.3f} | {secs / whole:.3f} | {'-' if child is None else child} | "
            f"{before:,.0f} -> {after:,.0f} |"
        )
    cancels = [r[1] for r in rows[1:]]
    lines.append("")
    lines.append(f"Cancel to answer: median {statistics.median(cancels):.3f} s, max {max(cancels):.3f} s.")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
