"""The parent side of a profiled run: preflight, start the child process, watch it, file the run.

The UI and the CLI both call :func:`profile_run`, which starts ``python -m advisor _child`` (the
child runs :func:`advisor.run.child.run_profile`). An out-of-memory error, a crash, a hang past the
timeout or a cancel all end as a run with a status and a message; the caller never dies with the child.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from advisor.errors import AdvisorError, Refused
from advisor.estimate.estimator import estimate
from advisor.run.child import proc_kib_bytes, proxy_setup
from advisor.run.fp8 import fp8_refusal
from advisor.run.step import check_step_options, resolve_device
from advisor.run.unified_memory import NSYS_UM_FLAGS, um_refusal
from advisor.spec.options import RunOptions
from advisor.spec.presets import local_hardware
from advisor.spec.specs import Setup, setup_from_dict, spec_to_dict
from advisor.store.runstore import (
    RunFiles,
    RunInfo,
    RunStore,
    add_owner,
    default_root,
    new_run_id,
    write_json_atomic,
)

CHILD_COMMAND = "_child"
"""The CLI command the profiling child runs (``python -m advisor _child --run-dir DIR``); not in the help."""

REPO_ROOT = Path(__file__).resolve().parents[2]
NSYS_HELP = (
    "nsys (NVIDIA Nsight Systems) is not on the PATH. Install it from https://developer.nvidia.com/nsight-systems "
    "(or the CUDA toolkit's nsight-systems package) and make sure `nsys --version` works, then retry; "
    "without it, profile without --nsys: the run still has NVTX ranges and a CUDA capture range."
)
ProgressFn = Callable[[int, int, str], None]


def local_device_type(device: str) -> str:
    """'cuda' or 'cpu' for a RunOptions.device, without touching CUDA in this process beyond a query."""
    return resolve_device(device).type


def on_this_machine(setup: Setup, device: str, nproc: int = 1) -> Setup:
    """The setup as the profiled step runs it: this machine's device as its hardware, and the eager
    PyTorch implementation (autocast over fp32 parameters) that the step is. ``nproc`` CPU processes
    share the host: each gets its share of the cores' FLOP/s, bandwidth and memory (torchrun gives each
    one thread)."""
    hw = local_hardware(local_device_type(device))
    if hw.kind == "cpu" and nproc > 1:
        hw = replace(
            hw,
            name=f"{hw.name} / {nproc} processes",
            memory_bytes=hw.memory_bytes // nproc,
            peak_fp32_flops=hw.peak_fp32_flops / nproc,
            peak_bf16_flops=hw.peak_bf16_flops / nproc,
            peak_fp16_flops=hw.peak_fp16_flops / nproc,
            mem_bw_bytes_per_s=hw.mem_bw_bytes_per_s / nproc,
        )
    try:
        return replace(setup, hardware=hw, train=replace(setup.train, framework="pytorch"))
    except AdvisorError as err:
        raise AdvisorError(f"this setup cannot run on {hw.name}: {err}") from err


def suggest_proxy_layers(setup: Setup) -> int:
    """The most layers (a divisor-friendly count) whose estimate fits this device; 0 if none does."""
    for n in range(setup.model.n_layers - 1, 0, -1):
        try:
            if estimate(proxy_setup(setup, n)).fits:
                return n
        except AdvisorError:
            continue
    return 0


# What a profiled run costs the host beyond its model state, measured on this project's 2-core x86 dev
# machine (torch 2.13 CPU) by polling every descendant's /proc smaps (psutil memory_full_info) while
# `profile --model tiny --device cpu --seq 64 --steps 3 --warmup 1` ran: one process, 2 loader workers,
# and 2 processes (torchrun, gloo), 1 worker each. Rounded up: the tiny model's own state is a few MiB.
PROCESS_HOST_BYTES = 768 * 2**20
"""One profiling process: Python, torch and its libraries, the step's buffers. Measured peak RSS 636 MiB
(one process) and 682 MiB (a rank of two); issue 22 saw 712 MiB per process on another machine."""
LOADER_WORKER_HOST_BYTES = 192 * 2**20
"""One DataLoader worker, a fork of its process: measured PSS 132-160 MiB (RSS 322 MiB, most of it pages
shared with the process it forked from; unique 7-42 MiB, growing as pages are touched)."""
LAUNCHER_HOST_BYTES = 320 * 2**20
"""torchrun's agent process (nproc > 1): measured peak RSS 280 MiB."""


