"""The dry run: the exact memory of the project's own training step for any model size, without allocating.

The Trainer of ``advisor.run.step`` (same model, autocast, checkpointing and optimizer) is built and run under
``FakeTensorMode``: every tensor carries its shape, dtype and device but no storage. On our 2 CPU
cores Llama-3.1-8B (seq 1024) took 3 s and 30 MiB of host memory, Llama-3.1-70B 7 s and 51 MiB.
``MemTracker`` (torch.distributed._tools) follows each storage as it is created and freed and files
it under a category (parameter, gradient, optimizer state, activation, temporary, other); its running
sum is the tensor memory of the step. One warm-up
step creates the optimizer state; the second, steady-state step is the one tracked, as in
``memprobe.measure_step_peak_bytes``. On our CPUs this matched the measured peak within 0.02 %
(DESIGN.md, "Facts measured on our CPU machines").

What the dry run cannot see, and what it does instead:

- Fake CUDA tensors abort the process on backward in a CPU-only build (SIGABRT, DESIGN.md), so the
  step always runs on fake CPU tensors. ``target="cuda"`` then adds the memory CUDA keeps outside
  the tensors: the runtime allowance of the hardware spec (context, cuBLAS and NCCL workspaces) and
  the caching allocator's fragmentation, with the estimator's constant.
- RMSNorm runs a different kernel on each device. CUDA's ``_fused_rms_norm`` saves its input, the fp32
  ``rstd`` per row and the weight; on a CPU the same op falls back to the composite of
  ``rms_norm_composite`` (aten layer_norm.cpp), which upcasts a 16-bit input and saves the fp32 copy and
  the fp32 product with ``rstd`` too: 6 more bytes a hidden unit per norm. On Llama-3.1-8B over 8
  FSDP2 ranks (bf16 activations, seq 8192) that was 12.2 GiB of the 59.3 GiB of activations. On the
  CUDA target every RMSNorm therefore runs as CUDA's fused op does (``_FusedRMSNorm``): same outputs,
  CUDA's saved tensors.
- MoE routing depends on the data. The dry run assumes balanced routing: each expert receives
  ``tokens * top_k / n_experts`` rows. Every token visits exactly top_k experts, so the rows summed
  over experts, and hence the saved expert activations, are exact; only per-expert temporaries
  depend on the balance.
- The fp16 GradScaler reads its found-inf flag with ``.item()``; the dry run reads it as "no overflow"
  and takes the optimizer step.
- Where a tensor gets two gradients (a tied embedding, a residual branch) the autograd engine sums
  them in place when it can, but never while a dispatch mode is active (``isTensorSubclassLike`` is
  true for every tensor then), so the dry run holds one more copy during the sum. It showed once in
  our benchmark: a tied GPT-2-style embedding under bf16 autocast read 5.4 % high, and the real step
  run under a do-nothing TorchDispatchMode peaked at exactly the dry run's bytes
  (bench/results/dryrun_accuracy_cpu.md).
- With optimizer offload the master weights, their gradients and the optimizer states live in host
  memory. On the CPU target host and device are one memory, so they count in the peak; on the CUDA
  target they are reported as ``host_bytes`` and left out of the device peak.

Over several data-parallel ranks (``dry_run_distributed``) the same Trainer runs the model wrapped as
the real torchrun run wraps it (``advisor.run.parallel.apply_fsdp``: FSDP2 per block and root), over a
1-D DeviceMesh of a fake process group (torch's "fake" backend: collectives return at once and move
nothing), so one process gives rank 0's bytes for any world size: the tiny model over 1024 ranks in
about 1 s, Llama-3.1-8B (seq 4096) over 8 to 1024 ranks in 5 to 15 s on our CPUs. ``FSDPMemTracker``
sorts the memory into sharded and unsharded parameters and gradients, all-gather and reduce-scatter
buffers, optimizer states, activations and temporaries. Against the real step on 2 gloo ranks
(``advisor.run.parallel``, measured as ``memprobe`` measures, tests/dryrun_worker.py) the per-rank peak
of the tiny model matched within 8 bytes for ZeRO-3 bf16, ZeRO-2 fp32 and ZeRO-0 fp32, and within
0.03 % under full and selective recompute; in 4 of 17 launches the real peak moved by one buffer the
size of the embedding, as gloo's collective threads ran early or late. Only data parallelism runs there: tp, pp, cp, ep > 1 and
offload are refused. ZeRO-0 cannot use the real run's DDP (its C++ reducer fails on fake tensors) and
runs torch's FSDP2-based ``replicate`` instead, whose second copy of the parameters during forward and
backward is the size of DDP's gradient buckets.
"""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch._decomp.decompositions import _fused_rms_norm_backward
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from advisor.errors import AdvisorError, SpecError
from advisor.estimate.estimator import EAGER_FRAGMENTATION_FRAC
from advisor.run.model import Transformer, build_model
from advisor.run.parallel import apply_fsdp
from advisor.run.step import (
    HostOffloadOptimizer,
    Trainer,
    attach_offloader,
    build_optimizer,
    build_trainer,
    check_step_options,
    unwrap,
)
from advisor.spec.specs import Setup

