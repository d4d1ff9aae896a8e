"""Wrappers around a rule (``zeroing``, ``dp``, ``secagg``): composed by ``rule_for`` from the registry, each a rule
of its own with state; checked by hand and against the rule they wrap."""

import math

import pytest
import torch

from bhfl_core.algorithm.aggregation_rule import MeanRule, fold_results
from bhfl_core.algorithm.contract import NO_PLAN, ChildResult, FoldPlan
from bhfl_core.algorithm.dp_rule import CLIP, DpRule
from bhfl_core.algorithm.node_state import Caller, NodeState, RoundKey
from bhfl_core.algorithm.privacy import clip_update
from bhfl_core.algorithm.privacy_params import AdaptiveClip, PrivacyParams, SecAggParams, ZeroingParams
from bhfl_core.algorithm.rule_registry import AggregateParams
from bhfl_core.algorithm.rules import rule_for
from bhfl_core.algorithm.secagg_rule import SecAggRule
from bhfl_core.algorithm.zeroing_rule import NONFINITE, ZEROED, ZeroingRule
from bhfl_core.store.node_store import state_info
from bhfl_core.store.state_header import state_from_file

KEY = RoundKey("edge", 2, Caller("root", 0))
REFERENCE = torch.tensor([1.0, 2.0, -1.0])
DP = PrivacyParams(clip=1.0, noise_multiplier=0.0, expected=3, population=3, noise_seed=5)
SECAGG = SecAggParams(threshold=2, mask_seed=9)


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def folded(rule, models: dict[str, torch.Tensor], weights: dict[str, float], plan: FoldPlan = NO_PLAN):
    """Each model folded in a batch of its own, sent over the wire and merged by ``fold_results``."""
    results = []
    for member, model in models.items():
        partial = rule.start(KEY.as_caller(), plan, REFERENCE)
        rule.contribute(partial, member, model, weights[member])
        results.append(ChildResult(members=(member,), partial=rule.unwire(*rule.wire(partial))))
    return fold_results(rule, KEY, results, [*models, "edge"], REFERENCE, plan).partial


def test_rule_for_composes_the_wrappers_outermost_first_from_the_registry():
    rule = rule_for(AggregateParams(wrappers=(ZeroingParams(5.0), DP, SECAGG)))
    assert isinstance(rule, ZeroingRule) and isinstance(rule.inner, DpRule) and isinstance(rule.inner.sum, SecAggRule)
    assert isinstance(rule_for(AggregateParams(wrappers=(ZeroingParams(),))).inner, MeanRule)
    with pytest.raises(TypeError, match=r"dp wraps a sum .* not MedianRule"):
        rule_for(AggregateParams("median", wrappers=(DP,)))
    with pytest.raises(TypeError, match="secagg wraps the mean"):
        rule_for(AggregateParams("krum", wrappers=(SECAGG,)))


def test_zeroing_replaces_a_nonfinite_or_too_long_update_by_the_reference_and_counts_it():
    rule = rule_for(AggregateParams(wrappers=(ZeroingParams(max_norm=2.0),)))
    models = {
        "ok": REFERENCE + t(1.0, 0.0, 0.0),  # norm 1: kept
        "nan": t(math.nan, 2.0, -1.0),  # not finite: zeroed
        "far": REFERENCE + t(0.0, 3.0, 0.0),  # norm 3 > 2: zeroed
        "inf": t(math.inf, 0.0, 0.0),
    }
    weights = {"ok": 2.0, "nan": 1.0, "far": 1.0, "inf": 4.0}
    done = rule.finalize(folded(rule, models, weights), KEY)
    # by hand: (2 (ref + e1) + (1 + 1 + 4) ref) / 8 = ref + e1 / 4
    assert torch.equal(done.input, REFERENCE + t(0.25, 0.0, 0.0))
    assert done.metrics == {ZEROED: 3.0, NONFINITE: 2.0} and done.state == {}


