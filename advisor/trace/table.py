"""The event table: one schema for every trace source (Kineto JSON, Nsight Systems SQLite).

A trace is parsed once into a pandas DataFrame with these columns (times in integer nanoseconds on
the trace's own clock; one row per event):

| column      | dtype    | meaning                                                                      |
|-------------|----------|------------------------------------------------------------------------------|
| rank        | int32    | process rank (0 for a single-process trace)                                  |
| kind        | category | kernel, memcpy, memset, runtime, cpu_op, annotation, memory, sync, other     |
| name        | category | kernel / op / range name (demangled where the source has it)                 |
| start_ns    | int64    | start time                                                                   |
| dur_ns      | int64    | duration (0 for instant events such as memory events)                        |
| device      | int32    | GPU index; -1 for host events                                                |
| stream      | int64    | CUDA stream; -1 for host events                                              |
| tid         | int64    | host thread id; -1 for device events                                         |
| correlation | int64    | CUDA correlation id linking a runtime call to its kernel/copy; -1 if none    |
| bytes       | int64    | bytes copied or set (memcpy/memset), allocated (+) or freed (-) (memory)     |
| copy_kind   | category | memcpy direction: HtoD, DtoH, DtoD, HtoH, PtoP; '' otherwise                 |
| host_mem    | category | host side of a copy: pageable, pinned, managed; '' otherwise or unknown     |

Kinds: ``kernel`` GPU kernels; ``memcpy``/``memset`` GPU copies and sets; ``runtime`` CUDA runtime and
driver API calls (cudaLaunchKernel, cudaMemcpyAsync, cudaDeviceSynchronize...); ``cpu_op`` framework
ops (aten::mm); ``annotation`` user ranges (record_function, NVTX, ProfilerStep#N); ``memory``
allocation events; ``sync`` CUDA synchronization records (nsys' CUPTI_ACTIVITY_KIND_SYNCHRONIZATION,
Kineto's ``cuda_sync``: on the device and stream waited for, with the correlation id of the runtime call
that waited, no host thread); ``other`` everything else kept.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

KINDS = ("kernel", "memcpy", "memset", "runtime", "cpu_op", "annotation", "memory", "sync", "other")
COPY_KINDS = ("", "HtoD", "DtoH", "DtoD", "HtoH", "PtoP")
HOST_MEM = ("", "pageable", "pinned", "managed")
GPU_KINDS = ("kernel", "memcpy", "memset")  # what runs on a GPU stream
COLUMNS: dict[str, str] = {
    "rank": "int32",
    "kind": "category",
    "name": "category",
    "start_ns": "int64",
    "dur_ns": "int64",
    "device": "int32",
    "stream": "int64",
    "tid": "int64",
    "correlation": "int64",
    "bytes": "int64",
    "copy_kind": "category",
    "host_mem": "category",
}
_DEFAULTS = {"device": -1, "stream": -1, "tid": -1, "correlation": -1, "bytes": 0, "copy_kind": "", "host_mem": ""}


def make_table(columns: dict[str, object], n: int | None = None) -> pd.DataFrame:
    """An event table from column arrays; missing optional columns get their defaults, dtypes are
    fixed and kinds checked. ``n`` is the row count when every given column is a scalar."""
    lengths = {len(v) for v in columns.values() if hasattr(v, "__len__") and not isinstance(v, str)}
    rows = n if n is not None else (lengths.pop() if lengths else 0)
    data: dict[str, object] = {}
    for col, dtype in COLUMNS.items():
        value = columns.get(col, _DEFAULTS.get(col))
        if value is None:
            raise ValueError(f"event table needs column {col!r}")
        if np.isscalar(value):
            value = np.full(rows, value)
        if dtype == "category":
            categories = {"kind": KINDS, "copy_kind": COPY_KINDS, "host_mem": HOST_MEM}.get(col)
            series = pd.Categorical(value, categories=categories) if categories else pd.Categorical(value)
            data[col] = series
        else:
            data[col] = np.asarray(value, dtype=dtype)
    # No copy: the loaders hand over fresh arrays, and consolidating them into one block would copy
    # the whole table once more (1.2 s and the table's size again in memory at 5 M rows).
    df = pd.DataFrame(data, copy=False)
    if df["kind"].isna().any():
        bad = sorted(set(pd.Series(columns["kind"])[df["kind"].isna().to_numpy()].astype(str)))[:5]
        raise ValueError(f"unknown event kinds {bad}; allowed: {', '.join(KINDS)}")
    return df


def empty_table() -> pd.DataFrame:
    return make_table({"rank": [], "kind": [], "name": [], "start_ns": [], "dur_ns": []})


def concat_tables(tables: list[pd.DataFrame]) -> pd.DataFrame:
    """Stack tables (e.g. one per rank) keeping the schema's dtypes and categories."""
    if not tables:
        return empty_table()
    out = pd.concat(_shared_categories(tables), ignore_index=True)
    for col, dtype in COLUMNS.items():
        if dtype == "category" and out[col].dtype != "category":
            out[col] = out[col].astype("category")
    out["kind"] = out["kind"].cat.set_categories(KINDS)
    return out


