"""Hostile input (issue 22): a seeded fuzz of the CLI and of the app's handlers, and the NaN that once
broke every plan replayed. Each case ends in a result or a message that names its field: no traceback,
no "Internal error", no hang (each case runs under an alarm)."""

import contextlib
import io
import json
import logging
import math
import random
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from advisor.cli import main
from advisor.spec.defaults import DEFAULTS
from advisor.store.runstore import RunStore, new_run_id, write_json_atomic

REPO = Path(__file__).resolve().parents[1]
CASE_LIMIT_S = 20  # an alarm per case: far above any case's time here (the slowest, a dry run, ~6 s)
HUGE = "1" + "0" * 400
VALUES = ["0", "-1", "1", "3", "1000", str(2**63), str(10**18), HUGE, "nan", "inf", "1e999", "abc", "", "[1]"]
VALUES += ["2.5", "/etc/passwd", "/dev/zero", "0x10", " 8 "]
SETUP_FLAGS = ["--gpus", "--seq", "--micro-batch", "--global-batch", "--tp", "--pp", "--vpp", "--cp", "--ep"]
SETUP_FLAGS += ["--zero", "--dp", "--recompute-layers", "--offload-activations", "--rope-scaling", "--model", "--gpu"]
SETUP_FLAGS += ["--hf-config", "--precision", "--recompute"]
PLAN_FLAGS = ["--gpus", "--seq", "--global-batch", "--top", "--max-memory-pct", "--model", "--gpu", "--precision"]
PLAN_FLAGS += ["--hf-config", "--time-budget"]
PLAN_BASE = ["plan", "--model", "tiny", "--gpus", "8", "--seq", "256", "--global-batch", "64", "--measured-comm", "off"]
# Words a rejection may name its flag by: the flag, its field, or what the field is called in the spec.
FIELD_WORDS = {
    "--seq": ["seq_len"],
    "--max-memory-pct": ["max_memory_frac"],
    "--time-budget": ["time_budget_s"],
    "--gpu": ["device"],
    "--hf-config": ["config"],
    "--gpus": ["parallel."],
    "--precision": ["precisions"],
}


class _Hang(Exception):
    pass


def _raise_hang(*_):
    raise _Hang


def _run_cli(argv: list[str]) -> tuple[object, str]:
    """(exit status or 'hang', stderr) of ``main(argv)`` in this process, stdout discarded."""
    err = io.StringIO()
    previous = signal.signal(signal.SIGALRM, _raise_hang)
    signal.alarm(CASE_LIMIT_S)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exit_:  # argparse's own refusals
                code = exit_.code
    except _Hang:
        code = "hang"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return code, err.getvalue()


def _cli_cases(seed: int, n: int) -> list[tuple[str, list[str]]]:
    """(the fuzzed flag, argv): setup commands, the planner, and store/trace commands given junk."""
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        kind, value = rng.random(), rng.choice(VALUES)
        if kind < 0.45:
            flag = rng.choice(SETUP_FLAGS)
            cases.append((flag, [rng.choice(["size", "advise"]), flag, value]))
        elif kind < 0.85:
            flag = rng.choice(PLAN_FLAGS)
            cases.append((flag, [*PLAN_BASE, flag, value]))
        else:
            argv = rng.choice([["runs", "--traces"], ["compare", "x", "--traces"], ["analyze"], ["advise"]])
            cases.append(("", [*argv, value]))
    return cases


def _names_its_field(flag: str, stderr: str) -> bool:
    words = [flag, flag[2:], flag[2:].replace("-", "_"), *FIELD_WORDS.get(flag, [])]
    return any(w in stderr for w in words)


