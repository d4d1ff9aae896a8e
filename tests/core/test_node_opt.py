"""NODEOPT maths against hand-computed values (scalar reference written out per coordinate)."""

import math

import pytest
import torch

from bhfl_core.algorithm.node_opt import NodeOptParams, node_opt_step


def reference(kind: str, theta: list[float], inputs: list[float], steps: int, p: NodeOptParams):
    """Plain-Python FedOPT per coordinate, straight from ALGORITHMS.md."""
    theta = list(theta)
    m = [0.0] * len(theta)
    v = [0.0] * len(theta)
    for _ in range(steps):
        deltas = [inputs[i] - theta[i] for i in range(len(theta))]
        for i, d in enumerate(deltas):
            if kind == "fedavg":
                theta[i] += p.eta * d
            elif kind == "fedavgm":
                m[i] = p.beta1 * m[i] + d
                theta[i] += p.eta * m[i]
            else:
                m[i] = p.beta1 * m[i] + (1 - p.beta1) * d
                if kind == "fedadagrad":
                    v[i] = v[i] + d * d
                elif kind == "fedadam":
                    v[i] = p.beta2 * v[i] + (1 - p.beta2) * d * d
                elif kind == "fedyogi":
                    sign = (v[i] - d * d > 0) - (v[i] - d * d < 0)
                    v[i] = v[i] - (1 - p.beta2) * d * d * sign
                theta[i] += p.eta * m[i] / (math.sqrt(v[i]) + p.tau)
    return theta


def weighted_mean(inputs, weights):
    total = sum(weights)
    return [sum(w * x[i] for x, w in zip(inputs, weights)) / total for i in range(len(inputs[0]))]


@pytest.mark.parametrize("kind", ["fedavg", "fedavgm", "fedadagrad", "fedadam", "fedyogi"])
@pytest.mark.parametrize("direction_eta", [1.0, 0.3])  # e.g. eta_up = 1, eta_down = 0.3
def test_three_steps_match_reference(kind, direction_eta):
    p = NodeOptParams(kind=kind, eta=direction_eta, beta1=0.9, beta2=0.99, tau=0.1)
    theta0 = [1.0, 2.0, -0.5]
    # two children with 1 and 3 training examples: mean = 0.25 * a + 0.75 * b
    children, weights = [[2.0, 0.0, 0.5], [0.0, 4.0, -1.5]], [1.0, 3.0]
    mean = weighted_mean(children, weights)
    assert mean == pytest.approx([0.5, 3.0, -1.0])
    state, theta = {}, torch.tensor(theta0)
    for _ in range(3):
        state, theta = node_opt_step(state, theta, torch.tensor(mean), p)
    expected = reference(kind, theta0, mean, 3, p)
    assert theta.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert int(state["step"]) == 3


def test_fedadam_first_step_by_hand():
    # Delta = [1, -2]; m = 0.1 * Delta = [0.1, -0.2]; v = 0.01 * Delta^2 = [0.01, 0.04]
    # theta += 0.5 * m / (sqrt(v) + 0.1) = [0.5 * 0.1 / 0.2, 0.5 * -0.2 / 0.3] = [0.25, -1/3]
    p = NodeOptParams(kind="fedadam", eta=0.5, beta1=0.9, beta2=0.99, tau=0.1)
    state, theta = node_opt_step({}, torch.tensor([1.0, 2.0]), torch.tensor([2.0, 0.0]), p)
    assert theta.tolist() == pytest.approx([1.25, 2.0 - 1 / 3])
    assert state["m"].tolist() == pytest.approx([0.1, -0.2])
    assert state["v"].tolist() == pytest.approx([0.01, 0.04])


def test_fedavg_eta_one_replaces_exactly():
    theta = torch.tensor([0.1, 0.7, 1e8])
    target = torch.tensor([0.3, -0.2, 3.0])
    _, out = node_opt_step({}, theta, target, NodeOptParams(kind="fedavg", eta=1.0))
    assert torch.equal(out, target)  # bit-exact: HierFAVG's "replace the child model"


def test_a_step_does_not_change_the_state_it_was_given():
    """Node states are values: a step returns a new state and leaves its input as it was,
    so two nodes (or a resumed and a live copy) can never share optimiser moments."""
    p = NodeOptParams(kind="fedadam", eta=0.1, tau=0.01)
    s1, _ = node_opt_step({}, torch.zeros(2), torch.ones(2), p)
    kept = {k: v.clone() for k, v in s1.items()}
    s2, _ = node_opt_step(s1, torch.zeros(2), -torch.ones(2), p)
    assert all(torch.equal(s1[k], kept[k]) for k in kept)  # the input state is untouched
    assert not torch.equal(s2["m"], s1["m"]) and not torch.equal(s2["v"], s1["v"])


def test_unknown_kind_and_shape_mismatch():
    with pytest.raises(ValueError, match="unknown NODEOPT"):
        node_opt_step({}, torch.zeros(2), torch.zeros(2), NodeOptParams(kind="sgdx"))
    with pytest.raises(ValueError, match="shape"):
        node_opt_step({}, torch.zeros(2), torch.zeros(3), NodeOptParams())


