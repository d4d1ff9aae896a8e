"""Metrics from additive statistics, chosen by the task.

Every task's evaluation returns, per test group, *statistics that add up*:
confusion matrices for classification, ``[summed masked-token NLL, masked-token
count]`` for masked language modelling. The metric of a model on the union of several
test sets is the metric of the *sum* of their statistics, so unions (a subtree's
clients, all clients) cost no extra model passes. ``task_metrics(manifest.task)``
gives the stats -> metrics function of a task and which direction is better (the
``TaskMetrics`` of its kind in ``bhfl_core.learning.task_kinds``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from bhfl_core.learning.task_kinds import TaskMetrics, available_task_kinds, get_task_kind


def classification_batch(confusions: torch.Tensor) -> dict[str, torch.Tensor]:
    """Accuracy and macro-F1 of a batch of confusion matrices ``[n, true, pred]`` (NaN where empty).

    Macro-F1 averages over the classes present in the truth or the predictions of each
    matrix (scikit-learn's convention).
    """
    c = confusions.to(torch.float64)
    tp = torch.diagonal(c, dim1=-2, dim2=-1)
    total = c.sum(dim=(-2, -1))
    true_count, pred_count = c.sum(dim=-1), c.sum(dim=-2)
    present = (true_count + pred_count) > 0
    f1 = 2 * tp / (true_count + pred_count).clamp(min=1)
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    return {
        "accuracy": torch.where(total > 0, tp.sum(dim=-1) / total.clamp(min=1), nan),
        "macro_f1": torch.where(
            present.any(dim=-1), (f1 * present).sum(dim=-1) / present.sum(dim=-1).clamp(min=1), nan
        ),
    }


def lm_batch(stats: torch.Tensor) -> dict[str, torch.Tensor]:
    """``stats[n] = [summed NLL over masked tokens, masked-token count]`` -> mean loss and perplexity.

    loss = sum / count (nats per masked token), perplexity = exp(loss); NaN with no tokens.
    """
    s = stats.to(torch.float64)
    count = s[..., 1]
    loss = torch.where(count > 0, s[..., 0] / count.clamp(min=1e-300), torch.tensor(float("nan"), dtype=torch.float64))
    return {"loss": loss, "perplexity": torch.exp(loss)}


def _single(batch: Callable[[torch.Tensor], dict[str, torch.Tensor]], block: torch.Tensor) -> dict[str, float]:
    return {k: float(v[0]) for k, v in batch(block[None]).items()}


def classification_metrics(confusion: torch.Tensor) -> dict[str, float]:
    return _single(classification_batch, confusion)


def accuracy(confusion: torch.Tensor) -> float:
    return classification_metrics(confusion)["accuracy"]


def macro_f1(confusion: torch.Tensor) -> float:
    return classification_metrics(confusion)["macro_f1"]


def lm_metrics(stats: torch.Tensor) -> dict[str, float]:
    return _single(lm_batch, stats)


def task_metrics(task: str) -> TaskMetrics:
    """The metrics of ``task`` (the data manifest's ``task``); unknown tasks are errors naming it."""
    try:
        return get_task_kind(task).metrics
    except ValueError:
        raise ValueError(f"no evaluation metrics for task {task!r}; known tasks: {available_task_kinds()}") from None


def metric_bounds(metric: str) -> tuple[float, float] | None:
    """The range ``metric`` cannot leave, as the task kind that defines it declares (accuracy: [0, 1]); None: unbounded.

    By name, because what is compared across runs (``bhfl compare``) is the metric's name.
    """
    for name in available_task_kinds():
        bounds = get_task_kind(name).metrics.bounds
        if metric in bounds:
            return bounds[metric]
    return None
