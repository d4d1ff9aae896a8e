"""On-disk node state: one safetensors file per node, written atomically.

A node's state (persistent model ``W_q``, up/down optimiser states, rounds done) is
one file, so a crash can never leave a model from round t beside optimiser moments
from round t-1. Files are written to a temporary name, fsync'ed and renamed; loads use
safetensors (no unpickling). Memory is bounded by what callers load, not by the
number of nodes. Messages (a model sent down to children or up to the parent) use
the same atomic writer under ``messages/``.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from bhfl_core.aggregation import WeightedSum
from bhfl_core.node_opt import OptState

_MODEL = "model"


@dataclass(frozen=True)
class NodeState:
    model: torch.Tensor | None = None
    opt_up: OptState = field(default_factory=dict)
    opt_down: OptState = field(default_factory=dict)
    rounds_done: int = 0
    opt_res: dict[str, OptState] = field(default_factory=dict)  # per residual input kind

    def to_tensors(self) -> dict[str, torch.Tensor]:
        tensors: dict[str, torch.Tensor] = {}
        if self.model is not None:
            tensors[_MODEL] = self.model
        tensors.update({f"up.{k}": v for k, v in self.opt_up.items()})
        tensors.update({f"down.{k}": v for k, v in self.opt_down.items()})
        for kind, opt in self.opt_res.items():
            tensors.update({f"res.{kind}.{k}": v for k, v in opt.items()})
        return tensors

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], rounds_done: int) -> NodeState:
        opt_res: dict[str, OptState] = {}
        for name, value in tensors.items():
            if name.startswith("res."):
                kind, k = name[4:].split(".", 1)
                opt_res.setdefault(kind, {})[k] = value
        return cls(
            model=tensors.get(_MODEL),
            opt_up={k[3:]: v for k, v in tensors.items() if k.startswith("up.")},
            opt_down={k[5:]: v for k, v in tensors.items() if k.startswith("down.")},
            rounds_done=rounds_done,
            opt_res=opt_res,
        )


def atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file so that readers see the old file or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}, dict(fh.metadata() or {})


class StateStore:
    """Node states and messages of one run, under ``root``."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def node_path(self, node_id: str) -> Path:
        return self.root / "nodes" / f"{node_id}.safetensors"

    def has(self, node_id: str) -> bool:
        return self.node_path(node_id).exists()

    def load(self, node_id: str) -> NodeState:
        path = self.node_path(node_id)
        if not path.exists():
            return NodeState()
        tensors, meta = load_tensors(path)
        return NodeState.from_tensors(tensors, int(meta.get("rounds_done", "0")))

    def load_model(self, node_id: str) -> torch.Tensor | None:
        path = self.node_path(node_id)
        if not path.exists():
            return None
        with safe_open(str(path), framework="pt") as fh:
            return fh.get_tensor(_MODEL) if _MODEL in fh.keys() else None

    def save(self, node_id: str, state: NodeState) -> None:
        atomic_save(state.to_tensors(), self.node_path(node_id), {"rounds_done": str(state.rounds_done)})

    # Residual accumulators R_up / R_down: one file per sending round, so posting is
    # idempotent (a re-run round overwrites its own file) and needs no read-modify-write.

    def post_residual(self, target: str, kind: str, tag: str, part: WeightedSum) -> None:
        """Append a sender's contribution to ``target``'s accumulator of residual ``kind``."""
        assert part.total is not None
        path = self.root / "residuals" / target / kind / f"{tag}.safetensors"
        atomic_save({"total": part.total}, path, {"weight": repr(part.weight)})

    def pending_residuals(self, target: str, direction: str) -> dict[str, tuple[WeightedSum, list[Path]]]:
        """``{kind: (accumulated sum, its files)}`` for the ``up`` or ``down`` kinds waiting at ``target``."""
        folder = self.root / "residuals" / target
        out: dict[str, tuple[WeightedSum, list[Path]]] = {}
        if not folder.is_dir():
            return out
        for kind_dir in sorted(d for d in folder.iterdir() if d.name.startswith(direction)):
            files = sorted(kind_dir.glob("*.safetensors"))
            if not files:
                continue
            acc = WeightedSum()
            for f in files:  # sorted: the float sums do not depend on directory order
                tensors, meta = load_tensors(f)
                acc.merge(WeightedSum(tensors["total"], float(meta["weight"])))
            out[kind_dir.name] = (acc, files)
        return out

    @staticmethod
    def consume(files: list[Path]) -> None:
        """Empty an accumulator once the state that read it is saved."""
        for f in files:
            f.unlink(missing_ok=True)

    def message_path(self, name: str) -> Path:
        return self.root / "messages" / f"{name}.safetensors"

    def write_message(self, name: str, theta: torch.Tensor) -> str:
        path = self.message_path(name)
        atomic_save({_MODEL: theta}, path)
        return str(path)

    @staticmethod
    def read_message(path: str | Path) -> torch.Tensor:
        with safe_open(str(path), framework="pt") as fh:
            return fh.get_tensor(_MODEL)