MAX_ACCUM = 64
"""Micro-batches per step a dry run takes: each runs under fake tensors (tens of ms for the tiny model,
seconds for a large one), and from two on the peak grows only by each micro-batch's 4-byte loss (tiny,
seq 64: 105,165,484 bytes at 2, 105,165,508 at 8, 105,165,732 at 64); 1,000 kept the CLI busy for
minutes and 2^26 for ever."""
TARGETS = ("cpu", "cuda")
PHASES = ("forward", "backward", "optimizer")
GiB = 2**30

# MemTracker's reference categories (the values of torch.distributed._tools.mem_tracker._MemRefType)
# under the names this project uses.
_CATEGORIES = {
    "Parameter": "params",
    "Buffer": "buffers",
    "Gradient": "grads",
    "Optstate": "optimizer",
    "Activation": "activations",
    "Temp": "temporaries",
    "Other": "other",
}
# FSDPMemTracker's (the values of torch.distributed._tools.fsdp2_mem_tracker._FSDPRefType). What a rank
# keeps between steps is its shard: "params" and "grads" are sharded; the unsharded copies, the
# collectives' flat buffers and the RoPE tables (tracked as the blocks' inputs) are listed apart.
_FSDP_CATEGORIES = {
    "Sharded Param": "params",
    "Unsharded Param": "unsharded_params",
    "Buffer": "buffers",
    "Sharded Grad": "grads",
    "Unsharded Grad": "unsharded_grads",
    "All Gather": "all_gather",
    "Reduce Scatter": "reduce_scatter",
    "OptState": "optimizer",
    "Activation": "activations",
    "Temp": "temporaries",
    "Inputs": "other",
}
DISTRIBUTED_DEGREES = "dp (any world size, zero 0 to 3)"
"""What the distributed dry run spreads over ranks; tp, pp, cp and ep must be 1."""
DISTRIBUTED_MIN_TORCH = (2, 13)
"""The oldest torch whose FSDPMemTracker the distributed dry run is right with. Before 2.13 it counts
the fake ops of DTensor's sharding propagation as memory and files no gathered parameters: on torch
2.11 the tiny model over 8 ranks (ZeRO-3, bf16) read 0.084 GiB at the optimizer step against the
0.037 GiB, in backward, that 2.13 reads and the real gloo step measures."""


@dataclass(frozen=True, slots=True)
class DryRunResult:
    """Memory of one steady-state training step on one device (one rank), from fake tensors, in bytes.

    ``peak_bytes`` is what the profiler's running sum (CPU, ``memprobe``) reports for the step, and what
    ``torch.cuda.max_memory_allocated()`` should report on a GPU (not yet checked on one). ``at_peak_bytes`` splits it by category at the moment of
    the peak and sums to it. The state sizes (params, grads, optimizer) are what this rank holds (the
    full sizes on one device, the shards under ZeRO), wherever the peak falls.
    """

    model: str
    target: str
    """'cpu' or 'cuda' (the latter: fake CPU tensors plus CUDA's own terms, see ``overhead_bytes``)."""
    precision: str
    recompute: str
    micro_batch: int
    seq_len: int
    grad_accum: int
    n_params: int
    peak_bytes: int
    """Tensor memory at the peak of the step (device only)."""
    peak_phase: str
    """Where the peak falls: forward, backward or optimizer."""
    params_bytes: int
    """Model parameters (fp32 under autocast: the step keeps fp32 parameters); this rank's shard, padded,
    under ZeRO-3 and FSDP2's ZeRO-1/2."""
    grads_bytes: int
    """All gradients on the device when the optimizer step begins (offload: before their copy to the
    host; ZeRO-1/2/3: this rank's shard)."""
    optimizer_bytes: int
    """Optimizer states (AdamW: exp_avg, exp_avg_sq and a 4-byte step per parameter tensor)."""
    activations_bytes: int
    """Saved for backward when one micro-batch's backward begins, including autocast's 16-bit weight
    copies (kept by the linears that use them) and the loss's fp32 log-softmax."""
    temporaries_bytes: int
    """Short-lived tensors at the peak: backward intermediates and the optimizer step's scratch."""
    at_peak_bytes: dict[str, int]
    """Category -> bytes at the peak (params, buffers, grads, optimizer, activations, temporaries,
    other; over several ranks also unsharded_params, unsharded_grads, all_gather, reduce_scatter);
    sums to peak_bytes. 'other' holds the cached RoPE tables and, under offload on the CPU target,
    the master weights and their gradients."""
    peak_by_phase_bytes: dict[str, int]
    """Highest tensor memory within each phase (forward, backward, optimizer)."""
    host_bytes: int
    """Offloaded optimizer state in host memory: fp32 master weights, their gradients, the states."""
    overhead_bytes: int
    """target='cuda': runtime allowance plus allocator fragmentation; 0 on the CPU."""
    wall_ms: float
    """Time the dry run itself took (over several ranks: including its child process's start)."""
    notes: tuple[str, ...] = field(default=())
    """Assumptions that apply to this run."""
    world_size: int = 1
    """Ranks the step is spread over (data parallel); every byte above is per rank."""
    zero: int = 0
    """ZeRO stage of the data parallelism; 0 for the one-device step."""

    @property
    def total_bytes(self) -> int:
        """Device memory to plan for: the tensor peak plus the CUDA allowance."""
        return self.peak_bytes + self.overhead_bytes

    def as_dict(self) -> dict:
        """JSON-ready values (the CLI's --json)."""
        d = asdict(self)
        d["notes"] = list(self.notes)
        d["total_bytes"] = self.total_bytes
        return d


