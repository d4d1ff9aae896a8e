"""Trivial baselines: what a model scores that learnt nothing but its training data's prior.

Without them a reader cannot tell learning from label priors: on one real-text
partition each client predicting its own most frequent training label scored
0.54-0.57, and every federated method only 0.05-0.11 above it (issue 34). They are
computed from the data alone, without training, and scored with the evaluation's own
statistics and metrics (``TaskMetrics.batch``), so a baseline and a headline differ in
the model only.

Every test set gets the trivial model of the training data that matches it:
``<client>``: the client's own train split; ``union``: the train splits of all
clients together; ``proxy``: the proxy train split. (The ``subtree:<server>`` sets have
none: no headline reads them.) The kind depends on the task:

- classification, ``majority``: predict the most frequent training label (ties: the
  smallest label id; no training rows: label 0). Its confusion matrix on a test split
  has one non-zero column, the split's label histogram; accuracy and macro-F1 follow
  from it as for any model. The manifest's label histograms are all it needs.
- masked LM, ``unigram``: predict every masked token from the training split's token
  frequencies, add-one smoothed over the vocabulary, p(t) = (n_t + 1) / (N + V), where
  n_t counts the attended non-special tokens (the ones masking may select) and V is the
  vocabulary size. It is scored on exactly the positions the evaluation masks (the same
  table, seed and rule: ``masked_targets``), so its ``loss`` is the unigram
  cross-entropy of the evaluated targets and ``perplexity`` = exp(loss).

``headline_metrics`` gives the run's headline keys with the baseline's values: the
baseline takes the place of every model in the evaluation matrix (``as_evaluation``),
so ``<relation>_on_own_clients/<metric>_mean`` averages over the same clients as the
run's headline of that key (a client model that was never trained is left out of both).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from bhfl_core.analysis.evaluation import Evaluation
from bhfl_core.analysis.matrix_axes import PROXY, UNION
from bhfl_core.learning.mlm import IGNORE_INDEX, mask_tokens
from bhfl_core.learning.task_kinds import TaskFacts, TaskMetrics
from bhfl_core.rng import derive_seed

PREFIX = "baseline/"
"""Parent-run metrics of a baseline: ``baseline/<kind>/<headline key>``."""

Block = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (train counts, test counts) -> statistics block


@dataclass(frozen=True)
class Counts:
    """What one test set's trivial model is fitted on (``train``) and scored on (``test``), over one index.

    Classification: the label histograms of the train and the test rows. Masked LM:
    token counts of the train split and of the test set's masked targets, over the vocabulary.
    """

    train: torch.Tensor
    test: torch.Tensor

    def __add__(self, other: Counts) -> Counts:
        return Counts(self.train + other.train, self.test + other.test)


def majority_block(train: torch.Tensor, test: torch.Tensor) -> torch.Tensor:
    """The confusion matrix ``[true, pred]`` of always predicting ``train``'s most frequent label.

    ``torch.argmax`` returns the first of equal maxima: ties go to the smallest label id.
    """
    labels = len(test)
    confusion = torch.zeros(labels, labels, dtype=torch.float64)
    confusion[:, int(torch.argmax(train))] = test.to(torch.float64)
    return confusion


def unigram_block(train: torch.Tensor, test: torch.Tensor) -> torch.Tensor:
    """``[summed NLL, target count]`` of the ``test`` targets under ``train``'s add-one-smoothed unigram model."""
    counts = train.to(torch.float64)
    log_p = torch.log((counts + 1) / (counts.sum() + len(counts)))
    targets = test.to(torch.float64)
    return torch.stack([-(targets * log_p).sum(), targets.sum()])


@dataclass(frozen=True)
class TrivialKind:
    """A task's trivial baseline: its name (in the metric keys), its statistics, and how the report says what it is."""

    name: str
    block: Block
    own: str  # what the report calls the per-client baseline, e.g. "each client's majority training label"
    union: str  # ... the union's
    proxy: str  # ... the proxy's

    def key(self, headline_key: str) -> str:
        """The parent-run metric with this baseline's value of a headline (``root/union/accuracy`` ->
        ``baseline/majority/root/union/accuracy``): what a comparison of runs reads beside it."""
        return f"{PREFIX}{self.name}/{headline_key}"


KINDS: dict[str, TrivialKind] = {
    "classification": TrivialKind(
        "majority",
        majority_block,
        "each client's majority training label",
        "the majority label of all clients' training data",
        "the proxy train split's majority label",
    ),
    "mlm": TrivialKind(
        "unigram",
        unigram_block,
        "a unigram model of each client's training tokens",
        "a unigram model of all clients' training tokens",
        "a unigram model of the proxy train split's tokens",
    ),
}


