"""Scoring inside a worker process: models on every test split, as additive statistics.

A worker loads a flat vector into its model instance, model after model, and scores
the client test splits the run's evaluation plan gives the model (every client, or a
sample: bhfl_core/analysis/eval_plan.py) and the proxy test split, in one batched pass
over the pre-tokenised tables. What comes back are statistics that add up (confusion
matrices, or masked-token NLL sums and counts), one block per split, so the orchestrator
forms every subtree union and the global union by summing, without re-running models. The scorer is that of the
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
from bhfl_core.analysis.matrix_axes import PROXY, ModelRef, client_order
from bhfl_core.analysis.model_values import ModelValues, Scored
from bhfl_core.learning.params import get_flat, set_flat
from tasks.client_training import LocalTrainer
from tasks.context import RunContext, ScoringTable


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


def score_models(ctx: RunContext, trainer: LocalTrainer, models: Sequence[ModelRef]) -> list[ModelValues]:
    """Each model's statistics on the client test splits the run's evaluation plan gives it, and on the proxy.

    ``models`` are node models and Ditto personal models (their saved models; missing
    ones are skipped) and the local-only / adapted baselines of clients (trained here
    first). Servers are scored on the population (every client, or ``eval.clients``);
    a client's models on their plan's clients (bhfl_core/analysis/eval_plan.py; a model
    of a client outside the population is skipped). The whole table is scored in one
    batched pass where a model's plan is every client; otherwise only its clients' rows.
    Each model's blocks are reduced here to its metrics (``MatrixBuilder``): what goes
    back is a few numbers per test set it was scored on.
    """
    table = ctx.scoring_table(PROXY)
    plan, tree = ctx.eval_plan, ctx.tree
    score, facts, batch_size = ctx.task_kind.score, ctx.task_facts, ctx.config.eval.batch_size
    order = _tree_order(ctx, table)
    baselines = _Baselines(ctx, trainer)
    builder = ctx.matrix_builder
    out: list[ModelValues] = []
    for ref in models:
        targets = plan.server_targets() if not tree[ref.node].is_leaf else plan.client_targets(ref.node)
        if targets is None:
            continue
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
        splits = torch.cat([order[torch.from_numpy(targets.clients)], order[-1:]])  # tree order, then the proxy
        if targets.weights is None and len(splits) == len(table.names):  # every split of the table: one pass
            stats = score(trainer.model, table.data, table.groups, len(table.names), batch_size, trainer.device, facts)
            blocks = stats[splits]  # a copy: no view of the whole result travels
        else:
            rows, groups = _rows_of(table, splits)
            data = {k: v[rows] for k, v in table.data.items()}
            blocks = score(trainer.model, data, groups, len(splits), batch_size, trainer.device, facts)
        out.append(builder.values(Scored(ref, targets.clients, targets.weights, blocks)))
    return out


def _tree_order(ctx: RunContext, table: ScoringTable) -> torch.Tensor:
    """The table's split index of each client in tree order (``client_order``; -1: a client the table does not
    hold, outside a sampled population, which no model is scored on), then the proxy's."""
    index = {name: i for i, name in enumerate(table.names)}
    at = [index.get(c, -1) for c in client_order(ctx.tree)]
    return torch.tensor([*at, len(table.names) - 1], dtype=torch.int64)


def _rows_of(table: ScoringTable, splits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of ``splits`` (table split indices), in that order, and each row's position among them."""
    sizes = table.sizes[splits]
    rows = torch.cat([torch.arange(int(a), int(a) + int(n)) for a, n in zip(table.starts[splits], sizes)])
    groups = torch.repeat_interleave(torch.arange(len(splits)), sizes)
    return rows, groups