class _PhasePeaks:
    """Mixin for a MemTracker that keeps the snapshot at the highest memory of each phase (forward,
    backward, optimizer) instead of per-module peaks.

    Upstream ``_update_peak_stats`` walks every tracked module after every op: the dry run of
    Llama-3.1-8B took 15 s with it and 3 s without on our CPUs. The per-module tables are not used here.
    """

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.phase_peaks: dict[str, dict] = {}

    def _update_peak_stats(self, peak_state) -> None:
        phase = "optimizer" if self._in_opt else "backward" if self._mod_tracker.is_bw else "forward"
        for snap in self._curr_mem_snap.values():  # one device: the step runs on (fake) CPU tensors
            best = self.phase_peaks.get(phase)
            if best is None or snap["Total"] > best["Total"]:
                self.phase_peaks[phase] = dict(snap)


class _PhasePeakTracker(_PhasePeaks, MemTracker):
    """MemTracker (one device) keeping per-phase peaks."""


class _FSDPPhasePeakTracker(_PhasePeaks, FSDPMemTracker):
    """FSDPMemTracker (one rank of an FSDP2 or replicate() model) keeping per-phase peaks."""


class _DataDependentStandIns(TorchDispatchMode):
    """Stand-ins for the two data-dependent results the step needs, which fake tensors cannot know.

    - ``nonzero`` of an MoE routing mask ``chosen == e`` (tokens x top_k elements): expert e gets
      ``numel // n_experts`` rows, the remainder going to the first experts in call order, so the
      shares add up to exactly tokens x top_k (balanced routing).
    - ``.item()`` of a fake tensor without a known value: 0. The only one in the step is the fp16
      GradScaler's found-inf flag, so the optimizer step is taken, as in a step without overflow.
    """

    def __init__(self, n_experts: int) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.nonzero.default and self.n_experts:
            mask = args[0]
            n = mask.numel()
            rows = n // self.n_experts + (1 if self.calls % self.n_experts < n % self.n_experts else 0)
            self.calls += 1
            return torch.empty((rows, mask.dim()), dtype=torch.int64, device=mask.device)
        if func is torch.ops.aten._local_scalar_dense.default and getattr(args[0], "constant", None) is None:
            return 0
        return func(*args, **(kwargs or {}))


def _fake_batches(setup: Setup, tracker: MemTracker | None = None) -> Iterator[torch.Tensor]:
    """Token batches (micro_batch, seq_len + 1) as the DataLoader yields them; fake under FakeTensorMode.

    Each micro-batch begins by drawing its batch: there the tracker's module stats are reset, as
    MemTracker refuses a second forward of the root module otherwise (gradient accumulation).
    """
    t = setup.train
    while True:
        if tracker is not None:
            tracker.reset_mod_stats()
        yield torch.zeros((t.micro_batch, t.seq_len + 1), dtype=torch.int64)


def _categories(snap: dict, names: dict[str, str]) -> dict[str, int]:
    """A tracker snapshot (keys: reference-type members and 'Total') under our category names."""
    out = dict.fromkeys(names.values(), 0)
    for key, value in snap.items():
        name = getattr(key, "value", key)
        if name in names:
            out[names[name]] += int(value)
    return out


def _current(tracker: MemTracker, names: dict[str, str]) -> dict[str, int]:
    snaps = list(tracker.get_tracker_snapshot("current").values())
    return _categories(snaps[0] if snaps else {}, names)


class _FusedRMSNorm(torch.autograd.Function):
    """RMSNorm saving for backward what CUDA's ``aten::_fused_rms_norm`` saves: the input in its own
    dtype, the fp32 ``rstd`` of each row and the weight (derivatives.yaml feeds exactly these to
    ``_fused_rms_norm_backward``). Forward runs under no grad, so the fp32 intermediates are freed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, shape: list[int], eps: float | None):
        y, rstd = torch.ops.aten._fused_rms_norm(x, shape, weight, eps)
        ctx.save_for_backward(x, rstd, weight)
        ctx.shape = shape
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1]]
        if is_fake(x):  # the op's meta kernel: outputs only, as CUDA's fused kernel allocates
            gx, gw = torch.ops.aten._fused_rms_norm_backward(grad, x, ctx.shape, rstd, weight, mask)
        else:  # no CPU kernel exists; torch's own decomposition of it
            gx, gw = _fused_rms_norm_backward(grad, x, ctx.shape, rstd, weight, mask)
        return gx, gw, None, None


def _fused_rms_norm_forward(self: torch.nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return _FusedRMSNorm.apply(x, self.weight, list(self.normalized_shape), self.eps)


def use_cuda_norms(model: torch.nn.Module) -> int:
    """Make every RMSNorm of ``model`` keep CUDA's saved tensors (module docstring); returns how many."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.RMSNorm)]
    for m in norms:
        m.forward = types.MethodType(_fused_rms_norm_forward, m)
    return len(norms)


