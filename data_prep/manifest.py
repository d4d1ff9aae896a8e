"""The data manifest: what data preparation produced, and where it lies on disk.

Paths are relative to the manifest's folder so a prepared cache can be moved.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

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
    edge: str
    train: Shard
    test: Shard


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fingerprint: str
    source: str
    task: str
    labels: list[str]
    tokenizer: str
    vocab_size: int
    pad_token_id: int
    clients: list[ClientEntry]
    proxy_train: Shard
    proxy_test: Shard
    unused_pool_rows: int

    def resolve(self, root: Path, relative: str) -> Path:
        return root / relative

    def write(self, folder: Path) -> None:
        tmp = folder / (MANIFEST_NAME + ".tmp")
        tmp.write_text(self.model_dump_json(indent=2))
        tmp.replace(folder / MANIFEST_NAME)

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        return cls.model_validate_json((folder / MANIFEST_NAME).read_text())
