"""Evaluation maths by hand: unions of statistics, metrics per task, client distributions,
relatives and gains over local-only, proximity (distances, Spearman, hypothesis shares),
communication accounting. No Prefect, no MLflow."""

import math

import numpy as np
import pytest
import torch

from bhfl_core.analysis import communication as comm
from bhfl_core.analysis.distribution import distribution
from bhfl_core.analysis.evaluation import Evaluation
from bhfl_core.analysis.matrix_axes import ModelRef, all_test_sets
from bhfl_core.analysis.model_values import MatrixBuilder, scored_from_stats
from bhfl_core.analysis.proximity import analyse, average_ranks, spearman
from bhfl_core.config.schema import EvalConfig
from bhfl_core.learning.metrics import classification_metrics, lm_metrics, task_metrics
from tests.core.fake_tree import settings, two_edge_tree

CLS = task_metrics("classification")
MLM = task_metrics("mlm")
N, LOCAL = ModelRef.of_node, ModelRef.local_only


def tree():
    """root -> A (a1, a2), B (b1, b2); clients at depth 2."""
    return two_edge_tree(settings())


def conf(right: int, wrong: int) -> torch.Tensor:
    """A 2-class confusion matrix: ``right`` correct class-0 rows, ``wrong`` class-0 rows predicted as 1."""
    return torch.tensor([[right, wrong], [0, 0]])


def accuracy_eval(acc: dict[ModelRef, dict[str, float]], task=CLS) -> Evaluation:
    """An evaluation whose per-client accuracies are exactly ``acc[model][client]`` (10 test rows each)."""
    t = tree()
    stats = {}
    for model, per_client in acc.items():
        blocks = {
            c: conf(round(10 * per_client.get(c, 0.0)), 10 - round(10 * per_client.get(c, 0.0)))
            for c in ("a1", "a2", "b1", "b2")
        }
        blocks["proxy"] = conf(5, 5)
        stats[model] = blocks
    return Evaluation.from_stats(t, task, stats)


def test_test_sets_and_unions_are_sums_of_client_blocks():
    t = tree()
    assert all_test_sets(t) == ["a1", "a2", "b1", "b2", "subtree:A", "subtree:B", "union", "proxy"]
    blocks = {"a1": conf(3, 1), "a2": conf(1, 3), "b1": conf(2, 0), "b2": conf(0, 2), "proxy": conf(9, 1)}
    (scored,) = scored_from_stats(t, {N("root"): blocks})
    builder = MatrixBuilder(t, CLS)
    sums = dict(zip(builder._unions.names, builder._unions.members @ scored.blocks[:4].double().reshape(4, -1)))
    assert torch.equal(sums["subtree:A"], conf(4, 4).double().flatten())
    assert torch.equal(sums["union"], conf(6, 6).double().flatten())
    ev = Evaluation.from_stats(t, CLS, {N("root"): blocks})
    assert ev.value("root", "subtree:A") == pytest.approx(4 / 8)
    assert ev.value("root", "subtree:B") == pytest.approx(2 / 4)
    assert ev.value("root", "union") == pytest.approx(6 / 12)  # not the mean of client accuracies (0.5 here too)
    assert ev.value("root", "a1") == pytest.approx(0.75) and ev.value("root", "proxy") == pytest.approx(0.9)
    # macro-F1 on the union: class 0 F1 = 2*6/(12+6), class 1 F1 = 0 (predicted, never true)
    assert ev.value("root", "union", "macro_f1") == pytest.approx((2 * 6 / 18 + 0.0) / 2)
    assert len(list(ev.rows())) == 8 * 2  # 8 test sets x 2 metrics
    empty = classification_metrics(torch.zeros(2, 2, dtype=torch.int64))
    assert math.isnan(empty["accuracy"]) and math.isnan(empty["macro_f1"])


