"""Communication per communicator: bandwidth per process group and kind, the wait for the late rank
apart from the transfer, and the ranks whose communication starts late.

What identifies a communicator: Kineto traces of torch 2.2 and later record, on each NCCL kernel, the
process group's name, description and global ranks and the group size (``Process Group Name``,
``Process Group Description``, ``Process Group Ranks``, ``Group size``; read by
``advisor.analysis.collectives.collective_sizes``). Calls are grouped by name and ranks. Older traces
(trace_filter, 2022) and Nsight Systems exports (whose NCCL NVTX payloads carry a communicator id that
the export leaves out) record none: their calls fall in one communicator named ``unknown``, of unknown
size and reach.

Intra- vs inter-node: torchrun numbers global ranks node by node (rank = node_rank x nproc_per_node +
local_rank), so global rank r lives on node r // gpus_per_node. A communicator whose recorded ranks
fall on more than one node is inter-node; its collectives run at the slowest link they cross (the
network, against NVLink within a node).

Wait and transfer (nccl-tests' view, NVIDIA/nccl-tests doc/PERFORMANCE.md: a collective's time is
meant from the moment every rank has joined): an NCCL kernel starts when its rank reaches the call and
cannot finish before the last rank has joined. For one collective instance matched across ranks, rank
r's kernel time splits into ``wait`` = (last rank's start - r's start), clipped to [0, r's duration],
spent waiting for the late rank, and ``transfer`` = the rest, from the last start to r's end. The
instance's spread of starts is its sync skew. This needs the ranks' clocks to agree: ranks of one host
share one; across hosts Kineto uses each host's clock, off by its NTP error (commonly well under a
millisecond), which shows as skew.

Matching: the k-th call of one communicator and kind on each rank is one instance (c10d issues a
group's collectives in one order on every member), counted within each profiler step (``ProfilerStep#N``
by the host launch time, so ranks whose captures start at different steps still pair) and, for the
kinds whose buffer is the same on every rank (all kinds but all-to-all), within one size, so a call
missing from one rank's trace (a sampled or cut trace) does not shift the others. A matched all-reduce,
all-gather, reduce-scatter, all-to-all or barrier whose kernels do not all overlap in time (one rank
finished before another started, which no rank can) is a false match and is left out. Point-to-point
calls pair only in a communicator of two ranks (elsewhere the peer is not recorded).
"""

from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd

from advisor.analysis.collectives import P2P_KINDS, collective_calls, collective_sizes
from advisor.analysis.commbw import bus_factor
from advisor.errors import AdvisorError
from advisor.trace.table import kind_mask

GPUS_PER_NODE = 8
"""GPUs per node for telling intra- from inter-node communicators: 8 on the DGX/HGX A100, H100 and H200
boards these traces come from. Pass ``gpus_per_node`` for other machines."""

STRAGGLER_FRAC = 0.05
"""A rank is a communication straggler when its median lateness, times the collectives per step it
takes part in, exceeds this share of its step: the same 5 % that ``breakdown.rank_skew`` applies to
step time. The median, so that one late start (a garbage collection, a checkpoint) does not make a
straggler of a rank that is on time otherwise."""

UNKNOWN = "unknown"
_ALL_JOIN = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "barrier")  # none finishes before all start
_PER_RANK_SIZE = ("all_to_all",)  # buffers may differ by rank (uneven splits)
_ALGO_RE = re.compile(r"_(RING|TREE|COLLNET\w*?|NVLS\w*?|PAT)_(LL128|LL|SIMPLE)", re.IGNORECASE)
_STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")

