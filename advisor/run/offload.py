"""Activation offload: the saved activations of chosen transformer blocks go to host memory during
forward and come back for backward (``--offload-activations N``).

Built as a per-block pair of saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``) with its
own copy stream, not ``torch.autograd.graph.save_on_cpu``: save_on_cpu copies every tensor on the
compute stream as it is saved, so the GPU waits for each copy in forward and for each copy back in
backward, and it would also move the weights (and autocast's copies of them) that a linear saves. Here:

- **Forward.** A block's saved tensors are copied into pinned host buffers on a side stream that waits
  for the compute stream only up to the tensor's producer; the GPU tensor is released to the caching
  allocator with ``record_stream`` (reused once the copy has passed), so compute never waits.
  Parameters and what is derived from them by casts and views (autocast's 16-bit weight copies) stay
  where they are: they are not activations and live on between steps anyway. So do the RoPE tables
  the model keeps.
- **Backward.** When the gradient of block i's output is ready (just before block i's backward), the
  copies of block i-1 are brought back on the side stream: they overlap block i's backward. A block
  whose copies are not back when its backward reads them makes the compute stream wait; that wait,
  timed with CUDA events around it, is the copy time not hidden. So at most two offloaded blocks are
  on the GPU in backward (the one running and the one arriving), the estimator's double buffering.
- **Host buffers** are pooled by shape, dtype and layout and reused across micro-batches and steps
  (pinning is slow: cudaHostAlloc costs milliseconds); the pool's size is the host memory used.

On a CPU the same hooks copy each saved tensor into a separate host buffer and back (no pinned memory
there: pin_memory needs an accelerator), so the path is run and tested although it saves nothing.
In the dry run (fake tensors, target "cuda") the tensor leaves the device with nothing copied and an
empty tensor of its shape comes back in backward: the device memory the offload leaves, exactly.

Each copy is an NVTX range (``act_offload`` out, ``act_reload`` back) and a record_function range of
the same name, so Nsight Systems and torch.profiler show them.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor

from advisor.run.ranges import phase

_VIEW_OR_CAST = {
    "ToCopyBackward0",
    "TBackward0",
    "ViewBackward0",
    "ExpandBackward0",
    "PermuteBackward0",
    "TransposeBackward0",
    "UnsafeViewBackward0",
    "AliasBackward0",
}


def parameter_derived(t: torch.Tensor) -> bool:
    """Whether ``t`` is a parameter, or a cast or view of one (autocast's 16-bit weight copy, a
    transposed weight): a leaf that requires grad, reached through casts and views only."""
    if t.grad_fn is None:
        return t.requires_grad
    fn = t.grad_fn
    while fn is not None and type(fn).__name__ in _VIEW_OR_CAST:
        nexts = [f for f, _ in fn.next_functions if f is not None]
        if len(nexts) != 1:
            return False
        fn = nexts[0]
        if type(fn).__name__ == "AccumulateGrad":
            return True
    return False


@dataclass
class OffloadStats:
    """One step's activation offload, summed over its micro-batches."""

    blocks: int
    """Offloaded blocks (per stage)."""
    tensors: int
    """Saved tensors moved to the host."""
    bytes_offloaded: int
    bytes_restored: int
    copy_out_ms: float
    """Time the device-to-host copies took (on the copy stream; on a CPU, inline)."""
    copy_in_ms: float
    exposed_ms: float
    """Copy time not hidden behind compute: the compute stream's waits for copies to come back (on a
    CPU the hooks run inline, so all of their time, copies and bookkeeping)."""
    host_bytes: int
    """Host memory the offload holds: the pinned pool on a GPU, the peak of live copies on a CPU."""
    pinned: bool

    @property
    def out_gb_per_s(self) -> float:
        return self.bytes_offloaded / self.copy_out_ms / 1e6 if self.copy_out_ms > 0 else 0.0

    @property
    def in_gb_per_s(self) -> float:
        return self.bytes_restored / self.copy_in_ms / 1e6 if self.copy_in_ms > 0 else 0.0

    def as_dict(self) -> dict:
        return asdict(self) | {"out_gb_per_s": self.out_gb_per_s, "in_gb_per_s": self.in_gb_per_s}


