"""The layout planner: search DP x TP x PP x CP x EP, ZeRO, recompute, micro-batch, precision and offload
for a GPU count, rank what fits by predicted tokens/s, and say why in plain words.

The grid walked (every combination counts as *considered*):

- precision: the requested ones (bf16 by default; fp8 where the device has fp8 tensor cores);
- tp: powers of two up to ``hardware.gpus_per_node`` that divide the GPU count (and, on more GPUs
  than a node holds, the node: 72-GPU NVL72 racks take TP 1-8). Practitioners' rule: a TP group stays
  inside one node's NVLink, where its per-layer all-reduces are cheap;
- cp: powers of two dividing gpus / tp (ring attention splits the sequence in 2 x cp chunks);
- pp: every divisor of gpus / (tp x cp) up to n_layers, dividing the blocks or not (the stages then
  uneven, ends lighter: estimator.stage_layers); vpp (interleaving): every divisor of n_layers / pp
  where pp divides n_layers;
- ep (mixture-of-experts only): every divisor of n_experts; dp = gpus / (tp x cp x pp);
- ZeRO 0-3; CPU offload none / optimizer (ZeRO >= 1) / optimizer+params (ZeRO-3), unless disallowed
  or the device is a CPU; memory techniques (``_techniques``): no recompute, the activations of half
  or all of each stage's blocks offloaded to host memory (GPUs, offload allowed), selective, op-level
  selective, full recompute of half of each stage's blocks, full recompute;
- micro-batch: every divisor of the global batch up to MAX_MICRO_BATCH; where a batch has more than
  MAX_BATCH_CHOICES of them (64,864,800 has 1,440), that many spread evenly on a log scale, 1 and the
  largest included, so the search stays within seconds (``batch_grid``).

Sequence parallelism is always on when tp > 1 (Megatron-LM's advice: it removes the activations TP
leaves replicated). Other step settings are the TrainSpec defaults (AdamW, fused, flash attention,
Megatron-style step). Communication runs at the datasheet links, or, when the request carries a
measurement, at the bus bandwidth a distributed run of the device reached (advisor.analysis.commbw). The rules of thumb above (TP inside a node, powers of two, SP on) are checked
in tests/test_planner.py against a search without them: on the spaces tested, none loses the optimum.

Most of the grid is never estimated. Combinations the Setup would reject are counted as *invalid*
from the same rules, without building them. The rest is searched with cuts that cannot lose a
result of the top (each also checked against an exhaustive search in the tests):

1. No fit. Per-GPU memory never shrinks as the micro-batch grows (saved activations grow with
   b x min(pp, m) and the loss buffers with b; nothing gets smaller), so micro-batches are tried in
   increasing order and the first that does not fit ends that setting. Where the model states alone
   (weights, gradients, optimizer) overflow the device, no recompute mode or micro-batch can help.
2. Speed bound. Kernel overheads, compute, recompute, memory-bound kernels, TP/CP/EP/PP communication
   and the bubble depend on the parallel degrees, precision, recompute mode and micro-batch, not on
   ZeRO or offload. Their least sum over the micro-batches (larger ones fill the GEMMs' waves better and
   pay fewer kernels' fixed costs, smaller ones shrink the bubble (p-1)/(v m)) thus bounds the tokens/s
   of every setting of a layout and recompute mode. Layouts are searched best bound first; once ``top``
   listed results are faster than a bound, the layout (or its heavier memory techniques) is *bounded* out.
3. Listing. Within one layout (degrees and precision), a setting is *dominated* and not listed when
   another fitting setting is at least as fast with no more memory, or when the same setting with
   less recompute or offload (same ZeRO stage and micro-batch) fits and is faster: more recompute
   than needed is never worth choosing. Both are checked on the estimates, not assumed, because the
   estimator has ties (parameter streaming that hides entirely behind compute costs nothing) and
   corner cases where a little extra work shrinks exposed communication.

Bounded in time as well as in count (issue 22): the largest grids the spec admits (Llama 4 Maverick on
262,144 GPUs, a global batch of 2^26, four precisions) take 2-4 minutes on a loaded 2-core box
(bench/results/planner_speed.md). A request carries a
wall-clock budget, ``time_budget_s``: the speed bounds get the first half of it (layouts of the
fastest precision first), the search the rest, best bound first; when it runs out the plan lists the
best layouts found so far and says how much was left unsearched (``PlanResult.complete``). The
search never stops before it has a layout to list, but gives up at twice the budget.
"""

from __future__ import annotations

import collections
import functools
import heapq
import math
import textwrap
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import pandas as pd

from advisor.errors import AdvisorError, SpecError
from advisor.estimate.efficiency import band_note
from advisor.estimate.estimator import TIGHT_FRAC, TIME_LABELS, Estimate, estimate, stage_layers
from advisor.estimate.links import MeasuredLink, describe_link, same_device, with_measured_link
from advisor.spec.specs import (
    MAX_GLOBAL_BATCH,
    MAX_GPUS,
    MAX_MICRO_BATCH,
    MAX_SEQ_LEN,
    PRECISIONS,
    RECOMPUTE_MODES,
    HardwareSpec,
    ModelSpec,
    ParallelSpec,
    Setup,
    TrainSpec,
)

GiB = 2**30
MAX_BATCH_CHOICES = 48  # micro-batches tried per global batch (batch_grid); 2^k batches have at most 17
MAX_TOP = 1000  # layouts a plan may list: each gets its reasons worked out
MAX_POINTS = 3000  # scatter points kept per plan: a browser draws them at once; the fastest are the ones that matter
DEFAULT_TIME_BUDGET_S = 60.0  # the plans of tests/ and bench/planner_speed.py take under 20 s on a loaded 2-core box
MAX_TIME_BUDGET_S = 3600.0  # an hour: the slowest grid found takes 2-4 minutes on a loaded 2-core box
TIME_BUDGET_HINT = "advisor plan --time-budget, or the app's ADVISOR_PLAN_TIMEOUT_S"
# Time components that do not depend on ZeRO or offload: for one recompute mode, their least sum over
# the micro-batches bounds the step time of a layout (module docstring, cut 2).
_BOUND_COMPONENTS = (
    "kernel_overhead_ms",
    "compute_ms",
    "recompute_ms",
    "memory_bound_ms",
    "tp_comm_ms",
    "cp_comm_ms",
    "ep_comm_ms",
    "pp_comm_ms",
    "bubble_ms",
)


