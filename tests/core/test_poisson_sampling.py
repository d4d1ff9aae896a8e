"""Poisson sampling: cohorts with ``sampling: poisson`` (each child with chance ``cohort`` a round) and DP-SGD's
batches (each row with chance ``batch_size / rows`` a step): the draws, what an empty one does, what is refused."""

import math

import pytest
import torch

from bhfl_core.algorithm.aggregation_rule import fold_results
from bhfl_core.algorithm.node_state import NodeState, RoundKey
from bhfl_core.algorithm.node_step import node_up
from bhfl_core.algorithm.privacy import noise
from bhfl_core.algorithm.privacy_params import DpSgdParams, PrivacyParams
from bhfl_core.algorithm.rule_registry import AggregateParams
from bhfl_core.algorithm.rules import rule_for
from bhfl_core.algorithm.tree import NodeSettings
from bhfl_core.config.base import ConfigError
from bhfl_core.rng import sample_cohort
from tests.core.test_dp_sgd import Line
from tests.core.test_privacy_accounting import _tree


def test_a_poisson_cohort_takes_each_child_independently_with_its_chance():
    children = [f"c{i:04d}" for i in range(10_000)]
    sizes = [len(sample_cohort(children, None, 7, "edge", r, rate=0.05)) for r in range(20)]
    # Binomial(10000, 0.05): mean 500, sd 21.8; every round within 5 sd, and rounds differ
    assert all(abs(s - 500) < 5 * 21.8 for s in sizes) and len(set(sizes)) > 1
    first = sample_cohort(children, None, 7, "edge", 0, rate=0.05)
    assert first == sample_cohort(children, None, 7, "edge", 0, rate=0.05)  # seeded by (seed, node, round)
    assert first == sorted(first)  # in the children's order: sums do not depend on the draw
    hits = sum(sample_cohort(["a", "b"], None, 7, "edge", r, rate=0.5) == [] for r in range(400))
    assert 60 < hits < 140  # empty a quarter of the time (sd 8.7)


def test_sampling_poisson_resolves_to_a_rate_and_the_dp_mean_divides_by_its_expectation():
    tree = _tree(
        "tree.edge.sampling=poisson", "tree.edge.cohort=0.25", "tree.edge.privacy={clip: 1, noise_multiplier: 1}"
    )
    settings = tree["edge-en"].settings
    assert (settings.cohort, settings.poisson_rate) == (None, 0.25)
    p = settings.aggregate.privacy
    assert (p.expected, p.population, p.poisson) == (5.0, 20, True)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["tree.edge.sampling=poisson", "tree.edge.cohort=4"],
            r"tree\.edge\.cohort: with tree\.edge\.sampling: poisson",
        ),
        (
            ["tree.edge.sampling=poisson", "tree.edge.cohort=null"],
            r"tree\.edge\.cohort: with tree\.edge\.sampling: poisson .* got None",
        ),
        (
            ["tree.root={mode: async, sampling: poisson, cohort: 0.5}"],
            r"tree\.root\.sampling: 'root' runs asynchronously",
        ),
        (
            ["tree.edge.sampling=poisson", "tree.edge.cohort=0.5", "tree.edge.secure_aggregation={threshold: 2}"],
            r"tree\.edge\.secure_aggregation: secure aggregation needs each round's cohort known",
        ),
    ],
)
def test_poisson_settings_that_cannot_work_are_refused_naming_the_key(overrides: list[str], message: str):
    with pytest.raises(ConfigError, match=message):
        _tree(*overrides)


def test_a_dp_round_that_drew_nobody_still_publishes_its_noise():
    """Under Poisson sampling an empty cohort is more likely without a given child: publishing the model unchanged
    would tell. theta + N(0, (zC)^2) / (q n), as for any other round."""
    p = PrivacyParams(clip=1.0, noise_multiplier=0.7, expected=2.5, population=10, noise_seed=3, poisson=True)
    settings = NodeSettings(aggregate=AggregateParams(wrappers=(p,)))
    theta = torch.tensor([1.0, -2.0, 0.5])
    key = RoundKey("edge", 4)
    folded = fold_results(rule_for(settings.aggregate), key, [], ["c0", "c1"], theta)
    after, _, metrics = node_up(NodeState(model=theta.clone()), folded, {}, settings, key)
    expected = (theta.double() + noise(p, key, 3, 0.7 * 1.0, "update") / 2.5).float()
    assert torch.equal(after.theta, expected) and metrics["privacy/epsilon"] > 0
    plain = NodeSettings()  # without DP an empty round leaves the model as it was
    same, _, _ = node_up(
        NodeState(model=theta.clone()), fold_results(rule_for(plain.aggregate), key, [], [], theta), {}, plain, key
    )
    assert torch.equal(same.theta, theta)


def test_dp_sgd_batches_are_poisson_draws_of_the_rows():
    from bhfl_core.learning.local_train import _poisson_batches

    data = {"x": torch.arange(400.0)}
    gen = torch.Generator().manual_seed(5)
    batches = [b for _ in range(10) for b in _poisson_batches(data, 400, 32, gen)]
    assert len(batches) == 10 * math.ceil(400 / 32)  # as many steps as a shuffled epoch
    sizes = torch.tensor([0 if b is None else len(b["x"]) for b in batches], dtype=torch.float64)
    # Binomial(400, 0.08): mean 32, sd 5.43; the mean of 130 batches within 4 standard errors
    assert abs(float(sizes.mean()) - 32) < 4 * 5.43 / math.sqrt(len(sizes)) and float(sizes.std()) > 3
    gen = torch.Generator().manual_seed(5)
    again = [b for _ in range(10) for b in _poisson_batches(data, 400, 32, gen)]
    assert all(torch.equal(a["x"], b["x"]) for a, b in zip(batches, again) if a is not None)


def test_an_empty_dp_sgd_batch_is_a_step_of_noise_alone():
    """No row drawn: Opacus's noise std z*C over the expected batch size is the whole gradient (SGD, lr 0.1)."""
    from bhfl_core.learning.dp_sgd import noise_only_step, private_training

    model = Line(1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    params = DpSgdParams(noise_multiplier=2.0, max_grad_norm=0.5)
    with private_training(model, optimizer, params, batch_size=4, seed=11) as (_, private):
        noise_only_step(private)
    drawn = torch.normal(0.0, 2.0 * 0.5, size=(1, 1), generator=torch.Generator().manual_seed(11))
    assert model.lin.weight.item() == pytest.approx(1.0 - 0.1 * float(drawn) / 4, rel=1e-6)
    quiet = Line(1.0)
    with private_training(quiet, torch.optim.SGD(quiet.parameters(), lr=0.1), DpSgdParams(0.0, 0.5), 4, 11) as (
        _,
        private,
    ):
        noise_only_step(private)
    assert quiet.lin.weight.item() == 1.0


def test_a_clients_epsilon_counts_only_the_rows_it_trains_on():
    from bhfl_core.algorithm.privacy_accounting import sample_epsilon
    from bhfl_core.algorithm.round_tail import client_epsilon
    from bhfl_core.algorithm.tree import Node, Role, TrainParams

    dp = DpSgdParams(noise_multiplier=1.0, max_grad_norm=1.0)
    settings = NodeSettings(train=TrainParams(batch_size=10, dp_sgd=dp), holdout=0.2)
    client = Node("en-00", Role.CLIENT, 2, "edge-en", (), settings, 100.0)
    assert client_epsilon(client, 30) == sample_epsilon(dp, 80, 10, 30) > sample_epsilon(dp, 100, 10, 30)
