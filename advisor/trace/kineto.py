"""Load PyTorch profiler (Kineto) Chrome-trace JSON into the event table, in bounded memory.

Accepts a ``.json`` or ``.json.gz`` file, or a folder of per-rank files. The ``traceEvents`` array is
read in small blocks: each block is cut at the end of its last complete event (found with vectorised
bracket/string bookkeeping), parsed with orjson (the standard library's json where orjson is missing)
and turned into numpy columns at once, so neither the whole raw JSON nor a tree of Python objects for
it is ever held; only the compact columns grow. A
gzip stream is capped at ``max_bytes`` decompressed (a gzip bomb stops there with an error).

Times: Kineto writes microseconds with fractional nanoseconds; they become integer nanoseconds.
The rank comes from ``distributedInfo.rank``, else from a ``rank-N`` / ``rank_N`` file name, else 0.

A folder may hold more than rank files. What ``analyze --save`` writes there (ANALYSIS_FILE, and
``<trace>`` + METRICS_SUFFIX beside a trace file) is never read as a trace, so a folder analyzes the
same after a save; any other JSON without a traceEvents array is skipped when the folder's other files
are traces, and named in the table's ``skipped_files``.
"""

from __future__ import annotations

import gc
import gzip
import itertools
import re
import zipfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from advisor.errors import TraceError
from advisor.trace.table import COPY_KINDS, HOST_MEM, KINDS, EventArgs, concat_tables, make_table

try:  # 3-5x faster than the standard library's parser on large traces
    from orjson import loads as json_loads
except ImportError:  # an optional speed-up (a GPU box's image may lack it): the same JSON, parsed slower
    from json import loads as json_loads

