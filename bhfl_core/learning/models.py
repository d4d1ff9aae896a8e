"""Model construction through the transformers Auto* API, for sequence classification or masked LM.

``tiny-bert`` builds a small BERT from a config (no download) sized by the config;
any other name (a hub id such as ``bert-base-multilingual-cased`` or
``xlm-roberta-base``, or a local folder) goes through
``AutoModelForSequenceClassification`` / ``AutoModelForMaskedLM.from_pretrained``:
the Auto class and head of the task's kind (``task_kinds``). A model that cannot be
loaded (no network, hub offline, a typo) is a ``ModelSourceError`` whose message says
how to point the config at local files.

torch and transformers are imported where a model is built: the checks before a run
(``check_available``, ``hub_error``) need neither.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bhfl_core.config.base import ConfigError, SettingError
from bhfl_core.learning.hub import require_hub
from bhfl_core.learning.lora_options import check_targets, lora_options, settle_lora
from bhfl_core.learning.model_config import ModelConfig
from bhfl_core.learning.task_kinds import get_task_kind

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PretrainedConfig

TINY = "tiny-bert"


class ModelSourceError(ConfigError):
    """A model or tokenizer cannot be loaded; the message says how to use a local copy."""


LOCAL_MODEL = (
    "a local model is a folder as save_pretrained (or `hf download NAME --local-dir DIR`) writes it: config.json, "
    "the weights and the tokenizer's files"
)


WEIGHTS = ("*.safetensors", "pytorch_model*.bin")  # what from_pretrained loads a PyTorch model from


def folder_problem(name: str) -> str | None:
    """What is wrong with ``name`` as a local model folder; None when it is one or a hub name (``org/name``).

    transformers loads a name from the folder of that name when there is one; a name that
    can only be a path (absolute, ``~``, ``./``, ``../``, or more than one ``/``: a hub
    id has one) and is no folder is a missing folder, not a hub name whose hub failed.
    """
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            return f"the folder {path} has no config.json"
        if not any(next(path.glob(pattern), None) for pattern in WEIGHTS):
            return f"the folder {path} has no weights ({' or '.join(WEIGHTS)})"
        return None
    if path.exists():
        return f"{path} is a file, not a model folder"
    if name.startswith(("/", "~", "./", "../")) or name.count("/") > 1:
        return f"the folder {path} does not exist"
    return None


def check_folder(model: ModelConfig) -> None:
    """A ``model.name`` that is a path must be a model folder (``folder_problem``): one line naming the key."""
    if model.name != TINY and (problem := folder_problem(model.name)) is not None:
        raise ModelSourceError(f"model.name: {problem}; {LOCAL_MODEL}.")


def hub_error(what: str, model: ModelConfig, exc: BaseException) -> ModelSourceError:
    detail = str(exc).strip().splitlines()[0][:300].rstrip(".") if str(exc).strip() else ""
    if (problem := folder_problem(model.name)) is not None or Path(model.name).expanduser().is_dir():
        why = problem or f"could not load the {what} from the folder {Path(model.name).expanduser()}"
        return ModelSourceError(f"model.name: {why} ({type(exc).__name__}: {detail}); {LOCAL_MODEL}.")
    return ModelSourceError(
        f"model.name: could not load the {what} {model.name!r} (revision {model.revision or 'default'}): "
        f"{type(exc).__name__}: {detail}. Without hub access (HF_HUB_OFFLINE=1, no network) use a local copy: "
        f"on a machine with access run `hf download {model.name} --local-dir DIR` (or save_pretrained "
        "the model and its tokenizer into DIR), copy DIR here and set model.name: DIR; a model already in the "
        "Hugging Face cache (HF_HOME) also loads offline. model.name: tiny-bert needs no download."
    )


def check_hub(model: ModelConfig) -> None:
    """Fail in seconds when ``model`` is a hub name and the hub cannot be reached (``hub.require_hub``), or a path
    that is no model folder (``check_folder``)."""
    check_folder(model)
    if model.name != TINY:
        require_hub(
            "model.name",
            model.name,
            f"on a machine with access run `hf download {model.name} --local-dir DIR`, copy DIR here and set "
            "model.name: DIR (model.name: tiny-bert needs no download).",
        )


def check_available(model: ModelConfig) -> None:
    """Fail early (before any data work) when a hub model's config cannot be found."""
    if model.name == TINY:
        return
    check_folder(model)
    from transformers import AutoConfig  # transformers (~1 s to import) only where a model is built or checked

    try:
        AutoConfig.from_pretrained(model.name, revision=model.revision)
    except Exception as exc:  # OSError offline / not found, ValueError for bad folders: one message
        raise hub_error("model", model, exc) from None


