"""Rules as data: load ``rules/*.yaml``, check each rule against the known fields, evaluate it safely.

A rule says what is wrong (``when``, an expression over the fields below), why, what to change
(``action``: new spec or run-option values) and names the Python function that says by how much the
change would help (``gain``, see ``advisor.advice.gains``). Conditions are parsed once at load time and may
use only the names in ``FIELDS``, literals, comparisons, arithmetic, ``and``/``or``/``not``,
``in`` and the functions in ``FUNCTIONS``: an unknown name, an attribute access or any other
construct is a load error that names the rule and the file. Evaluation goes through ``simpleeval``
(no ``eval``), with its limits on operand sizes.

A rule whose condition names a field the source cannot provide (a foreign trace has no spec; a CPU
run has no NVML) is decided where the fields it has settle the condition (three-valued logic), else
listed as not applicable with the missing names. A trace without a spec fills the spec fields it
shows itself: the optimizer and its implementation, fused attention.
"""

from __future__ import annotations

import ast
import re
import string
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml
from simpleeval import EvalWithCompoundTypes, InvalidExpression

from advisor import CHECKOUT
from advisor.errors import AdvisorError
from advisor.spec.metrics import StepMetrics
from advisor.spec.specs import ModelSpec, ParallelSpec, Setup, TrainSpec

RULES_DIR = CHECKOUT / "rules" if CHECKOUT else Path(sys.prefix) / "share" / "advisor" / "rules"
"""The checkout's ``rules/``; an installed package's copy (pyproject.toml's data-files) where there is none."""
SEVERITIES = ("critical", "warning", "info")
TARGETS = ("step_time_ms", "peak_memory_bytes", "tokens_per_s")
"""The measured figure a rule's action improves: less step time, less memory, more tokens/s."""
GROUPS = (
    "memory",
    "precision",
    "parallelism",
    "communication",
    "input",
    "launch",
    "optimizer",
    "kernels",
    "hardware",
    "roofline",
)
FUNCTIONS = {"min": min, "max": max, "abs": abs}
GiB = 2**30

