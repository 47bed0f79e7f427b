"""The roofline view of a CPU trace: FLOPs and bytes of each op, and whether it is bound by compute,
by memory bandwidth or by per-call latency against the machine's roofs.

The shapes come from the Kineto ``args`` the loader keeps for the modelled ops beside the event table
(``advisor.trace.table.EventArgs``): the trace is parsed once. FLOPs and bytes come from the input shapes by formula; the counting
conventions follow the roofline model (Williams, Waterman, Patterson, CACM 52(4), 2009): one
multiply-add is 2 FLOPs, bytes are the compulsory traffic (every input read once, every output written
once; cache reuse inside the op is the op's business). An op nested in another modelled op is counted
once, at the outermost modelled level: the op the model code called carries the work and the time of
the ops it calls (``aten::linear`` -> ``aten::t``, ``aten::mm``; an attention backward -> its
``aten::zero_`` of the gradient buffers), so nothing is counted twice and no op loses its work to a
helper it calls.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from advisor.analysis.breakdown import conv_math, gemm_math, kernel_category
from advisor.errors import AdvisorError, TraceError
from advisor.spec.ceilings import Ceilings
from advisor.spec.specs import HardwareSpec
from advisor.trace.table import GPU_KINDS, EventArgs, kind_mask

BOUNDS = ("compute", "memory", "latency", "communication")
"""Verdicts: against the compute roof, the memory roof, too short to reach either, or a collective
(bound by the network, judged in ``advisor.analysis.collectives``)."""
FUSABLE = ("elementwise", "reduction", "normalization")
"""Op classes a compiler fuses into one kernel when they are memory-bound: each fused chain reads its
inputs and writes its output once instead of once per op."""
SOFTMAX_OPS = ("aten::_softmax", "aten::softmax", "aten::_softmax_backward_data")
"""The ops whose 4-D ``[batch, heads, s, s]`` input marks unfused attention's score chain on a CPU
(``cpu_score_chain``)."""

_ELEMENT_BYTES = {
    "float": 4,
    "double": 8,
    "c10::BFloat16": 2,
    "c10::Half": 2,
    "c10::Float8_e4m3fn": 1,
    "c10::Float8_e5m2": 1,
    "long int": 8,
    "int": 4,
    "short int": 2,
    "signed char": 1,
    "unsigned char": 1,
    "bool": 1,
}
_PRECISION = {
    "float": "fp32",
    "double": "fp32",
    "c10::BFloat16": "bf16",
    "c10::Half": "fp16",
    "c10::Float8_e4m3fn": "fp8",
    "c10::Float8_e5m2": "fp8",
}

LATENCY_ROOF_FRAC = 0.10
"""An op reaching less than this share of its roof may be latency-bound (see ``LATENCY_CALL_US``)."""
LATENCY_CALL_US = {"cpu": 20.0, "gpu": 10.0}
"""Mean call time under which a slow op counts as latency-bound rather than compute- or memory-bound.
CPU: one aten op has a fixed cost of dispatch, allocation and an OpenMP fork of ~4-10 us (the shipped
tiny run: fill_ of 256 floats 4.5 us, copy_ of 256 int64 8.2 us), so below ~20 us that fixed cost is at
least a third of the call. GPU: a kernel launch costs ~3-5 us and a short grid never fills all SMs, so
kernels under ~10 us are dominated by ramp-up and tail."""

GEMM_CALL_FIXED_US = 10.0
"""A CPU GEMM call's fixed cost in us, whatever its size or precision: dispatch, autocast's cast, the
output's allocation, the BLAS/oneDNN call and its thread fork, the profiler's record. Recorded at 2-11
us a call on an AVX512-BF16 EPYC (``bench/cpu_gemm_call.py``, ``bench/results/cpu_gemm_call.md``).
Leaving a precision that runs slower than fp32 on the CPU (an emulated scalar loop), only this much a
call of the GEMMs' time stays (``gemm_fixed_frac``; ``advisor.advice.gains._class_speedups``)."""

_MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul"}
_ATTN_FWD = {
    "aten::scaled_dot_product_attention",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
}
_ATTN_BWD = {n + "_backward" for n in _ATTN_FWD}
# is_causal's position where the first boolean argument is something else (compute_log_sumexp).
_CAUSAL_ARG = {"aten::_scaled_dot_product_efficient_attention": 6, "aten::_scaled_dot_product_cudnn_attention": 6}
_ELEMENTWISE = {
    f"aten::{n}{s}"
    for n in (
        "add",
        "sub",
        "mul",
        "div",
        "neg",
        "pow",
        "rsqrt",
        "sqrt",
        "exp",
        "log",
        "reciprocal",
        "silu",
        "gelu",
        "relu",
        "sigmoid",
        "tanh",
        "where",
        "masked_fill",
        "clamp",
        "addcmul",
        "addcdiv",
        "lerp",
        "maximum",
        "minimum",
        "silu_backward",
        "gelu_backward",
        "threshold_backward",
        "sigmoid_backward",
        "tanh_backward",
    )
    for s in ("", "_")
}
_MOVEMENT = {"aten::copy_", "aten::fill_", "aten::zero_", "aten::clone", "aten::cat", "aten::index_select"}
# FLOPs per element of the normalised tensor; exp, log and rsqrt count as one FLOP each.
_ROWWISE_FLOPS = {
    "aten::_softmax": 5,  # max, subtract, exp, sum, divide
    "aten::_log_softmax": 5,  # max, subtract, exp, sum, subtract log
    "aten::_softmax_backward_data": 3,  # y * g, row sum, y * (g - sum)
    "aten::_log_softmax_backward_data": 4,  # exp(y), row sum of g, multiply, subtract
    "aten::native_layer_norm": 7,  # mean, subtract, square, sum, scale by rstd, weight, bias
    "aten::native_layer_norm_backward": 14,  # ~2x forward: recompute x_hat, two row sums, combine
    "aten::_fused_rms_norm": 4,  # square, sum, scale by rsqrt, weight
    "aten::_fused_rms_norm_backward": 8,  # ~2x forward
    "aten::sum": 1,
    "aten::mean": 1,
    "aten::amax": 1,
    "aten::norm": 2,  # square, sum
}
# Fused optimizer steps over fp32 tensors: (bytes per parameter element, FLOPs per element).
_FUSED_OPT = {
    # AdamW: param r+w, grad r, exp_avg r+w, exp_avg_sq r+w = 7 fp32 accesses; FLOPs: decay 1,
    # m update 3, v update 4, sqrt(v)/bc2 + eps 3, param update 3.
    "aten::_fused_adamw_": (7 * 4, 14),
    "aten::_fused_adam_": (7 * 4, 13),
    # SGD with momentum: param r+w, grad r, buffer r+w; FLOPs: buffer update 2, param update 2.
    "aten::_fused_sgd_": (5 * 4, 4),
}


@dataclass(frozen=True)
class TraceWork:
    """What the roofline needs from one Kineto trace file: its framework ops with their shapes, its
    GPU work (kernels, copies, sets) linked to the op that launched it, and the devices it names."""

    ops: pd.DataFrame
    """One row per ``cpu_op``: name, tid, start_us, dur_us, input_dims (list per argument; [] for
    scalars), input_types, concrete_inputs (literal scalar arguments as strings), flops (the profiler's
    own count where the trace carries one, else NaN), in_optimizer (the op starts inside an
    ``optimizer`` range on its thread: the optimizer step, which compiling the model leaves eager).
    The three argument columns are kept for the ops in MODELLED_OPS and those with a FLOP count; other
    ops (views, allocations) have them empty."""
    kernels: pd.DataFrame
    """One row per GPU event: name, kind ('kernel', 'memcpy', 'memset'), start_us, dur_us, bytes
    (copies and sets), launch_op (index into ``ops`` of the innermost op around the runtime call that
    launched it, -1 if none)."""
    gpus: list = field(default_factory=list)
    """(name, memory bytes) of each device in the trace's deviceProperties."""
    profiler_steps: int = 0
    file: str = ""


