"""Trace analyses: pure functions from the event table to tables (HolisticTraceAnalysis' definitions).

Definitions follow HTA (facebookresearch/HolisticTraceAnalysis) so that results are comparable:
GPU events are kernels, memcpys and memsets; per rank the kernel span runs from the first GPU event's
start to the last one's end; idle time is the span minus the union of GPU events; communication
kernels match ``^nccl`` (this covers the newer ``ncclDevKernel_*`` names HTA 0.5 misses), memory
events are memcpy and memset, everything else on a GPU is computation. Times are integer ns.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pandas as pd

from advisor.trace.table import GPU_KINDS, grouped_lexsort, kind_mask, unique_first, unique_inverse


def _case_insensitive(pattern: str) -> re.Pattern[str]:
    """A case-insensitive name pattern, written in lower case and compiled for lower-cased names (see
    _search)."""
    if pattern != pattern.lower():
        raise ValueError(f"write case-insensitive name patterns in lower case: {pattern!r}")
    return re.compile(pattern)


def _search(pattern: re.Pattern[str], name: str) -> bool:
    """Whether ``pattern`` (from _case_insensitive) matches ``name`` in any case. An ASCII name is
    lowered once and matched case-sensitively: the same matches as IGNORECASE, 4x faster on real
    kernel names (300 characters on average: 3 ms instead of 13 ms for the 199 in trace_filter).
    Other names keep IGNORECASE, whose Unicode case folding str.lower lacks (compiled on first use)."""
    if name.isascii():
        return pattern.search(name.lower()) is not None
    return re.search(pattern.pattern, name, re.IGNORECASE) is not None


COMM_RE = _case_insensitive(r"^nccl|ncclkernel|nccldevkernel")
TYPES = ("COMPUTATION", "COMMUNICATION", "MEMORY")
CONSECUTIVE_KERNEL_DELAY_NS = 30_000  # HTA's default for the idle split
# Fine kernel categories, first match wins (names of cuBLAS/CUTLASS/Hopper nvjet GEMMs, FlashAttention,
# cuDNN/MIOpen/Composable Kernel convolutions, PyTorch's elementwise and reduction templates, fused
# optimizers). Case-insensitive.
CATEGORY_PATTERNS = (
    ("communication", COMM_RE),
    ("attention", _case_insensitive(r"flash|fmha|attention|_attn|mha_")),
    # Before gemm: convolutions run as implicit GEMMs and many say so (sm80_xmma_fprop_implicit_gemm,
    # MIOpen's igemm_fwd_gtcx*, CK's grouped_conv_fwd ... GridwiseGemm). cuDNN: scudnn/hcudnn kernels,
    # winograd, fprop/dgrad/wgrad (xmma, CUTLASS s1688fprop, dgrad_engine, wgrad_alg0_engine,
    # cudnn::cnn::reduce_wgrad), its
    # FFT convolutions (fft2d_r2c/c2r with cudnn:: arguments) and cask_cudnn's offset kernels; MIOpen's
    # naive_conv and igemm kernels; CK's conv bwd-weight kernel (kernel_batched_gemm_xdlops_bwd_weight,
    # composable_kernel device_grouped_conv_bwd_weight_xdl_cshuffle.hpp). Not Inductor's
    # triton_*_fused_convolution_* kernels: those are the epilogue around a convolution, elementwise.
    (
        "convolution",
        _case_insensitive(
            r"^(?!triton_).*?(?:conv(?!ert)|implicit_gemm|implicit_convolve|[sh]cudnn|winograd|fft.*cudnn"
            r"|(?:xmma|cudnn)[\w:]*(?:fprop|dgrad|wgrad)|\d(?:fprop|dgrad|wgrad)|dgrad_engine|wgrad_alg\d|cask_cudnn"
            r"|igemm_(?:fwd|bwd|wrw)|xdlops_bwd_weight)"
        ),
    ),
    # ATen's max_pool/avg_pool/adaptive_average_pool, cuDNN's pooling_fw/bw, MIOpen's mloPooling*; not
    # FBGEMM's permute_pooled_embs (an embedding permute).
    ("pooling", _case_insensitive(r"(?:max|avg|average)_?pool|pooling")),
    # cuBLAS/cuBLASLt/CUTLASS/nvjet on NVIDIA; rocBLAS/hipBLASLt Tensile kernels (Cijk_...) on AMD.
    (
        "gemm",
        _case_insensitive(
            r"(?<!fb)gemm|cutlass|cublas|nvjet|xmma|wgmma|gemv|splitkreduce|matmul|^cijk_|rocblas|hipblaslt"
        ),
    ),
    ("normalization", _case_insensitive(r"norm(?!al)|bn_fw|bn_bw|batch_norm")),
    # Not "lamb": PyTorch kernel names are full of "{lambda(...)}".
    ("optimizer", _case_insensitive(r"adam|sgd|multi_tensor_apply|optimizer")),
    # Not cuDNN's "reduced_divisor" (an argument type of its FFT and other kernels).
    (
        "reduction",
        _case_insensitive(r"reduce(?!d_divisor)|softmax|cross_entropy|nll_loss|argmax|sum_kernel|max_kernel|cunn_"),
    ),
    (
        "elementwise",
        _case_insensitive(r"elementwise|vectorized|unrolled|pointwise|triton_|catarray|copy_kernel|fill|index"),
    ),
)
# Every value kernel_category returns, in the order groupby sorts them (by name).
CATEGORIES = tuple(sorted([*(c for c, _ in CATEGORY_PATTERNS), "other", "memcpy", "memset"]))


def _label(labels: pd.Index, code: int) -> str:
    return str(labels[code]) if code >= 0 else "nan"  # "nan": what astype(str) makes of a missing name


def _per_name(names: pd.Series, rows: np.ndarray, fn: Callable[[str], object], dtype: object = object) -> np.ndarray:
    """``fn(name)`` for the rows ``rows`` (a mask or positions) of the categorical ``names``, evaluated
    once per distinct name; per row it is a lookup by category code."""
    if not isinstance(names.dtype, pd.CategoricalDtype):
        names = names.astype("category")
    codes, labels = names.array.codes[rows], names.cat.categories
    per_code = np.zeros(len(labels) + 1, dtype=dtype)  # the extra last slot serves code -1 (missing)
    for c in np.unique(codes).tolist():
        per_code[c] = fn(_label(labels, c))
    return per_code[codes]


def _totals(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(distinct keys ascending, sum of ``values`` per key in their integer dtype, count per key)."""
    uniq, inv = unique_inverse(keys)
    sums = np.zeros(uniq.size, dtype=values.dtype)
    np.add.at(sums, inv, values)
    return uniq, sums, np.bincount(inv, minlength=uniq.size)


