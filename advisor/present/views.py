"""View models of the app's tabs: Markdown and tables from the core's results, with no Gradio in them,
so a handler in ``webui/`` is a call to the core and one of these, and each is tested on its own."""

from __future__ import annotations

import re
from typing import Any

import pandas as pd

from advisor.advice.advise import TARGET_LABELS, fmt_value, gain_phrase
from advisor.advice.evidence import UNKNOWN_SPREAD
from advisor.estimate.estimator import estimate
from advisor.estimate.planner import layout_label
from advisor.present.report import (
    describe_setup,
    fmt_duration,
    memory_rows,
    mfu_note,
    offload_line,
    roofline_line,
    step_band,
    time_rows,
    um_hints_note,
    verdict,
)
from advisor.spec.query import query_text

MEMORY_COLUMNS = ["component", "GiB", "share %"]
TIME_COLUMNS = ["component", "ms", "share %"]
TOP_OPS_COLUMNS = ["op", "calls", "self ms", "total ms", "GFLOP"]
TABLE_COLUMNS = ["name", "category", "time ms", "count", "share %"]
COLLECTIVE_COLUMNS = ["rank", "kind", "calls", "time_ms", "exposed_ms"]
NAME_CHARS = 90  # C++ template names run to pages
# The roofline table as shown: (column of advisor.analysis.roofline.ROOFLINE_COLUMNS, header, scale, decimals).
# The verdict and its numbers come right after the name, in view beside it; what identifies the row
# further (op, shapes) and how it was judged follow.
ROOFLINE_SHOWN = [
    ("name", "name", None, None),
    ("bound", "bound", None, None),
    ("time_ms", "ms over trace", 1, 3),  # summed over the whole trace, as the CLI says (not per step)
    ("headroom_frac", "headroom %", 100, 1),
    ("achieved_flops_per_s", "achieved GFLOP/s", 1e-9, 2),
    ("roof_flops_per_s", "roof GFLOP/s", 1e-9, 2),
    ("achieved_bytes_per_s", "achieved GB/s", 1e-9, 2),
    ("intensity_flops_per_byte", "FLOP/byte", 1, 2),
    ("calls", "calls", 1, 0),
    ("mean_call_us", "us per call", 1, 1),
    ("op", "op", None, None),
    ("input_dims", "input shapes", None, None),
    ("precision", "precision", None, None),
    ("basis", "basis", None, None),
]
ROOFLINE_HEADERS = [header for _, header, _, _ in ROOFLINE_SHOWN]
ROOFLINE_ROWS = 30
ADVICE_COLUMNS = ["#", "severity", "rule", "recommendation", "predicted gain %", "on", "before", "after"]
ADVICE_COLUMNS += ["estimator says", "calibrated says", "basis", "re-run here"]
VERIFY_COLUMNS = ["rule", "on", "verdict", "before", "predicted", "measured", "predicted gain %", "measured gain %"]
VERIFY_COLUMNS += ["baseline spread %", "baseline run", "re-run"]
PLAN_COLUMNS = ["rank", "layout", "tokens/s", "step ms", "MFU %", "memory GiB", "memory %"]
DIFF_CATEGORY_COLUMNS = ["category", "before ms", "after ms", "change ms", "before %", "after %"]
DIFF_CHANGE_COLUMNS = ["what", "status", "name", "before ms", "after ms", "change ms", "before calls"]
DIFF_CHANGE_COLUMNS += ["after calls"]
DIFF_ROWS = 10  # changed kernels, and changed ops, shown


def _sentence(line: str) -> str:
    return f"{line[0].upper()}{line[1:]}"


# --- Size ----------------------------------------------------------------------------------------


def _devices(setup) -> str:
    """'8 GPUs', '1 GPU', or on a CPU host '1 process' (its ranks are processes sharing the cores)."""
    n, what = setup.gpus, "process" if setup.hardware.kind == "cpu" else "GPU"
    return f"{n} {what}{'es' if what == 'process' and n != 1 else 's' if n != 1 else ''}"


