"""How tensors travel between a run's processes: named files mapped into memory, never pickled.

A parent's model goes to the workers that train its children, a worker's folded batch
comes back to the parent, a server's model goes to its proxy TRAIN. Each is written
once as a raw file and *mapped* by whoever reads it: readers on one host share the
file's pages (one physical copy of the parent model however many workers train from
it), and a worker folds its batch straight into a file it maps, so returning the fold
copies nothing. Only the reference (``TensorRef``: path, size, dtype) is pickled into a
task's arguments or result.

Where: for a run whose processes all live on this host (``runtime.executor`` local or
inprocess) the files are in ``/dev/shm`` (memory, no disk write-back); for a cluster
of machines (``cluster``) in the run folder, which every worker sees. Nothing here must
survive a crash — a resumed run recomputes what was in flight — so files are neither
checksummed nor fsync'ed, only renamed into place so a reader never maps half of one.
The folder is cleared when a run attempt starts; in memory it is removed when the
attempt ends (``runtime.transfer`` chooses: schema.py ``RuntimeConfig``).

Tensors are shared by convention: nothing in bhfl changes a model tensor in place, so
a mapped parent model may be used directly as a node's model. A file mapped read-only
is private (copy-on-write) anyway: a write would not reach other readers.
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from bhfl_core.algorithm.contract import ChildResult
from bhfl_core.algorithm.residuals import Candidate
from bhfl_core.algorithm.rule_registry import AggregationRule

SHM = Path("/dev/shm")
SHM_MIN_FREE = 2 << 30
"""Free bytes ``/dev/shm`` needs to be used (a container's default 64 MB is not enough: the run folder is)."""
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64}


@dataclass(frozen=True)
class TensorRef:
    """A flat tensor in a transfer folder: what a task argument or result carries instead of the tensor."""

    path: str
    numel: int
    dtype: str = "float32"


def transfer_folder(run_path: Path, mode: str, local: bool) -> Path:
    """Where a run's tensors travel (``runtime.transfer``): ``memory``, ``run_folder`` or ``auto``.

    ``auto``: shared memory when every process is on this host and it has room, else the
    run folder.
    """
    roomy = SHM.is_dir() and os.access(SHM, os.W_OK) and shutil.disk_usage(SHM).free >= SHM_MIN_FREE
    if mode == "memory" or (mode == "auto" and local and roomy):
        digest = hashlib.sha256(str(run_path.resolve()).encode()).hexdigest()[:16]
        return SHM / f"bhfl-{digest}"
    return run_path / "state" / "transfer"