# Every name a condition, a message or a computed action value may use, with its meaning and unit.
_METRIC_FIELDS = {
    f.name: f"StepMetrics.{f.name}"
    for f in fields(StepMetrics)
    if f.name not in ("run_id", "nvml", "kernel_category_pct", "stragglers", "comm_stragglers", "top_ops", "proxy_note")
}
_DERIVED_FIELDS = {
    "data_pct": "measured data-loading time, % of step time",
    "forward_pct": "measured forward time, % of step time",
    "backward_pct": "measured backward time, % of step time",
    "optimizer_pct": "measured optimizer-step time, % of step time",
    "memory_pct": "measured peak memory, % of device (or budget) capacity",
    "mfu_pct": "measured model FLOPs utilisation, %",
    "peak_memory_gib": "measured peak memory, GiB",
    "memory_capacity_gib": "device (or budget) capacity, GiB",
    "optimizer_impl": "for-loop, foreach or fused (from the spec or the run's optimizer label)",
    "sync_calls_per_step": "blocking host calls per profiled step",
    "n_stragglers": "ranks flagged as stragglers, by the figure straggler_basis names",
    "straggler_pct": (
        "what the slowest rank costs, %: comm_late_pct (the earliest rank's wait per step for the latest-"
        "starting one at the collectives matched across ranks) where measured, else step_skew_pct"
    ),
    "straggler_basis": "which figure straggler_pct is, with its value, in words",
    "reserved_over_peak": "CUDA allocator reservation over peak allocation (fragmentation), ratio",
    "act_offload_exposed_pct": (
        "measured activation-offload time not hidden behind compute, % of step time: on a CPU the step's "
        "cost measured against steps without it (act_offload_measured_by 'reference'), else the hooks' time"
    ),
    "act_offload_measured_by": "'reference' (steps with the offload off beside steps with it on) or 'hooks'",
    "reserved_pct": "CUDA allocator reservation at its peak, % of device capacity",
    "gemm_pct": "GEMM kernels, % of summed GPU-event time",
    "attention_pct": "attention kernels, % of summed GPU-event time",
    "elementwise_pct": "elementwise kernels, % of summed GPU-event time",
    "communication_pct": "communication kernels, % of summed GPU-event time",
    "memcpy_pct": "memcpy, % of summed GPU-event time",
    "nvml_available": "NVML readings exist for this run",
    "nvml_throttled_pct": "NVML samples with a clock slowdown reason set, %",
    "nvml_gpu_util_mean_pct": "NVML GPU utilisation, mean %",
    "nvml_thermal": "a thermal or power slowdown reason was seen",
}
_OPTION_FIELDS = {
    "num_workers": "DataLoader worker processes",
    "pin_memory": "pinned host memory for batches",
    "compile": "torch.compile on",
    "data_delay_ms": "simulated per-sample loading latency, ms (a test scenario knob)",
    "unified_memory": "the step's CUDA tensors in managed (Unified) memory",
}
_SPEC_FIELDS = {
    "model_n_params": "parameters",
    "model_hidden": "hidden size h",
    "model_n_layers": "layers L",
    "model_n_heads": "attention heads",
    "model_head_dim": "h / heads",
    "model_ffn_hidden": "MLP hidden size",
    "model_vocab": "vocabulary size",
    "model_is_moe": "mixture of experts",
    "model_n_experts": "routed experts",
    "train_seq_len": "sequence length",
    "train_micro_batch": "micro-batch",
    "train_global_batch": "global batch, sequences (0: micro_batch x dp)",
    "train_precision": "fp32, bf16, fp16 or fp8",
    "train_recompute": "none, selective or full",
    "train_flash_attention": "fused attention on",
    "train_recompute_layers": "with full recompute: blocks per stage that recompute (0: all)",
    "train_offload_activations": "blocks per stage whose activations go to host memory",
    "stage_blocks": "transformer blocks per pipeline stage (the fewest of any stage)",
    "attention_flops_pct": "attention's share of the model FLOPs (12 L s q of 6 N + 12 L s q), %",
    "train_optimizer": "adamw, sgd or adafactor",
    "train_optimizer_impl": "for-loop, foreach or fused",
    "train_framework": "megatron or pytorch",
    "grad_accum_steps": "micro-batches per optimizer step",
    "global_batch_seqs": "sequences per optimizer step",
    "par_dp": "data-parallel degree",
    "par_tp": "tensor-parallel degree",
    "par_pp": "pipeline stages",
    "par_vpp": "virtual stages per pipeline rank",
    "par_cp": "context-parallel degree",
    "par_ep": "expert-parallel degree",
    "par_zero": "ZeRO stage 0-3",
    "par_offload": "none, optimizer or optimizer+params",
    "par_sequence_parallel": "Megatron sequence parallelism",
    "gpus": "world size",
    "hw_name": "device name",
    "hw_kind": "gpu or cpu",
    "hw_host_link": "pcie4, pcie5, nvlink-c2c or none",
    "hw_gpus_per_node": "GPUs per node",
    "hw_tp_max": "largest power of two dividing a node's GPUs: the largest TP that tiles a node (8 on 8- and 72-GPU nodes)",
    "hw_memory_gib": "device memory, GiB",
    "hw_has_fp8": "fp8 tensor cores",
    "hw_bf16_speedup": "peak bf16 over peak fp32 FLOP/s, ratio",
    "hw_fp16_speedup": "peak fp16 over peak fp32 FLOP/s, ratio",
}
_ESTIMATE_FIELDS = {
    "est_step_time_ms": "estimated step time, ms",
    "est_memory_pct": "estimated peak memory, % of capacity",
    "est_memory_gib": "estimated peak memory, GiB",
    "est_fits": "the estimate fits the device and host memory",
    "est_activation_pct": "activations, % of estimated peak memory",
    "est_model_state_pct": "weights + gradients + optimizer states, % of estimated peak memory",
    "est_mfu_pct": "estimated MFU, %",
    "est_dp_comm_pct": "exposed DP/ZeRO communication, % of estimated step time",
    "est_tp_comm_pct": "TP communication, % of estimated step time",
    "est_bubble_pct": "pipeline bubble, % of estimated step time",
    "est_offload_pct": "exposed CPU offload, % of estimated step time",
    "est_compute_pct": "GEMMs and attention (math), % of estimated step time",
    "est_kernel_overhead_pct": "per-kernel launch and tail cost, % of estimated step time",
    "est_recompute_pct": "recomputation, % of estimated step time",
    "est_optimizer_pct": "optimizer step, % of estimated step time",
    "est_host_fits": "offloaded state fits host memory",
}
FIELDS: dict[str, str] = {**_METRIC_FIELDS, **_DERIVED_FIELDS, **_OPTION_FIELDS, **_SPEC_FIELDS, **_ESTIMATE_FIELDS}
_ACTION_SPECS = {"train": TrainSpec, "parallel": ParallelSpec, "model": ModelSpec}
_OPTION_NAMES = ("num_workers", "pin_memory", "compile", "data_delay_ms", "unified_memory")


