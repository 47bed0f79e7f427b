"""Runs killed from outside and runs cancelled with another queued: each leaves one filed record, never
a half run, and never two profiling children at once; the host memory preflight."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from advisor.errors import AdvisorError
from advisor.run import launcher
from advisor.run.launcher import profile_run
from advisor.spec.options import RunOptions
from advisor.spec.setup import make_setup
from advisor.store.runstore import OWNER_FILE, STAGING, RunStore, _machine, new_run_id, write_json_atomic
from tests.shared import pid_gone

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30


def _setup(**kw):
    return make_setup(model="tiny", gpu="cpu", seq=64, micro_batch=1, **kw)


def test_a_dead_run_still_running_is_filed_interrupted_and_one_never_created_is_removed(tmp_path):
    store = RunStore(tmp_path)
    dead = {"machine": _machine(), "owners": [{"pid": 2**22 + 1, "start": None}]}  # above pid_max: gone
    run_id, never = new_run_id("tiny"), new_run_id("tiny")
    for rid in (run_id, never):
        (tmp_path / STAGING / rid).mkdir(parents=True)
        write_json_atomic(tmp_path / STAGING / rid / OWNER_FILE, dead)
    # The launcher wrote run.json ("running") and the child its environment before both were killed.
    write_json_atomic(tmp_path / STAGING / run_id / "run.json", {"run_id": run_id, "status": "running"})
    write_json_atomic(tmp_path / STAGING / run_id / "environment.json", {"python": "3"})
    runs, damaged = store.list_runs()
    assert [(r.run_id, r.status) for r in runs] == [(run_id, "interrupted")] and damaged == []
    assert runs[0].record["message"].startswith("interrupted: the process that profiled this run and its child")
    assert runs[0].record["files"] == ["environment.json", "run.json"]
    assert not (runs[0].path / OWNER_FILE).exists() and list((tmp_path / STAGING).iterdir()) == []


def test_preflight_counts_each_process_and_loader_worker_on_the_host(tmp_path, monkeypatch):
    # Issue 22: 64 processes with 32 loader workers each passed on a 23.5 GiB host (0.16 GiB estimated
    # per process). Now: 64 x 0.75 + 2048 workers x 0.1875 + torchrun 0.3125 = 432.3 GiB, plus the
    # estimated state, 0.0932 GiB a process for tiny at seq 64: 438.3 GiB.
    monkeypatch.setattr(launcher, "host_memory_available_bytes", lambda: int(23.5 * GIB))
    store = RunStore(tmp_path)
    big = RunOptions(device="cpu", nproc=64, num_workers=32)
    with pytest.raises(AdvisorError) as err:
        profile_run(_setup(gpus=64), big, store)
    msg = str(err.value)
    assert (
        msg.startswith("nproc=64, num_workers=32 needs about 438.3 GiB") and "this host has 23.5 GiB available" in msg
    )
    assert "64 process(es) x 0.75 GiB (Python and torch) + 2048 loader worker(s) x 0.19 GiB + torchrun 0.31" in msg
    # 16 processes without workers: 12 + 0.31 + 16 x 0.0932 = 13.8 GiB, refused on an 8 GiB host.
    monkeypatch.setattr(launcher, "host_memory_available_bytes", lambda: 8 * GIB)
    with pytest.raises(
        AdvisorError, match=r"nproc=16, num_workers=0 needs about 13\.8 GiB.*16 x 0\.09 GiB of model state"
    ):
        profile_run(_setup(gpus=16), RunOptions(device="cpu", nproc=16), store)
    # What fits is not refused here: 2 processes with a worker each, 2.2 GiB and tiny's state.
    need = launcher.host_need_bytes(RunOptions(device="cpu", nproc=2, num_workers=1), 0)
    assert sum(need.values()) / GIB == pytest.approx(2 * 0.75 + 2 * 0.1875 + 0.3125)
    launcher.preflight(launcher.on_this_machine(_setup(gpus=2), "cpu", 2), RunOptions(device="cpu", nproc=2))
    assert not tmp_path.exists() or list(tmp_path.iterdir()) == []


def _measured_run(store: RunStore, device_type: str, rss: int, status: str = "ok", **fields) -> str:
    run_id = new_run_id("tiny")
    d = store.staging_dir(run_id)
    write_json_atomic(d / "run.json", {"run_id": run_id, "status": status})
    metrics = {"run_id": run_id, "source": "profile", "model_name": "tiny", "device_type": device_type}
    write_json_atomic(d / "metrics.json", {**metrics, "host_peak_rss_bytes": rss, **fields})
    store.commit(run_id)
    return run_id


def test_a_gpu_process_footprint_is_what_this_stores_gpu_runs_measured(tmp_path, monkeypatch):
    # A CUDA process maps the device runtime's libraries on top of Python and torch: the CPU figure
    # (0.75 GiB) is not its footprint, so the preflight reads what this store's cuda runs recorded.
    store = RunStore(tmp_path)
    assert launcher.process_host_bytes("cuda", store) == (launcher.PROCESS_HOST_BYTES, "Python and torch")
    _measured_run(store, "cuda", 3 * GIB, optimizer_host_bytes=GIB)  # 1 GiB of it an offloaded optimizer: 2 GiB
    _measured_run(store, "cuda", int(1.5 * GIB), activation_offload={"host_bytes": GIB // 2})
    _measured_run(store, "cuda", 9 * GIB, status="failed")  # not an ok run: not read
    _measured_run(store, "cpu", 5 * GIB)  # a CPU run's figure holds its model state: not read
    assert launcher.process_host_bytes("cuda", store) == (2 * GIB, "measured on this store's cuda runs")
    assert launcher.process_host_bytes("cpu", store) == (launcher.PROCESS_HOST_BYTES, "Python and torch")
    monkeypatch.setattr(launcher, "host_memory_available_bytes", lambda: 16 * GIB)
    options = RunOptions(device="cpu", nproc=8)
    with pytest.raises(AdvisorError, match=r"needs about 16\.3 GiB.*8 process\(es\) x 2\.00 GiB \(measured on this"):
        launcher._check_host(options, 0, *launcher.process_host_bytes("cuda", store))
    launcher._check_host(options, 0, *launcher.process_host_bytes("cpu", store))  # 8 x 0.75 + 0.31: fits


def _owners(store: RunStore, timeout_s: float = 60) -> tuple[Path, list[int]]:
    """The one staging directory and its owners' pids, once the child is among them."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for d in (store.root / STAGING).glob("*"):
            try:
                pids = [o["pid"] for o in json.loads((d / OWNER_FILE).read_text())["owners"]]
            except (OSError, ValueError, KeyError):
                continue
            if len(pids) == 2:
                return d, pids
        time.sleep(0.05)
    raise AssertionError("the profiling child never started")