def test_cli_fuzz_every_case_ends_in_a_result_or_a_message_naming_its_field(tmp_path, monkeypatch):
    """240 seeded cases (about 15 s here): exit 0, 1 (plan: nothing fits) or 2 (refused) in each."""
    monkeypatch.setenv("ADVISOR_TRACES_DIR", str(tmp_path / "traces"))
    results = [(flag, argv, *_run_cli(argv)) for flag, argv in _cli_cases(seed=22, n=240)]
    failures = [(argv, code, err[-300:]) for _, argv, code, err in results if code not in (0, 1, 2)]
    assert failures == []
    assert [argv for _, argv, _, err in results if "Traceback" in err] == []
    refusals = [(flag, argv, err) for flag, argv, code, err in results if code == 2 and flag]
    assert [(argv, err[-300:]) for flag, argv, err in refusals if not _names_its_field(flag, err)] == []
    # The fuzz reached both outcomes, and the bounds refused the extreme values by name.
    codes = [code for *_, code, _ in results]
    assert codes.count(0) >= 20 and codes.count(2) >= 100
    assert {flag for flag, _, _ in refusals} >= {*SETUP_FLAGS, *PLAN_FLAGS} - {"--recompute"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # Each once never returned, or died in a traceback (issue 22's audit).
        (["plan", "--gpus", str(10**18), "--global-batch", "8"], "gpus=1000000000000000000: must be an integer"),
        (["plan", "--gpus", "8", "--global-batch", str(2**63)], "global_batch=9223372036854775808: must be"),
        (["size", "--gpus", HUGE], "gpus=10000000000000000000...(401 digits): must be an integer from 1 to 1048576"),
        (["dryrun", "--model", "tiny", "--micro-batch", str(10**18)], "train.micro_batch=1000000000000000000"),
        (["dryrun", "--model", "tiny", "--global-batch", "2048"], "at most 64, a global batch up to 512 here"),
        (["size", "--hf-config", "/dev/zero"], "config file zero is over 1 MiB"),
    ],
)
def test_extreme_values_are_refused_by_name_in_process(argv, message):
    code, err = _run_cli([*argv, "--measured-comm", "off"] if argv[0] == "plan" else argv)
    assert code == 2 and message in err and "Traceback" not in err, err


