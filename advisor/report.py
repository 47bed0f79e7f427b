"""Readable summaries of an Estimate: text for the CLI, rows for the app's tables."""

from __future__ import annotations

import functools
import textwrap

from advisor.estimator import ATTENTION_EFFICIENCY_FRAC, Estimate

GiB = 2**30

MEMORY_LABELS = {
    "weights_bytes": "weights",
    "grads_bytes": "gradients",
    "optimizer_bytes": "optimizer states",
    "activations_bytes": "activations",
    "buffers_bytes": "temp/comm buffers",
    "overhead_bytes": "runtime + fragmentation",
}
TIME_LABELS = {
    "compute_ms": "compute (GEMM + attention)",
    "recompute_ms": "recompute",
    "memory_bound_ms": "memory-bound ops",
    "tp_comm_ms": "TP communication",
    "cp_comm_ms": "CP ring (exposed)",
    "ep_comm_ms": "EP all-to-all",
    "pp_comm_ms": "PP send/recv",
    "dp_comm_ms": "DP/ZeRO comm (exposed)",
    "bubble_ms": "pipeline bubble",
    "optimizer_ms": "optimizer step",
    "offload_ms": "CPU offload (exposed)",
}


def fmt_duration(ms: float) -> str:
    """A step time in the unit a reader takes in at a glance: ms up to 10 s, then s, min, h, days (a
    what-if at a billion-token sequence read "step 1,570,584,263,385 ms")."""
    for limit, unit, scale in ((10e3, "ms", 1.0), (120e3, "s", 1e3), (7200e3, "min", 60e3), (172800e3, "h", 3600e3)):
        if ms < limit:
            return f"{ms:,.0f} ms" if unit == "ms" else f"{ms / scale:,.1f} {unit}"
    return f"{ms / 86400e3:,.1f} days"


def describe_setup(est: Estimate) -> str:
    """One line: model, devices, layout, step shape."""
    s = est.setup
    m, t, p = s.model, s.train, s.parallel
    layout = f"dp{p.dp} tp{p.tp} pp{p.pp}" + (f"x{p.vpp}v" if p.vpp > 1 else "") + f" cp{p.cp} ep{p.ep}"
    extras = (
        [f"ZeRO-{p.zero}"]
        + (["SP"] if p.sequence_parallel else [])
        + ([f"offload {p.offload}"] if p.offload != "none" else [])
    )
    step = f"seq {t.seq_len} x micro {t.micro_batch} x accum {s.grad_accum} x dp {p.dp} = global {s.global_batch}"
    params = f"{m.n_params / 1e9:.2f}B params" + (f", {m.n_active_params / 1e9:.2f}B active" if m.is_moe else "")
    return (
        f"{m.name} ({params}) on {s.gpus} x {s.hardware.name}; {layout}, {', '.join(extras)}; "
        f"{t.precision}{' (fp32 grads)' if t.fp32_grads else ''} {t.optimizer}, recompute {t.recompute}, "
        f"flash {'on' if t.flash_attention else 'off'}; {step}"
    )


def verdict(est: Estimate) -> str:
    """FITS / DOES NOT FIT with the numbers behind it."""
    used, cap = est.memory.total_bytes / GiB, est.capacity_bytes / GiB
    line = f"{used:.1f} GiB of {cap:.1f} GiB per GPU ({100 * est.memory_frac:.0f} %)"
    if not est.host_fits:
        host = est.host_bytes_per_node / GiB
        return f"DOES NOT FIT: offloaded state needs {host:.0f} GiB of host memory per node, more than the node has; {line}"
    if est.fits:
        return f"FITS: {line}"
    return f"DOES NOT FIT: {line}"


def memory_rows(est: Estimate) -> list[tuple[str, float, float]]:
    """(component, GiB, share of total in %) for the fullest GPU."""
    d = est.memory.as_dict()
    total = d["total_bytes"]
    return [(label, d[k] / GiB, 100 * d[k] / total) for k, label in MEMORY_LABELS.items()]


def time_rows(est: Estimate) -> list[tuple[str, float, float]]:
    """(component, ms, share of step in %) for the non-zero components."""
    d = est.time.as_dict()
    total = d["total_ms"]
    return [(label, d[k], 100 * d[k] / total) for k, label in TIME_LABELS.items() if d[k] > 0]


@functools.cache
def _published_errors() -> tuple[float, int, int]:
    """On the published runs (``advisor.published``): the estimate's mean absolute step-time error in
    percent, how many of them it reads too fast, and how many there are."""
    from advisor.published import compare_published

    errors = [c.error_pct for c in compare_published()]
    return sum(abs(e) for e in errors) / len(errors), sum(e < 0 for e in errors), len(errors)


def mfu_note(est: Estimate) -> str:
    """What the estimate's MFU assumes, said beside it: it is the ideal of this model (every GEMM at the
    device's measured-ceiling efficiency, fused attention at half the peak, communication overlapped as
    the framework schedules it), and MFU counts attention non-causally (PaLM, appendix B) while a
    causal flash kernel executes half of it, so MFU runs above HFU and grows with the sequence.
    Published large runs measure lower: Llama 3 405B 38-43 % on H100 (Llama 3 paper, table 4),
    MegaScale 55.2 % (175B on 12,288 GPUs). Against ten published steps (Megatron-LM and torchtitan on
    A100) the estimated step is 14.3 % off on average, short on 9 (``advisor.published``,
    tests/test_published.py); a calibration on measured runs corrects the model."""
    hw = est.setup.hardware
    if hw is None or hw.kind == "cpu":
        return ""
    hfu = f"HFU {100 * est.hfu_frac:.1f} %"
    if est.hfu_frac < est.mfu_frac:
        hfu = f"it counts attention non-causally (PaLM), so it exceeds {hfu}, the FLOPs the causal kernel executes"
    else:
        hfu = f"{hfu} adds the recomputed FLOPs"
    err, fast, n = _published_errors()
    return (
        f"MFU {100 * est.mfu_frac:.1f} % is this setup's ideal: GEMMs at {100 * hw.matmul_efficiency_frac:.0f} % "
        f"of peak, fused attention at {100 * ATTENTION_EFFICIENCY_FRAC:.0f} %, communication overlapped as "
        f"scheduled; {hfu}. Large published runs measure 38-55 %. On {n} published training steps the "
        f"estimated step was off by {err:.0f} % on average, too fast on {fast} (bench/results/published_runs.md); "
        f"calibrate on measured runs to correct it."
    )