_BY_COMM_COLS = [
    "communicator",
    "pg_desc",
    "pg_ranks",
    "group_size",
    "nodes_count",
    "scope",
    "kind",
    "nccl_algo",
    "ranks_count",
    "calls_count",
    "bytes",
    "time_ms",
    "algbw_gbps",
    "busbw_gbps",
    "matched_calls_count",
    "wait_ms",
    "transfer_ms",
    "transfer_busbw_gbps",
]
_SKEW_COLS = [
    "rank",
    "instances_count",
    "wait_mean_ms",
    "transfer_mean_ms",
    "wait_total_ms",
    "transfer_total_ms",
    "wait_pct",
    "note",
]
_STRAGGLER_COLS = [
    "rank",
    "instances_count",
    "late_median_ms",
    "late_mean_ms",
    "last_count",
    "last_pct",
    "instances_per_step",
    "step_ms",
    "late_of_step_pct",
    "comm_straggler",
    "step_above_median_pct",
    "step_straggler",
    "note",
]


def comm_calls(
    table: pd.DataFrame, calls: pd.DataFrame | None = None, gpus_per_node: int = GPUS_PER_NODE
) -> pd.DataFrame:
    """The collective calls of ``table`` (``calls``: its
    :func:`advisor.analysis.collectives.collective_calls` with sizes, computed here where not given),
    each with its communicator, its profiler step and its match across ranks.

    Added columns: ``communicator`` (the process group's name, ``unknown`` where the trace records
    none), ``nodes_count`` (nodes its recorded ranks fall on, ``gpus_per_node`` to a node; 0 unknown),
    ``scope`` (``intra_node``, ``inter_node`` or ``unknown``), ``step`` (the ``ProfilerStep#N`` number
    whose range holds the launch; -1 outside any), ``instance`` (an id shared by the calls matched as
    one collective across ranks, see the module docstring; -1 unmatched), ``wait_ns`` and
    ``transfer_ns`` of matched calls (NaN unmatched), ``late_ns`` (start after the instance's earliest
    start; NaN unmatched), ``last`` (this rank started the instance last).
    """
    if calls is None:
        calls = collective_calls(table, collective_sizes(table))
    return _with_instances(_with_steps(_with_communicators(calls, gpus_per_node), table))


