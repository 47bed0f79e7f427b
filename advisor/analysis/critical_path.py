"""The critical path of a training step: the longest chain of dependent host and GPU work in it.

HolisticTraceAnalysis' method (hta/analyzers/critical_path_analysis.py, HTA 0.5), on the event table.
Every host op and runtime call and every GPU kernel, copy and set of the step becomes two nodes, its
start and its end; edges carry time (a weight) or only order (weight 0):

- along each host thread, in call-stack order: an edge from each boundary to the next one inside a
  top-level op, weighted by the time between them (host time, given to the innermost op open there);
  from the end of one top-level op to the start of the next, weight 0 (nothing traced runs there: the
  path may jump the gap, at no gain). The exit edge of a blocking call (a synchronize) weighs 0: its
  time is the GPU's, which a sync edge brings;
- a GPU event's start to its end, weighted by its duration (compute, communication, memcpy, memset);
- into each GPU event, one of: a launch edge from its runtime call's start (weight: the time from the
  call's start to the event's start) when the stream had nothing else queued at launch and at start
  (HTA's queue length 1 and 0) and its predecessor on the stream ended before the call; else a
  stream-order edge from the end of the previous event on its stream, weighted by the gap (idle: the
  GPU waits);
- a stream wait (a ``Stream Wait Event`` / ``Stream wait sync`` record of cudaStreamWaitEvent): from the
  end of the event on another stream of the device, launched before the wait call, that ended last
  before the waiting stream's next event starts, to that start (cross-stream dependency);
- a sync edge from the GPU to the host: into the end of each blocking call, from the GPU event that
  ended last before the call returned, on the stream the wait names (a synchronization record's
  stream; every stream for a device or context synchronize).

The critical path is the longest path of this acyclic graph: its length is the time covered by
dependent work, at most the time from its first node to its last. It can run past the step's end (in
a GPU-bound step the kernels the step launched finish later) and can be shorter than the step where the
host runs untraced code between top-level ops.

Where this differs from HTA 0.5 (``hta_compatible=True`` takes HTA's choice in each):

- blocking calls are the ones that block (``breakdown.SYNC_RE``: device, stream and event synchronize,
  synchronous cudaMemcpy/cudaMemset; and any call with a blocking synchronization record); HTA also
  counts cudaEventQuery (a poll) and cudaMemcpyAsync, whose host time it then drops;
- sync edges also come from blocking calls without a record (Kineto writes ``cuda_sync`` records only
  under ``enable_cuda_sync_events``; HTA adds none without them), and only from a GPU event that
  ended inside the call (the host did wait for it). A sync edge and a stream-wait edge carry the time
  from the GPU event's end to the host call's end or the waiting event's start (kinds sync and idle);
  HTA gives them weight 0, so its path loses that stretch. A stream wait carries that time only where
  it held the event back (the other stream's event ended after the launch and after the event's
  predecessor on its stream);
- HTA finds a sync record's GPU event as the last one to start before the record ends, and an event
  sync's through the cudaEventRecord call it names (``wait_on_cuda_event_record_corr_id``, which the
  event table does not keep); here the last one to end before the call returns, on the record's stream;
- the queue lengths count every runtime call that launched a GPU event, not only HTA's list of launch
  calls, and streams are told apart by device as well.

The host is seen only inside traced ops and calls: on an Nsight Systems export (runtime calls, no
framework ops) the Python between calls is a gap the path jumps at no gain, so where the GPU waits for
the host the path is short of the window (nsysai_mfu_2gpu_after: 40.5 ms of a 299 ms capture).

Cost: only one step of one rank is graphed, with two nodes per event there; the longest path is one
pass over the edges in topological order (a Python loop: about a microsecond per edge). The rest is
vectorised over the rank's rows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from advisor.analysis.breakdown import (
    COMM_RE,
    PROFILER_STEP_RE,
    STREAM_WAIT_RE,
    SYNC_RE,
    _per_name,
    _search,
    rank_spans,
)
from advisor.analysis.steps import step_windows
from advisor.errors import AdvisorError
from advisor.trace.table import GPU_KINDS, kind_mask, unique_first

SEGMENT_KINDS = ("compute", "communication", "memcpy", "memset", "idle", "launch", "sync", "host")
"""What a stretch of the path is: GPU work (the first four), the GPU waiting on its stream or on another
stream (idle), a runtime call's start to the start of the GPU event it launched (launch), the host
waking from a wait after the GPU event it waited for ended (sync), host ops and runtime calls (host)."""
CATEGORIES = ("compute", "communication", "copies", "idle", "launch", "sync", "host")
"""The summary's rows: the segment kinds, with memcpy and memset together as copies."""
PATH_COLUMNS = ["rank", "step", "kind", "name", "start_ns", "dur_ns", "stream", "tid"]
SUMMARY_COLUMNS = ["rank", "step", "category", "time_ms", "share_pct", "step_pct"]
HTA_BLOCKING_RE = re.compile(
    r"^(?:cudaDeviceSynchronize|cudaStreamSynchronize|cudaEventQuery|cudaEventSynchronize|cudaMemcpy|cudaMemcpyAsync)$"
)
"""HTA 0.5's blocking calls (CPGraph.BLOCKING_SYNC_CALLS), for ``hta_compatible``."""
DEVICE_SYNC_RE = re.compile(r"^(?:cuda|hip)DeviceSynchronize|^cuCtxSynchronize")
ALL_STREAMS = 2**32 - 1
"""A synchronization record's stream when it waited on no one stream (CUPTI_SYNCHRONIZATION_INVALID_VALUE;
Kineto may also write -1)."""
MAX_HOST_EVENTS = 100_000
"""The most host events graphed (about a second of work on these 2 cores; a training step of a large
model has tens of thousands): a longer window, a capture without steps graphed whole, is cut after that
many, and its label says so."""
_KIND = {k: i for i, k in enumerate(SEGMENT_KINDS)}
_DEPENDENCY = -1  # an edge that only orders (weight 0, no segment)