class _Packed:
    """One saved tensor on the host (or, in the dry run, only its shape), until backward reads it."""

    __slots__ = ("__weakref__", "device", "dtype", "group", "host", "meta", "on_device", "owner", "wrap")

    def __init__(self, owner: ActivationOffloader, group: _Group) -> None:
        self.owner, self.group = owner, group
        self.host: torch.Tensor | None = None
        self.on_device: torch.Tensor | None = None
        self.meta = None  # (shape, stride, dtype, device) in the dry run
        self.wrap = None  # rebuilds a DTensor around the restored local tensor

    def __del__(self) -> None:
        if self.host is not None:
            self.owner._release(self.host)


class _Group:
    """The tensors one block saved in one forward (one micro-batch)."""

    __slots__ = ("arrived", "block", "fetched", "packed", "seen", "waited")

    def __init__(self, block: int) -> None:
        self.block = block
        self.seen: dict[tuple, tuple] = {}
        self.packed: list[weakref.ref[_Packed]] = []
        self.fetched = False
        self.arrived = None  # CUDA event: every copy back is done
        self.waited = False


class ActivationOffloader:
    """Moves the saved activations of ``blocks`` (indices within a stage) to the host and back."""

    def __init__(
        self,
        device: torch.device,
        blocks: set[int] | frozenset[int],
        *,
        resident: Callable[[], tuple] = tuple,
        keep_host_copy: bool = True,
    ) -> None:
        """``resident`` returns tensors to leave alone (the model's RoPE tables). ``keep_host_copy``
        False is the dry run on a device target: nothing is copied, the host is another memory."""
        self.device, self.blocks, self.resident = device, frozenset(blocks), resident
        self.cuda = device.type == "cuda"
        self.keep_host_copy = keep_host_copy
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._pool: dict[tuple, list[torch.Tensor]] = {}
        self._pool_bytes = 0
        self._live_host = self._peak_host = 0
        self._pending: dict[int, deque[_Group]] = {}
        self._current: _Group | None = None
        self._events: list[tuple[str, object, object]] = []  # (kind, start, end): read after the step's sync
        self.reset()

    # -- the step's view ----------------------------------------------------------------------

    def reset(self) -> None:
        """Start counting a new step."""
        self._n = self._out = self._in = 0
        self._out_ms = self._in_ms = self._exposed_ms = self._hook_ms = 0.0
        self._events = []
        self._pending.clear()  # groups a failed step left behind (their forward never met its backward)
        self._peak_host = self._live_host

    def stats(self) -> OffloadStats:
        """This step's figures; on a GPU call after a device sync (the CUDA events must have passed)."""
        out_ms, in_ms, exposed = self._out_ms, self._in_ms, self._exposed_ms
        for kind, a, b in self._events:
            ms = a.elapsed_time(b)
            if kind == "out":
                out_ms += ms
            elif kind == "in":
                in_ms += ms
            else:
                exposed += ms
        if not self.cuda:
            # A CPU runs the hooks inline: their whole time (copies and bookkeeping) adds to the step.
            exposed = self._hook_ms
        host = self._pool_bytes if self.cuda else self._peak_host
        return OffloadStats(
            blocks=len(self.blocks),
            tensors=self._n,
            bytes_offloaded=self._out,
            bytes_restored=self._in,
            copy_out_ms=out_ms,
            copy_in_ms=in_ms,
            exposed_ms=exposed,
            host_bytes=host,
            pinned=self.cuda,
        )

    # -- the model's view ---------------------------------------------------------------------

    def block(self, i: int) -> Callable:
        """Runs block ``i``'s forward (a thunk) under the hooks when it is offloaded, and arranges for
        the next offloaded block below it to come back when its own backward begins."""

        def run(forward: Callable[[], torch.Tensor]) -> torch.Tensor:
            if i in self.blocks:
                group = _Group(i)
                self._pending.setdefault(i, deque()).append(group)
                self._current = group
                try:
                    with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                        out = forward()
                finally:
                    self._current = None
            else:
                out = forward()
            if (i - 1 in self.blocks or i in self.blocks) and out.requires_grad:
                out.register_hook(self._prefetch_hook(i))
            return out

        return run

    def _prefetch_hook(self, i: int) -> Callable:
        def fetch(_: object) -> None:
            # Block i's backward starts now: its own copies (if not asked for yet) and block i-1's go.
            for b in (i, i - 1):
                if b in self.blocks:
                    self._fetch(b)

        def hook(grad: torch.Tensor) -> None:
            if self.cuda:
                fetch(grad)
            else:
                self._inline(fetch, grad)

        return hook

    # -- the hooks ----------------------------------------------------------------------------

    def _skip(self, t: torch.Tensor) -> bool:
        if parameter_derived(t):
            return True
        base = t._base if t._base is not None else t
        return any(base is r for r in self.resident())

    def _pack(self, t: torch.Tensor):
        return self._pack_tensor(t) if self.cuda else self._inline(self._pack_tensor, t)

    def _unpack(self, packed):
        return self._unpack_tensor(packed) if self.cuda else self._inline(self._unpack_tensor, packed)

    def _inline(self, hook: Callable, arg):
        """Run a hook as a CPU does, inline: its whole time adds to the step (``exposed_ms``)."""
        t0 = time.perf_counter()
        try:
            return hook(arg)
        finally:
            self._hook_ms += (time.perf_counter() - t0) * 1e3

    def _pack_tensor(self, t: torch.Tensor):
        if self._skip(t):
            return t
        group = self._current
        # One copy per tensor: ops save the same one several times (an RMSNorm's input, the input that
        # q, k and v read through views of their own). Keyed by its storage, alive while t is.
        storage = t.untyped_storage()
        key = (id(storage), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        hit = group.seen.get(key)
        if hit is not None and hit[0]() is storage and (packed := hit[1]()) is not None:
            return packed
        packed = _Packed(self, group)
        group.seen[key] = (weakref.ref(storage), weakref.ref(packed))
        local = t
        if type(t).__name__ == "DTensor":  # tensor parallelism: move the local shard, rewrap it later
            from torch.distributed.tensor import DTensor

            local = t.to_local()
            mesh, placements, shape, stride = t.device_mesh, t.placements, t.shape, t.stride()
            packed.wrap = lambda x: DTensor.from_local(x, mesh, placements, run_check=False, shape=shape, stride=stride)
        nbytes = local.numel() * local.element_size()
        if not self.keep_host_copy:
            packed.meta = (local.shape, local.stride(), local.dtype, local.device)
        elif self.cuda and not isinstance(local, FakeTensor):
            host = self._host_buffer(local)
            cur = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(cur)
            with torch.cuda.stream(self.stream), phase("act_offload"):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                host.copy_(local, non_blocking=True)
                b.record()
            self._events.append(("out", a, b))
            local.record_stream(self.stream)  # its memory is reused only once the copy has passed
            packed.host = host
        else:
            t0 = time.perf_counter()
            with phase("act_offload"):
                host = torch.empty_like(local, device="cpu")
                host.copy_(local)
            self._out_ms += (time.perf_counter() - t0) * 1e3
            packed.host = host
            self._live_host += nbytes
            self._peak_host = max(self._peak_host, self._live_host)
        self._n += 1
        self._out += nbytes
        group.packed.append(weakref.ref(packed))
        return packed

    def _unpack_tensor(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        group = packed.group
        if not group.fetched:
            self._fetch(group.block, group)
        if self.cuda and group.arrived is not None and not group.waited:
            cur = torch.cuda.current_stream(self.device)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(cur)
            cur.wait_event(group.arrived)
            b.record(cur)
            self._events.append(("exposed", a, b))
            group.waited = True
        out = packed.on_device
        if out is None:  # a tensor saved after its block's copies were fetched: not expected, still right
            self._restore(packed)
            out = packed.on_device
        if self.cuda and self.keep_host_copy:
            out.record_stream(torch.cuda.current_stream(self.device))
        return packed.wrap(out) if packed.wrap is not None else out

    # -- copies back --------------------------------------------------------------------------

    def _fetch(self, block: int, group: _Group | None = None) -> None:
        """Bring back the oldest group of ``block`` not fetched yet (or ``group``)."""
        queue = self._pending.get(block)
        if group is None:
            while queue and queue[0].fetched:
                queue.popleft()
            if not queue:
                return
            group = queue[0]
        if group.fetched:
            return
        group.fetched = True
        if queue and group in queue:
            queue.remove(group)
        alive = [p for r in group.packed if (p := r()) is not None]
        if self.cuda and self.keep_host_copy and alive and not isinstance(alive[0].host, FakeTensor):
            with torch.cuda.stream(self.stream), phase("act_reload"):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for p in alive:
                    self._restore(p)
                b.record()
                group.arrived = b
            self._events.append(("in", a, b))
        else:
            for p in alive:
                self._restore(p)

    def _restore(self, p: _Packed) -> None:
        if p.on_device is not None:
            return
        if p.meta is not None:  # dry run: an empty tensor of the shape appears on the device
            shape, stride, dtype, device = p.meta
            p.on_device = torch.empty_strided(shape, stride, dtype=dtype, device=device)
            self._in += p.on_device.numel() * p.on_device.element_size()
            return
        host = p.host
        nbytes = host.numel() * host.element_size()
        if self.cuda and not isinstance(host, FakeTensor):
            dev = torch.empty_like(host, device=self.device)
            dev.copy_(host, non_blocking=True)
        else:
            t0 = time.perf_counter()
            with phase("act_reload"):
                dev = torch.empty_like(host, device=self.device)
                dev.copy_(host)
            self._in_ms += (time.perf_counter() - t0) * 1e3
            self._live_host -= nbytes
            p.host = None  # a CPU copy is freed at once; a pinned buffer goes back to the pool in __del__
        p.on_device = dev
        self._in += nbytes

    # -- the pinned pool ----------------------------------------------------------------------

    def _host_buffer(self, t: torch.Tensor) -> torch.Tensor:
        # The tensor's own layout where it is dense (as empty_like keeps it on the CPU path); an expanded
        # or overlapping view is stored contiguous (copy_ into a stride-0 buffer would fail).
        stride = tuple(t.stride()) if _dense(t) else tuple(torch.empty(t.shape, device="meta").stride())
        key = (tuple(t.shape), stride, t.dtype)
        free = self._pool.get(key)
        if free:
            return free.pop()
        buf = torch.empty_strided(t.shape, stride, dtype=t.dtype, device="cpu", pin_memory=True)
        self._pool_bytes += buf.untyped_storage().nbytes()
        return buf

    def _release(self, host: torch.Tensor) -> None:
        if self.cuda and host.is_pinned():
            self._pool.setdefault((tuple(host.shape), tuple(host.stride()), host.dtype), []).append(host)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its memory without overlap or gaps (any order of dimensions)."""
    from torch._prims_common import is_non_overlapping_and_dense_or_false

    return bool(is_non_overlapping_and_dense_or_false(t))


def offloaded_blocks(n_blocks: int, recompute: str, recompute_layers: int, offload: int) -> frozenset[int]:
    """Which of a stage's blocks offload: the first ``offload`` that keep their activations (under
    partial recompute the first ``recompute_layers`` blocks recompute, so the offloaded ones follow).
    The earliest blocks are the ones backward needs last, so their copies have the longest to hide."""
    first = recompute_layers if recompute == "full" else 0
    return frozenset(range(first, min(n_blocks, first + offload)))
