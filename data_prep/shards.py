"""Pre-tokenised shards on disk: a few Arrow files for all clients, each client a row range of them.

A preparation writes four Arrow files (``clients/train.arrow``, ``clients/test.arrow``,
``proxy/train.arrow``, ``proxy/test.arrow``): the clients' rows client after client, in
manifest order. A shard's ``path`` in the manifest names its rows:

- ``clients/train.arrow[1200:1240]``: rows 1200 to 1239 of that file (Python's slice
  notation; the size is ``stop - start``);
- ``proxy/train.arrow``: the whole file;
- ``clients/en-00/train``: a folder saved with ``datasets.Dataset.save_to_disk`` (the
  layout of earlier versions, and what an outside tool may write for
  ``data.source.kind: prepared``).

The files are Arrow IPC streams with ``datasets``' schema metadata (what ``datasets``
writes itself), so ``datasets.Dataset.from_file(path)`` opens them too. Token columns
are fixed-size lists (``input_ids`` int32, masks int8), so reading a client's rows is
a slice of a memory-mapped file and one copy into tensors: ``load_shard`` maps each
file once per process (``_MAPPED``) and reads only the rows it is asked for.
"""

from __future__ import annotations

import mmap
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pyarrow and torch where shards are written or read: not on a cache hit
    import pyarrow as pa
    import torch

_ROWS = re.compile(r"^(?P<file>.+\.arrow)\[(?P<start>\d+):(?P<stop>\d+)\]$")
ARROW_SUFFIX = ".arrow"


def row_range(file: str, start: int, stop: int) -> str:
    """The shard path of rows ``[start, stop)`` of ``file``."""
    return f"{file}[{start}:{stop}]"


def parse_path(path: str) -> tuple[str, tuple[int, int] | None]:
    """``(file or folder, (start, stop) or None for all of it)`` of a shard path."""
    match = _ROWS.match(path)
    if match is None:
        return path, None
    return match["file"], (int(match["start"]), int(match["stop"]))


def is_arrow_file(path: str) -> bool:
    return parse_path(path)[0].endswith(ARROW_SUFFIX)


# ---------------------------------------------------------------- writing


def token_schema(columns: Sequence[str], width: int, labelled: bool) -> pa.Schema:
    """The Arrow schema of a shard file: token columns of ``width`` tokens (+ ``labels``), datasets' metadata."""
    from datasets import Features, Sequence, Value

    types = {"input_ids": "int32"}  # masks and token types are small
    features = {c: Sequence(Value(types.get(c, "int8")), length=width) for c in columns}
    if labelled:
        features["labels"] = Value("int64")
    return Features(features).arrow_schema


class ShardWriter:
    """Appends rows (dicts of numpy arrays: 2-D token columns, 1-D labels) to one Arrow stream file."""

    def __init__(self, path: Path, schema: pa.Schema) -> None:
        import pyarrow as pa

        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.rows = 0
        self._schema = schema
        self._sink = pa.OSFile(str(path), "wb")
        self._writer = pa.ipc.new_stream(self._sink, schema)

    def write(self, columns: dict[str, np.ndarray]) -> None:
        import pyarrow as pa

        arrays = []
        for field in self._schema:
            values = columns[field.name]
            if pa.types.is_fixed_size_list(field.type):
                flat = pa.array(values.reshape(-1).astype(field.type.value_type.to_pandas_dtype(), copy=False))
                arrays.append(pa.FixedSizeListArray.from_arrays(flat, field.type.list_size))
            else:
                arrays.append(pa.array(values, field.type))
        batch = pa.RecordBatch.from_arrays(arrays, schema=self._schema)
        if batch.num_rows:
            self._writer.write_batch(batch)
        self.rows += batch.num_rows

    def close(self) -> None:
        self._writer.close()
        self._sink.close()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------- reading


@dataclass(frozen=True)
class _Mapped:
    """A shard file's table and the memory map its buffers point into."""

    table: pa.Table
    view: mmap.mmap | None  # None: an empty file (nothing to map; reading it fails as before)

    def let_go(self) -> None:
        """Drop the file's pages from this process's memory (``madvise(MADV_DONTNEED)``); they stay in the
        page cache, and a later read maps them again.

        Every read copies its rows out (``read_rows``), so what stays mapped after it is
        pages of a file this process will not read again soon: a worker touched most of
        the training file over a run (~80 MB at 10,000 clients) and the whole test file
        (~40 MB), all counted in its memory although each client's rows are read once a
        round. Dropping them costs a page-table walk (microseconds); a file's contents
        are never lost by it.
        """
        if self.view is not None and hasattr(mmap, "MADV_DONTNEED"):
            self.view.madvise(mmap.MADV_DONTNEED)