class RuleError(AdvisorError):
    """A rule file that cannot be loaded: names the file, the rule and what is wrong."""


@dataclass(frozen=True)
class Rule:
    """One rule of ``rules/<group>.yaml``."""

    id: str
    group: str
    title: str
    severity: str
    when: str
    why: str
    message: str
    action: dict[str, Any]
    """{describe: text, set: {'train.x': value}, compute: {'train.x': expression}}; set/compute may be absent
    (advice only, e.g. fix the host's cooling)."""
    gain: str
    """Name of a gain function in advisor.advice.gains."""
    target: str
    references: tuple[str, ...]
    examples: dict[str, dict[str, Any]]
    """{fires: context, silent: context}: the rule's own test fixtures."""
    names: frozenset[str] = field(default=frozenset())
    """Field names the condition reads."""

    @property
    def changes_spec(self) -> bool:
        return bool(self.action.get("set") or self.action.get("compute"))


@dataclass(frozen=True)
class Evaluation:
    """A rule's outcome on one context: fired, silent, or not applicable (missing fields)."""

    rule: Rule
    fired: bool
    missing: tuple[str, ...] = ()
    message: str = ""


# --- loading -------------------------------------------------------------------------------------

_ALLOWED_NODES = (
    ast.Expression,
    ast.BoolOp,
    ast.And,
    ast.Or,
    ast.UnaryOp,
    ast.Not,
    ast.USub,
    ast.UAdd,
    ast.BinOp,
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.Div,
    ast.FloorDiv,
    ast.Mod,
    ast.Compare,
    ast.Eq,
    ast.NotEq,
    ast.Lt,
    ast.LtE,
    ast.Gt,
    ast.GtE,
    ast.In,
    ast.NotIn,
    ast.IfExp,
    ast.Name,
    ast.Load,
    ast.Constant,
    ast.Tuple,
    ast.List,
    ast.Call,
)


def expression_names(expr: str, where: str) -> frozenset[str]:
    """The field names ``expr`` reads; RuleError for syntax, unknown names or disallowed constructs."""
    if not isinstance(expr, str) or not expr.strip():
        raise RuleError(f"{where}: the expression must be a non-empty string (got {expr!r})")
    if len(expr) > 2000:
        raise RuleError(f"{where}: the expression is {len(expr)} characters long (at most 2000)")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as err:
        raise RuleError(f"{where}: cannot parse {expr!r}: {err.msg}") from None
    except (RecursionError, MemoryError):
        raise RuleError(f"{where}: the expression is nested too deeply") from None
    names: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED_NODES):
            raise RuleError(
                f"{where}: {type(node).__name__} is not allowed in {expr!r}; conditions use field names, "
                "literals, comparisons, arithmetic, and/or/not, in, and min/max/abs"
            )
        if isinstance(node, ast.Call):
            if not (isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS) or node.keywords:
                raise RuleError(f"{where}: only min(), max() and abs() may be called in {expr!r}")
        elif isinstance(node, ast.Name) and node.id not in FUNCTIONS:
            if node.id not in FIELDS:
                raise RuleError(f"{where}: unknown name {node.id!r} in {expr!r} ({_near(node.id)})")
            names.add(node.id)
    return frozenset(names)


def _near(name: str) -> str:
    import difflib

    close = difflib.get_close_matches(name, FIELDS, n=3)
    return "did you mean " + ", ".join(close) if close else "see advisor.advice.rules.FIELDS for the known names"


