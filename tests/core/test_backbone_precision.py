"""The frozen backbone of a LoRA run in bf16 or quantised (``model.backbone_dtype``, ``model.quantization``).

bhfl_core/learning/backbone_precision.py: the backbone lowered, the adapters and head
float32, what travels float32; the errors that name the key.
"""

import importlib.util

import pytest
import torch

from bhfl_core.algorithm.tree import TrainParams
from bhfl_core.config.base import ConfigError
from bhfl_core.learning.local_train import train_model
from bhfl_core.learning.models import build_model
from bhfl_core.learning.params import get_flat
from bhfl_core.store.warm_start import config_mismatch
from tests.small import small_config

LABELS = [f"l{i}" for i in range(10)]
CPU = torch.device("cpu")
LORA = "model.adapter={r: 4}"


def _model(*overrides: str, task: str = "classification"):
    return build_model(small_config(*overrides).model, task, LABELS if task == "classification" else [], 400, 0, 0)


def _data(n: int = 16) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.randint(5, 400, (n, 12), generator=gen),
        "attention_mask": torch.ones(n, 12, dtype=torch.long),
        "labels": torch.randint(0, 10, (n,), generator=gen),
    }


def test_a_bf16_backbone_is_the_float32_one_rounded_under_the_same_float32_adapters_and_head():
    ref, low = _model(LORA), _model(LORA, "model.backbone_dtype=bf16")
    ref_params = dict(ref.named_parameters())
    for name, p in low.named_parameters():
        if p.requires_grad:  # adapters and head: float32, the float32 build's draws bit for bit
            assert p.dtype is torch.float32 and torch.equal(p, ref_params[name]), name
        else:
            assert p.dtype is torch.bfloat16 and torch.equal(p, ref_params[name].to(torch.bfloat16)), name
    assert get_flat(low).dtype is torch.float32 and torch.equal(get_flat(low), get_flat(ref))
    # the same model, its backbone rounded but computed in float32: bf16 activations are all that differ
    for p in ref.parameters():
        if not p.requires_grad:
            p.data = p.data.to(torch.bfloat16).float()
    batch = {k: v for k, v in _data(8).items() if k != "labels"}
    with torch.no_grad():
        a, b = ref.eval()(**batch).logits, low.eval()(**batch).logits
    assert b.dtype is torch.float32 and torch.allclose(a, b, atol=2e-2), (a - b).abs().max()


def test_a_bf16_backbone_trains_float32_adapters_and_stays_frozen():
    model = _model(LORA, "model.backbone_dtype=bf16")
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    start = get_flat(model).clone()
    result = train_model(model, _data(), TrainParams(lr=0.01, batch_size=4), seed=1, device=CPU)
    assert result.steps == 4 and torch.isfinite(torch.tensor(result.loss))
    after = get_flat(model)
    assert after.dtype is torch.float32 and not torch.equal(after, start)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)
    float32 = _model(LORA)  # the same steps on the float32 backbone: close, not equal
    train_model(float32, _data(), TrainParams(lr=0.01, batch_size=4), seed=1, device=CPU)
    moved, moved32 = after - start, get_flat(float32) - start
    assert torch.nn.functional.cosine_similarity(moved, moved32, dim=0) > 0.95


def test_a_bf16_masked_lm_keeps_its_tied_decoder_and_scores_in_float32():
    model = _model(LORA, "model.backbone_dtype=bf16", "data.task=mlm", task="mlm")
    base = model.get_base_model()
    assert base.get_output_embeddings().weight is base.get_input_embeddings().weight
    assert base.get_input_embeddings().weight.dtype is torch.bfloat16
    ids = _data(4)["input_ids"]
    out = model(input_ids=ids, labels=torch.where(ids % 5 == 0, ids, -100))
    assert out.logits.dtype is torch.float32 and out.loss.dtype is torch.float32
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None and g.dtype is torch.float32 for g in grads.values())
    assert all(bool(g.abs().sum() > 0) for n, g in grads.items() if "lora_B" in n)  # B starts at 0, A's grad too


def test_a_lowered_backbone_needs_adapters_and_one_precision_key():
    with pytest.raises(ConfigError, match=r"model\.backbone_dtype: a backbone below float32 needs model\.adapter"):
        small_config("model.backbone_dtype=bf16")
    with pytest.raises(ConfigError, match=r"model\.quantization: a backbone below float32 needs model\.adapter"):
        small_config("model.quantization={bits: 4}")
    with pytest.raises(ConfigError, match=r"model\.backbone_dtype: a quantised backbone computes in"):
        small_config(LORA, "model.quantization={bits: 4}", "model.backbone_dtype=bf16")
    with pytest.raises(ConfigError, match=r"model\.quantization\.bits"):
        small_config(LORA, "model.quantization={bits: 2}")


def test_runs_of_any_backbone_precision_warm_start_from_each_other():
    from bhfl_core.config.schema import dump

    float32, bf16 = dump(small_config(LORA)), dump(small_config(LORA, "model.backbone_dtype=bf16"))
    assert config_mismatch(float32, bf16) is None and config_mismatch(bf16, float32) is None
    assert config_mismatch(dump(small_config()), bf16) is None  # a full run as the bf16 run's backbone
    old = {**float32, "model": {k: v for k, v in float32["model"].items() if k != "backbone_dtype"}}
    assert config_mismatch(old, bf16) is None  # a run made before the key


HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None


@pytest.mark.skipif(HAS_BNB and torch.cuda.is_available(), reason="this machine can quantise")
def test_quantization_without_the_package_or_a_gpu_is_one_line_naming_the_key():
    why = "need the bitsandbytes package" if not HAS_BNB else "need a CUDA device"
    with pytest.raises(ConfigError, match=rf"^model\.quantization: 4-bit backbones.*{why}"):
        _model(LORA, "model.quantization={bits: 4}")


@pytest.mark.skipif(not (HAS_BNB and torch.cuda.is_available()), reason="needs a CUDA GPU and bitsandbytes ([gpu])")
def test_a_4bit_nf4_backbone_trains_float32_adapters_on_the_gpu():
    from bitsandbytes.nn import Linear4bit

    model = _model(LORA, "model.quantization={bits: 4}")
    assert any(isinstance(m, Linear4bit) for m in model.modules())
    ref = _model(LORA)
    assert get_flat(model).dtype is torch.float32 and get_flat(model).numel() == get_flat(ref).numel()
    gpu = torch.device("cuda")
    batch = {k: v.to(gpu) for k, v in _data(8).items() if k != "labels"}
    with torch.no_grad():
        a, b = ref.to(gpu).eval()(**batch).logits, model.eval()(**batch).logits
    assert b.dtype is torch.float32 and torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.9
    start = get_flat(model).clone()
    result = train_model(model, _data(), TrainParams(lr=0.01, batch_size=4), seed=1, device=gpu)
    assert torch.isfinite(torch.tensor(result.loss)) and get_flat(model).dtype is torch.float32
    assert not torch.equal(get_flat(model), start)


def test_quantization_on_cpu_workers_is_refused_at_config_time():
    with pytest.raises(ConfigError, match=r"model\.quantization: bitsandbytes backbones need CUDA devices"):
        small_config(LORA, "model.quantization={bits: 8}", "runtime.device=cpu")
