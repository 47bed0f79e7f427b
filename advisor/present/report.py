"""Readable summaries of an Estimate: text for the CLI, rows for the app's tables."""

from __future__ import annotations

import textwrap

from advisor.estimate.efficiency import ERROR_BAND, band_note, memory_band_applies
from advisor.estimate.estimator import TIGHT_FRAC, TIME_LABELS, Estimate

GiB = 2**30

MEMORY_LABELS = {
    "weights_bytes": "weights",
    "grads_bytes": "gradients",
    "optimizer_bytes": "optimizer states",
    "activations_bytes": "activations",
    "buffers_bytes": "temp/comm buffers",
    "overhead_bytes": "runtime + fragmentation",
}


def fmt_duration(ms: float) -> str:
    """A step time in the unit a reader takes in at a glance: ms up to 10 s, then s, min, h, days (a
    what-if at a billion-token sequence read "step 1,570,584,263,385 ms")."""
    for limit, unit, scale in ((10e3, "ms", 1.0), (120e3, "s", 1e3), (7200e3, "min", 60e3), (172800e3, "h", 3600e3)):
        if ms < limit:
            return f"{ms:,.0f} ms" if unit == "ms" else f"{ms / scale:,.1f} {unit}"
    return f"{ms / 86400e3:,.1f} days"


def fmt_params(n: float) -> str:
    """A parameter count as read: 70.55B, 1.24B, 124.4M, 3.1M ("tiny (0.00B params)" read as none)."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n:,.0f}"


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
    params = f"{fmt_params(m.n_params)} params" + (f", {fmt_params(m.n_active_params)} active" if m.is_moe else "")
    return (
        f"{m.name} ({params}) on {s.gpus} x {s.hardware.name}; {layout}, {', '.join(extras)}; "
        f"{t.precision}{' (fp32 grads)' if t.fp32_grads else ''} {t.optimizer}, recompute {t.recompute}, "
        f"flash {'on' if t.flash_attention else 'off'}; {step}"
    )


def verdict(est: Estimate) -> str:
    """FITS / DOES NOT FIT with the numbers behind it."""
    used, cap = est.memory.total_bytes / GiB, est.capacity_bytes / GiB
    band = memory_band(est)
    unit = "process" if est.setup.hardware.kind == "cpu" else "GPU"  # a CPU host runs processes, not GPUs
    line = f"{used:.1f} GiB of {cap:.1f} GiB per {unit} ({100 * est.memory_frac:.0f} %{', ' + band if band else ''})"
    if not est.host_fits:
        host = est.host_bytes_per_node / GiB
        has = est.setup.hardware.host_memory_bytes / GiB
        return (
            f"DOES NOT FIT: offloaded state needs {host:.0f} GiB of host memory per node, more than the node's "
            f"{has:.0f} GiB; {line}"
        )
    if est.tight:
        return (
            f"TIGHT: {line}; above {100 * TIGHT_FRAC:.0f} %, where allocation spikes, fragmentation and the memory "
            "estimate's error (checked against published peaks for eager FSDP only) can tip it over"
        )
    if est.fits:
        return f"FITS: {line}"
    return f"DOES NOT FIT: {line}"


def step_band(est: Estimate) -> str:
    """The step time's error band as text: '±8.5 %' and what it is (empty on a CPU or before a fit)."""
    if ERROR_BAND is None or est.setup.hardware.kind != "gpu":
        return ""
    return f"±{ERROR_BAND.step_pct:.0f} %"


def memory_band(est: Estimate) -> str:
    """The memory estimate's error band as text, for the kind of setup published peaks measured it on
    (``memory_band_applies``); empty elsewhere, where no source has checked it."""
    if ERROR_BAND is None or ERROR_BAND.memory_pct is None or not memory_band_applies(est.setup):
        return ""
    return f"±{ERROR_BAND.memory_pct:.0f} %"


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


def mfu_note(est: Estimate) -> str:
    """What the estimate's MFU rests on, said beside it: the rates this layout's kernels reach (GEMMs by
    their shapes, attention by its kernel and sequence: ``advisor.estimate.efficiency``, constants fitted on
    published runs) and the communication it leaves exposed; and that MFU counts attention
    non-causally (PaLM, appendix B) while a causal flash kernel executes half of it, so MFU runs above
    HFU and grows with the sequence."""
    hw = est.setup.hardware
    if hw is None or hw.kind == "cpu":
        return ""
    hfu = f"HFU {100 * est.hfu_frac:.1f} %"
    if est.hfu_frac < est.mfu_frac:
        hfu = f"it counts attention non-causally (PaLM), so it exceeds {hfu}, the FLOPs the causal kernel executes"
    else:
        hfu = f"{hfu} adds the recomputed FLOPs"
    band = f" ({step_band(est)})" if step_band(est) else ""
    return (
        f"MFU {100 * est.mfu_frac:.1f} %{band}: this layout's GEMMs at {100 * est.gemm_frac:.0f} % of the "
        f"{est.setup.train.precision} peak, attention at {100 * est.attention_frac:.0f} % of the 16-bit peak, "
        f"communication overlapped as the framework schedules it; {hfu}. {band_note()}"
    ).strip()


