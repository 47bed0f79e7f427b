"""The Nsight Systems SQLite loader on real exports, checked against ../shared/traces/nsys/reference.json
(numbers from a plain sqlite3 script run on the same files), and on damaged and foreign inputs; and the
blocking-sync figures, which read the synchronization records only nsys exports carry."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
from contextlib import closing

import numpy as np
import pandas as pd
import pytest

from advisor.analysis.summary import analyze
from advisor.errors import TraceError
from advisor.trace.nsys import NVTX_OP_RE, load_nsys_sqlite
from tests.shared import SHARED_TRACES

TRACES = SHARED_TRACES
NSYS = TRACES / "nsys"
READ_TABLES = (  # what the loader reads of an export
    "CUPTI_ACTIVITY_KIND_KERNEL",
    "CUPTI_ACTIVITY_KIND_MEMCPY",
    "CUPTI_ACTIVITY_KIND_MEMSET",
    "CUPTI_ACTIVITY_KIND_RUNTIME",
    "NVTX_EVENTS",
    "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION",
)
if not NSYS.is_dir():
    pytest.skip(f"real traces not found at {NSYS} (the shared traces folder beside the repo)", allow_module_level=True)

REFERENCE = {r["file"]: r for r in json.loads((NSYS / "reference.json").read_text())}
WITH_TABLES = ["nsysai_mfu_2gpu_before.sqlite", "nsysai_mfu_2gpu_after.sqlite", "pipit_cloverleaf_cuda.sqlite"]
ROW_KINDS = {
    "CUPTI_ACTIVITY_KIND_KERNEL": "kernel",
    "CUPTI_ACTIVITY_KIND_MEMCPY": "memcpy",
    "CUPTI_ACTIVITY_KIND_MEMSET": "memset",
    "CUPTI_ACTIVITY_KIND_RUNTIME": "runtime",
    "NVTX_EVENTS": "annotation",
}


@pytest.fixture(scope="module")
def tables() -> dict[str, pd.DataFrame]:
    return {f: load_nsys_sqlite(NSYS / f) for f in WITH_TABLES}


def busy_ns(start: np.ndarray, end: np.ndarray) -> int:
    """Length of the union of the intervals [start, end)."""
    order = np.argsort(start, kind="stable")
    start, end = start[order], end[order]
    reach = np.maximum.accumulate(end)
    first = np.ones(start.size, dtype=bool)
    first[1:] = start[1:] > reach[:-1]  # a gap before this interval starts a new merged segment
    heads = np.flatnonzero(first)
    return int((np.maximum.reduceat(end, heads) - start[heads]).sum())


def span_busy_idle(kernels: pd.DataFrame) -> tuple[int, int, float]:
    start = kernels["start_ns"].to_numpy()
    end = start + kernels["dur_ns"].to_numpy()
    span = int(end.max() - start.min())
    busy = busy_ns(start, end)
    return span, busy, 100.0 * (span - busy) / span


def test_busy_ns_helper():
    assert busy_ns(np.array([0, 5, 20, 22]), np.array([10, 12, 25, 23])) == 12 + 5


@pytest.mark.parametrize("file", WITH_TABLES)
def test_row_counts_match_reference(tables, file):
    # The reference counts every NVTX_EVENTS row; in these files all rows are eventType 59
    # (NvtxPushPopRange, reference nvtx_eventTypes) with an end, so they are exactly the ranges the
    # loader keeps (it drops marks and domain/category/thread naming records).
    df, ref = tables[file], REFERENCE[file]
    counts = df["kind"].value_counts()
    for table, kind in ROW_KINDS.items():
        assert counts[kind] == (ref["row_counts"][table] or 0), (file, kind)
    if "nvtx_eventTypes" in ref:
        assert set(ref["nvtx_eventTypes"]) == {"59"}


@pytest.mark.parametrize("file", WITH_TABLES)
def test_kernel_span_busy_idle_match_reference(tables, file):
    df, ref = tables[file], REFERENCE[file]
    kernels = df[df["kind"] == "kernel"]
    whole = ref["busy_all_devices"]
    span, busy, idle_pct = span_busy_idle(kernels)
    assert (span, busy) == (whole["span_ns"], whole["busy_ns"])  # equal to the nanosecond
    assert idle_pct == pytest.approx(whole["idle_pct"], abs=0.01)
    assert set(kernels["device"].unique().tolist()) == {int(d) for d in ref["busy_per_device"]}
    for device, want in ref["busy_per_device"].items():
        on = kernels[kernels["device"] == int(device)]
        span, busy, idle_pct = span_busy_idle(on)
        assert len(on) == want["kernels"]
        assert int(on["dur_ns"].sum()) == want["sum_kernel_ns"]
        assert (span, busy) == (want["span_ns"], want["busy_ns"])
        assert idle_pct == pytest.approx(want["idle_pct"], abs=0.01)


def test_idle_numbers_by_hand(tables):
    # README table: before 299.877 ms span, 285.206 ms busy, 4.89 % idle (device 0: 9.67, 1: 11.50).
    kernels = tables["nsysai_mfu_2gpu_before.sqlite"].query("kind == 'kernel'")
    span, busy, idle_pct = span_busy_idle(kernels)
    assert span / 1e6 == pytest.approx(299.877, abs=0.001)
    assert busy / 1e6 == pytest.approx(285.206, abs=0.001)
    assert idle_pct == pytest.approx(4.89, abs=0.005)
    assert span_busy_idle(kernels[kernels["device"] == 1])[2] == pytest.approx(11.50, abs=0.005)
    pipit = tables["pipit_cloverleaf_cuda.sqlite"].query("kind == 'kernel'")
    assert span_busy_idle(pipit)[2] == pytest.approx(14.00, abs=0.005)


@pytest.mark.parametrize("file", WITH_TABLES)
def test_top5_kernels_match_reference(tables, file):
    kernels = tables[file].query("kind == 'kernel'")
    top = (
        kernels.groupby("name", observed=True)["dur_ns"]
        .agg(["count", "sum"])
        .sort_values("sum", ascending=False, kind="stable")
        .head(5)
    )
    # The reference cuts names at 200 characters (two PdV_kernel instances share their first 200).
    got = [(str(name)[:200], int(r["count"]), int(r["sum"])) for name, r in top.iterrows()]
    want = [(k["name"], k["count"], k["total_ns"]) for k in REFERENCE[file]["top5_kernels_by_total_ns"]]
    assert got == want


@pytest.mark.parametrize("file", ["nsysai_mfu_2gpu_before.sqlite", "nsysai_mfu_2gpu_after.sqlite"])
def test_nvtx_names_inline_and_registered(tables, file):
    # Text is inline for most rows and a textId into StringIds for the rest (reference: 18656 + 462
    # before, 16693 + 420 after); both resolve, and the longest ranges match the reference.
    ref = REFERENCE[file]
    nvtx = tables[file].query("kind == 'annotation'")
    assert ref["nvtx_text_inline"] + ref["nvtx_textId"] == len(nvtx)
    assert not (nvtx["name"].astype(str) == "").any()
    assert nvtx["device"].eq(-1).all() and nvtx["tid"].gt(0).all()
    top = nvtx.sort_values("dur_ns", ascending=False, kind="stable").head(5)
    # emit_nvtx's texts ("aten::to, op_id = 999599") are named by their op ("aten::to").
    want = [(NVTX_OP_RE.match(r["name"]).group(1), r["total_ns"]) for r in ref["nvtx_top_ranges"]]
    assert list(zip(top["name"].astype(str), top["dur_ns"].astype(int), strict=True)) == want
    assert {"ncclSend", "ncclRecv"} <= set(nvtx["name"].astype(str))  # registered (textId) strings
    assert not nvtx["name"].astype(str).str.contains("op_id").any()
    ops = set(tables[file].attrs["nvtx_ops"])
    assert {"aten::to", "aten::copy_", "FlashAttnFunc"} <= ops and not ops & {"ncclSend", "ncclRecv"}


def _emit_nvtx_export(path, ops: int) -> list[str]:
    """An export in the real schema (nsysai_mfu_2gpu_before.sqlite's NVTX_EVENTS and StringIds) whose
    NVTX ranges are what emit_nvtx writes for ``ops`` ops of a long capture, every op id its own, plus
    a user's plain ranges and registered strings; the texts written, in row order."""
    with closing(sqlite3.connect(f"{(NSYS / 'nsysai_mfu_2gpu_before.sqlite').as_uri()}?mode=ro", uri=True)) as real:
        schema = real.execute("SELECT sql FROM sqlite_master WHERE name IN ('NVTX_EVENTS', 'StringIds')").fetchall()
    texts = []
    for i in range(ops):
        op = ("aten::mm", "aten::add", "FSDP::pre_forward (blocks.2)", "ProfilerStep#7")[i % 4]
        seq = f", seq = {i // 2}" if i % 3 else ""
        sizes = f", sizes = [[{i}, 3], [3, 4]], input_op_ids = [{i - 1}]" if i % 5 == 0 else ""
        texts.append(f"{op}{seq}, op_id = {1000 + i}{sizes}")
    # A user's ranges: plain, one with the words but no op id after them, one whose name holds a comma,
    # one whose name is not ASCII (SQLite cuts bytes), one with a sequence number but no op id.
    texts += ["forward", "my range, op_id = later", "loss, scaled, op_id = 5", "größe, seq = 2, op_id = 6"]
    texts += ["step, seq = 4"]
    with closing(sqlite3.connect(path)) as conn, conn:
        for (sql,) in schema:
            conn.execute(sql)
        conn.executemany("INSERT INTO StringIds VALUES (?, ?)", [(1, "ncclSend"), (2, "aten::mul, op_id = 77")])
        # The first row holds a registered string, no text.
        rows = [(0, 5, 59, None, (7 << 24) | 7, 1)]
        rows += [(10 * i + 10, 10 * i + 15, 59, t, (7 << 24) | 7, None) for i, t in enumerate(texts)]
        rows += [(10 * len(rows), 10 * len(rows) + 5, 59, None, (7 << 24) | 7, 2)]
        conn.executemany(
            "INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid, textId) VALUES (?, ?, ?, ?, ?, ?)", rows
        )
    return ["ncclSend", *texts, "aten::mul, op_id = 77"]


def _use_reader(monkeypatch, reader: str) -> list:
    """Load through ``reader`` alone ("pages", "connectorx", "sqlite3"; skipped where it is not here);
    returns the list that records, per table read, whether that reader read it."""
    from advisor.trace import nsys as trace_nsys
    from advisor.trace import pages

    if reader == "pages" and pages.library() is None:
        pytest.skip("no C compiler here: the page reader cannot be built, connectorx or sqlite3 read")
    if reader == "connectorx" and trace_nsys._cx is None:
        pytest.skip("connectorx is not installed here: only the row reader runs")
    monkeypatch.setattr(trace_nsys, "USE_PAGES", reader == "pages")
    if reader == "sqlite3":
        monkeypatch.setattr(trace_nsys, "_cx", None)
    read: list[bool] = []
    owner, name = (pages, "read") if reader == "pages" else (trace_nsys, "_columnar")
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        out = original(*args, **kwargs)
        read.append(out is not None)
        return out

    monkeypatch.setattr(owner, name, counted)
    return read


@pytest.mark.parametrize("reader", ["pages", "connectorx", "sqlite3"])
def test_emit_nvtx_ranges_are_named_by_their_op(tmp_path, monkeypatch, reader):
    # A long emit_nvtx capture has one distinct text per range: a 3.7 GB export 28 M of them, which as
    # names took 4x the file's size in memory (0.5 GB export: 38.6-38.8 s and 2.06-2.17 GB peak RSS
    # before, 7.4-7.9 s and 0.94-0.99 GB now). Each is named by its op; the names that were ops are
    # listed in attrs["nvtx_ops"]. The page reader cuts the texts in C as SQLite's expression does.
    read = _use_reader(monkeypatch, reader)
    texts = _emit_nvtx_export(tmp_path / "ops.sqlite", 2000)
    df = load_nsys_sqlite(tmp_path / "ops.sqlite")
    assert read == [reader != "sqlite3"]  # the one table, read by that reader (connectorx declines for sqlite3)
    names = df["name"].astype(str).tolist()
    want = [m.group(1) if (m := NVTX_OP_RE.match(t)) else t for t in texts]
    assert names == want
    assert names[:5] == ["ncclSend", "aten::mm", "aten::add", "FSDP::pre_forward (blocks.2)", "ProfilerStep#7"]
    assert names[-6:] == ["forward", "my range, op_id = later", "loss, scaled", "größe", "step, seq = 4", "aten::mul"]
    assert set(df["name"].cat.categories) == set(want)  # 12 names for 2,007 ranges
    ops = ["aten::mm", "aten::add", "FSDP::pre_forward (blocks.2)", "ProfilerStep#7", "loss, scaled", "größe"]
    assert df.attrs["nvtx_ops"] == sorted([*ops, "aten::mul"])


def test_ranks_are_processes_in_pid_order(tables):
    # Kernel globalPid >> 24 & 0xFFFFFF is 144 (device 0) and 145 (device 1), the two python3 rows of
    # PROCESSES; the after-tuning run has pids 148 and 149.
    df = tables["nsysai_mfu_2gpu_before.sqlite"]
    assert df.attrs["ranks"] == [0, 1]
    assert df.attrs["pid_map"] == {0: 144, 1: 145}
    assert df.attrs["process_names"] == {0: "python3", 1: "python3"}
    kernels = df[df["kind"] == "kernel"]
    assert kernels.groupby("rank")["device"].unique().map(list).to_dict() == {0: [0], 1: [1]}
    assert df.groupby("rank")["kind"].value_counts().loc[(0, "kernel")] == 1993
    assert tables["nsysai_mfu_2gpu_after.sqlite"].attrs["pid_map"] == {0: 148, 1: 149}
    runtime = df[df["kind"] == "runtime"]
    assert set(runtime["tid"].unique().tolist()) == {144, 145, 242, 245}  # globalTid & 0xFFFFFF


@pytest.mark.parametrize("file", WITH_TABLES)
def test_metadata(tables, file):
    df, ref = tables[file], REFERENCE[file]
    assert df.attrs["source"] == "nsys"
    assert df.attrs["file"] == file
    assert df.attrs["nsys_version"] == ref["meta"]["EXPORT_PRODUCT_VERSION"]
    assert sorted(set(df.attrs["gpu_names"].values())) == sorted(ref["gpu_names"])


def test_copies_sets_and_syncs(tables):
    # sqlite3: SELECT copyKind, srcKind, dstKind, count(*) ... GROUP BY 1, 2, 3 gives (1, 0, 2) x 34
    # and (8, 2, 2) x 986: HtoD from pageable memory, DtoD, in nsys' ENUM_CUDA_MEM_KIND (0 = pageable).
    df = tables["nsysai_mfu_2gpu_before.sqlite"]
    copies = df[df["kind"] == "memcpy"]
    assert copies.groupby(["copy_kind", "host_mem"], observed=True).size().to_dict() == {
        ("HtoD", "pageable"): 34,
        ("DtoD", ""): 986,
    }
    assert set(copies["name"].astype(str)) == {"Memcpy HtoD (Pageable -> Device)", "Memcpy DtoD (Device -> Device)"}
    assert copies["bytes"].gt(0).all() and copies["stream"].ge(0).all() and copies["correlation"].gt(0).all()
    sets = df[df["kind"] == "memset"]
    assert set(sets["name"].astype(str)) == {"Memset (Device)"}  # memKind 2 in all 269 rows
    assert df["kind"].eq("sync").sum() == 366
    syncs = tables["pipit_cloverleaf_cuda.sqlite"].query("kind == 'sync'")
    # streamId 4294967295 (CUPTI_SYNCHRONIZATION_INVALID_VALUE) in all 1312 rows: device-wide syncs.
    assert len(syncs) == 1312 and syncs["stream"].eq(-1).all() and syncs["device"].eq(0).all()
    pipit = tables["pipit_cloverleaf_cuda.sqlite"]
    copies = pipit[pipit["kind"] == "memcpy"]
    assert copies.groupby(["copy_kind", "host_mem"], observed=True).size().to_dict() == {
        ("HtoD", "pageable"): 254,
        ("DtoH", "pageable"): 25,
    }
    runtime = pipit[pipit["kind"] == "runtime"]["name"].astype(str).value_counts()
    assert runtime["cudaLaunchKernel"] == 1312  # cudaLaunchKernel_v7000 in StringIds
    assert runtime["cudaDeviceSynchronize"] == 1312
    assert (pipit["start_ns"].diff().dropna() >= 0).all()


# sqlite3 on the exports, per process (globalTid >> 24 & 0xFFFFFF, the rank): the blocking runtime calls
# (cudaStreamSynchronize; pipit: cudaDeviceSynchronize and cudaMemcpy), sum(end - start). Each process
# makes them on one thread, so they cannot overlap. Every CUPTI_ACTIVITY_KIND_SYNCHRONIZATION row shares
# its correlationId with a runtime call of its process and lies inside it: the same waits again
# (stream syncs in cudaStreamSynchronize, event syncs in cudaEventQuery, stream waits in
# cudaStreamWaitEvent; pipit's 1312 in its 1312 cudaDeviceSynchronize).
BLOCKED_NS = {
    "nsysai_mfu_2gpu_before.sqlite": [163_599_685, 160_935_048],  # pids 144, 145: 16 and 17 calls
    "nsysai_mfu_2gpu_after.sqlite": [137_962_155, 151_790_570],  # pids 148, 149: 15 and 15
    "pipit_cloverleaf_cuda.sqlite": [301_652_956 + 17_670_674],  # 1312 + 279 calls
}
BLOCKING_CALLS = {
    "nsysai_mfu_2gpu_before.sqlite": [16, 17],
    "nsysai_mfu_2gpu_after.sqlite": [15, 15],
    "pipit_cloverleaf_cuda.sqlite": [1312 + 279],
}
# SELECT count(*), sum(end - start) ... WHERE syncType = 2 (Stream wait sync).
STREAM_WAITS = {
    "nsysai_mfu_2gpu_before.sqlite": (200, 343_087),
    "nsysai_mfu_2gpu_after.sqlite": (180, 242_911),
    "pipit_cloverleaf_cuda.sqlite": (0, 0),
}


@pytest.mark.parametrize("file", WITH_TABLES)
def test_blocking_sync_time_counts_each_wait_once(tables, file):
    # Counting the calls and their records both, with stream waits as blocking, read 649.680 ms of
    # blocking sync in the 299.986 ms capture of 'before', 580.047 ms in 299.272 ms of 'after' and
    # 620.460 ms in pipit's 618.351 ms.
    report = analyze(tables[file])
    per_rank = report.tables["sync_time"]
    assert per_rank["blocking_ns"].tolist() == BLOCKED_NS[file]
    assert per_rank["blocking_calls"].tolist() == BLOCKING_CALLS[file]
    assert (per_rank["blocking_ns"] <= per_rank["span_ns"]).all()
    m = report.metrics
    assert m.sync_calls == sum(BLOCKING_CALLS[file])
    assert m.sync_time_ms == pytest.approx(np.mean(BLOCKED_NS[file]) / 1e6, abs=1e-9)
    assert m.sync_time_ms <= per_rank["span_ns"].min() / 1e6
    assert (per_rank["stream_waits"].sum(), per_rank["stream_wait_ns"].sum()) == STREAM_WAITS[file]
    by_name = report.tables["sync_calls"]
    assert set(by_name.loc[by_name["blocking"], "name"]) <= {
        "cudaStreamSynchronize",
        "cudaDeviceSynchronize",
        "cudaMemcpy",
    }
    assert by_name.loc[~by_name["blocking"], "name"].tolist() == (["Stream wait sync"] if STREAM_WAITS[file][0] else [])


SYNTHETIC_TABLES = (
    "StringIds",
    "ENUM_CUPTI_SYNC_TYPE",
    "CUPTI_ACTIVITY_KIND_KERNEL",
    "CUPTI_ACTIVITY_KIND_RUNTIME",
    "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION",
)


def _insert(conn: sqlite3.Connection, table: str, **given) -> None:
    """One row; the NOT NULL columns not given get 0 (text '[]', as the real rows hold)."""
    info = conn.execute(f"PRAGMA table_info({table})").fetchall()
    row = {
        name: ("[]" if kind == "TEXT" else 0) for _, name, kind, notnull, _, _ in info if notnull and name not in given
    }
    row.update(given)
    conn.execute(f"INSERT INTO {table} ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})", list(row.values()))


def _sync_export(path) -> None:
    """A small export in the real schema (the CREATE TABLE statements of nsysai_mfu_2gpu_before.sqlite,
    nsys 2026.2) where records without a correlation id, records no call accounts for and two host
    threads blocked at once occur; times in ns."""
    with closing(sqlite3.connect(f"{(NSYS / 'nsysai_mfu_2gpu_before.sqlite').as_uri()}?mode=ro", uri=True)) as real:
        marks = ", ".join("?" * len(SYNTHETIC_TABLES))
        schema = real.execute(f"SELECT sql FROM sqlite_master WHERE name IN ({marks})", SYNTHETIC_TABLES).fetchall()
        sync_types = real.execute("SELECT id, name, label FROM ENUM_CUPTI_SYNC_TYPE").fetchall()
    pid = 7 << 24  # globalPid of OS pid 7; its threads 7 and 8 as globalTids
    main, other = pid | 7, pid | 8
    names = ["cudaLaunchKernel_v7000", "cudaStreamSynchronize_v3020", "cudaDeviceSynchronize_v3020"]
    names += ["cudaEventQuery_v3020", "cudaStreamWaitEvent_v3020", "gemm_kernel"]
    with closing(sqlite3.connect(path)) as conn, conn:
        for (sql,) in schema:
            conn.execute(sql)
        conn.executemany("INSERT INTO ENUM_CUPTI_SYNC_TYPE VALUES (?, ?, ?)", sync_types)
        conn.executemany("INSERT INTO StringIds VALUES (?, ?)", list(enumerate(names, 1)))
        for start, end, tid, corr, name in [
            (0, 5_000, main, 1, 1),  # launches the first kernel
            (10_000, 1_001_000, main, 2, 2),  # cudaStreamSynchronize: 991 us
            (500_000, 1_001_000, other, 3, 3),  # cudaDeviceSynchronize on a second thread, inside that
            (1_100_000, 1_102_000, main, 4, 4),  # cudaEventQuery: polls, does not block
            (1_200_000, 1_203_000, main, 5, 5),  # cudaStreamWaitEvent: the GPU stream waits
            (1_710_000, 1_715_000, main, 6, 1),  # launches the last kernel
        ]:
            _insert(
                conn,
                "CUPTI_ACTIVITY_KIND_RUNTIME",
                start=start,
                end=end,
                globalTid=tid,
                correlationId=corr,
                nameId=name,
            )
        for start, end, corr in [(10_000, 1_000_000, 1), (1_720_000, 1_800_000, 6)]:
            _insert(
                conn,
                "CUPTI_ACTIVITY_KIND_KERNEL",
                start=start,
                end=end,
                streamId=7,
                correlationId=corr,
                globalPid=pid,
                demangledName=6,
                shortName=6,
            )
        no_stream = 0xFFFFFFFF
        for start, end, corr, sync_type, stream in [
            (11_000, 1_000_500, 2, 3, 7),  # the cudaStreamSynchronize's own wait
            (501_000, 1_000_800, 3, 4, no_stream),  # the cudaDeviceSynchronize's
            (20_000, 30_000, None, 3, 7),  # no correlation id, inside the cudaStreamSynchronize
            (1_100_500, 1_101_500, 4, 1, 7),  # the cudaEventQuery's
            (1_201_000, 1_202_000, 5, 2, 7),  # the cudaStreamWaitEvent's: 1 us, not blocking
            (1_300_000, 1_700_000, None, 4, no_stream),  # no call traced for it: a 400 us wait of its own
        ]:
            _insert(
                conn,
                "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION",
                start=start,
                end=end,
                streamId=stream,
                correlationId=corr,
                globalPid=pid,
                syncType=sync_type,
            )


def test_blocking_sync_time_on_a_synthetic_export(tmp_path):
    path = tmp_path / "syncs.sqlite"
    _sync_export(path)
    report = analyze(load_nsys_sqlite(path))
    by_name = report.tables["sync_calls"]
    got = {(r.name, r.blocking): (r.count, r.time_ns) for r in by_name.itertuples()}
    assert got == {
        ("cudaStreamSynchronize", True): (1, 991_000),
        ("cudaDeviceSynchronize", True): (1, 501_000),
        ("Context sync", True): (1, 400_000),
        ("Stream wait sync", False): (1, 1_000),
    }
    # The blocking waits sum to 1.892 ms in a 1.8 ms capture; the host was blocked in their union:
    # 10-1001 us (the second thread's 500-1001 us inside it) and 1300-1700 us, 1.391 ms. Counting every
    # call and record read 8 calls and 3.393 ms.
    (row,) = report.tables["sync_time"].itertuples()
    assert (row.span_ns, row.blocking_calls, row.blocking_ns) == (1_800_000, 3, 1_391_000)
    assert (row.stream_waits, row.stream_wait_ns) == (1, 1_000)
    assert report.metrics.sync_calls == 3 and report.metrics.sync_time_ms == pytest.approx(1.391)


def test_empty_export_is_refused():
    with pytest.raises(TraceError) as err:
        load_nsys_sqlite(NSYS / "dynamicvit_nsys_profile.sqlite")
    msg = str(err.value)
    assert msg.startswith("dynamicvit_nsys_profile.sqlite holds no CUDA or NVTX activity")
    assert "TARGET_INFO_GPU" in msg and "StringIds" in msg and str(NSYS) not in msg


def test_export_with_empty_tables_is_refused(tmp_path):
    copy = tmp_path / "emptied.sqlite"
    shutil.copy(NSYS / "pipit_cloverleaf_cuda.sqlite", copy)
    with closing(sqlite3.connect(copy)) as conn, conn:
        for table in ("CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_RUNTIME"):
            conn.execute(f"DELETE FROM {table}")
    with pytest.raises(TraceError, match=r"^emptied.sqlite holds no CUDA or NVTX events: its tables .* are empty"):
        load_nsys_sqlite(copy)


def test_missing_columns_and_enum_tables_are_tolerated(tmp_path):
    # Older or trimmed exports lack columns and ENUM tables; others carry extra columns.
    copy = tmp_path / "trimmed.sqlite"
    shutil.copy(NSYS / "pipit_cloverleaf_cuda.sqlite", copy)
    with closing(sqlite3.connect(copy)) as conn, conn:
        conn.execute("ALTER TABLE CUPTI_ACTIVITY_KIND_KERNEL DROP COLUMN correlationId")
        conn.execute("ALTER TABLE CUPTI_ACTIVITY_KIND_KERNEL DROP COLUMN greenContextId")
        conn.execute("ALTER TABLE CUPTI_ACTIVITY_KIND_KERNEL ADD COLUMN someToolsColumn TEXT")
        conn.execute("DROP TABLE ENUM_CUDA_MEMCPY_OPER")
        conn.execute("DROP TABLE ENUM_CUDA_MEM_KIND")
        conn.execute("DROP TABLE META_DATA_EXPORT")
        conn.execute("DROP TABLE TARGET_INFO_GPU")
    df = load_nsys_sqlite(copy)
    kernels = df[df["kind"] == "kernel"]
    assert len(kernels) == 1312 and kernels["correlation"].eq(-1).all()
    copies = df[df["kind"] == "memcpy"]
    assert copies["copy_kind"].value_counts()[["HtoD", "DtoH"]].tolist() == [254, 25]
    assert copies["host_mem"].eq("pageable").all()
    assert df.attrs["nsys_version"] is None and df.attrs["gpu_names"] == {}


def test_not_sqlite(tmp_path):
    text = tmp_path / "notes.sqlite"
    text.write_text("kernel,start,end\n")
    with pytest.raises(TraceError, match=r"^notes.sqlite is not an SQLite database .*nsys export --type sqlite"):
        load_nsys_sqlite(text)


def test_sqlite_but_not_nsys(tmp_path):
    other = tmp_path / "other.db"
    with closing(sqlite3.connect(other)) as conn, conn:
        conn.execute("CREATE TABLE runs (id INTEGER, loss REAL)")
    with pytest.raises(TraceError, match=r"^other.db is an SQLite database but not an Nsight Systems export.*runs"):
        load_nsys_sqlite(other)


def test_truncated_export(tmp_path):
    data = (NSYS / "pipit_cloverleaf_cuda.sqlite").read_bytes()
    cut = tmp_path / "cut.sqlite"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError) as err:
        load_nsys_sqlite(cut)
    assert str(err.value) == (
        "cut.sqlite is truncated: its header counts 526 pages of 4096 bytes (2154496 bytes) but the file "
        "has 1077248 bytes; copy or export it again"
    )


