"""The ``model`` section of an experiment config: which model, its size, its adapters, where it starts.

It lives in ``learning`` because the model builders (``models.py``) and the tokenizer
(``data_prep/tokenizer.py``) read it: the rest of the schema (``bhfl_core/config``)
validates names against the algorithm's and learning's registries, so it sits above
both, and a learning module importing it would tie the rooms in a cycle (docs/design.md,
"The rooms"). ``bhfl_core.config.schema`` holds it as ``ExperimentConfig.model``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from bhfl_core.config.base import Strict


class TinyBert(Strict):
    """A small BERT built from a config (no download); the tokenizer is trained on proxy data."""

    vocab_size: Annotated[int, Field(ge=100)] = 3000
    hidden_size: Annotated[int, Field(gt=0)] = 64
    num_hidden_layers: Annotated[int, Field(gt=0)] = 2
    num_attention_heads: Annotated[int, Field(gt=0)] = 2
    intermediate_size: Annotated[int, Field(gt=0)] = 128
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0

    @model_validator(mode="after")
    def _heads(self) -> TinyBert:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        return self


AdapterAggregation = Literal["ab-mean", "ffa", "exact", "fedsa"]
"""How a server folds its children's adapters (bhfl_core/algorithm/adapter_rule.py; docs/config.md):
``ab-mean`` averages A and B apart (FedIT), ``ffa`` freezes A (FFA-LoRA: the mean of B is exact),
``exact`` re-factorises the mean of the products B_i·A_i to rank r by SVD, ``fedsa`` averages A
while each client keeps its own B (FedSA-LoRA)."""


class AdapterSettings(Strict):
    """Low-rank adapters (LoRA, through ``peft``) as the federated parameters: the backbone stays frozen.

    ``target_modules``: the modules that get adapters (unset: peft's default for the
    architecture, e.g. BERT's and XLM-R's ``query`` and ``value``). ``rank_pattern`` /
    ``alpha_pattern`` (module name pattern -> r / alpha, peft's), ``use_rslora``,
    ``use_dora``, ``init_lora_weights`` and ``modules_to_save`` (trained and federated whole,
    beside the classifier head peft always adds) go to peft's ``LoraConfig`` as they are;
    a pattern or module that matches nothing is an error naming the key (``lora_options.py``).
    ``aggregation``: ``AdapterAggregation``.
    """

    kind: Literal["lora"] = "lora"
    r: Annotated[int, Field(ge=1)] = 8
    alpha: Annotated[int, Field(ge=1)] = 16
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    target_modules: list[str] | None = None
    # how a server folds its children's adapters, and peft's other LoRA options (docs/config.md, model.adapter)
    aggregation: AdapterAggregation = "ab-mean"
    error_metric: bool = False  # ab-mean: log adapter/ab_error each round (the children's products are folded too)
    rank_pattern: dict[str, Annotated[int, Field(ge=1)]] = Field(default_factory=dict)
    alpha_pattern: dict[str, Annotated[int, Field(ge=1)]] = Field(default_factory=dict)
    use_rslora: bool = False
    use_dora: bool = False
    init_lora_weights: bool | Literal["gaussian", "pissa", "olora"] = True
    modules_to_save: list[str] | None = None

    @model_validator(mode="after")
    def _aggregation(self) -> AdapterSettings:
        if self.error_metric and self.aggregation in ("ffa", "fedsa"):
            raise ValueError(
                "model.adapter.error_metric: it measures ab-mean's error (mean(B)·mean(A) against mean(B_i·A_i)), "
                f"which aggregation {self.aggregation} does not make (ffa: A is the same everywhere, the mean of B "
                "is exact; fedsa: B is each client's own); exact logs it without the key"
            )
        return self


class Quantization(Strict):
    """``model.quantization``: the frozen backbone's linear layers held in 4 or 8 bits (bitsandbytes, GPU only).

    4 bits: QLoRA's NF4 (``quant_type: nf4``; ``fp4`` also), optionally double-quantised,
    the matmuls computed in ``compute_dtype``; 8 bits: LLM.int8(). The adapters and the
    head stay float32 (``prepare_model_for_kbit_training``); the package is the optional
    extra ``pip install '.[gpu]'``.
    """

    bits: Literal[4, 8]
    quant_type: Literal["nf4", "fp4"] = "nf4"
    double_quant: bool = True
    compute_dtype: Literal["bf16", "float32"] = "bf16"


class ModelConfig(Strict):
    """``name: tiny-bert`` builds ``tiny``; any other name (hub id or local folder) goes through
    ``AutoModelForSequenceClassification`` / ``AutoModelForMaskedLM.from_pretrained`` (by ``data.task``)."""

    name: str = "tiny-bert"
    revision: str | None = None  # hub revision (branch, tag or commit) of model and tokenizer
    tiny: TinyBert = TinyBert()
    max_length: Annotated[int, Field(ge=8)] = 64
    truncation: Literal["longest_first", "only_first", "only_second"] = "longest_first"
    mlm_probability: Annotated[float, Field(gt=0, lt=1)] = 0.15  # masked-LM: share of tokens masked
    init_seed_offset: int = 0
    # ``RUN[:NODE]``: start from a finished run's node model (docs/config.md, "model.init_from"); a
    # run folder, stored absolute once resolved (flows/records/warm_source.py), or in a pipeline a stage name
    init_from: str | None = None
    # LoRA adapters (and the task head) are what is trained, stored, sent and aggregated (docs/config.md)
    adapter: AdapterSettings | None = None

    # how the frozen backbone is held (docs/config.md, "model.backbone_dtype"): float32 (as before), or bf16
    # (half the memory) or quantised (GPU), under float32 adapters and head; both need model.adapter
    backbone_dtype: Literal["float32", "bf16"] = "float32"
    quantization: Quantization | None = None

    @model_validator(mode="after")
    def _frozen_backbone_precision(self) -> ModelConfig:
        """A backbone below float32 must be frozen: only float32 adapters (and head) are trained and aggregated."""
        if self.quantization is not None and self.backbone_dtype != "float32":
            raise ValueError("model.backbone_dtype: a quantised backbone computes in model.quantization.compute_dtype")
        lowered = "model.quantization" if self.quantization is not None else "model.backbone_dtype"
        if (self.quantization is not None or self.backbone_dtype != "float32") and self.adapter is None:
            raise ValueError(
                f"{lowered}: a backbone below float32 needs model.adapter (LoRA): full fine-tuning would train, send "
                "and aggregate the rounded weights themselves"
            )
        return self
