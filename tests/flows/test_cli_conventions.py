"""The CLI's habits (issue 17, part 5): results on stdout and the rest on stderr, ``--json``, ``--version``,
help defaults from typer, full run ids (and unique prefixes) everywhere, ``compare --all``, ``ui`` on a busy port.
The Prefect flow run's address: test_cli_prefect_links.py; quick commands that stay quick (no torch, Prefect or
MLflow imported): test_cli_quick_commands.py.

Nothing is trained: run folders are a ``config.yaml`` and a ``run.json`` as a run writes them, and the
MLflow store is made with ``MlflowClient`` with the tags and parent-run metrics a finished experiment run
has (as in tests/flows/test_compare_seeds.py). Streams are told apart by running ``python -m
flows.cli.app`` as a subprocess; the variants of one command run in-process (typer's CliRunner, which
also keeps stdout and stderr apart).
"""

from __future__ import annotations

import json
import re
import socket
import time
import uuid
from importlib.metadata import version
from pathlib import Path

import psutil
import pytest
import yaml
from mlflow import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID
from typer.testing import CliRunner

from bhfl_core.config.schema import dump
from flows.cli.app import _print_summary, app
from flows.records.listing import Progress, _by_run_id, redo_summary
from flows.records.pipeline_record import PipelineRecord, StageRecord
from flows.records.run_record import RunRecord
from flows.records.run_state import RunStateError
from tests.flows.commands import cli
from tests.small import small_config

pytestmark = pytest.mark.integration

FULL_ID = re.compile(r"^[0-9a-f]{32}$")
RUN_KEYS = {"kind", "name", "folder", "path", "status", "started", "detail", "redo", "mlflow_run_id"}
PIPELINE_KEYS = {"kind", "name", "folder", "path", "status", "started", "detail", "mlflow_run_id", "stages"}
COMPARE_KEYS = {
    "experiment",
    "run_id",
    "metric",
    "leaf_mean",
    "leaf_worst10",
    "parent_mean",
    "parent_worst10",
    "root_union",
    "root_proxy",
    "closer_is_better_share",
    "comm_model_equivalents",
    "comm_mb",
    "root_rounds",
    "virtual_s",
    "wall_s",
    "run_path",
    "status",
    "baseline",
}