FLOWER = {  # NODEOPT kind: Flower's strategy and its names for (eta, beta1, beta2, tau)
    "fedyogi": ("FedYogi", "eta", "beta_1", "beta_2", "tau"),
    "fedadagrad": ("FedAdagrad", "eta", None, None, "tau"),  # Flower's has no momentum: beta_1 = 0
    "fedadam": ("FedAdam", "eta", "beta_1", "beta_2", "tau"),
    "fedavgm": ("FedAvgM", "server_learning_rate", "server_momentum", None, None),
}


@pytest.mark.parametrize("kind", sorted(FLOWER))
def test_four_rounds_match_flowers_strategies(kind):
    """NODEOPT against Flower's own FedYogi / FedAdagrad / FedAvgM / FedAdam (flwr 1.42.0) over four rounds of
    three children with uneven example counts, different each round (the sign of the pseudo-gradient, tau, the
    moments' first step and the weighted mean all enter). One documented difference: Flower's FedAdam scales
    ``eta`` by Adam's bias correction ``sqrt(1 - beta2^(t+1)) / (1 - beta1^(t+1))``; Reddi et al.'s Algorithm 2,
    which NODEOPT follows, has none. So for FedAdam the step is compared after that factor, from the same model."""
    import numpy as np

    from tests.core.flower_reference import server_round, server_strategy

    name, eta_key, beta1_key, beta2_key, tau_key = FLOWER[kind]
    p = NodeOptParams(kind=kind, eta=0.3, beta1=0.8 if beta1_key else 0.0, beta2=0.95, tau=0.05)
    flower_params = {eta_key: p.eta}
    flower_params.update({beta1_key: p.beta1} if beta1_key else {})
    flower_params.update({beta2_key: p.beta2} if beta2_key else {})
    flower_params.update({tau_key: p.tau} if tau_key else {})
    rng = np.random.default_rng(7)
    theta0 = rng.normal(size=5)
    strategy = server_strategy(name, [theta0.copy()], **flower_params)
    state, flower_theta = {}, theta0
    for rnd in range(1, 5):
        models = [flower_theta + rng.normal(scale=s, size=5) for s in (0.1, 1.0, 3.0)]
        examples = [int(n) for n in rng.integers(1, 50, size=3)]
        mean = torch.tensor(weighted_mean([m.tolist() for m in models], examples), dtype=torch.float64)
        new_flower = server_round(strategy, rnd, models, examples)
        state, new_theta = node_opt_step(state, torch.tensor(flower_theta), mean, p)
        step, flower_step = (new_theta - torch.tensor(flower_theta)).numpy(), new_flower - flower_theta
        if kind == "fedadam":  # Flower's server_round t uses t + 1 in the correction
            step = step * math.sqrt(1 - p.beta2 ** (rnd + 1)) / (1 - p.beta1 ** (rnd + 1))
        np.testing.assert_allclose(step, flower_step, rtol=1e-10, atol=1e-12)
        flower_theta = new_flower
    assert int(state["step"]) == 4


@pytest.mark.parametrize(
    ("opt", "message"),
    [
        ("{kind: fedavg, tau: 0.1}", r"tau: 0.1 is read by kind fedadagrad or fedadam or fedyogi, not by 'fedavg'"),
        ("{kind: fedavgm, beta2: 0.5}", r"beta2: 0.5 is read by kind fedadam or fedyogi, not by 'fedavgm'"),
        ("{kind: fedadagrad, beta2: 0.5}", r"beta2: 0.5 is read by kind fedadam or fedyogi, not by 'fedadagrad'"),
        ("{kind: fedadam, alphas: [0.5]}", r"alphas: \[0.5\] is read by kind interp, not by 'fedadam'"),
        ("{kind: interp, beta1: 0.5}", r"beta1: 0.5 is read by kind fedavgm or fedadagrad or fedadam or fedyogi"),
    ],
)
def test_a_hyperparameter_the_kind_does_not_read_is_an_error_naming_the_key(opt, message):
    """``beta2`` of ``fedavgm`` (its momentum is ``beta1``) or ``tau`` of ``fedavg`` would be silently ignored;
    the same keys at their defaults are what every saved config writes, so they pass."""
    from bhfl_core.config.base import ConfigError
    from tests.small import small_config

    with pytest.raises(ConfigError, match=rf"tree.edge.opt_up: {message}"):
        small_config(f"tree.edge.opt_up={opt}", "tree.edge.holdout=0.2")
    written = small_config("tree.edge.opt_up={kind: fedavgm, beta1: 0.5, beta2: 0.99, tau: 0.001}")
    assert written.tree.edge.opt_up.beta1 == 0.5  # the read key, and the others at their defaults
    with pytest.raises(ConfigError, match=r"tree.residuals.up\[0\].opt: tau: 0.1 is read by kind fedadagrad"):
        small_config("tree.residuals={up: [{from: edge, to: root, opt: {kind: fedavgm, tau: 0.1}}]}")