def test_zeroing_that_zeroes_nothing_gives_the_wrapped_rules_bits():
    gen = torch.Generator().manual_seed(0)
    models = {f"c{i}": REFERENCE + torch.randn(3, generator=gen) for i in range(5)}
    weights = {m: float(3 + i) for i, m in enumerate(models)}
    for kind in ("mean", "median"):
        plain = rule_for(AggregateParams(kind))
        zeroing = rule_for(AggregateParams(kind, wrappers=(ZeroingParams(),)))
        assert torch.equal(
            zeroing.finalize(folded(zeroing, models, weights), KEY).input,
            plain.finalize(folded(plain, models, weights), KEY).input,
        )


def test_a_nan_update_is_folded_as_no_update_by_dp_itself_or_by_zeroing_outside_it():
    rule = rule_for(AggregateParams(wrappers=(ZeroingParams(), DP)))
    models = {"a": REFERENCE + t(0.6, 0.8, 0.0), "b": t(math.nan, 0.0, 0.0), "c": REFERENCE + t(0.0, 0.0, 3.0)}
    done = rule.finalize(folded(rule, models, dict.fromkeys(models, 1.0), rule.plan({}, ())), KEY)
    # by hand: clipped updates (0.6, 0.8, 0) and (0, 0, 1 * SHRINK), zero for b; over the expected 3
    expected = (
        REFERENCE.double()
        + (clip_update(models["a"], REFERENCE, 1.0)[0].double() + clip_update(models["c"], REFERENCE, 1.0)[0].double())
        / 3
    )
    assert torch.equal(done.input, expected.float())
    assert done.metrics[ZEROED] == 1.0 and done.metrics["privacy/clipped_fraction"] == pytest.approx(1 / 3)
    assert done.metrics["privacy/nonfinite"] == 0.0  # zeroing took it first
    alone = rule_for(AggregateParams(wrappers=(DP,)))  # DP zeroes a non-finite update itself, and counts it
    by_dp = alone.finalize(folded(alone, models, dict.fromkeys(models, 1.0), alone.plan({}, ())), KEY)
    assert torch.equal(by_dp.input, expected.float()) and by_dp.metrics["privacy/nonfinite"] == 1.0


def test_the_dp_rules_state_is_its_adaptive_clip_which_goes_down_in_the_plan_and_is_saved_with_the_node():
    adaptive = PrivacyParams(
        clip=1.0, noise_multiplier=1.0, expected=2, population=4, noise_seed=5, adaptive=AdaptiveClip(count_noise=1.0)
    )
    rule = rule_for(AggregateParams(wrappers=(adaptive,)))
    assert rule.plan({}, ("a", "b")).number(CLIP) == 1.0  # no state yet: the configured clip
    plan = rule.plan({CLIP: 0.25}, ("a", "b"))
    assert plan == FoldPlan(((CLIP, 0.25),)) and plan.peers == ()  # DP alone needs no peers
    models = {"a": REFERENCE + t(0.1, 0.0, 0.0), "b": REFERENCE + t(0.0, 5.0, 0.0)}
    done = rule.finalize(folded(rule, models, {"a": 1.0, "b": 1.0}, plan), KEY, {CLIP: 0.25})
    assert done.metrics["privacy/clip"] == 0.25 and done.metrics["privacy/clipped_fraction"] == 0.5
    assert set(done.state) == {CLIP} and done.state[CLIP] != 0.25  # moved by the noised unclipped share
    saved = state_from_file({}, state_info(NodeState(model=REFERENCE, rule_state=dict(done.state))))
    assert saved.rule_state == done.state
    assert state_from_file({}, {"clip": 0.5}).rule_state == {CLIP: 0.5}  # a checkpoint from before rules kept state
    secure = rule_for(AggregateParams(wrappers=(DP, SECAGG)))
    assert secure.plan({}, ("a", "b")) == FoldPlan(((CLIP, 1.0),), ("a", "b"))  # the clip and the masking peers
