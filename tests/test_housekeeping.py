"""What the app leaves on disk (uploads, reports) and how it answers password guessing."""

import asyncio
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import app
from webui import common
from webui.analyze import analyze_view

REPO = Path(__file__).resolve().parents[1]


def test_a_refused_upload_is_removed_from_the_upload_cache_and_nothing_outside_it(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(cache))
    upload = cache / "3f2a" / "trace.json"  # Gradio keeps each upload in a folder of its own
    upload.parent.mkdir(parents=True)
    upload.write_text('{"traceEvents": [{"ph": "X", "name": "k", "ts": 1e30, "dur": 1}]}')
    message = analyze_view(str(upload), None)[0]
    assert message.startswith("### Cannot analyze this trace") and "trace.json" in message
    assert not upload.exists() and not upload.parent.exists() and cache.is_dir()
    outside = tmp_path / "mine.json"  # a path that is not an upload is never removed
    outside.write_text("not json")
    common.discard_upload(str(outside))
    common.discard_upload(str(cache))
    assert outside.is_file() and cache.is_dir()


def test_folders_of_dead_app_processes_are_removed_and_live_ones_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead, live = tmp_path / f"advisor-reports-{2**22 + 1}", tmp_path / f"advisor-uploads-{os.getpid()}"
    other = tmp_path / f"advisor-notes-{2**22 + 1}"  # not a kind the app makes
    for d in (dead, live, other):
        (d / "x").mkdir(parents=True)
    assert common.remove_dead_folders() == [str(dead)]
    assert not dead.exists() and live.is_dir() and other.is_dir()
    assert common.process_folder("reports") == str(tmp_path / f"advisor-reports-{os.getpid()}")


@pytest.mark.slow  # starts a child process or runs seconds of real steps
def test_the_report_folder_goes_when_the_process_exits(tmp_path):
    code = "from webui import common; r = common.download_root(); open(r + '/x.md', 'w').close(); print(r)"
    env = dict(os.environ, TMPDIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    root = Path(out.stdout.strip())
    assert root.parent == tmp_path and root.name.startswith("advisor-reports-") and not root.exists()


def test_gradio_cleans_its_cache_on_a_schedule():
    assert app.build_app().delete_cache == (app.CACHE_AGE_S, app.CACHE_AGE_S) == (3600, 3600)


def test_login_guessing_is_limited_per_name_and_in_all():
    now = [0.0]
    check = app.rate_limited_auth([("ana", "secret"), ("bo", "pw")], clock=lambda: now[0], fail_delay_s=0)

    def login(user, password):
        return asyncio.run(check(user, password))

    assert login("ana", "secret") and not login("ana", "secrets") and not login("nobody", "secret")
    assert [login("ana", f"guess{i}") for i in range(4)] == [False] * 4  # 5 wrong for ana now
    assert not login("ana", "secret")  # locked, even with the right password
    assert login("bo", "pw")  # another name is not
    now[0] = 59.9
    assert not login("ana", "secret")
    now[0] = 60.0  # the first failures left the window
    assert login("ana", "secret")
    # 50 wrong passwords over many names (issue 22 sent 50 in 0.19 s): after 30 in a minute, all refused.
    results = [login(f"user{i}", "x") for i in range(50)]
    assert results == [False] * 50 and not login("bo", "pw")
    now[0] = 120.0
    assert login("bo", "pw")
