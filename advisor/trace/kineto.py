"""Load PyTorch profiler (Kineto) Chrome-trace JSON into the event table, in bounded memory.

Accepts a ``.json`` or ``.json.gz`` file, or a folder of per-rank files. The ``traceEvents`` array is
read in small blocks: each block is cut at the end of its last complete event (found with vectorised
bracket/string bookkeeping), parsed with orjson (the standard library's json where orjson is missing)
and turned into numpy columns at once, so neither the whole raw JSON nor a tree of Python objects for
it is ever held; only the compact columns grow.

Bounded work for any input (issue 22): each byte is searched and parsed once, so time is linear in the
decompressed bytes; ``max_bytes`` caps those over all files of one load (a gzip bomb stops there),
``max_event_bytes`` one event (a 64 MiB name stops at 16 MiB), and the JSON kept outside traceEvents
is capped at META_MAX_BYTES with blanks not kept (a file padded with 1 GiB of spaces holds one block
of them). A string value longer than MAX_STRING_BYTES (a 64 MiB name, loaded with the event cap
raised) is cut in the raw buffer before it is parsed, to its first STRING_KEEP_BYTES and a marker
saying how many bytes were dropped, so no string of absurd length is ever materialised beside its raw
bytes; the table's ``attrs["cut_strings"]`` counts them and ``attrs["skipped_files"]`` says so. A
``check`` callable runs before each block (the app's Cancel and time budget). A field of
the wrong type (``args.device: "zero"``) or a time out of range (1e30, a negative duration, a
boolean) is refused with the event and the field named.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pandas as pd

from advisor.errors import TraceError
from advisor.trace.table import COPY_KINDS, HOST_MEM, KINDS, EventArgs, concat_tables, make_table

try:  # 3-5x faster than the standard library's parser on large traces
    from orjson import loads as _view_loads  # reads a memoryview in place (the standard library's cannot)
    from orjson import loads as json_loads
except ImportError:  # an optional speed-up (a GPU box's image may lack it): the same JSON, parsed slower
    from json import loads as json_loads

    _view_loads = None

# Small blocks keep each block's parsed objects in the CPU caches while they are turned into columns:
# on a 100 MiB trace, 256 KiB blocks load 3-4x faster than 32 MiB ones (bench/analyze_speed.py).
BLOCK_BYTES = 256 * 2**10
DEFAULT_MAX_BYTES = 8 * 2**30
# The largest Kineto event seen in real traces is a few hundred KiB (an op with thousands of inputs
# listed in its Input Dims); a longer run of bytes without an event's end is refused, so one hostile
# event (a 64 MiB name) cannot hold its whole self in memory or be scanned again and again.
DEFAULT_MAX_EVENT_BYTES = 16 * 2**20
META_MAX_BYTES = 64 * 2**20  # the JSON outside traceEvents (metadata): a few KiB in real traces
# The longest string value kept whole. The real traces' longest is 5 KiB (a kernel name with its template
# arguments, tests/data/hta's alexnet trace) and their largest event 6 KiB (../shared/traces, our own
# runs: at most 2.4 KiB). A longer one is cut to its first STRING_KEEP_BYTES (a name still reads) and a
# marker before it is parsed, so a 64 MiB name costs its raw bytes only, not those and the parsed string.
MAX_STRING_BYTES = 2**20
STRING_KEEP_BYTES = 1024
# Times in microseconds (Kineto's unit) whose nanoseconds, and a start plus a duration, fit int64:
# 2**62 ns is 146 years; an epoch timestamp today is about 1.8e15 us, under a third of it.
MAX_TIME_US = 2**62 / 1000
_LIMIT_HINT = "raise the limit: analyze --max-mb, or max_bytes in the API"
_EVENT_HINT = "raise the limit: analyze --max-event-mb, or max_event_bytes in the API"
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


class TraceSource:
    """One trace file to read: its name (shown in messages; never a server path), how to open its raw
    bytes, their size, and whether they are gzip. A file on disk or a member of an open zip alike."""

    def __init__(self, name: str, opener: Callable[[], BinaryIO], size: int, *, archive: str = "") -> None:
        self.name = name
        self.open = opener
        self.size = size
        self.gz = name.endswith(".gz")
        self.archive = archive  # the zip it is a member of ('' for a file)

    @classmethod
    def of_file(cls, path: Path) -> TraceSource:
        return cls(path.name, lambda: open(path, "rb"), path.stat().st_size)

    def damaged(self, err: BaseException) -> str:
        """What to say when its bytes cannot be read."""
        why = f"{type(err).__name__}: {err}"
        if self.archive:
            return f"{self.archive}: member {self.name} is damaged or its header lies about its size ({why})"
        return f"{self.name} is damaged or not gzip ({why})"


@dataclass
class StringCuts:
    """What the loader cut from one file: string values over MAX_STRING_BYTES, the events holding
    them, and the bytes dropped (the kept prefixes and markers not counted)."""

    events: int = 0
    strings: int = 0
    dropped_bytes: int = 0

    def note(self, name: str) -> str:
        """The sentence the table's ``skipped_files`` carries for a file with cut strings."""
        return (
            f"{self.dropped_bytes:,} bytes of {self.strings:,} over-long string value(s) in {self.events:,} event(s) "
            f"of {name}: each string over {_mib(MAX_STRING_BYTES)} MiB keeps its first {STRING_KEEP_BYTES:,} bytes "
            "and ends with '...[N bytes cut]'"
        )


