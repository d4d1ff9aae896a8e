"""XGLUE (local parquet in XGLUE's split naming) through the same ``load_dataset`` path as the hub."""

import numpy as np
import pytest
from transformers import AutoTokenizer

from bhfl_core.config.base import ConfigError
from bhfl_core.learning.models import ModelSourceError
from data_prep.embedded import CATEGORIES
from data_prep.prepare import fingerprint, load_shard, preflight, prepare_data
from data_prep.sources import DataSourceError, load_pool
from tests.data.xglue_fixtures import HELDOUT, write_xglue_nc, write_xglue_xnli
from tests.small import small_config


@pytest.fixture(scope="module")
def nc_dir(tmp_path_factory):
    return write_xglue_nc(tmp_path_factory.mktemp("xglue"))


def _xglue(folder, *extra):
    return small_config(f"data.source={{kind: xglue, local_dir: '{folder}', languages: [en, de, fr]}}", *extra)


def test_pool_follows_the_xglue_rule(nc_dir):
    pool = load_pool(_xglue(nc_dir))
    # en comes from `train` (260 rows), de and fr from their validation splits (200 rows each)
    assert {lang: int((pool.languages == lang).sum()) for lang in ("en", "de", "fr")} == {
        "en": 260,
        "de": 200,
        "fr": 200,
    }
    assert pool.label_names == list(CATEGORIES)  # the ClassLabel names survive the parquet round trip
    assert pool.pair and set(pool.data.column_names) == {"text", "text_pair", "label"}
    titles = pool.data["text"][:]
    assert not any(HELDOUT in t for t in titles)  # test.<lang> is never read
    assert np.array_equal(pool.labels, np.asarray(pool.data["label"][:]))


@pytest.mark.integration
def test_prepare_from_local_parquet_then_cache_hit(nc_dir, tmp_path):
    cfg = _xglue(nc_dir)
    logs: list[str] = []
    first = prepare_data(cfg, tmp_path, log=logs.append)
    m = first.manifest
    assert (
        not first.cached
        and m.source.startswith("xglue/nc from local parquet")
        and m.held_out == "test.en, test.de, test.fr"
    )
    assert "de=validation.de" in m.source and "en=train" in m.source
    assert [c.edge for c in m.clients] == [f"edge-{c.language}" for c in m.clients]
    used = sum(c.train.size + c.test.size for c in m.clients) + m.proxy_train.size + m.proxy_test.size
    assert used + m.unused_pool_rows == 260 + 200 + 200  # every pool row accounted for
    shard = load_shard(first.path(m.clients[0].train.path))
    assert np.bincount(shard["labels"].numpy(), minlength=10).tolist() == m.clients[0].train.label_hist
    assert int(shard["token_type_ids"].sum()) == 0 and shard["input_ids"].shape[1] == 32
    assert (first.report_dir / "label_skew.png").stat().st_size > 1000

    # the second run reads neither parquet nor tokenizer: same folder, untouched, and the log says so
    marker = first.root / "clients" / "marker"
    marker.write_text("kept")
    second = prepare_data(cfg, tmp_path, log=logs.append)
    assert second.cached and second.manifest == m and marker.exists()
    assert "no tokenisation" in logs[-1]

    # a replaced source file is different data: a different fingerprint
    before = fingerprint(cfg)
    path = nc_dir / "nc" / "validation.fr.parquet"
    original = path.read_bytes()
    try:
        write_xglue_nc(nc_dir / "other", languages=("fr",), eval_size=210, seed=5)
        path.write_bytes((nc_dir / "other" / "nc" / "validation.fr.parquet").read_bytes())
        assert fingerprint(cfg) != before
    finally:
        path.write_bytes(original)
    assert fingerprint(cfg) == before


