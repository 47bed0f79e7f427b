"""Collective communication per rank (calls, time, bytes, exposed time) and the pipeline bubble.

What the traces hold (our gloo runs under torch 2.13; the NCCL traces in ../shared/traces/kineto):

- CPU, gloo: each collective the backend runs is a ``gloo:<kind>`` range on one of the process
  group's worker threads (``gloo:send`` / ``gloo:recv`` on the calling thread). It spans the work from
  its start to its completion, so it includes waiting for the peers to join. The call that issued it
  is a ``c10d::*`` op on the training thread (``c10d::allreduce_``, ``c10d::_allgather_base_``,
  ``c10d::_reduce_scatter_base_``, ``c10d::send``, ``c10d::recv_``; under DTensor inside a
  ``_c10d_functional::*`` op). Gloo runs a reduce-scatter as an all-reduce of the whole input: its
  range is named ``gloo:all_reduce`` (FSDP2's and sequence parallelism's reduce-scatters), so the kind
  of a call comes from the op that issued it, not from the range's name.
- GPU, NCCL: each collective is an ``ncclKernel_*`` / ``ncclDevKernel_*`` kernel. Its kind comes from
  the ``c10d::*`` op around the runtime call that launched it (older NCCL names every kernel
  ``SendRecv``: in trace_filter they are all-reduces, all-gathers and all-to-alls), else from the
  kernel's name.
- Sizes: tensor shapes and NCCL message sizes are in the Kineto ``args`` the loader keeps for these
  events (``advisor.analysis.summary.load_trace``, ``advisor.trace.table.EventArgs``), read by
  :func:`collective_sizes`; ``bytes`` is NaN without them (an Nsight Systems export).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from advisor.errors import AdvisorError
from advisor.spec.specs import Setup
from advisor.trace.table import EventArgs, kind_mask, unique_first

KINDS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "send",
    "recv",
    "send_recv",
    "broadcast",
    "all_to_all",
    "barrier",
    "other",
)
P2P_KINDS = ("send", "recv", "send_recv")
"""Point-to-point kinds. ``send_recv`` is NCCL's p2p kernel seen without the op that launched it: it runs
sends, receives and all-to-alls alike, so the op (or the ``nccl:*`` range) around its launch, where the
trace has one, says which."""
# Name fragments (lower case, underscores removed) in the order they are tried: reduce-scatter before
# all-reduce, SendRecv (NCCL's kernel for send, recv and all-to-all alike) before send and recv.
_KIND_FRAGMENTS = (
    ("reducescatter", "reduce_scatter"),
    ("allreduce", "all_reduce"),
    ("allgather", "all_gather"),
    ("alltoall", "all_to_all"),
    ("broadcast", "broadcast"),
    ("barrier", "barrier"),
    ("sendrecv", "send_recv"),
    ("send", "send"),
    ("recv", "recv"),
)
_COMM_KERNEL = re.compile(r"^nccl|ncclkernel|nccldevkernel")  # analysis.COMM_RE, on lower-cased names
_NCCL_KERNEL_KEY = re.compile(r"nccl\w*kernel")  # a kernel's name, not a nccl:* range, in collective_kind's key
_ISSUE_PREFIXES = ("c10d::", "_c10d_functional::")
_NOT_ISSUE = ("wait_tensor", "_wrap_tensor_autograd")  # functional-collective helpers that send nothing
_COMM_OP_PREFIXES = (*_ISSUE_PREFIXES, "record_param_comms")
_STEP_RE = re.compile(r"^ProfilerStep#\d+$")
_BLOCK = 1 << 20  # rows per block where a pass over the table is made in blocks
# Element sizes of the dtype names traces use: record_shapes' "Input type" (C++ names) and NCCL
# kernels' "dtype" (c10 ScalarType names).
_ELEMENT_BYTES = {
    "float": 4,
    "double": 8,
    "c10::half": 2,
    "half": 2,
    "c10::bfloat16": 2,
    "bfloat16": 2,
    "long int": 8,
    "long": 8,
    "int": 4,
    "short int": 2,
    "short": 2,
    "signed char": 1,
    "char": 1,
    "unsigned char": 1,
    "byte": 1,
    "bool": 1,
    "c10::float8_e4m3fn": 1,
    "float8_e4m3fn": 1,
    "c10::float8_e5m2": 1,
    "float8_e5m2": 1,
}
_NOT_TENSOR = ("", "Scalar", "ScalarList", "GenericList", "None", "TensorList")


def collective_kind(name: str) -> str:
    """The kind (one of ``KINDS``) a c10d op, backend range or NCCL kernel name stands for. NCCL's
    point-to-point kernels (``SendRecv``, older ``Send`` / ``Recv``) are ``send_recv``: one kernel
    runs both directions."""
    key = name.split("(", 1)[0].lower().replace("_", "")
    kind = next((kind for fragment, kind in _KIND_FRAGMENTS if fragment in key), "other")
    return "send_recv" if kind in P2P_KINDS and _NCCL_KERNEL_KEY.match(key) else kind


def collective_calls(table: pd.DataFrame, sizes: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per collective call, rank by rank, each rank's in start order.

    Columns: ``rank``; ``kind`` (one of ``KINDS``); ``op``, the c10d op that issued it ('' where none
    is found); ``name`` of the collective's own event (NCCL kernel or gloo range); ``start_ns`` and
    ``dur_ns`` of that event; ``exposed_ns``, the part of it during which the rank computed nothing
    (see :func:`collective_table`); ``bytes`` (float, NaN without ``sizes``): the collective's full
    buffer, i.e. the all-reduced tensor, an all-gather's gathered output, a reduce-scatter's unreduced
    input, the tensor sent, received or broadcast, an all-to-all's larger side: the largest tensor or
    NCCL message the trace records for the call or the op that issued it, times its element size;
    ``launch_ns``: when the host issued it (the runtime call that launched an NCCL kernel, the c10d op
    of a gloo range; the event's own start where neither is found); the process group as the trace
    records it on the call's events (NCCL kernels' arguments in Kineto traces of torch 2.2 and later;
    '' and 0 where not recorded, and always without ``sizes``): ``pg_name``, ``pg_desc``,
    ``pg_ranks`` (the global ranks as recorded, e.g. '[0, 1]') and ``group_size``.

    ``kind`` comes from the op that issued the call, else the ``nccl:*`` range around its launch
    (Nsight Systems exports of PyTorch runs), else the event's own name.

    ``sizes``: :func:`collective_sizes` of the same table.
    """
    return _calls_and_busy(table, sizes)[0]