def _shared_categories(tables: list[pd.DataFrame]) -> list[pd.DataFrame]:
    """The tables with each categorical column that differs between them recoded to one category
    list: the sorted values in use, which is what ``astype("category")`` makes of the object column
    that concat would build from them (with no per-row strings: a few milliseconds less per trace)."""
    for col, dtype in COLUMNS.items():
        columns = [t[col] for t in tables]
        if dtype != "category" or not all(isinstance(c.dtype, pd.CategoricalDtype) for c in columns):
            continue
        if all(c.dtype == columns[0].dtype for c in columns):
            continue  # concat keeps a shared dtype as it is
        codes = [c.array.codes for c in columns]
        used = {v for c, k in zip(columns, codes, strict=True) for v in c.cat.categories[np.unique(k[k >= 0])].tolist()}
        categories = pd.Index(sorted(used))
        tables = [t.assign(**{col: c.cat.set_categories(categories)}) for t, c in zip(tables, columns, strict=True)]
    return tables


def kind_mask(df: pd.DataFrame, *kinds: str, rows: np.ndarray | None = None) -> np.ndarray:
    """Boolean mask of the rows whose kind is one of ``kinds``; with ``rows`` (positions), of those
    rows only, in their order. It compares category codes: on the tables of real traces (10-50
    thousand rows) that is several times cheaper than ``isin``, whose fixed cost dominates there."""
    kind = df["kind"]
    if not isinstance(kind.dtype, pd.CategoricalDtype):
        return (kind if rows is None else kind.iloc[rows]).isin(kinds).to_numpy()
    categories, codes = kind.cat.categories, kind.array.codes
    if rows is not None:
        codes = codes[rows]
    mask = np.zeros(len(codes), dtype=bool)
    for k in kinds:
        if k in categories:
            mask |= codes == categories.get_loc(k)
    return mask


def _few_distinct(values: np.ndarray) -> bool:
    """Whether a 1-D integer array looks to hold few distinct values (under half of an even sample of
    65,536): there a hash table and a sort of the distinct values beat np.unique's sort of every row by
    10x (names' ids); where most values are distinct (correlation ids, nearly in order) the sort wins by
    2-5x."""
    if values.dtype.kind not in "iu" or values.size < 2:
        return False
    sample = values[:: max(1, values.size // 65536)]
    return np.unique(sample).size < sample.size / 2


def unique_inverse(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(values, return_inverse=True)`` of a 1-D array; for integers with few distinct values,
    by a hash table (pandas' factorize) and a sort of the distinct values only."""
    if not _few_distinct(values):
        return np.unique(values, return_inverse=True)
    codes, distinct = pd.factorize(values)
    order = np.argsort(distinct, kind="stable")
    rank = np.empty(order.size, dtype=np.intp)
    rank[order] = np.arange(order.size)
    return distinct[order], rank[codes]


def unique_first(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(values, return_index=True)`` of a 1-D array (each distinct value's first position);
    for integers with few distinct values, by a hash table as unique_inverse."""
    if not _few_distinct(values):
        return np.unique(values, return_index=True)
    codes, distinct = pd.factorize(values)  # codes count up in order of first appearance
    first = np.flatnonzero(codes > np.maximum.accumulate(np.r_[-1, codes[:-1]]))
    order = np.argsort(distinct, kind="stable")
    return distinct[order], first[order]


def grouped_lexsort(keys: tuple[np.ndarray, ...], n_minor: int = 1) -> np.ndarray:
    """``np.lexsort(keys)`` (the last key sorts first), cheaper where the keys after the first
    ``n_minor`` are group ids of small range (rank, device, stream): the rows are sorted by the minor
    keys (not at all where there is one and it is already in order, as a table's start times are),
    then by one 16-bit code of the groups with numpy's stable radix sort. Ties keep their positions'
    order, as lexsort's do."""
    minor, groups = keys[:n_minor], keys[n_minor:]
    n = keys[0].size
    code, span = np.zeros(n, dtype=np.int64), 1
    for k in groups[::-1]:  # the major key first
        if n == 0:
            break
        lo, width = int(k.min()), int(k.max()) - int(k.min()) + 1
        span *= width
        if span > 2**16:
            return np.lexsort(keys)
        code = code * width + (k - lo)
    if n_minor == 1 and (n < 2 or bool((minor[0][1:] >= minor[0][:-1]).all())):
        return np.argsort(code.astype(np.uint16), kind="stable")
    within = np.argsort(minor[0], kind="stable") if n_minor == 1 else np.lexsort(minor)
    return within[np.argsort(code[within].astype(np.uint16), kind="stable")]


def gpu_events(df: pd.DataFrame) -> pd.DataFrame:
    """Kernels, copies and sets: what runs on a GPU stream."""
    return df[kind_mask(df, *GPU_KINDS)]


class EventArgs:
    """The recorded arguments (Kineto's ``args``: shapes, types, literal inputs, FLOP counts, NCCL
    message sizes) of the events an analysis asked the loader to keep, by the event's row label in
    the table. Kept in ``table.attrs["event_args"]``: pandas deep-copies attrs on nearly every
    operation on a table, so this read-only holder hands itself out as its own copy."""

    def __init__(self, by_row: dict[int, dict] | None = None) -> None:
        self._by_row = by_row or {}

    def __deepcopy__(self, memo: dict) -> EventArgs:
        return self

    def __copy__(self) -> EventArgs:
        return self

    def __len__(self) -> int:
        return len(self._by_row)

    def get(self, row: int) -> dict:
        """The args of the event at row label ``row``; {} where none were kept."""
        return self._by_row.get(row, {})

    def items(self):
        return self._by_row.items()

    @staticmethod
    def of(table: pd.DataFrame) -> EventArgs | None:
        """The table's kept arguments; None where its loader kept none (an nsys export, a table made
        without them)."""
        return table.attrs.get("event_args")
