"""Debian's Chromium as the browser tests and ``bench/ui_latency.py`` launch it: never a downloaded
browser, and none of its background connections, which this machine's closed network refuses."""

from __future__ import annotations

from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


def launch(playwright):
    """A headless Chromium browser from ``playwright`` (a started ``sync_playwright()``)."""
    return playwright.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS)
