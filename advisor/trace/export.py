"""Any event table as a Chrome trace (the JSON that Perfetto, chrome://tracing and HTA read): an Nsight
Systems export, or a folder of Kineto rank files, opens as one timeline.

Layout: one process per rank's host (its threads as threads) and one per rank's GPU (its streams as
threads), named by metadata events; every event a complete ("X") event with Kineto's category for its
kind and Kineto's args (device, stream, correlation, bytes), so that a one-rank export reads back as
the same table (advisor.trace.kineto); a flow arrow from each runtime call to the GPU work it launched
(the correlation id); memory events as Kineto's ``[memory]`` instants. Times are microseconds from the
table's first event, so that epoch clocks keep their nanoseconds in a float (at epoch times,
microseconds as float64 resolve 0.25 us only).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd

from advisor.errors import AdvisorError
from advisor.trace.table import GPU_KINDS, kind_mask

HOST_PID_BASE = 0
GPU_PID_BASE = 1_000_000  # a GPU's process id: GPU_PID_BASE + 1000 * rank + device
CHUNK = 50_000  # events per write: the text of one chunk stays a few MB
KINETO_CATEGORY = {
    "kernel": "kernel",
    "memcpy": "gpu_memcpy",
    "memset": "gpu_memset",
    "runtime": "cuda_runtime",
    "cpu_op": "cpu_op",
    "annotation": "user_annotation",
    "sync": "cuda_sync",
    "other": "python_function",
}


def _host_pid(rank: np.ndarray) -> np.ndarray:
    return HOST_PID_BASE + rank.astype(np.int64)


def _gpu_pid(rank: np.ndarray, device: np.ndarray) -> np.ndarray:
    return GPU_PID_BASE + 1000 * rank.astype(np.int64) + device.astype(np.int64)


def chrome_events(df: pd.DataFrame) -> Iterator[str]:
    """The Chrome trace events of ``df``, each as one JSON text, metadata first."""
    if df.empty:
        return
    t0 = int(df["start_ns"].min())
    rank, device = df["rank"].to_numpy(), df["device"].to_numpy()
    gpu = kind_mask(df, *GPU_KINDS) | (device >= 0)
    pid = np.where(gpu, _gpu_pid(rank, np.maximum(device, 0)), _host_pid(rank))
    tid = np.where(gpu, df["stream"].to_numpy(), df["tid"].to_numpy())
    for p, r, d, g in sorted(set(zip(pid.tolist(), rank.tolist(), device.tolist(), gpu.tolist(), strict=True))):
        name = f"rank {r} GPU {max(d, 0)}" if g else f"rank {r} host"
        yield json.dumps({"ph": "M", "name": "process_name", "pid": p, "tid": 0, "args": {"name": name}})
        yield json.dumps({"ph": "M", "name": "process_sort_index", "pid": p, "tid": 0, "args": {"sort_index": p}})
    names = [json.dumps(str(n)) for n in df["name"].cat.categories]
    codes = df["name"].array.codes
    kinds = df["kind"].astype(str).to_numpy()
    ts = (df["start_ns"].to_numpy() - t0) / 1000.0
    dur = df["dur_ns"].to_numpy() / 1000.0
    nbytes = df["bytes"].to_numpy()
    corr = df["correlation"].to_numpy()
    # Correlation ids repeat across ranks: a flow's id is the rank's and the call's together.
    flow = np.where(corr >= 0, rank.astype(np.int64) * (1 << 32) + corr, -1)
    launched = set(flow[gpu & (flow >= 0)].tolist())
    streams = df["stream"].to_numpy()
    for i in range(len(df)):
        name = names[codes[i]] if codes[i] >= 0 else '""'
        kind = kinds[i]
        if kind == "memory":
            on = f'"Device Type":1,"Device Id":{device[i]}' if device[i] >= 0 else '"Device Type":0,"Device Id":-1'
            yield (
                f'{{"ph":"i","s":"t","name":"[memory]","cat":"cpu_instant_event","pid":{pid[i]},"tid":{tid[i]},'
                f'"ts":{ts[i]:.3f},"args":{{"Bytes":{nbytes[i]},{on}}}}}'
            )
            continue
        cat = "gpu_user_annotation" if kind == "annotation" and gpu[i] else KINETO_CATEGORY[kind]
        args = [f'"correlation":{corr[i]}'] if corr[i] >= 0 else []
        if gpu[i]:
            args += [f'"device":{device[i]}', f'"stream":{streams[i]}']
        if nbytes[i]:
            args.append(f'"bytes":{nbytes[i]}')
        yield (
            f'{{"ph":"X","name":{name},"cat":"{cat}","pid":{pid[i]},"tid":{tid[i]},"ts":{ts[i]:.3f},'
            f'"dur":{dur[i]:.3f},"args":{{{",".join(args)}}}}}'
        )
        c = int(flow[i])
        if c >= 0 and c in launched:
            # Flow v1: the arrow starts inside the runtime call and ends at the GPU event it launched.
            if gpu[i]:
                yield f'{{"ph":"f","bp":"e","id":{c},"name":"launch","cat":"launch","pid":{pid[i]},"tid":{tid[i]},"ts":{ts[i]:.3f}}}'
            elif kinds[i] == "runtime":
                yield f'{{"ph":"s","id":{c},"name":"launch","cat":"launch","pid":{pid[i]},"tid":{tid[i]},"ts":{ts[i]:.3f}}}'


def write_chrome_trace(df: pd.DataFrame, path: str | Path) -> Path:
    """Write ``df`` as a Chrome trace to ``path`` (gzip-compressed where it ends in ``.gz``, as
    Perfetto and HTA read it). Returns the path."""
    path = Path(path)
    if df.empty:
        raise AdvisorError("the trace holds no events to export")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "wt", encoding="utf-8") as out:
            out.write('{"displayTimeUnit":"ns","traceEvents":[\n')
            first, chunk = True, []
            for event in chrome_events(df):
                chunk.append(event)
                if len(chunk) == CHUNK:
                    out.write(("" if first else ",\n") + ",\n".join(chunk))
                    first, chunk = False, []
            if chunk:
                out.write(("" if first else ",\n") + ",\n".join(chunk))
            out.write("\n]}\n")
    except OSError as err:
        raise AdvisorError(f"cannot write {path} ({err.strerror or err})") from None
    return path
