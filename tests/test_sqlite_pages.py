"""The C page reader (advisor/trace/pages.py) against SQLite on databases built to hit the file
format's cases: every integer width, B-trees several levels deep, records spilled to overflow pages,
rows older than a column, rowid gaps, filters, and what it must decline rather than misread."""

from __future__ import annotations

import os
import random
import sqlite3
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest

from advisor.trace import nsys, pages

pytestmark = pytest.mark.skipif(
    pages.library() is None,
    reason="no C compiler here: the page reader cannot be built (the loader reads through SQLite)",
)

WIDTHS = [0, 1, -1, 127, -128, 128, 32767, -32768, 32768, 2**23 - 1, -(2**23), 2**31 - 1, -(2**31)]
WIDTHS += [2**47 - 1, -(2**47), 2**63 - 1, -(2**63), None]  # 0 and 1 are stored as no bytes (serial types 8, 9)


def _db(path: Path, schema: str, rows: list[tuple], page_size: int = 4096, insert: str | None = None) -> Path:
    with closing(sqlite3.connect(path)) as db:
        db.execute(f"PRAGMA page_size = {page_size}")
        db.execute(schema)
        if rows:
            marks = ", ".join("?" * len(rows[0]))
            db.executemany(insert or f"INSERT INTO t VALUES ({marks})", rows)
        db.commit()
    return path


def _read(path: Path, ints: dict[str, int], **kw) -> dict | None:
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        plan = pages.plan(db, path, "t", ints, **kw)
    assert plan is not None
    return pages.read(plan)


@pytest.mark.parametrize("page_size", [512, 4096, 65536])
def test_integers_of_every_width_in_a_deep_tree(tmp_path, page_size):
    # 30,000 rows on 512-byte pages: a B-tree of leaves under two levels of interior pages.
    rows = [(WIDTHS[i % len(WIDTHS)], i, WIDTHS[(i * 7) % len(WIDTHS)]) for i in range(30_000)]
    path = _db(tmp_path / "t.sqlite", "CREATE TABLE t (a INTEGER, b INTEGER, c INTEGER)", rows, page_size)
    out = _read(path, {"a": -5, "c": 9, "b": 0, "missing": 1})
    assert set(out) == {"a", "b", "c"}  # a column the table lacks is left to the caller
    assert out["a"].tolist() == [-5 if r[0] is None else r[0] for r in rows]
    assert out["b"].tolist() == list(range(30_000))
    assert out["c"].tolist() == [9 if r[2] is None else r[2] for r in rows]
    if page_size == 512:
        assert _depth(path) == 3  # interior, interior, leaf: the reader walked two levels to the leaves


def _leaves(path: Path) -> tuple[list[int], int]:
    """Table t's leaf pages in rowid order and its B-tree's levels, walked in Python from the file."""
    with closing(sqlite3.connect(path)) as db:
        root = db.execute("SELECT rootpage FROM sqlite_master WHERE name = 't'").fetchone()[0]
        size = db.execute("PRAGMA page_size").fetchone()[0]
    data = path.read_bytes()

    def walk(page: int, level: int) -> tuple[list[int], int]:
        base = (page - 1) * size
        if data[base] == 0x0D:
            return [page], level
        cells = int.from_bytes(data[base + 3 : base + 5], "big")
        at = [int.from_bytes(data[base + 12 + 2 * i : base + 14 + 2 * i], "big") for i in range(cells)]
        children = [int.from_bytes(data[base + a : base + a + 4], "big") for a in at]
        children.append(int.from_bytes(data[base + 8 : base + 12], "big"))
        walks = [walk(c, level + 1) for c in children]
        return [p for w in walks for p in w[0]], max(w[1] for w in walks)

    return walk(root, 1)


def _depth(path: Path) -> int:
    return _leaves(path)[1]


def _sql_cut(path: Path) -> list[bytes]:
    """What SQLite's expression (the SQLite readers' cut) makes of every row's text."""
    with closing(sqlite3.connect(path)) as db:
        return [bytes(v) for (v,) in db.execute(f"SELECT {nsys._NVTX_TEXT_SQL} FROM t")]


