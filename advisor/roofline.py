"""The roofline view of a CPU trace: FLOPs and bytes of each op, and whether it is bound by compute,
by memory bandwidth or by per-call latency against the machine's roofs.

The event table (``advisor.trace_table``) drops the Kineto ``args``, so shapes are read here from the
raw JSON (``read_op_shapes``). FLOPs and bytes come from the input shapes by formula; the counting
conventions follow the roofline model (Williams, Waterman, Patterson, CACM 52(4), 2009): one
multiply-add is 2 FLOPs, bytes are the compulsory traffic (every input read once, every output written
once; cache reuse inside the op is the op's business). An op nested in another modelled op is counted
once, at the outermost modelled level: the op the model code called carries the work and the time of
the ops it calls (``aten::linear`` -> ``aten::t``, ``aten::mm``; an attention backward -> its
``aten::zero_`` of the gradient buffers), so nothing is counted twice and no op loses its work to a
helper it calls.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from advisor.ceilings import Ceilings
from advisor.errors import TraceError
from advisor.specs import HardwareSpec

BOUNDS = ("compute", "memory", "latency")

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


def read_op_shapes(path: str | Path, max_bytes: int = 2 * 2**30) -> pd.DataFrame:
    """One row per framework op (``cpu_op``) of a Kineto trace (``.json`` or ``.json.gz``) with the
    shapes the profiler recorded (``record_shapes=True``).

    Columns: name, tid, start_us, dur_us, input_dims (list per argument; [] for scalars), input_types,
    concrete_inputs (the literal scalar arguments as strings), flops (the profiler's own count where the
    trace carries one, else NaN). ``df.attrs['profiler_steps']`` counts the ProfilerStep#N ranges.
    Raises TraceError on a file that is not a readable Kineto trace.
    """
    path = Path(path)
    try:
        with gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except (OSError, EOFError) as err:
        raise TraceError(f"{path.name} cannot be read ({type(err).__name__}: {err})") from None
    if len(raw) > max_bytes:
        raise TraceError(f"{path.name} is over the {max_bytes / 2**20:.0f} MiB limit decompressed")
    try:
        trace = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise TraceError(f"{path.name} is not valid JSON ({err})") from None
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise TraceError(f"{path.name} is JSON without a traceEvents array: not a Kineto trace")
    rows = []
    steps = 0
    for e in events:
        if not isinstance(e, dict):
            continue
        if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("ProfilerStep#"):
            steps += 1
        if e.get("cat") != "cpu_op" or e.get("ph") != "X":
            continue
        a = e.get("args") or {}
        rows.append(
            (
                e.get("name", ""),
                int(e.get("tid", 0)) if isinstance(e.get("tid"), int) else hash(e.get("tid")),
                float(e["ts"]),
                float(e.get("dur", 0.0)),
                a.get("Input Dims", []),
                a.get("Input type", []),
                a.get("Concrete Inputs", []),
                float(a["flops"]) if "flops" in a else math.nan,
            )
        )
    if not rows:
        raise TraceError(f"{path.name} holds no cpu_op events (was the profiler run without CPU activity?)")
    cols = ["name", "tid", "start_us", "dur_us", "input_dims", "input_types", "concrete_inputs", "flops"]
    df = pd.DataFrame(rows, columns=cols)
    df.attrs["profiler_steps"] = steps
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
    here (views, allocations, autograd nodes) or its shapes were not recorded."""
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
        # Leading dims of a (batch of bmm, rows of a 3-D linear input) fold into M.
        m, k = _numel(a[:-1]), a[-1]
        n = b[0] if name == "aten::linear" else b[-1]  # linear's weight is [out, in]
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
    if name in _ELEMENTWISE:
        shapes = [d for d, _ in ts]
        try:
            n_out = _numel(list(np.broadcast_shapes(*[tuple(s) for s in shapes]))) or 1
        except ValueError:
            return None
        # One FLOP per output element: even a gelu's ~8 is far below any machine's ridge point.
        return float(n_out), moved + n_out * e0
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
    if name == "aten::nll_loss_backward" and len(ts) >= 2:
        return 0.0, float(size[1] * ts[1][1] + size[-1] * ts[-1][1])  # full grad written, target read
    return None


