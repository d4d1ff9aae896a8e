"""Trivial baselines by hand: majority label and unigram statistics, their unions, the mirrored headlines,
and the unigram scored on exactly the positions the evaluation masks. No Prefect, no MLflow."""

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from bhfl_core.analysis.evaluation import Evaluation
from bhfl_core.analysis.matrix_axes import ModelRef
from bhfl_core.analysis.trivial_baselines import (
    KINDS,
    Counts,
    TrivialBaseline,
    headline_metrics,
    majority_block,
    masked_targets,
    score,
    token_counts,
    unigram_block,
)
from bhfl_core.learning.metrics import task_metrics
from bhfl_core.learning.task_kinds import TaskFacts, get_task_kind
from tests.core.fake_tree import settings, two_edge_tree

CLS, MLM = task_metrics("classification"), task_metrics("mlm")
MAJORITY, UNIGRAM = KINDS["classification"], KINDS["mlm"]


def counts(train, test):
    return Counts(torch.tensor(train), torch.tensor(test))


def test_majority_predicts_the_most_frequent_training_label_smallest_id_on_ties():
    assert torch.equal(
        majority_block(torch.tensor([1, 4, 4]), torch.tensor([2, 0, 3])),
        torch.tensor([[0, 2, 0], [0, 0, 0], [0, 3, 0]], dtype=torch.float64),
    )  # labels 1 and 2 tie at 4: label 1
    assert majority_block(torch.tensor([0, 0]), torch.tensor([1, 1]))[:, 0].tolist() == [1, 1]  # no rows: label 0


def test_majority_scores_by_hand():
    baseline = score(
        MAJORITY,
        CLS,
        iter([("a", counts([5, 3, 0], [2, 1, 1])), ("b", counts([1, 1, 4], [0, 3, 1]))]),
        counts([0, 2, 1], [4, 4, 0]),
    )
    s = baseline.scores
    # a: label 0 right on 2 of 4; classes 0, 1, 2 present; F1(0) = 2·2 / (2 + 4)
    assert s["a"]["accuracy"] == 0.5 and s["a"]["macro_f1"] == pytest.approx((2 / 3) / 3)
    # b: label 2 right on 1 of 4; classes 1, 2 present; F1(2) = 2·1 / (1 + 4)
    assert s["b"]["accuracy"] == 0.25 and s["b"]["macro_f1"] == pytest.approx(0.4 / 2)
    # union: training labels [6, 4, 4] -> label 0 (the global prior), on tests [2, 4, 2]
    assert s["union"]["accuracy"] == 0.25 and s["union"]["macro_f1"] == pytest.approx((2 * 2 / (2 + 8)) / 3)
    # proxy: its own train split's majority (label 1), not the clients'
    assert s["proxy"]["accuracy"] == 0.5 and s["proxy"]["macro_f1"] == pytest.approx((2 * 4 / (4 + 8)) / 2)
    assert set(s) == {"a", "b", "union", "proxy"}


def test_the_union_is_scored_on_the_evaluations_population_and_fitted_on_every_client():
    """``eval.clients: N``: the models' ``union`` is the sampled clients' test splits, so the baseline's is too;
    its majority label stays that of all clients' training data (the global prior the root learns from)."""
    clients = [
        ("a", counts([5, 3, 0], [2, 1, 1])),
        ("b", counts([1, 1, 4], [0, 3, 1])),
        ("c", counts([0, 6, 0], [0, 0, 5])),
    ]
    proxy = counts([0, 2, 1], [4, 4, 0])
    full = score(MAJORITY, CLS, iter(clients), proxy).scores
    sample = score(MAJORITY, CLS, iter(clients), proxy, union_of=frozenset({"a", "b"})).scores
    # training labels of a + b + c: [6, 10, 4] -> label 1 (a + b alone: [6, 4, 4] -> label 0, 2 of 8 right)
    assert full["union"]["accuracy"] == pytest.approx(4 / 13)  # tests of a + b + c: [2, 4, 7]
    assert sample["union"]["accuracy"] == pytest.approx(4 / 8)  # tests of a + b: [2, 4, 2]
    assert {c: full[c] for c in ("a", "b", "c", "proxy")} == {c: sample[c] for c in ("a", "b", "c", "proxy")}


def test_an_empty_test_split_has_no_number():
    s = score(MAJORITY, CLS, iter([("a", counts([1, 0], [0, 0]))]), counts([1, 0], [0, 0])).scores
    assert math.isnan(s["a"]["accuracy"]) and math.isnan(s["proxy"]["macro_f1"])


