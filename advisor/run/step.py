"""One real training step of the project's model: data, forward, loss, backward, optimizer.

Every option the advice talks about is here: precision (fp32; bf16 autocast; fp16 autocast with a
GradScaler), activation checkpointing (in the model), CPU offload of the optimizer (ZeRO-Offload
style: fp32 master weights, states and the step on the host, through pinned buffers on a GPU),
gradient accumulation, for-loop / foreach / fused optimizer, and torch.compile. Each phase is an
NVTX range (Nsight Systems) and a ``record_function`` range (torch.profiler) of the same name.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.data import DataLoader, Dataset

from advisor.errors import AdvisorError, Refused, SpecError
from advisor.run.fp8 import convert_to_fp8, convert_to_te, fp8_refusal, torchao_available
from advisor.run.model import Transformer, build_model
from advisor.run.offload import ActivationOffloader, OffloadStats, offloaded_blocks
from advisor.run.ranges import phase
from advisor.spec.specs import OPTIMIZER_IMPLS, Setup

PHASES = ("data", "forward", "backward", "optimizer")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
"""Autocast dtype per precision: fp8 runs its linears in float8 (torchao) and the rest in bf16."""


class SyntheticTokens(Dataset):
    """Random token sequences of length seq_len + 1 (inputs and shifted targets), reproducible by index."""

    def __init__(self, vocab: int, seq_len: int, length: int, seed: int = 0, delay_ms: float = 0.0) -> None:
        self.vocab, self.seq_len, self.length, self.seed = vocab, seq_len, length, seed
        self.delay_s = delay_ms / 1e3

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.delay_s:
            time.sleep(self.delay_s)  # stands in for I/O latency: workers overlap it, as they would a read
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        return torch.randint(0, self.vocab, (self.seq_len + 1,), generator=g)


PREFETCH_FACTOR = 2
"""Batches each DataLoader worker loads ahead (PyTorch's default, set explicitly so ``prefetched_batches``
knows it)."""


def prefetched_batches(num_workers: int) -> int:
    """How many batches a DataLoader with ``num_workers`` workers holds ready at most: what the profiled
    step takes off before its timed steps (``advisor.run.child``), and what a loader adds for it."""
    return num_workers * PREFETCH_FACTOR if num_workers > 0 else 0


def loader_options(num_workers: int) -> dict:
    """The DataLoader arguments that go with ``num_workers`` (prefetch_factor only with workers)."""
    return {"num_workers": num_workers} | ({"prefetch_factor": PREFETCH_FACTOR} if num_workers > 0 else {})


def make_loader(
    setup: Setup, n_micro_batches: int, num_workers: int, pin_memory: bool, seed: int, delay_ms: float = 0.0
) -> DataLoader:
    """A real DataLoader over synthetic tokens: ``n_micro_batches`` batches of micro_batch sequences,
    each sample taking ``delay_ms`` to "read"."""
    t = setup.train
    data = SyntheticTokens(setup.model.vocab, t.seq_len, n_micro_batches * t.micro_batch, seed, delay_ms)
    return DataLoader(
        data, batch_size=t.micro_batch, shuffle=False, pin_memory=pin_memory, **loader_options(num_workers)
    )


def build_optimizer(params: list[torch.Tensor] | list[dict], kind: str, impl: str) -> torch.optim.Optimizer:
    """AdamW (lr 3e-4, wd 0.1), SGD (momentum 0.9) or Adafactor, as a for-loop, foreach or fused kernel,
    over a list of parameters or of parameter groups (dicts with "params")."""
    if impl not in OPTIMIZER_IMPLS:
        raise AdvisorError(f"optimizer_impl={impl!r}: must be one of {', '.join(OPTIMIZER_IMPLS)}")
    flags = {"foreach": impl == "foreach"}
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1, fused=impl == "fused" or None, **flags)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, fused=impl == "fused" or None, **flags)
    if impl == "fused":
        raise AdvisorError("optimizer_impl='fused': Adafactor has no fused kernel; use foreach or for-loop")
    return torch.optim.Adafactor(params, lr=1e-2, **flags)


class HostOffloadOptimizer:
    """ZeRO-Offload on one device: fp32 master weights, gradients and optimizer states live in host
    memory (pinned when the model is on a GPU); the step runs on the CPU and the updated weights are
    copied back. Ren et al. 2021, "ZeRO-Offload"."""

    def __init__(self, params: list[torch.Tensor], kind: str, impl: str) -> None:
        self.params = [p for p in params if p.requires_grad]
        pin = self.params[0].device.type == "cuda"
        self.master = [torch.empty(p.shape, dtype=torch.float32, pin_memory=pin).copy_(p.detach()) for p in self.params]
        for m in self.master:
            m.grad = torch.zeros_like(m, pin_memory=pin) if pin else torch.zeros_like(m)
        self.inner = build_optimizer(self.master, kind, "fused" if impl == "fused" else impl)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        with phase("offload_d2h"):
            for p, m in zip(self.params, self.master, strict=True):
                if p.grad is not None:
                    m.grad.copy_(p.grad, non_blocking=True)
            if self.params[0].device.type == "cuda":
                torch.cuda.current_stream().synchronize()
        with phase("cpu_optimizer_step"):
            self.inner.step()
        with phase("offload_h2d"), torch.no_grad():
            for p, m in zip(self.params, self.master, strict=True):
                p.copy_(m, non_blocking=True)

    def state_tensors(self) -> list[torch.Tensor]:
        """Master weights, host gradients and optimizer states (all on the host)."""
        out = list(self.master) + [m.grad for m in self.master]
        for st in self.inner.state.values():
            out += [v for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
        return out


@dataclass
class Trainer:
    """The model, optimizer and precision machinery of one training step on one device."""

    setup: Setup
    device: torch.device
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | HostOffloadOptimizer
    scaler: torch.amp.GradScaler | None
    autocast_dtype: torch.dtype | None
    grad_accum: int
    phase_ms: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PHASES})
    skipped_steps: int = 0
    """Optimizer steps the fp16 GradScaler skipped for inf/NaN gradients (it lowers the scale each time)."""
    fp8_context: Callable | None = None
    """With TransformerEngine's fp8 linears: makes the context their forward runs in (te.fp8_autocast)."""
    fp8: dict = field(default_factory=dict)
    """With precision fp8: the backend ('torchao' or 'transformer_engine'), the recipe and how many
    linears it converted; empty otherwise."""
    offloader: ActivationOffloader | None = None
    """Moves the saved activations of ``train.offload_activations`` blocks to the host and back."""
    offload_stats: list[OffloadStats] = field(default_factory=list)
    """Each step's activation offload figures (bytes, copy times, exposed time, host memory)."""
    losses: list[float] = field(default_factory=list)
    """Each step's loss: the mean over its micro-batches (and, in a parallel step, over the data-parallel
    ranks), so a layout's losses can be checked against the single-process step's."""

    def autocast(self):
        if self.autocast_dtype is None:
            return nullcontext()
        if self.fp8_context is not None:  # TransformerEngine's fp8 linears run inside te.fp8_autocast
            stack = ExitStack()
            stack.enter_context(torch.autocast(self.device.type, dtype=self.autocast_dtype))
            stack.enter_context(self.fp8_context())
            return stack
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def micro_batch_context(self, last: bool) -> AbstractContextManager:
        """Context of one micro-batch's forward and backward; ``last`` marks the step's final one (the
        parallel step turns DDP's gradient all-reduce off on the others)."""
        return nullcontext()

    def reduce_loss(self, loss_sum: torch.Tensor) -> float:
        """The step's loss from this process's sum of micro-batch losses / grad_accum (NaN in a dry run)."""
        # The dry run steps under FakeTensorMode, where the loss has a shape but no value.
        return math.nan if isinstance(loss_sum, FakeTensor) else loss_sum.item()

    def finalize_grads(self) -> None:
        """Whatever the gradients need between the last backward and the optimizer (nothing on one device;
        ``advisor.run.parallel.ParallelTrainer`` reduces the ones left partial)."""

    def step(self, batches: Iterator[torch.Tensor]) -> None:
        """One optimizer step over grad_accum micro-batches; appends per-phase times (ms) and the loss."""
        times = dict.fromkeys(PHASES, 0.0)
        clock = _Clock(self.device)
        micro_losses = []  # detached views of each loss: no memory beyond what the step holds anyway
        # CUDA events can be read only once the GPU has passed them: every mark is turned into a time
        # after the step's final sync (reading one earlier raises, the backward still queued).
        marks = []
        if self.offloader is not None:
            self.offloader.reset()
        with phase("step"):
            for i in range(self.grad_accum):
                with phase("data"):
                    t0 = clock.mark()
                    batch = next(batches).to(self.device, non_blocking=True)
                    tokens, targets = batch[:, :-1], batch[:, 1:]
                    t1 = clock.mark()
                with self.micro_batch_context(last=i == self.grad_accum - 1):
                    with phase("forward"), self.autocast():
                        loss = self.model(tokens, targets) / self.grad_accum
                    t2 = clock.mark()
                    with phase("backward"):
                        (self.scaler.scale(loss) if self.scaler else loss).backward()
                    t3 = clock.mark()
                micro_losses.append(loss.detach())
                marks.append((t0, t1, t2, t3))
            with phase("optimizer"):
                t4 = clock.mark()
                self.finalize_grads()
                if self.scaler:
                    scale = self.scaler.get_scale()
                    self.scaler.step(self.optimizer)
                    self.scaler.update()
                    self.skipped_steps += self.scaler.get_scale() < scale
                else:
                    self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                t5 = clock.mark()
        clock.sync()
        if self.offloader is not None:
            self.offload_stats.append(self.offloader.stats())
        for t0, t1, t2, t3 in marks:
            times["data"] += clock.ms(t0, t1)
            times["forward"] += clock.ms(t1, t2)
            times["backward"] += clock.ms(t2, t3)
        times["optimizer"] = clock.ms(t4, t5)
        for k, v in times.items():
            self.phase_ms[k].append(v)
        # Read after the clock's final sync so that logging the loss adds no host sync inside the step.
        self.losses.append(self.reduce_loss(torch.stack(micro_losses).sum()))

    def state_bytes(self) -> dict[str, int]:
        """Bytes of parameters and optimizer state, split by where they live (device vs host)."""
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        if isinstance(self.optimizer, HostOffloadOptimizer):
            host = sum(t.numel() * t.element_size() for t in self.optimizer.state_tensors())
            return {"params_bytes": params, "optimizer_device_bytes": 0, "optimizer_host_bytes": host}
        opt = 0
        for st in self.optimizer.state.values():
            opt += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
        return {"params_bytes": params, "optimizer_device_bytes": opt, "optimizer_host_bytes": 0}


