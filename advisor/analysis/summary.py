"""Analyze a trace end to end: load any supported file once (``advisor.trace.load``, with the
arguments the analyses read), run every analysis, summarise as StepMetrics.
"""

from __future__ import annotations

import ctypes
import math
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd

from advisor.analysis import breakdown as A
from advisor.analysis import queues as Q
from advisor.analysis.collectives import collective_calls_and_table, collective_sizes
from advisor.analysis.collectives import wants_args as collectives_wants_args
from advisor.analysis.comm import comm_by_communicator, comm_calls, comm_skew, comm_stragglers
from advisor.analysis.critical_path import critical_path, critical_path_summary, short_untraced_path
from advisor.analysis.roofline import VERDICTS, Roofline, step_roofline_summary, trace_roofline
from advisor.analysis.roofline import wants_args as roofline_wants_args
from advisor.analysis.sequences import chain_saving_pct, kernel_chains
from advisor.analysis.steps import BASES, fused_attention, optimizer_of, step_phases
from advisor.errors import AdvisorError
from advisor.spec.ceilings import Ceilings
from advisor.spec.metrics import StepMetrics
from advisor.spec.specs import HardwareSpec
from advisor.trace.kineto import DEFAULT_MAX_BYTES, DEFAULT_MAX_EVENT_BYTES
from advisor.trace.load import load_trace as trace_load
from advisor.trace.table import GPU_KINDS, kind_mask


def wants_args(name: str) -> bool:
    """The events whose recorded arguments an analysis reads: the roofline's modelled ops, the
    collectives' communication events."""
    return roofline_wants_args(name) or collectives_wants_args(name)


def load_trace(
    path: str | Path,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
    check: Callable[[], None] | None = None,
    dedicated: bool = False,
) -> pd.DataFrame:
    """The event table of any supported trace at ``path`` (``advisor.trace.load.load_trace``, whose
    limits and ``check`` these are), with the arguments the analyses read kept beside it, so that the
    trace is parsed once. ``dedicated``: this process analyses this one trace and exits (the app's
    analysis child, the CLI's ``analyze``): before the load, its threads come to share one heap, its
    arrays to use small pages and the memory it frees to stay for its next arrays (``share_one_heap``,
    ``use_small_pages``, ``reuse_freed_memory``)."""
    if dedicated:
        share_one_heap()
        use_small_pages()
        reuse_freed_memory()
    df = trace_load(path, max_bytes=max_bytes, max_event_bytes=max_event_bytes, keep_args=wants_args, check=check)
    return df


@dataclass(frozen=True)
class TraceReport:
    """Every analysis table of one trace, and the StepMetrics summary of them."""

    metrics: StepMetrics
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    skipped_files: tuple[str, ...] = ()
    """Files of a folder or zip that were not traces, each with the reason (``load_kineto``)."""


def analyze(
    df: pd.DataFrame,
    run_id: str = "trace",
    *,
    trim_last_step: bool = True,
    roofline: Roofline | None = None,
    check: Callable[[], None] | None = None,
) -> TraceReport:
    """All analyses of an event table. Kineto traces are cut to their complete profiler steps (the
    last ``ProfilerStep`` is dropped, as HTA does, unless ``trim_last_step`` is off: our own runs stop
    the profiler after their last step, so nothing is cut); nsys captures are used whole. With a
    ``roofline`` (``advisor.analysis.roofline.trace_roofline`` of the same trace) its table joins the tables
    and its step summary the metrics. ``check()`` runs between groups of analyses and stops them by
    raising (the app's Cancel and time budget); the analyses already running beside are left to end
    on their own, not waited for."""
    skipped = tuple(df.attrs.get("skipped_files") or ())
    if trim_last_step and df.attrs.get("source") == "kineto" and not df.attrs.get("own_run"):
        df = A.drop_last_profiler_step(df)
    check = check or _no_check
    check()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="analyze")
    try:
        # The analyses that need no other's result and cost the most on large traces run beside the
        # rest: their numpy sorts release the GIL (a 3.7 GB export's analysis: see bench/scale.py).
        beside = {
            "critical_path": pool.submit(critical_path, df),  # one step of one rank: the slowest's longest
            "gpu_idle": pool.submit(A.gpu_idle, df),
        }
        tables, host_self_ns = _tables(df, beside, check, pool.submit)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)  # a stop returns now; a running analysis ends alone
        raise
    pool.shutdown()
    metrics = _summary(df, tables, run_id, host_self_ns=host_self_ns)
    if roofline is not None:
        tables["roofline"] = roofline.table
        metrics = replace(metrics, **_roofline_fields(roofline, metrics))
    return TraceReport(metrics, tables, skipped)


