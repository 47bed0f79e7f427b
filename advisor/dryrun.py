"""The dry run: the exact memory of the project's own training step for any model size, without allocating.

The Trainer of ``advisor.step`` (same model, autocast, checkpointing and optimizer) is built and run under
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
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode

from advisor.errors import AdvisorError
from advisor.estimator import FRAGMENTATION_FRAC
from advisor.specs import Setup
from advisor.step import HostOffloadOptimizer, Trainer, build_trainer, unwrap

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


@dataclass(frozen=True, slots=True)
class DryRunResult:
    """Memory of one steady-state training step, from fake tensors, in bytes.

    ``peak_bytes`` is what the profiler's running sum (CPU, ``memprobe``) reports for the step, and what
    ``torch.cuda.max_memory_allocated()`` should report on a GPU (not yet checked on one). ``at_peak_bytes`` splits it by category at the moment of
    the peak and sums to it. The state sizes (params, grads, optimizer) are full sizes, wherever the
    peak falls.
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
    """Model parameters (fp32 under autocast: the step keeps fp32 parameters)."""
    grads_bytes: int
    """All gradients on the device when the optimizer step begins (offload: before their copy to the host)."""
    optimizer_bytes: int
    """Optimizer states (AdamW: exp_avg, exp_avg_sq and a 4-byte step per parameter tensor)."""
    activations_bytes: int
    """Saved for backward when one micro-batch's backward begins, including autocast's 16-bit weight
    copies (kept by the linears that use them) and the loss's fp32 log-softmax."""
    temporaries_bytes: int
    """Short-lived tensors at the peak: backward intermediates and the optimizer step's scratch."""
    at_peak_bytes: dict[str, int]
    """Category -> bytes at the peak (params, buffers, grads, optimizer, activations, temporaries,
    other); sums to peak_bytes. 'other' holds the cached RoPE tables and, under offload on the CPU
    target, the master weights and their gradients."""
    peak_by_phase_bytes: dict[str, int]
    """Highest tensor memory within each phase (forward, backward, optimizer)."""
    host_bytes: int
    """Offloaded optimizer state in host memory: fp32 master weights, their gradients, the states."""
    overhead_bytes: int
    """target='cuda': runtime allowance plus allocator fragmentation; 0 on the CPU."""
    wall_ms: float
    """Time the dry run itself took."""
    notes: tuple[str, ...] = field(default=())
    """Assumptions that apply to this run."""

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


class _PhasePeakTracker(MemTracker):
    """MemTracker that keeps the snapshot at the highest memory of each phase (forward, backward,
    optimizer) instead of per-module peaks.

    Upstream ``_update_peak_stats`` walks every tracked module after every op: the dry run of
    Llama-3.1-8B took 15 s with it and 3 s without on our CPUs. The per-module tables are not used here.
    """

    def __init__(self) -> None:
        super().__init__()
        self.phase_peaks: dict[str, dict] = {}

    def _update_peak_stats(self, peak_state) -> None:
        phase = "optimizer" if self._in_opt else "backward" if self._mod_tracker.is_bw else "forward"
        for snap in self._curr_mem_snap.values():  # one device: the step runs on (fake) CPU tensors
            best = self.phase_peaks.get(phase)
            if best is None or snap["Total"] > best["Total"]:
                self.phase_peaks[phase] = dict(snap)


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


def _categories(snap: dict) -> dict[str, int]:
    """A MemTracker snapshot (keys: _MemRefType members and 'Total') under our category names."""
    out = dict.fromkeys(_CATEGORIES.values(), 0)
    for key, value in snap.items():
        name = getattr(key, "value", key)
        if name in _CATEGORIES:
            out[_CATEGORIES[name]] += int(value)
    return out


def _current(tracker: MemTracker) -> dict[str, int]:
    snaps = list(tracker.get_tracker_snapshot("current").values())
    return _categories(snaps[0] if snaps else {})


def _check_inputs(setup: Setup, target: str) -> None:
    if not isinstance(setup, Setup):
        raise AdvisorError(f"setup: expected an advisor.specs.Setup, got {type(setup).__name__}")
    if target not in TARGETS:
        raise AdvisorError(f"target={target!r}: must be one of {', '.join(TARGETS)}")
    if target == "cuda" and setup.hardware.kind != "gpu":
        raise AdvisorError(
            f"target='cuda' takes its runtime allowance from a GPU spec; the setup's hardware is "
            f"{setup.hardware.name!r} (choose a GPU preset such as h100, or use target='cpu')"
        )


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
    if t.precision != "fp32":
        notes.append(
            f"{t.precision} runs as torch.autocast over fp32 parameters: 4-byte parameters, gradients and no "
            f"master copy; autocast's 16-bit weight copies live through forward and backward (in activations)"
        )
        if t.fp32_grads:
            notes.append("fp32_grads changes nothing here: the gradients of fp32 parameters are fp32 already")
    if t.precision == "fp16":
        notes.append("fp16: the GradScaler's inf check is read as 'no overflow', so the optimizer step is taken")
    if not t.flash_attention or t.dropout:
        notes.append("the step always runs scaled_dot_product_attention without dropout: flash/dropout flags ignored")
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
            f"{frag_bytes / GiB:.2f} GiB fragmentation ({100 * FRAGMENTATION_FRAC:.0f} % of the peak, as the "
            f"estimator); CUDA's 512-byte block rounding is not modelled"
        )
        if offload:
            notes.append(
                "offload: master weights, their gradients and optimizer states are host_bytes, not in the peak"
            )
    elif offload:
        notes.append("offload on the CPU target: host and device are one memory, so host_bytes are in the peak")
    return tuple(notes)


