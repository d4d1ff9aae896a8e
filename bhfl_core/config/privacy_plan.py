"""Each DP server's privacy over the whole run, planned when the tree is built: its most rounds, its noise
multiplier for a ``target_epsilon``, and a ``max_epsilon`` it may not be planned to exceed.

The accountant counts every round (flush) a DP server runs, over all its executions
(``privacy_accounting.py``). How many that is depends on the servers above it, so it is
known only for the whole tree: the server's ``rounds`` times the calls each ancestor's
execution can make to the child below it on the path:

- a synchronous ancestor calls each child at most once a round (a cohort without
  replacement, or a Poisson draw): its ``rounds``;
- an asynchronous ancestor (FedBuff) dispatches at most ``rounds * buffer`` results it
  folds plus ``concurrency`` still in flight when it ends, and any of them may go to one
  child: ``rounds * buffer + concurrency``.

The product is an upper bound: the planned epsilon is never below what the run spends
(cohort sampling above the server only makes it spend less). The noise multiplier for a
target is the smallest, to a relative 1e-4, whose epsilon after the planned rounds is
within it (``privacy_accounting.calibrate``). A run is refused before it starts when its
plan would exceed ``max_epsilon``; ``DpRule`` also refuses to publish a round past it
(``dp_rule.py``), which only a plan that undercounted could reach.
"""

from __future__ import annotations

from dataclasses import replace

from bhfl_core.algorithm.privacy_accounting import calibrate_server, epsilon
from bhfl_core.algorithm.privacy_params import PrivacyParams
from bhfl_core.algorithm.tree import Node, Tree
from bhfl_core.config.aggregation_settings import check_noise_split
from bhfl_core.config.base import ConfigError


def plan_privacy(tree: Tree) -> Tree:
    """``tree`` with every DP server's budget planned (``PrivacyBudget.planned_rounds``), its noise multiplier
    calibrated where a target epsilon was given, and its maximum checked; errors name the key."""
    nodes = dict(tree.nodes)
    for node in tree.servers():
        params = node.settings.aggregate.privacy
        if params is None or params.budget is None:
            continue
        planned = replace(params, budget=replace(params.budget, planned_rounds=planned_rounds(tree, node)))
        planned = _calibrated(planned)
        _check_maximum(planned, node.id)
        aggregate = node.settings.aggregate
        wrappers = tuple(planned if w is params else w for w in aggregate.wrappers)
        settings = replace(node.settings, aggregate=replace(aggregate, wrappers=wrappers))
        nodes[node.id] = replace(node, settings=settings)
    return Tree(nodes=nodes, root_id=tree.root_id)


def planned_rounds(tree: Tree, node: Node) -> int:
    """The most rounds (flushes) ``node`` can run in the run, over all its executions (module docstring)."""
    count = node.settings.rounds
    for ancestor_id in tree.ancestors(node.id):
        settings = tree[ancestor_id].settings
        flow = settings.asynchronous
        count *= settings.rounds if flow is None else settings.rounds * flow.buffer + flow.concurrency
    return count


def _calibrated(params: PrivacyParams) -> PrivacyParams:
    budget = params.budget
    assert budget is not None
    if budget.target_epsilon is None:
        return params
    z = calibrate_server(
        budget.target_epsilon,
        budget.planned_rounds,
        params.expected,
        params.population,
        params.poisson,
        params.delta,
        params.accountant,
    )
    out = replace(params, noise_multiplier=z)
    check_noise_split(out, budget.key)
    return out


def _check_maximum(params: PrivacyParams, node_id: str) -> None:
    budget = params.budget
    assert budget is not None
    if budget.max_epsilon is None:
        return
    planned = epsilon(params, budget.planned_rounds)
    if planned > budget.max_epsilon:
        raise ConfigError(
            f"{budget.key}.max_epsilon: {node_id!r} is planned to run up to {budget.planned_rounds} rounds, which "
            f"spend epsilon {planned:.4g} at delta {params.delta:g} with noise_multiplier "
            f"{params.noise_multiplier:.4g}, over the budget of {budget.max_epsilon:g}; raise the noise, run fewer "
            "rounds, or set target_epsilon to have the noise calibrated"
        )
