"""Load an Nsight Systems SQLite export (``nsys export --type sqlite``) into the event table.

Reads, where the export has them (exports omit empty tables): CUDA kernels, memcpys and memsets,
CUDA runtime/driver API calls, NVTX ranges and CUDA synchronization records. Only the columns the
event table needs are selected, and only those the table has (the schema gains columns across nsys
versions: greenContextId, graphId, cluster*...) into numpy arrays, and names stay integer codes into
one category list, so memory grows with the compact columns only. Three readers give the same table,
fastest first: the C page reader (advisor.trace.pages: the file's B-tree pages parsed with no SQL
engine, where a C compiler built it), connectorx (Rust, over SQLite), and sqlite3's rows in blocks.

Conventions of the export that the loader relies on (checked on exports of nsys 2024.5 and 2026.2):

- times are integer nanoseconds on the capture's clock; names are ids into ``StringIds``;
- ``globalPid``/``globalTid`` are serialized GlobalIds: bits 24-47 hold the OS pid and bits 0-23 the
  OS tid (they agree with the ``PROCESSES`` table), higher bits the host/VM;
- ``srcKind``/``dstKind``/``memKind`` use nsys' own ENUM_CUDA_MEM_KIND (0 = pageable), not CUPTI's
  CUpti_ActivityMemoryKind (0 = unknown, 1 = pageable): an HtoD copy reads srcKind 0, dstKind 2,
  "Pageable -> Device" in nsys' table. ``copyKind`` uses CUPTI's CUpti_ActivityMemcpyKind values.

Ranks: the processes that own events are numbered 0..n-1 in order of pid (for one-process-per-GPU
jobs launched on one node, this is the local rank order).
"""

from __future__ import annotations

import re
import sqlite3
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd

from advisor.errors import AdvisorError, TraceError
from advisor.trace import pages
from advisor.trace.table import COLUMNS, COPY_KINDS, HOST_MEM, make_table, unique_first, unique_inverse

try:  # an optional speed-up: reads a table's columns in Rust, 4-6x faster than sqlite3's row tuples
    import connectorx as _cx

    # Its pandas path builds frames with an internal pandas 3 deprecates; said once per read, on the
    # reading threads (warnings.catch_warnings is not thread-safe), so filtered here for that module only.
    warnings.filterwarnings("ignore", message="make_block is deprecated", module="connectorx")
except ImportError:  # the same rows through the standard library, slower
    _cx = None

USE_PAGES = True
"""Read tables through the C page reader (advisor.trace.pages) where it applies; tests turn it off to
check the SQLite readers give the same table."""
DEFAULT_MAX_BYTES = 2 * 2**30
FETCH_ROWS = 200_000  # rows per fetch: ~ a few tens of MiB of Python tuples at most
_SQLITE_MAGIC = b"SQLite format 3\x00"
_ACTIVITY_TABLES = (
    "CUPTI_ACTIVITY_KIND_KERNEL",
    "CUPTI_ACTIVITY_KIND_MEMCPY",
    "CUPTI_ACTIVITY_KIND_MEMSET",
    "CUPTI_ACTIVITY_KIND_RUNTIME",
    "NVTX_EVENTS",
)
_SYNC_TABLE = "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION"
_KINDS = ("kernel", "memcpy", "memset", "runtime", "annotation", "sync")  # the event-table kinds read here
# ENUM_NSYS_EVENT_TYPE: NvtxPushPopRange, NvtxStartEndRange and their NVTX-tools (Nvtxt) twins; the
# other NVTX types (marks, domain/category/thread naming) are instants or metadata.
_NVTX_RANGE_TYPES = (59, 60, 70, 71)
# Fallbacks for exports without the ENUM_* tables; values as in the ENUM tables of the exports
# (ENUM_CUDA_MEMCPY_OPER equals CUPTI's CUpti_ActivityMemcpyKind).
_MEMCPY_OPER = {
    0: "UNKNOWN",
    1: "HTOD",
    2: "DTOH",
    3: "HTOA",
    4: "ATOH",
    5: "ATOA",
    6: "ATOD",
    7: "DTOA",
    8: "DTOD",
    9: "HTOH",
    10: "PTOP",
    11: "UVM_HTOD",
    12: "UVM_DTOH",
    13: "UVM_DTOD",
}
_MEM_KIND = {
    0: "Pageable",
    1: "Pinned",
    2: "Device",
    3: "Array",
    4: "Managed",
    5: "Device Static",
    6: "Managed Static",
    7: "Unknown",
}
_SYNC_INVALID = 0xFFFFFFFF  # CUPTI_SYNCHRONIZATION_INVALID_VALUE, as the export stores it
_SYNC_TYPE = {0: "Unknown", 1: "Event sync", 2: "Stream wait sync", 3: "Stream sync", 4: "Context sync"}
# A CUDA array lives in device memory, so array copies count as device-side; unified-memory
# migrations keep their direction.
_COPY_KIND = {
    "HTOD": "HtoD",
    "DTOH": "DtoH",
    "HTOA": "HtoD",
    "ATOH": "DtoH",
    "ATOA": "DtoD",
    "ATOD": "DtoD",
    "DTOA": "DtoD",
    "DTOD": "DtoD",
    "HTOH": "HtoH",
    "PTOP": "PtoP",
}
_HOST_MEM = {"pageable": "pageable", "pinned": "pinned", "managed": "managed", "managed static": "managed"}
_API_VERSION = re.compile(r"_v\d+$")  # cudaLaunchKernel_v7000 -> cudaLaunchKernel, as Kineto names it
_PID_MASK = 0xFFFFFF
# torch.autograd.profiler.emit_nvtx (and nsys --pytorch=autograd-nvtx) writes each op's range as
# "name[, seq = N], op_id = N[, sizes = [...]][, input_op_ids = [...]]" (getNvtxStr in
# torch/csrc/profiler/util.cpp). No two ops share an op id, so a long capture holds as many distinct
# texts as ranges (28 M in a 3.7 GB export). The rule, in SQL for SQLite to apply to every row before
# Python sees it, and as NVTX_OP_RE for a whole text: a text holding ", op_id = " and a digit is an op's
# range, named by what comes before its ", seq = " (where that comes first) or its ", op_id = ".
# SQLite cuts such a text just after that ", seq = " or ", op_id = " (OP_ENDS: no emit_nvtx text ends
# so, digits follow), so that the coding of each distinct name knows the range was an op. It hands
# the texts over as BLOBs (UTF-8 bytes, positions in bytes): a third cheaper to cut and to pass than
# text, and typed even where the first row has none ('' for none: an expression has no declared type,
# and connectorx cannot type a column whose first value is NULL).
NVTX_OP_RE = re.compile(r"^(.*?)(?:, seq = .*?)?, op_id = \d", re.DOTALL)
OP_ENDS = (", op_id = ", ", seq = ")
_BYTES = 'CAST("text" AS BLOB)'
_OP_AT, _SEQ_AT = (f"instr({_BYTES}, X'{mark.encode().hex()}')" for mark in OP_ENDS)
_NVTX_TEXT_SQL = (
    f"COALESCE(CASE WHEN \"text\" GLOB '*{OP_ENDS[0]}[0-9]*' THEN substr({_BYTES}, 1, CASE WHEN {_SEQ_AT} "
    f"BETWEEN 1 AND {_OP_AT} THEN {_SEQ_AT} + {len(OP_ENDS[1]) - 1} ELSE {_OP_AT} + {len(OP_ENDS[0]) - 1} END) "
    f"ELSE {_BYTES} END, X'')"
)
_TEXT_SQL = {("NVTX_EVENTS", "text"): _NVTX_TEXT_SQL}
"""Text columns that _query reads through an SQL expression instead of as they are stored."""
# Times within +-2**62 ns (146 years): a start plus a duration stays inside int64, and an export's
# clock (ns since the session or the epoch) is far inside it.
MAX_TIME_NS = 2**62