def comm_by_communicator(calls: pd.DataFrame) -> pd.DataFrame:
    """Per communicator and kind of call, summed over the ranks in the trace, from :func:`comm_calls`.

    Columns: ``communicator``, ``pg_desc``, ``pg_ranks`` (as recorded), ``group_size`` (0 unknown),
    ``nodes_count``, ``scope`` (see :func:`comm_calls`); ``kind``; ``nccl_algo``: the algorithm and
    protocol in the kernels' names (``RING_LL``; several joined by ``,``; '' where the names carry none,
    as ``ncclDevKernel_SendRecv``); ``ranks_count`` (ranks of the trace that made such calls),
    ``calls_count``, ``bytes`` (summed full buffers, NaN unless every call's size is known), ``time_ms``
    (summed kernel time, waits included); ``algbw_gbps`` = bytes / time (GB/s, 1e9 bytes per second
    as nccl-tests), ``busbw_gbps`` = algbw x NCCL's bus factor of the kind and group size
    (``advisor.analysis.commbw.bus_factor``; NaN without a group size). Over the calls matched across
    ranks: ``matched_calls_count``, ``wait_ms`` (summed waits for the late rank), ``transfer_ms``
    (summed rest), ``transfer_busbw_gbps``: their bus bytes over their transfer time, the bandwidth
    the link gave once every rank had joined (NaN where none matched or sizes are unknown).
    """
    if calls.empty:
        return _empty(_BY_COMM_COLS)
    gid = _group_ids(calls["communicator"].to_numpy(), calls["pg_ranks"].to_numpy(), calls["kind"].to_numpy())
    first = np.unique(gid, return_index=True)[1]  # a row of each group, in group id order
    kind, size = calls["kind"].to_numpy()[first], calls["group_size"].to_numpy()[first]
    factor = np.array([bus_factor(k, int(n)) for k, n in zip(kind, size, strict=True)])
    nbytes = calls["bytes"].to_numpy(dtype=float)
    matched = calls["instance"].to_numpy() >= 0
    transfer = np.where(matched, calls["transfer_ns"].to_numpy(dtype=float), 0.0)

    def total(x: np.ndarray) -> np.ndarray:
        return np.bincount(gid, weights=x, minlength=first.size)

    sized_bytes = total(np.nan_to_num(nbytes))
    unsized = total(np.isnan(nbytes)) > 0
    time_ns = total(calls["dur_ns"].to_numpy(dtype=float))
    m_count = total(matched).astype(np.int64)
    m_transfer = total(transfer)
    m_unsized = total(matched & np.isnan(nbytes)) > 0
    algbw = np.where(unsized | (time_ns <= 0), np.nan, sized_bytes / np.where(time_ns > 0, time_ns, 1))  # B/ns = GB/s
    m_bus = total(np.where(matched, np.nan_to_num(nbytes), 0.0)) * factor
    ranks = np.bincount(np.unique(np.stack([gid, calls["rank"].to_numpy()]), axis=1)[0], minlength=first.size)
    algos = calls["name"].map(_nccl_algo).to_numpy()
    pick = [algos[gid == i] for i in range(first.size)]
    some = m_count > 0
    out = pd.DataFrame(
        {
            "communicator": calls["communicator"].to_numpy()[first],
            "pg_desc": calls["pg_desc"].to_numpy()[first],
            "pg_ranks": calls["pg_ranks"].to_numpy()[first],
            "group_size": size,
            "nodes_count": calls["nodes_count"].to_numpy()[first],
            "scope": calls["scope"].to_numpy()[first],
            "kind": kind,
            "nccl_algo": [",".join(sorted(set(a) - {""})) for a in pick],
            "ranks_count": ranks,
            "calls_count": np.bincount(gid, minlength=first.size),
            "bytes": np.where(unsized, np.nan, sized_bytes),
            "time_ms": time_ns / 1e6,
            "algbw_gbps": algbw,
            "busbw_gbps": algbw * factor,
            "matched_calls_count": m_count,
            "wait_ms": np.where(
                some, total(np.where(matched, calls["wait_ns"].to_numpy(dtype=float), 0.0)) / 1e6, np.nan
            ),
            "transfer_ms": np.where(some, m_transfer / 1e6, np.nan),
            "transfer_busbw_gbps": np.where(
                some & ~m_unsized & (m_transfer > 0), m_bus / np.where(m_transfer > 0, m_transfer, 1), np.nan
            ),
        }
    )
    return out.sort_values(["communicator", "pg_ranks", "kind"], kind="stable").reset_index(drop=True)


def comm_skew(calls: pd.DataFrame) -> pd.DataFrame:
    """Per rank of the trace: how long its communication kernels waited for the late rank, apart from
    the transfer, over the calls matched across ranks (:func:`comm_calls`).

    Columns: ``instances_count`` (its matched calls), ``wait_mean_ms`` / ``transfer_mean_ms`` (per
    call), ``wait_total_ms`` / ``transfer_total_ms``, ``wait_pct`` (wait, % of its matched calls'
    kernel time), ``note`` (why nothing was measured, '' where it was). Where no call could be matched
    (one rank's trace, or no collective that spans the traced ranks) the figures are NaN and the note
    says why: a wait cannot be told from a transfer in one rank's kernels.
    """
    if calls.empty:
        return _empty(_SKEW_COLS)
    per = _per_rank(calls)
    measured = per["instances_count"] > 0
    wait, transfer = per["wait_ns"] / 1e6, per["transfer_ns"] / 1e6
    out = pd.DataFrame(
        {
            "rank": per.index.to_numpy(dtype=np.int64),
            "instances_count": per["instances_count"].to_numpy(),
            "wait_mean_ms": (wait / per["instances_count"]).where(measured),
            "transfer_mean_ms": (transfer / per["instances_count"]).where(measured),
            "wait_total_ms": wait.where(measured),
            "transfer_total_ms": transfer.where(measured),
            "wait_pct": (100 * wait / (wait + transfer)).where(measured & (wait + transfer > 0)),
            "note": np.where(measured, "", _unmatched_note(calls)),
        }
    )
    return out[_SKEW_COLS].reset_index(drop=True)


