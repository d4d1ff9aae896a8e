"""Finished small runs shared by the report, compare and MLflow-server tests (one session fixture)."""

import pytest


@pytest.fixture(scope="session")
def evaluated_runs(tmp_path_factory):
    """Two finished runs in one store: the small tree with both per-client baselines and
    ``eval.every = 1`` (through Prefect), and flat FedAvg on the same data (inline)."""
    from flows.experiment import PLAIN_CALLS, run_experiment
    from tests.small import small_config

    root = tmp_path_factory.mktemp("report-runs")
    tree = run_experiment(
        small_config("name=itest-report", "eval.local_only={}", "eval.local_adaptation={}", "eval.figures=true"), root
    )
    flat = run_experiment(
        small_config("name=itest-flat", "tree.flat=true", "tree.groups={}", "eval.every=0"),
        root,
        orchestration=PLAIN_CALLS,
    )
    return root, tree, flat
