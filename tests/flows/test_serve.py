"""`bhfl serve` as a user runs it: a local Prefect server, a cron deployment, a run triggered from the API.

No PREFECT_API_URL: the command starts its own `prefect server start` (127.0.0.1), registers
`bhfl-experiment/<name>` with the cron schedule and the resolved config as parameters, and
serves it. The test checks over the Prefect REST API that the schedule is registered and
that the scheduler created upcoming runs from it, triggers a run as the UI's "Run" button
does, waits for it to complete, and finds the experiment in the MLflow store with the
reproducibility tags. Stopping the command (SIGTERM) stops its server too.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
import torch
from mlflow import MlflowClient

from flows.cli.shell import cron_problem
from tests.flows.kill_chain import leftovers
from tests.flows.prefect_api import api
from tests.small import REPO, SMALL

pytestmark = pytest.mark.integration


def _wait(what: str, check, timeout_s: float, proc: subprocess.Popen):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        assert proc.poll() is None, f"bhfl serve exited early while waiting for {what}"
        try:
            found = check()
        except OSError:
            found = None
        if found:
            return found
        time.sleep(1)
    raise AssertionError(f"timed out waiting for {what}")


def _temporary_servers(session: int) -> list[str]:
    """Prefect's temporary servers (what its client starts when it has no API URL) among the command's processes."""
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        try:
            if os.getsid(process.pid) == session and "prefect.server.api.server:create_app" in process.info["cmdline"]:
                found.append(f"{process.pid} {' '.join(process.info['cmdline'])}")
        except (ProcessLookupError, PermissionError, TypeError):
            continue
    return found


def _start_serve(tmp_path, log, cron: str = "0 2 * * *", config: str = "configs/embedded.yaml") -> subprocess.Popen:
    """`bhfl serve` of the small experiment (or a sweep file, its --set applied to every point) as a cron deployment
    ``nightly``, with no Prefect server of the user's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "3",
            "PREFECT_RUNNER_POLL_FREQUENCY": "2",
        }
    )
    sets = [arg for s in [*SMALL, "tree.root.rounds=1", "eval.every=0"] for arg in ("--set", s)]
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flows.cli.app",
            "serve",
            config,
            "--cron",
            cron,
            "--name",
            "nightly",
            *sets,
            "--run-dir",
            str(tmp_path / "runs"),
        ],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _api_of(proc: subprocess.Popen, log) -> str:
    """The API of the Prefect server `bhfl serve` says it serves on, once it says so."""

    def ui_url():
        log.seek(0)
        match = re.search(r"Prefect UI\s+(http://127\.0\.0\.1:\d+)", log.read())
        return match and match.group(1)

    return _wait("the Prefect server", ui_url, 240, proc) + "/api"


def _deployment_with_its_schedule(base: str, proc: subprocess.Popen) -> dict:
    """The registered deployment, once the scheduler has created its upcoming runs (checked against the cron)."""
    deployment = _wait("the deployment", lambda: api(f"{base}/deployments/name/bhfl-experiment/nightly"), 120, proc)
    assert [s["schedule"]["cron"] for s in deployment["schedules"]] == ["0 2 * * *"]
    assert deployment["parameters"]["config"]["name"] == "itest"  # the resolved config, pinned
    assert deployment["parameters"]["config"]["tree"]["root"]["rounds"] == 1

    by_deployment = {"deployments": {"id": {"any_": [deployment["id"]]}}}
    scheduled = _wait("scheduled runs", lambda: api(f"{base}/flow_runs/filter", by_deployment), 120, proc)
    assert all(r["state_type"] == "SCHEDULED" and "T02:00:00" in r["expected_start_time"] for r in scheduled)
    return deployment


def _quick_run(base: str, deployment: dict, proc: subprocess.Popen, log_path) -> None:
    """A run triggered as the UI's "Quick run" does, waited for; its progress is in its Prefect logs."""
    run = api(f"{base}/deployments/{deployment['id']}/create_flow_run", {})

    def finished():
        state = api(f"{base}/flow_runs/{run['id']}")["state_type"]
        assert state not in ("FAILED", "CRASHED"), f"flow run {state}; serve log:\n{log_path.read_text()[-4000:]}"
        return state == "COMPLETED"

    _wait("the triggered run", finished, 420, proc)
    # named as `bhfl run` names its flow runs (the config's name, the minute), not Prefect's random words
    name = api(f"{base}/flow_runs/{run['id']}")["name"]
    assert re.fullmatch(r"itest \d{4}-\d\d-\d\d \d\d:\d\d", name), name
    # the run's progress is in its logs in the Prefect UI (bhfl.progress, a Prefect extra logger)
    logs = api(f"{base}/logs/filter", {"logs": {"flow_run_id": {"any_": [run["id"]]}}})
    assert any("root rounds" in entry["message"] for entry in logs), [e["message"] for e in logs][:10]


def _check_the_experiment_in_mlflow(run_dir) -> None:
    """The served run's experiment in the MLflow store, finished, with the reproducibility tags and environment."""
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("itest")
    (parent,) = client.search_runs(
        [experiment.experiment_id], filter_string="attributes.run_name LIKE 'itest seed=0 %'"
    )
    tags = parent.data.tags
    assert parent.info.status == "FINISHED"
    assert tags["bhfl.seed"] == "0" and tags["bhfl.config_hash"] and tags["bhfl.data_fingerprint"]
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?|unknown", tags["bhfl.git_commit"])
    assert tags["bhfl.version.torch"].startswith("2.13")
    assert tags["bhfl.cpu_capability"] == torch.backends.cpu.get_cpu_capability()  # results depend on it
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id, "environment")}
    assert artifacts == {"environment/packages.txt"}