def _check_inputs(setup: Setup, target: str) -> None:
    if not isinstance(setup, Setup):
        raise AdvisorError(f"setup: expected an advisor.spec.specs.Setup, got {type(setup).__name__}")
    if target not in TARGETS:
        raise AdvisorError(f"target={target!r}: must be one of {', '.join(TARGETS)}")
    if target == "cuda" and setup.hardware.kind != "gpu":
        raise AdvisorError(
            f"target='cuda' takes its runtime allowance from a GPU spec; the setup's hardware is "
            f"{setup.hardware.name!r} (choose a GPU preset such as h100, or use target='cpu')"
        )
    check_step_options(setup)
    if setup.grad_accum > MAX_ACCUM:
        t, dp = setup.train, setup.parallel.dp
        raise SpecError(
            "train.global_batch",
            setup.global_batch,
            f"the dry run runs each of its {setup.grad_accum:,} micro-batches per step (global_batch / "
            f"(micro_batch x dp)) under fake tensors: at most {MAX_ACCUM}, a global batch up to "
            f"{MAX_ACCUM * t.micro_batch * dp:,} here. From the second micro-batch on the peak grows only by a "
            "4-byte loss each (gradients accumulate in place): a smaller global batch gives the same peak",
        )
    if setup.train.precision == "fp8":
        raise AdvisorError(
            "precision='fp8': the dry run does not trace torchao's float8 linears; use `advisor size` for the fp8 "
            "estimate, or profile it on a GPU with fp8 units"
        )


def torch_release() -> tuple[int, int]:
    """(major, minor) of the torch in use, read at each call (``2.13.0+cpu`` -> (2, 13))."""
    match = re.match(r"(\d+)\.(\d+)", str(torch.__version__))
    return (int(match[1]), int(match[2])) if match else (0, 0)


def _check_torch_for_distributed() -> None:
    """Refuses a torch older than ``DISTRIBUTED_MIN_TORCH``, whose memory tracker would misfile the step."""
    if torch_release() < DISTRIBUTED_MIN_TORCH:
        need = ".".join(map(str, DISTRIBUTED_MIN_TORCH))
        raise AdvisorError(
            f"the distributed dry run needs torch {need} or newer and this is torch {torch.__version__}: its "
            f"FSDPMemTracker counts DTensor's sharding propagation as memory before {need}. Upgrade torch, or use "
            f"`advisor size` (the estimator) or the one-device dry run (dp=1), which work on this torch"
        )


def _check_distributed(setup: Setup, offload_optimizer: bool) -> None:
    p = setup.parallel
    others = [f"{name}={getattr(p, name)}" for name in ("tp", "pp", "cp", "ep") if getattr(p, name) > 1]
    if others:
        raise AdvisorError(
            f"the distributed dry run supports {DISTRIBUTED_DEGREES} only; the layout has {', '.join(others)} "
            f"(tensor, pipeline, context and expert parallelism are not run on the fake process group: set them "
            f"to 1, or use `advisor size` for the estimate)"
        )
    if p.offload != "none" or offload_optimizer:
        raise AdvisorError(
            f"offload={p.offload if p.offload != 'none' else 'optimizer'!r}: the distributed dry run runs FSDP2 "
            f"without CPU offload; use offload none, or dp=1 (--gpus 1) for the single-device offloaded step"
        )
    check_step_options(setup)
    if setup.train.precision == "fp16" and p.zero:
        # As the real run (advisor.run.parallel.check_supported): a GradScaler's inf check must see every
        # gradient shard, which torch's GradScaler does not do for sharded gradients.
        raise AdvisorError(f"precision='fp16' with zero={p.zero}: fp16 loss scaling runs with zero=0 only; use bf16")
    _check_torch_for_distributed()


def _external(trainer: Trainer) -> list:
    """What outlives a step and exists before tracking begins: model, optimizer, offload state, RoPE."""
    model = unwrap(trainer.model)
    out: list = [model]
    opt = trainer.optimizer
    if isinstance(opt, HostOffloadOptimizer):
        out += [opt.inner, *opt.master, *(m.grad for m in opt.master)]
    else:
        out.append(opt)
    if model._rope is not None:
        out += list(model._rope)
    return out


