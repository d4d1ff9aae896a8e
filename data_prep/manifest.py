"""The data manifest: what data preparation produced, and where it lies on disk.

Paths are relative to the manifest's folder so a prepared cache can be moved. It is
the one description of a partition the rest of the pipeline reads: every client
with its language, edge server and cluster, shard sizes and label histograms, the
proxy splits (with per-language row ranges), the task and the tokenizer facts that
training and evaluation need (pad, mask and special token ids).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, overload

import numpy as np
from pydantic import BaseModel, ConfigDict, PlainSerializer, PlainValidator, TypeAdapter, field_validator

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


@dataclass(frozen=True, eq=False)
class ClientTable(Sequence[ClientEntry]):
    """The manifest's clients as columns: what every process of a run holds for the whole run.

    As pydantic objects (three models, their field sets, lists and dicts) a client took
    ~4.5 KB in ~30 tracked objects: 45 MB and ~300k objects at 10,000 clients in the
    command and in each worker, which every full garbage collection walks. Here each
    column is one numpy array (names as fixed-width strings, languages, edges and
    clusters as codes into a few names), ~0.6 KB a client in a dozen allocations, and the
    objects validation made are all freed, so their memory goes back whole. It reads as
    the sequence of ``ClientEntry`` it was validated from (each built when asked for, not
    kept), so code that walks the clients once (the partition report, the baselines) is
    unchanged; hot paths read the columns.
    """

    ids: np.ndarray  # str [C]
    language: np.ndarray  # str [C]
    edge: np.ndarray  # str [C]
    cluster: np.ndarray  # str [C]
    train_path: np.ndarray  # str [C]
    test_path: np.ndarray  # str [C]
    train_size: np.ndarray  # int64 [C]
    test_size: np.ndarray  # int64 [C]
    train_hist: np.ndarray  # int64 [C, L] (L = 0 where the task has no labels)
    test_hist: np.ndarray

    @classmethod
    def of(cls, entries: Sequence[ClientEntry]) -> ClientTable:
        for c in entries:
            if c.train.language_rows or c.test.language_rows:
                raise ValueError(f"client {c.id!r}: language_rows is for proxy shards, not a client's")
        ids = _strings([c.id for c in entries])
        if len(np.unique(ids)) != len(ids):
            raise ValueError("client ids must be unique")
        return cls(
            ids=ids,
            language=_strings([c.language for c in entries]),
            edge=_strings([c.edge for c in entries]),
            cluster=_strings([c.cluster for c in entries]),
            train_path=_strings([c.train.path for c in entries]),
            test_path=_strings([c.test.path for c in entries]),
            train_size=np.array([c.train.size for c in entries], dtype=np.int64),
            test_size=np.array([c.test.size for c in entries], dtype=np.int64),
            train_hist=_hist_table([c.train.label_hist for c in entries], "train"),
            test_hist=_hist_table([c.test.label_hist for c in entries], "test"),
        )

    def __len__(self) -> int:
        return len(self.ids)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ClientTable):
            return NotImplemented
        return all(np.array_equal(getattr(self, f.name), getattr(other, f.name)) for f in fields(self))

    __hash__ = None  # type: ignore[assignment]  # mutable-free but compared by value, like the list it replaces

    @overload
    def __getitem__(self, index: int) -> ClientEntry: ...
    @overload
    def __getitem__(self, index: slice) -> list[ClientEntry]: ...
    def __getitem__(self, index: int | slice) -> ClientEntry | list[ClientEntry]:
        if isinstance(index, slice):
            return [self._entry(i) for i in range(*index.indices(len(self)))]
        return self._entry(range(len(self))[index])

    def __iter__(self) -> Iterator[ClientEntry]:
        return (self._entry(i) for i in range(len(self)))

    @cached_property
    def _position(self) -> dict[str, int]:
        return {cid: i for i, cid in enumerate(self.ids.tolist())}

    def by_id(self, client_id: str) -> ClientEntry:
        """The client named ``client_id`` (a KeyError naming it if the manifest has none)."""
        try:
            return self._entry(self._position[client_id])
        except KeyError:
            raise KeyError(f"the data manifest has no client {client_id!r}") from None

    def _entry(self, i: int) -> ClientEntry:
        def shard(path: np.ndarray, size: np.ndarray, hist: np.ndarray) -> Shard:
            return Shard.model_construct(
                path=str(path[i]), size=int(size[i]), label_hist=hist[i].tolist(), language_rows={}
            )

        return ClientEntry.model_construct(
            id=str(self.ids[i]),
            language=str(self.language[i]),
            edge=str(self.edge[i]),
            cluster=str(self.cluster[i]),
            train=shard(self.train_path, self.train_size, self.train_hist),
            test=shard(self.test_path, self.test_size, self.test_hist),
        )


def _strings(values: list[str]) -> np.ndarray:
    """``values`` as one fixed-width string array (one allocation, however many there are)."""
    return np.array(values, dtype=np.str_) if values else np.array([], dtype="<U1")


def _hist_table(hists: list[list[int]], split: str) -> np.ndarray:
    widths = {len(h) for h in hists}
    if len(widths) > 1:
        raise ValueError(f"the clients' {split} label_hist have different lengths {sorted(widths)}")
    return np.array(hists, dtype=np.int64).reshape(len(hists), widths.pop() if widths else 0)


_ENTRIES = TypeAdapter(list[ClientEntry])


def _client_table(value: Any) -> ClientTable:
    """A manifest's ``clients`` (JSON entries or ``ClientEntry`` objects) validated into columns."""
    if isinstance(value, ClientTable):
        return value
    return ClientTable.of(_ENTRIES.validate_python(value))


Clients = Annotated[
    ClientTable,
    PlainValidator(_client_table),
    PlainSerializer(lambda table: [c.model_dump() for c in table], return_type=list[dict[str, Any]]),
]


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
    clients: Clients  # written as a list of ClientEntry, held as columns
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
        return cls.model_validate_json((folder / MANIFEST_NAME).read_text(encoding="utf-8"))

    def tree_clients(self) -> list[ClientInfo]:
        """The clients as the tree is built from them (``build_tree``): id, language, size, edge, cluster."""
        t = self.clients
        columns = (t.ids, t.language, t.train_size, t.edge, t.cluster)
        return [ClientInfo(*row) for row in zip(*(c.tolist() for c in columns), strict=True)]
