"""Task kinds: what differs between the tasks a run can learn, looked up by name.

The config's ``data.task`` and the data manifest's ``task`` name a task kind. A kind
says how its model is built (a transformers ``Auto*`` class and head keyword arguments
made from the labels), how a training batch is transformed (masked LM: BERT masking
drawn from the training generator; classification: none), how a model is scored on
the test table (statistics that add up: confusion matrices, or masked-token NLL sums
and counts), how those statistics become metrics (``TaskMetrics``), and what the data
must provide (class labels, a mask token). Code that depends on the task looks its
kind up here instead of switching on the name; new kinds plug in with
``register_task_kind(TaskKind(...))``.

This module is cheap to import (the config schema validates ``data.task`` against it):
torch, transformers and the model-side code are imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from bhfl_core.learning.local_train import BatchTransform
    from bhfl_core.learning.mlm import MaskingSpec

    StatsToMetrics = Callable[[torch.Tensor], dict[str, torch.Tensor]]
    Scorer = Callable[
        [nn.Module, Mapping[str, torch.Tensor], torch.Tensor, int, int, torch.device, "TaskFacts"], torch.Tensor
    ]


@dataclass(frozen=True)
class TaskMetrics:
    """How a task's additive statistics become metrics, and how to rank them.

    ``primary`` is the metric of headlines, heatmaps and the proximity analysis;
    ``higher_is_better[m]`` decides what "best 10%" and "worst 10%" mean for ``m``;
    ``bounds[m]``, for a metric that cannot leave a range (accuracy in [0, 1]), is what
    intervals over seeds are clipped to (bhfl_core/analysis/seeds.py ``interval``).
    """

    task: str
    batch: StatsToMetrics  # stats [n, ...] -> metric -> values [n]
    names: tuple[str, ...]
    higher_is_better: Mapping[str, bool]
    primary: str
    bounds: Mapping[str, tuple[float, float]] = field(default_factory=dict)  # metric -> (low, high); absent: unbounded

    def better(self, metric: str) -> bool:
        return self.higher_is_better[metric]


@dataclass(frozen=True)
class TaskFacts:
    """What a kind's batch transform and scorer need to know about a run (its manifest and config)."""

    task: str
    labels: tuple[str, ...]
    vocab_size: int
    special_ids: tuple[int, ...]
    mask_token_id: int | None
    mlm_probability: float  # model.mlm_probability
    seed: int  # the run's seed: evaluation masks derive from it

    def masking(self) -> MaskingSpec:
        """Masked-LM masking of this run: the tokenizer's ids and the masking rate."""
        if self.mask_token_id is None:
            raise ValueError(f"the data of this run (task {self.task!r}) has no mask token id")
        from bhfl_core.learning.mlm import MaskingSpec

        return MaskingSpec(self.special_ids, self.mask_token_id, self.vocab_size, self.mlm_probability)


@dataclass(frozen=True)
class TaskKind:
    """One task: model class and head, training transform, scorer, metrics, data requirements.

    ``score(model, data, groups, num_groups, batch_size, device, facts)`` returns one block
    of additive statistics per test group (``groups`` tags the rows of ``data``), the same
    for every model scored with the same ``facts``; ``metrics.batch`` turns blocks into metrics.
    """

    name: str
    auto_class: str  # the transformers Auto* class that builds the model (imported on use)
    head: Callable[[Sequence[str]], dict[str, Any]]  # labels -> model config / from_pretrained kwargs
    batch_transform: Callable[[TaskFacts], BatchTransform | None]  # the train_model transform of a run
    score: Scorer
    metrics: TaskMetrics
    # the test table as ``score`` reads it, prepared once per run (masked LM: its evaluation masks); None: as it is
    scoring_table: Callable[[Mapping[str, torch.Tensor], TaskFacts], dict[str, torch.Tensor]] | None = None
    needs_labels: bool = False  # trains and scores on class labels (a proxy corpus must name its label column)
    needs_mask_token: bool = False  # the tokenizer must have a mask token
    # its loss is a mean of per-example terms, so one example's gradient does not depend on the others in its
    # batch (DP-SGD's per-example clipping needs it; a masked LM's mean over the batch's masked tokens is not)
    per_example_loss: bool = True
    # peft's task type for LoRA (model.adapter): "SEQ_CLS" trains and federates the classifier head with the
    # adapters; None trains the adapters alone (models.with_adapter)
    peft_task_type: str | None = None

    def model_class(self) -> Any:
        import transformers  # ~1 s to import: only where a model is built

        return getattr(transformers, self.auto_class)


