"""What an experiment shows in the Prefect UI besides its runs: a markdown artefact and tags.

The Prefect UI lists flow runs; the results live in MLflow. The artefact puts the headline
numbers and the way to the MLflow run on the flow run's page (tab "Artifacts", and the
"Artifacts" page under a key per config), so the two UIs point at each other.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from bhfl_core.config.schema import ExperimentConfig
from bhfl_core.config.sweep import config_hash
from bhfl_core.store.tables import table_markdown
from flows.tracking.links import run_link


def prefect_tags(config: ExperimentConfig) -> list[str]:
    """The flow run's tags: the config's name, its hash (``bhfl.config_hash`` in MLflow) and seed."""
    return [f"config:{config.name}", f"hash:{config_hash(config)[:8]}", f"seed:{config.seed}"]


def artifact_key(name: str) -> str:
    """A Prefect artefact key for a config name (lowercase letters, digits and dashes only)."""
    return "bhfl-" + (re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "run")


def summary_markdown(
    config: ExperimentConfig,
    run_path: Path,
    tracking_uri: str,
    experiment_id: str,
    run_id: str,
    headline: Mapping[str, float],
) -> str:
    """The headline table and where to look further (MLflow run, run folder, report)."""
    rows = ([f"`{key}`", f"{value:.4f}"] for key, value in sorted(headline.items()))
    table = table_markdown(["metric", "value"], rows)
    return (
        f"# {config.name} (seed {config.seed}, config hash {config_hash(config)[:8]})\n\n"
        f"{table}\n\n"
        f"MLflow run [`{run_id}`]({run_link(tracking_uri, experiment_id, run_id)}) "
        f"(store `{tracking_uri}`; a local store opens with `bhfl ui`). "
        f"Run folder `{run_path}`; its report: `report/report.html`.\n"
    )


def publish_summary(config: ExperimentConfig, markdown: str) -> None:
    """Create the markdown artefact (``summary_markdown``) on the current Prefect flow run."""
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(
        markdown=markdown,
        key=artifact_key(config.name),
        description=f"{config.name}: headline metrics and the MLflow run",
    )
