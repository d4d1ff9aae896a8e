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