def test_lm_metrics_by_hand_and_unions_of_lm_stats():
    assert lm_metrics(torch.tensor([6.0, 3.0])) == pytest.approx({"loss": 2.0, "perplexity": math.exp(2.0)})
    assert all(math.isnan(v) for v in lm_metrics(torch.tensor([0.0, 0.0])).values())
    t = tree()
    blocks = {
        "a1": torch.tensor([6.0, 3.0]),
        "a2": torch.tensor([1.0, 1.0]),
        "b1": torch.tensor([2.0, 4.0]),
        "b2": torch.tensor([0.0, 2.0]),
        "proxy": torch.tensor([3.0, 1.0]),
    }
    ev = Evaluation.from_stats(t, MLM, {N("A"): blocks})
    assert ev.value("A", "subtree:A", "loss") == pytest.approx(7 / 4)  # (6 + 1) / (3 + 1)
    assert ev.value("A", "union", "perplexity") == pytest.approx(math.exp(9 / 10))
    assert ev.task.primary == "perplexity" and not ev.task.better("loss")
    with pytest.raises(ValueError, match="no evaluation metrics for task 'regression'"):
        task_metrics("regression")


def test_distribution_statistics_and_direction():
    values = [0.1 * i for i in range(1, 11)]
    d = distribution(values, higher_is_better=True)
    assert (d.n, d.mean, d.median) == (10, pytest.approx(0.55), pytest.approx(0.55))
    assert d.best10 == pytest.approx(1.0) and d.worst10 == pytest.approx(0.1)
    assert d.variance == pytest.approx(0.0825)  # population variance of 0.1..1.0
    low = distribution(values, higher_is_better=False)  # perplexity-like: the worst are the highest
    assert low.worst10 == pytest.approx(1.0) and low.best10 == pytest.approx(0.1)
    d20 = distribution([float(i) for i in range(20)], higher_is_better=True)
    assert d20.worst10 == pytest.approx(0.5) and d20.best10 == pytest.approx(18.5)  # 2 of 20 each side
    assert distribution([float("nan")], True).n == 0


