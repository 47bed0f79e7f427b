"""The shape of the web app's code: a short entry point over webui/, and short handlers (the core
and advisor.present.views do the work; a handler calls them and returns)."""

from __future__ import annotations

import ast
import inspect
import os
import textwrap
from pathlib import Path

import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
app = pytest.importorskip("app")

ROOT = Path(__file__).resolve().parents[1]
MAX_HANDLER_LINES = 25


def _body_lines(fn) -> int:
    """Lines of a function's body, from its first statement after the docstring to its end (the
    signature, one parameter a line for the endpoints' named inputs, does not count)."""
    if fn.__name__ == "<lambda>":  # one expression, on the line it sits on
        return 1
    node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    body = node.body[1:] if ast.get_docstring(node) is not None else node.body
    return node.end_lineno - body[0].lineno + 1


def _handlers() -> dict[str, object]:
    """Every function an event of the app calls, unwrapped from webui.common.guarded."""
    found = {}
    for block_fn in app.build_app().fns.values():
        fn = inspect.unwrap(block_fn.fn)
        if fn is not None and fn.__module__ in ("app", *(f"webui.{p.stem}" for p in (ROOT / "webui").glob("*.py"))):
            found[f"{fn.__module__}.{fn.__qualname__}"] = fn
    return found


def test_app_py_is_a_short_entry_point():
    assert len((ROOT / "app.py").read_text(encoding="utf-8").splitlines()) < 300


def test_no_handler_runs_over_25_lines():
    handlers = _handlers()
    # Each tab's own: size, profile, open_run, analyze, advise, verify, plan, history, compare, calibrate...
    for name in ("size_view", "profile_view", "open_run", "analyze_job", "advice_view", "verify_view", "plan_view"):
        assert any(h.endswith(f".{name}") for h in handlers), name
    assert len(handlers) >= 20
    lengths = {name: _body_lines(fn) for name, fn in handlers.items()}
    assert {n: k for n, k in lengths.items() if k > MAX_HANDLER_LINES} == {}


def test_the_line_count_sees_a_long_handler():
    def long_handler():
        """Doc."""
        x = 0
        x += 1
        x += 2
        return x

    assert _body_lines(long_handler) == 4