def _wait_for(cond, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


# The parent takes Ctrl-C as a terminal's CLI does: a shell that starts the test runner in the background
# hands it SIGINT ignored, and the parent would inherit that and never stop.
PARENT = (
    "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from advisor.run.launcher import profile_run; from advisor.spec.options import RunOptions; "
    "from advisor.spec.setup import make_setup; from advisor.store.runstore import RunStore; "
    "profile_run(make_setup(model='tiny', gpu='cpu', seq=64), RunOptions(device='cpu', steps=1, warmup=0, "
    "inject=sys.argv[2]), RunStore(sys.argv[1]))"
)


@pytest.mark.slow  # starts a child process or runs seconds of real steps
@pytest.mark.parametrize("victim", ["parent", "child", "both", "ctrl-c"])
def test_kill_9_during_a_run_leaves_the_run_filed_as_interrupted(tmp_path, victim):
    store = RunStore(tmp_path)
    # Killed alone, the parent leaves a child that runs on until its next progress line meets the dead
    # parent's pipe (BrokenPipeError: the device is freed); else the child hangs until killed.
    inject = "" if victim == "parent" else "hang"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path), inject], cwd=REPO)
    staged, (parent_pid, child_pid) = _owners(store)
    assert parent_pid == parent.pid
    if victim in ("parent", "both"):
        os.kill(parent_pid, signal.SIGKILL)
    if victim in ("child", "both"):
        os.kill(child_pid, signal.SIGKILL)
    if victim == "ctrl-c":  # the CLI's parent gets SIGINT; its child, in its own session, does not
        os.kill(parent_pid, signal.SIGINT)
    parent.wait(timeout=60)
    listed = store.list_runs()[0]
    assert listed == [] or pid_gone(child_pid) or victim in ("child", "ctrl-c")  # none while the child lives on
    _wait_for(lambda: pid_gone(child_pid))
    runs, damaged = store.list_runs()
    assert damaged == [] and [r.run_id for r in runs] == [staged.name] and not staged.exists()
    run = runs[0]
    assert run.status == "interrupted"
    if victim == "child":  # the parent lived to file it
        assert parent.returncode == 0 and run.record["message"].startswith("the child was stopped by SIGKILL")
        assert run.record["child"]["returncode"] == -signal.SIGKILL
    elif victim == "ctrl-c":  # the parent stopped its child and filed the run
        assert parent.returncode == 0 and run.record["message"] == "interrupted by Ctrl-C: the child was stopped"
        assert run.record["child"]["returncode"] == -signal.SIGKILL
    else:
        assert parent.returncode == -signal.SIGKILL and run.record["message"].startswith("interrupted: the process")
    assert "run.json" in run.record["files"] and "trace.json.gz" not in run.record["files"]


