"""``model.adapter`` checked before a run starts, on the model's module tree built without weights.

The adapter options (``target_modules``, ``rank_pattern``, ``alpha_pattern``,
``modules_to_save``) name modules of the built model, so ``with_adapter`` can refuse a
typo only once the model is built: inside the run, after its folder and record exist
and its data were prepared. ``check_adapter`` builds the same module tree on the
``meta`` device (no weights allocated, none read: ~9 ms at tiny-bert's size, ~33 ms at
BERT-base's, docs/config.md) from the model's config alone and runs the same checks
through the same ``with_adapter``, so the CLI refuses the key before anything starts.

The config comes from ``model.tiny`` (``tiny-bert``), a local folder's ``config.json``,
or the Hugging Face cache for a hub name (``local_files_only``: no network call). A hub
name not in the cache is not checked here; ``with_adapter`` still checks it when the
run builds the model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bhfl_core.learning.model_config import AdapterSettings, ModelConfig
from bhfl_core.learning.models import TINY, folder_problem, tiny_config, with_adapter
from bhfl_core.learning.task_kinds import get_task_kind

if TYPE_CHECKING:
    from torch import nn
    from transformers import PretrainedConfig

NAMED_OPTIONS = ("target_modules", "rank_pattern", "alpha_pattern", "modules_to_save")  # each names modules
_LABELS = ["a", "b"]  # the labels are known once the data are prepared; a head's name does not depend on them


def names_modules(adapter: AdapterSettings | None) -> bool:
    """Whether ``adapter`` sets an option that names modules of the model (what only a built model can check)."""
    return adapter is not None and any(getattr(adapter, key) for key in NAMED_OPTIONS)


def check_adapter(model: ModelConfig, task: str) -> list[str]:
    """Refuse an adapter option no module matches (``SettingError`` naming the key); return the warnings.

    Nothing to check without ``model.adapter``, or when the model's config cannot be
    read without the network (a hub name not in the cache) or is not a model folder
    (``check_folder`` says so first). The warnings: ``rank_waste``.
    """
    if model.adapter is None:
        return []
    import torch

    config = _config(model, task)
    if config is None:
        return []
    with torch.random.fork_rng(devices=[]), torch.device("meta"):  # no draw of this process's generator moves
        base = get_task_kind(task).model_class().from_config(config)
        wrapped = with_adapter(base, model, task)
    return rank_waste(wrapped, model.adapter)


def _config(model: ModelConfig, task: str) -> PretrainedConfig | None:
    """The model's config from ``model.tiny``, its folder or the hub cache; None where only the hub holds it."""
    head: dict[str, Any] = get_task_kind(task).head(_LABELS)
    if model.name == TINY:
        return tiny_config(model, model.tiny.vocab_size, 0, head)
    if folder_problem(model.name) is not None:
        return None
    from transformers import AutoConfig

    try:
        config: PretrainedConfig = AutoConfig.from_pretrained(
            model.name, revision=model.revision, local_files_only=True, **head
        )
    except Exception:  # OSError: not in the cache; anything else: the build-time load reports it with its key
        return None
    return config


def rank_waste(wrapped: nn.Module, adapter: AdapterSettings) -> list[str]:
    """A warning per rank key (``r``, ``rank_pattern``) set above the smallest dimension of layers it adapts.

    The product B·A of a layer with ``fan_in`` inputs and ``fan_out`` outputs has rank at
    most ``min(fan_in, fan_out)``: each rank above it adds a row of A and a column of B
    that the product could do without, trained, stored and sent. Warned, not refused
    (docs/config.md, ``model.adapter``): the rank also sets LoRA's scaling ``alpha / r``
    and the initial draw, which a study of ``r`` may mean to vary.
    """
    from peft.tuners.lora import LoraLayer

    over: dict[str, list[tuple[str, int, int]]] = {}
    for name, layer in wrapped.named_modules():
        if not isinstance(layer, LoraLayer) or "default" not in layer.r:
            continue
        if layer.in_features is None or layer.out_features is None:  # a layer kind without both: nothing to compare
            continue
        rank, smallest = int(layer.r["default"]), min(int(layer.in_features), int(layer.out_features))
        key = "r" if rank == adapter.r else "rank_pattern"
        if rank > smallest:
            over.setdefault(key, []).append((name.removeprefix("base_model.model."), rank, smallest))
    warnings = []
    for key, layers in over.items():
        useful = min(smallest for _, _, smallest in layers)
        ranks = sorted({rank for _, rank, _ in layers})
        kinds = sorted({name.rsplit(".", 1)[-1] for name, _, _ in layers})
        warnings.append(
            f"model.adapter.{key}: rank {', '.join(map(str, ranks))} is above the smallest dimension of "
            f"{len(layers)} adapted layer(s) ({', '.join(kinds)}; smallest {useful}): their product B·A has rank at "
            f"most that, so the rank above it is trained, stored and sent for nothing; {useful} is the largest "
            "rank that wastes none there"
        )
    return warnings
