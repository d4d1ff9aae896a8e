"""Data sources: the labelled client pool (embedded or XGLUE) and an optional separate proxy corpus.

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
only: the cache key (``source_signature``) and a cache hit need none of it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from bhfl_core.config.base import ConfigError
from bhfl_core.config.data import EmbeddedSource, ProxySource, XglueSource
from bhfl_core.config.schema import ExperimentConfig
from bhfl_core.learning.hub import require_hub
from bhfl_core.rng import derive_seed
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
        _normalise(_load_xglue_split(source, xglue_split(source, lang)), texts, label, f"data.source ({lang})")
        for lang in source.languages
    ]
    for lang, table in zip(source.languages, tables):
        _check_labels(table, source, xglue_split(source, lang))
    names = _common_label_names(tables, "data.source")
    data = concatenate_datasets([_encode_labels(t, names) for t in tables])
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


def _load_xglue_split(source: XglueSource, split: str) -> Dataset:
    from datasets import load_dataset

    if source.local_dir is not None:
        folder = Path(source.local_dir).expanduser()
        files = local_split_files(folder, source.config, split)
        if not files:
            raise DataSourceError(
                f"data.source.local_dir: no parquet files for split {split!r} of XGLUE {source.config!r} in "
                f"{str(folder)!r}. Expected {source.config}/{split}.parquet (or {source.config}/{split}/*.parquet, "
                f"or the same without the {source.config}/ folder); the pool of a language is "
                f"{source.train_split!r} for {source.train_languages} and {source.pool_split!r} for the others "
                f"(docs/data.md, 'XGLUE from local parquet')."
            )
        return _load(
            lambda: load_dataset("parquet", data_files={split: [str(f) for f in files]}, split=split),
            f"parquet files {[str(f) for f in files]}",
            "data.source.local_dir",
        )
    return _load(
        lambda: load_dataset(source.repo, source.repo_config or source.config, split=split, revision=source.revision),
        f"split {split!r} of {source.repo!r} (config {source.repo_config or source.config!r}, "
        f"revision {source.revision or 'default'})",
        "data.source",
    )


def _load(fn, what: str, key: str):
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


def _normalise(ds: Dataset, texts: list[str], label: str | None, key: str) -> Dataset:
    """Select and rename to the common schema (``text``, ``text_pair``, ``label``)."""
    wanted = [*texts, *([label] if label else [])]
    missing = [c for c in wanted if c not in ds.column_names]
    if missing:
        raise DataSourceError(
            f"{key}: columns {missing} not found; the data has {ds.column_names} "
            "(set text_columns / label_column to the names it uses)"
        )
    rename = {texts[0]: TEXT, **({texts[1]: PAIR} if len(texts) > 1 else {}), **({label: LABEL} if label else {})}
    return ds.select_columns(wanted).rename_columns({k: v for k, v in rename.items() if k != v})


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
    if all(isinstance(f, ClassLabel) for f in features):
        names = features[0].names
        if any(f.names != names for f in features):
            raise DataSourceError(f"{key}: the label column has different class names in different splits")
        return list(names)
    values: set = set()
    for t in tables:
        values |= set(t.unique(LABEL))
    if all(isinstance(v, (int, np.integer)) for v in values):
        return [str(i) for i in range(int(max(values)) + 1)]
    return sorted(str(v) for v in values)


def _encode_labels(ds: Dataset, names: list[str]) -> Dataset:
    from datasets import ClassLabel, Value

    feature = ds.features[LABEL]
    if isinstance(feature, ClassLabel):
        return ds
    if isinstance(feature, Value) and feature.dtype.startswith("int"):
        return ds.cast_column(LABEL, ClassLabel(names=names))
    return ds.cast_column(LABEL, Value("string")).cast_column(LABEL, ClassLabel(names=names))


# ---------------------------------------------------------------- the separate proxy corpus


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
            _normalise(_proxy_rows(spec, lang, need, seed), spec.text_columns, label, f"data.proxy.source ({lang})")
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
        parts = [_normalise(raw, spec.text_columns, label, "data.proxy.source")]
    if label:
        parts = [_encode_labels(p, label_names) for p in parts]
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
        thunk = lambda: load_dataset("parquet", data_files={split: files}, split=split, streaming=spec.streaming)  # noqa: E731
    else:
        name = fill(spec.name) if spec.name else None
        thunk = lambda: load_dataset(spec.repo, name, split=split, revision=spec.revision, streaming=spec.streaming)  # noqa: E731
    ds = _load(thunk, what, "data.proxy.source")
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


# ---------------------------------------------------------------- reachability (before any work)


def check_hubs(config: ExperimentConfig) -> None:
    """Fail in seconds when a hub dataset of ``config`` is on a hub that cannot be reached (``hub.require_hub``)."""
    source = config.data.source
    if isinstance(source, XglueSource) and source.local_dir is None:
        require_hub(
            "data.source.repo",
            source.repo,
            "data.source.local_dir: <folder of XGLUE parquet files> (docs/data.md shows the layout and how to "
            "export it).",
        )
    proxy = config.data.proxy.source
    if proxy is not None and proxy.repo is not None:
        require_hub("data.proxy.source.repo", proxy.repo, "data.proxy.source.data_files: <local parquet files>.")


def check_sources(config: ExperimentConfig) -> None:
    """Cheap checks that the configured datasets can be found: local files exist, hub repos answer.

    Hub datasets are probed with ``load_dataset_builder`` (metadata only; with
    ``HF_HUB_OFFLINE=1`` it fails at once). The same ``DataSourceError`` as a real
    load, so the CLI can stop before starting Prefect.
    """
    from datasets import load_dataset_builder

    source = config.data.source
    if isinstance(source, XglueSource):
        if source.local_dir is not None:
            for lang in source.languages:  # raises the layout error when a split has no files
                split = xglue_split(source, lang)
                if not local_split_files(Path(source.local_dir).expanduser(), source.config, split):
                    _load_xglue_split(source, split)
        else:
            _load(
                lambda: load_dataset_builder(
                    source.repo, source.repo_config or source.config, revision=source.revision
                ),
                f"{source.repo!r} (config {source.repo_config or source.config!r}, "
                f"revision {source.revision or 'default'})",
                "data.source",
            )
    proxy = config.data.proxy.source
    if proxy is None:
        return
    lang = config.data.source.languages[0]
    fill = (lambda v: v.format(lang=lang)) if proxy.per_language else (lambda v: v)
    if proxy.data_files is not None:
        patterns = [proxy.data_files] if isinstance(proxy.data_files, str) else proxy.data_files
        missing = [fill(p) for p in patterns if not _glob(fill(p))]
        if missing:
            raise DataSourceError(
                f"data.proxy.source.data_files: no files match {missing} (paths are relative to the "
                "working directory; {lang} is replaced by each language)"
            )
    else:
        _load(
            lambda: load_dataset_builder(proxy.repo, fill(proxy.name) if proxy.name else None, revision=proxy.revision),
            f"proxy dataset {proxy.repo!r}",
            "data.proxy.source",
        )


# ---------------------------------------------------------------- identity (for the cache key)


def source_signature(config: ExperimentConfig) -> dict:
    """What identifies the source data beyond the config: local files' names, sizes and parquet footers.

    Replacing a local parquet file changes the fingerprint, so the cache never serves
    shards of old data. Hub sources are identified by repo, config and revision
    (in the config); pin ``revision`` for a fixed dataset version.
    """
    out: dict = {}
    source = config.data.source
    if isinstance(source, XglueSource) and source.local_dir is not None:
        folder = Path(source.local_dir).expanduser()
        splits = {xglue_split(source, lang) for lang in source.languages}
        out["source_files"] = {
            s: [_file_signature(f) for f in local_split_files(folder, source.config, s)] for s in sorted(splits)
        }
    proxy = config.data.proxy.source
    if proxy is not None and proxy.data_files is not None:
        patterns = [proxy.data_files] if isinstance(proxy.data_files, str) else proxy.data_files
        langs = config.data.source.languages if proxy.per_language else [None]
        files = sorted({str(p) for pat in patterns for lg in langs for p in _glob(pat.format(lang=lg) if lg else pat)})
        out["proxy_files"] = [_file_signature(Path(f)) for f in files]
    return out


def _glob(pattern: str) -> list[Path]:
    path = Path(pattern).expanduser()
    if path.is_absolute():
        return sorted(Path(path.anchor).glob(str(path.relative_to(path.anchor))))
    return sorted(Path().glob(pattern))


def _file_signature(path: Path) -> list:
    size = path.stat().st_size
    with path.open("rb") as f:
        f.seek(max(0, size - 65536))
        tail = hashlib.sha256(f.read()).hexdigest()[:16]  # a parquet footer holds the schema and row-group statistics
    return [path.name, size, tail]
