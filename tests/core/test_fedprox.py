"""FedProx: TRAIN with the proximal term (mu/2)·||theta − theta0||² (``train.mu``)."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from bhfl_core.algorithm.tree import TrainParams
from bhfl_core.config.base import ConfigError
from bhfl_core.config.loader import load_config
from bhfl_core.config.topology import ClientInfo, build_tree
from bhfl_core.learning import local_train
from bhfl_core.learning.local_train import train_model
from bhfl_core.learning.models import build_model
from bhfl_core.learning.params import get_flat, set_flat, trainable_parameters
from tests.small import small_config

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


class Scalar(nn.Module):
    """One weight ``w``; loss = mean((w·x − y)²), so d loss / d w = 2·x·(w·x − y) by hand."""

    def __init__(self, w: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([w]))
        self.unused = nn.Parameter(torch.tensor([3.0]))  # never in the forward pass: no loss gradient

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(loss=((self.w * x).squeeze(-1) - labels).pow(2).mean())


@pytest.mark.parametrize(
    "weight_decay, want, want_plain, want_unused",
    [
        # w0 = 2, x = 1, y = 0, lr = 0.25, mu = 0.5, two SGD steps of one row each.
        # step 1 (w = w0, proximal gradient 0): g = 2·2 = 4 -> w1 = 2 − 0.25·4 = 1
        # step 2: g = 2·1 + 0.5·(1 − 2) = 1.5 -> w2 = 1 − 0.25·1.5 = 0.625   (mu = 0: 0.5)
        # the unused weight (3) gets only mu·(u − u0) = 0: it stays at 3
        (0.0, 0.625, 0.5, 3.0),
        # with weight decay 0.5 (SGD adds wd·w to the gradient inside step(), after the proximal term):
        # step 1: g = 4 + 0 + 0.5·2 = 5 -> w1 = 0.75
        # step 2: g = 2·0.75 + 0.5·(0.75 − 2) + 0.5·0.75 = 1.25 -> w2 = 0.75 − 0.3125 = 0.4375
        # (mu = 0: step 2 g = 1.5 + 0.375 = 1.875 -> w2 = 0.75 − 0.46875 = 0.28125)
        # the unused weight u: step 1: g = 0 + 0.5·3 = 1.5 -> u1 = 2.625; step 2, decay and proximal
        # gradient: g = 0.5·(2.625 − 3) + 0.5·2.625 = 1.125 -> u2 = 2.625 − 0.28125 = 2.34375
        (0.5, 0.4375, 0.28125, 2.34375),
    ],
)
def test_proximal_sgd_steps_match_the_hand_computed_values(weight_decay, want, want_plain, want_unused):
    data = {"x": torch.ones(2, 1), "labels": torch.zeros(2)}
    params = TrainParams(lr=0.25, epochs=1, batch_size=1, optimizer="sgd", weight_decay=weight_decay, mu=0.5)
    model = Scalar(2.0)
    result = train_model(model, data, params, seed=0, device=CPU)
    assert result.steps == 2
    assert model.w.item() == want  # exact: every value above is a dyadic rational
    # a weight with no loss gradient still gets the proximal one, as if the term were in the loss
    assert model.unused.item() == want_unused

    plain = Scalar(2.0)
    params = TrainParams(lr=0.25, epochs=1, batch_size=1, optimizer="sgd", weight_decay=weight_decay)
    train_model(plain, data, params, seed=0, device=CPU)
    assert plain.w.item() == want_plain  # the same steps without the proximal gradient


def _tiny_bert(seed: int = 0) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    cfg = small_config()
    vocab = cfg.model.tiny.vocab_size
    model = build_model(cfg.model, "classification", ["a", "b", "c"], vocab, 0, seed)
    g = torch.Generator().manual_seed(seed)
    n, width = 40, 16
    lengths = torch.randint(3, width + 1, (n,), generator=g)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    data = {
        "input_ids": torch.randint(5, vocab, (n, width), generator=g) * mask,
        "attention_mask": mask,
        "token_type_ids": torch.zeros(n, width, dtype=torch.long),
        "labels": torch.randint(0, 3, (n,), generator=g),
    }
    return model, data


def _reference_loop(model, data, params, seed, mu=0.0):
    """train_model before FedProx (its loop verbatim), optionally with the term written into the loss."""
    n = len(next(iter(data.values())))
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    optimizer = local_train._optimizer(model, params)
    anchor = [p.detach().clone() for p in trainable_parameters(model)]
    model.train()
    for _ in range(params.epochs):
        for batch in local_train._batches(data, torch.randperm(n, generator=generator), params.batch_size):
            loss = model(**batch).loss
            if mu > 0:
                loss = loss + mu / 2 * sum((p - a).pow(2).sum() for p, a in zip(trainable_parameters(model), anchor))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def test_mu_zero_is_bit_identical_to_the_plain_loop_and_builds_no_anchor(monkeypatch):
    params = TrainParams(lr=3e-3, epochs=2, batch_size=8, weight_decay=0.01)
    model, data = _tiny_bert()
    start = get_flat(model)

    _reference_loop(model, data, params, seed=7)
    reference = get_flat(model)

    def no_anchor(*args, **kwargs):
        raise AssertionError("mu = 0 must not build the proximal anchor")

    monkeypatch.setattr(local_train, "_Proximal", no_anchor)
    for p in (params, TrainParams(lr=3e-3, epochs=2, batch_size=8, weight_decay=0.01, mu=0.0)):
        set_flat(model, start)
        train_model(model, data, p, seed=7, device=CPU)
        assert torch.equal(get_flat(model), reference)


def test_gradient_form_equals_the_term_in_the_loss_with_adamw_and_weight_decay():
    params = TrainParams(lr=3e-3, epochs=2, batch_size=8, optimizer="adamw", weight_decay=0.05, mu=0.7)
    model, data = _tiny_bert()
    start = get_flat(model)
    _reference_loop(model, data, params, seed=3, mu=params.mu)
    in_loss = get_flat(model)
    set_flat(model, start)
    train_model(model, data, params, seed=3, device=CPU)
    assert not torch.equal(in_loss, start)
    torch.testing.assert_close(get_flat(model), in_loss, rtol=0, atol=1e-5)


def test_large_mu_keeps_the_model_closer_to_its_anchor():
    model, data = _tiny_bert()
    anchor = get_flat(model)
    distance = {}
    for mu in (0.0, 10.0):
        set_flat(model, anchor)
        train_model(model, data, TrainParams(lr=3e-3, epochs=3, batch_size=8, mu=mu), seed=1, device=CPU)
        distance[mu] = float((get_flat(model) - anchor).norm())
    assert 0 < distance[10.0] < distance[0.0]


def test_mu_reaches_every_level_and_is_validated():
    cfg = load_config(
        REPO / "configs" / "embedded.yaml",
        ["tree.client.train.mu=0.05", "tree.root.train.mu=0.2", "tree.nodes.en-00.train={lr: 0.01, mu: 0.3}"],
    )
    clients = [ClientInfo(f"{lang}-{i:02d}", lang, 10) for lang in cfg.data.source.languages for i in range(6)]
    tree = build_tree(cfg, clients)
    assert tree["de-01"].settings.train is not None and tree["de-01"].settings.train.mu == 0.05
    assert tree["en-00"].settings.train is not None and tree["en-00"].settings.train.mu == 0.3
    assert tree.root.settings.train is not None and tree.root.settings.train.mu == 0.2
    default = load_config(REPO / "configs" / "embedded.yaml")
    assert default.tree.client.train.mu == 0.0

    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs" / "embedded.yaml", ["tree.client.train.mu=-1"])
    assert "tree.client.train.mu" in str(err.value)


def test_sgd_whose_proximal_step_oversteps_its_anchor_is_refused():
    # lr·mu >= 1: one SGD step multiplies the distance to the anchor by 1 - lr·mu <= 0 (FedNova's normaliser too)
    embedded = REPO / "configs" / "embedded.yaml"
    load_config(embedded, ["tree.nodes.en-00.train={optimizer: sgd, lr: 0.33, mu: 3}"])  # 0.99: accepted
    load_config(embedded, ["tree.nodes.en-00.train={optimizer: adamw, lr: 0.5, mu: 4}"])  # AdamW scales its steps
    load_config(embedded, ["tree.nodes.en-00.train={optimizer: adamw, lr: 0.5, weight_decay: 4}"])  # and decouples
    for override, message in (
        ("tree.nodes.en-00.train={optimizer: sgd, lr: 0.5, mu: 2}", r"tree\.nodes\.en-00\.train\.mu: FedProx.* = 1 "),
        ("tree.client.personal={optimizer: sgd, lr: 0.5, mu: 5}", r"tree\.client\.personal\.mu: Ditto's .* = 2\.5 "),
        # weight decay pulls towards zero the same way (SGD adds weight_decay·p to the gradient)
        (
            "tree.nodes.en-00.train={optimizer: sgd, lr: 0.5, weight_decay: 3}",
            r"en-00\.train\.weight_decay: .* = 1\.5 ",
        ),
    ):
        with pytest.raises(ConfigError, match=rf"{message}>= 1: every step would move the parameters of 'en-00'"):
            load_config(embedded, [override])
