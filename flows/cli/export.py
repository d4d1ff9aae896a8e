"""``bhfl export``: a node's final model in the hub's ``save_pretrained`` layout, with its tokenizer.

What a user takes out of a run to use elsewhere (``from_pretrained(DIR)``, the hub).
Two formats:

* ``merged`` (default): the node's saved parameters loaded into the run's model and, for
  a LoRA run (``model.adapter``), the adapters folded into the backbone (peft's
  ``merge_and_unload``), so the folder is a plain transformers model.
* ``adapter`` (LoRA runs): the adapters (and a classifier's head) alone, in peft's
  ``PeftModel.save_pretrained`` layout (``adapter_config.json`` and
  ``adapter_model.safetensors``), loadable with ``PeftModel.from_pretrained(base, DIR)`` or
  transformers' ``base.load_adapter(DIR)``; ~1.2 MB at BERT-base. ``base_model_name_or_path``
  names the hub model or folder (and ``revision``); a base ``model.name`` does not hold
  (``tiny-bert``, a backbone warm-started from a full run, or weights without a parameter of
  the run's model that the adapter file does not carry: ``own_base``) is written under
  ``DIR/base``, without adapters, and named there (an absolute path).

``personal``: a Ditto client's personal model instead of its federated one.

The base is always the float32 one (the seeded build or the hub weights): a run with
``model.backbone_dtype: bf16`` or ``model.quantization`` trained its adapters on that
backbone rounded, and what leaves the run is the adapters for the real weights, as
QLoRA merges into the full-precision base (the export needs no GPU either). The
tokenizer is the one the run's data were prepared with. The folder is written under a
temporary name and renamed, so a failed export leaves nothing half-written.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from bhfl_core.config.base import ConfigError

if TYPE_CHECKING:
    from torch import nn

    from tasks.context import RunContext

ExportFormat = Literal["merged", "adapter"]
BASE_DIR = "base"  # DIR/base: an adapter export's base model when no hub holds it


class ExportError(ConfigError):
    """A run or node that cannot be exported; the message names it."""


def export_model(
    run_path: Path, node_id: str, out: Path, fmt: ExportFormat = "merged", *, personal: bool = False
) -> Path:
    """Write ``node_id``'s model (``personal``: its Ditto personal model) of the run at ``run_path`` to ``out``."""
    from transformers.utils import logging as hf_logging

    from bhfl_core.learning.params import set_flat
    from data_prep.tokenizer import load_tokenizer

    ctx = _open_run(run_path)
    if node_id not in ctx.tree.nodes:
        servers = ", ".join(n.id for n in ctx.tree.servers())
        raise ExportError(f"--node: {run_path} has no node {node_id!r} (servers: {servers}; clients: <language>-NN)")
    if fmt == "adapter" and ctx.config.model.adapter is None:
        raise ExportError(
            f"--format adapter: {run_path} is a full fine-tuning run (no model.adapter); export it merged"
        )
    theta = ctx.store.load_model(node_id, personal=personal)
    if theta is None and personal:
        raise ExportError(
            f"--personal: node {node_id!r} of {run_path} has no personal model (only the clients of a Ditto run, "
            "tree.client.personal, keep one)"
        )
    if theta is None:
        raise ExportError(f"--node: node {node_id!r} of {run_path} has no saved model (it never trained, or kept none)")
    _check_destination(out)
    hf_logging.disable_progress_bar()  # this command's output is its one line, not a shard-writing bar
    model: Any = float32_model(ctx, adapter=True)  # a peft model (LoRA) or a transformers one
    set_flat(model, theta)
    ref = ctx.manifest.tokenizer
    tokenizer = load_tokenizer(
        ctx.data_root / ref if (ctx.data_root / ref).is_dir() else ref, ctx.config.model.revision
    )
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if fmt == "adapter":
            _save_adapter(ctx, model, tmp, out)
        else:
            merged = model.merge_and_unload() if ctx.config.model.adapter is not None else model
            merged.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(out)
    except OSError as exc:  # no permission, a full disk: the folder named, nothing left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise ExportError(f"--to: cannot write {out}: {exc.strerror or exc}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _open_run(run_path: Path) -> RunContext:
    """The run's context; a run stopped before its data were prepared, or whose data cache is gone, is named.

    Exporting reads the prepared data's manifest (labels, tokenizer): without it no model can be rebuilt.
    """
    from bhfl_core.store.run_layout import DATA_POINTER
    from tasks.context import RunContext

    if not (run_path / DATA_POINTER).is_file():
        raise ExportError(f"{run_path}: the run stopped before its data were prepared; no node has a model to export")
    try:
        return RunContext.open(run_path)
    except OSError as exc:
        raise ExportError(
            f"{run_path}: its prepared data cannot be read ({exc.strerror}: {exc.filename}); the export needs their "
            "labels and tokenizer: prepare the same data again "
            "(`bhfl prepare` on its config.yaml, with the same --run-dir)"
        ) from None