def test_worst_and_best_10_percent_average_the_ceil_of_a_tenth_of_the_clients():
    """Not the 10th percentile: the mean of the ``ceil(n / 10)`` worst (at least one), NaNs left out first."""
    six = [0.9, 0.1, 0.5, 0.3, 0.7, 0.4]  # ceil(0.6) = 1 client each side
    d = distribution(six, True)
    assert (d.worst10, d.best10) == (0.1, 0.9)
    assert np.percentile(six, 10) == pytest.approx(0.2)  # what a percentile would have said instead
    for n in (10, 11, 20, 21, 70, 99, 101):  # k = ceil(n / 10) in integers: 1, 2, 2, 3, 7, 10, 11
        k = -(-n // 10)
        d = distribution([float(v) for v in reversed(range(n))], True)  # values 0..n-1, given unsorted
        assert (d.worst10, d.best10) == (pytest.approx((k - 1) / 2), pytest.approx(n - 1 - (k - 1) / 2)), n
    ties = distribution([0.2, 0.2, 0.2, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8], True)  # 11 clients: 2 worst
    assert ties.worst10 == pytest.approx(0.2) and ties.best10 == pytest.approx(0.8)
    gaps = distribution([math.nan] * 5 + [0.3, 0.6], True)  # 2 values: one each side, the NaNs not counted
    assert (gaps.n, gaps.worst10, gaps.best10) == (2, 0.3, 0.6)


def test_a_client_without_a_value_leaves_a_complete_evaluation_exact():
    """A client whose test split is empty has NaN metrics; over all clients the mean is still exact (no interval,
    ``of = n``), while in a sample (``eval.clients: N``) the other sampled clients stand for all of them."""
    d = distribution([0.5, 0.7, math.nan, 0.9], True, of=4, bounds=(0.0, 1.0))
    assert (d.n, d.of, d.mean_low, d.mean_high) == (3, 3, d.mean, d.mean) and d.mean == pytest.approx(0.7)
    s = distribution([0.5, 0.7, math.nan, 0.9], True, of=10)  # 4 sampled of 10, one of them without a value
    half = 4.302652730 * 0.2 / math.sqrt(3) * math.sqrt(7 / 10)  # t(0.975, 2), sample std 0.2, fpc (10 - 3) / 10
    assert (s.n, s.of) == (3, 10)
    assert (s.mean_low, s.mean_high) == (pytest.approx(0.7 - half), pytest.approx(0.7 + half))
    # through an evaluation: b2 has no test rows, every client scored; nothing claims a sample
    blocks = {"a1": conf(3, 1), "a2": conf(1, 3), "b1": conf(2, 0), "b2": torch.zeros(2, 2), "proxy": conf(9, 1)}
    ev = Evaluation.from_stats(tree(), CLS, {N("root"): blocks})
    rows = {(r.population, r.metric): r.dist for r in ev.distribution_rows()}
    assert all(r.n == r.of == 3 and r.mean_low == r.mean == r.mean_high for r in rows.values())
    assert rows[("all", "accuracy")].mean == pytest.approx((0.75 + 0.25 + 1.0) / 3)
    assert not any(k.endswith(("_mean_low", "_mean_high")) for k in ev.node_metrics("root"))
    assert not any(k.endswith(("_mean_low", "_mean_high")) for k in ev.headline())


def test_macro_f1_and_accuracy_match_scikit_learn_with_classes_absent_from_a_split():
    """Macro-F1 averages over the classes in the truth or the predictions (sklearn's ``labels=None``)."""
    from sklearn.metrics import accuracy_score, f1_score

    rng = np.random.default_rng(5)
    for _ in range(50):
        n = int(rng.integers(1, 15))
        true, pred = rng.integers(0, 3, n), rng.integers(1, 5, n)  # class 0 never predicted, 4 never true, ...
        confusion = torch.zeros(6, 6, dtype=torch.int64)  # class 5 in neither
        for t, p in zip(true, pred):
            confusion[t, p] += 1
        m = classification_metrics(confusion)
        assert m["macro_f1"] == pytest.approx(f1_score(true, pred, average="macro"), abs=1e-12)
        assert m["accuracy"] == pytest.approx(accuracy_score(true, pred), abs=1e-12)


def test_relatives_headline_and_gain_over_local_only():
    ev = accuracy_eval(
        {
            N("root"): {"a1": 0.5, "a2": 0.5, "b1": 0.5, "b2": 0.5},
            N("A"): {"a1": 0.7, "a2": 0.6},
            N("B"): {"b1": 0.8, "b2": 0.4},
            N("a1"): {"a1": 0.9},
            N("b1"): {"b1": 0.6},  # a2, b2 have no persistent model
            LOCAL("a1"): {"a1": 0.8},
            LOCAL("a2"): {"a2": 0.6},
            LOCAL("b1"): {"b1": 0.7},
            LOCAL("b2"): {"b2": 0.5},
        }
    )
    assert ev.relatives("a1") == [("client", "a1"), ("edge", "A"), ("root", "root"), ("local_only", "local:a1")]
    assert ev.relatives("a2") == [("edge", "A"), ("root", "root"), ("local_only", "local:a2")]
    h = ev.headline()
    assert h["client_on_own_clients/accuracy_mean"] == pytest.approx(0.75)  # a1 0.9, b1 0.6
    assert h["edge_on_own_clients/accuracy_mean"] == pytest.approx((0.7 + 0.6 + 0.8 + 0.4) / 4)
    assert h["edge_on_own_clients/accuracy_worst10"] == pytest.approx(0.4)
    assert h["root/union/accuracy"] == pytest.approx(0.5)
    # gains over local-only: edge: a1 -0.1, a2 0.0, b1 +0.1, b2 -0.1 -> mean -0.025, 1 of 4 strictly better
    assert h["gain_vs_local/edge/accuracy_mean"] == pytest.approx(-0.025)
    assert h["gain_vs_local/edge/accuracy_share_better"] == pytest.approx(0.25)
    assert h["gain_vs_local/client/accuracy_mean"] == pytest.approx((0.1 - 0.1) / 2)
    rows = {(r.client, r.relation): r for r in ev.client_rows() if r.metric == "accuracy"}
    assert rows[("b1", "edge")].gain_vs_local == pytest.approx(0.1)
    assert math.isnan(accuracy_eval({N("A"): {"a1": 0.5}}).client_rows()[0].gain_vs_local)  # no baseline ran
    dist = {(r.model, r.population): r.dist for r in ev.distribution_rows() if r.metric == "accuracy"}
    assert dist[("A", "subtree")].n == 2 and dist[("A", "subtree")].mean == pytest.approx(0.65)
    assert dist[("A", "all")].n == 4  # A scored on every client: b1, b2 at 0
    assert ev.node_models() == ["root", "A", "a1", "B", "b1"]  # tree order; baselines after them
    assert ev.models[-4:] == ["local:a1", "local:a2", "local:b1", "local:b2"]
    assert ev.population("local:a1") == ["a1"] and ev.population("A") == ["a1", "a2"]


def test_model_names_are_the_matrix_strings():
    assert [m.name for m in (N("edge-de"), LOCAL("en-00"), ModelRef.adapted("en-00"))] == [
        "edge-de",
        "local:en-00",
        "adapt:en-00",
    ]
    assert ModelRef.adapted("b2") == ModelRef("b2", "adapted") != LOCAL("b2")
    with pytest.raises(ValueError):
        ModelRef("b2", "global")  # type: ignore[arg-type]


def test_gain_is_positive_when_lower_perplexity():
    t = tree()
    ev = Evaluation.from_stats(
        t,
        MLM,
        {
            N("A"): {c: torch.tensor([2.0, 1.0]) for c in ("a1", "a2", "b1", "b2", "proxy")},
            LOCAL("a1"): {c: torch.tensor([3.0, 1.0]) for c in ("a1", "a2", "b1", "b2", "proxy")},
        },
    )
    h = ev.headline()
    assert h["gain_vs_local/edge/perplexity_mean"] == pytest.approx(math.exp(3) - math.exp(2))
    assert h["gain_vs_local/edge/perplexity_share_better"] == 1.0


def test_spearman_and_average_ranks_by_hand():
    assert average_ranks([10.0, 20.0, 10.0]) == [1.5, 3.0, 1.5]
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)  # 1 - 6*2/(4*15)
    assert spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(1.5 / math.sqrt(3.0))
    assert math.isnan(spearman([1, 1], [1, 2]))


