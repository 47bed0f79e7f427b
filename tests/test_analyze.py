"""Analyze any trace end to end: format sniffing, zips, run directories, the StepMetrics summary, CLI."""

import json
import math
import os
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest

from advisor.analysis.breakdown import launch_stats, memcpy_summary, phase_breakdown
from advisor.analysis.roofline import UNKNOWN_SIZE, trace_roofline
from advisor.analysis.summary import analyze, format_report, load_trace
from advisor.cli import main
from advisor.errors import TraceError
from advisor.present.views import roofline_rows
from advisor.trace.table import make_table
from tests.shared import SHARED_TRACES, needs_shared_traces

ROOT = Path(__file__).resolve().parents[1]
TRACES = SHARED_TRACES
needs_traces = needs_shared_traces
SAMPLE_RUN = ROOT / "traces" / "20261130-165248-tiny-6bcb2f"
HTA_DATA = ROOT / "tests" / "data" / "hta"
"""Small real traces from HolisticTraceAnalysis kept in the project (README there: origin, figures)."""


@needs_traces
def test_a_zip_of_rank_files_equals_the_folder(tmp_path):
    archive = tmp_path / "ranks.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for f in sorted((TRACES / "kineto" / "trace_filter").glob("*.json.gz")):
            z.write(f, arcname=f"some/dir/{f.name}")  # folders inside the zip are dropped
    from_zip = analyze(load_trace(archive)).metrics
    from_dir = analyze(load_trace(TRACES / "kineto" / "trace_filter")).metrics
    assert from_zip.n_ranks == from_dir.n_ranks == 2
    assert from_zip.gpu_idle_pct == pytest.approx(from_dir.gpu_idle_pct)
    # HTA reference: idle 53.56 and 54.72 % on the two ranks.
    assert from_dir.gpu_idle_pct == pytest.approx((53.56 + 54.72) / 2, abs=0.5)


@needs_traces
def test_summary_of_a_real_multi_gpu_nsys_capture():
    m = analyze(load_trace(TRACES / "nsys" / "nsysai_mfu_2gpu_before.sqlite")).metrics
    assert m.n_ranks == 2 and m.device_type == "cuda"
    # reference.json: device 0 idle 9.67 %, device 1 11.50 % of their own kernel spans... over the
    # per-rank span (first to last GPU event incl. copies) ours reads 8.7 and 10.5 %.
    assert 8 < m.gpu_idle_pct < 12
    assert m.kernel_category_pct["attention"] > 40  # flash_fwd dominates this capture
    assert m.top_ops[0]["name"].startswith("void flash::flash_fwd_kernel")
    assert m.pageable_copies == 34  # the 34 pageable HtoD copies counted in tests/test_trace_nsys.py


def test_our_own_cpu_run_is_summarised_from_its_trace():
    m = analyze(load_trace(SAMPLE_RUN)).metrics
    recorded = json.loads((SAMPLE_RUN / "metrics.json").read_text())
    assert m.device_type == "cpu" and m.gpu_idle_pct is None and m.n_ranks == 1
    # The step range in the trace is the profiled step (under the profiler), as recorded.
    assert m.step_time_ms == pytest.approx(recorded["profiled_step_time_ms"], rel=0.1)
    assert m.top_ops[0]["name"] == "aten::mm"
    assert sum(op["share_pct"] for op in m.top_ops) <= 100.0 + 1e-6  # self times do not double count


