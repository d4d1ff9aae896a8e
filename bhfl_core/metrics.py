"""Classification metrics from confusion matrices.

Working from confusion matrices makes unions free: the metric of a model on the union
of several test sets is the metric of the *sum* of their confusion matrices.
"""

from __future__ import annotations

import torch


def accuracy(confusion: torch.Tensor) -> float:
    total = int(confusion.sum())
    return float(confusion.diag().sum()) / total if total else float("nan")


def macro_f1(confusion: torch.Tensor) -> float:
    """Mean F1 over the classes present in the truth or the predictions (as scikit-learn does)."""
    tp = confusion.diag().to(torch.float64)
    true_count = confusion.sum(dim=1).to(torch.float64)
    pred_count = confusion.sum(dim=0).to(torch.float64)
    present = (true_count + pred_count) > 0
    if not bool(present.any()):
        return float("nan")
    f1 = 2 * tp / (true_count + pred_count).clamp(min=1)
    return float(f1[present].mean())


def classification_metrics(confusion: torch.Tensor) -> dict[str, float]:
    return {"accuracy": accuracy(confusion), "macro_f1": macro_f1(confusion)}