def _totals_by_name(names: pd.Series, rows: np.ndarray, values: np.ndarray) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(distinct names of the rows ``rows`` in ascending order, as groupby on ``names.astype(str)``
    sorts them; sum of ``values`` per name; count per name)."""
    codes, labels = names.array.codes[rows], names.cat.categories
    uniq, sums, counts = _totals(codes, values)
    text = [_label(labels, c) for c in uniq.tolist()]
    order = np.array(sorted(range(len(text)), key=text.__getitem__), dtype=np.intp)
    return [text[i] for i in order], sums[order], counts[order]


def drop_last_profiler_step(df: pd.DataFrame) -> pd.DataFrame:
    """The events of the complete profiler steps: per rank, host events that start before the last
    ``ProfilerStep#N`` range and the GPU events their runtime calls launched (HTA's default window:
    the last step is cut off by the end of the capture). A rank with fewer than two ProfilerStep ranges
    is kept whole. Only the host's ranges count: a ROCm trace repeats each on the GPU
    (gpu_user_annotation), and the copy of the last step starts later than the host's range, which
    would keep the host events of that step's first moments."""
    ranks, start, corr = (df[c].to_numpy() for c in ("rank", "start_ns", "correlation"))
    on_gpu = kind_mask(df, *GPU_KINDS)
    steps = kind_mask(df, "annotation") & (df["device"].to_numpy() == -1)
    steps[steps] = _per_name(df["name"], steps, lambda n: n.startswith("ProfilerStep#"), bool)
    keep = np.ones(len(df), dtype=bool)
    for rank in np.unique(ranks[steps]).tolist():
        in_rank = ranks == rank
        step_starts = start[in_rank & steps]
        if step_starts.size < 2:
            continue
        host = in_rank & ~on_gpu & (start < step_starts.max())
        launched = np.isin(corr, corr[host & (corr >= 0)])
        keep &= ~in_rank | host | (on_gpu & launched)
    out = df[keep]
    if not out.index.is_monotonic_increasing:
        out = out.sort_index()
    out.attrs = dict(df.attrs)
    return out


def round_like_hta(df: pd.DataFrame) -> pd.DataFrame:
    """The table with HTA 0.5's rounding of sub-microsecond traces applied: every event shrunk inward
    to whole microseconds (start rounded up, end rounded down; hta/common/trace_parser.py
    round_down_time_stamps, a workaround for pytorch/pytorch#122425). Only for comparing with HTA:
    our analyses keep nanoseconds, and on traces full of ~1 us events the rounding adds idle time."""
    if not (df["start_ns"] % 1000).any() and not (df["dur_ns"] % 1000).any():
        return df  # whole-microsecond trace: HTA leaves it as it is
    # HTA does this in float64 microseconds, where ts + dur itself rounds (to 0.25 us at epoch times):
    # the same arithmetic here gives its boundaries exactly. The start is rebuilt as the float the JSON
    # held, whole microseconds and the fraction apart: ``start_ns / 1000.0`` would first round the ns
    # (to 256 ns at epoch times) and move ~1 in 1000 boundaries across a whole microsecond.
    start_ns = df["start_ns"].to_numpy()
    whole_us = start_ns // 1000
    start_us = whole_us.astype(np.float64) + (start_ns - whole_us * 1000) / 1000.0
    end_us = start_us + df["dur_ns"].to_numpy() / 1000.0
    first = np.ceil(start_us).astype(np.int64)
    last = np.floor(end_us).astype(np.int64)
    out = df.copy()
    out["start_ns"] = first * 1000
    out["dur_ns"] = np.maximum(last - first, 0) * 1000
    return out


def hta_type(gpu: pd.DataFrame) -> np.ndarray:
    """COMPUTATION / COMMUNICATION / MEMORY for each GPU event (as codes 0, 1, 2)."""
    return _hta_types(gpu, np.ones(len(gpu), dtype=bool))


def _hta_types(df: pd.DataFrame, rows: np.ndarray) -> np.ndarray:
    comm = _per_name(df["name"], rows, lambda n: _search(COMM_RE, n), bool)
    memory = kind_mask(df, "memcpy", "memset")[rows]
    return np.where(comm, 1, np.where(memory, 2, 0))


def kernel_category(name: str, kind: str = "kernel") -> str:
    """The fine category of one GPU event (memcpy and memset by kind, kernels by name)."""
    if kind in ("memcpy", "memset"):
        return kind
    return _name_category(name)


@functools.lru_cache(maxsize=2**16)
def _name_category(name: str) -> str:
    """A kernel's category by its name, each name judged once: an analysis asks for the same names in
    several tables (the breakdown, the GEMM precisions), each a dozen regex searches."""
    for category, pattern in CATEGORY_PATTERNS:
        if _search(pattern, name):
            return category
    return "other"


def _sweep(starts: np.ndarray, ends: np.ndarray, types: np.ndarray, n_types: int = 3) -> np.ndarray:
    """Time (ns) spent in each combination of active types: index = bitmask of active types."""
    if starts.size == 0:
        return np.zeros(2**n_types, dtype=np.int64)
    t = np.concatenate([starts, ends])
    bit = np.concatenate([types, types])
    sign = np.concatenate([np.ones(starts.size, np.int64), -np.ones(ends.size, np.int64)])
    order = np.argsort(t, kind="stable")
    t, bit, sign = t[order], bit[order], sign[order]
    # One running count per type (a 1-D pass each: several times cheaper than an (events x types) array).
    mask = np.zeros(t.size, dtype=np.int64)
    for k in range(n_types):
        mask |= (np.cumsum(np.where(bit == k, sign, 0)) > 0).astype(np.int64) << k
    dur = np.diff(t)
    return np.bincount(mask[:-1], weights=dur, minlength=2**n_types).astype(np.int64)


def union_ns(starts: np.ndarray, ends: np.ndarray) -> int:
    """Length of the union of intervals [start, end), in ns."""
    if starts.size == 0 or (ends < starts).any():  # the sweep's count handles reversed intervals
        return int(_sweep(starts, ends, np.zeros(starts.size, dtype=np.int64), 1)[1])
    # Merged in start order: a new stretch begins where an interval starts after all before it ended.
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], np.maximum.accumulate(ends[order])
    first = np.r_[True, s[1:] > e[:-1]]
    last = np.r_[first[1:], True]
    return int((e[last] - s[first]).sum())


def type_sweeps(df: pd.DataFrame) -> dict[int, tuple[int, np.ndarray]]:
    """Per rank: (kernel span in ns, time per combination of active GPU-event types in ns), the one
    sweep that the temporal, kernel-type and overlap breakdowns all read."""
    gpu = kind_mask(df, *GPU_KINDS)
    ranks, starts = df["rank"].to_numpy()[gpu], df["start_ns"].to_numpy()[gpu]
    ends = starts + df["dur_ns"].to_numpy()[gpu]
    types = _hta_types(df, gpu)
    out = {}
    for rank in np.unique(ranks).tolist():
        sel = ranks == rank
        s, e = starts[sel], ends[sel]
        out[int(rank)] = (int(e.max() - s.min()), _sweep(s, e, types[sel]))
    return out


_COMPUTE_MASKS = [m for m in range(8) if m & 1]
_MEMORY_ALONE_MASKS = [m for m in range(8) if m & 4 and not m & 1]


def temporal_breakdown(df: pd.DataFrame, sweeps: dict | None = None) -> pd.DataFrame:
    """Per rank: kernel span split into idle, compute and non-compute (communication + memory) time.
    ``sweeps`` takes type_sweeps(df) already computed.

    Two idle figures, because they answer different questions:

    - ``idle_*``: no GPU event of any type runs (HTA's definition: a copy or set counts as busy). This is
      the figure to compare with HTA, and the one the host-wait split (idle_time_breakdown) divides.
    - ``compute_idle_*``: no computation kernel runs (copies, sets and communication kernels do not count
      as busy); ``idle + non_compute``. A capture that mostly copies reads ~0 % idle and ~100 % compute
      idle. ``memory_alone_*`` is the part of it where a copy or set runs and no computation does.
    """
    rows = []
    for rank, (span, per_mask) in (type_sweeps(df) if sweeps is None else sweeps).items():
        busy = int(per_mask[1:].sum())
        compute = int(per_mask[_COMPUTE_MASKS].sum())
        memory_alone = int(per_mask[_MEMORY_ALONE_MASKS].sum())
        rows.append((rank, span, span - busy, compute, busy - compute, span - compute, memory_alone))
    columns = [
        "rank",
        "kernel_span_ns",
        "idle_ns",
        "compute_ns",
        "non_compute_ns",
        "compute_idle_ns",
        "memory_alone_ns",
    ]
    out = pd.DataFrame(rows, columns=columns)
    for col in ("idle", "compute", "non_compute", "compute_idle", "memory_alone"):
        out[f"{col}_pct"] = 100 * out[f"{col}_ns"] / out["kernel_span_ns"]
    return out