def format_estimate(est: Estimate) -> str:
    """The CLI's readable breakdown."""
    head = f"Memory per GPU (fullest stage, {est.memory.moment})"
    out = [describe_setup(est), "", verdict(est), "", f"{head:44s}GiB      %"]
    for label, gib, pct in memory_rows(est):
        out.append(f"  {label:38s}{gib:9.2f} {pct:6.1f}")
    mband = f" {memory_band(est)}" if memory_band(est) else ""
    out.append(f"  {'total':38s}{est.memory.total_bytes / GiB:9.2f}{mband}")
    if est.memory.host_bytes:
        out.append(f"  {'(offloaded to host memory)':38s}{est.memory.host_bytes / GiB:9.2f}")
    out += ["", f"Step time{'':35s}ms      %"]
    for label, ms, pct in time_rows(est):
        out.append(f"  {label:38s}{ms:9.1f} {pct:6.1f}")
    band = f" {step_band(est)}" if step_band(est) else ""
    out.append(f"  {'total':38s}{est.step_time_ms:9.1f}{band}")
    out += [
        "",
        f"Throughput: {est.tokens_per_s:,.0f} tokens/s; MFU {100 * est.mfu_frac:.1f} %{band}, HFU {100 * est.hfu_frac:.1f} %",
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
        if off := m.get("activation_offload"):
            out.append("  " + offload_line(off))
        if um := m.get("unified_memory"):
            out.append(
                f"  Unified Memory: peak {um.get('peak_bytes', 0) / GiB:.3f} GiB managed in {um.get('allocations', 0)} "
                f"segments, cap {um['budget']['cap_bytes'] / GiB:.1f} GiB ({um.get('refused_allocations', 0)} refused)"
                + um_hints_note(um)
            )
        if f8 := m.get("fp8"):
            out.append(f"  fp8: {f8['backend']} ({f8['recipe']} scaling), {f8['linears']} linears in fp8")
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
    if record.get("status") == "refused":
        return "\n".join(out)  # nothing ran: no trace to open, no command that would run
    if ((metrics or {}).get("world_size") or 1) > 1:
        out.append("  traces: ranks/rank-<r>.trace.json.gz, one per rank (open in https://ui.perfetto.dev)")
    else:
        out.append("  trace: trace.json.gz (open in https://ui.perfetto.dev)")
    out.append(f"  with Nsight Systems: {record.get('nsys_command', '')}")
    return "\n".join(out)


def um_hints_note(um: dict) -> str:
    """What a Unified Memory run's failed advice or prefetch calls mean ('' where none failed)."""
    n = um.get("hint_failures") or 0
    if not n:
        return ""
    return (
        f"; the placement hints failed on {n} segment{'s' if n != 1 else ''} (cudaMemAdvise / "
        "cudaMemPrefetchAsync: a GPU without concurrent managed access), which then moved on demand"
    )


def offload_line(off: dict) -> str:
    """One line on a run's activation offload (StepMetrics.activation_offload)."""
    where = "pinned host memory" if off.get("pinned") else "a host buffer (CPU device: saves nothing)"
    line = (
        f"activation offload: {off['blocks']:.0f} blocks, {off['bytes_offloaded'] / GiB:.3f} GiB a step to "
        f"{where} and back (estimate {off['estimate_bytes'] / GiB:.3f} GiB); copies {off['copy_out_ms']:.1f} ms "
        f"out at {off['out_gb_per_s']:.1f} GB/s, {off['copy_in_ms']:.1f} ms back at {off['in_gb_per_s']:.1f} GB/s, "
        f"{off['exposed_ms']:.1f} ms not hidden; host memory {off['host_bytes'] / GiB:.3f} GiB"
    )
    if off.get("step_cost_ms") is not None:
        line += (
            f"; it costs {off['step_cost_ms']:.1f} ms a step (median of {off['reference_pairs']:.0f} alternating "
            f"pairs' differences; steps with it {off['step_with_ms']:.1f} ms, without {off['step_without_ms']:.1f} ms)"
        )
    return line


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