@pytest.mark.slow  # starts a child process or runs seconds of real steps
def test_cancel_stops_the_child_before_the_next_queued_run_starts(tmp_path):
    store = RunStore(tmp_path)
    for _ in range(3):
        cancel, results = threading.Event(), {}

        def run(name, options, cancel=None, results=results):
            results[name] = profile_run(_setup(), options, store, cancel=cancel)

        hang = RunOptions(device="cpu", steps=1, warmup=0, inject="hang")
        first = threading.Thread(target=run, args=("first", hang, cancel))
        first.start()
        _owners(store)
        # The next job starts while the first is still running, as a queue that gave up on it would.
        second = threading.Thread(target=run, args=("second", RunOptions(device="cpu", steps=1, inject="error")))
        second.start()
        time.sleep(0.2)
        cancel.set()
        first.join(60)
        second.join(120)
        a, b = results["first"], results["second"]
        assert (a.status, b.status) == ("cancelled", "failed")
        assert a.record["child"]["ended_unix_s"] <= b.record["child"]["started_unix_s"]
        assert a.record["finished_utc"] <= b.record["created_utc"]  # filed before the next was created


@pytest.mark.slow  # starts a child process or runs seconds of real steps
def test_kill_9_of_the_app_during_a_run_files_it_interrupted_and_its_folders_go(tmp_path):
    gradio_client = pytest.importorskip("gradio_client")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, TMPDIR=str(tmp_path), GRADIO_ANALYTICS_ENABLED="False")
    env.pop("GRADIO_TEMP_DIR", None)
    argv = [sys.executable, "app.py", "--port", str(port), "--traces", str(tmp_path / "runs")]
    served = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = _connect(gradio_client, f"http://127.0.0.1:{port}/")
        client.submit(model="tiny", seq=64, micro_batch=1, device="cpu", steps=100, api_name="/profile")
        staged, (app_pid, child_pid) = _owners(RunStore(tmp_path / "runs"))
        assert app_pid == served.pid
        (tmp_path / f"advisor-uploads-{app_pid}" / "a1").mkdir(parents=True)  # an upload in its cache
    finally:
        served.kill()
        served.wait()
    _wait_for(lambda: pid_gone(child_pid))  # its next progress line meets the dead app's pipe
    runs, damaged = RunStore(tmp_path / "runs").list_runs()
    assert damaged == [] and [(r.run_id, r.status) for r in runs] == [(staged.name, "interrupted")]
    assert (tmp_path / f"advisor-uploads-{app_pid}").is_dir()
    code = "import app, webui.common as c; print(c.remove_dead_folders())"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    assert str(tmp_path / f"advisor-uploads-{app_pid}") in out.stdout
    assert not (tmp_path / f"advisor-uploads-{app_pid}").exists()


