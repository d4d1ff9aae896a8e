"""Scheduled, reproducible pipelines: the experiment flow as a served Prefect deployment.

``bhfl serve CONFIG --cron "0 2 * * *"`` registers a deployment of ``bhfl-experiment``
whose parameters are the fully resolved config (so every scheduled run computes the
same thing and logs the same config hash, seed and data fingerprint), and serves it:
this process polls the Prefect API and runs each due (or UI-triggered) flow run in a
subprocess. Schedules need a real Prefect server (a temporary one never schedules):
with ``PREFECT_API_URL`` set it is used, otherwise a local ``prefect server start``
bound to 127.0.0.1 is started for the time the command runs. A sweep file and a
pipeline file are served the same way by their own modules (``flows.sweep.serve_sweep``,
``flows.pipeline.serve_pipeline``), each run a new sweep or pipeline folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def serve_experiment(config_data: dict, cron: str, name: str, run_root: Path, tracking_uri: str) -> None:
    """Register the deployment ``bhfl-experiment/<name>`` and serve it until interrupted."""
    from prefect.deployments.runner import EntrypointType

    from flows.experiment import experiment_flow

    deployment = experiment_flow.to_deployment(
        name=name,
        cron=cron,
        parameters={"config": config_data, "run_root": str(run_root), "tracking_uri": tracking_uri},
        description=f"B-HFL experiment `{config_data['name']}` (seed {config_data['seed']}) on a schedule: {cron}",
        tags=["bhfl", str(config_data["name"])],
        enforce_parameter_schema=False,
        entrypoint_type=EntrypointType.MODULE_PATH,  # runs from any working directory
    )
    serve_deployment(deployment)


def serve_deployment(deployment: Any) -> None:
    """Serve one deployment built by ``to_deployment`` (experiment, sweep or pipeline) until stopped.

    Prefect's ``serve`` with one change: its runner's SIGTERM handler (installed when the
    runner starts) hands the signal to the command's (flows/cli/stopping.py), so SIGTERM
    stops ``bhfl serve`` as Ctrl-C and SIGHUP do, one line and exit 128 + the signal.
    Prefect's own handler exits 0; a SIGTERM that came before the runner had started
    (the deployment already registered) met the command's and exited 143, so a
    supervisor saw one or the other by timing. Either way the runner unwinds the same:
    its schedules paused, the flow runs it started stopped. (Prefect's start table is not
    printed: the command's own line names the deployment, the UI and how to trigger it.)
    """
    import asyncio
    import contextlib
    import signal

    from prefect.deployments.runner import RunnerDeployment
    from prefect.runner import Runner

    assert isinstance(deployment, RunnerDeployment)  # to_deployment is sync outside an event loop
    commands = signal.getsignal(signal.SIGTERM)

    class CommandStoppedRunner(Runner):
        def handle_sigterm(self, *args: Any, **kwargs: Any) -> None:
            if not callable(commands):  # no handler of the command's (a caller that runs this in-process)
                super().handle_sigterm(*args, **kwargs)
                return
            commands(*args, **kwargs)  # the first raises Stopped(SIGTERM), unwound as Ctrl-C is

    runner = CommandStoppedRunner(pause_on_shutdown=True)
    runner.add_deployment(deployment)
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C or a Stopped: the command says how (flows/cli/shell.py)
        asyncio.run(runner.start())
