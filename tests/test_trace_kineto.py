"""Kineto JSON loading and the HTA-style analyses, on the real GPU traces in ../shared/traces."""

import gzip
import json
import os
import re
import shutil
from pathlib import Path

import pandas as pd
import pytest

from advisor.analysis.breakdown import (
    comm_comp_overlap,
    drop_last_profiler_step,
    idle_split,
    idle_time_breakdown,
    kernel_breakdown,
    kernel_category,
    kernel_type_breakdown,
    round_like_hta,
    temporal_breakdown,
)
from advisor.analysis.summary import analyze
from advisor.errors import TraceError
from advisor.trace.kineto import ANALYSIS_FILE, load_kineto
from tests.shared import SHARED_TRACES

TRACES = SHARED_TRACES
KINETO, REFERENCE = TRACES / "kineto", TRACES / "reference"
needs_traces = pytest.mark.skipif(not KINETO.is_dir(), reason="real traces live in ../shared/traces (absent here)")


def _ref(folder: str, name: str) -> pd.DataFrame:
    return pd.read_csv(REFERENCE / folder / f"{name}.csv")


def _analysed(folder: str) -> pd.DataFrame:
    return drop_last_profiler_step(load_kineto(KINETO / folder))


@needs_traces
def test_event_counts_and_chunked_reading_agree():
    whole = load_kineto(KINETO / "ns_resolution_trace")
    counts = whole["kind"].value_counts()
    # Counted from the file's categories: cpu_op, cuda_runtime, kernel, gpu_memcpy, gpu_memset,
    # user_annotation + gpu_user_annotation.
    assert (counts["cpu_op"], counts["runtime"], counts["kernel"], counts["memcpy"], counts["memset"]) == (
        23910,
        15329,
        4350,
        1600,
        145,
    )
    assert counts["annotation"] == 70 + 15
    pd.testing.assert_frame_equal(whole, load_kineto(KINETO / "ns_resolution_trace", block_bytes=4096))
    two = load_kineto(KINETO / "trace_filter")
    assert two.attrs["ranks"] == [0, 1]  # from distributedInfo.rank
    copies = two[two["kind"] == "memcpy"]
    assert set(copies["copy_kind"]) <= {"HtoD", "DtoH", "DtoD"} and "pageable" in set(copies["host_mem"])


@needs_traces
@pytest.mark.parametrize("folder", ["trace_filter", "nccl_parser_config", "ns_resolution_trace"])
def test_kernel_span_matches_hta(folder):
    ours = temporal_breakdown(_analysed(folder))
    ref = _ref(folder, "temporal_breakdown")
    # HTA reports whole microseconds (its clock truncates); ours is in ns over the same window (the last
    # ProfilerStep dropped): equal to within a few microseconds of ~0.5 s.
    assert (ours["kernel_span_ns"] / 1000).tolist() == pytest.approx(ref["kernel_time(us)"].tolist(), abs=3)


@needs_traces
def test_temporal_breakdown_trace_filter_matches_hta():
    ours = temporal_breakdown(_analysed("trace_filter"))
    ref = _ref("trace_filter", "temporal_breakdown")
    for col in ("idle", "compute", "non_compute"):
        assert ours[f"{col}_pct"].tolist() == pytest.approx(ref[f"{col}_time_pctg"].tolist(), abs=0.05)


@needs_traces
@pytest.mark.parametrize("folder", ["nccl_parser_config", "ns_resolution_trace"])
def test_temporal_breakdown_sub_microsecond_traces_match_hta(folder):
    # These traces carry nanoseconds. HTA 0.5 shrinks every event inward to whole microseconds
    # (round_like_hta); with that rounding our breakdown is HTA's: every time to the microsecond, every
    # share to its printed two decimals.
    ours = temporal_breakdown(round_like_hta(_analysed(folder)))
    ref = _ref(folder, "temporal_breakdown")
    for col in ("idle", "compute", "non_compute"):
        assert (ours[f"{col}_ns"] / 1000).tolist() == ref[f"{col}_time(us)"].tolist()
        assert ours[f"{col}_pct"].tolist() == pytest.approx(ref[f"{col}_time_pctg"].tolist(), abs=0.005)