def _notes(setup: Setup, target: str, offload: bool, runtime_bytes: int, frag_bytes: int) -> tuple[str, ...]:
    t, m = setup.train, setup.model
    notes = []
    if t.precision != "fp32" and not (setup.gpus > 1 and setup.parallel.zero):  # FSDP2: _distributed_notes
        notes.append(
            f"{t.precision} runs as torch.autocast over fp32 parameters: 4-byte parameters, gradients and no "
            f"master copy; autocast's 16-bit weight copies live through forward and backward (in activations)"
        )
        if t.fp32_grads:
            notes.append("fp32_grads changes nothing here: the gradients of fp32 parameters are fp32 already")
    if t.precision == "fp16":
        notes.append("fp16: the GradScaler's inf check is read as 'no overflow', so the optimizer step is taken")
    if t.dropout:
        notes.append("the step runs attention and its blocks without dropout: the dropout flag is ignored")
    if m.tied_embeddings and t.precision != "fp32":
        notes.append(
            "tied embeddings under autocast: the real step may sum the shared matrix's two gradients in place, "
            f"which fake tensors cannot; the end of backward may read up to {m.vocab * m.hidden * 4 / GiB:.3f} GiB high"
        )
    if m.is_moe:
        notes.append(
            f"MoE routing assumed balanced: each of {m.n_experts} experts gets tokens x {m.top_k} / {m.n_experts} rows"
        )
    if target == "cuda":
        notes.append(
            f"target cuda: computed on fake CPU tensors (a fake CUDA backward aborts CPU-only builds), plus "
            f"{runtime_bytes / GiB:.2f} GiB runtime allowance of the {setup.hardware.name} spec and "
            f"{frag_bytes / GiB:.2f} GiB fragmentation ({100 * EAGER_FRAGMENTATION_FRAC:.0f} % of the peak, as the "
            f"estimator's eager step); CUDA's 512-byte block rounding is not modelled"
        )
        if offload:
            notes.append(
                "offload: master weights, their gradients and optimizer states are host_bytes, not in the peak"
            )
    elif offload:
        notes.append("offload on the CPU target: host and device are one memory, so host_bytes are in the peak")
    return tuple(notes)


def _distributed_notes(setup: Setup) -> tuple[str, ...]:
    n, zero = setup.parallel.dp, setup.parallel.zero
    where = (
        f"rank 0's, whose shards are the largest (FSDP2 pads each parameter's dim 0 to a multiple of {n})"
        if zero
        else "every rank's"
    )
    notes = [
        f"{n} data-parallel ranks on a fake process group (one process, collectives move no data); the bytes are {where}"
    ]
    if zero == 0:
        notes.append(
            "zero 0 runs torch's replicate() (DDP built on FSDP2) in place of the real run's DDP, whose C++ reducer "
            "fails on fake tensors: full parameters, gradients and optimizer states on every rank; replicate's "
            "second copy of the parameters in forward and backward stands for DDP's flat gradient buckets, the same "
            "size under fp32 parameters (against the real 2-rank DDP step the peaks agreed within 8 bytes in most launches)"
        )
    elif zero == 1:
        notes.append(
            "zero 1 runs as zero 2, as in the real run: FSDP2 always reduce-scatters gradients "
            "(reshard_after_forward=False); ZeRO-1's full gradients would add (1 - 1/dp) x 4 bytes per parameter"
        )
    if zero and setup.train.precision != "fp32":
        precision = setup.train.precision
        notes.append(
            f"{precision} on FSDP2 runs under the real run's MixedPrecisionPolicy (param_dtype {precision}, reduce_dtype "
            "fp32, advisor.run.parallel.apply_fsdp): fp32 shards, gradients and optimizer states; 16-bit gathers, forward "
            "and backward, so autocast makes no copies of the weights"
        )
    return tuple(notes)


def _tracked_step(
    trainer: Trainer, tracker: MemTracker, setup: Setup, names: dict[str, str]
) -> tuple[list[dict[str, int]], list[dict[str, int]]]:
    """Runs one step under ``tracker``; returns the categories when each micro-batch's backward begins
    and when the optimizer step begins."""
    model = unwrap(trainer.model)
    opt = trainer.optimizer
    torch_opt = opt.inner if isinstance(opt, HostOffloadOptimizer) else opt
    backward_start: list[dict[str, int]] = []
    pre_optimizer: list[dict[str, int]] = []

    def on_loss(module, args, loss: torch.Tensor) -> None:
        # The loss's gradient arrives first in backward, after autocast has dropped its weight cache.
        loss.register_hook(lambda grad: backward_start.append(_current(tracker, names)))

    hooks = [
        model.register_forward_hook(on_loss),
        torch_opt.register_step_pre_hook(lambda *_: pre_optimizer.append(_current(tracker, names))),
    ]
    try:
        with tracker, _DataDependentStandIns(setup.model.n_experts):
            trainer.step(_fake_batches(setup, tracker))
    finally:
        for h in hooks:
            h.remove()
    return backward_start, pre_optimizer


def _phases(tracker: _PhasePeaks, names: dict[str, str], states_bytes: int) -> dict[str, dict[str, int]]:
    """The categories at the highest memory of each phase."""
    phases: dict[str, dict[str, int]] = {}
    for phase in PHASES:
        snap = _categories(tracker.phase_peaks.get(phase, {}), names)
        # MemTracker files the optimizer step's scratch as optimizer state: move it to temporaries.
        scratch = max(snap["optimizer"] - states_bytes, 0)
        snap["optimizer"] -= scratch
        snap["temporaries"] += scratch
        phases[phase] = snap
    return phases


