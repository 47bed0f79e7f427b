"""Load PyTorch profiler (Kineto) Chrome-trace JSON into the event table, in bounded memory.

Accepts a ``.json`` or ``.json.gz`` file, or a folder of per-rank files. The ``traceEvents`` array is
read in blocks: each block is cut at the end of its last complete event (found with vectorised
bracket/string bookkeeping), parsed with orjson and turned into columns at once, so neither the whole
raw JSON nor a tree of Python objects for it is ever held; only the compact columns grow. A gzip
stream is capped at ``max_bytes`` decompressed (a gzip bomb stops there with an error).

Times: Kineto writes microseconds with fractional nanoseconds; they become integer nanoseconds.
The rank comes from ``distributedInfo.rank``, else from a ``rank-N`` / ``rank_N`` file name, else 0.
"""

from __future__ import annotations

import gzip
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pandas as pd

from advisor.errors import TraceError
from advisor.trace_table import concat_tables, make_table

BLOCK_BYTES = 32 * 2**20
DEFAULT_MAX_BYTES = 8 * 2**30
_CAT_KIND = {
    "kernel": "kernel",
    "gpu_memcpy": "memcpy",
    "gpu_memset": "memset",
    "cuda_runtime": "runtime",
    "cuda_driver": "runtime",
    "cpu_op": "cpu_op",
    "operator": "cpu_op",
    "user_annotation": "annotation",
    "gpu_user_annotation": "annotation",
    "python_function": "other",
    "cpu_instant_event": "other",
}
_COPY = re.compile(r"Memcpy (HtoD|DtoH|DtoD|HtoH|PtoP)(?: \((\w+) -> (\w+)\))?")
_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)