class _Clock:
    """Phase boundaries: CUDA events on a GPU (no host sync until the end), perf_counter on a CPU.

    Marks are read (``ms``) only after a ``sync`` that follows the last mark: a CUDA event's time is
    there once the GPU has passed it, and reading it earlier raises. The rule is enforced on the CPU
    too, so the CPU tests catch a read that would fail on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.unsynced = False

    def mark(self):
        self.unsynced = True
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.unsynced = False

    def ms(self, a, b) -> float:
        if self.unsynced:
            raise RuntimeError("_Clock.ms before sync(): a CUDA event cannot be read until the GPU has passed it")
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


def resolve_device(device: str) -> torch.device:
    """'auto' means CUDA where present, else the CPU; asking for CUDA without it is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise AdvisorError(f"device={device!r}: must be one of auto, cpu, cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise AdvisorError(
            "device='cuda': no CUDA device is visible here (torch.cuda.is_available() is False); use cpu"
        )
    return torch.device(device)


def check_step_options(setup: Setup, compile_model: bool = False) -> None:
    """Raise SpecError for the training options the profiled step and the dry run do not run: they
    are estimated only (``advisor size``), and a run would silently measure something else."""
    t = setup.train
    if t.fused_loss:
        raise SpecError(
            "train.fused_loss",
            t.fused_loss,
            "the profiled step and the dry run do not run it yet (estimated only); the step's loss is PyTorch's "
            "cross-entropy",
        )
    if t.compile_loss is not None and t.compile_loss != (t.compile or compile_model):
        raise SpecError(
            "train.compile_loss",
            t.compile_loss,
            f"the profiled step compiles the model with its loss or neither (compile={t.compile or compile_model}); "
            "a loss compiled apart from the blocks is estimated only",
        )
    if t.offload_activations:
        if t.recompute in ("selective", "selective-op"):
            # Checkpointed regions keep what they save out of the saved-tensor hooks' reach.
            raise SpecError(
                "train.offload_activations",
                t.offload_activations,
                f"the profiled step offloads blocks that keep all their activations; recompute={t.recompute!r} "
                "keeps them in checkpointed regions the hooks cannot see: use recompute none, or full with "
                "recompute_layers below the blocks",
            )
        if compile_model or t.compile:
            raise SpecError(
                "train.offload_activations",
                t.offload_activations,
                "torch.compile traces through the saved-tensor hooks that move activations to the host; "
                "offload runs in eager mode only (turn compile off)",
            )


