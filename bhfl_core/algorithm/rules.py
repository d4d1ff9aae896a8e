"""Every aggregation rule and wrapper, registered, and how a node's settings find theirs (``rule_for``).

A rule lives in one module of this package named ``<name>_rule.py`` (or ``_rules.py``
for several): importing this module imports each of them, and each registers its rules
on import (``@register_rule`` / ``@register_wrapper``). So adding a rule is adding one
file (docs/design.md, "An aggregation rule"). Today: ``aggregation_rule.py`` (the mean),
``robust_rules.py`` (coordinate-wise median, trimmed mean, Krum), ``fednova_rule.py``
(FedNova), and the wrappers ``zeroing_rule.py``, ``dp_rule.py``, ``secagg_rule.py`` and
``adapter_rule.py`` (LoRA's A and B, ``AggregateParams.adapter``).
Each rule declares its ``RuleTraits`` (the ``aggregate`` keys it reads, what it needs of
its node), which the config checks before any work (``config/aggregation_settings.py``).
"""

from __future__ import annotations

import importlib
import pkgutil

import bhfl_core.algorithm
from bhfl_core.algorithm.rule_registry import (
    AggregateParams,
    AggregationRule,
    RuleTraits,
    registered,
    registered_names,
    registered_wrapper,
)

RULE_MODULES = tuple(
    sorted(
        info.name
        for info in pkgutil.iter_modules(bhfl_core.algorithm.__path__)
        if info.name.endswith(("_rule", "_rules"))
    )
)
"""The modules that register rules, found by their names (imported below, in this order)."""

for _module in RULE_MODULES:
    importlib.import_module(f"bhfl_core.algorithm.{_module}")


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
    if params.adapter is not None:  # around the kind, inside the listed wrappers (it needs every child's model)
        rule = registered_wrapper(params.adapter)(params.adapter, rule)
    for wrapper in reversed(params.wrappers):  # innermost first: the first listed wraps all the others
        rule = registered_wrapper(wrapper)(wrapper, rule)
    return rule