def use_small_pages() -> bool:
    """Make this process's next numpy arrays use ordinary 4 KiB pages, not transparent huge pages:
    numpy advises huge pages for every array of 4 MiB or more on Linux (``MADV_HUGEPAGE``; the same
    switch as its documented ``NUMPY_MADVISE_HUGEPAGE=0``, read only at import). On VMs that hand freed
    memory back to their host (free page reporting, balloons: our 2-core VMs, many cloud sandboxes) a
    huge page comes from the memory the host took back, so each is backed again first, while 4 KiB
    pages come from memory the guest used a moment ago: filling a GiB cost 12.5-13.4 s with huge pages
    against 0.4-0.6 s without for the first 2 GiB (``bench/fresh_memory.py --by-gib``), and a 0.5 GB
    dense nsys export's load and analysis took 7.4-7.5 s instead of 14-16 s, the same user time
    (bench/results/analyze_speed.md). Called before the load by the processes that analyse one trace
    and exit (``load_trace(dedicated=True)``). Returns whether it took effect (False: a numpy without the
    switch, or not Linux, where nothing changes)."""
    core = getattr(np, "_core", None) or getattr(np, "core", None)
    toggle = getattr(getattr(core, "multiarray", None), "_set_madvise_hugepage", None)
    if toggle is None or not sys.platform.startswith("linux"):
        return False
    toggle(False)
    return True


def share_one_heap() -> bool:
    """Make every thread of this process allocate from glibc's main heap (``M_ARENA_MAX`` 1, as the
    documented ``MALLOC_ARENA_MAX=1``). glibc gives each new thread a heap of its own of at most 64 MiB,
    so an array larger than that made on a thread (the analyses that run beside the others: at 3.7 GB
    most of their columns are 64-376 MB) is mapped afresh and unmapped when freed even after
    ``reuse_freed_memory``, its pages zeroed again each time, and memory freed by one thread never
    serves another. With it and ``reuse_freed_memory`` before the load, the 3.7 GB dense nsys export's
    analyses took 20-24 K page faults instead of 1.1-1.4 M, and 24.3-25.3 s instead of 35.3-36.4 s
    side by side (bench/results/analyze_speed.md); the user time of the load and of the analyses did
    not change beyond the noise (numpy's large arrays are few: the one heap's lock is rarely taken).
    Holds only where no thread of the process has yet taken a heap of its own (glibc fixes the number
    of heaps when it makes its second): call it before starting threads. glibc only; returns whether it
    took effect."""
    mallopt = _mallopt()
    return mallopt is not None and bool(mallopt(-8, 1))  # M_ARENA_MAX (malloc.h)