def host_memory_available_bytes() -> int:
    """The host memory a new run can have now: /proc/meminfo's MemAvailable (bytes); 0 where unknown
    (then the host check is skipped)."""
    return proc_kib_bytes("/proc/meminfo", "MemAvailable") or 0


MEASURED_RUNS = 50
"""The newest runs of a store whose recorded host footprint process_host_bytes reads."""


def process_host_bytes(device_type: str, store: RunStore | None = None) -> tuple[int, str]:
    """(bytes, where from) of one profiling process's host footprint on ``device_type``: the largest
    that this store's newest ok runs on that device type recorded (StepMetrics.host_peak_rss_bytes, less
    what they kept on the host on purpose: an offloaded optimizer, offloaded activations), where that
    is more than PROCESS_HOST_BYTES (measured on the CPU); a GPU process also maps the CUDA libraries, so
    its own runs say what it takes. CPU runs hold their model state in that figure too, so their
    device type uses PROCESS_HOST_BYTES and counts the state apart."""
    measured = 0
    if store is not None and device_type != "cpu":
        runs, _ = store.list_runs()
        for info in [r for r in runs if r.status == "ok"][:MEASURED_RUNS]:
            try:
                m = info.metrics() or {}
            except AdvisorError:
                continue  # a damaged run is listed as such elsewhere
            if m.get("device_type") != device_type or not m.get("host_peak_rss_bytes"):
                continue
            kept = (m.get("optimizer_host_bytes") or 0) + ((m.get("activation_offload") or {}).get("host_bytes") or 0)
            measured = max(measured, int(m["host_peak_rss_bytes"] - kept))
    if measured > PROCESS_HOST_BYTES:
        return measured, f"measured on this store's {device_type} runs"
    return PROCESS_HOST_BYTES, "Python and torch"


def host_need_bytes(options: RunOptions, state_bytes: int, process_bytes: int = PROCESS_HOST_BYTES) -> dict[str, int]:
    """The host memory a run on this node takes, by part (bytes): ``nproc`` processes' interpreter and
    torch footprint (``process_bytes`` each: see process_host_bytes), their loader workers
    (``num_workers`` each), torchrun's agent, and the model state where it lives on the host
    (``state_bytes`` per process: a CPU run's whole estimate, else 0)."""
    n = options.nproc
    return {
        "processes": n * process_bytes,
        "workers": n * options.num_workers * LOADER_WORKER_HOST_BYTES,
        "launcher": LAUNCHER_HOST_BYTES if n > 1 else 0,
        "state": n * state_bytes,
    }


