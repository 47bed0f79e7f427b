"""Size tab latency in a real browser: from a widget change to the updated verdict on screen.

Starts the app on a free local port, opens it in Debian's Chromium through Playwright (never a
downloaded browser), then alternates the sequence length between two values and times, in the page,
from the input's change event to the moment the verdict text changes. Prints the median and spread.

    .venv/bin/python bench/ui_latency.py [--n 30]

Target (issue 6): median under 300 ms on this machine.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from tests.chromium import CHROMIUM, launch

# Runs in the page: set the sequence-length input, fire its change, resolve when the verdict names the
# new sequence length ("seq 4096 x"), so only the answer to this change counts (a MutationObserver,
# so no polling interval adds to the figure).
MEASURE_JS = """
async ([value]) => {
  const verdict = document.querySelector('#size-verdict');
  const wanted = `seq ${value} x`;
  const input = [...document.querySelectorAll('input[type=number]')]
      .find(el => el.closest('label, .block')?.innerText.includes('Sequence length'));
  const t0 = performance.now();
  const done = new Promise(resolve => {
    const obs = new MutationObserver(() => {
      if (verdict.innerText.includes(wanted)) { obs.disconnect(); resolve(performance.now() - t0); }
    });
    obs.observe(verdict, {subtree: true, childList: true, characterData: true});
  });
  const setter = Object.getOwnPropertyDescriptor(HTMLInputElement.prototype, 'value').set;
  setter.call(input, String(value));
  input.dispatchEvent(new Event('input', {bubbles: true}));
  input.dispatchEvent(new Event('change', {bubbles: true}));
  input.dispatchEvent(new KeyboardEvent('keydown', {key: 'Enter', bubbles: true}));
  input.blur();
  return await done;
}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=30, help="changes to time (default: %(default)s)")
    args = ap.parse_args()
    if not CHROMIUM.exists():
        print(f"needs Debian's chromium at {CHROMIUM} (apt install chromium)", file=sys.stderr)
        return 2
    from playwright.sync_api import sync_playwright

    import app

    port = _free_port()
    demo = app.build_app().queue(default_concurrency_limit=16)
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    times: list[float] = []
    try:
        with sync_playwright() as p:
            browser = launch(p)
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{port}", wait_until="load")
            page.wait_for_function("document.querySelector('#size-verdict')?.innerText.includes('FITS')")
            for i in range(args.n + 3):
                ms = page.evaluate(MEASURE_JS, [4096 if i % 2 == 0 else 8192])
                if i >= 3:  # the first changes warm the server's and the page's caches
                    times.append(ms)
            browser.close()
    finally:
        demo.close()
    times.sort()
    median = statistics.median(times)
    print(f"Size tab, sequence length changed {len(times)} times: widget change -> verdict updated")
    print(f"  median {median:.0f} ms, p10 {times[len(times) // 10]:.0f} ms, p90 {times[9 * len(times) // 10]:.0f} ms")
    print(f"  target: median under 300 ms: {'met' if median < 300 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