def _mallopt():
    """glibc's mallopt, or None where the C library has none (musl, macOS)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt


def reuse_freed_memory(*, trim: bool = True) -> bool:
    """Make this process keep the memory it frees for its next arrays: glibc hands every block over
    its mmap threshold (at most 32 MiB) back to the kernel when freed, so each of the analyses' arrays
    over a large table (48.6 M rows at 3.7 GB: 389 MB a column) comes from fresh pages, which the
    kernel zeroes on first touch: on our 2-core VMs the largest part of the analysis (perf:
    clear_page_erms 44 % of the samples at 0.5 GB; a fresh GiB costs 48x a reused one there,
    bench/fresh_memory.py). With mmap off and no trimming, freed blocks are reused in place: the 3.7 GB
    dense export's analyses took 36-39 s instead of 63-70 s side by side (bench/results/analyze_speed.md).

    For a process that analyses one trace and exits (the CLI's ``analyze``, the app's analysis child)
    or runs one profiled step and exits (``advisor.run.launcher``'s child, recorded in its run's
    environment as ``freed_memory_kept``): its resident memory never shrinks afterwards. Set before the
    load, with ``share_one_heap`` (its figures): the analyses then run in the memory the load freed.
    Without one heap the loader's threads kept what they freed in heaps of their own, and the 3.7 GB
    dense export's peak read 2.08x the file; with it, 1.46-1.58x (bench/results/analyze_speed.md).
    glibc only; elsewhere (musl, macOS) nothing changes. Returns whether it took effect.

    A free top of the heap over 1 GiB still goes back to the kernel; with ``trim=False`` none does
    (the profiling child: its profiler rehearsal grows the heap by what the profiled steps will need,
    advisor.run.child.rehearsal_steps)."""
    mallopt = _mallopt()
    # mallopt's parameters (malloc.h): M_TRIM_THRESHOLD -1, M_MMAP_MAX -4; it returns 1 on success. A
    # threshold of -1 (SIZE_MAX as glibc stores it) never trims.
    return mallopt is not None and bool(mallopt(-1, 2**30 if trim else -1)) and bool(mallopt(-4, 0))


def _no_check() -> None:
    """What runs between analyses when the caller has nothing to stop them with."""


def _tables(
    df: pd.DataFrame, beside: dict[str, Future], check: Callable[[], None], submit: Callable[..., Future]
) -> tuple[dict[str, pd.DataFrame], int]:
    """Every table but the ``beside`` ones' (filled in, in the same order, once they are done), and the
    host ops' summed self time; ``check()`` between groups of analyses. ``submit`` starts the rest of the
    analyses beside, once the queue series, the largest arrays of all (8 M operations at 3.7 GB), is
    summarised and gone: kernel chains and copy bandwidth beside it made the analysis' peak memory."""
    categories, top = A.kernel_breakdown(df)
    sweeps, launches = A.type_sweeps(df), A.launch_calls(df)
    check()
    host_ops = A.host_op_times(df)
    temporal, phases = A.temporal_breakdown(df, sweeps), step_phases(df, A.phase_breakdown(df))
    check()
    gaps = A.idle_gaps(df, launches=launches)  # both idle tables' gaps, dropped before the queue series
    idle, intervals = A.idle_time_breakdown(df, gaps=gaps), Q.idle_interval_stats(df, gaps=gaps)
    del gaps
    waits = A.sync_waits(df, launches=launches)
    queue = Q.queue_length_series(df, launches=launches)
    queues = {
        "queue_length": Q.queue_length_summary(df, series=queue),
        "blocked_on_full_queue": Q.blocked_on_full_queue(df, series=queue),
    }
    del queue
    # Copy bandwidth beside the collectives, then kernel chains beside the smaller analyses after them:
    # kernel chains beside the collectives made the peak (at 3.7 GB, RSS 4.3 -> 5.8 GB).
    beside |= {"memory_bw": submit(Q.memory_bw_summary, df), "kernel_chains": submit(kernel_chains, df)}
    check()
    calls, collectives = collective_calls_and_table(df, collective_sizes(df))
    comm = comm_calls(df, calls)
    check()
    tables = {
        "temporal_breakdown": temporal,
        "kernel_type_breakdown": A.kernel_type_breakdown(df, sweeps),
        "comm_comp_overlap": A.comm_comp_overlap(df, sweeps),
        "gpu_idle": None,  # from beside, in this order
        "idle_time_breakdown": idle,
        "idle_split": A.idle_split_of(idle) if not idle.empty else pd.DataFrame(),
        "kernel_categories": categories,
        "top_kernels": top,
        "launch_stats": A.launch_stats(df, launches=launches),
        "memcpy": A.memcpy_summary(df),
        "sync_calls": A.sync_calls(df, waits),
        "sync_time": A.sync_time(df, waits),
        "phases": phases,
        "memory_peak": A.memory_timeline(df)[1],
        "rank_skew": A.rank_skew(df, phases=phases, temporal=temporal),
        "top_ops": host_ops.head(10),
        "gemm_precision": A.gemm_precision(df),
        "collectives": collectives,
        "comm_by_communicator": comm_by_communicator(comm),
        "comm_skew": comm_skew(comm),
        "critical_path": None,
        "critical_path_summary": None,
        "kernel_chains": None,
        **queues,
        "idle_intervals": intervals,
        "memory_bw": None,
    }
    tables["comm_stragglers"] = comm_stragglers(comm, tables["rank_skew"])
    check()
    for name, pending in beside.items():
        tables[name] = pending.result()
    tables["critical_path_summary"] = critical_path_summary(tables["critical_path"])
    return tables, int(host_ops["time_ns"].sum())