def preflight(setup: Setup, options: RunOptions, store: RunStore | None = None) -> None:
    """Refuse a run the estimator says will not fit this machine's memory (offering proxy mode), or
    whose processes, loader workers and host-side state do not fit the host's available memory (each
    process's footprint as ``store``'s runs on this device type measured it: process_host_bytes)."""
    run = proxy_setup(setup, options.layers)
    est = estimate(run)
    if est.fits:
        device_type = local_device_type(options.device)
        on_host = est.memory.total_bytes if device_type == "cpu" else 0
        _check_host(options, on_host, *process_host_bytes(device_type, store))
        return
    hw = run.hardware
    need, have = est.memory.total_bytes / 2**30, hw.memory_bytes / 2**30
    what = f"{run.model.n_layers} layers of {setup.model.name}" if run is not setup else setup.model.name
    msg = f"{what} needs about {need:.1f} GiB on {hw.name}, which has {have:.1f} GiB."
    n = suggest_proxy_layers(setup)
    if n:
        msg += (
            f" Try proxy mode: --layers {n} profiles {n} of {setup.model.n_layers} layers and extrapolates per-layer"
            " costs to the full depth (labelled as extrapolated); or shrink micro-batch / sequence."
        )
    else:
        one = estimate(proxy_setup(setup, 1)).memory
        states = one.weights_bytes + one.grads_bytes + one.optimizer_bytes
        if states > hw.memory_bytes:
            # What is left with one block is the embedding, the head and their optimizer state: no batch
            # or sequence fits then (a review saw 70B told to shrink a 256-token micro-batch).
            msg += (
                f" Even one layer does not fit: with one block, the weights, gradients and optimizer state alone "
                f"(most of them the embedding and the head) take {states / 2**30:.1f} GiB. Profile a smaller model, or size "
                "this one with `advisor size` / the Size tab."
            )
        else:
            msg += " Even one layer does not fit: shrink the micro-batch or sequence length."
    raise AdvisorError(msg)


def _check_host(
    options: RunOptions, state_bytes: int, process_bytes: int = PROCESS_HOST_BYTES, basis: str = "Python and torch"
) -> None:
    have = host_memory_available_bytes()
    need = host_need_bytes(options, state_bytes, process_bytes)
    if not have or sum(need.values()) <= have:
        return
    gib = 2**30
    n, w = options.nproc, options.num_workers
    parts = [f"{n} process(es) x {process_bytes / gib:.2f} GiB ({basis})"]
    if w:
        parts.append(f"{n * w} loader worker(s) x {LOADER_WORKER_HOST_BYTES / gib:.2f} GiB")
    if need["launcher"]:
        parts.append(f"torchrun {LAUNCHER_HOST_BYTES / gib:.2f} GiB")
    if state_bytes:
        parts.append(f"{n} x {state_bytes / gib:.2f} GiB of model state")
    raise AdvisorError(
        f"nproc={n}, num_workers={w} needs about {sum(need.values()) / gib:.1f} GiB of host memory "
        f"({' + '.join(parts)}), but this host has {have / gib:.1f} GiB available: lower --nproc or "
        "--num-workers (or free memory)"
    )


def launcher(options: RunOptions) -> list[str]:
    """How the child starts: plain ``python`` for one process, else torchrun with ``nproc`` processes on
    this node (``--standalone`` on one node; a c10d rendezvous every node joins on several)."""
    if options.world_size == 1:
        return [sys.executable]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(options.nproc)]
    if options.nnodes == 1:
        return [*cmd, "--standalone"]
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", options.rdzv_endpoint, "--rdzv-id", options.rdzv_id]
    return [*cmd, "--nnodes", str(options.nnodes), *rdzv]


def _child_command(run_dir: Path, options: RunOptions) -> list[str]:
    cmd = [*launcher(options), "-m", "advisor", CHILD_COMMAND, "--run-dir", str(run_dir)]
    if options.nsys:
        cmd = nsys_prefix(RunFiles(run_dir).nsys, options.unified_memory) + cmd
    return cmd


def nsys_prefix(output: Path | str, unified_memory: bool = False) -> list[str]:
    """``nsys profile`` recording only the CUDA capture range (the active steps), with a SQLite export;
    for a Unified Memory run, with its CPU and GPU page faults."""
    return [
        "nsys",
        "profile",
        "--capture-range=cudaProfilerApi",
        "--capture-range-end=stop",
        "--trace=cuda,nvtx,osrt,cublas,cudnn",
        *(NSYS_UM_FLAGS if unified_memory else ()),
        "--sample=none",
        "--export=sqlite",
        "--force-overwrite=true",
        "-o",
        str(output),
    ]


