"""The command line: readable output, --json, clear errors with exit status 2."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from advisor.cli import main

DATA = Path(__file__).parent / "data" / "hf"


def test_size_prints_a_readable_breakdown(capsys):
    code = main(
        ["size", "--model", "llama-3.1-8b", "--gpu", "h200", "--gpus", "8", "--tp", "2", "--zero", "1", "--seq", "8192"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "llama-3.1-8b (8.03B params) on 8 x H200 141GB; dp4 tp2" in out
    assert out.count("FITS") == 1 and "GiB per GPU" in out
    for row in ("weights", "gradients", "optimizer states", "activations", "TP communication", "Throughput:", "MFU"):
        assert row in out


def test_size_json_is_machine_readable(capsys):
    code = main(["size", "--model", "gpt2-124m", "--gpu", "a100-80gb", "--seq", "1024", "--micro-batch", "8", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["n_params"] == 124_439_808
    assert data["setup"]["train"]["micro_batch"] == 8
    assert data["fits"] is True
    parts = ("weights_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "buffers_bytes", "overhead_bytes")
    assert sum(data["memory"][k] for k in parts) == pytest.approx(data["memory"]["total_bytes"])
    # No --gpus: the app's 8 (advisor.spec.defaults), each data-parallel rank with its 8 x 1024 tokens.
    assert data["setup"]["parallel"]["dp"] == 8
    assert data["tokens_per_s"] == pytest.approx(8 * 8 * 1024 / (data["step_time_ms"] / 1e3))


def test_hf_config_flag(capsys):
    assert main(["size", "--hf-config", str(DATA / "qwen2-0.5b.json"), "--gpu", "l40s", "--seq", "2048", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["n_params"] == 494_032_768 and data["setup"]["model"]["name"] == "qwen2-0.5b"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tp", "3", "--gpus", "3"], "error: parallel.tp=3: model.n_heads=32 must be divisible by tp"),
        (["--tp", "16"], "error: gpus=8: must be a multiple of tp x pp x cp = 16"),
        (["--gpus", "8", "--dp", "2", "--tp", "2"], "error: gpus=8: dp(2) * tp(2) * pp(1) * cp(1) = 4 != gpus(8)"),
        (["--model", "gpt-9"], "error: model='gpt-9': unknown preset"),
        (["--hf-config", "/nonexistent/config.json"], "error: cannot read config file /nonexistent/config.json"),
        (["--precision", "fp8", "--gpu", "a100"], "error: train.precision='fp8': A100 SXM 80GB has no fp8"),
    ],
)
def test_bad_input_exits_2_with_the_reason(argv, message, capsys):
    assert main(["size", *argv]) == 2
    assert message in capsys.readouterr().err


def test_presets_lists_models_and_devices(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "llama-4-maverick" in out and "400,711,848,960" in out and "GH200 96GB" in out


def test_module_entry_point_runs():
    cmd = [sys.executable, "-m", "advisor", "size", "--model", "tiny", "--gpu", "cpu", "--seq", "256", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["n_params"] == 4_999_424


@pytest.mark.slow  # starts a child process or runs seconds of real steps
def test_profile_prints_the_run_id_and_directory(tmp_path, capsys):
    argv = ["profile", "--model", "tiny", "--device", "cpu", "--seq", "64", "--micro-batch", "1"]
    code = main([*argv, "--steps", "1", "--warmup", "0", "--traces", str(tmp_path), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["status"] == "ok"
    assert Path(out["run_dir"]) == tmp_path / out["run_id"]
    assert out["metrics"]["tokens_per_step"] == 64
    assert main(["runs", "--traces", str(tmp_path)]) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split() == ["run", "status", "dev", "step", "tokens/s", "message"]
    m = out["metrics"]
    assert row.split() == [out["run_id"], "ok", "cpu", f"{m['step_time_ms']:,.1f}", "ms", f"{m['tokens_per_s']:,.0f}"]


@pytest.mark.parametrize("flags, precision", [({"avx2"}, "fp32"), ({"avx2", "avx512f", "avx512_bf16"}, "bf16")])
def test_profile_defaults_to_the_devices_fast_precision(monkeypatch, tmp_path, flags, precision):
    # bf16 autocast ran the tiny step 23x slower than fp32 on an AVX2-only CPU (10.7 s against 0.47 s).
    from advisor.run import launcher as runner
    from advisor.spec import presets

    monkeypatch.setattr(presets, "cpu_flags", lambda: flags)
    seen = []

    def fake_run(setup, *args, **kwargs):
        seen.append(setup)
        raise _Stop

    monkeypatch.setattr(runner, "profile_run", fake_run)  # the CLI imports it when a step is run
    with pytest.raises(_Stop):
        main(["profile", "--model", "tiny", "--device", "cpu", "--traces", str(tmp_path)])
    with pytest.raises(_Stop):
        main(["profile", "--model", "tiny", "--device", "cpu", "--precision", "fp16", "--traces", str(tmp_path)])
    assert [s.train.precision for s in seen] == [precision, "fp16"]


class _Stop(Exception):
    """Raised in place of a profiled run: the test needs only the setup it was given."""


@pytest.mark.slow  # starts a child process or runs seconds of real steps
def test_profile_bad_input_and_failed_runs(tmp_path, capsys):
    assert main(["profile", "--model", "tiny", "--device", "cpu", "--steps", "0", "--traces", str(tmp_path)]) == 2
    assert "steps=0: must be an integer from 1 to 100" in capsys.readouterr().err
    argv = ["profile", "--model", "tiny", "--device", "cpu", "--seq", "64", "--steps", "1", "--warmup", "0"]
    assert main([*argv, "--traces", str(tmp_path), "--inject", "oom"]) == 1
    assert "oom - out of memory: injected" in capsys.readouterr().out


RUN = Path(__file__).resolve().parent.parent / "traces" / "20261130-165248-tiny-6bcb2f"


def test_ceilings_measure_store_show_and_feed_analyze(tmp_path, capsys):
    argv = ["ceilings", "--device", "cpu", "--dtypes", "fp32", "--matmul-n", "256", "--copy-mib", "16"]
    assert main([*argv, "--repeats", "1", "--traces", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "matmul fp32:" in out and "% of the datasheet's" in out and "stored in" in out
    assert main(["ceilings", "--show", "--json", "--traces", str(tmp_path)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["device_name"].startswith("CPU host") and shown["matmul_flops_per_s"]["fp32"] > 0
    stored = next((tmp_path / "ceilings").glob("*.json"))
    assert main(["analyze", str(RUN), "--ceilings-file", str(stored)]) == 0
    out = capsys.readouterr().out
    # The verdict follows the roofs this machine measured a moment ago, so a loaded machine (a low
    # matmul roof) reads another one: the point here is that the stored roofs are the ones used.
    assert re.search(r"Roofline verdict: (compute|memory|latency/launch|communication)-bound", out)
    assert f"roofs measured {shown['measured_utc']}" in out


def test_ceilings_errors_are_clear(tmp_path, capsys):
    assert main(["ceilings", "--show", "--device", "cpu", "--traces", str(tmp_path)]) == 2
    assert "no ceilings stored for CPU host" in capsys.readouterr().err
    assert main(["ceilings", "--device", "cpu", "--repeats", "0", "--traces", str(tmp_path)]) == 2
    assert "--repeats=0: must be an integer from 1 to 1000" in capsys.readouterr().err
    # Issue 22: a size whose buffers cannot exist is refused by name, before torch tries (4e18 bytes).
    assert main(["ceilings", "--device", "cpu", "--matmul-n", str(10**9), "--traces", str(tmp_path)]) == 2
    assert "--matmul-n=1000000000: must be an integer from 0 to 32768" in capsys.readouterr().err
    assert main(["analyze", str(RUN), "--ceilings-file", str(tmp_path / "none.json")]) == 2
    assert "ceilings file none.json cannot be read" in capsys.readouterr().err


def test_analyze_prints_the_roofline_against_a_chosen_gpu(capsys):
    assert main(["analyze", str(RUN), "--ceilings"]) == 0
    captured = capsys.readouterr()
    assert "Roofline verdict: compute-bound (compute 72.5 %, memory 17.9 %, latency 0.6 % of the step)" in captured.out
    # Stored ceilings are used where there are some; otherwise a note says the datasheet's are: one or the other.
    assert ("datasheet roofs used" in captured.err) != ("roofs measured" in captured.out)
    # --gpu judges the same trace against that device's datasheet instead of the one it ran on.
    assert main(["analyze", str(RUN), "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    assert "\n  roofs: H100 SXM 80GB; datasheet roofs\n" in out


def test_help_lists_the_user_commands_only(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert (
        "{size,export,profile,dryrun,analyze,export-trace,ceilings,runs,compare,diff,presets,plan,calibrate,advise,rules,verify}"
        in out
    )
    # The profiling child's command works but is not offered (no "_child", no "==SUPPRESS==" line).
    assert "_child" not in out and "SUPPRESS" not in out
    with pytest.raises(SystemExit) as exit_:
        main(["_child"])
    assert exit_.value.code == 2 and "--run-dir" in capsys.readouterr().err


# --- damaged stores and paths: one line on stderr, exit 2, never a traceback ----------------------------

NEWER = "20261130-165253-tiny-617152"  # the newer of the two shipped runs


@pytest.fixture
def damaged_store(tmp_path):
    """A copy of the shipped runs whose newer run's metrics.json is a JSON list, not a record."""
    root = tmp_path / "traces"
    shutil.copytree(RUN.parent, root)
    (root / NEWER / "metrics.json").write_text("[1, 2]")
    return root