def _result(
    setup: Setup,
    target: str,
    phases: dict[str, dict[str, int]],
    before_opt: dict[str, int],
    backward_start: list[dict[str, int]],
    *,
    states_bytes: int,
    host_bytes: int,
    notes: tuple[str, ...],
    start: float,
    world_size: int = 1,
    zero: int = 0,
    optimizer_offload: bool = False,
) -> DryRunResult:
    spec = setup.model
    by_phase = {phase: sum(snap.values()) for phase, snap in phases.items()}
    peak_phase = max(PHASES, key=lambda p: by_phase[p])
    peak = by_phase[peak_phase]
    runtime = setup.hardware.runtime_overhead_bytes if target == "cuda" else 0
    frag = int(EAGER_FRAGMENTATION_FRAC * peak) if target == "cuda" else 0
    return DryRunResult(
        model=spec.name,
        target=target,
        precision=setup.train.precision,
        recompute=setup.train.recompute,
        micro_batch=setup.train.micro_batch,
        seq_len=setup.train.seq_len,
        grad_accum=setup.grad_accum,
        n_params=spec.n_params,
        peak_bytes=peak,
        peak_phase=peak_phase,
        params_bytes=before_opt["params"] + before_opt["buffers"],
        grads_bytes=before_opt["grads"],
        optimizer_bytes=states_bytes,
        activations_bytes=max(snap["activations"] for snap in backward_start),
        temporaries_bytes=phases[peak_phase]["temporaries"],
        at_peak_bytes=phases[peak_phase],
        peak_by_phase_bytes=by_phase,
        host_bytes=host_bytes,
        overhead_bytes=runtime + frag,
        wall_ms=(time.perf_counter() - start) * 1e3,
        notes=_notes(setup, target, optimizer_offload, runtime, frag) + notes,
        world_size=world_size,
        zero=zero,
    )


def dry_run(
    setup: Setup, *, optimizer_impl: str | None = None, offload_optimizer: bool = False, target: str = "cpu"
) -> DryRunResult:
    """Memory of one steady-state training step of ``setup`` on one device, in bytes, without allocating.

    ``optimizer_impl`` and ``offload_optimizer`` are those of ``step.build_trainer``. ``target`` is
    'cpu' (what ``memprobe`` measures on this machine) or 'cuda' (the same step plus CUDA's runtime
    allowance and fragmentation, offloaded state left out of the device peak). A setup on several
    devices goes to ``dry_run_distributed`` (per-rank bytes, in a child process). Raises AdvisorError
    for what the step cannot run (fp8, fp16 with offload) and bad names.
    """
    _check_inputs(setup, target)
    if setup.gpus > 1:
        _check_distributed(setup, offload_optimizer)
        return dry_run_distributed(setup, optimizer_impl=optimizer_impl, target=target)
    start = time.perf_counter()
    with FakeTensorMode():
        trainer = build_trainer(
            setup, torch.device("cpu"), optimizer_impl=optimizer_impl, offload_optimizer=offload_optimizer
        )
        if target == "cuda":
            use_cuda_norms(unwrap(trainer.model))
        if trainer.offloader is not None and target == "cuda":
            # The host is another memory: offloaded activations leave the device and come back empty.
            trainer.offloader = attach_offloader(
                unwrap(trainer.model), setup, torch.device("cpu"), keep_host_copy=False
            )
        with _DataDependentStandIns(setup.model.n_experts):
            trainer.step(_fake_batches(setup))  # warm-up: creates the optimizer state and the RoPE cache

        tracker = _PhasePeakTracker()
        tracker.track_external(*_external(trainer))
        backward_start, pre_optimizer = _tracked_step(trainer, tracker, setup, _CATEGORIES)
        offload = isinstance(trainer.optimizer, HostOffloadOptimizer)
        # Offloaded host state besides the optimizer states: fp32 master weights and their gradients.
        host_other = sum(2 * m.numel() * m.element_size() for m in trainer.optimizer.master) if offload else 0

    before_opt = pre_optimizer[-1]
    states = before_opt["optimizer"]
    phases = _phases(tracker, _CATEGORIES, states)
    host = host_other + states if offload else 0
    acts_host, notes = _offload_host_and_notes(trainer, setup, target)
    host += acts_host
    if offload and target == "cuda":
        # The host's tensors leave the device view: master weights and their gradients ("other"), the
        # states; during the host optimizer step the GPU holds only the parameters and their gradients.
        for snap in phases.values():
            snap["other"] = max(snap["other"] - host_other, 0)
            snap["optimizer"] = 0
        params = before_opt["params"] + before_opt["buffers"]
        phases["optimizer"] = dict.fromkeys(_CATEGORIES.values(), 0) | {"params": params, "grads": before_opt["grads"]}
        states = 0
    return _result(
        setup,
        target,
        phases,
        before_opt,
        backward_start,
        states_bytes=states,
        host_bytes=host,
        notes=notes,
        start=start,
        optimizer_offload=offload,
    )


def _offload_host_and_notes(trainer: Trainer, setup: Setup, target: str) -> tuple[int, tuple[str, ...]]:
    """The host bytes activation offload holds (one micro-batch's: they go out and come back in turn)
    on the CUDA target, and the note that says how the dry run counted them."""
    if not trainer.offload_stats:
        return 0, ()
    acts = trainer.offload_stats[-1]
    per_micro_batch = acts.bytes_offloaded // setup.grad_accum
    how = (
        "and back; the copies count as instantaneous (the real step holds the block being copied too)"
        if target == "cuda"
        else "(another buffer of the same memory on a CPU target: nothing saved)"
    )
    note = f"activation offload: {acts.blocks} blocks, {per_micro_batch / GiB:.3f} GiB a micro-batch to the host {how}"
    return (per_micro_batch if target == "cuda" else 0), (note,)