@functools.lru_cache(maxsize=4096)
def _divisors(n: int) -> tuple[int, ...]:
    """Divisors of ``n``, increasing: O(sqrt n), at most 2^13 steps for the largest batch a spec takes
    (MAX_GLOBAL_BATCH = 2^26), cached since each layout asks again for its share of the batch."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return (*small, *(n // d for d in reversed(small) if d * d != n))


def _powers_of_two(n: int, limit: int) -> list[int]:
    """Powers of two up to ``limit`` that divide ``n``."""
    out, d = [], 1
    while d <= limit and n % d == 0:
        out.append(d)
        d *= 2
    return out


@dataclass(frozen=True)
class PlanRequest:
    """What to plan for: a model on ``gpus`` devices of one kind, one sequence length and global batch."""

    model: ModelSpec
    hardware: HardwareSpec
    gpus: int
    """Devices in the job; every layout uses all of them (dp x tp x pp x cp = gpus)."""
    seq_len: int
    """Tokens per sequence."""
    global_batch: int
    """Sequences per optimizer step, over all data-parallel ranks."""
    precisions: tuple[str, ...] = ("bf16",)
    """Compute precisions to try (fp32, bf16, fp16, fp8); each must exist on the device."""
    allow_offload: bool = True
    """Also try CPU offload of the optimizer (and of the parameters under ZeRO-3)."""
    top: int = 10
    """Results to return, best first."""
    max_memory_frac: float = TIGHT_FRAC
    """Share of the device's memory a listed layout may use: above 90 % a layout is 'tight', within
    the memory estimate's error of not fitting (advisor.estimate.efficiency.ERROR_BAND); 1.0 lists those too."""
    measured_link: MeasuredLink | None = None
    """Bus bandwidth measured on a distributed run of this device (advisor.advice.commlinks.link_for); None: the
    datasheet link. Collectives inside a node then run at it (advisor.estimate.links.with_measured_link)."""
    time_budget_s: float = DEFAULT_TIME_BUDGET_S
    """Wall-clock seconds the search may take (above 0, at most MAX_TIME_BUDGET_S); past it the plan
    lists the best layouts found so far and says what was left unsearched (module docstring)."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelSpec):
            raise AdvisorError(f"model={self.model!r}: must be a ModelSpec (advisor.spec.presets.get_model)")
        if not isinstance(self.hardware, HardwareSpec):
            raise AdvisorError(
                f"hardware={self.hardware!r}: must be a HardwareSpec (advisor.spec.presets.get_hardware)"
            )
        link = self.measured_link
        if link is not None and not isinstance(link, MeasuredLink):
            raise AdvisorError(
                f"measured_link={link!r}: must be a MeasuredLink (advisor.advice.commlinks.link_for) or None"
            )
        if link is not None and not same_device(link, self.hardware):
            raise SpecError(
                "measured_link", link.run_id, f"was measured on {link.device_key}, not on {self.hardware.name}"
            )
        frac = self.max_memory_frac
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0.1 <= frac <= 1.0:
            raise SpecError("max_memory_frac", frac, "must be a number from 0.1 to 1.0")
        budget = self.time_budget_s
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= MAX_TIME_BUDGET_S:
            raise SpecError(
                "time_budget_s", budget, f"must be a number of seconds above 0, at most {MAX_TIME_BUDGET_S:g}"
            )
        for name, most in (
            ("gpus", MAX_GPUS),
            ("seq_len", MAX_SEQ_LEN),
            ("global_batch", MAX_GLOBAL_BATCH),
            ("top", MAX_TOP),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most:
                raise SpecError(name, value, f"must be an integer from 1 to {most}")
        if not isinstance(self.precisions, (str, tuple, list)):
            raise SpecError("precisions", self.precisions, f"must be a list of {', '.join(PRECISIONS)}")
        precisions = (self.precisions,) if isinstance(self.precisions, str) else tuple(self.precisions)
        if not precisions:
            raise SpecError("precisions", self.precisions, f"must name at least one of {', '.join(PRECISIONS)}")
        for p in precisions:
            if not isinstance(p, str) or p not in PRECISIONS:
                raise SpecError("precisions", p, f"unknown precision; choose from {', '.join(PRECISIONS)}")
            if self.hardware.peak_flops(p) <= 0:
                have = ", ".join(q for q in PRECISIONS if self.hardware.peak_flops(q) > 0)
                raise SpecError("precisions", p, f"{self.hardware.name} has no {p} tensor cores (it has: {have})")
        object.__setattr__(self, "precisions", tuple(dict.fromkeys(precisions)))
        m = self.model
        if m.position == "learned" and self.seq_len > m.max_positions:
            raise SpecError("seq_len", self.seq_len, f"{m.name} has learned positions up to {m.max_positions}")
        dps = sorted({lay.dp for lay in _layouts(self) if lay.valid})
        if not dps:
            raise SpecError(
                "gpus",
                self.gpus,
                f"no parallel layout of {m.name} uses exactly {self.gpus} GPUs "
                f"(n_heads={m.n_heads}, n_layers={m.n_layers}, seq_len={self.seq_len})",
            )
        if all(self.global_batch % dp for dp in dps):
            raise SpecError(
                "global_batch",
                self.global_batch,
                f"must be a multiple of the data-parallel size of some layout; on {self.gpus} GPUs "
                f"{m.name} allows dp = {', '.join(map(str, dps))}",
            )


@dataclass(frozen=True)
class PlanEntry:
    """One ranked layout and why it is where it is."""

    setup: Setup
    estimate: Estimate
    rank: int
    """1 is the fastest."""
    reason: str
    """Rank 1: why this layout. Others: what they lose against rank 1, with numbers."""
    details: tuple[str, ...] = ()
    """Rank 1: the reason as separate points (one per decision)."""


@dataclass(frozen=True)
class PlanPoint:
    """One fitting setting the search estimated: a point of the memory / speed scatter."""

    label: str
    """layout_label of its setup."""
    memory_gib: float
    """Memory per GPU (GiB)."""
    tokens_per_s: float
    in_top: bool
    """Among the plan's top entries."""


