"""Evaluation tasks: score models on every test split, as additive statistics.

A worker task takes one model instance from the pool (the same pool, devices and
workers as training) and, model after model, loads a flat vector into it and scores
every client test split and the proxy test split in one batched pass over the
pre-tokenised tables. What comes back are statistics that add up (confusion matrices,
or masked-token NLL sums and counts), so the flow forms every subtree union and the
global union by summing, without re-running models. The scorer is chosen by the data
manifest's ``task``.

Besides node models (``<node id>``: the saved model of a server or persistent client)
a task can build and score two per-client baselines in the same worker, never saving
them: ``local:<client>`` (trained from the initial model on the client's own train
split only) and ``adapt:<client>`` (the final parent or root model fine-tuned on the
client's train split). Their TRAIN calls use the client level's train settings and
seeds derived from (seed, client, round, "local-only" / "adapt"), so they are
reproducible and independent of the federated draws.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE
from torch import nn

from bhfl_core.engine import RoundKey
from bhfl_core.evaluation import ADAPTED, LOCAL_ONLY, PROXY, parse_model
from bhfl_core.local_train import grouped_confusions
from bhfl_core.mlm import grouped_lm_stats
from bhfl_core.params import get_flat, set_flat
from bhfl_core.rng import derive_seed
from tasks.context import RunContext, get_context
from tasks.training import LocalTrainer

Scorer = Callable[[RunContext, nn.Module, torch.device], torch.Tensor]


def _confusions(ctx: RunContext, model: nn.Module, device: torch.device) -> torch.Tensor:
    names, data, groups = ctx.test_sets(PROXY)
    return grouped_confusions(model, data, groups, len(names), len(ctx.manifest.labels), ctx.config.eval.batch_size, device)


def _lm_stats(ctx: RunContext, model: nn.Module, device: torch.device) -> torch.Tensor:
    """``[summed masked-token NLL, masked tokens]`` per test group; the same masks for every model (seed)."""
    names, data, groups = ctx.test_sets(PROXY)
    seed = derive_seed(ctx.config.seed, "eval", "mlm-masks")
    return grouped_lm_stats(model, data, groups, len(names), ctx.config.eval.batch_size, device, seed, masking=ctx.masking)


SCORERS: dict[str, Scorer] = {"classification": _confusions, "mlm": _lm_stats}


def scorer(task_name: str) -> Scorer:
    try:
        return SCORERS[task_name]
    except KeyError:
        raise ValueError(f"no evaluation scorer for task {task_name!r}; known tasks: {sorted(SCORERS)}") from None


def node_models(ctx: RunContext) -> list[str]:
    """Every server model and (``eval.client_models``) every persistent client model that exists."""
    nodes = [n.id for n in ctx.tree.servers()]
    if ctx.config.eval.client_models:
        nodes += [n.id for n in ctx.tree.clients() if n.settings.persistent and ctx.store.has(n.id)]
    return nodes


def baseline_models(ctx: RunContext) -> tuple[list[str], list[float]]:
    """The per-client baselines the config asks for, with a relative cost for placement.

    Cost ~ rows trained (x3: a training step costs about three inference passes) plus
    the evaluation pass every model pays.
    """
    names: list[str] = []
    loads: list[float] = []
    ev = ctx.config.eval
    test_rows = sum(c.test.size for c in ctx.manifest.clients) + ctx.manifest.proxy_test.size
    for client in ctx.tree.clients():
        train = client.settings.train
        assert train is not None
        rows = ctx.clients[client.id].train.size * train.epochs
        if ev.local_adaptation is not None:
            names.append(f"{ADAPTED}{client.id}")
            loads.append(test_rows + 3.0 * rows * ev.local_adaptation.rounds)
        if ev.local_only is not None:
            names.append(f"{LOCAL_ONLY}{client.id}")
            loads.append(test_rows + 3.0 * rows * local_only_rounds(ctx, client.id))
    return names, loads


def local_only_rounds(ctx: RunContext, client_id: str) -> int:
    setting = ctx.config.eval.local_only
    assert setting is not None
    if setting.rounds == "matched":
        return max(1, int(ctx.store.load_info(client_id).get("rounds_done", 0)))
    return int(setting.rounds)


class _Baselines:
    """Builds a baseline model's vector with a worker's trainer (the initial model is built once)."""

    def __init__(self, ctx: RunContext, trainer: LocalTrainer) -> None:
        self.ctx, self.trainer = ctx, trainer
        self._initial: torch.Tensor | None = None

    def initial(self) -> torch.Tensor:
        if self._initial is None:
            cfg = self.ctx.config
            self._initial = get_flat(self.ctx.build_model(cfg.seed + cfg.model.init_seed_offset))
        return self._initial

    def build(self, kind: str, client_id: str) -> torch.Tensor | None:
        ctx = self.ctx
        node = ctx.tree[client_id]
        if kind == "local_only":
            theta, rounds, tag = self.initial(), local_only_rounds(ctx, client_id), "local-only"
        else:
            setting = ctx.config.eval.local_adaptation
            assert setting is not None and node.parent is not None
            source = node.parent if setting.source == "parent" else ctx.tree.root_id
            start = ctx.store.load_model(source)
            if start is None:
                return None
            theta, rounds, tag = start, setting.rounds, "adapt"
        for r in range(rounds):
            theta, _ = self.trainer.train(node, theta, RoundKey(client_id, r, tag))
        return theta


@task(name="evaluate-models", cache_policy=NO_CACHE, persist_result=False)
def evaluate_models(run_path: str, models: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """``{model: {client id or 'proxy': statistics}}`` for every client test split and the proxy test split.

    ``models`` are node ids (their saved models; missing ones are skipped) and
    ``local:<client>`` / ``adapt:<client>`` baselines (trained here first).
    """
    ctx = get_context(run_path)
    names, _, _ = ctx.test_sets(PROXY)
    score = scorer(ctx.manifest.task)
    out: dict[str, dict[str, torch.Tensor]] = {}
    with ctx.models.take() as (model, device):
        baselines = _Baselines(ctx, LocalTrainer(ctx, model, device))
        for name in models:
            ref = parse_model(name)
            theta = ctx.store.load_model(name) if ref.kind == "node" else baselines.build(ref.kind, ref.node)
            if theta is None:
                continue
            set_flat(model, theta)
            out[name] = dict(zip(names, score(ctx, model, device)))
    return out