def load_nsys_sqlite(
    path: str | Path, *, max_bytes: int = DEFAULT_MAX_BYTES, check: Callable[[], None] | None = None
) -> pd.DataFrame:
    """The event table of one nsys SQLite export, rows in start-time order.

    ``df.attrs`` holds ``source`` ('nsys'), ``file`` (its name), ``nsys_version`` and
    ``schema_version`` (None when the export has no metadata table), ``gpu_names`` ({device id:
    name}, from TARGET_INFO_GPU), ``ranks``, ``pid_map`` ({rank: OS pid}) and ``process_names``
    ({rank: name}, from PROCESSES) and ``nvtx_ops`` (the names of the NVTX ranges that
    ``emit_nvtx`` wrote for framework ops: such a range is named by its op alone, "aten::mm" for
    "aten::mm, seq = 3, op_id = 17, sizes = [...]"). Raises TraceError for a file over ``max_bytes``,
    one that is not SQLite, an SQLite file that is not an nsys export, a truncated or damaged database,
    and an export without CUDA or NVTX activity, and one whose values have the wrong type (text where an
    id belongs) or lie out of range. ``check()`` runs before each table is read and stops the load by raising.
    """
    path = Path(path)
    # The file's pages as the page cache holds them before any read: the page reader hands back those
    # it brings in as it reads them, _load the rest once the tables are read, and close() what the
    # metadata's reads brought in (pages.CachedBefore).
    cached = pages.CachedBefore(path) if USE_PAGES else None
    try:
        _check_file(path, max_bytes)
        with closing(sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True, factory=_Connection)) as conn:
            conn.path = path.absolute()
            conn.check = check
            conn.cached = cached
            return _load(conn, path.name)
    except sqlite3.DatabaseError as err:
        raise TraceError(f"{path.name} is a damaged SQLite database ({err}); expected an intact nsys export") from None
    except AdvisorError:  # its own messages, and a caller's check() stopping the load
        raise
    except (TypeError, ValueError, OverflowError) as err:  # a value of a type no export writes
        raise TraceError(f"{path.name}: a value of an unexpected type in the export ({err})") from None
    finally:
        if cached is not None:
            cached.close()


