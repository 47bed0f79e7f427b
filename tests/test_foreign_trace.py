"""A trace of someone else's training loop: a Hugging Face Llama trained for three steps on the CPU
under a plain ``with profile():`` (no ``prof.step()``, so no ProfilerStep ranges, and none of our
phase ranges). What the trace measured (steps, phases, peak tensor memory, the optimizer) must reach
StepMetrics and the text, and the rules the trace can decide must be decided from it."""

from __future__ import annotations

import ast
import json

import numpy as np
import pytest

from advisor.advice.advise import advise_trace
from advisor.advice.rules import _decided
from advisor.analysis.steps import inferred_phases
from advisor.cli import main
from advisor.trace.table import make_table

transformers = pytest.importorskip("transformers", reason="transformers is in requirements-dev.txt")
torch = pytest.importorskip("torch")

STEPS = 3


def _train_and_trace(path, foreach: bool) -> None:
    """Three steps of a two-layer Llama with AdamW, profiled the way its users do: one ``profile()``
    around the loop, memory and shapes recorded, the trace exported at the end."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)
    ids = torch.randint(0, config.vocab_size, (2, 64))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
        for _ in range(STEPS):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    prof.export_chrome_trace(str(path))


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    out = {}
    for impl, foreach in (("for-loop", False), ("foreach", True)):
        out[impl] = folder / f"hf_llama_{impl}.json"
        _train_and_trace(out[impl], foreach)
    return out


def _expected(path) -> dict:
    """What the raw trace says, computed here without the package: each step runs from the end of the
    previous Optimizer.step range (the first from the first op) to the end of its own; the peak is the
    running sum of the [memory] events' bytes on the host."""
    events = json.loads(path.read_text())["traceEvents"]
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    updates = sorted((e for e in ops if e["name"] == "Optimizer.step#AdamW.step"), key=lambda e: e["ts"])
    ends = [e["ts"] + e["dur"] for e in updates]
    starts = [min(e["ts"] for e in ops), *ends[:-1]]
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    running = np.cumsum([e["args"]["Bytes"] for e in memory])
    return {
        "step_ms": float(np.mean(np.subtract(ends, starts))) / 1e3,
        "optimizer_ms": float(np.mean([e["dur"] for e in updates])) / 1e3,
        "peak_bytes": int(running.max()),
        "updates": len(updates),
    }


def test_the_cli_reports_steps_phases_and_peak_memory_the_trace_measured(traces, capsys):
    path = traces["for-loop"]
    want = _expected(path)
    assert want["updates"] == STEPS
    assert main(["analyze", str(path), "--json"]) == 0
    m = json.loads(capsys.readouterr().out)["metrics"]
    assert m["steps_measured"] == STEPS
    # Within a microsecond of the hand computation (Kineto writes microseconds with ns decimals).
    assert m["step_time_ms"] == pytest.approx(want["step_ms"], abs=1e-3)
    assert m["optimizer_ms"] == pytest.approx(want["optimizer_ms"], abs=1e-3)
    assert m["peak_memory_bytes"] == want["peak_bytes"]
    assert m["optimizer"] == "adamw (for-loop)" and m["attention_fused"] is True  # HF Llama uses SDPA
    assert m["forward_ms"] > 0 and m["backward_ms"] > 0
    assert m["forward_ms"] + m["backward_ms"] + m["optimizer_ms"] <= m["step_time_ms"] + 1e-9

    assert main(["analyze", str(path)]) == 0
    text = capsys.readouterr().out
    assert f"Step {m['step_time_ms']:.1f} ms (the traced steps' mean): forward {m['forward_ms']:.1f} ms" in text
    assert "a step ends where each Optimizer.step range ends; 3 steps" in text
    assert "Optimizer: adamw (for-loop)" in text
    assert f"Peak tensor memory while profiled: {want['peak_bytes'] / 2**20:.1f} MiB" in text


def test_the_optimizer_and_memory_rules_are_decided_from_the_trace(traces):
    loop, foreach = advise_trace(traces["for-loop"]), advise_trace(traces["foreach"])
    undecided = {e.rule.id for e in loop.not_applicable}
    fired = {r.rule.id for r in loop.recommendations}
    # The for-loop AdamW is flagged from the ops inside its Optimizer.step ranges; the foreach one not.
    assert "opt-unfused" in fired
    assert "opt-unfused" not in {e.rule.id for e in foreach.not_applicable} | {
        r.rule.id for r in foreach.recommendations
    }
    # Decided although memory_pct is unknown (a CPU trace names no capacity): the optimizer is not
    # foreach, and attention runs fused.
    for rule in ("opt-foreach-scratch", "mem-near-oom-flash-off", "kern-non-flash"):
        assert rule not in undecided and rule not in fired
    assert "mem-near-oom-activations" in undecided  # needs the estimate's activation share