def comm_stragglers(
    calls: pd.DataFrame, rank_skew: pd.DataFrame | None = None, straggler_frac: float = STRAGGLER_FRAC
) -> pd.DataFrame:
    """Per rank: how late its communication kernels start against the earliest rank of each matched
    collective (:func:`comm_calls`), beside its step-time skew (``breakdown.rank_skew``).

    Columns: ``instances_count``; ``late_median_ms`` / ``late_mean_ms`` (its start after the
    instance's earliest start); ``last_count`` / ``last_pct`` (instances it started last; ties count
    for each tied rank); ``instances_per_step`` (its matched calls per profiler step, all of them
    where the trace has no steps); ``step_ms`` (``rank_skew``'s step time: ProfilerStep mean, else the
    kernel span); ``late_of_step_pct`` = late_mean x instances_per_step / step: how long per step the
    earliest rank waits for this one, % of the step; ``comm_straggler``: late_median x
    instances_per_step above ``straggler_frac`` of the step (typically late, see STRAGGLER_FRAC);
    ``step_above_median_pct`` and ``step_straggler`` from ``rank_skew`` (NaN / False without it);
    ``note`` as in :func:`comm_skew`. Start order, not step time, finds the rank the others wait
    for: every rank's step is as long as the slowest one's once they all wait for it.
    """
    if calls.empty:
        return _empty(_STRAGGLER_COLS)
    per = _per_rank(calls)
    n = per["instances_count"]
    measured = n > 0
    skew = rank_skew.set_index("rank") if rank_skew is not None and not rank_skew.empty else None
    has = skew is not None
    step_ns = skew["step_ns"].reindex(per.index).astype(float) if has else pd.Series(math.nan, index=per.index)
    per_step = (n / per["steps"].clip(lower=1)).where(measured)
    of_step = 100 * per["late_mean_ns"] * per_step / step_ns
    typical = 100 * per["late_median_ns"] * per_step / step_ns
    out = pd.DataFrame(
        {
            "rank": per.index.to_numpy(dtype=np.int64),
            "instances_count": n.to_numpy(),
            "late_median_ms": per["late_median_ns"] / 1e6,
            "late_mean_ms": per["late_mean_ns"] / 1e6,
            "last_count": per["last_count"].to_numpy(),
            "last_pct": (100 * per["last_count"] / n).where(measured),
            "instances_per_step": per_step,
            "step_ms": step_ns / 1e6,
            "late_of_step_pct": of_step,
            "comm_straggler": (typical > 100 * straggler_frac).to_numpy(),
            "step_above_median_pct": skew["above_median_pct"].reindex(per.index) if has else math.nan,
            "step_straggler": skew["straggler"].reindex(per.index).fillna(False).astype(bool) if has else False,
            "note": np.where(measured, "", _unmatched_note(calls)),
        }
    )
    return out[_STRAGGLER_COLS].reset_index(drop=True)


# --- internals ---------------------------------------------------------------------------------------


def _with_communicators(calls: pd.DataFrame, gpus_per_node: int) -> pd.DataFrame:
    if gpus_per_node < 1:
        raise AdvisorError(f"gpus_per_node={gpus_per_node}: a node has at least one GPU (default {GPUS_PER_NODE})")
    named = calls["pg_name"].astype(str)
    recorded = calls["pg_ranks"].astype(str)
    nodes = {r: _nodes(r, gpus_per_node) for r in recorded.unique().tolist()}
    n_nodes = recorded.map(nodes).astype(np.int64)
    scope = np.select([n_nodes > 1, n_nodes == 1], ["inter_node", "intra_node"], UNKNOWN)
    return calls.assign(
        communicator=named.where(named != "", UNKNOWN),
        nodes_count=n_nodes.to_numpy(),
        scope=scope,
    )


