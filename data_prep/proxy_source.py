"""The separate proxy corpus (``data.proxy.source``), in the common schema of ``data_prep/sources.py``.

Servers' proxy rows come from the client pool unless the config names a corpus of their
own: local parquet files or a hub dataset, one per language (``per_language``) or one
for all with an optional language column. A large corpus can be streamed: only the rows
the proxy splits need are read, through a shuffle buffer seeded from the run's seed, so
the same config reads the same rows. Loading and errors go through the same helpers as
the client pool (``sources.load_or_explain``, ``normalise``, ``encode_labels``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from bhfl_core.config.data import ProxySource
from bhfl_core.rng import derive_seed
from data_prep.source_checks import glob_files
from data_prep.sources import (
    LABEL,
    NO_LANGUAGE,
    DataSourceError,
    TextTable,
    column,
    empty_parquet,
    encode_labels,
    load_or_explain,
    normalise,
)

if TYPE_CHECKING:
    from datasets import Dataset


def load_proxy_source(
    spec: ProxySource, languages: list[str], need: int, seed: int, label_names: list[str]
) -> TextTable:
    """The proxy corpus in the common schema; ``need`` rows per language are enough (streaming stops there).

    Labels, when the corpus has them, are encoded with the client pool's class names
    (a proxy label the pool does not know is an error).
    """
    from datasets import concatenate_datasets

    label = spec.label_column
    if spec.per_language:
        parts = [
            normalise(_proxy_rows(spec, lang, need, seed), spec.text_columns, label, f"data.proxy.source ({lang})")
            for lang in languages
        ]
        langs = np.repeat(np.array(languages), [len(p) for p in parts])
    else:
        columns = [
            *spec.text_columns,
            *([label] if label else []),
            *([spec.language_column] if spec.language_column else []),
        ]
        raw = _proxy_rows(spec, None, need, seed, languages)
        missing = [c for c in columns if c not in raw.column_names]
        if missing:
            raise DataSourceError(f"data.proxy.source: columns {missing} not found; the data has {raw.column_names}")
        if spec.language_column:
            langs = column(raw, spec.language_column).astype(str)
        else:
            langs = np.full(len(raw), NO_LANGUAGE)
        parts = [normalise(raw, spec.text_columns, label, "data.proxy.source")]
    if label:
        parts = [encode_labels(p, label_names) for p in parts]
        unknown = set().union(*(set(p.unique(LABEL)) for p in parts)) - set(range(len(label_names)))
        if unknown:
            raise DataSourceError(
                f"data.proxy.source.label_column: labels {sorted(unknown)} are not classes of the client pool"
            )
    data = concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    labels = column(data, LABEL) if label else None
    return TextTable(data, langs, labels, label_names)


def _proxy_rows(
    spec: ProxySource, lang: str | None, need: int, seed: int, languages: list[str] | None = None
) -> Dataset:
    from datasets import load_dataset

    fill = (lambda v: v.format(lang=lang)) if lang is not None else (lambda v: v)
    split = fill(spec.split)
    what = f"proxy {'files ' + str(spec.data_files) if spec.data_files else repr(spec.repo)} split {split!r}"
    if spec.data_files is not None:
        files = [fill(f) for f in ([spec.data_files] if isinstance(spec.data_files, str) else spec.data_files)]
        if empty := empty_parquet([path for pattern in files for path in glob_files(pattern)]):
            raise DataSourceError(
                f"data.proxy.source.data_files: {empty} has no rows; write its rows, or leave it out."
            )
        thunk = lambda: load_dataset("parquet", data_files={split: files}, split=split, streaming=spec.streaming)  # noqa: E731
    else:
        name = fill(spec.name) if spec.name else None
        thunk = lambda: load_dataset(spec.repo, name, split=split, revision=spec.revision, streaming=spec.streaming)  # noqa: E731
    ds = load_or_explain(thunk, what, "data.proxy.source")
    if not spec.streaming:
        return ds
    return _take_streamed(ds, spec, lang, need, seed, languages)


def _take_streamed(
    stream, spec: ProxySource, lang: str | None, need: int, seed: int, languages: list[str] | None
) -> Dataset:
    """Read only ``need`` rows per language from a streamed corpus (seeded shuffle buffer)."""
    from datasets import Dataset

    stream = stream.shuffle(
        seed=derive_seed(seed, "proxy", "stream", lang or "") % 2**32, buffer_size=spec.shuffle_buffer
    )
    if lang is not None or not spec.language_column:
        total = need if lang is not None or spec.language_column else need * len(languages or [None])
        return Dataset.from_list(list(stream.take(total)))
    wanted = {lg: need for lg in languages or []}
    rows = []
    for row in stream:
        lg = str(row[spec.language_column])
        if wanted.get(lg, 0) > 0:
            rows.append(row)
            wanted[lg] -= 1
            if not any(wanted.values()):
                break
    return Dataset.from_list(rows) if rows else Dataset.from_dict({c: [] for c in spec.text_columns})
