"""Plotly figures of estimates, runs and traces. Pure presentation: the numbers come from the core."""

from __future__ import annotations

import math
import re

import plotly.graph_objects as go

from advisor.estimate.estimator import Estimate, MemoryBreakdown
from advisor.estimate.planner import layout_label
from advisor.present.report import MEMORY_LABELS, TIME_LABELS

GiB = 2**30
_MEMORY_COLOURS = ("#4c78a8", "#f58518", "#e45756", "#72b7b2", "#54a24b", "#bab0ac")


def memory_figure(est: Estimate) -> go.Figure:
    """Stacked bar of per-GPU memory by component (first and last pipeline stage when pp > 1, and
    between them a middle rank where uneven stages make it the fullest), with the device capacity as a
    dashed line."""
    stages: list[tuple[str, MemoryBreakdown]] = [("per GPU", est.memory)]
    pp = est.setup.parallel.pp
    if pp > 1:
        stages = [("first stage", est.memory_first_stage), ("last stage", est.memory_last_stage)]
        if 0 < est.memory_rank < pp - 1:
            stages.insert(1, (f"rank {est.memory_rank + 1} of {pp} (fullest)", est.memory))
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
    # Two lines: in a half-width plot at 1280 px one line ran past the edge. Which step time this is
    # (the timed steps' mean, not one traced step) is said, as the app shows three.
    title = f"Step {metrics['step_time_ms']:.1f} ms: the timed steps' mean"
    if metrics.get("extrapolated"):
        title += " (extrapolated)"
    title += f"<br><sup>no profiler running; estimate {metrics['estimate_step_time_ms']:.1f} ms</sup>"
    fig.update_layout(title=title, xaxis_title="ms per step", height=340, margin={"l": 90, "r": 20, "t": 70, "b": 40})
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


_PHASES = ("data", "forward", "backward", "optimizer", "other")
_KIND_COLOURS = {"run estimate": "#4c78a8", "verified gain": "#f58518"}


def compare_phase_figure(metrics_a: dict, metrics_b: dict, label_a: str = "A", label_b: str = "B") -> go.Figure:
    """Two measured steps' phases side by side: grouped horizontal bars of data, forward, backward,
    optimizer and other (ms per step), one trace per run."""
    fig = go.Figure()
    # Added B first: plotly stacks grouped horizontal bars bottom-up, so A reads above B in each group.
    for metrics, label, colour in ((metrics_b, label_b, "#f58518"), (metrics_a, label_a, "#4c78a8")):
        values = [metrics.get(f"{p}_ms") for p in _PHASES]
        fig.add_bar(
            name=label,
            x=values,
            y=list(_PHASES),
            orientation="h",
            marker_color=colour,
            hovertemplate="%{y}: %{x:.2f} ms<extra>" + label + "</extra>",
        )
    fig.update_layout(
        barmode="group",
        title="Step phases, A against B",
        xaxis_title="ms per step",
        yaxis={"categoryorder": "array", "categoryarray": list(reversed(_PHASES))},
        legend={"orientation": "h", "y": -0.2, "traceorder": "reversed"},
        height=360,
        margin={"l": 90, "r": 20, "t": 50, "b": 40},
    )
    return fig


def predicted_measured_figure(df) -> go.Figure:
    """Measured against predicted step time (ms) from ``history.predicted_vs_measured``: one scatter trace
    per kind, then the y = x line (dashed) where a perfect prediction lies. Log axes when the values span
    more than 20x; the hover names the run (and rule for a verified gain)."""
    fig = go.Figure()
    if len(df) == 0:
        fig.update_layout(title="Predicted vs measured: no measured runs yet", height=380)
        return fig
    for kind in dict.fromkeys(df["kind"]):
        part = df[df["kind"] == kind]
        fig.add_scatter(
            name=kind,
            x=part["predicted_ms"],
            y=part["measured_ms"],
            mode="markers",
            marker={"color": _KIND_COLOURS.get(kind, "#54a24b"), "size": 9},
            customdata=list(zip(part["run_id"], part["rule_id"], part["measured_over_predicted"], strict=True)),
            hovertemplate="%{customdata[0]} %{customdata[1]}<br>predicted %{x:.1f} ms, measured %{y:.1f} ms"
            "<br>measured / predicted %{customdata[2]:.2f}<extra>" + kind + "</extra>",
        )
    values = [*df["predicted_ms"], *df["measured_ms"]]
    lo, hi = min(values), max(values)
    fig.add_scatter(
        name="measured = predicted",
        x=[lo, hi],
        y=[lo, hi],
        mode="lines",
        line={"dash": "dash", "color": "black", "width": 1},
        hoverinfo="skip",
    )
    axis_type = "log" if hi > 20 * lo else "linear"
    fig.update_layout(
        title="Predicted vs measured step time",
        xaxis={"title": "predicted ms per step", "type": axis_type},
        yaxis={"title": "measured ms per step", "type": axis_type},
        legend={"orientation": "h", "y": -0.2},
        height=380,
        margin={"l": 60, "r": 20, "t": 50, "b": 40},
    )
    return fig