class ReadBudget:
    """What one request may read, over all its files together: ``max_bytes`` decompressed, and
    ``check()`` (a cancel or a deadline: it raises to stop) called before each block, so a stop
    takes effect within one block's work."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, check: Callable[[], None] | None = None) -> None:
        self.max_bytes = max_bytes
        self.check = check
        self.read_bytes = 0
        self._file_start = 0  # read_bytes where the file being read began
        self._file = ""

    @property
    def left_bytes(self) -> int:
        return self.max_bytes - self.read_bytes

    def charge(self, n_bytes: int, name: str) -> None:
        if self.check is not None:
            self.check()
        if name != self._file:
            self._file, self._file_start = name, self.read_bytes
        self.read_bytes += n_bytes
        if self.read_bytes > self.max_bytes:
            what = f"{name} and the files before it decompress" if self._file_start else f"{name} decompresses"
            raise TraceError(f"{what} to over {_mib(self.max_bytes)} MiB; refusing it ({_LIMIT_HINT})")


def load_kineto(
    path: str | Path,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
    block_bytes: int = BLOCK_BYTES,
    keep_args: Callable[[str], bool] | None = None,
    check: Callable[[], None] | None = None,
) -> pd.DataFrame:
    """The event table of one Kineto trace file or a folder of rank files.

    ``max_bytes`` caps the decompressed bytes read over all the files together, ``max_event_bytes``
    one event's; ``check()`` runs before each block read and stops the load by raising (a cancel, a
    deadline). Raises TraceError on anything that is not a Kineto trace: damaged gzip, invalid JSON,
    another JSON schema, a field of the wrong type or out of range, or a trace with no events. In a
    folder, a JSON file of another schema is skipped when other files are traces; the table's
    ``attrs["skipped_files"]`` names each with the reason.

    ``keep_args(name)``: the event names whose recorded ``args`` the analyses read (shapes, literal
    inputs, NCCL message sizes); those events' args, and every framework op's that carries a FLOP
    count, go to ``attrs["event_args"]`` (``advisor.trace.table.EventArgs``), so no analysis parses the
    file again. ``attrs["devices"]`` gives each rank's first device as (name, memory bytes).
    """
    p = Path(path)
    sources = [TraceSource.of_file(f) for f in trace_files(p)]
    return load_sources(
        sources,
        f"folder {p}" if p.is_dir() else p.name,
        budget=ReadBudget(max_bytes, check),
        max_event_bytes=max_event_bytes,
        block_bytes=block_bytes,
        keep_args=keep_args,
    )


def load_sources(
    sources: list[TraceSource],
    label: str,
    *,
    budget: ReadBudget,
    max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
    block_bytes: int = BLOCK_BYTES,
    keep_args: Callable[[str], bool] | None = None,
) -> pd.DataFrame:
    """The event table of the rank files ``sources`` (``label``: the folder or archive they came from),
    as :func:`load_kineto` gives it, read within ``budget``."""
    tables, meta, skipped = [], [], []
    for src in sources:
        try:
            with gc_paused():
                table, info = _load_file(src, budget, max_event_bytes, block_bytes, len(tables), keep_args)
        except NotKinetoError as err:
            if len(sources) == 1:
                raise
            skipped.append(str(err))
            continue
        tables.append(table)
        meta.append(info)
    if not tables:
        raise TraceError(f"{label} holds no Kineto trace: {'; '.join(skipped)}")
    ranks = [m["rank"] for m in meta]
    if len(set(ranks)) != len(ranks):
        raise TraceError(f"several files claim the same rank ({sorted(ranks)}); give one file per rank")
    offsets = np.cumsum([0, *(len(t) for t in tables)]).tolist()
    df = concat_tables(tables)
    # Only small values in attrs: pandas deep-copies them on nearly every operation on the table
    # (EventArgs, the large one, hands itself out as its copy).
    names = sorted({str(d.get("name")) for m in meta for d in m.get("deviceProperties") or [] if d.get("name")})
    cuts = [(m["file"], m["cuts"]) for m in meta if m["cuts"].strings]
    skipped += [c.note(name) for name, c in cuts]
    df.attrs.update(
        source="kineto", files=[m["file"] for m in meta], ranks=sorted(ranks), gpu_names=names, skipped_files=skipped
    )
    df.attrs["cut_strings"] = {name: c.strings for name, c in cuts}
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


def _blocks(src: TraceSource, budget: ReadBudget, block_bytes: int) -> Iterator[bytes]:
    """The decompressed bytes of ``src`` in blocks of ``block_bytes``, each charged to ``budget``."""
    if not src.gz and src.size > budget.left_bytes:
        over = f"over the {_mib(budget.max_bytes)} MiB limit" + (
            " with the files before it" if budget.read_bytes else ""
        )
        raise TraceError(f"{src.name} is {_mib(src.size)} MiB, {over} ({_LIMIT_HINT})")
    try:
        with src.open() as raw, gzip.GzipFile(fileobj=raw, mode="rb") if src.gz else raw as f:
            while block := f.read(block_bytes):
                budget.charge(len(block), src.name)
                yield block
    except (EOFError, OSError, zlib.error, zipfile.BadZipFile) as err:
        raise TraceError(src.damaged(err)) from None


class _Boundaries:
    """Where the events of a traceEvents array end, found incrementally: each byte is looked at once
    however many blocks an event spans (a rescan of the whole buffer per block made one 64 MiB name
    take 78 s). The buffer given to :meth:`scan` starts at an event boundary, outside any string, and
    only grows at its end between calls; only the positions of quotes and brackets are materialised.
    A bracket is inside a string when an odd number of unescaped quotes precede it; depth is the
    running sum over brackets outside strings."""

    def __init__(self) -> None:
        self.scanned = 0  # bytes of the buffer looked at
        self.depth = 0  # bracket depth at ``scanned``, 0 between events, -1 past the array's end
        self.in_string = False
        self.backslashes = 0  # the run of backslashes the scanned bytes end with
        self.done = 0  # the end of the last whole event
        self.array_end: int | None = None  # the index of the array's closing ']' once seen

    def scan(self, buf: bytearray) -> None:
        base = self.scanned
        if base >= len(buf) or self.array_end is not None:
            return
        a = np.frombuffer(buf, dtype=np.uint8, offset=base)
        quotes = np.flatnonzero(a == 34)
        plain = np.flatnonzero(a != 92)  # not a backslash: where a run of backslashes stops
        if quotes.size:
            # A quote preceded by an odd run of backslashes is escaped; a run may begin in an earlier block.
            before = np.searchsorted(plain, quotes) - 1
            run = np.where(before >= 0, quotes - 1 - plain[np.maximum(before, 0)], quotes + self.backslashes)
            quotes = quotes[run % 2 == 0]
        self.backslashes = len(a) - 1 - int(plain[-1]) if plain.size else self.backslashes + len(a)
        opens = np.flatnonzero((a == 123) | (a == 91))
        closes = np.flatnonzero((a == 125) | (a == 93))
        del a  # the buffer may grow once no view of it is left
        idx = np.concatenate([opens, closes])
        step = np.concatenate([np.ones(opens.size, np.int64), -np.ones(closes.size, np.int64)])
        order = np.argsort(idx, kind="stable")
        idx, step = idx[order], step[order]
        outside = (np.searchsorted(quotes, idx) + self.in_string) % 2 == 0
        idx, step = idx[outside], step[outside]
        depth = self.depth + np.cumsum(step)
        ends = idx[depth == -1]
        done = idx[(step == -1) & (depth == 0)]
        if ends.size:
            self.array_end = base + int(ends[0])
            done = done[done < ends[0]]
        if done.size:
            self.done = base + int(done[-1]) + 1
        self.depth = int(depth[-1]) if depth.size else self.depth
        self.in_string ^= bool(quotes.size % 2)
        self.scanned = len(buf)


class _EventReader:
    """Cuts the bytes of a traceEvents array, as they arrive, into whole events for ``on_events``.

    Kineto closes each event with "}," and a prefix of the buffer that ends at one and parses as a JSON
    array ends at an event boundary: a cut inside a string leaves the string unterminated, one inside
    an event leaves an object open. So a block is cut at its last "}," and parsed at once; only when
    that fails (the array's end is near, an event longer than a block, an odd event) is the cut found
    by _Boundaries, which took a fifth of the load time when every block went through it. Either way
    each byte is searched once and parsed once: the time is linear in the bytes."""

    def __init__(
        self, src: TraceSource, on_events: Callable[[list], None], max_event_bytes: int, cuts: StringCuts
    ) -> None:
        self.src = src
        self.on_events = on_events
        self.max_event_bytes = max_event_bytes
        self.cuts = cuts
        self.buf = bytearray()
        self.bounds: _Boundaries | None = None  # set while the fast cut has failed on the buffer
        self.after: bytes | None = None  # the bytes after the array's end, once found

    def feed(self, block: bytes) -> None:
        searched = max(0, len(self.buf) - 1)  # a "}," may straddle the previous block's end
        self.buf += block
        if self.bounds is None:
            cut = self.buf.rfind(b"},", searched) + 1
            # A prefix that could hold an over-long string goes through _Boundaries, which knows it ends
            # at an event's end: only there can its strings be found and cut (_cut_long_strings).
            if 0 < cut <= MAX_STRING_BYTES:
                try:
                    events = _parse_prefix(self.buf, cut)
                except ValueError:
                    pass
                else:
                    del self.buf[:cut]
                    self.on_events(events)
                    return
            self.bounds = _Boundaries()
        self._scan()
        if self.after is None and len(self.buf) > self.max_event_bytes:
            raise TraceError(
                f"{self.src.name}: traceEvents runs over {_mib(self.max_event_bytes)} MiB without an event's end "
                f"(one event that large, or not an array of objects); refusing it ({_EVENT_HINT})"
            )

    def _scan(self) -> None:
        bounds = self.bounds
        assert bounds is not None
        bounds.scan(self.buf)
        if bounds.done:
            if bounds.done > MAX_STRING_BYTES:
                shrunk = _cut_long_strings(self.buf, bounds.done, self.cuts)
                bounds.done -= shrunk
                bounds.array_end = None if bounds.array_end is None else bounds.array_end - shrunk
                bounds.scanned -= shrunk
            try:
                events = _parse_prefix(self.buf, bounds.done)
            except ValueError as err:
                raise TraceError(f"{self.src.name} is not valid JSON inside traceEvents ({err})") from None
            self.on_events(events)
        if bounds.array_end is not None:
            self.after = bytes(self.buf[bounds.array_end + 1 :])
            self.buf.clear()
        elif bounds.done:
            del self.buf[: bounds.done]
            self.bounds = None  # the rest starts at a boundary: the fast cut may work again

    def finish(self) -> bytes:
        """The bytes after the array's end; raises TraceError where the array never ends."""
        if self.after is None and self.buf:
            self.bounds = self.bounds or _Boundaries()
            self._scan()
        if self.after is None:
            raise TraceError(f"{self.src.name} ends inside its traceEvents array: the file is truncated")
        return self.after


def stream_events(
    src: TraceSource | Path,
    on_events: Callable[[list], None],
    *,
    budget: ReadBudget | None = None,
    max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
    block_bytes: int = BLOCK_BYTES,
    cuts: StringCuts | None = None,
) -> dict[str, Any]:
    """Parse one Kineto file block by block, handing each block's whole events (a list of dicts) to
    ``on_events`` as they are parsed, so no more than a block of parsed events is alive at once;
    returns the trace's metadata (everything outside traceEvents). Time is linear in the file's bytes,
    and memory bounded by a block, the longest event (at most ``max_event_bytes``) and the metadata
    (at most META_MAX_BYTES, blanks not counted). String values over MAX_STRING_BYTES are cut before
    parsing and counted in ``cuts``. Raises TraceError on anything that is not a Kineto trace (damaged
    gzip, invalid JSON, no traceEvents array, a truncated file) or over a limit."""
    src = TraceSource.of_file(src) if isinstance(src, Path) else src
    budget = budget or ReadBudget()
    head = bytearray()  # the JSON before traceEvents' elements, kept to read the metadata
    tail = bytearray()  # the JSON after them
    key = b'"traceEvents"'
    at, searched = -1, 0  # where the key is in head; how much of head has been searched
    reader: _EventReader | None = None
    for block in _blocks(src, budget, block_bytes):
        if reader is None:
            head += block
            if at < 0:
                at = head.find(key, max(0, searched - len(key)))
            start = head.find(b"[", max(at, searched)) if at >= 0 else -1
            searched = len(head)
            if start < 0:
                if len(head) > META_MAX_BYTES:
                    raise NotKinetoError(
                        f"{src.name} is JSON without a traceEvents array in its first {_mib(META_MAX_BYTES)} MiB: "
                        "not a Kineto trace"
                    )
                continue
            block = bytes(head[start + 1 :])
            del head[start + 1 :]
            head += b"]"
            reader = _EventReader(src, on_events, max_event_bytes, cuts if cuts is not None else StringCuts())
        if reader.after is None:
            reader.feed(block)
            if reader.after is None:
                continue
            block, reader.after = reader.after, b""
        if block.strip():  # blanks after the events (a padded file) are not kept
            tail += block
            if len(tail) > META_MAX_BYTES:
                raise TraceError(
                    f"{src.name}: the JSON after traceEvents is over {_mib(META_MAX_BYTES)} MiB; "
                    "a Kineto trace's metadata is a few KiB"
                )
    if reader is None:
        _check_json(bytes(head), src)
        raise NotKinetoError(f"{src.name} is JSON without a traceEvents array: not a Kineto (PyTorch profiler) trace")
    if reader.after is None:
        tail[:0] = reader.finish()
    return _metadata(bytes(head) + bytes(tail), src)


def _load_file(
    src: TraceSource,
    budget: ReadBudget,
    max_event_bytes: int,
    block_bytes: int,
    default_rank: int,
    keep_args: Callable[[str], bool] | None,
) -> tuple[pd.DataFrame, dict]:
    parts: list[dict[str, np.ndarray]] = []
    names: dict[str, int] = {}
    keeper = _ArgKeeper(keep_args) if keep_args is not None else None

    def columns(events: list) -> None:
        if part := _events_to_columns(events, names, src, keeper):
            parts.append(part)

    cuts = StringCuts()
    meta = stream_events(
        src, columns, budget=budget, max_event_bytes=max_event_bytes, block_bytes=block_bytes, cuts=cuts
    )
    rank = _rank(meta, src, default_rank)
    if not parts:
        raise TraceError(f"{src.name} holds no trace events")
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
        "file": src.name,
        "rank": rank,
        **{k: meta[k] for k in ("distributedInfo", "deviceProperties") if k in meta},
        "args": keeper.kept if keeper is not None else [],
        "cuts": cuts,
    }