def size_summary(est) -> str:
    """The Size tab's verdict: fits or not, tokens/s, step and MFU with their band, the setup. The
    verdict opens with its word (FITS, TIGHT, DOES NOT FIT), which the app colours: no emoji, which
    drew as an empty box where no emoji font is installed."""
    band = f" {step_band(est)}" if step_band(est) else ""
    summary = (
        f"### {verdict(est)}\n"
        f"**{est.tokens_per_s:,.0f} tokens/s**{band} · step {fmt_duration(est.step_time_ms)}{band} · "
        f"**MFU {100 * est.mfu_frac:.1f} %**{band} · {_devices(est.setup)} (dp {est.setup.parallel.dp})\n\n"
        f"<small>{describe_setup(est)}</small>"
    )
    if note := mfu_note(est):
        summary += f"\n\n<small>{note}</small>"
    return summary


def memory_table(est) -> pd.DataFrame:
    return pd.DataFrame(memory_rows(est), columns=MEMORY_COLUMNS).round(2)


def time_table(est) -> pd.DataFrame:
    return pd.DataFrame(time_rows(est), columns=TIME_COLUMNS).round(1)


# --- Profile: a stored run -----------------------------------------------------------------------


def _nvml_line(m: dict[str, Any]) -> str:
    nv = m.get("nvml") or {}
    if not nv.get("nvml_available"):
        return nv.get("nvml_reason", "NVML unavailable")
    return f"NVML: {nv.get('gpu_util_pct_mean', 0):.0f} % util, {nv.get('power_w_mean', 0):.0f} W"


def _technique_lines(m: dict[str, Any]) -> list[str]:
    """What the run's techniques did: roofline verdict, proxy, activation offload, fp8, Unified Memory."""
    lines = [_sentence(roofline_line(m))] if m.get("roofline_bound") else []
    if m.get("proxy_note"):
        lines.append(f"**{m['proxy_note']}**")
    if off := m.get("activation_offload"):
        lines.append(_sentence(offload_line(off)))
    if f8 := m.get("fp8"):
        lines.append(f"fp8: {f8['backend']} ({f8['recipe']} scaling), {f8['linears']} linears in fp8")
    if um := m.get("unified_memory"):
        lines.append(
            f"Unified Memory: peak {um.get('peak_bytes', 0) / 2**30:.3f} GiB managed in "
            f"{um.get('allocations', 0)} segments (cap {um['budget']['cap_bytes'] / 2**30:.1f} GiB: "
            f"{um['budget']['why']}); {um.get('refused_allocations', 0)} refused by the cap{um_hints_note(um)}. "
            f"{um['page_faults']}"
        )
    return lines


def _ranks_line(m: dict[str, Any]) -> str:
    mems = ", ".join(f"{b / 2**30:.3f}" for b in m["rank_peak_memory_bytes"])
    steps = ", ".join(f"{t:.1f}" for t in m["rank_step_time_ms"])
    skew = m.get("step_skew_pct")
    return (
        f"**{m['world_size']} processes: {m['layout']}.** Peak memory by rank (GiB): {mems}; "
        f"step by rank (ms): {steps}" + ("" if skew is None else f"; the slowest rank is {skew:.1f} % behind")
    )


def run_head(run_id: str, record: dict[str, Any]) -> str:
    head = f"### Run `{run_id}`: {record['status']}"
    return head + (f"\n{record['message']}" if record.get("message") else "")


