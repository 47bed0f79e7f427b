"""Load any supported trace into the event table, recognising the format from the file's first bytes.

Supported inputs: a Kineto JSON file (``.json`` or ``.json.gz``), a folder of per-rank Kineto files,
a ``.zip`` of them, an Nsight Systems SQLite export, or one of our run directories (whose context, the
device it ran on and its optimizer's size, comes along in the table's attrs). The name is not trusted.
"""

from __future__ import annotations

import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from advisor.errors import TraceError
from advisor.store.runstore import is_run_dir, run_context, run_trace
from advisor.trace.kineto import DEFAULT_MAX_BYTES, copy_zip_member, load_kineto
from advisor.trace.nsys import load_nsys_sqlite

SQLITE_MAGIC = b"SQLite format 3\x00"
GZIP_MAGIC = b"\x1f\x8b"
MAX_ZIP_MEMBERS = 1024
FORMATS = "Kineto JSON (.json, .json.gz, a folder or .zip of rank files) or an Nsight Systems SQLite export"


def load_trace(
    path: str | Path, *, max_bytes: int = DEFAULT_MAX_BYTES, keep_args: Callable[[str], bool] | None = None
) -> pd.DataFrame:
    """The event table of any supported trace at ``path`` (see the module docstring); ``keep_args``
    as ``load_kineto``'s (an nsys export records no args). One of our run directories gives its
    trace (one file, or one per rank) with ``attrs["own_run"]`` set and ``attrs["run"]`` the run's
    context (``advisor.store.runstore.run_context``: its device, its optimizer's parameters)."""
    p = Path(path)
    if p.is_dir():
        if is_run_dir(p):
            inner = run_trace(p)
            if not inner.exists():
                raise TraceError(f"run {p.name} has no trace (its status says why)")
            df = load_kineto(inner, max_bytes=max_bytes, keep_args=keep_args)
            df.attrs["own_run"] = True
            df.attrs["run"] = run_context(p)
            return df
        return load_kineto(p, max_bytes=max_bytes, keep_args=keep_args)
    if not p.is_file():
        raise TraceError(f"no file or folder {p.name}")
    with open(p, "rb") as f:
        head = f.read(16)
    if head.startswith(SQLITE_MAGIC):
        return load_nsys_sqlite(p, max_bytes=max_bytes)
    if zipfile.is_zipfile(p):
        return _load_zip(p, max_bytes, keep_args)
    if head.startswith(GZIP_MAGIC) or head.lstrip()[:1] in (b"{", b"["):
        return load_kineto(p, max_bytes=max_bytes, keep_args=keep_args)
    raise TraceError(f"{p.name} is not a trace this tool reads; expected {FORMATS}")


def _load_zip(path: Path, max_bytes: int, keep_args: Callable[[str], bool] | None) -> pd.DataFrame:
    """Rank files from a zip: only .json/.json.gz members, no paths kept, total size capped."""
    with zipfile.ZipFile(path) as z:
        members = [m for m in z.infolist() if not m.is_dir() and m.filename.endswith((".json", ".json.gz"))]
        if not members:
            raise TraceError(f"{path.name} holds no .json or .json.gz files")
        if len(members) > MAX_ZIP_MEMBERS:
            raise TraceError(f"{path.name} holds {len(members)} trace files; at most {MAX_ZIP_MEMBERS}")
        total = sum(m.file_size for m in members)
        if total > max_bytes:
            raise TraceError(
                f"{path.name} unpacks to {total / 2**20:.0f} MiB, over the {max_bytes / 2**20:.0f} MiB limit"
            )
        with tempfile.TemporaryDirectory(prefix="advisor-zip-") as tmp:
            names: set[str] = set()
            for m in members:
                name = Path(m.filename).name  # never a path from the archive
                if name in names:
                    raise TraceError(f"{path.name} holds two files named {name}")
                names.add(name)
                copy_zip_member(z, m, Path(tmp) / name, path.name)
            df = load_kineto(tmp, max_bytes=max_bytes, keep_args=keep_args)
    df.attrs["files"] = [path.name]
    return df