@dataclass(frozen=True)
class PlanResult:
    """The ranked layouts that fit and what the search did. The counts partition the grid:
    considered = invalid + no_fit + bounded + fitting + unsearched."""

    request: PlanRequest
    top: list[PlanEntry]
    considered: int
    """Combinations in the grid (see the module docstring)."""
    invalid: int
    """Rejected by the Setup's own rules (heads, layers, sequence or batch not divisible...)."""
    no_fit: int
    """Over device or host memory: estimated, or implied by one that was (cut 1)."""
    elapsed_s: float
    """Wall-clock time of the search, in seconds."""
    estimated: int = 0
    """Calls to the estimator (the speed-bound estimates included)."""
    dominated: int = 0
    """Of ``fitting``, not worth listing (cut 3): as fast with less memory, or faster with less
    recompute or offload, elsewhere in the same layout."""
    bounded: int = 0
    """Not searched: their speed bound is below the top results (cut 2); fit or not, unknown."""
    fitting: int = 0
    """Estimated and fit, dominated ones included."""
    closest: Estimate | None = None
    """When nothing fits: the setting nearest to fitting (least memory over capacity)."""
    points: list[PlanPoint] = field(default_factory=list)
    """The settings counted in ``fitting`` (dominated ones included), fastest first: every top entry and
    the fastest of the rest, MAX_POINTS in all at most."""
    layouts: int = 0
    """Layouts of the grid (parallel degrees and precision) with a valid micro-batch."""
    layouts_unsearched: int = 0
    """Of ``layouts``, those the time budget left unsearched: neither estimated nor bounded out."""
    unsearched: int = 0
    """Their combinations (0 when the search is complete)."""
    grid_complete: bool = True
    """Every layout of the grid was listed. False where listing it took half the time budget (a model
    with tens of thousands of layers or experts): the counts above then cover the part listed."""

    @property
    def complete(self) -> bool:
        """The whole grid was searched: the top is the best of every combination, not only of those
        reached within ``request.time_budget_s``."""
        return self.layouts_unsearched == 0 and self.grid_complete

    def budget_note(self) -> str:
        """'' for a complete search; else what the time budget cut and how to get the complete answer."""
        if self.complete:
            return ""
        r = self.request
        listed = "" if self.grid_complete else " listed before the time ran out (the rest of the grid was not listed)"
        return (
            f"Stopped at the time budget of {r.time_budget_s:g} s: {self.layouts - self.layouts_unsearched:,} of "
            f"the {self.layouts:,} layouts{listed} searched in {self.elapsed_s:.2f} s; {self.layouts_unsearched:,} "
            f"layouts ({self.unsearched:,} combinations) were not estimated, so a faster layout (or one that fits) "
            "may exist. For the "
            f"complete answer, raise the budget ({TIME_BUDGET_HINT}) or narrow the search: fewer precisions, "
            "no offload, fewer GPUs or a global batch with fewer divisors."
        )

    def table(self) -> pd.DataFrame:
        """One row per top entry: speed, memory and the layout; units in the column names."""
        rows = []
        for e in self.top:
            s, est = e.setup, e.estimate
            p, t = s.parallel, s.train
            rows.append(
                {
                    "rank": e.rank,
                    "tokens_per_s": est.tokens_per_s,
                    "step_time_ms": est.step_time_ms,
                    "mfu_pct": 100 * est.mfu_frac,
                    "memory_gib": est.memory.total_bytes / GiB,
                    "memory_pct": 100 * est.memory_frac,
                    "bubble_ms": est.time.bubble_ms,
                    "dp": p.dp,
                    "tp": p.tp,
                    "pp": p.pp,
                    "vpp": p.vpp,
                    "cp": p.cp,
                    "ep": p.ep,
                    "zero": p.zero,
                    "sequence_parallel": p.sequence_parallel,
                    "offload": p.offload,
                    "recompute": t.recompute,
                    "recompute_layers": t.recompute_layers,
                    "offload_activations": t.offload_activations,
                    "micro_batch": t.micro_batch,
                    "grad_accum": s.grad_accum,
                    "precision": t.precision,
                    "reason": e.reason,
                }
            )
        return pd.DataFrame(rows, columns=_TABLE_COLUMNS)

    def explain(self) -> str:
        """The plan in markdown: search counts, the best layout and why, the alternatives and their cost."""
        r = self.request
        lines = [
            f"## Layout plan: {r.model.name} on {r.gpus} x {r.hardware.name}, "
            f"sequence {r.seq_len:,}, global batch {r.global_batch:,}",
            "",
            f"Considered {self.considered:,} combinations in {self.elapsed_s:.2f} s: {self.invalid:,} invalid, "
            f"{self.no_fit:,} do not fit, {self.bounded:,} ruled out by a speed bound, "
            + (f"{self.unsearched:,} not searched (time budget), " if self.unsearched else "")
            + f"{self.fitting:,} fit; {self.dominated:,} of these not listed because another setting of the same "
            "layout is as fast "
            f"with less memory, or faster with less recompute or offload. {self.estimated:,} estimates. "
            f"Listed: layouts within {100 * r.max_memory_frac:.0f} % of the GPU's memory.",
            "",
        ]
        if note := self.budget_note():
            lines += [f"**Incomplete.** {note}", ""]
        if r.hardware.kind == "gpu" and (note := band_note()):
            lines += [f"<small>{note}</small>", ""]
        if r.measured_link is not None:
            lines += [describe_link(r.measured_link, r.hardware), ""]
        if not self.top:
            lines.append("**Nothing fits.** " + _closest_text(r, self.closest))
            return "\n".join(lines) + "\n"
        best = self.top[0]
        est = best.estimate
        lines += [
            f"### Best: {layout_label(best.setup)}",
            "",
            f"{est.tokens_per_s:,.0f} tokens/s, step {_ms(est.step_time_ms)} ms, MFU {100 * est.mfu_frac:.1f} %, "
            f"{est.memory.total_bytes / GiB:.1f} of {est.capacity_bytes / GiB:.1f} GiB per GPU "
            f"({100 * est.memory_frac:.0f} %).",
            "",
            *(f"- {d}" for d in best.details),
        ]
        if len(self.top) > 1:
            lines += [
                "",
                "### Alternatives",
                "",
                "| # | layout | tokens/s | step ms | MFU % | memory GiB | against #1 |",
                "|---|---|---|---|---|---|---|",
            ]
            for e in self.top[1:]:
                x = e.estimate
                lines.append(
                    f"| {e.rank} | {layout_label(e.setup)} | {x.tokens_per_s:,.0f} | {_ms(x.step_time_ms)} | "
                    f"{100 * x.mfu_frac:.1f} | {x.memory.total_bytes / GiB:.1f} | {e.reason} |"
                )
        return "\n".join(lines) + "\n"

    def as_dict(self) -> dict:
        """JSON-ready: the request, the counts and each top entry with its full estimate."""
        r = self.request
        return {
            "request": {
                "model": r.model.name,
                "hardware": r.hardware.name,
                "gpus": r.gpus,
                "seq_len": r.seq_len,
                "global_batch": r.global_batch,
                "precisions": list(r.precisions),
                "allow_offload": r.allow_offload,
                "top": r.top,
                "measured_link": None if r.measured_link is None else asdict(r.measured_link),
                "time_budget_s": r.time_budget_s,
            },
            "complete": self.complete,
            "layouts": self.layouts,
            "layouts_unsearched": self.layouts_unsearched,
            "grid_complete": self.grid_complete,
            "unsearched": self.unsearched,
            "budget_note": self.budget_note(),
            "considered": self.considered,
            "invalid": self.invalid,
            "no_fit": self.no_fit,
            "dominated": self.dominated,
            "bounded": self.bounded,
            "estimated": self.estimated,
            "fitting": self.fitting,
            "elapsed_s": self.elapsed_s,
            "top": [
                {"rank": e.rank, "layout": layout_label(e.setup), "reason": e.reason, "estimate": e.estimate.as_dict()}
                for e in self.top
            ],
            "closest": None if self.closest is None else self.closest.as_dict(),
            "explanation": self.explain(),
        }


_TABLE_COLUMNS = [
    "rank",
    "tokens_per_s",
    "step_time_ms",
    "mfu_pct",
    "memory_gib",
    "memory_pct",
    "bubble_ms",
    "dp",
    "tp",
    "pp",
    "vpp",
    "cp",
    "ep",
    "zero",
    "sequence_parallel",
    "offload",
    "recompute",
    "recompute_layers",
    "offload_activations",
    "micro_batch",
    "grad_accum",
    "precision",
    "reason",
]


def _ms(ms: float) -> str:
    """A step time in ms as the tables print it: whole ms from 100 ms, three digits below (a tiny
    model's 0.81 ms step read "1", and GPT-2's 14.6 and 15.3 ms steps both "15")."""
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.3g}"


def layout_label(setup: Setup) -> str:
    """A short name of a layout: ``DP64 TP8+SP PP2x3v CP1, ZeRO-1, b1 x m16, recompute none, bf16``
    (+SP: sequence parallelism, which changes the memory: a label copied into ``size`` without it
    sized another layout)."""
    p, t = setup.parallel, setup.train
    tp = f"TP{p.tp}" + ("+SP" if p.sequence_parallel and p.tp > 1 else "")
    degrees = f"DP{p.dp} {tp} PP{p.pp}" + (f"x{p.vpp}v" if p.vpp > 1 else "") + f" CP{p.cp}"
    if setup.model.is_moe:
        degrees += f" EP{p.ep}"
    parts = [degrees, f"ZeRO-{p.zero}", f"b{t.micro_batch} x m{setup.grad_accum}", technique_label(t)]
    if p.offload != "none":
        parts.append(f"offload {p.offload}")
    parts.append(t.precision)
    return ", ".join(parts)


