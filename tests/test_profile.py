"""The profiled step end to end on the CPU: child process, run store, step options, failure paths."""

import functools
import gzip
import json
import os
import platform
import signal
import statistics
from pathlib import Path

import pytest
import torch

from advisor.errors import AdvisorError
from advisor.run.child import RunOptions, median_step_phases, median_steps, run_profile, typical_step_ms
from advisor.run.launcher import on_this_machine, profile_run
from advisor.run.memprobe import measure_step_peak_bytes
from advisor.run.step import _Clock, build_trainer, make_loader
from advisor.spec.setup import make_setup
from advisor.store.runstore import RunStore

CPU = torch.device("cpu")
CPU_TRACE_DIR = Path(__file__).resolve().parents[1] / "traces" / "20261130-165248-tiny-6bcb2f"


def _setup(**kw):
    values = {"model": "tiny", "gpu": "cpu", "seq": 64, "micro_batch": 1, **kw}
    return make_setup(**values)


def _trace_events(run_dir):
    with gzip.open(run_dir / "trace.json.gz", "rt") as f:
        return json.load(f)["traceEvents"]


@pytest.mark.slow  # starts a child process
def test_a_childs_peak_rss_is_its_own_not_its_parents():
    # getrusage's ru_maxrss survives fork and exec on Linux: a child of a 2.4 GB test runner read 2.4 GB.
    # The child reads its own image's high-water mark: here a parent holding 512 MiB more than it.
    import subprocess
    import sys

    ballast = bytearray(512 * 2**20)
    ballast[:: 2**12] = b"\x01" * (len(ballast) // 2**12)  # every page touched: resident
    code = "from advisor.run.child import peak_rss_bytes; print(peak_rss_bytes())"
    child = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 2**20 < child < len(ballast)  # importing torch takes about 300 MiB; the parent held more


@pytest.mark.slow  # starts a child process
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the child keeps freed memory through glibc's mallopt")
def test_the_profiled_steps_take_no_fresh_pages_the_timed_steps_do_not(tmp_path):
    """The profiler pins a small object for every tensor its records name (its TensorImpl) until it
    stops; on a CPU those split the heap's freed blocks, so the first profiled steps took fresh pages
    for their tensors. Measured on our EPYC VM for this step: 213-295 K page faults a
    profiled step against 0-2 a timed one, the profiled step 1.6-6x the timed one, with the profile's
    memory-bound ops read at 2-3x. The CPU child rehearses the profiled steps first; after it the
    profiled steps took 0-2 faults. A fresh page is 4 KiB: 1,000 faults are 4 MiB, where one step
    moves over 1 GiB through its tensors."""
    setup = _setup(seq=1024, micro_batch=2, precision="bf16", flash_attention=False)
    run = profile_run(setup, RunOptions(device="cpu", steps=5), RunStore(tmp_path))
    assert run.status == "ok", run.record["message"]
    m = run.metrics()
    assert m["profiler_rehearsal_steps"] == 5
    assert m["page_faults_per_step"] < 1_000
    assert m["profiled_page_faults_per_step"] < 1_000


@pytest.mark.slow  # starts a child process and sleeps through 11 batch loads of 0.8 s
def test_the_timed_steps_wait_for_a_loader_that_cannot_keep_up(tmp_path):
    """One worker loading 8 samples of 100 ms (0.8 s a batch) against a step that computes in tens of
    ms: a long run waits for every batch. The worker loads up to two batches ahead while the untimed
    steps run; the child takes those off before its timed steps, so each timed step waits for its
    batch. The sleeps make 0.8 s a floor on any machine, however loaded; without the drain the first
    timed steps took the batches loaded ahead in the compute's time (the few-workers scenario of
    bench/advice_scenarios.py timed 132 ms against 344 ms for its slowest step)."""
    setup = _setup(seq=32, micro_batch=8, precision="fp32")
    run = profile_run(setup, RunOptions(device="cpu", steps=3, num_workers=1, data_delay_ms=100.0), RunStore(tmp_path))
    assert run.status == "ok", run.record["message"]
    m = run.metrics()
    assert m["step_time_min_ms"] >= 0.75 * 800 and m["data_ms"] >= 0.5 * 800


def test_environment_records_the_cpu_features_behind_its_peaks(monkeypatch):
    # A CPU host is named by its core count only; its bf16 peak depends on AVX512-BF16 or AMX (3.5x and
    # 16x fp32 in cpu_host()), so the run records which of them the machine had, and its model name.
    from advisor.run import child

    flags = {"fpu", "sse2", "avx2", "avx512f", "avx512_bf16", "sha_ni"}
    monkeypatch.setattr(child, "cpu_flags", lambda: flags)
    monkeypatch.setattr(child, "cpu_model", lambda: "AMD EPYC 9R14")
    env = child.environment()
    assert (env["cpu_model"], env["cpu_matrix_flags"]) == ("AMD EPYC 9R14", ["avx2", "avx512_bf16", "avx512f"])
    monkeypatch.setattr(child, "cpu_flags", set)
    assert child.environment()["cpu_matrix_flags"] == []


@pytest.mark.slow  # starts a child process or runs seconds of real steps
def test_profiled_run_through_the_child_is_complete(tmp_path):
    store = RunStore(tmp_path)
    progress = []
    run = profile_run(
        _setup(global_batch=2),
        RunOptions(device="cpu", steps=2, warmup=0),
        store,
        on_progress=lambda d, t, m: progress.append((d, t)),
    )
    assert run.status == "ok", run.record["message"]
    assert {"run.json", "metrics.json", "trace.json.gz", "nvml.json", "environment.json", "log.txt"} <= set(
        run.record["files"]
    )
    assert progress[-1] == (7, 7)  # 1 warm-up + 2 rehearsal + 2 timed + 0 profiler warm-up + 2 profiled
    m = run.metrics()
    assert m["profiler_rehearsal_steps"] == 2
    assert (m["tokens_per_step"], m["grad_accum"], m["steps_measured"]) == (128, 2, 2)
    assert m["n_params"] == 4_999_424 and m["device_type"] == "cpu"
    assert m["step_time_ms"] > 0 and m["forward_ms"] > 0 and m["backward_ms"] > 0 and m["optimizer_ms"] > 0
    assert m["data_ms"] + m["forward_ms"] + m["backward_ms"] + m["optimizer_ms"] <= m["step_time_ms"] * 1.001
    # fp32 AdamW state alone is 16 bytes per parameter; the estimate stays within 20 % of what was measured.
    assert m["peak_memory_bytes"] > 16 * 4_999_424
    assert m["estimate_peak_memory_bytes"] == pytest.approx(m["peak_memory_bytes"], rel=0.2)
    # The process's host footprint is recorded, and the preflight's figure for one process covers it
    # (543 MiB measured on the 2-core dev machine against 768 MiB).
    from advisor.run.launcher import PROCESS_HOST_BYTES

    assert m["peak_memory_bytes"] < m["host_peak_rss_bytes"] <= PROCESS_HOST_BYTES
    assert m["nvml"]["nvml_available"] is False and "CPU" in m["nvml"]["nvml_reason"]
    assert run.record["environment"]["torch"] == torch.__version__
    # The commands filed to repeat the run (plain and under nsys) file into the same store.
    assert run.record["command"].endswith(f" --traces {tmp_path}")
    assert run.record["nsys_command"].endswith(f" --traces {tmp_path}")
    from advisor.spec.presets import CPU_MATRIX_FLAGS, cpu_flags

    assert run.record["environment"]["cpu_matrix_flags"] == sorted(CPU_MATRIX_FLAGS & cpu_flags())
    # The child keeps the memory its steps free (glibc's mallopt), so its steps reuse warm pages.
    assert run.record["environment"]["freed_memory_kept"] is (platform.libc_ver()[0] == "glibc")
    # The run's own trace is analysed into the same metrics: top ops by self time, one rank.
    assert m["n_ranks"] == 1 and m["top_ops"] and all(op["name"].startswith("aten::") for op in m["top_ops"][:3])
    assert "--capture-range=cudaProfilerApi" in run.record["nsys_command"]
    names = {e["name"] for e in _trace_events(run.path) if e.get("cat") == "user_annotation"}
    assert {"step", "data", "forward", "backward", "optimizer"} <= names
    runs, damaged = store.list_runs()
    assert [r.run_id for r in runs] == [run.run_id] and damaged == []


@pytest.mark.slow  # starts a child process or runs seconds of real steps
def test_checkpointing_lowers_measured_peak_memory():
    peaks = {}
    for mode in ("none", "selective", "full"):
        setup = on_this_machine(_setup(seq=256, micro_batch=4, precision="fp32", recompute=mode), "cpu")
        trainer = build_trainer(setup, CPU)
        peaks[mode] = measure_step_peak_bytes(trainer, iter(make_loader(setup, 3, 0, False, 0)))
    # Flash-style SDPA on the CPU keeps no s x s scores, so selective saves little; full saves most.
    assert peaks["full"] < 0.8 * peaks["none"]
    assert peaks["selective"] <= peaks["none"]


@pytest.mark.slow  # starts a child process or runs seconds of real steps
def test_bf16_autocast_puts_bf16_matmuls_in_the_trace(tmp_path):
    dtypes = {}
    for precision in ("fp32", "bf16"):
        run_dir = tmp_path / precision
        run_dir.mkdir()
        setup = on_this_machine(_setup(precision=precision), "cpu")
        run_profile(setup, RunOptions(device="cpu", steps=1, warmup=0), run_dir, "20260101-000000-tiny-abcdef")
        mm = [e for e in _trace_events(run_dir) if e.get("name") in ("aten::mm", "aten::addmm", "aten::linear")]
        dtypes[precision] = {t for e in mm for t in e.get("args", {}).get("Input type", []) if t}
    assert "c10::BFloat16" in dtypes["bf16"]
    assert "c10::BFloat16" not in dtypes["fp32"] and "float" in dtypes["fp32"]


def test_offload_keeps_optimizer_state_on_the_host():
    setup = on_this_machine(_setup(), "cpu")
    trainer = build_trainer(setup, CPU, offload_optimizer=True)
    trainer.step(iter(make_loader(setup, 1, 0, False, 0)))
    state = trainer.state_bytes()
    n = 4_999_424
    # fp32 master weights + fp32 gradients + AdamW m and v, all in host memory: 16 bytes per parameter.
    assert state == {"params_bytes": 4 * n, "optimizer_device_bytes": 0, "optimizer_host_bytes": 16 * n}
    # The device copy of every weight equals its updated host master after the step.
    for p, master in zip(trainer.model.parameters(), trainer.optimizer.master, strict=True):
        assert torch.equal(p.detach(), master)


def test_gradient_accumulation_matches_one_big_batch():
    def grads(micro, accum):
        setup = on_this_machine(_setup(micro_batch=micro, global_batch=micro * accum, precision="fp32"), "cpu")
        trainer = build_trainer(setup, CPU, optimizer_impl="for-loop")
        trainer.optimizer.step = lambda: None  # keep the gradients for comparison
        trainer.optimizer.zero_grad = lambda set_to_none=True: None
        trainer.step(iter(make_loader(setup, accum, 0, False, 0)))
        return [p.grad.clone() for p in trainer.model.parameters()]

    for a, b in zip(grads(4, 1), grads(1, 4), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_phase_times_are_read_only_after_the_steps_sync():
    # On a GPU the phase marks are CUDA events, readable only once the GPU has passed them; the clock
    # refuses an early read on the CPU too, so this CPU step would fail as the GPU step would.
    clock = _Clock(CPU)
    a, b = clock.mark(), clock.mark()
    with pytest.raises(RuntimeError, match="before sync"):
        clock.ms(a, b)
    clock.sync()
    assert clock.ms(a, b) >= 0.0
    # A step of 3 micro-batches reads its marks after the sync and times every phase.
    setup = on_this_machine(_setup(micro_batch=1, global_batch=3), "cpu")
    trainer = build_trainer(setup, CPU)
    trainer.step(iter(make_loader(setup, 3, 0, False, 0)))
    assert all(len(v) == 1 and v[0] > 0 for k, v in trainer.phase_ms.items() if k != "data")


@pytest.mark.slow  # starts a child process or runs seconds of real steps
@pytest.mark.parametrize(
    ("inject", "status", "words"),
    [
        ("oom", "oom", "out of memory: injected"),
        ("crash", "crashed", signal.Signals.SIGABRT.name),
        ("error", "failed", "RuntimeError: injected error"),
        ("hang", "timeout", "no result after 5 s"),
    ],
)
def test_failures_become_runs_with_a_status(tmp_path, inject, status, words):
    store = RunStore(tmp_path)
    # The hang is stopped at the timeout wherever the child is by then (importing torch on a loaded
    # machine, or asleep at the injected hang): either way the run is filed as a timeout.
    opts = RunOptions(device="cpu", steps=1, warmup=0, inject=inject, timeout_s=5 if inject == "hang" else 120)
    run = profile_run(_setup(), opts, store)
    assert run.status == status and words in run.record["message"]
    assert run.metrics() is None
    runs, damaged = store.list_runs()
    assert [r.status for r in runs] == [status] and damaged == []
    assert list((tmp_path / ".staging").iterdir()) == []


def test_preflight_refuses_what_does_not_fit_and_offers_proxy_mode(tmp_path):
    store = RunStore(tmp_path)
    with pytest.raises(AdvisorError, match=r"needs about .* GiB on CPU host.*Try proxy mode: --layers \d+"):
        profile_run(make_setup(model="gpt2-1.5b", gpu="cpu", seq=1024), RunOptions(device="cpu"), store)
    with pytest.raises(AdvisorError, match="Even one layer does not fit"):
        profile_run(make_setup(model="llama-3.1-405b", gpu="cpu", seq=4096), RunOptions(device="cpu"), store)
    assert not tmp_path.exists() or list(tmp_path.iterdir()) == []


def test_proxy_mode_is_labelled_extrapolated(tmp_path):
    setup = on_this_machine(_setup(), "cpu")
    m = run_profile(
        setup, RunOptions(device="cpu", steps=1, warmup=0, layers=2), tmp_path, "20260101-000000-tiny-abcdef"
    )
    assert m.extrapolated and m.n_layers_run == 2 and m.n_params == 4_999_424
    assert m.proxy_note.startswith("extrapolated: measured on 2 of 4 layers")


def test_bad_run_options_are_named():
    with pytest.raises(AdvisorError, match="steps=0: must be an integer from 1 to 100"):
        RunOptions(steps=0)
    with pytest.raises(AdvisorError, match="device='tpu': must be auto, cpu or cuda"):
        RunOptions(device="tpu")
    with pytest.raises(AdvisorError, match=r"this run is on the CPU, which has no fp8 units.*compute capability 8.9"):
        build_trainer(make_setup(model="tiny", gpu="h100", seq=64, precision="fp8"), CPU)
    with pytest.raises(AdvisorError, match=r"cannot run on CPU host .* has no fp8 math \(use fp32, bf16, fp16\)"):
        on_this_machine(make_setup(model="tiny", gpu="h100", seq=64, precision="fp8"), "cpu")


def test_nsys_missing_is_explained(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nsys here
    with pytest.raises(AdvisorError, match=r"nsys \(NVIDIA Nsight Systems\) is not on the PATH"):
        profile_run(_setup(), RunOptions(device="cpu", nsys=True), RunStore(tmp_path / "runs"))


@pytest.mark.slow  # starts a child process or runs seconds of real steps
def test_nsys_wraps_the_child_and_its_files_stay_in_the_run(tmp_path, monkeypatch):
    # A stand-in nsys: checks the capture-range flags, writes the report files, runs the command.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nsys"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        '[[ "$1" == profile && " $* " == *" --capture-range=cudaProfilerApi "* ]] || exit 9\n'
        "shift\n"
        'while [[ $# -gt 0 && "$1" != -o ]]; do shift; done\n'
        'out="$2"; shift 2\n'
        'touch "$out.nsys-rep" "$out.sqlite"\n'
        'exec "$@"\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    opts = RunOptions(device="cpu", steps=1, warmup=0, nsys=True, timeout_s=120)
    run = profile_run(_setup(), opts, RunStore(tmp_path / "runs"))
    assert run.status == "ok", run.record["message"]
    assert {"nsys.nsys-rep", "nsys.sqlite", "metrics.json"} <= set(run.record["files"])


def test_unfused_attention_stores_the_scores():
    # seq 512, 8 heads, micro-batch 2: autograd keeps the fp32 softmax output of every layer (the
    # input of probs @ v and of softmax's backward, one tensor): 4 layers x 2 x 8 x 512^2 x 4 bytes =
    # 64 MiB that fused attention never stores (measured: 64.9 MiB more).
    peaks = {}
    for flash in (True, False):
        setup = on_this_machine(_setup(seq=512, micro_batch=2, precision="fp32", flash_attention=flash), "cpu")
        trainer = build_trainer(setup, CPU)
        peaks[flash] = measure_step_peak_bytes(trainer, iter(make_loader(setup, 3, 0, False, 0)))
    assert 60 * 2**20 < peaks[False] - peaks[True] < 72 * 2**20


@pytest.mark.slow  # starts a child process or runs seconds of real steps
def test_memory_budget_is_the_capacity_the_run_is_judged_against(tmp_path):
    store = RunStore(tmp_path)
    run = profile_run(_setup(), RunOptions(device="cpu", steps=1, warmup=0, memory_budget_gib=0.25), store)
    m = run.metrics()
    assert m["memory_capacity_bytes"] == 2**28
    assert m["memory_frac"] == pytest.approx(m["peak_memory_bytes"] / 2**28)
    assert run.record["setup"]["hardware"]["name"].endswith(", 0.25 GiB budget")
    assert "--memory-budget-gib 0.25" in run.record["command"]
    # A budget below the estimate is refused before any run exists, like a device that is too small.
    with pytest.raises(AdvisorError, match=r"needs about .* GiB on CPU host .*0.01 GiB budget"):
        profile_run(_setup(), RunOptions(device="cpu", memory_budget_gib=0.01), store)
    with pytest.raises(AdvisorError, match="memory_budget_gib=-1: must be 0"):
        RunOptions(memory_budget_gib=-1)
    with pytest.raises(AdvisorError, match="data_delay_ms=-5: must be 0 to 10000"):
        RunOptions(data_delay_ms=-5)


@pytest.mark.slow  # starts a child process or runs seconds of real steps
def test_fp16_skipped_steps_are_counted(tmp_path, monkeypatch):
    setup = on_this_machine(_setup(precision="fp16"), "cpu")
    options = RunOptions(device="cpu", steps=1, warmup=0)  # a warm-up, 1 timed and 1 profiled step
    m = run_profile(setup, options, tmp_path, "20260101-000000-tiny-abcdef")
    # The GradScaler starts at 2**16 and halves on every overflow; the count is what it skipped in the
    # timed steps: here one step, so 0 or 1 (measured: 0, tiny's fp16 gradients fit at 2**16).
    assert m.fp16_skipped_steps in (0, 1)
    # Scaled by 2**100 every fp16 gradient overflows: all three steps are skipped and the scale halves
    # each time, but only the timed step counts.
    with monkeypatch.context() as mp:
        mp.setattr(torch.amp, "GradScaler", functools.partial(torch.amp.GradScaler, init_scale=2.0**100))
        overflowing = run_profile(setup, options, tmp_path, "20260101-000000-tiny-abcded")
    assert overflowing.fp16_skipped_steps == 1
    assert (
        run_profile(
            on_this_machine(_setup(), "cpu"),
            RunOptions(device="cpu", steps=1, warmup=0),
            tmp_path,
            "20260101-000000-tiny-abcdee",
        ).fp16_skipped_steps
        is None
    )


def test_a_failing_trace_analysis_keeps_the_measured_metrics(monkeypatch, capsys):
    # The GPU box may lack an optional package, or the analysis meet a trace it has not seen: the
    # measured step is kept, and the run's log says why the analysis is missing.
    from advisor.run import child as profiling
    from advisor.spec.metrics import StepMetrics

    def broken(*args):
        raise ModuleNotFoundError("No module named 'orjson'")

    monkeypatch.setattr(profiling, "_with_trace_analysis", broken)
    measured = StepMetrics(run_id="r", source="profile", step_time_ms=12.5, peak_memory_bytes=2**30)
    assert profiling.with_trace_analysis(measured, CPU_TRACE_DIR / "trace.json.gz") is measured
    out = capsys.readouterr().out
    assert "trace analysis failed; the measured metrics are kept" in out and "No module named 'orjson'" in out


def test_the_phases_are_those_of_the_median_step_they_are_shown_beside():
    # Three steps, the second an outlier (the machine was busy): the median step is the third
    # (120 ms), and its phases add up to it; the mean would read forward 300 beside a 120 ms step.
    steps = [100.0, 900.0, 120.0]
    phases = {"forward": [40.0, 700.0, 50.0], "backward": [60.0, 200.0, 70.0]}
    assert median_step_phases(steps, phases) == {"forward": 50.0, "backward": 70.0}
    # An even count: the two middle steps (100 and 120), as statistics.median averages them.
    steps4, phases4 = [*steps, 90.0], {"forward": [*phases["forward"], 30.0], "backward": [*phases["backward"], 60.0]}
    assert median_step_phases(steps4, phases4) == {"forward": 45.0, "backward": 65.0}
    assert median_step_phases([5.0], {"forward": [2.0]}) == {"forward": 2.0}


def test_a_step_paced_by_several_loader_workers_is_read_over_their_cycles():
    # Measured (tiny, micro-batch 8, 40 ms a sample: 320 ms a batch; 2 workers; ~120 ms of compute):
    # the two workers deliver together, so the steps alternate, and the first waits a whole load.
    steps = [446.0, 120.0, 209.0, 126.0, 205.0, 120.0, 186.0, 118.0, 202.0]
    data = [323.0, 1.0, 81.0, 0.0, 71.0, 0.0, 68.0, 0.0, 88.0]
    assert statistics.median(steps) == 186.0  # no step's pace: the loader's is one load per 2 steps
    # Cycles of 2 after the first step: 329, 331, 306, 320 ms; the middle two are steps 7-8 and 1-2.
    assert median_steps(steps, 2) == [7, 8, 1, 2]
    assert typical_step_ms(steps, 2) == pytest.approx((118 + 202 + 120 + 209) / 4) == pytest.approx(162.25)
    assert median_step_phases(steps, {"data": data}, 2) == {"data": pytest.approx((0 + 88 + 1 + 81) / 4)}
    # One worker, or none: the plain median, as before.
    assert typical_step_ms(steps, 1) == typical_step_ms(steps, 0) == 186.0
    # Three steps and 2 workers: the one cycle after the first step; fewer than a cycle: every step.
    assert median_steps(steps[:3], 2) == [1, 2] and median_steps(steps[:3], 4) == [0, 1, 2]


def test_progress_says_what_each_step_is_for():
    from advisor.run.child import _step_role, _total_steps

    options = RunOptions(device="cpu", steps=2)  # 1 warm-up, 2 timed, the profiler's warm-up, 2 profiled
    total = _total_steps(options, "cuda")
    timed, first_active = 1 + options.steps, 1 + options.steps + options.warmup
    roles = [_step_role(i, timed, first_active, total) for i in range(total)]
    assert total == 6 and roles[0] == "warm-up" and roles[1:3] == ["timed 1/2", "timed 2/2"]
    assert roles[-2:] == ["profiled 1/2", "profiled 2/2"]
    assert roles[3 : 3 + options.warmup] == ["profiler warm-up"] * options.warmup
    # On a CPU the rehearsal (as many steps as are timed) comes before the timed steps.
    total, timed, first_active = _total_steps(options, "cpu"), 5, 6
    assert total == 8
    roles = [_step_role(i, timed, first_active, total, rehearsal=2) for i in range(total)]
    assert roles == [
        "warm-up",
        "profiler rehearsal 1/2",
        "profiler rehearsal 2/2",
        "timed 1/2",
        "timed 2/2",
        "profiler warm-up",
        "profiled 1/2",
        "profiled 2/2",
    ]


def test_preflight_names_what_one_layer_cannot_fit():
    # 70B at micro-batch 2 x 256 tokens was told to shrink them; what does not fit with one block is
    # the embedding and the head with their optimizer state (a browser review). A 16 GiB host, fixed.
    from dataclasses import replace

    from advisor.run.launcher import preflight

    def on_16_gib(**kw):
        setup = on_this_machine(make_setup(gpu="cpu", **kw), "cpu")
        return replace(setup, hardware=replace(setup.hardware, memory_bytes=16 * 2**30))

    with pytest.raises(AdvisorError, match=r"optimizer state alone \(most of them the embedding and the head\) take 4"):
        preflight(on_16_gib(model="llama-3.1-70b", seq=256, micro_batch=2), RunOptions(device="cpu"))
    with pytest.raises(AdvisorError, match="Even one layer does not fit: shrink the micro-batch or sequence length"):
        preflight(on_16_gib(model="llama-3.2-1b", seq=8192, micro_batch=64), RunOptions(device="cpu"))
