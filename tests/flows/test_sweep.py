"""A 2 x 3 sweep (two eta_down values x three seeds) through the real CLI, Prefect, MLflow and tiny models.

It runs as a user runs it: ``bhfl sweep CONFIG --grid ... --seeds ...`` in a subprocess
against the session's Prefect server, its experiments sharing one local worker cluster,
two at a time. The fault injector (BHFL_FAULTS, a real SIGKILL) kills the process in the
middle of the sweep; the same command with ``--resume FOLDER`` (here in this process)
must keep the finished experiments untouched, resume the interrupted ones from their
checkpoints and run the rest, with one MLflow run per experiment nested under the sweep's.
"""

import csv
import io
import math
import os
import re
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
from prefect.settings import PREFECT_API_URL
from typer.testing import CliRunner

from bhfl_core.config.sweep import load_sweep, sweep_from_dump
from flows.cli.app import app
from flows.records.run_record import RunRecord
from flows.records.sweep_record import SweepRecord
from flows.sweep import run_sweep, sweep_deployment
from tasks import faults
from tests.small import REPO, SMALL

pytestmark = pytest.mark.integration

KILLED = -9
CONFIG = REPO / "configs" / "embedded.yaml"
# the small data and model of tests/small.py; one round per level, no evaluation between rounds
SETS = [*SMALL, "tree.root.rounds=1", "tree.edge.rounds=1", "eval.every=0"]
GRID = ["tree.edge.eta_down=1.0,0.5"]
SEEDS = [0, 1, 2]
LABELS = [f"eta_down={v},seed={s}" for v in ("1.0", "0.5") for s in SEEDS]
ROUNDS_PER_RUN = 6  # server rounds of one experiment: 3 edges, 2 groups, the root
KILL_AT = 2 * ROUNDS_PER_RUN + 3  # two at a time: one or two finished, the others in flight or not started


def _cli_args(run_dir: Path) -> list[str]:
    args = ["sweep", str(CONFIG), "--name", "tsweep", "--seeds", "0,1,2", "--run-dir", str(run_dir)]
    for s in SETS:
        args += ["--set", s]
    for g in GRID:
        args += ["--grid", g]
    return args


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """The sweep command killed mid-sweep: (run dir, sweep folder, fault counter file, its stderr)."""
    run_dir = tmp_path_factory.mktemp("sweep")
    counter = run_dir / "faults.txt"
    env = {
        **os.environ,
        "PREFECT_API_URL": PREFECT_API_URL.value(),
        "HF_HUB_OFFLINE": "1",
        faults.ENV: f"round@{KILL_AT}",
        faults.COUNTER_ENV: str(counter),
    }
    cmd = [sys.executable, "-m", "flows.cli.app", *_cli_args(run_dir)]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == KILLED, out.stderr[-3000:]
    (folder,) = [p.parent for p in run_dir.glob("tsweep/*/sweep.json")]
    return run_dir, folder, counter, out.stderr


@pytest.fixture(scope="module")
def resumed(killed):
    run_dir, folder, _, _ = killed
    before = SweepRecord.read(folder)
    finished = {
        label: (Path(e.run_path) / "run.json").read_bytes()
        for label, e in before.points.items()
        if e.run_path and (run := RunRecord.read(Path(e.run_path))) is not None and run.status == "finished"
    }
    started = {  # a point can be killed between getting its folder and writing its run record: never started
        label for label, e in before.points.items() if e.run_path and RunRecord.read(Path(e.run_path)) is not None
    }
    sweep = replace(load_sweep(CONFIG, SETS, GRID, SEEDS, name="tsweep"), baseline="eta_down=1.0")
    result = run_sweep(sweep, run_dir, resume_from=folder)
    return before, finished, result, started


def test_killed_sweep_leaves_a_resumable_record(killed):
    _, folder, counter, _ = killed
    record = SweepRecord.read(folder)
    assert record.effective_status == "interrupted" and record.parallel == 2
    assert list(record.points) == LABELS
    assert len({p.config_hash for p in record.points.values()}) == 6
    assert faults.shared_counts(str(counter))["round"] == KILL_AT
    runs = {label: RunRecord.read(Path(e.run_path)) if e.run_path else None for label, e in record.points.items()}
    done = [label for label, run in runs.items() if run is not None and run.status == "finished"]
    assert 1 <= len(done) <= 2  # 15 server rounds: two whole experiments at most (which two: who was faster)
    assert runs[LABELS[-1]] is None  # not started: two at a time
    assert not any(e.error for e in record.points.values())  # no point failed: the kill stopped them
    assert any(run is not None and run.effective_status == "interrupted" for run in runs.values())
    # each point's config: the grid value and the seed it stands for
    for label, entry in record.points.items():
        if entry.run_path and runs[label] is not None:
            config = yaml.safe_load((Path(entry.run_path) / "config.yaml").read_text())
            assert config["tree"]["edge"]["eta_down"] == entry.values["tree.edge.eta_down"]
            assert config["seed"] == entry.values["seed"] and config["name"] == "itest", label