def _roofline_fields(roofline: Roofline, m: StepMetrics) -> dict:
    idle = m.gpu_idle_pct / 100 if m.gpu_idle_pct is not None else None
    host = m.idle_host_wait_pct / 100 if m.idle_host_wait_pct is not None else None
    s = step_roofline_summary(roofline.table, gpu_idle_frac=idle, host_wait_frac=host, step_ms=m.step_time_ms)
    per_step = s["headroom_per_step_ms"]
    return {
        "roofline_bound": s["verdict"],
        "roofline_compute_frac": s["compute_frac"],
        "roofline_memory_frac": s["memory_frac"],
        "roofline_latency_frac": s["latency_frac"],
        "roofline_communication_frac": s["communication_frac"],
        "roofline_headroom_ms": None if math.isnan(per_step) else per_step,
        "roofline_modelled_frac": None if math.isnan(s["modelled_frac"]) else s["modelled_frac"],
        "roofline_gemm_frac": s["gemm_frac"],
        "roofline_gemm_roof_frac": None if math.isnan(s["gemm_roof_frac"]) else s["gemm_roof_frac"],
        "roofline_gemm_fixed_frac": None if math.isnan(s["gemm_fixed_frac"]) else s["gemm_fixed_frac"],
        "roofline_fusable_frac": s["fusable_frac"],
        "roofline_compile_fusable_frac": s["compile_fusable_frac"],
        "roofline_compile_fusable_roof_frac": s["compile_fusable_roof_frac"],
        "roofline_score_chain_frac": None if math.isnan(s["score_chain_frac"]) else s["score_chain_frac"],
        "roofline_attention_frac": s["attention_frac"],
        "roofline_roofs": roofline.roofs_note,
    }


def analyze_path(
    path: str | Path,
    run_id: str | None = None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
    hardware: HardwareSpec | None = None,
    ceilings: Ceilings | Callable[[HardwareSpec], Ceilings | None] | None = None,
    trim_last_step: bool = True,
    dedicated: bool = False,
) -> TraceReport:
    """``analyze`` of the trace at ``path`` with its roofline (see ``trace_roofline`` for
    ``hardware`` and ``ceilings``: a run directory of ours is judged against its device's stored
    ceilings when the caller passes the store's lookup, ``advisor.store.ceilings.run_ceilings``). A
    trace whose roofline cannot be made is still analyzed: the reason is printed and the roofline
    left out. ``dedicated``: the process does nothing else and exits after (the CLI): see load_trace."""
    path = Path(path)
    df = load_trace(path, max_bytes=max_bytes, max_event_bytes=max_event_bytes, dedicated=dedicated)
    try:
        roofline = trace_roofline(df, hardware=hardware, ceilings=ceilings)
    except AdvisorError as err:
        print(f"roofline skipped: {err}", file=sys.stderr, flush=True)  # stdout may be --json
        roofline = None
    return analyze(df, run_id or path.name, trim_last_step=trim_last_step, roofline=roofline)


def _mean(frame: pd.DataFrame, col: str) -> float | None:
    if frame.empty or col not in frame:
        return None
    value = float(frame[col].mean())
    return None if math.isnan(value) else value


def _all_devices_idle(table: pd.DataFrame) -> float | None:
    rows = table[table["scope"] == "all devices"] if not table.empty else table
    return float(rows["idle_pct"].iloc[0]) if len(rows) and pd.notna(rows["idle_pct"].iloc[0]) else None