def build_model(
    model: ModelConfig,
    task: str,
    labels: list[str],
    vocab_size: int,
    pad_token_id: int,
    seed: int,
    *,
    backbone: torch.Tensor | None = None,
) -> nn.Module:
    """The model of ``task``'s kind: a sequence classifier (``classification``), a masked LM (``mlm``), ...

    Weights are initialised from ``seed`` (tiny) or the checkpoint (hub; new heads from ``seed``).
    ``backbone``: a full model's flat vector (``params.get_flat`` of a model without
    adapters) loaded into the base model before ``with_adapter`` wraps it: a LoRA run
    warm-started from a full run (bhfl_core/store/warm_start.py). The base is still
    built from ``seed`` first, so the adapters draw the same random numbers as without it.
    """
    import torch

    kind = get_task_kind(task)
    head = kind.head(labels)
    auto = kind.model_class()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if model.name == TINY:
            built: nn.Module = auto.from_config(tiny_config(model, vocab_size, pad_token_id, head))
        else:
            try:
                built = auto.from_pretrained(model.name, revision=model.revision, **head)
            except Exception as exc:
                raise hub_error("model", model, exc) from None
        return _held(with_adapter(_quantized(_with_backbone(built, backbone), model), model, task), model)


def missing_weights(model: ModelConfig, task: str, labels: list[str]) -> list[str]:
    """The parameters of ``task``'s model (a hub name or a folder) that ``model.name``'s weights lack.

    ``build_model`` draws them from the run's seed: a classifier's new head, and whatever
    else the checkpoint was saved without (a BERT folder saved from ``BertForMaskedLM``
    has no pooler). Whoever loads ``model.name`` elsewhere draws them anew, so an export
    that names it as the base must carry them (``bhfl export --format adapter``). The
    names are the model's own (``bert.pooler.dense.weight``); loaded as ``build_model``
    loads it, so a load that fails fails there first.
    """
    kind = get_task_kind(task)
    _, info = kind.model_class().from_pretrained(
        model.name, revision=model.revision, output_loading_info=True, **kind.head(labels)
    )
    return sorted(info["missing_keys"])


def tiny_config(model: ModelConfig, vocab_size: int, pad_token_id: int, head: dict[str, Any]) -> PretrainedConfig:
    """The BERT config of ``model.tiny`` (``head``: the task kind's keywords, e.g. a classifier's labels)."""
    from transformers import BertConfig

    t = model.tiny
    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=t.hidden_size,
        num_hidden_layers=t.num_hidden_layers,
        num_attention_heads=t.num_attention_heads,
        intermediate_size=t.intermediate_size,
        max_position_embeddings=max(64, model.max_length),
        hidden_dropout_prob=t.dropout,
        attention_probs_dropout_prob=t.dropout,
        pad_token_id=pad_token_id,
        **head,
    )


def _quantized(base: nn.Module, model: ModelConfig) -> nn.Module:
    """``base`` quantised to ``model.quantization`` (bitsandbytes, CUDA), or as it is."""
    if model.quantization is None:
        return base
    from bhfl_core.learning.backbone_precision import quantized_base

    return quantized_base(base, model.quantization)


def _held(wrapped: nn.Module, model: ModelConfig) -> nn.Module:
    """``wrapped`` with its frozen backbone in ``model.backbone_dtype`` (float32: as it is)."""
    from bhfl_core.learning.backbone_precision import lower_backbone

    return lower_backbone(wrapped, model.backbone_dtype)


def _with_backbone(base: nn.Module, backbone: torch.Tensor | None) -> nn.Module:
    """``base`` with ``backbone`` loaded (all its parameters: nothing is frozen before the adapters)."""
    if backbone is not None:
        from bhfl_core.learning.params import set_flat  # torch: imported where a model is built

        set_flat(base, backbone)
    return base


def with_adapter(built: nn.Module, model: ModelConfig, task: str = "classification") -> nn.Module:
    """``built`` with LoRA adapters (``model.adapter``) wrapped in by peft, or as it is.

    Only the adapters and the classification head then require gradients, so the flat
    vector that travels the tree (``params.get_flat``: the trainable parameters) is the
    adapter vector; the frozen backbone is whatever every worker builds or loads from the
    same seed or checkpoint, identical everywhere. Called inside ``build_model``'s seeded
    block: the adapters' random initialisation is part of the run's initial model.

    ``task``'s kind says what else peft trains (``TaskKind.peft_task_type``): a classifier's
    head; for a masked LM nothing else, its decoder being the frozen, tied word embeddings.
    """
    adapter = model.adapter
    if adapter is None:
        return built
    from peft import LoraConfig, get_peft_model

    # peft asks transformers a deprecated question while wrapping; transformers says so on stderr each time
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    # peft's note on a pattern key that matched nothing: settle_lora refuses it, naming the key
    warnings.filterwarnings("ignore", message="The following .* keys did not match", category=RuntimeWarning)

    config = LoraConfig(
        task_type=get_task_kind(task).peft_task_type,  # classification: the head is trained with the adapters
        r=adapter.r,
        lora_alpha=adapter.alpha,
        lora_dropout=adapter.dropout,
        target_modules=adapter.target_modules,
        **lora_options(adapter),
    )
    check_targets(built, adapter)
    try:
        wrapped: nn.Module = get_peft_model(built, config)
    except ValueError as exc:  # a target peft cannot adapt (a LayerNorm, say): its message, naming the key
        if adapter.target_modules is None:
            raise
        raise SettingError(f"model.adapter.target_modules: {exc}") from None
    settle_lora(wrapped, adapter)
    return wrapped
