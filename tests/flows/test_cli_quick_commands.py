"""Quick commands stay quick (issue 17, part 5): `bhfl prepare` on a cache hit and `bhfl runs` import no
heavy library, report on stdout, and `bhfl runs` reads a run's plan from checkpoint headers; `bhfl run` starts
Prefect before it imports torch.

The run folder is made as a run leaves it (a data cache, a config, a record, the root's checkpoint of an
interrupted run); nothing is trained. The commands run as subprocesses (tests/flows/commands.py ``cli``), so
what they import is what a user's command imports.
"""

from __future__ import annotations

import json
import shutil

import pytest
import yaml
from typer.testing import CliRunner

from bhfl_core.config.schema import dump
from flows.cli.app import app
from flows.cli.options import DEFAULT_RUN_DIR, runs_folder_of
from flows.records.run_record import RunRecord, RunStateError
from tests.flows.commands import cli, sets
from tests.small import REPO, SMALL, small_config

pytestmark = pytest.mark.integration


@pytest.mark.own_data_cache  # a hit of the run dir's own cache
def test_prepare_on_a_cache_hit_is_quick_and_reports_on_stdout(tmp_path):
    from data_prep.prepare import prepare_data
    from tests.small import SMALL

    prepared = prepare_data(small_config(), tmp_path / "cache", log=lambda _: None)  # the cache, made inline
    sets = [arg for assignment in SMALL for arg in ("--set", assignment)]
    out = cli("prepare", *sets, "--run-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "cache hit (no tokenisation) in " in out.stdout
    assert f"  manifest: {prepared.root / 'manifest.json'}\n" in out.stdout
    assert "| en |" in out.stdout  # the partition report
    assert f"data cache hit {prepared.root}: reusing pre-tokenised shards" in out.stderr  # the note
    assert not list((tmp_path / ".prefect").glob("*.db"))  # no Prefect server was started for a hit

    # The same folder as a `kind: prepared` source is used in place, not a hit of the run dir's cache.
    source = f"data.source={{kind: prepared, path: {prepared.root}, languages: [en, de, fr]}}"
    out = cli("prepare", *sets, "--set", source, "--run-dir", str(tmp_path / "elsewhere"))
    assert out.returncode == 0, out.stderr
    assert "used in place (no tokenisation) in " in out.stdout and "cache hit" not in out.stdout
    assert not (tmp_path / "elsewhere" / "cache").exists()


def test_one_data_cache_serves_every_run_dir_and_a_file_in_its_place_is_refused(tmp_path, monkeypatch):
    """``BHFL_DATA_CACHE``: data prepared under one run dir is a cache hit under another, in that folder alone;
    a file where the folder should be is one line naming the variable, exit 2, nothing written."""
    from data_prep.cache_folder import DATA_CACHE_ENV
    from data_prep.prepare import prepare_data

    shared = tmp_path / "shared"
    monkeypatch.setenv(DATA_CACHE_ENV, str(shared))
    prepared = prepare_data(small_config(), shared, log=lambda _: None)  # as another run dir's command left it
    out = cli("prepare", *sets(), "--run-dir", str(tmp_path / "b"))
    assert out.returncode == 0 and "cache hit (no tokenisation) in " in out.stdout, out.stderr
    assert f"  manifest: {prepared.root / 'manifest.json'}\n" in out.stdout
    assert not (tmp_path / "b" / "cache").exists()

    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv(DATA_CACHE_ENV, str(tmp_path / "file"))
    refused = cli("run", *sets(), "--run-dir", str(tmp_path / "c"))
    error = " ".join(refused.stderr.split())
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert f"error: {DATA_CACHE_ENV}={tmp_path / 'file'}: {tmp_path / 'file'} is a file, not a folder" in error, error
    assert not list((tmp_path / "c").glob("itest/*"))  # refused before a run folder was made


@pytest.fixture(scope="module")
def prepared_run(tmp_path_factory):
    """A run dir with a data cache and an interrupted run: its config, record, data pointer, the root's checkpoint."""
    import torch

    from bhfl_core.algorithm.node_state import NodeState
    from bhfl_core.store.node_store import StateStore
    from bhfl_core.store.run_layout import DATA_POINTER, STATE_DIR
    from data_prep.cache_folder import data_cache_folder
    from data_prep.prepare import prepare_data

    run_dir = tmp_path_factory.mktemp("prepared")
    cfg = small_config()
    prepared = prepare_data(cfg, data_cache_folder(run_dir), log=lambda _: None)  # where its run left it
    path = run_dir / "itest" / "20260101-000000-001"
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump(dump(cfg), sort_keys=False))
    (path / DATA_POINTER).write_text(json.dumps({"data_root": str(prepared.root)}))
    # the root finished round 1 of 2 of the run's one execution (caller: the run itself)
    StateStore(path / STATE_DIR).save("root", NodeState(torch.zeros(8), rounds_done=1, exec_caller=""))
    RunRecord(name="itest", status="failed", started=1.7e9, error="killed").write(path)
    return run_dir, path