def _max(frame: pd.DataFrame, col: str) -> float | None:
    values = frame[col].dropna() if col in frame else []
    return float(values.max()) if len(values) else None


LAUNCH_BOUND_IDLE_PCT = 30.0
LAUNCH_BOUND_HOST_WAIT_PCT = 50.0


def _launch_bound(t: dict[str, pd.DataFrame]) -> bool | None:
    """Idle GPU that mostly waits for the host (None without GPU events)."""
    idle, host = _mean(t["temporal_breakdown"], "idle_pct"), _mean(t["idle_split"], "host_wait_pct")
    if idle is not None and idle < LAUNCH_BOUND_IDLE_PCT:
        return False  # decided without the split (which a GPU with no idle time lacks)
    if idle is None or host is None:
        return None
    return idle >= LAUNCH_BOUND_IDLE_PCT and host >= LAUNCH_BOUND_HOST_WAIT_PCT


def _gemm_pct(table: pd.DataFrame, math: str) -> float:
    return round(float(table.loc[table["math"] == math, "time_pct"].sum()), 3)


def _comm_pcts(df: pd.DataFrame, t: dict[str, pd.DataFrame]) -> tuple[float | None, float | None]:
    """(collective time, exposed collective time) as % of each rank's step time (its profiler steps'
    total, else its span), mean over ranks; None without collectives. Kinds that overlap each count
    their shared stretch, so the exposed share is capped at 100."""
    coll = t["collectives"]
    if coll.empty:
        return None, None
    phases = t["phases"]
    steps = phases[phases["phase"] == "step"].set_index("rank")["total_ns"] if not phases.empty else pd.Series()
    time_pct, exposed_pct = [], []
    for rank, group in coll.groupby("rank"):
        if rank in steps.index:
            base_ms = float(steps[rank]) / 1e6
        else:
            mine = df["rank"].to_numpy() == rank  # a mask, not a copy of the rank's rows
            start = df["start_ns"].to_numpy()[mine]
            base_ms = float((start + df["dur_ns"].to_numpy()[mine]).max() - start.min()) / 1e6
        if base_ms > 0:
            time_pct.append(min(100.0, 100 * group["time_ms"].sum() / base_ms))
            exposed_pct.append(min(100.0, 100 * group["exposed_ms"].sum() / base_ms))
    if not time_pct:
        return None, None
    return sum(time_pct) / len(time_pct), sum(exposed_pct) / len(exposed_pct)


def _rank_peaks(memory_peak: pd.DataFrame, gpu: bool) -> list[int]:
    """Each rank's peak of allocated tensor memory on its training device (its GPUs in a GPU trace,
    the host in a CPU one), by rank; [] where the trace recorded no memory events."""
    if memory_peak.empty:
        return []
    on = memory_peak[(memory_peak["device"] >= 0) if gpu else (memory_peak["device"] == -1)]
    return [int(v) for v in on.groupby("rank")["peak_bytes"].max().sort_index()]


def _capacity(df: pd.DataFrame) -> int | None:
    """The training device's memory in bytes, from the trace's device properties (Kineto's
    ``deviceProperties``: rank 0's device, else the first named); None where the trace names none."""
    devices = df.attrs.get("devices") or {}
    if not devices:
        return None
    _, memory = devices.get(0) or next(iter(devices.values()))
    return int(memory) or None