@pytest.mark.slow  # starts child processes
def test_extreme_values_are_refused_by_a_real_cli_process(tmp_path, monkeypatch):
    monkeypatch.setenv("ADVISOR_TRACES_DIR", str(tmp_path))
    for argv, words in (
        (["plan", "--gpus", str(2**63), "--global-batch", "8"], "gpus=9223372036854775808"),
        (["size", "--micro-batch", HUGE], "train.micro_batch=10000000000000000000...(401 digits)"),
        (["plan", "--gpus", "8", "--global-batch", str(10**18)], "global_batch=1000000000000000000"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "advisor", *argv],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


# --- the app's handlers ---------------------------------------------------------------------------

HOSTILE = [None, math.nan, math.inf, "nan", "inf", "1e999", [], [1, 2], {}, {"a": 1}, "8", "abc", "", 10**18]
HOSTILE += [2**63, 10**400, -1, 0, 2.5, True, "/etc/passwd", "/nonexistent/x.json", "../../etc/passwd", "1" * 5000]
# Size tab inputs and the words a rejection of each may use (the spec's field names).
SIZE_WORDS = {"seq": "seq_len", "config_file": "config", "gpu": "gpu", "model": "model"}


def _first_line(out) -> str:
    return (out[0] if isinstance(out, tuple) else out).split("\n", 2)[:2]


def test_handler_fuzz_has_no_internal_error_and_logs_one_line_per_rejection(tmp_path, monkeypatch, caplog):
    """300 seeded calls of the Size, Plan, History, Compare, Open-run and Advice handlers, as an API
    client may make them (numbers as text, NaN, lists, dicts, paths never uploaded): each a result or
    a message; a Size or Plan rejection names the field it refused."""
    pytest.importorskip("gradio")
    from webui import advice, common, history, plan, profile, size

    store = RunStore(tmp_path)
    monkeypatch.setattr(common, "store", lambda: store)
    rng = random.Random(22)
    size_base = {**DEFAULTS, "config_file": None, "model": "tiny", "seq": 256}
    plan_base = {"model": "tiny", "gpu": "h100", "gpus": 8, "seq": 256, "global_batch": 64, "precisions": ["bf16"]}
    plan_base |= {"offload": True, "measured_comm": True}
    outcomes = []
    caplog.set_level(logging.WARNING, logger="advisor.app")
    for _ in range(300):
        which, value = rng.choice(["size", "size", "plan", "plan", "history", "compare", "open", "advise"]), None
        value = rng.choice(HOSTILE)
        if which == "size":
            field = rng.choice(size.SIZE_KEYS)
            out = size.size_view(*({**size_base, field: value}[k] for k in size.SIZE_KEYS))
        elif which == "plan":
            field = rng.choice(["model", "gpu", "gpus", "seq", "global_batch", "precisions"])
            out = plan.plan_view(*{**plan_base, field: value}.values())
        elif which == "history":
            field = rng.choice(["model", "status", "device", "text"])
            out = history.history_view(**{"model": None, "status": None, "device": None, "text": None, field: value})
        elif which == "compare":
            field, out = "run", history.compare_view(value, rng.choice(HOSTILE))
        elif which == "open":
            field, out = "run", profile.open_run(value)
        else:
            field = rng.choice(["source", "run_id", "upload"])
            a = {"source": "Size tab setup", "run_id": None, "upload": None, field: value}
            out = advice.advice_view(a["source"], a["run_id"], a["upload"], *(size_base[k] for k in size.SIZE_KEYS))
        outcomes.append((which, field, value, _first_line(out)))
    assert [o for o in outcomes if "Internal error" in o[3][0]] == []
    rejected = [o for o in outcomes if o[3][0].startswith("### ") and o[3][0] != "### ✅ FITS"]
    rejected = [o for o in rejected if o[0] in ("size", "plan") and not o[3][0].startswith("### ✅")]
    unnamed = [
        o
        for o in rejected
        if o[3][0].startswith(("### Invalid setup", "### Cannot plan"))
        and SIZE_WORDS.get(o[1], o[1]).split("_")[0] not in o[3][1]
    ]
    assert unnamed == []
    assert len(rejected) >= 60  # most hostile values are refused; a few ("8", 2.5 as micro-batch...) pass or fit
    assert all(r.exc_info is None for r in caplog.records)  # no traceback logged
    assert sum("rejected:" in r.getMessage() for r in caplog.records) >= len(rejected)


# --- one NaN in the store -------------------------------------------------------------------------


def _stored_run(store: RunStore, **metrics) -> str:
    run_id = new_run_id("tiny")
    d = store.staging_dir(run_id)
    write_json_atomic(d / "run.json", {"run_id": run_id, "status": "ok"})
    m = {"run_id": run_id, "source": "profile", "model_name": "tiny", "device_type": "cpu", **metrics}
    (d / "metrics.json").write_text(json.dumps(m))  # NaN as Python writes it, and reads it back
    store.commit(run_id)
    return run_id


def test_a_nan_world_size_is_a_damaged_run_and_every_plan_still_answers(tmp_path, monkeypatch, capsys):
    """Issue 22: ``"world_size": NaN`` in one stored metrics.json was listed ok, then every plan with
    measured communication (the default) answered "Internal error" (10 of 10 concurrent plans)."""
    store = RunStore(tmp_path)
    good = _stored_run(store, world_size=1, step_time_ms=12.5)
    bad = _stored_run(store, world_size=math.nan)
    runs, damaged = store.list_runs()
    assert [r.run_id for r in runs] == [good]
    assert damaged == [(bad, "metrics.json has world_size=nan: expected an integer or null")]
    argv = ["plan", "--model", "tiny", "--gpu", "cpu", "--gpus", "2", "--seq", "64", "--global-batch", "4"]
    assert main([*argv, "--precision", "fp32", "--traces", str(tmp_path)]) == 0
    assert "measured communication: no distributed run of CPU host" in capsys.readouterr().err
    pytest.importorskip("gradio")
    from webui import common, plan

    monkeypatch.setattr(common, "store", lambda: store)
    args = ("tiny", "cpu", 2, 64, 4, ["fp32"], False, True)  # measured_comm on
    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(lambda _: plan.plan_view(*args), range(10)))
    assert all(a[0].startswith("### ") and "Internal error" not in a[0] and len(a[1]) > 0 for a in answers)
