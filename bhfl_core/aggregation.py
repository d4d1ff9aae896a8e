"""Weighted sums of flat parameter vectors: add tensors and weights, divide late.

A ``WeightedSum`` is what travels from workers to their server: a worker that trains
several clients folds them into one running sum, so client models never sit in memory
together and partial sums from several workers combine associatively.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class WeightedSum:
    """Running ``sum_i w_i * x_i`` and ``sum_i w_i`` over flat vectors."""

    total: torch.Tensor | None = None
    weight: float = 0.0

    def add(self, vector: torch.Tensor, weight: float) -> None:
        """Fold one input with weight ``weight`` (e.g. its number of training examples)."""
        if weight <= 0:
            raise ValueError(f"aggregation weight must be positive, got {weight}")
        scaled = vector.to(torch.float64) * float(weight)
        self.total = scaled if self.total is None else self.total.add_(scaled)
        self.weight += float(weight)

    def merge(self, other: WeightedSum) -> None:
        """Fold another partial sum (e.g. from another worker)."""
        if other.total is None:
            return
        self.total = other.total.clone() if self.total is None else self.total.add_(other.total)
        self.weight += other.weight

    @property
    def empty(self) -> bool:
        return self.total is None

    def mean(self) -> torch.Tensor:
        """The weighted mean as float32 (sums are kept in float64 for order-robustness)."""
        if self.total is None:
            raise ValueError("cannot average an empty WeightedSum")
        return (self.total / self.weight).to(torch.float32)