@pytest.mark.integration
def test_xnli_sentence_pairs_with_plain_int_labels(tmp_path):
    folder = write_xglue_xnli(tmp_path / "x")
    cfg = small_config(
        f"data.source={{kind: xglue, config: xnli, local_dir: '{folder}', languages: [en, de]}}",
        "tree.groups={}",
        "data.clients_per_language=2",
        "data.sizes={median: 20, sigma: 0.3, min: 10, max: 30}",
        "data.proxy={train_per_language: 10, test_per_language: 10}",
        "tree.edge.cohort=1",
    )
    prepared = prepare_data(cfg, tmp_path / "cache", log=lambda _: None)
    m = prepared.manifest
    assert m.labels == ["0", "1", "2"] and {c.language for c in m.clients} == {"en", "de"}
    shard = load_shard(prepared.path(m.clients[0].train.path))
    sep = AutoTokenizer.from_pretrained(prepared.path(m.tokenizer)).sep_token_id
    assert (shard["input_ids"] == sep).sum(dim=1).tolist() == [2] * len(
        shard["input_ids"]
    )  # premise + hypothesis: a pair


def test_unreachable_sources_and_models_are_clear_errors(nc_dir, tmp_path):
    # a split missing from the local folder names the key, the split and the expected layout
    cfg = small_config(f"data.source={{kind: xglue, local_dir: '{nc_dir}', languages: [en, de, es]}}", "tree.groups={}")
    with pytest.raises(
        DataSourceError,
        match=r"data.source.local_dir: no parquet files for split 'validation.es'.*nc/validation.es.parquet",
    ):
        preflight(cfg, tmp_path)
    with pytest.raises(DataSourceError, match=rf"data.source.local_dir: '{nc_dir}/nowhere' does not exist \("):
        preflight(_xglue(nc_dir / "nowhere"), tmp_path)
    with pytest.raises(DataSourceError, match=r"data.source.local_dir: '.*train.parquet' is a file, not a folder"):
        preflight(_xglue(nc_dir / "nc" / "train.parquet"), tmp_path)
    # the hub with HF_HUB_OFFLINE=1 (tests/conftest.py): says how to point the config at local files
    hub = small_config("data.source={kind: xglue, languages: [en, de, fr]}")
    with pytest.raises(DataSourceError, match=r"data.source: could not load .*microsoft/xglue.*data.source.local_dir"):
        preflight(hub, tmp_path)
    with pytest.raises(DataSourceError):
        prepare_data(hub, tmp_path, log=lambda _: None)  # the real load fails the same way
    with pytest.raises(
        ModelSourceError, match=r"model.name: could not load the model 'xlm-roberta-base'.*--local-dir DIR"
    ):
        preflight(_xglue(nc_dir, "model.name=xlm-roberta-base"), tmp_path)
    # both are config errors: the CLI prints them as one paragraph (tests/flows/test_data_flow.py)
    assert issubclass(DataSourceError, ConfigError) and issubclass(ModelSourceError, ConfigError)
    assert not list(tmp_path.iterdir())  # nothing was prepared


def test_wrong_column_names_are_named(nc_dir, tmp_path):
    cfg = _xglue(nc_dir, "data.source.label_column=category")
    with pytest.raises(
        DataSourceError,
        match=r"columns \['category'\] not found; the data has \['news_title', 'news_body', 'news_category'\]",
    ):
        prepare_data(cfg, tmp_path, log=lambda _: None)


def test_shipped_xglue_configs_load_and_a_new_kind_replaces_the_inherited_source():
    from bhfl_core.config.data import XglueSource
    from bhfl_core.config.loader import load_config
    from tests.small import REPO

    nc = load_config(REPO / "configs" / "xglue-nc-mbert.yaml")
    assert isinstance(nc.data.source, XglueSource) and nc.data.source.local_dir == "data/xglue"
    assert nc.model.name == "bert-base-multilingual-cased" and nc.tree.root.opt_up.kind == "fedadam"  # bhfl-full
    assert len(nc.tree.residuals.up) == 1 and nc.data.proxy.source is None  # proxy carved from the pool, at the root
    local = load_config(REPO / "configs" / "xglue-nc-parquet.yaml")
    assert local.model.name == "tiny-bert" and local.data.source.local_dir == "runs/xglue-embedded"
    mlm = load_config(REPO / "configs" / "xglue-mlm-mbert.yaml")
    assert mlm.data.task == "mlm" and mlm.data.proxy.source.per_language and mlm.data.proxy.source.streaming