def trace_work(events: pd.DataFrame) -> TraceWork:
    """The ops, GPU events and devices of a Kineto event table's rank 0 (or its lowest rank), from the
    table and the op arguments its loader kept (``advisor.analysis.summary.load_trace``): the trace is
    parsed once. A kernel is linked to its op through its correlation id: the runtime call with the
    same id (cudaLaunchKernel...) runs inside the op on the op's thread, so the innermost op that
    spans that call launched it. An Nsight Systems table gives its kernels without ops (it records no
    shapes). Raises TraceError on a table with neither ops nor GPU events, or without kept arguments."""
    if events.attrs.get("source") == "nsys":
        return _work_from_events(events)
    kept = EventArgs.of(events)
    if kept is None:
        raise TraceError("the event table has no op arguments: load it with advisor.analysis.summary.load_trace")
    rank = events["rank"].to_numpy()
    r0 = 0 if (rank == 0).any() or not len(rank) else int(rank.min())
    ev = events[rank == r0]
    base = int(ev["start_ns"].min()) if len(ev) else 0  # small times: exact in float microseconds
    ops = _ops_of(ev[kind_mask(ev, "cpu_op")], kept, base)
    ops["in_optimizer"] = _inside(ops, ev[kind_mask(ev, "annotation") & (ev["name"] == "optimizer")], base)
    gpu = ev[kind_mask(ev, *GPU_KINDS)]
    kernels = pd.DataFrame(
        {
            "name": gpu["name"].astype(str).to_numpy(),
            "kind": gpu["kind"].astype(str).to_numpy(),
            "start_us": (gpu["start_ns"].to_numpy() - base) / 1e3,
            "dur_us": gpu["dur_ns"].to_numpy() / 1e3,
            "bytes": gpu["bytes"].to_numpy(),
        }
    )
    if ops.empty and kernels.empty:
        raise TraceError(
            f"{_file_of(events, r0)} holds no cpu_op or GPU events (was the profiler run without activities?)"
        )
    calls = ev[kind_mask(ev, "runtime") & (ev["correlation"].to_numpy() >= 0)]
    spans = zip(
        calls["tid"].tolist(),
        ((calls["start_ns"] - base) / 1e3).tolist(),
        (calls["dur_ns"] / 1e3).tolist(),
        strict=True,
    )
    runtime = dict(zip(calls["correlation"].tolist(), spans, strict=True))
    kernels["launch_op"] = _launching_ops(ops, gpu["correlation"].tolist(), runtime)
    host = kind_mask(ev, "annotation") & (ev["tid"].to_numpy() != -1)
    steps = int(ev["name"][host].astype(str).str.startswith("ProfilerStep#").sum())
    device = (events.attrs.get("devices") or {}).get(r0)
    return TraceWork(ops, kernels, [device] if device else [], steps, _file_of(events, r0))


def _inside(ops: pd.DataFrame, ranges: pd.DataFrame, base: int) -> np.ndarray:
    """True for each op that starts inside one of ``ranges`` (annotation rows) on the same thread."""
    inside = np.zeros(len(ops), dtype=bool)
    tid, start = ops["tid"].to_numpy(), ops["start_us"].to_numpy()
    for t, s0, d in zip(ranges["tid"].tolist(), ranges["start_ns"].tolist(), ranges["dur_ns"].tolist(), strict=True):
        s0_us = (s0 - base) / 1e3
        inside |= (tid == t) & (start >= s0_us) & (start < s0_us + d / 1e3)
    return inside


def _file_of(events: pd.DataFrame, rank: int) -> str:
    """The trace file a rank's events came from, for messages."""
    return (events.attrs.get("rank_files") or {}).get(rank) or f"rank {rank}"


def _ops_of(rows: pd.DataFrame, kept: EventArgs, base: int) -> pd.DataFrame:
    """TraceWork.ops of a rank's cpu_op rows: the argument columns for the ops in MODELLED_OPS and
    those with a FLOP count (what the roofline reads), empty for the rest (views, allocations)."""
    names = rows["name"].astype(str).tolist()
    args = [kept.get(i) for i in rows.index.tolist()]
    full = [n in MODELLED_OPS or "flops" in a for n, a in zip(names, args, strict=True)]
    flops = [a.get("flops") for a in args]
    return pd.DataFrame(
        {
            "name": names,
            "tid": rows["tid"].to_numpy(),
            "start_us": (rows["start_ns"].to_numpy() - base) / 1e3,
            "dur_us": rows["dur_ns"].to_numpy() / 1e3,
            "input_dims": [a.get("Input Dims", []) if k else [] for a, k in zip(args, full, strict=True)],
            "input_types": [a.get("Input type", []) if k else [] for a, k in zip(args, full, strict=True)],
            "concrete_inputs": [a.get("Concrete Inputs", []) if k else [] for a, k in zip(args, full, strict=True)],
            "flops": [float(x) if isinstance(x, (int, float)) else math.nan for x in flops],
        }
    )


def wants_args(name: str) -> bool:
    """The events whose recorded arguments the roofline reads: the ops it models."""
    return name in MODELLED_OPS


def _launching_ops(ops: pd.DataFrame, correlations: list, runtime: dict) -> np.ndarray:
    """For each correlation id, the index of the innermost op (on the runtime call's thread) whose
    span holds the runtime call with that id; -1 where there is no such call or op."""
    calls = {c: runtime[c] for c in correlations if c in runtime}
    by_tid: dict[int, list] = {}
    for i, (tid, start, dur) in enumerate(zip(ops["tid"], ops["start_us"], ops["dur_us"], strict=True)):
        by_tid.setdefault(tid, []).append((start, -dur, 0, i))
    for c, (tid, start, dur) in calls.items():
        if tid in by_tid:
            by_tid[tid].append((start, -dur, 1, c))
    found: dict[int, int] = {}
    for events in by_tid.values():
        events.sort(key=lambda x: (x[0], x[1], x[2]))
        stack: list[tuple[float, int]] = []  # (end, op index)
        for start, neg_dur, is_call, ref in events:
            while stack and stack[-1][0] <= start:  # ops that ended before this event began
                stack.pop()
            if is_call:
                found[ref] = stack[-1][1] if stack else -1
            else:
                stack.append((start - neg_dur, ref))
    return np.array([found.get(c, -1) for c in correlations], dtype=np.int64)


def op_shapes(events: pd.DataFrame) -> pd.DataFrame:
    """The framework ops of a Kineto event table with their recorded shapes (``TraceWork.ops``);
    ``df.attrs['profiler_steps']`` counts the ProfilerStep#N ranges."""
    work = trace_work(events)
    if work.ops.empty:
        raise TraceError(f"{work.file} holds no cpu_op events (was the profiler run without CPU activity?)")
    df = work.ops
    df.attrs["profiler_steps"] = work.profiler_steps
    return df


def _numel(dims: object) -> int:
    return int(np.prod(dims)) if isinstance(dims, list) and dims else 0


def _tensors(dims: list, types: list) -> list[tuple[list, int]]:
    """(shape, element bytes) of each tensor argument (scalars and lists skipped; a 0-dim tensor has
    shape [] and one element)."""
    out = []
    for i, d in enumerate(dims):
        t = types[i] if i < len(types) else ""
        if t in _ELEMENT_BYTES and isinstance(d, list) and all(isinstance(x, int) for x in d):
            out.append((d, _ELEMENT_BYTES[t]))
    return out


def _bool_arg(concrete: list, name: str) -> bool:
    if name in _CAUSAL_ARG:
        i = _CAUSAL_ARG[name]
        return i < len(concrete) and concrete[i] == "True"
    for c in concrete:
        if c in ("True", "False"):
            return c == "True"
    return False


