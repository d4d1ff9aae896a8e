"""Secure aggregation (bhfl_core/algorithm/secure_aggregation.py, secagg_crypto.py): masks cancel, recover, hide."""

import math

import pytest
import torch
from scipy.stats import chisquare

from bhfl_core.algorithm.aggregation_rule import fold_results
from bhfl_core.algorithm.compression import NonFiniteUpdate
from bhfl_core.algorithm.contract import ChildResult
from bhfl_core.algorithm.node_state import Caller, RoundKey
from bhfl_core.algorithm.privacy_params import PrivacyParams, SecAggParams, ZeroingParams
from bhfl_core.algorithm.rule_registry import AggregateParams
from bhfl_core.algorithm.rules import rule_for
from bhfl_core.algorithm.secure_aggregation import SecureAggregationError
from tests.small import embedded_tree

KEY = RoundKey("edge-en", 2, Caller("root", 1))
PARAMS = SecAggParams(threshold=3, mask_seed=11, bits=48, fraction_bits=24)
gen = torch.Generator().manual_seed(0)
REFERENCE = torch.randn(4000, generator=gen)
MODELS = {f"c{i}": REFERENCE + 0.05 * torch.randn(4000, generator=gen) for i in range(5)}
WEIGHTS = {f"c{i}": float(17 + 13 * i) for i in range(5)}
PEERS = tuple(MODELS)


def fold(layout, contributors=PEERS, params=PARAMS, privacy=None):
    rule = rule_for(AggregateParams(wrappers=(params,) if privacy is None else (privacy, params)))
    plan = rule.plan({}, PEERS)  # the round's called cohort: every member's peers
    results = []
    for batch in layout:
        partial = rule.start(KEY.as_caller(), plan, REFERENCE)
        for member in batch:
            if member in contributors:
                rule.contribute(partial, member, MODELS[member], WEIGHTS[member])
        tensors, numbers = rule.wire(partial)  # what a worker sends: masked sums and counts
        results.append(ChildResult(members=tuple(batch), partial=rule.unwire(tensors, numbers)))
    return rule, fold_results(rule, KEY, results, [*PEERS, "edge-en"], REFERENCE, plan).partial


def quantised(member: str) -> torch.Tensor:
    """By hand: round(w (x - theta) 2^24) as an integer."""
    update = (MODELS[member].double() - REFERENCE.double()) * WEIGHTS[member]
    return torch.round(update * 2.0**24).to(torch.int64)


@pytest.mark.parametrize("params", [PARAMS, SecAggParams(threshold=2, mask_seed=11, neighbours=2)])  # complete, ring
def test_the_unmasked_sum_is_the_plain_quantised_sum_exactly_however_batched(params):
    expected = sum(quantised(m) for m in PEERS)
    for layout in ([list(PEERS)], [["c4", "c1"], ["c0"], ["c3", "c2"]]):
        _, partial = fold(layout, params=params)
        assert torch.equal(partial.unmasked()[:-1], expected)  # (then the clamped counter's total)
        assert partial.totals() == {"clamped": 0}


def test_one_masked_update_looks_uniform_and_the_unmasked_one_does_not():
    rule = rule_for(AggregateParams(wrappers=(PARAMS,)))
    alone = rule.start(KEY.as_caller(), rule.plan({}, PEERS), REFERENCE)
    rule.contribute(alone, "c2", MODELS["c2"], WEIGHTS["c2"])
    top = (alone.masked >> 40) & 255  # the top byte of the 48-bit field
    assert chisquare(torch.bincount(top, minlength=256).numpy()).pvalue > 1e-3
    plain_top = (quantised("c2") & ((1 << 48) - 1)) >> 40  # small signed values: top byte 0 or 255
    assert chisquare(torch.bincount(plain_top, minlength=256).numpy()).pvalue < 1e-12


def test_the_mean_is_within_the_documented_quantisation_error_of_the_exact_weighted_mean():
    rule, partial = fold([list(PEERS)])
    total = sum(WEIGHTS.values())
    exact = sum(WEIGHTS[m] * (MODELS[m].double() - REFERENCE.double()) for m in PEERS) / total
    got = partial.summed() / total
    assert (got - exact).abs().max() <= len(PEERS) * 2.0**-25 / total
    mean = rule.finalize(partial, KEY).input
    assert torch.allclose(mean.double(), REFERENCE.double() + exact, atol=1e-6)