def test_runs_reads_the_plan_from_checkpoint_headers_and_names_a_damaged_one(prepared_run, tmp_path):
    run_dir, path = prepared_run
    runner = CliRunner()
    one = runner.invoke(app, ["runs", str(path), "--run-dir", str(run_dir)])
    assert one.exit_code == 0, one.output
    assert "root rounds saved: 1 of 2" in one.stdout and "root: round 2 of 2, 0 of 2 children finished" in one.stdout
    assert "a resume would redo: root round 2; final evaluation" in one.stdout

    copy = tmp_path / "itest" / path.name
    shutil.copytree(path, copy)
    node = copy / "state" / "nodes" / "root.safetensors"
    node.write_bytes(node.read_bytes()[:-3])  # truncated: the header still parses, the tensors end past the file
    listed = runner.invoke(app, ["runs", "--run-dir", str(tmp_path)])
    assert listed.exit_code == 0, listed.output
    assert f"{copy}  unreadable: checkpoint {node} is damaged (unreadable: the tensors end at byte" in listed.stdout


def test_a_run_typed_as_a_path_uses_the_runs_folder_it_lives_in(prepared_run, tmp_path, monkeypatch):
    """`bhfl runs /data/runs/x/<stamp>` typed in another folder creates no ./runs (nor its .prefect) there."""
    run_dir, path = prepared_run
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert runs_folder_of(str(path), DEFAULT_RUN_DIR) == run_dir.resolve()
    assert runs_folder_of(str(path), tmp_path) == tmp_path  # --run-dir given: it wins
    assert runs_folder_of(str(elsewhere), DEFAULT_RUN_DIR) == DEFAULT_RUN_DIR  # no run there
    one = CliRunner().invoke(app, ["runs", str(path)])
    assert one.exit_code == 0, one.output
    assert "root rounds saved: 1 of 2" in one.stdout
    assert not list(elsewhere.iterdir())


def _imported(*args: str) -> set[str]:
    """The top-level packages ``bhfl ARGS`` imported, read from ``python -X importtime``."""
    out = cli(*args, python=["-X", "importtime"])
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("import time:")]
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in lines}


@pytest.fixture(scope="module")
def quick_imports(prepared_run) -> dict[str, set[str]]:
    run_dir, path = prepared_run
    sets = [arg for assignment in SMALL for arg in ("--set", assignment)]
    return {
        "runs": _imported("runs", "--run-dir", str(run_dir)) | _imported("runs", str(path), "--run-dir", str(run_dir)),
        "prepare (cache hit)": _imported("prepare", *sets, "--run-dir", str(run_dir)),
    }


@pytest.mark.parametrize("library", ["torch", "transformers", "datasets", "prefect", "mlflow"])
def test_runs_and_a_prepare_cache_hit_import_no_heavy_library(quick_imports, library):
    """Structural, not timed: each of these costs 0.5-1.5 s to import; without them both commands take ~1 s."""
    for command, imported in quick_imports.items():
        assert library not in imported, f"`bhfl {command}` imports {library}"