def profile_cli_args(setup: Setup, options: RunOptions) -> list[str]:
    """The ``python -m advisor profile`` flags that reproduce this run (UI and CLI share one path)."""
    from advisor.spec.presets import MODELS

    m, t, p = setup.model, setup.train, setup.parallel
    preset = MODELS.get(m.name)
    args = (
        ["--model", m.name] if preset is not None and preset() == m else ["--hf-config", f"<config.json of {m.name}>"]
    )
    args += ["--seq", str(t.seq_len), "--micro-batch", str(t.micro_batch)]
    if t.global_batch:
        args += ["--global-batch", str(t.global_batch)]
    args += ["--precision", t.precision, "--optimizer", t.optimizer, "--recompute", t.recompute]
    if t.recompute_layers:
        args += ["--recompute-layers", str(t.recompute_layers)]
    if t.offload_activations:
        args += ["--offload-activations", str(t.offload_activations)]
    if t.precision == "fp8" and t.fp8_recipe != "tensorwise":
        args += ["--fp8-recipe", t.fp8_recipe]
    if not t.flash_attention:
        args.append("--no-flash")
    if setup.gpus > 1:
        args += ["--gpus", str(setup.gpus)]
        args += [a for flag, v in (("--tp", p.tp), ("--pp", p.pp), ("--vpp", p.vpp)) if v > 1 for a in (flag, str(v))]
        if p.sequence_parallel:
            args.append("--sp")
    if p.zero:
        args += ["--zero", str(p.zero)]
    if p.offload != "none":
        args += ["--offload", p.offload]
    args += ["--device", options.device, "--steps", str(options.steps), "--warmup", str(options.warmup)]
    if options.nproc > 1:
        args += ["--nproc", str(options.nproc)]
    if options.nnodes > 1:
        args += [
            "--nnodes",
            str(options.nnodes),
            "--rdzv-endpoint",
            options.rdzv_endpoint,
            "--rdzv-id",
            options.rdzv_id,
        ]
    if options.layers:
        args += ["--layers", str(options.layers)]
    if t.optimizer_impl != "fused":
        args += ["--optimizer-impl", t.optimizer_impl]
    if options.num_workers:
        args += ["--num-workers", str(options.num_workers)]
    if options.data_delay_ms:
        args += ["--data-delay-ms", f"{options.data_delay_ms:g}"]
    if options.memory_budget_gib:
        args += ["--memory-budget-gib", f"{options.memory_budget_gib:g}"]
    args += [flag for flag, on in (("--pin-memory", options.pin_memory), ("--compile", options.compile)) if on]
    if options.unified_memory:
        args.append("--unified-memory")
    if options.um_host_budget_gib:
        args += ["--um-host-budget-gib", f"{options.um_host_budget_gib:g}"]
    return args


def profile_run(
    setup: Setup,
    options: RunOptions,
    store: RunStore | None = None,
    *,
    on_progress: ProgressFn | None = None,
    cancel: threading.Event | None = None,
) -> RunInfo:
    """Profile ``setup`` in a child process and file the run; returns it whatever its status.

    Bad input and a failed preflight raise AdvisorError before any run is created.
    """
    store = store or RunStore()
    store.check_root()  # a path that cannot hold runs is said at once, not after the device's turn
    if options.nsys and shutil.which("nsys") is None:
        raise AdvisorError(NSYS_HELP)
    if reason := device_refusal(setup, options):
        return _file_refused(setup, options, store, reason)
    setup = on_this_machine(setup, options.device, options.nproc)
    if options.compile != setup.train.compile:
        # The run compiles or not as its options say; its setup says the same, so the estimate filed
        # with it prices the step that ran (no per-op dispatch under torch.compile).
        setup = replace(setup, train=replace(setup.train, compile=options.compile))
    if options.memory_budget_gib:
        hw = setup.hardware
        budget = int(options.memory_budget_gib * 2**30)
        setup = replace(
            setup,
            hardware=replace(hw, memory_bytes=budget, name=f"{hw.name}, {options.memory_budget_gib:g} GiB budget"),
        )
    if setup.gpus != options.world_size:
        raise AdvisorError(
            f"the layout needs {setup.gpus} processes (dp {setup.parallel.dp} x tp {setup.parallel.tp} x pp "
            f"{setup.parallel.pp} x cp {setup.parallel.cp}) but nproc({options.nproc}) x nnodes({options.nnodes}) = "
            f"{options.world_size}: set --gpus to the world size, or --nproc / --nnodes to the layout"
        )
    check_step_options(setup, options.compile)
    preflight(setup, options, store)
    with _device_turn(cancel, on_progress, local_device_type(options.device)):
        return _profile(setup, options, store, on_progress, cancel)


