"""No path leaks past a DP or secure-aggregation server (issue 46, item 1): every way a child's data could reach
the server's parent, or its published model, un-noised is refused naming the key, or cut where it is made."""

import pytest

from bhfl_core.config.base import ConfigError
from tests.small import embedded_tree

DP = "{clip: 1, noise_multiplier: 1}"
DP_SGD = "tree.client.train.dp_sgd={noise_multiplier: 1.0, max_grad_norm: 1.0}"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (  # an up-residual that ends at the DP server would be folded into its model, unclipped
            [f"tree.root.privacy={DP}", "tree.residuals.up=[{from: edge, to: root}]"],
            "tree.residuals.up[0]: 'edge-en' would send its children's models to 'root' unclipped and un-noised, "
            "into the differential privacy of 'root'",
        ),
        (
            ["tree.root.secure_aggregation={threshold: 2}", "tree.residuals.up=[{from: edge, to: root}]"],
            "'edge-en' would send its children's models to 'root' into 'root', whose secure aggregation may see only",
        ),
        (  # Tempo picks the next epochs from the children's raw models
            ["tree.tempo=true", "tree.groups={}", f"tree.root.aggregate={{wrap: [{{dp: {DP}}}]}}"],
            "tree.tempo: Tempo sets each edge's next epochs from the model it sent up",
        ),
        (  # interp would choose the client's model by held-out rows no DP-SGD step protects
            [DP_SGD, "tree.client.opt_down={kind: interp}", "tree.client.holdout=0.2"],
            "tree.client.train.dp_sgd: tree.client.opt_down is interp",
        ),
        (  # a residual picked by the clients' raw training loss, which no DP-SGD noise covers
            [DP_SGD, "tree.residuals.up=[{from: edge, to: root, select: loss}]"],
            "tree.residuals.up[0].select: 'loss' would pick which of 'edge-en''s clients' models go up by their "
            "training loss, computed un-noised from the examples the DP-SGD of 'en-00' protects",
        ),
        (
            [DP_SGD, "tree.residuals.down=[{from: edge, to: client, opt: {kind: interp}}]", "tree.client.holdout=0.2"],
            "tree.residuals.down[0].opt: interp at 'en-00' would pick its model by its loss on held-out rows",
        ),
    ],
)
def test_a_path_past_or_into_a_private_server_is_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        embedded_tree(*overrides)
    assert message in str(err.value)


def test_dp_sgd_needs_a_task_whose_loss_is_a_sum_of_per_example_terms():
    from bhfl_core.algorithm.tree import Role
    from bhfl_core.config.aggregation_settings import check_dp_sgd
    from bhfl_core.config.tree_schema import TrainSettings

    train = TrainSettings.model_validate({"dp_sgd": {"noise_multiplier": 1.0, "max_grad_norm": 1.0}})
    check_dp_sgd(train, "tree.client.train", "en-0", Role.CLIENT, "classification")  # accepted
    with pytest.raises(ConfigError, match=r"tree.client.train.dp_sgd: data.task 'mlm' averages its loss over"):
        check_dp_sgd(train, "tree.client.train", "en-0", Role.CLIENT, "mlm")


def test_the_rules_say_what_may_leave_a_private_server():
    from bhfl_core.algorithm.privacy_params import PrivacyParams, SecAggParams, ZeroingParams
    from bhfl_core.algorithm.rule_registry import AggregateParams
    from bhfl_core.algorithm.rules import rule_for

    dp = PrivacyParams(clip=1.0, noise_multiplier=1.0, expected=2, population=2, noise_seed=0)
    secagg = SecAggParams(threshold=2, mask_seed=0)
    flags = {
        name: (rule.reports_up, rule.sees_members)
        for name, rule in {
            "mean": rule_for(AggregateParams()),
            "median": rule_for(AggregateParams("median", wrappers=(ZeroingParams(),))),
            "dp": rule_for(AggregateParams(wrappers=(ZeroingParams(), dp))),
            "secagg": rule_for(AggregateParams(wrappers=(secagg,))),
            "dp+secagg": rule_for(AggregateParams(wrappers=(dp, secagg))),
        }.items()
    }
    assert flags == {
        "mean": (True, True),
        "median": (True, True),
        "dp": (False, True),  # trusted with its children (central DP), publishes only the noised model
        "secagg": (False, False),  # sees only the masked sum
        "dp+secagg": (False, False),
    }