def test_damaged_export(tmp_path):
    # Full length, so the header check passes, but the middle pages are zeros: SQLite reports it.
    data = bytearray((NSYS / "pipit_cloverleaf_cuda.sqlite").read_bytes())
    data[4096 * 100 : 4096 * 400] = bytes(4096 * 300)
    bad = tmp_path / "bad.sqlite"
    bad.write_bytes(bytes(data))
    with pytest.raises(
        TraceError, match=r"^bad.sqlite is a damaged SQLite database \(database disk image is malformed\)"
    ):
        load_nsys_sqlite(bad)


def test_over_max_bytes():
    with pytest.raises(TraceError) as err:
        load_nsys_sqlite(NSYS / "pipit_cloverleaf_cuda.sqlite", max_bytes=2**20)
    assert str(err.value).startswith(
        "pipit_cloverleaf_cuda.sqlite is 2.1 MiB (2154496 bytes), over the 1.0 MiB limit (1048576 bytes)"
    )


def test_missing_file(tmp_path):
    with pytest.raises(TraceError, match=r"^no trace file gone.sqlite$"):
        load_nsys_sqlite(tmp_path / "gone.sqlite")


@pytest.mark.parametrize("name", [b"caf\xe9.sqlite", b"run #1?mode=rw&x=%41.sqlite"])
def test_odd_file_names_load(tmp_path, name):
    # A Latin-1 byte that is not UTF-8, and characters that mean something in a URI.
    odd = tmp_path / os.fsdecode(name)
    shutil.copy(NSYS / "pipit_cloverleaf_cuda.sqlite", odd)
    df = load_nsys_sqlite(odd)
    assert df["kind"].eq("kernel").sum() == 1312
    assert df.attrs["file"] == odd.name
    with pytest.raises(TraceError) as err:
        load_nsys_sqlite(odd, max_bytes=2**20)
    assert str(err.value).startswith(odd.name)


