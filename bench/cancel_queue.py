"""Cancel a running profile with another queued behind it, through the app's own queue (issue 22).

Each trial, against one app served in this process (as ``app.main()`` serves it, run store in a
temporary folder), from one API client: submit run A (tiny model on the CPU, 100 steps: long enough to
be cancelled mid-run), wait until A's profiling child has started (its pid is in the staging folder's
owners), submit run B (1 step) so it queues behind A, then cancel A, alternately with the Profile tab's
Cancel endpoint and with the client's own ``job.cancel()`` (Gradio gives up on the job). Checked from
the records the launcher files (``run.json``'s ``child``: its start just before the child was started,
its end just after the child's exit was reaped, so the real lifetimes lie inside): A is filed as
cancelled, B finishes ok, and A's child ended before B's child started (never two children at once).

Run (from the checkout, installed with `make setup`): ``.venv/bin/python bench/cancel_queue.py [--trials 20] [--out bench/results/cancel_queue.md]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio_client

import app
from advisor.store.runstore import OWNER_FILE, STAGING, RunStore
from webui import common

RUN = {"model": "tiny", "seq": 64, "micro_batch": 1, "device": "cpu"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_started(store: RunStore, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for d in (store.root / STAGING).glob("*"):
            try:
                if len(json.loads((d / OWNER_FILE).read_text())["owners"]) == 2:
                    return
            except (OSError, ValueError, KeyError):
                pass
        time.sleep(0.02)
    raise RuntimeError("run A's child never started")


def _trial(client, store: RunStore, how: str) -> dict:
    before = {r.run_id for r in store.list_runs()[0]}
    a = client.submit(**RUN, steps=100, api_name="/profile")
    _child_started(store)
    b = client.submit(**RUN, steps=1, api_name="/profile")
    time.sleep(0.2)  # B is in the queue behind A
    if how == "Cancel button":
        client.predict(api_name="/cancel_profile")
    else:
        a.cancel()
    b.result(timeout=300)
    deadline = time.monotonic() + 300
    while len(new := [r for r in store.list_runs()[0] if r.run_id not in before]) < 2:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(new)} of 2 runs filed")
        time.sleep(0.1)
    first, second = sorted(new, key=lambda r: r.record["child"]["started_unix_s"])
    gap = second.record["child"]["started_unix_s"] - first.record["child"]["ended_unix_s"]
    return {"how": how, "a": first.status, "b": second.status, "gap_s": gap}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--out", default=None, help="write the table here (markdown)")
    args = parser.parse_args()
    store = RunStore(tempfile.mkdtemp(prefix="cancel-queue-"))
    common.store = lambda: store
    demo = app.build_app()
    _, url, _ = demo.queue(default_concurrency_limit=16).launch(
        server_name="127.0.0.1", server_port=_free_port(), prevent_thread_lock=True, quiet=True
    )
    rows = []
    try:
        client = gradio_client.Client(url, verbose=False, download_files=False)
        for i in range(args.trials):
            row = _trial(client, store, "Cancel button" if i % 2 == 0 else "job.cancel()")
            rows.append(row)
            print(i, row, flush=True)
    finally:
        demo.close()
    good = [r for r in rows if r["a"] == "cancelled" and r["b"] == "ok" and r["gap_s"] >= 0]
    lines = [
        "# Cancel with a run queued behind it (bench/cancel_queue.py)",
        "",
        f"{len(good)} of {len(rows)} trials: A filed as cancelled, B ok, A's child reaped before B's started.",
        f"Smallest gap between A's child's end and B's child's start: {min(r['gap_s'] for r in rows):.3f} s.",
        "",
        "| trial | cancelled by | A | B | B's child start - A's child end (s) |",
        "|---|---|---|---|---|",
        *(f"| {i} | {r['how']} | {r['a']} | {r['b']} | {r['gap_s']:.3f} |" for i, r in enumerate(rows)),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