TRICKY = [
    "aten::mm, seq = 3, op_id = 17, sizes = [[2, 3]]",
    "aten::add, op_id = 18",
    "my range, op_id = later",  # no digit: not an op, kept whole
    "odd, op_id = x, op_id = 5",  # a later mark has its digit: cut at the first mark
    "back, op_id = 5, seq = 3",  # seq after op_id: cut at op_id
    "step, seq = 4",
    "größe, seq = 1, op_id = 2",  # bytes, not characters
    "",
    None,
    "plain",
]


@pytest.mark.parametrize("page_size", [512, 4096])
def test_texts_cut_and_coded_as_sqlite_cuts_them_overflow_pages_included(tmp_path, page_size):
    rnd = random.Random(7)
    texts = list(TRICKY)
    for i in range(3000):  # up to 40 KB: records spilled over chains of overflow pages
        body = "x" * rnd.choice([0, 10, 400, 3000, 5000, 40_000])
        texts.append(rnd.choice([f"aten::op{i % 9}, seq = {i}, op_id = {i}, sizes = [{body}]", f"user {i % 5} {body}"]))
    rows = [(i, t, i % 3) for i, t in enumerate(texts)]
    path = _db(tmp_path / "t.sqlite", 'CREATE TABLE t (start INTEGER, "text" TEXT, k INTEGER)', rows, page_size)
    out = _read(path, {"start": 0, "k": 0}, text="text", cut_ops=True)
    coded = out["text"]
    got = [b"" if c < 0 else coded.distinct[c] for c in coded.codes.tolist()]
    assert got == _sql_cut(path)
    assert out["k"].tolist() == [i % 3 for i in range(len(texts))]  # columns after a spilled text
    assert got[:7] == [
        b"aten::mm, seq = ",
        b"aten::add, op_id = ",
        b"my range, op_id = later",
        b"odd, op_id = ",
        b"back, op_id = ",
        b"step, seq = 4",
        "größe, seq = ".encode(),
    ]
    assert coded.codes[7:9].tolist() == [-1, -1]  # '' and NULL
    assert len(coded.distinct) == len(set(got) - {b""})  # each distinct text once, first appearance order
    assert list(coded.distinct[:2]) == [b"aten::mm, seq = ", b"aten::add, op_id = "]


def test_rows_older_than_a_column_rowid_alias_gaps_and_filters(tmp_path):
    path = tmp_path / "t.sqlite"
    with closing(sqlite3.connect(path)) as db:
        db.execute('CREATE TABLE t (id INTEGER PRIMARY KEY, "end" INTEGER, kind INTEGER)')
        db.executemany(
            "INSERT INTO t VALUES (?, ?, ?)", [(i * 10, i if i % 4 else None, 59 + i % 3) for i in range(1, 200)]
        )
        db.execute("ALTER TABLE t ADD COLUMN later INTEGER")  # rows before it have no such field
        db.executemany("INSERT INTO t VALUES (?, ?, ?, ?)", [(5000 + i, i, 59, -i) for i in range(3)])
        db.execute("DELETE FROM t WHERE id BETWEEN 500 AND 900")
        db.commit()
        want = db.execute(
            'SELECT id, "end", kind, COALESCE(later, 7) FROM t WHERE "end" IS NOT NULL AND kind IN (59, 60)'
        )
        want = [list(r) for r in want]
    out = _read(path, {"id": 0, "end": 0, "kind": 0, "later": 7}, not_null="end", within=("kind", (59, 60)))
    got = [list(r) for r in zip(*(out[c].tolist() for c in ("id", "end", "kind", "later")), strict=True)]
    assert got == want
    assert len(got) == sum(1 for i in range(1, 200) if not 50 <= i <= 90 and i % 4 and i % 3 != 2) + 3 == 83
    assert got[-3:] == [[5000, 0, 59, 0], [5001, 1, 59, -1], [5002, 2, 59, -2]]


