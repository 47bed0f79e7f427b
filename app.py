"""The web app (Gradio): the tabs of ``webui/`` put together, and the server started.

Run ``python app.py`` or ``advisor-app`` (binds 127.0.0.1:7860; set ADVISOR_HOST / ADVISOR_PORT to
change, ADVISOR_AUTH to ask for a login).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import os
import tempfile
import time
from collections import deque
from collections.abc import Awaitable, Callable

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
# Gradio's upload cache, one folder per app process (UPLOADS), set before gradio is imported (some of its
# modules read it then): removed at exit, and by the next start after a kill.
os.environ.setdefault("GRADIO_TEMP_DIR", os.path.join(tempfile.gettempdir(), f"advisor-uploads-{os.getpid()}"))

import gradio as gr

from advisor.run import analysis_child as isolated
from webui import common
from webui.advice import advice_view, apply_choices, build_advice_tab
from webui.analyze import MAX_UPLOAD, build_analyze_tab
from webui.history import build_history_tab, history_filters, history_view
from webui.linking import URL_KEYS, link_tabs, url_setup, wire_apply, wire_model_limits, wire_url, wire_use_layout
from webui.plan import build_plan_tab
from webui.profile import build_profile_tab
from webui.report import wire_report
from webui.size import SIZE_KEYS, build_size_tab
from webui.style import CSS, PAGE_JS, glossary

log = logging.getLogger("advisor.app")
UPLOADS = common.process_folder("uploads")
_QUIET = {"api_visibility": "undocumented"}
CACHE_AGE_S = 3600
"""Uploads and made files older than this are removed from Gradio's cache (checked as often)."""


def _on_load(demo: gr.Blocks, tabs: dict, size_outputs: list, pickers: list, link_note: gr.Markdown) -> None:
    """What a page load fills: the setup the page address carries (Size and Plan tabs), then the Size
    tab's estimate and a first advice on it (opened on a first recommendation), the run pickers
    (History's A on the second newest), the History tab's list."""
    size, plan, advice, history = (tabs[k] for k in ("size", "plan", "advice", "history"))
    demo.load(None, None, None, js=PAGE_JS, **_QUIET)
    from_url = [link_note, *(size[k] for k in URL_KEYS), *plan.values(), *size_outputs]
    demo.load(url_setup(size, plan), None, from_url, **_QUIET).then(
        advice_view, advice["advise_inputs"], advice["outputs"], **_QUIET
    ).then(apply_choices, advice["state"], advice["apply_choice"], **_QUIET)
    for picker in pickers:
        demo.load(common.run_choices, None, picker, **_QUIET)
    demo.load(lambda: common.run_choices(1), None, history["run_a"], **_QUIET)
    demo.load(history_filters, None, history["filters"][:3], **_QUIET)
    demo.load(history_view, history["filters"], history["outputs"], **_QUIET)


def build_app() -> gr.Blocks:
    """The whole app: six tabs over one current setup."""
    # Gradio removes the uploads and files it made older than CACHE_AGE_S every CACHE_AGE_S, and all of
    # them when the server shuts down (gradio.route_utils.delete_files_created_by_app).
    with gr.Blocks(title="LLM training advisor", delete_cache=(CACHE_AGE_S, CACHE_AGE_S)) as demo:
        gr.Markdown(
            "# LLM training advisor\nSize a training setup instantly (memory per GPU, step time, MFU), then "
            "profile a real step on this machine. The page address carries the Size tab's setup: copy it "
            "to share or reopen that setup."
        )
        glossary()
        link_note = gr.Markdown(elem_id="link-note")
        with gr.Tab("Size"):
            size, size_outputs = build_size_tab()
        with gr.Tab("Profile"):
            profile, runs = build_profile_tab()
        with gr.Tab("Analyze") as analyze_tab:
            analyze_runs = build_analyze_tab()
        with gr.Tab("Advice") as advice_tab:
            advice = build_advice_tab([size[k] for k in SIZE_KEYS])
        with gr.Tab("Plan"):
            plan, plan_use = build_plan_tab()
        with gr.Tab("History") as history_tab:
            history = build_history_tab()
        link_tabs(size, profile, plan)
        wire_model_limits(size, profile, plan)
        wire_apply(advice, size, profile, plan)
        wire_use_layout(plan_use, size)
        wire_url(size)
        wire_report(advice, [size[k] for k in SIZE_KEYS])
        pickers = [runs, analyze_runs, advice["runs"], history["run_b"]]
        tabs = {"size": size, "plan": plan, "advice": advice, "history": history}
        _on_load(demo, tabs, size_outputs, pickers, link_note)
        # Opened, a tab lists the runs made since the page loaded (the History tab its table too).
        for tab, tab_pickers in ((analyze_tab, [analyze_runs]), (advice_tab, [advice["runs"]]),
                                 (history_tab, [history["run_a"], history["run_b"]])):  # fmt: skip
            for picker in tab_pickers:
                tab.select(common.refresh_runs, picker, picker, **_QUIET)
        history_tab.select(history_view, history["filters"], history["outputs"], **_QUIET)
    common.validate_in_handlers(demo)
    return demo


