"""Distributed DP (bhfl_core/algorithm/discrete_gaussian.py; privacy.distributed): each child adds discrete Gaussian
noise to its quantised clipped update under secure aggregation, so no server sees an un-noised sum."""

import math

import numpy as np
import pytest
import torch

from bhfl_core.algorithm.discrete_gaussian import epsilon as zcdp_epsilon
from bhfl_core.algorithm.discrete_gaussian import round_rho, sample, tau
from bhfl_core.algorithm.privacy_accounting import distributed_epsilon, server_epsilon
from bhfl_core.algorithm.privacy_params import PrivacyParams, SecAggParams
from bhfl_core.config.base import ConfigError
from bhfl_core.rng import derive_seed
from tests.core.test_secure_aggregation import KEY, MODELS, PEERS, REFERENCE, fold
from tests.small import embedded_tree


def test_the_sampler_draws_the_discrete_gaussian():
    """P(x) proportional to exp(-x^2 / (2 sigma^2)) on the integers: counts against that pmf, and the moments."""
    rng = np.random.default_rng(0)
    draws = sample(1.3, 200_000, rng)
    support = np.arange(-8, 9)
    pmf = np.exp(-(support**2) / (2 * 1.3**2))
    pmf /= pmf.sum()
    counts = np.array([(draws == x).sum() for x in support])
    assert np.all(np.abs(counts - 200_000 * pmf) < 5 * np.sqrt(200_000 * pmf) + 1)  # each within 5 sd
    big = sample(1e6, 100_000, rng)
    assert abs(big.mean()) < 5 * 1e6 / math.sqrt(1e5) and abs(big.std() / 1e6 - 1) < 0.02
    assert big.dtype == np.int64


def test_the_accounting_is_rho_two_over_z_squared_with_tau_zero():
    """rho = Delta^2 / (2 t sigma_c^2) with Delta = 2 C 2^f and sigma_c = z C 2^f / sqrt(t): 2 / z^2, any d."""
    z, clip, scale, t = 1.5, 0.5, 2.0**24, 3
    sigma = z * clip * scale / math.sqrt(t)
    assert tau(sigma, t) == 0.0 and tau(1.0, 3) > 1e-9  # it only vanishes for a large enough std
    assert round_rho(2 * clip * scale, sigma, t) == pytest.approx(2 / z**2, rel=1e-12)
    eps = distributed_epsilon(z, 20, 1e-5)
    rho = 20 * 2 / z**2
    assert eps == zcdp_epsilon(rho, 1, 1e-5) <= rho + 2 * math.sqrt(rho * math.log(1e5))  # Bun & Steinke's bound
    central = server_epsilon(z, 20, 5, 5, False, 1e-5, "pld")  # the same z as a central, unsampled Gaussian
    assert central < eps < 1.3 * central  # the zCDP conversion is a little looser
    with pytest.raises(ValueError, match="below 10"):
        round_rho(2.0, 5.0, 3)


def _distributed(threshold: int = 3) -> tuple[PrivacyParams, SecAggParams]:
    privacy = PrivacyParams(0.5, 1.0, expected=5, population=5, noise_seed=3, distributed=True)
    sigma = 1.0 * 0.5 * 2.0**24 / math.sqrt(threshold)
    secagg = SecAggParams(threshold, 11, client_noise=sigma, client_norm=0.5 * 2.0**24)
    return privacy, secagg


