"""Rules: every rule's own fixtures (fires / stays silent), load-time checks, safe evaluation."""

from __future__ import annotations

from pathlib import Path

import pytest

from advisor.advice import rules as R

RULES = R.load_rules()


def test_at_least_30_rules_with_unique_ids_and_every_group_used():
    assert len(RULES) >= 30
    assert {r.group for r in RULES} == set(R.GROUPS)
    assert len({r.id for r in RULES}) == len(RULES)


@pytest.mark.parametrize("rule", RULES, ids=[r.id for r in RULES])
def test_rule_fixture_fires_and_silent_stays_silent(rule: R.Rule):
    for kind, expect in (("fires", True), ("silent", False)):
        example = rule.examples[kind]
        # A fixture must give every field the condition reads: silence for want of input proves nothing.
        assert rule.names <= set(example), f"{rule.id} {kind} lacks {sorted(rule.names - set(example))}"
        ctx = dict.fromkeys(R.FIELDS) | example
        ev = R.evaluate(rule, ctx)
        assert ev.missing == ()
        assert ev.fired is expect, f"{rule.id}: {kind} example evaluated to {ev.fired}"
        if expect:
            assert "?" not in ev.message, f"{rule.id}: message has an unfilled field: {ev.message}"
            assert "{" not in ev.message


def test_why_texts_have_no_placeholders():
    assert len(RULES) >= 20
    for r in RULES:
        assert "{" not in r.why, r.id


def test_messages_print_missing_values_as_a_question_mark():
    rule = next(r for r in RULES if r.id == "mem-near-oom-flash-off")
    ctx = dict.fromkeys(R.FIELDS) | {"memory_pct": 93.0, "train_flash_attention": False, "train_seq_len": 4096}
    assert R.evaluate(rule, ctx).message == (
        "Peak memory is 93 % of the ? GiB capacity with attention unfused at sequence length 4096."
    )


def test_deeply_nested_conditions_fail_at_load():
    # Python's parser refuses ~200 levels itself; the length cap stops longer inputs before parsing.
    with pytest.raises(R.RuleError, match=r"cannot parse|nested too deeply"):
        R.expression_names("(" * 900 + "1" + ")" * 900, "x")
    with pytest.raises(R.RuleError, match=r"is 10001 characters long \(at most 2000\)"):
        R.expression_names("(" * 5000 + "1" + ")" * 5000, "x")


def test_missing_input_makes_a_rule_not_applicable():
    rule = next(r for r in RULES if r.id == "input-dataloader-stall")
    ev = R.evaluate(rule, dict.fromkeys(R.FIELDS) | {"data_pct": 40.0})
    assert not ev.fired and ev.missing == ("num_workers",)


def _write(tmp_path: Path, text: str, group: str = "memory") -> Path:
    (tmp_path / f"{group}.yaml").write_text(text, encoding="utf-8")
    return tmp_path


GOOD = """
- id: x
  title: t
  severity: info
  when: "{when}"
  why: w
  message: "m {{memory_pct}}"
  action: {{describe: d}}
  gain: whatif
  target: step_time_ms
  examples:
    fires: {{memory_pct: 50}}
    silent: {{memory_pct: 5}}
"""


@pytest.mark.parametrize(
    "when, expected",
    [
        ("memory_pct > 10 and bogus_field < 3", "unknown name 'bogus_field'"),
        ("memry_pct > 10", "did you mean memory_pct"),
        ("memory_pct.__class__", "Attribute is not allowed"),
        ("__import__('os').system('true')", r"only min\(\), max\(\) and abs\(\) may be called"),
        ("[x for x in (1, 2)]", "ListComp is not allowed"),
        ("memory_pct >", "cannot parse"),
        ("lambda: 1", "Lambda is not allowed"),
    ],
)
def test_bad_conditions_fail_at_load_time(tmp_path, when, expected):
    with pytest.raises(R.RuleError, match=expected) as err:
        R.load_rules(_write(tmp_path, GOOD.format(when=when)))
    assert "memory.yaml rule 'x'" in str(err.value)


def test_a_good_rule_file_loads(tmp_path):
    (rule,) = R.load_rules(_write(tmp_path, GOOD.format(when="memory_pct > 10")))
    assert rule.names == {"memory_pct"}
    assert R.evaluate(rule, dict.fromkeys(R.FIELDS) | {"memory_pct": 50.0}).message == "m 50.0"


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda t: t.replace("severity: info", "severity: urgent"), "severity 'urgent' not in"),
        (lambda t: t.replace("gain: whatif", "gain: magic"), "gain 'magic' is not registered"),
        (lambda t: t.replace("target: step_time_ms", "target: joy"), "target 'joy' not in"),
        (lambda t: t.replace("m {memory_pct}", "m {nope}"), "placeholder {nope} is not a known field"),
        (lambda t: t.replace("m {memory_pct}", "m {memory_pct.real}"), "placeholder"),
        (lambda t: t.replace("m {memory_pct}", "m {memory_pct:{hw_name}}"), "has format"),
        (lambda t: t.replace("m {memory_pct}", "m {memory_pct:>100000000}"), "has format"),
        (lambda t: t.replace("m {memory_pct}", "m {memory_pct!r}"), "has format"),
        (
            lambda t: t.replace("{describe: d}", "{describe: d, set: {train.colour: red}}"),
            "train has no field 'colour'",
        ),
        (lambda t: t.replace("{describe: d}", "{describe: d, set: {os.system: x}}"), "must start with train."),
        (lambda t: t.replace("{describe: d}", "{describe: d, compute: {train.seq_len: 'open(1)'}}"), r"only min\(\)"),
        (lambda t: t.replace("    silent: {memory_pct: 5}\n", ""), "needs examples"),
        (lambda t: t.replace("  title: t\n", ""), "missing keys \\['title'\\]"),
        (lambda t: t + t, "duplicate id"),
        (lambda t: "{not: a list}", "must be a list of rules"),
        (lambda t: "- id: [unclosed", "not valid YAML"),
    ],
)
def test_bad_rule_files_fail_with_the_reason(tmp_path, mutate, expected):
    with pytest.raises(R.RuleError, match=expected):
        R.load_rules(_write(tmp_path, mutate(GOOD.format(when="memory_pct > 10"))))


def test_unknown_group_and_empty_folder(tmp_path):
    with pytest.raises(R.RuleError, match="no rule files"):
        R.load_rules(tmp_path)
    with pytest.raises(R.RuleError, match="unknown group 'misc'"):
        R.load_rules(_write(tmp_path, GOOD.format(when="memory_pct > 10"), group="misc"))


def test_power_and_comprehensions_are_refused():
    # No ** (a condition could otherwise build enormous numbers) and no comprehensions.
    with pytest.raises(R.RuleError, match="Pow is not allowed"):
        R.expression_names("memory_pct ** 99999", "x")
    with pytest.raises(R.RuleError, match="GeneratorExp is not allowed"):
        R.expression_names("max(x for x in (1, 2))", "x")


def test_a_condition_that_fails_on_its_input_names_the_rule():
    rule = next(r for r in RULES if r.id == "par-tp-across-nodes")
    ctx = dict.fromkeys(R.FIELDS) | {"par_tp": 16, "hw_tp_max": "eight", "hw_gpus_per_node": 8, "gpus": 16, "par_pp": 1}
    with pytest.raises(R.AdvisorError, match="rule par-tp-across-nodes: condition"):
        R.evaluate(rule, ctx)
