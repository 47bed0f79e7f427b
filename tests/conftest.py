"""Suite-wide options and markers. ``--as-cpu`` runs the suite with the advice seeing another CPU's flags.

Markers (pyproject.toml): ``browser`` (tests/test_browser.py), ``gpu`` (every test skipped for want of
CUDA), ``slow`` (the modules in ``SLOW_MODULES`` and tests marked so: child processes, torchrun,
seconds of real steps), ``reliability`` (tests/test_hostile_traces.py: hostile traces and load;
``make test-reliability``). ``make test-fast`` runs the rest: ``pytest -m "not slow and not browser and
not gpu"``.

CI runs on whichever machine it is given: an AVX2-only EPYC (bf16 at 1/30 of fp32), an AVX512-BF16
EPYC (3.5x) or an AMX Xeon (16x). What changes between them is the peaks ``presets.cpu_host`` takes
from ``/proc/cpuinfo``, so the rules and gains that read them. ``pytest --as-cpu amx`` makes every test
see an AMX Xeon's flags (tests that pin a CPU themselves still do), so a test that holds on one CPU
only shows up on any machine. The measured speeds stay this machine's.
"""

from __future__ import annotations

import pytest

AS_CPU_FLAGS = {
    "avx2": frozenset({"avx2", "fma"}),
    "avx512-bf16": frozenset({"avx2", "fma", "avx512f", "avx512_bf16"}),
    "amx": frozenset({"avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16"}),
}


def pytest_addoption(parser):
    parser.addoption(
        "--as-cpu",
        choices=sorted(AS_CPU_FLAGS),
        default=None,
        help="make the advice see this CPU's flags instead of this machine's",
    )


@pytest.fixture(autouse=True)
def _as_cpu(request, monkeypatch):
    name = request.config.getoption("--as-cpu")
    if name is not None:
        from advisor.spec import presets

        monkeypatch.setattr(presets, "cpu_flags", lambda: set(AS_CPU_FLAGS[name]))
    yield


SLOW_MODULES = {
    "test_browser.py",
    "test_parallel.py",
    "test_distributed_run.py",
    "test_gpu_check.py",
    "test_api.py",
}
"""Modules whose every test starts processes (torchrun, the app's server, the GPU check script)."""


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.path.name
        if module == "test_browser.py":
            item.add_marker(pytest.mark.browser)
        if module in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
        reasons = " ".join(str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))
        if "CUDA" in reasons or "GPU" in reasons:
            item.add_marker(pytest.mark.gpu)
