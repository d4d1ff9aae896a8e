"""Sample-level DP-SGD in a client's TRAIN (bhfl_core/learning/dp_sgd.py through Opacus) and its accounting."""

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from bhfl_core.algorithm.privacy_accounting import sample_epsilon
from bhfl_core.algorithm.privacy_params import DpSgdParams
from bhfl_core.algorithm.tree import TrainParams
from bhfl_core.learning.local_train import train_model
from bhfl_core.learning.models import build_model
from bhfl_core.learning.params import get_flat, set_flat
from tests.small import small_config

CPU = torch.device("cpu")


class Line(nn.Module):
    """``y = w x`` with a squared loss: the per-example gradient is ``2 x (w x - y)``, by hand."""

    def __init__(self, w: float) -> None:
        super().__init__()
        self.lin = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            self.lin.weight.fill_(w)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(loss=(self.lin(x).squeeze(-1) - labels).pow(2).mean())


DATA = {"x": torch.tensor([[1.0], [2.0], [3.0], [4.0]]), "labels": torch.zeros(4)}


def test_each_examples_gradient_is_clipped_before_the_mean_step():
    """w = 1, y = 0: per-example gradients 2 x^2 = 2, 8, 18, 32; clipped at 5: 2, 5, 5, 5; mean 4.25; lr 0.1."""
    model = Line(1.0)
    dp = DpSgdParams(noise_multiplier=0.0, max_grad_norm=5.0)
    train_model(model, DATA, TrainParams(lr=0.1, batch_size=4, optimizer="sgd", dp_sgd=dp), seed=0, device=CPU)
    assert model.lin.weight.item() == pytest.approx(1.0 - 0.1 * (2 + 5 + 5 + 5) / 4)
    plain = Line(1.0)
    train_model(plain, DATA, TrainParams(lr=0.1, batch_size=4, optimizer="sgd"), seed=0, device=CPU)
    assert plain.lin.weight.item() == pytest.approx(1.0 - 0.1 * (2 + 8 + 18 + 32) / 4)


def test_noise_is_seeded_by_the_call_and_the_model_is_plain_afterwards():
    def trained(seed: int, z: float = 1.0) -> tuple[nn.Module, torch.Tensor]:
        model = Line(1.0)
        dp = DpSgdParams(noise_multiplier=z, max_grad_norm=1.0)
        train_model(model, DATA, TrainParams(lr=0.1, batch_size=2, optimizer="sgd", dp_sgd=dp), seed, CPU)
        return model, get_flat(model)

    model, first = trained(7)
    assert torch.equal(first, trained(7)[1]) and not torch.equal(first, trained(8)[1])
    assert not torch.equal(first, trained(7, z=0.0)[1])  # the noise moved it
    assert not model.lin._forward_hooks and not model.lin._backward_hooks  # the reused model is plain again
    assert not hasattr(model.lin.weight, "grad_sample")


def test_a_transformers_client_trains_privately_and_deterministically():
    cfg = small_config()
    model = build_model(cfg.model, "classification", [f"l{i}" for i in range(10)], 400, 0, seed=0)
    gen = torch.Generator().manual_seed(0)
    data = {
        "input_ids": torch.randint(5, 400, (12, 16), generator=gen),
        "attention_mask": torch.ones(12, 16, dtype=torch.long),
        "labels": torch.randint(0, 10, (12,), generator=gen),
    }
    start = get_flat(model).clone()
    dp = DpSgdParams(noise_multiplier=0.5, max_grad_norm=1.0)
    params = TrainParams(lr=0.05, batch_size=4, optimizer="sgd", dp_sgd=dp)
    outs = []
    for _ in range(2):
        set_flat(model, start)
        result = train_model(model, data, params, seed=3, device=CPU)
        outs.append(get_flat(model).clone())
    assert result.steps == 3 and torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], start)


def test_the_clients_epsilon_is_the_poisson_sampled_gaussian_composed_over_its_steps():
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    dp = DpSgdParams(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5)
    accountant = RdpAccountant()
    event = dp_accounting.PoissonSampledDpEvent(32 / 400, dp_accounting.GaussianDpEvent(1.1))
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, 50))
    assert sample_epsilon(dp, 400, 32, 50) == accountant.get_epsilon(1e-5)
    assert sample_epsilon(dp, 400, 32, 10) < sample_epsilon(dp, 400, 32, 50)
    assert sample_epsilon(DpSgdParams(0.0, 1.0), 400, 32, 1) == math.inf and sample_epsilon(dp, 400, 32, 0) == 0.0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["tree.root.train.dp_sgd={noise_multiplier: 1, max_grad_norm: 1}"],
            "tree.root.train.dp_sgd: sample-level DP-SGD protects clients' private examples; 'root' trains",
        ),
        (
            ["tree.client.train.dp_sgd={noise_multiplier: 1, max_grad_norm: 1}", "tree.client.train.mu=0.1"],
            "tree.client.train.dp_sgd: FedProx's term (mu: 0.1) would be overwritten",
        ),
        (  # Ditto's personal TRAIN: Opacus's step would drop lambda (v - w) and train a plain local model
            ["tree.client.personal={mu: 0.1, dp_sgd: {noise_multiplier: 1, max_grad_norm: 1}}"],
            "tree.client.personal.dp_sgd: Ditto's lambda (mu: 0.1) would be overwritten",
        ),
        (
            ["tree.client.train.dp_sgd={noise_multiplier: 1, max_grad_norm: 1}", "tree.client.train.precision=bf16"],
            "tree.client.train.dp_sgd: DP-SGD runs in fp32 only",
        ),
        (["tree.client.train.dp_sgd={noise_multiplier: 1}"], "tree.client.train.dp_sgd.max_grad_norm: Field required"),
    ],
)
def test_dp_sgd_configs_that_cannot_work_are_rejected_naming_the_key(overrides, message):
    from bhfl_core.config.base import ConfigError

    with pytest.raises(ConfigError) as err:
        small_config(*overrides)
    assert message in str(err.value)
