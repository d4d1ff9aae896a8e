"""SIGKILL a real run at several moments, resume it each time: the final node models are
bit-identical to an uninterrupted run, and the MLflow store holds what an uninterrupted run's
holds: one parent run, every run FINISHED, the same metric points (run, key, step) each once,
the same artefacts.

The experiment is the B-HFL example (FedAdam both ways, proxy training, up- and
down-residuals, cohort sampling, evaluation every root round), shrunken. It runs as the
user runs it: `bhfl run` / `bhfl resume` in subprocesses against the session's Prefect
server. Each process is killed by the pipeline's fault injector (BHFL_FAULTS, a real
SIGKILL) at a chosen point; the kills form one chain, so a run interrupted several
times, at every kind of point, must still end exactly where the uninterrupted one ends.
"""

import sqlite3
from pathlib import Path

import pytest
from mlflow import MlflowClient

from bhfl_core.store.node_store import StateStore
from flows.experiment import PLAIN_CALLS, run_experiment
from flows.records.run_record import RunRecord
from flows.tracking.tracker import RUN_KEY_TAG, sqlite_file
from tests.flows.kill_chain import EXAMPLE, KILLED, cli, leftovers, node_files
from tests.small import SMALL, small_config

pytestmark = pytest.mark.integration

# One chain of interruptions, in the order the run meets them:
# (fault, expected return code, text the user must see, what it interrupts)
CHAIN = [
    ("tracking@1", KILLED, "", "the MLflow runs created, their ids not yet in run.json: the resume adopts them"),
    ("artefacts@1", KILLED, "", "the parent run's files half logged, beside the first round's clients"),
    ("round@3", KILLED, "", "mid-subtree: a server round finished and saved, inside a subtree's execution"),
    # a worker task is retried once (runtime.retries): the error must hit twice to fail the run
    ("client@2:oom,client@3:oom", 1, "Out of GPU memory", "a CUDA out-of-memory error while a client trains"),
    ("checkpoint@7", KILLED, "", "a checkpoint write: the temporary file is written, not yet renamed"),
    ("checkpoint@3:enospc,checkpoint@4:enospc", 74, "The disk is full", "disk full while writing a checkpoint"),
    ("eval@1", KILLED, "", "during evaluation: the evaluation after a root round"),
    ("report@1", KILLED, "", "the report: the final evaluation and timings logged, the summary metrics not"),
]

# Steps whose process trains on the run's local worker cluster: the start, the mid-subtree kill (its
# workers must die with it) and the retried worker task. The others resume with
# runtime.executor=inprocess (a runtime.* change, which must not change results): no workers to start.
WITH_WORKERS = (0, 2, 3)
IN_PROCESS = ("--set", "runtime.executor=inprocess")
LISTED_AFTER = (1, 4)  # `bhfl runs` is checked after a kill and after a failure (6 s a call: not after each)


def _store_points(tracking_uri: str, run_key: str) -> dict[tuple[str, str], list[int]]:
    """Every metric point of a run's MLflow runs, read from the store's tables: (node or "parent", key) -> steps."""
    db = sqlite3.connect(sqlite_file(tracking_uri))
    rows = db.execute(
        "SELECT COALESCE(n.value, 'parent'), m.key, m.step FROM metrics m "
        "JOIN tags t ON t.run_uuid = m.run_uuid AND t.key = ? AND t.value = ? "
        "LEFT JOIN tags n ON n.run_uuid = m.run_uuid AND n.key = 'bhfl.node'",
        (RUN_KEY_TAG, run_key),
    ).fetchall()
    db.close()
    points: dict[tuple[str, str], list[int]] = {}
    for name, key, step in rows:
        points.setdefault((name, key), []).append(step)
    return {k: sorted(v) for k, v in points.items()}


def _tables(tracking_uri: str) -> list[list[tuple]]:
    """Every row of the store's metric tables and of its runs table (status, start and end times)."""
    db = sqlite3.connect(sqlite_file(tracking_uri))
    rows = [
        db.execute(f"SELECT * FROM {table} ORDER BY {order}").fetchall()
        for table, order in (
            ("metrics", "run_uuid, key, step, timestamp, value"),
            ("latest_metrics", "run_uuid, key"),
            ("runs", "run_uuid"),
        )
    ]
    db.close()
    return rows


def _artefacts(client: MlflowClient, run_id: str, path: str | None = None) -> set[str]:
    found = set()
    for item in client.list_artifacts(run_id, path):
        found |= _artefacts(client, run_id, item.path) if item.is_dir else {item.path}
    return found


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("resume")
    # without Prefect and without workers (the killed run has both): neither may change the record
    config = small_config(*EXAMPLE, "runtime.executor=inprocess", config="bhfl-full.yaml")
    result = run_experiment(config, run_dir, orchestration=PLAIN_CALLS)
    return run_dir, Path(result["run_path"])