def dry_run(
    setup: Setup, *, optimizer_impl: str | None = None, offload_optimizer: bool = False, target: str = "cpu"
) -> DryRunResult:
    """Memory of one steady-state training step of ``setup`` on one device, in bytes, without allocating.

    ``optimizer_impl`` and ``offload_optimizer`` are those of ``step.build_trainer``. ``target`` is
    'cpu' (what ``memprobe`` measures on this machine) or 'cuda' (the same step plus CUDA's runtime
    allowance and fragmentation, offloaded state left out of the device peak). Raises AdvisorError for
    what the single-process step cannot run (fp8, several GPUs, fp16 with offload) and bad names.
    """
    _check_inputs(setup, target)
    start = time.perf_counter()
    spec = setup.model
    with FakeTensorMode():
        trainer = build_trainer(
            setup, torch.device("cpu"), optimizer_impl=optimizer_impl, offload_optimizer=offload_optimizer
        )
        with _DataDependentStandIns(spec.n_experts):
            trainer.step(_fake_batches(setup))  # warm-up: creates the optimizer state and the RoPE cache

        tracker = _PhasePeakTracker()
        tracker.track_external(*_external(trainer))
        model = unwrap(trainer.model)
        offload = isinstance(trainer.optimizer, HostOffloadOptimizer)
        torch_opt = trainer.optimizer.inner if offload else trainer.optimizer
        backward_start: list[dict[str, int]] = []
        pre_optimizer: list[dict[str, int]] = []

        def on_loss(module, args, loss: torch.Tensor) -> None:
            # The loss's gradient arrives first in backward, after autocast has dropped its weight cache.
            loss.register_hook(lambda grad: backward_start.append(_current(tracker)))

        hooks = [
            model.register_forward_hook(on_loss),
            torch_opt.register_step_pre_hook(lambda *_: pre_optimizer.append(_current(tracker))),
        ]
        try:
            with tracker, _DataDependentStandIns(spec.n_experts):
                trainer.step(_fake_batches(setup, tracker))
        finally:
            for h in hooks:
                h.remove()
        # Offloaded host state besides the optimizer states: fp32 master weights and their gradients.
        host_other = sum(2 * m.numel() * m.element_size() for m in trainer.optimizer.master) if offload else 0

    before_opt = pre_optimizer[-1]
    params = before_opt["params"] + before_opt["buffers"]
    grads = before_opt["grads"]
    states = before_opt["optimizer"]
    host = host_other + states if offload else 0
    phases: dict[str, dict[str, int]] = {}
    for phase in PHASES:
        snap = _categories(tracker.phase_peaks.get(phase, {}))
        # MemTracker files the optimizer step's scratch as optimizer state: move it to temporaries.
        scratch = max(snap["optimizer"] - states, 0)
        snap["optimizer"] -= scratch
        snap["temporaries"] += scratch
        phases[phase] = snap
    if offload and target == "cuda":
        # The host's tensors leave the device view: master weights and their gradients ("other"), the
        # states; during the host optimizer step the GPU holds only the parameters and their gradients.
        for snap in phases.values():
            snap["other"] = max(snap["other"] - host_other, 0)
            snap["optimizer"] = 0
        phases["optimizer"] = dict.fromkeys(_CATEGORIES.values(), 0) | {"params": params, "grads": grads}
        states = 0
    by_phase = {phase: sum(snap.values()) for phase, snap in phases.items()}
    peak_phase = max(PHASES, key=lambda p: by_phase[p])
    peak = by_phase[peak_phase]
    runtime = setup.hardware.runtime_overhead_bytes if target == "cuda" else 0
    frag = int(FRAGMENTATION_FRAC * peak) if target == "cuda" else 0
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
        params_bytes=params,
        grads_bytes=grads,
        optimizer_bytes=states,
        activations_bytes=max(snap["activations"] for snap in backward_start),
        temporaries_bytes=phases[peak_phase]["temporaries"],
        at_peak_bytes=phases[peak_phase],
        peak_by_phase_bytes=by_phase,
        host_bytes=host,
        overhead_bytes=runtime + frag,
        wall_ms=(time.perf_counter() - start) * 1e3,
        notes=_notes(setup, target, offload, runtime, frag),
    )


def format_dry_run(result: DryRunResult) -> str:
    """The result as text for the CLI: the peak, its breakdown at the peak, the state sizes, notes."""
    r = result
    head = (
        f"Dry run of {r.model} ({r.n_params / 1e9:.3f}B params), target {r.target}: {r.precision}, "
        f"recompute {r.recompute}, micro-batch {r.micro_batch} x seq {r.seq_len} x accum {r.grad_accum} "
        f"({r.wall_ms / 1e3:.1f} s, nothing allocated)"
    )
    out = [head, "", f"Peak tensor memory {r.peak_bytes / GiB:10.3f} GiB, in the {r.peak_phase} phase"]
    out.append(f"At the peak{'':27s}GiB      %")
    for name, nbytes in r.at_peak_bytes.items():
        if nbytes:
            out.append(f"  {name:32s}{nbytes / GiB:9.3f}  {100 * nbytes / max(r.peak_bytes, 1):5.1f}")
    if r.target == "cuda":
        out.append(f"  {'+ CUDA runtime + fragmentation':32s}{r.overhead_bytes / GiB:9.3f}")
        out.append(f"  {'= device total':32s}{r.total_bytes / GiB:9.3f}")
    out += ["", "State and activations, full size     GiB"]
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