@pytest.mark.parametrize("file", WITH_TABLES)
def test_the_page_columnar_and_row_readers_give_the_same_table(file, monkeypatch):
    # The page reader (C, compiled on first use) and connectorx are speed-ups a machine may lack
    # (no compiler, an image without connectorx): each, and sqlite3's rows, give the same table,
    # categories and attrs included, each table read by that reader alone.
    with closing(sqlite3.connect(NSYS / file)) as db:
        names = {r[0] for r in db.execute("SELECT name FROM sqlite_master")}
    read_here = len(names & {*READ_TABLES})
    tables = {}
    for reader in ("pages", "connectorx", "sqlite3"):
        with monkeypatch.context() as m:
            try:
                read = _use_reader(m, reader)
            except pytest.skip.Exception:
                continue
            tables[reader] = load_nsys_sqlite(NSYS / file)
            assert read == [reader != "sqlite3"] * read_here  # connectorx declines each table for sqlite3
    if len(tables) < 2:
        pytest.skip("only the row reader runs here: no C compiler and no connectorx")
    for reader, table in tables.items():
        pd.testing.assert_frame_equal(table, tables["sqlite3"], obj=reader)
        assert table.attrs == tables["sqlite3"].attrs


def test_odd_file_names_and_bad_values_fall_back_to_the_row_reader(tmp_path):
    odd = tmp_path / "my run (1) ünïcode.sqlite"  # not a name connectorx's URI takes: sqlite3 reads it
    shutil.copy(NSYS / "pipit_cloverleaf_cuda.sqlite", odd)
    pd.testing.assert_frame_equal(load_nsys_sqlite(odd), load_nsys_sqlite(NSYS / "pipit_cloverleaf_cuda.sqlite"))
    bad = tmp_path / "bad.sqlite"
    shutil.copy(NSYS / "pipit_cloverleaf_cuda.sqlite", bad)
    with closing(sqlite3.connect(bad)) as db:
        db.execute("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET streamId = 'seven' WHERE rowid = 3")
        db.commit()
    # Whichever reader meets it first, the text in an integer column is named.
    with pytest.raises(TraceError, match="column streamId of table CUPTI_ACTIVITY_KIND_KERNEL holds non-integer"):
        load_nsys_sqlite(bad)