def _check_file(path: Path, max_bytes: int) -> None:
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            header = f.read(100)
    except IsADirectoryError:
        raise TraceError(f"{path.name} is a folder; expected an nsys .sqlite export file") from None
    except FileNotFoundError:
        raise TraceError(f"no trace file {path.name}") from None
    except OSError as err:
        raise TraceError(f"{path.name} cannot be read ({err.strerror})") from None
    if size > max_bytes:
        raise TraceError(
            f"{path.name} is {size / 2**20:.1f} MiB ({size} bytes), over the {max_bytes / 2**20:.1f} MiB limit "
            f"({max_bytes} bytes); raise max_bytes or export a shorter time range (nsys export --times)"
        )
    if not header.startswith(_SQLITE_MAGIC):
        raise TraceError(
            f"{path.name} is not an SQLite database (it starts with {header[:16]!r}); expected the "
            "output of nsys export --type sqlite"
        )
    # The header's page count is valid when the change counter (24) equals version-valid-for (92)
    # (https://www.sqlite.org/fileformat.html#in_header_database_size); a cut file is shorter.
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    pages = int.from_bytes(header[28:32], "big")
    if len(header) == 100 and pages and header[24:28] == header[92:96] and size < page_size * pages:
        raise TraceError(
            f"{path.name} is truncated: its header counts {pages} pages of {page_size} bytes "
            f"({page_size * pages} bytes) but the file has {size} bytes; copy or export it again"
        )


def _load(conn: sqlite3.Connection, file: str) -> pd.DataFrame:
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if "StringIds" not in tables and not any(t.startswith(("CUPTI_", "NVTX_")) for t in tables):
        listed = ", ".join(sorted(tables)[:8]) or "none"
        raise TraceError(
            f"{file} is an SQLite database but not an Nsight Systems export: it has no StringIds, CUPTI_* "
            f"or NVTX_* tables (tables: {listed}); expected the output of nsys export --type sqlite"
        )
    present = [t for t in _ACTIVITY_TABLES if t in tables]
    if not present:
        raise TraceError(
            f"{file} holds no CUDA or NVTX activity: it has none of the tables {', '.join(_ACTIVITY_TABLES)} "
            f"(its tables: {', '.join(sorted(tables))}); profile with nsys profile -t cuda,nvtx"
        )
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="nsys-read") as pool:
        _prefetch(conn, file, tables, pool)
        try:
            parts = _parts(conn, file, tables)
        finally:
            for pending in (conn.prefetched or {}).values():
                pending.cancel()
            conn.prefetched = None
    if conn.cached is not None:  # the pool has waited for every read: the rest of what they brought in
        conn.cached.drop()  # before the table is built, whose arrays may take these pages
    return _table(conn, file, tables, present, parts)


def _parts(conn: sqlite3.Connection, file: str, tables: set[str]) -> tuple[list[dict], _Names]:
    """The columns of each table read, in one order, and the one list of names they code into."""
    strings = _string_ids(conn) if "StringIds" in tables else {}
    names = _Names()
    readers = {
        "CUPTI_ACTIVITY_KIND_KERNEL": lambda: _kernels(conn, file, strings, names),
        "CUPTI_ACTIVITY_KIND_MEMCPY": lambda: _memcpys(conn, file, tables, names),
        "CUPTI_ACTIVITY_KIND_MEMSET": lambda: _memsets(conn, file, tables, names),
        "CUPTI_ACTIVITY_KIND_RUNTIME": lambda: _runtime(conn, file, strings, names),
        "NVTX_EVENTS": lambda: _nvtx(conn, file, strings, names),
        _SYNC_TABLE: lambda: _syncs(conn, file, tables, names),
    }
    parts = []
    for table, read in readers.items():
        if table in tables:
            if getattr(conn, "check", None) is not None:
                conn.check()
            parts.append(_check_times(read(), file, table))
    return parts, names


