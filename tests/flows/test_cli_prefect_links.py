"""Where a job's Prefect flow run is, told on stderr (issue 17, part 5): the Prefect UI and the flow run's page
for a user's server, how to browse a run of the command's own server, looked up only once the job ends; and what
each job kind loads while Prefect boots (the module of its flow, whose names the links look up).
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import uuid

import pytest

from tests.flows.prefect_api import api
from tests.small import REPO, SMALL

pytestmark = pytest.mark.integration


def test_run_prints_the_prefect_ui_and_the_flow_run_on_stderr(tmp_path):
    """With a Prefect server of the user's: its UI at the start, the experiment's flow run page once it exists."""
    from prefect.settings import PREFECT_API_URL

    api_url = str(PREFECT_API_URL.value())  # the session's Prefect test server, as a user's server
    ui = api_url.removesuffix("/api")
    extra = ("tree.root.rounds=1", "eval.every=0", "runtime.executor=inprocess")
    sets = [arg for assignment in (*SMALL, *extra) for arg in ("--set", assignment)]
    env = {**os.environ, "PREFECT_API_URL": api_url, "HF_HUB_OFFLINE": "1", "COLUMNS": "60"}  # narrow: no wrapping
    env.pop("MLFLOW_TRACKING_URI", None)
    out = subprocess.run(
        [sys.executable, "-m", "flows.cli.app", "run", *sets, "--run-dir", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"\nPrefect UI: {ui}\n" in out.stderr and "Prefect" not in out.stdout
    link = rf"^Prefect flow run: {re.escape(ui)}/runs/flow-run/([0-9a-f-]{{36}})$"  # one line, whole
    (flow_run_id,) = re.findall(link, out.stderr, re.M)
    run = api(f"{api_url}/flow_runs/{flow_run_id}")
    assert api(f"{api_url}/flows/{run['flow_id']}")["name"] == "bhfl-experiment" and run["state_type"] == "COMPLETED"
    assert run["parameters"]["run_path"] == str(next((tmp_path / "itest").iterdir()))
    # the MLflow links on stdout: the run in the model-training view, the run list with the headline columns
    run_page = r"http://127\.0\.0\.1:5000/#/experiments/\d+/runs/[0-9a-f]{32}\?workflowType=machine_learning$"
    assert re.search(rf"then browse {run_page}", out.stdout, re.M), out.stdout
    runs_page = r"/#/experiments/\d+/runs\?viewStateShareKey=bhfl-headline&workflowType=machine_learning$"
    assert re.search(rf"headline metrics as columns: http://127\.0\.0\.1:5000{runs_page}", out.stdout, re.M)


def test_the_own_servers_flow_run_is_named_with_how_to_browse_it(tmp_path, monkeypatch):
    """The command's own server has no UI and stops with it: the line says where its records stay and how to look."""
    from prefect import flow
    from rich.console import Console

    from flows.cli.prefect_link import flow_run_link

    @flow(name="bhfl-link-test")
    def fake(run_path: str) -> None:
        """Stands in for the experiment flow (a name of its own: other tests count bhfl-experiment runs)."""

    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / ".prefect"))
    console = Console(file=io.StringIO(), width=60, soft_wrap=True)
    path = tmp_path / "itest" / "20260101-000000-001"
    fake(str(path))  # an earlier attempt of the same run: not the one the command starts
    with flow_run_link(console, own_server=True, path=path, flow=("bhfl-link-test", "run_path")):
        flow_run_id = fake(str(path), return_state=True).state_details.flow_run_id
    (line,) = console.file.getvalue().splitlines()
    assert line.startswith(f"Prefect flow run {flow_run_id}: this command's Prefect server stops with it")
    assert f"`PREFECT_HOME={tmp_path / '.prefect'} .venv/bin/prefect server start`" in line
    assert line.endswith(f"/runs/flow-run/{flow_run_id}")


def test_a_new_jobs_flow_run_is_looked_up_only_at_its_end(tmp_path, monkeypatch):
    """A new job's folder has no flow run yet: no API read before the job starts (it would delay the first
    client training); the run it starts is still found at the end, and a resumed folder's earlier runs are not."""
    from prefect import flow
    from rich.console import Console

    from flows.cli import prefect_link

    @flow(name="bhfl-link-new-test")
    def fake(run_path: str) -> None:
        """Stands in for the experiment flow (a name of its own: other tests count bhfl-experiment runs)."""

    reads: list[str] = []
    matching = prefect_link._FlowRuns._matching

    def counted(self):  # the real lookup, counted
        reads.append(self.path)
        return matching(self)

    monkeypatch.setattr(prefect_link._FlowRuns, "_matching", counted)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / ".prefect"))
    for new, reads_before in ((True, 0), (False, 1)):
        reads.clear()
        console = Console(file=io.StringIO(), width=60, soft_wrap=True)
        path = tmp_path / "itest" / f"20260101-000000-00{int(new)}"
        if not new:
            fake(str(path))  # the earlier attempt of a resumed run: not the one the command starts
        with prefect_link.flow_run_link(console, True, path, ("bhfl-link-new-test", "run_path"), new=new):
            assert len(reads) == reads_before
            flow_run_id = fake(str(path), return_state=True).state_details.flow_run_id
        assert len(reads) == reads_before + 1
        assert console.file.getvalue().startswith(f"Prefect flow run {flow_run_id}: ")