def _connect(gradio_client, url: str, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return gradio_client.Client(url, verbose=False, download_files=False)
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_runs_of_two_processes_take_turns_on_the_device(tmp_path, monkeypatch):
    # The app and a CLI run (or two apps) on one machine: the second waits for the first's lock on the
    # device, a Cancel while waiting runs nothing, and the kernel frees the lock when its holder dies.
    monkeypatch.setattr(launcher.tempfile, "gettempdir", lambda: str(tmp_path))
    path = launcher.device_lock_path("cpu")
    assert path == tmp_path / "advisor-device-cpu.lock"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); "
            "print('held', flush=True); time.sleep(600)",
            str(path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        cancel, said = threading.Event(), []

        def progress(done, total, message):
            said.append(message)
            cancel.set()

        with pytest.raises(AdvisorError) as err, launcher._device_turn(cancel, progress, "cpu"):
            raise AssertionError("ran while another process held the device")
        assert str(err.value) == (
            "cancelled while waiting for another process's run on this machine's cpu to stop; nothing ran"
        )
        assert said == ["waiting for another process's run on this machine's cpu to stop"]
        assert launcher._DEVICE.acquire(blocking=False)  # this process's lock was given back
        launcher._DEVICE.release()
        entered = threading.Event()
        waiter = threading.Thread(target=lambda: _take_turn(entered))
        waiter.start()
        time.sleep(0.3)
        assert not entered.is_set()  # still waiting on the other process
        holder.kill()
        holder.wait()
        waiter.join(timeout=30)
        assert entered.is_set()  # the holder's death freed the device
    finally:
        holder.kill()
        holder.wait()


def test_a_store_that_cannot_hold_runs_is_said_before_waiting_for_the_device(tmp_path, monkeypatch):
    # Another run holds the device: a --traces that names a file is refused at once, not after that run
    # (seen in the suite while another process profiled: the message came after "waiting for ...").
    import fcntl

    monkeypatch.setattr(launcher.tempfile, "gettempdir", lambda: str(tmp_path))
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    said, cancel = [], threading.Event()

    def progress(done, total, message):
        said.append(message)
        cancel.set()  # a wait would end here, as "cancelled while waiting"

    with open(launcher.device_lock_path("cpu"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second open file in this process cannot take it either
        with pytest.raises(AdvisorError) as err:
            profile_run(make_setup(model="tiny", gpu="cpu", seq=64), RunOptions(device="cpu"), RunStore(a_file),
                        on_progress=progress, cancel=cancel)  # fmt: skip
    assert str(err.value) == f"run store {a_file} is a file, not a folder; give --traces a folder"
    assert said == [] and a_file.read_text() == ""


def _take_turn(entered: threading.Event) -> None:
    with launcher._device_turn(None, None, "cpu"):
        entered.set()


def test_ctrl_c_just_after_the_child_starts_stops_it_and_files_the_run(tmp_path, monkeypatch):
    # A Ctrl-C between the child's start and the wait for it (its owner just written, the log reader
    # starting) escaped the wait: this process died and the child ran on (seen once in the suite as
    # test_kill_9_during_a_run_leaves_the_run_filed_as_interrupted[ctrl-c] with returncode -2).
    owner = launcher.add_owner

    def then_ctrl_c(run_dir, pid):
        owner(run_dir, pid)
        raise KeyboardInterrupt

    monkeypatch.setattr(launcher, "add_owner", then_ctrl_c)
    cmd = [sys.executable, "-c", "import time; time.sleep(120)"]
    status, message, child = launcher._watch(cmd, tmp_path, 60, None, None)
    assert (status, message) == ("interrupted", "interrupted by Ctrl-C: the child was stopped")
    assert child["returncode"] == -signal.SIGKILL and pid_gone(child["pid"])
