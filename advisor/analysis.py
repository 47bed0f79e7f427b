"""Trace analyses: pure functions from the event table to tables (HolisticTraceAnalysis' definitions).

Definitions follow HTA (facebookresearch/HolisticTraceAnalysis) so that results are comparable:
GPU events are kernels, memcpys and memsets; per rank the kernel span runs from the first GPU event's
start to the last one's end; idle time is the span minus the union of GPU events; communication
kernels match ``^nccl`` (this covers the newer ``ncclDevKernel_*`` names HTA 0.5 misses), memory
events are memcpy and memset, everything else on a GPU is computation. Times are integer ns.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from advisor.trace_table import gpu_events

COMM_RE = re.compile(r"^nccl|ncclKernel|ncclDevKernel", re.IGNORECASE)
TYPES = ("COMPUTATION", "COMMUNICATION", "MEMORY")
CONSECUTIVE_KERNEL_DELAY_NS = 30_000  # HTA's default for the idle split
# Fine kernel categories, first match wins (names of cuBLAS/CUTLASS/Hopper nvjet GEMMs, FlashAttention,
# PyTorch's elementwise and reduction templates, fused optimizers).
CATEGORY_PATTERNS = (
    ("communication", re.compile(r"^nccl|ncclDevKernel|ncclKernel", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|_attn|mha_", re.I)),
    # cuBLAS/cuBLASLt/CUTLASS/nvjet on NVIDIA; rocBLAS/hipBLASLt Tensile kernels (Cijk_...) on AMD.
    (
        "gemm",
        re.compile(r"gemm|cutlass|cublas|nvjet|xmma|wgmma|gemv|splitKreduce|matmul|^Cijk_|rocblas|hipblaslt", re.I),
    ),
    ("convolution", re.compile(r"conv|implicit_convolve|winograd|cudnn::.*(?:fprop|dgrad|wgrad)", re.I)),
    ("normalization", re.compile(r"norm(?!al)|bn_fw|bn_bw|batch_norm", re.I)),
    # Not "lamb": PyTorch kernel names are full of "{lambda(...)}".
    ("optimizer", re.compile(r"adam|sgd|multi_tensor_apply|optimizer", re.I)),
    ("reduction", re.compile(r"reduce|softmax|cross_entropy|nll_loss|argmax|sum_kernel|max_kernel|cunn_", re.I)),
    (
        "elementwise",
        re.compile(r"elementwise|vectorized|unrolled|pointwise|triton_|CatArray|copy_kernel|fill|index", re.I),
    ),
)


def drop_last_profiler_step(df: pd.DataFrame) -> pd.DataFrame:
    """The events of the complete profiler steps: per rank, host events that start before the last
    ``ProfilerStep#N`` range and the GPU events their runtime calls launched (HTA's default window:
    the last step is cut off by the end of the capture). A rank with fewer than two ProfilerStep ranges
    is kept whole."""
    kept = []
    for _, g in df.groupby("rank", observed=True, sort=True):
        ann = g[g["kind"] == "annotation"]
        steps = ann[ann["name"].astype(str).str.startswith("ProfilerStep#")]
        if len(steps) < 2:
            kept.append(g)
            continue
        last = steps["start_ns"].max()
        gpu_mask = g["kind"].isin(("kernel", "memcpy", "memset")).to_numpy()
        host = g[~gpu_mask & (g["start_ns"].to_numpy() < last)]
        launched = set(host.loc[host["correlation"] >= 0, "correlation"].tolist())
        gpu = g[gpu_mask]
        kept += [host, gpu[gpu["correlation"].isin(launched)]]
    out = pd.concat(kept)
    out.attrs = dict(df.attrs)
    return out.sort_index()


def round_like_hta(df: pd.DataFrame) -> pd.DataFrame:
    """The table with HTA 0.5's rounding of sub-microsecond traces applied: every event shrunk inward
    to whole microseconds (start rounded up, end rounded down; hta/common/trace_parser.py
    round_down_time_stamps, a workaround for pytorch/pytorch#122425). Only for comparing with HTA:
    our analyses keep nanoseconds, and on traces full of ~1 us events the rounding adds idle time."""
    if not (df["start_ns"] % 1000).any() and not (df["dur_ns"] % 1000).any():
        return df  # whole-microsecond trace: HTA leaves it as it is
    # HTA does this in float64 microseconds, where ts + dur itself rounds (to 0.25 us at epoch times):
    # the same arithmetic here gives its boundaries exactly.
    start_us = df["start_ns"].to_numpy() / 1000.0
    end_us = start_us + df["dur_ns"].to_numpy() / 1000.0
    first = np.ceil(start_us).astype(np.int64)
    last = np.floor(end_us).astype(np.int64)
    out = df.copy()
    out["start_ns"] = first * 1000
    out["dur_ns"] = np.maximum(last - first, 0) * 1000
    return out


def hta_type(gpu: pd.DataFrame) -> np.ndarray:
    """COMPUTATION / COMMUNICATION / MEMORY for each GPU event (as codes 0, 1, 2)."""
    names = gpu["name"]
    if isinstance(names.dtype, pd.CategoricalDtype):  # match each distinct name once, not every row
        names = names.cat.remove_unused_categories()
        per_name = np.array([bool(COMM_RE.search(str(c))) for c in names.cat.categories], dtype=bool)
        codes = names.cat.codes.to_numpy()
        comm = np.where(codes >= 0, per_name[codes], False)
    else:
        comm = names.astype(str).str.contains(COMM_RE).to_numpy()
    memory = gpu["kind"].isin(("memcpy", "memset")).to_numpy()
    return np.where(comm, 1, np.where(memory, 2, 0))


def kernel_category(name: str, kind: str = "kernel") -> str:
    """The fine category of one GPU event (memcpy and memset by kind, kernels by name)."""
    if kind in ("memcpy", "memset"):
        return kind
    for category, pattern in CATEGORY_PATTERNS:
        if pattern.search(name):
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
    counts = np.zeros((t.size, n_types), dtype=np.int64)
    counts[np.arange(t.size), bit] = sign
    active = np.cumsum(counts, axis=0) > 0
    mask = (active * (1 << np.arange(n_types))).sum(axis=1)
    dur = np.diff(t)
    return np.bincount(mask[:-1], weights=dur, minlength=2**n_types).astype(np.int64)


def union_ns(starts: np.ndarray, ends: np.ndarray) -> int:
    """Length of the union of intervals [start, end), in ns."""
    return int(_sweep(starts, ends, np.zeros(starts.size, dtype=np.int64), 1)[1])


def type_sweeps(df: pd.DataFrame) -> dict[int, tuple[int, np.ndarray]]:
    """Per rank: (kernel span in ns, time per combination of active GPU-event types in ns), the one
    sweep that the temporal, kernel-type and overlap breakdowns all read."""
    out = {}
    for rank, g in gpu_events(df).groupby("rank", observed=True, sort=True):
        starts = g["start_ns"].to_numpy()
        ends = starts + g["dur_ns"].to_numpy()
        out[int(rank)] = (int(ends.max() - starts.min()), _sweep(starts, ends, hta_type(g)))
    return out


def temporal_breakdown(df: pd.DataFrame, sweeps: dict | None = None) -> pd.DataFrame:
    """Per rank: kernel span split into idle, compute and non-compute (communication + memory) time.
    ``sweeps`` takes type_sweeps(df) already computed."""
    rows = []
    for rank, (span, per_mask) in (type_sweeps(df) if sweeps is None else sweeps).items():
        busy = int(per_mask[1:].sum())
        compute = int(per_mask[[m for m in range(8) if m & 1]].sum())
        rows.append((rank, span, span - busy, compute, busy - compute))
    out = pd.DataFrame(rows, columns=["rank", "kernel_span_ns", "idle_ns", "compute_ns", "non_compute_ns"])
    for col in ("idle", "compute", "non_compute"):
        out[f"{col}_pct"] = 100 * out[f"{col}_ns"] / out["kernel_span_ns"]
    return out


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


def _launch_start(df: pd.DataFrame) -> pd.Series:
    """Start of the runtime call that launched each correlation id, per rank."""
    rt = df[(df["kind"] == "runtime") & (df["correlation"] >= 0)]
    return rt.drop_duplicates(["rank", "correlation"]).set_index(["rank", "correlation"])["start_ns"]


def idle_time_breakdown(df: pd.DataFrame, consecutive_delay_ns: int = CONSECUTIVE_KERNEL_DELAY_NS) -> pd.DataFrame:
    """Per rank and stream: idle time between consecutive GPU events split into host wait (the next
    event was launched only after the previous one finished: the GPU waited for the CPU), kernel wait
    (a gap shorter than ``consecutive_delay_ns`` between back-to-back events: launch overhead) and
    other, with each category's share of that stream's idle time.

    HTA's exact rules, for comparable numbers: the gap is measured from the previous event's end, host
    wait needs the launch to start strictly after it, and (rare) negative gaps from overlapping events
    on one stream count in the sums."""
    launch = _launch_start(df)
    rows = []
    gpu = gpu_events(df).sort_values(["rank", "stream", "start_ns"])
    for (rank, stream), g in gpu.groupby(["rank", "stream"], observed=True, sort=False):
        starts = g["start_ns"].to_numpy()
        ends = starts + g["dur_ns"].to_numpy()
        gaps = starts[1:] - ends[:-1]
        keys = pd.MultiIndex.from_arrays([np.full(len(g) - 1, rank), g["correlation"].to_numpy()[1:]])
        launched = launch.reindex(keys).to_numpy(dtype=float)
        host = launched > ends[:-1]
        kernel = ~host & (gaps < consecutive_delay_ns)
        other = ~host & ~kernel
        total = int(gaps.sum())
        for cat, sel in (("host_wait", host), ("kernel_wait", kernel), ("other", other)):
            t = int(gaps[sel].sum())
            rows.append((int(rank), int(stream), cat, t, t / total if total else float("nan")))
    return pd.DataFrame(rows, columns=["rank", "stream", "idle_category", "idle_ns", "idle_frac"])


def idle_split(df: pd.DataFrame, consecutive_delay_ns: int = CONSECUTIVE_KERNEL_DELAY_NS) -> pd.DataFrame:
    """Per rank: idle time by category summed over streams, as shares in %."""
    return idle_split_of(idle_time_breakdown(df, consecutive_delay_ns))


def idle_split_of(per_stream: pd.DataFrame) -> pd.DataFrame:
    """idle_split from an idle_time_breakdown table already computed."""
    out = per_stream.pivot_table(index="rank", columns="idle_category", values="idle_ns", aggfunc="sum").fillna(0)
    total = out.sum(axis=1)
    return pd.DataFrame({f"{c}_pct": 100 * out[c] / total for c in ("host_wait", "kernel_wait", "other")}).reset_index()


def kernel_breakdown(df: pd.DataFrame, top: int = 10) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(time per fine category with its share of summed GPU-event time, the top kernels by total time)."""
    gpu = gpu_events(df)
    # Classify each distinct name once (names are categorical); copies and sets by their kind.
    names = gpu["name"].cat.remove_unused_categories()
    per_name = np.array([kernel_category(str(c)) for c in names.cat.categories], dtype=object)
    cats = per_name[names.cat.codes.to_numpy()] if len(per_name) else np.array([], dtype=object)
    kinds = gpu["kind"].to_numpy()
    cats = np.where(kinds == "memcpy", "memcpy", np.where(kinds == "memset", "memset", cats))
    frame = pd.DataFrame({"name": names.astype(str).to_numpy(), "category": cats, "dur_ns": gpu["dur_ns"].to_numpy()})
    by_cat = frame.groupby("category")["dur_ns"].agg(time_ns="sum", count="size").reset_index()
    by_cat["time_pct"] = 100 * by_cat["time_ns"] / by_cat["time_ns"].sum()
    by_name = frame.groupby(["name", "category"])["dur_ns"].agg(time_ns="sum", count="size", mean_ns="mean")
    by_name = by_name.reset_index().sort_values("time_ns", ascending=False).head(top)
    by_name["time_pct"] = 100 * by_name["time_ns"] / frame["dur_ns"].sum()
    return by_cat.sort_values("time_ns", ascending=False).reset_index(drop=True), by_name.reset_index(drop=True)


TINY_KERNEL_NS = 10_000  # kernels shorter than 10 us cannot hide a ~5-10 us launch: launch-bound territory
SYNC_RE = re.compile(
    r"^(?:cuda|hip)(?:DeviceSynchronize|StreamSynchronize|EventSynchronize|Memcpy|Memset)(?!Async|Peer)"
)
PHASES = ("step", "data", "forward", "backward", "optimizer")


def launch_stats(df: pd.DataFrame, tiny_ns: int = TINY_KERNEL_NS) -> pd.DataFrame:
    """Per rank: kernel launch statistics from runtime calls joined to kernels by correlation id.

    launch delay = kernel start minus the end of the runtime call that launched it (0 when the GPU
    started it before the call returned); tiny kernels are shorter than ``tiny_ns``. Many tiny kernels
    with the GPU mostly idle waiting for the host is the launch-bound signature.
    """
    rows = []
    kernels = df[df["kind"] == "kernel"]
    runtime = df[(df["kind"] == "runtime") & (df["correlation"] >= 0)]
    for rank, k in kernels.groupby("rank", observed=True, sort=True):
        rt = runtime[runtime["rank"] == rank].drop_duplicates("correlation").set_index("correlation")
        calls = rt[["start_ns", "dur_ns"]].rename(columns={"start_ns": "start_ns_rt", "dur_ns": "dur_ns_rt"})
        joined = k.merge(calls, left_on="correlation", right_index=True, how="inner")
        delay = np.maximum(0, joined["start_ns"] - joined["start_ns_rt"] - joined["dur_ns_rt"]).to_numpy()
        dur = k["dur_ns"].to_numpy()
        tiny = dur < tiny_ns
        rows.append(
            {
                "rank": int(rank),
                "kernels": len(k),
                "kernel_mean_us": dur.mean() / 1e3,
                "tiny_kernel_frac": tiny.mean(),
                "tiny_kernel_time_frac": dur[tiny].sum() / max(dur.sum(), 1),
                "launch_delay_mean_us": delay.mean() / 1e3 if delay.size else float("nan"),
                "launch_delay_p95_us": np.percentile(delay, 95) / 1e3 if delay.size else float("nan"),
                "launch_call_mean_us": joined["dur_ns_rt"].mean() / 1e3 if len(joined) else float("nan"),
            }
        )
    return pd.DataFrame(rows)


def memcpy_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Copies by direction and host memory kind: count, bytes, time, bandwidth, and whether the host side
    is pageable (a host<->device copy from pageable memory is staged and synchronous)."""
    copies = df[df["kind"] == "memcpy"]
    if copies.empty:
        return pd.DataFrame(
            columns=["copy_kind", "host_mem", "count", "bytes", "time_ns", "bandwidth_gbps", "pageable"]
        )
    g = copies.groupby(["copy_kind", "host_mem"], observed=True)
    out = g.agg(count=("bytes", "size"), bytes=("bytes", "sum"), time_ns=("dur_ns", "sum")).reset_index()
    out["bandwidth_gbps"] = out["bytes"] / out["time_ns"].clip(lower=1)
    out["pageable"] = out["host_mem"].astype(str).eq("pageable") & out["copy_kind"].isin(("HtoD", "DtoH"))
    return out.sort_values("time_ns", ascending=False).reset_index(drop=True)


def sync_calls(df: pd.DataFrame) -> pd.DataFrame:
    """Host calls that block until the GPU catches up (device/stream/event synchronize, blocking
    cudaMemcpy/cudaMemset), and nsys synchronization records: count and total time per name."""
    rt = df[df["kind"].isin(("runtime", "sync"))]
    names = rt["name"].astype(str)
    hits = rt[(rt["kind"] == "sync").to_numpy() | names.str.contains(SYNC_RE).to_numpy()]
    out = hits.groupby(hits["name"].astype(str)).agg(count=("dur_ns", "size"), time_ns=("dur_ns", "sum"))
    return out.reset_index().rename(columns={"index": "name"}).sort_values("time_ns", ascending=False)


def phase_breakdown(df: pd.DataFrame) -> pd.DataFrame:
    """Time in the step ranges (our step/data/forward/backward/optimizer; ProfilerStep#N counts as
    'step' where the trace has no 'step' range of its own), per rank: count, total and mean in ns."""
    ann = df[(df["kind"] == "annotation") & (df["device"] == -1)]  # host ranges; the GPU copies repeat them
    names = ann["name"].astype(str)
    if not names.eq("step").any():
        names = names.str.replace(r"^ProfilerStep#\d+$", "step", regex=True)
    keep = names.isin(PHASES).to_numpy()
    sel = ann[keep].assign(phase=names[keep].to_numpy())
    out = sel.groupby(["rank", "phase"], observed=True)["dur_ns"].agg(count="size", total_ns="sum", mean_ns="mean")
    return out.reset_index()


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
