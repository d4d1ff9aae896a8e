"""Data sources: the labelled client pool (embedded or XGLUE), and the schema every source ends in.

The optional separate proxy corpus is loaded by ``data_prep/proxy_source.py``, with this
module's loaders; what can be checked of the sources before any work (can they be
reached? which files are they?) is ``data_prep/source_checks.py``.

Every source goes through Hugging Face ``datasets`` and ends as Arrow tables with one
schema: ``text`` (and ``text_pair`` for pair tasks), ``label`` (an integer class id)
where the source is labelled, plus a numpy array with each row's language. Nothing
here turns a dataset into Python lists: labels and languages are read as numpy
columns, texts stay in Arrow until tokenisation (``datasets.map``, batched).

XGLUE has training text only in English. The rule (``XglueSource``): a language in
``train_languages`` (default ``[en]``) draws its pool from ``train``; every other
language draws it from ``validation.<lang>``; ``test.<lang>`` is never read (held
out). Local parquet files are loaded through the same ``load_dataset`` call
(``"parquet"`` builder) as the hub, with the same split names.

``datasets`` (~0.7 s to import, with pandas and pyarrow) is imported by the loaders
only: the cache key (``source_checks.source_signature``) and a cache hit need none of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from bhfl_core.config.base import ConfigError
from bhfl_core.config.data import EmbeddedSource, XglueSource
from bhfl_core.config.schema import ExperimentConfig
from data_prep.partition import pool_size_needed

if TYPE_CHECKING:
    from datasets import Dataset

TEXT, PAIR, LABEL = "text", "text_pair", "label"
NO_LANGUAGE = "*"  # proxy rows of a corpus without language information


class DataSourceError(ConfigError):
    """A dataset (or model) cannot be loaded; the message says how to point the config at local files."""


@dataclass(frozen=True)
class TextTable:
    """Rows in the common schema, with each row's language (and label, when labelled)."""

    data: Dataset
    languages: np.ndarray
    labels: np.ndarray | None
    label_names: list[str]

    @property
    def pair(self) -> bool:
        return PAIR in self.data.column_names

    def __len__(self) -> int:
        return len(self.data)


def column(data: Dataset, name: str) -> np.ndarray:
    """One column as a numpy array, converted from Arrow as a whole.

    (``data[name]`` is a lazy column in ``datasets`` >= 4: ``np.asarray`` of it formats
    one row at a time, ~30 µs a row.)
    """
    return np.asarray(data.with_format("numpy", columns=[name])[:][name])


# ---------------------------------------------------------------- the client pool


def load_pool(config: ExperimentConfig, scratch: Path | None = None) -> TextTable:
    """The labelled client pool; ``scratch``: a folder for a large generated pool (see ``SPILL_BYTES``)."""
    source = config.data.source
    if isinstance(source, EmbeddedSource):
        return _embedded_pool(config, source, scratch)
    if isinstance(source, XglueSource):
        return _xglue_pool(source)
    raise ValueError(f"data.source kind {source.kind!r} has no client pool to load (it is prepared already)")


SPILL_BYTES = 64 << 20  # a generated language larger than this is written to ``scratch`` and memory-mapped


def _spill(part: Dataset, path: Path) -> Dataset:
    """``part`` written to the Arrow file ``path`` and opened from it, memory-mapped (the same rows and features)."""
    import pyarrow as pa
    from datasets import Dataset

    path.parent.mkdir(parents=True, exist_ok=True)
    table = part.data.table
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=1 << 16)
    return Dataset.from_file(str(path))


def _embedded_pool(config: ExperimentConfig, source: EmbeddedSource, scratch: Path | None) -> TextTable:
    """The generated pool, language after language; a large language is kept on disk, not in memory.

    At 100,000 clients the pool is ~1.9 GB of text: each language is written to
    ``scratch`` as soon as it is generated and read back memory-mapped, so the process
    holds one language's generation at a time.
    """
    from datasets import concatenate_datasets

    from data_prep.embedded import CATEGORIES, generate_pool

    parts = []
    for lang in source.languages:
        need = pool_size_needed(config.data, config.seed, lang)
        part = generate_pool(config.seed, lang, int(need * 1.3) + 50, source.shared_cue_strength, source.topic_strength)
        if scratch is not None and part.data.nbytes > SPILL_BYTES:
            part = _spill(part, scratch / f"{lang}.arrow")
        parts.append(part)
    pool = concatenate_datasets(parts)
    languages = np.repeat(np.array(source.languages), [len(p) for p in parts])
    data = pool.select_columns(["news_title", "news_body", "news_category"]).rename_columns(
        {"news_title": TEXT, "news_body": PAIR, "news_category": LABEL}
    )
    return TextTable(data, languages, column(data, LABEL), list(CATEGORIES))


def xglue_split(source: XglueSource, language: str) -> str:
    """The split a language's pool comes from (the XGLUE rule above)."""
    if language in source.train_languages:
        return source.train_split.format(lang=language)
    return source.pool_split.format(lang=language)


