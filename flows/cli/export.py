"""``bhfl export``: a node's final model in the hub's ``save_pretrained`` layout, with its tokenizer.

What a user takes out of a run to use elsewhere (``from_pretrained(DIR)``, the hub):
the node's saved parameters loaded into the run's model, and, for a LoRA run
(``model.adapter``), the adapters folded into the backbone (peft's
``merge_and_unload``), so the folder is a plain transformers model. The tokenizer is the
one the run's data were prepared with. The folder is written under a temporary name and
renamed, so a failed export leaves nothing half-written.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from bhfl_core.config.base import ConfigError


class ExportError(ConfigError):
    """A run or node that cannot be exported; the message names it."""


def export_model(run_path: Path, node_id: str, out: Path) -> Path:
    """Write ``node_id``'s model of the run at ``run_path`` to ``out`` (a new folder); return ``out``."""
    from transformers.utils import logging as hf_logging

    from bhfl_core.learning.params import set_flat
    from data_prep.tokenizer import load_tokenizer
    from tasks.context import RunContext

    ctx = RunContext.open(run_path)
    if node_id not in ctx.tree.nodes:
        servers = ", ".join(n.id for n in ctx.tree.servers())
        raise ExportError(f"--node: {run_path} has no node {node_id!r} (servers: {servers}; clients: <language>-NN)")
    theta = ctx.store.load_model(node_id)
    if theta is None:
        raise ExportError(f"--node: node {node_id!r} of {run_path} has no saved model (it never trained, or kept none)")
    if out.exists():
        raise ExportError(f"--to: {out} already exists; give a new folder")
    hf_logging.disable_progress_bar()  # this command's output is its one line, not a shard-writing bar
    cfg = ctx.config
    model = ctx.training_model()  # the backbone every worker trained on (for a LoRA run, not the initial model's)
    set_flat(model, theta)
    if cfg.model.adapter is not None:
        model = model.merge_and_unload()  # type: ignore[operator]
    ref = ctx.manifest.tokenizer
    tokenizer = load_tokenizer(ctx.data_root / ref if (ctx.data_root / ref).is_dir() else ref, cfg.model.revision)
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)  # type: ignore[operator]
        tokenizer.save_pretrained(tmp)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