def test_proximity_distances_and_hypothesis_shares():
    # a1: own 0.9 > A 0.7 > root 0.5 > B 0.3 (d 0, 1, 2, 3): holds by rank and on the path.
    # b1: own 0.6 < B 0.8 (parent better than own): fails on the path; rank over
    #     (d0 0.6, d1 0.8, d2 0.5, d3 A 0.1) -> rho(distance, quality) = -0.4 < 0: holds by rank.
    ev = accuracy_eval(
        {
            N("root"): {"a1": 0.5, "a2": 0.5, "b1": 0.5, "b2": 0.5},
            N("A"): {"a1": 0.7, "a2": 0.6, "b1": 0.1, "b2": 0.1},
            N("B"): {"a1": 0.3, "a2": 0.3, "b1": 0.8, "b2": 0.4},
            N("a1"): {"a1": 0.9},
            N("b1"): {"b1": 0.6},
        }
    )
    p = analyse(ev)
    pairs = p.pairs
    pair = {
        (pairs.models[pairs.model[i]], pairs.clients[pairs.client[i]]): (int(pairs.distance[i]), bool(pairs.on_path[i]))
        for i in range(len(pairs))
    }
    assert pair[("A", "a1")] == (1, True) and pair[("B", "a1")] == (3, False)
    assert pair[("b1", "a1")] == (4, False) and pair[("a1", "a1")] == (0, True)
    assert pair[("root", "b2")] == (2, True)
    assert all(int(pairs.distance[i]) == ev.tree.distance(*key) for i, key in enumerate(pair))  # as Tree.distance
    per = {c.client: c for c in p.clients}
    assert per["a1"].rho == pytest.approx(spearman([0, 1, 2, 3, 4], [0.9, 0.7, 0.5, 0.3, 0.0]))
    assert per["a1"].rho == pytest.approx(-1.0) and per["a1"].path_holds is True
    assert per["b1"].rho == pytest.approx(spearman([0, 1, 2, 3, 4], [0.6, 0.8, 0.5, 0.1, 0.0]))
    assert per["b1"].path_holds is False
    # a2: path = A 0.6, root 0.5 -> holds; b2: B 0.4, root 0.5 -> fails
    assert per["a2"].path_holds is True and per["b2"].path_holds is False
    assert p.share_path == pytest.approx(2 / 4)
    # steps: own >= parent: a1 yes, b1 no; parent >= root: a1 0.7>=0.5, a2 0.6>=0.5, b1 0.8>=0.5, b2 0.4<0.5
    assert p.path_steps == [(0, 2, 0.5), (1, 4, 0.75)]
    assert p.share_rank == pytest.approx(sum(c.rho < 0 for c in p.clients) / 4)
    all_curve = {c.distance: c for c in p.curve if c.relation == "all"}
    assert all_curve[0].n == 2 and all_curve[0].mean == pytest.approx(0.75)  # own models of a1, b1
    assert all_curve[1].mean == pytest.approx((0.7 + 0.6 + 0.8 + 0.4) / 4)
    # union (10 rows per client): root 20/40; A 15/40, B 18/40 (depth 1); a1 9/40, b1 6/40 (depth 2)
    g = p.globals["union"]
    assert g.by_depth == [(0, 1, pytest.approx(0.5)), (1, 2, pytest.approx(0.4125)), (2, 2, pytest.approx(0.1875))]
    assert g.rho_depth < 0 and g.path_share == 1.0


