"""A full disk is recognised however it is said, and the message names the filesystem (flows/cli/full_disk.py).

The real full disks (tmpfs filled mid-run) are in tests/flows/test_disk_full_run.py; these
are the words each library uses, checked on the filesystem of a temporary folder.
"""

import errno
import os
import sqlite3

import pytest

from flows.cli import full_disk
from flows.cli.errors import EXIT_DISK_FULL, exit_code, explain
from flows.services.prefect_server import OWN_DATABASE_ENV


class _ServerError(Exception):
    """What httpx and Prefect raise for an answer 5xx: the response carries the status."""

    def __init__(self, status: int) -> None:
        super().__init__(f"Server error '{status}' for url 'http://127.0.0.1:4200/api/logs/'")
        self.response = type("Response", (), {"status_code": status})()


def _raised_during(outer: BaseException, inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException:
            raise outer  # noqa: B904 (the chain through __context__ is what is tested)
    except BaseException as exc:
        return exc


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        OSError(errno.EDQUOT, "Disk quota exceeded"),
        Exception("Error while serializing: I/O error: No space left on device (os error 28)"),  # safetensors
        sqlite3.OperationalError("database or disk is full"),  # SQLite under MLflow (SQLAlchemy wraps it)
        ExceptionGroup("two tasks failed", [ValueError("x"), OSError(errno.ENOSPC, "No space left on device")]),
    ],
    ids=["ENOSPC", "EDQUOT", "rust", "sqlite", "group"],
)
def test_every_wording_of_a_full_disk_is_one_paragraph_and_exit_74(error, tmp_path, monkeypatch):
    monkeypatch.setenv(OWN_DATABASE_ENV, str(tmp_path / ".prefect" / "prefect.db"))
    failed = _raised_during(RuntimeError("the flow run failed"), error)
    message = explain(failed, None)
    assert message is not None and message.startswith("The disk is full: the filesystem mounted at "), message
    assert " free of " in message and "\n" not in message
    assert exit_code(failed, None) == EXIT_DISK_FULL


def test_the_file_being_written_names_its_filesystem_and_what_of_the_run_it_holds(tmp_path, monkeypatch):
    monkeypatch.setenv(OWN_DATABASE_ENV, str(tmp_path / ".prefect" / "prefect.db"))
    run_path = tmp_path / "runs" / "itest" / "20261127-000000-000"
    run_path.mkdir(parents=True)
    target = run_path / "state" / "nodes" / "root.safetensors"
    message = explain(OSError(errno.ENOSPC, "No space left on device", str(target)), run_path)
    assert message is not None and message.startswith(f"The disk is full while writing {target}: the filesystem ")
    mount = full_disk._mount_point(tmp_path)
    assert f"mounted at {mount} " in message and "; it holds the run folder, Prefect's database" in message
    assert f"`df -h {mount}`" in message and f"continue with `bhfl resume {run_path}`" not in message  # no config yet


def test_a_server_error_is_a_full_disk_only_where_prefects_database_has_no_room(tmp_path, monkeypatch):
    monkeypatch.setenv(OWN_DATABASE_ENV, str(tmp_path / ".prefect" / "prefect.db"))
    answer = _ServerError(500)
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    monkeypatch.setattr(full_disk, "NEARLY_FULL_BYTES", free // 2)  # room left: a server error is a bug
    assert explain(answer, None) is None and exit_code(answer, None) == 1
    monkeypatch.setattr(full_disk, "NEARLY_FULL_BYTES", free * 2)  # as if nearly full
    message = explain(answer, None)
    assert message is not None and "it holds Prefect's database" in message and exit_code(answer, None) == 74
    assert explain(_ServerError(404), None) is None  # not a server error
    monkeypatch.delenv(OWN_DATABASE_ENV)  # a Prefect server of the user's: its disk is not ours to judge
    assert explain(answer, None) is None


def test_other_errors_are_not_a_full_disk(tmp_path, monkeypatch):
    monkeypatch.setenv(OWN_DATABASE_ENV, str(tmp_path / ".prefect" / "prefect.db"))
    for error in (OSError(errno.EACCES, "Permission denied"), RuntimeError("a bug")):
        assert explain(error, None) is None and exit_code(error, None) == 1
