"""The training step of one rank under torchrun: process group, device mesh, parallel layouts, data.

Layouts are applied to the project's Transformer in a fixed order, as torchtitan's
``parallelize_llama`` does: pipeline split, tensor parallelism (with sequence parallelism),
activation checkpointing (already inside the model), torch.compile per block, then data parallelism
(DDP for ZeRO-0, FSDP2 ``fully_shard`` for ZeRO-1/2/3). The result is a ``step.Trainer`` whose
``step`` and ``phase_ms`` behave as the single-process step's, so the profiler times both alike.

Correctness contract (tests/test_parallel.py): every rank builds the full model from the same seed
before sharding it, and ``rank_loader`` hands the data-parallel ranks exactly the samples of the
single-process step with ``micro_batch x dp``, so the losses and updated weights equal that step's.
That holds in fp32; in bf16 FSDP2 computes on bf16 weights (``apply_fsdp``) where the single-process
step casts fp32 ones under autocast: the tiny model's losses agreed within 1e-4 relative over 20 steps
(ZeRO-3, 2 gloo ranks), and both stayed within 6e-5 relative of the fp32 step's.

Context and expert parallelism (cp, ep > 1) are estimated only: the profiled step rejects them.
Nothing here needs a GPU at import time; NCCL and CUDA are touched only when ``device_type='cuda'``.
"""

from __future__ import annotations

import copy
import itertools
import os
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext, suppress
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from advisor.errors import AdvisorError, SpecError
from advisor.run.model import Block, Transformer, build_model, lm_loss
from advisor.run.ranges import phase
from advisor.run.step import (
    _DTYPES,
    SyntheticTokens,
    Trainer,
    _Clock,
    attach_offloader,
    build_optimizer,
    check_step_options,
    loader_options,
)
from advisor.spec.specs import Setup
from advisor.spec.stages import pipeline_stage_layers

MESH_DIMS = ("pp", "dp", "tp")
"""Mesh dimensions, outermost first: Megatron-LM's rank order (TP innermost, so a TP group shares a
node's fastest links; PP outermost, as its point-to-point traffic is the lightest)."""

PIPELINE_PHASES = ("data", "forward", "backward", "pipeline_wait", "optimizer")
"""Phases of a pipeline-parallel step. The schedule interleaves micro-batches, so forward and backward
are the summed compute of this rank's chunks and ``pipeline_wait`` is the rest of the schedule:
point-to-point transfers, bubble waits and the gradient reduction the schedule triggers."""

_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


@dataclass(frozen=True)
class ParallelInfo:
    """This rank's place in the job: torchrun's ranks, its device, and its coordinates on the mesh."""

    rank: int
    world_size: int
    local_rank: int
    """Rank on this node; the CUDA device index."""
    device: torch.device
    backend: str
    """Process-group backend: gloo (CPU) or nccl (CUDA)."""
    mesh: DeviceMesh
    """One mesh with dims named pp, dp, tp (sizes may be 1) that every layout takes its groups from."""
    pp: int
    dp: int
    tp: int
    pp_rank: int
    dp_rank: int
    tp_rank: int

    def __post_init__(self) -> None:
        if self.pp * self.dp * self.tp != self.world_size:
            raise SpecError("world_size", self.world_size, f"must equal pp({self.pp}) x dp({self.dp}) x tp({self.tp})")
        if not 0 <= self.rank < self.world_size:
            raise SpecError("rank", self.rank, f"must be in [0, {self.world_size})")
        for name in ("pp", "dp", "tp"):
            coord = getattr(self, f"{name}_rank")
            if not 0 <= coord < getattr(self, name):
                raise SpecError(f"{name}_rank", coord, f"must be in [0, {getattr(self, name)})")
        if self.backend not in _BACKENDS.values():
            raise SpecError("backend", self.backend, f"must be one of {', '.join(_BACKENDS.values())}")

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank holds the first pipeline stage (the embedding reads the tokens)."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank holds the last pipeline stage (the head computes the loss)."""
        return self.pp_rank == self.pp - 1


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise AdvisorError(
            f"{name} is not set: the parallel step runs under torchrun "
            "(python -m torch.distributed.run --nproc-per-node N ...), which sets RANK, WORLD_SIZE and LOCAL_RANK"
        )
    try:
        return int(value)
    except ValueError:
        raise AdvisorError(f"{name}={value!r}: must be an integer (set by torchrun)") from None