def trivial_kind(task: str) -> TrivialKind | None:
    """The trivial baseline of ``task`` (a task kind's name); None for a task that has none."""
    return KINDS.get(task)


@dataclass(frozen=True)
class TrivialBaseline:
    """A kind's values on every client test split, ``union`` and ``proxy``: ``scores[test set][metric]``."""

    kind: TrivialKind
    scores: Mapping[str, Mapping[str, float]]

    def per_client(self, clients: Iterable[str], metric: str) -> list[float]:
        return [self.scores[c][metric] for c in clients]


def score(
    kind: TrivialKind,
    task: TaskMetrics,
    clients: Iterable[tuple[str, Counts]],
    proxy: Counts,
    union_of: Container[str] | None = None,
) -> TrivialBaseline:
    """Score ``kind`` on each client's test split, the union (counts summed over clients) and the proxy test.

    ``union_of``: the clients whose test splits the evaluation's ``union`` is made of (its
    population, a sample under ``eval.clients: N``; None: every client), so the baseline's
    ``union`` is scored on the same rows as the models'. Its trivial model is still fitted
    on every client's train split, the data the root learns from. ``clients`` is consumed
    one at a time and only the running union is held, so a masked-LM run with many
    clients never holds every client's vocabulary-sized counts.
    """
    blocks: dict[str, torch.Tensor] = {}
    union: Counts | None = None
    for client, counts in clients:
        blocks[client] = kind.block(counts.train, counts.test)
        tested = (
            counts if union_of is None or client in union_of else Counts(counts.train, torch.zeros_like(counts.test))
        )
        union = tested if union is None else union + tested
    if union is not None:
        blocks[UNION] = kind.block(union.train, union.test)
    blocks[PROXY] = kind.block(proxy.train, proxy.test)
    values = task.batch(torch.stack(list(blocks.values())))
    return TrivialBaseline(kind, {name: {m: float(values[m][i]) for m in task.names} for i, name in enumerate(blocks)})


def as_evaluation(ev: Evaluation, baseline: TrivialBaseline) -> Evaluation:
    """``ev``'s matrix with every value replaced by its test set's baseline (the ``subtree:`` sets left out).

    Every model is then the trivial one, on exactly the (model, test set) pairs the run
    scored, so the evaluation's own headlines give the baseline's over the same clients.
    """
    scores = baseline.scores
    return ev.with_values(lambda test_set, metric: scores[test_set][metric] if test_set in scores else None)


def headline_metrics(ev: Evaluation, baseline: TrivialBaseline) -> dict[str, float]:
    """``baseline/<kind>/<key>`` for every headline key of every metric of the task (gains over local-only aside:
    the baseline's over itself are 0)."""
    mirror = as_evaluation(ev, baseline)
    return {
        baseline.kind.key(key): value
        for metric in ev.task.names
        for key, value in mirror.headline(metric).items()
        if not key.startswith("gain_vs_local/")
    }


# ---------------------------------------------------------------- masked LM: the counts from tokenised tables


def token_counts(table: Mapping[str, torch.Tensor], special_ids: Sequence[int], vocab_size: int) -> torch.Tensor:
    """Counts ``[vocab]`` of the attended, non-special tokens of a tokenised table (those masking may select)."""
    ids = table["input_ids"]
    keep = ~torch.isin(ids, torch.tensor(sorted(set(special_ids)), dtype=ids.dtype))
    if "attention_mask" in table:
        keep &= table["attention_mask"].bool()
    return torch.bincount(ids[keep], minlength=vocab_size)


def masked_targets(
    data: Mapping[str, torch.Tensor], groups: torch.Tensor, num_groups: int, facts: TaskFacts
) -> list[torch.Tensor]:
    """Per group of ``data``'s rows, the ids of the tokens the evaluation masks (its targets).

    ``data`` and ``groups`` must be the table the workers score (``RunContext.test_sets``):
    the masks are drawn as the ``mlm`` scorer draws them (``task_kinds._lm_stats`` ->
    ``mlm.grouped_lm_stats``), once over the whole table from the run's evaluation seed;
    tests/core/test_trivial_baselines.py checks that the two agree.
    """
    spec = facts.masking()
    generator = torch.Generator().manual_seed(derive_seed(facts.seed, "eval", "mlm-masks"))
    _, targets = mask_tokens(
        data["input_ids"],
        data.get("attention_mask"),
        spec.special_ids,
        spec.mask_token_id,
        spec.vocab_size,
        spec.probability,
        generator,
    )
    chosen = targets != IGNORE_INDEX
    row_group = groups[:, None].expand_as(targets)[chosen]
    order = torch.argsort(row_group, stable=True)
    sizes = torch.bincount(row_group, minlength=num_groups).tolist()
    return list(torch.split(targets[chosen][order], sizes))