def _summary(df: pd.DataFrame, t: dict[str, pd.DataFrame], run_id: str, host_self_ns: int) -> StepMetrics:
    ranks = sorted(int(r) for r in df["rank"].unique())
    gpu = bool(kind_mask(df, *GPU_KINDS).any())
    phases = t["phases"].groupby("phase")["mean_ns"].mean() / 1e6 if not t["phases"].empty else pd.Series(dtype=float)
    memcpy = t["memcpy"]
    pageable = memcpy[memcpy["pageable"]] if not memcpy.empty else memcpy
    skew, late = t["rank_skew"], t["comm_stragglers"]
    top = t["top_kernels"] if gpu else t["top_ops"]
    # Shares of all GPU-event time, or of all host-op self time.
    base = float(t["kernel_categories"]["time_ns"].sum() if gpu else host_self_ns) or 1.0
    devices = df.attrs.get("gpu_names") or []  # a list (Kineto) or {device id: name} (nsys)
    names = list(devices.values()) if isinstance(devices, dict) else list(devices)
    device_name = names[0] if names else None
    comm_time_pct, comm_exposed_pct = _comm_pcts(df, t)
    steps = t["phases"][t["phases"]["phase"] == "step"] if not t["phases"].empty else t["phases"]
    peaks = _rank_peaks(t["memory_peak"], gpu)
    capacity = _capacity(df)
    return StepMetrics(
        run_id=run_id,
        source="trace",
        device_type="cuda" if gpu else "cpu",
        device_name=device_name,
        step_time_ms=float(phases["step"]) if "step" in phases else None,
        data_ms=float(phases["data"]) if "data" in phases else None,
        forward_ms=float(phases["forward"]) if "forward" in phases else None,
        backward_ms=float(phases["backward"]) if "backward" in phases else None,
        optimizer_ms=float(phases["optimizer"]) if "optimizer" in phases else None,
        n_ranks=len(ranks),
        steps_measured=int(steps["count"].min()) if len(steps) else None,
        optimizer=optimizer_of(df),
        attention_fused=fused_attention(df),
        peak_memory_bytes=max(peaks) if peaks else None,
        rank_peak_memory_bytes=peaks if len(peaks) > 1 else [],
        memory_capacity_bytes=capacity,
        memory_frac=max(peaks) / capacity if peaks and capacity else None,
        gpu_idle_pct=_mean(t["temporal_breakdown"], "idle_pct"),
        gpu_compute_idle_pct=_mean(t["temporal_breakdown"], "compute_idle_pct"),
        gpu_memory_alone_pct=_mean(t["temporal_breakdown"], "memory_alone_pct"),
        gpu_idle_all_devices_pct=_all_devices_idle(t["gpu_idle"]),
        gpu_compute_pct=_mean(t["temporal_breakdown"], "compute_pct"),
        gpu_non_compute_pct=_mean(t["temporal_breakdown"], "non_compute_pct"),
        comm_overlap_pct=_mean(t["comm_comp_overlap"], "overlap_pct"),
        comm_time_pct=comm_time_pct,
        comm_exposed_pct=comm_exposed_pct,
        idle_host_wait_pct=_mean(t["idle_split"], "host_wait_pct"),
        idle_kernel_wait_pct=_mean(t["idle_split"], "kernel_wait_pct"),
        idle_other_pct=_mean(t["idle_split"], "other_pct"),
        kernel_category_pct={r.category: round(float(r.time_pct), 3) for r in t["kernel_categories"].itertuples()},
        tiny_kernel_frac=_mean(t["launch_stats"], "tiny_kernel_frac"),
        fusion_chain_saving_pct=chain_saving_pct(t["kernel_chains"], len(t["temporal_breakdown"])) if gpu else None,
        fp32_gemm_pct=_gemm_pct(t["gemm_precision"], "fp32") if gpu else None,
        tf32_gemm_pct=_gemm_pct(t["gemm_precision"], "tf32") if gpu else None,
        launch_bound=_launch_bound(t),
        launch_delay_mean_us=_mean(t["launch_stats"], "launch_delay_mean_us"),
        pageable_copies=int(pageable["count"].sum()) if len(pageable) else 0,
        pageable_copy_bytes=int(pageable["bytes"].sum()) if len(pageable) else 0,
        pageable_copy_pct=100.0 * float(pageable["time_ns"].sum()) / base if gpu and len(pageable) else 0.0,
        sync_calls=int(t["sync_time"]["blocking_calls"].sum()),
        sync_time_ms=float(t["sync_time"]["blocking_ns"].mean()) / 1e6 if len(t["sync_time"]) else 0.0,
        step_skew_pct=float(skew["above_median_pct"].max()) if len(skew) > 1 else None,
        stragglers=[int(r) for r in skew.loc[skew["straggler"], "rank"]] if len(skew) > 1 else [],
        comm_late_pct=_max(t["comm_stragglers"], "late_of_step_pct"),
        comm_stragglers=[int(r) for r in late.loc[late["comm_straggler"].astype(bool), "rank"]] if len(late) else [],
        top_ops=[
            {"name": str(r.name)[:160], "time_ms": float(r.time_ns) / 1e6, "share_pct": 100 * float(r.time_ns) / base}
            for r in top.head(10).itertuples()
        ],
    )


