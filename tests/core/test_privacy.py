"""Client-level DP at a server (bhfl_core/algorithm/privacy.py): clipping, noise, adaptive clipping, accounting.

Expected values are computed here by hand from the definitions (DP-FedAvg, McMahan et
al. 2018; adaptive clipping, Andrew et al. 2021), with the noise drawn from the seeded
generator the rule must use.
"""

import math

import pytest
import torch

from bhfl_core.algorithm.aggregation_rule import fold_results
from bhfl_core.algorithm.contract import ChildResult
from bhfl_core.algorithm.node_state import Caller, NodeState, RoundKey
from bhfl_core.algorithm.node_step import node_up
from bhfl_core.algorithm.privacy import SHRINK, clip_update, next_clip, privacy_metrics
from bhfl_core.algorithm.privacy_accounting import epsilon
from bhfl_core.algorithm.privacy_params import AdaptiveClip, PrivacyParams
from bhfl_core.algorithm.rule_registry import AggregateParams
from bhfl_core.algorithm.rules import rule_for
from bhfl_core.algorithm.tree import NodeSettings
from bhfl_core.rng import derive_seed
from tests.small import embedded_tree

KEY = RoundKey("edge-en", 3, Caller("root", 1))
REFERENCE = torch.tensor([1.0, -2.0, 0.5, 0.0])
MODELS = {  # updates (model - reference): norms 5, 0.5, 13, 1.5
    "c0": REFERENCE + torch.tensor([3.0, 4.0, 0.0, 0.0]),
    "c1": REFERENCE + torch.tensor([0.0, 0.3, 0.4, 0.0]),
    "c2": REFERENCE + torch.tensor([0.0, 0.0, 5.0, -12.0]),
    "c3": REFERENCE + torch.tensor([1.5, 0.0, 0.0, 0.0]),
}


def params(z: float = 0.5, clip: float = 1.0, expected: int = 4, adaptive: AdaptiveClip | None = None):
    return PrivacyParams(
        clip=clip, noise_multiplier=z, expected=expected, population=6, noise_seed=77, adaptive=adaptive
    )


def by_hand_clipped(update: torch.Tensor, clip: float) -> torch.Tensor:
    norm = math.sqrt(sum(v * v for v in update.tolist()))
    scale = 1.0 if norm <= clip else clip / norm * SHRINK
    return torch.tensor([v * scale for v in update.tolist()], dtype=torch.float64).to(torch.float32)


def fold(p: PrivacyParams, layout: list[list[str]], clip: float | None = None):
    """The models folded in worker batches (``layout``), each batch sent up as a partial, then merged in order."""
    rule = rule_for(AggregateParams(wrappers=(p,)))
    plan = rule.plan({} if clip is None else {"dp/clip": clip}, ())  # the round's clip: the rule's state
    results = []
    for batch in layout:
        partial = rule.start(KEY.as_caller(), plan, REFERENCE)
        for member in batch:
            rule.contribute(partial, member, MODELS[member], 1.0)
        tensors, numbers = rule.wire(partial)  # what crosses the process boundary
        results.append(ChildResult(members=tuple(batch), partial=rule.unwire(tensors, numbers)))
    return rule, fold_results(rule, KEY, results, [*MODELS, "edge-en"], REFERENCE, plan)


def test_an_update_is_clipped_to_the_norm_and_one_within_it_is_kept():
    clipped, norm = clip_update(MODELS["c0"], REFERENCE, 1.0)
    assert norm == 5.0
    assert torch.equal(clipped, by_hand_clipped(MODELS["c0"] - REFERENCE, 1.0))
    assert torch.allclose(clipped, torch.tensor([0.6, 0.8, 0.0, 0.0]))
    assert float(torch.linalg.vector_norm(clipped.double())) <= 1.0  # rounding to float32 stays inside
    kept, norm = clip_update(MODELS["c1"], REFERENCE, 1.0)
    assert math.isclose(norm, 0.5, rel_tol=1e-6) and torch.equal(kept, MODELS["c1"] - REFERENCE)


