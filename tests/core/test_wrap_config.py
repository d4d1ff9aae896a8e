"""``aggregate: {wrap: [...]}`` in the config: wrappers listed outermost first, the same rule as their shorthands
(``privacy:``, ``secure_aggregation:``, ``aggregate.compress``), and every mistake named by its key."""

import math

import pytest

from bhfl_core.algorithm.privacy_params import PrivacyParams, SecAggParams, ZeroingParams
from bhfl_core.config.base import ConfigError
from tests.core.test_robust_config import tree

# tests/small.py: root -> west (edge-en, edge-fr), east (edge-de) -> 3 clients each, edge cohort 2
COHORT = "tree.edge.cohort=3"
DP = "{clip: 1.0, noise_multiplier: 1.0}"


def test_the_list_resolves_to_the_same_rule_as_the_shorthands():
    listed = tree(COHORT, f"tree.edge.aggregate={{wrap: [zeroing, {{dp: {DP}}}, {{secagg: {{threshold: 2}}}}]}}")
    short = tree(
        COHORT,
        "tree.edge.aggregate={wrap: [{zeroing: {}}]}",
        f"tree.edge.privacy={DP}",
        "tree.edge.secure_aggregation={threshold: 2}",
    )
    params = listed["edge-en"].settings.aggregate
    assert params == short["edge-en"].settings.aggregate
    zeroing, dp, secagg = params.wrappers
    assert zeroing == ZeroingParams(math.inf) and isinstance(dp, PrivacyParams) and isinstance(secagg, SecAggParams)
    assert (dp.clip, dp.expected, dp.population, secagg.threshold) == (1.0, 3, 3, 2)
    assert params.privacy is dp and params.secagg is secagg and params.zeroing is zeroing
    bounded = tree(COHORT, "tree.edge.aggregate={kind: median, wrap: [{zeroing: {max_norm: 5}}]}")
    assert bounded["edge-de"].settings.aggregate.zeroing == ZeroingParams(5.0)  # around a robust rule too
    compressed = tree("tree.edge.aggregate={wrap: [{compress: {kind: int8}}]}")
    assert (
        compressed["en-00"].settings.uplink
        == tree("tree.edge.aggregate={compress: {kind: int8}}")["en-00"].settings.uplink
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [f"tree.edge.aggregate={{wrap: [{{secagg: {{threshold: 2}}}}, {{dp: {DP}}}]}}"],
            r"tree.edge.aggregate.wrap\[1\].dp: dp cannot come after secagg \(tree.edge.aggregate.wrap\[0\].secagg\)",
        ),
        (
            ["tree.edge.aggregate={wrap: [zeroing, zeroing]}"],
            r"wrap\[1\].zeroing: zeroing cannot come after zeroing",
        ),
        (
            [f"tree.edge.aggregate={{wrap: [{{dp: {DP}}}]}}", f"tree.edge.privacy={DP}"],
            r"tree.edge.privacy and tree.edge.aggregate.wrap\[0\].dp both set the dp wrapper of 'edge-en'",
        ),
        (
            [f"tree.edge.aggregate={{kind: median, wrap: [{{dp: {DP}}}]}}"],
            r"tree.edge.aggregate.kind: median cannot be combined with tree.edge.aggregate.wrap\[0\].dp at 'edge-en'",
        ),
        (
            ["tree.client.aggregate={wrap: [zeroing]}"],
            r"tree.client.aggregate.wrap\[0\].zeroing: .* 'en-00' is a client",
        ),
        (["tree.edge.aggregate={wrap: [clipping]}"], r"unknown wrapper 'clipping'"),
        (["tree.edge.aggregate={wrap: [{zeroing: {}, dp: {clip: 1, noise_multiplier: 1}}]}"], r"names one wrapper"),
        (["tree.edge.aggregate={wrap: [{zeroing: {max_norm: 0}}]}"], r"max_norm"),
    ],
)
def test_mistakes_are_named_by_their_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tree(COHORT, *overrides)


def test_dp_and_secagg_at_an_asynchronous_server_fold_flushes_of_the_buffer():
    fedbuff = ["tree.edge.mode=async", "tree.edge.concurrency=2", "tree.edge.buffer=2"]
    dp = tree(*fedbuff, f"tree.edge.aggregate={{wrap: [zeroing, {{dp: {DP}}}]}}")["edge-en"].settings.aggregate.privacy
    assert dp is not None and (dp.expected, dp.population) == (2, 2)  # a flush of 2, every child in every flush
    with pytest.raises(ConfigError, match=r"tree.edge.privacy: a DP flush takes at most one update per child, so "):
        tree("tree.edge.mode=async", "tree.edge.buffer=4", f"tree.edge.privacy={DP}")  # 3 children
    secagg = tree(*fedbuff, f"tree.edge.aggregate={{wrap: [{{dp: {DP}}}, secagg]}}")["edge-en"].settings.aggregate
    assert secagg.secagg is not None and secagg.secagg.threshold == 2  # a majority of the buffer of 2
    with pytest.raises(ConfigError, match=r"wrap\[0\].secagg.threshold: 3 is more than the 2 children its buffer"):
        tree(*fedbuff, "tree.edge.aggregate={wrap: [{secagg: {threshold: 3}}]}")
