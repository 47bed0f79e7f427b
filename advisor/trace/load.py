"""Load any supported trace into the event table, recognising the format from the file's first bytes.

Supported inputs: a Kineto JSON file (``.json`` or ``.json.gz``), a folder of per-rank Kineto files,
a ``.zip`` of them, an Nsight Systems SQLite export, or one of our run directories (whose context, the
device it ran on and its optimizer's size, comes along in the table's attrs). The name is not trusted.
"""

from __future__ import annotations

import zipfile
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from advisor.errors import TraceError
from advisor.store.runstore import is_run_dir, run_context, run_trace
from advisor.trace.kineto import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_EVENT_BYTES,
    ReadBudget,
    TraceSource,
    load_kineto,
    load_sources,
)
from advisor.trace.nsys import load_nsys_sqlite

SQLITE_MAGIC = b"SQLite format 3\x00"
GZIP_MAGIC = b"\x1f\x8b"
MAX_ZIP_MEMBERS = 1024
FORMATS = "Kineto JSON (.json, .json.gz, a folder or .zip of rank files) or an Nsight Systems SQLite export"


def load_trace(
    path: str | Path,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
    keep_args: Callable[[str], bool] | None = None,
    check: Callable[[], None] | None = None,
) -> pd.DataFrame:
    """The event table of any supported trace at ``path`` (see the module docstring); ``keep_args``
    as ``load_kineto``'s (an nsys export records no args). One of our run directories gives its
    trace (one file, or one per rank) with ``attrs["own_run"]`` set and ``attrs["run"]`` the run's
    context (``advisor.store.runstore.run_context``: its device, its optimizer's parameters).

    Bounded work: ``max_bytes`` caps the decompressed bytes read (all files of a folder or zip
    together; an nsys export's size), ``max_event_bytes`` one Kineto event's; ``check()`` runs before
    each block read (each table of an nsys export) and stops the load by raising."""
    p = Path(path)
    kineto = {"max_bytes": max_bytes, "max_event_bytes": max_event_bytes, "keep_args": keep_args, "check": check}
    if p.is_dir():
        if is_run_dir(p):
            inner = run_trace(p)
            if not inner.exists():
                raise TraceError(f"run {p.name} has no trace (its status says why)")
            df = load_kineto(inner, **kineto)
            df.attrs["own_run"] = True
            df.attrs["run"] = run_context(p)
            return df
        return load_kineto(p, **kineto)
    if not p.is_file():
        raise TraceError(f"no file or folder {p.name}")
    with open(p, "rb") as f:
        head = f.read(16)
    if head.startswith(SQLITE_MAGIC):
        return load_nsys_sqlite(p, max_bytes=max_bytes, check=check)
    if zipfile.is_zipfile(p):
        return _load_zip(p, ReadBudget(max_bytes, check), max_event_bytes, keep_args)
    if head.startswith(GZIP_MAGIC) or head.lstrip()[:1] in (b"{", b"["):
        return load_kineto(p, **kineto)
    raise TraceError(f"{p.name} is not a trace this tool reads; expected {FORMATS}")


def _load_zip(
    path: Path, budget: ReadBudget, max_event_bytes: int, keep_args: Callable[[str], bool] | None
) -> pd.DataFrame:
    """Rank files from a zip: only .json/.json.gz members, no paths kept, read member by member
    straight from the archive (nothing unpacked to disk) within ``budget``; a member whose header
    lies about its size is refused when its bytes run past or short of it."""
    try:
        z = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as err:
        raise TraceError(f"{path.name} is a damaged zip ({err})") from None
    with z:
        members = [m for m in z.infolist() if not m.is_dir() and m.filename.endswith((".json", ".json.gz"))]
        if not members:
            raise TraceError(f"{path.name} holds no .json or .json.gz files")
        if len(members) > MAX_ZIP_MEMBERS:
            raise TraceError(f"{path.name} holds {len(members)} trace files; at most {MAX_ZIP_MEMBERS}")
        total = sum(m.file_size for m in members)
        if total > budget.max_bytes:
            raise TraceError(
                f"{path.name} unpacks to {total / 2**20:.0f} MiB, over the {budget.max_bytes / 2**20:.0f} MiB limit"
            )
        sources, names = [], set()
        for m in sorted(members, key=lambda m: Path(m.filename).name):
            name = Path(m.filename).name  # never a path from the archive
            if name in names:
                raise TraceError(f"{path.name} holds two files named {name}")
            names.add(name)
            sources.append(TraceSource(name, lambda m=m: z.open(m), m.file_size, archive=path.name))
        df = load_sources(sources, path.name, budget=budget, max_event_bytes=max_event_bytes, keep_args=keep_args)
    df.attrs["files"] = [path.name]
    return df