def test_serve_registers_cron_deployment_and_runs_it(tmp_path):
    with open(tmp_path / "serve.log", "w+") as log:
        proc = _start_serve(tmp_path, log)
        try:
            base = _api_of(proc, log)
            deployment = _deployment_with_its_schedule(base, proc)
            # registered and polled through the server it printed: no temporary server of Prefect's beside it on
            # the same database (Prefect imported before PREFECT_API_URL was set kept no API URL and started one)
            assert _temporary_servers(proc.pid) == []
            log.seek(0)  # the command another shell can paste names that server
            assert f"`PREFECT_API_URL={base} " in log.read()
            _quick_run(base, deployment, proc, tmp_path / "serve.log")
        finally:
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C (SIGTERM: the sweep's test)
            code = proc.wait(timeout=60)
            log.seek(0)
            said = log.read()
    assert code == 130, said[-3000:]
    assert said.rstrip().endswith(  # (it said "Start the command again.", of a run it had started)
        "stopped by SIGINT. A run it had started and not finished is interrupted, nothing of it lost: `bhfl runs "
        f"--run-dir {tmp_path / 'runs'}` lists it, `bhfl resume RUN` continues it; the same `bhfl serve` serves the "
        "deployment again."
    ), said[-3000:]
    assert leftovers(proc.pid) == []
    _check_the_experiment_in_mlflow(tmp_path / "runs")
    try:
        api(f"{base}/health")
        raise AssertionError("the Prefect server outlived `bhfl serve`")
    except OSError:
        pass


def test_a_bad_cron_is_one_line_and_leaves_nothing_running(tmp_path):
    with open(tmp_path / "serve.log", "w+") as log:
        proc = _start_serve(tmp_path, log, cron="61 2 * * *")
        assert proc.wait(timeout=120) == 2
        log.seek(0)
        said = log.read()
    assert said.startswith(
        "error: --cron '61 2 * * *': not a valid cron expression (Invalid cron string: \"61 2 * * *\"); five fields"
    ), said
    assert len(said.strip().splitlines()) == 1, said
    assert leftovers(proc.pid) == []


def test_a_cron_of_six_fields_is_refused_not_read_as_seconds():
    """One `*` too many made Prefect's croniter read seconds: "0 2 * * * *" was a run every second of 02:00."""
    assert cron_problem("0 2 * * *") is None and cron_problem("@daily") is None
    assert cron_problem("0 2 * * * *") == (
        "6 fields: Prefect reads a sixth as seconds, so this would start a run every second"
    )
    assert (
        cron_problem("0 2 * * *  2027") is not None
        and cron_problem("61 2 * * *") == 'Invalid cron string: "61 2 * * *"'
    )


def test_a_served_sweep_registers_through_the_printed_server_and_sigterm_stops_it(tmp_path):
    """SIGTERM once Prefect's runner polls (it has installed its SIGTERM handler by then): one line, exit 143, as
    Ctrl-C's 130. Prefect's handler exited 0 and the command's, met before the runner started, 143: CI saw each."""
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(
        f"name: nightly-sweep\nbase: {REPO}/configs/embedded.yaml\ngrid: {{tree.edge.eta_down: [1.0, 0.5]}}\n"
    )
    with open(tmp_path / "serve.log", "w+") as log:
        proc = _start_serve(tmp_path, log, config=str(sweep))
        try:
            base = _api_of(proc, log)
            deployment = _wait("the deployment", lambda: api(f"{base}/deployments/name/bhfl-sweep/nightly"), 120, proc)
            assert len(deployment["parameters"]["sweep"]["points"]) == 2, deployment["parameters"]
            assert _temporary_servers(proc.pid) == []  # (flows.sweep, which imports Prefect, was imported too early)
            # the runner's first poll marks the deployment polled
            _wait("the runner", lambda: api(f"{base}/deployments/{deployment['id']}")["last_polled"], 120, proc)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            code = proc.wait(timeout=60)
            log.seek(0)
            said = log.read()
    assert code == 143, said[-3000:]  # 128 + SIGTERM, as every bhfl command (docs/runtime.md, "Faults")
    assert said.rstrip().endswith("the same `bhfl serve` serves the deployment again."), said[-3000:]
    assert "stopped by SIGTERM." in said.splitlines()[-1], said[-3000:]
    assert leftovers(proc.pid) == []


def test_a_prefect_server_of_the_users_that_does_not_answer_is_one_line(tmp_path):
    """PREFECT_API_URL naming a server that is not running: one line naming it, exit 2 (it was httpx's traceback after
    Prefect's retries, exit 1; `bhfl run` the same: tests share this check, flows/cli/shell.py::prefect_api). Served
    here: a pipeline file, checked and then served like an experiment (it was refused as "a pipeline")."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # free once closed: nothing listens there
    api_url = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}  # (a proxy is left to Prefect)
    env.update({"HF_HUB_OFFLINE": "1", "PREFECT_API_URL": api_url})
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli.app",
            "serve",
            "configs/groupperfl.yaml",
            "--run-dir",
            str(tmp_path / "runs"),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.startswith(
        f"error: PREFECT_API_URL is {api_url}: nothing answers at 127.0.0.1:{port} (Connection refused). Start that "
        "Prefect server (`prefect server start`), or unset PREFECT_API_URL"
    ), out.stderr[-3000:]
    assert len(out.stderr.strip().splitlines()) == 1 and not out.stdout