_SPEC_RE = re.compile(r"^(,?\.\d[f%]|,|\.\dg)?$")


def _message_names(message: str, where: str) -> None:
    try:
        parts = list(string.Formatter().parse(message))
    except ValueError as err:
        raise RuleError(f"{where}: bad message template: {err}") from None
    for _, name, spec, conversion in parts:
        if name is None:
            continue
        if not name.isidentifier() or name not in FIELDS:
            raise RuleError(f"{where}: message placeholder {{{name}}} is not a known field name ({_near(name)})")
        if conversion or not _SPEC_RE.match(spec or ""):
            raise RuleError(
                f"{where}: placeholder {{{name}}} has format {spec!r}; allowed: none, or a precision like "
                "'.1f', ',.0f', '.2f', '.0%' (no nested fields, widths or conversions)"
            )


def _check_action(action: object, where: str) -> dict[str, Any]:
    if not isinstance(action, dict) or not isinstance(action.get("describe"), str):
        raise RuleError(f"{where}: action must be a mapping with a 'describe' text")
    unknown = set(action) - {"describe", "set", "compute"}
    if unknown:
        raise RuleError(f"{where}: action keys {sorted(unknown)} unknown (allowed: describe, set, compute)")
    for kind in ("set", "compute"):
        for key, value in (action.get(kind) or {}).items():
            section, _, name = str(key).partition(".")
            if section == "options":
                if name not in _OPTION_NAMES:
                    raise RuleError(f"{where}: action {kind} {key!r}: run options are {', '.join(_OPTION_NAMES)}")
            elif section in _ACTION_SPECS:
                known = {f.name for f in fields(_ACTION_SPECS[section])}
                if name not in known:
                    raise RuleError(f"{where}: action {kind} {key!r}: {section} has no field {name!r}")
            else:
                raise RuleError(f"{where}: action {kind} {key!r} must start with train., parallel., model. or options.")
            if kind == "compute":
                expression_names(str(value), f"{where} action {key}")
    return action


def load_rules(directory: Path | str | None = None) -> list[Rule]:
    """Every rule in ``directory/*.yaml`` (default: the repo's ``rules/``), checked; RuleError on any fault."""
    from advisor.advice import gains

    root = Path(directory) if directory else RULES_DIR
    files = sorted(root.glob("*.yaml"))
    if not files:
        raise RuleError(f"no rule files (*.yaml) in {root}")
    rules: list[Rule] = []
    seen: dict[str, str] = {}
    for path in files:
        group = path.stem
        if group not in GROUPS:
            raise RuleError(f"{path.name}: unknown group {group!r} (allowed: {', '.join(GROUPS)})")
        try:
            doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            raise RuleError(f"{path.name}: not valid YAML: {err}") from None
        if not isinstance(doc, list):
            raise RuleError(f"{path.name}: must be a list of rules")
        for i, raw in enumerate(doc):
            where = f"{path.name} rule #{i + 1}"
            if not isinstance(raw, dict):
                raise RuleError(f"{where}: must be a mapping")
            rid = raw.get("id")
            if not isinstance(rid, str) or not rid:
                raise RuleError(f"{where}: needs an 'id'")
            where = f"{path.name} rule {rid!r}"
            if rid in seen:
                raise RuleError(f"{where}: duplicate id (also in {seen[rid]})")
            seen[rid] = path.name
            missing = [
                k for k in ("title", "severity", "when", "why", "message", "action", "gain", "target") if k not in raw
            ]
            if missing:
                raise RuleError(f"{where}: missing keys {missing}")
            if raw["severity"] not in SEVERITIES:
                raise RuleError(f"{where}: severity {raw['severity']!r} not in {SEVERITIES}")
            if raw["target"] not in TARGETS:
                raise RuleError(f"{where}: target {raw['target']!r} not in {TARGETS}")
            if raw["gain"] not in gains.GAINS:
                raise RuleError(
                    f"{where}: gain {raw['gain']!r} is not registered (known: {', '.join(sorted(gains.GAINS))})"
                )
            names = expression_names(str(raw["when"]), f"{where} when")
            _message_names(str(raw["message"]), where)
            examples = raw.get("examples") or {}
            if not isinstance(examples, dict) or set(examples) != {"fires", "silent"}:
                raise RuleError(f"{where}: needs examples with 'fires' and 'silent' contexts")
            for kind, ctx in examples.items():
                if not isinstance(ctx, dict) or set(ctx) - set(FIELDS):
                    raise RuleError(
                        f"{where}: example {kind} has unknown fields {sorted(set(ctx or {}) - set(FIELDS))}"
                    )
            rules.append(
                Rule(
                    id=rid,
                    group=group,
                    title=str(raw["title"]),
                    severity=raw["severity"],
                    when=str(raw["when"]).strip(),
                    why=str(raw["why"]).strip(),
                    message=str(raw["message"]).strip(),
                    action=_check_action(raw["action"], where),
                    gain=raw["gain"],
                    target=raw["target"],
                    references=tuple(raw.get("references") or ()),
                    examples=examples,
                    names=names,
                )
            )
    return rules