_LEADING = re.compile(rb"[\s,]*")


def _cut_long_strings(buf: bytearray, end: int, cuts: StringCuts) -> int:
    """Cut, in place, each string value of ``buf[:end]`` (whole events, from outside any string) longer
    than MAX_STRING_BYTES to its first STRING_KEEP_BYTES and a marker; the bytes after ``end`` move
    down. Counts them in ``cuts``; returns how many bytes ``buf`` shrank. Linear in ``end`` however many
    cuts (the kept pieces move down in one pass, each move a memmove), and the only arrays made are
    of the quotes, backslashes and brackets (found a chunk at a time), never one per byte."""
    a = np.frombuffer(buf, dtype=np.uint8, count=end)
    quotes, slashes = _where(a, 34), _where(a, 92)
    if slashes.size:  # a quote after an odd run of backslashes is escaped
        first = np.ones(slashes.size, dtype=bool)
        first[1:] = slashes[1:] != slashes[:-1] + 1
        run_start = slashes[first][np.cumsum(first) - 1]
        j = np.maximum(np.searchsorted(slashes, quotes) - 1, 0)
        run = np.where(slashes[j] == quotes - 1, quotes - run_start[j], 0)
        quotes = quotes[run % 2 == 0]
    opens, closes = quotes[0::2], quotes[1::2]
    long = np.flatnonzero(closes - opens - 1 > MAX_STRING_BYTES)
    if not long.size:
        return 0
    # The event of each long string: events start at a '{' at depth 0, brackets inside strings aside.
    idx = _where(a, 123, 91, 125, 93)
    idx = idx[np.searchsorted(quotes, idx) % 2 == 0]
    step = np.where((a[idx] == 123) | (a[idx] == 91), 1, -1)
    starts = idx[(step == 1) & (np.cumsum(step) == 1)]
    del a
    cuts.events += len(np.unique(np.searchsorted(starts, opens[long], side="right")))
    cuts.strings += len(long)
    view = memoryview(buf)
    w = r = 0  # write and read positions: w <= r, as every cut drops more than its marker adds
    for o, c in zip(opens[long].tolist(), closes[long].tolist(), strict=True):
        k = _kept_end(buf, o + 1)
        marker = f"...[{c - k:,} bytes cut]".encode()
        view[w : w + k - r] = view[r:k]
        w += k - r
        view[w : w + len(marker)] = marker
        w += len(marker)
        cuts.dropped_bytes += c - k
        r = c  # the closing quote on
    n = len(buf) - r
    view[w : w + n] = view[r:]
    view.release()
    del buf[w + n :]
    return r - w


