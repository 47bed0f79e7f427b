"""The roofline figure on a small table whose every number is set by hand: what is plotted where, at
which size, against which roofs, and what the title says is left out."""

import html
import math

import pandas as pd
import pytest

from advisor.analysis.roofline import BOUNDS, ROOFLINE_COLUMNS
from advisor.present.charts import BOUND_COLOURS, roofline_figure

LONG_KERNEL = "void cutlass::Kernel<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_256x128_32x3_nn_align8<" + "x" * 300


def _row(name, bound, time_ms, flops, nbytes, calls=1, basis="shapes"):
    t_s = time_ms / 1e3
    return {
        "name": name,
        "op": "aten::mm" if flops else "",
        "input_dims": "[[4096, 4096], [4096, 4096]]" if basis == "shapes" else "",
        "precision": "bf16",
        "basis": basis,
        "calls": calls,
        "time_ms": time_ms,
        "mean_call_us": 1e3 * time_ms / calls,
        "flops": flops,
        "bytes": nbytes,
        "intensity_flops_per_byte": flops / nbytes if nbytes else math.nan,
        "achieved_flops_per_s": flops / t_s,
        "achieved_bytes_per_s": nbytes / t_s,
        "roof_flops_per_s": math.nan,
        "bound": bound,
        "headroom_frac": 0.25 if basis == "shapes" else math.nan,
    }


@pytest.fixture
def table() -> pd.DataFrame:
    """A GPU step of 12 ms: a GEMM of 4 ms at 1,000 FLOP/byte, a norm of 1 ms at 1 FLOP/byte, 5 ms of
    kernels with no shapes recorded and a 2 ms copy (bytes, no FLOPs)."""
    rows = [
        _row(LONG_KERNEL, "compute", 4.0, 4e12, 4e9, calls=2),
        _row("rms_norm_kernel", "memory", 1.0, 1e9, 1e9),
        _row("ncclDevKernel_AllReduce", "communication", 5.0, math.nan, math.nan, basis="kernel class"),
        _row("Memcpy DtoD (Device -> Device)", "memory", 2.0, 0.0, 2e9, basis="transfer"),
    ]
    df = pd.DataFrame(rows, columns=list(ROOFLINE_COLUMNS))
    df["bound"] = pd.Categorical(df["bound"], categories=BOUNDS)
    df.attrs["roofs"] = {
        "peak_flops_per_s": {"fp32": 1e12, "bf16": 4e12},
        "bytes_per_s": 1e11,
        "measured": True,
        "device": "Test GPU",
    }
    df.attrs["device"] = "gpu"
    return df


def test_points_sit_at_their_intensity_and_rate_sized_by_time(table):
    fig = roofline_figure(table)
    markers = {t.name: t for t in fig.data if t.mode == "markers"}
    assert list(markers) == ["compute", "memory"]  # no point has a communication verdict with FLOPs
    gemm, norm = markers["compute"], markers["memory"]
    # 4e12 FLOPs in 4 ms over 4e9 bytes; 1e9 FLOPs in 1 ms over 1e9 bytes.
    assert (gemm.x[0], gemm.y[0]) == (1000.0, 1e15) and (norm.x[0], norm.y[0]) == (1.0, 1e12)
    assert gemm.marker.color == BOUND_COLOURS["compute"] and norm.marker.color == BOUND_COLOURS["memory"]
    # Marker area in proportion to time: the 4 ms GEMM is 40 px across, the 1 ms norm 20 px.
    assert gemm.marker.sizemode == "area" and gemm.marker.sizeref == pytest.approx(2 * 4.0 / 40**2)
    assert math.sqrt(2 * norm.marker.size[0] / norm.marker.sizeref) == pytest.approx(40 / 2)
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log"
    assert fig.layout.xaxis.title.text == "arithmetic intensity, FLOP/byte"


def test_roofs_are_drawn_from_the_tables_peaks_and_bandwidth(table):
    lines = {t.name: t for t in roofline_figure(table).data if t.mode == "lines"}
    assert set(lines) == {
        "memory 100 GB/s (measured)",
        "fp32 peak 1 TFLOP/s (measured)",
        "bf16 peak 4 TFLOP/s (measured)",
    }
    # The diagonal rises at 1e11 FLOP/s per FLOP/byte up to the highest ridge point, 4e12 / 1e11 = 40.
    diagonal = lines["memory 100 GB/s (measured)"]
    assert diagonal.y[0] / diagonal.x[0] == pytest.approx(1e11) and diagonal.x[-1] == pytest.approx(40)
    # Each peak starts at its own ridge point (fp32: 1e12 / 1e11 = 10) and runs past the last point.
    fp32 = lines["fp32 peak 1 TFLOP/s (measured)"]
    assert list(fp32.y) == [1e12, 1e12] and fp32.x[0] == pytest.approx(10) and fp32.x[-1] > 1000
    table.attrs["roofs"]["measured"] = False
    assert "fp32 peak 1 TFLOP/s (datasheet)" in {t.name for t in roofline_figure(table).data}


def test_the_title_says_how_much_time_is_not_plotted(table):
    title = roofline_figure(table).layout.title.text
    # 5 of the 12 ms are plotted: 42 %; the kernel with no shapes and the copy are named with their time.
    assert title.startswith("Roofline on Test GPU: 2 kernels, 42 % of the kernels' time")
    assert "not plotted: 5.0 ms with no shapes recorded; 2.0 ms of copies and sets (no FLOPs)" in title


def test_hover_names_the_kernel_its_op_and_numbers_briefly(table):
    gemm = next(t for t in roofline_figure(table).data if t.name == "compute")
    lines = gemm.hovertext[0].split("<br>")
    # The kernel name cut to 80 characters (79 and an ellipsis), its template bracket escaped so plotly
    # shows it rather than reading a tag.
    assert lines[0] == "<b>void cutlass::Kernel&lt;cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_256x128_32x3…</b>"
    shown = html.unescape(lines[0].removeprefix("<b>").removesuffix("</b>"))
    assert len(shown) == 80 and shown == LONG_KERNEL[:79] + "…"
    assert lines[1:] == [
        "op: aten::mm",
        "shapes: [[4096, 4096], [4096, 4096]]",
        "2 calls, 4.000 ms (2000.0 us per call), bf16",
        "achieved 1 PFLOP/s, 1 TB/s",
        "intensity 1e+03 FLOP/byte",
        "compute-bound, 25 % of its time above the roof",
    ]


def test_a_trace_without_shapes_gets_a_figure_that_says_why(table):
    no_shapes = table[table["basis"] != "shapes"].copy()
    no_shapes.attrs = table.attrs
    fig = roofline_figure(no_shapes)
    assert not [t for t in fig.data if t.mode == "markers"]
    assert fig.layout.annotations[0].text == (
        "no op in this trace has recorded shapes: profile with record_shapes=True to place kernels on the roofline"
    )
    assert fig.layout.title.text.startswith("Roofline on Test GPU: nothing to plot<br><sup>not plotted: 5.0 ms")
    copies = table[table["basis"] == "transfer"].copy()
    copies.attrs = table.attrs
    assert roofline_figure(copies).layout.annotations[0].text == (
        "no kernels with FLOPs in this trace to place on the roofline"
    )
