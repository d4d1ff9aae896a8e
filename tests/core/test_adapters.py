"""LoRA adapters as the federated parameters (``model.adapter``; bhfl_core/learning/models.py::with_adapter)."""

from typing import Any

import pytest
import torch

from bhfl_core.algorithm.tree import TrainParams
from bhfl_core.learning.local_train import train_model
from bhfl_core.learning.models import build_model
from bhfl_core.learning.params import get_flat, set_flat
from tests.small import small_config

LABELS = [f"l{i}" for i in range(10)]
CPU = torch.device("cpu")


def _model(*overrides: str, seed: int = 0):
    return build_model(small_config(*overrides).model, "classification", LABELS, 400, 0, seed)


def test_only_the_adapters_and_the_head_are_trained_and_federated():
    model = _model("model.adapter={r: 4, alpha: 8}")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or "classifier" in n for n in trainable), trainable
    full = _model()
    hidden, layers = 32, 1  # tests/small.py: query and value of each layer get A (r x h) and B (h x r)
    adapters = layers * 2 * 2 * 4 * hidden
    head = sum(p.numel() for n, p in full.named_parameters() if n.startswith("classifier"))  # 32 x 10 + 10
    assert get_flat(model).numel() == adapters + head  # the flat vector that travels is the adapters and the head
    assert get_flat(model).numel() < get_flat(full).numel() / 20


def test_training_moves_the_adapters_and_leaves_the_backbone_bit_identical():
    model = _model("model.adapter={r: 4, alpha: 8}")
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    start = get_flat(model).clone()
    gen = torch.Generator().manual_seed(0)
    data = {
        "input_ids": torch.randint(5, 400, (16, 12), generator=gen),
        "attention_mask": torch.ones(16, 12, dtype=torch.long),
        "labels": torch.randint(0, 10, (16,), generator=gen),
    }
    train_model(model, data, TrainParams(lr=0.01, batch_size=4), seed=1, device=CPU)
    assert not torch.equal(get_flat(model), start)
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)


def test_the_adapters_initialisation_is_the_seeds_and_loading_a_vector_sets_only_the_adapters():
    a, b = _model("model.adapter={r: 4}"), _model("model.adapter={r: 4}")
    assert torch.equal(get_flat(a), get_flat(b)) and not torch.equal(
        get_flat(a), get_flat(_model("model.adapter={r: 4}", seed=1))
    )
    backbone = {n: p.detach().clone() for n, p in a.named_parameters() if not p.requires_grad}
    set_flat(a, torch.zeros_like(get_flat(a)))
    assert float(get_flat(a).abs().sum()) == 0.0
    assert all(torch.equal(p, backbone[n]) for n, p in a.named_parameters() if not p.requires_grad)


def test_a_backbone_is_loaded_under_adapters_drawn_as_without_it():
    full = _model(seed=5)
    backbone = torch.randn(get_flat(full).numel(), generator=torch.Generator().manual_seed(1))
    set_flat(full, backbone)
    cfg = small_config("model.adapter={r: 4}").model
    warm = build_model(cfg, "classification", LABELS, 400, 0, 0, backbone=backbone)
    fresh = _model("model.adapter={r: 4}")
    base = dict(full.named_parameters())
    for name, p in warm.get_base_model().named_parameters():
        if "lora_" in name or "modules_to_save" in name:
            continue
        # peft's names for the wrapped originals: query.base_layer.weight, classifier.original_module.weight
        assert torch.equal(p, base[name.replace(".base_layer", "").replace(".original_module", "")]), name
    lora = {n: p for n, p in warm.named_parameters() if "lora_" in n}
    assert lora and all(torch.equal(p, dict(fresh.named_parameters())[n]) for n, p in lora.items())  # same draws
    head = {n: p for n, p in warm.named_parameters() if "modules_to_save" in n}
    assert {n.split(".")[-1]: p for n, p in head.items()}.keys() == {"weight", "bias"}
    for n, p in head.items():  # the trained head starts from the backbone's
        assert torch.equal(p, base[f"classifier.{n.split('.')[-1]}"]), n
    with pytest.raises(ValueError, match="trainable parameters"):
        build_model(cfg, "classification", LABELS, 400, 0, 0, backbone=backbone[:-1])


def test_lora_masked_lm_trains_the_adapters_alone_and_its_loss_goes_down():
    """Continued pretraining: the decoder stays the frozen, tied word embeddings; the adapters lower the loss."""
    from bhfl_core.learning.mlm import MaskingSpec, mask_tokens, mlm_transform

    full = build_model(small_config("data.task=mlm").model, "mlm", [], 400, 0, 0)
    with torch.no_grad():  # a pretrained model's embeddings (std ~1), not a fresh init's 0.02 that caps the logits
        full.get_input_embeddings().weight.mul_(25)
    cfg = small_config("model.adapter={r: 4}", "data.task=mlm").model
    model = build_model(cfg, "mlm", [], 400, 0, 0, backbone=get_flat(full))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 4 and all("lora_" in n for n in trainable), trainable  # query and value: A and B
    base = model.get_base_model()
    assert base.get_output_embeddings().weight is base.get_input_embeddings().weight  # still tied, frozen
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    spec = MaskingSpec((0, 1, 2, 3), 4, 400, 0.15)
    ids = torch.randint(5, 21, (64, 16), generator=torch.Generator().manual_seed(0))  # 16 of 400 tokens occur
    held_out = mask_tokens(ids, None, spec.special_ids, 4, 400, 0.15, torch.Generator().manual_seed(9))

    def loss() -> float:
        model.eval()
        with torch.no_grad():
            return float(model(input_ids=held_out[0], labels=held_out[1]).loss)

    before = loss()
    data = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    train_model(model, data, TrainParams(lr=0.01, batch_size=16, epochs=5), 1, CPU, transform=mlm_transform(spec))
    assert loss() < before - 0.5  # 9.09 -> 8.21 measured
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)


def _lora_layers(model) -> dict[str, Any]:
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def test_alpha_dropout_and_target_modules_reach_peft():
    custom = _lora_layers(_model("model.adapter={r: 4, alpha: 12, dropout: 0.25, target_modules: [query, key]}"))
    assert sorted(name.rsplit(".", 1)[-1] for name in custom) == ["key", "query"]  # not peft's default: value
    for layer in custom.values():
        assert layer.scaling == {"default": 3.0}  # lora_alpha / r = 12 / 4 (peft's default alpha, 8: 2.0)
        assert isinstance(layer.lora_dropout["default"], torch.nn.Dropout)
        assert layer.lora_dropout["default"].p == 0.25
    default = _lora_layers(_model("model.adapter={r: 4}"))  # alpha 16, no dropout, query and value
    assert sorted(name.rsplit(".", 1)[-1] for name in default) == ["query", "value"]
    assert all(layer.scaling == {"default": 4.0} for layer in default.values())
    assert all(not isinstance(layer.lora_dropout["default"], torch.nn.Dropout) for layer in default.values())