# --- evaluation ----------------------------------------------------------------------------------


def _evaluator(ctx: dict[str, Any]) -> EvalWithCompoundTypes:
    # The compound-types evaluator only for tuple literals (``x in ('a', 'b')``); comprehensions are
    # refused at load time by expression_names.
    return EvalWithCompoundTypes(names=ctx, functions=FUNCTIONS)


def evaluate_expression(expr: str, ctx: dict[str, Any]) -> Any:
    """The value of a checked expression over ``ctx``."""
    return _evaluator(ctx).eval(expr)


class _MessageFormatter(string.Formatter):
    """Fills a checked message template: a missing or None field prints '?', a value its spec cannot
    format (text under '.1f') prints plainly; other fields keep their specs."""

    def get_value(self, key: object, args: object, kwargs: dict[str, Any]) -> Any:
        return kwargs.get(str(key))

    def format_field(self, value: Any, format_spec: str) -> str:
        if value is None:
            return "?"
        try:
            return format(value, format_spec)
        except (ValueError, TypeError):
            return str(value)


def _format(template: str, ctx: dict[str, Any]) -> str:
    return _MessageFormatter().vformat(template, (), ctx)


def _decided(node: ast.expr, ctx: dict[str, Any], missing: set[str]) -> bool | None:
    """The truth of a condition where some fields are unknown (``missing``), by Kleene's three-valued
    logic: ``a and b`` is false once either side is, ``a or b`` true once either side is, ``not``
    keeps an unknown; any other part that reads an unknown field is unknown. None: undecided."""
    if isinstance(node, ast.BoolOp):
        values = [_decided(v, ctx, missing) for v in node.values]
        settles = isinstance(node.op, ast.Or)  # the value that decides: True for `or`, False for `and`
        if settles in values:
            return settles
        return None if None in values else not settles
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        inner = _decided(node.operand, ctx, missing)
        return None if inner is None else not inner
    if any(isinstance(n, ast.Name) and n.id in missing for n in ast.walk(node)):
        return None
    return bool(_evaluator(ctx).eval(ast.unparse(node)))


def evaluate(rule: Rule, ctx: dict[str, Any]) -> Evaluation:
    """Fire ``rule`` on ``ctx`` (a ``build_context`` dict). A rule whose condition reads fields the
    input does not have is still decided where the known ones settle it (``x == 'foreach' and y > 85``
    is false for x = 'for-loop', whatever y is: ``_decided``); else it is not applicable, with the
    missing names."""
    missing = tuple(sorted(n for n in rule.names if ctx.get(n) is None))
    try:
        if missing:
            fired = _decided(ast.parse(rule.when, mode="eval").body, ctx, set(missing))
            if fired is None:
                return Evaluation(rule, False, missing)
        else:
            fired = bool(_evaluator(ctx).eval(rule.when))
    except (TypeError, ZeroDivisionError, ValueError, InvalidExpression) as err:
        raise AdvisorError(f"rule {rule.id}: condition {rule.when!r} failed on this input: {err}") from None
    return Evaluation(rule, fired, (), _format(rule.message, ctx) if fired else "")


# --- the context ---------------------------------------------------------------------------------


def _pct(part: float | None, whole: float | None) -> float | None:
    if part is None or not whole:
        return None
    return 100.0 * part / whole