def _apply_data_parallel(model: Transformer, mesh: DeviceMesh, zero: int, precision: str) -> None:
    """The real run's data parallelism over ``mesh`` (``advisor.run.parallel``): each block its own unit
    (one all-gather or all-reduce per block), then the root for the embedding, final norm and head.

    zero 3: FSDP2 ``fully_shard`` with reshard_after_forward (parameters gathered again in backward);
    zero 1 and 2: without (gathered parameters kept until the block's backward); bf16 and fp16 gather
    16-bit weights (the real run's MixedPrecisionPolicy). zero 0: the real run
    uses classic DDP, whose C++ reducer does not run on fake tensors, so here it is ``replicate``,
    torch's DDP built on FSDP2, over the same units.
    """
    if zero:
        apply_fsdp(model, mesh, reshard_after_forward=zero == 3, cpu_offload=False, precision=precision)
        return
    for unit in [*model.blocks, model]:
        replicate(unit, mesh=mesh)


def _distributed_trainer(
    setup: Setup, mesh: DeviceMesh, optimizer_impl: str | None, fake_mode: FakeTensorMode, target: str = "cpu"
) -> Trainer:
    """The Trainer of ``advisor.run.step`` over a data-parallel model: autocast as on one device (over FSDP2's
    16-bit gathered weights under bf16, as in the real run), the optimizer built over the sharded (DTensor) parameters, which are fake CPU tensors of
    ``fake_mode`` (it must allow non-fake inputs: ``to_empty`` reads the meta ones).

    The model is sharded on the meta device, outside the fake mode: sharding splits every parameter
    into world-size chunks, each a fake op under FakeTensorMode, and ``fully_shard`` of the tiny model
    over 1024 ranks took 4 s on our CPUs that way, 0.25 s on meta tensors, with the same bytes at every
    point of the step (checked at 8 and 1024 ranks).
    """
    t = setup.train
    model = build_model(
        setup.model, t.recompute, device="meta", flash=t.flash_attention, recompute_layers=t.recompute_layers
    )
    model.train()
    if target == "cuda":
        use_cuda_norms(model)
    # Activation offload wraps the blocks before data parallelism does, as in the real run
    # (advisor.run.parallel); on the CUDA target the offloaded tensors leave the device with nothing copied.
    offloader = attach_offloader(model, setup, torch.device("cpu"), keep_host_copy=target != "cuda")
    _apply_data_parallel(model, mesh, setup.parallel.zero, t.precision)
    with fake_mode:
        model.to_empty(device="cpu")
        optimizer = build_optimizer(list(model.parameters()), t.optimizer, optimizer_impl or t.optimizer_impl)
    autocast = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[t.precision]
    return Trainer(
        setup=setup,
        device=torch.device("cpu"),
        model=model,
        optimizer=optimizer,
        scaler=torch.amp.GradScaler("cpu") if t.precision == "fp16" else None,
        autocast_dtype=autocast,
        grad_accum=setup.grad_accum,
        offloader=offloader,
    )


def _dry_run_distributed_here(setup: Setup, optimizer_impl: str | None, target: str) -> DryRunResult:
    """The distributed dry run in this process: it owns the default process group while it runs."""
    # Importing the module registers the "fake" backend with torch.distributed.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_available():
        raise AdvisorError("this torch build has no torch.distributed: the distributed dry run needs it")
    if dist.is_initialized():
        raise AdvisorError(
            "a default process group is already initialized in this process; run the distributed dry run "
            "with isolate=True (a child process of its own)"
        )
    start = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=setup.parallel.dp)
    try:
        mesh = init_device_mesh("cpu", (setup.parallel.dp,), mesh_dim_names=("dp",))
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        trainer = _distributed_trainer(setup, mesh, optimizer_impl, fake_mode, target)
        with fake_mode:
            with _DataDependentStandIns(setup.model.n_experts):
                trainer.step(_fake_batches(setup))  # warm-up: creates the optimizer state and the RoPE cache
            tracker = _FSDPPhasePeakTracker(trainer.model, trainer.optimizer)
            rope = unwrap(trainer.model)._rope
            if rope is not None:
                tracker.track_inputs(rope)  # every block takes the tables as an input
            backward_start, pre_optimizer = _tracked_step(trainer, tracker, setup, _FSDP_CATEGORIES)
    finally:
        dist.destroy_process_group()
    before_opt = pre_optimizer[-1]
    states = before_opt["optimizer"]
    host, offload_notes = _offload_host_and_notes(trainer, setup, target)
    return _result(
        setup,
        target,
        _phases(tracker, _FSDP_CATEGORIES, states),
        before_opt,
        backward_start,
        states_bytes=states,
        host_bytes=host,
        notes=_distributed_notes(setup) + offload_notes,
        start=start,
        world_size=setup.parallel.dp,
        zero=setup.parallel.zero,
    )