def test_the_flow_module_loads_while_prefect_boots(tmp_path, monkeypatch):
    """``tracking_store_ready`` imports the job's flow module before it waits for the Prefect API, and opens the
    MLflow store meanwhile."""
    from flows.cli.shell import tracking_store_ready

    module = f"bhfl_probe_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text("LOADED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[bool] = []
    uri = tracking_store_ready(tmp_path, None, lambda: seen.append(module in sys.modules), module)
    assert seen == [True]
    assert uri == f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}" and (tmp_path / "mlflow.db").is_file()


def test_each_job_kind_loads_the_module_of_its_flow():
    """What a job imports while Prefect boots is where its flow is defined (a moved flow: the load would miss it)."""
    import importlib

    from prefect import Flow

    from flows.cli.pipeline import PIPELINE
    from flows.cli.run import EXPERIMENT
    from flows.cli.sweep import _kind

    for kind in (EXPERIMENT, PIPELINE, _kind(1)):
        module = importlib.import_module(kind.module)
        flows_there = [v for v in vars(module).values() if isinstance(v, Flow)]
        assert kind.flow[0] in [f.name for f in flows_there], kind.module


def test_the_links_name_each_flow_and_its_folder_parameter():
    """The pipeline and sweep commands find their flow run by these names (a renamed flow or parameter: no link)."""
    import inspect

    from flows.cli.prefect_link import EXPERIMENT_FLOW, PIPELINE_FLOW, SWEEP_FLOW
    from flows.experiment import experiment_flow
    from flows.pipeline import pipeline_flow
    from flows.sweep import sweep_flow

    for (name, parameter), flow_ in (
        (EXPERIMENT_FLOW, experiment_flow),
        (PIPELINE_FLOW, pipeline_flow),
        (SWEEP_FLOW, sweep_flow),
    ):
        assert flow_.name == name and parameter in inspect.signature(flow_.fn).parameters


FIRST_PREFECT_IMPORT = """
import os, sys

class FirstPrefectImport:
    '''Say whether the command's Prefect API was in the environment when Prefect was first imported, and end.'''

    def find_spec(self, name, path=None, target=None):
        if name.startswith("prefect."):  # the package's own imports: it is being imported (not a find_spec lookup)
            print("PREFECT_API_URL " + ("set" if "PREFECT_API_URL" in os.environ else "unset"), flush=True)
            os._exit(0)  # (the command's own server and workers die with it)

sys.meta_path.insert(0, FirstPrefectImport())
sys.argv[0] = "bhfl"
from flows.cli.app import app
from flows.cli.stopping import run_command

run_command(lambda: app)
"""


def test_prefect_is_first_imported_once_the_commands_own_server_is_in_the_environment(tmp_path):
    """Prefect reads PREFECT_API_URL once, when first imported. `bhfl sweep` and a pipeline imported their flow
    modules (which import Prefect) before the command's own server was set: the job's flow-run lookup at its
    end then started a temporary Prefect server of Prefect's own on the same database (13 s, also after Ctrl-C).
    Both commands at once (each ends at Prefect's first import)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["HF_HUB_OFFLINE"] = "1"
    sets = [arg for assignment in SMALL for arg in ("--set", assignment)]
    jobs = {
        "sweep": ["sweep", "configs/embedded.yaml", *sets, "--grid", "tree.edge.eta_down=1.0,0.5", "--seeds", "0"],
        "pipeline": ["run", "configs/groupperfl.yaml"],
    }
    started = {
        kind: subprocess.Popen(
            [sys.executable, "-c", FIRST_PREFECT_IMPORT, *job, "--run-dir", str(tmp_path / kind)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for kind, job in jobs.items()
    }
    for kind, proc in started.items():
        out, err = proc.communicate(timeout=300)
        assert out.splitlines()[-1:] == ["PREFECT_API_URL set"], (kind, out[-2000:], err[-3000:])