def test_the_noised_mean_is_the_reference_plus_clipped_updates_and_seeded_noise_over_the_expected_count():
    p = params(z=0.5, clip=1.0, expected=5)  # one of the five expected children dropped out
    rule, folded = fold(p, [["c0", "c1"], ["c2", "c3"]])
    got = rule.finalize(folded.partial, KEY).input

    summed = sum(by_hand_clipped(m - REFERENCE, 1.0).double() for m in MODELS.values())
    gen = torch.Generator().manual_seed(derive_seed(77, "update", *KEY.parts()))
    noise = torch.randn(4, generator=gen, dtype=torch.float64) * (0.5 * 1.0)
    expected = (REFERENCE.double() + (summed + noise) / 5).to(torch.float32)
    assert torch.equal(got, expected)
    assert not torch.equal(got, (REFERENCE.double() + summed / 5).to(torch.float32))  # the noise is there
    metrics = privacy_metrics(p, folded.partial, 4)
    assert metrics["privacy/clipped_fraction"] == 0.75  # c0, c2 and c3
    assert metrics["privacy/noise_std"] == 0.5 * 1.0 / 5
    assert metrics["privacy/clip"] == 1.0


def test_the_same_round_gives_the_same_bits_however_children_were_batched_and_a_new_round_other_noise():
    p = params()
    layouts = [[["c0", "c1", "c2", "c3"]], [["c3"], ["c1", "c0"], ["c2"]], [["c2", "c1"], ["c3", "c0"]]]
    outs = []
    for layout in layouts:
        rule, folded = fold(p, layout)
        outs.append(rule.finalize(folded.partial, KEY).input)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    rule, folded = fold(p, layouts[0])
    later = RoundKey(KEY.node_id, KEY.round + 1, KEY.caller)
    assert not torch.equal(rule.finalize(folded.partial, later).input, outs[0])


def test_no_noise_and_a_large_clip_is_the_plain_unweighted_mean():
    rule, folded = fold(params(z=0.0, clip=100.0, expected=4), [["c0", "c1", "c2", "c3"]])
    plain = (sum(m.double() for m in MODELS.values()) / 4).to(torch.float32)
    assert torch.allclose(rule.finalize(folded.partial, KEY).input, plain, atol=1e-6)


def test_adaptive_clipping_moves_the_norm_by_the_noised_unclipped_share():
    adaptive = AdaptiveClip(quantile=0.5, lr=0.2, count_noise=1.5)
    p = params(z=0.5, clip=1.0, expected=4, adaptive=adaptive)
    _, folded = fold(p, [["c0", "c1", "c2", "c3"]], clip=2.0)  # the round's clip from the state: 2
    gen = torch.Generator().manual_seed(derive_seed(77, "count", *KEY.parts()))
    count_noise = float(torch.randn(1, generator=gen, dtype=torch.float64)[0]) * 1.5
    unclipped = 2  # c1 (0.5) and c3 (1.5) are within 2; c0 (5) and c2 (13) are not
    assert next_clip(p, folded.partial, KEY) == 2.0 * math.exp(-0.2 * ((unclipped + count_noise) / 4 - 0.5))
    # the update's noise multiplier leaves room for the count's (Andrew et al., Theorem 1)
    assert math.isclose(p.update_noise_multiplier, (0.5**-2 - 3.0**-2) ** -0.5)
    with pytest.raises(ValueError, match=r"count_noise 0\.2 leaves no budget"):
        _ = params(z=0.5, adaptive=AdaptiveClip(count_noise=0.2)).update_noise_multiplier