def _precision(types: list) -> str:
    for t in types:
        if t in _PRECISION:
            return _PRECISION[t]
    return "fp32"


def _modelled_outermost(df: pd.DataFrame, modelled: np.ndarray) -> np.ndarray:
    """True for modelled events not nested (on the same thread) inside another modelled event."""
    keep = np.zeros(len(df), dtype=bool)
    order = np.lexsort((-df["dur_us"].to_numpy(), df["start_us"].to_numpy(), df["tid"].to_numpy()))
    tid, start = df["tid"].to_numpy(), df["start_us"].to_numpy()
    end = start + df["dur_us"].to_numpy()
    stack: list[int] = []
    for i in order:
        while stack and (tid[stack[-1]] != tid[i] or end[stack[-1]] <= start[i]):
            stack.pop()
        keep[i] = modelled[i] and not any(modelled[j] for j in stack)
        stack.append(i)
    return keep


def op_roofline(
    ops: pd.DataFrame | str | Path,
    hardware: HardwareSpec,
    ceilings: Ceilings | None = None,
    *,
    optimizer_params: int = 0,
    latency_call_us: float | None = None,
) -> pd.DataFrame:
    """The roofline of each (op, input shapes) of a CPU trace, most time first.

    ``ops`` is ``read_op_shapes``' table or a trace path. Roofs: the peak FLOP/s for the op's
    precision and the memory bandwidth, from ``ceilings`` when given (measured; a precision it lacks
    falls back to the spec) else from ``hardware``. ``optimizer_params`` is the number of parameter
    elements a fused optimizer step updates (its tensor lists carry no shapes in the trace); 0 leaves
    the optimizer unmodelled.

    Columns: name, input_dims, precision, calls, time_ms (summed over the trace), mean_call_us, flops,
    bytes, intensity_flops_per_byte, achieved_flops_per_s, achieved_bytes_per_s, roof_flops_per_s
    (min(peak, intensity x bandwidth); 0 for pure data movement), bound ('compute' or 'memory' by the
    side of the ridge point; 'latency' when it reaches under LATENCY_ROOF_FRAC of its roof with a mean
    call under ``latency_call_us``), headroom_frac (1 - roof time / measured time, where roof time
    is max(flops / peak, bytes / bandwidth): the share of the op's time above the roofline).
    """
    df = read_op_shapes(ops) if isinstance(ops, (str, Path)) else ops
    call_us = LATENCY_CALL_US[hardware.kind] if latency_call_us is None else latency_call_us
    work = [
        op_work(n, d, t, c, optimizer_params)
        for n, d, t, c in zip(df["name"], df["input_dims"], df["input_types"], df["concrete_inputs"], strict=True)
    ]
    modelled = np.array([w is not None for w in work], dtype=bool)
    keep = _modelled_outermost(df, modelled)
    sel = df[keep].copy()
    sel["w_flops"] = [w[0] for w, k in zip(work, keep, strict=True) if k]
    sel["w_bytes"] = [w[1] for w, k in zip(work, keep, strict=True) if k]
    sel["shape"] = [json.dumps(d) for d in sel["input_dims"]]
    sel["precision"] = [_precision(t) for t in sel["input_types"]]
    g = sel.groupby(["name", "shape", "precision"], sort=False, observed=True).agg(
        calls=("dur_us", "size"), time_us=("dur_us", "sum"), flops=("w_flops", "sum"), bytes=("w_bytes", "sum")
    )
    g = g.reset_index()
    bw = ceilings.copy_bytes_per_s if ceilings else hardware.mem_bw_bytes_per_s
    peaks = []
    for p in g["precision"]:
        measured = ceilings.matmul_flops_per_s.get(p, 0.0) if ceilings else 0.0
        peaks.append(measured or hardware.peak_flops(p) or hardware.peak_fp32_flops)
    peak = np.array(peaks, dtype=float)
    t_s = g["time_us"].to_numpy(float) / 1e6
    flops, nbytes = g["flops"].to_numpy(float), g["bytes"].to_numpy(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        intensity = np.where(nbytes > 0, flops / nbytes, np.inf)
        roof = np.minimum(peak, intensity * bw)
        roof_time_s = np.maximum(flops / peak, nbytes / bw)
        roof_frac = np.where(t_s > 0, roof_time_s / t_s, 1.0)
    mean_call_us = g["time_us"].to_numpy(float) / g["calls"].to_numpy(float)
    bound = np.where(intensity * bw < peak, "memory", "compute").astype(object)
    bound[(roof_frac < LATENCY_ROOF_FRAC) & (mean_call_us < call_us)] = "latency"
    out = pd.DataFrame(
        {
            "name": g["name"].astype(str),
            "input_dims": g["shape"],
            "precision": g["precision"],
            "calls": g["calls"].astype(int),
            "time_ms": g["time_us"] / 1e3,
            "mean_call_us": mean_call_us,
            "flops": flops,
            "bytes": nbytes,
            "intensity_flops_per_byte": intensity,
            "achieved_flops_per_s": np.where(t_s > 0, flops / t_s, 0.0),
            "achieved_bytes_per_s": np.where(t_s > 0, nbytes / t_s, 0.0),
            "roof_flops_per_s": roof,
            "bound": pd.Categorical(bound, categories=BOUNDS),
            "headroom_frac": np.clip(1.0 - roof_frac, 0.0, 1.0),
        }
    )
    out = out.sort_values("time_ms", ascending=False, kind="stable").reset_index(drop=True)
    out.attrs["profiler_steps"] = df.attrs.get("profiler_steps", 0)
    out.attrs["op_time_ms"] = float(df.loc[_top_level(df), "dur_us"].sum() / 1e3) if len(df) else 0.0
    return out


def _top_level(df: pd.DataFrame) -> np.ndarray:
    """True for ops not nested in another op on the same thread (their durations add up to op time)."""
    return _modelled_outermost(df, np.ones(len(df), dtype=bool))


def step_roofline_summary(roofline: pd.DataFrame) -> dict:
    """Where the modelled op time goes: ``{'modelled_ms', 'op_time_ms', 'modelled_frac',
    '<bound>_ms', '<bound>_frac', 'headroom_ms'}`` with the fractions of modelled time per bound,
    ``modelled_frac`` the modelled share of all top-level op time, and ``headroom_ms`` the time above
    the roofline summed over ops. Times are totals over the trace; ``per_step_ms`` divides the
    modelled time by the profiled steps (NaN when the trace has no ProfilerStep ranges)."""
    total = float(roofline["time_ms"].sum())
    out: dict[str, float] = {"modelled_ms": total}
    for b in BOUNDS:
        ms = float(roofline.loc[roofline["bound"] == b, "time_ms"].sum())
        out[f"{b}_ms"] = ms
        out[f"{b}_frac"] = ms / total if total else 0.0
    out["headroom_ms"] = float((roofline["time_ms"] * roofline["headroom_frac"]).sum())
    op_time = float(roofline.attrs.get("op_time_ms", 0.0))
    out["op_time_ms"] = op_time
    out["modelled_frac"] = total / op_time if op_time else math.nan
    steps = int(roofline.attrs.get("profiler_steps", 0))
    out["per_step_ms"] = total / steps if steps else math.nan
    return out


def total_flops(roofline: pd.DataFrame, names: Sequence[str]) -> float:
    """Summed FLOPs of the rows whose op name is in ``names``."""
    return float(roofline.loc[roofline["name"].isin(list(names)), "flops"].sum())
