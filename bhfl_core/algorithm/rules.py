"""Every aggregation rule, registered, and how a node's settings find theirs (``rule_for``).

Importing this module imports each module that registers rules: ``aggregation_rule.py``
(the mean; DP-FedAvg's and secure aggregation's, chosen by ``privacy:`` /
``secure_aggregation:``), ``robust_rules.py`` (coordinate-wise median, trimmed mean,
Krum) and ``fednova.py`` (FedNova). A new rule's module is added to that list. Each
declares its ``RuleTraits`` (the ``aggregate`` keys it reads, what it needs of its
node), which the config checks before any work (``config/aggregation_settings.py``).
"""

from __future__ import annotations

from bhfl_core.algorithm import fednova, robust_rules  # noqa: F401  (they register their rules on import)
from bhfl_core.algorithm.aggregation_rule import DpMeanRule, SecAggRule
from bhfl_core.algorithm.rule_registry import AggregateParams, AggregationRule, RuleTraits, registered, registered_names


def available_rules() -> list[str]:
    return registered_names()


def rule_traits(name: str) -> RuleTraits:
    """The traits ``name`` was registered with (a KeyError for an unknown rule)."""
    return registered(name)[1]


def rule_for(params: AggregateParams) -> AggregationRule:
    """The rule a node's ``aggregate`` settings name (DP-FedAvg's where they carry ``privacy``)."""
    if params.secagg is not None:
        return SecAggRule(params.secagg, params.privacy)
    if params.privacy is not None:
        return DpMeanRule(params.privacy)
    try:
        factory, _ = registered(params.kind)
    except KeyError:
        raise ValueError(f"unknown aggregation rule {params.kind!r}; available: {available_rules()}") from None
    return factory(params)