def check_supported(setup: Setup, device_type: str) -> None:
    """Raise AdvisorError for what the profiled parallel step cannot run (it stays estimated only)."""
    m, t, p = setup.model, setup.train, setup.parallel
    check_step_options(setup)
    if t.offload_activations and p.pp > 1:
        raise SpecError(
            "train.offload_activations",
            t.offload_activations,
            "the pipelined step keeps several micro-batches of a stage in flight and does not offload them yet "
            "(estimated only); use pp=1 or offload_activations=0",
        )
    for name in ("cp", "ep"):
        if getattr(p, name) > 1:
            raise SpecError(
                f"parallel.{name}",
                getattr(p, name),
                "context and expert parallelism are not supported by the profiled step yet (they are "
                f"estimated only); use {name}=1",
            )
    if device_type not in _BACKENDS:
        raise AdvisorError(f"device_type={device_type!r}: must be one of {', '.join(_BACKENDS)}")
    if t.precision == "fp8":
        raise SpecError(
            "train.precision",
            "fp8",
            "the distributed step does not convert its linears to float8 yet; fp8 (torchao) runs in the "
            "single-process step",
        )
    if t.precision == "fp16" and (p.tp > 1 or p.pp > 1 or p.zero > 0):
        # A GradScaler's inf check must see every gradient shard (FSDP's ShardedGradScaler, Megatron's
        # found_inf all-reduce); under DDP each rank holds the full averaged gradients, so it does.
        raise SpecError(
            "train.precision", "fp16", "fp16 loss scaling runs with plain DDP only (zero=0, tp=1, pp=1); use bf16"
        )
    if t.optimizer == "sgd" and t.optimizer_impl == "fused" and (p.tp > 1 or p.zero > 0):
        # FSDP2 and TP parameters are DTensors; torch has no sharding rule for aten._fused_sgd_.
        raise SpecError(
            "train.optimizer_impl",
            "fused",
            "torch has no fused SGD for the sharded (DTensor) parameters of FSDP2 and TP; use 'foreach' or 'for-loop'",
        )
    if p.offload != "none" and device_type == "cpu":
        # FSDP2's CPUOffloadPolicy moves shards from a GPU to the host; on the CPU there is no other
        # memory to move them to, so offload there would profile nothing real.
        raise SpecError(
            "parallel.offload", p.offload, "offload moves state from a GPU to the host; on the CPU device use 'none'"
        )
    if p.tp > 1:
        for name in ("n_heads", "n_kv_heads"):
            if getattr(m, name) % p.tp:
                raise SpecError(
                    "parallel.tp",
                    p.tp,
                    f"model.{name}={getattr(m, name)} must be divisible by tp: the profiled step splits query and "
                    "key/value heads over the TP ranks (it does not replicate KV heads)",
                )
        rows = vocab_rows_per_rank(m.vocab, p.tp)
        if (p.tp - 1) * rows >= m.vocab:
            raise SpecError(
                "parallel.tp",
                p.tp,
                f"model.vocab={m.vocab} leaves the last TP rank no vocabulary rows ({rows} per rank); "
                f"use tp <= {max(d for d in range(1, p.tp) if (d - 1) * vocab_rows_per_rank(m.vocab, d) < m.vocab)}",
            )
        if m.qk_norm:
            raise SpecError(
                "parallel.tp", p.tp, f"{m.name} has q/k norms over whole heads; the profiled step runs them with tp=1"
            )
        if m.is_moe:
            raise SpecError(
                "parallel.tp", p.tp, f"{m.name} is a MoE model; the profiled step runs MoE blocks with tp=1"
            )
        if p.dp > 1 and p.zero == 0:
            raise SpecError(
                "parallel.zero", 0, "DDP does not take tensor-parallel (DTensor) parameters; use zero >= 1 (FSDP x TP)"
            )
        if p.sequence_parallel and t.seq_len % p.tp:
            raise SpecError("train.seq_len", t.seq_len, f"sequence parallelism needs a multiple of tp={p.tp}")
    if m.is_moe and p.zero >= 1:
        # FSDP2 reduce-scatters a block's gradients as one flat buffer; an expert that got no token on
        # one rank has no gradient there, and the ranks' buffers differ in size (gloo: "Received data
        # size doesn't match expected size"). DDP finds the unused experts instead.
        raise SpecError(
            "parallel.zero", p.zero, f"{m.name} is a MoE model; the profiled step runs MoE with zero=0 (DDP)"
        )
    if p.pp > 1:
        if p.sequence_parallel:
            # The stages after the first would see sequence shards and build RoPE tables for them.
            raise SpecError("parallel.sequence_parallel", True, "not supported with pp > 1 by the profiled step yet")
        if m.is_moe:
            # The load-balancing loss sums over all blocks, but the last stage's loss_fn sees only its own.
            raise SpecError("parallel.pp", p.pp, f"{m.name} is a MoE model; the profiled step runs MoE with pp=1")