@dataclass(frozen=True)
class StepWindow:
    """The stretch of one rank's trace that is graphed: host events that start in it, and the GPU
    events their runtime calls launched."""

    rank: int
    step: str
    """'ProfilerStep#N', the annotation's name, 'step N (<basis>)' for inferred steps, or 'whole trace'."""
    start_ns: int
    end_ns: int


def step_window(
    df: pd.DataFrame, rank: int | None = None, step: int | None = None, annotation: str | None = None
) -> StepWindow | None:
    """The window ``critical_path`` graphs; None for an empty table.

    Candidates: the host's ``ProfilerStep#N`` ranges (``step`` picks N); else, with ``annotation``,
    the host ranges whose name contains it (HTA's ``annotation``; ``step`` picks the instance, from 0, in
    time order); else the steps ``advisor.analysis.steps.step_windows`` finds (``step`` picks the
    position); else each rank's whole trace. Of those (on ``rank`` where given) the longest is taken:
    in a synchronous job the slowest rank's longest step is the one that sets the pace. The table's
    ProfilerStep ranges are taken as they are: ``analyze`` passes the table with the last (cut) step
    already dropped. Raises AdvisorError where the rank or step asked for is not in the trace."""
    if df.empty:
        return None
    cands = _candidates(df, annotation)
    if rank is not None:
        cands = cands[cands["rank"] == rank]
    if step is not None:
        cands = cands[cands["number"] == step]
    if cands.empty:
        asked = ", ".join(
            f"{k}={v!r}" for k, v in (("rank", rank), ("step", step), ("annotation", annotation)) if v is not None
        )
        raise AdvisorError(
            f"critical path: no step with {asked} in the trace (ranks {sorted(set(df['rank'].tolist()))})"
        )
    best = cands.assign(length=cands["end_ns"] - cands["start_ns"]).sort_values(
        ["length", "rank", "start_ns"], ascending=[False, True, True], kind="stable"
    )
    r = best.iloc[0]
    return StepWindow(int(r["rank"]), str(r["label"]), int(r["start_ns"]), int(r["end_ns"]))


