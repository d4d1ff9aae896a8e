"""Residual connections: selected child models skip levels (SELECTRESIDUALS, ALGORITHMS.md).

Up-residuals: after a round, node q selects K of its children's models and appends them
to the accumulator ``R_up[a]`` of each listed ancestor a; a consumes the accumulator in
its next NODEOPT_up. Down-residuals: at the start of each round, q appends its model
to ``R_down[d]`` of each listed descendant d, consumed by d's next NODEOPT_down.

Accumulators are weighted sums (weights = training examples of the selected clients;
1 for down-residuals), so "the mean of the top-K as one model" is exactly what the
receiving node averages. Each rule (residual input kind) has its own optimiser state
and learning rate at the receiving node; its step is added to the regular one.

Selection criteria (``select``):
- ``l2``: largest update norm ``||input - theta_t||`` (default);
- ``loss``: largest mean training loss;
- ``cosine``: most dissimilar update by cosine similarity to the round's mean update.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: configs name these settings without loading torch
    import torch

    from bhfl_core.algorithm.aggregation import WeightedSum

SELECTORS = ("l2", "loss", "cosine")


@dataclass(frozen=True)
class Candidate:
    """A child's model from one round, with what selection may need."""

    node_id: str
    theta: torch.Tensor
    weight: float
    loss: float = float("nan")


@dataclass(frozen=True)
class UpLink:
    """Node -> ancestor residual edge of rule ``rule`` (accumulator key ``up<rule>``)."""

    rule: int
    target: str
    k: int = 1
    select: str = "l2"
    combine: str = "each"  # each: K weighted models; mean: their plain mean as one model

    @property
    def key(self) -> str:
        return f"up{self.rule}"


@dataclass(frozen=True)
class DownLink:
    """Node -> descendant residual edge of rule ``rule`` (accumulator key ``down<rule>``)."""

    rule: int
    target: str

    @property
    def key(self) -> str:
        return f"down{self.rule}"


def _score(c: Candidate, theta: torch.Tensor, select: str, mean_update: torch.Tensor | None) -> float:
    update = c.theta - theta
    if select == "l2":
        return float(update.norm())
    if select == "loss":
        return c.loss
    if select == "cosine":
        assert mean_update is not None
        from torch.nn.functional import cosine_similarity

        return -float(cosine_similarity(update, mean_update, dim=0))
    raise ValueError(f"unknown residual selection {select!r}; choose one of {SELECTORS}")


def select_residuals(
    candidates: Sequence[Candidate], theta: torch.Tensor, k: int, select: str, mean_input: torch.Tensor | None = None
) -> list[Candidate]:
    """The ``k`` highest-scoring candidates (ties: input order). ``cosine`` needs the round's mean input."""
    mean_update = None if mean_input is None else mean_input - theta
    order = sorted(range(len(candidates)), key=lambda i: (-_score(candidates[i], theta, select, mean_update), i))
    return [candidates[i] for i in order[:k]]


def keep_top(candidates: list[Candidate], new: Candidate, theta: torch.Tensor, k: int, select: str) -> list[Candidate]:
    """Bounded-memory running top-k for l2/loss (a worker never holds more than k models)."""
    pool = [*candidates, new]
    if select == "cosine":  # needs the round's mean: keep all (bounded by the cohort)
        return pool
    return select_residuals(pool, theta, k, select)


def needs(links: Iterable[UpLink]) -> tuple[int, str | None]:
    """How many candidates a worker must keep, and by which criterion, for a node's up-links."""
    links = list(links)
    if not links:
        return 0, None
    selects = {link.select for link in links}
    select = "cosine" if "cosine" in selects or len(selects) > 1 else selects.pop()
    return max(link.k for link in links), select


def contribution(chosen: Sequence[Candidate], combine: str) -> WeightedSum:
    """What one sending round adds to the receiver's accumulator."""
    from bhfl_core.algorithm.aggregation import WeightedSum

    out = WeightedSum()
    if combine == "mean":
        plain = WeightedSum()
        for c in chosen:
            plain.add(c.theta, 1.0)
        out.add(plain.mean(), 1.0)
    else:
        for c in chosen:
            out.add(c.theta, c.weight)
    return out