_MAPPED: OrderedDict[tuple, _Mapped] = OrderedDict()  # (path, inode, size, mtime) -> its memory-mapped table
_MAPPED_FILES = 8  # a worker serves a run or a few: each has four files
_LOCK = threading.Lock()


def _open_mapped(path: Path) -> _Mapped:
    import pyarrow as pa

    with open(path, "rb") as file:
        view = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) if os.fstat(file.fileno()).st_size else None
    table = pa.ipc.open_stream(pa.py_buffer(view if view is not None else b"")).read_all()
    return _Mapped(table, view)


def _mapped(path: Path) -> _Mapped:
    """The file's table, memory-mapped (no rows are read until used), opened once per process."""
    stat = path.stat()
    key = (str(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)
    with _LOCK:
        mapped = _MAPPED.get(key)
        if mapped is None:
            mapped = _open_mapped(path)
            _MAPPED[key] = mapped
            while len(_MAPPED) > _MAPPED_FILES:
                _MAPPED.popitem(last=False)
        else:
            _MAPPED.move_to_end(key)
        return mapped


def file_rows(path: Path) -> int:
    """The number of rows of an Arrow shard file."""
    return _mapped(path).table.num_rows


def _numpy(column: pa.ChunkedArray) -> np.ndarray:
    """A column as numpy: fixed-size lists as 2-D arrays (views into the map where they can be)."""
    import pyarrow as pa

    array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if pa.types.is_fixed_size_list(array.type):
        return array.flatten().to_numpy(zero_copy_only=False).reshape(len(array), array.type.list_size)
    if pa.types.is_list(array.type) or pa.types.is_large_list(array.type):
        return np.array(array.to_pylist())
    return array.to_numpy(zero_copy_only=False)


def _tensor(values: np.ndarray) -> torch.Tensor:
    """As ``datasets``' torch format gives it: integers as int64, floats as float32 (a copy, not a view)."""
    import torch

    if np.issubdtype(values.dtype, np.integer):
        return torch.from_numpy(values.astype(np.int64))
    if np.issubdtype(values.dtype, np.floating):
        return torch.from_numpy(values.astype(np.float32))
    return torch.from_numpy(values.copy())


def read_numpy(file: Path, start: int | None = None, stop: int | None = None) -> dict[str, np.ndarray]:
    """Rows ``[start, stop)`` (default: all) of an Arrow shard file as numpy arrays (views into the map if they can)."""
    return _numpy_rows(_mapped(file).table, file, start, stop)


def _numpy_rows(table: pa.Table, file: Path, start: int | None, stop: int | None) -> dict[str, np.ndarray]:
    start = 0 if start is None else start
    stop = table.num_rows if stop is None else stop
    if not 0 <= start <= stop <= table.num_rows:
        raise ValueError(f"rows [{start}, {stop}) are not in {file} ({table.num_rows} rows)")
    rows = table.slice(start, stop - start)
    return {name: _numpy(rows.column(name)) for name in rows.column_names}


def read_rows(file: Path, start: int | None = None, stop: int | None = None) -> dict[str, torch.Tensor]:
    """Rows ``[start, stop)`` (default: all) of an Arrow shard file as tensors (copies); only those rows are read.

    The file's pages are let go after the copy (``_Mapped.let_go``), so a long-lived
    worker holds the rows it uses, not the files it read them from.
    """
    mapped = _mapped(file)
    rows = {name: _tensor(values) for name, values in _numpy_rows(mapped.table, file, start, stop).items()}
    mapped.let_go()
    return rows


def load_shard(path: Path) -> dict[str, torch.Tensor]:
    """A shard (the ``path`` of a manifest entry under the data folder) as a dict of tensors."""
    file, rows = parse_path(str(path))
    if file.endswith(ARROW_SUFFIX):
        return read_rows(Path(file), *(rows or (None, None)))
    from datasets import load_from_disk

    return load_from_disk(file).with_format("torch")[:]


def load_shards(root: Path, paths: Sequence[str]) -> dict[str, torch.Tensor]:
    """Several shards' rows concatenated, in order (consecutive row ranges of one file are read as one)."""
    import torch

    if not paths:
        raise ValueError("load_shards needs at least one shard")
    reads: list[tuple[str, int, int] | str] = []  # merged ranges of files, or folders
    for path in paths:
        file, rows = parse_path(path)
        last = reads[-1] if reads else None
        if rows is not None and isinstance(last, tuple) and last[0] == file and last[2] == rows[0]:
            reads[-1] = (file, last[1], rows[1])
        elif rows is not None:
            reads.append((file, *rows))
        else:
            reads.append(path)
    parts = [read_rows(root / r[0], r[1], r[2]) if isinstance(r, tuple) else load_shard(root / r) for r in reads]
    parts = [p for p in parts if len(p) and len(next(iter(p.values())))] or parts[:1]
    if len(parts) == 1:
        return parts[0]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