def _experiment_run(client: MlflowClient, experiment: str, run_path: Path, start: int, accuracy: float) -> str:
    """A finished experiment run (tags, params, headline metrics) with one node run under it."""
    run = client.create_run(
        experiment,
        run_name="itest",
        start_time=start,
        tags={
            "bhfl.seed": "0",
            "bhfl.config_hash": f"h{start}",
            "bhfl.task": "classification",
            "bhfl.run_path": str(run_path),
        },
    )
    rid = run.info.run_id
    client.log_param(rid, "tree.root.rounds", "2")
    for key, value in {
        "client_on_own_clients/accuracy_mean": accuracy,
        "root/union/accuracy": accuracy - 0.1,
        "baseline/majority/root/union/accuracy": 0.15,  # the trivial baseline the report logs beside it
        "comm/total_bytes": 2.0e6,
        "time/total_s": 12.0,
    }.items():
        client.log_metric(rid, key, value, step=0)
    node = client.create_run(experiment, run_name="root", tags={MLFLOW_PARENT_RUN_ID: rid, "bhfl.node": "root"})
    client.set_terminated(node.info.run_id, "FINISHED")
    client.set_terminated(rid, "FINISHED")
    return rid


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A run dir with two finished runs, a failed one and a pipeline (folders + MLflow store); the ids."""
    root = tmp_path_factory.mktemp("conventions")
    # a long folder name: the printed paths are longer than a terminal line and must stay whole
    run_dir = root / ("a-run-dir-with-a-long-name-" + "x" * 60)
    run_dir.mkdir()
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    experiment = client.create_experiment("itest")
    config = yaml.safe_dump(dump(small_config()), sort_keys=False)
    ids = []
    for i, (status, stamp) in enumerate([("finished", "20260101-000000-001"), ("finished", "20260101-000000-002")]):
        path = run_dir / "itest" / stamp
        path.mkdir(parents=True)
        (path / "config.yaml").write_text(config)
        rid = _experiment_run(client, experiment, path, 1000 + i, 0.6 + i / 10)
        RunRecord(name="itest", status=status, started=1.7e9 + i, parent_run_id=rid).write(path)
        ids.append(rid)
    failed = run_dir / "itest" / "20260101-000000-003"
    failed.mkdir()
    (failed / "config.yaml").write_text(config)
    RunRecord(name="itest", status="failed", started=1.7e9 + 5, error="boom: out of luck").write(failed)
    pipeline = run_dir / "tp" / "20260101-000000-004"  # a one-stage pipeline made of the first run
    pipeline.mkdir(parents=True)
    (pipeline / "pipeline.yaml").write_text("stages: {}\n")  # listing never reads it
    stage = StageRecord(run_path=str(run_dir / "itest" / "20260101-000000-001"), status="finished", run_id=ids[0])
    PipelineRecord(name="tp", status="finished", run_id=uuid.uuid4().hex, stages={"a": stage}).write(pipeline)
    node = client.search_runs([experiment], f"tags.`{MLFLOW_PARENT_RUN_ID}` = '{ids[0]}'")[0].info.run_id
    return run_dir, ids, node


def test_version():
    out = cli("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"bhfl {version('bhfl')}" and not out.stderr


def test_help_shows_typer_defaults_no_bool_metavar_and_completion():
    top = cli("--help")
    assert "--install-completion" in top.stdout and "--show-completion" in top.stdout and "--version" in top.stdout
    helps = {command: cli(command, "--help").stdout for command in ("compare", "runs", "sweep", "run", "serve")}
    helps["top"] = top.stdout
    for command, text in helps.items():
        assert "<bool>" not in text, command  # flags take no value
        assert "(default:" not in text, command  # no hand-written defaults left
    compare = " ".join(helps["compare"].split())
    assert "Write the table as CSV here. [default: (RUN_DIR/compare.csv)]" in compare
    assert "[env var: MLFLOW_TRACKING_URI] [default: (sqlite:///RUN_DIR/mlflow.db)]" in compare
    assert "--all" in compare and "--json" in compare
    assert "[default: (one per shared worker, else 1)]" in " ".join(helps["sweep"].split())
    assert "Deployment name. [default: (the config's name)]" in " ".join(helps["serve"].split())


def test_runs_lists_on_stdout_json_and_id_prefixes(world):
    run_dir, ids, _ = world
    out = cli("runs", "--run-dir", str(run_dir))
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr and "itest/" not in out.stderr  # the listing is on stdout only
    for rid in ids:
        assert f"MLflow run {rid}" in out.stdout  # full ids
    assert "itest/20260101-000000-003  failed" in out.stdout and "boom: out of luck" in out.stdout
    assert "a resume would redo: everything" in out.stdout

    runner = CliRunner()
    listed = runner.invoke(app, ["runs", "--run-dir", str(run_dir), "--json"])
    assert listed.exit_code == 0, listed.output
    pipeline, *entries = json.loads(listed.stdout)  # pipelines first
    assert set(pipeline) == PIPELINE_KEYS and pipeline["kind"] == "pipeline" and pipeline["status"] == "finished"
    assert (
        pipeline["detail"] is None
    )  # (the reason a damaged pipeline.json is unreadable: tests/flows/test_cli_records.py)
    assert FULL_ID.match(pipeline["mlflow_run_id"]) and pipeline["folder"] == "tp/20260101-000000-004"
    assert pipeline["stages"] == [
        {"name": "a", "status": "finished", "path": entries[0]["path"], "mlflow_run_id": ids[0]}
    ]
    assert [set(e) for e in entries] == [RUN_KEYS] * 3
    assert [e["mlflow_run_id"] for e in entries] == [*ids, None]
    assert all(FULL_ID.match(e["mlflow_run_id"]) for e in entries[:2])
    assert [e["status"] for e in entries] == ["finished", "finished", "failed"]
    assert entries[0]["path"] == str(run_dir / "itest" / "20260101-000000-001")
    assert entries[0]["folder"] == "itest/20260101-000000-001" and entries[0]["started"].startswith("2023-11-14T")

    for spec in (ids[1], ids[1][:8]):  # the full id and a prefix name the same run
        one = runner.invoke(app, ["runs", spec, "--run-dir", str(run_dir), "--json"])
        assert one.exit_code == 0, one.output
        (entry,) = json.loads(one.stdout)
        assert entry["mlflow_run_id"] == ids[1] and set(entry) == RUN_KEYS | {"plan"} and entry["plan"] is None
    text = runner.invoke(app, ["runs", ids[1][:8], "--run-dir", str(run_dir)])
    assert f"MLflow run id: {ids[1]}" in text.stdout and str(run_dir / "itest" / "20260101-000000-002") in text.stdout
    one = runner.invoke(app, ["runs", pipeline["mlflow_run_id"][:8], "--run-dir", str(run_dir), "--json"])
    assert json.loads(one.stdout) == [pipeline]  # a pipeline by (a prefix of) its run id
    short = runner.invoke(app, ["runs", ids[1][:7], "--run-dir", str(run_dir)])
    assert short.exit_code == 2 and "first 8+ characters" in " ".join(short.stderr.split())


def test_an_ambiguous_id_prefix_names_the_candidates(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    ids = {a: "abcdef12" + "0" * 24, b: "abcdef12" + "1" * 24}
    assert _by_run_id("abcdef12" + "1" * 24, ids, "run") == b.resolve()
    assert _by_run_id("abcdef121", ids, "run") == b.resolve()
    with pytest.raises(RunStateError, match="'abcdef12' is the start of the MLflow run ids of 2 runs"):
        _by_run_id("abcdef12", ids, "run")
    assert _by_run_id("abcdef1", ids, "run") is None  # under 8 characters: no prefix match


def test_compare_full_ids_prefixes_all_and_json(world, tmp_path):
    run_dir, ids, node = world
    csv = str(tmp_path / "c.csv")
    out = cli("compare", ids[0], "--run-dir", str(run_dir), "--csv", csv)
    assert out.returncode == 0, out.stderr
    assert f"| itest | {ids[0]} | accuracy |" in out.stdout  # the table, full run id, on stdout
    assert "1 run(s) compared; CSV written to" in out.stderr and "| itest |" not in out.stderr

    runner = CliRunner()

    def compare(*args):
        result = runner.invoke(app, ["compare", *args, "--run-dir", str(run_dir), "--csv", csv])
        assert result.exit_code == 0, result.output
        return result

    latest = compare("itest")  # an experiment name: its latest finished run
    assert ids[1] in latest.stdout and ids[0] not in latest.stdout
    printed = re.findall(r"\| itest \| ([0-9a-f]+) \|", compare("itest", "--all").stdout)
    assert printed == ids  # every finished run, oldest first, with the ids compare takes back
    again = compare(*printed, ids[0][:8])
    assert re.findall(r"\| itest \| ([0-9a-f]+) \|", again.stdout) == [*ids, ids[0]]

    rows = json.loads(compare("itest", "--all", "--json").stdout)
    assert [set(r) for r in rows] == [COMPARE_KEYS, COMPARE_KEYS]
    assert [r["run_id"] for r in rows] == ids and all(FULL_ID.match(r["run_id"]) for r in rows)
    first = rows[0]
    assert first["run_path"] == str(run_dir / "itest" / "20260101-000000-001") and first["status"] == "finished"
    assert first["leaf_mean"] == pytest.approx(0.6) and first["root_union"] == pytest.approx(0.5)
    assert first["comm_mb"] == pytest.approx(2.0) and first["root_rounds"] == 2 and first["leaf_worst10"] is None
    assert first["baseline"]["kind"] == "majority" and first["baseline"]["root_union"] == pytest.approx(0.15)
    assert first["baseline"]["leaf_mean"] is None  # the run logged no baseline of that headline
    assert "| ↳ trivial baseline (majority) |  | accuracy | – | – | – | – | 0.1500 |" in latest.stdout
    targeted = json.loads(compare(ids[0][:10], "--target", "0.4", "--json").stdout)
    assert set(targeted[0]) == COMPARE_KEYS | {"time_to_target"}

    node_run = runner.invoke(app, ["compare", node[:8], "--run-dir", str(run_dir), "--csv", csv])
    assert node_run.exit_code == 2 and "this is the run of node 'root'" in node_run.stderr


def test_ui_on_a_busy_port_fails_clearly(tmp_path):
    (tmp_path / "mlflow.db").touch()  # a store: the port is the only problem
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = cli("ui", "--run-dir", str(tmp_path), "--port", str(port), timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    message = " ".join(out.stderr.split())
    assert f"port {port} on 127.0.0.1 is already in use" in message
    # the command to paste serves the same store (it said `bhfl ui --port N`: the default runs/ store)
    assert re.search(
        rf"`\S*bhfl ui --run-dir {tmp_path} --port {port + 1}` and browse http://127.0.0.1:{port + 1},", message
    )
    assert "Traceback" not in out.stderr and not out.stdout
    with socket.socket(socket.AF_INET6) as busy:  # an IPv6 interface: its address in brackets, the host kept
        try:
            busy.bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 loopback here")
        busy.listen()
        port = busy.getsockname()[1]
        out = cli("ui", "--run-dir", str(tmp_path), "--port", str(port), "--host", "::1", timeout=60)
    message = " ".join(out.stderr.split())
    assert out.returncode == 2 and f"--host ::1 --port {port + 1}` and browse http://[::1]:{port + 1}," in message


def test_ui_on_a_port_outside_1_65535_is_a_usage_error_before_anything_starts(tmp_path):
    (tmp_path / "mlflow.db").touch()  # a store: the port is the only problem
    for port in ("65536", "99999"):  # (it started an MLflow server, whose uvicorn died with a traceback: exit 0)
        out = CliRunner().invoke(app, ["ui", "--run-dir", str(tmp_path), "--port", port])
        assert out.exit_code == 2, out.output
        message = " ".join(out.stderr.split())
        assert "Invalid value for '--port': Input should be less than or equal to 65535" in message, message
        assert "MLflow UI for" not in out.output and "Traceback" not in out.output


def test_sync_with_a_negative_wait_is_a_usage_error(tmp_path):
    out = CliRunner().invoke(app, ["sync", "latest", "--run-dir", str(tmp_path), "--wait", "-5"])
    assert out.exit_code == 2, out.output
    assert "Invalid value for '--wait'" in " ".join(out.stderr.split()) and "Traceback" not in out.output


def test_end_of_run_summary_on_stdout_unwrapped(capsys, tmp_path):
    run_path = tmp_path / ("runs-" + "y" * 90) / "itest" / "20260101-000000-001"
    result = {
        "headline": {"root/union/accuracy": 0.5},
        "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db",
        "run_path": str(run_path),
        "run_id": "0123456789abcdef0123456789abcdef",
        "experiment_id": "1",
    }
    before = time.time() - psutil.Process().create_time()
    _print_summary(result, Path("runs"))
    after = time.time() - psutil.Process().create_time()
    captured = capsys.readouterr()
    assert not captured.err
    # "done in" is the command's time, imports and servers included (the flow's own is time/total_s)
    said = float(re.search(r"done in (\d+) s\n", captured.out)[1])
    assert round(before) <= said <= round(after), (said, before, after)
    assert "Final evaluation" in captured.out and "root/union/accuracy" in captured.out
    assert f"  run files (node models, optimiser states): {run_path}\n" in captured.out  # one line, whole
    assert "MLflow run id: 0123456789abcdef0123456789abcdef" in captured.out
    # its store is not runs/'s (a resumed run folder of another run directory): the UI command names it
    assert f" ui --run-dir {tmp_path}   then browse " in captured.out, captured.out


def test_a_run_logged_to_a_tracking_server_is_browsed_there_not_through_bhfl_ui(capsys, tmp_path):
    """`bhfl ui --tracking-uri http://...` cannot serve a server (`mlflow server` takes stores): the summary does not
    send the user there (it did, and that command died with MLflow's traceback, exit 1), and the command says why."""
    server = "http://127.0.0.1:15500"
    result = {
        "headline": {"root/union/accuracy": 0.5},
        "tracking_uri": server,
        "run_path": str(tmp_path / "runs" / "itest" / "20260101-000000-001"),
        "run_id": "0123456789abcdef0123456789abcdef",
        "experiment_id": "4",
    }
    _print_summary(result, Path("runs"))
    summary = capsys.readouterr().out
    link = f"{server}/#/experiments/4/runs/0123456789abcdef0123456789abcdef?workflowType=machine_learning"
    assert f"  open the UI:  the tracking server serves it, then browse {link}\n" in summary, summary
    assert " ui " not in summary
    out = CliRunner().invoke(app, ["ui", "--tracking-uri", server + "/", "--port", "1"])
    assert out.exit_code == 2 and len(out.stderr.strip().splitlines()) == 1, out.output
    assert (
        f"error: --tracking-uri {server}/ is an MLflow tracking server, which serves its own UI: browse {server} ("
        in (out.stderr)
    )


def test_end_of_run_summary_shows_the_trivial_baseline_beside_each_headline(capsys, tmp_path):
    """The terminal's table has report.md's trivial baseline: a column beside the headlines it has a value of."""
    result = {
        "headline": {"root/union/accuracy": 0.5, "client_on_own_clients/accuracy_mean": 0.8, "comm/total_bytes": 9.0},
        "baseline": {"root/union/accuracy": 0.152, "client_on_own_clients/accuracy_mean": 0.413},
        "baseline_name": "majority",
        "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db",
        "run_path": str(tmp_path / "runs" / "itest" / "20260101-000000-001"),
        "run_id": "0123456789abcdef0123456789abcdef",
        "experiment_id": "1",
    }
    _print_summary(result, Path("runs"))
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if "┃" in line)
    assert [c.strip() for c in header.split("┃")[1:-1]] == ["metric", "value", "trivial baseline"]
    assert "trivial baseline: majority, without training" in "\n".join(lines)  # the caption names its kind
    rows = {
        cells[0]: cells[1:] for line in lines if "│" in line for cells in [[c.strip() for c in line.split("│")[1:-1]]]
    }
    assert rows["root/union/accuracy"] == ["0.5", "0.152"]
    assert rows["client_on_own_clients/accuracy_mean"] == ["0.8", "0.413"]
    assert rows["comm/total_bytes"] == ["9", ""]  # no baseline of that number


def test_an_error_is_printed_as_written_not_read_as_markup(capsys):
    """A message holding brackets (a pip extra, a list) keeps them: Rich would take ``[gpu]`` for a style."""
    import typer

    from flows.cli.shell import fail

    message = "model.quantization: pip install '.[gpu]' (CUDA machines only); keys [bold] and [/]"
    with pytest.raises(typer.Exit) as stop:
        fail(message)
    assert stop.value.exit_code == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"


def test_redo_names_one_remaining_round_as_a_round_not_a_range():
    """An interrupted 2-round run said 'rounds 2-2'; the rest of a run reads as English."""
    inside = "edge-ru round 1"
    assert redo_summary(Progress(0, 2, stopped_at=inside)) == (
        "root round 1 (from edge-ru round 1); round 2; final evaluation"
    )
    assert redo_summary(Progress(0, 4, stopped_at=inside)) == (
        "root round 1 (from edge-ru round 1); rounds 2-4; final evaluation"
    )
    assert redo_summary(Progress(1, 2)) == "root round 2; final evaluation"
