"""Evaluation tasks: score node models on every test split, as confusion matrices.

Confusion matrices (not metrics) come back, so the flow can form the union of all
client tests, or of any subtree's, by adding them up, without re-running models.
"""

from __future__ import annotations

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from bhfl_core.local_train import confusion_matrix
from bhfl_core.params import set_flat
from tasks.context import get_context

PROXY_TEST = "proxy"


@task(name="evaluate-models", cache_policy=NO_CACHE, persist_result=False)
def evaluate_models(run_path: str, node_ids: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """``{node: {test_set: confusion}}`` for every client test split and the proxy test split."""
    ctx = get_context(run_path)
    num_labels = len(ctx.manifest.labels)
    tests = {c.id: ctx.shard(c.test.path) for c in ctx.manifest.clients}
    tests[PROXY_TEST] = ctx.proxy("test")
    batch_size = ctx.config.eval.batch_size
    out: dict[str, dict[str, torch.Tensor]] = {}
    with ctx.models.take() as (model, device):
        for node_id in node_ids:
            theta = ctx.store.load_model(node_id)
            if theta is None:
                continue
            set_flat(model, theta)
            out[node_id] = {name: confusion_matrix(model, data, num_labels, batch_size, device)[0] for name, data in tests.items()}
    return out