def test_a_run_with_damaged_metrics_is_listed_damaged_and_refused_clearly(damaged_store, capsys):
    root = str(damaged_store)
    why = "metrics.json is a JSON list, not an object of StepMetrics fields"
    assert main(["runs", "--traces", root]) == 0
    lines = capsys.readouterr().out.splitlines()
    row = next(line for line in lines if line.startswith(NEWER))
    # The reason sits under the message column, where the runs' messages are.
    assert row.split(None, 2) == [NEWER, "DAMAGED", why] and row.index(why) == lines[0].index("message")
    for argv in (["advise", NEWER], ["verify", NEWER, "--no-baseline"], ["compare", RUN.name, NEWER]):
        assert main([*argv, "--traces", root]) == 2
        assert capsys.readouterr().err == f"error: run {NEWER} is damaged: {why}\n"
    assert main(["analyze", str(damaged_store / NEWER)]) == 2
    assert f"{damaged_store / NEWER / 'metrics.json'} is a JSON list" in capsys.readouterr().err
    # plan passes the damaged run over when it looks for a measured link.
    argv = ["plan", "--gpu", "cpu", "--model", "tiny", "--gpus", "2", "--seq", "64", "--global-batch", "4"]
    assert main([*argv, "--precision", "fp32", "--top", "1", "--traces", root]) == 0
    assert "measured communication: no distributed run" in capsys.readouterr().err