@needs_traces
def test_we_keep_nanoseconds_on_purpose():
    # Without HTA's rounding the ~1 us memcpys of this trace keep their length: less idle time. Rounded,
    # it is HTA's 2.63 % (reference temporal_breakdown.csv).
    exact = temporal_breakdown(_analysed("ns_resolution_trace")).loc[0]
    rounded = temporal_breakdown(round_like_hta(_analysed("ns_resolution_trace"))).loc[0]
    assert exact["idle_pct"] == pytest.approx(1.68, abs=0.01) and rounded["idle_pct"] == pytest.approx(2.63, abs=0.005)


@needs_traces
@pytest.mark.parametrize("folder", ["trace_filter", "nccl_parser_config"])
def test_comm_compute_overlap_within_one_point(folder):
    ours = comm_comp_overlap(round_like_hta(_analysed(folder)))
    ref = _ref(folder, "comm_comp_overlap")
    assert ours["overlap_pct"].tolist() == pytest.approx(ref["comp_comm_overlap_pctg"].tolist(), abs=0.05)


@needs_traces
@pytest.mark.parametrize("folder", ["trace_filter", "nccl_parser_config", "ns_resolution_trace"])
def test_kernel_type_shares_within_one_point(folder):
    ours = kernel_type_breakdown(round_like_hta(_analysed(folder))).set_index("kernel_type")["time_pct"]
    ref = _ref(folder, "kernel_type_breakdown").set_index("kernel_type")["percentage"]
    assert set(ref.index) == set(ours.index)
    for kind, pct in ref.items():
        assert ours[kind] == pytest.approx(pct, abs=0.1), kind  # HTA prints one decimal


def _idle_shares(table: pd.DataFrame, time_col: str) -> dict:
    """{(rank, stream, category): share of that stream's idle time} from unrounded idle times."""
    totals = table.groupby(["rank", "stream"])[time_col].transform("sum")
    shares = (table[time_col] / totals).fillna(0.0)
    return {
        (int(r), int(s), c): v
        for r, s, c, v in zip(table["rank"], table["stream"], table["idle_category"], shares, strict=True)
    }


@needs_traces
@pytest.mark.parametrize("folder", ["trace_filter", "nccl_parser_config"])
def test_idle_split_per_stream_within_two_points(folder):
    ours = _idle_shares(idle_time_breakdown(round_like_hta(_analysed(folder))), "idle_ns")
    ref = _idle_shares(_ref(folder, "idle_time_breakdown"), "idle_time")
    assert len(ref) >= 2  # (rank, stream, category) shares of HTA's table: several to compare
    for key, share in ref.items():
        assert ours.get(key, 0.0) == pytest.approx(share, abs=0.01), key


@needs_traces
def test_idle_split_sub_microsecond_trace_within_two_points():
    ours = _idle_shares(idle_time_breakdown(round_like_hta(_analysed("ns_resolution_trace"))), "idle_ns")
    ref = _idle_shares(_ref("ns_resolution_trace", "idle_time_breakdown"), "idle_time")
    assert len(ref) >= 2
    for key, share in ref.items():
        assert ours.get(key, 0.0) == pytest.approx(share, abs=0.01), key


@needs_traces
def test_host_bound_trace_is_host_wait():
    # nccl_parser_config is host-bound: HTA puts 99 % of stream 7's idle time on host wait.
    ours = idle_split(_analysed("nccl_parser_config"))
    assert ours.loc[0, "host_wait_pct"] == pytest.approx(99.0, abs=2.0)