def run_summary(run_id: str, record: dict[str, Any], m: dict[str, Any]) -> str:
    """A measured run in Markdown: step, tokens/s, MFU and peak memory against the estimate, the setup,
    what its techniques did, the ranks of a distributed run, and its Nsight Systems command."""
    parts = [
        f"{run_head(run_id, record)}\n**{m['step_time_ms']:.1f} ms per step** (the timed steps' mean, no "
        f"profiler; estimate {m['estimate_step_time_ms']:.1f} ms) · **{m['tokens_per_s']:,.0f} tokens/s** · MFU "
        f"{100 * m['mfu_frac']:.1f} % · peak memory {m['peak_memory_bytes'] / 2**30:.3f} GiB on {m['device_name']}",
        f"{m['model_name']}: seq {m['seq_len']} x micro {m['micro_batch']} x accum {m['grad_accum']}, "
        f"{m['precision']}, recompute {m['recompute']}, {m['optimizer']} · {_nvml_line(m)}",
        *_technique_lines(m),
    ]
    if (m.get("world_size") or 1) > 1:
        parts.append(_ranks_line(m))
    parts.append(f"With Nsight Systems:\n```\n{record.get('nsys_command', '')}\n```")
    return "\n\n".join(parts)


def top_ops_table(rows: list[dict[str, Any]], device_type: str, n: int = 15) -> pd.DataFrame:
    """A run's top ops (top_ops.json rows) by self time on its device, in ms and GFLOP."""
    key = "self_device_us" if device_type == "cuda" else "self_cpu_us"
    return pd.DataFrame(
        [(r["name"], r["calls"], r[key] / 1e3, r["cpu_total_us"] / 1e3, (r["flops"] or 0) / 1e9) for r in rows[:n]],
        columns=TOP_OPS_COLUMNS,
    ).round(3)


# --- Analyze -------------------------------------------------------------------------------------


def roofline_rows(table: pd.DataFrame) -> pd.DataFrame:
    """The roofline table's rows with the most time, in units for reading (headers carry them). The
    bandwidth of a row whose bytes are not known (a copy the trace gives no size for, a kernel judged
    by its class) reads "unknown"."""
    top = table.sort_values("time_ms", ascending=False, kind="stable").head(ROOFLINE_ROWS)
    shown = {}
    for column, header, scale, decimals in ROOFLINE_SHOWN:
        values = top[column]
        shown[header] = (
            values.astype(str).str.slice(0, NAME_CHARS) if scale is None else (values * scale).round(decimals)
        ).to_numpy()
    rate = pd.Series(shown["achieved GB/s"], dtype=object)
    shown["achieved GB/s"] = rate.where(rate.notna(), "unknown").to_numpy()
    return pd.DataFrame(shown)