def test_analyze_of_a_folder_still_works_after_save(tmp_path, capsys):
    folder = tmp_path / "ranks"
    folder.mkdir()
    shutil.copy(RUN / "trace.json.gz", folder / "rank-0.json.gz")
    assert main(["analyze", str(folder), "--save"]) == 0
    saved = json.loads((folder / "analysis.json").read_text())
    assert saved["source"] == "trace" and saved["run_id"] == "ranks"
    capsys.readouterr()
    assert main(["analyze", str(folder), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["metrics"]["step_time_ms"] == saved["step_time_ms"]
    assert "note: left out analysis.json: written by analyze --save, not traces" in captured.err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["profile", "--device", "cpu", "--traces", "{file}"], "error: run store {file} is a file, not a folder"),
        (["ceilings", "--device", "cpu", "--traces", "{file}"], "error: --traces {file} is a file"),
        (["runs", "--traces", "{file}"], "error: --traces {file} is a file"),
        (["runs", "--traces", "{tmp}/none"], "error: --traces {tmp}/none: no such folder"),
        (["compare", RUN.name, NEWER, "--traces", "{tmp}/none"], "error: --traces {tmp}/none: no such folder"),
        (
            ["advise", "--model", "tiny", "--gpu", "cpu", "--markdown", "{tmp}/none/a.md"],
            "error: advise --markdown {tmp}/none/a.md: cannot write it (No such file or directory)",
        ),
        (
            ["advise", "--model", "tiny", "--gpu", "cpu", "--markdown", "{tmp}"],
            "error: advise --markdown {tmp}: cannot write it (Is a directory)",
        ),
        (["analyze", "{tmp}/none/trace.json"], "error: analyze {tmp}/none/trace.json: no such file or folder"),
        (["analyze", "/dev/null"], "error: analyze /dev/null: not a regular file or folder"),
        (["analyze", str(RUN), "--max-mb", "-1"], "error: --max-mb=-1: must be from 0 (excluded) to 1048576"),
        (["analyze", str(RUN), "--max-mb", "inf"], "error: --max-mb=inf: must be from 0 (excluded) to 1048576"),
        (
            ["analyze", str(RUN / "trace.json.gz"), "--max-mb", "0.1"],
            "error: trace.json.gz decompresses to over 0.1 MiB; refusing it (raise the limit: analyze --max-mb",
        ),
    ],
)
def test_paths_and_limits_that_cannot_be_used_are_one_line_errors(argv, message, tmp_path, capsys):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    fill = {"file": str(a_file), "tmp": str(tmp_path)}
    assert main([a.format(**fill) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message.format(**fill)) and err.count("\n") == 1


def test_unwritable_outputs_are_one_line_errors(tmp_path, capsys):
    trace = tmp_path / "trace.json.gz"
    shutil.copy(RUN / "trace.json.gz", trace)
    (tmp_path / "trace.json.gz.metrics.json").mkdir()  # where --save would write
    assert main(["analyze", str(trace), "--save"]) == 2
    assert capsys.readouterr().err.endswith(
        f"error: analyze --save: cannot write {trace}.metrics.json (Is a directory)\n"
    )
    # Any other file the command cannot write: the command, the path and the system's reason.
    (tmp_path / "ceilings").write_text("")  # where ceilings are stored
    argv = ["ceilings", "--device", "cpu", "--dtypes", "fp32", "--matmul-n", "64", "--copy-mib", "1"]
    assert main([*argv, "--repeats", "1", "--traces", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: ceilings: cannot use {tmp_path / 'ceilings'}: File exists\n"


def test_runs_refuses_an_unknown_status_and_plan_says_the_store_is_missing(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["runs", "--status", "bogus"])
    assert exit_.value.code == 2
    assert "invalid choice: 'bogus' (choose from 'running', 'ok', 'oom'" in capsys.readouterr().err
    argv = [
        "plan",
        "--gpu",
        "cpu",
        "--model",
        "tiny",
        "--gpus",
        "2",
        "--seq",
        "64",
        "--global-batch",
        "4",
        "--top",
        "1",
    ]
    assert main([*argv, "--traces", str(tmp_path / "none")]) == 0
    assert f"in {tmp_path / 'none'} (no such folder); using the datasheet link" in capsys.readouterr().err


def test_a_closed_pipe_ends_the_output_quietly():
    # `python -m advisor rules --fields | head -1`: the reader is gone before the output is written.
    read, write = os.pipe()
    os.close(read)
    cmd = [sys.executable, "-m", "advisor", "rules", "--fields"]
    proc = subprocess.run(cmd, stdout=write, stderr=subprocess.PIPE, text=True, timeout=120, check=False)
    os.close(write)
    assert proc.returncode == 1 and proc.stderr == ""


def test_dryrun_says_whether_the_step_fits_the_device(capsys):
    assert main(["dryrun", "--model", "tiny", "--gpu", "h100", "--seq", "64"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("FITS: ") and last.endswith("GiB of 79.6 GiB on the H100 SXM 80GB (1 %)")
    assert main(["dryrun", "--model", "tiny", "--gpu", "h100", "--seq", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["device"] == "H100 SXM 80GB" and out["device_bytes"] == 85_520_809_984 > out["total_bytes"]


def test_presets_show_a_small_moe_active_count(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "(0.00712B active)" in out and "(12.9B active)" in out  # not "(0.0B active)"


def test_setup_flags_beside_a_run_are_named_as_ignored(capsys):
    run = "20261130-165248-tiny-6bcb2f"  # a shipped sample run
    assert main(["advise", run, "--tp", "4", "--precision", "fp32"]) == 0
    err = capsys.readouterr().err
    assert "note: --precision, --tp ignored: a run or trace is advised on as it was recorded" in err
    assert main(["advise", run]) == 0 and "ignored" not in capsys.readouterr().err


def test_size_and_plan_default_to_a_sequence_the_model_can_take(capsys):
    # GPT-2 has 1024 learned positions: the 4096 default would only be refused.
    assert main(["size", "--model", "gpt2-124m", "--gpu", "a100-40gb", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["setup"]["train"]["seq_len"] == 1024
    assert main(["plan", "--model", "gpt2-124m", "--gpu", "a100-40gb", "--gpus", "8", "--global-batch", "64"]) == 0
    assert "gpt2-124m on 8 x A100 SXM 40GB, sequence 1,024" in capsys.readouterr().out
    # Adafactor has no fused kernel: its default is foreach.
    assert main(["size", "--model", "llama-3.2-1b", "--optimizer", "adafactor", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["setup"]["train"]["optimizer_impl"] == "foreach"


def test_estimating_and_analyzing_commands_import_no_torch():
    # Users run the command: `size` answers in milliseconds, so importing torch (1.2-9.6 s) would be its
    # whole cost (bench/results/cli_startup.md: 1.30 s before, 0.09 s after).
    root = RUN.parent.parent
    commands = [
        ["size", "--model", "llama-3.1-8b", "--gpu", "h100", "--json"],
        ["plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--gpus", "8", "--global-batch", "64"],
        ["export", "--to", "megatron", "--model", "llama-3.1-8b", "--gpu", "h100"],
        ["advise", "--model", "llama-3.1-8b", "--gpu", "h100"],
        ["analyze", str(RUN), "--json"],
        ["rules"],
    ]
    code = (
        "import contextlib, io, json, sys\n"
        "from advisor.cli import main\n"
        "out = []\n"
        f"for argv in {commands!r}:\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "        rc = main(argv)\n"
        "    out.append((argv[0], rc, 'torch' in sys.modules))\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert results == [[argv[0], 0, False] for argv in commands]


def test_analyze_as_the_program_reuses_freed_memory_and_a_caller_keeps_its_malloc(monkeypatch, capsys):
    """Only the program (no argv: ``python -m advisor``, the script) is a process of its own that
    exits after the analysis; main(["analyze", ...]) from a caller (these tests) leaves its process's
    allocator as it is."""
    from advisor.analysis import summary

    calls = []
    monkeypatch.setattr(summary, "reuse_freed_memory", lambda: calls.append("reuse") or True)
    monkeypatch.setattr(summary, "use_small_pages", lambda: calls.append("small") or True)
    monkeypatch.setattr(summary, "share_one_heap", lambda: calls.append("heap") or True)
    assert main(["analyze", str(RUN)]) == 0 and calls == []
    monkeypatch.setattr(sys, "argv", ["advisor", "analyze", str(RUN)])
    # One heap, small pages and reuse, before the load.
    assert main() == 0 and calls == ["heap", "small", "reuse"]
    capsys.readouterr()


def test_analyze_and_export_trace_take_a_run_id_of_the_store(tmp_path, capsys):
    # As diff and advise do: a run id names a run of --traces (a user review found them path-only).
    store = tmp_path / "store"
    store.mkdir()
    shutil.copytree(RUN, store / RUN.name)
    assert main(["analyze", RUN.name, "--traces", str(store)]) == 0
    assert capsys.readouterr().out.startswith(f"{RUN.name}: 1 rank(s), cpu\n")
    out = tmp_path / "t.json.gz"
    assert main(["export-trace", RUN.name, "--traces", str(store), "-o", str(out)]) == 0
    assert out.stat().st_size > 0 and capsys.readouterr().out.startswith(f"wrote {out} (")
    assert main(["analyze", "20261130-000000-tiny-000000", "--traces", str(store)]) == 2
    assert f"not a run in {store} nor a trace file or folder" in capsys.readouterr().err


def test_calibrate_asks_to_sweep_into_the_store_it_read(tmp_path, capsys):
    assert main(["calibrate", "--traces", str(tmp_path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f"Run `python -m advisor calibrate --sweep --traces {tmp_path}` (about 36 short profiled steps)" in err


def test_help_says_the_defaults_each_command_takes(capsys):
    # profile's precision defaults to the device's fastest (it printed "default: None"); size's to bf16.
    for argv, said in (
        (["profile", "--help"], "default: this device's fastest"),
        (["size", "--help"], "default: bf16"),
    ):
        with pytest.raises(SystemExit):
            main(argv)
        assert said in " ".join(capsys.readouterr().out.split())


def test_ceilings_say_which_precisions_they_skip_and_why(tmp_path, capsys, monkeypatch):
    import advisor.spec.presets as presets

    monkeypatch.setattr(presets, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})  # no fp16 unit
    argv = ["ceilings", "--device", "cpu", "--matmul-n", "128", "--copy-mib", "4", "--repeats", "1"]
    assert main([*argv, "--traces", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "  not measured: fp16: this CPU has neither AVX512_FP16 nor AMX_FP16, and PyTorch's fallback" in out
    assert "matmul fp32:" in out and "matmul bf16:" in out and "matmul fp16:" not in out
    # Asking only for what cannot be measured says why, instead of an empty-table error.
    assert main([*argv, "--dtypes", "fp16", "--traces", str(tmp_path)]) == 2
    assert "error: no precision asked for has a fast matmul to measure here: fp16: this CPU" in capsys.readouterr().err
