"""Columns of an SQLite table read straight from the file's B-tree pages by a small C reader
(``csrc/sqlite_pages.c``, compiled on first use): the nsys loader's fast path.

SQLite's own row stepping costs about 80 ns a value, and every text a Python object: at 3.7 GB (47 M
rows) the export's reads took 25 s of CPU through connectorx. The pages hold the same values in a
documented format (https://www.sqlite.org/fileformat.html), which the C reader parses with no engine
and no object per row, coding the one text column it reads into its distinct values as it goes.

:func:`plan` takes what the reader needs from SQLite (the table's root page, its columns' positions
in a record, a bound on its rows) on the calling thread; :func:`read` parses on any thread (ctypes
releases the GIL). Either returns None where this reader does not apply (no C compiler, a journal or
WAL file beside the database, a column with a default, an index-organised table, a value of another
type than asked): the caller then reads through SQLite, which also names what is wrong with a value.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sqlite3
from pathlib import Path
from typing import NamedTuple

import numpy as np

from advisor.cbuild import build_shared
from advisor.errors import AdvisorError

SOURCE = Path(__file__).with_name("csrc") / "sqlite_pages.c"
_I64P = ctypes.POINTER(ctypes.c_int64)


class Coded(NamedTuple):
    """A text column read as codes (int64, -1 for NULL or empty) into ``distinct`` (an object array
    of bytes, in order of first appearance)."""

    codes: np.ndarray
    distinct: np.ndarray


class Plan(NamedTuple):
    """One table's read: everything :func:`read` passes to the C reader."""

    path: bytes  # os.fsencode'd: any name the file system takes
    page_size: int
    usable: int
    pages: int
    root: int
    columns: tuple[str, ...]
    positions: tuple[int, ...]  # each column's index in a record; -1 for the rowid
    nulls: tuple[int, ...]
    capacity: int
    text: str | None
    text_position: int
    cut_ops: bool
    not_null: int
    within: int
    within_values: tuple[int, ...]
    cached: int | None = None  # a CachedBefore's handle: pages read that it lacks are dropped after


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled reader, or None where it cannot be built here (no C compiler)."""
    try:
        lib = ctypes.CDLL(
            str(build_shared(SOURCE, ["-std=c11"], [], stem="sqlite_pages", purpose="the nsys page reader"))
        )
    except (AdvisorError, OSError):
        return None
    lib.sp_read.restype = ctypes.c_int64
    lib.sp_read.argtypes = [
        ctypes.c_char_p,
        *(ctypes.c_int64,) * 4,
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_int),
        _I64P,
        ctypes.POINTER(_I64P),
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_int,
        _I64P,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
        _I64P,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    lib.sp_dict_new.restype = ctypes.c_void_p
    lib.sp_cached_new.restype, lib.sp_cached_new.argtypes = ctypes.c_void_p, [ctypes.c_char_p]
    lib.sp_cached_drop.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.sp_cached_free.argtypes = [ctypes.c_void_p]
    for name in ("sp_dict_size", "sp_dict_bytes"):
        getattr(lib, name).restype = ctypes.c_int64
        getattr(lib, name).argtypes = [ctypes.c_void_p]
    lib.sp_dict_copy.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _I64P]
    lib.sp_dict_free.argtypes = [ctypes.c_void_p]
    return lib


def plan(
    conn,
    path: Path,
    table: str,
    ints: dict[str, int],
    *,
    text: str | None = None,
    cut_ops: bool = False,
    not_null: str | None = None,
    within: tuple[str, tuple[int, ...]] | None = None,
    cached: CachedBefore | None = None,
) -> Plan | None:
    """The read of ``table``'s ``ints`` columns (those it has; NULL read as the value given) and its
    ``text`` column, keeping rows where ``not_null`` is not NULL and ``within[0]`` holds one of
    ``within[1]``; None where the page reader does not apply. ``conn``: an open sqlite3 connection to
    ``path``, on the calling thread. ``cached``: the file's page cache as the caller found it, which
    the read leaves it as (see :class:`CachedBefore`)."""
    if library() is None or not _plain_file(path):
        return None
    with path.open("rb") as f:
        header = f.read(100)
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    if len(header) < 100 or int.from_bytes(header[56:60], "big") not in (0, 1):  # text not UTF-8
        return None
    pages = path.stat().st_size // page_size
    row = conn.execute("SELECT rootpage FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)).fetchone()
    info = list(conn.execute(f'PRAGMA table_xinfo("{table}")'))
    if row is None or not isinstance(row[0], int) or any(r[6] for r in info):  # hidden or generated columns
        return None
    keys = [r for r in info if r[5]]
    alias = keys[0][1] if len(keys) == 1 and str(keys[0][2]).upper() == "INTEGER" else None
    position = {r[1]: (-1 if r[1] == alias else r[0]) for r in info}
    default = {r[1] for r in info if r[4] is not None}
    wanted = [c for c in ints if c in position]
    filters = [c for c in (text, not_null, within and within[0]) if c]
    if any(c in default for c in [*wanted, *filters]) or any(c not in position for c in filters):
        return None
    if any(position[c] < 0 for c in filters):  # the rowid is never NULL, text or filtered on here
        return None
    try:
        # Two statements: SQLite reads one end of the B-tree for a lone MIN or MAX, and scans the table
        # for both in one SELECT.
        low, high = (conn.execute(f'SELECT {end}(rowid) FROM "{table}"').fetchone()[0] for end in ("MIN", "MAX"))
    except sqlite3.OperationalError:  # a WITHOUT ROWID table: an index B-tree, which SQLite reads
        return None
    capacity = 0 if high is None else high - low + 1  # rowids are distinct integers: no more rows than that
    if capacity > pages * page_size // 4:  # rowids far apart: count the rows instead
        capacity = conn.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0]
    return Plan(
        path=os.fsencode(path),
        page_size=page_size,
        usable=page_size - header[20],
        pages=pages,
        root=row[0],
        columns=tuple(wanted),
        positions=tuple(position[c] for c in wanted),
        nulls=tuple(ints[c] for c in wanted),
        capacity=max(capacity, 0),
        text=text,
        text_position=position[text] if text else -1,
        cut_ops=cut_ops,
        not_null=position[not_null] if not_null else -1,
        within=position[within[0]] if within else -1,
        within_values=tuple(within[1]) if within else (),
        cached=cached.handle if cached is not None else None,
    )


class CachedBefore:
    """Which of a file's pages the page cache holds now (``mincore``), so that reads of it leave the
    cache as they found it: each :func:`read` of a plan made with it drops the pages it brought in
    as soon as it has copied them (``POSIX_FADV_DONTNEED``), and :meth:`drop` the rest, which the kernel read ahead or
    SQLite read. A multi-GB export read once then pushes no other cached file out, and on a VM whose
    host backs guest memory on demand the freed pages go on to hold the event table instead of the
    host backing both (bench/results/analyze_speed.md, 2026-12-07 afternoon). A file that was in the
    cache stays there. Where residency cannot be read (no C compiler, no mmap, no posix_fadvise:
    macOS) nothing is dropped."""

    def __init__(self, path: Path) -> None:
        self.path = os.fsencode(path)
        lib = library()
        self.handle: int | None = (lib.sp_cached_new(self.path) or None) if lib is not None else None

    def drop(self) -> None:
        """Drop every page of the file that was not cached when this was made; call it while no read
        made with it runs."""
        if self.handle:
            library().sp_cached_drop(self.handle, self.path)

    def close(self) -> None:
        """:meth:`drop`, then forget the residency: plans made with this must not be read after."""
        self.drop()
        handle, self.handle = self.handle, None
        if handle:
            library().sp_cached_free(handle)


def _plain_file(path: Path) -> bool:
    """No rollback journal or WAL beside the database: its pages alone are the whole, committed content."""
    return all(not Path(f"{path}{suffix}").exists() for suffix in ("-journal", "-wal"))


def read(p: Plan) -> dict[str, np.ndarray | Coded] | None:
    """The planned columns: int64 arrays, and a :class:`Coded` for the text column; None where the
    reader met what it does not handle (the caller reads the table through SQLite)."""
    lib = library()
    if lib is None:
        return None
    out = [np.empty(p.capacity, dtype=np.int64) for _ in p.columns]
    codes = np.empty(p.capacity if p.text else 0, dtype=np.int64)
    ptrs = (_I64P * max(len(out), 1))(*(a.ctypes.data_as(_I64P) for a in out))
    positions = (ctypes.c_int * max(len(out), 1))(*p.positions)
    nulls = np.array(p.nulls or (0,), dtype=np.int64)
    within = np.array(p.within_values or (0,), dtype=np.int64)
    dictionary = lib.sp_dict_new() if p.text else None
    if p.text and not dictionary:
        return None
    try:
        n = lib.sp_read(
            p.path,
            p.page_size,
            p.usable,
            p.pages,
            p.root,
            len(out),
            positions,
            nulls.ctypes.data_as(_I64P),
            ptrs,
            p.capacity,
            p.text_position,
            int(p.cut_ops),
            codes.ctypes.data_as(_I64P),
            dictionary,
            p.not_null,
            p.within,
            within.ctypes.data_as(_I64P),
            len(p.within_values),
            p.cached,
        )
        if n < 0:
            return None
        result: dict[str, np.ndarray | Coded] = {c: a[:n] for c, a in zip(p.columns, out, strict=True)}
        if p.text:
            result[p.text] = Coded(codes[:n], _distinct(lib, dictionary))
    finally:
        if dictionary:
            lib.sp_dict_free(dictionary)
    return result


def _distinct(lib: ctypes.CDLL, dictionary: int) -> np.ndarray:
    count, size = lib.sp_dict_size(dictionary), lib.sp_dict_bytes(dictionary)
    buf = ctypes.create_string_buffer(max(size, 1))
    offsets = np.empty(count + 1, dtype=np.int64)
    lib.sp_dict_copy(dictionary, buf, offsets.ctypes.data_as(_I64P))
    raw = buf.raw
    out = np.empty(count, dtype=object)
    out[:] = [raw[a:b] for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)]
    return out
