"""Plotly figures of an Estimate. Pure presentation: numbers come from the estimator."""

from __future__ import annotations

import plotly.graph_objects as go

from advisor.estimator import Estimate, MemoryBreakdown
from advisor.report import MEMORY_LABELS, TIME_LABELS

GiB = 2**30
_MEMORY_COLOURS = ("#4c78a8", "#f58518", "#e45756", "#72b7b2", "#54a24b", "#bab0ac")


def memory_figure(est: Estimate) -> go.Figure:
    """Stacked bar of per-GPU memory by component (first and last pipeline stage when pp > 1),
    with the device capacity as a dashed line."""
    stages: list[tuple[str, MemoryBreakdown]] = [("per GPU", est.memory)]
    if est.setup.parallel.pp > 1:
        stages = [("first stage", est.memory_first_stage), ("last stage", est.memory_last_stage)]
    fig = go.Figure()
    for (key, label), colour in zip(MEMORY_LABELS.items(), _MEMORY_COLOURS, strict=True):
        fig.add_bar(
            name=label,
            x=[name for name, _ in stages],
            y=[getattr(mem, key) / GiB for _, mem in stages],
            marker_color=colour,
            hovertemplate="%{y:.2f} GiB<extra>" + label + "</extra>",
        )
    cap = est.capacity_bytes / GiB
    fig.add_hline(y=cap, line_dash="dash", line_color="black", annotation_text=f"capacity {cap:.0f} GiB")
    top = max(cap, max(mem.total_bytes for _, mem in stages) / GiB) * 1.1
    fig.update_layout(
        barmode="stack",
        yaxis_title="GiB",
        yaxis_range=[0, top],
        title="Memory per GPU",
        legend={"orientation": "h", "y": -0.15},
        margin={"l": 50, "r": 20, "t": 50, "b": 40},
        height=380,
    )
    return fig


def time_figure(est: Estimate) -> go.Figure:
    """Horizontal bar of the step-time components (ms), largest first."""
    d = est.time.as_dict()
    items = sorted(((label, d[k]) for k, label in TIME_LABELS.items() if d[k] > 0), key=lambda kv: kv[1])
    total = d["total_ms"]
    fig = go.Figure(
        go.Bar(
            x=[v for _, v in items],
            y=[k for k, _ in items],
            orientation="h",
            marker_color="#4c78a8",
            text=[f"{100 * v / total:.0f} %" for _, v in items],
            textposition="auto",
            hovertemplate="%{x:.1f} ms<extra></extra>",
        )
    )
    fig.update_layout(
        title=f"Step time {total:,.0f} ms",
        xaxis_title="ms per step",
        margin={"l": 190, "r": 20, "t": 50, "b": 40},
        height=380,
    )
    return fig


def phase_figure(metrics: dict) -> go.Figure:
    """Where one measured step's time went: data, forward, backward, optimizer, other (ms)."""
    names = ["data", "forward", "backward", "optimizer", "other"]
    values = [metrics[f"{n}_ms"] for n in names]
    fig = go.Figure(
        go.Bar(
            x=values,
            y=names,
            orientation="h",
            marker_color=["#bab0ac", "#4c78a8", "#f58518", "#e45756", "#72b7b2"],
            text=[f"{v:.1f} ms" for v in values],
            textposition="auto",
        )
    )
    title = f"Measured step {metrics['step_time_ms']:.1f} ms (estimate {metrics['estimate_step_time_ms']:.1f} ms)"
    if metrics.get("extrapolated"):
        title += " - extrapolated"
    fig.update_layout(title=title, xaxis_title="ms per step", height=320, margin={"l": 90, "r": 20, "t": 50, "b": 40})
    return fig


def measured_memory_figure(metrics: dict) -> go.Figure:
    """Measured peak memory beside the estimator's prediction and the device capacity (GiB)."""
    measured, predicted = metrics["peak_memory_bytes"] / GiB, metrics["estimate_peak_memory_bytes"] / GiB
    fig = go.Figure(
        go.Bar(
            x=["measured peak", "estimated"],
            y=[measured, predicted],
            marker_color=["#4c78a8", "#bab0ac"],
            text=[f"{measured:.3f} GiB", f"{predicted:.3f} GiB"],
            textposition="auto",
        )
    )
    cap = metrics["memory_capacity_bytes"] / GiB
    if cap < 4 * max(measured, predicted):
        fig.add_hline(y=cap, line_dash="dash", annotation_text=f"capacity {cap:.0f} GiB")
    fig.update_layout(title=f"Peak memory ({100 * metrics['memory_frac']:.1f} % of {cap:.0f} GiB)", yaxis_title="GiB")
    fig.update_layout(height=320, margin={"l": 50, "r": 20, "t": 50, "b": 40})
    return fig


def nvml_figure(samples: list[dict]) -> go.Figure | None:
    """GPU utilisation (%), power (W) and SM clock (MHz) over the run; None without NVML samples."""
    if not samples:
        return None
    fig = go.Figure()
    t = [s["t_s"] for s in samples]
    for key, label in (("gpu_util_pct", "GPU util %"), ("power_w", "power W"), ("sm_clock_mhz", "SM clock MHz")):
        if any(key in s for s in samples):
            fig.add_scatter(x=t, y=[s.get(key) for s in samples], name=label, mode="lines")
    fig.update_layout(title="NVML samples", xaxis_title="s", height=320, margin={"l": 50, "r": 20, "t": 50, "b": 40})
    return fig


def temporal_figure(temporal) -> go.Figure:
    """Per rank: idle, compute and non-compute shares of the GPU kernel span (stacked %)."""
    fig = go.Figure()
    ranks = [f"rank {r}" for r in temporal["rank"]]
    for col, label, colour in (
        ("compute_pct", "compute", "#4c78a8"),
        ("non_compute_pct", "communication + memory", "#f58518"),
        ("idle_pct", "idle", "#bab0ac"),
    ):
        fig.add_bar(name=label, x=ranks, y=temporal[col], marker_color=colour, hovertemplate="%{y:.1f} %")
    fig.update_layout(barmode="stack", yaxis_title="% of kernel span", title="GPU time per rank", height=340)
    fig.update_layout(margin={"l": 50, "r": 20, "t": 50, "b": 40}, legend={"orientation": "h", "y": -0.2})
    return fig


def category_figure(categories) -> go.Figure:
    """Share of summed GPU-event time per kernel category."""
    cats = categories.sort_values("time_pct")
    fig = go.Figure(
        go.Bar(
            x=cats["time_pct"],
            y=cats["category"],
            orientation="h",
            marker_color="#4c78a8",
            text=[f"{v:.1f} %" for v in cats["time_pct"]],
            textposition="auto",
        )
    )
    fig.update_layout(title="Kernel time by category", xaxis_title="% of GPU time", height=340)
    fig.update_layout(margin={"l": 110, "r": 20, "t": 50, "b": 40})
    return fig
