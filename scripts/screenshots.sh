#!/usr/bin/env bash
# Remakes the README's screenshots (tests/screenshots/<tab>.jpg): the real-browser tests save each
# tab's finished state when ADVISOR_SCREENSHOTS is set. Needs Debian's chromium and `make setup-dev`,
# and no emoji font (the verdict is a coloured word, not an icon).
set -euo pipefail
cd "$(dirname "$0")/.."
export GRADIO_ANALYTICS_ENABLED=False
ADVISOR_SCREENSHOTS=tests/screenshots .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_browser.py
ls -l tests/screenshots