def _candidates(df: pd.DataFrame, annotation: str | None) -> pd.DataFrame:
    """rank, label, number (what ``step`` selects), start_ns, end_ns of every window on offer."""
    ranges = np.flatnonzero(kind_mask(df, "annotation") & (df["device"].to_numpy() == -1))
    if annotation is None:
        want = _per_name(df["name"], ranges, lambda n: PROFILER_STEP_RE.match(n) is not None, bool)
    else:
        want = _per_name(df["name"], ranges, lambda n: annotation in n, bool)
    rows = ranges[want]
    if rows.size or annotation is not None:
        if not rows.size:
            raise AdvisorError(f"critical path: no host range named like {annotation!r} in the trace")
        found = pd.DataFrame(
            {
                "rank": df["rank"].to_numpy()[rows],
                "label": df["name"].iloc[rows].astype(str).to_numpy(),
                "start_ns": df["start_ns"].to_numpy()[rows],
                "end_ns": df["start_ns"].to_numpy()[rows] + df["dur_ns"].to_numpy()[rows],
            }
        ).sort_values(["rank", "start_ns"], kind="stable")
        if annotation is None:
            found["number"] = found["label"].str.removeprefix("ProfilerStep#").astype(np.int64)
        else:
            found["number"] = found.groupby("rank").cumcount()
        return found
    windows = step_windows(df)
    if windows:
        inferred = pd.DataFrame(
            [
                (rank, i, int(a), int(b), basis)
                for rank, (starts, ends, basis) in windows.items()
                for i, (a, b) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True))
            ],
            columns=["rank", "step", "start_ns", "end_ns", "basis"],
        )
        labels = [f"step {s} ({b})" for s, b in zip(inferred["step"].tolist(), inferred["basis"].tolist(), strict=True)]
        return inferred.assign(label=labels, number=inferred["step"])
    return rank_spans(df).assign(label="whole trace", number=0)


def critical_path(
    df: pd.DataFrame,
    rank: int | None = None,
    step: int | None = None,
    *,
    annotation: str | None = None,
    hta_compatible: bool = False,
) -> pd.DataFrame:
    """The critical path of one step of one rank (``step_window`` says which), as its segments in
    time order: ``rank``, ``step`` (the window's label), ``kind`` (``SEGMENT_KINDS``), ``name`` (the op,
    runtime call or GPU event the stretch belongs to: for idle and launch the GPU event that waits, for
    sync the host call), ``start_ns``, ``dur_ns``, ``stream`` (-1 on the host) and ``tid`` (-1 on the
    GPU). The path's length is the sum of ``dur_ns``; ``attrs["window"]`` holds the graphed window
    (rank, step, start_ns, end_ns). Empty (with the columns) where the window holds no host op, runtime
    call or GPU event. ``hta_compatible`` takes HTA 0.5's choice wherever this module's docstring
    lists a difference."""
    window = step_window(df, rank, step, annotation)
    if window is None:
        return _empty_path()
    window = _capped(df, window)
    graph = _Graph(df, window, hta_compatible)
    edges = graph.longest_path()
    if edges.size == 0:
        out = _empty_path()
    else:
        kind = graph.kind[edges]
        rows = graph.row[edges]
        out = pd.DataFrame(
            {
                "rank": np.full(edges.size, window.rank, dtype=np.int32),
                "step": window.step,
                "kind": pd.Categorical.from_codes(kind, categories=list(SEGMENT_KINDS)),
                "name": df["name"].iloc[rows].astype(str).to_numpy(),
                "start_ns": graph.ts[graph.src[edges]],
                "dur_ns": graph.weight[edges],
                "stream": graph.stream[edges],
                "tid": graph.tid[edges],
            },
            columns=PATH_COLUMNS,
        )
    out.attrs["window"] = {
        "rank": window.rank,
        "step": window.step,
        "start_ns": window.start_ns,
        "end_ns": window.end_ns,
        "host_traced": df.attrs.get("source") != "nsys",  # an nsys export has runtime calls, no framework ops
    }
    return out


UNTRACED_HOST_NOTE = (
    "an Nsight Systems export traces the host only inside CUDA calls: the path jumps the code between them at "
    "no cost, so it covers {pct:.0f} % of the window; the rest is that untraced host time and GPU work off the "
    "path, and the shares above are of the traced part"
)
"""Said under a short path of an nsys export (``short_untraced_path``): a user review read 'host 69.8 %'
over 40.5 ms of a 299 ms window as a contradiction of the GPU's 76 % busy time."""


def short_untraced_path(path_summary: pd.DataFrame, window: dict | None) -> str:
    """``UNTRACED_HOST_NOTE`` where the path of a trace whose host is untraced between calls covers
    under half its window, else ''."""
    if window is None or window.get("host_traced", True) or path_summary.empty:
        return ""
    total = path_summary[path_summary["category"] == "total"]
    pct = float(total["step_pct"].iloc[0]) if len(total) else float("nan")
    return UNTRACED_HOST_NOTE.format(pct=pct) if pct < 50 else ""


