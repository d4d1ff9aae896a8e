"""The CLI as a user meets it: help, clean errors for bad input, no stack traces."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BHFL = [sys.executable, "-m", "flows.cli.app"]


def run(*args, cwd=REPO):
    return subprocess.run([*BHFL, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


def test_help_lists_commands():
    out = run("--help")
    assert out.returncode == 0 and "run" in out.stdout and "ui" in out.stdout
    out = run("run", "--help")
    assert "--set" in out.stdout and "--run-dir" in out.stdout and "--tracking-uri" in out.stdout


def test_unknown_key_is_a_clean_error(tmp_path):
    out = run("run", "--set", "tree.root.roundz=2", "--run-dir", str(tmp_path))
    assert out.returncode == 2
    assert "tree.root.roundz: unknown key" in out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    assert not (tmp_path / "mlflow.db").exists()  # nothing started, nothing written


def test_missing_config_file_and_impossible_tree(tmp_path):
    out = run("run", str(tmp_path / "nope.yaml"))
    assert out.returncode == 2 and "not found" in out.stderr
    out = run("run", "--set", "tree.edge.cohort=50", "--run-dir", str(tmp_path))
    assert out.returncode == 2 and "tree.edge.cohort: cohort of 50 is larger than the 6 children" in out.stderr


def test_ui_without_store_says_what_to_do(tmp_path):
    out = run("ui", "--run-dir", str(tmp_path / "empty"))
    assert out.returncode == 2 and "run `bhfl run` first" in out.stderr