def format_report(report: TraceReport, name: str) -> str:
    """The CLI's readable summary of a trace."""
    m = report.metrics
    out = [f"{name}: {m.n_ranks} rank(s), {m.device_type}" + (f", {m.device_name}" if m.device_name else "")]
    out.extend(f"Skipped {reason}" for reason in report.skipped_files)
    tb = report.tables["temporal_breakdown"]
    if not tb.empty:
        out.append("GPU time per rank (idle / compute / non-compute %):")
        for r in tb.itertuples():
            out.append(
                f"  rank {r.rank}: {r.idle_pct:5.1f} / {r.compute_pct:5.1f} / {r.non_compute_pct:5.1f}  over {r.kernel_span_ns / 1e6:.1f} ms"
            )
        out.append(
            f"GPU idle: {m.gpu_idle_pct:.1f} % with copies counted busy (HTA), "
            f"{m.gpu_compute_idle_pct:.1f} % without a compute kernel"
            + (f" ({m.gpu_memory_alone_pct:.1f} % copies alone)" if m.gpu_memory_alone_pct else "")
            + (
                f"; all devices idle at once {m.gpu_idle_all_devices_pct:.1f} %"
                if m.gpu_idle_all_devices_pct is not None and len(report.tables["gpu_idle"]) > 2
                else ""
            )
        )
        if m.comm_overlap_pct is not None:
            out.append(f"Communication overlapped by computation: {m.comm_overlap_pct:.1f} %")
        if m.idle_host_wait_pct is not None:
            out.append(
                f"Idle split: host wait {m.idle_host_wait_pct:.1f} %, kernel wait {m.idle_kernel_wait_pct:.1f} %, other {m.idle_other_pct:.1f} %"
            )
        cats = ", ".join(f"{k} {v:.1f} %" for k, v in sorted(m.kernel_category_pct.items(), key=lambda kv: -kv[1]))
        out.append(f"Kernel time by category: {cats}")
        out.append(f"Tiny kernels (<10 us): {100 * (m.tiny_kernel_frac or 0):.0f} % of launches")
        chains = report.tables["kernel_chains"]
        if len(chains):
            top = chains.iloc[0]
            out.append(
                f"Repeated memory-bound kernel chains: {len(chains)}; fused, about {m.fusion_chain_saving_pct:.1f} % "
                f"of the GPU span less (top: {top['length']} kernels x {top['count']}, {top['categories']})"
            )
        if m.launch_bound:
            out.append("Verdict: launch/host-bound: the GPU mostly waits for the host to launch work")
    if m.comm_time_pct is not None:
        out.append(
            f"Collectives: {m.comm_time_pct:.1f} % of the step, {m.comm_exposed_pct:.1f} % exposed (no compute beside them)"
        )
    if m.step_time_ms is not None:
        phases = ", ".join(
            f"{k} {getattr(m, f'{k}_ms'):.1f} ms"
            for k in ("data", "forward", "backward", "optimizer")
            if getattr(m, f"{k}_ms") is not None
        )
        phases_table = report.tables["phases"]
        step_rows = phases_table[phases_table["phase"] == "step"] if "basis" in phases_table else phases_table.iloc[:0]
        basis = step_rows["basis"].iloc[0] if len(step_rows) else "ranges"
        found = "" if basis == "ranges" else f" (steps: {BASES[basis]}; {m.steps_measured} steps)"
        out.append(f"Step {m.step_time_ms:.1f} ms (the traced steps' mean)" + (f": {phases}" if phases else "") + found)
    cp = report.tables.get("critical_path_summary")
    if cp is not None and not cp.empty:
        total = cp[cp["category"] == "total"].iloc[0]
        shares = ", ".join(
            f"{r.category} {r.share_pct:.1f} %"
            for r in cp.itertuples()
            if r.category != "total" and r.share_pct >= 0.05
        )
        out.append(
            f"Critical path (rank {total['rank']}, {total['step']}): {total['time_ms']:.1f} ms, {total['step_pct']:.0f} % of the step: {shares}"
        )
        if note := short_untraced_path(cp, report.tables["critical_path"].attrs.get("window")):
            out.append(f"  ({note})")
    if m.optimizer:
        out.append(f"Optimizer: {m.optimizer}")
    if m.peak_memory_bytes is not None:
        of = f" of {m.memory_capacity_bytes / 2**30:.1f} GiB ({100 * m.memory_frac:.1f} %)" if m.memory_frac else ""
        out.append(f"Peak tensor memory while profiled: {m.peak_memory_bytes / 2**20:.1f} MiB{of}")
    per_rank = ", mean per rank" if (m.n_ranks or 1) > 1 else ""
    out.append(
        f"Pageable host copies: {m.pageable_copies}; blocking sync calls: {m.sync_calls} "
        f"({m.sync_time_ms:.2f} ms blocked{per_rank})"
    )
    if m.step_skew_pct is not None:
        out.append(
            f"Step skew across ranks: {m.step_skew_pct:.1f} % above the median; stragglers: {m.stragglers or 'none'}"
        )
    out.append("Top " + ("kernels" if m.device_type == "cuda" else "ops") + ":")
    for op in m.top_ops[:8]:
        out.append(f"  {op['time_ms']:10.3f} ms {op['share_pct']:5.1f} %  {op['name'][:100]}")
    if "roofline" in report.tables:
        out.extend(format_roofline(report))
    return "\n".join(out)


