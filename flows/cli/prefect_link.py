"""Where a command's Prefect flow run can be seen: one line on stderr, beside the MLflow run's.

A Prefect server of the user's (``$PREFECT_API_URL``) has a UI: its address is printed
when the command starts, and the flow run's page as soon as the run exists, so it can
be watched live. The command's own server (flows/services/prefect_server.py) has no UI
and stops with the command, but its database stays in ``$PREFECT_HOME`` (the run
folder's ``.prefect/``); at the end the command says how to browse the flow run there
with ``prefect server start``.

The flow run is found through the API: the newest run of the flow whose folder
parameter (``run_path`` of an experiment, ``pipeline_path`` of a pipeline, ``sweep_path``
of a sweep) is this command's folder and which did not exist when the command started
(a resumed run has earlier ones). Nothing here may fail a command: a lookup that fails
prints nothing.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console

from flows.cli.shell import command_of

EXPERIMENT_FLOW = ("bhfl-experiment", "run_path")  # a flow's name, and its parameter that names the folder
PIPELINE_FLOW = ("bhfl-pipeline", "pipeline_path")
SWEEP_FLOW = ("bhfl-sweep", "sweep_path")
POLL_S = 1.0


class _FlowRuns:
    """Runs of ``flow`` whose folder parameter is ``path`` that appear after it was made."""

    def __init__(self, flow: tuple[str, str], path: Path, new: bool) -> None:
        (self.flow, self.parameter), self.path = flow, str(path)
        self.before = set() if new else {run.id for run in self._matching()}

    def _matching(self) -> list[Any]:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import FlowFilter, FlowFilterName
        from prefect.client.schemas.sorting import FlowRunSort

        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(
                flow_filter=FlowFilter(name=FlowFilterName(any_=[self.flow])),
                sort=FlowRunSort.EXPECTED_START_TIME_DESC,
                limit=50,
            )
        return [run for run in runs if run.parameters.get(self.parameter) == self.path]

    def new(self) -> str | None:
        """The id of the newest run that was not there at the start; None yet."""
        return next((str(run.id) for run in self._matching() if run.id not in self.before), None)


def _ui_url() -> str | None:
    from prefect.settings import PREFECT_UI_URL

    return PREFECT_UI_URL.value()


def _flow_run_url(flow_run_id: str) -> str | None:
    from prefect.utilities.urls import url_for

    return url_for("flow-run", obj_id=flow_run_id)


@contextmanager
def flow_run_link(
    console: Console, own_server: bool, path: Path, flow: tuple[str, str] = EXPERIMENT_FLOW, new: bool = False
) -> Iterator[None]:
    """Print where the flow run of the folder ``path`` can be seen (see the module docstring); the API must be up.

    ``flow``: EXPERIMENT_FLOW (``path`` a run folder), PIPELINE_FLOW or SWEEP_FLOW (their folders).
    ``new``: the folder is a new job's, so no run of it exists yet (no API call before the job
    starts: it would delay the first client training).
    """
    runs: _FlowRuns | None = None
    with contextlib.suppress(Exception):  # an API that does not answer as expected: the run itself will say so
        runs = _FlowRuns(flow, path, new)
    if runs is None:
        yield
        return
    if own_server:
        try:
            yield
        finally:
            with contextlib.suppress(Exception):
                if (flow_run_id := runs.new()) is not None:
                    _browse_later(console, flow_run_id)
        return
    if (ui := _ui_url()) is not None:
        console.print(f"Prefect UI: {ui}", highlight=False)
    found = threading.Event()
    stop = threading.Event()

    def announce() -> None:
        with contextlib.suppress(Exception):
            if (flow_run_id := runs.new()) is not None:
                console.print(f"Prefect flow run: {_flow_run_url(flow_run_id) or flow_run_id}", highlight=False)
                found.set()

    def poll() -> None:
        while not (found.is_set() or stop.wait(POLL_S)):
            announce()

    poller = threading.Thread(target=poll, name="bhfl-prefect-link", daemon=True)
    poller.start()
    try:
        yield
    finally:
        stop.set()
        poller.join()
        if not found.is_set():  # a run that ended (or failed) before the next poll
            announce()


def _browse_later(console: Console, flow_run_id: str) -> None:
    """How to see a flow run of the command's own server, which stopped: its database, the server to start on it."""
    from prefect.settings import get_current_settings

    home = os.environ.get("PREFECT_HOME", "~/.prefect")
    api = get_current_settings().server.api
    console.print(
        f"Prefect flow run {flow_run_id}: this command's Prefect server stops with it, its records stay in "
        f"{home}; to browse them run `PREFECT_HOME={home} {command_of('prefect', 'prefect')} server start` and open "
        f"http://{api.host}:{api.port}/runs/flow-run/{flow_run_id}",
        highlight=False,
    )