def _xglue_pool(source: XglueSource) -> TextTable:
    from datasets import concatenate_datasets

    texts, label = source.columns()
    tables = [
        normalise(load_xglue_split(source, xglue_split(source, lang)), texts, label, f"data.source ({lang})")
        for lang in source.languages
    ]
    for lang, table in zip(source.languages, tables):
        _check_labels(table, source, xglue_split(source, lang))
    names = _common_label_names(tables, "data.source")
    data = concatenate_datasets([encode_labels(t, names) for t in tables])
    languages = np.repeat(np.array(source.languages), [len(t) for t in tables])
    return TextTable(data, languages, column(data, LABEL), names)


def local_split_files(folder: Path, config: str, split: str) -> list[Path]:
    """Parquet files of one split in a local XGLUE folder (the layouts docs/data.md lists)."""
    found: list[Path] = []
    for base in (folder / config, folder):
        for pattern in (f"{split}.parquet", f"{split}/*.parquet", f"{split}-*.parquet"):
            found += sorted(base.glob(pattern))
        if found:
            return found
    return found


def load_xglue_split(source: XglueSource, split: str) -> Dataset:
    from datasets import load_dataset

    if source.local_dir is not None:
        folder = Path(source.local_dir).expanduser()
        files = local_split_files(folder, source.config, split)
        if not folder.is_dir():
            what = "is a file, not a folder" if folder.exists() else "does not exist"
            raise DataSourceError(
                f"data.source.local_dir: {str(folder)!r} {what} (a relative path is relative to the working "
                f"directory, {Path.cwd()}); it must be the folder of XGLUE parquet files (docs/data.md, 'XGLUE from "
                "local parquet')."
            )
        if not files:
            raise DataSourceError(
                f"data.source.local_dir: no parquet files for split {split!r} of XGLUE {source.config!r} in "
                f"{str(folder)!r}. Expected {source.config}/{split}.parquet (or {source.config}/{split}/*.parquet, "
                f"or the same without the {source.config}/ folder); the pool of a language is "
                f"{source.train_split!r} for {source.train_languages} and {source.pool_split!r} for the others "
                f"(docs/data.md, 'XGLUE from local parquet')."
            )
        if empty := empty_parquet(files):  # datasets' own error says only "An error occurred while generating"
            raise DataSourceError(
                f"data.source.local_dir: {empty} has no rows (split {split!r} of XGLUE {source.config!r}); "
                "write the split's rows into it, or remove it."
            )
        return load_or_explain(
            lambda: load_dataset("parquet", data_files={split: [str(f) for f in files]}, split=split),
            f"parquet files {[str(f) for f in files]}",
            "data.source.local_dir",
        )
    return load_or_explain(
        lambda: load_dataset(source.repo, source.repo_config or source.config, split=split, revision=source.revision),
        f"split {split!r} of {source.repo!r} (config {source.repo_config or source.config!r}, "
        f"revision {source.revision or 'default'})",
        "data.source",
    )


def empty_parquet(files: list[Path]) -> Path | None:
    """The first of ``files`` that is a readable parquet file without rows (unreadable ones fail in the load)."""
    import pyarrow.parquet as pq

    for file in files:
        try:
            if pq.ParquetFile(file).metadata.num_rows == 0:
                return file
        except Exception:  # not parquet, or damaged: load_dataset's error names it
            continue
    return None


def load_or_explain(fn, what: str, key: str):
    """``fn()`` (a ``datasets`` load of ``what``), any failure turned into one ``DataSourceError`` under ``key``.

    One message for every way a load fails (network, missing repo or split, offline mode, a
    repo that needs a loading script), saying how to point the config at local files.
    """
    try:
        return fn()
    except DataSourceError:
        raise
    except Exception as exc:  # network, missing repo/split, offline mode, script datasets: all one message
        detail = str(exc).strip().splitlines()[0][:300].rstrip(".") if str(exc).strip() else ""
        raise DataSourceError(
            f"{key}: could not load {what}: {type(exc).__name__}: {detail}. "
            "Without hub access (HF_HUB_OFFLINE=1, no network), or when a repo needs a loading script "
            "(datasets >= 4 runs none; the canonical microsoft/xglue is one), point the config at local files: "
            "data.source.local_dir: <folder of XGLUE parquet files> (or data.proxy.source.data_files for the proxy), "
            "or data.source.repo / revision at a parquet mirror. docs/data.md shows the layout and how to export it."
        ) from None