def gpu_idle(df: pd.DataFrame) -> pd.DataFrame:
    """Idle time per device and over all devices at once, under both definitions of temporal_breakdown
    (``idle_*``: no GPU event runs, copies count as busy, HTA's; ``compute_idle_*``: no computation
    kernel runs).

    One row per (rank, device) that ran GPU work, over that device's own span (first GPU event's start
    to the last one's end), and a last row with ``rank`` and ``device`` -1, ``scope`` 'all devices':
    the time no device runs anything, over the span from the first GPU event of the trace to its last.
    The union needs one clock: true within one Nsight Systems capture and within one node's Kineto
    ranks; ranks on different nodes carry their hosts' clock offsets (a few ms skew the union). A
    process that drives two GPUs (one nsys capture of a single-process job) is one rank of
    temporal_breakdown with its devices' work unioned; here each device has its own row."""
    gpu = kind_mask(df, *GPU_KINDS)
    columns = ["scope", "rank", "device", "span_ns", "idle_ns", "idle_pct", "compute_idle_ns", "compute_idle_pct"]
    if not gpu.any():
        return pd.DataFrame(columns=columns)
    starts = df["start_ns"].to_numpy()[gpu]
    ends = starts + df["dur_ns"].to_numpy()[gpu]
    compute = _hta_types(df, gpu) == 0
    ranks, devices = df["rank"].to_numpy()[gpu], df["device"].to_numpy()[gpu]
    rows = []

    def row(scope: str, rank: int, device: int, sel: np.ndarray) -> None:  # sel: a mask or positions
        s, e = starts[sel], ends[sel]
        span = int(e.max() - s.min())
        idle = span - union_ns(s, e)
        compute_idle = span - union_ns(s[compute[sel]], e[compute[sel]])
        rows.append((scope, rank, device, span, idle, compute_idle))

    # One sort of an int64 key (rank, device) instead of np.unique(axis=0)'s row sort: 10x faster on
    # millions of events.
    key = ranks.astype(np.int64) * (1 << 32) + (devices.astype(np.int64) + 1)
    order = np.argsort(key, kind="stable")
    bounds = np.flatnonzero(np.diff(key[order])) + 1
    for part in np.split(order, bounds):
        row("device", int(ranks[part[0]]), int(devices[part[0]]), part)
    row("all devices", -1, -1, np.ones(starts.size, dtype=bool))
    out = pd.DataFrame(rows, columns=[c for c in columns if not c.endswith("_pct")])
    with np.errstate(divide="ignore", invalid="ignore"):
        for col in ("idle", "compute_idle"):
            out[f"{col}_pct"] = 100 * out[f"{col}_ns"] / out["span_ns"].where(out["span_ns"] > 0)
    return out[columns]


def _mask_label(mask: int) -> str:
    return " overlapping ".join(t for i, t in enumerate(TYPES) if mask & (1 << i))


def kernel_type_breakdown(df: pd.DataFrame, sweeps: dict | None = None) -> pd.DataFrame:
    """Busy GPU time by type, overlaps as their own rows, summed over ranks (HTA's kernel_type_breakdown)."""
    total = np.zeros(8, dtype=np.int64)
    for _, per_mask in (type_sweeps(df) if sweeps is None else sweeps).values():
        total += per_mask
    rows = [(_mask_label(m), int(total[m])) for m in range(1, 8) if total[m] > 0]
    out = pd.DataFrame(rows, columns=["kernel_type", "time_ns"]).sort_values("time_ns", ascending=False)
    out["time_pct"] = 100 * out["time_ns"] / out["time_ns"].sum()
    return out.reset_index(drop=True)


def comm_comp_overlap(df: pd.DataFrame, sweeps: dict | None = None) -> pd.DataFrame:
    """Per rank: share of communication time that overlaps computation (NaN without communication)."""
    rows = []
    for rank, (_, per_mask) in (type_sweeps(df) if sweeps is None else sweeps).items():
        comm = int(per_mask[[m for m in range(8) if m & 2]].sum())
        overlap = int(per_mask[[m for m in range(8) if m & 3 == 3]].sum())
        rows.append((rank, comm, overlap, 100 * overlap / comm if comm else float("nan")))
    return pd.DataFrame(rows, columns=["rank", "comm_ns", "overlap_ns", "overlap_pct"])


GRAPH_LAUNCH_RE = re.compile(r"^(?:cuda|cu|hip)GraphLaunch")