class Transfer:
    """Put, map and drop flat tensors in one folder (see the module docstring)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _path(self, name: str) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        return self.folder / name

    def put(self, name: str, tensor: torch.Tensor) -> TensorRef:
        """Write ``tensor`` (flat, float32, float64 or int64, any device) under ``name``, replacing an older one."""
        flat = tensor.detach().reshape(-1)
        dtype = _name(flat.dtype)
        path = self._path(name)
        tmp = path.with_name(f".{name}.{secrets.token_hex(4)}.tmp")
        try:
            if flat.device.type == "cpu":
                with open(tmp, "wb") as fh:  # write(): faster than filling a fresh mapping page by page
                    fh.write(flat.contiguous().numpy().data)
            else:  # from a GPU straight into the file's pages: one copy, not one to host memory and one to the file
                _mapped(tmp, flat.numel(), flat.dtype, create=True).copy_(flat)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return TensorRef(str(path), flat.numel(), dtype)

    def allocate(self, name: str, numel: int, dtype: torch.dtype) -> tuple[TensorRef, torch.Tensor]:
        """A zeroed tensor backed by a new file ``name``: filled in place, then handed on by its reference."""
        path = self._path(f"{name}.{secrets.token_hex(6)}")
        return TensorRef(str(path), numel, _name(dtype)), _mapped(path, numel, dtype, create=True)

    @staticmethod
    def get(ref: TensorRef, writable: bool = False) -> torch.Tensor:
        """The tensor behind ``ref``, mapped (pages are read when used, and shared with other readers).

        ``writable``: the caller owns the file from now on and changes the tensor in place
        (a parent merging into a worker's fold): the mapping is shared, so changing a page
        does not copy it.
        """
        return _mapped(Path(ref.path), ref.numel, _DTYPES[ref.dtype], create=False, shared=writable)

    @staticmethod
    def drop(ref: TensorRef) -> None:
        """Remove the file (mappings already made stay valid until they are released)."""
        Path(ref.path).unlink(missing_ok=True)

    def done_with(self, ref: TensorRef) -> None:
        """A model sent under a fixed name (``<node>.down``) is no longer needed: freed if it is in memory.

        In the run folder it stays until the same name is sent again, for inspection.
        """
        if self.in_memory:
            Transfer.drop(ref)

    @property
    def in_memory(self) -> bool:
        return self.folder.is_relative_to(SHM)

    def clear(self) -> None:
        """Remove the folder and everything in it (a run attempt's start)."""
        shutil.rmtree(self.folder, ignore_errors=True)

    def release(self) -> None:
        """At a run attempt's end: free what lives in memory; files in the run folder stay for inspection."""
        if self.in_memory:
            self.clear()


def _name(dtype: torch.dtype) -> str:
    for name, known in _DTYPES.items():
        if known == dtype:
            return name
    raise ValueError(f"only float32, float64 and int64 tensors travel between processes, not {dtype}")


def _reserve(fd: int, size: int, path: Path) -> None:
    """Give the file behind ``fd`` all its ``size`` bytes of disk now, zero-filled.

    A file merely truncated to its size has no blocks yet, and writing through a mapping
    to a page the full disk cannot provide is SIGBUS: the process dies without a word
    (seen with ``runtime.transfer: run_folder`` on a full disk). Reserved up front, a
    full disk is an ``OSError(ENOSPC)`` naming the file, told like any other.
    """
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OSError(exc.errno, os.strerror(exc.errno), str(path)) from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)  # a filesystem that cannot reserve: as before


def _mapped(path: Path, numel: int, dtype: torch.dtype, *, create: bool, shared: bool = False) -> torch.Tensor:
    """Map ``path`` as a flat tensor: a new zero-filled file shared for writing, or an existing one (privately)."""
    if create:
        with open(path, "wb") as fh:
            try:
                if numel:
                    _reserve(fh.fileno(), numel * dtype.itemsize, path)
            except BaseException:
                path.unlink(missing_ok=True)
                raise
    elif not path.exists():
        raise FileNotFoundError(
            f"{path}: a tensor sent between the run's processes is missing (was the run restarted?)"
        )
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    return torch.from_file(str(path), shared=create or shared, size=numel, dtype=dtype)


@dataclass(frozen=True)
class SentCandidate:
    """A residual candidate on the wire: its model by reference."""

    node_id: str
    model: TensorRef
    weight: float
    loss: float


@dataclass(frozen=True)
class SentResult:
    """A ``ChildResult`` on the wire: its tensors by reference, the rest as it is."""

    result: ChildResult  # with no tensors: model, partial and candidates are below
    model: TensorRef | None = None
    partial: dict[str, TensorRef] | None = None
    partial_numbers: dict[str, float] | None = None
    candidates: tuple[SentCandidate, ...] = ()


def send_result(
    result: ChildResult,
    rule: AggregationRule | None,
    transfer: Transfer,
    name: str,
    in_place: Mapping[str, tuple[TensorRef, torch.Tensor]] | None = None,
) -> SentResult:
    """``result`` with its tensors put in ``transfer`` under ``name``; ``in_place``: tensors already in files.

    A worker that folded its batch into mapped files (``Transfer.allocate``) passes
    them in ``in_place`` (by the rule's tensor names): they are referenced, not copied.
    What crosses a process or a Prefect task or flow boundary is this, never tensors:
    Prefect keeps a run's return values in memory until its flow ends.
    """
    in_place = in_place or {}

    def ref(part: str, tensor: torch.Tensor) -> TensorRef:
        known = in_place.get(part)
        if known is not None and known[1].data_ptr() == tensor.data_ptr() and known[1].numel() == tensor.numel():
            return known[0]  # folded into that file (``tensor`` may be a view of the mapping)
        return transfer.put(f"{name}.{part}", tensor)

    model = ref("model", result.model) if result.model is not None else None
    partial = numbers = None
    if result.partial is not None:
        if rule is None:
            raise ValueError("a partial fold travels with the rule that made it")
        tensors, numbers = rule.wire(result.partial)
        partial = {part: ref(part, t) for part, t in tensors.items()}
    candidates = tuple(
        SentCandidate(c.node_id, ref(f"candidate-{i}", c.theta), c.weight, c.loss)
        for i, c in enumerate(result.candidates)
    )
    bare = replace(result, model=None, partial=None, candidates=())
    return SentResult(bare, model, partial, numbers, candidates)


def receive_result(sent: SentResult, rule: AggregationRule | None) -> ChildResult:
    """The ``ChildResult`` a ``SentResult`` stands for; its files are mapped, then removed."""
    refs = [*([sent.model] if sent.model else []), *(sent.partial or {}).values(), *(c.model for c in sent.candidates)]
    model = Transfer.get(sent.model) if sent.model is not None else None
    partial = None
    if sent.partial is not None:
        if rule is None:
            raise ValueError("a partial fold is received by the rule that made it")
        tensors = {k: Transfer.get(r, writable=True) for k, r in sent.partial.items()}  # merged into in place
        partial = rule.unwire(tensors, sent.partial_numbers or {})
    candidates = tuple(Candidate(c.node_id, Transfer.get(c.model), c.weight, c.loss) for c in sent.candidates)
    for r in refs:  # mapped already: the memory stays until the tensors are released
        Transfer.drop(r)
    return replace(sent.result, model=model, partial=partial, candidates=candidates)
