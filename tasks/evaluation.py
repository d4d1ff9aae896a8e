"""Evaluation tasks: score node models on every test split, as confusion matrices.

Confusion matrices (not metrics) come back, so the flow can form the union of all
client tests, or of any subtree's, by adding them up, without re-running models.
"""

from __future__ import annotations

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from bhfl_core.local_train import grouped_confusions
from bhfl_core.params import set_flat
from tasks.context import get_context

PROXY_TEST = "proxy"


@task(name="evaluate-models", cache_policy=NO_CACHE, persist_result=False)
def evaluate_models(run_path: str, node_ids: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """``{node: {test_set: confusion}}`` for every client test split and the proxy test split.

    All test splits are scored in one pass per model (rows tagged by split).
    """
    ctx = get_context(run_path)
    names, data, groups = ctx.test_sets(PROXY_TEST)
    num_labels = len(ctx.manifest.labels)
    out: dict[str, dict[str, torch.Tensor]] = {}
    with ctx.models.take() as (model, device):
        for node_id in node_ids:
            theta = ctx.store.load_model(node_id)
            if theta is None:
                continue
            set_flat(model, theta)
            confusions = grouped_confusions(model, data, groups, len(names), num_labels, ctx.config.eval.batch_size, device)
            out[node_id] = dict(zip(names, confusions))
    return out
