"""Evaluation at scale, by hand: which clients each model is scored on (eval_plan.py), what its union values weigh,
what a sample of the population says about all of it (intervals), and that nothing grows as models x clients."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
import torch

from bhfl_core.algorithm.tree import Node, Role, Tree
from bhfl_core.analysis.distribution import distribution
from bhfl_core.analysis.eval_plan import EvalPlan
from bhfl_core.analysis.evaluation import Evaluation
from bhfl_core.analysis.matrix_axes import PROXY, ModelRef, client_order
from bhfl_core.analysis.model_values import MatrixBuilder, Scored
from bhfl_core.analysis.proximity import analyse
from bhfl_core.learning.metrics import task_metrics
from tests.core.fake_tree import settings

CLS = task_metrics("classification")


def big_tree(groups: int, edges_per_group: int, clients_per_edge: int) -> Tree:
    """root -> g0.. (intermediate servers) -> e0-0.. (edge servers) -> clients c<g>-<e>-<i>, depth 3."""
    nodes: dict[str, Node] = {}
    group_ids = []
    for g in range(groups):
        edge_ids = []
        for e in range(edges_per_group):
            edge = f"e{g}-{e}"
            clients = tuple(f"c{g}-{e}-{i:03d}" for i in range(clients_per_edge))
            for c in clients:
                nodes[c] = Node(c, Role.CLIENT, 3, edge, (), settings(), 1.0)
            nodes[edge] = Node(edge, Role.EDGE, 2, f"g{g}", clients, settings(), float(clients_per_edge))
            edge_ids.append(edge)
        nodes[f"g{g}"] = Node(f"g{g}", Role.SERVER, 1, "root", tuple(edge_ids), settings(), 1.0)
        group_ids.append(f"g{g}")
    nodes["root"] = Node("root", Role.ROOT, 0, None, tuple(group_ids), settings(), 1.0)
    return Tree(nodes=nodes, root_id="root")


def test_a_client_model_is_scored_on_its_split_and_a_seeded_sample_of_each_ring():
    tree = big_tree(2, 2, 10)  # rings of c0-0-000: 9 siblings, 10 cousins (e0-1), 20 others (g1)
    every = client_order(tree)
    plan = EvalPlan(tree, seed=3, clients=None, per_ring=4)
    t = plan.client_targets("c0-0-000")
    assert t is not None and t.weights is not None
    picked = [every[i] for i in t.clients]
    assert "c0-0-000" in picked and len(picked) == 1 + 4 * 3 and list(t.clients) == sorted(t.clients)
    weight = dict(zip(picked, t.weights.tolist()))
    assert weight["c0-0-000"] == 1.0
    siblings = [c for c in picked if c.startswith("c0-0-") and c != "c0-0-000"]
    cousins = [c for c in picked if c.startswith("c0-1-")]
    others = [c for c in picked if c.startswith("c1-")]
    assert (len(siblings), len(cousins), len(others)) == (4, 4, 4)
    assert {weight[c] for c in siblings} == {9 / 4} and {weight[c] for c in cousins} == {10 / 4}
    assert {weight[c] for c in others} == {20 / 4}
    # the same draw at every evaluation and in every process; another client gets another draw
    again = EvalPlan(tree, seed=3, clients=None, per_ring=4).client_targets("c0-0-000")
    assert again is not None and np.array_equal(again.clients, t.clients)
    other = plan.client_targets("c0-0-001")
    assert other is not None and not np.array_equal(np.sort(other.clients), np.sort(t.clients))
    # rings no larger than K: every client, exactly as a server is scored (the embedded default: K 16 >= 12)
    complete = EvalPlan(tree, seed=3, clients=None, per_ring=20).client_targets("c0-0-000")
    assert complete is not None and complete.weights is None and len(complete.clients) == len(every)


def test_a_ring_sample_weighs_each_client_by_the_ring_it_stands_for():
    """Union values of a sampled client model are ring-weighted sums of what it was scored on, by hand."""
    tree = big_tree(1, 2, 3)  # c0-0-000: siblings c0-0-001/002 (ring 1, 2), cousins c0-1-* (ring 2, 3)
    plan = EvalPlan(tree, seed=0, clients=None, per_ring=1)
    t = plan.client_targets("c0-0-000")
    assert t is not None and t.weights is not None and len(t.clients) == 3
    every = client_order(tree)
    right = {c: i + 1 for i, c in enumerate(every)}  # client i: i+1 right of 10 (class 0 rows)
    blocks = torch.stack(
        [torch.tensor([[right[every[i]], 10 - right[every[i]]], [0, 0]]) for i in t.clients] + [torch.eye(2) * 5]
    )
    values = MatrixBuilder(tree, CLS).values(Scored(ModelRef.of_node("c0-0-000"), t.clients, t.weights, blocks))
    w = dict(zip((every[i] for i in t.clients), t.weights.tolist()))
    own, sibling, cousin = (c for c in (every[i] for i in t.clients))
    edge = (right[own] * w[own] + right[sibling] * w[sibling]) / (10 * (w[own] + w[sibling]))
    assert w[sibling] == 2.0 and w[cousin] == 3.0
    assert values.on_sets["subtree:e0-0"][0] == pytest.approx(edge)
    union = sum(right[c] * w[c] for c in w) / (10 * sum(w.values()))
    assert values.on_sets["subtree:g0"][0] == pytest.approx(union) and values.on_sets["union"][0] == pytest.approx(
        union
    )
    assert "subtree:e0-1" not in values.on_sets  # a sampled client model: its ancestors' sets only
    assert values.on_sets[PROXY][0] == 1.0


def accuracies(tree: Tree) -> dict[str, float]:
    rng = np.random.default_rng(7)
    return {c: float(rng.integers(0, 21)) / 20 for c in client_order(tree)}


def server_values(tree: Tree, plan: EvalPlan, acc: dict[str, float]) -> Evaluation:
    """The root scored on the plan's population, each client with 20 test rows of the accuracy ``acc``."""
    t = plan.server_targets()
    every = client_order(tree)
    blocks = [torch.tensor([[round(20 * acc[every[i]]), 20 - round(20 * acc[every[i]])], [0, 0]]) for i in t.clients]
    scored = Scored(ModelRef.of_node("root"), t.clients, t.weights, torch.stack([*blocks, torch.eye(2)]))
    builder = MatrixBuilder(tree, CLS, plan.population)
    return Evaluation(tree, CLS, [builder.values(scored)], plan.population)