@needs_traces
def test_kernel_categories_on_real_kernels():
    cats, top = kernel_breakdown(_analysed("trace_filter"))
    assert top.loc[0, "name"].startswith("ncclKernel_SendRecv") and top.loc[0, "category"] == "communication"
    assert top.loc[0, "time_ns"] == 195_327_000 + 168_027_000  # HTA's kernel_breakdown_top: both ranks
    assert cats["time_pct"].sum() == pytest.approx(100.0)


@pytest.mark.parametrize(
    ("name", "kind", "category"),
    [
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "kernel", "communication"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1", "kernel", "gemm"),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", "kernel", "gemm"),
        ("void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "kernel", "attention"),
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>",
            "kernel",
            "elementwise",
        ),
        (
            "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>",
            "kernel",
            "normalization",
        ),
        ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>", "kernel", "reduction"),
        ("void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<float>>", "kernel", "optimizer"),
        ("Memcpy HtoD (Pageable -> Device)", "memcpy", "memcpy"),
    ],
)
def test_kernel_category_names(name, kind, category):
    assert kernel_category(name, kind) == category


# Real kernel names, by where they were found: [alexnet] HTA @ f4d0062c tests/data/critical_path/alexnet
# (A100, tests/data/hta here); [a100] and [v100] ../shared/traces nccl_parser_config and
# ns_resolution_trace; [trace_filter] ../shared/traces trace_filter; [mi300x] AMD-AGI/TraceLens @
# 171dd747 tests/traces/mi300/resnet_act_checkpoint.json.gz (ResNet on an MI300X); [miopen] ROCm/MIOpen
# kernel sources: src/kernels/gpu_reference_kernel/naive_conv.cpp @ 01aec825 and
# src/kernels/MIOpenPooling.cl @ 2e957fb3. Composable Kernel's mangled names run to ~2,000 characters:
# their first 120 are kept, which is all the pattern reads.
CONVOLUTIONS = [
    "cudnn_ampere_scudnn_128x64_relu_xregs_large_nn_v1",  # [alexnet]
    "sm80_xmma_fprop_implicit_gemm_indexed_tf32f32_tf32f32_f32_nhwckrsc_nchw_tilesize128x128x16_stage4_"
    "warpsize2x2x1_g1_tensor16x8x8_alignc4_execute_kernel_cudnn",  # [alexnet]
    # [alexnet] cuDNN's FFT convolution: "cudnn::reduced_divisor" made it a reduction.
    "void fft2d_r2c_32x32<float, false, 0u, false>(float2*, float const*, int, int, int, int, int, int, int, "
    "int, int, cudnn::reduced_divisor, bool, int2, int, int)",
    "void fft2d_c2r_32x32<float, false, false, 0u, false, false>(float*, float2 const*, int, int, int, int, int, "
    "int, int, int, int, float, float, cudnn::reduced_divisor, bool, float*, float*, int2, int, int)",
    "void cask_cudnn::computeOffsetsKernel<false, false>(cask_cudnn::ComputeOffsetsParams)",  # [alexnet]
    "sm80_xmma_dgrad_implicit_gemm_tf32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize128x128x16_stage4_warpsize2x2x1_"
    "g1_tensor16x8x8_execute_kernel_cudnn_infer",  # [a100]
    "void cutlass_cudnn_train::Kernel<cutlass_tensorop_s1688wgrad_optimized_tf32_256x64_16x4_nhwc_align4>"
    "(cutlass_tensorop_s1688wgrad_optimized_tf32_256x64_16x4_nhwc_align4::Params)",  # [a100]
    "void cudnn::cnn::reduce_wgrad_nchw_helper<float, float>(void*, void const*, float, int, int)",  # [a100]
    "void cudnn::winograd_nonfused::winogradForwardData4x4<float, float>"
    "(cudnn::winograd_nonfused::WinogradDataParams<float, float>)",  # [v100]
    "void wgrad_alg0_engine<float, 128, 5, 5, 3, 3, 3, false, 512>(int, int, int, float const*, int, float*, "
    "float const*, kernel_grad_params, unsigned long long, int, float, int, int, int, int)",  # [v100]
    "igemm_fwd_gtcx3_nhwc_bf16_bx0_ex1_bt128x128x32_wt32x32x8_ws1x1_wr2x2_ta1x8x2x1_1x4x1x64_tb1x8x2x1_"
    "1x4x1x64_gkgs",  # [mi300x] MIOpen's implicit GEMM, forward
    "igemm_wrw_gtcx3_nhwc_bf16_bx0_ex1_bt64x64x64_wt32x32x8_ws1x1_wr1x1_ta1x4x1x4_1x16x1x16_tb1x4x1x4_"
    "1x16x1x16_gkgs",  # [mi300x] and its weight gradient
    "_ZN2ck16tensor_operation6device12_GLOBAL__N_149kernel_grouped_conv_fwd_multiple_abd_xdl_cshuffleINS_34"
    "GridwiseGemmMulti",  # [mi300x]
    "_ZN2ck16tensor_operation6device37kernel_batched_gemm_xdlops_bwd_weightINS_47GridwiseGemm_bk0mk1_bk0nk1_"
    "mn_xdlops_bwd_weig",  # [mi300x]
    "naive_conv_fwd_nchw_fp16",  # [miopen]
]
POOLING = [
    "void at::native::(anonymous namespace)::max_pool_forward_nchw<float, float>(int, float const*, long, "
    "long, long, int, int, int, int, int, int, int, int, int, int, float*, long*)",  # [alexnet]
    "void at::native::(anonymous namespace)::adaptive_average_pool<float>(float const*, float*, int, int, "
    "int, int, long, long, long)",  # [alexnet]
    "void at::native::(anonymous namespace)::max_pool_backward_nchw<c10::BFloat16, float>(c10::BFloat16 "
    "const*, long const*, int, long, long, long, int, int, int, int, int, int, int, int, int, int, "
    "c10::BFloat16*)",  # [mi300x]
    "mloPoolingG",  # [miopen]
]