def test_a_client_that_never_sent_its_update_has_its_masks_removed_from_the_survivors_shares():
    survivors = ("c0", "c2", "c3")
    _, partial = fold([["c0", "c1"], ["c2", "c3", "c4"]], contributors=survivors)
    assert torch.equal(partial.unmasked()[:-1], sum(quantised(m) for m in survivors))
    assert partial.secagg_metrics()["secagg/recovered_clients"] == 2
    with pytest.raises(SecureAggregationError, match=r"'edge-en' .*2 of 5 children .* fewer than the threshold 3"):
        fold([list(PEERS)], contributors=("c0", "c4"))[1].unmasked()


def test_with_dp_updates_are_clipped_before_masking_and_noised_after_unmasking():
    privacy = PrivacyParams(clip=0.5, noise_multiplier=0.8, expected=5, population=6, noise_seed=3)
    secure, masked = fold([["c1", "c3"], ["c0", "c2", "c4"]], privacy=privacy)
    dp = rule_for(AggregateParams(wrappers=(privacy,)))
    plain = dp.start(KEY.as_caller(), dp.plan({}, ()), REFERENCE)
    for m in PEERS:
        dp.contribute(plain, m, MODELS[m], WEIGHTS[m])
    assert masked.clipped == 0 and plain.clipped == 5  # under secagg the server holds no batch's count...
    together, separately = secure.finalize(masked, KEY).input, dp.finalize(plain, KEY).input
    assert masked.clipped == 5 and masked.inner.totals() == {"clamped": 0, "clipped": 5, "nonfinite": 0}  # ...totals
    assert torch.allclose(together, separately, atol=1e-6) and not torch.equal(together, REFERENCE)


def test_secure_aggregation_resolves_per_edge_with_a_majority_threshold():
    tree = embedded_tree("tree.edge.secure_aggregation={bits: 40, fraction_bits: 20}")
    secagg = tree["edge-en"].settings.aggregate.secagg
    assert secagg is not None and (secagg.bits, secagg.fraction_bits, secagg.threshold) == (40, 20, 3)  # 4 // 2 + 1
    assert secagg.mask_seed != tree["edge-de"].settings.aggregate.secagg.mask_seed
    assert math.isclose(tree["edge-en"].settings.cohort, 4)
    assert (secagg.neighbours, secagg.randomness) == (None, "seeded")  # the complete graph, keys from the seed
    sparse = embedded_tree("tree.edge.secure_aggregation={graph: sparse, randomness: secure}")["edge-en"]
    secagg = sparse.settings.aggregate.secagg
    assert (secagg.neighbours, secagg.threshold, secagg.randomness) == (2, 2, "secure")  # k: 2 ceil(log2 4), capped


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["tree.client.secure_aggregation={}"], "tree.client.secure_aggregation: secure aggregation is a server's"),
        (
            ["tree.edge.secure_aggregation={threshold: 2}", "tree.edge.mode=async", "tree.edge.buffer=9"],
            "a secure-aggregation flush takes at most one update per child, so buffer (9) cannot exceed",
        ),
        (["tree.edge.secure_aggregation={threshold: 5}"], "tree.edge.secure_aggregation.threshold: 5 is more than"),
        (
            ["tree.edge.secure_aggregation={threshold: 1}"],
            "tree.edge.secure_aggregation.threshold: 1 lets 'edge-en' unmask a round that one child's update alone",
        ),
        (  # FedBuff's buffer of 1: every flush is one child's update, whatever the masks
            [
                "tree.root.secure_aggregation={}",
                "tree.root.mode=async",
                "tree.root.buffer=1",
                "tree.root.concurrency=2",
            ],
            "tree.root.buffer: 1 lets 'root' unmask a flush that one child's update alone went into",
        ),
        (
            ["tree.edge.secure_aggregation={bits: 20, fraction_bits: 19}"],
            "fraction_bits: 19 leaves no integer bits of 20",
        ),
        (["tree.edge.secure_aggregation={bits: 70}"], "tree.edge.secure_aggregation.bits"),
        (["tree.edge.secure_aggregation={neighbours: 2}"], "tree.edge.secure_aggregation.neighbours: 2 needs graph"),
        (["tree.edge.secure_aggregation={graph: sparse, neighbours: 3}"], "neighbours: 3 is odd; the Harary"),
        (
            ["tree.edge.secure_aggregation={graph: sparse, neighbours: 4}"],
            "tree.edge.secure_aggregation.neighbours: 4 must be at least 2 and below the mask group of 4 children",
        ),
        (
            ["tree.edge.secure_aggregation={graph: sparse, neighbours: 2, threshold: 3}"],
            "tree.edge.secure_aggregation.threshold: 3 is more than the 2 neighbours of graph: sparse",
        ),
        (["tree.edge.secure_aggregation={graph: ring}"], "tree.edge.secure_aggregation.graph"),
        (
            [
                "tree.edge.secure_aggregation={}",
                "tree.edge.privacy={clip: 1, noise_multiplier: 0.1, adaptive: {count_noise: 1}}",
            ],
            "adaptive clipping with secure aggregation is not supported yet",
        ),
        (
            ["tree.edge.secure_aggregation={}", "tree.residuals.up=[{from: edge, to: root}]"],
            "'edge-en' would send its children's models to 'root' in the clear, past the secure aggregation",
        ),
    ],
)
def test_secure_aggregation_configs_that_cannot_work_are_rejected_naming_the_key(overrides, message):
    from bhfl_core.config.base import ConfigError

    with pytest.raises(ConfigError) as err:
        embedded_tree(*overrides)
    assert message in str(err.value)