def leave_rank(code: int) -> None:
    """End this rank's process with ``code`` once its files are written, without the interpreter's
    finalisation: the FSDP modules, the device mesh and the profiler keep references to the gloo
    process group after ``destroy_process_group``, so it would be freed there, where gloo's worker
    threads still holding tensors abort the process (SIGABRT, "terminate called without an active
    exception"; twice in CI on the 2-rank FSDP2 run, after rank 0 had filed metrics.json). The
    streams are flushed first; nothing else is left to do."""
    for stream in (sys.stdout, sys.stderr):
        with suppress(Exception):
            stream.flush()
    os._exit(code)


def init_parallel(setup: Setup, device_type: str) -> ParallelInfo:
    """This rank's ParallelInfo: reads torchrun's RANK, WORLD_SIZE and LOCAL_RANK, checks them against
    the layout, starts the process group (gloo on the CPU, NCCL on CUDA) unless one is already up (a
    process may run several layouts) and builds the (pp, dp, tp) mesh. Raises AdvisorError."""
    check_supported(setup, device_type)
    rank, world_size, local_rank = _env_int("RANK"), _env_int("WORLD_SIZE"), _env_int("LOCAL_RANK")
    p = setup.parallel
    if setup.gpus != world_size:
        raise AdvisorError(
            f"the layout needs dp({p.dp}) x tp({p.tp}) x pp({p.pp}) x cp({p.cp}) = {setup.gpus} processes, "
            f"but torchrun started WORLD_SIZE={world_size}"
        )
    backend = _BACKENDS[device_type]
    if not dist.is_available():
        raise AdvisorError("this PyTorch build has no torch.distributed")
    if backend == "gloo" and not dist.is_gloo_available():
        raise AdvisorError("this PyTorch build has no gloo backend (needed for the parallel step on the CPU)")
    if device_type == "cuda":
        if not dist.is_nccl_available():
            raise AdvisorError("this PyTorch build has no NCCL backend (needed for the parallel step on GPUs)")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world_size)
    elif dist.get_backend() != backend:
        raise AdvisorError(
            f"a {dist.get_backend()} process group is already running; device_type={device_type!r} needs {backend}"
        )
    mesh = init_device_mesh(device_type, (p.pp, p.dp, p.tp), mesh_dim_names=MESH_DIMS)
    pp_rank, dp_rank, tp_rank = (mesh.get_local_rank(d) for d in MESH_DIMS)
    return ParallelInfo(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=device,
        backend=backend,
        mesh=mesh,
        pp=p.pp,
        dp=p.dp,
        tp=p.tp,
        pp_rank=pp_rank,
        dp_rank=dp_rank,
        tp_rank=tp_rank,
    )


# -- layouts ---------------------------------------------------------------------------------------


def stage_bounds(setup: Setup) -> list[int]:
    """Where each pipeline stage's blocks start, and the end: stage i holds blocks
    [bounds[i], bounds[i + 1])."""
    return [0, *itertools.accumulate(pipeline_stage_layers(setup))]


