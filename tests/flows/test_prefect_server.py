"""The command's own Prefect server and the migrated store templates new stores start from.

Real servers on real SQLite files: the first server on a new database migrates it and
leaves it as the template; a second server on a copy of it starts without migrating
and runs a flow with a subflow and a task that the API then lists. The template code
never replaces a store that exists (not even in a race), ignores templates of another
version and refuses stores that hold user data. Templates live in a per-test folder
(``BHFL_STORE_TEMPLATES``), never in the user's cache.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from flows.services import store_templates
from flows.services.prefect_server import PrefectServer, prefect_version, start_server
from flows.services.store_templates import (
    save_template,
    seed,
    sqlite_from_template,
    template_path,
)
from tests.flows.prefect_api import api

pytestmark = pytest.mark.integration

FLOW = """
from prefect import flow, task
from prefect.settings import temporary_settings

@task
def double(x: int) -> int:
    return 2 * x

@flow(name="child-flow")
def child(x: int) -> int:
    return double(x)

@flow(name="parent-flow")
def parent() -> int:
    return child(21)

with temporary_settings(updates={"flows.heartbeat_frequency": None}):
    assert parent() == 42
"""


@pytest.fixture
def templates(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "templates"
    monkeypatch.setenv(store_templates.ENV, str(folder))
    for key in list(os.environ):  # the session's test harness must not leak into our servers
        if key.startswith(("PREFECT_API_", "PREFECT_SERVER_DATABASE")):
            monkeypatch.delenv(key)
    return folder


def _start(home: Path, monkeypatch) -> PrefectServer:
    monkeypatch.setenv("PREFECT_HOME", str(home))
    return start_server(home / "server.log", full=False)


def test_server_on_a_copied_template_runs_a_flow(templates, tmp_path, monkeypatch):
    version = prefect_version()
    first_db = tmp_path / "first" / "prefect.db"
    with _start(first_db.parent, monkeypatch) as first:  # no template yet: this one migrates
        assert first.database == first_db, "a database the server creates is the template candidate"
        first.wait_healthy(240)
    template = template_path("prefect", version)
    assert template is not None and template.is_file(), (first_db.parent / "server.log").read_text()[-3000:]

    home = tmp_path / "second"
    t0 = time.monotonic()
    server = _start(home, monkeypatch)
    try:
        assert time.monotonic() - t0 < 2, "start_server returns while the server boots"
        assert (home / "prefect.db").is_file() and server.database is None, "started from the template copy"
        server.wait_healthy(240)
        # block registration is skipped on a copy: the template brought the block types along
        assert any(b["slug"] == "local-file-system" for b in api(f"{server.api_url}/block_types/filter", {}))
        env = {**os.environ, "PREFECT_API_URL": server.api_url, "PREFECT_LOGGING_LEVEL": "WARNING"}
        done = subprocess.run(
            [sys.executable, "-c", FLOW], env=env, capture_output=True, text=True, timeout=180, check=False
        )
        assert done.returncode == 0, done.stderr[-3000:]

        runs = {r["name"]: r for r in api(f"{server.api_url}/flow_runs/filter", {})}
        flows = {f["id"]: f["name"] for f in api(f"{server.api_url}/flows/filter", {})}
        by_flow = {flows[r["flow_id"]]: r for r in runs.values()}
        assert set(by_flow) == {"parent-flow", "child-flow"}
        assert all(r["state_type"] == "COMPLETED" for r in by_flow.values())
        assert by_flow["child-flow"]["parent_task_run_id"], "the child is a subflow of the parent"
        deadline = time.monotonic() + 30  # task runs are recorded from events, a moment later
        while True:
            tasks = api(f"{server.api_url}/task_runs/filter", {})
            doubles = [t for t in tasks if t["task_key"].startswith("double")]
            if (doubles and doubles[0]["state_type"] == "COMPLETED") or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert [t["flow_run_id"] for t in doubles] == [by_flow["child-flow"]["id"]]
        assert doubles[0]["state_type"] == "COMPLETED"
        assert save_template(home / "prefect.db", "prefect", version) is False  # there is one already
    finally:
        server.stop()
    assert server.proc.returncode is not None
    # the template itself is still pristine: no flow run of this test went into it
    with sqlite3.connect(template) as conn:
        assert conn.execute("SELECT count(*) FROM flow_run").fetchone()[0] == 0


def test_wait_healthy_fails_fast_when_the_server_dies(templates, tmp_path, monkeypatch):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    monkeypatch.setenv("PREFECT_API_DATABASE_CONNECTION_URL", f"sqlite+aiosqlite:///{not_a_folder}/sub/prefect.db")
    server = _start(tmp_path / "home", monkeypatch)
    with pytest.raises(RuntimeError, match="exited with code"):
        server.wait_healthy(120)
    assert server.proc.poll() is not None
    assert not list(templates.glob("*.db")), "the user's own database is never a template"


def _store(path: Path, rows: int = 0) -> Path:
    """A stand-in for a migrated Prefect database: alembic version, block types, ``rows`` flow runs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE alembic_version (version_num TEXT)")
        conn.execute("INSERT INTO alembic_version VALUES ('head')")
        conn.execute("CREATE TABLE block_type (name TEXT)")
        conn.execute("INSERT INTO block_type VALUES ('local-file-system')")
        for table in (
            "flow",
            "flow_run",
            "task_run",
            "deployment",
            "automation",
            "variable",
            "artifact",
            "log",
            "events",
        ):
            conn.execute(f"CREATE TABLE {table} (id TEXT)")
        conn.executemany("INSERT INTO flow_run VALUES (?)", [(str(i),) for i in range(rows)])
    conn.close()
    return path


