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

from collections.abc import Sequence

import torch

from bhfl_core.algorithm.contract import RoundPlan
from bhfl_core.algorithm.node_state import Caller, RoundKey
from bhfl_core.analysis.evaluation import PROXY, ModelRef
from bhfl_core.learning.params import get_flat, set_flat
from tasks.client_training import LocalTrainer
from tasks.context import RunContext

Stats = dict[ModelRef, dict[str, torch.Tensor]]


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

    def local_only(self, client_id: str) -> torch.Tensor:
        """Trained from the initial model on the client's own train split only."""
        return self._train(client_id, self.initial(), local_only_rounds(self.ctx, client_id), "local-only")

    def adapted(self, client_id: str) -> torch.Tensor | None:
        """The final parent (or root) model fine-tuned on the client's train split; None if it is not saved."""
        ctx = self.ctx
        setting = ctx.config.eval.local_adaptation
        parent = ctx.tree[client_id].parent
        assert setting is not None and parent is not None
        start = ctx.store.load_model(parent if setting.source == "parent" else ctx.tree.root_id)
        if start is None:
            return None
        return self._train(client_id, start, setting.rounds, "adapt")

    def _train(self, client_id: str, theta: torch.Tensor, rounds: int, tag: str) -> torch.Tensor:
        node = self.ctx.tree[client_id]
        for r in range(rounds):
            key = RoundKey(client_id, r, Caller(tag))
            theta = self.trainer.train(node, theta, key, RoundPlan(key.caller)).theta
        return theta


def score_models(ctx: RunContext, trainer: LocalTrainer, models: Sequence[ModelRef]) -> Stats:
    """``{model: {client id or 'proxy': statistics}}`` for every client test split and the proxy test split.

    ``models`` are node models and Ditto personal models (their saved models; missing
    ones are skipped) and the local-only / adapted baselines of clients (trained here first).
    """
    names, data, groups = ctx.test_sets(PROXY)
    score, facts, batch_size = ctx.task_kind.score, ctx.task_facts, ctx.config.eval.batch_size
    baselines = _Baselines(ctx, trainer)
    out: Stats = {}
    for ref in models:
        theta: torch.Tensor | None
        if ref.kind in ("node", "personal"):
            theta = ctx.store.load_model(ref.node, personal=ref.kind == "personal")
        elif ref.kind == "local_only":
            theta = baselines.local_only(ref.node)
        else:
            theta = baselines.adapted(ref.node)
        if theta is None:
            continue
        set_flat(trainer.model, theta)
        out[ref] = dict(zip(names, score(trainer.model, data, groups, len(names), batch_size, trainer.device, facts)))
    return out
