"""A node checkpoint's header (round counter, execution, last metrics), read without torch.

Progress reads (``bhfl runs``, the resume plan, a parent reading a child's last
metrics) need the JSON header of a node's safetensors file, never its tensors. The
format is an 8-byte little-endian header length, the JSON header, then the tensor
bytes; reading it here keeps those reads free of torch (~1.5 s to import) and of
mapping the file. The header is checked as safetensors checks it on open: the tensors'
byte ranges must end where the file ends, so a truncated file is reported, not read.

The tensors themselves, and the writer, are in ``node_store.py``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bhfl_core.algorithm.node_state import AsyncProgress, InFlight, NodeState

if TYPE_CHECKING:
    import torch

    from bhfl_core.algorithm.node_opt import OptState

INFO = "bhfl"  # the metadata entry holding a file's info and its tensors' checksums
CHECKSUMS = "xxh3"  # the info's map of tensor name -> XXH3-64 (hex)
LEGACY_CHECKSUMS = "crc32"  # ... of tensor name -> CRC-32, in files of earlier versions
MODEL = "model"
PERSONAL = "personal"
VERSION = "async.v"  # + the version: a model an asynchronous node's in-flight child was sent
FEEDBACK = "feedback"  # a compressing sender's error-feedback residual (compression.py)
SENT = "sent."  # + the payload's part: the compressed update a finished execution sent
DOWN_REF = "downlink"  # a server's compressed broadcasts: the model its children hold (downlink.py)
_MAX_HEADER = 100_000_000  # safetensors' own limit


class CheckpointError(RuntimeError):
    """A state file that cannot be trusted (truncated, damaged, unreadable); names the file."""


def damaged(path: Path, why: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path} is damaged ({why}). It was complete when written (files are written to a "
        f"temporary name and renamed), so it was truncated or changed afterwards, e.g. by a disk error or "
        f"an outside copy. Restore it from a backup, or delete the run folder and run the experiment again."
    )


def node_file(root: Path, node_id: str) -> Path:
    """Where a store rooted at ``root`` keeps ``node_id``'s state."""
    return root / "nodes" / f"{node_id}.safetensors"


def _header(path: Path) -> dict[str, Any]:
    with path.open("rb") as fh:
        size = path.stat().st_size
        (length,) = struct.unpack("<Q", fh.read(8))
        if length > min(size - 8, _MAX_HEADER):
            raise ValueError(f"a header of {length} bytes in a file of {size}")
        header = json.loads(fh.read(length))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    if 8 + length + end != size:
        raise ValueError(f"the tensors end at byte {8 + length + end}, the file at {size}")
    return header


def read_info(path: Path) -> dict[str, Any]:
    """The info ``node_store.atomic_save`` wrote into ``path`` (its checksums left out)."""
    try:
        info = json.loads((_header(path).get("__metadata__") or {}).get(INFO, "{}"))
    except (OSError, ValueError, struct.error, KeyError, TypeError, IndexError) as exc:
        raise damaged(path, f"unreadable: {exc}") from None
    info.pop(CHECKSUMS, None)
    info.pop(LEGACY_CHECKSUMS, None)
    return dict(info)


def read_header(root: Path, node_id: str) -> NodeState:
    """``node_id``'s state without its tensors (``model`` None); an empty state if it has none yet."""
    path = node_file(root, node_id)
    return state_from_file({}, read_info(path) if path.exists() else {})


def _progress_from(info: dict[str, Any] | None, tensors: dict[str, torch.Tensor]) -> AsyncProgress | None:
    if info is None:
        return None
    flights = tuple(
        InFlight(c, int(d), int(v), float(s), None if f is None else float(f)) for c, d, v, s, f in info["in_flight"]
    )
    versions = {int(k[len(VERSION) :]): t for k, t in tensors.items() if k.startswith(VERSION)}
    return AsyncProgress(int(info["dispatched"]), float(info["now"]), flights, versions)


def state_from_file(tensors: dict[str, torch.Tensor], info: dict[str, Any]) -> NodeState:
    """The inverse of ``state_tensors`` + ``state_info`` (tensors may be omitted: a header-only state)."""
    opt_res: dict[str, OptState] = {}
    for name, value in tensors.items():
        if name.startswith("res."):
            kind, k = name[4:].split(".", 1)
            opt_res.setdefault(kind, {})[k] = value
    result = info.get("result", {})
    return NodeState(
        model=tensors.get(MODEL),
        opt_up={k[3:]: v for k, v in tensors.items() if k.startswith("up.")},
        opt_down={k[5:]: v for k, v in tensors.items() if k.startswith("down.")},
        rounds_done=int(info.get("rounds_done", 0)),
        opt_res=opt_res,
        exec_caller=info.get("exec_caller"),
        exec_start=int(info.get("exec_start", 0)),
        metrics=dict(info.get("metrics", {})),
        res_seen=dict(info.get("res_seen", {})),
        personal=tensors.get(PERSONAL),
        pending=_progress_from(info.get("async"), tensors),
        loss=None if result.get("loss") is None else float(result["loss"]),
        examples=int(result.get("examples", 0)),
        virtual_s=float(result.get("virtual_s", 0.0)),
        child_epochs={k: int(v) for k, v in info.get("child_epochs", {}).items()},
        rule_state=_rule_state(info),
        dp_steps=int(info.get("dp_steps", 0)),
        feedback=tensors.get(FEEDBACK),
        sent={k[len(SENT) :]: v for k, v in tensors.items() if k.startswith(SENT)},
        down_ref=tensors.get(DOWN_REF),
    )


def _rule_state(info: Mapping[str, Any]) -> dict[str, float]:
    """The aggregation rule's state (``rule``); a checkpoint written before rules kept state had a DP server's
    adaptive clipping norm as ``clip``."""
    if "clip" in info and info["clip"] is not None:
        return {"dp/clip": float(info["clip"])}
    return {k: float(v) for k, v in info.get("rule", {}).items()}