def critical_path_summary(path: pd.DataFrame) -> pd.DataFrame:
    """The path's time in each of ``CATEGORIES`` and in all (category 'total'): ``time_ms``,
    ``share_pct`` (of the path's length) and ``step_pct`` (of the graphed window's length, from
    ``path.attrs["window"]``; NaN without it; the total exceeds 100 where the path runs past the step's
    end). Empty for an empty path."""
    if path.empty:
        return pd.DataFrame(columns=SUMMARY_COLUMNS)
    kind = path["kind"].astype(str).replace({"memcpy": "copies", "memset": "copies"})
    per = path["dur_ns"].groupby(kind.to_numpy()).sum().reindex(list(CATEGORIES), fill_value=0)
    total = int(path["dur_ns"].sum())
    window = path.attrs.get("window")
    step_ns = window["end_ns"] - window["start_ns"] if window else 0
    time_ns = np.array([*per.to_numpy(), total], dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        share = 100 * time_ns / total if total else np.full(time_ns.size, np.nan)
        of_step = 100 * time_ns / step_ns if step_ns else np.full(time_ns.size, np.nan)
    return pd.DataFrame(
        {
            "rank": np.full(time_ns.size, path["rank"].iloc[0], dtype=np.int32),
            "step": path["step"].iloc[0],
            "category": [*CATEGORIES, "total"],
            "time_ms": time_ns / 1e6,
            "share_pct": share,
            "step_pct": of_step,
        },
        columns=SUMMARY_COLUMNS,
    )


def _capped(df: pd.DataFrame, window: StepWindow) -> StepWindow:
    """The window, ended before its host event number MAX_HOST_EVENTS + 1 where it holds more."""
    start = df["start_ns"].to_numpy()
    host = (df["rank"].to_numpy() == window.rank) & kind_mask(df, "cpu_op", "runtime")
    starts = start[host & (start >= window.start_ns) & (start <= window.end_ns)]
    if starts.size <= MAX_HOST_EVENTS:
        return window
    cut = int(np.partition(starts, MAX_HOST_EVENTS)[MAX_HOST_EVENTS]) - 1
    return replace(window, step=f"{window.step} (first {MAX_HOST_EVENTS} host events)", end_ns=cut)


def _empty_path() -> pd.DataFrame:
    out = pd.DataFrame({c: pd.Series(dtype="int64") for c in PATH_COLUMNS})
    return out.astype({"rank": "int32", "step": "str", "kind": pd.CategoricalDtype(list(SEGMENT_KINDS)), "name": "str"})


class _Graph:
    """The nodes and edges of one window (see the module docstring). Node 2i / 2i+1 is the start / end
    of host event i; node 2H + 2g / 2H + 2g + 1 those of GPU event g. Per edge: ``src``, ``dst``,
    ``weight`` (ns), ``kind`` (a SEGMENT_KINDS code, or _DEPENDENCY), ``row`` (the table row the
    stretch belongs to), ``stream`` and ``tid``."""

    def __init__(self, df: pd.DataFrame, window: StepWindow, hta: bool) -> None:
        self.hta = hta
        rank, start, dur = (df[c].to_numpy() for c in ("rank", "start_ns", "dur_ns"))
        in_rank = rank == window.rank
        # Host: framework ops and runtime calls with a duration that start in the window (HTA's clip).
        host = np.flatnonzero(
            in_rank
            & kind_mask(df, "cpu_op", "runtime")
            & (dur > 0)
            & (start >= window.start_ns)
            & (start <= window.end_ns)
        )
        corr = df["correlation"].to_numpy()
        runtime = host[kind_mask(df, "runtime")[host] & (corr[host] >= 0)]
        by_corr = runtime[np.argsort(corr[runtime], kind="stable")]
        corr_sorted = corr[by_corr]
        # GPU: what those runtime calls launched.
        gpu = np.flatnonzero(in_rank & kind_mask(df, *GPU_KINDS))
        gpu = gpu[_member(corr[gpu], corr_sorted)]
        launch = by_corr[np.searchsorted(corr_sorted, corr[gpu])]  # the runtime row of each GPU event
        self.df, self.in_rank, self.host, self.gpu, self.launch = df, in_rank, host, gpu, launch
        n_host = host.size
        self.n_nodes = 2 * (n_host + gpu.size)
        self.ts = np.zeros(self.n_nodes, dtype=np.int64)
        recs = np.flatnonzero(in_rank & kind_mask(df, "sync"))  # the rank's synchronization records
        waits = _per_name(df["name"], recs, lambda n: _search(STREAM_WAIT_RE, n), bool)
        self.stream_waits, self.records = recs[waits], recs[~waits]
        parts = [self._host_edges(), *self._gpu_edges(), self._sync_edges()]
        parts = [p for p in parts if p[0].size]
        cols = [np.concatenate([p[i] for p in parts]) if parts else np.zeros(0, dtype=np.int64) for i in range(7)]
        self.src, self.dst, self.weight, self.kind, self.row, self.stream, self.tid = cols

    # --- host threads --------------------------------------------------------------------------------
    def _host_edges(self) -> tuple[np.ndarray, ...]:
        df, host = self.df, self.host
        tid = df["tid"].to_numpy()[host]
        start = df["start_ns"].to_numpy()[host]
        end = start + df["dur_ns"].to_numpy()[host]
        runtime = kind_mask(df, "runtime")[host]
        if self.hta:
            blocking = runtime & _per_name(df["name"], host, lambda n: HTA_BLOCKING_RE.match(n) is not None, bool)
        else:
            blocking = runtime & (
                _per_name(df["name"], host, lambda n: SYNC_RE.search(n) is not None, bool)
                | np.isin(df["correlation"].to_numpy()[host], df["correlation"].to_numpy()[self.records])
            )
        self.blocking = blocking
        # HTA's call-stack order: by start, the longer first; a child that outlives its parent is cut
        # at the parent's end (ns-resolution traces, pytorch/pytorch#122425), so the walk nests.
        order = np.lexsort((np.arange(host.size), -(end - start), start, tid))
        # The walk emits each boundary with the innermost event still open after it (-1: none).
        node, inner, thread = [], [], []
        clipped = end.tolist()
        stack: list[int] = []

        def close(t: int) -> None:
            j = stack.pop()
            node.append(2 * j + 1)
            inner.append(stack[-1] if stack else -1)
            thread.append(t)

        last_tid = None
        for i, t, s in zip(order.tolist(), tid[order].tolist(), start[order].tolist(), strict=True):
            while stack and (t != last_tid or clipped[stack[-1]] <= s):
                close(last_tid)
            last_tid = t
            if stack and clipped[i] > clipped[stack[-1]]:
                clipped[i] = clipped[stack[-1]]
            stack.append(i)
            node.append(2 * i)
            inner.append(i)
            thread.append(t)
        while stack:
            close(last_tid)
        self.ts[0 : 2 * host.size : 2] = start
        self.ts[1 : 2 * host.size : 2] = clipped
        node_a, inner_a, thread_a = np.array(node, dtype=np.int64), np.array(inner, dtype=np.int64), np.array(thread)
        if node_a.size < 2:
            return _no_edges()
        same = thread_a[1:] == thread_a[:-1]
        src, dst, within = node_a[:-1][same], node_a[1:][same], inner_a[:-1][same]
        weight = self.ts[dst] - self.ts[src]
        exits_blocking = (dst % 2 == 1) & blocking[dst // 2]
        weight[(within < 0) | exits_blocking] = 0
        kind = np.where(within < 0, _DEPENDENCY, _KIND["host"])
        row = host[np.maximum(within, 0)]
        return src, dst, weight, kind, row, np.full(src.size, -1, dtype=np.int64), tid[np.maximum(within, 0)]

    # --- GPU streams ---------------------------------------------------------------------------------
    def _gpu_edges(self) -> list[tuple[np.ndarray, ...]]:
        df, gpu, n_host = self.df, self.gpu, self.host.size
        self.g_start = self.g_end = self.g_device = self.g_stream = np.zeros(0, dtype=np.int64)
        if gpu.size == 0:
            return [_no_edges()]
        start = df["start_ns"].to_numpy()[gpu]
        end = start + df["dur_ns"].to_numpy()[gpu]
        device = df["device"].to_numpy()[gpu].astype(np.int64)
        stream = df["stream"].to_numpy()[gpu]
        g_start = 2 * n_host + 2 * np.arange(gpu.size)
        self.ts[g_start], self.ts[g_start + 1] = start, end
        self.g_start, self.g_end, self.g_device, self.g_stream = start, end, device, stream
        kind = np.full(gpu.size, _KIND["compute"])
        kind[kind_mask(df, "memcpy")[gpu]] = _KIND["memcpy"]
        kind[kind_mask(df, "memset")[gpu]] = _KIND["memset"]
        is_kernel = kind_mask(df, "kernel")[gpu]
        comm = _per_name(df["name"], gpu[is_kernel], lambda n: _search(COMM_RE, n), bool)
        kind[np.flatnonzero(is_kernel)[comm]] = _KIND["communication"]
        no_tid = np.full(gpu.size, -1, dtype=np.int64)
        spans = (g_start, g_start + 1, end - start, kind, gpu, stream, no_tid)

        # Stream order: each event's predecessor on its (device, stream), in start order.
        order = np.lexsort((start, stream, device))
        prev = np.full(gpu.size, -1, dtype=np.int64)
        same = (device[order][1:] == device[order][:-1]) & (stream[order][1:] == stream[order][:-1])
        prev[order[1:][same]] = order[:-1][same]
        rt_start = df["start_ns"].to_numpy()[self.launch]
        q_launch, q_start = self._queue_lengths(device, stream, rt_start, start)
        cross = self._cross_stream_sources(device, stream, start, end)
        has_prev, has_cross = prev >= 0, cross >= 0
        prev_end = np.where(has_prev, end[np.maximum(prev, 0)], np.iinfo(np.int64).min)
        cross_end = np.where(has_cross, end[np.maximum(cross, 0)], np.iinfo(np.int64).min)
        launched = (
            (q_launch == 1) & (q_start == 0) & (prev_end < rt_start) & (cross_end < rt_start) & (start >= rt_start)
        )
        chained = ~launched & has_prev & (cross_end < prev_end)
        out = [spans]
        g = np.flatnonzero(launched)
        rt_node = 2 * np.searchsorted(self.host, self.launch[g])  # host rows are in table order
        tid = df["tid"].to_numpy()
        out.append(
            (
                rt_node,
                g_start[g],
                start[g] - rt_start[g],
                np.full(g.size, _KIND["launch"]),
                gpu[g],
                stream[g],
                tid[self.launch[g]],
            )
        )
        g = np.flatnonzero(chained)
        gap = np.maximum(start[g] - prev_end[g], 0)
        out.append(
            (g_start[prev[g]] + 1, g_start[g], gap, np.full(g.size, _KIND["idle"]), gpu[g], stream[g], no_tid[g])
        )
        # A stream wait carries time only where it held the event back: the other stream's event ended
        # after the launch and after the event's predecessor (the GPU waited for it, then started).
        g = np.flatnonzero(has_cross & (cross_end <= start))
        binding = (cross_end[g] >= rt_start[g]) & (cross_end[g] >= prev_end[g])
        wait = np.where(binding & (not self.hta), start[g] - cross_end[g], 0)
        kinds = np.where(wait > 0, _KIND["idle"], _DEPENDENCY)
        out.append((g_start[cross[g]] + 1, g_start[g], wait, kinds, gpu[g], stream[g], no_tid[g]))
        return out

    def _queue_lengths(
        self, device: np.ndarray, stream: np.ndarray, rt_start: np.ndarray, start: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """HTA's queue length of each window GPU event's stream just after its launch and just after it
        started: GPU events of the rank launched by then and not started yet (the event itself counted
        at launch). Work launched before the window counts, as in HTA, which reads the whole trace."""
        df = self.df
        corr, at = df["correlation"].to_numpy(), df["start_ns"].to_numpy()
        first = min(int(start.min()), int(rt_start.min()))  # an event started before this never counts
        others = np.flatnonzero(self.in_rank & kind_mask(df, *GPU_KINDS) & (corr >= 0) & (at >= first))
        calls = np.flatnonzero(self.in_rank & kind_mask(df, "runtime") & (corr >= 0))
        calls = calls[np.argsort(corr[calls], kind="stable")]
        pos = np.minimum(np.searchsorted(corr[calls], corr[others]), calls.size - 1)
        if calls.size:
            launched = corr[calls][pos] == corr[others]
            others, pos = others[launched], pos[launched]
        o_launch, o_start = at[calls[pos]] if calls.size else at[others], at[others]
        # Work launched and started after the window's last launch and start counts at no time asked.
        last = max(int(start.max()), int(rt_start.max()))
        early = (o_launch <= last) | (o_start <= last)
        others, o_launch, o_start = others[early], o_launch[early], o_start[early]
        o_dev, o_stream = df["device"].to_numpy()[others].astype(np.int64), df["stream"].to_numpy()[others]
        q_launch = np.zeros(start.size, dtype=np.int64)
        q_start = np.zeros(start.size, dtype=np.int64)
        for d, s in set(zip(device.tolist(), stream.tolist(), strict=True)):
            mine = (device == d) & (stream == s)
            theirs = (o_dev == d) & (o_stream == s)
            launches, starts = np.sort(o_launch[theirs]), np.sort(o_start[theirs])
            for t, q in ((rt_start, q_launch), (start, q_start)):
                q[mine] = np.searchsorted(launches, t[mine], "right") - np.searchsorted(starts, t[mine], "right")
        return q_launch, q_start

    def _cross_stream_sources(
        self, device: np.ndarray, stream: np.ndarray, start: np.ndarray, end: np.ndarray
    ) -> np.ndarray:
        """Per window GPU event, the event on another stream it waits for through a stream-wait record
        (-1: none): the record's stream's first event launched after the wait call waits for the event
        of another stream of its device, launched before the call, that ended last before it started.
        Ties go to the first event in table order, and to the first record in table order."""
        df = self.df
        out = np.full(start.size, -1, dtype=np.int64)
        if self.stream_waits.size == 0 or start.size == 0:
            return out
        rt_start = df["start_ns"].to_numpy()[self.launch]
        recs, at = self._wait_calls()
        # Only a wait call between the window's first and last launch has a GPU event launched before
        # it and one after it: the rest of the trace's records are skipped (they scale with the file,
        # the window does not).
        inside = (at > rt_start.min()) & (at < rt_start.max())
        recs, at = recs[inside], at[inside]
        # Per stream, its events by launch (the first launched after the call is the one that waits);
        # per device, its events by end, the latest end last and, among equal ends, the first event
        # last, so a backward walk meets the latest-ending, first candidate first.
        dests, sources = {}, {}
        for d, s in set(zip(device.tolist(), stream.tolist(), strict=True)):
            on = np.flatnonzero((device == d) & (stream == s))
            on = on[np.argsort(rt_start[on], kind="stable")]
            dests[(d, s)] = (on, rt_start[on])
        for d in set(device.tolist()):
            on = np.flatnonzero(device == d)
            on = on[np.lexsort((-on, end[on]))]
            sources[d] = (on.tolist(), on, end[on])
        stream_l, rt_l, end_l = stream.tolist(), rt_start.tolist(), end.tolist()
        walk = 64  # events walked back in Python before the rest is searched in one numpy pass
        r_dev, r_stream = (df[c].to_numpy()[recs].tolist() for c in ("device", "stream"))
        for t, d, s in zip(at.tolist(), r_dev, r_stream, strict=True):
            if (d, s) not in dests:
                continue
            on, launched = dests[(d, s)]
            k = int(np.searchsorted(launched, t, "right"))
            if k == on.size:
                continue
            dest = int(on[k])
            by_end, by_end_a, ends = sources[d]
            best, last = -1, int(np.searchsorted(ends, start[dest], "right")) - 1
            for i in range(last, max(last - walk, -1), -1):
                g = by_end[i]
                if stream_l[g] != s and rt_l[g] < t:
                    best = g
                    break
            else:
                rest = by_end_a[: max(last - walk + 1, 0)]
                hits = np.flatnonzero((stream[rest] != s) & (rt_start[rest] < t))
                best = int(rest[hits[-1]]) if hits.size else -1
            if best >= 0 and (out[dest] < 0 or end_l[best] > end_l[out[dest]]):
                out[dest] = best
        return out

    def _wait_calls(self) -> tuple[np.ndarray, np.ndarray]:
        """The rank's stream-wait records and when each wait was issued: the start of the first runtime
        call of the rank with the record's correlation id, else the record's own start."""
        df, recs = self.df, self.stream_waits
        corr, at = df["correlation"].to_numpy(), df["start_ns"].to_numpy()
        wanted = np.unique(corr[recs])
        calls = np.flatnonzero(self.in_rank & kind_mask(df, "runtime") & (corr >= 0))
        calls = calls[_member(corr[calls], wanted)]  # in table order: the first of a correlation id wins
        ids, first = unique_first(corr[calls])
        pos = np.minimum(np.searchsorted(ids, corr[recs]), max(ids.size - 1, 0))
        found = (ids[pos] == corr[recs]) if ids.size else np.zeros(recs.size, dtype=bool)
        return recs, np.where(found, at[calls[first[pos]]] if ids.size else 0, at[recs])

    # --- GPU -> host ---------------------------------------------------------------------------------
    def _sync_edges(self) -> tuple[np.ndarray, ...]:
        """Edges from the GPU event each blocking call waited for to the call's end."""
        df, host = self.df, self.host
        if self.gpu.size == 0 or host.size == 0:
            return _no_edges()
        corr, recs = df["correlation"].to_numpy(), self.records
        rec_of = dict(zip(corr[recs].tolist(), recs.tolist(), strict=True))
        calls = np.flatnonzero(self.blocking)
        if self.hta:  # HTA: only where a record says the call waited
            calls = calls[np.isin(corr[host[calls]], corr[recs])]
        streams = sorted(set(zip(self.g_device.tolist(), self.g_stream.tolist(), strict=True)))
        by_stream = {}
        for key in streams:
            on = np.flatnonzero((self.g_device == key[0]) & (self.g_stream == key[1]))
            by = self.g_start if self.hta else self.g_end
            on = on[np.argsort(by[on], kind="stable")]
            by_stream[key] = (on, by[on])
        device_wide = _per_name(df["name"], host[calls], lambda n: DEVICE_SYNC_RE.match(n) is not None, bool)
        src, dst, row, strm = [], [], [], []
        start, dur, names_tid = df["start_ns"].to_numpy(), df["dur_ns"].to_numpy(), df["tid"].to_numpy()
        rec_device, rec_stream = df["device"].to_numpy(), df["stream"].to_numpy()
        for c, wide in zip(calls.tolist(), device_wide.tolist(), strict=True):
            r = host[c]
            c_start, c_end = int(start[r]), int(start[r] + dur[r])
            rec = rec_of.get(int(corr[r]))
            waited, single, until = streams, not wide, c_end
            if rec is not None:
                s = int(rec_stream[rec])
                single = False
                if 0 <= s < ALL_STREAMS:
                    waited = [(int(rec_device[rec]), s)]
                if self.hta:
                    until = int(start[rec] + dur[rec])
            found = []
            for key in waited:
                if key not in by_stream:
                    continue
                on, times = by_stream[key]
                k = np.searchsorted(times, until, "right") - 1
                if k >= 0 and (self.hta or self.g_end[on[k]] > c_start):
                    found.append(int(on[k]))
            if single and found:
                found = [max(found, key=lambda g: self.g_end[g])]
            for g in found:
                src.append(2 * host.size + 2 * g + 1), dst.append(2 * c + 1), row.append(r)
                strm.append(int(self.g_stream[g]))
        if not src:
            return _no_edges()
        src_a, dst_a = np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64)
        weight = np.zeros(src_a.size, dtype=np.int64) if self.hta else self.ts[dst_a] - self.ts[src_a]
        row_a = np.array(row, dtype=np.int64)
        kind = np.where(weight > 0, _KIND["sync"], _DEPENDENCY)
        return src_a, dst_a, weight, kind, row_a, np.array(strm, dtype=np.int64), names_tid[row_a]

    # --- longest path --------------------------------------------------------------------------------
    def longest_path(self) -> np.ndarray:
        """The edges of the longest path, in order, that carry time (Kahn's topological order with
        relaxation; a node on a cycle, which only equal timestamps could make, is never reached)."""
        n, src, dst = self.n_nodes, self.src, self.dst
        if src.size == 0:
            return np.zeros(0, dtype=np.int64)
        weight = np.maximum(self.weight, 0)
        by_src = np.argsort(src, kind="stable")
        ptr = np.searchsorted(src[by_src], np.arange(n + 1)).tolist()
        out_dst, out_w, out_id = dst[by_src].tolist(), weight[by_src].tolist(), by_src.tolist()
        indeg = np.bincount(dst, minlength=n).tolist()
        dist = [0] * n
        pred = [-1] * n
        ready = [v for v in range(n) if indeg[v] == 0]
        while ready:
            u = ready.pop()
            du = dist[u]
            for k in range(ptr[u], ptr[u + 1]):
                v = out_dst[k]
                if du + out_w[k] > dist[v]:
                    dist[v] = du + out_w[k]
                    pred[v] = out_id[k]
                indeg[v] -= 1
                if indeg[v] == 0:
                    ready.append(v)
        path = []
        v = int(np.argmax(dist))
        while pred[v] >= 0:
            path.append(pred[v])
            v = int(src[pred[v]])
        edges = np.array(path[::-1], dtype=np.int64)
        return edges[(weight[edges] > 0) & (self.kind[edges] >= 0)]


def _member(values: np.ndarray, sorted_ids: np.ndarray) -> np.ndarray:
    """``np.isin(values, sorted_ids)`` for a sorted ``sorted_ids``, without sorting ``values``."""
    if sorted_ids.size == 0:
        return np.zeros(values.size, dtype=bool)
    pos = np.minimum(np.searchsorted(sorted_ids, values), sorted_ids.size - 1)
    return sorted_ids[pos] == values


def _no_edges() -> tuple[np.ndarray, ...]:
    empty = np.zeros(0, dtype=np.int64)
    return (empty,) * 7