def format_plan(result: PlanResult) -> str:
    """The plan as plain text for a terminal: the ranked table, why #1, what the others lose."""
    r = result.request
    lines = [
        f"{r.model.name} on {r.gpus} x {r.hardware.name}, sequence {r.seq_len:,}, global batch {r.global_batch:,}",
        f"considered {result.considered:,} combinations in {result.elapsed_s:.2f} s: {result.invalid:,} invalid, "
        f"{result.no_fit:,} do not fit, {result.dominated:,} dominated, {result.bounded:,} bounded"
        + (f", {result.unsearched:,} not searched (time budget)" if result.unsearched else "")
        + f"; {result.estimated:,} estimated",
        "",
    ]
    if note := result.budget_note():
        lines += [*textwrap.wrap("INCOMPLETE: " + note, 110), ""]
    if r.measured_link is not None:
        lines += [describe_link(r.measured_link, r.hardware), ""]
    if not result.top:
        lines.append("Nothing fits. " + _closest_text(r, result.closest))
        return "\n".join(lines)
    lines.append(f"{'#':>3} {'tokens/s':>12} {'step ms':>10} {'MFU %':>6} {'GiB/GPU':>8}  layout")
    for e in result.top:
        x = e.estimate
        lines.append(
            f"{e.rank:>3} {x.tokens_per_s:>12,.0f} {_ms(x.step_time_ms):>10} {100 * x.mfu_frac:>6.1f} "
            f"{x.memory.total_bytes / GiB:>8.1f}  {layout_label(e.setup)}"
        )
    if r.hardware.kind == "gpu" and (note := band_note()):
        lines += ["", textwrap.fill(note, 110)]
    lines += ["", "Why #1:", *(f"  - {d}" for d in result.top[0].details)]
    if len(result.top) > 1:
        lines += ["", "Against #1:", *(f"  #{e.rank}: {e.reason}" for e in result.top[1:])]
    return "\n".join(lines)


# --- the grid -------------------------------------------------------------------------------------


@dataclass
class _Layout:
    """Parallel degrees and precision; ZeRO, offload, recompute and micro-batch vary inside."""

    precision: str
    tp: int
    cp: int
    pp: int
    vpp: int
    ep: int
    dp: int
    valid: bool
    micro_batches: tuple[int, ...] = ()
    """Valid micro-batches, increasing."""
    techniques: tuple[str, ...] = ()
    """Memory techniques tried (``_techniques``), lightest first."""
    bound_ms: dict[str, float] = field(default_factory=dict)
    """Per memory technique, the step time no setting can beat (cut 2)."""
    cache: dict = field(default_factory=dict)


def _layout_ok(m: ModelSpec, seq_len: int, tp: int, cp: int, pp: int, vpp: int, ep: int, dp: int) -> bool:
    """Setup's cross-field rules that do not involve the batch (advisor.spec.specs.Setup.__post_init__)."""
    if m.n_heads % tp or (m.n_kv_heads % tp and tp % m.n_kv_heads):
        return False
    if m.ffn_hidden % tp or (m.is_moe and m.expert_ffn_hidden % tp):
        return False
    if pp * vpp > m.n_layers:
        return False
    if cp > 1 and seq_len % (2 * cp):
        return False
    return not (m.is_moe and (m.n_experts % ep or (dp * cp) % ep))