def test_resume_skips_finished_experiments_and_runs_the_rest(resumed):
    before, finished, result, started = resumed
    assert result["resumes"] == 1 and result["run_id"] == before.run_id
    assert {e["status"] for e in result["points"].values()} == {"finished"}
    assert sorted(result["ran"]) == sorted(set(LABELS) - set(finished))
    paths = [Path(e["run_path"]) for e in result["points"].values()]
    assert len(set(paths)) == 6
    for label, entry in result["points"].items():
        run = RunRecord.read(Path(entry["run_path"]))
        assert run.status == "finished" and run.parent_run_id == entry["run_id"]
        if label in finished:  # not run again: its record is byte for byte what it was
            assert (Path(entry["run_path"]) / "run.json").read_bytes() == finished[label]
            assert run.resumes == 0
        elif label in started:  # interrupted: continued in its folder
            assert entry["run_path"] == before.points[label].run_path and run.resumes == 1
        elif before.points[label].run_path:  # given its folder, killed before its run began: started there
            assert entry["run_path"] == before.points[label].run_path and run.resumes == 0


def test_mlflow_groups_one_run_per_experiment_under_the_sweep(resumed):
    result = resumed[2]
    client = MlflowClient(result["tracking_uri"])
    sweep_run = client.get_run(result["run_id"])
    experiment = client.get_experiment(sweep_run.info.experiment_id)
    assert experiment.name == "tsweep" and sweep_run.info.status == "FINISHED"
    assert sweep_run.data.tags["bhfl.kind"] == "sweep" and sweep_run.data.tags["bhfl.resumes"] == "1"
    assert sweep_run.data.metrics["sweep/finished"] == 6
    children = client.search_runs(
        [experiment.experiment_id], f"tags.`mlflow.parentRunId` = '{result['run_id']}'", max_results=100
    )
    assert sorted(r.info.run_name for r in children) == sorted(LABELS)  # no duplicates from the resume
    hashes = {r.data.tags["bhfl.sweep_hash"] for r in children}
    assert hashes == {e["config_hash"] for e in result["points"].values()} and len(hashes) == 6
    for run in children:
        entry = result["points"][run.data.tags["bhfl.sweep_label"]]
        assert run.info.run_id == entry["run_id"] and run.info.status == "FINISHED"
        assert run.data.tags["bhfl.sweep"] == "tsweep" and run.data.tags["bhfl.seed"] == str(entry["values"]["seed"])
        assert "client_on_own_clients/accuracy_mean" in run.data.metrics


def test_the_sweep_report_aggregates_seeds_and_pairs_against_the_baseline(resumed):
    result = resumed[2]
    report = Path(result["sweep_path"]) / "report"
    client = MlflowClient(result["tracking_uri"])
    own = {
        label: client.get_run(e["run_id"]).data.metrics["client_on_own_clients/accuracy_mean"]
        for label, e in result["points"].items()
    }
    rows = {r["config"]: r for r in csv.DictReader(io.StringIO((report / "seeds.csv").read_text()))}
    assert len(rows) == 2
    for value in ("1.0", "0.5"):
        (row,) = [r for label, r in rows.items() if f"eta_down={value}" in label]
        runs = [own[f"eta_down={value},seed={s}"] for s in SEEDS]
        assert row["leaf_mean_n"] == "3" and row["seeds"] == "0 1 2"
        assert math.isclose(float(row["leaf_mean_mean"]), statistics.mean(runs), abs_tol=1e-9)
        assert math.isclose(float(row["leaf_mean_std"]), statistics.stdev(runs), abs_tol=1e-9)
    (paired,) = csv.DictReader(io.StringIO((report / "paired.csv").read_text()))
    diffs = [own[f"eta_down=0.5,seed={s}"] - own[f"eta_down=1.0,seed={s}"] for s in SEEDS]
    assert "eta_down=1.0" in paired["baseline"] and paired["leaf_mean_diff_n"] == "3"
    assert math.isclose(float(paired["leaf_mean_diff_mean"]), statistics.mean(diffs), abs_tol=1e-9)
    assert (report / "seeds_tree.edge.eta_down.png").stat().st_size > 0
    text = (report / "report.md").read_text()
    assert "6 of 6 experiment(s) finished, 2 config(s)" in text and "seeds_tree.edge.eta_down.png" in text
    artefacts = [f.path for f in client.list_artifacts(result["run_id"], "report")]
    assert "report/report.md" in artefacts  # logged on the sweep's MLflow run


