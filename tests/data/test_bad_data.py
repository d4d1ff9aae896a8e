"""Bad data gets one clear error naming the file, split or language and the fix; nothing is half-written.

Local XGLUE parquet folders (tests/data/xglue_fixtures.py) broken the ways real data is
broken: a corrupt parquet file, labels outside the task's label set, a missing text
column, a text column of numbers or with null rows, class names in a split beside
ClassLabel splits, and a language with too few rows for its clients (an empty client).
"""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_prep.partition import PartitionError
from data_prep.prepare import prepare_data
from data_prep.sources import DataSourceError, load_pool
from flows.cli.errors import exit_code, explain
from tests.data.xglue_fixtures import write_xglue_nc, write_xglue_xnli
from tests.small import small_config


def _xglue(folder, languages="[en, de, fr]", config="nc", *extra):
    return small_config(
        f"data.source={{kind: xglue, config: {config}, local_dir: '{folder}', languages: {languages}}}", *extra
    )


def _prepare_fails(cfg, cache, error, pattern):
    with pytest.raises(error, match=pattern):
        prepare_data(cfg, cache, log=lambda _: None)
    left = sorted(p.name for p in cache.iterdir()) if cache.exists() else []
    assert left == [], left  # no cache entry, complete or partial, was left behind


def test_corrupt_parquet_file_is_named(tmp_path):
    folder = write_xglue_nc(tmp_path / "xglue")
    (folder / "nc" / "validation.de.parquet").write_bytes(b"PAR1 this is not a parquet file")
    _prepare_fails(
        _xglue(folder),
        tmp_path / "cache",
        DataSourceError,
        r"data.source.local_dir: could not load parquet files .*validation.de.parquet.*point the config",
    )


def test_a_parquet_file_without_rows_is_named(tmp_path):
    folder = write_xglue_nc(tmp_path / "xglue")
    path = folder / "nc" / "validation.de.parquet"
    pq.write_table(pq.read_table(path).slice(0, 0), path)  # the schema, no rows (datasets: "An error occurred")
    _prepare_fails(
        _xglue(folder),
        tmp_path / "cache",
        DataSourceError,
        rf"data.source.local_dir: {path} has no rows \(split 'validation.de' of XGLUE 'nc'\)",
    )
    proxy = f"data.proxy.source={{data_files: '{path}', text_columns: [news_title], label_column: news_category}}"
    _prepare_fails(
        small_config(proxy), tmp_path / "cache", DataSourceError, rf"data.proxy.source.data_files: {path} has no rows"
    )


def test_labels_outside_the_label_set(tmp_path):
    folder = write_xglue_xnli(tmp_path / "xglue", languages=("en", "de"))
    broken = pq.read_table(folder / "xnli" / "validation.de.parquet")
    labels = broken.column("label").to_pylist()
    labels[3], labels[7] = -1, 5  # an unlabelled row and a class XNLI does not have
    pq.write_table(broken.set_column(2, "label", pa.array(labels)), folder / "xnli" / "validation.de.parquet")
    _prepare_fails(
        _xglue(folder, "[en, de]", "xnli", "tree.groups={}"),
        tmp_path / "cache",
        DataSourceError,
        r"split 'validation.de' .* has labels \[-1, 5\] outside the label set \(class ids 0..2\)",
    )


def test_missing_text_column(tmp_path):
    folder = write_xglue_nc(tmp_path / "xglue")
    table = pq.read_table(folder / "nc" / "validation.fr.parquet").drop(["news_body"])
    pq.write_table(table, folder / "nc" / "validation.fr.parquet")
    _prepare_fails(
        _xglue(folder), tmp_path / "cache", DataSourceError, r"data.source \(fr\): columns \['news_body'\] not found"
    )


def test_too_few_rows_for_the_clients_of_a_language(tmp_path):
    folder = write_xglue_nc(tmp_path / "xglue")
    table = pq.read_table(folder / "nc" / "validation.de.parquet").slice(0, 12)
    pq.write_table(table, folder / "nc" / "validation.de.parquet")
    _prepare_fails(_xglue(folder), tmp_path / "cache", PartitionError, r"language 'de': the pool has 12 documents")
    short = PartitionError("data.sizes: language 'de': the pool has 12 documents")
    assert exit_code(short, None) == 2  # a data mistake found before training, as a DataSourceError is
    assert explain(short, None).startswith("The data cannot be partitioned as configured: data.sizes: language 'de'")


def _rewrite_column(path, name, values):
    table = pq.read_table(path)
    pq.write_table(table.set_column(table.column_names.index(name), name, pa.array(values)), path)


@pytest.mark.parametrize(
    "values, pattern",
    [
        (lambda n: list(range(n)), r"data.source \(de\): text column 'news_body' holds Value\('int64'\), not strings"),
        (
            lambda n: [None if i in (3, 9) else f"body {i}" for i in range(n)],
            r"data.source \(de\): text column 'news_body' is missing \(null\) in 2 of 200 rows",
        ),
    ],
)
def test_text_columns_without_text_are_named(tmp_path, values, pattern):
    folder = write_xglue_nc(tmp_path / "xglue")
    _rewrite_column(folder / "nc" / "validation.de.parquet", "news_body", values(200))
    _prepare_fails(_xglue(folder), tmp_path / "cache", DataSourceError, pattern)


def test_class_names_in_one_split_and_a_classlabel_in_the_others(tmp_path):
    """A split whose labels are the class names (a mirror that wrote strings) joins splits with a ClassLabel."""
    from data_prep.embedded import CATEGORIES

    folder = write_xglue_nc(tmp_path / "xglue")
    path = folder / "nc" / "validation.de.parquet"
    ids = pq.read_table(path).column("news_category").to_pylist()
    _rewrite_column(path, "news_category", [CATEGORIES[i] for i in ids])
    prepared = prepare_data(_xglue(folder), tmp_path / "cache", log=lambda _: None)
    german = [c for c in prepared.manifest.clients if c.language == "de"]
    assert prepared.manifest.labels == list(CATEGORIES)
    assert sum(sum(c.train.label_hist) + sum(c.test.label_hist) for c in german) > 0
    labels = load_pool(_xglue(folder)).labels  # the same ids as the ClassLabel split they were written from
    assert labels[len(pq.read_table(folder / "nc" / "train.parquet")) :][: len(ids)].tolist() == ids

    _rewrite_column(path, "news_category", ["sports"] * 199 + ["weather"])
    _prepare_fails(
        _xglue(folder, "[en, de, fr]", "nc", "data.source.label_column=news_category"),
        tmp_path / "cache2",
        DataSourceError,
        r"labels \['weather'\] of one split are neither class names nor ids",
    )


def test_no_proxy_text_to_learn_the_tiny_tokenizer_from(tmp_path):
    """tiny-bert's WordPiece learns from the proxy train split alone: without it, every word would be [UNK]."""
    from bhfl_core.config.base import ConfigError

    cfg = small_config("data.proxy={train_per_language: 0, test_per_language: 5}", "tree.root.proxy_train=false")
    _prepare_fails(
        cfg, tmp_path / "cache", ConfigError, r"^data.proxy.train_per_language: 0 leaves no proxy train text"
    )