def _layouts(req: PlanRequest) -> Iterator[_Layout]:
    """Every layout of the grid, valid or not (module docstring)."""
    m, hw, gpus = req.model, req.hardware, req.gpus
    for precision in req.precisions:
        for tp in _powers_of_two(gpus, hw.gpus_per_node):
            if gpus > hw.gpus_per_node and tp > hw.tp_tile_max:
                continue  # TP 16 on 72-GPU racks: some TP groups would straddle two racks
            for cp in _powers_of_two(gpus // tp, gpus):
                for pp in _divisors(gpus // (tp * cp)):
                    dp = gpus // (tp * cp * pp)
                    # Stages need not divide the blocks (uneven stages: estimator.stage_layers); the
                    # interleaved schedules tried are the even ones.
                    vpps = _divisors(m.n_layers // pp) if pp > 1 and m.n_layers % pp == 0 else (1,)
                    for vpp in vpps:
                        for ep in _divisors(m.n_experts) if m.is_moe else (1,):
                            ok = _layout_ok(m, req.seq_len, tp, cp, pp, vpp, ep, dp)
                            yield _Layout(precision, tp, cp, pp, vpp, ep, dp, ok)


@functools.lru_cache(maxsize=64)
def batch_grid(global_batch: int) -> tuple[int, ...]:
    """The micro-batches the planner tries for a global batch, increasing (module docstring): its
    divisors up to MAX_MICRO_BATCH, thinned to MAX_BATCH_CHOICES where there are more. Neighbouring
    micro-batches among hundreds differ by a few per cent in GEMM shape, so the thinned grid loses
    little; without the thinning a batch like 64,864,800 kept the search busy for minutes."""
    bs = [b for b in _divisors(global_batch) if b <= MAX_MICRO_BATCH]
    if len(bs) <= MAX_BATCH_CHOICES:
        return tuple(bs)
    logs = np.log(bs)
    targets = np.linspace(0.0, logs[-1], MAX_BATCH_CHOICES)
    picked = {bs[int(np.argmin(np.abs(logs - t)))] for t in targets}
    return tuple(sorted(picked))


def _micro_batches(req: PlanRequest, lay: _Layout) -> tuple[int, ...]:
    """Micro-batches of the grid (``batch_grid``) the Setup accepts for this layout: global_batch =
    b x dp x m, and m a multiple of pp when interleaved."""
    if not lay.valid or req.global_batch % lay.dp:
        return ()
    per_replica = req.global_batch // lay.dp
    return tuple(
        b
        for b in batch_grid(req.global_batch)
        if per_replica % b == 0 and (lay.vpp == 1 or (per_replica // b) % lay.pp == 0)
    )


def _offloads(req: PlanRequest, zero: int) -> tuple[str, ...]:
    """Offload settings in order of memory saved (ZeRO-Offload needs ZeRO >= 1, parameters ZeRO-3)."""
    if not req.allow_offload or req.hardware.kind == "cpu" or zero == 0:
        return ("none",)
    return ("none", "optimizer", "optimizer+params") if zero == 3 else ("none", "optimizer")


# --- the search -----------------------------------------------------------------------------------


def _techniques(req: PlanRequest, lay: _Layout) -> tuple[str, ...]:
    """The memory techniques tried on a layout (``techniques_for`` its smallest stage)."""
    return techniques_for(req, min(stage_layers(_probe_setup(req, lay))))


def techniques_for(req: PlanRequest, fewest: int) -> tuple[str, ...]:
    """The memory techniques tried on a layout whose smallest stage holds ``fewest`` blocks, lightest
    first: no recompute; the activations of half or all of each stage's blocks offloaded to host
    memory (on a GPU, where offload is allowed); Megatron's selective and torchtitan's op-level
    recompute; full recompute of half of each stage's blocks (Megatron's recompute_num_layers), then of
    all. Half and all: the recipes' choices (Megatron-Bridge's Llama 3 70B on GB200 offloads 40 of 80)."""
    out = ["none"]
    hw = req.hardware
    if req.allow_offload and hw.kind == "gpu" and hw.host_link_bw_bytes_per_s > 0:
        out += [f"offload:{n}" for n in sorted({max(1, fewest // 2), fewest})]
    out += ["selective", "selective-op"]
    if fewest >= 2:
        out.append(f"full:{fewest // 2}")
    out.append("full")
    return tuple(out)


def _probe_setup(req: PlanRequest, lay: _Layout) -> Setup:
    """A setup of the layout, for what depends on its stages only."""
    return Setup(
        req.model, layout_train(req, lay, "none", lay.micro_batches[0]), layout_parallel(lay, 0, "none"), req.hardware
    )


def technique_fields(technique: str) -> dict:
    """The TrainSpec fields of a memory technique name: ``full:16``, ``offload:40``, ``selective``..."""
    mode, _, n = technique.partition(":")
    if mode == "offload":
        return {"recompute": "none", "recompute_layers": 0, "offload_activations": int(n)}
    return {"recompute": mode, "recompute_layers": int(n) if n else 0, "offload_activations": 0}


def technique_of(train: TrainSpec) -> str:
    """The memory technique name of a step (inverse of ``technique_fields``)."""
    if train.offload_activations:
        return f"offload:{train.offload_activations}"
    if train.recompute_layers:
        return f"{train.recompute}:{train.recompute_layers}"
    return train.recompute


def technique_label(train: TrainSpec) -> str:
    """How a table says it: ``recompute none``, ``recompute full (16 blocks/stage)``, ``offload 40 blocks``,
    ``recompute full (5 blocks/stage), offload 5 blocks`` (both, as a recipe may set them)."""
    if train.recompute_layers:
        n = train.recompute_layers
        recompute = f"recompute full ({n} block{'s' if n > 1 else ''}/stage)"
    else:
        recompute = f"recompute {train.recompute}"
    if not train.offload_activations:
        return recompute
    n = train.offload_activations
    offload = f"offload {n} block{'s' if n > 1 else ''}"
    return offload if train.recompute == "none" else f"{recompute}, {offload}"


_TECHNIQUE_RANK = {"none": 0, "offload": 1, "selective": 2, "selective-op": 3, "full": 4}


def _technique_order(technique: str) -> tuple[int, int]:
    """Lightest first: what a technique costs in redone work or transfers (the listing rule's order)."""
    mode, _, n = technique.partition(":")
    rank = _TECHNIQUE_RANK[mode]
    return (rank, int(n) if n else (10**9 if mode == "full" else 0))


def layout_train(req: PlanRequest, lay: _Layout, technique: str, b: int) -> TrainSpec:
    """The step of one grid point: the request's sequence and global batch, micro-batch ``b``."""
    return TrainSpec(
        seq_len=req.seq_len,
        micro_batch=b,
        global_batch=req.global_batch,
        precision=lay.precision,
        **technique_fields(technique),
    )


def layout_parallel(lay: _Layout, zero: int, offload: str) -> ParallelSpec:
    """The parallel spec of one grid point; sequence parallelism always on with TP (a stated rule)."""
    return ParallelSpec(
        dp=lay.dp,
        tp=lay.tp,
        pp=lay.pp,
        vpp=lay.vpp,
        cp=lay.cp,
        ep=lay.ep,
        zero=zero,
        sequence_parallel=lay.tp > 1,
        offload=offload,
    )


class _Search:
    """Builds and estimates setups with cached specs; keeps the counts and the running top."""

    def __init__(self, req: PlanRequest) -> None:
        self.req = req
        self.trains: dict[tuple, TrainSpec] = {}
        self.parallels: dict[tuple, ParallelSpec] = {}
        self.estimated = 0
        self.no_fit = 0
        self.fitting = 0
        self.dominated = 0
        self.bounded = 0
        self.listed: list[Estimate] = []
        self.fits: list[Estimate] = []  # every estimate counted in ``fitting``, for the scatter
        self.best_speeds: list[float] = []  # min-heap: tokens/s of the best listed layouts so far
        self.tokens_per_step = req.global_batch * req.seq_len
        link = req.measured_link
        self.hardware = req.hardware if link is None else with_measured_link(req.hardware, link)

    def setup(self, lay: _Layout, zero: int, offload: str, recompute: str, b: int) -> Setup:
        # The specs are shared between layouts that differ elsewhere (validated once each).
        tkey = (lay.precision, recompute, b)
        train = self.trains.get(tkey)
        if train is None:
            train = self.trains[tkey] = layout_train(self.req, lay, recompute, b)
        pkey = (lay.tp, lay.cp, lay.pp, lay.vpp, lay.ep, zero, offload)
        par = self.parallels.get(pkey)
        if par is None:
            par = self.parallels[pkey] = layout_parallel(lay, zero, offload)
        return Setup(self.req.model, train, par, self.hardware)

    def run(self, lay: _Layout, zero: int, offload: str, recompute: str, b: int) -> Estimate:
        key = (zero, offload, recompute, b)
        est = lay.cache.get(key)
        if est is None:
            est = estimate(self.setup(lay, zero, offload, recompute, b))
            lay.cache[key] = est
            self.estimated += 1
        return est

    def bound(self, lay: _Layout, recompute: str) -> float:
        """Cut 2: tokens/s that no setting of ``lay`` with this recompute mode can beat."""
        if recompute not in lay.bound_ms:
            lay.bound_ms[recompute] = min(
                sum(getattr(self.run(lay, 0, "none", recompute, b).time, c) for c in _BOUND_COMPONENTS)
                for b in lay.micro_batches
            )
        return self.tokens_per_step / (lay.bound_ms[recompute] / 1e3)

    def fits_limit(self, est: Estimate) -> bool:
        """Fits, host memory included, within the request's share of the device (``max_memory_frac``)."""
        return est.fits and est.memory_frac <= self.req.max_memory_frac

    @property
    def threshold(self) -> float:
        """tokens/s a layout must be able to beat to enter the top (0 until the top is full)."""
        return self.best_speeds[0] if len(self.best_speeds) >= self.req.top else 0.0

    def closest(self, layouts: list[_Layout], deadline: float = math.inf) -> Estimate | None:
        """When nothing fits: the setting nearest to fitting, over every layout, ZeRO stage, offload and
        recompute mode at the smallest micro-batch (the search skips some of these once it knows they
        cannot fit; here they are estimated so the comparison is fair). Past ``deadline`` (a
        perf_counter time) the layouts left are not looked at."""
        best, best_excess = None, float("inf")
        host_cap = self.req.hardware.host_memory_bytes
        for i, lay in enumerate(layouts):
            if i and time.perf_counter() > deadline:
                break
            for zero in range(4):
                for offload in _offloads(self.req, zero):
                    for recompute in lay.techniques:
                        est = self.run(lay, zero, offload, recompute, lay.micro_batches[0])
                        excess = est.memory_frac
                        if not est.host_fits and host_cap:
                            excess = max(excess, est.host_bytes_per_node / host_cap)
                        if excess < best_excess:
                            best, best_excess = est, excess
        return best

    def visit(self, lay: _Layout) -> None:
        """Search ``lay``, or count its combinations as bounded out when its speed bound cannot reach
        the top (cut 2)."""
        if _below(self.bound(lay, "none"), self.threshold):
            self.bounded += _combos(self.req, len(lay.techniques)) * len(lay.micro_batches)
        else:
            self.search_layout(lay)

    def search_layout(self, lay: _Layout) -> None:
        """Every ZeRO stage, offload, recompute and micro-batch of one layout (cuts 1 and 2), then the
        listing rule (cut 3)."""
        bs = lay.micro_batches
        threshold = self.threshold
        modes = [r for r in lay.techniques if not _below(self.bound(lay, r), threshold)]
        cap = self.req.hardware.memory_bytes
        fits: list[Estimate] = []
        for zero in range(4):
            for offload in _offloads(self.req, zero):
                self.bounded += len(bs) * (len(lay.techniques) - len(modes))
                states_over = False
                for recompute in modes:
                    if states_over:
                        self.no_fit += len(bs)
                        continue
                    for i_b, b in enumerate(bs):
                        est = self.run(lay, zero, offload, recompute, b)
                        if self.fits_limit(est):
                            fits.append(est)
                            continue
                        # Cut 1: larger micro-batches need more memory still.
                        self.no_fit += len(bs) - i_b
                        mem = est.memory
                        # Model states alone overflow: no recompute mode or micro-batch can help.
                        states_over = mem.weights_bytes + mem.grads_bytes + mem.optimizer_bytes > cap
                        break
        self.fitting += len(fits)
        self.fits += fits
        listed = _undominated(fits, lay.cache)
        self.dominated += len(fits) - len(listed)
        self.listed += listed
        for est in listed:
            if len(self.best_speeds) < self.req.top:
                heapq.heappush(self.best_speeds, est.tokens_per_s)
            elif est.tokens_per_s > self.best_speeds[0]:
                heapq.heapreplace(self.best_speeds, est.tokens_per_s)


_OFFLOAD_ORDER = {"none": 0, "optimizer": 1, "optimizer+params": 2}


def _undominated(fits: list[Estimate], cache: dict) -> list[Estimate]:
    """Cut 3, the settings of one layout worth listing. Dropped: a setting that another fitting one beats or
    ties on both tokens/s and memory; and a setting with more recompute or offload than a variant (same
    ZeRO and micro-batch) that fits and is faster. Both are checked on the estimates, not assumed."""
    out: list[Estimate] = []
    least = float("inf")
    for est in sorted(fits, key=_rank_key):
        if est.memory.total_bytes >= least:
            continue
        least = est.memory.total_bytes
        p, t = est.setup.parallel, est.setup.train
        o, r = _OFFLOAD_ORDER[p.offload], _technique_order(technique_of(t))
        lighter = (
            x
            for (zero, lo, lr, b), x in cache.items()
            if zero == p.zero
            and b == t.micro_batch
            and _OFFLOAD_ORDER[lo] <= o
            and _technique_order(lr) <= r
            and (_OFFLOAD_ORDER[lo], _technique_order(lr)) != (o, r)
        )
        if not any(x.fits and x.memory_frac <= _limit(est) and _speed(x) > _speed(est) for x in lighter):
            out.append(est)
    return out


def _limit(est: Estimate) -> float:
    """The memory share a lighter variant must keep to replace ``est`` in the listing (its own, at least)."""
    return max(est.memory_frac, TIGHT_FRAC)


def _combos(req: PlanRequest, techniques: int) -> int:
    """Grid combinations inside one layout for one micro-batch: ZeRO x offload x memory technique."""
    return sum(len(_offloads(req, z)) for z in range(4)) * techniques


def plan(request: PlanRequest) -> PlanResult:
    """Search the layouts of ``request`` and rank those that fit by predicted tokens/s (ties: less memory).

    Returns the top ``request.top`` with reasons; an empty top (and the closest layout) when nothing
    fits. Never raises for a layout that is invalid or too big: those are counted. Past
    ``request.time_budget_s`` the top is the best of what was searched (``PlanResult.complete``).
    """
    t0 = time.perf_counter()
    req = request
    budget = req.time_budget_s
    search = _Search(req)
    n_b = len(batch_grid(req.global_batch))
    considered = invalid = 0
    layouts: list[_Layout] = []
    base = len(RECOMPUTE_MODES)  # an invalid layout counts the plain recompute modes
    techniques: dict[tuple[int, int], tuple[str, ...]] = {}  # they follow the stages: (pp, vpp)
    grid_complete = True
    for lay in _layouts(req):
        spent = time.perf_counter() - t0
        if (layouts and spent > budget / 2) or spent > budget:
            grid_complete = False  # a grid that takes half the budget to list (a hostile model's)
            break
        lay.micro_batches = _micro_batches(req, lay)
        if lay.micro_batches:
            if (lay.pp, lay.vpp) not in techniques:
                techniques[lay.pp, lay.vpp] = _techniques(req, lay)
            lay.techniques = techniques[lay.pp, lay.vpp]
        per_b = _combos(req, len(lay.techniques) or base)
        considered += per_b * n_b
        invalid += per_b * (n_b - len(lay.micro_batches))
        if lay.micro_batches:
            layouts.append(lay)
    # The speed bounds take up to half the budget (those of the fastest precision first: a cut there
    # leaves the slower ones out), the search the rest; at least one layout is bounded and searched.
    order = sorted(range(len(layouts)), key=lambda i: -req.hardware.peak_flops(layouts[i].precision))
    n_bounded = 0
    for i in order:
        if n_bounded and time.perf_counter() - t0 > budget / 2:
            break
        search.bound(layouts[i], "none")
        n_bounded += 1
    unsearched = collections.deque(layouts[i] for i in order[n_bounded:])
    # Best bound first (ties in the grid's order), so the top fills early and the bound cuts the most.
    reached = [layouts[i] for i in sorted(order[:n_bounded], key=lambda i: (layouts[i].bound_ms["none"], i))]

    def out_of_time() -> bool:
        spent = time.perf_counter() - t0
        return spent > budget and (bool(search.listed) or spent > 2 * budget)

    for i, lay in enumerate(reached):
        if i and out_of_time():
            unsearched.extendleft(reversed(reached[i:]))  # best bound first, should the loop below run
            break
        search.visit(lay)
    # Time left after the bounds' half (or nothing to list yet): the layouts not bounded, in their order.
    while unsearched and not out_of_time():
        lay = unsearched.popleft()
        search.visit(lay)
        reached.append(lay)

    ranked = sorted(search.listed, key=_rank_key)[: req.top]
    entries = _entries(ranked)
    closest = None if entries else search.closest(reached, t0 + 2 * budget)
    points = _points(search.fits, ranked)
    return PlanResult(
        request=req,
        top=entries,
        considered=considered,
        invalid=invalid,
        no_fit=search.no_fit,
        elapsed_s=time.perf_counter() - t0,
        estimated=search.estimated,
        dominated=search.dominated,
        bounded=search.bounded,
        fitting=search.fitting,
        closest=closest,
        points=points,
        layouts=len(layouts),
        layouts_unsearched=len(unsearched),
        unsearched=sum(_combos(req, len(lay.techniques)) * len(lay.micro_batches) for lay in unsearched),
        grid_complete=grid_complete,
    )


def _points(fits: list[Estimate], ranked: list[Estimate], limit: int | None = None) -> list[PlanPoint]:
    """The scatter points of the fitting estimates ``fits``: the ``ranked`` top always among them, the
    fastest of the rest up to ``limit`` (default MAX_POINTS) in all, fastest first (ties as the
    ranking breaks them)."""
    limit = MAX_POINTS if limit is None else limit
    top = {id(est) for est in ranked}
    rest = [est for est in fits if id(est) not in top]
    room = max(limit - len(ranked), 0)
    if len(rest) > room:
        # A partial sort on tokens/s alone: _rank_key on every estimate of a large search costs more.
        speed = np.fromiter((est.tokens_per_s for est in rest), dtype=np.float64, count=len(rest))
        rest = [rest[i] for i in np.argpartition(-speed, room - 1)[:room]] if room else []
    chosen = sorted([*ranked, *rest], key=_rank_key)
    return [
        PlanPoint(layout_label(est.setup), est.memory.total_bytes / GiB, est.tokens_per_s, id(est) in top)
        for est in chosen
    ]


def _below(bound: float, threshold: float) -> bool:
    """The bound cannot reach the threshold, even as a tie after rounding (see _speed)."""
    return bound < threshold * (1 - 1e-9)


def _speed(est: Estimate) -> float:
    """tokens/s to 12 significant digits: settings whose times differ by float rounding tie (a recompute
    hidden behind exposed ZeRO-3 gathers costs exactly nothing, give or take the last bit)."""
    return float(f"{est.tokens_per_s:.12g}")


def _rank_key(est: Estimate) -> tuple:
    """Faster first; ties: less memory, then smaller degrees and lighter settings."""
    p, t = est.setup.parallel, est.setup.train
    return (
        -_speed(est),
        est.memory.total_bytes,
        t.precision,
        (p.tp, p.cp, p.pp, p.vpp, p.ep, p.zero, _OFFLOAD_ORDER[p.offload], _technique_order(technique_of(t))),
        t.micro_batch,
    )


# --- explanations ---------------------------------------------------------------------------------


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f} %" if whole else "0 %"


def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.1f} GiB"


def _speed_change(value: float, ref: float) -> str:
    """``-3.2 % tokens/s``, or ``the same tokens/s`` within 0.05 %."""
    change = 100 * (value / ref - 1)
    return "the same tokens/s" if abs(change) < 0.05 else f"{change:+.1f} % tokens/s"


def _entries(ranked: list[Estimate]) -> list[PlanEntry]:
    if not ranked:
        return []
    best = ranked[0]
    details = tuple(_why(best))
    out = [PlanEntry(best.setup, best, 1, " ".join(details), details)]
    out += [PlanEntry(est.setup, est, i, _versus(est, best)) for i, est in enumerate(ranked[1:], start=2)]
    return out


def _variant(est: Estimate, **changes: object) -> Estimate | None:
    """The estimate of ``est``'s setup with some fields changed, or None when that setup is invalid."""
    s = est.setup
    train = {
        k: v for k, v in changes.items() if k in ("micro_batch", "recompute", "recompute_layers", "offload_activations")
    }
    par = {k: v for k, v in changes.items() if k not in train}
    try:
        return estimate(replace(s, train=replace(s.train, **train), parallel=replace(s.parallel, **par)))
    except SpecError:
        return None


def _outcome(alt: Estimate | None, best: Estimate, what: str) -> str | None:
    """``ZeRO-1 would need 128.0 GiB`` or ``ZeRO-3 gives -4.1 % tokens/s``; None when invalid."""
    if alt is None:
        return None
    if not alt.fits:
        return f"{what} would need {_gib(alt.memory.total_bytes)}"
    speed = f"{what} gives {_speed_change(alt.tokens_per_s, best.tokens_per_s)}"
    if alt.memory_frac > TIGHT_FRAC and alt.tokens_per_s > best.tokens_per_s:
        # Faster but left out as tight: say so, or the pick reads as a slower layout chosen for nothing.
        return f"{speed} but needs {_gib(alt.memory.total_bytes)}, {100 * alt.memory_frac:.0f} % of memory (tight)"
    return speed


def _why(best: Estimate) -> list[str]:
    """Why the best layout: one point per decision, with the numbers behind it."""
    s, mem, tm = best.setup, best.memory, best.time
    p, t, hw, m = s.parallel, s.train, s.hardware, s.model
    step = tm.total_ms
    cap = best.capacity_bytes
    out: list[str] = []

    if p.tp > 1:
        out.append(
            f"TP={p.tp} splits every layer over {p.tp} GPUs inside one {hw.gpus_per_node}-GPU node, so its "
            f"all-reduces stay on the intra-node link: {tm.tp_comm_ms:,.0f} ms per step ({_pct(tm.tp_comm_ms, step)}); "
            "sequence parallelism splits the norms' activations over them too."
        )
    else:
        out.append("No tensor parallelism: whole layers fit on each GPU, so there are no per-layer all-reduces.")
    if p.pp > 1:
        share = 100 * (p.pp - 1) / (p.vpp * s.grad_accum)
        inter = f", interleaved {p.vpp} ways," if p.vpp > 1 else ""
        out.append(
            f"PP={p.pp}{inter} with {s.grad_accum} micro-batches per step keeps the bubble at (p-1)/(v m) = "
            f"{share:.1f} % of the work: {tm.bubble_ms:,.0f} ms ({_pct(tm.bubble_ms, step)})."
        )
    if p.cp > 1:
        ring = (
            "hides behind the attention it feeds"
            if tm.cp_comm_ms < 0.5
            else f"exposes {tm.cp_comm_ms:,.0f} ms ({_pct(tm.cp_comm_ms, step)})"
        )
        out.append(f"CP={p.cp} splits each {t.seq_len:,}-token sequence into {p.cp} parts; the ring exchange {ring}.")
    if p.ep > 1:
        out.append(
            f"EP={p.ep} spreads the {m.n_experts} experts over {p.ep} GPUs; the all-to-alls cost "
            f"{tm.ep_comm_ms:,.0f} ms ({_pct(tm.ep_comm_ms, step)})."
        )
    out.append(
        f"DP={p.dp}: gradient reduction and weight gathers expose {tm.dp_comm_ms:,.0f} ms ({_pct(tm.dp_comm_ms, step)})."
    )

    zero_text = {
        0: "ZeRO-0 keeps the whole optimizer state on every replica",
        1: "ZeRO-1 shards the optimizer state (fp32 master weights and Adam moments, 12 bytes/param)",
        2: "ZeRO-2 shards the optimizer state and the gradients",
        3: "ZeRO-3 shards optimizer state, gradients and weights",
    }[p.zero]
    others = [_outcome(_variant(best, zero=z), best, f"ZeRO-{z}") for z in range(4) if z != p.zero]
    others = [o for o in others if o]
    placed = (
        f"{_gib(mem.host_bytes)} of it offloaded to host memory"
        if p.offload != "none"
        else f"optimizer {_gib(mem.optimizer_bytes)}, gradients {_gib(mem.grads_bytes)}, "
        f"weights {_gib(mem.weights_bytes)} per GPU"
    )
    over = f"over dp x cp = {p.dp * p.cp} ranks"
    if best.setup.model.is_moe and p.ep > 1 and p.zero:
        # Expert weights are replicated over dp x cp / ep ranks only: their states shard over those.
        over += f" (the experts' over dp x cp / ep = {p.dp * p.cp // p.ep})"
    out.append(f"{zero_text} {over}: {placed}" + (f" ({'; '.join(others)})." if others else "."))

    if t.offload_activations:
        need = _outcome(_variant(best, offload_activations=0), best, "keeping them on the GPU")
        link = {"nvlink-c2c": "NVLink-C2C", "pcie5": "PCIe Gen5", "pcie4": "PCIe Gen4", "pcie3": "PCIe Gen3"}.get(
            hw.host_link, hw.host_link
        )
        out.append(
            f"The activations of {t.offload_activations} blocks per stage go to host memory over {link} during "
            f"forward and come back for backward: {tm.offload_ms:,.0f} ms ({_pct(tm.offload_ms, step)}) of copies "
            "the compute does not hide, and no work redone" + (f"; {need}." if need else ".")
        )
    elif t.recompute == "none":
        out.append(
            f"No activation recompute: the activations ({_gib(mem.activations_bytes)}) fit, so no work is redone."
        )
    else:
        lighter = RECOMPUTE_MODES[RECOMPUTE_MODES.index(t.recompute) - 1]
        if t.recompute_layers:
            lighter = "full"
            need = _outcome(_variant(best, recompute_layers=0), best, "full recompute of every block")
            what = f"Full recompute of {t.recompute_layers} blocks per stage"
        else:
            need = _outcome(_variant(best, recompute=lighter), best, f"{lighter} recompute")
            what = f"{t.recompute.capitalize()} recompute"
        text = f"{what} costs {tm.recompute_ms:,.0f} ms ({_pct(tm.recompute_ms, step)})"
        text += f"; {need}" if need else ""
        # Recompute may pay for itself by allowing a larger micro-batch (fewer ZeRO-3 gathers, a smaller
        # bubble): say how the lightest recompute does at the micro-batch that suits it best.
        fitting = [
            alt
            for b in _divisors(s.global_batch // p.dp)
            if (alt := _variant(best, recompute="none", recompute_layers=0, micro_batch=b)) is not None and alt.fits
        ]
        if fitting:
            alt = max(fitting, key=lambda e: e.tokens_per_s)
            b = alt.setup.train.micro_batch
            text += f"; no recompute at micro-batch {b} gives {_speed_change(alt.tokens_per_s, best.tokens_per_s)}"
        else:
            text += "; without recompute no micro-batch fits"
        out.append(text + ".")
    if p.offload != "none":
        need = _outcome(_variant(best, offload="none"), best, "no offload")
        out.append(
            f"Offloading the {p.offload} to host memory costs {tm.offload_ms:,.0f} ms "
            f"({_pct(tm.offload_ms, step)}) of host transfers and CPU optimizer step" + (f"; {need}." if need else ".")
        )

    mb_text = f"Micro-batch {t.micro_batch}, {s.grad_accum} per step"
    for b in (b for b in _divisors(s.global_batch // p.dp) if b > t.micro_batch):
        alt = _outcome(_variant(best, micro_batch=b), best, f"micro-batch {b}")
        if alt:  # the next micro-batch the layout accepts (interleaving needs m a multiple of pp)
            mb_text += f"; {alt}"
            break
    out.append(mb_text + ".")
    if t.precision == "fp8":
        out.append(
            f"fp8: the blocks' GEMMs reach {100 * best.gemm_frac:.0f} % of the fp8 peak (twice the bf16 one); "
            "attention, the embedding and the head stay bf16, each GEMM input is cast to fp8, and weights keep "
            "a bf16 copy plus a 1-byte fp8 cache."
        )
    out.append(
        f"Memory: {_gib(mem.total_bytes)} of {_gib(cap)} per GPU ({100 * best.memory_frac:.0f} %), "
        f"highest during the {mem.moment}."
    )
    return out


def _versus(est: Estimate, best: Estimate) -> str:
    """What ``est`` loses against ``best``: speed, the time components that grew, how it differs, memory."""
    d_ms = est.step_time_ms - best.step_time_ms
    change = _speed_change(est.tokens_per_s, best.tokens_per_s)
    parts = [change if change.startswith("the same") else f"{change} ({d_ms:+,.0f} ms per step)"]
    a, b = est.time.as_dict(), best.time.as_dict()
    grew = sorted(((a[k] - b[k], k) for k in TIME_LABELS if a[k] - b[k] > max(0.1 * d_ms, 0.0)), reverse=True)
    if grew and d_ms > 0:
        parts.append(", ".join(f"+{dv:,.0f} ms {TIME_LABELS[k]}" for dv, k in grew[:2]))
    diff = _differences(est.setup, best.setup)
    if diff:
        parts.append(diff)
    dm = est.memory.total_bytes - best.memory.total_bytes
    if abs(dm) >= 0.05 * GiB:
        parts.append(f"{_gib(abs(dm))} {'more' if dm > 0 else 'less'} memory")
    return "; ".join(parts)


def _differences(s: Setup, ref: Setup) -> str:
    """How ``s`` differs from ``ref``: ``tp 4 (vs 8), ZeRO 3 (vs 1)``."""
    pairs = [
        ("tp", s.parallel.tp, ref.parallel.tp),
        ("pp", s.parallel.pp, ref.parallel.pp),
        ("vpp", s.parallel.vpp, ref.parallel.vpp),
        ("cp", s.parallel.cp, ref.parallel.cp),
        ("ep", s.parallel.ep, ref.parallel.ep),
        ("ZeRO", s.parallel.zero, ref.parallel.zero),
        ("offload", s.parallel.offload, ref.parallel.offload),
        ("recompute", s.train.recompute, ref.train.recompute),
        ("recompute blocks", s.train.recompute_layers, ref.train.recompute_layers),
        ("offloaded blocks", s.train.offload_activations, ref.train.offload_activations),
        ("micro-batch", s.train.micro_batch, ref.train.micro_batch),
        ("precision", s.train.precision, ref.train.precision),
    ]
    return ", ".join(f"{name} {a} (vs {b})" for name, a, b in pairs if a != b)


def _closest_text(req: PlanRequest, closest: Estimate | None) -> str:
    """What came nearest to fitting and by how much memory."""
    if closest is None:
        return "No layout could be built: every combination is invalid."
    hw = req.hardware
    label = layout_label(closest.setup)
    need, cap = closest.memory.total_bytes, closest.capacity_bytes
    if need > cap:
        text = (
            f"Closest: {label} needs {_gib(need)} per GPU, {_gib(need - cap)} "
            f"({100 * (need / cap - 1):.0f} %) more than the {_gib(cap)} of one {hw.name}."
        )
    else:
        host, host_cap = closest.host_bytes_per_node, hw.host_memory_bytes
        text = (
            f"Closest: {label} fits the GPU ({_gib(need)} of {_gib(cap)}) but its offloaded state needs "
            f"{_gib(host)} of host memory per node, {_gib(host - host_cap)} more than the node's {_gib(host_cap)}."
        )
    if not req.allow_offload and hw.kind == "gpu":
        text += " CPU offload was not allowed; allowing it may help."
    return text