@pytest.mark.parametrize(
    ("when", "ctx", "expect"),
    [
        ("x == 'foreach' and y > 85", {"x": "for-loop", "y": None}, False),
        ("x == 'foreach' and y > 85", {"x": "foreach", "y": None}, None),
        ("x == 'foreach' or y > 85", {"x": "foreach", "y": None}, True),
        ("x == 'foreach' or y > 85", {"x": "sgd", "y": None}, None),
        ("not (y > 85 and x == 'a')", {"x": "b", "y": None}, True),
        ("not f", {"f": None}, None),
        ("85 <= y <= 100 and x == 'a'", {"x": "b", "y": None}, False),
    ],
)
def test_a_condition_is_decided_where_its_known_fields_settle_it(when, ctx, expect):
    missing = {k for k, v in ctx.items() if v is None}
    assert _decided(ast.parse(when, mode="eval").body, ctx, missing) is expect


def _table(events: list[tuple[str, str, int, int, int]]):
    """An event table of host events (kind, name, start ns, duration ns, thread)."""
    kind, name, start, dur, tid = zip(*events, strict=True)
    return make_table(
        {
            "rank": 0,
            "kind": list(kind),
            "name": list(name),
            "start_ns": list(start),
            "dur_ns": list(dur),
            "tid": list(tid),
        },
        n=len(events),
    )


def test_a_users_repeated_top_level_range_is_the_step():
    # Two `record_function("train_step")` ranges, each around forward, backward (on the autograd
    # thread) and one optimizer update, with a data range first: hand-computed phases.
    events = []
    for k, t0 in enumerate((0, 1000)):
        events += [
            ("annotation", "train_step", t0, 900, 1),
            ("annotation", "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", t0 + 10, 40, 1),
            ("cpu_op", "aten::mm", t0 + 60, 200, 1),
            ("cpu_op", "autograd::engine::evaluate_function: MmBackward0", t0 + 300, 150, 2),
            ("cpu_op", "aten::mm", t0 + 310, 100, 2),  # nested in the backward node
            ("cpu_op", "autograd::engine::evaluate_function: AddBackward0", t0 + 460, 90 + 10 * k, 2),
            ("annotation", "Optimizer.step#SGD.step", t0 + 600, 250, 1),
        ]
    phases = inferred_phases(_table(events)).set_index("phase")
    assert set(phases["basis"]) == {"user range"}
    assert phases.loc["step", "mean_ns"] == 900 and phases.loc["step", "count"] == 2
    assert phases.loc["data", "mean_ns"] == 40
    assert phases.loc["forward", "mean_ns"] == 300 - 40  # step start to the first backward node, less data
    assert phases.loc["backward", "mean_ns"] == (250 + 260) / 2  # 300 -> 550, then 300 -> 560
    assert phases.loc["optimizer", "mean_ns"] == 250


def test_profiler_steps_keep_their_length_and_get_phases_inside():
    events = [
        ("annotation", "ProfilerStep#7", 0, 1000, 1),
        ("cpu_op", "aten::mm", 20, 300, 1),
        ("cpu_op", "autograd::engine::evaluate_function: MmBackward0", 400, 200, 1),
        ("annotation", "Optimizer.step#AdamW.step", 700, 100, 1),
        ("annotation", "Optimizer.zero_grad#AdamW.zero_grad", 850, 20, 1),
    ]
    phases = inferred_phases(_table(events)).set_index("phase")
    assert set(phases["basis"]) == {"profiler steps"}
    assert phases.loc["step", "mean_ns"] == 1000 and phases.loc["forward", "mean_ns"] == 400
    assert phases.loc["backward", "mean_ns"] == 200 and phases.loc["optimizer", "mean_ns"] == 100


def test_a_trace_without_optimizer_or_step_ranges_has_no_steps():
    events = [("cpu_op", "aten::mm", 0, 300, 1), ("cpu_op", "autograd::engine::evaluate_function: X", 400, 20, 1)]
    assert inferred_phases(_table(events)).empty
