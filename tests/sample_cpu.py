"""The CPU the shipped sample runs (``traces/``) were profiled on, for tests whose advice depends on it.

Advice on a stored CPU run uses this machine's CPU peaks (``presets.current_hardware``), and those
follow its flags: bf16 autocast is 3.5x fp32 with AVX512-BF16 and 1/30 of it on an AVX2-only CPU, so
"use bf16" is advice on one machine and a mistake on the other. Tests that walk the samples' advice
pin the flags of the EPYC they were recorded on (AVX512-BF16), whatever CPU runs the tests.
"""

from __future__ import annotations

SAMPLE_CPU_FLAGS = frozenset({"avx2", "avx512f", "avx512_bf16"})


def pin_sample_cpu(monkeypatch) -> None:
    """Make ``presets.cpu_host`` see the samples' CPU for the rest of the test."""
    from advisor import presets

    monkeypatch.setattr(presets, "cpu_flags", lambda: set(SAMPLE_CPU_FLAGS))
