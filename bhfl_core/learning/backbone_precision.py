"""How a LoRA run holds its frozen backbone: float32, bfloat16, or quantised to 4/8 bits (bitsandbytes, GPU).

Only the backbone is lowered. The adapters and the task head, the parameters that are
trained, sent and aggregated (``params.get_flat``), stay float32: the optimizer's
state and its small updates (Adam's second moments, an lr of 1e-4 times a gradient)
would round away in bf16's 8-bit mantissa, and every fold of the tree (weighted sums,
DP noise, secure-aggregation masks, compression residuals) is float32 arithmetic on
those vectors, unchanged by this option. float16 is not offered: its range would need
loss scaling for gradients flowing through a frozen float16 backbone, where bf16 has
float32's range.

``lower_backbone`` is applied after the adapters are wrapped in, so the random draws of
the build (the seeded backbone, the adapters, the head) are the float32 build's: a bf16
run starts from the float32 run's model rounded, adapters and head bit-identical. At
the boundary a float32 module reads bf16 activations: each trainable module casts its
floating inputs to its own dtype (peft's LoRA layers already do; the head does not),
and the output embeddings' logits (a masked LM's frozen, tied decoder) are cast to
float32, so the loss and the gradients start in float32.

Quantisation (``quantized_base``) follows QLoRA: the seeded float32 base is saved and
loaded back through ``from_pretrained`` with a ``BitsAndBytesConfig`` on the CUDA
device, then ``peft.prepare_model_for_kbit_training`` freezes it and casts its
non-quantised parameters (layer norms, embeddings, the head) to float32.
"""

from __future__ import annotations

import importlib.util
import tempfile
from typing import TYPE_CHECKING, Any

import torch

from bhfl_core.config.base import ConfigError

if TYPE_CHECKING:
    from torch import nn

    from bhfl_core.learning.model_config import Quantization

DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16}
# never quantised: the heads a run trains or ties (peft's SEQ_CLS heads, BERT's masked-LM head, a causal lm_head)
SKIP_QUANTISATION = ["classifier", "score", "cls", "lm_head"]


def lower_backbone(model: nn.Module, backbone_dtype: str) -> nn.Module:
    """``model`` (in place) with its frozen floating parameters in ``backbone_dtype``; float32: untouched."""
    dtype = DTYPES[backbone_dtype]
    if dtype is torch.float32:
        return model
    for p in model.parameters():
        if not p.requires_grad and p.is_floating_point():
            p.data = p.data.to(dtype)  # a tied parameter is one object: both uses see the cast
    for module in model.modules():
        if any(p.requires_grad for p in module.parameters(recurse=False)):
            module.register_forward_pre_hook(_inputs_to_own_dtype, with_kwargs=True)
    peft_model: Any = model  # a peft model (the base under get_base_model) or a plain transformers one
    base: Any = peft_model.get_base_model() if hasattr(model, "get_base_model") else model
    output = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if isinstance(output, torch.nn.Module):
        output.register_forward_hook(_output_to_float32)
    return model


def _inputs_to_own_dtype(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    dtype = next(p.dtype for p in module.parameters(recurse=False) if p.requires_grad)

    def cast(x: Any) -> Any:
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}


def _output_to_float32(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    return output.float() if isinstance(output, torch.Tensor) and output.is_floating_point() else output


def check_quantization(quantization: Quantization) -> None:
    """Fail with one line naming ``model.quantization`` when this process cannot quantise (no package, no GPU)."""
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(
            f"model.quantization: {quantization.bits}-bit backbones need the bitsandbytes package, which is not "
            "installed: pip install '.[gpu]' (CUDA machines only), or remove model.quantization"
        )
    if not torch.cuda.is_available():
        raise ConfigError(
            f"model.quantization: {quantization.bits}-bit backbones (bitsandbytes) need a CUDA device and this "
            "worker has none: run on a GPU, or use model.backbone_dtype: bf16 (any device)"
        )


def quantized_base(built: nn.Module, quantization: Quantization) -> nn.Module:
    """``built`` (a transformers model, float32) reloaded quantised on the current CUDA device, ready for LoRA."""
    check_quantization(quantization)
    from peft import prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig

    compute = DTYPES[quantization.compute_dtype]
    config = BitsAndBytesConfig(  # type: ignore[no-untyped-call]
        load_in_4bit=quantization.bits == 4,
        load_in_8bit=quantization.bits == 8,
        bnb_4bit_quant_type=quantization.quant_type,
        bnb_4bit_use_double_quant=quantization.double_quant,
        bnb_4bit_compute_dtype=compute,
        llm_int8_skip_modules=SKIP_QUANTISATION,
    )
    with tempfile.TemporaryDirectory(prefix="bhfl-quantise-") as tmp:
        built.save_pretrained(tmp)  # type: ignore[operator]
        loaded = type(built).from_pretrained(  # type: ignore[attr-defined]
            tmp, quantization_config=config, device_map={"": torch.cuda.current_device()}
        )
    prepared: nn.Module = prepare_model_for_kbit_training(  # type: ignore[no-untyped-call]
        loaded, use_gradient_checkpointing=False
    )
    return prepared