def build_trainer(
    setup: Setup,
    device: torch.device,
    *,
    optimizer_impl: str | None = None,
    offload_optimizer: bool = False,
    compile_model: bool = False,
    seed: int = 0,
    fp8_emulate: bool = False,
) -> Trainer:
    """Model, optimizer, scaler and autocast for ``setup`` on ``device`` (fp32 parameters; 16-bit
    precisions run under torch.autocast, fp16 with a GradScaler; fp8 is torchao's float8 linears under
    bf16 autocast, refused (``Refused``) without fp8 units unless ``fp8_emulate``, for tests)."""
    t = setup.train
    optimizer_impl = optimizer_impl or t.optimizer_impl
    check_step_options(setup, compile_model)
    if t.precision == "fp8" and (reason := fp8_refusal(device, emulate=fp8_emulate)):
        raise Refused(reason)
    if t.precision == "fp16" and offload_optimizer:
        raise AdvisorError(
            "precision='fp16' with optimizer offload: the loss scaler needs the optimizer on the device; use bf16"
        )
    if setup.gpus > 1:
        raise AdvisorError(f"this is the single-process step; the layout asks for {setup.gpus} GPUs (use --nproc)")
    torch.manual_seed(seed)
    model: torch.nn.Module = build_model(
        setup.model, t.recompute, device=device, flash=t.flash_attention, recompute_layers=t.recompute_layers
    )
    model.train()
    fp8_context, fp8 = None, {}
    if t.precision == "fp8":
        if torchao_available():
            linears = convert_to_fp8(model, t.fp8_recipe, emulate=fp8_emulate)
            fp8 = {"backend": "torchao", "recipe": t.fp8_recipe, "linears": linears}
        else:
            linears, fp8_context = convert_to_te(model, t.fp8_recipe)
            fp8 = {"backend": "transformer_engine", "recipe": t.fp8_recipe, "linears": linears}
    offloader = attach_offloader(model, setup, device)
    params = list(model.parameters())
    if offload_optimizer:
        optimizer: torch.optim.Optimizer | HostOffloadOptimizer = HostOffloadOptimizer(
            params, t.optimizer, optimizer_impl
        )
    else:
        optimizer = build_optimizer(params, t.optimizer, optimizer_impl)
    if compile_model:
        # The first forward caches the RoPE tables on the model: made before compiling, the cache is
        # there from the first call, so the second step does not fail a guard on it and compile the
        # whole model again (its first timed step took twice the steady step on the CPU).
        model.rope_for(t.seq_len, device)
        model = torch.compile(model)
    dtype = _DTYPES[t.precision]
    scaler = torch.amp.GradScaler(device.type) if t.precision == "fp16" else None
    return Trainer(
        setup=setup,
        device=device,
        model=model,
        optimizer=optimizer,
        scaler=scaler,
        autocast_dtype=None if dtype == torch.float32 else dtype,
        grad_accum=setup.grad_accum,
        offloader=offloader,
        fp8_context=fp8_context,
        fp8=fp8,
    )


def attach_offloader(model: Transformer, setup: Setup, device: torch.device, *, keep_host_copy: bool = True):
    """The ActivationOffloader for ``setup.train.offload_activations`` blocks of ``model`` (this
    stage's), set as its block runner; None when nothing is offloaded."""
    t = setup.train
    if not t.offload_activations:
        return None
    blocks = offloaded_blocks(len(model.blocks), t.recompute, t.recompute_layers, t.offload_activations)
    offloader = ActivationOffloader(device, blocks, resident=lambda: model._rope or (), keep_host_copy=keep_host_copy)
    model.block_runner = offloader.block
    return offloader


def unwrap(model: torch.nn.Module) -> Transformer:
    """The Transformer under a torch.compile wrapper."""
    return getattr(model, "_orig_mod", model)  # type: ignore[return-value]