def _check_destination(out: Path) -> None:
    """``--to`` must be a new path whose nearest existing folder above is a folder (checked before any work)."""
    if out.exists() or out.is_symlink():
        raise ExportError(f"--to: {out} already exists; give a new folder")
    above = next(p for p in out.absolute().parents if p.exists())
    if not above.is_dir():
        raise ExportError(f"--to: {above} is a file, not a folder; give a new folder")


def float32_model(ctx: RunContext, *, adapter: bool) -> nn.Module:
    """The run's training model (seeded by ``seed``, on the run's backbone file) with a float32 backbone.

    ``adapter=False``: the base alone, as the adapters were wrapped around it.
    """
    from bhfl_core.learning.models import build_model
    from bhfl_core.store.warm_start import load_backbone

    cfg, m, path = ctx.config, ctx.manifest, ctx.backbone_path()
    update = {"backbone_dtype": "float32", "quantization": None, **({} if adapter else {"adapter": None})}
    model_cfg = cfg.model.model_copy(update=update)
    backbone = load_backbone(path) if path is not None else None
    return build_model(model_cfg, m.task, m.labels, m.vocab_size, m.pad_token_id, cfg.seed, backbone=backbone)


def _save_adapter(ctx: RunContext, model: Any, folder: Path, out: Path) -> None:
    """peft's adapter layout in ``folder`` (renamed ``out`` once written); with ``folder/base`` when ``model.name``
    does not hold the run's base (``own_base``), the adapter config then naming ``out/base``."""
    cfg = ctx.config.model
    peft_config = model.peft_config["default"]  # a PeftModel: its LoraConfig
    own = own_base(ctx, list(peft_config.modules_to_save or []))
    peft_config.base_model_name_or_path = str(out.absolute() / BASE_DIR) if own else cfg.name
    peft_config.revision = None if own else cfg.revision
    model.save_pretrained(folder, save_embedding_layers=False)  # the embeddings are the frozen base's: not moved
    if own:
        base: Any = float32_model(ctx, adapter=False)
        base.save_pretrained(folder / BASE_DIR)


def own_base(ctx: RunContext, saved: list[str]) -> bool:
    """Whether the export writes the base itself: ``tiny-bert`` (no hub holds it), a backbone warm-started from a
    full run, or a ``model.name`` whose weights lack a parameter of the run's model outside the modules the
    adapter file carries (``saved``: peft's ``modules_to_save``, a classifier's head among them).

    Such a parameter (a pooler the checkpoint was saved without, ``models.missing_weights``)
    was drawn from the run's seed; loaded from ``model.name`` elsewhere it would be drawn
    anew, and the adapters would predict on another model (logits 0.07 apart, measured).
    """
    from bhfl_core.learning.models import TINY, missing_weights

    cfg = ctx.config.model
    if cfg.name == TINY or ctx.backbone_path() is not None:
        return True
    missing = missing_weights(cfg, ctx.manifest.task, ctx.manifest.labels)
    return any(not _under(key, saved) for key in missing)


def _under(key: str, modules: list[str]) -> bool:
    """Whether parameter ``key`` lies in one of ``modules`` (a module's name, or its last dotted parts: peft's)."""
    parts = key.split(".")
    prefixes = (".".join(parts[:i]) for i in range(1, len(parts)))
    return any(p == m or p.endswith(f".{m}") for p in prefixes for m in modules)