def test_a_sampled_population_gives_intervals_that_hold_the_full_value():
    tree = big_tree(2, 2, 50)  # 200 clients
    acc = accuracies(tree)
    full = server_values(tree, EvalPlan(tree, 11, None, 16), acc)
    plan = EvalPlan(tree, 11, 60, 16)
    assert len(plan.population) == 60 and plan.population == sorted(plan.population, key=client_order(tree).index)
    assert plan.population == EvalPlan(tree, 11, 60, 16).population  # seeded: every evaluation the same clients
    sample = server_values(tree, plan, acc)
    assert sample.sampled and not full.sampled
    exact = {(r.model, r.population): r.dist for r in full.distribution_rows() if r.metric == "accuracy"}
    est = {(r.model, r.population): r.dist for r in sample.distribution_rows() if r.metric == "accuracy"}
    truth, d = exact[("root", "all")], est[("root", "all")]
    assert (truth.n, truth.of, truth.mean_low, truth.mean_high) == (200, 200, truth.mean, truth.mean)
    assert (d.n, d.of) == (60, 200) and d.mean_low < truth.mean < d.mean_high
    half = d.mean_high - d.mean
    sd = float(np.std([acc[c] for c in plan.population], ddof=1))
    assert half == pytest.approx(2.0010 * sd / math.sqrt(60) * math.sqrt(140 / 200), rel=1e-3)  # t(59), fpc
    # the headline over clients carries the interval too; an exact run's has none
    h = sample.headline()
    assert h["root_on_own_clients/accuracy_mean_low"] < truth.mean < h["root_on_own_clients/accuracy_mean_high"]
    assert "root_on_own_clients/accuracy_mean_low" not in full.headline()
    node = sample.node_metrics("root")
    assert node["dist/all/accuracy_mean_low"] == d.mean_low and not any(k.startswith("eval/c") for k in node)