def op_work(
    name: str, dims: list, types: list, concrete: list, optimizer_params: int = 0
) -> tuple[float, float] | None:
    """(FLOPs, bytes) of one op call from its recorded input shapes; None when the op has no model
    here (views, allocations, autograd nodes), its shapes were not recorded, or its arguments are
    not what the model expects (an odd trace never stops the analysis)."""
    try:
        return _op_work(name, dims, types, concrete, optimizer_params)
    except (ArithmeticError, IndexError, KeyError, TypeError, ValueError):
        return None


def _op_work(name: str, dims: list, types: list, concrete: list, optimizer_params: int) -> tuple[float, float] | None:
    ts = _tensors(dims, types)
    size = [_numel(d) if d else 1 for d, _ in ts]
    moved = float(sum(n * e for n, (_, e) in zip(size, ts, strict=True)))
    e0 = ts[0][1] if ts else 4
    if name in _FUSED_OPT:
        per_byte, per_flop = _FUSED_OPT[name]
        return (float(per_flop * optimizer_params), float(per_byte * optimizer_params)) if optimizer_params else None
    if not ts:
        return None
    if name in _MATMUL:
        mats = [d for d, _ in ts if len(d) >= 2]
        if name in ("aten::addmm", "aten::baddbmm"):
            mats = mats[-2:]
        if len(mats) < 2:
            return None
        a, b = mats[0], mats[1]
        if name == "aten::linear" or len(b) == 2:
            # Leading dims of a (rows of a 3-D linear input, a batch against one matrix) fold into M;
            # linear's weight is [out, in].
            m, k = _numel(a[:-1]), a[-1]
            n = b[0] if name == "aten::linear" else b[-1]
        else:  # batched: the batch dims broadcast (bmm: equal; matmul: [m, k] @ [B, k, n] too)
            batch = _numel(list(np.broadcast_shapes(tuple(a[:-2]), tuple(b[:-2])))) or 1
            m, k, n = batch * a[-2], a[-1], b[-1]
        # 2*M*N*K as torch.profiler counts mm/addmm/bmm (the bias add of addmm, M*N, left out).
        return 2.0 * m * n * k, moved + m * n * e0
    if name in _ATTN_FWD or name in _ATTN_BWD:
        bwd = name in _ATTN_BWD
        q, k = (ts[1][0], ts[2][0]) if bwd else (ts[0][0], ts[1][0])
        if len(q) != 4 or len(k) != 4:
            return None
        b, h, sq, d = q
        sk = k[2]
        # Forward: QK^T and PV, 2 matmuls of 2*b*h*sq*sk*d each; backward recomputes QK^T and does
        # dV, dP, dQ, dK: 5 matmuls, 2.5x forward (FlashAttention-2, Dao 2023, section 3.1).
        flops = (10.0 if bwd else 4.0) * b * h * sq * sk * d
        if _bool_arg(concrete, name):
            flops /= 2  # causal: only the lower triangle of the score matrix is computed
        out = sum(_numel(t) for t, _ in ts[1:4]) if bwd else _numel(q)  # dq, dk, dv or the output
        return flops, moved + out * e0
    if name in _CONV_ARGS or name == "aten::convolution_backward":
        return _conv_work(name, ts, concrete)
    if name in _ELEMENTWISE:
        shapes = [d for d, _ in ts]
        try:
            n_out = _numel(list(np.broadcast_shapes(*[tuple(s) for s in shapes]))) or 1
        except ValueError:
            return None
        # One FLOP per output element: even a gelu's ~8 is far below any machine's ridge point. The
        # output has the widest input's element size (where's bool condition is not it).
        return float(n_out), moved + n_out * max(e for _, e in ts)
    if name in _ROWWISE_FLOPS:
        n_in = size[0]
        reduce = name in ("aten::sum", "aten::mean", "aten::amax", "aten::norm")
        # Reductions write a small output (counted only where the trace passes an out= tensor);
        # softmax and norms write a tensor of the input's size.
        return float(_ROWWISE_FLOPS[name] * n_in), moved + (0 if reduce else n_in * e0)
    if name in _MOVEMENT:
        if name == "aten::index_select" and len(ts) >= 2:
            table, idx = ts[0][0], size[-1]
            row = _numel(table[1:]) if len(table) > 1 else 1
            return 0.0, 2.0 * idx * row * e0 + idx * ts[-1][1]  # rows read and written, indices read
        if name in ("aten::fill_", "aten::zero_"):
            return 0.0, float(size[0] * e0)  # written only
        if name == "aten::copy_":
            if len(ts) < 2:
                return None
            return 0.0, float(size[0] * ts[0][1] + size[1] * ts[1][1])  # dst written, src read
        return 0.0, 2.0 * moved  # clone, cat: read everything, write it once
    if name == "aten::embedding_dense_backward" and len(ts) >= 2:
        vocab = int(concrete[2]) if len(concrete) > 2 and concrete[2].lstrip("-").isdigit() else 0
        row = ts[0][0][-1]
        # grad rows read and accumulated into a zeroed [vocab, hidden] table: one add per element.
        return float(size[0]), moved + vocab * row * e0
    if name == "aten::nll_loss_backward" and len(ts) >= 3:
        # grad_output, self, target[, weight], total_weight: the full gradient written, target read.
        return 0.0, float(size[1] * ts[1][1] + size[2] * ts[2][1])
    return None


# Argument positions of (stride, padding, dilation, transposed) in the convolution ops that carry the
# model's view of a convolution (the cudnn_/mkldnn_ variants below them order theirs differently and
# are left to these, their callers); None: the op has no transposed flag.
_CONV_ARGS = {
    "aten::convolution": (3, 4, 5, 6),
    "aten::_convolution": (3, 4, 5, 6),
    "aten::conv1d": (3, 4, 5, None),
    "aten::conv2d": (3, 4, 5, None),
    "aten::conv3d": (3, 4, 5, None),
}


def _int_list(text: str, n: int) -> list[int] | None:
    try:
        v = json.loads(text)
    except (TypeError, ValueError):
        return None
    v = [v] if isinstance(v, int) else v
    if not isinstance(v, list) or not all(isinstance(x, int) for x in v):
        return None
    return v * n if len(v) == 1 else v