def normalise(ds: Dataset, texts: list[str], label: str | None, key: str) -> Dataset:
    """Select and rename to the common schema (``text``, ``text_pair``, ``label``)."""
    wanted = [*texts, *([label] if label else [])]
    missing = [c for c in wanted if c not in ds.column_names]
    if missing:
        raise DataSourceError(
            f"{key}: columns {missing} not found; the data has {ds.column_names} "
            "(set text_columns / label_column to the names it uses)"
        )
    _check_texts(ds, texts, key)
    rename = {texts[0]: TEXT, **({texts[1]: PAIR} if len(texts) > 1 else {}), **({label: LABEL} if label else {})}
    return ds.select_columns(wanted).rename_columns({k: v for k, v in rename.items() if k != v})


def _check_texts(ds: Dataset, texts: list[str], key: str) -> None:
    """Text columns hold strings in every row: else the tokenizer fails mid-preparation with a bare TypeError.

    A column of another type (numbers, lists) is named with its type; missing texts
    (nulls) are named with their count, not replaced by empty strings: a row without
    its text is a data problem to fix, not one to train on.
    """
    from datasets import Value

    for name in texts:
        feature = ds.features[name]
        if not (isinstance(feature, Value) and feature.dtype in ("string", "large_string")):
            raise DataSourceError(
                f"{key}: text column {name!r} holds {feature}, not strings (set text_columns to the text columns)."
            )
        if nulls := ds.data.column(name).null_count:
            raise DataSourceError(
                f"{key}: text column {name!r} is missing (null) in {nulls} of {len(ds)} rows; remove or fill them."
            )


def _xglue_labels(task: str) -> tuple[str, ...]:
    """The classes of an XGLUE task, for checking labels (with the task's own label column)."""
    from data_prep.embedded import CATEGORIES  # XGLUE NC's 10 categories (the embedded corpus uses them too)

    return {"nc": CATEGORIES, "xnli": ("entailment", "neutral", "contradiction"), "paws-x": ("0", "1")}[task]


def _check_labels(table: Dataset, source: XglueSource, split: str) -> None:
    """Labels outside the task's label set (or negative ids, the usual mark of unlabelled rows) are data errors."""
    from datasets import ClassLabel

    known = _xglue_labels(source.config) if source.label_column is None else None
    feature = table.features[LABEL]
    values = table.unique(LABEL)
    if isinstance(feature, ClassLabel) or all(isinstance(v, (int, np.integer)) for v in values):
        size = len(known) if known else len(feature.names) if isinstance(feature, ClassLabel) else None
        bad: list[int] | list[str] = sorted(
            int(v) for v in values if int(v) < 0 or (size is not None and int(v) >= size)
        )
        allowed = f"class ids 0..{size - 1}" if size else "class ids >= 0"
    else:
        bad = sorted(str(v) for v in values if known and str(v) not in known)
        allowed = f"the XGLUE {source.config!r} classes {list(known or ())}"
    if bad:
        where = f"parquet files in {source.local_dir}" if source.local_dir else f"{source.repo}"
        raise DataSourceError(
            f"data.source: split {split!r} ({where}) has labels {bad[:5]} outside the label set ({allowed}). "
            f"Remove or relabel those rows (a label of -1 usually marks an unlabelled row), or, for a mirror with "
            f"other label names, set data.source.label_column to its label column."
        )


def _common_label_names(tables: list[Dataset], key: str) -> list[str]:
    """Class names shared by every table: a ClassLabel's names, or the sorted values of a string/int column."""
    from datasets import ClassLabel

    features = [t.features[LABEL] for t in tables]
    named = [f for f in features if isinstance(f, ClassLabel)]
    if named:
        names = named[0].names
        if any(f.names != names for f in named):
            raise DataSourceError(f"{key}: the label column has different class names in different splits")
        for table, feature in zip(tables, features):  # the others (no ClassLabel): its class names, or ids
            if not isinstance(feature, ClassLabel) and (bad := _not_classes(table.unique(LABEL), names)):
                raise DataSourceError(
                    f"{key}: labels {bad[:5]} of one split are neither class names nor ids of the others' class "
                    f"names {list(names)}."
                )
        return list(names)
    values: set = set()
    for t in tables:
        values |= set(t.unique(LABEL))
    if all(isinstance(v, (int, np.integer)) for v in values):
        return [str(i) for i in range(int(max(values)) + 1)]
    return sorted(str(v) for v in values)


def _not_classes(values: list, names: list[str]) -> list:
    """The label values that are not one of ``names`` (strings) or an id of one (integers)."""
    if all(isinstance(v, (int, np.integer)) for v in values):
        return sorted(int(v) for v in values if not 0 <= int(v) < len(names))
    return sorted(str(v) for v in values if str(v) not in names)


def encode_labels(ds: Dataset, names: list[str]) -> Dataset:
    from datasets import ClassLabel, Value

    feature = ds.features[LABEL]
    if isinstance(feature, ClassLabel):
        return ds
    if isinstance(feature, Value) and feature.dtype.startswith("int"):
        return ds.cast_column(LABEL, ClassLabel(names=names))
    return ds.cast_column(LABEL, Value("string")).cast_column(LABEL, ClassLabel(names=names))