_WHERE_CHUNK = 2**20


def _where(a: np.ndarray, *values: int) -> np.ndarray:
    """Positions in ``a`` of the bytes ``values``, increasing, found a MiB at a time (one mask of the
    whole of a 64 MiB event would be another 64 MiB)."""
    out = [np.zeros(0, dtype=np.int64)]
    for lo in range(0, len(a), _WHERE_CHUNK):
        chunk = a[lo : lo + _WHERE_CHUNK]
        hit = chunk == values[0]
        for v in values[1:]:
            hit |= chunk == v
        out.append(np.flatnonzero(hit) + lo)
    return np.concatenate(out)


def _kept_end(buf: bytearray, start: int) -> int:
    """Where to cut a long string whose text begins at ``start``: at most STRING_KEEP_BYTES in, at the
    end of a whole character, so that no escape (``\\n``, ``\\u00e9``, a surrogate pair) and no UTF-8
    sequence is split. Walks the kept bytes once (1 KiB)."""
    limit = start + STRING_KEEP_BYTES
    p = safe = start
    while p < limit:
        safe = p
        b = buf[p]
        if b == 92:  # an escape: \uXXXX (twice for a surrogate pair) or a backslash and one byte
            if buf[p + 1] == 117:  # 'u'
                high = buf[p + 2] in b"dD" and buf[p + 3] in b"89abAB"
                p += 12 if high else 6
            else:
                p += 2
        else:  # a UTF-8 sequence: its length from its first byte
            p += 4 if b >= 0xF0 else 3 if b >= 0xE0 else 2 if b >= 0xC0 else 1
    return limit if p == limit else safe