def test_unknown_and_hostile_inputs(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(TraceError, match="not a trace this tool reads; expected Kineto JSON"):
        load_trace(text)
    with pytest.raises(TraceError, match=r"no file or folder missing\.json"):
        load_trace(tmp_path / "missing.json")
    empty_zip = tmp_path / "empty.zip"
    with zipfile.ZipFile(empty_zip, "w") as z:
        z.writestr("readme.txt", "no traces")
    with pytest.raises(TraceError, match=r"holds no \.json or \.json\.gz files"):
        load_trace(empty_zip)
    big_zip = tmp_path / "big.zip"
    with zipfile.ZipFile(big_zip, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("rank-0.json", b"{" + b" " * (4 * 2**20) + b"}")
    with pytest.raises(TraceError, match="unpacks to 4 MiB, over the 1 MiB limit"):
        load_trace(big_zip, max_bytes=2**20)
    twins = tmp_path / "twins.zip"
    with zipfile.ZipFile(twins, "w") as z:
        z.writestr("a/rank-0.json", "{}")
        z.writestr("b/rank-0.json", "{}")
    with pytest.raises(TraceError, match=r"two files named rank-0\.json"):
        load_trace(twins)
    evil = tmp_path / "evil.zip"
    with zipfile.ZipFile(evil, "w") as z:
        z.writestr(
            "../../escape.json",
            json.dumps({"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": 1}]}),
        )
    df = load_trace(evil)  # the member's path is dropped: nothing is written outside a temp dir
    assert len(df) == 1 and not (tmp_path.parent / "escape.json").exists()
    sqlite_named_json = tmp_path / "trace.json"
    sqlite_named_json.write_bytes(b"SQLite format 3\x00" + b"\x00" * 100)
    with pytest.raises(TraceError, match=r"trace\.json"):
        load_trace(sqlite_named_json)  # sniffed as SQLite, refused as a damaged export


