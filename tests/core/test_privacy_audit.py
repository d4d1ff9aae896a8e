"""The empirical privacy audit (bhfl_core/algorithm/canaries.py): canaries inserted at a DP server, the epsilon
their traces imply, against the analytic Gaussian and against the server's analytical epsilon."""

import pytest
import torch
from dp_accounting.gaussian_mechanism import get_epsilon_gaussian

from bhfl_core.algorithm.aggregation_rule import fold_results
from bhfl_core.algorithm.canaries import (
    CanaryParams,
    direction,
    empirical_epsilon,
    gaussians_epsilon,
    inserted,
    statistics,
)
from bhfl_core.algorithm.node_state import RoundKey
from bhfl_core.algorithm.privacy_accounting import epsilon
from bhfl_core.algorithm.privacy_params import PrivacyParams
from bhfl_core.algorithm.rule_registry import AggregateParams
from bhfl_core.algorithm.rules import rule_for


@pytest.mark.parametrize("mu", [0.5, 1.0, 3.0])
def test_two_gaussians_of_equal_spread_are_the_gaussian_mechanism(mu: float):
    """N(mu, 1) against N(0, 1) is the Gaussian mechanism of sensitivity mu and std 1: Balle & Wang's epsilon."""
    assert gaussians_epsilon(mu, 1.0, 0.0, 1.0, 1e-5) == pytest.approx(get_epsilon_gaussian(1 / mu, 1e-5), rel=1e-4)
    assert gaussians_epsilon(0.0, 2.0, 0.0, 2.0, 1e-5) == 0.0


def _audited(z: float, rounds: int, count: int = 40, numel: int = 3000) -> tuple[PrivacyParams, dict[str, float]]:
    """``rounds`` rounds of a DP server with no real child (its noise and its canaries only): the final rule state."""
    canaries = CanaryParams(count, seed=9)
    p = PrivacyParams(1.0, z, expected=5, population=20, noise_seed=4, canaries=canaries)
    rule = rule_for(AggregateParams(wrappers=(p,)))
    state: dict[str, float] = {}
    reference = torch.zeros(numel)
    for r in range(rounds):
        key = RoundKey("edge-en", r)
        state = dict(rule.finalize(fold_results(rule, key, [], ["c"], reference).partial, key, state).state)
    return p, state


def test_canaries_are_unit_directions_drawn_by_where_they_are_and_join_with_a_real_childs_chance():
    canaries = CanaryParams(200, seed=1)
    u = direction(canaries, 3, 1000)
    assert torch.linalg.vector_norm(u).item() == pytest.approx(1.0) and torch.equal(u, direction(canaries, 3, 1000))
    assert not torch.equal(u, direction(canaries, 4, 1000))
    joined = [len(inserted(canaries, RoundKey("edge", r), 0.25)) for r in range(40)]
    assert abs(sum(joined) / 40 - 50) < 5 * (200 * 0.25 * 0.75 / 40) ** 0.5  # Binomial(200, 1/4) a round


def test_without_noise_the_inserted_canaries_stand_out():
    _, state = _audited(z=0.0, rounds=10)
    inserted_stats, held_out = statistics(state, 40)
    spread = torch.tensor(held_out).std().item()  # each canary joins ~2.5 of the 10 rounds (0 for ~2 of them)
    assert sum(inserted_stats) / 40 > 5 * spread and abs(sum(held_out) / 40) < spread
    assert empirical_epsilon(inserted_stats, held_out, 1e-5) > 20


def test_with_noise_the_estimate_stays_below_the_analytical_epsilon():
    p, state = _audited(z=2.0, rounds=10)
    estimate = empirical_epsilon(*statistics(state, 40), 1e-5)
    assert estimate < epsilon(p, 10)  # the bound holds with room (3.2 against 9.7 here)
    _, loud = _audited(z=0.3, rounds=10)
    assert empirical_epsilon(*statistics(loud, 40), 1e-5) > estimate  # less noise, more visible
