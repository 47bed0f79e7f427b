"""The run store: ids validated, commits atomic, damaged runs reported, not fatal, orphans removed."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from advisor.errors import AdvisorError
from advisor.store.runstore import OWNER_FILE, STAGING, RunStore, add_owner, check_run_id, new_run_id, write_json_atomic


def _commit(store, status="ok", metrics=True):
    run_id = new_run_id("Llama 3.1/8B")
    d = store.staging_dir(run_id)
    write_json_atomic(d / "run.json", {"run_id": run_id, "status": status})
    if metrics:
        # The fields StepMetrics cannot do without, and those a finished profiled run always has.
        minimal = {"run_id": run_id, "source": "profile", "model_name": "tiny", "device_type": "cpu"}
        (d / "metrics.json").write_text(json.dumps(minimal))
    store.commit(run_id)
    return run_id


def test_run_ids_are_validated():
    run_id = new_run_id("Llama 3.1/8B", now=0)
    assert run_id.startswith("19700101-000000-llama-3.1-8b-") and check_run_id(run_id) == run_id
    for bad in ("../../etc/passwd", "20260101-000000-x-zzzzzz", "", None, "20260101-000000-/tmp-abcdef", 42):
        with pytest.raises(AdvisorError, match="is not valid"):
            check_run_id(bad)


def test_commit_is_one_rename_and_listing_skips_staging(tmp_path):
    store = RunStore(tmp_path)
    done = _commit(store)
    half = new_run_id("tiny")
    store.staging_dir(half)  # a run still being written (or left by a crash): not listed
    runs, damaged = store.list_runs()
    assert [r.run_id for r in runs] == [done] and damaged == []
    # The committed run moved out of the staging area whole: its folder there is gone, its files here.
    assert not (tmp_path / STAGING / done).exists() and (tmp_path / STAGING / half).is_dir()
    assert sorted(p.name for p in (tmp_path / done).iterdir()) == ["metrics.json", "run.json"]
    with pytest.raises(AdvisorError, match="refusing to commit a half-written run"):
        store.commit(half)


def test_damaged_runs_are_reported_not_fatal(tmp_path):
    store = RunStore(tmp_path)
    good = _commit(store)
    no_metrics = _commit(store, metrics=False)
    bad_json = new_run_id("x")
    (tmp_path / bad_json).mkdir()
    (tmp_path / bad_json / "run.json").write_text("{oops")
    (tmp_path / "notes").mkdir()
    runs, damaged = store.list_runs()
    assert [r.run_id for r in runs] == [good]
    assert dict(damaged) == {
        no_metrics: "status ok but metrics.json is missing",
        bad_json: "run.json is unreadable (JSONDecodeError)",
        "notes": "name is not a run id",
    }
    with pytest.raises(AdvisorError, match=r"is damaged: run\.json is unreadable"):
        store.load(bad_json)


def test_paths_stay_inside_the_store(tmp_path):
    store = RunStore(tmp_path / "traces")
    with pytest.raises(AdvisorError, match="is not valid"):
        store.path("../traces")
    with pytest.raises(AdvisorError, match="no run"):
        store.path(new_run_id("tiny"))


def test_write_json_atomic_leaves_no_temporary_files(tmp_path):
    target = tmp_path / "run.json"
    write_json_atomic(target, {"status": "ok"})
    write_json_atomic(target, {"status": "failed"})
    assert json.loads(target.read_text()) == {"status": "failed"}
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("{oops", "metrics.json is unreadable (JSONDecodeError)"),
        ("[1, 2]", "metrics.json is a JSON list, not an object of StepMetrics fields"),
        ('{"step_time_ms": 3.0}', "metrics.json lacks the field(s) run_id, source (a string each)"),
        ('{"run_id": "r", "source": "profile", "step_time_ms": "fast"}', "metrics.json has step_time_ms='fast'"),
    ],
)
def test_a_run_with_a_damaged_metrics_json_is_listed_as_damaged(tmp_path, text, reason):
    store = RunStore(tmp_path)
    good, bad = _commit(store), _commit(store)
    (tmp_path / bad / "metrics.json").write_text(text)
    runs, damaged = store.list_runs()
    assert [r.run_id for r in runs] == [good]
    assert len(damaged) == 1 and damaged[0][0] == bad and damaged[0][1].startswith(reason)
    with pytest.raises(AdvisorError, match=f"run {bad} is damaged: metrics.json"):
        store.load(bad)
    # A run handed out before its file was damaged: its metrics name the file, never a JSON traceback.
    info = runs[0]
    (info.path / "metrics.json").write_text(text)
    with pytest.raises(AdvisorError, match=r"metrics\.json .*; the run is damaged"):
        info.metrics()


def test_staging_dirs_of_dead_processes_are_removed_and_no_others(tmp_path):
    store = RunStore(tmp_path)
    staging = tmp_path / STAGING
    # A process that staged a run and was killed before its commit (os._exit: no cleanup runs).
    code = (
        "import os, sys; from advisor.store.runstore import RunStore, new_run_id; "
        "print(RunStore(sys.argv[1]).staging_dir(new_run_id('tiny')).name, flush=True); os._exit(9)"
    )
    repo = Path(__file__).resolve().parents[1]
    argv = [sys.executable, "-c", code, str(tmp_path)]
    proc = subprocess.run(argv, cwd=repo, capture_output=True, text=True, check=False)
    dead = proc.stdout.strip()
    assert proc.returncode == 9 and (staging / dead / OWNER_FILE).is_file()
    live = store.staging_dir(new_run_id("tiny"))  # this process: alive
    record = json.loads((live / OWNER_FILE).read_text())
    assert [o["pid"] for o in record["owners"]] == [os.getpid()] and record["machine"]["host"]
    legacy = staging / new_run_id("old")  # staged before owners were recorded: owner unknown
    legacy.mkdir()
    dead_pid = {"pid": 2**22 + 1, "start": None}  # above Linux's pid_max: no such process
    # Staged on another node, or in another container of this host (same hostname, its own PID
    # namespace, where our pids mean nothing): never judged from here.
    remote = staging / new_run_id("remote")
    remote.mkdir()
    (remote / OWNER_FILE).write_text(
        json.dumps({"machine": record["machine"] | {"host": "node7"}, "owners": [dead_pid]})
    )
    sibling = staging / new_run_id("sibling")
    sibling.mkdir()
    (sibling / OWNER_FILE).write_text(json.dumps({"machine": record["machine"] | {"pidns": 1}, "owners": [dead_pid]}))
    # A staging process killed while its profiling child runs on: the child keeps the run staged.
    orphaned_parent = staging / new_run_id("child")
    orphaned_parent.mkdir()
    (orphaned_parent / OWNER_FILE).write_text(json.dumps({"machine": record["machine"], "owners": [dead_pid]}))
    add_owner(orphaned_parent, os.getpid())
    # A reused pid: this process's pid with another start time is not the owner that started then.
    reused = staging / new_run_id("reused")
    reused.mkdir()
    owner = {"pid": os.getpid(), "start": "1"}
    (reused / OWNER_FILE).write_text(json.dumps({"machine": record["machine"], "owners": [owner]}))
    outside = tmp_path / "notes"  # beside the staging area: never touched
    outside.mkdir()
    runs, damaged = store.list_runs()
    kept = [live.name, legacy.name, remote.name, sibling.name, orphaned_parent.name]
    assert sorted(p.name for p in staging.iterdir()) == sorted(kept)
    assert outside.is_dir() and runs == [] and damaged == [("notes", "name is not a run id")]
    # A committed run carries no owner file.
    write_json_atomic(live / "run.json", {"run_id": live.name, "status": "failed"})
    assert not (store.commit(live.name) / OWNER_FILE).exists()


def test_a_store_that_cannot_be_written_is_a_clear_error(tmp_path):
    a_file = tmp_path / "traces"
    a_file.write_text("")
    with pytest.raises(AdvisorError, match=r"run store .*traces is a file, not a folder"):
        RunStore(a_file).staging_dir(new_run_id("tiny"))
    with pytest.raises(AdvisorError, match=r"cannot create the staging folder .*: Not a directory"):
        RunStore(a_file / "inner").staging_dir(new_run_id("tiny"))


def test_a_relative_store_is_made_absolute(tmp_path, monkeypatch):
    # The profiling child runs in the repository root: a relative --traces must not name a folder there.
    monkeypatch.chdir(tmp_path)
    store = RunStore("mytraces")
    assert store.root == tmp_path / "mytraces" and store.root.is_absolute()
    monkeypatch.setenv("ADVISOR_TRACES_DIR", "elsewhere")
    assert RunStore().root == tmp_path / "elsewhere"


def _set_json(name: str, value: object):
    """A damage: ``name`` in the run directory rewritten as ``value`` (text as is, else JSON)."""

    def damage(d: Path) -> None:
        (d / name).write_text(value if isinstance(value, str) else json.dumps(value))

    return damage


def _patch_metrics(**changes):
    def damage(d: Path) -> None:
        m = json.loads((d / "metrics.json").read_text())
        m.update(changes)
        for k in [k for k, v in changes.items() if v is None]:
            del m[k]
        (d / "metrics.json").write_text(json.dumps(m))  # json writes float('nan') as NaN, as Python reads it

    return damage


def _link_trace(d: Path) -> None:
    (d / "trace.json.gz").symlink_to("/etc/passwd")


# Each damage the issue 22 audit found listed as ok (and then an "Internal error" on open, advise or
# plan), with the reason the listing now gives.
DAMAGES = [
    (_patch_metrics(world_size=math.nan), "metrics.json has world_size=nan: expected an integer or null"),
    (_patch_metrics(world_size=2**40), "metrics.json has world_size=1099511627776: expected an integer from 1"),
    (_patch_metrics(step_time_ms=math.inf), "metrics.json has step_time_ms=inf: expected a finite number or null"),
    (_patch_metrics(model_name=None), "metrics.json lacks model_name (a string each, as every profiled run has)"),
    (_patch_metrics(nvml="x"), "metrics.json has nvml='x': expected an object"),
    (_patch_metrics(world_size=2), "metrics.json has world_size=2 but rank_step_time_ms is not a list of 2 numbers"),
    (
        _patch_metrics(world_size=2, rank_step_time_ms=[1.0, 2.0], rank_peak_memory_bytes=[1, -5]),
        "metrics.json has world_size=2 but rank_peak_memory_bytes is not a list of 2 numbers >= 0",
    ),
    (_set_json("top_ops.json", "{oops"), "top_ops.json is unreadable (JSONDecodeError)"),
    (_set_json("top_ops.json", {"name": "mm"}), "top_ops.json holds a JSON dict, not a list of ops"),
    (_set_json("top_ops.json", [{"name": "mm", "self_cpu_us": "x"}]), "top_ops.json row 0 has self_cpu_us='x'"),
    (_set_json("top_ops.json", [{"calls": 3}]), "top_ops.json row 0 has no name (a string)"),
    (_set_json("nvml.json", []), "nvml.json is not an object with a list of samples"),
    (
        _set_json("nvml.json", '{"samples": [{"t_s": 1, "power_w": NaN}]}'),
        "nvml.json row 0 has power_w=nan: expected a finite",
    ),
    (_link_trace, "trace.json.gz is a symbolic link; a run's files must be inside its folder"),
    (_set_json("run.json", {"status": "ok", "setup": [1]}), "run.json has a setup that is not an object"),
    (_set_json("run.json", {"status": "ok", "message": {"a": 1}}), "run.json has message={'a': 1}: expected a string"),
]


@pytest.mark.parametrize(("damage", "reason"), DAMAGES)
def test_damaged_files_are_listed_with_the_reason_and_the_other_runs_stay_usable(tmp_path, damage, reason):
    from advisor.advice.commlinks import link_for
    from advisor.spec.presets import cpu_host
    from advisor.store.history import DAMAGED, run_table

    store = RunStore(tmp_path)
    good, bad = _commit(store), _commit(store)
    for run_id in (good, bad):  # what a finished profiled run holds beside its metrics
        _set_json("top_ops.json", [{"name": "aten::mm", "calls": 2, "self_cpu_us": 10.5}])(tmp_path / run_id)
        _set_json("nvml.json", {"summary": {}, "samples": [{"t_s": 0.0, "gpu_util_pct": 50}]})(tmp_path / run_id)
    damage(tmp_path / bad)
    runs, damaged = store.list_runs()
    assert [r.run_id for r in runs] == [good]
    assert len(damaged) == 1 and damaged[0][0] == bad and damaged[0][1].startswith(reason), damaged
    with pytest.raises(AdvisorError, match=f"run {bad} is damaged"):
        store.load(bad)
    table = run_table(store)
    assert table.set_index("run_id")["status"].to_dict() == {good: "ok", bad: DAMAGED}
    assert link_for(store, cpu_host()) is None  # the store-wide readers pass the damaged run over
    info = store.load(good)
    assert info.top_ops()[0]["name"] == "aten::mm" and info.nvml_samples()[0]["gpu_util_pct"] == 50


def test_a_run_folder_that_is_a_link_is_damaged(tmp_path):
    store = RunStore(tmp_path / "store")
    good = _commit(store)
    elsewhere = RunStore(tmp_path / "elsewhere")
    other = _commit(elsewhere)
    (store.root / other).symlink_to(elsewhere.root / other)
    runs, damaged = store.list_runs()
    assert [r.run_id for r in runs] == [good]
    assert damaged == [(other, "is a symbolic link; a run must be a folder inside the store")]


def test_files_damaged_after_the_listing_name_the_file_when_read(tmp_path):
    store = RunStore(tmp_path)
    info = store.load(_commit(store))
    (info.path / "top_ops.json").write_text('{"oops": 1}')
    with pytest.raises(AdvisorError, match=r"top_ops\.json holds a JSON dict, not a list of ops; the run is damaged"):
        info.top_ops()
    (info.path / "nvml.json").write_text('{"samples": "none"}')
    with pytest.raises(AdvisorError, match=r"nvml\.json is not an object with a list of samples; the run is damaged"):
        info.nvml_samples()
