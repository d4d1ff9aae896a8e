"""Warm starts (``model.init_from: RUN[:NODE]``): which saved models of a finished run a new run starts from.

Two shapes, both *model only* (a warm-started node gets fresh optimiser states, round
counter 0 and no consumed-residual marks, exactly like a node that was just given an
initial model):

- ``RUN:NODE``: the new run's root starts from NODE's model; every other node starts
  without a model and adopts its parent's on its first execution, as in any run.
- ``RUN``: tree-shaped: every node of the new tree whose namesake saved a model in RUN
  starts from it (servers and persistent clients alike); the others start empty.

A LoRA run (``model.adapter``) from a full fine-tuning run (none) is the one allowed
difference in ``model``: the vectors do not fit (adapters and head against the whole
model), so no node state is copied; NODE's model (the root's for ``RUN``) becomes the
new run's frozen backbone file (``run_layout.BACKBONE_FILE``), which every build of
the run's model loads before the adapters are wrapped in (so it is also the head's
starting point), and the adapters start fresh from the seed. A LoRA run from a LoRA
run that was itself so started copies its nodes' adapters and carries its backbone
file over (``carry_backbone``): the adapters were trained on that backbone, not on the
seeded one.

This module is the pure part: parsing the value, planning the copy, the config keys
that must agree between the two runs, and the copy between two state stores (or into
the backbone file). Finding and checking RUN (its folder, record, status) is the
flows' job (flows/records/warm_source.py): run folders and ``run.json`` belong there.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bhfl_core.algorithm.node_state import NodeState
from bhfl_core.config.base import ConfigError

if TYPE_CHECKING:
    import torch

    from bhfl_core.store.node_store import StateStore

KEY = "model.init_from"
ADAPTER_KEY = "model.adapter"
AGREEING_SECTIONS = ("model", "data.task")
"""What the source run's config must share with the new one (``model.init_from`` itself aside,
and ``model.adapter`` for a backbone start): the model's architecture and task decide the
shape and meaning of every saved vector."""
PRECISION_KEYS = ("model.backbone_dtype", "model.quantization")
"""Never compared: how the frozen backbone is held changes no saved vector (adapters and head are float32),
so a bf16 or 4-bit run starts from a float32 one and back (and from runs made before these keys)."""
BACKBONE = "backbone"
"""The backbone file's one tensor: the source node's full flat vector (``params.get_flat``)."""
CARRIED = "carried"  # backbone file info: carried over from a LoRA source, its node models copied after it


@dataclass(frozen=True)
class InitFrom:
    """A parsed ``model.init_from``: the run (as written) and the node (None: tree-shaped)."""

    run: str
    node: str | None = None

    def __str__(self) -> str:
        return self.run if self.node is None else f"{self.run}:{self.node}"


def parse_init_from(value: str) -> InitFrom:
    """``RUN[:NODE]``: the node is what follows the last ``:``, when it holds no ``/``.

    So ``runs/a/20260101-000000-000:edge-de`` names a node and ``/mnt/x:y/run`` does not.
    """
    if not value.strip():
        raise ConfigError(f"{KEY}: an empty value; give a run folder, optionally with :NODE (e.g. runs/x/STAMP:root)")
    head, sep, tail = value.rpartition(":")
    if not sep or "/" in tail:
        return InitFrom(value)
    if not head or not tail:
        raise ConfigError(
            f"{KEY}: {value!r}: expected RUN or RUN:NODE (e.g. runs/x/STAMP:root); a side of ':' is empty"
        )
    return InitFrom(head, tail)


def copy_plan(spec: InitFrom, target_nodes: Iterable[str], target_root: str) -> dict[str, str]:
    """Target node -> the source node whose model it starts from (the root last: see ``copy_models``).

    ``RUN:NODE`` plans the root alone; ``RUN`` plans every target node from its
    namesake (those the source never saved are skipped when copying).
    """
    if spec.node is not None:
        return {target_root: spec.node}
    others = [n for n in target_nodes if n != target_root]
    return {**{n: n for n in others}, target_root: target_root}


def copy_models(source: StateStore, target: StateStore, plan: Mapping[str, str]) -> list[str]:
    """Write each planned source model as the whole state of its target node; return the nodes written.

    Nodes the source holds no model of are skipped, except the root (the plan's last
    entry), which must exist. The root is written last, so "the target store has a
    root" means "the copy is complete": a run killed while copying copies again when
    resumed, and a resumed run whose store has its root never copies a second time.
    """
    written = []
    items = list(plan.items())
    for i, (target_node, source_node) in enumerate(items):
        model = source.load_model(source_node)
        if model is None:
            if i == len(items) - 1:
                raise ConfigError(f"{KEY}: the source run has no saved model of node {source_node!r}")
            continue
        target.save(target_node, NodeState(model=model))
        written.append(target_node)
    return written


def save_backbone(source: StateStore, node: str, path: Path) -> bool:
    """Write ``node``'s saved model in ``source`` as the backbone file ``path``; False if ``path`` exists.

    An existing file is kept: a resumed run's workers may already have built on it,
    and it is whole (written atomically), so writing it again could only change it.
    """
    from bhfl_core.store.node_store import atomic_save  # torch only where a backbone is written

    if path.exists():
        return False
    model = source.load_model(node)
    if model is None:
        raise ConfigError(f"{KEY}: the source run has no saved model of node {node!r}")
    atomic_save({BACKBONE: model}, path, info={"node": node})
    return True


def carry_backbone(source_file: Path, path: Path) -> bool:
    """Write the source LoRA run's backbone file ``source_file`` as ``path``, marked carried; False if it exists.

    The mark tells a resume that node models are still to be copied (``is_carried``):
    the file is written before them, and a backbone start's file means no copy at all.
    """
    from bhfl_core.store.node_store import atomic_save, load_tensors

    if path.exists():
        return False
    tensors, info = load_tensors(source_file, [BACKBONE])
    atomic_save({BACKBONE: tensors[BACKBONE]}, path, info={**info, CARRIED: True})
    return True


def is_carried(path: Path) -> bool:
    """Whether the backbone file ``path`` was carried over from a LoRA source (``carry_backbone``)."""
    from bhfl_core.store.node_store import load_tensors

    return bool(load_tensors(path, [])[1].get(CARRIED, False))


def load_backbone(path: Path) -> torch.Tensor:
    """The flat vector ``save_backbone`` wrote (checksum verified)."""
    from bhfl_core.store.node_store import load_tensors

    tensors, _ = load_tensors(path, [BACKBONE])
    if BACKBONE not in tensors:
        raise ConfigError(f"{KEY}: {path} holds no {BACKBONE!r} tensor; delete it and resume to write it again")
    return tensors[BACKBONE]


def is_backbone_start(source: Mapping[str, Any], target: Mapping[str, Any]) -> bool:
    """A full fine-tuning source (no ``model.adapter``) and a LoRA target (two dumped configs).

    Then the source's model is the target's frozen backbone (``save_backbone``), not a
    node state: the one difference in ``model`` a warm start allows.
    """
    return _at(source, ADAPTER_KEY) is None and _at(target, ADAPTER_KEY) is not None


def config_mismatch(source: Mapping[str, Any], target: Mapping[str, Any]) -> tuple[str, Any, Any] | None:
    """The first key of ``AGREEING_SECTIONS`` whose value differs between two dumped configs, else None.

    Returns ``(dotted key, source value, target value)``; ``model.init_from`` and
    ``PRECISION_KEYS`` are ignored, and so is ``model.adapter`` for a backbone start (``is_backbone_start``).
    """
    ignored = {KEY, ADAPTER_KEY, *PRECISION_KEYS} if is_backbone_start(source, target) else {KEY, *PRECISION_KEYS}
    for section in AGREEING_SECTIONS:
        found = _first_difference(_at(source, section), _at(target, section), section, ignored)
        if found is not None:
            return found
    return None


def mismatch_reason(key: str) -> str:
    """Why ``key`` (from ``config_mismatch``) must agree: the end of the callers' one-line error."""
    if key == ADAPTER_KEY or key.startswith(f"{ADAPTER_KEY}."):
        return (
            "a LoRA run (model.adapter) starts from a LoRA run with the same model.adapter, or from a full "
            "fine-tuning run (no model.adapter), whose model becomes its frozen backbone; a full run cannot "
            "start from a LoRA run"
        )
    return "the model and data.task must be the same for its saved models to fit this run"


def _at(data: Mapping[str, Any], dotted: str) -> Any:
    value: Any = data
    for key in dotted.split("."):
        value = value.get(key) if isinstance(value, Mapping) else None
    return value


def _first_difference(a: Any, b: Any, key: str, ignored: Collection[str]) -> tuple[str, Any, Any] | None:
    if key in ignored:
        return None
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for name in sorted(set(a) | set(b), key=str):
            found = _first_difference(a.get(name), b.get(name), f"{key}.{name}", ignored)
            if found is not None:
                return found
        return None
    return None if a == b else (key, a, b)