def test_adding_or_removing_one_child_moves_the_released_count_by_a_half_as_theorem_1_assumes():
    """Andrew et al.'s split ``z_delta = (z^-2 - (2 sigma_b)^-2)^-1/2`` holds when one child moves the count by 1/2
    (add/remove, Poisson cohorts): the count is released centred. The raw count moved by 1 for an unclipped child
    and 0 for a clipped one, so both releases together cost ``(z^-2 + 3/(4 sigma_b^2))^-1/2``, not ``z``."""
    adaptive = AdaptiveClip(quantile=0.5, lr=0.2, count_noise=1.5)
    p = params(z=0.5, clip=1.0, expected=4, adaptive=adaptive)

    def released(members: list[str]) -> float:  # the share times m, back from the next clip (same noise draw)
        _, folded = fold(p, [members], clip=2.0)  # within 2: c1 (0.5), c3 (1.5); clipped: c0 (5), c2 (13)
        return (0.5 - math.log(next_clip(p, folded.partial, KEY) / 2.0) / 0.2) * 4

    base = released(["c0", "c1"])
    assert math.isclose(released(["c0", "c1", "c3"]) - base, 0.5)  # one unclipped child more
    assert math.isclose(released(["c0", "c1", "c2"]) - base, -0.5)  # one clipped child more


def test_node_up_steps_to_the_noised_mean_and_keeps_the_adaptive_clip_in_the_state():
    adaptive = AdaptiveClip(quantile=0.5, lr=0.2, count_noise=1.5)
    p = params(z=0.5, clip=1.0, adaptive=adaptive)
    settings = NodeSettings(aggregate=AggregateParams(wrappers=(p,)))
    rule, folded = fold(p, [["c0", "c1", "c2", "c3"]])
    state, posts, _ = node_up(NodeState(model=REFERENCE.clone()), folded, {}, settings, KEY)
    assert torch.equal(state.theta, rule.finalize(folded.partial, KEY).input) and not posts  # fedavg, eta 1: adopt it
    moved = next_clip(p, folded.partial, KEY)
    assert state.rule_state == {"dp/clip": moved} and moved != 1.0


def test_epsilon_is_the_replace_one_gaussian_mechanism_composed_over_rounds():
    """Without sampling, T rounds of noise z*C on a sum whose replace-one sensitivity is 2C: within the zCDP bound.

    rho = T / (2 (z/2)^2); epsilon <= rho + 2 sqrt(rho log(1/delta)) (Bun & Steinke 2016), and an RDP accountant's
    conversion is a little tighter. With z instead of z/2 (sensitivity C) it would be about 4x smaller.
    """
    z, rounds, delta = 2.0, 10, 1e-5
    full = PrivacyParams(1.0, z, expected=6, population=6, noise_seed=0, delta=delta, accountant="rdp")
    rho = rounds / (2 * (z / 2) ** 2)
    bound = rho + 2 * math.sqrt(rho * math.log(1 / delta))
    assert 0.8 * bound < epsilon(full, rounds) <= bound
    sampled = PrivacyParams(1.0, z, expected=2, population=6, noise_seed=0, delta=delta, accountant="rdp")
    assert epsilon(sampled, rounds) < epsilon(full, rounds)  # amplification by sampling 2 of 6
    assert epsilon(sampled, rounds) < epsilon(sampled, rounds + 5)
    assert epsilon(sampled, 0) == 0.0
    assert epsilon(PrivacyParams(1.0, 0.0, 2, 6, 0), 1) == math.inf


def test_epsilon_matches_the_librarys_accountant_for_the_sampling_we_do():
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    accountant = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    event = dp_accounting.SampledWithoutReplacementDpEvent(30, 6, dp_accounting.GaussianDpEvent(1.5 / 2))
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, 20))
    p = PrivacyParams(0.5, 1.5, expected=6, population=30, noise_seed=0, delta=1e-6, accountant="rdp")
    assert epsilon(p, 20) == accountant.get_epsilon(1e-6)


