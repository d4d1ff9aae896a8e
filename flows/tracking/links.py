"""Addresses in the MLflow UI that open what a user wants to see, in the view that shows it.

No MLflow import here: the CLI prints these after a run and ``bhfl runs`` stays light.
MLflow 3.17's UI opens on its GenAI views unless the address asks for the model-training
ones (``workflowType``), and its run list shows no metric column until one is picked; a
view shared through an experiment tag (the UI's own "share view": ``?viewStateShareKey=K``
reads the tag ``mlflow.sharedViewState.K``) brings the headline metrics as columns.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from urllib.parse import urlparse

UI_DEFAULT = "http://127.0.0.1:5000"  # where `bhfl ui` serves a local store
MODEL_TRAINING_VIEW = "workflowType=machine_learning"
HEADLINE_VIEW_KEY = "bhfl-headline"
SHARED_VIEW_TAG = "mlflow.sharedViewState."


def is_tracking_server(tracking_uri: str) -> bool:
    """Whether ``tracking_uri`` is an MLflow tracking server (``http(s)://``), which serves its own UI."""
    return urlparse(tracking_uri).scheme in ("http", "https")


def _ui_base(tracking_uri: str) -> str:
    return tracking_uri.rstrip("/") if is_tracking_server(tracking_uri) else UI_DEFAULT


def run_link(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """A run's page in the model-training view: on the tracking server, or where ``bhfl ui`` serves a local store."""
    return f"{_ui_base(tracking_uri)}/#/experiments/{experiment_id}/runs/{run_id}?{MODEL_TRAINING_VIEW}"


def runs_link(tracking_uri: str, experiment_id: str) -> str:
    """The experiment's run list with the headline metrics as columns (the view ``share_headline_view`` saved)."""
    return (
        f"{_ui_base(tracking_uri)}/#/experiments/{experiment_id}/runs"
        f"?viewStateShareKey={HEADLINE_VIEW_KEY}&{MODEL_TRAINING_VIEW}"
    )


def headline_view(metrics: Iterable[str]) -> str:
    """The run list's state with ``metrics`` as columns, as the UI reads a shared view (its JSON form)."""
    return json.dumps(
        {
            "searchFilter": "",
            "orderByKey": "attributes.start_time",
            "orderByAsc": False,
            "startTime": "ALL",
            "lifecycleFilter": "Active",
            "datasetsFilter": [],
            "modelVersionFilter": "All Runs",
            "selectedColumns": [f"metrics.`{key}`" for key in metrics],
            "runsExpanded": {},
        }
    )