def format_roofline(report: TraceReport, top: int = 8) -> list[str]:
    """The roofline part of the CLI summary: the verdict, the shares, and the rows with the most
    time above their roof."""
    m, table = report.metrics, report.tables["roofline"]
    if m.roofline_bound is None:
        return ["Roofline: nothing to judge"]
    gpu = m.device_type == "cuda"
    of = "of the GPU span" if gpu else "of the step"
    shares = ", ".join(
        f"{b} {100 * getattr(m, f'roofline_{b}_frac'):.1f} %"
        for b in ("compute", "memory", "latency", "communication")
        if getattr(m, f"roofline_{b}_frac")
    )
    out = [f"Roofline verdict: {VERDICTS[m.roofline_bound]} ({shares} {of})", f"  roofs: {m.roofline_roofs}"]
    if m.roofline_modelled_frac is not None:
        what = "kernel time" if gpu else "op time"
        out.append(
            f"  {100 * m.roofline_modelled_frac:.1f} % of {what} has FLOPs/bytes from shapes"
            + ("; the rest is judged by kernel class and length" if gpu else "")
        )
    if m.roofline_headroom_ms is not None:
        out.append(f"  time above the roofline: {m.roofline_headroom_ms:.2f} ms per step (upper bound)")
    known = table[table["headroom_frac"].notna()]
    known = known.assign(above_ms=known["time_ms"] * known["headroom_frac"]).nlargest(top, "above_ms")
    if len(known):
        out.append("  most time above the roof (ms over trace, bound, achieved, intensity FLOP/B, op shapes):")
        for r in known.itertuples():
            if r.flops > 0:
                rate = f"{r.achieved_flops_per_s / (1e12 if gpu else 1e9):.2f} {'T' if gpu else 'G'}FLOP/s"
            else:  # a copy or set: its bandwidth
                rate = f"{r.achieved_bytes_per_s / 1e9:.1f} GB/s"
            out.append(
                f"  {r.above_ms:9.3f} of {r.time_ms:9.3f} ms  {r.bound:8s} {rate:>15s} {r.intensity_flops_per_byte:8.1f}"
                f"  {r.op or r.name[:60]} {r.input_dims[:60]}"
            )
    return out
