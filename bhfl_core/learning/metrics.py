"""Metrics from additive statistics, chosen by the task.

Every task's evaluation returns, per test group, *statistics that add up*:
confusion matrices for classification, ``[summed masked-token NLL, masked-token
count]`` for masked language modelling. The metric of a model on the union of several
test sets is the metric of the *sum* of their statistics, so unions (a subtree's
clients, all clients) cost no extra model passes. ``task_metrics(manifest.task)``
gives the stats -> metrics function of a task and which direction is better (the
``TaskMetrics`` of its kind in ``bhfl_core.learning.task_kinds``). The batched maths
(statistics of many groups at once -> metric tensors) is ``batch_metrics.py``, below
both this module and the task kinds that name it; here are the one-block forms and the
lookups by task.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from bhfl_core.learning.batch_metrics import classification_batch, lm_batch
from bhfl_core.learning.task_kinds import TaskMetrics, available_task_kinds, get_task_kind


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