@pytest.mark.parametrize("name", CONVOLUTIONS)
def test_convolution_kernels_are_convolutions(name):
    assert kernel_category(name) == "convolution"


@pytest.mark.parametrize("name", POOLING)
def test_pooling_kernels_are_pooling(name):
    assert kernel_category(name) == "pooling"


@pytest.mark.parametrize(
    ("name", "category"),
    [
        # [trace_filter] FBGEMM's embedding permute: "pooled", not pooling.
        (
            "void permute_pooled_embs_kernel<float>(float const*, long const*, long const*, long const*, "
            "float*, long, long, long)",
            "other",
        ),
        # [v100] cuDNN's batch norm and layout transform are not convolutions.
        (
            "void cudnn::bn_fw_tr_1C11_kernel_NCHW<float, float, int, 128, true, 1, true>(cudnnTensorStruct, "
            "float const*, cudnnTensorStruct, float*, float const*, float const*, float, float, float*, float*, "
            "float*, float*, float, float)",
            "normalization",
        ),
        (
            "void cudnn::ops::nchwToNhwcKernel<float, float, float, false, true, (cudnnKernelDataType_t)0>"
            "(cudnn::ops::nchw2nhwc_params_t<float>, float const*, float*)",
            "other",
        ),
        ("ampere_gcgemm_64x64_nt", "gemm"),  # [alexnet] the complex GEMM of cuDNN's FFT convolution
    ],
)
def test_convolution_and_pooling_neighbours_keep_their_class(name, category):
    assert kernel_category(name) == category