# Small blocks keep each block's parsed objects in the CPU caches while they are turned into columns:
# on a 100 MiB trace, 256 KiB blocks load 3-4x faster than 32 MiB ones (bench/analyze_speed.py).
BLOCK_BYTES = 256 * 2**10
DEFAULT_MAX_BYTES = 8 * 2**30
_LIMIT_HINT = "raise the limit: analyze --max-mb, or max_bytes in the API"
_CAT_KIND = {
    "kernel": "kernel",
    "gpu_memcpy": "memcpy",
    "gpu_memset": "memset",
    "cuda_runtime": "runtime",
    "cuda_driver": "runtime",
    # CUPTI synchronization records, written with _ExperimentalConfig(enable_cuda_sync_events=True): args
    # hold the device, the stream (-1 for a context sync) and the correlation id of the call that waited.
    "cuda_sync": "sync",
    "cpu_op": "cpu_op",
    "operator": "cpu_op",
    "user_annotation": "annotation",
    "gpu_user_annotation": "annotation",
    "python_function": "other",
    "cpu_instant_event": "other",
}
_CAT_CODE = {cat: i for i, cat in enumerate(_CAT_KIND)}
_MEMORY_CODE = len(_CAT_KIND)
_CODE_KIND = np.array([*(KINDS.index(k) for k in _CAT_KIND.values()), KINDS.index("memory")], dtype=np.int8)
# GPU-stream events: their device and stream come from args and they have no host thread. Where args
# lack them (every gpu_user_annotation, the GPU copy of a record_function range: CUDA and ROCm traces
# alike), Kineto's pid and tid are the device and the stream, as on every kernel that has both.
_CODE_GPU = np.array(
    [*(c in ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation", "cuda_sync") for c in _CAT_KIND), False]
)
_NO_ARGS: dict[str, Any] = {}
_CPU_OP = KINDS.index("cpu_op")
_COPY = re.compile(r"Memcpy (HtoD|DtoH|DtoD|HtoH|PtoP)(?: \((\w+) -> (\w+)\))?")
_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)
ANALYSIS_FILE = "analysis.json"
"""Where ``analyze --save`` writes the StepMetrics of a folder: inside it (not a trace; never loaded)."""
METRICS_SUFFIX = ".metrics.json"
"""``analyze --save`` of a trace file writes its StepMetrics beside it as ``<file name>`` + this."""


class NotKinetoError(TraceError):
    """A well-formed JSON file without a traceEvents array: another tool's file, not a damaged trace."""


def is_own_output(path: Path) -> bool:
    """Whether ``path`` is a StepMetrics file ``analyze --save`` wrote rather than a trace."""
    return path.name == ANALYSIS_FILE or path.name.endswith(METRICS_SUFFIX)


def trace_files(path: Path) -> list[Path]:
    """The trace files at ``path``: the file itself, or the .json/.json.gz files of a folder, less the
    files ``analyze --save`` wrote there (:func:`is_own_output`)."""
    if path.is_dir():
        files = sorted(
            p for p in path.iterdir() if p.name.endswith((".json", ".json.gz")) and p.is_file() and not is_own_output(p)
        )
        if not files:
            raise TraceError(f"folder {path} holds no .json or .json.gz trace files")
        return files
    if not path.is_file():
        raise TraceError(f"no trace file {path}")
    return [path]


def copy_zip_member(z: zipfile.ZipFile, member: zipfile.ZipInfo, dest: Path, archive: str) -> None:
    """Copy one member of an open zip to ``dest`` in 1 MiB chunks, refusing one that unpacks to more
    than its header says (the caller has checked the header's size against its limit)."""
    with z.open(member) as src, open(dest, "wb") as dst:
        copied = 0
        while chunk := src.read(2**20):
            copied += len(chunk)
            if copied > member.file_size:
                raise TraceError(f"{archive}: member {Path(member.filename).name} is larger than its header says")
            dst.write(chunk)


def load_kineto(
    path: str | Path,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    block_bytes: int = BLOCK_BYTES,
    keep_args: Callable[[str], bool] | None = None,
) -> pd.DataFrame:
    """The event table of one Kineto trace file or a folder of rank files.

    ``max_bytes`` caps each file's (decompressed) size. Raises TraceError on anything that is not a
    Kineto trace: damaged gzip, invalid JSON, another JSON schema, or a trace with no events. In a
    folder, a JSON file of another schema is skipped when other files are traces; the table's
    ``attrs["skipped_files"]`` names each with the reason.

    ``keep_args(name)``: the event names whose recorded ``args`` the analyses read (shapes, literal
    inputs, NCCL message sizes); those events' args, and every framework op's that carries a FLOP
    count, go to ``attrs["event_args"]`` (``advisor.trace.table.EventArgs``), so no analysis parses the
    file again. ``attrs["devices"]`` gives each rank's first device as (name, memory bytes).
    """
    files = trace_files(Path(path))
    tables, meta, skipped = [], [], []
    for f in files:
        try:
            with gc_paused():
                table, info = _load_file(f, max_bytes, block_bytes, len(tables), keep_args)
        except NotKinetoError as err:
            if len(files) == 1:
                raise
            skipped.append(str(err))
            continue
        tables.append(table)
        meta.append(info)
    if not tables:
        raise TraceError(f"folder {path} holds no Kineto trace: {'; '.join(skipped)}")
    ranks = [m["rank"] for m in meta]
    if len(set(ranks)) != len(ranks):
        raise TraceError(f"several files claim the same rank ({sorted(ranks)}); give one file per rank")
    offsets = np.cumsum([0, *(len(t) for t in tables)]).tolist()
    df = concat_tables(tables)
    # Only small values in attrs: pandas deep-copies them on nearly every operation on the table
    # (EventArgs, the large one, hands itself out as its copy).
    names = sorted({str(d.get("name")) for m in meta for d in m.get("deviceProperties") or [] if d.get("name")})
    df.attrs.update(
        source="kineto", files=[m["file"] for m in meta], ranks=sorted(ranks), gpu_names=names, skipped_files=skipped
    )
    df.attrs["devices"] = {m["rank"]: d for m in meta if (d := _first_device(m))}
    df.attrs["rank_files"] = {m["rank"]: m["file"] for m in meta}
    if keep_args is not None:
        kept = {off + row: a for off, m in zip(offsets, meta, strict=False) for row, a in m.pop("args")}
        df.attrs["event_args"] = EventArgs(kept)
    return df


def _first_device(meta: dict) -> tuple[str, int] | None:
    """(name, memory bytes) of the first device a file's deviceProperties names; None without one."""
    devices = [d for d in meta.get("deviceProperties") or [] if isinstance(d, dict) and d.get("name")]
    return (str(devices[0]["name"]), int(devices[0].get("totalGlobalMem") or 0)) if devices else None


class _ArgKeeper:
    """Picks, block by block, the events whose args a loader's caller wants kept: by name (judged
    once per distinct name, then a vectorised lookup per block), and any framework op with a FLOP
    count; records (row in the file, args)."""

    def __init__(self, wanted: Callable[[str], bool]) -> None:
        self._wanted = wanted
        self._judged = np.zeros(1024, dtype=bool)
        self._n_judged = 0
        self._row = 0
        self.kept: list[tuple[int, dict]] = []

    def _judge_new(self, names: dict[str, int]) -> None:
        new = len(names) - self._n_judged
        if not new:
            return
        if len(names) > len(self._judged):
            self._judged = np.resize(self._judged, 2 * len(names))
        fresh = list(itertools.islice(reversed(names), new))[::-1]  # the names added since the last block
        self._judged[self._n_judged : len(names)] = [self._wanted(n) for n in fresh]
        self._n_judged = len(names)

    def take(self, name: np.ndarray, kind: np.ndarray, args: list, names: dict[str, int]) -> None:
        self._judge_new(names)
        hit = self._judged[name]
        ops = np.flatnonzero((kind == _CPU_OP) & ~hit).tolist()
        hit[[i for i in ops if "flops" in args[i]]] = True
        self.kept += [(self._row + i, args[i]) for i in np.flatnonzero(hit).tolist()]
        self._row += len(name)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector: parsing makes millions of short-lived dicts and no cycles,
    and the collector's passes over them cost about a quarter of the load time."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _mib(n_bytes: float) -> str:
    """Bytes in MiB with the precision a limit like ``--max-mb 0.1`` needs: '8,192', '1.5', '0.1'."""
    mib = n_bytes / 2**20
    return f"{mib:,.0f}" if mib >= 100 else f"{mib:.3g}"


def _open(path: Path, max_bytes: int):
    raw = path.stat().st_size
    gz = path.name.endswith(".gz")
    if not gz and raw > max_bytes:
        raise TraceError(f"{path.name} is {_mib(raw)} MiB, over the {_mib(max_bytes)} MiB limit ({_LIMIT_HINT})")
    return gzip.open(path, "rb") if gz else open(path, "rb")


def _blocks(path: Path, max_bytes: int, block_bytes: int) -> Iterator[bytes]:
    total = 0
    try:
        with _open(path, max_bytes) as f:
            while block := f.read(block_bytes):
                total += len(block)
                if total > max_bytes:
                    raise TraceError(
                        f"{path.name} decompresses to over {_mib(max_bytes)} MiB; refusing it ({_LIMIT_HINT})"
                    )
                yield block
    except (EOFError, OSError, zlib.error) as err:
        raise TraceError(f"{path.name} is damaged or not gzip ({type(err).__name__}: {err})") from None


def stream_events(
    path: Path,
    on_events: Callable[[list], None],
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    block_bytes: int = BLOCK_BYTES,
) -> dict[str, Any]:
    """Parse one Kineto file block by block, handing each block's whole events (a list of dicts) to
    ``on_events`` as they are parsed, so no more than a block of parsed events is alive at once;
    returns the trace's metadata (everything outside traceEvents). Raises TraceError on anything that
    is not a Kineto trace (damaged gzip, invalid JSON, no traceEvents array, a truncated file)."""
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
                    raise NotKinetoError(
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
            carry, after = _take_events(carry, path, on_events, last=False)
            if after is not None:
                tail += after
                state = "tail"
        elif state == "tail":
            tail += carry
            carry = b""
    if state == "head":
        _check_json(bytes(head), path)
        raise NotKinetoError(f"{path.name} is JSON without a traceEvents array: not a Kineto (PyTorch profiler) trace")
    if state == "events":  # the array's end is in what is left, or the file is cut short
        carry, after = _take_events(carry, path, on_events, last=True)
        if after is None:
            raise TraceError(f"{path.name} ends inside its traceEvents array: the file is truncated")
        tail += after
    return _metadata(bytes(head) + bytes(tail), path)


def _load_file(
    path: Path, max_bytes: int, block_bytes: int, default_rank: int, keep_args: Callable[[str], bool] | None
) -> tuple[pd.DataFrame, dict]:
    parts: list[dict[str, np.ndarray]] = []
    names: dict[str, int] = {}
    keeper = _ArgKeeper(keep_args) if keep_args is not None else None

    def columns(events: list) -> None:
        if part := _events_to_columns(events, names, path, keeper):
            parts.append(part)

    meta = stream_events(path, columns, max_bytes=max_bytes, block_bytes=block_bytes)
    rank = _rank(meta, path, default_rank)
    if not parts:
        raise TraceError(f"{path.name} holds no trace events")
    cols = {k: np.concatenate([p.pop(k) for p in parts]) for k in list(parts[0])}  # frees each part as it goes
    n = len(cols["start_ns"])
    copy_kind, host_mem = _copy_columns(cols["kind"], cols["name"], list(names))
    table = make_table(
        {
            "rank": rank,
            "kind": pd.Categorical.from_codes(cols.pop("kind"), categories=KINDS),
            "name": pd.Categorical.from_codes(cols.pop("name"), categories=list(names)),
            **cols,
            "copy_kind": copy_kind,
            "host_mem": host_mem,
        },
        n=n,
    )
    return table, {
        "file": path.name,
        "rank": rank,
        **{k: meta[k] for k in ("distributedInfo", "deviceProperties") if k in meta},
        "args": keeper.kept if keeper is not None else [],
    }


def _take_events(
    carry: bytes, path: Path, on_events: Callable[[list], None], *, last: bool
) -> tuple[bytes, bytes | None]:
    """Hand the whole events at the start of ``carry`` to ``on_events``; return
    (the rest of ``carry``, the bytes after the traceEvents array's end or None while inside it).
    ``last``: no more bytes follow, so the array's end must be in ``carry``.

    Kineto closes each event with "}," and a prefix of ``carry`` that ends at one and parses as a JSON
    array ends at an event boundary: a cut inside a string leaves the string unterminated, one inside
    an event leaves an object open. So a block is cut at its last "}," and parsed at once; only when
    that fails (the array's end is near, or an odd event) is the cut found by bracket bookkeeping,
    which took a fifth of the load time when every block went through it."""
    if not last:
        cut = carry.rfind(b"},") + 1
        if cut:
            try:
                events = json_loads(b"[" + carry[:cut].strip().strip(b",") + b"]")
            except ValueError:
                pass
            else:
                on_events(events)
                return carry[cut:], None
    cut, end = _last_event_end(carry)
    if cut:
        on_events(_parse_events(carry[:cut], path))
    return (b"", carry[end + 1 :]) if end is not None else (carry[cut:], None)


def _parse_events(chunk: bytes, path: Path) -> list:
    """The events of ``chunk``: whole events of traceEvents, comma separated."""
    text = chunk.strip().strip(b",")
    if not text:
        return []
    try:
        return json_loads(b"[" + text + b"]")
    except ValueError as err:
        raise TraceError(f"{path.name} is not valid JSON inside traceEvents ({err})") from None


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


def _events_to_columns(
    events: list, names: dict[str, int], path: Path, keeper: _ArgKeeper | None = None
) -> dict[str, np.ndarray] | None:
    """The columns of the kept ones of ``events`` (parsed from traceEvents); new names get the next
    code in ``names``. The per-event Python work is one pass to pick the kept events, then one
    comprehension per field; the rest is numpy over the block."""
    kept, codes, durs = [], [], []
    keep, code_of, dur_of = kept.append, codes.append, durs.append
    cat_code = _CAT_CODE.get
    for e in events:
        if type(e) is not dict:  # orjson makes exact dicts of JSON objects
            raise TraceError(f"{path.name}: traceEvents holds a {type(e).__name__}, expected objects")
        ph = e.get("ph")
        if ph == "X":
            code = cat_code(e.get("cat", ""))
            if code is None:
                continue
            dur_of(e.get("dur", 0))
        elif ph == "i" and e.get("name") == "[memory]":
            code = _MEMORY_CODE
            dur_of(0)
        else:
            continue
        keep(e)
        code_of(code)
    del events
    if not kept:
        return None
    code = np.array(codes, dtype=np.int8)
    gpu = _CODE_GPU[code]
    try:
        start_ns = _to_ns([e["ts"] for e in kept])
        dur_ns = _to_ns(durs)
    except (KeyError, TypeError, ValueError):
        bad = next((e for e, d in zip(kept, durs, strict=True) if not _numeric(e.get("ts")) or not _numeric(d)), {})
        raise TraceError(f"{path.name}: an event lacks a numeric ts/dur: {str(bad)[:200]}") from None
    new_code = names.setdefault
    name = np.array([new_code(str(e.get("name", "")), len(names)) for e in kept], dtype=np.int32)
    args = [e.get("args") or _NO_ARGS for e in kept]
    tid = np.array([t if isinstance(t := e.get("tid", -1), int) else -1 for e in kept], dtype=np.int64)
    nbytes = [a.get("bytes", 0) or 0 for a in args]
    device = np.full(len(kept), -1, dtype=np.int32)
    stream = np.full(len(kept), -1, dtype=np.int64)
    on_gpu = np.flatnonzero(gpu).tolist()
    if on_gpu:
        device[on_gpu] = [
            a["device"] if "device" in (a := args[i]) else _pid_device(kept[i].get("pid")) for i in on_gpu
        ]
        stream[on_gpu] = [args[i].get("stream", kept[i].get("tid", -1)) for i in on_gpu]
        tid[on_gpu] = -1
    for i in np.flatnonzero(code == _MEMORY_CODE).tolist():
        a = args[i]
        nbytes[i] = a.get("Bytes", 0)
        device[i] = int(a.get("Device Id", -1)) if a.get("Device Type") == 1 else -1
    kind = _CODE_KIND[code]
    if keeper is not None:
        keeper.take(name, kind, args, names)
    return {
        "kind": kind,
        "name": name,
        "start_ns": start_ns,
        "dur_ns": dur_ns,
        "device": device,
        "stream": stream,
        "tid": tid,
        "correlation": np.array([a.get("correlation", -1) for a in args], dtype=np.int64),
        "bytes": np.array(nbytes, dtype=np.int64),
    }


def _pid_device(pid: object) -> int:
    """The device a GPU-stream event's pid names (-1 where it is not a device index)."""
    return pid if isinstance(pid, int) and not isinstance(pid, bool) and pid >= 0 else -1


def _to_ns(us: list) -> np.ndarray:
    """Microseconds (JSON numbers) to integer ns. Whole and fractional microseconds are converted
    apart: ``x * 1000`` in float64 would round epoch timestamps (~1.7e18 ns) to multiples of 256 ns."""
    x = np.array(us, dtype=np.float64)
    if not np.isfinite(x).all():  # None and "nan" become NaN here
        raise ValueError("not a finite number")
    whole = np.floor(x)
    return whole.astype(np.int64) * 1000 + np.rint((x - whole) * 1000).astype(np.int64)


def _numeric(x: object) -> bool:
    try:
        return bool(np.isfinite(float(x)))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


def _copy_columns(kind: np.ndarray, name: np.ndarray, names: list[str]) -> tuple[pd.Categorical, pd.Categorical]:
    """copy_kind and host_mem of every row, read once per distinct memcpy name ('' for other rows)."""
    copy_code = np.zeros(len(names), dtype=np.int8)
    mem_code = np.zeros(len(names), dtype=np.int8)
    for c in np.unique(name[kind == KINDS.index("memcpy")]).tolist():
        m = _COPY.match(names[c])
        if m:
            copy_code[c] = COPY_KINDS.index(m.group(1))
            sides = {m.group(2), m.group(3)} - {None, "Device"}
            host = next((s.lower() for s in sides if s.lower() in ("pageable", "pinned", "managed")), "")
            mem_code[c] = HOST_MEM.index(host)
    is_copy = kind == KINDS.index("memcpy")
    copy_kind = np.where(is_copy, copy_code[name], 0).astype(np.int8)
    host_mem = np.where(is_copy, mem_code[name], 0).astype(np.int8)
    return (
        pd.Categorical.from_codes(copy_kind, categories=COPY_KINDS),
        pd.Categorical.from_codes(host_mem, categories=HOST_MEM),
    )


def _check_json(text: bytes, path: Path) -> None:
    try:
        json_loads(text)
    except ValueError as err:
        raise TraceError(f"{path.name} is not valid JSON ({err})") from None


def _metadata(text: bytes, path: Path) -> dict[str, Any]:
    try:
        meta = json_loads(text)
    except ValueError as err:
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