def test_proximity_flips_sign_for_perplexity():
    t = tree()
    low, high = torch.tensor([0.0, 1.0]), torch.tensor([2.0, 1.0])  # perplexity 1 (good) and e^2 (bad)
    stats = {
        N("A"): {c: (low if c.startswith("a") else high) for c in ("a1", "a2", "b1", "b2")},
        N("B"): {c: high for c in ("a1", "a2", "b1", "b2")},
        N("root"): {c: high for c in ("a1", "a2", "b1", "b2")},
    }
    for s in stats.values():
        s["proxy"] = low
    p = analyse(Evaluation.from_stats(t, MLM, stats))
    per = {c.client: c for c in p.clients}
    assert per["a1"].path_holds is True  # A (ppl 1) better than root (ppl e^2) for a1
    assert per["b1"].path_holds is True  # B and root tie for b1 (e^2 each): never improves going up
    assert per["a1"].rho < 0  # distances 1, 2, 3 (A, root, B) with perplexity 1, e^2, e^2


def test_communication_bytes_per_level_by_hand():
    t = tree()
    history = {
        "root": {
            "comm/down_models": {1: 2, 2: 2},
            "comm/up_models": {1: 2, 2: 2},
            "comm/res_down_models": {1: 2, 2: 2},
            "comm/res_up_models": {1: 0, 2: 0},
        },
        "A": {"comm/down_models": {1: 2, 2: 1}, "comm/up_models": {1: 2, 2: 1}, "comm/res_up_models": {1: 1, 2: 1}},
    }
    rows = comm.comm_rows(t, history, num_params=10)
    assert all(r.bytes == r.models * 40 for r in rows)  # 10 float32 values per model
    assert not [r for r in rows if r.models == 0]
    totals = comm.totals(rows)
    assert totals["comm/total_model_equivalents"] == 4 + 4 + 4 + 3 + 3 + 2
    assert totals["comm/total_bytes"] == 20 * 40
    assert totals["comm/residual_bytes"] == (4 + 2) * 40
    assert totals["comm/down_bytes"] == (4 + 4 + 3) * 40
    summary = {(s.level, s.direction, s.kind): s for s in comm.summarise(t, rows)}
    assert summary[(1, "up", "residual")].models == 2 and summary[(1, "up", "residual")].servers == "edge"
    assert summary[(1, "down", "regular")].models_per_round == pytest.approx(1.5)
    assert summary[(0, "down", "regular")].server_rounds == 2
    assert comm.human_bytes(1_500_000) == "1.50 MB" and comm.human_bytes(999) == "999 B"
    with pytest.raises(ValueError):
        comm.comm_rows(t, history, num_params=0)


def test_eval_config_baselines():
    cfg = EvalConfig.model_validate({"local_only": {}, "local_adaptation": {"from": "root", "rounds": 2}})
    assert cfg.local_only is not None and cfg.local_only.rounds == "matched"
    assert cfg.local_adaptation is not None and cfg.local_adaptation.source == "root"
    assert EvalConfig().local_only is None and EvalConfig().local_adaptation is None
    with pytest.raises(Exception, match="from"):
        EvalConfig.model_validate({"local_adaptation": {"from": "sibling"}})