def test_kernel_classes_of_a_real_cnn_trace():
    # HTA's AlexNet trace (A100, tests/data/hta), 66,203,000 ns of GPU events. Convolutions: scudnn
    # 2,069,000 + xmma fprop 1,814,000 + FFT 290,000 + 137,000 + 130,000 + cask offsets 8,000 = 4,448,000
    # (6.719 %; they read 0 %, split into gemm and other, the FFT into reduction); pooling: max_pool
    # 644,000 + adaptive_average_pool 271,000 = 915,000 (1.382 %); GEMMs: ampere_sgemm 2,621,000 +
    # gcgemm 646,000 + cuBLASLt epilogue 39,000 = 3,306,000 (4.994 %, was 7.734 with the fprop).
    path = Path(__file__).parent / "data" / "hta" / "alexnet_benchmark_result_2869224_1695835535_trace.json.gz"
    cats, _ = kernel_breakdown(load_kineto(path))
    pct = dict(zip(cats["category"], cats["time_pct"].round(3), strict=True))
    assert (pct["convolution"], pct["pooling"], pct["gemm"]) == (6.719, 1.382, 4.994)
    assert "reduction" not in pct and pct["other"] == 0.47  # cuDNN's nchwToNhwc 277,000 + dropout 34,000


# --- bad input: a clear TraceError, nothing else ---


def _write_gz(path: Path, data: bytes) -> Path:
    with gzip.open(path, "wb") as f:
        f.write(data)
    return path


