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
target is the smallest, to a relative 1e-3 (rounded up), whose epsilon after the planned rounds is
within it (``privacy_accounting.calibrate``). A run is refused before it starts when its
plan would exceed ``max_epsilon``; ``DpRule`` also refuses to publish a round past it
(``dp_rule.py``), which only a plan that undercounted could reach.
"""

from __future__ import annotations

import math
from dataclasses import replace

from bhfl_core.algorithm.discrete_gaussian import MIN_SIGMA
from bhfl_core.algorithm.privacy_accounting import calibrate, calibrate_server, distributed_epsilon, epsilon
from bhfl_core.algorithm.privacy_params import PrivacyParams, SecAggParams
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
        secagg = aggregate.secagg
        noised = _children_noise(planned, secagg, node.id) if planned.distributed and secagg is not None else None
        wrappers = tuple(
            planned if w is params else noised if w is secagg and noised else w for w in aggregate.wrappers
        )
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


def _children_noise(params: PrivacyParams, secagg: SecAggParams, node_id: str) -> SecAggParams:
    """Distributed DP: each child's discrete Gaussian std ``z C 2^f / sqrt(t)`` (integer units) and its integer
    vector's L2 bound ``C 2^f``, so at least ``t`` contributors give the sum ``z`` (``privacy_accounting``)."""
    budget = params.budget
    assert budget is not None
    scale = 2.0**secagg.fraction_bits
    sigma = params.noise_multiplier * params.clip * scale / math.sqrt(secagg.threshold)
    if sigma < MIN_SIGMA:
        raise ConfigError(
            f"{budget.key}.distributed: each child's discrete Gaussian would have std {sigma:.3g} in fixed-point "
            f"units at {node_id!r}, below {MIN_SIGMA:g} (where its accounting stops being exact); raise "
            "secure_aggregation.fraction_bits or the noise"
        )
    members = math.ceil(params.expected)
    used = params.clip * scale * members + 12 * sigma * math.sqrt(members)
    if used >= 2 ** (secagg.bits - 1):
        raise ConfigError(
            f"{budget.key}.distributed: {members} clipped updates and their noise need {math.log2(used) + 1:.1f} "
            f"bits at {node_id!r}, more than secure_aggregation.bits ({secagg.bits}); raise bits or lower "
            "fraction_bits"
        )
    return replace(secagg, client_noise=sigma, client_norm=params.clip * scale)


def _calibrated(params: PrivacyParams) -> PrivacyParams:
    budget = params.budget
    assert budget is not None
    if budget.target_epsilon is None:
        return params
    if params.distributed:
        rounds = budget.planned_rounds
        z = calibrate(budget.target_epsilon, lambda z: distributed_epsilon(z, rounds, params.delta))
        return replace(params, noise_multiplier=z)
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