_DEVICE = threading.Lock()
"""Held from a run's creation until it is filed: one profiled run at a time in this process. The app's
queue runs one profile at a time, but a job it has given up on (a cancel, a page that went away) can
still be stopping its child when the queue starts the next one; the next one waits here, so a cancelled
child has exited and its run is filed before the next run is even created."""


def device_lock_path(device_type: str) -> Path:
    """The file whose lock (flock) one process holds while it profiles on this machine's
    ``device_type`` (``cpu``, ``cuda``): the app and a CLI run, or two apps, take turns too."""
    return Path(tempfile.gettempdir()) / f"advisor-device-{device_type}.lock"


@contextlib.contextmanager
def _device_turn(cancel: threading.Event | None, on_progress: ProgressFn | None, device_type: str = "cpu"):
    """Wait for the device: this process's turn (_DEVICE), then the machine's (an exclusive flock on
    device_lock_path, released by the kernel when the holder exits, even killed); AdvisorError where the
    caller cancels while waiting."""
    told = set()

    def wait(what: str) -> None:
        if cancel is not None and cancel.is_set():
            raise AdvisorError(f"cancelled while waiting for {what} to stop; nothing ran")
        if on_progress is not None and what not in told:
            on_progress(0, 1, f"waiting for {what} to stop")
            told.add(what)

    while not _DEVICE.acquire(timeout=0.05):
        wait("the previous run")
    try:
        with open(device_lock_path(device_type), "a+") as lock:
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    wait(f"another process's run on this machine's {device_type}")
                    time.sleep(0.05)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    finally:
        _DEVICE.release()


def _profile(
    setup: Setup,
    options: RunOptions,
    store: RunStore,
    on_progress: ProgressFn | None,
    cancel: threading.Event | None,
) -> RunInfo:
    """Create the run, watch its child to the end and file it (the device is this caller's)."""
    run_id = new_run_id(setup.model.name)
    run_dir = store.staging_dir(run_id)
    cmd = _child_command(run_dir, options)
    record = _new_record(run_id, setup, options, store)
    files = RunFiles(run_dir)
    write_json_atomic(files.request, {"run_id": run_id, "setup": record["setup"], "options": record["options"]})
    write_json_atomic(files.record, record)

    t0 = time.perf_counter()
    status, message, child = _watch(cmd, run_dir, options.timeout_s, on_progress, cancel)
    record.update(
        status=status,
        message=message,
        child=child,
        finished_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        wall_s=round(time.perf_counter() - t0, 3),
        files=sorted(p.name for p in run_dir.iterdir() if not p.name.startswith(".")),
    )
    if files.environment.is_file():
        record["environment"] = json.loads(files.environment.read_text(encoding="utf-8"))
    write_json_atomic(files.record, record)
    store.commit(run_id)
    return store.load(run_id)