def test_bad_traces_fail_clearly(tmp_path):
    good = json.dumps({"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": 2}]}).encode()
    cases = {
        "invalid JSON": (tmp_path / "bad.json", b'{"traceEvents": [{"ph": "X",, }]}', "is not valid JSON"),
        "wrong schema": (tmp_path / "other.json", b'{"layers": [1, 2, 3]}', "without a traceEvents array"),
        "empty trace": (tmp_path / "empty.json", b'{"traceEvents": []}', "holds no trace events"),
        "truncated": (tmp_path / "cut.json", good[: len(good) // 2], "truncated"),
        "not objects": (tmp_path / "nums.json", b'{"traceEvents": [1, 2]}', "holds no trace events"),
    }
    for path, data, words in cases.values():
        path.write_bytes(data)
        with pytest.raises(TraceError, match=words):
            load_kineto(path)
    truncated_gz = tmp_path / "cut.json.gz"
    truncated_gz.write_bytes(_write_gz(tmp_path / "full.json.gz", good * 1).read_bytes()[:-12])
    with pytest.raises(TraceError, match="damaged or not gzip"):
        load_kineto(truncated_gz)
    bomb = _write_gz(tmp_path / "bomb.json.gz", b'{"traceEvents": [' + b" " * (8 * 2**20) + b"]}")
    assert bomb.stat().st_size < 64 * 2**10  # 8 MiB of blanks compress to a few KiB
    with pytest.raises(TraceError, match="decompresses to over 1 MiB"):
        load_kineto(bomb, max_bytes=2**20)
    # A limit under 1 MiB is shown as given (--max-mb 0.1), not rounded to "0 MiB", with the flag to raise it.
    with pytest.raises(
        TraceError, match=r"decompresses to over 0\.1 MiB; refusing it \(raise the limit: analyze --max-mb"
    ):
        load_kineto(bomb, max_bytes=2**20 // 10)
    big = tmp_path / "big.json"
    big.write_bytes(good + b" " * 2**20)
    with pytest.raises(TraceError, match="over the 1 MiB limit"):
        load_kineto(big, max_bytes=2**20)
    empty_dir = tmp_path / "emptydir"
    empty_dir.mkdir()
    with pytest.raises(TraceError, match=r"holds no \.json or \.json\.gz trace files"):
        load_kineto(empty_dir)


@needs_traces
def test_non_utf8_file_names_load(tmp_path):
    original = KINETO / "trace_filter" / "sampled_rank-1.json.gz"
    odd = tmp_path / os.fsdecode(b"rank-1-caf\xe9.json.gz")
    shutil.copy(original, odd)
    df = load_kineto(odd)
    assert df.attrs["ranks"] == [1]
    pd.testing.assert_frame_equal(df, load_kineto(original))  # the same events as under the plain name


def test_the_standard_library_parser_reads_the_same_table(tmp_path, monkeypatch):
    # orjson is an optional speed-up (a GPU box's image may lack it): without it the standard
    # library's json reads the same events, and bad input still fails clearly.
    from advisor.analysis import collectives
    from advisor.analysis.summary import load_trace
    from advisor.trace import kineto as trace_kineto

    sample = Path(__file__).resolve().parents[1] / "traces" / "20261130-165248-tiny-6bcb2f" / "trace.json.gz"
    # Collective sizes: a real 2-rank NCCL trace where ../shared is here (our sample run has none).
    comm = KINETO / "trace_filter" if KINETO.is_dir() else sample
    fast, fast_sizes = load_kineto(sample, block_bytes=4096), collectives.collective_sizes(load_trace(comm))
    assert len(fast_sizes) > 0 or comm == sample
    monkeypatch.setattr(trace_kineto, "json_loads", json.loads)
    pd.testing.assert_frame_equal(fast, load_kineto(sample, block_bytes=4096))
    pd.testing.assert_frame_equal(fast_sizes, collectives.collective_sizes(load_trace(comm)))
    bad = tmp_path / "bad.json"
    bad.write_bytes(b'{"traceEvents": [{"ph": "X", "name": "\xff\xfe", "ts": 1}, {"ph": "X",, }]}')
    with pytest.raises(TraceError, match="is not valid JSON"):
        load_kineto(bad)


SAMPLE = Path(__file__).resolve().parents[1] / "traces" / "20261130-165248-tiny-6bcb2f" / "trace.json.gz"


def test_a_folder_leaves_out_saved_analyses_and_skips_other_json(tmp_path):
    shutil.copy(SAMPLE, tmp_path / "rank-0.json.gz")
    alone = load_kineto(tmp_path)
    # What analyze --save writes (StepMetrics, no traceEvents) is never read as a trace...
    (tmp_path / ANALYSIS_FILE).write_text(json.dumps({"run_id": "x", "source": "trace"}))
    (tmp_path / "rank-0.json.gz.metrics.json").write_text(json.dumps({"run_id": "x", "source": "trace"}))
    saved = load_kineto(tmp_path)
    pd.testing.assert_frame_equal(alone, saved)
    assert saved.attrs["files"] == ["rank-0.json.gz"] and saved.attrs["skipped_files"] == []
    # ...and another tool's JSON beside rank traces is skipped, and named.
    (tmp_path / "config.json").write_text(json.dumps({"layers": 4}))
    mixed = load_kineto(tmp_path)
    pd.testing.assert_frame_equal(alone, mixed)
    assert mixed.attrs["skipped_files"] == [
        "config.json is JSON without a traceEvents array: not a Kineto (PyTorch profiler) trace"
    ]
    # Damage is not skipped: a truncated JSON file still fails the folder.
    (tmp_path / "cut.json").write_bytes(b'{"traceEvents": [{"ph": "X"')
    with pytest.raises(TraceError, match=r"cut\.json ends inside its traceEvents array"):
        load_kineto(tmp_path)
    # A folder of no traces says so, with each file's reason, and its full path.
    other = tmp_path / "other"
    other.mkdir()
    for name in ("config.json", "notes.json", ANALYSIS_FILE):
        (other / name).write_text("{}")
    words = f"folder {other} holds no Kineto trace: config.json is JSON without a traceEvents array"
    with pytest.raises(TraceError, match=re.escape(words)):
        load_kineto(other)


def test_the_loader_keeps_the_args_asked_for_and_they_follow_the_table(tmp_path):
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0, "dur": 10,
         "args": {"Input Dims": [[2, 3], [3, 4]], "Input type": ["float", "float"]}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::view", "pid": 1, "tid": 1, "ts": 11, "dur": 1,
         "args": {"Input Dims": [[6]]}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::conv2d", "pid": 1, "tid": 1, "ts": 13, "dur": 5,
         "args": {"flops": 1234}},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce", "pid": 0, "tid": 7, "ts": 20, "dur": 4,
         "args": {"In msg nelems": 8, "dtype": "Float", "device": 0, "stream": 7}},
    ]  # fmt: skip
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    table = load_kineto(path, keep_args=lambda name: name in ("aten::mm", "ncclDevKernel_AllReduce"))
    kept = table.attrs["event_args"]
    # Asked for by name: mm and the NCCL kernel; the conv by its FLOP count; the view not at all.
    assert [table.loc[i, "name"] for i, _ in kept.items()] == ["aten::mm", "aten::conv2d", "ncclDevKernel_AllReduce"]
    assert kept.get(0)["Input Dims"] == [[2, 3], [3, 4]] and kept.get(1) == {}
    # pandas deep-copies attrs on every operation: the holder is shared, not copied.
    assert table[table["kind"] == "cpu_op"].attrs["event_args"] is kept
    assert "event_args" not in load_kineto(path).attrs  # nobody asked: nothing kept