def build_context(
    metrics: StepMetrics | None = None,
    setup: Setup | None = None,
    estimate: Any = None,
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Every name in FIELDS with its value for this input (None where the input does not say)."""
    ctx: dict[str, Any] = dict.fromkeys(FIELDS)
    if metrics is not None:
        m = metrics
        for name in _METRIC_FIELDS:
            ctx[name] = getattr(m, name)
        step = m.step_time_ms
        for phase in ("data", "forward", "backward", "optimizer"):
            ctx[f"{phase}_pct"] = _pct(getattr(m, f"{phase}_ms"), step)
        ctx["memory_pct"] = None if m.memory_frac is None else 100.0 * m.memory_frac
        ctx["mfu_pct"] = None if m.mfu_frac is None else 100.0 * m.mfu_frac
        ctx["peak_memory_gib"] = None if m.peak_memory_bytes is None else m.peak_memory_bytes / GiB
        ctx["memory_capacity_gib"] = None if m.memory_capacity_bytes is None else m.memory_capacity_bytes / GiB
        if m.optimizer and "(" in m.optimizer:
            ctx["optimizer_impl"] = m.optimizer.split("(")[1].rstrip(")")
        if setup is None:  # a trace: the spec fields it shows itself (a spec, where given, says them)
            ctx["train_optimizer"] = m.optimizer.split(" (")[0] if m.optimizer else None
            ctx["train_optimizer_impl"] = ctx["optimizer_impl"]
            ctx["train_flash_attention"] = m.attention_fused
        if m.sync_calls is not None and m.steps_measured:
            ctx["sync_calls_per_step"] = m.sync_calls / m.steps_measured
        ctx["n_stragglers"] = len(m.stragglers) if m.n_ranks else None
        # The late start of communication kernels finds the rank the others wait for; step time is the
        # fallback where one rank's trace (or no matched collective) leaves that unmeasured.
        if m.comm_late_pct is not None:
            ctx["straggler_pct"] = m.comm_late_pct
            ctx["n_stragglers"] = len(m.comm_stragglers)
            ctx["straggler_basis"] = (
                f"measured by the start of communication kernels: the earliest rank waits {m.comm_late_pct:.1f} % "
                "of each step for the latest one"
            )
        elif m.step_skew_pct is not None:
            ctx["straggler_pct"] = m.step_skew_pct
            ctx["straggler_basis"] = (
                f"measured by step time: the slowest rank's step is {m.step_skew_pct:.1f} % above the median rank's"
            )
        if m.activation_offload and step:
            # On a CPU the run also timed steps with the offload off beside steps with it on: that
            # difference is its whole cost, where the hooks' own timer misses part (child._offload_reference).
            cost = m.activation_offload.get("step_cost_ms")
            measured = m.activation_offload.get("exposed_ms") if cost is None else max(0.0, cost)
            ctx["act_offload_exposed_pct"] = _pct(measured, step)
            ctx["act_offload_measured_by"] = "hooks" if cost is None else "reference"
        if m.reserved_memory_bytes and m.peak_memory_bytes:
            ctx["reserved_over_peak"] = m.reserved_memory_bytes / m.peak_memory_bytes
        if m.reserved_memory_bytes and m.memory_capacity_bytes:
            ctx["reserved_pct"] = 100.0 * m.reserved_memory_bytes / m.memory_capacity_bytes
        if m.kernel_category_pct:
            for cat in ("gemm", "attention", "elementwise", "communication", "memcpy"):
                ctx[f"{cat}_pct"] = float(m.kernel_category_pct.get(cat, 0.0))
        nv = m.nvml or {}
        ctx["nvml_available"] = bool(nv.get("nvml_available"))
        if nv.get("nvml_available"):
            ctx["nvml_throttled_pct"] = 100.0 * nv.get("throttled_frac", 0.0)
            ctx["nvml_gpu_util_mean_pct"] = nv.get("gpu_util_pct_mean")
            reasons = " ".join(nv.get("throttle_reasons", []))
            ctx["nvml_thermal"] = "thermal" in reasons or "power" in reasons
    if options is not None:
        for name in _OPTION_FIELDS:
            ctx[name] = options.get(name)
    if setup is not None:
        md, t, p, hw = setup.model, setup.train, setup.parallel, setup.hardware
        ctx.update(
            model_n_params=md.n_params,
            model_hidden=md.hidden,
            model_n_layers=md.n_layers,
            model_n_heads=md.n_heads,
            model_head_dim=md.hidden // md.n_heads,
            model_ffn_hidden=md.ffn_hidden,
            model_vocab=md.vocab,
            model_is_moe=md.is_moe,
            model_n_experts=md.n_experts,
            train_seq_len=t.seq_len,
            train_micro_batch=t.micro_batch,
            train_global_batch=t.global_batch,
            train_precision=t.precision,
            train_recompute=t.recompute,
            train_flash_attention=t.flash_attention,
            train_recompute_layers=t.recompute_layers,
            train_offload_activations=t.offload_activations,
            stage_blocks=md.n_layers // (p.pp * p.vpp),
            attention_flops_pct=100.0 * _attention_flops_share(md, t.seq_len),
            train_optimizer=t.optimizer,
            train_optimizer_impl=t.optimizer_impl,
            train_framework=t.framework,
            grad_accum_steps=setup.grad_accum,
            global_batch_seqs=setup.global_batch,
            par_dp=p.dp,
            par_tp=p.tp,
            par_pp=p.pp,
            par_vpp=p.vpp,
            par_cp=p.cp,
            par_ep=p.ep,
            par_zero=p.zero,
            par_offload=p.offload,
            par_sequence_parallel=p.sequence_parallel,
            gpus=setup.gpus,
            hw_name=hw.name,
            hw_kind=hw.kind,
            hw_host_link=hw.host_link,
            hw_gpus_per_node=hw.gpus_per_node,
            hw_tp_max=hw.tp_tile_max,
            hw_memory_gib=hw.memory_bytes / GiB,
            hw_has_fp8=hw.peak_fp8_flops > 0,
            hw_bf16_speedup=hw.peak_bf16_flops / hw.peak_fp32_flops,
            hw_fp16_speedup=hw.peak_fp16_flops / hw.peak_fp32_flops,
        )
        ctx["optimizer_impl"] = t.optimizer_impl
    if estimate is not None:
        mem, tm = estimate.memory, estimate.time
        total_ms = tm.total_ms
        states = mem.weights_bytes + mem.grads_bytes + mem.optimizer_bytes
        ctx.update(
            est_step_time_ms=total_ms,
            est_memory_pct=100.0 * estimate.memory_frac,
            est_memory_gib=mem.total_bytes / GiB,
            est_fits=estimate.fits,
            est_activation_pct=100.0 * mem.activations_bytes / mem.total_bytes,
            est_model_state_pct=100.0 * states / mem.total_bytes,
            est_mfu_pct=100.0 * estimate.mfu_frac,
            est_dp_comm_pct=_pct(tm.dp_comm_ms, total_ms),
            est_tp_comm_pct=_pct(tm.tp_comm_ms, total_ms),
            est_bubble_pct=_pct(tm.bubble_ms, total_ms),
            est_offload_pct=_pct(tm.offload_ms, total_ms),
            est_compute_pct=_pct(tm.compute_ms, total_ms),
            est_kernel_overhead_pct=_pct(tm.kernel_overhead_ms, total_ms),
            est_recompute_pct=_pct(tm.recompute_ms, total_ms),
            est_optimizer_pct=_pct(tm.optimizer_ms, total_ms),
            est_host_fits=estimate.host_fits,
        )
        if metrics is None:
            # Sizing only: the estimate stands in for the measured memory figures.
            ctx["memory_pct"] = ctx["est_memory_pct"]
            ctx["peak_memory_gib"] = ctx["est_memory_gib"]
            ctx["memory_capacity_gib"] = estimate.capacity_bytes / GiB
    return ctx


def _attention_flops_share(model, seq_len: int) -> float:
    """Attention's share of the training FLOPs (PaLM's 12 L s q over 6 N_matmul + 12 L s q)."""
    attn = 12.0 * model.n_layers * seq_len * model.q_dim
    return attn / (6.0 * model.matmul_params_per_token() + attn)