def _nodes(recorded: str, gpus_per_node: int) -> int:
    """Nodes the recorded global ranks ('[0, 1, 8]') fall on; 0 where none are recorded."""
    ranks = [int(x) for x in re.findall(r"-?\d+", recorded)]
    return len({r // gpus_per_node for r in ranks}) if ranks else 0


def _with_steps(calls: pd.DataFrame, table: pd.DataFrame) -> pd.DataFrame:
    """Each call's ProfilerStep#N number, from the range on its rank's host that holds its launch."""
    step = np.full(len(calls), -1, dtype=np.int64)
    if calls.empty:
        return calls.assign(step=step)
    names = table["name"]
    if not isinstance(names.dtype, pd.CategoricalDtype):
        names = names.astype("category")
    # The step number of each distinct name (-1: not a ProfilerStep), and -1 for a missing name.
    per_name = [int(m.group(1)) if (m := _STEP_RE.match(str(n))) else -1 for n in names.cat.categories]
    number = np.array([*per_name, -1], dtype=np.int64)[names.array.codes]
    host = kind_mask(table, "annotation") & (table["device"].to_numpy() == -1) & (number >= 0)
    numbers = number[host]
    s_rank, s_start = table["rank"].to_numpy()[host], table["start_ns"].to_numpy()[host]
    s_end = s_start + table["dur_ns"].to_numpy()[host]
    c_rank, c_launch = calls["rank"].to_numpy(), calls["launch_ns"].to_numpy()
    for rank in np.unique(s_rank).tolist():
        mine = np.flatnonzero(s_rank == rank)
        mine = mine[np.argsort(s_start[mine], kind="stable")]
        on = np.flatnonzero(c_rank == rank)
        j = np.searchsorted(s_start[mine], c_launch[on], side="right") - 1
        inside = (j >= 0) & (c_launch[on] < s_end[mine[np.maximum(j, 0)]])
        step[on[inside]] = numbers[mine[j[inside]]]
    return calls.assign(step=step)


def _with_instances(calls: pd.DataFrame) -> pd.DataFrame:
    """Matched instances (module docstring) and each matched call's wait, transfer and lateness."""
    n = len(calls)
    if n == 0:
        return calls.assign(instance=np.int64(-1), wait_ns=np.nan, transfer_ns=np.nan, late_ns=np.nan, last=False)
    kind = calls["kind"].to_numpy(dtype=object)
    rank = calls["rank"].to_numpy(dtype=np.int64)
    start = calls["start_ns"].to_numpy(dtype=np.int64)
    end = start + calls["dur_ns"].to_numpy(dtype=np.int64)
    p2p = np.isin(kind, P2P_KINDS)
    comm = _group_ids(calls["communicator"].to_numpy(), calls["pg_ranks"].to_numpy())
    lo, hi = np.full(comm.max() + 1, rank.max()), np.full(comm.max() + 1, rank.min())
    np.minimum.at(lo, comm, rank)
    np.maximum.at(hi, comm, rank)
    comm_ranks = np.bincount(np.unique(np.stack([comm, rank]), axis=1)[0])  # traced ranks per communicator
    # A send pairs with its peer's recv: label both by the sending rank (of two; a send_recv kernel
    # has no direction). The size keys kinds whose buffer is one size on every rank.
    src = np.select([kind == "send", kind == "recv"], [rank, lo[comm] + hi[comm] - rank], -1)
    family = _group_ids(np.where(p2p, "p2p", kind), src)
    size = np.where(np.isin(kind, _PER_RANK_SIZE), -1.0, np.nan_to_num(calls["bytes"].to_numpy(dtype=float), nan=-1.0))
    group = _group_ids(comm, family, calls["step"].to_numpy(), size)
    # k: the call's place among its rank's calls of its group, in start order.
    order = np.lexsort((start, rank, group))
    g, r = group[order], rank[order]
    new = np.ones(n, dtype=bool)
    new[1:] = (g[1:] != g[:-1]) | (r[1:] != r[:-1])
    run_start = np.maximum.accumulate(np.where(new, np.arange(n), 0))
    k = np.empty(n, dtype=np.int64)
    k[order] = np.arange(n) - run_start
    inst = _group_ids(group, k)
    count = np.bincount(inst)
    first, last, min_end = (np.full(count.size, v, dtype=np.int64) for v in (start.max(), start.min(), end.max()))
    np.minimum.at(first, inst, start)
    np.maximum.at(last, inst, start)
    np.minimum.at(min_end, inst, end)
    # A p2p pair needs a group of two (recorded, else two traced ranks that make its calls).
    size_n = calls["group_size"].to_numpy()
    pair = np.where(size_n > 0, size_n == 2, comm_ranks[comm] == 2)
    ok = (count[inst] >= 2) & (~p2p | pair)
    ok &= ~np.isin(kind, _ALL_JOIN) | (min_end[inst] >= last[inst])
    wait = np.clip(last[inst] - start, 0, end - start)
    return calls.assign(
        instance=np.where(ok, inst, -1).astype(np.int64),
        wait_ns=np.where(ok, wait, np.nan),
        transfer_ns=np.where(ok, (end - start) - wait, np.nan),
        late_ns=np.where(ok, start - first[inst], np.nan),
        last=ok & (start == last[inst]),
    )


def _group_ids(*columns: np.ndarray) -> np.ndarray:
    """Per row, the id (0, 1, ...) of its distinct tuple of ``columns`` values."""
    codes = np.stack([pd.factorize(pd.Series(c), use_na_sentinel=False)[0] for c in columns])
    return np.unique(codes, axis=1, return_inverse=True)[1].reshape(-1)


def _per_rank(calls: pd.DataFrame) -> pd.DataFrame:
    """Per rank (index, every rank with calls): its matched calls' count, summed wait and transfer,
    median and mean lateness, times it started last, and the profiler steps they fall in."""
    ranks, pos = np.unique(calls["rank"].to_numpy(dtype=np.int64), return_inverse=True)
    matched = calls["instance"].to_numpy() >= 0
    p, late = pos[matched], calls["late_ns"].to_numpy(dtype=float)[matched]
    count = np.bincount(p, minlength=ranks.size)

    def total(x: np.ndarray) -> np.ndarray:
        return np.bincount(p, weights=x, minlength=ranks.size)

    with np.errstate(invalid="ignore"):
        mean = total(late) / count
    # Median per rank: sort by (rank, lateness) and take the middle of each rank's run.
    order = np.lexsort((late, p))
    lo_i = np.concatenate([[0], np.cumsum(count)[:-1]])
    mid_a, mid_b = lo_i + (count - 1) // 2, lo_i + count // 2
    sorted_late = late[order]
    has = count > 0
    median = np.full(ranks.size, np.nan)
    median[has] = (sorted_late[mid_a[has]] + sorted_late[mid_b[has]]) / 2
    step = calls["step"].to_numpy()[matched]
    in_step = step >= 0
    steps = np.bincount(np.unique(np.stack([p[in_step], step[in_step]]), axis=1)[0], minlength=ranks.size)
    return pd.DataFrame(
        {
            "instances_count": count,
            "wait_ns": total(calls["wait_ns"].to_numpy(dtype=float)[matched]),
            "transfer_ns": total(calls["transfer_ns"].to_numpy(dtype=float)[matched]),
            "late_median_ns": median,
            "late_mean_ns": mean,
            "last_count": total(calls["last"].to_numpy(dtype=float)[matched]).astype(np.int64),
            "steps": steps,
        },
        index=pd.Index(ranks, name="rank"),
    )


def _unmatched_note(calls: pd.DataFrame) -> str:
    ranks = calls["rank"].nunique()
    if ranks < 2:
        return (
            "one rank's trace: the wait for the late rank cannot be told from the transfer without the "
            "other ranks' traces of the same collectives"
        )
    return (
        "no collective was matched across the traced ranks (none of one communicator and kind overlaps on every rank)"
    )


def _nccl_algo(name: str) -> str:
    m = _ALGO_RE.search(name)
    return f"{m.group(1).upper()}_{m.group(2).upper()}" if m else ""


def _empty(cols: list[str]) -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype="float64") for c in cols})