def _conv_work(name: str, ts: list, concrete: list) -> tuple[float, float] | None:
    """Convolution: every output element is a dot product over C_in/groups x kernel inputs, so
    forward FLOPs are 2 x N x prod(output spatial) x numel(weight) (the bias add left out, as for
    addmm). The backward computes the input gradient and the weight gradient, each as many FLOPs as
    the forward (per its output_mask)."""
    bwd = name == "aten::convolution_backward"
    shapes = [d for d, _ in ts]
    if len(shapes) < (3 if bwd else 2):
        return None
    x, w = (shapes[1], shapes[2]) if bwd else (shapes[0], shapes[1])
    nd = len(w) - 2
    if nd < 1 or len(x) != nd + 2:
        return None
    e = ts[0][1]
    if bwd:
        out = shapes[0]
        if len(out) != nd + 2 or (len(concrete) > 7 and concrete[7] == "True"):
            return None  # a transposed convolution's backward: not modelled
        flags = re.findall(r"True|False", concrete[10]) if len(concrete) > 10 else []
        # output_mask = [input, weight, bias]; where the trace does not render it, both gradients.
        grads = flags[:2].count("True") if len(flags) == 3 else 2
        macs = out[0] * _numel(out[2:]) * _numel(w)
        moved = sum(_numel(d) * b for d, b in ts[:3]) + (_numel(x) + _numel(w)) * e
        return 2.0 * macs * grads, float(moved)
    i_stride, i_pad, i_dil, i_trans = _CONV_ARGS[name]
    if i_trans is not None and len(concrete) > i_trans and concrete[i_trans] == "True":
        return None
    if len(concrete) <= max(i_stride, i_pad, i_dil):
        return None  # the trace has no literal arguments: the output size is unknown
    stride, pad, dil = (_int_list(concrete[i], nd) for i in (i_stride, i_pad, i_dil))
    if stride is None or pad is None or dil is None or len({len(stride), len(pad), len(dil), nd}) != 1:
        return None  # padding='same' and other spellings: not modelled
    if min(stride) <= 0 or min(dil) <= 0:
        return None
    spatial = [(x[2 + k] + 2 * pad[k] - dil[k] * (w[2 + k] - 1) - 1) // stride[k] + 1 for k in range(nd)]
    if min(spatial) <= 0:
        return None
    out_numel = x[0] * w[0] * _numel(spatial)
    macs = x[0] * _numel(spatial) * _numel(w)
    moved = sum(_numel(d) * b for d, b in ts) + out_numel * e
    return 2.0 * macs, float(moved)


def _precision(types: list) -> str:
    for t in types:
        if t in _PRECISION:
            return _PRECISION[t]
    return "fp32"


def _outermost_of(df: pd.DataFrame, modelled: np.ndarray) -> np.ndarray:
    """For each event, the outermost modelled event around it on its thread, itself included; -1
    where there is none. An op is counted at this level, with everything it calls."""
    outer = np.full(len(df), -1, dtype=np.int64)
    order = np.lexsort((-df["dur_us"].to_numpy(), df["start_us"].to_numpy(), df["tid"].to_numpy()))
    tid, start = df["tid"].to_numpy(), df["start_us"].to_numpy()
    end = start + df["dur_us"].to_numpy()
    stack: list[int] = []
    for i in order:
        while stack and (tid[stack[-1]] != tid[i] or end[stack[-1]] <= start[i]):
            stack.pop()
        parent = outer[stack[-1]] if stack else -1
        outer[i] = parent if parent >= 0 else (i if modelled[i] else -1)
        stack.append(i)
    return outer


def _modelled_outermost(df: pd.DataFrame, modelled: np.ndarray) -> np.ndarray:
    """True for modelled events not nested (on the same thread) inside another modelled event."""
    return _outermost_of(df, modelled) == np.arange(len(df))


_NARROW = ("fp8", "fp16", "bf16", "tf32", "fp32")


def _group_precisions(df: pd.DataFrame, outer: np.ndarray) -> dict[int, str]:
    """The precision each outermost modelled op computes in: the narrowest among it and the ops it
    calls (under autocast ``aten::linear`` records fp32 inputs and its ``aten::mm`` runs in bf16)."""
    out: dict[int, str] = {}
    types = df["input_types"].to_numpy(object)
    for i in np.flatnonzero(outer >= 0):
        p = _precision(types[i])
        j = int(outer[i])
        if j not in out or _NARROW.index(p) < _NARROW.index(out[j]):
            out[j] = p
    return out


def op_roofline(
    ops: pd.DataFrame,
    hardware: HardwareSpec,
    ceilings: Ceilings | None = None,
    *,
    optimizer_params: int = 0,
    latency_call_us: float | None = None,
) -> pd.DataFrame:
    """The roofline of each (op, input shapes) of a CPU trace, most time first.

    ``ops`` is ``op_shapes``' table (``TraceWork.ops``). Roofs: the peak FLOP/s for the op's
    precision and the memory bandwidth, from ``ceilings`` when given (measured; a precision it lacks
    falls back to the spec) else from ``hardware``. ``optimizer_params`` is the number of parameter
    elements a fused optimizer step updates (its tensor lists carry no shapes in the trace); 0 leaves
    the optimizer unmodelled. See ``ROOFLINE_COLUMNS`` for the columns.
    """
    df = ops
    work = _op_work_list(df, optimizer_params)
    modelled = np.array([w is not None for w in work], dtype=bool)
    outer = _outermost_of(df, modelled)
    keep = outer == np.arange(len(df))
    sel = df[keep].copy()
    sel["w_flops"] = [w[0] for w, k in zip(work, keep, strict=True) if k]
    sel["w_bytes"] = [w[1] for w, k in zip(work, keep, strict=True) if k]
    sel["shape"] = [json.dumps(d) for d in sel["input_dims"]]
    group_precision = _group_precisions(df, outer)
    sel["precision"] = [group_precision[i] for i in np.flatnonzero(keep)]
    sel["op"] = sel["name"]
    sel["basis"] = "shapes"
    sel["klass"] = ""
    sel["category"] = [op_category(n) for n in sel["name"]]
    out = _judge(_group(sel), hardware, ceilings, latency_call_us)
    out.attrs["optimizer_fusable"] = _optimizer_fusable(sel, out)
    out.attrs["profiler_steps"] = df.attrs.get("profiler_steps", 0)
    out.attrs["op_time_ms"] = float(df.loc[_top_level(df), "dur_us"].sum() / 1e3) if len(df) else 0.0
    out.attrs["device"] = "cpu"
    return out


def _optimizer_fusable(sel: pd.DataFrame, table: pd.DataFrame) -> dict[str, float]:
    """The fusable memory-bound ops (``FUSABLE``) that ran inside the optimizer step, a for-loop or
    foreach optimizer's elementwise updates, which ``torch.compile`` of the model does not reach:
    ``time_ms`` and ``bytes`` of those whose bytes are known, ``unknown_ms`` of the rest. Each op takes
    its group's verdict from ``table``."""
    out = {"time_ms": 0.0, "bytes": 0.0, "unknown_ms": 0.0}
    if "in_optimizer" not in sel or not sel["in_optimizer"].any():
        return out
    opt = sel.loc[sel["in_optimizer"].to_numpy(bool), ["name", "shape", "precision", "dur_us", "w_bytes"]]
    verdicts = table[["name", "input_dims", "precision", "category", "bound"]].drop_duplicates(
        ["name", "input_dims", "precision"]
    )
    m = opt.merge(verdicts, left_on=["name", "shape", "precision"], right_on=["name", "input_dims", "precision"])
    m = m[m["category"].isin(FUSABLE).to_numpy() & (m["bound"].astype(str) == "memory").to_numpy()]
    nbytes = pd.to_numeric(m["w_bytes"], errors="coerce")
    known = nbytes.notna().to_numpy()
    out["time_ms"] = float(m.loc[known, "dur_us"].sum()) / 1e3
    out["bytes"] = float(nbytes[known].sum())
    out["unknown_ms"] = float(m.loc[~known, "dur_us"].sum()) / 1e3
    return out


def cpu_score_chain(roofline: pd.DataFrame) -> np.ndarray:
    """CPU tables: the rows of unfused attention's score chain, the ops whose first input is a
    ``[batch, heads, s, s]`` tensor a softmax (or its backward) ran on in this trace: the scale, the
    causal ``masked_fill``, the softmax and their backwards (and the probabilities'
    GEMM, which is not fusable). Compiling the model does not speed them up on a CPU: Inductor's fused
    masked-softmax kernel runs the chain forward and backward at 0.90-1.19x of eager from 0.5 to 32 MiB
    of scores, where an RMSNorm gains 1.3-6x (``bench/cpu_fusion.py``, ``bench/results/cpu_fusion.md``).
    All False on a GPU table, where fused kernels stream at the memory roof."""
    none = np.zeros(len(roofline), dtype=bool)
    if roofline.attrs.get("device") == "gpu" or not len(roofline):
        return none
    first = [_first_dims(d) for d in roofline["input_dims"]]
    scores = {
        f
        for f, n in zip(first, roofline["name"], strict=True)
        if n in SOFTMAX_OPS and f is not None and len(f) == 4 and f[-1] == f[-2] and f[-1] > 1
    }
    if not scores:
        return none
    return np.array([f in scores for f in first], dtype=bool)


def _first_dims(input_dims: object) -> tuple[int, ...] | None:
    """The first input's shape of a row's ``input_dims`` (a JSON list of shapes), None where absent."""
    try:
        dims = json.loads(input_dims) if isinstance(input_dims, str) else input_dims
        first = dims[0] if dims else None
        return tuple(int(x) for x in first) if isinstance(first, list) else None
    except (ValueError, TypeError, IndexError):
        return None


def streaming_bytes_per_s(rows: pd.DataFrame, roof_bytes_per_s: float) -> float:
    """The memory bandwidth a fused kernel can count on in this trace: the fastest rate reached by a
    group of ``rows`` that carries at least 1 % of their bytes (a tiny group can run from cache), never
    above the roof. On a quiet machine the big fp32 streams sit on the roof (20 GB/s on the AMX Xeon's
    two cores); on a loaded one every op slows, and so does this rate: a gain priced from it stays a
    ratio of the run's own speeds."""
    known = rows[(rows["bytes"] > 0) & (rows["time_ms"] > 0)]
    big = known[known["bytes"] >= 0.01 * known["bytes"].sum()]
    if big.empty:
        return roof_bytes_per_s
    return min(roof_bytes_per_s, float((big["bytes"] / (big["time_ms"] / 1e3)).max()))


ROOFLINE_COLUMNS = {
    "name": "the op (CPU) or kernel (GPU)",
    "op": "the modelled op that launched the kernel (GPU); the op itself (CPU)",
    "input_dims": "the op's input shapes as JSON ('' where none were recorded)",
    "precision": "fp32, tf32, bf16, fp16, fp8",
    "category": "the kernel's class (advisor.analysis.breakdown.kernel_category), or the op's in the same words",
    "basis": "'shapes' (FLOPs and bytes by formula), 'transfer' (a copy or set: its bytes), "
    "'transfer of unknown size' (a copy or set the trace gives no bytes for: bytes and bandwidth NaN), "
    "'kernel class' (no shapes: the verdict follows the kernel's class and length)",
    "calls": "calls over the trace",
    "time_ms": "summed over the trace",
    "mean_call_us": "time per call",
    "flops": "summed FLOPs (NaN where not modelled)",
    "bytes": "summed compulsory bytes moved (NaN where not known)",
    "intensity_flops_per_byte": "FLOPs / bytes",
    "achieved_flops_per_s": "FLOPs / time",
    "achieved_bytes_per_s": "bytes / time (NaN where the bytes are not known)",
    "roof_flops_per_s": "min(peak, intensity x bandwidth); 0 for pure data movement",
    "bound": "compute or memory by the side of the ridge point; latency when it reaches under "
    "LATENCY_ROOF_FRAC of its roof with a mean call under the latency cut; communication for collectives",
    "headroom_frac": "1 - roof time / measured time (roof time = max(flops / peak, bytes / bandwidth)): the "
    "share of the time above the roofline, NaN where not modelled",
}


MODELLED_OPS = frozenset(
    {
        *_MATMUL,
        *_ATTN_FWD,
        *_ATTN_BWD,
        *_ELEMENTWISE,
        *_MOVEMENT,
        *_ROWWISE_FLOPS,
        *_FUSED_OPT,
        *_CONV_ARGS,
        "aten::convolution_backward",
        "aten::embedding_dense_backward",
        "aten::nll_loss_backward",
    }
)
"""Every op name ``op_work`` has a model for."""
_NORMS = {
    "aten::native_layer_norm",
    "aten::native_layer_norm_backward",
    "aten::_fused_rms_norm",
    "aten::_fused_rms_norm_backward",
}


def op_category(name: str) -> str:
    """A CPU op's class in the words ``advisor.analysis.breakdown.kernel_category`` uses for GPU kernels."""
    if name in _MATMUL:
        return "gemm"
    if name in _CONV_ARGS or name == "aten::convolution_backward":
        return "convolution"
    if name in _ATTN_FWD or name in _ATTN_BWD:
        return "attention"
    if name in _NORMS:
        return "normalization"
    if name in _ROWWISE_FLOPS or name == "aten::nll_loss_backward":
        return "reduction"
    if name in _ELEMENTWISE or name in _MOVEMENT:
        return "elementwise"
    if name in _FUSED_OPT:
        return "optimizer"
    return "other"


def _op_work_list(ops: pd.DataFrame, optimizer_params: int) -> list:
    """(FLOPs, bytes) per op, or None. Where the trace carries the profiler's own FLOP count for a call
    (``with_flops``: matmuls and convolutions) that count is taken, with the bytes from the shapes."""
    out = []
    for n, d, t, c, f in zip(
        ops["name"], ops["input_dims"], ops["input_types"], ops["concrete_inputs"], ops["flops"], strict=True
    ):
        w = op_work(n, d, t, c, optimizer_params) if n in MODELLED_OPS else None
        if isinstance(f, float) and not math.isnan(f) and f > 0:
            moved = float(sum(_numel(s) * e if s else e for s, e in _tensors(d, t)))
            w = (f, w[1] if w else moved)
        out.append(w)
    return out


def _group(rows: pd.DataFrame) -> pd.DataFrame:
    keys = ["name", "op", "shape", "precision", "basis", "klass", "category"]
    g = rows.groupby(keys, sort=False, observed=True, dropna=False).agg(
        calls=("dur_us", "size"),
        time_us=("dur_us", "sum"),
        flops=("w_flops", lambda x: x.sum(min_count=1)),
        bytes=("w_bytes", lambda x: x.sum(min_count=1)),
    )
    return g.reset_index()


UNKNOWN_SIZE = "transfer of unknown size"
"""The basis of a copy or set whose bytes the trace does not give (0): its bytes and bandwidth are NaN."""
UNKNOWN_PRECISION = "?"
"""The precision of a kernel with no launching op to read it from (judged by class, with no FLOPs)."""


def _peak(hardware: HardwareSpec, ceilings: Ceilings | None, precision: str) -> float:
    if precision == UNKNOWN_PRECISION:
        return hardware.peak_fp32_flops
    measured = ceilings.matmul_flops_per_s.get(precision, 0.0) if ceilings else 0.0
    if measured:
        return measured
    spec = hardware.peak_tf32_flops if precision == "tf32" else hardware.peak_flops(precision)
    return spec or hardware.peak_fp32_flops


def _judge(g: pd.DataFrame, hardware: HardwareSpec, ceilings: Ceilings | None, latency_call_us: float | None):
    """Roofs, verdicts and headroom for grouped rows (name, op, shape, precision, basis, klass, calls,
    time_us, flops, bytes): the shared tail of the CPU and GPU tables."""
    call_us = LATENCY_CALL_US[hardware.kind] if latency_call_us is None else latency_call_us
    bw = np.full(len(g), ceilings.copy_bytes_per_s if ceilings else hardware.mem_bw_bytes_per_s, dtype=float)
    host = g["name"].str.contains(r"HtoD|DtoH|HtoH", regex=True).to_numpy() & (g["basis"] == "transfer").to_numpy()
    if hardware.host_link_bw_bytes_per_s:
        bw[host] = hardware.host_link_bw_bytes_per_s  # a host copy is bound by the host link, not HBM
    peak = np.array([_peak(hardware, ceilings, p) for p in g["precision"]], dtype=float)
    t_s = g["time_us"].to_numpy(float) / 1e6
    flops, nbytes = g["flops"].to_numpy(float), g["bytes"].to_numpy(float)
    modelled = ~np.isnan(flops)
    with np.errstate(divide="ignore", invalid="ignore"):
        intensity = np.where(nbytes > 0, flops / nbytes, np.where(modelled, np.inf, np.nan))
        roof = np.minimum(peak, intensity * bw)
        roof_time_s = np.maximum(flops / peak, nbytes / bw)
        roof_frac = np.where(t_s > 0, roof_time_s / t_s, 1.0)
        achieved_flops = np.where(t_s > 0, flops / t_s, 0.0)
        achieved_bytes = np.where(t_s > 0, nbytes / t_s, 0.0)
    mean_call_us = g["time_us"].to_numpy(float) / g["calls"].to_numpy(float)
    klass = g["klass"].to_numpy(object)
    bound = np.where(intensity * bw < peak, "memory", "compute").astype(object)
    bound[~modelled] = np.where(klass[~modelled] == "", "memory", klass[~modelled])
    short = mean_call_us < call_us
    slow = np.where(modelled, roof_frac < LATENCY_ROOF_FRAC, True)  # unmodelled: length alone decides
    bound[short & slow & (bound != "communication")] = "latency"
    out = pd.DataFrame(
        {
            "name": g["name"].astype(str),
            "op": g["op"].astype(str),
            "input_dims": g["shape"].astype(str),
            "precision": g["precision"],
            "category": g["category"].astype(str),
            "basis": g["basis"].astype(str),
            "calls": g["calls"].astype(int),
            "time_ms": g["time_us"] / 1e3,
            "mean_call_us": mean_call_us,
            "flops": flops,
            "bytes": nbytes,
            "intensity_flops_per_byte": intensity,
            "achieved_flops_per_s": achieved_flops,
            "achieved_bytes_per_s": achieved_bytes,
            "roof_flops_per_s": roof,
            "bound": pd.Categorical(bound, categories=BOUNDS),
            "headroom_frac": np.where(modelled | ~np.isnan(nbytes), np.clip(1.0 - roof_frac, 0.0, 1.0), np.nan),
        }
    )
    out = out.sort_values("time_ms", ascending=False, kind="stable").reset_index(drop=True)
    precisions = sorted((set(g["precision"]) - {UNKNOWN_PRECISION}) | {"fp32"})
    out.attrs["roofs"] = {
        "peak_flops_per_s": {p: _peak(hardware, ceilings, p) for p in precisions},
        "bytes_per_s": float(ceilings.copy_bytes_per_s if ceilings else hardware.mem_bw_bytes_per_s),
        "measured": ceilings is not None,
        "measured_peaks": sorted(p for p in precisions if ceilings and ceilings.matmul_flops_per_s.get(p)),
        "device": hardware.name,
    }
    return out


_COMPUTE_CLASSES = {"gemm", "convolution", "attention"}
_OP_CLASSES = {"gemm": "gemm", "attention": "attention"}


def kernel_roofline(
    work: TraceWork,
    hardware: HardwareSpec,
    ceilings: Ceilings | None = None,
    *,
    optimizer_params: int = 0,
    latency_call_us: float | None = None,
) -> pd.DataFrame:
    """The roofline of each GPU kernel, copy and set of a Kineto trace (same columns as
    ``op_roofline``), most time first.

    A kernel takes its FLOPs and bytes from the outermost modelled op around the op that launched it
    (``TraceWork.kernels.launch_op``), as the CPU table counts ops (``aten::linear`` for the GEMM its
    ``aten::mm`` launches; ``scaled_dot_product_attention`` for the flash kernels; a loss backward for
    the fill of its gradient and its own kernel); that op's work is shared among all the kernels
    launched inside it, in proportion to their time. Collectives take no op's work. A GEMM kernel's
    peak follows its math (``ampere_sgemm``: fp32 cores; fp32 tensors on tensor-core kernels:
    TF32; otherwise the narrowest dtype the op computes in). Copies and sets are judged by their bytes (HBM, or the host
    link for host copies). Kernels with no shapes to go by (a trace recorded without
    ``record_shapes``) get the verdict of their class: GEMM, convolution and attention kernels
    compute, the rest memory, collectives communication; any of them under the latency cut latency.
    """
    ops, k = work.ops, work.kernels
    work_of = _op_work_list(ops, optimizer_params) if len(ops) else []
    modelled = np.array([w is not None for w in work_of], dtype=bool)
    outer = _outermost_of(ops, modelled) if len(ops) else np.zeros(0, dtype=np.int64)
    group_precision = _group_precisions(ops, outer) if len(ops) else {}
    launch = k["launch_op"].to_numpy()
    src = np.where(launch >= 0, outer[np.clip(launch, 0, None)] if len(outer) else -1, -1)
    src[k["kind"].to_numpy() != "kernel"] = -1
    names = k["name"].astype(str).to_numpy()
    kinds = k["kind"].to_numpy()
    categories = {n: kernel_category(n) for n in set(names)}
    # A collective launched inside a modelled op keeps its own verdict and takes none of the op's work.
    src[np.array([categories[n] == "communication" for n in names], dtype=bool)] = -1
    dur = k["dur_us"].to_numpy(float)
    # Each modelled op instance's work is shared among its kernels by time.
    op_kernel_time = pd.Series(dur[src >= 0]).groupby(src[src >= 0]).sum()
    rows = k[["name", "kind", "dur_us"]].copy()
    flops = np.full(len(k), np.nan)
    nbytes = np.full(len(k), np.nan)
    precision = np.full(len(k), UNKNOWN_PRECISION, dtype=object)
    shape = np.full(len(k), "", dtype=object)
    op_name = np.full(len(k), "", dtype=object)
    basis = np.full(len(k), "kernel class", dtype=object)
    klass = np.full(len(k), "", dtype=object)
    op_names = ops["name"].to_numpy(object) if len(ops) else np.zeros(0, dtype=object)
    op_dims = ops["input_dims"].to_numpy(object) if len(ops) else np.zeros(0, dtype=object)
    k_bytes = k["bytes"].to_numpy()
    row_category = np.array(
        [categories[n] if kd == "kernel" else kd for n, kd in zip(names, kinds, strict=True)], dtype=object
    )
    for i in range(len(k)):
        if kinds[i] != "kernel":
            copies = 2 if "DtoD" in names[i] else 1  # a device copy reads and writes HBM
            if k_bytes[i] > 0:
                basis[i] = "transfer"
                nbytes[i], flops[i] = float(k_bytes[i]) * copies, 0.0
            else:  # the trace does not give its size: judged by its length, grouped apart from sized copies
                basis[i] = UNKNOWN_SIZE
            continue
        cat = categories[names[i]]
        if launch[i] >= 0:
            op_name[i] = op_names[src[i] if src[i] >= 0 else launch[i]]
            if cat == "other":  # a kernel whose name says nothing (cuDNN's nchwToNhwc): its op does
                cat = _OP_CLASSES.get(op_category(op_names[launch[i]]), cat)
                if cat == "other" and "conv" in op_names[launch[i]]:
                    cat = "convolution"
                row_category[i] = cat
        klass[i] = "compute" if cat in _COMPUTE_CLASSES else "communication" if cat == "communication" else "memory"
        j = src[i]
        if j < 0:
            continue
        share = dur[i] / op_kernel_time[j] if op_kernel_time[j] > 0 else 0.0
        w_flops, w_bytes = work_of[j]
        flops[i], nbytes[i] = w_flops * share, w_bytes * share
        shape[i] = json.dumps(op_dims[j])
        precision[i] = group_precision.get(j, "fp32")
        if cat == "gemm" and precision[i] == "fp32":
            # fp32 tensors on tensor cores run as TF32 (s1688gemm, xmma/nvjet/wgmma with fp32 in/out).
            precision[i] = "fp32" if gemm_math(names[i]) == "fp32" else "tf32"
        elif cat == "convolution" and precision[i] == "fp32":
            precision[i] = conv_math(names[i])  # cuDNN's TF32 kernels say so; the rest run fp32
        basis[i] = "shapes"
    rows = rows.assign(
        op=op_name,
        shape=shape,
        precision=precision,
        basis=basis,
        klass=klass,
        category=row_category,
        w_flops=flops,
        w_bytes=nbytes,
    )
    rows, implausible = _drop_implausible(rows, hardware, ceilings)
    out = _judge(_group(rows), hardware, ceilings, latency_call_us)
    out.attrs["profiler_steps"] = work.profiler_steps
    out.attrs["device"] = "gpu"
    out.attrs["implausible"] = implausible
    return out


IMPLAUSIBLE_FACTOR = 1.5
"""How far above its roof a kernel's shape-derived rate may read before the shapes are not believed:
above it the time or the FLOPs are not that kernel's (timestamps have microsecond steps; a roof is a
peak no kernel passes)."""


def _drop_implausible(
    rows: pd.DataFrame, hardware: HardwareSpec, ceilings: Ceilings | None
) -> tuple[pd.DataFrame, dict[str, float]]:
    """Kernels whose op's shapes would have them run above the roofs lose that work and are judged by
    their class: a sampled or filtered trace lacks some of an op's kernels (HTA's trace_filter sample:
    an aten::linear's 1.6 TFLOP given to 0.3 ms of kernels, 5.4 PFLOP/s on an A100), or an op records
    shapes its kernels do not run. Returns the rows and ``{"kernels", "time_ms", "max_ratio"}``."""
    t_s = rows["dur_us"].to_numpy(float) / 1e6
    flops, nbytes = rows["w_flops"].to_numpy(float), rows["w_bytes"].to_numpy(float)
    shaped = (rows["basis"] == "shapes").to_numpy()
    peak = np.array([_peak(hardware, ceilings, p) for p in rows["precision"]], dtype=float)
    bw = ceilings.copy_bytes_per_s if ceilings else hardware.mem_bw_bytes_per_s
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.fmax(np.where(t_s > 0, flops / t_s / peak, np.inf), np.where(t_s > 0, nbytes / t_s / bw, np.inf))
    bad = shaped & (np.nan_to_num(ratio, nan=0.0) > IMPLAUSIBLE_FACTOR)
    info = {"kernels": int(bad.sum()), "time_ms": float(t_s[bad].sum() * 1e3), "max_ratio": 0.0}
    if not bad.any():
        return rows, info
    info["max_ratio"] = float(np.nanmax(np.where(bad, ratio, np.nan)))
    rows = rows.copy()
    rows.loc[bad, ["w_flops", "w_bytes"]] = np.nan
    rows.loc[bad, ["basis", "shape", "op"]] = ["kernel class", "", ""]
    return rows, info


def _top_level(df: pd.DataFrame) -> np.ndarray:
    """True for ops not nested in another op on the same thread (their durations add up to op time)."""
    return _modelled_outermost(df, np.ones(len(df), dtype=bool))


VERDICTS = {
    "compute": "compute-bound",
    "memory": "memory-bound",
    "latency": "latency/launch-bound",
    "communication": "communication-bound",
}


def step_roofline_summary(
    roofline: pd.DataFrame,
    *,
    gpu_idle_frac: float | None = None,
    host_wait_frac: float | None = None,
    step_ms: float | None = None,
) -> dict:
    """Where the step's time goes by bound, and the verdict.

    CPU tables (``op_roofline``): with ``step_ms`` (the profiled step's mean time) and ProfilerStep
    ranges, the shares are of the step (what is not in a modelled op, data loading or Python, is
    ``other_frac``); without, of the modelled op time. ``modelled_frac`` is the modelled share of all
    top-level op time.

    GPU tables (``kernel_roofline``): the shares are of the GPU's span. The busy part (1 -
    ``gpu_idle_frac``) is split by each bound's share of summed kernel time; the idle time the GPU
    spends waiting for the host to launch work (``gpu_idle_frac x host_wait_frac``) adds to latency
    (the host's per-op cost sets the pace); other idle time is ``idle_other_frac``.
    ``modelled_frac`` is the share of kernel time with FLOPs or bytes known (shapes or transfers).

    Keys: ``<bound>_ms`` and ``<bound>_frac`` for each of BOUNDS, ``modelled_ms`` (summed time of the
    table), ``modelled_frac``, ``headroom_ms`` (time above the roofline summed over rows),
    ``per_step_ms`` and ``headroom_per_step_ms`` (divided by the profiled steps; NaN without
    ProfilerStep ranges), ``idle_other_frac``, ``verdict`` (the bound with the largest share),
    ``gemm_frac`` (GEMMs that are not latency-bound), ``gemm_roof_frac`` (their time-weighted share of
    the roof reached: roof time / time; NaN without shapes), ``gemm_fixed_frac`` (CPU: the share of
    their time that is a fixed per-call cost, ``GEMM_CALL_FIXED_US``; NaN on a GPU or without shapes)
    and ``fusable_frac`` (memory-bound elementwise, reduction and normalisation ops: what fusion would
    cut), ``compile_fusable_frac`` (those of them outside the optimizer step, which compiling the model
    reaches; a CPU table only knows which ran inside it; on a CPU, not unfused attention's score chain,
    ``score_chain_frac``, which compiling leaves as it is: ``cpu_score_chain``; NaN on a GPU) with
    ``compile_fusable_roof_frac`` (their bytes at the bandwidth this trace's big streams reached,
    ``streaming_bytes_per_s``; their time where it is shorter), and
    ``attention_frac`` (attention that is not latency-bound).
    """
    total = float(roofline["time_ms"].sum())
    out: dict = {"modelled_ms": total}
    by_bound = {b: float(roofline.loc[roofline["bound"] == b, "time_ms"].sum()) for b in BOUNDS}
    gpu = roofline.attrs.get("device") == "gpu"
    steps = int(roofline.attrs.get("profiler_steps", 0))
    idle = min(max(gpu_idle_frac or 0.0, 0.0), 1.0) if gpu else 0.0
    host_wait = idle * min(max(host_wait_frac or 0.0, 0.0), 1.0)
    # The CPU base: the steps' time where known (never below the modelled time: ops on several
    # threads can add up to more than the wall time), else the modelled time itself.
    base = max(step_ms * steps, total) if not gpu and step_ms and steps else total
    for b in BOUNDS:
        out[f"{b}_ms"] = by_bound[b]
        share = by_bound[b] / total if total else 0.0
        if gpu:
            out[f"{b}_frac"] = (1.0 - idle) * share + (host_wait if b == "latency" else 0.0)
        else:
            out[f"{b}_frac"] = by_bound[b] / base if base else 0.0
    out["idle_other_frac"] = idle - host_wait
    out["other_frac"] = 0.0 if gpu else max(0.0, 1.0 - total / base) if base else 0.0
    headroom = roofline["time_ms"] * roofline["headroom_frac"]
    out["headroom_ms"] = float(headroom.sum(min_count=1)) if headroom.notna().any() else 0.0
    if gpu:
        known = roofline["basis"].isin(["shapes", "transfer"])
        out["op_time_ms"] = total
        out["modelled_frac"] = float(roofline.loc[known, "time_ms"].sum()) / total if total else 0.0
    else:
        op_time = float(roofline.attrs.get("op_time_ms", 0.0))
        out["op_time_ms"] = op_time
        out["modelled_frac"] = total / op_time if op_time else math.nan
    out["per_step_ms"] = total / steps if steps else math.nan
    out["headroom_per_step_ms"] = out["headroom_ms"] / steps if steps else math.nan
    # GEMMs and fusable memory-bound ops, on the same base as the bound shares.
    scale = ((1.0 - idle) if gpu else 1.0) / (total if gpu else base) if total else 0.0
    gemm = roofline[(roofline["category"] == "gemm") & (roofline["bound"] != "latency")]
    out["gemm_frac"] = float(gemm["time_ms"].sum()) * scale
    known = gemm[gemm["headroom_frac"].notna()]
    out["gemm_roof_frac"] = (
        float((known["time_ms"] * (1.0 - known["headroom_frac"])).sum() / known["time_ms"].sum())
        if known["time_ms"].sum() > 0
        else math.nan
    )
    # CPU: the share of those GEMMs' time that is a fixed cost per call (GEMM_CALL_FIXED_US, at most the
    # time above the roof). A GPU kernel's time above its roof is tiles and waves, not a per-call cost:
    # NaN there.
    if gpu or known["time_ms"].sum() <= 0:
        out["gemm_fixed_frac"] = math.nan
    else:
        above = known["time_ms"] * known["headroom_frac"]
        fixed = np.minimum(above.to_numpy(float), known["calls"].to_numpy(float) * GEMM_CALL_FIXED_US / 1e3)
        out["gemm_fixed_frac"] = float(fixed.sum() / known["time_ms"].sum())
    fusable = (
        roofline["category"].isin(FUSABLE)
        & (roofline["bound"] == "memory")
        & ~roofline["name"].str.startswith(("triton_", "fused_"))  # compiled: fused already
    ).to_numpy(bool)
    out["fusable_frac"] = float(roofline.loc[fusable, "time_ms"].sum()) * scale
    # What compiling the model reaches of them (not the optimizer step's), and their time at the memory
    # roof (time x (1 - headroom); where the bytes are unknown, their measured time).
    # CPU: unfused attention's score chain stays as it is under compile (cpu_score_chain).
    chain = cpu_score_chain(roofline) & fusable
    out["score_chain_frac"] = math.nan if gpu else float(roofline.loc[chain, "time_ms"].sum()) * scale
    fus = roofline.loc[fusable & ~chain]
    roof_bw = float((roofline.attrs.get("roofs") or {}).get("bytes_per_s") or 0.0)
    bw = streaming_bytes_per_s(fus, roof_bw) if roof_bw else 0.0
    has_bytes = (fus["bytes"] > 0).to_numpy()
    fused_ms = fus["time_ms"].to_numpy(float).copy()
    if bw:
        fused_ms[has_bytes] = np.minimum(fused_ms[has_bytes], fus["bytes"].to_numpy(float)[has_bytes] / bw * 1e3)
    opt = roofline.attrs.get("optimizer_fusable") or {}
    opt_ms = float(opt.get("time_ms", 0.0)) + float(opt.get("unknown_ms", 0.0))
    opt_fused_ms = float(opt.get("unknown_ms", 0.0)) + (
        min(float(opt.get("time_ms", 0.0)), float(opt.get("bytes", 0.0)) / bw * 1e3) if bw else opt.get("time_ms", 0.0)
    )
    out["compile_fusable_frac"] = max(0.0, float(fus["time_ms"].sum()) - opt_ms) * scale
    out["compile_fusable_roof_frac"] = max(0.0, float(fused_ms.sum()) - opt_fused_ms) * scale
    # Attention (fused SDPA kernels and ops, forward and backward) that is not latency-bound: with the
    # GEMMs and the fusable ops, the op classes a precision change speeds up each at its own rate.
    attention = (roofline["category"] == "attention") & (roofline["bound"] != "latency")
    out["attention_frac"] = float(roofline.loc[attention, "time_ms"].sum()) * scale
    shares = {b: out[f"{b}_frac"] for b in BOUNDS}
    out["verdict"] = max(shares, key=shares.get) if total or host_wait else None
    return out


def total_flops(roofline: pd.DataFrame, names: Sequence[str]) -> float:
    """Summed FLOPs of the rows whose op name is in ``names``."""
    return float(roofline.loc[roofline["name"].isin(list(names)), "flops"].sum())


@dataclass(frozen=True)
class Roofline:
    """The roofline of one trace: its table (``op_roofline``/``kernel_roofline``), the device whose
    roofs judged it, and where those roofs came from."""

    table: pd.DataFrame
    hardware: HardwareSpec
    ceilings: Ceilings | None
    roofs_note: str
    """The device and its roofs in words: how the device was found; datasheet or measured."""


def trace_roofline(
    events: pd.DataFrame,
    *,
    hardware: HardwareSpec | None = None,
    ceilings: Ceilings | Callable[[HardwareSpec], Ceilings | None] | None = None,
    optimizer_params: int | None = None,
) -> Roofline:
    """The roofline of a trace's event table (``advisor.analysis.summary.load_trace``): kernels on a
    GPU trace, ops on a CPU trace.

    ``hardware`` defaults to the device the trace names (or its kernel names give away; else the H100
    datasheet, said in the note); for one of our run directories, the device it ran on (the table's
    ``attrs["run"]``). ``ceilings``: measured roofs to use, or a lookup from the device found to its
    stored roofs (``advisor.store.ceilings.ceilings_lookup``; None where it has none); None: the
    datasheet. ``optimizer_params`` defaults to the parameters a run directory's metrics record (0
    elsewhere: fused optimizer steps stay unmodelled)."""
    run = events.attrs.get("run") or {}
    gpu = bool(kind_mask(events, *GPU_KINDS).any())
    work = trace_work(events)
    hardware, note = _device(events, work, gpu, hardware, run.get("hardware"), run.get("cpu_matrix_flags"))
    if callable(ceilings):
        ceilings = ceilings(hardware)
    if ceilings is not None:
        note += f"; roofs measured {ceilings.measured_utc or 'earlier'} on {ceilings.device_name}"
    else:
        note += "; datasheet roofs"
    if optimizer_params is None:
        optimizer_params = int(run.get("optimizer_params") or 0)
    if gpu:
        table = kernel_roofline(work, hardware, ceilings, optimizer_params=optimizer_params)
        bad = table.attrs.get("implausible") or {}
        if bad.get("kernels"):
            note += (
                f"; {bad['kernels']:,} kernels ({bad['time_ms']:.1f} ms) would run up to {bad['max_ratio']:,.0f}x "
                "above the roofs on their op's shapes, so the trace lacks some of their op's kernels (a sampled "
                "or filtered trace) or the shapes are not theirs: judged by kernel class instead"
            )
    else:
        if work.ops.empty:
            raise TraceError(f"{work.file} holds no cpu_op events to judge")
        ops = work.ops
        ops.attrs["profiler_steps"] = work.profiler_steps
        table = op_roofline(ops, hardware, ceilings, optimizer_params=optimizer_params)
    return Roofline(table, hardware, ceilings, note)


def _device(
    events: pd.DataFrame,
    work: TraceWork,
    gpu: bool,
    hardware: HardwareSpec | None,
    run_hardware: dict | None,
    cpu_matrix_flags: list[str] | None = None,
) -> tuple[HardwareSpec, str]:
    """The device whose roofs judge the trace, and how it was found, in words."""
    from advisor.spec.presets import cpu_host, current_hardware, h100_sxm, hardware_for_trace

    if hardware is not None:
        return hardware, hardware.name
    if run_hardware is not None:
        try:
            found = current_hardware(HardwareSpec(**run_hardware), cpu_matrix_flags)
            return found, f"{found.name}: the device the run used"
        except (AdvisorError, TypeError, ValueError):
            pass
    if gpu:
        names = events.attrs.get("gpu_names") or []
        names = list(names.values()) if isinstance(names, dict) else list(names)
        gpus = work.gpus or [(str(n), 0) for n in names[:1]]
        found, note = hardware_for_trace(gpus, work.kernels["name"].astype(str).unique())
        return (found, note or found.name) if found is not None else (h100_sxm(), note + "; H100 datasheet roofs used")
    found = cpu_host()
    return found, f"{found.name}: this machine's CPU datasheet (the trace names no device)"


def _work_from_events(events: pd.DataFrame) -> TraceWork:
    """The GPU events of an event table as TraceWork without ops (Nsight Systems exports record no
    shapes): every kernel is judged by its class, copies and sets by their bytes."""
    gpu = events[kind_mask(events, *GPU_KINDS)]
    kernels = pd.DataFrame(
        {
            "name": gpu["name"].astype(str).to_numpy(),
            "kind": gpu["kind"].astype(str).to_numpy(),
            "start_us": gpu["start_ns"].to_numpy() / 1e3,
            "dur_us": gpu["dur_ns"].to_numpy() / 1e3,
            "bytes": gpu["bytes"].to_numpy(),
            "launch_op": np.full(len(gpu), -1, dtype=np.int64),
        }
    )
    ops = pd.DataFrame(
        columns=["name", "tid", "start_us", "dur_us", "input_dims", "input_types", "concrete_inputs", "flops"]
    )
    names = events.attrs.get("gpu_names") or {}
    names = list(names.values()) if isinstance(names, dict) else list(names)
    return TraceWork(ops, kernels, [(str(names[0]), 0)] if names else [], 0, "nsys export")