def test_run_starts_prefect_before_importing_torch(tmp_path):
    """Without a warm start, nothing ``bhfl run`` does before its Prefect server starts imports torch (~1 s of
    CPU the server's boot would otherwise wait behind). The job is stopped where it would start the server."""
    code = (
        "import sys\n"
        "import flows.cli.run as run\n"
        "def server_starts_here(*args, **kwargs):\n"
        "    sys.exit(3 if 'torch' in sys.modules else 0)\n"
        "run.run_job = server_starts_here\n"
        "from flows.cli.app import app\n"
        "app(sys.argv[3:])\n"  # after the "-m flows.cli.app" that ``cli`` puts behind the interpreter's options
    )
    sets = [arg for assignment in (*SMALL, "runtime.executor=inprocess") for arg in ("--set", assignment)]
    out = cli("run", *sets, "--run-dir", str(tmp_path), python=["-c", code])
    assert out.returncode == 0, f"exit {out.returncode} (3: torch was imported)\n{out.stderr[-3000:]}"


def test_a_saved_config_refused_by_a_newer_rule_names_its_file_and_key(tmp_path):
    # a run saved before a rule tightened (here: a YAML boolean for a number), or a config.yaml edited by hand:
    # `bhfl runs` and a resume name the file and the key (was: "unreadable (1 validation error for ...)")
    folder = tmp_path / "itest" / "20260101-000000-000"
    folder.mkdir(parents=True)
    RunRecord(name="itest", status="interrupted", tracking_uri="sqlite:///unused.db").write(folder)
    saved = dump(small_config())
    saved["seed"] = True
    (folder / "config.yaml").write_text(yaml.safe_dump(saved))
    listed = CliRunner().invoke(app, ["runs", str(folder), "--run-dir", str(tmp_path)])
    assert listed.exit_code == 2, listed.output
    said = " ".join(listed.output.split())
    assert f"{folder / 'config.yaml'}: the run's saved config is refused by this bhfl" in said
    assert "seed: expected a number, got the boolean true" in said and "edit that file" in said
    assert RunRecord.read(folder).status == "interrupted"  # nothing written

    # one the tree's checks refuse (an async-only key at a synchronous server): named before the resume touches
    # the run (met mid-resume, it marked the run failed; a finished run's --force-eval too)
    from flows.experiment import resume_experiment

    saved["seed"], saved["tree"]["root"]["buffer"] = 0, 7
    (folder / "config.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(RunStateError, match=r"config.yaml: the run's saved config is refused(.|\n)*tree.root.buffer"):
        resume_experiment(folder)
    assert RunRecord.read(folder).status == "interrupted"


def test_resume_of_a_run_whose_record_is_damaged_is_one_line_naming_the_file(tmp_path):
    # a run.json cut off by a full disk or a bad copy: one line naming the file, exit 2, the file kept as it was
    folder = tmp_path / "itest" / "20260101-000000-000"
    folder.mkdir(parents=True)
    (folder / "run.json").write_text('{"name": "itest", "sta')
    (folder / "config.yaml").write_text("name: itest\n")
    out = CliRunner().invoke(app, ["resume", str(folder), "--run-dir", str(tmp_path)])
    assert out.exit_code == 2, out.output
    assert out.exception is None or isinstance(out.exception, SystemExit)  # no traceback
    message = " ".join(out.output.split())
    assert f"{folder / 'run.json'}: damaged run record (Invalid JSON" in message
    assert (folder / "run.json").read_text() == '{"name": "itest", "sta'
    synced = CliRunner().invoke(app, ["sync", str(folder), "--run-dir", str(tmp_path)])  # (was a traceback)
    assert synced.exit_code == 2 and f"{folder / 'run.json'}: damaged run record" in " ".join(synced.output.split())
    listed = CliRunner().invoke(app, ["runs", "--run-dir", str(tmp_path)])  # the listing shows it, unreadable
    assert listed.exit_code == 0, listed.output
    assert "unreadable: " in listed.output and "damaged run record" in " ".join(listed.output.split())


def test_runs_lists_a_sweep_with_its_points_grouped(prepared_run, tmp_path):
    # `bhfl sweep --run-dir X` then `bhfl runs X` showed each point as an unrelated run and no sweep; `bhfl runs
    # SWEEP_FOLDER` was "no run". A sweep of 100 points as its records leave it: 97 finished, 2 failed, 1 pending.
    from flows.records.sweep_record import PointRecord, SweepRecord

    _, interrupted = prepared_run
    run_dir = tmp_path / "runs"
    shutil.copytree(interrupted, run_dir / "itest" / interrupted.name)  # a run of no sweep: listed as before
    saved = yaml.safe_dump(dump(small_config()), sort_keys=False)
    points = {}
    for i in range(100):
        label, path = f"eta_down={i},seed=0", run_dir / "itest" / f"20260102-000000-{i:03d}"
        status = "failed" if i in (3, 50) else "finished"
        if i < 99:  # the last point never started
            path.mkdir(parents=True)
            (path / "config.yaml").write_text(saved)
            RunRecord(
                name="itest", status=status, started=1.8e9 + i, error=f"boom {i}\nmore" if status == "failed" else ""
            ).write(path)
        points[label] = PointRecord(
            config_hash=f"{i:016x}", run_path=str(path) if i < 99 else "", run_id=f"{i:032x}" if i < 99 else ""
        )
    folder = run_dir / "itest-sweep" / "20260102-000000-000"
    folder.mkdir(parents=True)
    (folder / "sweep.yaml").write_text("{}\n")  # (not read by the listing)
    sweep_id = "5eef" * 8
    SweepRecord(name="itest-sweep", status="failed", started=1.8e9, run_id=sweep_id, points=points).write(folder)

    listed = CliRunner().invoke(app, ["runs", "--run-dir", str(run_dir)])
    assert listed.exit_code == 0, listed.output
    lines = listed.output.splitlines()
    assert lines[0].startswith("sweep itest-sweep/20260102-000000-000  failed  ") and sweep_id in lines[0]
    assert lines[1] == "    100 points: 97 finished, 2 failed, 1 pending"
    assert f"    eta_down=3,seed=0: failed  {run_dir}/itest/20260102-000000-003  (boom 3)" in lines
    assert "    eta_down=99,seed=0: pending  (not started)" in lines
    assert sum(line.startswith("    eta_down=") for line in lines) == 100
    assert f"    continue with: bhfl resume {folder}" in lines
    assert sum(line.startswith("itest/") for line in lines) == 1  # the points are not listed again as runs
    assert lines[-1] == "(99 runs of the sweeps above not listed again: `bhfl runs RUN` shows one's plan)"

    as_json = json.loads(CliRunner().invoke(app, ["runs", "--run-dir", str(run_dir), "--json"]).output)
    sweep = next(entry for entry in as_json if entry["kind"] == "sweep")
    assert (sweep["status"], sweep["mlflow_run_id"], len(sweep["points"])) == ("failed", sweep_id, 100)
    assert sweep["points"][3] == {
        "label": "eta_down=3,seed=0",
        "status": "failed",
        "path": str(run_dir / "itest" / "20260102-000000-003"),
        "mlflow_run_id": f"{3:032x}",
    }
    assert sum(entry["kind"] == "run" for entry in as_json) == 100  # --json keeps every run, points included

    for spec in (str(folder), "itest-sweep/20260102-000000-000", sweep_id[:8]):  # one sweep, however named
        one = CliRunner().invoke(app, ["runs", spec, "--run-dir", str(run_dir)])
        assert one.exit_code == 0 and one.output.splitlines()[:2] == lines[:2], (spec, one.output)


@pytest.mark.parametrize(
    "command",
    [
        ["run", "embedded.yaml", "--set", "seed=x"],
        ["sweep", "embedded.yaml", "--grid", "tree.edge.eta_dwn=1.0,0.5"],
        ["run", "groupperfl.yaml", "--set", "stages.nope.seed=1"],
    ],
)
def test_a_refused_config_makes_no_run_dir(tmp_path, command):
    # a config mistake is found before anything is made: `--run-dir NEW` with a typo left an empty NEW behind
    command[1] = str(REPO / "configs" / command[1])
    out = CliRunner().invoke(app, [*command, "--run-dir", str(tmp_path / "new")])
    assert out.exit_code == 2 and out.output.startswith("error: "), out.output
    assert not (tmp_path / "new").exists()


def test_resume_set_follows_one_rule_whether_or_not_the_run_finished(tmp_path):
    # `bhfl resume RUN --set tree.root.rounds=5` on a finished run said "nothing to resume" and dropped the --set
    folder = tmp_path / "itest" / "20260101-000000-000"
    folder.mkdir(parents=True)
    RunRecord(name="itest", status="finished", tracking_uri="sqlite:///unused.db").write(folder)
    (folder / "config.yaml").write_text(yaml.safe_dump(dump(small_config()), sort_keys=False))
    saved, record = (folder / "config.yaml").read_bytes(), (folder / "run.json").read_bytes()

    def resume(*sets: str):
        args = [arg for assignment in sets for arg in ("--set", assignment)]
        out = CliRunner().invoke(app, ["resume", str(folder), *args, "--run-dir", str(tmp_path)])
        return out.exit_code, " ".join(out.output.split())

    code, said = resume("tree.root.rounds=5")  # a key a resume may not change: refused, as for any resume
    assert code == 2 and "--set tree.root.rounds=5: a resumed run keeps its config" in said, said
    code, said = resume("runtime.workers=1", "eval.batch_size=8")  # allowed, but nothing runs: said so
    assert code == 0 and "finished; nothing to resume" in said, said
    assert "--set runtime.workers=1 --set eval.batch_size=8 not applied: nothing runs" in said
    assert (folder / "config.yaml").read_bytes() == saved and (folder / "run.json").read_bytes() == record

    RunRecord(name="itest", status="interrupted", tracking_uri="sqlite:///unused.db").write(folder)
    record = (folder / "run.json").read_bytes()
    code, said = resume("seed=1")  # an unfinished run: refused before Prefect or a worker starts
    assert code == 2 and "--set seed=1: a resumed run keeps its config" in said, said
    assert not (tmp_path / ".prefect").exists()  # (it was refused after the command's Prefect server started)
    assert (folder / "run.json").read_bytes() == record


def test_a_prefect_api_url_that_is_no_prefect_server_is_one_line_and_nothing_is_made(tmp_path):
    # PREFECT_API_URL at a web server that is not Prefect (here: one that answers 404 to everything): Prefect's
    # client failed with a traceback ("Failed to reach API", exit 1) after the run folder and mlflow.db were made
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class NotPrefect(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_error(404)

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), NotPrefect)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    api_url = f"http://127.0.0.1:{server.server_port}/api"
    try:
        out = cli("run", *sets(), "--run-dir", str(tmp_path / "runs"), env={"PREFECT_API_URL": api_url})
    finally:
        server.shutdown()
    assert out.returncode == 2, out.stderr[-3000:]
    said = " ".join(out.stderr.split())
    assert f"error: PREFECT_API_URL is {api_url}: something answers there, but not as a Prefect API" in said
    assert "(GET /admin/version: HTTP 404 Not Found; " in said and "Traceback" not in out.stderr
    assert list((tmp_path / "runs").iterdir()) == []  # no mlflow.db, no run folder


