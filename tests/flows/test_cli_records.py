"""What ``bhfl`` reads and what it leaves: commands that only read create nothing, and files are UTF-8 whatever
the locale.

Job folders are made as a job leaves them (records and configs written directly); nothing is trained or resumed
for real: each resume here is refused or finds nothing to do.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from flows.cli.app import app
from tests.flows.commands import cli

pytestmark = pytest.mark.integration


def test_a_non_utf8_locale_reads_our_utf8_files_and_prints_what_it_cannot_show_as_a_question_mark(tmp_path):
    # Under a non-UTF-8 locale (ASCII here: the C locale with Python's UTF-8 mode off) files took the locale's
    # encoding: a sweep record holding a UTF-8 value (an edit, or a tool that does not escape) listed as
    # "unreadable" and refused its resume; and the terminal's strict encoding made `bhfl compare --help` (its "±")
    # a UnicodeEncodeError traceback.
    from flows.records.sweep_record import PointRecord, SweepRecord

    folder = tmp_path / "sw" / "20260101-000000-000"
    folder.mkdir(parents=True)
    (folder / "sweep.yaml").write_text("{}\n", encoding="utf-8")  # (not read by the listing or a finished resume)
    point = PointRecord(config_hash="0" * 16, values={"data.source.path": "/data/café"}, status="finished")
    record = SweepRecord(name="sw", status="finished", started=1.7e9, points={"path=café": point})
    (folder / "sweep.json").write_text(json.dumps(record.model_dump(), ensure_ascii=False), encoding="utf-8")
    ascii_locale = {"LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}

    listed = cli("runs", "--run-dir", str(tmp_path), env=ascii_locale)
    assert listed.returncode == 0, listed.stderr[-3000:]
    assert listed.stdout.startswith("sweep sw/20260101-000000-000  finished  "), listed.stdout
    assert "    path=caf?: finished  (not started)" in listed.stdout  # "é" is no ASCII: shown as "?"
    resumed = cli("resume", str(folder), env=ascii_locale)
    assert resumed.returncode == 0 and f"sweep {folder} finished; nothing to resume" in resumed.stderr, resumed.stderr

    helped = cli("compare", "--help", env=ascii_locale)
    assert helped.returncode == 0, helped.stderr[-3000:]
    assert "mean ? std" in " ".join(helped.stdout.split()) and "Traceback" not in helped.stderr


def test_commands_that_only_read_make_no_run_dir(tmp_path, monkeypatch):
    # `bhfl runs SOMEID` or `bhfl resume SOMEID` typed in a folder without runs left an empty ./runs/ behind
    monkeypatch.chdir(tmp_path)
    spec = "0123abcd0123"
    for command, code in (
        (["runs"], 0),
        (["runs", "--json"], 0),
        (["runs", spec], 2),
        (["resume", spec], 2),
        (["resume", spec, "--set", "runtime.workers=1"], 2),
        (["sync", spec], 2),
        (["export", spec, "--to", "model"], 2),
        (["runs", "--run-dir", "elsewhere/new"], 0),
    ):
        out = CliRunner().invoke(app, command)
        assert out.exit_code == code, (command, out.output)
        assert code == 0 or f"error: no run {spec!r} under " in out.output, (command, out.output)
        assert list(tmp_path.iterdir()) == [], command