def test_without_a_c_compiler_the_page_reader_steps_aside(tmp_path, monkeypatch):
    # A machine with no cc: the reader cannot be built (nothing cached yet), and the export loads
    # through SQLite, the same table.
    from advisor.trace import pages

    want = load_nsys_sqlite(NSYS / "pipit_cloverleaf_cuda.sqlite")
    monkeypatch.setenv("ADVISOR_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    pages.library.cache_clear()
    try:
        assert pages.library() is None
        pd.testing.assert_frame_equal(load_nsys_sqlite(NSYS / "pipit_cloverleaf_cuda.sqlite"), want)
        assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())
    finally:
        pages.library.cache_clear()


def _cached_pages(path) -> tuple[int, int]:
    """(pages of ``path`` in the page cache, its pages), from mincore on a mapping of it."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as m:
        pages = -(-len(m) // mmap.PAGESIZE)
        vec = ctypes.create_string_buffer(pages)
        # The c_char over the mapping is a temporary: gone before the mapping closes, which it would block.
        address = ctypes.addressof(ctypes.c_char.from_buffer(m))
        assert libc.mincore(address, len(m), vec) == 0, os.strerror(ctypes.get_errno())
        resident = sum(b & 1 for b in vec.raw)
    return resident, pages


def test_a_load_leaves_the_page_cache_as_it_found_the_file(tmp_path):
    # A multi-GB export read once should not push the machine's cached files out (nor, on a VM whose
    # host backs memory on demand, take the memory the event table then needs): the page reader drops
    # the pages it brought in; a file that was cached stays cached.
    from advisor.trace import pages

    if pages.library() is None or not hasattr(os, "posix_fadvise"):
        pytest.skip("no page reader here (no C compiler) or no posix_fadvise: the cache is SQLite's to fill")
    export = tmp_path / "export.sqlite"
    shutil.copy(NSYS / "nsysai_mfu_2gpu_before.sqlite", export)
    with open(export, "rb+") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    resident, total = _cached_pages(export)
    if resident:
        pytest.skip(f"this file system keeps {resident} of {total} pages cached after POSIX_FADV_DONTNEED (tmpfs)")
    want = load_nsys_sqlite(NSYS / "nsysai_mfu_2gpu_before.sqlite")
    pd.testing.assert_frame_equal(load_nsys_sqlite(export), want)
    resident, total = _cached_pages(export)
    assert total > 600 and resident == 0, (resident, total)
    export.read_bytes()  # now the file is cached before the load: it stays so
    assert _cached_pages(export)[0] == total
    pd.testing.assert_frame_equal(load_nsys_sqlite(export), want)
    assert _cached_pages(export) == (total, total)