def test_seed_never_overwrites_an_existing_store(templates, tmp_path, monkeypatch):
    assert save_template(_store(tmp_path / "made" / "prefect.db"), "prefect", "9.9")
    mine = _store(tmp_path / "mine" / "prefect.db", rows=3)
    before = mine.read_bytes()
    assert seed(mine, "prefect", "9.9") is False
    assert mine.read_bytes() == before

    # a deleted store's journal or WAL would be replayed into the copy: leave it alone
    gone = tmp_path / "gone" / "prefect.db"
    gone.parent.mkdir()
    Path(f"{gone}-wal").write_bytes(b"stale")
    assert seed(gone, "prefect", "9.9") is False and not gone.exists()

    # the store appears while the template is being copied (another process): it wins
    racing = tmp_path / "race" / "prefect.db"
    real_copy = store_templates.shutil.copyfile

    def copy_then_race(src, dst):
        real_copy(src, dst)
        _store(racing, rows=1)

    monkeypatch.setattr(store_templates.shutil, "copyfile", copy_then_race)
    assert seed(racing, "prefect", "9.9") is False
    with sqlite3.connect(racing) as conn:
        assert conn.execute("SELECT count(*) FROM flow_run").fetchone()[0] == 1
    assert [p.name for p in racing.parent.iterdir()] == ["prefect.db"], "no temporary file left behind"


def test_template_of_another_version_is_not_used(templates, tmp_path):
    assert save_template(_store(tmp_path / "made" / "prefect.db"), "prefect", "1.0.0")
    fresh = tmp_path / "new" / "prefect.db"
    assert seed(fresh, "prefect", "1.0.1") is False and not fresh.exists()
    assert seed(fresh, "prefect", "1.0.0") is True and fresh.is_file()
    assert template_path("prefect", "1.0.0") != template_path("prefect", "1.0.1")
    assert template_path("mlflow", "1.0.0") != template_path("prefect", "1.0.0")


def test_templates_can_be_switched_off(tmp_path, monkeypatch):
    monkeypatch.setenv(store_templates.ENV, "off")
    assert template_path("prefect", "1.0") is None
    assert save_template(_store(tmp_path / "a" / "prefect.db"), "prefect", "1.0") is False
    assert seed(tmp_path / "b" / "prefect.db", "prefect", "1.0") is False


def test_a_used_or_unmigrated_store_is_never_a_template(templates, tmp_path):
    assert save_template(_store(tmp_path / "used" / "prefect.db", rows=1), "prefect", "2.0") is False
    empty = tmp_path / "empty" / "prefect.db"
    empty.parent.mkdir()
    sqlite3.connect(empty).close()
    assert save_template(empty, "prefect", "2.0") is False
    assert not list(templates.glob("*.db")) and not list(templates.glob(".*"))


def test_concurrent_first_runs_write_one_whole_template(templates, tmp_path):
    source = _store(tmp_path / "src" / "prefect.db")
    barrier = threading.Barrier(8)
    results: list[bool] = []

    def save() -> None:
        barrier.wait()
        results.append(save_template(source, "prefect", "3.0"))

    threads = [threading.Thread(target=save) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert any(results)
    assert sorted(p.name for p in templates.iterdir()) == [template_path("prefect", "3.0").name]
    with sqlite3.connect(template_path("prefect", "3.0")) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert conn.execute("SELECT count(*) FROM block_type").fetchone()[0] == 1


def test_mlflow_store_from_template_writes_and_reads_runs(templates, tmp_path, monkeypatch):
    import mlflow
    from mlflow import MlflowClient

    version = mlflow.__version__
    monkeypatch.chdir(tmp_path)
    for name in ("first", "second"):
        db = tmp_path / name / "mlflow.db"
        with sqlite_from_template(db, "mlflow", version) as seeded:
            client = MlflowClient(f"sqlite:///{db}")
        assert seeded is (name == "second")
        experiment = client.create_experiment("exp", artifact_location=(tmp_path / name / "art").as_uri())
        run = client.create_run(experiment, run_name="parent")
        client.log_metric(run.info.run_id, "eval/union/accuracy", 0.5, step=2)
        client.set_terminated(run.info.run_id)
        assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval/union/accuracy")] == [
            (2, 0.5)
        ]
        default = client.get_experiment("0")  # made for this store, not copied from the template's creator
        assert default.name == "Default" and default.artifact_location.startswith(str(tmp_path / "mlruns"))
        assert [r.info.run_name for r in client.search_runs([experiment])] == ["parent"]
    with sqlite3.connect(template_path("mlflow", version)) as conn:
        assert conn.execute("SELECT count(*) FROM experiments").fetchone()[0] == 0
        assert conn.execute("SELECT count(*) FROM runs").fetchone()[0] == 0