def trace_files(path: Path) -> list[Path]:
    """The trace files at ``path``: the file itself, or the .json/.json.gz files of a folder."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.name.endswith((".json", ".json.gz")) and p.is_file())
        if not files:
            raise TraceError(f"folder {path.name} holds no .json or .json.gz trace files")
        return files
    if not path.is_file():
        raise TraceError(f"no trace file {path.name}")
    return [path]


def load_kineto(
    path: str | Path, *, max_bytes: int = DEFAULT_MAX_BYTES, block_bytes: int = BLOCK_BYTES
) -> pd.DataFrame:
    """The event table of one Kineto trace file or a folder of rank files.

    ``max_bytes`` caps each file's (decompressed) size. Raises TraceError on anything that is not a
    Kineto trace: damaged gzip, invalid JSON, another JSON schema, or a trace with no events.
    """
    files = trace_files(Path(path))
    tables, meta = [], []
    for i, f in enumerate(files):
        table, info = _load_file(f, max_bytes, block_bytes, default_rank=i)
        tables.append(table)
        meta.append(info)
    ranks = [m["rank"] for m in meta]
    if len(set(ranks)) != len(ranks):
        raise TraceError(f"several files claim the same rank ({sorted(ranks)}); give one file per rank")
    df = concat_tables(tables)
    df.attrs.update(source="kineto", files=[f.name for f in files], ranks=sorted(ranks), meta=meta)
    return df


def _open(path: Path, max_bytes: int):
    raw = path.stat().st_size
    gz = path.name.endswith(".gz")
    if not gz and raw > max_bytes:
        raise TraceError(f"{path.name} is {raw / 2**20:.0f} MiB, over the {max_bytes / 2**20:.0f} MiB limit")
    return gzip.open(path, "rb") if gz else open(path, "rb")


def _blocks(path: Path, max_bytes: int, block_bytes: int) -> Iterator[bytes]:
    total = 0
    try:
        with _open(path, max_bytes) as f:
            while block := f.read(block_bytes):
                total += len(block)
                if total > max_bytes:
                    raise TraceError(
                        f"{path.name} decompresses to over {max_bytes / 2**20:.0f} MiB; refusing it (limit max_bytes)"
                    )
                yield block
    except (EOFError, OSError, zlib.error) as err:
        raise TraceError(f"{path.name} is damaged or not gzip ({type(err).__name__}: {err})") from None


def _load_file(path: Path, max_bytes: int, block_bytes: int, default_rank: int) -> tuple[pd.DataFrame, dict]:
    cols: dict[str, list] = {k: [] for k in _COLUMN_NAMES}
    names: dict[str, int] = {}
    head = bytearray()  # the JSON outside traceEvents, kept to read the metadata
    tail = bytearray()
    state = "head"
    carry = b""
    for block in _blocks(path, max_bytes, block_bytes):
        if state == "head":
            head += block
            at = head.find(b'"traceEvents"')
            if at < 0:
                if len(head) > 64 * 2**20:
                    raise TraceError(
                        f"{path.name} is JSON without a traceEvents array in its first 64 MiB: not a Kineto trace"
                    )
                continue
            start = head.find(b"[", at)
            if start < 0:
                continue
            carry = bytes(head[start + 1 :])
            del head[start + 1 :]
            head += b"]"
            state = "events"
        else:
            carry += block
        if state == "events":
            cut, end = _last_event_end(carry)
            if cut:
                _add_events(carry[:cut], cols, names, path)
            if end is not None:
                tail += carry[end + 1 :]
                carry = b""
                state = "tail"
            else:
                carry = carry[cut:]
        elif state == "tail":
            tail += carry
            carry = b""
    if state == "head":
        _check_json(bytes(head), path)
        raise TraceError(f"{path.name} is JSON without a traceEvents array: not a Kineto (PyTorch profiler) trace")
    if state == "events":
        raise TraceError(f"{path.name} ends inside its traceEvents array: the file is truncated")
    meta = _metadata(bytes(head) + bytes(tail), path)
    rank = _rank(meta, path, default_rank)
    n = len(cols["start_ns"])
    if n == 0:
        raise TraceError(f"{path.name} holds no trace events")
    table = make_table(
        {
            "rank": rank,
            "kind": cols["kind"],
            "name": pd.Categorical.from_codes(np.asarray(cols["name"], dtype=np.int64), categories=list(names)),
            "start_ns": cols["start_ns"],
            "dur_ns": cols["dur_ns"],
            "device": cols["device"],
            "stream": cols["stream"],
            "tid": cols["tid"],
            "correlation": cols["correlation"],
            "bytes": cols["bytes"],
            "copy_kind": cols["copy_kind"],
            "host_mem": cols["host_mem"],
        },
        n=n,
    )
    return table, {
        "file": path.name,
        "rank": rank,
        **{k: meta[k] for k in ("distributedInfo", "deviceProperties") if k in meta},
    }


_COLUMN_NAMES = (
    "kind",
    "name",
    "start_ns",
    "dur_ns",
    "device",
    "stream",
    "tid",
    "correlation",
    "bytes",
    "copy_kind",
    "host_mem",
)


def _last_event_end(buf: bytes) -> tuple[int, int | None]:
    """(cut, end): ``buf[:cut]`` holds whole events of the traceEvents array (``buf`` starts at an event
    boundary, outside any string); ``end`` is the index of the array's closing ']' if it is in ``buf``.

    Only the positions of quotes and brackets are materialised: a bracket is inside a string when an
    odd number of unescaped quotes precede it; depth is the running sum over brackets outside strings.
    """
    a = np.frombuffer(buf, dtype=np.uint8)
    quotes = np.flatnonzero(a == 34)
    if quotes.size:
        # A quote preceded by an odd run of backslashes is escaped (rare: count those runs one by one).
        escaped = []
        for q in quotes[(quotes > 0) & (a[quotes - 1] == 92)].tolist():
            j = q - 1
            while j >= 0 and buf[j] == 92:
                j -= 1
            if (q - 1 - j) % 2:
                escaped.append(q)
        if escaped:
            quotes = np.setdiff1d(quotes, np.asarray(escaped))
    opens = np.flatnonzero((a == 123) | (a == 91))
    closes = np.flatnonzero((a == 125) | (a == 93))
    idx = np.concatenate([opens, closes])
    step = np.concatenate([np.ones(opens.size, np.int32), -np.ones(closes.size, np.int32)])
    order = np.argsort(idx, kind="stable")
    idx, step = idx[order], step[order]
    outside = np.searchsorted(quotes, idx) % 2 == 0
    idx, step = idx[outside], step[outside]
    depth = np.cumsum(step)
    ends = idx[depth == -1]
    array_end = int(ends[0]) if ends.size else None
    done = idx[(step == -1) & (depth == 0)]
    if array_end is not None:
        done = done[done < array_end]
    return (int(done[-1]) + 1 if done.size else 0), array_end


def _add_events(chunk: bytes, cols: dict[str, list], names: dict[str, int], path: Path) -> None:
    text = chunk.strip().strip(b",")
    if not text:
        return
    try:
        events = orjson.loads(b"[" + text + b"]")
    except orjson.JSONDecodeError as err:
        raise TraceError(f"{path.name} is not valid JSON inside traceEvents ({err})") from None
    kind_append, name_append = cols["kind"].append, cols["name"].append
    for e in events:
        if not isinstance(e, dict):
            raise TraceError(f"{path.name}: traceEvents holds a {type(e).__name__}, expected objects")
        ph = e.get("ph")
        args = e.get("args") or {}
        if ph == "X":
            kind = _CAT_KIND.get(e.get("cat", ""))
            if kind is None:
                continue
            dur = e.get("dur", 0)
        elif ph == "i" and e.get("name") == "[memory]":
            kind, dur = "memory", 0
        else:
            continue
        try:
            name = str(e.get("name", ""))
            start = round(float(e["ts"]) * 1000)
            dur_ns = round(float(dur) * 1000)
        except (KeyError, TypeError, ValueError):
            raise TraceError(f"{path.name}: an event lacks a numeric ts/dur: {str(e)[:200]}") from None
        code = names.get(name)
        if code is None:
            code = names[name] = len(names)
        kind_append(kind)
        name_append(code)
        cols["start_ns"].append(start)
        cols["dur_ns"].append(dur_ns)
        gpu = kind in ("kernel", "memcpy", "memset") or (kind == "annotation" and e.get("cat") == "gpu_user_annotation")
        if kind == "memory":
            device = int(args.get("Device Id", -1)) if args.get("Device Type") == 1 else -1
            cols["bytes"].append(int(args.get("Bytes", 0)))
        else:
            device = int(args.get("device", -1)) if gpu else -1
            cols["bytes"].append(int(args.get("bytes", 0) or 0))
        cols["device"].append(device)
        cols["stream"].append(int(args.get("stream", e.get("tid", -1))) if gpu else -1)
        tid = e.get("tid", -1)
        cols["tid"].append(-1 if gpu or not isinstance(tid, int) else tid)
        cols["correlation"].append(int(args.get("correlation", -1)))
        copy_kind, host_mem = "", ""
        if kind == "memcpy":
            m = _COPY.match(name)
            if m:
                copy_kind = m.group(1)
                sides = {m.group(2), m.group(3)} - {None, "Device"}
                host_mem = next((s.lower() for s in sides if s.lower() in ("pageable", "pinned", "managed")), "")
        cols["copy_kind"].append(copy_kind)
        cols["host_mem"].append(host_mem)


def _check_json(text: bytes, path: Path) -> None:
    try:
        orjson.loads(text)
    except orjson.JSONDecodeError as err:
        raise TraceError(f"{path.name} is not valid JSON ({err})") from None


def _metadata(text: bytes, path: Path) -> dict[str, Any]:
    try:
        meta = orjson.loads(text)
    except orjson.JSONDecodeError as err:
        raise TraceError(f"{path.name} is not valid JSON outside traceEvents ({err})") from None
    if not isinstance(meta, dict):
        raise TraceError(f"{path.name}: the top level is not a JSON object; not a Kineto trace")
    return meta


def _rank(meta: dict, path: Path, default: int) -> int:
    info = meta.get("distributedInfo")
    if isinstance(info, dict) and isinstance(info.get("rank"), int):
        return info["rank"]
    m = _RANK_IN_NAME.search(path.name)
    return int(m.group(1)) if m else default