_REGISTRY: dict[str, TaskKind] = {}


def register_task_kind(kind: TaskKind) -> TaskKind:
    """Register ``kind`` under its name; returns it unchanged."""
    if not kind.name.isidentifier():
        raise ValueError(f"task kind name must be an identifier, got {kind.name!r}")
    if kind.name in _REGISTRY:
        raise ValueError(f"task kind {kind.name!r} is already registered")
    if kind.metrics.task != kind.name:
        raise ValueError(f"task kind {kind.name!r} has the metrics of task {kind.metrics.task!r}")
    _REGISTRY[kind.name] = kind
    return kind


def available_task_kinds() -> list[str]:
    return sorted(_REGISTRY)


def get_task_kind(name: str) -> TaskKind:
    """The kind registered as ``name``; an unknown name is a ValueError naming it and the available ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; available: {available_task_kinds()}") from None


# ---------------------------------------------------------------- classification


def _label_head(labels: Sequence[str]) -> dict[str, Any]:
    id2label = dict(enumerate(labels))
    return {"num_labels": len(labels), "id2label": id2label, "label2id": {name: i for i, name in id2label.items()}}


def _no_transform(facts: TaskFacts) -> None:
    return None


def _confusions(
    model: nn.Module,
    data: Mapping[str, torch.Tensor],
    groups: torch.Tensor,
    num_groups: int,
    batch_size: int,
    device: torch.device,
    facts: TaskFacts,
) -> torch.Tensor:
    """``confusion[group, true, pred]``."""
    from bhfl_core.learning.local_train import grouped_confusions

    return grouped_confusions(model, data, groups, num_groups, len(facts.labels), batch_size, device)


def _classification_metrics(confusions: torch.Tensor) -> dict[str, torch.Tensor]:
    from bhfl_core.learning.batch_metrics import classification_batch

    return classification_batch(confusions)


register_task_kind(
    TaskKind(
        name="classification",
        auto_class="AutoModelForSequenceClassification",
        head=_label_head,
        batch_transform=_no_transform,
        score=_confusions,
        metrics=TaskMetrics(
            "classification",
            _classification_metrics,
            ("accuracy", "macro_f1"),
            {"accuracy": True, "macro_f1": True},
            "accuracy",
            {"accuracy": (0.0, 1.0), "macro_f1": (0.0, 1.0)},
        ),
        needs_labels=True,
        peft_task_type="SEQ_CLS",
    )
)


# ---------------------------------------------------------------- masked language modelling


def _no_head(labels: Sequence[str]) -> dict[str, Any]:
    return {}


def _masking_transform(facts: TaskFacts) -> BatchTransform:
    """Masks each training batch with the training generator (i.e. from the TRAIN call's seed)."""
    from bhfl_core.learning.mlm import mlm_transform

    return mlm_transform(facts.masking())


def _lm_scoring_table(data: Mapping[str, torch.Tensor], facts: TaskFacts) -> dict[str, torch.Tensor]:
    """The test table with its evaluation masks applied (drawn once from the run seed over the whole table)."""
    from bhfl_core.learning.mlm import with_eval_masks
    from bhfl_core.rng import derive_seed

    return with_eval_masks(data, derive_seed(facts.seed, "eval", "mlm-masks"), facts.masking())


def _lm_stats(
    model: nn.Module,
    data: Mapping[str, torch.Tensor],
    groups: torch.Tensor,
    num_groups: int,
    batch_size: int,
    device: torch.device,
    facts: TaskFacts,
) -> torch.Tensor:
    """``[summed masked-token NLL, masked tokens]`` per group; the same masks for every model (run seed)."""
    from bhfl_core.learning.mlm import grouped_lm_stats
    from bhfl_core.rng import derive_seed

    seed = derive_seed(facts.seed, "eval", "mlm-masks")
    return grouped_lm_stats(model, data, groups, num_groups, batch_size, device, seed, masking=facts.masking())


def _lm_metrics(stats: torch.Tensor) -> dict[str, torch.Tensor]:
    from bhfl_core.learning.batch_metrics import lm_batch

    return lm_batch(stats)


register_task_kind(
    TaskKind(
        name="mlm",
        auto_class="AutoModelForMaskedLM",
        head=_no_head,
        batch_transform=_masking_transform,
        score=_lm_stats,
        scoring_table=_lm_scoring_table,
        metrics=TaskMetrics(
            "mlm", _lm_metrics, ("loss", "perplexity"), {"loss": False, "perplexity": False}, "perplexity"
        ),
        needs_mask_token=True,
        per_example_loss=False,
    )
)