def test_each_child_adds_its_own_noise_and_the_server_only_removes_masks():
    """The unmasked sum is exactly: each child's clipped update in fixed point, plus its own seeded noise."""
    privacy, secagg = _distributed()
    rule, partial = fold([["c1", "c3"], ["c0", "c2", "c4"]], params=secagg, privacy=privacy)
    masked = partial.inner
    expected = torch.zeros(REFERENCE.numel(), dtype=torch.int64)
    for m in PEERS:  # by hand: clip to 0.5 (with the 2^-22 shrink), round, add N_Z(0, sigma_c^2) from the seed
        delta = MODELS[m].double() - REFERENCE.double()
        clipped = (delta * (0.5 / float(delta.norm()) * (1 - 2.0**-22))).float().double()
        q = torch.round(clipped * 2.0**24).to(torch.int64)
        rng = np.random.default_rng(derive_seed(11, "dp-noise", KEY.as_caller().key, m))
        expected += q + torch.from_numpy(sample(secagg.client_noise, q.numel(), rng))
    assert torch.equal(masked.unmasked(), expected) and masked.counters == ()  # no count reaches the server
    out = rule.finalize(partial, KEY)
    assert torch.allclose(out.input.double(), REFERENCE.double() + expected.double() / 2.0**24 / 5, atol=1e-6)
    assert "privacy/clipped_fraction" not in out.metrics and out.metrics["privacy/epsilon"] == pytest.approx(
        distributed_epsilon(1.0, KEY.round + 1, 1e-5)
    )


def test_a_config_resolves_each_childs_noise_from_z_the_clip_and_the_threshold():
    tree = embedded_tree(
        "tree.edge.aggregate={wrap: [{dp: {clip: 0.5, noise_multiplier: 1.2, distributed: true}}, secagg]}"
    )
    aggregate = tree["edge-en"].settings.aggregate
    assert aggregate.privacy.distributed and aggregate.secagg.threshold == 3
    assert aggregate.secagg.client_noise == pytest.approx(1.2 * 0.5 * 2**24 / math.sqrt(3))
    assert aggregate.secagg.client_norm == 0.5 * 2**24
    target = embedded_tree(
        "tree.edge.aggregate={wrap: [{dp: {clip: 0.5, target_epsilon: 8, distributed: true}}, secagg]}"
    )["edge-en"].settings.aggregate.privacy
    planned = target.budget.planned_rounds
    assert (
        distributed_epsilon(target.noise_multiplier, planned, 1e-5)
        <= 8
        < distributed_epsilon(target.noise_multiplier * 0.998, planned, 1e-5)
    )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("tree.edge.privacy={clip: 0.5, noise_multiplier: 1, distributed: true}", r"\.distributed: distributed DP"),
        (
            "tree.edge.aggregate={wrap: [{dp: {clip: 0.5, noise_multiplier: 1, distributed: true}}, "
            "{secagg: {fraction_bits: 2, bits: 20}}]}",
            r"std 1\.15 in fixed-point units .* raise secure_aggregation\.fraction_bits",
        ),
        (
            "tree.edge.aggregate={wrap: [{dp: {clip: 1000, noise_multiplier: 1, distributed: true}}, "
            "{secagg: {fraction_bits: 30, bits: 40}}]}",
            r"more than secure_aggregation\.bits \(40\)",
        ),
    ],
)
def test_distributed_dp_that_cannot_work_is_refused_naming_the_key(override: str, message: str):
    with pytest.raises(ConfigError, match=message):
        embedded_tree(override)


def test_rounding_cannot_lift_a_childs_integer_vector_past_its_bound():
    """Rounding to the fixed point can add up to sqrt(d)/2 to the norm; the child truncates back to C 2^f, so the
    sensitivity the accountant uses (2 C 2^f) holds for any model size (here 2^4 units, 400 values)."""
    from bhfl_core.algorithm.node_state import Caller
    from bhfl_core.algorithm.secure_aggregation import MaskedSum

    params = SecAggParams(2, 5, bits=48, fraction_bits=4, client_noise=0.0, client_norm=16.0)
    masked = MaskedSum(params, Caller("edge-en", 0), ("c0", "c1"))
    x = torch.full((400,), 1 / 20, dtype=torch.float64) * (1 - 2.0**-22)  # clipped to C = 1 (norm just under)
    q = torch.round(x * 16).to(torch.int64)  # every value 0.8 rounds up to 1: norm 20 > C 2^4 = 16
    assert float(q.double().norm()) > 16
    out = masked.noised(q, "c0")
    by_hand = torch.trunc(q.double() * (16 / float(q.double().norm()))).long()  # towards zero: 0.8 -> 0
    assert float(out.double().norm()) <= 16 and torch.equal(out, by_hand)
