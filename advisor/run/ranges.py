"""Named ranges of the step that both Nsight Systems (NVTX) and torch.profiler (record_function) see."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.profiler import record_function

try:  # the nvtx package works without a GPU; torch.cuda.nvtx needs a CUDA build (DESIGN.md)
    import nvtx

    _push, _pop = nvtx.push_range, nvtx.pop_range
except ImportError:  # e.g. a GPU image without the package: torch's binding sees the same NVTX
    if torch.cuda.is_available():
        _push, _pop = torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop
    else:
        _push = _pop = lambda *a: None


@contextmanager
def phase(name: str) -> Iterator[None]:
    """A range both Nsight Systems (NVTX) and torch.profiler (record_function) see."""
    _push(name)
    try:
        with record_function(name):
            yield
    finally:
        _pop()