@pytest.mark.parametrize("command", [["prepare"], ["runs"]])
def test_a_run_dir_that_is_a_file_is_one_line(tmp_path, command):
    # `--run-dir configs/bhfl.yaml` (a slip of the hand): the folder cannot be made, exit 2, not a FileExistsError
    given = tmp_path / "bhfl.yaml"
    given.write_text("name: bhfl\n")
    out = CliRunner().invoke(app, [*command, "--run-dir", str(given / "sub" if command == ["runs"] else given)])
    assert out.exit_code == 2, out.output
    assert out.exception is None or isinstance(out.exception, SystemExit)  # no traceback
    assert f"error: --run-dir {given}" in out.output and "not a folder" in out.output
    assert given.read_text() == "name: bhfl\n"


def test_a_model_check_failing_in_one_pipeline_stage_names_the_stage(tmp_path, monkeypatch):
    """The model and data checks run once per distinct (data, model) before anything starts: a failure in one
    stage says which (the same for a sweep's points: test_sweep.py)."""
    import os

    monkeypatch.setattr(os, "environ", os.environ.copy())
    base = tmp_path / "small.yaml"
    base.write_text(yaml.safe_dump(dump(small_config("runtime.executor=inprocess"))))
    spec = tmp_path / "pipeline.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "name": "two",
                "stages": {
                    "one": {"base": str(base)},
                    "two": {"base": str(base), "model": {"name": str(tmp_path / "nowhere")}},
                },
            }
        )
    )
    out = CliRunner().invoke(app, ["run", str(spec), "--run-dir", str(tmp_path / "runs")])
    assert out.exit_code == 2, out.output
    assert " ".join(out.stderr.split()).startswith("error: stage 'two': model.name: the folder")
    assert not (tmp_path / "runs" / "two").exists()


