"""Small C helpers compiled on first use with the machine's C compiler, cached by source and flags."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from advisor.errors import AdvisorError


def cache_dir() -> Path:
    """Where compiled helpers are kept: $ADVISOR_CACHE, else ~/.cache/advisor."""
    return Path(os.environ.get("ADVISOR_CACHE", Path.home() / ".cache" / "advisor"))


def build_shared(
    source: Path, flags: list[str], libs: list[str], *, stem: str, purpose: str, out_dir: Path | None = None
) -> Path:
    """``source`` compiled into a shared library named ``stem-<hash of source and flags>.so`` in
    ``out_dir`` (else cache_dir()), or the one already there; returns its path. AdvisorError, led by
    ``purpose``, where there is no C compiler or the compile fails."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        raise AdvisorError(f"{purpose} builds a small C helper and needs a C compiler (cc or gcc) on the PATH")
    flags = ["-O2", "-shared", "-fPIC", "-Wall", *flags]
    key = hashlib.sha256(source.read_bytes() + " ".join(flags + libs).encode()).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    lib = out_dir / f"{stem}-{key}.so"
    if lib.is_file():
        return lib
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        proc = subprocess.run([cc, *flags, str(source), "-o", str(tmp), *libs], capture_output=True, text=True)
    except OSError as err:
        raise AdvisorError(f"{purpose}: compiling {source.name} failed: {err}") from None
    if proc.returncode:
        raise AdvisorError(f"{purpose}: compiling {source.name} failed: {proc.stderr.strip()[-600:]}")
    os.replace(tmp, lib)
    return lib
