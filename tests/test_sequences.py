"""Repeated chains of memory-bound kernels (advisor.analysis.sequences): the fusion candidates that feed
the kern-fuse-chains rule."""

import gzip
import json

import numpy as np
import pytest

from advisor.advice.advise import advise
from advisor.analysis.breakdown import kernel_category
from advisor.analysis.sequences import FUSABLE, kernel_chains, short_kernel_name
from advisor.analysis.summary import analyze, format_report, load_trace
from advisor.trace.table import make_table
from tests.shared import SHARED_TRACES, needs_shared_traces

US = 1000
ADD = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, at::detail::Array<char*, 3> >"
RELU = "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::launch_clamp_scalar>"
GEMM = "ampere_sgemm_128x64_tn"


def _layers():
    """Stream 7: gemm, add, relu, gemm, add, relu, gemm, a lone mul, a copy, add, relu. Stream 8: one add
    in the middle of stream 7's first chain, which must not join it. Durations in us."""
    events = [  # (name, kind, stream, start, dur)
        ("cudaLaunchKernel", "runtime", -1, 0, 1),
        (GEMM, "kernel", 7, 0, 10),
        (ADD, "kernel", 7, 10, 3),
        (ADD, "kernel", 8, 11, 1),
        (RELU, "kernel", 7, 13, 2),
        (GEMM, "kernel", 7, 15, 10),
        (ADD, "kernel", 7, 25, 4),
        (RELU, "kernel", 7, 29, 1),
        (GEMM, "kernel", 7, 30, 10),
        ("void at::native::mul_kernel", "kernel", 7, 40, 2),
        ("Memcpy DtoD", "memcpy", 7, 42, 5),
        (ADD, "kernel", 7, 47, 1),
        (RELU, "kernel", 7, 48, 1),
        ("ProfilerStep#1", "annotation", -1, 0, 50),
    ]
    name, kind, stream, start, dur = zip(*events, strict=True)
    return make_table(
        {
            "rank": 0,
            "kind": list(kind),
            "name": list(name),
            "start_ns": np.array(start) * US,
            "dur_ns": np.array(dur) * US,
            "device": [0 if s >= 0 else -1 for s in stream],
            "stream": list(stream),
            "tid": [-1 if s >= 0 else 1 for s in stream],
        }
    )


def test_chains_by_hand():
    chains = kernel_chains(_layers())
    assert len(chains) == 1
    row = chains.iloc[0]
    # add -> relu three times on stream 7 (the copy splits the last one off, the lone mul is no chain):
    # 3+2, 4+1 and 1+1 us; fused, each costs its longer kernel: saves 2 + 1 + 1 us, 3 launches, of the
    # 49 us kernel span (0 to 49 us).
    assert (row["length"], row["count"], row["time_ns"], row["saving_ns"]) == (2, 3, 12 * US, 4 * US)
    assert row["launches_saved"] == 3 and row["saving_pct"] == pytest.approx(100 * 4 / 49)
    assert row["categories"] == "elementwise"
    assert row["sequence"] == (
        "vectorized_elementwise_kernel<4, CUDAFunctor_add<float>, Ar… → "
        "vectorized_elementwise_kernel<4, launch_clamp_scalar>"
    )


def test_short_names_drop_namespaces_and_casts():
    assert short_kernel_name("void at::native::elementwise_kernel<(int)128, (int)4, f>(int, f)") == (
        "elementwise_kernel<128, 4, f>(int, f)"
    )


def test_the_chains_feed_the_fusion_rule():
    report = analyze(_layers(), trim_last_step=False)
    m = report.metrics
    assert m.fusion_chain_saving_pct == pytest.approx(100 * 4 / 49)
    assert "Repeated memory-bound kernel chains: 1; fused, about 8.2 % of the GPU span less" in format_report(
        report, "t"
    )
    rec = next(r for r in advise(m).recommendations if r.rule.id == "kern-fuse-chains")
    # The 50 us step less 8.2 % of it.
    assert rec.gain.before == pytest.approx(0.05) and rec.gain.after == pytest.approx(0.05 * (1 - 4 / 49))
    assert rec.changes == {"options.compile": True}


def test_no_kernels_no_chains():
    table = make_table({"rank": 0, "kind": ["cpu_op"], "name": ["aten::add"], "start_ns": [0], "dur_ns": [5]})
    assert kernel_chains(table).empty and analyze(table).metrics.fusion_chain_saving_pct is None


@needs_shared_traces
def test_the_v100_traces_batch_norm_chains_counted_from_the_json():
    folder = SHARED_TRACES / "kineto" / "ns_resolution_trace"
    chains = analyze(load_trace(folder)).tables["kernel_chains"]
    top = chains.iloc[0]
    # 10 per step over the 4 complete steps: a batch-norm backward amid its elementwise kernels.
    assert (top["length"], top["count"]) == (6, 40) and top["categories"] == "elementwise, normalization"
    # Independently from the raw events: kernels and copies per stream by start, runs of fusable ones.
    (path,) = folder.glob("*.json.gz")
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if str(e.get("name", "")).startswith("ProfilerStep#"))
    # analyze() drops the last, cut-off step (HTA's window): the GPU work launched before it starts (this
    # GPU-bound trace runs its kernels most of a step behind their launches).
    end = steps[-1][0]
    launched = {e["args"]["correlation"] for e in events if e.get("cat") == "cuda_runtime" and e["ts"] < end}
    gpu = sorted(
        (e["args"]["stream"], e["ts"], e["name"], e["cat"], round(e["dur"] * 1000))
        for e in events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e["args"].get("correlation") in launched
    )
    runs: dict[tuple, list[int]] = {}  # the kernels of a run -> [count, saving in ns]
    current: list = []

    def close():
        if len(current) >= 2:
            entry = runs.setdefault(tuple(n for n, _ in current), [0, 0])
            entry[0] += 1
            entry[1] += sum(d for _, d in current) - max(d for _, d in current)

    last_stream = None
    for stream, _, name, cat, dur in gpu:
        fusable = cat == "kernel" and kernel_category(name) in FUSABLE
        if stream != last_stream or not fusable:
            close()
            current = []
        if fusable:
            current.append((name, dur))
        last_stream = stream
    close()
    repeated = sorted(((len(k), c, sv) for k, (c, sv) in runs.items() if c >= 2), key=lambda r: -r[2])
    ours = list(zip(chains["length"], chains["count"], chains["saving_ns"], strict=True))
    assert ours == repeated[:20]
