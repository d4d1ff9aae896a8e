"""The data manifest: what data preparation produced, and where it lies on disk.

Paths are relative to the manifest's folder so a prepared cache can be moved. It is
the one description of a partition the rest of the pipeline reads: every client
with its language, edge server and cluster, shard sizes and label histograms, the
proxy splits (with per-language row ranges), the task and the tokenizer facts that
training and evaluation need (pad, mask and special token ids).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, field_validator

from bhfl_core.config.topology import ClientInfo
from bhfl_core.learning.task_kinds import get_task_kind
from bhfl_core.store.atomic import write_text_atomic

MANIFEST_NAME = "manifest.json"


class Shard(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str
    size: int
    label_hist: list[int]
    # proxy shards: language -> [start, stop) rows, so a server can take its languages' share
    language_rows: dict[str, tuple[int, int]] = {}


class ClientEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    language: str
    edge: str  # the client's edge server (its parent in the tree)
    cluster: str  # the edge server's cluster: its language, or a k-means cluster c0, c1, ...
    train: Shard
    test: Shard


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fingerprint: str
    source: str  # where the client pool came from (and, for XGLUE, which splits)
    task: str  # a kind of bhfl_core.learning.task_kinds
    labels: list[str]
    tokenizer: str
    vocab_size: int
    pad_token_id: int
    mask_token_id: int | None = None
    special_ids: list[int] = []
    clustering: str = "language"
    clients: list[ClientEntry]
    proxy_source: str = "pool"  # "pool" (carved from the client pool) or the separate corpus
    proxy_train: Shard
    proxy_test: Shard
    unused_pool_rows: int
    held_out: str = ""  # splits of the source never read (XGLUE: test.<lang>)

    @field_validator("task")
    @classmethod
    def _known_task(cls, v: str) -> str:
        get_task_kind(v)  # unknown: a ValueError naming it and the available tasks
        return v

    def write(self, folder: Path) -> None:
        write_text_atomic(folder / MANIFEST_NAME, self.model_dump_json(indent=2))

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        return cls.model_validate_json((folder / MANIFEST_NAME).read_text())

    def tree_clients(self) -> list[ClientInfo]:
        """The clients as the tree is built from them (``build_tree``): id, language, size, edge, cluster."""
        return [ClientInfo(c.id, c.language, c.train.size, c.edge, c.cluster) for c in self.clients]