def collective_table(table: pd.DataFrame, sizes: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per rank and kind of collective (kinds that occur): ``calls``, ``time_ms``, ``bytes``, ``exposed_ms``.

    - ``time_ms``: summed duration of the collectives' own events: NCCL kernels on a GPU, ``gloo:*``
      ranges on the CPU (which run from the work's start to its completion, waiting for peers included).
    - ``bytes``: summed full buffers of the calls (see :func:`collective_calls`); NaN unless ``sizes``
      (:func:`collective_sizes`) is given.
    - ``exposed_ms``: the length of the union of the kind's calls during which the rank's compute was
      not running. GPU: compute = the rank's kernels that are not NCCL kernels (HTA's definition; copies
      and sets are not compute), on any stream. CPU: compute = the training thread (the thread of the
      ``ProfilerStep#`` ranges) inside an ``aten::`` op, minus the time it is inside a communication op
      (``c10d::*``, ``_c10d_functional::*`` such as ``wait_tensor``, ``record_param_comms``). The
      training thread's blocking waits leave no op of their own (DDP's wait for the last bucket at
      the end of backward, FSDP's wait for an all-gather or for the last reduce-scatter, a pipeline
      stage's wait for a recv): they are gaps between ops, or time inside a communication op, and so
      count as exposed. Kinds that run at the same time (a send and a recv posted together) each count
      the stretch they share.
    """
    return collective_calls_and_table(table, sizes)[1]


def collective_calls_and_table(
    table: pd.DataFrame, sizes: pd.DataFrame | None = None
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(:func:`collective_calls`, :func:`collective_table`) of ``table`` from one pass over it."""
    calls, busy = _calls_and_busy(table, sizes)
    if calls.empty:
        return calls, pd.DataFrame(columns=["rank", "kind", "calls", "time_ms", "bytes", "exposed_ms"])
    rows = []
    for (rank, kind), group in calls.groupby(["rank", "kind"], sort=True):
        starts = group["start_ns"].to_numpy()
        ends = starts + group["dur_ns"].to_numpy()
        us, ue = _merged(starts, ends)
        bs, be = busy[rank]
        exposed = int((ue - us).sum() - _covered(us, ue, bs, be).sum())
        nbytes = group["bytes"].sum() if group["bytes"].notna().all() else math.nan
        rows.append((rank, kind, len(group), group["dur_ns"].sum() / 1e6, nbytes, exposed / 1e6))
    out = pd.DataFrame(rows, columns=["rank", "kind", "calls", "time_ms", "bytes", "exposed_ms"])
    out["kind"] = pd.Categorical(out["kind"], categories=KINDS)
    return calls, out.sort_values(["rank", "kind"]).reset_index(drop=True).astype({"kind": "str"})


def wants_args(name: str) -> bool:
    """The events whose recorded arguments the collectives read (their tensors' or NCCL messages'
    sizes): NCCL kernels, ``gloo:*`` / ``nccl:*`` ranges and ``c10d::*`` / ``_c10d_functional::*`` ops."""
    return _COMM_KERNEL.search(name.lower()) is not None or name.startswith(("gloo:", "nccl:")) or _is_issue_op(name)


def collective_sizes(table: pd.DataFrame) -> pd.DataFrame | None:
    """Sizes of the communication events of a Kineto event table, from the arguments its loader kept
    (``advisor.analysis.summary.load_trace``): one row per NCCL kernel, ``gloo:*`` / ``nccl:*`` range
    and ``c10d::*`` / ``_c10d_functional::*`` op, with ``rank``, ``name``, ``start_ns``, ``numel`` (the
    largest tensor or NCCL message of the event, in elements; NaN where the trace records none, e.g.
    without record_shapes), ``elem_bytes`` (NaN where unknown) and the process group the event records
    (``pg_name``, ``pg_desc``, ``pg_ranks``, ``group_size``; '' and 0 where it records none). None for a
    table without kept arguments (an Nsight Systems export records no shapes)."""
    kept = EventArgs.of(table)
    if kept is None:
        return None
    # Judged once per distinct name (a categorical column), as a kernel and as any other event.
    names = table["name"].cat
    # A trailing False for code -1 (a missing name).
    as_kernel = np.array([*(_is_sized(str(n), "kernel") for n in names.categories), False], dtype=bool)
    as_other = np.array([*(_is_sized(str(n), "") for n in names.categories), False], dtype=bool)
    codes = names.codes.to_numpy()
    sized = np.where(kind_mask(table, "kernel"), as_kernel[codes], as_other[codes])
    rows = table[sized]
    args = [kept.get(i) for i in rows.index.tolist()]
    sizes = [_size_of(a) for a in args]
    groups = [_group_of(a) for a in args]
    return pd.DataFrame(
        {
            "rank": rows["rank"].to_numpy(dtype=np.int32),
            "name": pd.Series(rows["name"].astype(str).tolist(), dtype="str"),
            "start_ns": rows["start_ns"].to_numpy(dtype=np.int64),
            "numel": np.asarray([n for n, _ in sizes], dtype=np.float64),
            "elem_bytes": np.asarray([b for _, b in sizes], dtype=np.float64),
            "pg_name": pd.Series([g[0] for g in groups], dtype="str"),
            "pg_desc": pd.Series([g[1] for g in groups], dtype="str"),
            "pg_ranks": pd.Series([g[2] for g in groups], dtype="str"),
            "group_size": np.asarray([g[3] for g in groups], dtype=np.int64),
        }
    )


def pipeline_bubble(table: pd.DataFrame, setup: Setup) -> pd.DataFrame:
    """Per rank of a pipeline-parallel run (our trace: ``forward`` / ``backward`` ranges around each
    chunk the schedule runs, inside ``step`` ranges): the measured bubble next to the analytic one.

    For each step, a pipeline's makespan runs from the first chunk's start to the last chunk's end over
    the pipeline's stage ranks (one clock: ranks of one host, or clocks kept in sync). Per rank, means
    per step: ``compute_ms`` (union of its chunks), ``makespan_ms``, ``bubble_ms`` = makespan - compute
    (waits for the neighbour stages, and the transfers), ``step_ms`` (its ``step`` range). Fractions:
    ``bubble_frac`` = bubble / compute, Narayanan et al. 2021's bubble fraction (bubble over ideal
    compute time), which the schedule's ``analytic_bubble_frac`` (p-1)/m, interleaved (p-1)/(v*m),
    predicts for equal stages; ``bubble_of_step_frac`` = bubble / step; ``modelled_bubble_frac``: the
    bubble predicted from the measured stage times t_s per micro-batch (compute / m) for unequal stages,
    makespan = sum(t_s) + (m-1) * max(t_s) (the slowest stage sets the pace; NaN when interleaved).

    Raises AdvisorError for a setup without pipeline parallelism or a table without the ranges.
    """
    p = setup.parallel
    if p.pp < 2:
        raise AdvisorError(f"parallel.pp={p.pp}: the pipeline bubble needs a pipeline-parallel run (pp >= 2)")
    m, per_stage = setup.grad_accum, p.dp * p.tp
    cols = _Columns(table)
    spans: dict[int, list[tuple[int, int, int, int]]] = {}  # rank -> per step (first, last, compute, step)
    for rank in cols.ranks():
        steps = cols.host_ranges(rank, _is_step) or cols.host_ranges(rank, _is_profiler_step)
        chunks = cols.host_ranges(rank, _is_fwd_bwd)
        per_step = []
        for s0, s1 in steps:
            inside = [(a, b) for a, b in chunks if a >= s0 and b <= s1]
            if inside:
                cs, ce = (np.array(x, dtype=np.int64) for x in zip(*inside, strict=True))
                us, ue = _merged(cs, ce)
                per_step.append((int(cs.min()), int(ce.max()), int((ue - us).sum()), s1 - s0))
        if per_step:
            spans[int(rank)] = per_step
    if not spans:
        raise AdvisorError("the trace has no forward/backward ranges inside step ranges: not one of our PP runs")
    rows = []
    for rank, per_step in sorted(spans.items()):
        peers = [r for r in spans if r % per_stage == rank % per_stage]
        n_steps = min(len(spans[r]) for r in peers)
        makespan = [max(spans[r][k][1] for r in peers) - min(spans[r][k][0] for r in peers) for k in range(n_steps)]
        compute = [per_step[k][2] for k in range(n_steps)]
        step = [per_step[k][3] for k in range(n_steps)]
        rows.append((rank, rank // per_stage, n_steps, np.mean(compute), np.mean(makespan), np.mean(step)))
    out = pd.DataFrame(rows, columns=["rank", "stage", "steps", "compute_ns", "makespan_ns", "step_ns"])
    out["bubble_ns"] = out["makespan_ns"] - out["compute_ns"]
    for col in ("compute", "makespan", "bubble", "step"):
        out[f"{col}_ms"] = out.pop(f"{col}_ns") / 1e6
    out["bubble_frac"] = out["bubble_ms"] / out["compute_ms"]
    out["bubble_of_step_frac"] = out["bubble_ms"] / out["step_ms"]
    out["analytic_bubble_frac"] = (p.pp - 1) / (p.vpp * m)
    out["modelled_bubble_frac"] = math.nan
    if p.vpp == 1:
        pipeline = out["rank"] % per_stage
        for _, group in out.groupby(pipeline):
            t = group["compute_ms"] / m  # per micro-batch
            makespan = t.sum() + (m - 1) * t.max()
            out.loc[group.index, "modelled_bubble_frac"] = (makespan - m * t) / (m * t)
    cols_order = ["rank", "stage", "steps", "compute_ms", "makespan_ms", "bubble_ms", "step_ms"]
    return out[[*cols_order, "bubble_frac", "bubble_of_step_frac", "analytic_bubble_frac", "modelled_bubble_frac"]]


# -- internals ---------------------------------------------------------------------------------------


def _calls_and_busy(
    table: pd.DataFrame, sizes: pd.DataFrame | None
) -> tuple[pd.DataFrame, dict[int, tuple[np.ndarray, np.ndarray]]]:
    """(collective_calls' table, each rank's compute intervals)."""
    cols = _Columns(table)
    lookup = _size_lookup(sizes)
    busy = cols.busy_by_rank()
    frames = [_rank_calls(cols, rank, lookup, busy[rank]) for rank in busy]
    frames = [f for f in frames if len(f)]
    if not frames:
        return pd.DataFrame(
            {
                "rank": pd.Series(dtype="int32"),
                "kind": pd.Series(dtype="str"),
                "op": pd.Series(dtype="str"),
                "name": pd.Series(dtype="str"),
                "start_ns": pd.Series(dtype="int64"),
                "dur_ns": pd.Series(dtype="int64"),
                "exposed_ns": pd.Series(dtype="int64"),
                "bytes": pd.Series(dtype="float64"),
                "launch_ns": pd.Series(dtype="int64"),
                "pg_name": pd.Series(dtype="str"),
                "pg_desc": pd.Series(dtype="str"),
                "pg_ranks": pd.Series(dtype="str"),
                "group_size": pd.Series(dtype="int64"),
            }
        ), busy
    return pd.concat(frames, ignore_index=True), busy


def _is_comm_kernel(name: str) -> bool:
    return _COMM_KERNEL.search(name.lower()) is not None


def _is_aten(name: str) -> bool:
    return name.startswith("aten::")


def _is_comm_op(name: str) -> bool:
    return name.startswith(_COMM_OP_PREFIXES)


def _is_nccl_range(name: str) -> bool:
    return name.startswith("nccl:")


def _is_gloo_range(name: str) -> bool:
    return name.startswith("gloo:")


def _is_step(name: str) -> bool:
    return name == "step"


def _is_profiler_step(name: str) -> bool:
    return _STEP_RE.match(name) is not None


def _is_fwd_bwd(name: str) -> bool:
    return name in ("forward", "backward")


class _Columns:
    """The event table's columns as arrays, with each name test judged once per distinct name and its
    rows found in one pass over the names' codes, kept for the next caller (every rank asks again)."""

    def __init__(self, table: pd.DataFrame) -> None:
        self.rank = table["rank"].to_numpy()
        self.start = table["start_ns"].to_numpy()
        self.end = self.start + table["dur_ns"].to_numpy()
        self.tid = table["tid"].to_numpy()
        self.device = table["device"].to_numpy()
        self.corr = table["correlation"].to_numpy()
        names = table["name"]
        if not isinstance(names.dtype, pd.CategoricalDtype):
            names = names.astype("category")
        self.labels = [str(c) for c in names.cat.categories]
        self.codes = names.array.codes
        self.kernel = kind_mask(table, "kernel")
        self.runtime = kind_mask(table, "runtime")
        self.cpu_op = kind_mask(table, "cpu_op")
        self.host_annotation = kind_mask(table, "annotation") & (self.device == -1)
        self._named: dict[Callable[[str], bool], tuple[np.ndarray, np.ndarray]] = {}
        self._label_array: np.ndarray | None = None

    def per_name(self, test: Callable[[str], bool]) -> np.ndarray:
        """Per name code (the extra last slot serves code -1): whether ``test(name)`` holds."""
        return self._name_rows(test)[0]

    def rows(self, test: Callable[[str], bool], of: np.ndarray | None = None, rank: int | None = None) -> np.ndarray:
        """The rows (ascending) whose name passes ``test``, among those where the mask ``of`` holds and
        on ``rank``. The pass over every row's name code is made once per test (a module-level function,
        so that it is found again); the masks are read at the rows that passed only (at 3.7 GB, 47.0 M
        rows: nine full-length masks per call before)."""
        rows = self._name_rows(test)[1]
        if of is not None:
            rows = rows[of[rows]]
        if rank is not None:
            rows = rows[self.rank[rows] == rank]
        return rows

    def _name_rows(self, test: Callable[[str], bool]) -> tuple[np.ndarray, np.ndarray]:
        found = self._named.get(test)
        if found is None:
            per_name = np.array([bool(test(n)) for n in self.labels] + [False], dtype=bool)  # code -1: last
            found = self._named[test] = (per_name, np.flatnonzero(per_name[self.codes]))
        return found

    def name(self, row: int) -> str:
        code = self.codes[row]
        return self.labels[code] if code >= 0 else ""

    def names(self, rows: np.ndarray) -> list[str]:
        """The names of ``rows`` ('' for row -1 and for a row without a name)."""
        if self._label_array is None:
            self._label_array = np.array([*self.labels, ""], dtype=object)  # code -1: last
        codes = np.where(rows >= 0, self.codes[np.maximum(rows, 0)], -1)
        return self._label_array[codes].tolist()

    def ranks(self) -> list[int]:
        """The ranks that have events, ascending."""
        if self.rank.size == 0:
            return []
        low, high = int(self.rank.min()), int(self.rank.max())
        if high - low >= 2**20:  # numbers far apart: a sort instead of a count per number
            return np.unique(self.rank).tolist()
        seen = np.zeros(high - low + 1, dtype=bool)
        for a in range(0, self.rank.size, _BLOCK):  # counted a block at a time: no column-long temporaries
            seen |= np.bincount(self.rank[a : a + _BLOCK] - low, minlength=seen.size) > 0
        return (np.flatnonzero(seen) + low).tolist()

    def host_ranges(self, rank: int, test: Callable[[str], bool]) -> list[tuple[int, int]]:
        """(start, end) of the rank's host annotations whose name passes ``test``, by start."""
        rows = self.rows(test, self.host_annotation, rank)
        rows = rows[np.argsort(self.start[rows], kind="stable")]
        return list(zip(self.start[rows].tolist(), self.end[rows].tolist(), strict=True))

    def main_tid(self, rank: int) -> int:
        """The rank's training thread: that of its ProfilerStep#/step ranges, else its busiest thread."""
        for test in (_is_profiler_step, _is_step):
            rows = self.rows(test, self.host_annotation, rank)
            if rows.size:
                return int(self.tid[rows[0]])
        tids, counts = np.unique(self.tid[self.cpu_op & (self.rank == rank)], return_counts=True)
        return int(tids[np.argmax(counts)]) if tids.size else -1

    def busy_by_rank(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Per rank: the disjoint intervals in which it computes (see collective_table)."""
        comm_kernels = self.rows(_is_comm_kernel, self.kernel)
        comm_name = self.per_name(_is_comm_kernel)
        kernels = np.flatnonzero(self.kernel)
        aten, comm_op = self.rows(_is_aten, self.cpu_op), self.rows(_is_comm_op, self.cpu_op)
        out = {}
        for rank in self.ranks():
            if (self.rank[comm_kernels] == rank).any():
                rows = kernels[self.rank[kernels] == rank]
                rows = rows[~comm_name[self.codes[rows]]]
                out[rank] = _merged(self.start[rows], self.end[rows])
            else:
                tid = self.main_tid(rank)
                a = aten[(self.rank[aten] == rank) & (self.tid[aten] == tid)]
                c = comm_op[(self.rank[comm_op] == rank) & (self.tid[comm_op] == tid)]
                out[rank] = _minus(self.start[a], self.end[a], self.start[c], self.end[c])
        return out


def _rank_calls(cols: _Columns, rank: int, lookup: dict, busy: tuple[np.ndarray, np.ndarray]) -> pd.DataFrame:
    kernels = cols.rows(_is_comm_kernel, cols.kernel, rank)
    issue = cols.rows(_is_issue_op, cols.cpu_op, rank)
    if kernels.size:
        calls = kernels[np.argsort(cols.start[kernels], kind="stable")]
        # The nccl:* range around the launch records the tensor where the c10d op may not (trace_filter).
        ranges = cols.rows(_is_nccl_range, cols.host_annotation, rank)
        ops, extra, launch_t = _launching_ops(cols, rank, calls, issue, ranges)
    else:
        gloo = cols.rows(_is_gloo_range, cols.host_annotation, rank)
        calls = gloo[np.argsort(cols.start[gloo], kind="stable")]
        ops = _issuing_ops_fifo(cols, calls, _innermost(cols, issue))
        extra = np.full(calls.size, -1, dtype=np.int64)
        launch_t = np.where(ops >= 0, cols.start[np.maximum(ops, 0)], cols.start[calls]).astype(np.int64)
    if not calls.size:
        return pd.DataFrame()
    names, op_names, range_names = (cols.names(rows) for rows in (calls, ops, extra))
    kind_of: dict[str, str] = {}  # a few names, tens of thousands of calls
    kinds = [
        kind_of[k] if (k := o or r or n) in kind_of else kind_of.setdefault(k, collective_kind(k))
        for o, r, n in zip(op_names, range_names, names, strict=True)
    ]
    starts, ends = cols.start[calls], cols.end[calls]
    exposed = (ends - starts) - _covered(starts, ends, *busy)
    if lookup.sizes or lookup.groups:
        events = [
            [(cols.name(r), int(cols.start[r])) for r in rows if r >= 0]
            for rows in zip(calls.tolist(), ops.tolist(), extra.tolist(), strict=True)
        ]
        nbytes = [_call_bytes(lookup.sizes, ev, rank) for ev in events]
        groups = [_call_group(lookup.groups, ev, rank) for ev in events]
        pg_name, pg_desc, pg_ranks, group_size = zip(*groups, strict=True)
    else:  # no recorded sizes or groups (an nsys export): every call's are unknown
        nbytes = [math.nan] * calls.size
        pg_name = pg_desc = pg_ranks = [""] * calls.size
        group_size = [0] * calls.size
    return pd.DataFrame(
        {
            "rank": np.full(calls.size, rank, dtype=np.int32),
            "kind": kinds,
            "op": op_names,
            "name": names,
            "start_ns": starts.astype(np.int64),
            "dur_ns": (ends - starts).astype(np.int64),
            "exposed_ns": exposed.astype(np.int64),
            "bytes": np.asarray(nbytes, dtype=np.float64),
            "launch_ns": launch_t,
            "pg_name": list(pg_name),
            "pg_desc": list(pg_desc),
            "pg_ranks": list(pg_ranks),
            "group_size": np.asarray(group_size, dtype=np.int64),
        }
    )


def _is_issue_op(name: str) -> bool:
    return name.startswith(_ISSUE_PREFIXES) and not name.endswith(_NOT_ISSUE)


def _innermost(cols: _Columns, ops: np.ndarray) -> np.ndarray:
    """The ops (rows) that contain no other op of ``ops`` on their thread (a ``_c10d_functional`` op
    runs its ``c10d::`` op inside: only the inner one issues the work)."""
    if ops.size < 2:
        return ops
    ops = ops[np.lexsort((-cols.end[ops], cols.start[ops], cols.tid[ops]))]
    tid, start, end = cols.tid[ops], cols.start[ops], cols.end[ops]
    parent = np.zeros(ops.size, dtype=bool)
    parent[:-1] = (tid[1:] == tid[:-1]) & (start[1:] < end[:-1])
    return ops[~parent]


def _issuing_ops_fifo(cols: _Columns, calls: np.ndarray, ops: np.ndarray) -> np.ndarray:
    """For each gloo range (by start) the c10d op that issued it, or -1: the oldest op issued before
    the range started that is still unmatched and whose kind the range can run (gloo's work queue is
    first in, first out; a reduce-scatter runs as gloo:all_reduce)."""
    ops = ops[np.argsort(cols.start[ops], kind="stable")]
    op_kinds = [collective_kind(cols.name(o)) for o in ops.tolist()]
    out = np.full(calls.size, -1, dtype=np.int64)
    pending: list[int] = []  # positions in ops
    nxt = 0
    for i, call in enumerate(calls.tolist()):
        while nxt < ops.size and cols.start[ops[nxt]] <= cols.start[call]:
            pending.append(nxt)
            nxt += 1
        kind = collective_kind(cols.name(call))
        runs = {kind, "reduce_scatter"} if kind == "all_reduce" else {kind}
        hit = next((j for j, pos in enumerate(pending) if op_kinds[pos] in runs), None)
        if hit is not None:
            out[i] = ops[pending.pop(hit)]
    return out


def _launching_ops(
    cols: _Columns, rank: int, kernels: np.ndarray, ops: np.ndarray, ranges: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each NCCL kernel, the innermost c10d op and the innermost of ``ranges`` (nccl:* ranges)
    around the runtime call with the kernel's correlation id, on its thread (-1 where there is none),
    and the start of that call (the kernel's own start where none is found)."""
    ops_out = np.full(kernels.size, -1, dtype=np.int64)
    ranges_out = np.full(kernels.size, -1, dtype=np.int64)
    launch_t = cols.start[kernels].astype(np.int64)
    runtime = np.flatnonzero(cols.runtime & (cols.rank == rank) & (cols.corr >= 0))
    if not runtime.size:
        return ops_out, ranges_out, launch_t
    corr, first = unique_first(cols.corr[runtime])
    launch = runtime[first]
    pos = np.minimum(np.searchsorted(corr, cols.corr[kernels]), corr.size - 1)
    found = np.flatnonzero(corr[pos] == cols.corr[kernels])
    tid, t = cols.tid[launch[pos[found]]], cols.start[launch[pos[found]]]
    ops_out[found] = _around(cols, ops, tid, t)
    ranges_out[found] = _around(cols, ranges, tid, t)
    launch_t[found] = t
    return ops_out, ranges_out, launch_t


def _around(cols: _Columns, rows: np.ndarray, tid: np.ndarray, t: np.ndarray) -> np.ndarray:
    """For each (tid, t): the latest-starting row of ``rows`` on thread tid whose interval holds t (the
    innermost when they nest); -1 where none does."""
    out = np.full(t.size, -1, dtype=np.int64)
    for thread in np.unique(tid).tolist():
        mine = rows[cols.tid[rows] == thread]
        if not mine.size:
            continue
        mine = mine[np.argsort(cols.start[mine], kind="stable")]
        ends = cols.end[mine]
        asked = np.flatnonzero(tid == thread)
        last = np.searchsorted(cols.start[mine], t[asked], side="right") - 1  # the latest to start by t
        holds = (last >= 0) & (ends[np.maximum(last, 0)] > t[asked])
        out[asked[holds]] = mine[last[holds]]
        # Where that one ended by t, walk back to an earlier one still open (an outer range).
        walk = ~holds & (last > 0)
        for i, j in zip(asked[walk].tolist(), (last[walk] - 1).tolist(), strict=True):
            while j >= 0 and ends[j] <= t[i]:
                j -= 1
            if j >= 0:
                out[i] = mine[j]
    return out


@dataclass(frozen=True)
class _Lookup:
    """collective_sizes' rows by (rank, name, start_ns): sizes, and the process group where recorded."""

    sizes: dict[tuple[int, str, int], tuple[float, float]]
    groups: dict[tuple[int, str, int], tuple[str, str, str, int]]


def _size_lookup(sizes: pd.DataFrame | None) -> _Lookup:
    if sizes is None or sizes.empty:
        return _Lookup({}, {})
    keys = list(zip(sizes["rank"].tolist(), sizes["name"].tolist(), sizes["start_ns"].tolist(), strict=True))
    values = zip(sizes["numel"].tolist(), sizes["elem_bytes"].tolist(), strict=True)
    groups = {}
    if "pg_name" in sizes:  # a sizes table of an older caller may lack the group columns
        pg = zip(sizes["pg_name"], sizes["pg_desc"], sizes["pg_ranks"], sizes["group_size"].tolist(), strict=True)
        groups = {k: g for k, g in zip(keys, pg, strict=True) if g[0] or g[2] or g[3]}
    return _Lookup(dict(zip(keys, values, strict=True)), groups)


def _call_group(groups: dict, events: list[tuple[str, int]], rank: int) -> tuple[str, str, str, int]:
    """(process group name, description, ranks as recorded, group size; 0 unknown) of a call: the first of
    its events (its own, the op that issued it, the range around the launch) that records one."""
    return next((groups[k] for name, start in events if (k := (rank, name, start)) in groups), ("", "", "", 0))


def _call_bytes(lookup: dict, events: list[tuple[str, int]], rank: int) -> float:
    """A call's full buffer in bytes: the largest tensor the events of the call (its own event, the op
    that issued it, the range around the launch) record, times the first element size found."""
    if not lookup:
        return math.nan
    found = [lookup[(rank, name, start)] for name, start in events if (rank, name, start) in lookup]
    numel = [n for n, _ in found if not math.isnan(n)]
    elem = [b for _, b in found if not math.isnan(b)]
    return max(numel) * elem[0] if numel and elem else math.nan


def _is_sized(name: str, cat: str) -> bool:
    if cat == "kernel":
        return _COMM_KERNEL.search(name.lower()) is not None
    return name.startswith(("gloo:", "nccl:")) or _is_issue_op(name)


def _size_of(args: dict) -> tuple[float, float]:
    """(elements of the event's largest tensor or message, element bytes), NaN where unknown."""
    if "In msg nelems" in args or "Out msg nelems" in args:
        n = max(float(args.get("In msg nelems") or 0), float(args.get("Out msg nelems") or 0))
        return n, float(_ELEMENT_BYTES.get(str(args.get("dtype", "")).lower(), math.nan))
    dims, types = args.get("Input Dims"), args.get("Input type")
    if not isinstance(dims, list) or not isinstance(types, list):
        return math.nan, math.nan
    numel, elem = math.nan, math.nan
    for d, t in zip(dims, types, strict=False):
        t = str(t)
        if t == "TensorList" and isinstance(d, list) and all(_is_shape(s) for s in d):
            n = float(sum(math.prod(s) for s in d)) if d else math.nan
        elif t not in _NOT_TENSOR and _is_shape(d):
            n = float(math.prod(d))
            if math.isnan(elem):
                elem = float(_ELEMENT_BYTES.get(t.lower(), math.nan))
        else:
            continue
        if not math.isnan(n):
            numel = n if math.isnan(numel) else max(numel, n)
    return numel, elem


def _group_of(args: dict) -> tuple[str, str, str, int]:
    """(process group name, description, ranks as recorded e.g. '[0, 1]', group size; 0 unknown) from
    the NCCL arguments Kineto records on a collective's kernel and its record_param_comms op."""
    try:
        size = int(args.get("Group size") or 0)
    except (TypeError, ValueError):
        size = 0
    ranks = args.get("Process Group Ranks", "")
    ranks = str(list(ranks)) if isinstance(ranks, list) else str(ranks or "")
    return (
        str(args.get("Process Group Name", "") or ""),
        str(args.get("Process Group Description", "") or ""),
        ranks,
        size,
    )


def _is_shape(d: object) -> bool:
    return isinstance(d, list) and all(isinstance(x, int) for x in d)


def _merged(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of intervals [start, end) as disjoint intervals sorted by start."""
    if starts.size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    order = np.argsort(starts, kind="stable")
    s, e = starts[order].astype(np.int64), ends[order].astype(np.int64)
    reach = np.maximum.accumulate(e)
    new = np.ones(s.size, dtype=bool)
    new[1:] = s[1:] > reach[:-1]
    first = np.flatnonzero(new)
    return s[first], np.maximum.reduceat(e, first)


def _minus(a_s: np.ndarray, a_e: np.ndarray, b_s: np.ndarray, b_e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint sorted intervals covering the union of A and none of B."""
    t = np.concatenate([a_s, a_e, b_s, b_e]).astype(np.int64)
    na, nb = a_s.size, b_s.size
    da = np.concatenate([np.ones(na), -np.ones(na), np.zeros(2 * nb)]).astype(np.int64)
    db = np.concatenate([np.zeros(2 * na), np.ones(nb), -np.ones(nb)]).astype(np.int64)
    if t.size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    order = np.argsort(t, kind="stable")
    t = t[order]
    on = (np.cumsum(da[order]) > 0) & (np.cumsum(db[order]) == 0)  # the state after each point
    seg_s, seg_e = t[:-1][on[:-1]], t[1:][on[:-1]]
    keep = seg_e > seg_s
    return _merged(seg_s[keep], seg_e[keep])


def _covered(starts: np.ndarray, ends: np.ndarray, bs: np.ndarray, be: np.ndarray) -> np.ndarray:
    """Per interval [start, end): how much of it the disjoint sorted intervals (bs, be) cover."""
    if bs.size == 0:
        return np.zeros(starts.size, dtype=np.int64)
    prefix = np.concatenate([[0], np.cumsum(be - bs)])

    def below(t: np.ndarray) -> np.ndarray:  # covered length of (-inf, t)
        i = np.searchsorted(bs, t, side="left")  # intervals that start before t
        last = np.maximum(i - 1, 0)
        return prefix[last] + np.where(i > 0, np.minimum(t, be[last]) - bs[last], 0)

    return below(np.asarray(ends, dtype=np.int64)) - below(np.asarray(starts, dtype=np.int64))