def in_ms(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` with its ``*_ns`` columns in milliseconds (``*_ms``), as every other time in the app."""
    ns = [c for c in table.columns if str(c).endswith("_ns")]
    out = table.copy()
    for c in ns:
        out[c] = out[c] / 1e6
    return out.rename(columns={c: c[:-3] + "_ms" for c in ns})


TABLE_NOTES = {
    "temporal_breakdown": "per rank: kernel span split into idle, compute and non-compute time (HTA); also "
    "compute-idle (no computation kernel) and copies alone",
    "gpu_idle": "idle per device and over all devices at once; copies busy (HTA) and compute-only",
    "kernel_type_breakdown": "busy GPU time by type, overlaps as their own rows (HTA)",
    "comm_comp_overlap": "per rank: share of communication time overlapped by computation (HTA)",
    "idle_time_breakdown": "per rank and stream: idle time split into host wait, kernel wait, other (HTA)",
    "idle_split": "per rank: the idle split summed over streams, in %",
    "kernel_categories": "GPU-event time per kernel category",
    "top_kernels": "the kernels with the most time",
    "launch_stats": "per rank: launch delay and runtime-call statistics, tiny kernels, CUDA graphs",
    "memcpy": "copies and sets per direction and host memory: count, bytes, bandwidth",
    "sync_calls": "blocking synchronisation calls per name",
    "sync_time": "per rank: time blocked in synchronising calls",
    "phases": "per rank: step phases (data, forward, backward, optimizer) and how they were found",
    "memory_peak": "per rank and device: peak tensor memory seen in the trace",
    "rank_skew": "per rank: step time against the median rank, stragglers",
    "top_ops": "the host ops with the most self time",
    "gemm_precision": "GEMM time by math precision (fp32 SIMT, tf32, 16-bit, fp8)",
    "collectives": "per rank and collective kind: calls, bytes, time and exposed time",
    "kernel_chains": "repeated chains of elementwise/reduction/norm kernels on a stream (fusion candidates): "
    "count, time, and what fusing saves",
    "queue_length": "per rank and stream: operations launched and not yet finished, over its change points (HTA)",
    "blocked_on_full_queue": "per rank and stream: time the launch queue was at 1024 operations (HTA)",
    "idle_intervals": "per rank, stream and idle category: count and length statistics of the gaps (HTA)",
    "memory_bw": "per rank and copy kind: bandwidth of the copies running at once, GB/s (HTA)",
    "roofline": "per op or kernel: FLOPs, bytes, achieved rate and bound against the device's roofs",
}
"""One line on what each of analyze()'s tables holds, for the CLI's --table and the Analyze tab's picker
(a table without a note is still shown)."""


def table_choices(tables: dict[str, pd.DataFrame]) -> list[tuple[str, str]]:
    """(label, name) for every non-empty table of a report, in the report's order."""
    return [(f"{name} ({len(t):,} rows)", name) for name, t in tables.items() if not t.empty]


def table_view(tables: dict[str, pd.DataFrame], name: str, rows: int | None = 500) -> pd.DataFrame:
    """One of a report's tables as shown: times in ms, numbers to 3 decimals, at most ``rows`` rows
    (None: all)."""
    if name not in tables:
        raise KeyError(f"no table {name!r}; this report has: {', '.join(tables)}")
    shown = in_ms(tables[name] if rows is None else tables[name].head(rows))
    for c in shown.columns:
        if shown[c].dtype == object:
            shown[c] = shown[c].map(lambda v: v if isinstance(v, (str, int, float, bool)) or v is None else str(v))
    return shown.round(3)


def analysis_top_table(report) -> pd.DataFrame:
    """The top kernels of a GPU trace, or the top CPU ops of a CPU one, in the same five columns."""
    t = report.tables
    if not t["temporal_breakdown"].empty:
        top = t["top_kernels"].assign(time_ms=lambda d: d["time_ns"] / 1e6)
        top = top[["name", "category", "time_ms", "count", "time_pct"]]
    else:
        ops = t["top_ops"]
        top = pd.DataFrame(
            {
                "name": ops["name"],
                "category": "cpu op",
                "time_ms": ops["time_ns"] / 1e6,
                "count": ops["count"],
                "time_pct": [op["share_pct"] for op in report.metrics.top_ops],
            }
        )
    top.columns = TABLE_COLUMNS
    top["name"] = top["name"].astype(str).str.slice(0, NAME_CHARS)
    return top.round(3)


def analysis_details(report) -> pd.DataFrame:
    """Idle time by stream (a GPU trace) or the step's phases (a CPU one), times in ms (the phases
    showed ``total_ns`` beside every other table's ms)."""
    t = report.tables
    gpu = not t["temporal_breakdown"].empty
    return in_ms(t["idle_time_breakdown"] if gpu else t["phases"]).round(3)


# --- Advice --------------------------------------------------------------------------------------


def _advice_row(i: int, r) -> list:
    g = r.gain
    head = [i, r.rule.severity, r.rule.id, r.rule.title]
    rerun = "" if r.evidence is None else r.evidence.sentence()
    if g is None:
        return [*head, None, TARGET_LABELS[r.rule.target], "", "", "", "", r.action_note, rerun]
    return [
        *head,
        round(g.gain_pct, 1),
        TARGET_LABELS[r.rule.target],
        *(fmt_value(g.target, g.before), fmt_value(g.target, g.after)),
        "" if g.analytic_after is None else fmt_value(g.target, g.analytic_after),
        "" if g.calibrated_after is None else fmt_value(g.target, g.calibrated_after),
        g.basis + (" (upper bound)" if g.upper_bound else ""),
        rerun,
    ]


def advice_table(advice) -> pd.DataFrame:
    """The ranked recommendations, one row each: gain, before and after, and what each model says."""
    return pd.DataFrame([_advice_row(i, r) for i, r in enumerate(advice.recommendations, 1)], columns=ADVICE_COLUMNS)


def advice_summary(advice) -> str:
    """How many recommendations for what, the top one with its predicted gain, and the rules' count."""
    n = len(advice.recommendations)
    if n:
        top = advice.recommendations[0]
        g = top.gain
        gain = f" (predicted: {gain_phrase(g.target, g.gain_pct)})" if g else ""
        summary = f"### {n} recommendation{'s' * (n > 1)} for {advice.source}\nTop: **{top.rule.title}**{gain}."
    else:
        summary = f"### Nothing to recommend for {advice.source}\nNo rule fired on this input."
    demoted = [r for r in advice.rejected if r.evidence is not None and r.evidence.verdict == "refuted"]
    for r in demoted:
        summary += f"\n\nNo longer recommended: **{r.rule.title}** (`{r.rule.id}`), {r.action_note}."
    return summary + f"\n\n<small>{advice.n_rules} rules; {len(advice.not_applicable)} lacked their input.</small>"


def apply_label(i: int, rec) -> str:
    """A recommendation as the Apply dropdown names it."""
    return f"#{i} {rec.rule.id}: {rec.rule.title}"


def applied_message(rec, source: str) -> str:
    """What applying ``rec`` changed, its predicted effect, and what to press next."""
    # Run options (loader workers, pinned memory, the device) are the Profile tab's alone; torch.compile is
    # a run option the setup carries too (apply_action), so the Size and Plan tabs show it.
    run_only = {k: v for k, v in rec.changes.items() if k.startswith("options.") and k != "options.compile"}
    spec = ", ".join(f"`{k} = {v}`" for k, v in rec.changes.items() if k not in run_only)
    opts = ", ".join(f"`{k} = {v}`" for k, v in run_only.items())
    msg = f"### Applied {rec.rule.title}\n"
    if spec:
        msg += f"{spec} is now the current setup on the Size, Profile and Plan tabs."
    if opts:
        msg += f"{' ' if spec else ''}{opts}: a run option, set on the Profile tab (the Size tab's estimate has no such field)."
    if (g := rec.gain) is not None:
        msg += (
            f" Predicted: {fmt_value(g.target, g.before)} → {fmt_value(g.target, g.after)} "
            f"({gain_phrase(g.target, g.gain_pct)})."
        )
    if source == "stored run":
        if g is not None and rec.after is not None and g.target == "step_time_ms":
            # Three figures for one change (a browser review): say which is which.
            own = estimate(rec.after).step_time_ms
            msg += f" That prediction starts from the run's measured {fmt_value(g.target, g.before)}"
            if g.analytic_after is not None and abs(g.analytic_after - g.after) > 0.005 * g.before:
                msg += (
                    f" ({g.basis.split(':')[0]}); the estimator's ratio alone gives "
                    f"{fmt_value(g.target, g.analytic_after)} (the table's 'estimator says')"
                )
            msg += (
                f". The Size tab shows the estimator's own figure for the changed setup, {fmt_value(g.target, own)},"
                " not scaled to what this machine measured."
            )
        return msg + " Press **Re-run with the recommendation applied** to measure it on this machine."
    return msg + " The Size tab shows its estimate; press **Advise** again for what to do next."


def setup_diff(before: dict, after: dict) -> str:
    """What Apply changes on the Size tab, as Markdown: a table of every field whose value ``after``
    changes (field, before, after; values compared as a page address writes them, so 8 and 8.0 or
    "1" and 1 are the same), or a line saying it changes none. Keys of ``after`` not in ``before``
    (a field the tab does not show) are left out."""
    rows = [
        f"| {k} | {query_text(before[k])} | {query_text(v)} |"
        for k, v in after.items()
        if k in before and query_text(before[k]) != query_text(v)
    ]
    if not rows:
        return "It changes no field of the Size tab: the setup there already has it."
    head = f"It changes {len(rows)} field{'s' * (len(rows) > 1)} of the Size tab:\n\n| field | before | after |\n|---|---|---|\n"
    return head + "\n".join(rows)


def verify_table(v) -> pd.DataFrame:
    """A verification's one row: before, predicted and measured, both gains, the baseline's spread."""
    row = [v.rule_id, v.target.replace("_", " "), v.verdict]
    row += [fmt_value(v.target, x) for x in (v.before, v.predicted_after, v.measured_after)]
    row += [round(v.predicted_gain_pct, 1), round(v.measured_gain_pct, 1)]
    row += [None if v.noise_pct is None else round(v.noise_pct, 1), v.baseline_run_id or "(stored run)", v.new_run_id]
    return pd.DataFrame([row], columns=VERIFY_COLUMNS)


def diff_category_table(d) -> pd.DataFrame:
    """A trace diff's step-time categories (``advisor.analysis.diff.trace_diff``) in ms per step, with
    a last row 'step': their sum, the step time of each run."""
    c = d.categories
    rows = [[r.category, r.a_ns / 1e6, r.b_ns / 1e6, r.delta_ns / 1e6, r.a_pct, r.b_pct] for r in c.itertuples()]
    rows.append(["step", d.step_a_ns / 1e6, d.step_b_ns / 1e6, d.step_delta_ns / 1e6, 100.0, 100.0])
    return pd.DataFrame(rows, columns=DIFF_CATEGORY_COLUMNS).round(3)


def diff_changes_table(d, n: int = DIFF_ROWS) -> pd.DataFrame:
    """The ``n`` kernels and the ``n`` host ops (self time) of a trace diff that changed most (added,
    removed, slower, faster), in ms and calls per step."""
    rows = []
    for what, t in (("kernel", d.kernels), ("op", d.ops)):
        for r in t[t["status"] != "unchanged"].head(n).itertuples():
            rows.append([what, r.status, str(r.name)[:NAME_CHARS], r.a_ns / 1e6, r.b_ns / 1e6, r.delta_ns / 1e6])
            rows[-1] += [r.a_count, r.b_count]
    return pd.DataFrame(rows, columns=DIFF_CHANGE_COLUMNS).round(3)


def diff_line(d) -> str:
    """One sentence: the step time per step in both traces and the categories that moved most."""
    moved = ", ".join(f"{r.category} {r.delta_ns / 1e6:+.1f} ms" for r in d.categories.head(3).itertuples())
    return (
        f"Trace diff, per step: {d.step_a_ns / 1e6:,.1f} → {d.step_b_ns / 1e6:,.1f} ms"
        + (f"; most changed: {moved}" if moved else "")
        + "."
    )


def verify_message(v, diff=None, diff_note: str = "") -> str:
    """Whether the re-run improved on the target, beyond the baseline's step-to-step spread; with the
    trace ``diff`` of the before and after runs (``advisor.advice.verify.verification_diff``), its
    line, or ``diff_note`` where there is none."""
    if v.noise_unknown:
        outcome = f"inconclusive: {UNKNOWN_SPREAD}"
    elif v.verdict == "inconclusive":
        what = "spread over its steps and its re-runs" if v.pairs > 1 else "step-to-step spread"
        outcome = f"inconclusive: the change is within the baseline's {what} of {v.noise_pct:.1f} %"
    else:
        outcome = "improved" if v.measured_gain_pct > 0 else "did NOT improve"
    change = ", ".join(f"`{k} = {val}`" for k, val in v.changes.items())
    label = TARGET_LABELS.get(v.target, v.target.replace("_", " "))
    msg = f"### Re-ran with {change}: {label} {outcome} (measured {gain_phrase(v.target, v.measured_gain_pct)})"
    if v.baseline_run_id and v.stored_before is not None and v.pairs > 1:
        gains = ", ".join(f"{g:+.1f} %" for g in v.pair_gains_pct)
        msg += (
            f"\n{v.pairs} pairs re-run just now in alternating order; the measured gain is the median of "
            f"theirs ({gains}), from the median before: {fmt_value(v.target, v.before)} (the stored run "
            f"measured {fmt_value(v.target, v.stored_before)})."
        )
    elif v.baseline_run_id and v.stored_before is not None:
        msg += (
            f"\nBefore is the original setup re-run just now, side by side with the change: "
            f"{fmt_value(v.target, v.before)} (the stored run measured {fmt_value(v.target, v.stored_before)})."
        )
    msg += (
        "\n\n"
        + {
            "confirmed": "The measurement confirms the prediction; the advice on this setup now quotes it.",
            "fell short": "The change helped far less than predicted; the advice on this setup is re-priced from it.",
            "refuted": "The prediction was wrong on this machine: the advice on this setup no longer recommends it.",
            "inconclusive": "Not a verdict: re-run on a quieter machine. The advice keeps its prediction and "
            "notes this re-run.",
        }[v.verdict]
    )
    if diff is not None:
        msg += f"\n\n{diff_line(diff)}"
    elif diff_note:
        msg += f"\n\n<small>{diff_note}</small>"
    return msg


# --- Plan ----------------------------------------------------------------------------------------


def plan_table(result) -> pd.DataFrame:
    """The planner's best layouts: rank, layout, tokens/s, step, MFU and memory per GPU."""
    rows = []
    for e in result.top:
        est = e.estimate
        rows.append([e.rank, layout_label(e.setup), round(est.tokens_per_s), round(est.step_time_ms, 1)])
        rows[-1] += [round(100 * est.mfu_frac, 1), round(est.memory.total_bytes / 2**30, 1)]
        rows[-1].append(round(100 * est.memory_frac, 1))
    return pd.DataFrame(rows, columns=PLAN_COLUMNS)


def layout_used_message(rank: int, setup) -> str:
    """The Plan tab's answer to "Use this layout": what went to the Size tab."""
    return (
        f"### Layout #{rank} is the current setup\n{layout_label(setup)} on {setup.gpus} x {setup.hardware.name}: "
        "the Size tab shows its memory and step time, and exports it."
    )


def export_summary(out) -> str:
    """The Size tab's Export answer: the file, and what it cannot say (also written in it)."""
    text = f"### Exported for {out.framework}: `{out.filename}`"
    if out.notes:
        where = "its `_advisor_notes`" if out.framework == "deepspeed" else "its comments"
        text += f"\nWhat the file leaves out or changes (also in {where}):\n" + "\n".join(f"- {n}" for n in out.notes)
    return text


def plan_summary(result) -> str:
    """The Plan tab's headline: what was listed and searched; an incomplete search says so first."""
    note = result.budget_note()
    return (
        f"### {len(result.top)} layouts of {result.fitting:,} that fit"
        + (" (incomplete search)" if note else "")
        + "\n"
        f"{result.considered:,} combinations considered ({result.invalid:,} invalid, {result.no_fit:,} do not fit), "
        f"{result.estimated:,} estimated, in {result.elapsed_s:.2f} s." + (f"\n\n**{note}**" if note else "")
    )


def code_block(text: str) -> str:
    """``text`` as a Markdown code block whose fence is longer than any run of backticks in it, so a
    name from a trace (a kernel named with a Markdown fence) cannot end the block early and format
    the rest of the page (CommonMark: a fence closes only at a run at least as long as its opening)."""
    fence = "`" * max(3, max(map(len, re.findall("`+", text)), default=0) + 1)
    return f"{fence}\n{text}\n{fence}"


def inline_code(text: str) -> str:
    """``text`` as inline Markdown code, delimited by one more backtick than its longest run (and padded
    with a space where it starts or ends with one), so it renders verbatim."""
    ticks = "`" * (max(map(len, re.findall("`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"