@pytest.mark.timeout(1500)  # reference run + 13 `bhfl` processes: ~3 min idle, far more on a busy machine
def test_killed_and_resumed_run_is_bit_identical_to_uninterrupted(reference):
    run_dir, clean_path = reference
    sets = [arg for s in [*SMALL, *EXAMPLE] for arg in ("--set", s)]
    run_path = None
    for i, (fault, code, text, what) in enumerate(CHAIN):
        if run_path is None:
            out, session = cli("run", "configs/bhfl-full.yaml", *sets, faults=fault, run_dir=run_dir)
            started = [p for p in (run_dir / "itest").iterdir() if p != clean_path]
            assert started, f"no run folder made: {out.returncode}\n{out.stderr[-3000:]}"
            run_path = max(started, key=lambda p: p.name)
        else:
            if i in LISTED_AFTER:
                listed, _ = cli("runs", faults=None, run_dir=run_dir)
                assert listed.returncode == 0 and "a resume would redo: root round" in listed.stdout, listed.stdout
            executor = () if i in WITH_WORKERS else IN_PROCESS
            out, session = cli("resume", str(run_path), *executor, faults=fault, run_dir=run_dir)
        assert out.returncode == code, f"step {i}: {fault} ({what}): rc {out.returncode}\n{out.stderr[-3000:]}"
        assert text in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]
        if code != KILLED:
            assert f"bhfl resume {run_path}" in out.stderr.replace("\n", "")  # the message says how to go on
        assert leftovers(session) == [], f"step {i}: processes of the run outlived it"
        assert RunRecord.read(run_path).effective_status == ("interrupted" if code == KILLED else "failed")
    finished, _ = cli("resume", str(run_path), *IN_PROCESS, faults=None, run_dir=run_dir)
    assert finished.returncode == 0, finished.stderr[-3000:]

    clean, resumed = node_files(clean_path), node_files(run_path)
    assert len(clean) > 8 and clean.keys() == resumed.keys()
    assert [name for name in clean if clean[name] != resumed[name]] == []
    assert not list((run_path / "state").glob("**/.*.tmp"))  # the killed write's temporary file was removed
    assert StateStore(run_path / "state").load("root").rounds_done == 3

    # MLflow: exactly the record of the uninterrupted run
    record, clean_record = RunRecord.read(run_path), RunRecord.read(clean_path)
    assert record.status == "finished" and record.resumes == len(CHAIN)
    client = MlflowClient(record.tracking_uri)
    parent = client.get_run(record.parent_run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["bhfl.resumes"] == str(len(CHAIN))
    runs = client.search_runs([parent.info.experiment_id], f"tags.`{RUN_KEY_TAG}` = '{record.run_key}'")
    assert sorted(r.info.run_id for r in runs) == sorted([record.parent_run_id, *record.node_runs.values()])
    assert {r.info.status for r in runs} == {"FINISHED"}  # the runs the first attempt created were adopted
    same_path = client.search_runs([parent.info.experiment_id], f"tags.`bhfl.run_path` = '{run_path}'")
    assert len(same_path) == 1  # one parent run for the whole, interrupted run
    got, want = (
        _store_points(record.tracking_uri, record.run_key),
        _store_points(clean_record.tracking_uri, clean_record.run_key),
    )
    twice = {k: steps for k, steps in got.items() if len(steps) != len(set(steps))}
    assert twice == {}, f"{len(twice)} metric histories have a step logged twice: {sorted(twice)[:5]}"
    assert got == want  # every point the uninterrupted run logged, at the same steps (timings at step 0)
    assert got[("parent", "time/total_s")] == [0]
    clean_client = MlflowClient(clean_record.tracking_uri)
    promised = _artefacts(clean_client, clean_record.parent_run_id)
    assert {"config.yaml", "environment/packages.txt", "data/manifest.json", "report.md"} <= promised
    assert _artefacts(client, record.parent_run_id) == promised

    # resuming the finished run changes nothing: no attempt, no MLflow write
    run_json, tables = (run_path / "run.json").read_bytes(), _tables(record.tracking_uri)
    again, _ = cli("resume", str(run_path), faults=None, run_dir=run_dir)
    assert again.returncode == 0 and "finished; nothing to resume" in " ".join(again.stderr.split()), again.stderr
    assert (run_path / "run.json").read_bytes() == run_json
    assert _tables(record.tracking_uri) == tables  # metrics, latest metrics, runs (status, end time): row for row

    # --force-eval: evaluated again (no training), at a step of its own after the last root round
    forced, _ = cli("resume", str(run_path), "--force-eval", *IN_PROCESS, faults=None, run_dir=run_dir)
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert "after root round 3, re-evaluation 1 (MLflow step 4)" in " ".join(forced.stderr.split())  # not "round 4"
    report = (run_path / "report" / "report.md").read_text()
    over_time = report.split("## Quality against virtual time", 1)[1].split("\n## ", 1)[0]
    assert "\n| 3, re-evaluation 1 (MLflow step 4) | " in over_time and "\n| 4 | " not in over_time, over_time
    after = _store_points(record.tracking_uri, record.run_key)
    added = {k: sorted(set(steps) - set(got[k])) for k, steps in after.items()}  # KeyError: a new metric
    assert {tuple(v) for v in added.values()} == {(), (4,)}  # only points at step 4 (root rounds + 1)
    new_step = {k for k, steps in added.items() if steps}
    assert {("parent", "root/union/accuracy"), ("edge-de", "eval/union/accuracy")} <= new_step
    assert {k: steps for k, steps in after.items() if len(steps) != len(set(steps))} == {}
    history = {m.step: m.value for m in client.get_metric_history(record.parent_run_id, "root/union/accuracy")}
    assert history[4] == history[3]  # the same final models, the same scores
    assert RunRecord.read(run_path).forced_evaluations == 1 and RunRecord.read(run_path).status == "finished"
    assert node_files(run_path) == resumed  # nothing trained