def _parse_prefix(buf: bytearray, end: int) -> list:
    """The events in ``buf[:end]``: whole events of traceEvents, comma separated, ``end`` just past the
    last one's "}". Parsed in place where it can be: the byte before the first event becomes "[" and
    the one at ``end`` "]" while orjson reads a view of them, then both are restored, so a 64 MiB event
    is not copied three more times (slice, strip, brackets). Raises ValueError on invalid JSON."""
    start = _LEADING.match(buf, 0, end).end()
    if start == end:
        return []
    if start == 0 or end >= len(buf) or json_loads is not _view_loads:
        return json_loads(b"[" + bytes(buf[start:end]) + b"]")
    before, after = buf[start - 1], buf[end]
    buf[start - 1], buf[end] = 0x5B, 0x5D  # '[' and ']'
    try:
        return json_loads(memoryview(buf)[start - 1 : end + 1])
    finally:
        buf[start - 1], buf[end] = before, after


def _events_to_columns(
    events: list, names: dict[str, int], src: TraceSource, keeper: _ArgKeeper | None = None
) -> dict[str, np.ndarray] | None:
    """The columns of the kept ones of ``events`` (parsed from traceEvents); new names get the next
    code in ``names``. The per-event Python work is one pass to pick the kept events, then one
    comprehension per field; the rest is numpy over the block. A field of the wrong type or out of
    range raises TraceError naming the event and the field (found by a second, per-event pass)."""
    kept, codes, durs = [], [], []
    keep, code_of, dur_of = kept.append, codes.append, durs.append
    cat_code = _CAT_CODE.get
    for e in events:
        if type(e) is not dict:  # orjson makes exact dicts of JSON objects
            raise TraceError(f"{src.name}: traceEvents holds a {type(e).__name__}, expected objects")
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
    try:
        return _columns_of(kept, np.array(codes, dtype=np.int8), durs, names, keeper)
    except TraceError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as err:
        raise TraceError(
            _bad_field(kept, codes, durs, src) or f"{src.name}: an event field is unreadable ({err})"
        ) from None


