"""A run's trivial baselines (bhfl_core/analysis/trivial_baselines.py), from its data manifest and shards.

Classification reads the manifest's label histograms only. Masked LM reads each train
split to count its tokens (one at a time) and the test table the workers score
(``RunContext.test_sets``, which the context then keeps, as a worker's does) to
redraw the evaluation's masks; no model is built or trained.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from bhfl_core.analysis.matrix_axes import PROXY
from bhfl_core.analysis.trivial_baselines import (
    Counts,
    TrivialBaseline,
    masked_targets,
    score,
    token_counts,
    trivial_kind,
)
from data_prep.manifest import Shard
from tasks.context import RunContext

ClientCounts = tuple[Iterator[tuple[str, Counts]], Counts]  # (each client's counts, lazily; the proxy's)


def _label_counts(ctx: RunContext) -> ClientCounts:
    """Label histograms of every client's train and test split, and of the proxy's (from the manifest)."""
    labels = len(ctx.manifest.labels)

    def hist(shard: Shard) -> torch.Tensor:
        return torch.tensor(shard.label_hist or [0] * labels, dtype=torch.int64)

    m = ctx.manifest
    clients = ((c.id, Counts(hist(c.train), hist(c.test))) for c in m.clients)
    return clients, Counts(hist(m.proxy_train), hist(m.proxy_test))


def _token_counts(ctx: RunContext) -> ClientCounts:
    """Token counts of every train split, and of the targets the evaluation masks in every test split."""
    m, facts = ctx.manifest, ctx.task_facts
    names, data, groups = ctx.test_sets(PROXY)
    targets = masked_targets(data, groups, len(names), facts)

    def counts(train: Shard, group: int) -> Counts:
        fitted = (
            token_counts(ctx.shard(train.path), facts.special_ids, facts.vocab_size)
            if train.size
            else torch.zeros(facts.vocab_size, dtype=torch.int64)
        )
        return Counts(fitted, torch.bincount(targets[group], minlength=facts.vocab_size))

    clients = ((c.id, counts(c.train, i)) for i, c in enumerate(m.clients))  # test_sets: clients in manifest order
    return clients, counts(m.proxy_train, names.index(PROXY))


_COUNTS: dict[str, Callable[[RunContext], ClientCounts]] = {"majority": _label_counts, "unigram": _token_counts}


def trivial_baseline(ctx: RunContext) -> TrivialBaseline | None:
    """The run's trivial baseline on every client test split, ``union`` (the evaluation's population) and ``proxy``;
    None if its task has none."""
    kind = trivial_kind(ctx.manifest.task)
    if kind is None:
        return None
    clients, proxy = _COUNTS[kind.name](ctx)
    return score(kind, ctx.task_kind.metrics, clients, proxy, _union_clients(ctx))


def _union_clients(ctx: RunContext) -> frozenset[str] | None:
    """The clients whose test splits the models' ``union`` is: the sample under ``eval.clients: N``; None: all (the
    plan, which builds the tree, only read when there is a sample)."""
    if ctx.config.eval.sample_sizes()[0] is None:
        return None
    plan = ctx.eval_plan
    return None if plan.complete else frozenset(plan.population)
