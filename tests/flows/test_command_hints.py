"""The commands bhfl's hints print (``open the UI: ...``) run as printed, however bhfl was installed."""

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from flows.cli.shell import command_of
from tests.small import REPO


@pytest.mark.parametrize("script", ["bhfl", "no-such-script"])  # the installed script, or this python's -m
def test_a_printed_bhfl_command_runs_from_where_the_user_stands(script, monkeypatch):
    monkeypatch.chdir(REPO)
    command = command_of(script, "flows.cli.main")
    if script == "bhfl":  # scripts/test.sh's python is .venv/bin/python: its bhfl, found on the PATH or not
        assert command in ("bhfl", str(Path(sys.executable).with_name("bhfl").relative_to(REPO)))
    else:
        assert command == f"{sys.executable} -m flows.cli.main"
    out = subprocess.run([*shlex.split(command), "--version"], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0 and "bhfl" in out.stdout, out.stderr[-2000:]


def test_outside_the_checkout_the_script_is_named_by_its_whole_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # not found by the shell: its path is what runs it
    assert command_of("bhfl", "flows.cli.main") == str(Path(sys.executable).with_name("bhfl").absolute())