def _columns_of(
    kept: list[dict], code: np.ndarray, durs: list, names: dict[str, int], keeper: _ArgKeeper | None
) -> dict[str, np.ndarray]:
    gpu = _CODE_GPU[code]
    start_ns = _to_ns([e["ts"] for e in kept])
    dur_ns = _to_ns(durs, duration=True)
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


_INT32 = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)


def _bad_field(kept: list[dict], codes: list[int], durs: list, src: TraceSource) -> str | None:
    """The message for the first event of ``kept`` with a field the table cannot hold: the event (its
    name and ts), the field, its value and what is allowed; None where every field is fine."""
    for e, code, dur in zip(kept, codes, durs, strict=True):
        args = e.get("args") or _NO_ARGS
        problems = [("ts", e.get("ts"), _time_problem(e.get("ts"), duration=False))]
        problems.append(("dur", dur, _time_problem(dur, duration=True)))
        if not isinstance(args, dict):
            problems.append(("args", args, "expected an object"))
        else:
            fields = [("correlation", _INT64), ("bytes", _INT64)]
            if _CODE_GPU[code]:
                fields += [("device", _INT32), ("stream", _INT64)]
            if code == _MEMORY_CODE:
                fields += [("Bytes", _INT64)] + ([("Device Id", _INT32)] if args.get("Device Type") == 1 else [])
            problems += [(f"args.{f}", args[f], _int_problem(args[f], *r)) for f, r in fields if args.get(f)]
        for field, value, problem in problems:
            if problem:
                return (
                    f"{src.name}: event {_short(e.get('name'))} (ph {_short(e.get('ph'))}, ts {_short(e.get('ts'))}) "
                    f"has {field} = {_short(value)}; {problem}"
                )
    return None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _int_problem(value: object, low: int, high: int) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int | str):
        return f"expected an integer from {low} to {high}"
    try:
        ok = low <= int(value) <= high
    except ValueError:
        ok = False
    return None if ok else f"expected an integer from {low} to {high}"