def test_what_a_batch_sends_a_secagg_server_holds_no_count_of_its_own_only_masked_values():
    """Per-batch counts (values clamped; under DP, updates clipped or not finite) would tell the server about the
    batch's clients: they travel masked, as extra coordinates of the masked vector, and only their totals open."""
    privacy = PrivacyParams(clip=0.5, noise_multiplier=0.8, expected=5, population=6, noise_seed=3)
    rule = rule_for(AggregateParams(wrappers=(privacy, PARAMS)))
    partial = rule.start(KEY.as_caller(), rule.plan({}, PEERS), REFERENCE)
    for member in ("c0", "c1"):
        rule.contribute(partial, member, MODELS[member], WEIGHTS[member])
    tensors, numbers = rule.wire(partial)
    counts = {k: v for k, v in numbers.items() if not k.startswith(("member.", "counter."))}
    assert counts == {"weight": 2.0, "dp/clip": 0.5}  # how many it folded (the server called them), its clip
    assert {k for k in numbers if k.startswith("counter.")} == {
        "counter.clamped",
        "counter.clipped",
        "counter.nonfinite",
    }
    assert set(numbers.values()) - {2.0, 0.5} == {1.0} and tensors["masked"].numel() == REFERENCE.numel() + 3


@pytest.mark.parametrize("dp", [False, True], ids=["secagg", "dp-secagg"])
def test_zeroing_around_secure_aggregation_sends_the_server_no_count_of_a_batchs_zeroed_children(dp):
    """``zeroing`` counts the updates it zeroes where the children are folded; beside a masked vector a batch's
    count would tell the server which of its clients diverged or sent a long update, so none is sent (or logged)."""
    privacy = PrivacyParams(clip=0.5, noise_multiplier=0.0, expected=5, population=6, noise_seed=3)  # no accountant
    rule = rule_for(AggregateParams(wrappers=(ZeroingParams(max_norm=3.0), *([privacy] if dp else []), PARAMS)))
    plan = rule.plan({}, PEERS)
    models = {**MODELS, "c1": MODELS["c1"] * 2, "c3": MODELS["c3"] + math.nan}  # c1 too long, c3 diverged
    results = []
    for member in PEERS:  # one client a batch
        partial = rule.start(KEY.as_caller(), plan, REFERENCE)
        rule.contribute(partial, member, models[member], WEIGHTS[member])
        tensors, numbers = rule.wire(partial)
        assert {k for k in numbers if not k.startswith(("member.", "counter."))} <= {"weight", "dp/clip"}
        results.append(ChildResult(members=(member,), partial=rule.unwire(tensors, numbers)))
    done = rule.finalize(fold_results(rule, KEY, results, [*PEERS, "edge-en"], REFERENCE, plan).partial, KEY)
    assert torch.isfinite(done.input).all() and not [k for k in done.metrics if k.startswith("zeroing/")]


def test_a_nonfinite_update_is_not_masked_unseen_but_stops_naming_the_child():
    """In the field a NaN becomes 0 (and an infinity the clamp's bound): summed without a trace where the plain
    mean would turn NaN. Alone, secure aggregation refuses it, naming the child and the wrapper that handles it."""
    rule = rule_for(AggregateParams(wrappers=(PARAMS,)))
    partial = rule.start(KEY.as_caller(), rule.plan({}, PEERS), REFERENCE)
    diverged = MODELS["c2"].clone()
    diverged[:3] = torch.tensor([math.nan, math.inf, math.nan])
    with pytest.raises(
        NonFiniteUpdate, match=r"^c2: its update to 'edge-en' \(round 2\) has 3 non-finite .* \(2 NaN\).*zeroing"
    ):
        rule.contribute(partial, "c2", diverged, WEIGHTS["c2"])