def test_cli_analyze(tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(SAMPLE_RUN, run)
    assert main(["analyze", str(run), "--save"]) == 0
    out = capsys.readouterr().out
    assert "run: 1 rank(s), cpu" in out and "aten::mm" in out
    saved = json.loads((run / "analysis.json").read_text())
    assert saved["source"] == "trace" and saved["top_ops"][0]["name"] == "aten::mm"
    assert main(["analyze", str(run), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"temporal_breakdown", "top_ops", "phases"} <= set(data["tables"])
    assert main(["analyze", str(tmp_path / "nope.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: analyze /") and err.endswith(
        "/nope.json: no such file or folder\n"
    )  # the full path given


def test_format_report_names_the_trace():
    text = format_report(analyze(load_trace(SAMPLE_RUN)), "sample")
    assert text.startswith("sample: 1 rank(s), cpu") and "Top ops:" in text


def test_files_a_folder_skipped_are_named_in_the_report_and_the_cli(tmp_path, capsys):
    shutil.copy(SAMPLE_RUN / "trace.json.gz", tmp_path / "rank-0.json.gz")
    (tmp_path / "config.json").write_text(json.dumps({"layers": 4}))
    reason = "config.json is JSON without a traceEvents array: not a Kineto (PyTorch profiler) trace"
    report = analyze(load_trace(tmp_path))
    assert report.skipped_files == (reason,)
    assert format_report(report, "ranks").splitlines()[1] == f"Skipped {reason}"
    assert main(["analyze", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["skipped_files"] == [reason]
    # A file alone, or a folder of traces only, skips nothing and says nothing.
    alone = analyze(load_trace(SAMPLE_RUN))
    assert alone.skipped_files == () and "Skipped" not in format_report(alone, "sample")


@needs_traces
@pytest.mark.parametrize(
    "file", ["nsysai_mfu_2gpu_before.sqlite", "nsysai_mfu_2gpu_after.sqlite", "pipit_cloverleaf_cuda.sqlite"]
)
def test_nsys_kernel_busy_time_through_our_analysis_matches_the_reference(file):
    from advisor.analysis.breakdown import union_ns

    ref = next(r for r in json.loads((TRACES / "nsys" / "reference.json").read_text()) if r["file"] == file)
    df = load_trace(TRACES / "nsys" / file)
    kernels = df[df["kind"] == "kernel"]
    starts = kernels["start_ns"].to_numpy()
    ends = starts + kernels["dur_ns"].to_numpy()
    assert union_ns(starts, ends) == ref["busy_all_devices"]["busy_ns"]
    assert int(ends.max() - starts.min()) == ref["busy_all_devices"]["span_ns"]
    for device, expected in ref["busy_per_device"].items():
        mine = kernels["device"].to_numpy() == int(device)
        assert union_ns(starts[mine], ends[mine]) == expected["busy_ns"], device


@needs_traces
def test_launch_bound_verdict_on_the_host_bound_and_the_gpu_bound_trace():
    # README of ../shared/traces: nccl_parser_config is host-bound (99 % of idle is host wait),
    # ns_resolution_trace GPU-bound (launch queue ~812 deep).
    host_bound = analyze(load_trace(TRACES / "kineto" / "nccl_parser_config")).metrics
    gpu_bound = analyze(load_trace(TRACES / "kineto" / "ns_resolution_trace")).metrics
    assert host_bound.launch_bound is True and gpu_bound.launch_bound is False
    assert "Verdict: launch/host-bound" in format_report(
        analyze(load_trace(TRACES / "kineto" / "nccl_parser_config")), "x"
    )


@needs_traces
def test_gemm_math_modes_on_real_traces():
    # ns_resolution_trace (V100, fp32): its GEMMs are volta_sgemm_* kernels, all of its 24.845 % GEMM
    # share; nccl_parser_config (A100, fp32 with TF32 allowed): the two cutlass_80_tensorop_s1688gemm_*
    # kernels, 8,217,258 + 4,746,528 ns of 102,977,881 = 12.589 %, the rest ampere_sgemm/simt_sgemm and
    # split-K reductions (its TF32 convolutions, sm80_xmma_{fprop,dgrad,wgrad}_implicit_gemm and
    # cutlass_tensorop_s1688{fprop,dgrad,wgrad}: 10.140 % more, are convolutions, not GEMMs); the nsys
    # H100 capture: nvjet (16-bit tensor-core) GEMMs only.
    fp32 = analyze(load_trace(TRACES / "kineto" / "ns_resolution_trace")).metrics
    assert (fp32.fp32_gemm_pct, fp32.tf32_gemm_pct) == (24.836, 0.0)
    tf32 = analyze(load_trace(TRACES / "kineto" / "nccl_parser_config")).metrics
    assert (tf32.fp32_gemm_pct, tf32.tf32_gemm_pct) == (0.108, 12.589)
    h100 = analyze(load_trace(TRACES / "nsys" / "nsysai_mfu_2gpu_before.sqlite")).metrics
    assert (h100.fp32_gemm_pct, h100.tf32_gemm_pct) == (0.0, 0.0)


def test_gemm_math_of_kernel_names():
    from advisor.analysis.breakdown import gemm_math

    assert gemm_math("volta_sgemm_128x64_nn") == "fp32"
    assert gemm_math("void cutlass::Kernel<cutlass_80_simt_sgemm_128x32_8x5_nn_align1>") == "fp32"
    assert gemm_math("void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_256x64_16x4_nn_align4>") == "tf32"
    assert gemm_math("sm80_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x16") == "tf32"
    assert gemm_math("volta_h884gemm_64x64_ldg8_nn") == "tensor_core_16bit_or_other"
    assert gemm_math("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1") == (
        "tensor_core_16bit_or_other"
    )
    assert gemm_math("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_bias_TNN") == "tensor_core_16bit_or_other"
    # fp32 without TF32 on Ampere/Hopper: cuBLAS's xmma SIMT kernels and its k = 1 kernel.
    assert gemm_math("sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize128x128x8_stage3_warpsize2x2x1_ffma_aligna4") == (
        "fp32"
    )
    assert gemm_math("void gemmk1_kernel<float, 256, 5, false, false, false, false>") == "fp32"


@pytest.mark.parametrize(
    ("name", "math"),
    [
        # Tensile's A/B type letter after the index letters (S single, B bf16, H half, D double; see
        # _TENSILE_TYPE_RE). Real names, their first 70-80 characters (the rest lists tuning tokens):
        # hipBLASLt on an MI250 (gfx90a), tests/data/hta's trace;
        ("Cijk_Alik_Bljk_SB_Bias_AS_SAV_UserArgs_MT64x16x32_MI16x16x1_SN_LDSB0_AFC1", "fp32"),
        ("Cijk_Ailk_Bjlk_SB_Bias_AS_SAV_UserArgs_MT64x16x16_MI16x16x1_SN_LDSB0_AFC1", "fp32"),
        # newer hipBLASLt on an MI300X, types apart: AMD-AGI/TraceLens @ 171dd747
        # tests/traces/mi300/Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz;
        ("Cijk_Ailk_Bljk_S_B_Bias_HA_S_SAV_UserArgs_MT16x16x128_MI16x16x1_SN_LDSB1", "fp32"),
        ("Cijk_Alik_Bljk_B_BS_BH_Bias_HA_S_SAV_UserArgs_MT256x128x64_MI16x16x1_SN_LDSB1", "tensor_core_16bit_or_other"),
        # rocBLAS bf16 (BBS: bf16 in and out, fp32 compute) on an MI300X, TraceLens
        # tests/traces/mi300/resnet_act_checkpoint.json.gz, and on an MI210, tests/traces/mi210/gpu_only_trace;
        ("Cijk_Ailk_Bljk_BBS_BH_MT64x64x64_MI16x16x16x1_SN_1LDSB0_APM1_ABV0_ACED0", "tensor_core_16bit_or_other"),
        ("Cijk_Ailk_Bjlk_BBS_BH_Bias_HAS_SAV_UserArgs_MT128x64x32_MI32x32x1_SN_LDSB0", "tensor_core_16bit_or_other"),
        # whole names from ROCm/Tensile @ a164ed70: Tensile/Configs/miopen/Logic/deepbench_conv/
        # vega10_Cijk_Ailk_Bljk_HB.yaml (fp16) and Tensile/Tests/extended/big_tensor/bigskinny_nt.yaml
        # (fp64: not the fp32 that mixed precision speeds up).
        (
            "Cijk_Ailk_Bljk_HB_MT032x128x32_GRVW02_LPB04_PGR0_PLR1_TT04_04_VW04_WG08_32_01_WGM01",
            "tensor_core_16bit_or_other",
        ),
        (
            "Cijk_Ailk_Bljk_DB_MT064x064x04_AF0EM01_ASEM01_BL1_GRVW02_GSU01_ISA900_K1_KLA_LPB00_MGWVW01_NLCA01_"
            "NLCB01_PBC1_PGR1_PLR1_TT04_04_USFGRO00_VAW01_VW02_WG16_16_01_WGM08",
            "tensor_core_16bit_or_other",
        ),
    ],
)
def test_gemm_math_of_tensile_kernel_names(name, math):
    from advisor.analysis.breakdown import gemm_math

    assert gemm_math(name) == math


def test_fp32_gemms_of_a_real_mi250_trace_are_fp32():
    # The trace's two hipBLASLt GEMMs are SB (fp32) kernels: 17,600 + 12,640 ns of the 149,042 ns of
    # GPU events, 20.290 %. They read as 16-bit, so the fp32 -> mixed precision advice stayed silent.
    m = analyze(load_trace(HTA_DATA / "mi250_minitoy_train_ROCm6_2_kineto.json.gz")).metrics
    assert (m.fp32_gemm_pct, m.tf32_gemm_pct) == (20.29, 0.0)
    assert m.kernel_category_pct["gemm"] == 20.29


def _rocm_steps(step_us: tuple[int, ...], copy_us: tuple[int, ...]) -> list[dict]:
    """Host ProfilerStep#N ranges, one kernel each, and the GPU copy of each range as ROCm's Kineto
    writes it (the MI250 trace of HTA's tests/data/amd_trace): a gpu_user_annotation on pid = device 2,
    tid = stream 0, with only an External id in its args, spanning the step's GPU work."""
    host = {"pid": 597913, "tid": 597913}
    events, ts = [], 1000
    for n, (step, busy) in enumerate(zip(step_us, copy_us, strict=True), start=1):
        kernel = {"pid": 2, "tid": 0, "ts": ts + 300, "dur": busy}
        events += [
            {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", **host, "ts": ts, "dur": step},
            {
                "ph": "X",
                "cat": "cuda_runtime",
                "name": "hipLaunchKernel",
                **host,
                "ts": ts + 100,
                "dur": 10,
                "args": {"correlation": n},
            },
            {
                "ph": "X",
                "cat": "kernel",
                "name": "Cijk_Alik_Bljk_SB_MT64x64x16_MI16x16x1",
                **kernel,
                "args": {"device": 2, "stream": 0, "correlation": n, "kind": "Dispatch Kernel"},
            },
            {
                "ph": "X",
                "cat": "gpu_user_annotation",
                "name": f"ProfilerStep#{n}",
                **kernel,
                "args": {"External id": n},
            },
        ]
        ts += step + 100
    return events


def test_rocm_gpu_copies_of_profiler_steps_are_not_host_steps(tmp_path):
    # Two host steps of 9 and 8 ms, their GPU copies 2 and 1.5 ms. The copies are the GPU's, not
    # more host steps: untrimmed the step is (9 + 8) / 2 = 8.5 ms (reading them as host steps gave
    # (9 + 8 + 2 + 1.5) / 4 = 5.125); trimmed to the complete steps, step 1's 9 ms. The copy of step 2
    # starts 300 us into the host's step 2: cutting at the copy's start kept step 2 (8.5 ms; 6.333
    # with the copies read as host steps as well).
    path = tmp_path / "rocm_steps.json"
    path.write_text(json.dumps({"traceEvents": _rocm_steps((9000, 8000), (2000, 1500))}))
    table = load_trace(path)
    copies = table[table["name"].str.startswith("ProfilerStep") & (table["device"] == 2)]
    assert len(copies) == 2 and (copies["stream"] == 0).all()
    assert analyze(table, trim_last_step=False).metrics.step_time_ms == pytest.approx(8.5)
    assert analyze(table).metrics.step_time_ms == pytest.approx(9.0)


def test_step_time_of_a_real_mi250_trace():
    # HTA's ROCm 6.2 trace of one MI250 GCD: host ProfilerStep#1 9,288.291 us; its GPU copy (1,031.368
    # us) no longer halves it to 5.160 ms (tests/data/hta/README.md).
    m = analyze(load_trace(HTA_DATA / "mi250_minitoy_train_ROCm6_2_kineto.json.gz")).metrics
    assert m.step_time_ms == pytest.approx(9.288291)


def test_rocm_names_are_understood(tmp_path):
    # A ROCm trace written by Kineto uses the same categories with HIP names: hipLaunchKernel, rocBLAS
    # Tensile GEMMs (Cijk_...), RCCL (ncclDevKernel_...), hipMemcpyWithStream (blocking).
    events = [
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "hipLaunchKernel",
            "pid": 1,
            "tid": 1,
            "ts": 0,
            "dur": 5,
            "args": {"correlation": 1},
        },
        {
            "ph": "X",
            "cat": "kernel",
            "name": "Cijk_Ailk_Bljk_HHS_BH_MT128x128x32_MI32x32x8x1",
            "pid": 0,
            "tid": 3,
            "ts": 10,
            "dur": 100,
            "args": {"device": 0, "stream": 3, "correlation": 1},
        },
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "hipLaunchKernel",
            "pid": 1,
            "tid": 1,
            "ts": 6,
            "dur": 5,
            "args": {"correlation": 2},
        },
        {
            "ph": "X",
            "cat": "kernel",
            "name": "ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)",
            "pid": 0,
            "tid": 4,
            "ts": 50,
            "dur": 100,
            "args": {"device": 0, "stream": 4, "correlation": 2},
        },
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "hipMemcpyWithStream",
            "pid": 1,
            "tid": 1,
            "ts": 200,
            "dur": 30,
            "args": {"correlation": 3},
        },
    ]
    path = tmp_path / "rocm.json"
    path.write_text(json.dumps({"traceEvents": events}))
    report = analyze(load_trace(path))
    cats = report.metrics.kernel_category_pct
    assert cats == {"gemm": 50.0, "communication": 50.0}
    # Overlap: the GEMM runs 10-110 us, the collective 50-150 us: 60 of its 100 us overlap.
    assert report.metrics.comm_overlap_pct == pytest.approx(60.0)
    assert report.metrics.sync_calls == 1 and report.metrics.sync_time_ms == pytest.approx(0.03)


def test_kernels_of_a_cuda_graph_stay_out_of_the_launch_delay():
    # One cudaGraphLaunch (0-10 us) runs three kernels at 20, 1000 and 2000 us, all carrying its
    # correlation id 1; a cudaLaunchKernel (3000-3005 us) launches one at 3010 us: a 5 us delay.
    us = 1000
    table = make_table(
        {
            "rank": 0,
            "kind": ["runtime", "kernel", "kernel", "kernel", "runtime", "kernel"],
            "name": ["cudaGraphLaunch", "k_a", "k_b", "k_c", "cudaLaunchKernel", "k_d"],
            "start_ns": np.array([0, 20, 1000, 2000, 3000, 3010]) * us,
            "dur_ns": np.array([10, 50, 50, 50, 5, 50]) * us,
            "device": [-1, 0, 0, 0, -1, 0],
            "stream": [-1, 7, 7, 7, -1, 7],
            "tid": [1, -1, -1, -1, 1, -1],
            "correlation": [1, 1, 1, 1, 2, 2],
        }
    )
    (row,) = launch_stats(table).itertuples()
    assert (row.kernels, row.graph_kernels) == (4, 3)
    # With the graph's kernels: delays of 10, 990, 1990 and 5 us (a mean of 748.75 us), calls of 8.75 us.
    assert row.launch_delay_mean_us == pytest.approx(5.0) and row.launch_delay_p95_us == pytest.approx(5.0)
    assert row.launch_call_mean_us == pytest.approx(5.0)
    assert row.kernel_mean_us == pytest.approx(50.0)  # every kernel still counts as a kernel


def _ranges(names: list[str], kinds: list[str], devices: list[int], ranks: list[int]):
    n = len(names)
    return make_table(
        {
            "rank": np.array(ranks, dtype=np.int32),
            "kind": kinds,
            "name": names,
            "start_ns": np.arange(n, dtype=np.int64) * 1000,
            "dur_ns": (np.arange(n, dtype=np.int64) + 1) * 10,  # row i lasts 10 * (i + 1) ns
            "device": devices,
        }
    )


def test_phases_are_the_host_ranges_named_as_phases():
    # Rows (duration): 0 step (10), 1 forward (20), 2 the GPU copy of forward (30), 3 a kernel named
    # step (40), 4 step on rank 1 (50), 5 ProfilerStep#1 (60), 6 optimizer (70), 7 forward on rank 0 (80).
    names = ["step", "forward", "forward", "step", "step", "ProfilerStep#1", "optimizer", "forward"]
    kinds = ["annotation", "annotation", "annotation", "kernel", "annotation", "annotation", "annotation", "annotation"]
    table = _ranges(names, kinds, [-1, -1, 0, 0, -1, -1, -1, -1], [0, 0, 0, 0, 1, 0, 1, 0])
    got = phase_breakdown(table)
    # The trace has step ranges of its own: ProfilerStep#1 is not a step; the GPU copy and the kernel
    # are not host ranges.
    assert got[["rank", "phase", "count", "total_ns"]].values.tolist() == [
        [0, "forward", 2, 100],
        [0, "step", 1, 10],
        [1, "optimizer", 1, 70],
        [1, "step", 1, 50],
    ]
    # No host range named step (a kernel is): ProfilerStep#N ranges are the steps, and a name that only
    # looks like one is not (a trailing newline, no number).
    names = ["ProfilerStep#1", "step", "ProfilerStep#12", "ProfilerStep#3\n", "ProfilerStep#x", "backward"]
    kinds = ["annotation", "kernel", "annotation", "annotation", "annotation", "annotation"]
    got = phase_breakdown(_ranges(names, kinds, [-1, 0, -1, -1, -1, -1], [0, 0, 0, 0, 0, 0]))
    assert got[["rank", "phase", "count", "total_ns"]].values.tolist() == [[0, "backward", 1, 60], [0, "step", 2, 40]]
    assert got["mean_ns"].tolist() == [60.0, 20.0]


def test_copies_of_unknown_size_have_an_unknown_bandwidth(tmp_path):
    # A Kineto gpu_memcpy without args.bytes: its size is unknown, not 0. One HtoD copy moves 1 MB in
    # 100 us (10 GB/s), a second HtoD and a DtoH give no size.
    def event(cat, name, ts, dur, corr, **args):
        place = {"pid": 0, "tid": 7} if cat != "cuda_runtime" else {"pid": 1, "tid": 1}
        gpu = {"device": 0, "stream": 7} if cat != "cuda_runtime" else {}
        return {"ph": "X", "cat": cat, "name": name, **place, "ts": ts, "dur": dur,
                "args": {**gpu, "correlation": corr, **args}}  # fmt: skip

    events = [
        event("cuda_runtime", "cudaLaunchKernel", 90, 5, 1),
        event("kernel", "ampere_sgemm_128x64_nn", 100, 50, 1),
        event("cuda_runtime", "cudaMemcpyAsync", 190, 5, 2),
        event("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 200, 100, 2, bytes=1_000_000),
        event("cuda_runtime", "cudaMemcpyAsync", 390, 5, 3),
        event("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 400, 100, 3),
        event("cuda_runtime", "cudaMemcpyAsync", 590, 5, 4),
        event("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 600, 100, 4),
    ]
    path = tmp_path / "copies.json"
    path.write_text(json.dumps({"traceEvents": events}))
    table = load_trace(path)
    copies = memcpy_summary(table).set_index("copy_kind", drop=False)
    assert copies.loc["HtoD", ["count", "unknown_size_count", "bytes"]].tolist() == [2, 1, 1_000_000]
    # Was 5.0 (1 MB over both copies' 200 us) and 0.0 for the DtoH.
    assert copies.loc["HtoD", "bandwidth_gbps"] == pytest.approx(10.0)
    assert math.isnan(copies.loc["DtoH", "bandwidth_gbps"]) and copies.loc["DtoH", "unknown_size_count"] == 1
    roofline = trace_roofline(table)
    rows = roofline.table.set_index("basis")
    assert rows.loc["transfer", "achieved_bytes_per_s"] == pytest.approx(1e10)
    unknown = rows.loc[[UNKNOWN_SIZE]]
    assert sorted(unknown["name"]) == ["Memcpy DtoH (Device -> Pageable)", "Memcpy HtoD (Pageable -> Device)"]
    assert unknown["bytes"].isna().all() and unknown["achieved_bytes_per_s"].isna().all()
    report = analyze(table, roofline=roofline)
    # Of 350 us of GPU events only the sized copy's 100 us has its bytes known (was 300 of 350).
    assert report.metrics.roofline_modelled_frac == pytest.approx(100 / 350)
    assert "10.0 GB/s      0.0  Memcpy HtoD" in format_report(report, "copies.json")
    shown = roofline_rows(roofline.table).set_index("basis")
    assert shown.loc["transfer", "achieved GB/s"] == 10.0
    assert shown.loc[[UNKNOWN_SIZE], "achieved GB/s"].tolist() == ["unknown", "unknown"]


def test_reuse_freed_memory_keeps_a_freed_array_in_the_process():
    """glibc gives a freed block over its mmap threshold back to the kernel (the RSS drops by its size);
    after reuse_freed_memory it stays for the next arrays (an analysis' next column comes from it,
    not from pages the kernel zeroes again). Measured in a child: the setting is process-wide."""
    import subprocess
    import sys

    code = """
import re, sys
import numpy as np
from advisor.analysis.summary import reuse_freed_memory
def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
if sys.argv[1] == "reuse":
    assert reuse_freed_memory()
a = np.ones(200 * 2**20 // 8)
held = rss()
del a
print(round((held - rss()) / 2**20))
"""
    if not Path("/proc/self/status").exists():
        pytest.skip("needs /proc (Linux) to read the resident memory")
    root = str(Path(__file__).resolve().parents[1])
    given_back = {
        mode: int(
            subprocess.run(
                [sys.executable, "-c", code, mode], capture_output=True, text=True, cwd=root, check=True
            ).stdout
        )
        for mode in ("default", "reuse")
    }
    assert given_back["default"] >= 190 and given_back["reuse"] <= 10, given_back


def test_share_one_heap_lets_a_thread_reuse_the_memory_it_freed():
    """glibc gives a new thread a heap of its own of at most 64 MiB: a larger array made on it is mapped
    afresh each time, its pages faulted in and zeroed again even after reuse_freed_memory. With one
    heap for all threads the second such array costs no page faults. In a child: the settings are
    process-wide and must come before the child's first thread."""
    import subprocess
    import sys

    code = """
import resource, sys, threading
import numpy as np
from advisor.analysis.summary import reuse_freed_memory, share_one_heap, use_small_pages
if sys.argv[1] == "one":
    assert share_one_heap()
use_small_pages()  # as load_trace(dedicated=True): with numpy's huge pages a fault maps 2 MiB
assert reuse_freed_memory()
faults = []
def work():
    for _ in range(2):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        a = np.ones(160 * 2**20 // 8)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        del a
thread = threading.Thread(target=work)
thread.start()
thread.join()
print(faults[1])
"""
    if not Path("/proc/self/status").exists():
        pytest.skip("needs Linux's glibc allocator")
    root = str(Path(__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    second = {
        mode: int(
            subprocess.run(
                [sys.executable, "-c", code, mode], capture_output=True, text=True, cwd=root, check=True, env=env
            ).stdout
        )
        for mode in ("default", "one")
    }
    # 160 MiB is 40,960 pages of 4 KiB.
    if second["default"] < 5000:
        pytest.skip(f"this allocator or kernel faults in no fresh pages for a thread's array ({second})")
    assert second["one"] <= 500, second


def test_use_small_pages_stops_numpys_huge_page_advice():
    """numpy advises transparent huge pages (MADV_HUGEPAGE: "hg" in the mapping's VmFlags) for arrays
    of 4 MiB or more; after use_small_pages a new array's mapping carries no such advice. In a child:
    the switch is process-wide."""
    import subprocess
    import sys

    code = """
import sys
import numpy as np
from advisor.analysis.summary import use_small_pages
if sys.argv[1] == "small":
    assert use_small_pages()
a = np.ones(64 * 2**20 // 8)
address, flags = a.ctypes.data + a.nbytes // 2, None  # numpy advises from the first whole page on
for line in open("/proc/self/smaps"):
    if "-" in line.split()[0] and ":" not in line.split()[0]:
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        inside = lo <= address < hi
    elif line.startswith("VmFlags:") and inside:
        flags = line.split()[1:]
print("hg" in flags)
"""
    if not Path("/proc/self/smaps").exists():
        pytest.skip("needs /proc/self/smaps (Linux) to read a mapping's advice")
    root = str(Path(__file__).resolve().parents[1])
    advised = {
        mode: subprocess.run(
            [sys.executable, "-c", code, mode], capture_output=True, text=True, cwd=root, check=True
        ).stdout.strip()
        for mode in ("default", "small")
    }
    assert advised["small"] == "False", advised
    if advised["default"] != "True":
        pytest.skip(f"this kernel or numpy gives no huge page advice to begin with ({advised})")


def test_the_apps_analysis_child_shares_one_heap_from_its_start(monkeypatch):
    """The app's analysis child starts with MALLOC_ARENA_MAX=1 in its environment: its watcher thread
    starts before the load, too early for share_one_heap to hold."""
    from advisor.run import analysis_child

    envs = []
    real_popen = analysis_child.subprocess.Popen
    monkeypatch.setattr(
        analysis_child.subprocess, "Popen", lambda *a, **k: envs.append(k["env"]) or real_popen(*a, **k)
    )
    child = analysis_child._Child()
    try:
        assert child.alive()
    finally:
        child.end()
    assert envs[0]["MALLOC_ARENA_MAX"] == "1"


def test_the_apps_analysis_child_sets_its_allocator_before_the_load(monkeypatch):
    """analysis_work (what the app's analysis child runs, and only it: the switches are process-wide)
    shares one heap among its threads, turns the huge pages off and keeps freed memory, all before the
    trace is read."""
    from advisor.analysis import summary
    from advisor.run import analysis_child as child

    calls = []
    real_load = summary.trace_load
    monkeypatch.setattr(summary, "use_small_pages", lambda: calls.append("small") or True)
    monkeypatch.setattr(summary, "reuse_freed_memory", lambda: calls.append("reuse") or True)
    monkeypatch.setattr(summary, "share_one_heap", lambda: calls.append("heap") or True)
    monkeypatch.setattr(summary, "trace_load", lambda *a, **k: calls.append("load") or real_load(*a, **k))
    request = {"label": "sample", "path": str(SAMPLE_RUN), "max_bytes": 2**30, "max_event_bytes": 2**24}
    result = child.analysis_work(request, lambda done, message: None)
    assert calls == ["heap", "small", "reuse", "load"]
    assert result.report.metrics.step_time_ms is not None