def test_privacy_at_a_level_resolves_per_node_with_its_cohort_and_its_own_noise_seed():
    tree = embedded_tree(
        "tree.edge.privacy={clip: 0.5, noise_multiplier: 1.2, adaptive: {quantile: 0.7, count_noise: 2}}"
    )
    en, de = (tree[e].settings.aggregate.privacy for e in ("edge-en", "edge-de"))
    assert en is not None and de is not None
    assert (en.clip, en.noise_multiplier, en.population) == (0.5, 1.2, 6)
    assert en.expected == tree["edge-en"].settings.cohort  # the fixed denominator is the cohort size
    assert en.adaptive == AdaptiveClip(quantile=0.7, lr=0.2, count_noise=2.0)
    assert en.noise_seed != de.noise_seed  # each server draws its own noise
    assert tree.root.settings.aggregate.privacy is None


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["tree.client.privacy={clip: 1, noise_multiplier: 1}"], "tree.client.privacy: client-level DP is a server's"),
        (
            ["tree.edge.secure_aggregation={threshold: 2}", "tree.edge.mode=async", "tree.edge.buffer=7"],
            "tree.edge.secure_aggregation: a secure-aggregation flush takes at most one update per child, so "
            "buffer (7) cannot exceed the 6 children 'edge-en' has",
        ),
        (
            ["tree.root.privacy={clip: 1, noise_multiplier: 1}", "tree.root.proxy_train=async"],
            "tree.root.privacy: 'root' trains on its proxy split alongside its children (proxy_train: async)",
        ),
        (
            ["tree.edge.privacy={clip: 1, noise_multiplier: 0.5, adaptive: {}}"],  # default count_noise: cohort 4 / 20
            "tree.edge.privacy.adaptive.count_noise: adaptive clipping: count_noise 0.2 leaves no budget for the "
            "update at noise_multiplier 0.5 (it needs 2 * count_noise > noise_multiplier); not set, it is the "
            "default: 4 contributions a fold / 20",
        ),
        (
            ["tree.edge.privacy={clip: 1, noise_multiplier: 1}", "tree.residuals.up=[{from: edge, to: root}]"],
            "tree.residuals.up[0]: 'edge-en' would send its children's models to 'root' unclipped and un-noised, "
            "past the differential privacy of 'edge-en'",
        ),
        (
            ["tree.server.privacy={clip: 1, noise_multiplier: 1}", "tree.residuals.up=[{from: edge, to: root}]"],
            "'edge-en' would send its children's models to 'root' through 'europe-west'",
        ),
        (["tree.edge.privacy={clip: 0, noise_multiplier: 1}"], "tree.edge.privacy.clip"),
        (["tree.edge.privacy={noise_multiplier: 1}"], "tree.edge.privacy.clip: Field required"),
    ],
)
def test_configs_that_would_leak_or_cannot_be_private_are_rejected_naming_the_key(overrides, message):
    from bhfl_core.config.base import ConfigError

    with pytest.raises(ConfigError) as err:
        embedded_tree(*overrides)
    assert message in str(err.value)


def test_a_residual_that_ends_below_the_dp_server_is_allowed():
    tree = embedded_tree(
        "tree.root.privacy={clip: 1, noise_multiplier: 1}", "tree.residuals.up=[{from: edge, to: server}]"
    )
    assert tree["edge-en"].settings.res_up and tree.root.settings.aggregate.privacy is not None


def test_epsilon_reproduces_the_libraries_worked_example():
    """dp-accounting's own test (rdp_privacy_accountant_test.test_compute_epsilon_delta_gaussian), with the RDP
    accountant (the PLD one is tighter: tests/core/test_privacy_accounting.py): the Gaussian
    mechanism with noise multiplier 4.530877117 is exactly (1, 1e-6)-DP. A DP server that calls all its children
    has replace-one sensitivity 2C, so it needs twice that z; a DP-SGD client whose batch is all its rows, z itself.
    """
    from bhfl_core.algorithm.privacy_accounting import sample_epsilon
    from bhfl_core.algorithm.privacy_params import DpSgdParams

    server = PrivacyParams(1.0, 2 * 4.530877117, expected=5, population=5, noise_seed=0, delta=1e-6, accountant="rdp")
    assert epsilon(server, 1) == pytest.approx(1.0, abs=1e-5)
    client = DpSgdParams(noise_multiplier=4.530877117, max_grad_norm=1.0, delta=1e-6)
    assert sample_epsilon(client, 10, 10, 1) == pytest.approx(1.0, abs=1e-5)
