"""The run store: ids validated, commits atomic, damaged runs reported, not fatal."""

import json

import pytest

from advisor.errors import AdvisorError
from advisor.runstore import RunStore, check_run_id, new_run_id, write_json_atomic


def _commit(store, status="ok", metrics=True):
    run_id = new_run_id("Llama 3.1/8B")
    d = store.staging_dir(run_id)
    write_json_atomic(d / "run.json", {"run_id": run_id, "status": status})
    if metrics:
        (d / "metrics.json").write_text("{}")
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