@dataclass(frozen=True)
class LaunchCalls:
    """One rank's runtime calls that launched GPU work: per correlation id (ascending), the start and
    duration of the first runtime call in the table with that id, and whether that call is a CUDA
    graph launch (one call whose correlation id every kernel of the graph carries)."""

    correlation: np.ndarray
    start_ns: np.ndarray
    dur_ns: np.ndarray
    graph: np.ndarray

    def find(self, correlation: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(whether each id has a call, the position of its call where it has one)."""
        pos = np.searchsorted(self.correlation, correlation)
        if self.correlation.size == 0:
            return np.zeros(len(correlation), dtype=bool), pos
        return self.correlation[np.minimum(pos, self.correlation.size - 1)] == correlation, pos


_NO_CALLS = LaunchCalls(*(np.zeros(0, dtype=np.int64) for _ in range(3)), np.zeros(0, dtype=bool))  # launched nothing


def launch_calls(df: pd.DataFrame) -> dict[int, LaunchCalls]:
    """Per rank: the runtime calls that launched GPU work, by correlation id (what idle_time_breakdown
    and launch_stats join GPU events to)."""
    corr = df["correlation"].to_numpy()
    rows = np.flatnonzero(kind_mask(df, "runtime") & (corr >= 0))
    ranks, corr = df["rank"].to_numpy()[rows], corr[rows]
    start, dur = df["start_ns"].to_numpy()[rows], df["dur_ns"].to_numpy()[rows]
    graph = _per_name(df["name"], rows, lambda n: GRAPH_LAUNCH_RE.match(n) is not None, bool)
    out = {}
    for rank in np.unique(ranks).tolist():
        in_rank = np.flatnonzero(ranks == rank)
        ids, first = unique_first(corr[in_rank])  # first: each id's first occurrence
        call = in_rank[first]
        out[int(rank)] = LaunchCalls(ids, start[call], dur[call], graph[call])
    return out


IDLE_CATEGORIES = ("host_wait", "kernel_wait", "other")
IDLE_INTERVAL_COLUMNS = ["rank", "stream", "idle_category", "start_ns", "idle_ns"]


class IdleGaps(NamedTuple):
    """The gaps between consecutive GPU events of each stream, classified by idle_time_breakdown's
    rules: ``ranks`` and ``streams`` of each stream with a GPU event, ordered by rank then stream; per
    gap, in that order and then by time, ``at`` (its stream's position in those), ``start_ns`` (the
    earlier event's end), ``idle_ns`` (its length) and ``category`` (an index into IDLE_CATEGORIES)."""

    ranks: np.ndarray
    streams: np.ndarray
    at: np.ndarray
    start_ns: np.ndarray
    idle_ns: np.ndarray
    category: np.ndarray


def idle_gaps(
    df: pd.DataFrame,
    consecutive_delay_ns: int = CONSECUTIVE_KERNEL_DELAY_NS,
    *,
    launches: dict[int, LaunchCalls] | None = None,
) -> IdleGaps:
    """The idle gaps of every GPU stream, computed once for idle_time_breakdown, idle_intervals and
    queues.idle_interval_stats (each takes them as ``gaps``; at 3.7 GB each had computed them again:
    7.7 M GPU events sorted by stream and joined to their launches). ``launches`` takes
    launch_calls(df) already computed."""
    launches = launch_calls(df) if launches is None else launches
    gpu = kind_mask(df, *GPU_KINDS)
    rank, stream, start, dur, corr = (
        df[c].to_numpy()[gpu] for c in ("rank", "stream", "start_ns", "dur_ns", "correlation")
    )
    order = grouped_lexsort((start, stream, rank))  # stable, as sort_values on several columns
    rank, stream, start, corr = rank[order], stream[order], start[order], corr[order]
    end = start + dur[order]
    first = np.ones(rank.size, dtype=bool)  # the first event of its stream
    first[1:] = (rank[1:] != rank[:-1]) | (stream[1:] != stream[:-1])
    after = np.flatnonzero(~first)  # each event that follows another on its stream closes a gap
    prev_end = end[after - 1]
    gaps = start[after] - prev_end
    # Launch starts as float, NaN where no call launched the event (HTA compares in float too).
    launched = np.full(after.size, np.nan)
    gap_rank = rank[after]
    bounds = np.flatnonzero(gap_rank[1:] != gap_rank[:-1]) + 1  # ranks are sorted: one slice each
    for a, b in itertools.pairwise([0, *bounds.tolist(), gap_rank.size] if gap_rank.size else []):
        calls = launches.get(int(gap_rank[a]), _NO_CALLS)
        found, pos = calls.find(corr[after[a:b]])
        launched[a + np.flatnonzero(found)] = calls.start_ns[pos[found]]
    host = launched > prev_end
    kernel = ~host & (gaps < consecutive_delay_ns)
    category = np.where(host, 0, np.where(kernel, 1, 2))
    return IdleGaps(rank[first], stream[first], np.cumsum(first)[after] - 1, prev_end, gaps, category)


def idle_intervals(
    df: pd.DataFrame,
    consecutive_delay_ns: int = CONSECUTIVE_KERNEL_DELAY_NS,
    *,
    launches: dict[int, LaunchCalls] | None = None,
    gaps: IdleGaps | None = None,
) -> pd.DataFrame:
    """Every idle interval of every GPU stream, the ones idle_time_breakdown sums: per rank and stream,
    one row per GPU event that follows another on its stream, ordered by rank, stream and time, with
    ``start_ns`` (the earlier event's end), ``idle_ns`` (the gap to this event's start; negative where
    the two overlap) and ``idle_category`` (host_wait, kernel_wait or other, by idle_time_breakdown's
    rules). ``launches`` takes launch_calls(df) and ``gaps`` idle_gaps(df) already computed (with the
    same delay)."""
    ranks, streams, at, start, gaps, category = (
        idle_gaps(df, consecutive_delay_ns, launches=launches) if gaps is None else gaps
    )
    return pd.DataFrame(
        {
            "rank": ranks[at],
            "stream": streams[at],
            "idle_category": pd.Categorical.from_codes(category, categories=list(IDLE_CATEGORIES)),
            "start_ns": start,
            "idle_ns": gaps,
        },
        columns=IDLE_INTERVAL_COLUMNS,
        copy=False,
    )


def idle_time_breakdown(
    df: pd.DataFrame,
    consecutive_delay_ns: int = CONSECUTIVE_KERNEL_DELAY_NS,
    *,
    launches: dict[int, LaunchCalls] | None = None,
    gaps: IdleGaps | None = None,
) -> pd.DataFrame:
    """Per rank and stream: idle time between consecutive GPU events split into host wait (the next
    event was launched only after the previous one finished: the GPU waited for the CPU), kernel wait
    (a gap shorter than ``consecutive_delay_ns`` between back-to-back events: launch overhead) and
    other, with each category's share of that stream's idle time (every stream has the three rows;
    ``idle_intervals`` lists the intervals themselves).

    HTA's exact rules, for comparable numbers: the gap is measured from the previous event's end, host
    wait needs the launch to start strictly after it, and (rare) negative gaps from overlapping events
    on one stream count in the sums. ``launches`` takes launch_calls(df) and ``gaps`` idle_gaps(df)
    already computed (with the same delay)."""
    ranks, streams, at, _, gaps, category = (
        idle_gaps(df, consecutive_delay_ns, launches=launches) if gaps is None else gaps
    )
    n = len(IDLE_CATEGORIES)
    idle = np.zeros(ranks.size * n, dtype=np.int64)
    np.add.at(idle, at * n + category, gaps)
    total = np.repeat(idle.reshape(-1, n).sum(axis=1), n)
    with np.errstate(divide="ignore", invalid="ignore"):
        frac = np.where(total != 0, idle / total, np.nan)
    return pd.DataFrame(
        {
            "rank": np.repeat(ranks.astype(np.int64), n),
            "stream": np.repeat(streams.astype(np.int64), n),
            "idle_category": np.tile(np.array(IDLE_CATEGORIES, dtype=object), ranks.size),
            "idle_ns": idle,
            "idle_frac": frac,
        }
    )


def idle_split(df: pd.DataFrame, consecutive_delay_ns: int = CONSECUTIVE_KERNEL_DELAY_NS) -> pd.DataFrame:
    """Per rank: idle time by category summed over streams, as shares in %."""
    return idle_split_of(idle_time_breakdown(df, consecutive_delay_ns))


def idle_split_of(per_stream: pd.DataFrame) -> pd.DataFrame:
    """idle_split from an idle_time_breakdown table already computed."""
    ranks, inv = np.unique(per_stream["rank"].to_numpy(), return_inverse=True)
    category, idle = per_stream["idle_category"].to_numpy(), per_stream["idle_ns"].to_numpy()
    sums = {}
    for c in ("host_wait", "kernel_wait", "other"):
        sums[c] = np.zeros(ranks.size, dtype=idle.dtype)
        np.add.at(sums[c], inv[category == c], idle[category == c])
    total = sums["host_wait"] + sums["kernel_wait"] + sums["other"]
    with np.errstate(divide="ignore", invalid="ignore"):  # a rank without idle time: NaN, as pandas gives
        return pd.DataFrame({"rank": ranks, **{f"{c}_pct": 100 * s / total for c, s in sums.items()}})


# GEMM math modes from cuBLAS/CUTLASS kernel names: plain FP32 on the SIMT cores ("volta_sgemm_*",
# "ampere_sgemm_*"); TF32 tensor cores ("*_s1688gemm_*" is Ampere's 16x8x8 TF32 MMA, or "tf32" in
# the name); everything else (h884/h16816/bf16/fp8/nvjet/wgmma...) runs 16- or 8-bit tensor cores.
GEMM_PRECISIONS = ("fp32", "tf32", "tensor_core_16bit_or_other")
_TF32_RE = _case_insensitive(r"tf32|s1688gemm")
_SGEMM_RE = _case_insensitive(r"sgemm|gemmsn_|gemv2[tn]_kernel_val<float")
_TENSOR_CORE_RE = _case_insensitive(r"tensorop|xmma|wgmma|hmma|16816|884|nvjet")
# cuBLAS's fp32 GEMMs without TF32 on Ampere/Hopper: xmma kernels of fp32 in, compute and out on the
# SIMT FMA units ("sm80_xmma_gemm_f32f32_f32f32_f32_..._ffma_..."; TF32 ones say "tf32f32"), and the
# k = 1 outer-product kernel.
_FP32_SIMT_RE = _case_insensitive(r"_ffma|f32f32_f32f32_f32|gemmk1_kernel<float")


# AMD's Tensile GEMMs (rocBLAS, hipBLASLt) name their problem type after the index letters, the A/B
# data type's letter first (ROCm/Tensile @ a164ed70: Tensile/SolutionStructs.py ProblemType.__str__,
# the letters in Tensile/DataType.py): S single, D double, C/Z complex single/double, H half, B bfloat16,
# X xfloat32, I8/4xi8 int8, F8/B8 fp8; then the destination and compute types of the mixed ones (HHS,
# BBS: 16-bit in, fp32 accumulate), B for beta and H for high-precision accumulate, fused ("SB",
# "BBS_BH") or, in newer hipBLASLt, apart ("S_B", "B_BS_BH"). On CDNA an S kernel runs fp32 MFMA
# (MI16x16x1 f32) or FMA: fp32 either way, a quarter of the bf16 matrix rate on an MI250, an eighth on
# an MI300X.
_TENSILE_TYPE_RE = _case_insensitive(r"^cijk_a[a-z]+_b[a-z]+_([0-9a-z]+)")


def gemm_math(name: str) -> str:
    """'fp32', 'tf32' or 'tensor_core_16bit_or_other' for one GEMM kernel name."""
    tensile = _TENSILE_TYPE_RE.match(name.lower())
    if tensile is not None:
        return "fp32" if tensile.group(1)[0] in "sc" else "tensor_core_16bit_or_other"
    if _search(_TF32_RE, name):
        return "tf32"
    if _search(_FP32_SIMT_RE, name):
        return "fp32"
    if _search(_SGEMM_RE, name) and not _search(_TENSOR_CORE_RE, name):
        return "fp32"
    return "tensor_core_16bit_or_other"


def conv_math(name: str) -> str:
    """'tf32' or 'fp32' for a convolution kernel that computes on fp32 tensors: cuDNN names its TF32
    kernels (sm80_xmma_fprop_implicit_gemm_tf32f32_..., cutlass_tensorop_s1688fprop_..._tf32); its
    scudnn, winograd and FFT kernels and MIOpen's fp32 ones compute in plain fp32."""
    return "tf32" if _search(_TF32_RE, name) else "fp32"


def gemm_precision(df: pd.DataFrame) -> pd.DataFrame:
    """GEMM time by math mode (fp32 on SIMT cores, tf32, 16-bit/8-bit tensor cores), with each one's
    share of summed GPU-event time: fp32 GEMMs on a tensor-core GPU are the AMP opportunity."""
    gpu = kind_mask(df, *GPU_KINDS)
    dur = df["dur_ns"].to_numpy()[gpu]
    names = df["name"]
    if not isinstance(names.dtype, pd.CategoricalDtype):
        names = names.astype("category")
    mode = _per_name(
        names,
        gpu,
        lambda n: GEMM_PRECISIONS.index(gemm_math(n)) if kernel_category(n) == "gemm" else -1,
        np.int64,
    )
    total = dur.sum()
    rows = []
    for i, label in enumerate(GEMM_PRECISIONS):
        t = int(dur[mode == i].sum())
        rows.append((label, t, 100.0 * t / total if total else 0.0))
    return pd.DataFrame(rows, columns=["math", "time_ns", "time_pct"])


def kernel_breakdown(df: pd.DataFrame, top: int = 10) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(time per fine category with its share of summed GPU-event time, the top kernels by total time)."""
    gpu = kind_mask(df, *GPU_KINDS)
    names, dur = df["name"], df["dur_ns"].to_numpy()[gpu]
    # Each distinct name is classified once, as an index into CATEGORIES; copies and sets by their kind.
    cat = _per_name(names, gpu, lambda n: CATEGORIES.index(kernel_category(n)), np.int64)
    cat[kind_mask(df, "memcpy")[gpu]] = CATEGORIES.index("memcpy")
    cat[kind_mask(df, "memset")[gpu]] = CATEGORIES.index("memset")
    cats, time_ns, count = _totals(cat, dur)
    with np.errstate(divide="ignore", invalid="ignore"):
        by_cat = pd.DataFrame(
            {
                "category": np.array([CATEGORIES[c] for c in cats.tolist()], dtype=object),
                "time_ns": time_ns,
                "count": count,
                "time_pct": 100 * time_ns / time_ns.sum(),
            }
        )
    # Per (name, category), in the order groupby sorts them, before the sort by time (ties keep it).
    keys, time_ns, count = _totals(names.array.codes[gpu].astype(np.int64) * len(CATEGORIES) + cat, dur)
    labels = names.cat.categories
    pairs = [(_label(labels, k // len(CATEGORIES)), CATEGORIES[k % len(CATEGORIES)]) for k in keys.tolist()]
    order = np.array(sorted(range(len(pairs)), key=pairs.__getitem__), dtype=np.intp)
    by_name = pd.DataFrame(
        {
            "name": np.array([pairs[i][0] for i in order], dtype=object),
            "category": np.array([pairs[i][1] for i in order], dtype=object),
            "time_ns": time_ns[order],
            "count": count[order],
            "mean_ns": time_ns[order] / count[order],
        }
    )
    by_name = by_name.sort_values("time_ns", ascending=False).head(top)
    with np.errstate(divide="ignore", invalid="ignore"):
        by_name["time_pct"] = 100 * by_name["time_ns"].to_numpy() / dur.sum()
    return by_cat.sort_values("time_ns", ascending=False).reset_index(drop=True), by_name.reset_index(drop=True)


TINY_KERNEL_NS = 10_000  # kernels shorter than 10 us cannot hide a ~5-10 us launch: launch-bound territory
SYNC_RE = re.compile(
    r"^(?:cuda|hip)(?:DeviceSynchronize|StreamSynchronize|EventSynchronize|Memcpy|Memset)(?!Async|Peer)"
    r"|^cu(?:CtxSynchronize|StreamSynchronize|EventSynchronize)"  # the driver API's, where it is traced
)
# Synchronization records of cudaStreamWaitEvent: a GPU stream waits for an event, the host goes on
# (nsys' ENUM_CUPTI_SYNC_TYPE label "Stream wait sync", Kineto's "Stream Wait Event").
STREAM_WAIT_RE = _case_insensitive(r"^stream wait")
PHASES = ("step", "data", "forward", "backward", "optimizer")
SORTED_PHASES = tuple(sorted(PHASES))
PROFILER_STEP_RE = re.compile(r"^ProfilerStep#\d+$")
SELF_TIME_BLOCK = 65_536  # ops per block of the self-time walk
PARENT_ROUNDS = 256  # pointer-jumping rounds of _parents before the walk decides


def _host_ranges(df: pd.DataFrame, rows: np.ndarray) -> np.ndarray:
    """Those of ``rows`` (positions) that are host annotations (device -1)."""
    return rows[kind_mask(df, "annotation", rows=rows) & (df["device"].to_numpy()[rows] == -1)]


def launch_stats(
    df: pd.DataFrame, tiny_ns: int = TINY_KERNEL_NS, *, launches: dict[int, LaunchCalls] | None = None
) -> pd.DataFrame:
    """Per rank: kernel launch statistics from runtime calls joined to kernels by correlation id.

    launch delay = kernel start minus the end of the runtime call that launched it (0 when the GPU
    started it before the call returned), in us; tiny kernels are shorter than ``tiny_ns``. Many tiny
    kernels with the GPU mostly idle waiting for the host is the launch-bound signature. Kernels of a
    CUDA graph (``graph_kernels``) all carry the correlation id of their one cudaGraphLaunch, so a
    delay from that call says nothing about any one launch: they count among the kernels and tiny
    kernels but stay out of the launch delay and launch call figures. ``launches`` takes
    launch_calls(df) already computed.
    """
    launches = launch_calls(df) if launches is None else launches
    kernel = kind_mask(df, "kernel")
    ranks, start, dur, corr = (df[c].to_numpy()[kernel] for c in ("rank", "start_ns", "dur_ns", "correlation"))
    rows = []
    for rank in np.unique(ranks).tolist():
        sel = ranks == rank
        k_dur = dur[sel]
        calls = launches.get(int(rank), _NO_CALLS)
        found, pos = calls.find(corr[sel])
        graph = np.zeros(found.size, dtype=bool)
        graph[found] = calls.graph[pos[found]]
        single = found & ~graph  # a kernel launched by a call of its own
        call = pos[single]
        call_dur = calls.dur_ns[call]
        delay = np.maximum(0, start[sel][single] - calls.start_ns[call] - call_dur)
        tiny = k_dur < tiny_ns
        rows.append(
            {
                "rank": int(rank),
                "kernels": int(sel.sum()),
                "graph_kernels": int(graph.sum()),
                "kernel_mean_us": k_dur.mean() / 1e3,
                "tiny_kernel_frac": tiny.mean(),
                "tiny_kernel_time_frac": k_dur[tiny].sum() / max(k_dur.sum(), 1),
                "launch_delay_mean_us": delay.mean() / 1e3 if delay.size else float("nan"),
                "launch_delay_p95_us": np.percentile(delay, 95) / 1e3 if delay.size else float("nan"),
                "launch_call_mean_us": call_dur.mean() / 1e3 if call_dur.size else float("nan"),
            }
        )
    return pd.DataFrame(rows)


MEMCPY_COLUMNS = [
    "copy_kind",
    "host_mem",
    "count",
    "unknown_size_count",
    "bytes",
    "time_ns",
    "bandwidth_gbps",
    "pageable",
]


def memcpy_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Copies by direction and host memory kind: count, copies whose size the trace does not give
    (bytes 0: ``unknown_size_count``), bytes, time in ns, bandwidth in GB/s, and whether the host side
    is pageable (a host<->device copy from pageable memory is staged and synchronous).

    The bandwidth is that of the copies of known size (their bytes over their time): NaN where none
    has a size, as a copy of unknown size moved an unknown number of bytes, not zero."""
    copy_kind, host_mem = df["copy_kind"], df["host_mem"]
    kind_code, mem_code = copy_kind.array.codes, host_mem.array.codes
    copies = kind_mask(df, "memcpy") & (kind_code >= 0) & (mem_code >= 0)  # groupby drops missing keys
    if not copies.any():
        return pd.DataFrame(columns=MEMCPY_COLUMNS)
    # Groups in category-code order, as groupby on categoricals sorts them.
    n_mem = len(host_mem.cat.categories)
    key = kind_code[copies].astype(np.int64) * n_mem + mem_code[copies]
    copy_bytes, dur = df["bytes"].to_numpy()[copies], df["dur_ns"].to_numpy()[copies]
    sized = copy_bytes > 0
    keys, nbytes, count = _totals(key, copy_bytes)
    _, time_ns, _ = _totals(key, dur)
    sized_time_ns = np.zeros(keys.size, dtype=dur.dtype)
    np.add.at(sized_time_ns, np.searchsorted(keys, key[sized]), dur[sized])
    unknown = np.bincount(np.searchsorted(keys, key[~sized]), minlength=keys.size)
    kinds = pd.Categorical.from_codes(keys // n_mem, dtype=copy_kind.dtype)
    mems = pd.Categorical.from_codes(keys % n_mem, dtype=host_mem.dtype)
    bandwidth = np.where(unknown < count, nbytes / np.maximum(sized_time_ns, 1), np.nan)  # bytes/ns = GB/s
    out = pd.DataFrame(
        {
            "copy_kind": kinds,
            "host_mem": mems,
            "count": count,
            "unknown_size_count": unknown,
            "bytes": nbytes,
            "time_ns": time_ns,
            "bandwidth_gbps": bandwidth,
            "pageable": (np.asarray(mems.astype(str)) == "pageable")
            & np.isin(np.asarray(kinds.astype(str)), ("HtoD", "DtoH")),
        }
    )
    return out.sort_values("time_ns", ascending=False).reset_index(drop=True)


SYNC_WAIT_COLUMNS = ["rank", "tid", "name", "start_ns", "dur_ns", "blocking"]


def _inside(starts: np.ndarray, ends: np.ndarray, s: np.ndarray, e: np.ndarray) -> np.ndarray:
    """Whether each interval [s, e) lies inside one of the intervals [starts, ends)."""
    if starts.size == 0:
        return np.zeros(s.size, dtype=bool)
    order = np.argsort(starts, kind="stable")
    starts, reach = starts[order], np.maximum.accumulate(ends[order])  # reach: the furthest end so far
    pos = np.searchsorted(starts, s, side="right") - 1
    return (pos >= 0) & (reach[np.maximum(pos, 0)] >= e)


def sync_waits(df: pd.DataFrame, *, launches: dict[int, LaunchCalls] | None = None) -> pd.DataFrame:
    """Every wait of the host for the GPU, each once: ``rank``, ``tid`` (-1 where a record names no host
    thread), ``name``, ``start_ns``, ``dur_ns`` and ``blocking`` (whether the host waited).

    Two sources record the same waits: the runtime calls that block (``SYNC_RE``: device, stream and
    event synchronize, blocking cudaMemcpy/cudaMemset) and the synchronization records CUPTI writes for
    them (nsys CUPTI_ACTIVITY_KIND_SYNCHRONIZATION, Kineto ``cuda_sync``). A record belongs to the call
    of its rank that has its correlation id (ids are per process) or, without an id, to a blocking
    call of its rank around it; the call is kept, with its host thread, and the record dropped, so the
    record of a call that does not block (cudaEventQuery polls) goes with that call. A record that no
    call accounts for (its API call not traced) is a blocking wait of its own. Stream-wait records
    (cudaStreamWaitEvent) are kept with ``blocking`` False: a GPU stream waits there, not the host.
    ``launches`` takes launch_calls(df) already computed."""
    launches = launch_calls(df) if launches is None else launches
    rank, tid, start, dur, corr = (df[c].to_numpy() for c in ("rank", "tid", "start_ns", "dur_ns", "correlation"))
    runtime = np.flatnonzero(kind_mask(df, "runtime"))
    calls = runtime[_per_name(df["name"], runtime, lambda n: SYNC_RE.search(n) is not None, bool)]
    records = np.flatnonzero(kind_mask(df, "sync"))
    stream_wait = _per_name(df["name"], records, lambda n: _search(STREAM_WAIT_RE, n), bool)
    own = np.ones(records.size, dtype=bool)  # no call accounts for the record
    for r in np.unique(rank[records]).tolist():
        mine = rank[records] == r
        with_id = mine & (corr[records] >= 0)
        own[with_id] = ~launches.get(int(r), _NO_CALLS).find(corr[records[with_id]])[0]
        without = mine & (corr[records] < 0)
        if without.any():
            around = calls[rank[calls] == r]
            lo, hi = start[records[without]], start[records[without]] + dur[records[without]]
            own[without] = ~_inside(start[around], start[around] + dur[around], lo, hi)
    kept = own | stream_wait
    rows = np.concatenate([calls, records[kept]])
    out = pd.DataFrame(
        {
            "rank": rank[rows],
            "tid": tid[rows],
            "name": df["name"].iloc[rows].to_numpy(),
            "start_ns": start[rows],
            "dur_ns": dur[rows],
            "blocking": np.concatenate([np.ones(calls.size, dtype=bool), ~stream_wait[kept]]),
        },
        columns=SYNC_WAIT_COLUMNS,
    )
    return out.sort_values(["rank", "start_ns"], kind="stable").reset_index(drop=True)


def sync_calls(df: pd.DataFrame, waits: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per name of the waits of ``sync_waits`` (the blocking host calls, the synchronization records no
    call accounts for, the stream waits): whether it is ``blocking``, its ``count`` and summed
    ``time_ns``, largest first. ``waits`` takes sync_waits(df) already computed."""
    waits = sync_waits(df) if waits is None else waits
    names = waits["name"].astype("category")
    codes, labels = names.array.codes.astype(np.int64), names.cat.categories
    keys, time_ns, count = _totals(codes * 2 + waits["blocking"].to_numpy(), waits["dur_ns"].to_numpy())
    out = pd.DataFrame(
        {
            "name": pd.Series([_label(labels, k // 2) for k in keys.tolist()], dtype="str"),
            "blocking": (keys % 2).astype(bool),
            "count": count.astype(np.int64),
            "time_ns": time_ns.astype(np.int64),
        }
    )
    return out.sort_values("time_ns", ascending=False, kind="stable").reset_index(drop=True)


SYNC_TIME_COLUMNS = [
    "rank",
    "span_ns",
    "blocking_calls",
    "blocking_ns",
    "blocking_pct",
    "stream_waits",
    "stream_wait_ns",
]


SPAN_BLOCK = 1 << 20  # rows per block of rank_spans


def rank_spans(df: pd.DataFrame, mask: np.ndarray | None = None) -> pd.DataFrame:
    """Per rank (ascending): its first event's start and its last event's end (``rank``, ``start_ns``,
    ``end_ns``), over the rows where ``mask`` holds (all by default; ``kind_mask(df, *GPU_KINDS)``: the
    kernel span), a block of rows at a time: no column of the table's length is made (48.6 M rows at
    3.7 GB). In each block the rows are put in rank order by a radix sort of 16-bit codes and each
    rank's least start and greatest end taken in one reduction: 0.70-0.75 s for the 47.0 M rows (2
    ranks) of a 3.7 GB nsys export, where np.minimum.at and np.maximum.at over every row (sync_time's
    way before) took 3.6 s. sync_time and the critical path's whole-trace window share it."""
    rank, start, dur = (df[c].to_numpy() for c in ("rank", "start_ns", "dur_ns"))
    if mask is not None and not mask.all():
        if not mask.any():
            rank = rank[:0]
        elif rank.size and int(rank.max()) - int(rank.min()) >= 2**16:
            return rank_spans(df[mask])  # the grouped path copies the rows anyway
    if rank.size == 0:
        return pd.DataFrame({"rank": rank[:0], "start_ns": start[:0], "end_ns": start[:0]})
    low = int(rank.min())
    width = int(rank.max()) - low + 1
    if width > 2**16:  # rank numbers far apart: grouped by pandas instead
        spans = df.assign(end_ns=df["start_ns"] + df["dur_ns"]).groupby("rank")
        return pd.DataFrame({"start_ns": spans["start_ns"].min(), "end_ns": spans["end_ns"].max()}).reset_index()
    first = np.full(width, np.iinfo(np.int64).max, dtype=np.int64)
    last = np.full(width, np.iinfo(np.int64).min, dtype=np.int64)
    seen = np.zeros(width, dtype=bool)
    for a in range(0, rank.size, SPAN_BLOCK):
        keep = slice(None) if mask is None else mask[a : a + SPAN_BLOCK]
        s = start[a : a + SPAN_BLOCK][keep]
        if s.size == 0:
            continue
        e = s + dur[a : a + SPAN_BLOCK][keep]
        if width == 1:
            first[0], last[0], seen[0] = min(first[0], s.min()), max(last[0], e.max()), True
            continue
        code = (rank[a : a + SPAN_BLOCK][keep] - low).astype(np.uint16)
        order = np.argsort(code, kind="stable")
        code = code[order]
        heads = np.flatnonzero(np.r_[True, code[1:] != code[:-1]])
        ids = code[heads].astype(np.intp)  # distinct within the block: plain assignment is safe
        first[ids] = np.minimum(first[ids], np.minimum.reduceat(s[order], heads))
        last[ids] = np.maximum(last[ids], np.maximum.reduceat(e[order], heads))
        seen[ids] = True
    ranks = np.flatnonzero(seen)
    return pd.DataFrame({"rank": (ranks + low).astype(rank.dtype), "start_ns": first[ranks], "end_ns": last[ranks]})


def kernel_spans(df: pd.DataFrame) -> dict[int, int]:
    """Per rank with GPU events: its kernel span, the first GPU event's start to the last one's end, ns
    (temporal_breakdown's span; kernel chains and the full-queue time take their shares of it)."""
    spans = rank_spans(df, kind_mask(df, *GPU_KINDS))
    return {r: e - s for r, s, e in zip(*(spans[c].tolist() for c in ("rank", "start_ns", "end_ns")), strict=True)}


def sync_time(df: pd.DataFrame, waits: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per rank: its capture span (``span_ns``: its first event's start to its last one's end), its
    blocking waits (``blocking_calls``), the time its host was blocked (``blocking_ns``: the union of the
    blocking waits of all its host threads, so two threads blocked at once count once; at most the
    span) and that time's share of the span (``blocking_pct``), and its stream waits (count and summed
    ``stream_wait_ns``). ``waits`` takes sync_waits(df) already computed."""
    waits = sync_waits(df) if waits is None else waits
    if len(df) == 0:
        return pd.DataFrame(columns=SYNC_TIME_COLUMNS)
    spans = rank_spans(df)
    w_rank, blocking = waits["rank"].to_numpy(), waits["blocking"].to_numpy()
    w_start, w_dur = waits["start_ns"].to_numpy(), waits["dur_ns"].to_numpy()
    rows = []
    for r, first, last in zip(*(spans[c].tolist() for c in ("rank", "start_ns", "end_ns")), strict=True):
        mine = w_rank == r
        b, w = mine & blocking, mine & ~blocking
        blocked = union_ns(w_start[b], w_start[b] + w_dur[b])
        span = int(last - first)
        pct = 100 * blocked / span if span else float("nan")
        rows.append((r, span, int(b.sum()), blocked, pct, int(w.sum()), int(w_dur[w].sum())))
    return pd.DataFrame(rows, columns=SYNC_TIME_COLUMNS)


def phase_breakdown(df: pd.DataFrame) -> pd.DataFrame:
    """Time in the step ranges (our step/data/forward/backward/optimizer; ProfilerStep#N counts as
    'step' where the trace has no 'step' range of its own), per rank: count, total and mean in ns."""
    names = df["name"]
    codes, labels = names.array.codes, names.cat.categories
    # Each name's phase (its index in SORTED_PHASES, -1 for none; the last slot serves code -1), looked
    # up per row: the few phase ranges are found in one pass over the codes, and only their kind and
    # device read (28 M ranges at 3.7 GB, a handful of them phases).
    phase_of = np.append(pd.Index(SORTED_PHASES).get_indexer(labels), -1).astype(np.int8)
    rows = _host_ranges(df, np.flatnonzero(phase_of[codes] >= 0))  # the GPU copies repeat them
    if not (phase_of[codes[rows]] == SORTED_PHASES.index("step")).any():
        steps = [c for c, t in enumerate(labels) if PROFILER_STEP_RE.fullmatch(str(t))]
        if steps:
            phase_of[steps] = SORTED_PHASES.index("step")
            rows = _host_ranges(df, np.flatnonzero(phase_of[codes] >= 0))
    phase, rank = phase_of[codes[rows]].astype(np.int64), df["rank"].to_numpy()[rows]
    keys, total_ns, count = _totals(rank.astype(np.int64) * len(PHASES) + phase, df["dur_ns"].to_numpy()[rows])
    return pd.DataFrame(
        {
            "rank": (keys // len(PHASES)).astype(rank.dtype),
            "phase": np.array([SORTED_PHASES[p] for p in (keys % len(PHASES)).tolist()], dtype=object),
            "count": count,
            "total_ns": total_ns,
            "mean_ns": total_ns / count,
        }
    )


def host_op_times(df: pd.DataFrame) -> pd.DataFrame:
    """Self time and call count of every framework op name, largest first (the top ops of CPU-only
    traces, where there are no kernels)."""
    rows = np.flatnonzero(kind_mask(df, "cpu_op"))
    tid, start, dur = (df[c].to_numpy()[rows] for c in ("tid", "start_ns", "dur_ns"))
    names, time_ns, count = _totals_by_name(df["name"], rows, _self_ns(tid, start, dur))
    out = pd.DataFrame({"time_ns": time_ns, "count": count}, index=pd.Index(names, dtype="str", name="name"))
    return out.sort_values("time_ns", ascending=False).reset_index()


def self_time_ns(ops: pd.DataFrame) -> pd.Series:
    """Each op's self time: its duration minus that of the ops nested directly inside it (same thread)."""
    return pd.Series(_self_ns(*(ops[c].to_numpy() for c in ("tid", "start_ns", "dur_ns"))), index=ops.index)


def _self_ns(tid: np.ndarray, start: np.ndarray, dur: np.ndarray) -> np.ndarray:
    # Per thread by start, the longer first at equal starts, so an op's parent precedes it on the stack.
    order = np.lexsort((-dur, start, tid))
    parent = _parents(tid, start, dur, order)
    self_ns = dur.astype(np.int64, copy=True)
    nested = parent >= 0
    np.subtract.at(self_ns, parent[nested], dur[nested])
    return self_ns.clip(min=0)


def _parents(tid: np.ndarray, start: np.ndarray, dur: np.ndarray, order: np.ndarray) -> np.ndarray:
    """The position of the op each op is nested directly in (-1: none), walking the ops in ``order``
    with a stack of open ops: each op pops those of another thread or ended by its start (end <= its
    start) and takes the top as its parent.

    That parent is the nearest op before it in the walk, on its thread, that ends after it starts, and
    it is found for all ops at once by pointer jumping (1.08 M ops: 0.21 s, the Python walk 0.40 s):
    each op's guess starts at the op before it and, while the guess ended by the op's start, moves to
    the guess's own current guess. A guess only ever moves to ops the stack would have popped or to the next one
    below them on the stack, so it stops at the same op; flat runs of siblings converge in log2(n)
    rounds, a return from a deep stack in its depth. After PARENT_ROUNDS rounds (stacks deeper than real
    call stacks) the Python walk decides, so the result is the stack's in every case."""
    t, s = tid[order], start[order]
    e = s + dur[order]
    n = order.size
    guess = np.arange(-1, n - 1, dtype=np.int64)
    if n:
        guess[np.r_[True, t[1:] != t[:-1]]] = -1  # a thread's first op has no parent
    live = np.flatnonzero(guess >= 0)
    for _ in range(PARENT_ROUNDS):
        live = live[e[guess[live]] <= s[live]]
        if live.size == 0:
            break
        guess[live] = guess[guess[live]]
        live = live[guess[live] >= 0]
    else:
        return _parents_walk(tid, start, dur, order)
    parent = np.full(n, -1, dtype=np.int64)
    has = guess >= 0
    parent[order[has]] = order[guess[has]]
    return parent


def _parents_walk(tid: np.ndarray, start: np.ndarray, dur: np.ndarray, order: np.ndarray) -> np.ndarray:
    """_parents by the stack itself, in Python: plain ints, a block at a time so that they never exist
    for all ops at once."""
    parent = np.full(order.size, -1, dtype=np.int64)
    stack: list[tuple[int, int, int]] = []  # (end, position, tid)
    for lo in range(0, order.size, SELF_TIME_BLOCK):
        block = order[lo : lo + SELF_TIME_BLOCK]
        parents = []
        for i, t, s, d in zip(
            block.tolist(), tid[block].tolist(), start[block].tolist(), dur[block].tolist(), strict=True
        ):
            while stack and (stack[-1][2] != t or stack[-1][0] <= s):
                stack.pop()
            parents.append(stack[-1][1] if stack else -1)
            stack.append((s + d, i, t))
        parent[block] = parents
    return parent


def memory_timeline(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(timeline of bytes allocated per rank and device from memory events, peak per rank and device).

    The running sum starts at 0 when the profiler starts: memory allocated before it is not seen."""
    mem = df[df["kind"] == "memory"].sort_values("start_ns", kind="stable")
    if mem.empty:
        cols = ["rank", "device", "start_ns", "allocated_bytes"]
        return pd.DataFrame(columns=cols), pd.DataFrame(columns=["rank", "device", "peak_bytes"])
    mem = mem.assign(allocated_bytes=mem.groupby(["rank", "device"], observed=True)["bytes"].cumsum())
    timeline = mem[["rank", "device", "start_ns", "allocated_bytes"]].reset_index(drop=True)
    peak = timeline.groupby(["rank", "device"], observed=True)["allocated_bytes"].max().rename("peak_bytes")
    return timeline, peak.reset_index()


def rank_skew(
    df: pd.DataFrame,
    straggler_frac: float = 0.05,
    *,
    phases: pd.DataFrame | None = None,
    temporal: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """Per rank: mean step time (ProfilerStep/step ranges, else the GPU kernel span) and how far it is
    above the median rank; ranks more than ``straggler_frac`` above the median are stragglers.
    ``phases`` and ``temporal`` take phase_breakdown / temporal_breakdown tables already computed."""
    phases = phase_breakdown(df) if phases is None else phases
    steps = phases[phases["phase"] == "step"].set_index("rank")["mean_ns"]
    if steps.empty:
        spans = temporal_breakdown(df) if temporal is None else temporal
        steps = spans.set_index("rank")["kernel_span_ns"].astype(float)
    out = steps.rename("step_ns").reset_index()
    if out.empty:
        return out.assign(above_median_pct=[], straggler=[])
    median = out["step_ns"].median()
    out["above_median_pct"] = 100 * (out["step_ns"] - median) / median
    out["straggler"] = out["above_median_pct"] > 100 * straggler_frac
    return out
