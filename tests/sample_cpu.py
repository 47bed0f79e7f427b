"""The CPU the shipped sample runs (``traces/``) were profiled on, for tests whose advice depends on it.

Advice on a stored CPU run uses this machine's CPU peaks (``presets.current_hardware``), and those
follow its flags: bf16 autocast is 3.5x fp32 with AVX512-BF16 and 1/30 of it on an AVX2-only CPU, so
"use bf16" is advice on one machine and a mistake on the other. Tests that walk the samples' advice
pin the EPYC they were recorded on (2 cores, AVX512-BF16), whatever CPU runs the tests: a stored CPU
run takes this machine's peaks only where the names match ("CPU host (2 cores)").
"""

from __future__ import annotations

SAMPLE_CPU_FLAGS = frozenset({"avx2", "avx512f", "avx512_bf16"})
SAMPLE_CPU_CORES = 2


def pin_sample_cpu(monkeypatch, cores: bool = True) -> None:
    """Make ``presets.cpu_host`` see the samples' CPU for the rest of the test: its flags, and its core
    count unless ``cores`` is False (tests of this machine's own runs keep its name)."""
    from advisor.spec import presets

    monkeypatch.setattr(presets, "cpu_flags", lambda: set(SAMPLE_CPU_FLAGS))
    if cores:
        monkeypatch.setattr(presets, "cpu_cores", lambda: SAMPLE_CPU_CORES)