def test_an_interval_over_seeds_covers_the_full_mean_about_95_times_in_100():
    values = np.random.default_rng(1).beta(2, 5, size=500)
    truth = float(values.mean())
    covered = 0
    for seed in range(200):
        pick = np.random.default_rng(seed).choice(500, 40, replace=False)
        d = distribution(values[pick].tolist(), True, of=500)
        covered += d.mean_low <= truth <= d.mean_high
    assert 180 <= covered <= 200  # 95% nominal: 190 expected, binomial sd ~3


def test_the_finite_population_correction_keeps_95_percent_when_the_sample_is_most_of_the_clients():
    """150 of 200 clients: without the correction sqrt((200 - 150) / 200) = 0.5 the interval would be twice as wide
    and hold the full mean nearly always; with it, ~95% of the time."""
    values = np.random.default_rng(2).beta(2, 5, size=200)
    truth = float(values.mean())
    covered = uncorrected = 0
    for seed in range(400):
        pick = np.random.default_rng(seed).choice(200, 150, replace=False)
        d = distribution(values[pick].tolist(), True, of=200)
        covered += d.mean_low <= truth <= d.mean_high
        uncorrected += abs(d.mean - truth) <= 2 * (d.mean_high - d.mean)
    assert 367 <= covered <= 393  # 380 expected, binomial sd 4.4
    assert uncorrected >= 398  # what the test tells apart: the uncorrected interval covers ~99.99%


def test_a_sampled_interval_near_a_bound_is_clipped_to_what_the_metric_can_take():
    """Three of 100 clients sampled, accuracies 0, 0, 0.3: the t-interval runs below 0, which no accuracy can."""
    values = [0.0, 0.0, 0.3]
    half = 4.3027 * float(np.std(values, ddof=1)) / math.sqrt(3) * math.sqrt(97 / 100)  # t(2) 97.5%, fpc
    free = distribution(values, True, of=100)
    assert (free.mean_low, free.mean_high) == pytest.approx((0.1 - half, 0.1 + half), rel=1e-4) and free.mean_low < 0
    clipped = distribution(values, True, of=100, bounds=CLS.bounds["accuracy"])
    assert (clipped.mean_low, clipped.mean_high) == (0.0, free.mean_high) and clipped.mean == free.mean
    # a run's evaluation clips with its task's bounds: the root right on 2 of the 60 sampled clients only
    tree = big_tree(2, 2, 50)
    plan = EvalPlan(tree, 11, 60, 16)
    acc = {c: float(c in plan.population[:2]) for c in client_order(tree)}
    root = {(r.population, r.metric): r.dist for r in server_values(tree, plan, acc).distribution_rows()}
    d = root[("all", "accuracy")]
    assert d.mean == pytest.approx(2 / 60) and distribution([acc[c] for c in plan.population], True, 200).mean_low < 0
    assert d.mean_low == 0.0 < d.mean < d.mean_high


def test_evaluation_of_persistent_clients_grows_with_clients_not_clients_squared():
    """2,000 client models on a 2,000-client tree: each scored on 1 + 3 x 8 splits, the matrix, pairs and what
    a worker returns per model bounded by that, not by the 2,000 clients."""
    tree = big_tree(2, 4, 250)
    every = client_order(tree)
    plan = EvalPlan(tree, seed=0, clients=None, per_ring=8)
    builder = MatrixBuilder(tree, CLS)
    ev = Evaluation(tree, CLS)
    sizes = []
    for c in every:
        t = plan.client_targets(c)
        assert t is not None
        blocks = torch.zeros(len(t.clients) + 1, 10, 10, dtype=torch.int64)
        blocks[:, 0, 0] = 3
        values = builder.values(Scored(ModelRef.of_node(c), t.clients, t.weights, blocks))
        wire = len(pickle.dumps(values))
        assert wire <= 2 * (len(t.clients) + 4) * 16 + 1500  # two float64 metrics a split scored, and a header
        sizes.append(len(t.clients))
        ev.add(values)
    assert set(sizes) == {1 + 3 * 8}
    rows = sum(1 for _ in ev.rows())
    assert rows == len(every) * (1 + 3 * 8 + 3 + 1) * 2  # own + rings, 2 ancestors' subtrees + union, proxy
    p = analyse(ev)
    assert len(p.pairs) == len(every) * (1 + 3 * 8)
    assert p.curve[0].distance == 0 and p.curve[0].mean == pytest.approx(1.0)
