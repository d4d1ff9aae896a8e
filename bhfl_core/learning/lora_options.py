"""peft's LoRA options from ``model.adapter``, and the check that each one reached the model.

peft ignores a ``rank_pattern`` / ``alpha_pattern`` key or a ``modules_to_save`` name
that matches no module, silently: a typo would train rank ``r`` everywhere, or leave a
module frozen, and nothing would say so. ``settle_lora`` checks each against the
wrapped model and names the key. It also freezes the A matrices for
``aggregation: ffa`` (FFA-LoRA, Sun et al. 2024): A stays what every worker draws from
the run's seed (``build_model``'s seeded block), so it is identical everywhere, is not
in the trainable vector (``params.get_flat``), and the server's mean of the B matrices
is the mean of the products exactly.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from bhfl_core.config.base import SettingError
from bhfl_core.learning.model_config import AdapterSettings

if TYPE_CHECKING:
    from torch import nn


def lora_options(adapter: AdapterSettings) -> dict[str, Any]:
    """The ``LoraConfig`` keywords beyond r, alpha, dropout and targets (each default is peft's own)."""
    return {
        "rank_pattern": dict(adapter.rank_pattern),
        "alpha_pattern": dict(adapter.alpha_pattern),
        "use_rslora": adapter.use_rslora,
        "use_dora": adapter.use_dora,
        "init_lora_weights": adapter.init_lora_weights,
        "modules_to_save": list(adapter.modules_to_save) if adapter.modules_to_save is not None else None,
    }


def check_targets(built: nn.Module, adapter: AdapterSettings) -> None:
    """Refuse a ``target_modules`` name that matches no module of ``built``, naming the key, before peft wraps it.

    peft stops only when no name matches (a ``NoMatchingPeftModuleError`` traceback) and drops a typo beside a
    name that does. Matching is peft's for a list: the module's name, or its last dotted parts.
    """
    names = [name for name, _ in built.named_modules() if name]
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in built.named_modules() if type(m).__name__ == "Linear"})
    for entry in adapter.target_modules or ():
        if not any(name == entry or name.endswith(f".{entry}") for name in names):
            raise SettingError(
                f"model.adapter.target_modules: no module of the model is named {entry!r} "
                f"(its linear modules: {', '.join(linear)})"
            )


def settle_lora(wrapped: nn.Module, adapter: AdapterSettings) -> None:
    """Refuse a pattern or module name that matched nothing (naming the key); freeze A for ``ffa``."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    adapted = [name for name, m in wrapped.named_modules() if isinstance(m, LoraLayer)]
    for key, pattern in (("rank_pattern", adapter.rank_pattern), ("alpha_pattern", adapter.alpha_pattern)):
        for entry in pattern:
            if not any(re.match(rf"(.*\.)?({entry})$", name) for name in adapted):  # peft's get_pattern_key
                raise SettingError(
                    f"model.adapter.{key}: {entry!r} matches none of the adapted modules "
                    f"({', '.join(_short(adapted))}); peft would ignore it"
                )
    saved = [name for name, m in wrapped.named_modules() if isinstance(m, ModulesToSaveWrapper)]
    for entry in adapter.modules_to_save or ():
        if not any(name == entry or name.endswith(f".{entry}") for name in saved):
            raise SettingError(f"model.adapter.modules_to_save: no module of the model is named {entry!r}")
    if adapter.aggregation == "ffa":
        for name, p in wrapped.named_parameters():
            if ".lora_A." in name or ".lora_embedding_A." in name:  # an adapted embedding's A too
                p.requires_grad_(False)


def _short(names: list[str], keep: int = 4) -> list[str]:
    """The first few module names, without peft's ``base_model.model.`` prefix."""
    short = [n.removeprefix("base_model.model.") for n in names[:keep]]
    return short + ([f"... {len(names) - keep} more"] if len(names) > keep else [])
