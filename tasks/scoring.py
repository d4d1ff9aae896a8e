"""Scoring inside a worker process: models on every test split, as additive statistics.

A worker loads a flat vector into its model instance, model after model, and scores
every client test split and the proxy test split in one batched pass over the
pre-tokenised tables. What comes back are statistics that add up (confusion matrices,
or masked-token NLL sums and counts), so the orchestrator forms every subtree union and
the global union by summing, without re-running models. The scorer is that of the
data manifest's ``task`` kind (``bhfl_core.learning.task_kinds``).

Besides node models (``<node id>``: the saved model of a server or persistent client)
a worker can build and score two per-client baselines, never saving them:
``local:<client>`` (trained from the initial model on the client's own train split
only) and ``adapt:<client>`` (the final parent or root model fine-tuned on the client's
train split). Their TRAIN calls use the client level's train settings and seeds
derived from (seed, client, round, "local-only" / "adapt"), so they are reproducible
and independent of the federated draws.
"""

from __future__ import annotations

import torch

from bhfl_core.algorithm.node_state import Caller, RoundKey
from bhfl_core.analysis.evaluation import PROXY, parse_model
from bhfl_core.learning.params import get_flat, set_flat
from tasks.client_training import LocalTrainer
from tasks.context import RunContext

Stats = dict[str, dict[str, torch.Tensor]]


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
            theta, _ = self.trainer.train(node, theta, RoundKey(client_id, r, Caller(tag)))
        return theta


def score_models(ctx: RunContext, trainer: LocalTrainer, models: list[str]) -> Stats:
    """``{model: {client id or 'proxy': statistics}}`` for every client test split and the proxy test split.

    ``models`` are node ids (their saved models; missing ones are skipped) and
    ``local:<client>`` / ``adapt:<client>`` baselines (trained here first).
    """
    names, data, groups = ctx.test_sets(PROXY)
    score, facts, batch_size = ctx.task_kind.score, ctx.task_facts, ctx.config.eval.batch_size
    baselines = _Baselines(ctx, trainer)
    out: Stats = {}
    for name in models:
        ref = parse_model(name)
        theta = ctx.store.load_model(name) if ref.kind == "node" else baselines.build(ref.kind, ref.node)
        if theta is None:
            continue
        set_flat(trainer.model, theta)
        out[name] = dict(zip(names, score(trainer.model, data, groups, len(names), batch_size, trainer.device, facts)))
    return out