def _time_problem(value: object, *, duration: bool) -> str | None:
    low = 0 if duration else -MAX_TIME_US
    what = f"expected microseconds from {low:.3g} to {MAX_TIME_US:.3g}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return what
    return None if low <= value <= MAX_TIME_US else what


def _pid_device(pid: object) -> int:
    """The device a GPU-stream event's pid names (-1 where it is not a device index)."""
    return pid if isinstance(pid, int) and not isinstance(pid, bool) and 0 <= pid < 2**31 else -1


def _to_ns(us: list, *, duration: bool = False) -> np.ndarray:
    """Microseconds (JSON numbers) to integer ns. Whole and fractional microseconds are converted
    apart: ``x * 1000`` in float64 would round epoch timestamps (~1.7e18 ns) to multiples of 256 ns.
    Raises ValueError on anything but numbers within +-MAX_TIME_US (a duration: from 0): booleans,
    text, NaN, 1e30 and negative durations would turn every figure computed from them into nonsense."""
    if not set(map(type, us)) <= {int, float}:
        raise ValueError("not a number")
    x = np.array(us, dtype=np.float64)
    low = 0 if duration else -MAX_TIME_US
    if not ((x >= low) & (x <= MAX_TIME_US)).all():  # NaN fails both
        raise ValueError("out of range")
    whole = np.floor(x)
    return whole.astype(np.int64) * 1000 + np.rint((x - whole) * 1000).astype(np.int64)


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


def _check_json(text: bytes, src: TraceSource) -> None:
    try:
        json_loads(text)
    except ValueError as err:
        raise TraceError(f"{src.name} is not valid JSON ({err})") from None


def _metadata(text: bytes, src: TraceSource) -> dict[str, Any]:
    try:
        meta = json_loads(text)
    except ValueError as err:
        raise TraceError(f"{src.name} is not valid JSON outside traceEvents ({err})") from None
    if not isinstance(meta, dict):
        raise TraceError(f"{src.name}: the top level is not a JSON object; not a Kineto trace")
    return meta


def _rank(meta: dict, src: TraceSource, default: int) -> int:
    info = meta.get("distributedInfo")
    if isinstance(info, dict) and isinstance(info.get("rank"), int):
        return info["rank"]
    m = _RANK_IN_NAME.search(src.name)
    return int(m.group(1)) if m else default
