"""A large Nsight Systems export in a real export's schema, for the scale benchmark (bench/scale.py).

The template's schema is copied as it is (every table, column and type of the export), its small
tables once, and its timed tables again and again: the event tables (kernels, copies, sets, runtime
calls, synchronisations, NVTX ranges) and, in a default capture, the OS runtime calls, CPU samples,
their call stacks and the scheduling events. Each copy is shifted in time by the capture's span and in
correlation and call-stack ids by their range, as if the job had been captured for that much longer.
The op ids and sequence numbers that ``torch.autograd.profiler.emit_nvtx`` writes into each NVTX range's
text ("aten::mm, seq = 12, op_id = 34") move the same way, so every copy's ranges have texts of their
own, as in a real capture of that length, where no two ops share an op id. SQLite copies the rows itself
(``INSERT ... SELECT`` from the attached template), so a 3.7 GB file takes a minute or two.

Run: ``.venv/bin/python bench/make_nsys.py --size-gb 3.7 --out /tmp/big.sqlite``
(template: ``../shared/traces/nsys/nsysai_mfu_2gpu_before.sqlite``; ``--template`` for another).
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
import time
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "nsys" / "nsysai_mfu_2gpu_before.sqlite"
EVENT_TABLES = (
    "CUPTI_ACTIVITY_KIND_KERNEL",
    "CUPTI_ACTIVITY_KIND_MEMCPY",
    "CUPTI_ACTIVITY_KIND_MEMSET",
    "CUPTI_ACTIVITY_KIND_RUNTIME",
    "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION",
    "NVTX_EVENTS",
)
SHIFTED = ("start", "end")
"""Time columns moved by each copy's offset."""
ID_FAMILIES = (
    (("OSRT_CALLCHAINS", "id"), ("OSRT_API", "callchainId")),
    (("SAMPLING_CALLCHAINS", "id"), ("COMPOSITE_EVENTS", "id")),
)
"""Ids shared between tables (an OS runtime call's call stack, a CPU sample's): each copy moves them by
the family's range, so a copy's rows point at its own copies and (id, stackDepth) stays unique."""
ALSO_REPEATED = ("SCHED_EVENTS",)
"""Timed tables outside the families that a default capture fills (thread scheduling)."""
GENERATION = 2
"""Bumped whenever the rows written change (2: op ids and sequence numbers move with each copy), so
that bench/scale.py writes its files again instead of reusing older ones."""
NVTX_NUMBERS = (", op_id = ", ", seq = ")
"""The numbers emit_nvtx writes into an NVTX range's text (torch/csrc/profiler/util.cpp, getNvtxStr)."""


def _columns(conn: sqlite3.Connection, schema: str, table: str) -> list[str]:
    return [r[1] for r in conn.execute(f'PRAGMA {schema}.table_info("{table}")')]


def _shifted_number(expr: str, key: str, offset: int) -> str:
    """SQL for ``expr`` with the integer after ``key`` raised by ``offset``; ``expr`` where it has no
    ``key``. (CAST of text to INTEGER reads its longest integer prefix.)"""
    at = f"instr({expr}, '{key}')"
    number = f"CAST(substr({expr}, {at} + {len(key)}) AS INTEGER)"
    return (
        f"CASE WHEN {at} > 0 THEN substr({expr}, 1, {at} + {len(key) - 1}) || ({number} + {offset}) || "
        f"substr({expr}, {at} + {len(key)} + length(CAST({number} AS TEXT))) ELSE {expr} END"
    )


def _text_ranges(conn: sqlite3.Connection, tables: list[str]) -> dict[str, int]:
    """For each of NVTX_NUMBERS, one more than the largest such number in the template's NVTX texts."""
    if "NVTX_EVENTS" not in tables or "text" not in _columns(conn, "src", "NVTX_EVENTS"):
        return {}
    out = {}
    for key in NVTX_NUMBERS:
        at = f"instr(text, '{key}')"
        top = conn.execute(
            f"SELECT MAX(CAST(substr(text, {at} + {len(key)}) AS INTEGER)) FROM src.NVTX_EVENTS WHERE {at} > 0"
        ).fetchone()[0]
        if top is not None:
            out[key] = top + 1
    return out


