"""Bad data gets one clear error naming the file, split or language and the fix; nothing is half-written.

Local XGLUE parquet folders (tests/data/xglue_fixtures.py) broken the ways real data is
broken: a corrupt parquet file, labels outside the task's label set, a missing text
column, and a language with too few rows for its clients (an empty client).
"""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_prep.partition import PartitionError
from data_prep.prepare import prepare_data
from data_prep.sources import DataSourceError
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