def _new_record(run_id: str, setup: Setup, options: RunOptions, store: RunStore) -> dict[str, Any]:
    # The command files its run where this one went: a store other than the default is named.
    where = [] if store.root.absolute() == default_root() else ["--traces", str(store.root)]
    user_cmd = shlex.join(["python", "-m", "advisor", "profile", *profile_cli_args(setup, options), *where])
    return {
        "run_id": run_id,
        "status": "running",
        "message": "",
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "setup": spec_to_dict(setup),
        "options": options.as_dict(),
        "command": user_cmd,
        "nsys_command": shlex.join(nsys_prefix(f"{run_id}-nsys", options.unified_memory)) + " " + user_cmd,
    }


def device_refusal(setup: Setup, options: RunOptions) -> str | None:
    """Why this machine's device cannot run an option (fp8 on a CPU or without torchao, Unified Memory
    on a CPU), or None: the run is filed as refused without starting a child. What needs the GPU itself
    (its compute capability, its free memory) the child checks before it allocates, and files the same
    way; asking here would start CUDA in the app's process."""
    device = resolve_device(options.device)
    if setup.train.precision == "fp8" and (reason := fp8_refusal(device, query_gpu=False)):
        return reason
    if options.unified_memory and device.type != "cuda":
        return um_refusal(device, 0.0, None)
    return None


def _file_refused(setup: Setup, options: RunOptions, store: RunStore, reason: str) -> RunInfo:
    """A run with status 'refused' and the reason: nothing ran, the store stays consistent."""
    run_id = new_run_id(setup.model.name)
    run_dir = store.staging_dir(run_id)
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    record = _new_record(run_id, setup, options, store) | {
        "status": "refused",
        "message": reason,
        # The device it was refused on: the setup may name a GPU preset (fp8 asked of a CPU).
        "device_type": resolve_device(options.device).type,
        "finished_utc": now,
        "wall_s": 0.0,
        "files": [RunFiles(run_dir).record.name],
    }
    write_json_atomic(RunFiles(run_dir).record, record)
    store.commit(run_id)
    return store.load(run_id)


INTERRUPTING_SIGNALS = (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""Signals that stop a child from outside (a user's kill, a shutdown, the kernel's OOM killer): the run
is 'interrupted', where a signal the child raised itself (SIGSEGV, SIGABRT) is a crash."""


def _watch(
    cmd: list[str], run_dir: Path, timeout_s: float, on_progress: ProgressFn | None, cancel: threading.Event | None
) -> tuple[str, str, dict[str, Any]]:
    """Run the child to its end, the timeout or a cancel (Ctrl-C too); returns (status, message, child),
    ``child`` the child's pid, exit code and the wall-clock bracket of its life as this process saw it
    (``started_unix_s`` just before it was started, ``ended_unix_s`` just after its exit was reaped: the
    child lived inside it)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    env.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    files = RunFiles(run_dir)
    log = open(files.log, "w", encoding="utf-8")  # noqa: SIM115 - closed after the reader thread
    started = time.time()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT, env=env, start_new_session=True
    )

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("@@progress "):
                try:
                    p = json.loads(line[len("@@progress ") :])
                    if on_progress:
                        on_progress(int(p["done"]), int(p["total"]), str(p["message"]))
                except (ValueError, KeyError):
                    pass
                continue
            log.write(line)
            log.flush()

    reader: threading.Thread | None = None
    outcome: tuple[str, str] | None = None
    # From the child's start on, a Ctrl-C stops the child and files the run: one that came before the
    # wait (the owner just written, the reader starting) killed this process and left the child running.
    try:
        add_owner(run_dir, proc.pid)  # the run stays staged while the child lives, even if this process dies
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None:
            if cancel is not None and cancel.is_set():
                outcome = ("cancelled", "cancelled by the user")
            elif time.monotonic() > deadline:
                outcome = (
                    "timeout",
                    f"no result after {timeout_s:g} s: the child was stopped (a hang, or raise --timeout)",
                )
            if outcome:
                break
            time.sleep(0.05)
    except KeyboardInterrupt:  # Ctrl-C at the CLI: the child, in its own session, did not get it
        outcome = ("interrupted", "interrupted by Ctrl-C: the child was stopped")
    if outcome:
        _kill(proc)
    proc.wait()  # the child has exited before the run is filed (and before the next one may start)
    child = {"pid": proc.pid, "returncode": proc.returncode, "started_unix_s": started, "ended_unix_s": time.time()}
    if reader is not None:
        reader.join(timeout=5)
    log.close()
    return (*(outcome or _ending(proc.returncode, files)), child)


