"""Hostile traces, generated (nothing large is committed): each failure class of issue 22 that a small
upload can cause, for tests/test_hostile_traces.py and bench/hostile_inputs.py. Sizes are parameters, so
a test builds a small one and the benchmark the issue's full size; big bodies are written in chunks,
never held whole."""

from __future__ import annotations

import gzip
import json
import sqlite3
import struct
import zipfile
from collections.abc import Iterable, Iterator
from contextlib import closing
from pathlib import Path

CHUNK = 2**20
HEAD = b'{"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H100", "totalGlobalMem": 85}],\n'


def events(n: int) -> list[dict]:
    """``n`` events in Kineto's shape: pairs of a launch (cuda_runtime) and its kernel, 10 us apart."""
    out = []
    for i in range(n // 2):
        ts = 1_000 + 10 * i
        out.append(
            {
                "ph": "X",
                "cat": "cuda_runtime",
                "name": "cudaLaunchKernel",
                "pid": 1,
                "tid": 1,
                "ts": ts,
                "dur": 4,
                "args": {"correlation": i},
            }
        )
        out.append(
            {
                "ph": "X",
                "cat": "kernel",
                "name": f"gemm_{i % 7}",
                "pid": 0,
                "tid": 7,
                "ts": ts + 5,
                "dur": 3,
                "args": {"device": 0, "stream": 7, "correlation": i},
            }
        )
    return out


def event_bytes(evs: list[dict]) -> bytes:
    """The events as Kineto writes them: one per line, each but the last closed by "},"."""
    return b",\n".join(json.dumps(e, separators=(", ", ": ")).encode() for e in evs)


def trace_bytes(evs: list[dict]) -> bytes:
    return HEAD + b'"traceEvents": [\n' + event_bytes(evs) + b'\n],\n"traceName": "t"}'


def _repeat(byte: bytes, n: int) -> Iterator[bytes]:
    block = byte * CHUNK
    for done in range(0, n, CHUNK):
        yield block[: min(CHUNK, n - done)]


def write_gz(path: Path, parts: Iterable[bytes]) -> Path:
    with gzip.open(path, "wb", compresslevel=6) as f:
        for part in parts:
            f.write(part)
    return path


def long_name(path: Path, name_bytes: int, *, closed: bool = False, n_events: int = 100) -> Path:
    """A gzip trace whose one event's name is ``name_bytes`` of "a": unterminated (no "}," ever comes:
    the issue's 65 KB upload at 64 MiB), or ``closed`` and followed by ``n_events`` ordinary events."""
    head = HEAD + b'"traceEvents": [\n{"ph": "X", "cat": "kernel", "name": "'
    parts = [head, *_repeat(b"a", name_bytes)]
    if closed:
        parts.append(b'", "pid": 0, "tid": 7, "ts": 1, "dur": 1, "args": {"device": 0, "stream": 7}},\n')
        parts.append(event_bytes(events(n_events)) + b"\n]}")
    return write_gz(path, parts)


def padded(path: Path, evs: list[dict], pad_bytes: int) -> Path:
    """A zip (``.zip``) or gzip (``.json.gz``) holding a valid trace followed by ``pad_bytes`` of blanks."""
    body = trace_bytes(evs)
    if path.suffix == ".zip":
        with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z, z.open("rank-0.json", "w") as f:
            f.write(body)
            for part in _repeat(b" ", pad_bytes):
                f.write(part)
        return path
    return write_gz(path, [body, *_repeat(b" ", pad_bytes)])


def string_after(path: Path, evs: list[dict], string_bytes: int) -> Path:
    """A gzip trace whose metadata after the events holds a ``string_bytes`` string."""
    head = HEAD + b'"traceEvents": [\n' + event_bytes(evs) + b'\n],\n"junk": "'
    return write_gz(path, [head, *_repeat(b"x", string_bytes), b'"}'])


def lying_zip(path: Path, evs: list[dict]) -> Path:
    """A zip whose one member's headers (local and central) say it unpacks to 16 bytes."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("rank-0.json", trace_bytes(evs))
    data = bytearray(path.read_bytes())
    local = data.find(b"PK\x03\x04")
    central = data.find(b"PK\x01\x02")
    struct.pack_into("<I", data, local + 22, 16)  # uncompressed size in the local header
    struct.pack_into("<I", data, central + 24, 16)  # and in the central directory
    path.write_bytes(bytes(data))
    return path


def kineto_file(path: Path, evs: list[dict]) -> Path:
    path.write_bytes(trace_bytes(evs))
    return path


NSYS_SCHEMA = {
    "StringIds": "id INTEGER PRIMARY KEY, value TEXT NOT NULL",
    "CUPTI_ACTIVITY_KIND_KERNEL": "start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId INTEGER, streamId INTEGER, "
    "correlationId INTEGER, globalPid INTEGER, demangledName INTEGER, shortName INTEGER",
    "CUPTI_ACTIVITY_KIND_MEMCPY": "start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId INTEGER, streamId INTEGER, "
    "correlationId INTEGER, globalPid INTEGER, bytes INTEGER, copyKind INTEGER, srcKind INTEGER, dstKind INTEGER",
    "ENUM_CUDA_MEM_KIND": "id INTEGER NOT NULL, name TEXT, label TEXT",
    "TARGET_INFO_GPU": "id INTEGER, name TEXT",
}


def nsys_export(path: Path) -> Path:
    """A small export in nsys' schema (the columns the loader reads): two kernels and a pageable HtoD
    copy on device 0 of OS pid 7, times in ns; a test then spoils one value with SQL."""
    pid = 7 << 24
    with closing(sqlite3.connect(path)) as conn, conn:
        for table, columns in NSYS_SCHEMA.items():
            conn.execute(f"CREATE TABLE {table} ({columns})")
        conn.executemany("INSERT INTO StringIds VALUES (?, ?)", [(1, "gemm_kernel"), (2, "gemm")])
        kernels = [(1_000, 5_000, 0, 7, 1, pid, 1, 2), (6_000, 9_000, 0, 7, 2, pid, 1, 2)]
        conn.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, ?, ?, ?, ?, ?, ?)", kernels)
        conn.execute("INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY VALUES (100, 900, 0, 7, 3, ?, 4096, 1, 0, 2)", (pid,))
        conn.executemany(
            "INSERT INTO ENUM_CUDA_MEM_KIND VALUES (?, ?, ?)",
            [(0, "CUDA_MEMOPR_MEMORY_KIND_PAGEABLE", "Pageable"), (2, "CUDA_MEMOPR_MEMORY_KIND_DEVICE", "Device")],
        )
        conn.execute("INSERT INTO TARGET_INFO_GPU VALUES (0, 'NVIDIA H100 80GB HBM3')")
    return path
