"""Every aggregation rule and wrapper, registered, and how a node's settings find theirs (``rule_for``).

Importing this module imports each module that registers one: ``aggregation_rule.py``
(the mean), ``robust_rules.py`` (coordinate-wise median, trimmed mean, Krum),
``fednova.py`` (FedNova), and the wrappers ``zeroing.py``, ``dp_rule.py`` and
``secagg_rule.py``. A new rule's module is added to that list. Each rule declares its
``RuleTraits`` (the ``aggregate`` keys it reads, what it needs of its node), which the
config checks before any work (``config/aggregation_settings.py``).
"""

from __future__ import annotations

from bhfl_core.algorithm import dp_rule, fednova, robust_rules, secagg_rule, zeroing  # noqa: F401  (they register)
from bhfl_core.algorithm.rule_registry import (
    AggregateParams,
    AggregationRule,
    RuleTraits,
    registered,
    registered_names,
    registered_wrapper,
)


def available_rules() -> list[str]:
    return registered_names()


def rule_traits(name: str) -> RuleTraits:
    """The traits ``name`` was registered with (a KeyError for an unknown rule)."""
    return registered(name)[1]


def rule_for(params: AggregateParams) -> AggregationRule:
    """The rule a node's ``aggregate`` settings name: the registered ``kind``, inside each registered wrapper."""
    try:
        factory, _ = registered(params.kind)
    except KeyError:
        raise ValueError(f"unknown aggregation rule {params.kind!r}; available: {available_rules()}") from None
    rule: AggregationRule = factory(params)
    for wrapper in reversed(params.wrappers):  # innermost first: the first listed wraps all the others
        rule = registered_wrapper(wrapper)(wrapper, rule)
    return rule