def _ending(returncode: int, files: RunFiles) -> tuple[str, str]:
    """(status, message) of a child that ended on its own."""
    if returncode == 0 and files.metrics.is_file():
        return "ok", ""
    if files.child_status.is_file():
        info = json.loads(files.child_status.read_text(encoding="utf-8"))
        return info["status"], info["message"]
    if returncode < 0:
        sig = signal.Signals(-returncode)
        if sig in INTERRUPTING_SIGNALS:
            return "interrupted", (
                f"the child was stopped by {sig.name} from outside (a user's kill, a shutdown, or the kernel's "
                "out-of-memory killer: see dmesg); see log.txt"
            )
        return "crashed", f"the child died with {sig.name}; see log.txt"
    return "crashed", f"the child exited with status {returncode}; see log.txt: {_tail(files.log)}"


def _kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _tail(path: Path, n: int = 3) -> str:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(lines[-n:])


def child_main(run_dir: Path) -> int:
    """Entry of ``python -m advisor _child``: run the request in ``run_dir``; 0 ok, 3 handled failure.
    A rank of a distributed run leaves by ``advisor.run.parallel.leave_rank`` (why: there)."""
    code = _child_run(run_dir)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from advisor.run.parallel import leave_rank

        leave_rank(code)
    return code


def _child_run(run_dir: Path) -> int:
    from advisor.analysis.summary import reuse_freed_memory

    # The step's CPU tensors come from glibc's malloc, which hands every freed block over its mmap
    # threshold back to the kernel, so each step's activations came from fresh pages that the kernel
    # zeroes: the 8-layer tiny model at seq 512 x 8 took 164-191 K page faults and 271-351 ms of system
    # time in a 1.0-1.3 s step on 2 cores of our EPYC VM, most of it in the profiled steps' small ops.
    # A GPU's caching allocator keeps what it frees, and the CPU step stands in for a GPU step, so the
    # child keeps it too: 0-15 faults and 0-16 ms of system time a step after the first two; side by
    # side the step took 795-798 ms against 933-1,124 ms, its profiled steps 1.3-1.9x that, not 2.1-3.2x.
    # Nothing is trimmed either: the profiler rehearsal's heap is the room the profiled steps need.
    kept = reuse_freed_memory(trim=False)
    import torch

    from advisor.run.child import environment, run_profile

    files = RunFiles(run_dir)
    request = json.loads(files.request.read_text(encoding="utf-8"))
    write_json_atomic(files.environment, environment() | {"freed_memory_kept": kept})
    try:
        setup = setup_from_dict(request["setup"])
        options = RunOptions(**request["options"])
        run_profile(setup, options, run_dir, request["run_id"])
    except torch.OutOfMemoryError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else "out of memory"
        _child_status(
            run_dir, "oom", f"out of memory: {first}. Lower the micro-batch, enable checkpointing, or use --layers"
        )
        return 3
    except Refused as err:
        _child_status(run_dir, "refused", str(err))
        return 3
    except AdvisorError as err:
        _child_status(run_dir, "failed", str(err))
        return 3
    except Exception as err:
        import traceback

        traceback.print_exc()
        _child_status(run_dir, "failed", f"{type(err).__name__}: {err}")
        return 3
    return 0


def _child_status(run_dir: Path, status: str, message: str) -> None:
    write_json_atomic(RunFiles(run_dir).child_status, {"status": status, "message": message})
