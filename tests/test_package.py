"""`pip install .` into a fresh virtual environment gives working `advisor` and `advisor-app` commands.

The fresh venv borrows the test environment's installed dependencies (torch, gradio, ...) through a
``.pth`` line instead of downloading them again, then installs this checkout the way a user would
(non-editable, no build isolation: setuptools comes from requirements-dev.txt). The commands run from
an empty folder, so nothing is found through the checkout: the rules come from the installed data files
and the run store is ``./traces`` there.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    site = Path(
        subprocess.check_output(
            [str(where / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            text=True,
        ).strip()
    )
    (site / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [str(where / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(ROOT)],
        capture_output=True,
        text=True,
        env=env,
        cwd=where.parent,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return where


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ADVISOR_TRACES_DIR")}
    env["GRADIO_ANALYTICS_ENABLED"] = "False"
    return env


def test_installed_package_is_not_the_checkout(venv, tmp_path):
    code = (
        "import advisor, app, advisor.advice.rules as r, advisor.store.runstore as s;"
        "print(advisor.__file__); print(app.__file__); print(r.RULES_DIR); print(s.default_root())"
    )
    out = subprocess.check_output([str(venv / "bin" / "python"), "-c", code], text=True, cwd=tmp_path, env=_env())
    pkg, app_file, rules, store = out.split()
    assert Path(store) == tmp_path.resolve() / "traces" or Path(store) == tmp_path / "traces", store
    assert str(ROOT) not in pkg and str(ROOT) not in app_file, out
    assert Path(rules) == venv / "share" / "advisor" / "rules"
    assert sorted(p.name for p in Path(rules).glob("*.yaml")) == sorted(p.name for p in (ROOT / "rules").glob("*.yaml"))


def test_advisor_command_sizes_and_lists_rules(venv, tmp_path):
    size = subprocess.run(
        [str(venv / "bin" / "advisor"), "size", "--model", "llama-3.1-8b", "--gpu", "h100", "--json"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=_env(),
    )
    assert size.returncode == 0, size.stderr
    doc = json.loads(size.stdout)
    assert doc["setup"]["model"]["name"] == "llama-3.1-8b" and doc["setup"]["model"]["n_layers"] == 32
    rules = subprocess.run(
        [str(venv / "bin" / "advisor"), "rules"], capture_output=True, text=True, cwd=tmp_path, env=_env()
    )
    assert rules.returncode == 0, rules.stderr
    ids = [
        line.split(":", 1)[1].strip()
        for p in (ROOT / "rules").glob("*.yaml")
        for line in p.read_text().splitlines()
        if line.startswith("- id:")
    ]
    listed = {line.split()[0] for line in rules.stdout.splitlines() if line.strip()}
    assert len(ids) > 40 and set(ids) <= listed, sorted(set(ids) - listed)
    # The installed data files ship with the package: the estimator's fitted constants and published runs.
    assert list(venv.glob("lib/python*/site-packages/advisor/estimate/published_runs.json"))
    # ... and the C sources compiled on first use: the nsys page reader and the Unified Memory allocator.
    for source in ("trace/csrc/sqlite_pages.c", "run/csrc/um_alloc.c"):
        assert list(venv.glob(f"lib/python*/site-packages/advisor/{source}")), source


def test_advisor_app_command_serves(venv, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [str(venv / "bin" / "advisor-app"), "--port", str(port)],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as r:
                    assert r.status == 200
                    break
            except OSError:
                time.sleep(1)
        else:
            pytest.fail(
                f"advisor-app did not serve (exit {proc.poll()}): {proc.stdout.read() if proc.poll() is not None else ''}"
            )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