@pytest.mark.parametrize("command", ["run", "sweep"])
def test_an_adapter_option_matching_no_module_stops_the_command_before_anything_starts(command, tmp_path, monkeypatch):
    """Checked on the model built without weights: one line naming the key, exit 2; no run or sweep folder, no
    Prefect server, no data prepared (it was found only once the run had built its model, its folder written)."""
    import os

    monkeypatch.setattr(os, "environ", os.environ.copy())  # the CLI's defaults (PREFECT_HOME...) stay in this test
    sets = [*SMALL, "runtime.executor=inprocess", "model.adapter={r: 4, rank_pattern: {valeu: 2}}"]
    args = [arg for assignment in sets for arg in ("--set", assignment)]
    extra = ["--seeds", "0,1"] if command == "sweep" else []
    out = CliRunner().invoke(app, [command, *args, *extra, "--run-dir", str(tmp_path)])
    assert out.exit_code == 2, out.output
    line = "error: model.adapter.rank_pattern: 'valeu' matches none of the adapted modules"
    assert out.stderr.startswith(line) and out.stderr.count("\n") == 1, out.stderr
    assert [p.name for p in tmp_path.iterdir()] == []  # nothing: no itest/<stamp>, no .prefect, no cache


def test_a_job_runs_with_the_cyclic_collector_on_and_the_libraries_frozen(tmp_path):
    """The command's entry turns the collector off for its imports (flows/cli/stopping.py); ``run_job`` must turn
    it back on before the work, or a sweep of hours would never free a reference cycle (tasks/collector.py)."""
    import dataclasses
    import gc

    from flows.cli.jobs import run_job
    from flows.cli.run import EXPERIMENT

    seen: dict[str, object] = {}

    def work(launch) -> dict:
        seen.update(on=gc.isenabled(), frozen=gc.get_freeze_count())
        return {}

    kind = dataclasses.replace(EXPERIMENT, summary=lambda result, run_dir: None)
    gc.disable()  # as the command's entry leaves it
    try:
        run_job(kind, tmp_path / "job", tmp_path, False, work, "a job")
    finally:
        gc.unfreeze()
        gc.enable()
    assert seen["on"] is True and isinstance(seen["frozen"], int) and seen["frozen"] > 100_000


@pytest.mark.parametrize(("command", "on"), [(["runs"], True), (["run", "missing.yaml"], False)])
def test_a_command_without_a_job_turns_the_collector_on_at_once(tmp_path, command, on):
    """Every command but run, sweep and resume collects from its start (the app's callback); those three from
    their work (``run_job``), so one that ends before it (a config error) leaves it to the command's entry."""
    import gc

    gc.disable()
    try:
        out = CliRunner().invoke(app, [*command, "--run-dir", str(tmp_path)])
        found = gc.isenabled()
    finally:
        gc.unfreeze()
        gc.enable()
    assert out.exit_code == (0 if on else 2), out.output
    assert found is on
