"""What ``bhfl`` reads and what it leaves: commands that only read create nothing, a damaged record (``run.json``,
``sweep.json``, ``pipeline.json``, a sweep's or pipeline's saved config) is one line naming its file and the rest of
the listing intact, and files are UTF-8 whatever the locale.

Job folders are made as a job leaves them (records and configs written directly); nothing is trained or resumed
for real: each resume here is refused or finds nothing to do.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli.app import app
from flows.records.run_record import RunRecord
from tests.flows.commands import cli

pytestmark = pytest.mark.integration


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


def _pipeline(run_dir, stamp: str, record: bytes) -> Path:
    folder = run_dir / "tp" / stamp
    folder.mkdir(parents=True)
    (folder / "pipeline.yaml").write_text("stages: {}\n", encoding="utf-8")  # (not read by the listing)
    (folder / "pipeline.json").write_bytes(record)
    return folder


def test_a_damaged_pipeline_record_is_one_line_and_the_rest_still_lists(tmp_path):
    # A pipeline.json cut off, edited into the wrong types or saved in Latin-1 broke the whole `bhfl runs` listing
    # (and --json, and finding any run by its MLflow id) with a traceback; `bhfl resume` of it was a traceback too.
    from flows.records.pipeline_record import PipelineRecord, StageRecord

    run_dir = tmp_path / "runs"
    good = run_dir / "itest" / "20260101-000000-000"
    good.mkdir(parents=True)
    (good / "config.yaml").write_text("name: itest\n", encoding="utf-8")
    run_id = "ab" * 16
    RunRecord(name="itest", status="finished", started=1.7e9, parent_run_id=run_id).write(good)
    damaged = {
        "20260101-000000-001": (b'{"name": "tp", "sta', "Invalid JSON"),
        "20260101-000000-002": (b'{"name": "tp", "stages": 3}', "Input should be an object"),
        "20260101-000000-003": ('{"name": "tp-caf\xe9"}'.encode("latin-1"), "'utf-8' codec can't decode byte 0xe9"),
    }
    folders = {stamp: _pipeline(run_dir, stamp, record) for stamp, (record, _) in damaged.items()}
    broken_stage = run_dir / "itest" / "20260101-000000-005"  # a stage whose own run.json is damaged
    broken_stage.mkdir()
    (broken_stage / "config.yaml").write_text("name: itest\n", encoding="utf-8")
    (broken_stage / "run.json").write_text('{"name": "itest", "sta', encoding="utf-8")
    stages = {"a": StageRecord(run_path=str(good), status="finished"), "b": StageRecord(run_path=str(broken_stage))}
    intact = _pipeline(run_dir, "20260101-000000-004", b"")
    PipelineRecord(name="tp", status="failed", started=1.7e9, stages=stages).write(intact)

    listed = CliRunner().invoke(app, ["runs", "--run-dir", str(run_dir)])
    assert listed.exit_code == 0, listed.output
    lines = listed.output.splitlines()
    for stamp, (_, why) in damaged.items():
        file = folders[stamp] / "pipeline.json"
        assert any(
            line.startswith(f"pipeline {folders[stamp]}  unreadable: {file}: damaged pipeline record (") and why in line
            for line in lines
        ), (stamp, listed.output)
    assert any(line.startswith("pipeline tp/20260101-000000-004  failed  started ") for line in lines), listed.output
    assert f"    a: finished  {good}" in lines and f"    b: unreadable  {broken_stage}" in lines
    assert any(line.startswith(f"itest/{good.name}  finished  ") and run_id in line for line in lines)
    assert any(line.startswith(f"{broken_stage}  unreadable: ") for line in lines)  # named where it is listed

    entries = json.loads(CliRunner().invoke(app, ["runs", "--run-dir", str(run_dir), "--json"]).output)
    pipelines = {entry["folder"]: entry for entry in entries if entry["kind"] == "pipeline"}
    for stamp, (_, why) in damaged.items():
        entry = pipelines[f"tp/{stamp}"]
        assert (entry["status"], entry["started"], entry["stages"]) == ("unreadable", None, [])
        assert entry["detail"].startswith(f"{folders[stamp] / 'pipeline.json'}: damaged") and why in entry["detail"]
    assert [s["status"] for s in pipelines["tp/20260101-000000-004"]["stages"]] == ["finished", "unreadable"]
    assert any(entry["kind"] == "run" and entry["mlflow_run_id"] == run_id for entry in entries)

    # another job's damaged record does not stop a lookup by MLflow id
    found = CliRunner().invoke(app, ["resume", run_id[:8], "--run-dir", str(run_dir)])
    assert found.exit_code == 0 and "finished; nothing to resume" in found.output, found.output

    for stamp, (record, why) in damaged.items():  # a resume of one: one line naming the file, the file kept
        out = CliRunner().invoke(app, ["resume", str(folders[stamp]), "--run-dir", str(run_dir)])
        assert out.exit_code == 2, out.output
        assert out.exception is None or isinstance(out.exception, SystemExit)  # no traceback
        said = " ".join(out.output.split())
        assert said.startswith(f"error: {folders[stamp] / 'pipeline.json'}: damaged pipeline record (") and why in said
        assert (folders[stamp] / "pipeline.json").read_bytes() == record
        shown = CliRunner().invoke(app, ["runs", str(folders[stamp]), "--run-dir", str(run_dir)])
        assert shown.exit_code == 2, shown.output
        assert " ".join(shown.output.split()).startswith(f"error: {folders[stamp] / 'pipeline.json'}: damaged")
    assert not (run_dir / ".prefect").exists()


def test_a_damaged_sweep_file_stops_its_resume_in_one_line(tmp_path):
    # a sweep.json or sweep.yaml cut off, or not UTF-8: `bhfl resume SWEEP_FOLDER` was a traceback
    from flows.records.sweep_record import SweepRecord

    folder = tmp_path / "sw" / "20260101-000000-000"
    folder.mkdir(parents=True)
    (folder / "sweep.json").write_text('{"name": "sw", "sta', encoding="utf-8")
    (folder / "sweep.yaml").write_text("name: sw\n", encoding="utf-8")

    def resume() -> str:
        out = CliRunner().invoke(app, ["resume", str(folder)])
        assert out.exit_code == 2, out.output
        assert out.exception is None or isinstance(out.exception, SystemExit)  # no traceback
        return " ".join(out.output.split())

    said = resume()
    assert said.startswith(f"error: {folder / 'sweep.json'}: damaged sweep record (Invalid JSON"), said
    shown = CliRunner().invoke(app, ["runs", str(folder)])  # the one job asked for: an error, as a damaged run is
    assert shown.exit_code == 2, shown.output
    assert " ".join(shown.output.split()) == said
    SweepRecord(name="sw", status="interrupted").write(folder)
    for content, why in ((b"name: sw\npoints: [\n", "expected the node content"), (b"name: sw\xe9\n", "'utf-8'")):
        (folder / "sweep.yaml").write_bytes(content)
        said = resume()
        assert said.startswith(f"error: {folder / 'sweep.yaml'} cannot be read as the sweep it ran ("), said
        assert why in said and "put it back as it was to resume" in said
    assert not (tmp_path / ".prefect").exists()


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
    assert "no runs under" not in listed.stdout  # (it said so under the sweep it had just listed)
    resumed = cli("resume", str(folder), env=ascii_locale)
    assert resumed.returncode == 0 and f"sweep {folder} finished; nothing to resume" in resumed.stderr, resumed.stderr

    helped = cli("compare", "--help", env=ascii_locale)
    assert helped.returncode == 0, helped.stderr[-3000:]
    assert "mean ? std" in " ".join(helped.stdout.split()) and "Traceback" not in helped.stderr


def test_the_listing_prints_paths_labels_and_errors_as_written(tmp_path):
    # `bhfl runs` printed them as rich markup: a run dir named "[old] runs" lost "[old]" from every path (a printed
    # path no longer pasted back), a point labelled "langs=[en]" and an error quoting "[bold]" lost those words
    from flows.records.pipeline_record import PipelineRecord, StageRecord
    from flows.records.sweep_record import PointRecord, SweepRecord

    run_dir = tmp_path / "[old] runs"
    run = run_dir / "itest" / "20260101-000000-000"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("name: itest\n", encoding="utf-8")
    RunRecord(name="itest", status="failed", started=1.7e9, error="ValueError: a [bold] word\nmore").write(run)
    sweep = run_dir / "sw" / "20260101-000000-001"
    sweep.mkdir(parents=True)
    (sweep / "sweep.yaml").write_text("{}\n", encoding="utf-8")
    point = PointRecord(config_hash="0" * 16, run_path=str(run), status="failed")
    SweepRecord(name="sw", status="failed", started=1.7e9, points={"langs=[en]": point}).write(sweep)
    pipeline = run_dir / "tp" / "20260101-000000-002"
    pipeline.mkdir(parents=True)
    (pipeline / "pipeline.yaml").write_text("stages: {}\n", encoding="utf-8")
    PipelineRecord(name="tp", status="failed", started=1.7e9, stages={"a": StageRecord(run_path=str(run))}).write(
        pipeline
    )

    listed = CliRunner().invoke(app, ["runs", "--run-dir", str(run_dir)])
    assert listed.exit_code == 0, listed.output
    lines = listed.output.splitlines()
    assert f"    a: failed  {run}" in lines and f"    continue with: bhfl resume {pipeline}" in lines
    assert f"    langs=[en]: failed  {run}  (ValueError: a [bold] word)" in lines
    one = CliRunner().invoke(app, ["runs", str(run), "--run-dir", str(run_dir)])
    assert one.exit_code == 0 and f"itest {run}" in one.output and "a [bold] word" in one.output, one.output