def test_cuda_sync_events_are_kept_and_count_once(tmp_path):
    # Kineto's cuda_sync events (enable_cuda_sync_events): pid the device, tid the stream, and in args
    # the device, stream (-1: a context sync) and correlation id of the runtime call that waited.
    def sync(name, ts, dur, stream, corr, **extra):
        args = {"cuda_sync_kind": name, "stream": stream, "correlation": corr, "device": 0, "context": 1, **extra}
        return {
            "ph": "X",
            "cat": "cuda_sync",
            "name": name,
            "pid": 0,
            "tid": stream,
            "ts": ts,
            "dur": dur,
            "args": args,
        }

    def call(name, ts, dur, corr):
        return {"ph": "X", "cat": "cuda_runtime", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur,
                "args": {"correlation": corr}}  # fmt: skip

    events = [
        call("cudaLaunchKernel", 0, 5, 1),
        {"ph": "X", "cat": "kernel", "name": "gemm_kernel", "pid": 0, "tid": 7, "ts": 10, "dur": 100,
         "args": {"device": 0, "stream": 7, "correlation": 1}},
        call("cudaStreamSynchronize", 12, 100, 2),
        sync("Stream Sync", 13, 97, 7, 2),
        call("cudaStreamWaitEvent", 120, 2, 3),
        sync("Stream Wait Event", 120.5, 1, 9, 3, wait_on_stream=7, wait_on_cuda_event_record_corr_id=1),
        call("cudaDeviceSynchronize", 130, 20, 4),
        sync("Context Sync", 131, 18, -1, 4),
    ]  # fmt: skip
    path = tmp_path / "syncs.json"
    path.write_text(json.dumps({"traceEvents": events}))
    table = load_kineto(path)
    syncs = table[table["kind"] == "sync"]
    assert syncs["name"].astype(str).tolist() == ["Stream Sync", "Stream Wait Event", "Context Sync"]
    assert syncs["device"].tolist() == [0, 0, 0] and syncs["stream"].tolist() == [7, 9, -1]
    assert syncs["correlation"].tolist() == [2, 3, 4] and syncs["tid"].eq(-1).all()
    # Each record lies in the call with its correlation id: the two blocking calls count, 100 + 20 us;
    # the stream wait is reported apart, not blocking.
    report = analyze(table)
    assert report.metrics.sync_calls == 2 and report.metrics.sync_time_ms == pytest.approx(0.12)
    by_name = report.tables["sync_calls"]
    assert by_name.loc[~by_name["blocking"], ["name", "count", "time_ns"]].values.tolist() == [
        ["Stream Wait Event", 1, 1000]
    ]
    # The analyses that match HTA read GPU kernels, copies and sets only: the records change none.
    plain = load_kineto(path).query("kind != 'sync'")
    pd.testing.assert_frame_equal(temporal_breakdown(table), temporal_breakdown(plain))
    pd.testing.assert_frame_equal(idle_time_breakdown(table), idle_time_breakdown(plain))