def split_pipeline(model: Transformer, setup: Setup, info: ParallelInfo) -> list[tuple[int, Transformer]]:
    """This rank's pipeline stages as (stage index, model holding only that stage's blocks): the
    layers split over pp x vpp stages balanced with the head's cost on the last one
    (``advisor.spec.stages.pipeline_stage_layers``), the embedding on the first, final norm and head on the
    last. With vpp > 1 rank r holds stages r, r + pp, ... (interleaved 1F1B, Narayanan et al. 2021)."""
    p = setup.parallel
    n_stages = p.pp * p.vpp
    bounds = stage_bounds(setup)
    indices = [info.pp_rank + v * p.pp for v in range(p.vpp)]
    stages = []
    for k, index in enumerate(indices):
        # The last local stage prunes the model itself; the others prune copies of the unpruned model.
        part = model if k == len(indices) - 1 else copy.deepcopy(model)
        part.blocks = nn.ModuleList(list(part.blocks)[bounds[index] : bounds[index + 1]])
        if index != 0:
            part.embed = part.pos = None
        if index != n_stages - 1:
            part.norm = part.head = None
        stages.append((index, part))
    return stages


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Megatron tensor parallelism on ``model``, in place (Shoeybi et al. 2019), following torchtitan's
    Llama plan. In each block q/k/v and the MLP's gate/up split by output columns, o_proj and down by
    input rows, so a block costs two all-reduces in forward (after attention and after the MLP) and
    two in backward. With ``sequence_parallel`` the norms run on sequence shards and those all-reduces
    become all-gather + reduce-scatter (Korthikanti et al. 2022).

    The embedding and the head are vocabulary-parallel: each TP rank keeps vocab / tp rows of the
    embedding (one all-reduce, or with SP a reduce-scatter, of its output) and computes the logits of
    its vocab / tp columns, which the loss reads in place (``loss_parallel``: cross-entropy over
    vocab-sharded logits, a few per-token all-reduces), so no rank holds the full logits. A tied head
    stays one weight: both shard the (vocab, hidden) matrix by rows. With learned positions the
    embedding's output is all-reduced and cut into sequence shards after the positions are added, as
    Megatron-LM does; with RoPE and SP it is reduce-scattered straight into them.

    ``loss_parallel`` must be active around the forward and backward of a step
    (``ParallelTrainer.micro_batch_context``).
    """
    seq = Shard(1)
    out = seq if sequence_parallel else Replicate()
    for block in model.blocks:
        plan: dict[str, object] = {
            "attn.q_proj": ColwiseParallel(),
            "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(),
            "attn.o_proj": RowwiseParallel(output_layouts=out),
            "mlp.up": ColwiseParallel(),
            "mlp.down": RowwiseParallel(output_layouts=out),
        }
        if block.mlp.swiglu:
            plan["mlp.gate"] = ColwiseParallel()
        # Attention and MLP take their input as one replicated DTensor (gathered from the sequence
        # shards under SP), so the gradients of q, k and v (gate and up) add up before one all-reduce
        # or reduce-scatter, as Megatron's fused QKV and gate-up projections do, not one each.
        plan |= {
            "attn": PrepareModuleInput(input_layouts=(out, None), desired_input_layouts=(Replicate(), None)),
            "mlp": PrepareModuleInput(input_layouts=(out,), desired_input_layouts=(Replicate(),)),
        }
        if sequence_parallel:
            plan |= {"norm1": SequenceParallel(), "norm2": SequenceParallel()}
        parallelize_module(block, tp_mesh, plan)
    # A pipeline stage holds the embedding (first stage), the head (last) or neither.
    tied = model.embed is not None and model.head is not None and model.head.weight is model.embed.weight
    edges: dict[str, object] = {}
    if model.head is not None:
        if sequence_parallel:
            edges["norm"] = SequenceParallel()
        edges["head"] = ColwiseParallel(input_layouts=out, output_layouts=Shard(-1), use_local_output=False)
    scatter = sequence_parallel and model.pos is None  # reduce-scatter straight into sequence shards
    if model.embed is not None and sequence_parallel and not scatter:
        # Between blocks the residual stream is this rank's sequence shard (a plain tensor): cut it
        # from the replicated embedding + positions.
        edges["blocks.0"] = PrepareModuleInput(
            input_layouts=(Replicate(), None), desired_input_layouts=(seq, None), use_local_output=True
        )
    parallelize_module(model, tp_mesh, edges)
    if model.embed is not None:
        # The head's plan shards a tied weight by rows already: the embedding takes that parameter.
        weight = (
            model.head.weight
            if tied
            else nn.Parameter(distribute_tensor(model.embed.weight.detach(), tp_mesh, [Shard(0)]))
        )
        model.embed = VocabParallelEmbedding(weight, seq if scatter else Replicate())


def vocab_rows_per_rank(vocab: int, tp: int) -> int:
    """Rows of a (vocab, hidden) weight on each TP rank but the last, as DTensor's Shard(0) splits it
    (torch.chunk's sizes: the last rank's shard may be shorter, or empty)."""
    return -(-vocab // tp)


class VocabParallelEmbedding(nn.Module):
    """An embedding whose (vocab, hidden) weight is a DTensor sharded by rows over a TP mesh (Megatron-
    LM's VocabParallelEmbedding): each rank looks up the tokens in its vocabulary range, zeroes the
    others, and the partial sums are all-reduced (``output`` Replicate) or reduce-scattered over the
    sequence (``output`` Shard(1)); the output is a plain tensor. Backward gives each rank the gradient
    of its own rows only, as a DTensor of the weight's placement (``parallelize_module``'s
    RowwiseParallel embedding computes the full vocab x hidden gradient on every rank and keeps it
    replicated)."""

    def __init__(self, weight: nn.Parameter, output: Shard | Replicate) -> None:
        super().__init__()
        if not (isinstance(weight, DTensor) and weight.placements == (Shard(0),)):
            raise ValueError(f"weight must be a DTensor sharded by rows (Shard(0)), got {type(weight).__name__}")
        self.weight, self.output = weight, output
        mesh = weight.device_mesh
        rows = vocab_rows_per_rank(weight.shape[0], mesh.size())
        self.first = rows * mesh.get_local_rank()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = self.weight.to_local()  # its backward hands the gradient back as a Shard(0) DTensor
        index = tokens - self.first
        outside = (index < 0) | (index >= local.shape[0])
        x = F.embedding(index.masked_fill(outside, 0), local).masked_fill(outside.unsqueeze(-1), 0.0)
        mesh = self.weight.device_mesh
        partial = DTensor.from_local(x, mesh, [Partial()], run_check=False)
        return partial.redistribute(mesh, [self.output]).to_local()


def apply_compile(model: Transformer) -> None:
    """torch.compile each block in place (torchtitan compiles per block: repeated blocks share one
    compiled graph, and TP/FSDP hooks stay at block boundaries)."""
    for block in model.blocks:
        block.compile()


def apply_fsdp(
    model: nn.Module, dp_mesh: DeviceMesh, *, reshard_after_forward: bool, cpu_offload: bool, precision: str
) -> None:
    """FSDP2 in place: ``fully_shard`` on each block, then on the root for the rest (embedding, norm,
    head). Parameters, gradients and optimizer states are sharded over dp. ``reshard_after_forward``
    frees the gathered weights after each block's forward (ZeRO-3, gathered again for backward); off,
    they stay until backward (ZeRO-2-like). ``cpu_offload`` keeps shards, gradients and the optimizer
    step on the host (FSDP2 CPUOffloadPolicy).

    ``precision`` 'bf16' or 'fp16': FSDP2's MixedPrecisionPolicy, as torchtitan's ``apply_fsdp`` sets it
    (param_dtype bf16, reduce_dtype fp32): the shards and the optimizer stay fp32, the gathers and the
    forward and backward run on 16-bit weights, and gradients are reduced and kept in fp32. Without
    it autocast casts each gathered fp32 weight itself, and those 16-bit copies are never sharded: every
    linear saves its copy for backward, and under full recompute autocast's cache keeps them all until
    the forward ends (fairscale PR #650), up to 2 bytes per parameter of the whole model on every rank.
    'fp32': no policy.
    """
    dtype = _DTYPES[precision]
    mixed = {"param_dtype": dtype, "reduce_dtype": torch.float32} if dtype != torch.float32 else {}
    kwargs = {
        "mesh": dp_mesh,
        "reshard_after_forward": reshard_after_forward,
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
        "mp_policy": MixedPrecisionPolicy(**mixed),
    }
    for block in [m for m in model.modules() if isinstance(m, Block)]:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def apply_ddp(
    model: nn.Module, dp_mesh: DeviceMesh, device: torch.device, find_unused: bool
) -> DistributedDataParallel:
    """``model`` under DDP over the dp group: full replicas, gradients averaged by bucketed all-reduce
    overlapping backward. ``find_unused`` for MoE, whose experts may receive no token on a rank."""
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=dp_mesh.get_group(),
        find_unused_parameters=find_unused,
    )


def _apply_data_parallel(module: nn.Module, setup: Setup, info: ParallelInfo) -> nn.Module:
    """``module`` under FSDP2 (zero >= 1, in place) or DDP (zero 0, dp > 1), else unchanged."""
    p = setup.parallel
    if p.zero >= 1:
        # FSDP2 has no stage that shards only optimizer states: ZeRO-1 runs as ZeRO-2 (gradients
        # reduce-scattered too), which moves the same bytes as ZeRO-1's all-reduce (Rajbhandari et al.).
        apply_fsdp(
            module,
            info.mesh["dp"],
            reshard_after_forward=p.zero == 3,
            cpu_offload=p.offload != "none",
            precision=setup.train.precision,
        )
        return module
    if p.dp > 1:
        return apply_ddp(module, info.mesh["dp"], info.device, find_unused=setup.model.is_moe)
    return module


# -- trainers --------------------------------------------------------------------------------------


def _param_groups(module: nn.Module) -> list[dict]:
    """``module``'s parameters as optimizer groups of DTensors and of plain tensors: a foreach or fused
    optimizer kernel refuses to mix the two ("got mixed torch.Tensor and DTensor"), and tensor
    parallelism leaves some parameters plain (the norms without SP, learned positions; see apply_tp)."""
    params = list(module.parameters())
    groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    return [{"params": g} for g in groups if g]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass(kw_only=True)
class ParallelTrainer(Trainer):
    """The single-process Trainer on one rank of a layout: DDP's all-reduce runs on the last
    micro-batch only, the logged loss is averaged over the data-parallel ranks, and state is counted
    as this rank's shards."""

    info: ParallelInfo

    def micro_batch_context(self, last: bool) -> AbstractContextManager:
        """DDP's ``no_sync`` on all but the step's last micro-batch (gradients accumulate locally, one
        all-reduce per step); FSDP reduce-scatters every micro-batch, as ZeRO-2/3 keep gradients sharded.
        Under TP, ``loss_parallel`` around forward and backward: the loss reads vocab-sharded logits."""
        stack = ExitStack()
        if isinstance(self.model, DistributedDataParallel) and not last:
            stack.enter_context(self.model.no_sync())
        if self.info.tp > 1:
            stack.enter_context(loss_parallel())  # the head's logits stay vocab-sharded (apply_tp)
        return stack

    def finalize_grads(self) -> None:
        """Reduces each gradient left ``Partial`` to its parameter's placements, once per step, before the
        optimizer reads it: under sequence parallelism the norms' weight gradients (each TP rank holds
        its sequence shard's sum), as Megatron-LM's ``finalize_model_grads`` all-reduces them. Left to
        the optimizer, torch before 2.13 kept SGD's momentum buffer ``Partial`` and stepped the norms
        wrongly (0.25 off a weight after 3 steps on torch 2.11; 3e-8 here)."""
        for param in self.model.parameters():
            grad = param.grad
            if isinstance(grad, DTensor) and any(isinstance(pl, Partial) for pl in grad.placements):
                param.grad = grad.redistribute(grad.device_mesh, param.placements)

    def reduce_loss(self, loss_sum: torch.Tensor) -> float:
        """The step's loss averaged over the data-parallel ranks (one all-reduce, outside the timed step)."""
        # Each data-parallel replica counts once: its TP ranks hold equal losses and only the last
        # pipeline stage has one.
        counts = self.info.tp_rank == 0 and self.info.is_last_stage
        share = loss_sum.detach().clone() if counts else torch.zeros((), device=self.device)
        dist.all_reduce(share)
        return share.item() / self.info.dp

    def state_bytes(self) -> dict[str, int]:
        """Bytes of this rank's parameters and optimizer state (its shards under FSDP and TP), split by
        where the optimizer state lives (device vs host under CPU offload)."""
        params = sum(_local(p).numel() * _local(p).element_size() for p in self.model.parameters())
        device = host = 0
        for st in self.optimizer.state.values():
            for v in st.values():
                if torch.is_tensor(v) and v.dim() > 0:
                    local = _local(v)
                    nbytes = local.numel() * local.element_size()
                    if local.device.type == self.device.type:
                        device += nbytes
                    else:
                        host += nbytes
        return {"params_bytes": params, "optimizer_device_bytes": device, "optimizer_host_bytes": host}


class _ChunkTimes:
    """Forward and backward compute of the pipeline chunks on this rank, timed as they run."""

    def __init__(self, device: torch.device) -> None:
        self.clock = _Clock(device)
        self.marks: list[tuple[str, object, object]] = []

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        with phase(name):
            start = self.clock.mark()
            yield
            self.marks.append((name, start, self.clock.mark()))

    def total_ms(self, name: str) -> float:
        return sum(self.clock.ms(a, b) for n, a, b in self.marks if n == name)


class _TimedStage(PipelineStage):
    """A PipelineStage whose forward and backward chunks are NVTX/record_function ranges and timed."""

    def __init__(self, *args, times: _ChunkTimes, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.times = times

    def forward_one_chunk(self, *args, **kwargs):
        with self.times.timed("forward"):
            return super().forward_one_chunk(*args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        with self.times.timed("backward"):
            return super().backward_one_chunk(*args, **kwargs)


class _Autocast(nn.Module):
    """A pipeline stage's model under torch.autocast. The schedule runs the stage's forward itself (and
    once more to infer the shapes it sends), so autocast must live inside the stage's module."""

    def __init__(self, model: Transformer, device_type: str, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.model, self.device_type, self.dtype = model, device_type, dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device_type, dtype=self.dtype, enabled=self.dtype is not None):
            return self.model(x)


@dataclass(kw_only=True)
class PipelineTrainer(ParallelTrainer):
    """One rank of a pipeline: the schedule runs grad_accum micro-batches through this rank's stages;
    phases are those of ``PIPELINE_PHASES``."""

    schedule: PipelineScheduleSingle | PipelineScheduleMulti
    stage_models: list[Transformer]
    """This rank's stages (unwrapped), in stage order."""
    times: _ChunkTimes
    tied_group: dist.ProcessGroup | None = None
    """First and last stage of this pipeline when embedding and head share one weight (else None)."""

    def step(self, batches: Iterator[torch.Tensor]) -> None:
        """One optimizer step over grad_accum micro-batches through the pipeline; appends per-phase
        times (ms) and the loss (of the last stage, averaged over data-parallel ranks)."""
        info = self.info
        clock = self.times.clock  # one clock for the step and its chunks: one sync makes all readable
        self.times.marks.clear()
        losses: list[torch.Tensor] = []
        with phase("step"):
            with phase("data"):
                t0 = clock.mark()
                # Only the first stage reads tokens and only the last reads targets (rank_loader gives
                # the middle stages no batches).
                args: tuple[torch.Tensor, ...] = ()
                target = None
                if info.is_first_stage or info.is_last_stage:
                    micro = [next(batches) for _ in range(self.grad_accum)]
                    batch = torch.cat(micro).to(self.device, non_blocking=True)
                    # Contiguous: the stage checks its input's strides against the shapes it inferred
                    # (torch 2.11 refuses the (s + 1, 1) strides of a slice; 2.13 no longer checks).
                    args = (batch[:, :-1].contiguous(),) if info.is_first_stage else ()
                    target = batch[:, 1:].contiguous() if info.is_last_stage else None
                t1 = clock.mark()
            # The schedule splits the batch back into grad_accum micro-batches (the same samples as the
            # single-process step's) and divides the gradients by grad_accum (scale_grads).
            # The last stage's loss and backward run inside the schedule (vocab-sharded logits under TP).
            with loss_parallel() if info.tp > 1 else nullcontext():
                self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
            self._sum_tied_gradients()
            t2 = clock.mark()
            with phase("optimizer"):
                self.finalize_grads()
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                t3 = clock.mark()
        clock.sync()
        forward_ms, backward_ms = self.times.total_ms("forward"), self.times.total_ms("backward")
        times = {
            "data": clock.ms(t0, t1),
            "forward": forward_ms,
            "backward": backward_ms,
            "pipeline_wait": max(0.0, clock.ms(t1, t2) - forward_ms - backward_ms),
            "optimizer": clock.ms(t2, t3),
        }
        for k, v in times.items():
            self.phase_ms[k].append(v)
        loss_sum = torch.stack(losses).mean() if losses else torch.zeros((), device=self.device)
        self.losses.append(self.reduce_loss(loss_sum))

    def _sum_tied_gradients(self) -> None:
        # Embedding (first stage) and head (last stage) are one weight in the single-process model:
        # each stage updates its copy with the sum of both gradients, so the copies stay equal
        # (Megatron-LM's embedding-group all-reduce, Shoeybi et al. 2019).
        if self.tied_group is None:
            return
        info = self.info
        first, last = self.stage_models[0], self.stage_models[-1]
        weight = first.embed.weight if info.is_first_stage else last.head.weight
        grad = _local(weight.grad)
        buf = grad if grad.device == self.device else grad.to(self.device)  # CPU-offloaded shards
        with phase("tied_grad_all_reduce"):
            dist.all_reduce(buf, group=self.tied_group)
        if buf is not grad:
            grad.copy_(buf)


def _tied_group(info: ParallelInfo) -> dist.ProcessGroup | None:
    """The two-rank group of this rank's first and last pipeline stage (None for the middle stages).
    Every rank creates every pair's group, in the same order, as ``new_group`` requires."""
    ranks = info.mesh.mesh  # (pp, dp, tp) -> global rank
    mine = None
    for d in range(info.dp):
        for t in range(info.tp):
            pair = [int(ranks[0, d, t]), int(ranks[-1, d, t])]
            group = dist.new_group(pair)
            if info.rank in pair:
                mine = group
    return mine


def build_parallel_trainer(
    setup: Setup, device: torch.device, info: ParallelInfo, *, seed: int = 0, compile_model: bool = False
) -> Trainer:
    """This rank's Trainer for ``setup``'s layout (a PipelineTrainer when pp > 1). Every rank builds the
    full model from ``seed`` on ``device`` (the weights of ``step.build_trainer``'s model) and then
    keeps its part, so a rank briefly holds the whole model in fp32. Raises AdvisorError."""
    check_supported(setup, device.type)
    check_step_options(setup, compile_model)
    t, p = setup.train, setup.parallel
    torch.manual_seed(seed)
    model = build_model(
        setup.model, t.recompute, device=device, flash=t.flash_attention, recompute_layers=t.recompute_layers
    )
    model.train()
    dtype = _DTYPES[t.precision]
    autocast_dtype = None if dtype == torch.float32 else dtype
    common = {
        "setup": setup,
        "device": device,
        "scaler": torch.amp.GradScaler(device.type) if t.precision == "fp16" else None,
        "autocast_dtype": autocast_dtype,
        "grad_accum": setup.grad_accum,
        "info": info,
    }
    # Order as torchtitan's parallelize_llama: pipeline split, TP, activation checkpointing (inside
    # the model), compile, then data parallelism, which must see the final (DTensor) parameters.
    parts = [(0, model)] if p.pp == 1 else split_pipeline(model, setup, info)
    for _, part in parts:
        if p.tp > 1:
            apply_tp(part, info.mesh["tp"], p.sequence_parallel)
        if compile_model:
            apply_compile(part)
    if p.pp == 1:
        offloader = attach_offloader(model, setup, device)  # hooks around each block, under FSDP2 too
        wrapped = _apply_data_parallel(model, setup, info)
        optimizer = build_optimizer(_param_groups(wrapped), t.optimizer, t.optimizer_impl)
        return ParallelTrainer(model=wrapped, optimizer=optimizer, offloader=offloader, **common)

    times = _ChunkTimes(device)
    pp_group = info.mesh.get_group("pp")
    n_stages = p.pp * p.vpp
    stages, modules = [], []
    for index, part in parts:
        module = _apply_data_parallel(_Autocast(part, device.type, autocast_dtype), setup, info)
        modules.append(module)
        stages.append(_TimedStage(module, index, n_stages, device, group=pp_group, times=times))

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with times.timed("forward"):  # the loss ends the last stage's forward
            return lm_loss(logits, targets)

    m = setup.grad_accum
    if p.vpp > 1:
        schedule: PipelineScheduleSingle | PipelineScheduleMulti = ScheduleInterleaved1F1B(
            stages, n_microbatches=m, loss_fn=loss_fn
        )
    elif m >= p.pp:
        schedule = Schedule1F1B(stages[0], n_microbatches=m, loss_fn=loss_fn)
    else:
        # torch's 1F1B needs at least as many micro-batches as stages; with fewer, 1F1B has no steady
        # state and is GPipe's fill and drain anyway.
        schedule = ScheduleGPipe(stages[0], n_microbatches=m, loss_fn=loss_fn)
    container = nn.ModuleList(modules)
    optimizer = build_optimizer(_param_groups(container), t.optimizer, t.optimizer_impl)
    return PipelineTrainer(
        model=container,
        optimizer=optimizer,
        phase_ms={k: [] for k in PIPELINE_PHASES},
        schedule=schedule,
        stage_models=[part for _, part in parts],
        times=times,
        tied_group=_tied_group(info) if setup.model.tied_embeddings else None,
        **common,
    )


def rank_loader(
    setup: Setup,
    info: ParallelInfo,
    n_steps: int,
    num_workers: int,
    pin_memory: bool,
    seed: int,
    delay_ms: float = 0.0,
    extra_micro_batches: int = 0,
) -> DataLoader:
    """This rank's micro-batches (micro_batch sequences of seq_len + 1 tokens) for ``n_steps`` steps,
    and ``extra_micro_batches`` more (those the profiled step takes off its workers' prefetch).

    Global micro-batch j is samples [j*B, (j+1)*B) of ``step.SyntheticTokens`` with B = micro_batch x dp,
    as ``step.make_loader`` reads them for the single-process step with micro_batch x dp; data-parallel
    rank r takes the r-th contiguous slice of micro_batch samples. TP ranks of one replica read the same
    samples; in a pipeline only the first and last stage read (tokens and targets), the middle stages
    get an empty loader.
    """
    b, B = setup.train.micro_batch, setup.train.micro_batch * info.dp
    n_micro = n_steps * setup.grad_accum + extra_micro_batches
    data = SyntheticTokens(setup.model.vocab, setup.train.seq_len, n_micro * B, seed, delay_ms)
    reads = info.is_first_stage or info.is_last_stage
    start = info.dp_rank * b
    batches = [list(range(j * B + start, j * B + start + b)) for j in range(n_micro if reads else 0)]
    return DataLoader(data, batch_sampler=batches, pin_memory=pin_memory, **loader_options(num_workers))