def _plotly_text(text: str) -> str:
    """``text`` with the characters plotly reads as markup escaped: kernel names such as
    ``elementwise_kernel<(int)128, ...>`` would otherwise lose their template arguments as unknown tags."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _lane_key(lane: str) -> tuple:
    """Lanes in reading order: the step, its phases, then the others by their numbers (stream 7 before
    23; a stream of -1, where the trace gives none, first), words before numbers at each position."""
    head = {"step": 0, "phase": 1}.get(lane, 2 if lane.startswith(("NVTX", "ranges")) else 3)
    return (head, *((0, int(w), "") if re.fullmatch(r"-?\d+", w) else (1, 0, w) for w in lane.split()))


def timeline_figure(df) -> go.Figure:
    """Gantt chart of one step from ``advisor.analysis.timeline.step_timeline``: one horizontal bar per row at its
    lane, from ``start_ms`` for ``dur_ms`` (ms from the step's start); one trace per kind and name, so the
    legend names the kernels or ops; the hover gives the name, start, end and duration."""
    fig = go.Figure()
    lanes = sorted(dict.fromkeys(df["lane"]), key=_lane_key)
    ranges = df["kind"] == "range"
    for (kind, name), part in df[~ranges].groupby(["kind", "name"], sort=False):
        start, dur = part["start_ms"].to_numpy(), part["dur_ms"].to_numpy()
        fig.add_bar(
            name=_plotly_text(name),
            base=start,
            x=dur,
            y=part["lane"],
            orientation="h",
            marker_color="#bab0ac" if part["lane"].iloc[0] == "step" else None,
            customdata=list(zip(start, start + dur, strict=True)),
            hovertemplate=_plotly_text(name)
            + "<br>%{customdata[0]:.3f} to %{customdata[1]:.3f} ms: %{x:.3f} ms<extra>"
            + _plotly_text(str(kind))
            + "</extra>",
        )
    # Host ranges (NVTX, record_function) run to thousands of names: one trace per lane, the name in
    # the hover, so the legend keeps naming the kernels or ops.
    for lane, part in df[ranges].groupby("lane", sort=False):
        start, dur = part["start_ms"].to_numpy(), part["dur_ms"].to_numpy()
        fig.add_bar(
            name=_plotly_text(lane),
            base=start,
            x=dur,
            y=part["lane"],
            orientation="h",
            marker_color="#9ecae9",
            marker_line={"width": 0.5, "color": "#4c78a8"},
            showlegend=False,
            hovertext=[_plotly_text(n) for n in part["name"]],
            customdata=list(zip(start, start + dur, strict=True)),
            hovertemplate="%{hovertext}<br>%{customdata[0]:.3f} to %{customdata[1]:.3f} ms: %{x:.3f} ms<extra>range</extra>",
        )
    steps = df[df["lane"] == "step"]
    # One step as traced (under the profiler): not the timed steps' mean the Profile tab leads with.
    name = str(steps["name"].iloc[0]) if len(steps) else ""
    label = name if name.startswith("whole trace") else f"One traced step, {name}"
    title = f"{label}: {steps['dur_ms'].iloc[0]:.1f} ms" if len(steps) else "Step timeline"
    fig.update_layout(
        barmode="overlay",
        title=title,
        xaxis_title="ms from the step's start",
        yaxis={"categoryorder": "array", "categoryarray": lanes, "autorange": "reversed"},
        # The legend names up to a dozen kernels or ops: below the axis title, in the figure's own height.
        legend={"orientation": "h", "yanchor": "top", "y": -0.25, "font": {"size": 10}},
        height=380 + 30 * len(lanes),
        margin={"l": 120, "r": 20, "t": 50, "b": 40},
    )
    return fig


def plan_scatter_figure(result) -> go.Figure:
    """Every fitting setting of an ``advisor.estimate.planner.PlanResult`` (its ``points``): memory per GPU (GiB)
    against predicted tokens/s, the top entries highlighted and labelled with their rank, and the device's
    capacity as a dashed vertical line. The hover names each layout."""
    fig = go.Figure()
    rest = [p for p in result.points if not p.in_top]
    fig.add_scatter(
        name="fits",
        x=[p.memory_gib for p in rest],
        y=[p.tokens_per_s for p in rest],
        mode="markers",
        marker={"color": "#bab0ac", "size": 6, "opacity": 0.6},
        text=[p.label for p in rest],
        hovertemplate="%{text}<br>%{x:.1f} GiB, %{y:,.0f} tokens/s<extra></extra>",
    )
    top = result.top
    fig.add_scatter(
        name=f"top {len(top)}",
        x=[e.estimate.memory.total_bytes / GiB for e in top],
        y=[e.estimate.tokens_per_s for e in top],
        mode="markers+text",
        marker={"color": "#e45756", "size": 11, "line": {"color": "black", "width": 1}},
        text=[f"#{e.rank}" for e in top],
        textposition="top center",
        customdata=[_plotly_text(layout_label(e.setup)) for e in top],
        hovertemplate="%{text} %{customdata}<br>%{x:.1f} GiB, %{y:,.0f} tokens/s<extra></extra>",
    )
    cap = result.request.hardware.memory_bytes / GiB
    fig.add_vline(
        x=cap,
        line_dash="dash",
        line_color="black",
        annotation_text=f"capacity {cap:.0f} GiB",
        annotation_position="bottom left",
    )
    r = result.request
    fig.update_layout(
        title=f"{len(result.points):,} fitting settings of {r.model.name} on {r.gpus} x {r.hardware.name}"
        if result.points
        else "Nothing fits",
        xaxis={"title": "memory per GPU, GiB", "range": [0, cap * 1.05]},
        yaxis_title="tokens/s",
        legend={"orientation": "h", "y": -0.2},
        height=420,
        margin={"l": 70, "r": 20, "t": 50, "b": 40},
    )
    return fig


BOUND_COLOURS = {"compute": "#4c78a8", "memory": "#f58518", "latency": "#e45756", "communication": "#72b7b2"}
"""One colour per roofline verdict (``advisor.analysis.roofline.BOUNDS``), the same on every roofline chart."""
_ROOF_COLOURS = {
    "memory": "#555555",
    "fp32": "#222222",
    "tf32": "#7f3c8d",
    "bf16": "#11a579",
    "fp16": "#3969ac",
    "fp8": "#e73f74",
}
_NO_SHAPES = "no op in this trace has recorded shapes: profile with record_shapes=True to place kernels on the roofline"
_HOVER_NAME_CHARS = 80  # C++ kernel names run to pages; the table beside the chart has the rest


def _rate(value: float, unit: str) -> str:
    """``value`` per second with an SI prefix and 3 significant digits: ``_rate(1.76e11, "FLOP")`` is
    "176 GFLOP/s"."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}/s"
    return f"{value:.3g} {unit}/s"


def _short(text: str, limit: int) -> str:
    return _plotly_text(text if len(text) <= limit else text[: limit - 1] + "…")


def _roofline_hover(r, gpu: bool) -> str:
    lines = [f"<b>{_short(r.name, _HOVER_NAME_CHARS)}</b>"]
    if gpu or r.op != r.name:
        lines.append(f"op: {_short(r.op or 'unknown', _HOVER_NAME_CHARS)}")
    if r.input_dims:
        lines.append(f"shapes: {_short(r.input_dims, _HOVER_NAME_CHARS)}")
    lines.append(f"{r.calls:,} calls, {r.time_ms:.3f} ms ({r.mean_call_us:.1f} us per call), {r.precision}")
    lines.append(f"achieved {_rate(r.achieved_flops_per_s, 'FLOP')}, {_rate(r.achieved_bytes_per_s, 'B')}")
    lines.append(f"intensity {r.intensity_flops_per_byte:.3g} FLOP/byte")
    headroom = "" if math.isnan(r.headroom_frac) else f", {100 * r.headroom_frac:.0f} % of its time above the roof"
    lines.append(f"{r.bound}-bound{headroom}")
    return "<br>".join(lines)


def roofline_figure(table) -> go.Figure:
    """Log-log roofline of an ``advisor.analysis.roofline`` table: achieved FLOP/s against arithmetic intensity
    (FLOP/byte), one marker per row (op or kernel, and its shapes), its area proportional to its time,
    one trace per verdict coloured by ``BOUND_COLOURS``; the roofs (``table.attrs['roofs']``) drawn as
    lines: the bandwidth diagonal up to each precision's ridge point, then that precision's peak. Rows
    without FLOPs (no shapes recorded, copies and sets) cannot sit on log axes: the title says how much
    time they hold, and a trace with none plottable gets a figure that says why."""
    roofs = table.attrs.get("roofs") or {}
    gpu = table.attrs.get("device") == "gpu"
    what = "kernels" if gpu else "ops"
    t = table[table["time_ms"] > 0]
    plotted = (t["flops"] > 0) & (t["bytes"] > 0)
    plotted &= t["intensity_flops_per_byte"].map(math.isfinite) & (t["achieved_flops_per_s"] > 0)
    points = t[plotted]
    total_ms = float(t["time_ms"].sum())
    no_shapes_ms = float(t.loc[t["flops"].isna(), "time_ms"].sum())
    movement_ms = float(t.loc[~plotted & t["flops"].notna(), "time_ms"].sum())
    left_out = []
    if no_shapes_ms:
        left_out.append(f"{no_shapes_ms:,.1f} ms with no shapes recorded")
    if movement_ms:
        left_out.append(f"{movement_ms:,.1f} ms of copies and sets (no FLOPs)")
    device = roofs.get("device", "unknown device")
    if len(points):
        share = 100 * float(points["time_ms"].sum()) / total_ms
        title = f"Roofline on {device}: {len(points)} {what}, {share:.0f} % of the {what}' time"
    else:
        title = f"Roofline on {device}: nothing to plot"
    if left_out:
        title += "<br><sup>not plotted: " + "; ".join(left_out) + "</sup>"
    fig = go.Figure()
    if len(points):
        biggest = float(points["time_ms"].max())
        for bound, colour in BOUND_COLOURS.items():
            part = points[points["bound"] == bound]
            if part.empty:
                continue
            fig.add_scatter(
                name=bound,
                x=part["intensity_flops_per_byte"],
                y=part["achieved_flops_per_s"],
                mode="markers",
                # Marker area in proportion to time: the biggest is 40 px across.
                marker={
                    "color": colour,
                    "size": part["time_ms"],
                    "sizemode": "area",
                    "sizeref": 2 * biggest / 40**2,
                    "sizemin": 4,
                    "opacity": 0.75,
                    "line": {"color": "white", "width": 0.5},
                },
                text=[name[:_HOVER_NAME_CHARS] for name in part["name"]],
                hovertext=[_roofline_hover(r, gpu) for r in part.itertuples()],
                hovertemplate="%{hovertext}<extra></extra>",
            )
    _add_roofs(fig, roofs, points["intensity_flops_per_byte"])
    if not len(points):
        message = _NO_SHAPES if no_shapes_ms else f"no {what} with FLOPs in this trace to place on the roofline"
        fig.add_annotation(
            text=message,
            xref="paper",
            yref="paper",
            x=0.5,
            y=0.5,
            showarrow=False,
            bgcolor="white",
            bordercolor="#888888",
            borderpad=6,
        )
    fig.update_layout(
        title=title,
        xaxis={"title": "arithmetic intensity, FLOP/byte", "type": "log"},
        yaxis={"title": "achieved FLOP/s", "type": "log"},
        # Legend markers at one size: a bound's marker would otherwise take the size of its first point.
        legend={"orientation": "h", "yanchor": "top", "y": -0.18, "itemsizing": "constant"},
        height=480,
        margin={"l": 70, "r": 20, "t": 70, "b": 40},
    )
    return fig


def _add_roofs(fig: go.Figure, roofs: dict, intensity) -> None:
    """The bandwidth diagonal y = bytes_per_s * x up to the highest ridge point, and each precision's
    peak from its ridge point to the right edge, named in the legend with its value and source (labels
    on the lines would sit on the points near the ridge)."""
    peaks = roofs.get("peak_flops_per_s") or {}
    bw = roofs.get("bytes_per_s") or 0.0
    if not peaks or bw <= 0:
        return
    measured_peaks = set(roofs.get("measured_peaks", peaks if roofs.get("measured") else ()))
    source = "measured" if roofs.get("measured") else "datasheet"
    ridges = {p: f / bw for p, f in peaks.items()}
    # Without points, three decades of the diagonal and two of the peaks show where ops would fall.
    lo = min([*intensity, min(ridges.values())]) / 3 if len(intensity) else min(ridges.values()) / 1000
    hi = max([*intensity, max(ridges.values())]) * 3 if len(intensity) else max(ridges.values()) * 100
    top = max(ridges.values())
    fig.add_scatter(
        name=f"memory {_rate(bw, 'B')} ({source})",
        x=[lo, top],
        y=[bw * lo, bw * top],
        mode="lines",
        line={"color": _ROOF_COLOURS["memory"], "width": 1.5, "dash": "dash"},
        hoverinfo="name",
    )
    for precision, peak in sorted(peaks.items(), key=lambda kv: kv[1]):
        label = f"{precision} peak {_rate(peak, 'FLOP')} ({'measured' if precision in measured_peaks else 'datasheet'})"
        fig.add_scatter(
            name=label,
            x=[ridges[precision], hi],
            y=[peak, peak],
            mode="lines",
            line={"color": _ROOF_COLOURS.get(precision, "#222222"), "width": 1.5},
            hoverinfo="name",
        )
