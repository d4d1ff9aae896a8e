"""A rule that divides each child's update by its local steps (FedNova) needs children that start from what they
were sent.

FedNova (``fednova_rule.py``) takes ``d_i = (x_ref - x_i) / tau_i``, the model the
server sent minus the child's result, as the child's progress per local step. That
holds only if the child's TRAIN started from ``x_ref``. A persistent client whose
down step keeps part of its own model (``eta_down`` other than 1, an ``opt_down``
other than ``fedavg``: ``theta_0 = W_i + eta·(x_ref − W_i)``), that folds
down-residuals into it, or that keeps its own LoRA B (``fedsa``) starts elsewhere:
``x_ref − x_i`` then holds the offset ``x_ref − theta_0`` too, which no step made,
and dividing it by ``tau_i`` and rescaling by ``tau_eff`` weighs that offset by the
client's step count (a client with few steps has its offset amplified). That is
neither FedNova nor any documented rule, so such a config is refused, naming the key
that makes the child start elsewhere. A compressed broadcast (``compress_down``) is
not such a case: the children start from the decoded model, which the fold takes as
``x_ref``. A client's ``adapter_rank`` cap is not either: it zeroes the same
coordinates of ``theta_0`` and of its result, which FedNova then folds as the mean
rule folds them (HetLoRA's zero-padding, scaled per step).
"""

from __future__ import annotations

from bhfl_core.algorithm.rules import rule_traits
from bhfl_core.algorithm.tree import Node, Tree
from bhfl_core.config.base import ConfigError
from bhfl_core.config.layering import layered
from bhfl_core.config.schema import ExperimentConfig


def check_step_normalised_starts(config: ExperimentConfig, tree: Tree) -> None:
    """Refuse a child of a step-normalising server (``RuleTraits.steps``) that does not start from its parent's
    model; the error names the child's key (its ``eta_down`` / ``opt_down``, a down-residual rule, or
    ``model.adapter.aggregation``) and the server's rule."""
    for server in tree.servers():
        kind = server.settings.aggregate.kind
        if not rule_traits(kind).steps:
            continue
        for child in tree.children(server.id):
            elsewhere = _elsewhere(config, child)
            if elsewhere is not None:
                key, start = elsewhere
                raise ConfigError(
                    f"{key}: {child.id!r} would start its TRAIN from {start}, not from the model {server.id!r} "
                    f"sends it, but the aggregate.kind {kind} of {server.id!r} divides each child's update from the "
                    "model it was sent by the child's local steps, so that offset, which no step made, would be "
                    "rescaled as if it were training; let the children adopt the model they are sent (eta_down: 1, "
                    "opt_down fedavg, no down-residuals into them, an adapter aggregation other than fedsa), or use "
                    "aggregate.kind: mean there"
                )


def _elsewhere(config: ExperimentConfig, child: Node) -> tuple[str, str] | None:
    """The key that makes ``child``'s execution start from something other than its parent's model, and what it
    starts from, if any."""
    settings = child.settings
    adopts = settings.opt_down.kind == "fedavg" and settings.opt_down.eta == 1.0  # node_step.replaces, without torch
    if settings.persistent and not adopts:
        values, origin = layered(config, child.id, child.role, child.depth)
        if values["opt_down"].kind == "fedavg":
            return origin["eta_down"], f"a mix of its own model and that one (eta_down {values['eta_down']})"
        return f"{origin['opt_down']}.kind", f"its {values['opt_down'].kind} step from its own model towards that one"
    down = sorted(k for k, _ in settings.res_in if k.startswith("down"))
    if down:
        return f"tree.residuals.down[{down[0][len('down') :]}]", "that model plus its down-residuals"
    if settings.own_b is not None:
        return "model.adapter.aggregation", "that model with its own LoRA B matrices (fedsa)"
    return None