def _child_main(request_path: str, answer_path: str) -> None:
    """Entry point of the child process: reads the pickled (setup, optimizer_impl, target), writes the
    pickled DryRunResult, or an AdvisorError's message (SpecError's arguments would not survive pickling)."""
    setup, optimizer_impl, target = pickle.loads(Path(request_path).read_bytes())
    try:
        answer: DryRunResult | str = _dry_run_distributed_here(setup, optimizer_impl, target)
    except AdvisorError as err:
        answer = str(err)
    Path(answer_path).write_bytes(pickle.dumps(answer))


def dry_run_distributed(
    setup: Setup, *, optimizer_impl: str | None = None, target: str = "cpu", isolate: bool = True
) -> DryRunResult:
    """Per-rank memory of one steady-state step of ``setup`` spread over ``setup.parallel.dp`` ranks, in
    bytes, in one process and without allocating.

    The step is ``advisor.run.step``'s Trainer over the project's model, each block and the root wrapped in
    FSDP2 (zero 1 to 3) or replicate() (zero 0) over a 1-D DeviceMesh of a fake process group, tracked
    by FSDPMemTracker. ``isolate`` (default) runs it in a child Python process: the fake process group
    is the process's default group while it runs, so a caller that has one, or runs two at once in
    threads, would collide, and a crash inside torch takes only the child down; the child's start
    (imports) adds 3 to 5 s on our 2 shared cores (tiny, 8 ranks: 3.2 s against 0.5 s in process). It
    is a plain subprocess, not multiprocessing's spawn, which re-runs the caller's main script (and
    fails where that script is stdin). ``isolate=False`` runs here (the CLI, a process of its own). Raises AdvisorError for tp, pp, cp or ep > 1, offload, fp8, fp16 with
    zero >= 1, bad names, and a child that died.
    """
    _check_inputs(setup, target)
    _check_distributed(setup, offload_optimizer=False)
    if not isolate:
        return _dry_run_distributed_here(setup, optimizer_impl, target)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="advisor-dryrun-") as tmp:
        request, answer = Path(tmp) / "request.pickle", Path(tmp) / "answer.pickle"
        request.write_bytes(pickle.dumps((setup, optimizer_impl, target)))
        code = f"from advisor.run.dryrun import _child_main; _child_main({str(request)!r}, {str(answer)!r})"
        # The child imports this very package, wherever the caller found it.
        path = os.pathsep.join(filter(None, (str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH"))))
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=os.environ | {"PYTHONPATH": path}
        )
        if proc.returncode != 0 or not answer.exists():
            last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise AdvisorError(
                f"the distributed dry run's child process failed (exit status {proc.returncode}): {last}; run "
                f"`python -m advisor dryrun` with the same flags to see its whole output"
            )
        value = pickle.loads(answer.read_bytes())
    if isinstance(value, str):
        raise AdvisorError(value)
    return replace(value, wall_ms=(time.perf_counter() - start) * 1e3)


def format_dry_run(result: DryRunResult) -> str:
    """The result as text for the CLI: the peak, its breakdown at the peak, the state sizes, notes."""
    r = result
    head = (
        f"Dry run of {r.model} ({r.n_params / 1e9:.3f}B params), target {r.target}: {r.precision}, "
        f"recompute {r.recompute}, micro-batch {r.micro_batch} x seq {r.seq_len} x accum {r.grad_accum} "
        f"({r.wall_ms / 1e3:.1f} s, nothing allocated)"
    )
    per_rank = r.world_size > 1
    if per_rank:
        layout = "replicate (DDP)" if r.zero == 0 else f"FSDP2, ZeRO-{r.zero}"
        head += f"\nPer rank of {r.world_size} data-parallel ranks ({layout}), on a fake process group"
    out = [head, "", f"Peak tensor memory {r.peak_bytes / GiB:10.3f} GiB, in the {r.peak_phase} phase"]
    out.append(f"At the peak{'':27s}GiB      %")
    for name, nbytes in r.at_peak_bytes.items():
        if nbytes:
            out.append(f"  {name:32s}{nbytes / GiB:9.3f}  {100 * nbytes / max(r.peak_bytes, 1):5.1f}")
    if r.target == "cuda":
        out.append(f"  {'+ CUDA runtime + fragmentation':32s}{r.overhead_bytes / GiB:9.3f}")
        out.append(f"  {'= device total':32s}{r.total_bytes / GiB:9.3f}")
    out += ["", f"State and activations, {'per rank' if per_rank else 'full size'}{'':5s}GiB"]
    for label, nbytes in (
        ("parameters", r.params_bytes),
        ("gradients (at optimizer step)", r.grads_bytes),
        ("optimizer states", r.optimizer_bytes),
        ("activations (backward begins)", r.activations_bytes),
        ("offloaded to host", r.host_bytes),
    ):
        out.append(f"  {label:32s}{nbytes / GiB:9.3f}")
    out += [
        "",
        "Highest memory by phase (GiB): " + ", ".join(f"{k} {v / GiB:.3f}" for k, v in r.peak_by_phase_bytes.items()),
    ]
    out += [f"Note: {n}" for n in r.notes]
    return "\n".join(out)
