"""Where the real test data lives: ``../shared/traces`` beside the repository (present in CI), with one
skip reason for every test that needs it."""

import os
from pathlib import Path

import pytest

SHARED_TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
"""Real PyTorch profiler traces (A100, V100; 1 to 128 ranks) and Nsight Systems exports, with the
reference numbers of other tools (their README says where each comes from)."""

needs_shared_traces = pytest.mark.skipif(
    not SHARED_TRACES.is_dir(), reason=f"real traces live in ../shared/traces ({SHARED_TRACES} is absent here)"
)


def pid_gone(pid: int) -> bool:
    """The process has ended and been waited for: its pid names no process any more."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False
