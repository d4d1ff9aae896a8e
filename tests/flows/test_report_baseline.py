"""The trivial baseline of a small run, in its report and on its MLflow parent run, against the manifest by hand."""

from pathlib import Path
from statistics import mean

import pytest
import torch
from mlflow import MlflowClient

from flows.experiment import PLAIN_CALLS, run_experiment
from tasks.context import open_run
from tests.small import small_config

pytestmark = pytest.mark.integration


def _accuracy(train: list[int], test: list[int]) -> float:
    """Predicting ``train``'s most frequent label (the first of equals) on rows labelled as ``test`` counts."""
    return test[train.index(max(train))] / sum(test)


def test_a_small_runs_report_and_parent_run_show_the_majority_baseline(tmp_path):
    cfg = small_config("name=itest-baseline", "tree.root.rounds=1", "eval.every=0")
    result = run_experiment(cfg, tmp_path, orchestration=PLAIN_CALLS)
    ctx = open_run(result["run_path"])
    m = ctx.manifest
    for c in m.clients:  # the manifest's histograms describe the very rows the evaluation scores
        labels = ctx.shard(c.test.path)["labels"]
        assert torch.bincount(labels, minlength=len(m.labels)).tolist() == c.test.label_hist
    own = {c.id: _accuracy(c.train.label_hist, c.test.label_hist) for c in m.clients}
    union = _accuracy(
        [sum(h) for h in zip(*(c.train.label_hist for c in m.clients))],
        [sum(h) for h in zip(*(c.test.label_hist for c in m.clients))],
    )
    proxy = _accuracy(m.proxy_train.label_hist, m.proxy_test.label_hist)

    metrics = MlflowClient(result["tracking_uri"]).get_run(result["run_id"]).data.metrics
    assert metrics["baseline/majority/edge_on_own_clients/accuracy_mean"] == pytest.approx(mean(own.values()))
    assert metrics["baseline/majority/root_on_own_clients/accuracy_worst10"] == pytest.approx(min(own.values()))
    assert metrics["baseline/majority/root/union/accuracy"] == pytest.approx(union)
    assert metrics["baseline/majority/root/proxy/accuracy"] == pytest.approx(proxy)
    assert 0 < metrics["baseline/majority/root/union/macro_f1"] < 1
    report = (Path(result["run_path"]) / "report" / "report.md").read_text()
    row = f"| trivial baseline: each client's majority training label | {len(own)} | {mean(own.values()):.4g} |"
    assert row in report
    assert f"{union:.4f} on the union; " in report and f"{proxy:.4f} on the proxy test split." in report
    assert "trivial baseline" in (Path(result["run_path"]) / "report" / "report.html").read_text()
    # the end-of-run summary's column (flows/cli/run.py print_summary): the same values, keyed by headline
    assert result["baseline_name"] == "majority"
    assert result["baseline"]["root/union/accuracy"] == pytest.approx(union)
    assert result["baseline"]["edge_on_own_clients/accuracy_mean"] == pytest.approx(mean(own.values()))
    assert (
        set(result["baseline"]) < set(result["headline"]) and "comm/total_model_equivalents" not in result["baseline"]
    )