def _table(conn: sqlite3.Connection, file: str, tables: set[str], present: list[str], read) -> pd.DataFrame:
    parts, names = read
    values = names.values
    sizes = [p["start_ns"].size for p in parts]
    if not any(n and (p["kind"] != _KINDS.index("sync")).any() for p, n in zip(parts, sizes, strict=True)):
        raise TraceError(  # sync records alone show no work
            f"{file} holds no CUDA or NVTX events: its tables {', '.join(present)} are empty; "
            "profile with nsys profile -t cuda,nvtx over a range where the GPU works"
        )
    start = np.concatenate([p.pop("start_ns") for p in parts])
    order = np.argsort(start, kind="stable")
    distinct = np.unique(np.concatenate([np.unique(p["process"]) for p in parts]))
    by_pid = np.lexsort((distinct, distinct & _PID_MASK))  # order of pid; host/VM bits break ties
    keys = distinct[by_pid]
    rank_of = np.empty(distinct.size, dtype=np.int32)
    rank_of[by_pid] = np.arange(distinct.size)
    for p in parts:
        p["rank"] = rank_of[np.searchsorted(distinct, p.pop("process"))]
    # Each column written once, in the event table's dtype, every part's rows straight to their place in
    # start order (a constant fills its rows): no concatenated copy, no arrays of constants, no int64
    # column narrowed after (at 3.7 GB a column of int64 is 376 MB).
    index = np.int32 if start.size < 2**31 else np.intp
    place = np.empty(start.size, dtype=index)
    place[order] = np.arange(start.size, dtype=index)
    bounds = np.cumsum([0, *sizes])
    cols = {"start_ns": start[order]}
    del start, order
    dtypes = {k: v for k, v in COLUMNS.items() if v != "category"} | {"name": _code_dtype(len(values))}
    for k in list(parts[0]):
        column = np.empty(place.size, dtype=dtypes.get(k) or np.result_type(*(p[k] for p in parts)))
        for p, a, b in zip(parts, bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
            column[place[a:b]] = p.pop(k)
        cols[k] = column
    rank = cols.pop("rank")
    table = make_table(
        {
            "rank": rank,
            "kind": pd.Categorical.from_codes(cols.pop("kind"), categories=_KINDS),
            "copy_kind": pd.Categorical.from_codes(cols.pop("copy_kind"), categories=COPY_KINDS),
            "host_mem": pd.Categorical.from_codes(cols.pop("host_mem"), categories=HOST_MEM),
            "name": pd.Categorical.from_codes(cols.pop("name"), categories=pd.Index(values, dtype=object)),
            **cols,
        }
    )
    table.attrs.update(_attrs(conn, tables, file, keys))
    table.attrs["nvtx_ops"] = sorted(values[c] for c in names.ops)
    return table


def _code_dtype(categories: int) -> type:
    """The integer type pandas keeps a categorical's codes in for this many categories (its
    coerce_indexer_dtype), so that Categorical.from_codes takes the codes without a copy."""
    for t in (np.int8, np.int16, np.int32):
        if categories < np.iinfo(t).max:
            return t
    return np.int64


def _attrs(conn: sqlite3.Connection, tables: set[str], file: str, keys: np.ndarray) -> dict:
    meta: dict[str, str] = {}
    for t in ("META_DATA_EXPORT", "EXPORT_META_DATA"):  # renamed after nsys 2023.2
        if t in tables and {"name", "value"} <= _columns(conn, t):
            meta = {str(k): v for k, v in conn.execute(f'SELECT name, value FROM "{t}"')}
            break
    gpu_names: dict[int, str] = {}
    if "TARGET_INFO_GPU" in tables and {"id", "name"} <= _columns(conn, "TARGET_INFO_GPU"):
        rows = conn.execute("SELECT id, name FROM TARGET_INFO_GPU ORDER BY id")
        gpu_names = {_id(i, file, "TARGET_INFO_GPU", "id"): _text(n) for i, n in rows}
    pids = [int(k) & _PID_MASK if k >= 0 else -1 for k in keys]
    process_names: dict[int, str] = {}
    if "PROCESSES" in tables and {"globalPid", "name"} <= _columns(conn, "PROCESSES"):
        rows = conn.execute("SELECT globalPid, name FROM PROCESSES")
        by_key = {_id(g, file, "PROCESSES", "globalPid") >> 24: n for g, n in rows if g is not None}
        process_names = {r: _text(by_key[int(k)]) for r, k in enumerate(keys) if int(k) in by_key}
    return {
        "source": "nsys",
        "file": file,
        "nsys_version": meta.get("EXPORT_PRODUCT_VERSION"),
        "schema_version": meta.get("EXPORT_SCHEMA_VERSION"),
        "gpu_names": gpu_names,
        "ranks": list(range(len(keys))),
        "pid_map": dict(enumerate(pids)),
        "process_names": process_names,
    }


class _Connection(sqlite3.Connection):
    """A connection that knows its file, for the columnar reader (connectorx opens the file itself)."""

    path: Path | None = None
    prefetched: dict | None = None
    check: Callable[[], None] | None = None
    cached: pages.CachedBefore | None = None


class _Names:
    """One list of distinct names; events hold integer codes into it. ``ops``: the codes of names that
    emit_nvtx ranges carried (framework ops), from ``range_code``."""

    def __init__(self) -> None:
        self.values: list[str] = []
        self._index: dict[str, int] = {}
        self.ops: set[int] = set()

    def range_code(self, text: str) -> int:
        """The code of an NVTX range's name: an emit_nvtx text (cut by SQLite after OP_ENDS, or whole)
        coded as its op name, and counted among ``ops``."""
        end = next((e for e in OP_ENDS if text.endswith(e)), None)
        if end is not None:
            op = text[: -len(end)]
        else:
            m = NVTX_OP_RE.match(text)
            op = m.group(1) if m else None
        if op is None:
            return self.code(text)
        c = self.code(op)
        self.ops.add(c)
        return c

    def code(self, name: str) -> int:
        c = self._index.get(name)
        if c is None:
            c = self._index[name] = len(self.values)
            self.values.append(name)
        return c

    def codes(
        self, keys: np.ndarray, name_of: Callable[..., str], code: Callable[[str], int] | None = None
    ) -> np.ndarray:
        """Codes (``code``, else ``self.code``) of ``name_of(key)`` for each key (rows of a 2-D array are
        keys), computed once per distinct key."""
        code = code or self.code
        if keys.shape[0] == 0:
            return np.empty(0, dtype=np.int64)
        columns = [unique_inverse(col) for col in keys.T] if keys.ndim == 2 else []
        if columns and np.prod([float(v.size) for v, _ in columns]) < 2.0**62:
            # Rows as one int64 each (mixed radix over each column's distinct values, which keeps
            # np.unique(axis=0)'s lexicographic order): a 1-D unique is several times faster than its sort
            # of rows.
            flat = np.zeros(keys.shape[0], dtype=np.int64)
            for values, inv in columns:
                flat = flat * values.size + inv.reshape(-1)
            _, first = unique_first(flat)
            _, inverse = unique_inverse(flat)
            distinct = keys[first]
        elif columns:
            distinct, inverse = np.unique(keys, axis=0, return_inverse=True)
        else:
            distinct, inverse = unique_inverse(keys)
        lookup = np.array(
            [code(name_of(*k) if keys.ndim == 2 else name_of(k)) for k in distinct.tolist()], dtype=np.int64
        )
        return lookup[inverse.reshape(-1)]


def _columns(conn: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in conn.execute(f'PRAGMA table_info("{table}")')}


def _string_ids(conn: sqlite3.Connection) -> dict[int, str]:
    strings = dict(conn.execute("SELECT id, value FROM StringIds"))
    # Values that are not text (a BLOB, a number) are rare: SQLite finds them, Python fixes those alone.
    strings.update(
        (i, _text(v)) for i, v in conn.execute("SELECT id, value FROM StringIds WHERE typeof(value) != 'text'")
    )
    return strings


def _text(value: object) -> str:
    """A name as text: a BLOB (a string stored as bytes) decoded, invalid UTF-8 shown as U+FFFD."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _id(value: object, file: str, table: str, column: str) -> int:
    """An integer id read from ``table.column``; TraceError naming them where it is not one."""
    if isinstance(value, int):
        return value
    raise TraceError(
        f"{file}: table {table} holds {str(value)[:40]!r} ({type(value).__name__}) in its integer column "
        f"{column}; expected an nsys export's integers"
    )


def _enum(conn: sqlite3.Connection, tables: set[str], table: str, column: str, fallback: dict[int, str]) -> dict:
    if table in tables and {"id", column} <= _columns(conn, table):
        file = Path(getattr(conn, "path", None) or table).name
        rows = conn.execute(f'SELECT id, "{column}" FROM "{table}"')
        return {_id(i, file, table, "id"): _text(v) for i, v in rows if v is not None}
    return fallback


def _check_times(part: dict, file: str, table: str) -> dict:
    """``part`` where its times are within +-MAX_TIME_NS and no event ends before it starts; else
    TraceError naming the table, the column and the value."""
    start, dur = part["start_ns"], part["dur_ns"]
    for column, values, low in (("start", start, -MAX_TIME_NS), ("end - start", dur, 0)):
        bad = np.flatnonzero((values < low) | (values > MAX_TIME_NS))
        if bad.size:
            raise TraceError(
                f"{file}: table {table} has {column} = {int(values[bad[0]])} ns in row {int(bad[0]) + 1} "
                f"(and {bad.size - 1} more); expected {low} to {MAX_TIME_NS} ns"
            )
    return part


def _read(
    conn: sqlite3.Connection,
    file: str,
    table: str,
    ints: dict[str, int],
    texts: dict[str, Callable[[tuple], np.ndarray]] | None = None,
    where: _Where | None = None,
) -> dict[str, np.ndarray]:
    """Columns of ``table`` as int64 arrays, fetched in blocks. ``ints`` maps integer columns to the
    value that stands for NULL and for a column the table lacks; ``texts`` maps text columns to a
    function turning one block of values into int64 codes (-1 for a missing column), so the strings
    of a block are dropped as soon as it is coded."""
    texts = texts or {}
    where = where or _Where()
    sql, keep = _query(conn, file, table, ints, tuple(texts), where)
    pending = (getattr(conn, "prefetched", None) or {}).pop(sql, None)
    if pending is not None:
        raw = pending.result()
    else:
        paged = _page_plan(conn, table, ints, tuple(texts), where)
        raw = _fetch(paged, getattr(conn, "path", None), sql, keep, ints, texts)
    if raw is not None:
        out = {c: _coded(texts[c], v) if c in texts else v for c, v in raw.items()}
    else:
        out = _read_rows(conn, file, table, sql, keep, texts)
    n = out["start"].size
    for c in [*ints, *texts]:
        if c not in out:
            out[c] = np.full(n, ints.get(c, -1), dtype=np.int64)
    return out


def _coded(code: Callable[..., np.ndarray], values: np.ndarray | pages.Coded) -> np.ndarray:
    """int64 codes of a text column: ``code`` applied to its values, or to the distinct values of one
    the page reader coded (and spread over its rows)."""
    if isinstance(values, pages.Coded):
        # -1 (NULL, empty) wraps to the -1 appended; in place: the codes are the reader's own array.
        return np.take(np.append(code(values.distinct), -1), values.codes, out=values.codes, mode="wrap")
    return code(values)


class _Where(NamedTuple):
    """The rows a read keeps: those where ``not_null`` is not NULL and ``within[0]`` holds one of
    ``within[1]``; one statement for SQLite and the page reader."""

    not_null: str | None = None
    within: tuple[str, tuple[int, ...]] | None = None

    def sql(self) -> str:
        terms = [f'"{self.not_null}" IS NOT NULL'] if self.not_null else []
        if self.within:
            terms.append(f'"{self.within[0]}" IN ({", ".join(map(str, self.within[1]))})')
        return f"WHERE {' AND '.join(terms)}" if terms else ""


def _page_plan(
    conn: sqlite3.Connection, table: str, ints: dict[str, int], texts: tuple[str, ...], where: _Where
) -> pages.Plan | None:
    """The page reader's plan of this read, on the calling thread; None where it does not apply."""
    path = getattr(conn, "path", None)
    if not USE_PAGES or path is None or len(texts) > 1:
        return None
    text = texts[0] if texts else None
    cut = (table, text) in _TEXT_SQL
    return pages.plan(
        conn,
        path,
        table,
        ints,
        text=text,
        cut_ops=cut,
        not_null=where.not_null,
        within=where.within,
        cached=getattr(conn, "cached", None),
    )


def _fetch(
    paged: pages.Plan | None, path: Path | None, sql: str, keep: list[str], ints: dict[str, int], texts: dict
) -> dict | None:
    """A table's columns read by the page reader, else by connectorx; None where neither could (the
    standard library's row reader then reads it). Safe on any thread."""
    raw = pages.read(paged) if paged is not None else None
    return raw if raw is not None else _columnar(path, sql, keep, ints, texts)


def _query(
    conn: sqlite3.Connection, file: str, table: str, ints: dict[str, int], texts: tuple[str, ...], where: _Where
) -> tuple[str, list[str]]:
    """The SELECT of ``table``'s columns that _read reads, and the columns it has of those asked for."""
    have = _columns(conn, table)
    for required in ("start", "end"):
        if required not in have:
            raise TraceError(f"{file}: table {table} has no column {required!r}; expected an nsys export's schema")
    keep = [c for c in [*ints, *texts] if c in have]
    exprs = [f'COALESCE("{c}", {ints[c]})' if c in ints else _TEXT_SQL.get((table, c), f'"{c}"') for c in keep]
    return f'SELECT {", ".join(exprs)} FROM "{table}" {where.sql()}', keep


def _prefetch(conn: sqlite3.Connection, file: str, tables: set[str], pool: ThreadPoolExecutor) -> None:
    """Start reading every table _load will read, on ``pool``'s threads: the page reader and connectorx
    release the GIL, so two tables read at once on two cores (1.65x on a 3.7 GB export's three largest
    tables through connectorx). _read takes each result by its SELECT; the coding of names stays on the
    calling thread, in _load's order."""
    path = getattr(conn, "path", None)
    if path is None or (_cx is None and (not USE_PAGES or pages.library() is None)):
        return
    prefetched = {}
    # The largest table first: one thread reads it while the other reads the rest, and the calling thread
    # codes those (a 0.5 GB dense export: NVTX_EVENTS is 60 % of the rows).
    plans = sorted(_plans(conn, tables).items(), key=lambda item: -_rowids(conn, item[0]))
    for table, (ints, texts, where) in plans:
        try:
            sql, keep = _query(conn, file, table, ints, texts, where)
        except TraceError:
            continue  # _read raises it again, in order
        paged = _page_plan(conn, table, ints, texts, where)
        prefetched[sql] = pool.submit(_fetch, paged, path, sql, keep, ints, dict.fromkeys(texts))
    conn.prefetched = prefetched


def _rowids(conn: sqlite3.Connection, table: str) -> int:
    """The table's largest rowid (its row count where no row was deleted), read from its B-tree's end;
    0 where it has none."""
    try:
        high = conn.execute(f'SELECT MAX(rowid) FROM "{table}"').fetchone()[0]
    except sqlite3.DatabaseError:  # a WITHOUT ROWID table
        return 0
    return high if isinstance(high, int) else 0


def _columnar(
    path: Path | None, sql: str, keep: list[str], ints: dict[str, int], texts: dict
) -> dict[str, np.ndarray] | None:
    """``sql``'s columns read by connectorx: int64 arrays, and object arrays for the ``texts`` columns
    (coded by _read); None where connectorx is not installed or cannot read the file (a name it cannot
    take as a URI, a value it cannot type): the standard library's reader then reads it, and says what
    is wrong with a bad value. Safe on any thread: it opens the file itself."""
    if _cx is None or path is None or not re.fullmatch(r"[\w./-]+", str(path)):
        return None
    try:
        frame = _cx.read_sql(f"sqlite://{path}", sql, return_type="pandas")
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:  # a Rust panic arrives as a BaseException: the other reader decides
        return None
    if len(frame.columns) != len(keep):
        return None
    out = {}
    for c, column in zip(keep, (frame[k] for k in frame.columns), strict=True):
        if c in texts:
            out[c] = column.to_numpy(dtype=object)
        elif column.dtype.kind in "iu" or str(column.dtype) in ("Int64", "Int32", "Int16", "Int8"):
            out[c] = column.to_numpy(dtype=np.int64, na_value=ints[c])
        else:  # text or real in an integer column: the row reader raises the error that names it
            return None
    return out


def _read_rows(
    conn: sqlite3.Connection, file: str, table: str, sql: str, keep: list[str], texts: dict[str, Callable]
) -> dict[str, np.ndarray]:
    blocks: dict[str, list[np.ndarray]] = {c: [] for c in keep}
    cursor = conn.execute(sql)
    while rows := cursor.fetchmany(FETCH_ROWS):
        for c, values in zip(keep, zip(*rows, strict=True), strict=True):
            try:
                blocks[c].append(texts[c](values) if c in texts else np.array(values, dtype=np.int64))
            except (TypeError, ValueError, OverflowError):
                raise TraceError(
                    f"{file}: column {c} of table {table} holds non-integer values; expected integers"
                ) from None
        del rows
    return {c: np.concatenate(b) if b else np.empty(0, dtype=np.int64) for c, b in blocks.items()}


def _event(
    kind: str, r: dict[str, np.ndarray], name: np.ndarray, process: np.ndarray, **cols: np.ndarray | int
) -> dict:
    """One table's columns: arrays of its rows, or a 0-d array where every row holds one value (_table
    fills those rows with it)."""
    base = {
        "kind": np.array(_KINDS.index(kind), dtype=np.int8),
        "name": name,
        "start_ns": r["start"],
        "dur_ns": np.subtract(r["end"], r["start"], out=r["end"] if r["end"].flags.writeable else None),
        "device": np.array(-1, dtype=np.int64),
        "stream": np.array(-1, dtype=np.int64),
        "tid": np.array(-1, dtype=np.int64),
        "correlation": r.get("correlationId", np.array(-1, dtype=np.int64)),
        "bytes": np.array(0, dtype=np.int64),
        "copy_kind": np.array(0, dtype=np.int8),  # codes into COPY_KINDS, 0 = ''
        "host_mem": np.array(0, dtype=np.int8),  # codes into HOST_MEM
        "process": process,
    }
    for k, v in cols.items():
        base[k] = np.asarray(v)
    return base


def _thread_and_process(global_tid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The OS tid and the process part of each GlobalId (-1 where the export left it out); the process
    written over ``global_tid`` where it may be (at 3.7 GB an NVTX column is 223 MB: no copies)."""
    missing = global_tid < 0
    tid = global_tid & _PID_MASK
    tid[missing] = -1
    if not global_tid.flags.writeable:
        return tid, _process(global_tid)
    process = np.right_shift(global_tid, 24, out=global_tid)
    process[missing] = -1
    return tid, process


def _process(global_id: np.ndarray) -> np.ndarray:
    """The process part (pid and host/VM bits) of a GlobalId; -1 where the export left it out."""
    return np.where(global_id >= 0, global_id >> 24, -1)


_DEVICE_COLS = {"start": 0, "end": 0, "deviceId": -1, "streamId": -1, "correlationId": -1, "globalPid": -1}


def _plans(conn: sqlite3.Connection, tables: set[str]) -> dict[str, tuple[dict[str, int], tuple[str, ...], _Where]]:
    """What _load reads of each table it reads: (integer columns with their NULL value, text columns,
    WHERE clause); the one place that says it, for the readers and _prefetch alike."""
    plans = {
        "CUPTI_ACTIVITY_KIND_KERNEL": ({**_DEVICE_COLS, "demangledName": -1, "shortName": -1}, (), _Where()),
        "CUPTI_ACTIVITY_KIND_MEMCPY": (
            {**_DEVICE_COLS, "bytes": 0, "copyKind": 0, "srcKind": -1, "dstKind": -1},
            (),
            _Where(),
        ),
        "CUPTI_ACTIVITY_KIND_MEMSET": ({**_DEVICE_COLS, "bytes": 0, "memKind": -1}, (), _Where()),
        "CUPTI_ACTIVITY_KIND_RUNTIME": (
            {"start": 0, "end": 0, "globalTid": -1, "correlationId": -1, "nameId": -1},
            (),
            _Where(),
        ),
    }
    if "NVTX_EVENTS" in tables:
        typed = "eventType" in _columns(conn, "NVTX_EVENTS")
        where = _Where("end", ("eventType", _NVTX_RANGE_TYPES) if typed else None)
        plans["NVTX_EVENTS"] = ({"start": 0, "end": 0, "globalTid": -1, "textId": -1}, ("text",), where)
    if _SYNC_TABLE in tables:
        plans[_SYNC_TABLE] = ({**_DEVICE_COLS, _sync_column(conn): 0}, (), _Where())
    return {t: plan for t, plan in plans.items() if t in tables}


def _sync_column(conn: sqlite3.Connection) -> str:
    return "syncType" if "syncType" in _columns(conn, _SYNC_TABLE) else "deprecatedSyncType"  # renamed later


def _read_plan(conn: sqlite3.Connection, file: str, table: str, texts: dict | None = None) -> dict[str, np.ndarray]:
    ints, _, where = _plans(conn, {table})[table]
    return _read(conn, file, table, ints, texts, where)


def _kernels(conn: sqlite3.Connection, file: str, strings: dict[int, str], names: _Names) -> dict:
    r = _read_plan(conn, file, "CUPTI_ACTIVITY_KIND_KERNEL")

    def name_of(demangled: int, short: int) -> str:
        return strings.get(demangled) or strings.get(short) or f"kernel (name id {demangled})"

    name = names.codes(np.stack([r["demangledName"], r["shortName"]], axis=1), name_of)
    return _event("kernel", r, name, _process(r["globalPid"]), device=r["deviceId"], stream=r["streamId"])


def _memcpys(conn: sqlite3.Connection, file: str, tables: set[str], names: _Names) -> dict:
    r = _read_plan(conn, file, "CUPTI_ACTIVITY_KIND_MEMCPY")
    oper = _enum(conn, tables, "ENUM_CUDA_MEMCPY_OPER", "name", _MEMCPY_OPER)
    mem = _enum(conn, tables, "ENUM_CUDA_MEM_KIND", "label", _MEM_KIND)

    def copy_kind(kind: int) -> str:
        suffix = oper.get(kind, "").removeprefix("CUDA_MEMCPY_KIND_").removeprefix("UVM_")
        return _COPY_KIND.get(suffix, "")

    def name_of(kind: int, src: int, dst: int) -> str:
        direction = copy_kind(kind)
        sides = f" ({mem.get(src, 'Unknown')} -> {mem.get(dst, 'Unknown')})" if src >= 0 or dst >= 0 else ""
        return f"Memcpy {direction}{sides}" if direction else f"Memcpy{sides}"

    def host_mem(src: int, dst: int) -> str:
        return _HOST_MEM.get(mem.get(src, "").lower()) or _HOST_MEM.get(mem.get(dst, "").lower(), "")

    triples = np.stack([r["copyKind"], r["srcKind"], r["dstKind"]], axis=1)
    name = names.codes(triples, name_of)
    kinds_u, inv = unique_inverse(r["copyKind"])
    directions = np.array([COPY_KINDS.index(copy_kind(k)) for k in kinds_u.tolist()], dtype=np.int8)[inv.reshape(-1)]
    (src_u, src_inv), (dst_u, dst_inv) = unique_inverse(r["srcKind"]), unique_inverse(r["dstKind"])
    if src_u.size * dst_u.size <= 2**16:  # memory kinds are a handful: every pair, looked up by position
        pairs = [HOST_MEM.index(host_mem(s, d)) for s in src_u.tolist() for d in dst_u.tolist()]
        hosts = np.array(pairs, dtype=np.int8)[src_inv * dst_u.size + dst_inv]
    else:
        pairs_u, inv = np.unique(triples[:, 1:], axis=0, return_inverse=True)
        hosts = np.array([HOST_MEM.index(host_mem(s, d)) for s, d in pairs_u.tolist()], dtype=np.int8)[inv.reshape(-1)]
    return _event(
        "memcpy",
        r,
        name,
        _process(r["globalPid"]),
        device=r["deviceId"],
        stream=r["streamId"],
        bytes=r["bytes"],
        copy_kind=directions,
        host_mem=hosts,
    )


def _memsets(conn: sqlite3.Connection, file: str, tables: set[str], names: _Names) -> dict:
    r = _read_plan(conn, file, "CUPTI_ACTIVITY_KIND_MEMSET")
    mem = _enum(conn, tables, "ENUM_CUDA_MEM_KIND", "label", _MEM_KIND)
    name = names.codes(r["memKind"], lambda k: f"Memset ({mem[k]})" if k in mem else "Memset")
    return _event(
        "memset", r, name, _process(r["globalPid"]), device=r["deviceId"], stream=r["streamId"], bytes=r["bytes"]
    )


def _runtime(conn: sqlite3.Connection, file: str, strings: dict[int, str], names: _Names) -> dict:
    r = _read_plan(conn, file, "CUPTI_ACTIVITY_KIND_RUNTIME")
    name = names.codes(r["nameId"], lambda i: _API_VERSION.sub("", strings.get(i, f"API call (name id {i})")))
    tid, process = _thread_and_process(r["globalTid"])
    return _event("runtime", r, name, process, tid=tid)


def _nvtx(conn: sqlite3.Connection, file: str, strings: dict[int, str], names: _Names) -> dict:
    def inline(block) -> np.ndarray:
        # Each distinct text coded once (pandas' hash table in C); None and '' stay -1.
        codes, distinct = pd.factorize(np.asarray(block, dtype=object), use_na_sentinel=True)
        texts = [_text(t) for t in distinct.tolist()]
        lookup = np.array([names.range_code(t) if t else -1 for t in texts] + [-1], dtype=np.int64)
        return lookup[codes]

    r = _read_plan(conn, file, "NVTX_EVENTS", {"text": inline})
    # Text is inline (``text``) or registered (``textId`` into StringIds), mixed within one file; a row
    # with neither is named ''.
    name = r["text"]
    registered = name < 0
    name[registered] = names.codes(r["textId"][registered], lambda i: strings.get(i, ""), names.range_code)
    tid, process = _thread_and_process(r["globalTid"])
    return _event("annotation", r, name, process, tid=tid)


def _syncs(conn: sqlite3.Connection, file: str, tables: set[str], names: _Names) -> dict:
    sync_col = _sync_column(conn)
    r = _read_plan(conn, file, _SYNC_TABLE)
    labels = _enum(conn, tables, "ENUM_CUPTI_SYNC_TYPE", "label", _SYNC_TYPE)
    name = names.codes(r[sync_col], lambda k: labels.get(k, f"Sync (type {k})"))
    # A context or device synchronize waits on no one stream: CUPTI writes CUPTI_SYNCHRONIZATION_INVALID_VALUE.
    stream = np.where(r["streamId"] == _SYNC_INVALID, -1, r["streamId"])
    return _event("sync", r, name, _process(r["globalPid"]), device=r["deviceId"], stream=stream)