def test_prefect_runs_the_experiments_as_subflows_of_the_sweep(resumed):
    result = resumed[2]
    with get_client(sync_client=True) as client:
        # named as `bhfl run` names an experiment's: the sweep's name and the minute (it was the folder's name)
        named = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_="resume tsweep 20")))
        (sweep_run,) = [r for r in named if r.parameters.get("sweep_path") == result["sweep_path"]]
        assert re.fullmatch(r"resume tsweep \d{4}-\d\d-\d\d \d\d:\d\d", sweep_run.name), sweep_run.name
        points = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=result["ran"])))
        resumed_points = [r for r in points if r.parent_task_run_id]
        parents = {client.read_task_run(r.parent_task_run_id).flow_run_id for r in resumed_points}
    assert sweep_run.state.is_completed()
    assert sweep_run.id in parents


def test_deployment_carries_the_resolved_sweep():
    sweep = load_sweep(CONFIG, SETS, GRID, SEEDS, name="tsweep")
    deployment = sweep_deployment(sweep, "0 2 * * *", "nightly", Path("/tmp/runs"), "sqlite:////tmp/runs/mlflow.db")
    assert deployment.name == "nightly" and deployment.parameters["run_root"] == "/tmp/runs"
    again = sweep_from_dump(deployment.parameters["sweep"], "parameters")
    assert [(p.label, p.hash) for p in again] == [(p.label, p.hash) for p in sweep]


def test_cli_rejects_a_bad_grid_naming_the_key(tmp_path):
    out = CliRunner().invoke(
        app, ["sweep", str(CONFIG), "--grid", "tree.edge.eta_dwn=1.0,0.5", "--run-dir", str(tmp_path)]
    )
    assert out.exit_code == 2
    assert "tree.edge.eta_dwn" in out.output and "unknown key" in out.output
    assert not list(tmp_path.glob("*/*/sweep.json"))  # nothing started


def test_cli_names_the_sweep_point_whose_model_check_fails(tmp_path):
    """The model and data checks run once per distinct (data, model) before anything starts; a failure says
    which point it was (the same for the adapter check: flows/cli/jobs.py)."""
    spec = tmp_path / "models.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "name": "models",
                "base": str(CONFIG),
                "configs": {"good": {}, "bad": {"set": {"model.name": str(tmp_path / "no-such-model")}}},
                "seeds": [0],
            }
        )
    )
    out = CliRunner().invoke(app, ["sweep", str(spec), "--run-dir", str(tmp_path / "runs")])
    assert out.exit_code == 2, out.output
    said = " ".join(out.output.split())
    assert "error: sweep point 'bad,seed=0': model.name: the folder" in said and "no-such-model" in said
    assert not list(tmp_path.glob("runs/*/*/sweep.json"))  # nothing started


def test_resuming_the_finished_sweep_changes_nothing(resumed):
    result = resumed[2]
    folder = Path(result["sweep_path"])
    record, run_dir = (folder / "sweep.json").read_bytes(), folder.parents[1]
    client = MlflowClient(result["tracking_uri"])
    end_time = client.get_run(result["run_id"]).info.end_time
    out = CliRunner().invoke(app, ["resume", str(folder), "--run-dir", str(run_dir)])
    assert out.exit_code == 0 and "finished; nothing to resume" in " ".join(out.output.split()), out.output
    assert (folder / "sweep.json").read_bytes() == record  # no attempt recorded
    assert client.get_run(result["run_id"]).info.end_time == end_time  # its MLflow run not reopened


def test_the_sweep_command_prints_its_prefect_flow_run(killed):
    """With a Prefect server of the user's, the sweep's flow run page is printed once it exists (stderr)."""
    _, folder, _, stderr = killed
    api_url = str(PREFECT_API_URL.value())
    link = rf"^Prefect flow run: {re.escape(api_url.removesuffix('/api'))}/runs/flow-run/([0-9a-f-]{{36}})$"
    (flow_run_id,) = re.findall(link, stderr, re.M)
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run_id)
        assert client.read_flow(run.flow_id).name == "bhfl-sweep"
    assert run.parameters["sweep_path"] == str(folder)