def test_unigram_with_add_one_smoothing_by_hand():
    # train tokens: 0 three times, 1 once; V = 4 -> p = (4, 2, 1, 1) / 8; targets: one 0, two 2s
    nll, n = unigram_block(torch.tensor([3, 1, 0, 0]), torch.tensor([1, 0, 2, 0])).tolist()
    assert n == 3 and nll == pytest.approx(math.log(2) + 2 * math.log(8))
    s = score(UNIGRAM, MLM, iter([("a", counts([3, 1, 0, 0], [1, 0, 2, 0]))]), counts([0, 0, 0, 0], [0, 1, 0, 0]))
    assert s.scores["a"]["perplexity"] == pytest.approx(2 ** (7 / 3))
    assert s.scores["proxy"]["perplexity"] == pytest.approx(4.0)  # no training tokens: uniform over V
    # union: train counts summed over clients (a's only here)
    assert s.scores["union"]["loss"] == pytest.approx(s.scores["a"]["loss"])


def test_headlines_mirror_the_runs_keys_over_the_same_clients():
    """a2, b1, b2 never trained a model of their own: the client row's baseline averages a1 alone, as the run's."""
    tree = two_edge_tree(settings())
    conf = torch.tensor([[1, 1], [0, 0]])
    stats = {ModelRef.of_node(m): {c: conf for c in ("a1", "a2", "b1", "b2", "proxy")} for m in ("root", "A", "B")}
    stats[ModelRef.of_node("a1")] = {c: conf for c in ("a1", "a2", "b1", "b2", "proxy")}
    ev = Evaluation.from_stats(tree, CLS, stats)
    accuracy = {"a1": 0.5, "a2": 1.0, "b1": 0.25, "b2": 0.75, "union": 0.4, "proxy": 0.3}
    baseline = TrivialBaseline(MAJORITY, {k: {"accuracy": v, "macro_f1": v / 2} for k, v in accuracy.items()})
    got = headline_metrics(ev, baseline)
    assert set(got) == {f"baseline/majority/{key}" for metric in CLS.names for key in ev.headline(metric)}
    assert got["baseline/majority/client_on_own_clients/accuracy_mean"] == 0.5
    assert got["baseline/majority/edge_on_own_clients/accuracy_mean"] == pytest.approx(0.625)
    assert got["baseline/majority/edge_on_own_clients/accuracy_worst10"] == 0.25  # ceil(10% of 4) = 1 client
    assert got["baseline/majority/root_on_own_clients/macro_f1_mean"] == pytest.approx(0.3125)
    assert got["baseline/majority/root/union/accuracy"] == 0.4 and got["baseline/majority/root/proxy/macro_f1"] == 0.15


SPECIAL, MASK, VOCAB = (0, 1, 2, 3, 4), 4, 12


class UnigramModel(nn.Module):
    """Predicts the same distribution at every position: what the unigram baseline is, as a model."""

    def __init__(self, log_p: torch.Tensor) -> None:
        super().__init__()
        self.log_p = log_p

    def forward(self, input_ids, **_):
        return SimpleNamespace(logits=self.log_p.expand(*input_ids.shape, -1))


def test_the_unigram_is_scored_on_exactly_the_positions_the_evaluation_masks():
    g = torch.Generator().manual_seed(0)
    rows, width = 40, 10
    ids = torch.randint(5, VOCAB, (rows, width), generator=g)
    lengths = torch.randint(3, width + 1, (rows,), generator=g)
    attention = (torch.arange(width)[None, :] < lengths[:, None]).long()
    ids[:, 0], ids[torch.arange(rows), lengths - 1] = 2, 3
    ids[attention == 0] = 0
    data = {"input_ids": ids, "attention_mask": attention}
    groups = torch.arange(rows) % 3
    facts = TaskFacts("mlm", (), VOCAB, SPECIAL, MASK, 0.15, seed=11)
    train = token_counts(data, SPECIAL, VOCAB)
    assert train[:5].sum() == 0 and train.sum() == (lengths - 2).sum()  # attended, non-special tokens only

    counts_train = torch.arange(VOCAB) % 4  # any training counts: the model and the baseline share them
    log_p = torch.log((counts_train + 1) / (counts_train.sum() + VOCAB)).float()
    scored = get_task_kind("mlm").score(UnigramModel(log_p), data, groups, 3, 7, torch.device("cpu"), facts)
    targets = masked_targets(data, groups, 3, facts)
    for group in range(3):
        block = unigram_block(counts_train, torch.bincount(targets[group], minlength=VOCAB))
        assert block.tolist() == pytest.approx(scored[group].tolist(), rel=1e-5)