def auth_from_env(value: str | None) -> list[tuple[str, str]] | None:
    """``ADVISOR_AUTH="user:password[,user2:password2]"`` as Gradio's auth list; None when unset.
    Raises ValueError naming the malformed entry (never echoing a password)."""
    if not value:
        return None
    pairs = []
    for i, entry in enumerate(value.split(","), 1):
        user, sep, password = entry.strip().partition(":")
        if not sep or not user or not password:
            raise ValueError(f"ADVISOR_AUTH entry {i} is not user:password (both non-empty, comma-separated entries)")
        pairs.append((user, password))
    return pairs


LOGIN_MAX_FAILURES = 5
"""Wrong passwords one user name may have in LOGIN_WINDOW_S; past it, that name is refused (even the
right password) until its oldest failure leaves the window."""
LOGIN_MAX_FAILURES_ALL = 30
"""Wrong passwords all user names together may have in LOGIN_WINDOW_S (a guesser cycling names);
past it, every login is refused for the rest of the window (logged)."""
LOGIN_WINDOW_S = 60.0
LOGIN_FAIL_DELAY_S = 1.0
"""Each refused login is answered after this delay (awaited: the server serves others meanwhile)."""


def rate_limited_auth(
    pairs: list[tuple[str, str]],
    *,
    clock: Callable[[], float] = time.monotonic,
    fail_delay_s: float = LOGIN_FAIL_DELAY_S,
) -> Callable[[str, str], Awaitable[bool]]:
    """Gradio's auth as an async callable over ``pairs`` with the limits above: a password guesser gets
    LOGIN_MAX_FAILURES tries a name and LOGIN_MAX_FAILURES_ALL in all per LOGIN_WINDOW_S, each a second
    late (without it, issue 22 measured 50 wrong passwords in 0.19 s). Passwords compare in constant
    time. Memory stays bounded: only names with a failure in the window are kept."""
    users = dict(pairs)
    failures: dict[str, deque[float]] = {}
    everyone: deque[float] = deque()

    def recent(times: deque[float], now: float) -> int:
        while times and now - times[0] >= LOGIN_WINDOW_S:
            times.popleft()
        return len(times)

    async def check(username: str, password: str) -> bool:
        now = clock()
        for name in [n for n, t in failures.items() if not recent(t, now)]:
            del failures[name]
        mine = failures.get(username, deque())
        limited = recent(mine, now) >= LOGIN_MAX_FAILURES or recent(everyone, now) >= LOGIN_MAX_FAILURES_ALL
        expected = users.get(username, "")
        ok = hmac.compare_digest(password.encode(), expected.encode()) and username in users
        if ok and not limited:
            return True
        if not limited:
            failures[username] = mine
            mine.append(now)
            everyone.append(now)
        else:
            log.warning("login for %r refused: too many wrong passwords in the last %g s", username, LOGIN_WINDOW_S)
        await asyncio.sleep(fail_delay_s)
        return False

    return check


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``python app.py [--host H] [--port P] [--traces DIR]``; the flags override ADVISOR_HOST,
    ADVISOR_PORT and ADVISOR_TRACES_DIR, which override the defaults."""
    parser = argparse.ArgumentParser(
        prog="python app.py",
        description="The LLM training advisor's web app: Size, Profile, Analyze, Advice, Plan and History tabs.",
        epilog="ADVISOR_AUTH='user:password[,user2:password2]' asks for a login (needed to serve beyond localhost).",
    )
    parser.add_argument(
        "--host", default=os.environ.get("ADVISOR_HOST", "127.0.0.1"), help="address to bind (default: %(default)s)"
    )
    parser.add_argument("--port", type=int, default=None, help="port (default: ADVISOR_PORT or 7860)")
    parser.add_argument("--traces", default=None, help="the run store (default: ADVISOR_TRACES_DIR or traces/)")
    args = parser.parse_args(argv)
    if args.port is None:
        try:
            args.port = int(os.environ.get("ADVISOR_PORT", "7860"))
        except ValueError:
            parser.error(f"ADVISOR_PORT={os.environ['ADVISOR_PORT']!r}: must be a port number (1 to 65535)")
    if not 1 <= args.port <= 65535:
        parser.error(f"--port {args.port}: must be from 1 to 65535")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    if args.traces:
        os.environ["ADVISOR_TRACES_DIR"] = args.traces
    host, port = args.host, args.port
    try:
        auth = auth_from_env(os.environ.get("ADVISOR_AUTH"))
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    common.remove_dead_folders()  # uploads and reports of app processes killed before their exit handlers
    if os.environ["GRADIO_TEMP_DIR"] == UPLOADS:
        common.remove_at_exit(UPLOADS)
    if host not in ("127.0.0.1", "localhost") and auth is None:
        log.warning("serving on %s without a login: set ADVISOR_AUTH=user:password to require one", host)
    isolated.SPARE.start()  # the first Analyze finds its child's imports done
    build_app().queue(default_concurrency_limit=16).launch(
        server_name=host,
        server_port=port,
        max_file_size=MAX_UPLOAD,
        allowed_paths=[str(common.store().root)],
        auth=rate_limited_auth(auth) if auth else None,
        css=CSS,
    )


if __name__ == "__main__":
    main()