def test_what_it_declines_instead_of_misreading(tmp_path):
    rows = [(i, i * 2) for i in range(20_000)]
    schema = "CREATE TABLE t (a INTEGER, b INTEGER)"
    for bad in ("'seven'", "2.5", "x'00'"):  # text, real, blob in an integer column: SQLite's readers name it
        path = _db(tmp_path / f"bad{len(bad)}.sqlite", schema, rows)
        with closing(sqlite3.connect(path)) as db:
            db.execute(f"UPDATE t SET b = {bad} WHERE rowid = 15000")
            db.commit()
        assert _read(path, {"a": 0, "b": 0}) is None
        assert _read(path, {"a": 0})["a"].tolist() == list(range(20_000))  # the column not read is not judged
    without = tmp_path / "without.sqlite"
    _db(without, "CREATE TABLE t (a INTEGER PRIMARY KEY, b INTEGER) WITHOUT ROWID", rows)
    with closing(sqlite3.connect(without)) as db:
        assert pages.plan(db, without, "t", {"a": 0, "b": 0}) is None  # an index B-tree: no rowid
    plain = _db(tmp_path / "plain.sqlite", schema, rows)
    damaged = tmp_path / "damaged.sqlite"
    data = bytearray(plain.read_bytes())
    leaves = _leaves(plain)[0]
    data[4096 * (leaves[len(leaves) // 2] - 1)] = 0x42  # a middle leaf's page type (MIN/MAX(rowid) never read it)
    damaged.write_bytes(bytes(data))
    assert _read(damaged, {"a": 0, "b": 0}) is None
    # The walk to the leaves reads only an interior page's first child and takes the rest as leaves
    # (SQLite's B-trees are balanced); a later child that is not a leaf is caught when it is parsed.
    data = bytearray(plain.read_bytes())
    data[4096 * (leaves[-2] - 1)] = 0x05  # a leaf made an interior page (not the last: MAX(rowid) reads that)
    damaged.write_bytes(bytes(data))
    assert _read(damaged, {"a": 0, "b": 0}) is None
    wal = Path(f"{plain}-wal")
    wal.write_bytes(b"\0" * 32)  # pages that may be newer than the file's: SQLite reads them
    with closing(sqlite3.connect(f"file:{plain}?mode=ro", uri=True)) as db:
        assert pages.plan(db, plain, "t", {"a": 0}) is None
    wal.unlink()
    defaults = _db(tmp_path / "default.sqlite", "CREATE TABLE t (a INTEGER, b INTEGER DEFAULT 3)", rows)
    with closing(sqlite3.connect(defaults)) as db:
        assert pages.plan(db, defaults, "t", {"a": 0, "b": 0}) is None  # old rows would read the default
        assert pages.plan(db, defaults, "t", {"a": 0}) is not None
    utf16 = tmp_path / "utf16.sqlite"
    with closing(sqlite3.connect(utf16)) as db:
        db.execute("PRAGMA encoding = 'UTF-16le'")
        db.execute(schema)
        db.commit()
    with closing(sqlite3.connect(utf16)) as db:
        assert pages.plan(db, utf16, "t", {"a": 0}) is None


def test_an_empty_table_reads_as_no_rows(tmp_path):
    path = _db(tmp_path / "t.sqlite", 'CREATE TABLE t (a INTEGER, "text" TEXT)', [])
    out = _read(path, {"a": 0}, text="text", cut_ops=True)
    assert out["a"].size == 0 and out["text"].codes.size == 0 and out["text"].distinct.size == 0
    assert isinstance(out["a"], np.ndarray)


def test_damaged_bytes_never_crash_it(tmp_path):
    # Any byte of a table page changed: the reader declines or reads rows, and never reads or writes
    # out of bounds (a crash here would take the test run down). Seeded: the same 300 damages each run.
    texts = [f"aten::op{i % 7}, seq = {i}, op_id = {i}" + "y" * (i % 5000) for i in range(600)]
    clean = _db(tmp_path / "clean.sqlite", 'CREATE TABLE t (a INTEGER, "text" TEXT)', list(enumerate(texts)), 512)
    data = clean.read_bytes()
    with closing(sqlite3.connect(clean)) as db:
        plan = pages.plan(db, clean, "t", {"a": 0}, text="text", cut_ops=True)
    rnd, outcomes = random.Random(11), set()
    damaged = tmp_path / "damaged.sqlite"
    for _ in range(300):
        broken = bytearray(data)
        for _ in range(rnd.choice([1, 4])):
            broken[rnd.randrange(512, len(data))] = rnd.randrange(256)
        damaged.write_bytes(bytes(broken))
        out = pages.read(plan._replace(path=os.fsencode(damaged)))
        outcomes.add(out is None)
        assert out is None or out["a"].size <= plan.capacity
    assert outcomes == {True, False}  # some damage it reads past (in values), some it declines