def make(template: Path, out: Path, size_bytes: int) -> dict:
    """Write ``out`` from ``template`` until it holds at least ``size_bytes``; the counts of what was
    written."""
    if out.exists():
        out.unlink()
    conn = sqlite3.connect(out)
    conn.execute("PRAGMA journal_mode = OFF")
    conn.execute("PRAGMA synchronous = OFF")
    conn.execute(f"ATTACH DATABASE '{template}' AS src")
    tables = [r[0] for r in conn.execute("SELECT name FROM src.sqlite_master WHERE type = 'table'")]
    for (sql,) in conn.execute("SELECT sql FROM src.sqlite_master WHERE type = 'table' AND sql IS NOT NULL").fetchall():
        conn.execute(sql)
    events = [t for t in EVENT_TABLES if t in tables]
    id_offset: dict[tuple[str, str], int] = {}
    for family in ID_FAMILIES:
        present = [(t, c) for t, c in family if t in tables]
        top = max((conn.execute(f'SELECT MAX("{c}") FROM src."{t}"').fetchone()[0] or 0 for t, c in present), default=0)
        id_offset.update({(t, c): top + 1 for t, c in present})
    repeated = events + sorted({t for t, _ in id_offset} | {t for t in ALSO_REPEATED if t in tables})
    for t in tables:
        if t not in repeated and not t.startswith("sqlite_"):
            conn.execute(f'INSERT INTO main."{t}" SELECT * FROM src."{t}"')
    timed = [t for t in repeated if "start" in _columns(conn, "src", t)]
    lo = min(conn.execute(f'SELECT MIN(start) FROM src."{t}"').fetchone()[0] for t in timed)
    hi = max(
        conn.execute(
            f'SELECT MAX({"end" if "end" in _columns(conn, "src", t) else "start"}) FROM src."{t}"'
        ).fetchone()[0]
        for t in timed
    )
    span = hi - lo + 1000  # a microsecond between copies
    corr = max(
        conn.execute(f'SELECT MAX(correlationId) FROM src."{t}"').fetchone()[0] or 0
        for t in events
        if "correlationId" in _columns(conn, "src", t)
    )
    text_ranges = _text_ranges(conn, tables)
    copies = 0
    conn.commit()
    while copies == 0 or os.path.getsize(out) < size_bytes:
        for t in repeated:
            cols = _columns(conn, "src", t)
            exprs = [
                _nvtx_text(text_ranges, copies)
                if (t, c) == ("NVTX_EVENTS", "text")
                else f'"{c}" + {copies * span}'
                if c in SHIFTED
                else f'"{c}" + {copies * (corr + 1)}'
                if c == "correlationId"
                else f'"{c}" + {copies * id_offset[(t, c)]}'
                if (t, c) in id_offset
                else f'"{c}"'
                for c in cols
            ]
            names = ", ".join(f'"{c}"' for c in cols)
            conn.execute(f'INSERT INTO main."{t}" ({names}) SELECT {", ".join(exprs)} FROM src."{t}"')
        conn.commit()
        copies += 1
    rows = {t: conn.execute(f'SELECT COUNT(*) FROM main."{t}"').fetchone()[0] for t in repeated}
    conn.close()
    return {"copies": copies, "bytes": os.path.getsize(out), "rows": rows}


def _nvtx_text(ranges: dict[str, int], copies: int) -> str:
    expr = '"text"'
    for key, top in ranges.items():
        expr = _shifted_number(expr, key, copies * top) if copies else expr
    return expr


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, required=True, help="at least this many GB (1e9 bytes)")
    ap.add_argument("--out", required=True, help="the export to write (replaced)")
    ap.add_argument("--template", default=str(TEMPLATE), help="a real export whose schema and events to copy")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    made = make(Path(args.template), Path(args.out), int(args.size_gb * 1e9))
    print(
        f"{args.out}: {made['bytes'] / 1e9:.2f} GB, {made['copies']} copies of {Path(args.template).name}, "
        f"{sum(made['rows'].values()):,} event rows, {time.perf_counter() - t0:.0f} s",
        file=sys.stderr,
    )
    for t, n in made["rows"].items():
        print(f"  {t}: {n:,}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