def format_estimate(est: Estimate) -> str:
    """The CLI's readable breakdown."""
    head = f"Memory per GPU (fullest stage, {est.memory.moment})"
    out = [describe_setup(est), "", verdict(est), "", f"{head:44s}GiB      %"]
    for label, gib, pct in memory_rows(est):
        out.append(f"  {label:38s}{gib:9.2f} {pct:6.1f}")
    out.append(f"  {'total':38s}{est.memory.total_bytes / GiB:9.2f}")
    if est.memory.host_bytes:
        out.append(f"  {'(offloaded to host memory)':38s}{est.memory.host_bytes / GiB:9.2f}")
    out += ["", f"Step time{'':35s}ms      %"]
    for label, ms, pct in time_rows(est):
        out.append(f"  {label:38s}{ms:9.1f} {pct:6.1f}")
    out.append(f"  {'total':38s}{est.step_time_ms:9.1f}")
    out += [
        "",
        f"Throughput: {est.tokens_per_s:,.0f} tokens/s; MFU {100 * est.mfu_frac:.1f} %, HFU {100 * est.hfu_frac:.1f} %",
        f"FLOPs per step: {est.model_flops_per_step:.3e} model, {est.hardware_flops_per_step:.3e} executed",
    ]
    if note := mfu_note(est):
        out += ["", textwrap.fill(note, 110)]
    return "\n".join(out)


def format_run(record: dict, metrics: dict | None, path) -> str:
    """The CLI's summary of a profiled run."""
    out = [f"run {record['run_id']}: {record['status']}" + (f" - {record['message']}" if record.get("message") else "")]
    out.append(f"  directory: {path}")
    if metrics:
        m = metrics
        out += [
            f"  {m['model_name']} on {m['device_name']}: seq {m['seq_len']} x micro {m['micro_batch']} x accum "
            f"{m['grad_accum']}, {m['precision']}, recompute {m['recompute']}",
            f"  step {m['step_time_ms']:.1f} ms (median of {m['steps_measured']}; estimate "
            f"{m['estimate_step_time_ms']:.1f} ms; {m['profiled_step_time_ms']:.1f} ms under the profiler): data {m['data_ms']:.1f}, forward {m['forward_ms']:.1f}, "
            f"backward {m['backward_ms']:.1f}, optimizer {m['optimizer_ms']:.1f}, other {m['other_ms']:.1f}",
            f"  peak memory {m['peak_memory_bytes'] / GiB:.3f} GiB (estimate {m['estimate_peak_memory_bytes'] / GiB:.3f}"
            f" GiB) of {m['memory_capacity_bytes'] / GiB:.1f} GiB",
            f"  {m['tokens_per_s']:,.0f} tokens/s; MFU {100 * m['mfu_frac']:.1f} %, HFU {100 * m['hfu_frac']:.1f} %",
        ]
        if m.get("proxy_note"):
            out.append(f"  {m['proxy_note']}")
        if (m.get("world_size") or 1) > 1:
            mems = ", ".join(f"{b / 2**30:.3f}" for b in m["rank_peak_memory_bytes"])
            out.append(f"  {m['world_size']} processes: {m['layout']}")
            out.append(f"  peak memory by rank (GiB): {mems}")
            out.append("  step by rank (ms): " + ", ".join(f"{t:.1f}" for t in m["rank_step_time_ms"]))
        nv = m.get("nvml") or {}
        if nv.get("nvml_available"):
            out.append(
                f"  NVML: util {nv.get('gpu_util_pct_mean', 0):.0f} %, power {nv.get('power_w_mean', 0):.0f} W, "
                f"SM clock {nv.get('sm_clock_mhz_mean', 0):.0f} MHz"
            )
        else:
            out.append(f"  {nv.get('nvml_reason', 'NVML unavailable')}")
        if m.get("roofline_bound"):
            out.append("  " + roofline_line(m))
    if ((metrics or {}).get("world_size") or 1) > 1:
        out.append("  traces: ranks/rank-<r>.trace.json.gz, one per rank (open in https://ui.perfetto.dev)")
    else:
        out.append("  trace: trace.json.gz (open in https://ui.perfetto.dev)")
    out.append(f"  with Nsight Systems: {record.get('nsys_command', '')}")
    return "\n".join(out)


def roofline_line(m: dict) -> str:
    """One line on the roofline verdict of a run's metrics (StepMetrics as a dict)."""
    shares = ", ".join(
        f"{b} {100 * (m.get(f'roofline_{b}_frac') or 0):.0f} %"
        for b in ("compute", "memory", "latency", "communication")
        if m.get(f"roofline_{b}_frac")
    )
    bound = {"latency": "latency/launch"}.get(m["roofline_bound"], m["roofline_bound"])
    line = f"roofline: {bound}-bound ({shares})"
    if m.get("roofline_headroom_ms") is not None:
        line += f"; {m['roofline_headroom_ms']:.1f} ms per step above the roofs"
    return line + f" [{m.get('roofline_roofs') or 'datasheet roofs'}]"
