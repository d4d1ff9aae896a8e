"""Data preparation: shards, manifest, tokenizer round-trip, and the fingerprint cache."""

import numpy as np
from transformers import AutoTokenizer

from data_prep.prepare import fingerprint, load_shard, prepare_data
from tests.small import small_config


def test_prepare_then_cache_hit(tmp_path):
    cfg = small_config()
    logs: list[str] = []
    first = prepare_data(cfg, tmp_path, log=logs.append)
    assert not first.cached and first.root.name == fingerprint(cfg)
    m = first.manifest
    assert len(m.clients) == 9 and {c.language for c in m.clients} == {"en", "de", "fr"}
    assert m.proxy_train.size == 90 and m.proxy_test.size == 60
    assert all(c.edge == f"edge-{c.language}" for c in m.clients)

    shard = load_shard(first.path(m.clients[0].train.path))
    assert set(shard) == {"input_ids", "attention_mask", "token_type_ids", "labels"}
    assert shard["input_ids"].shape == (m.clients[0].train.size, 32)
    assert np.bincount(shard["labels"].numpy(), minlength=10).tolist() == m.clients[0].train.label_hist

    # the tokenizer was trained on proxy data and reloads through the Auto API as a fast tokenizer
    tok = AutoTokenizer.from_pretrained(first.path(m.tokenizer))
    assert tok.is_fast and tok.pad_token == "[PAD]" and len(tok) == m.vocab_size
    assert tok("a b", "c")["input_ids"][0] == tok.cls_token_id

    # same config: nothing is regenerated or tokenised again, and the log says so
    (first.root / "clients" / m.clients[0].id / "train" / "marker").write_text("kept")
    second = prepare_data(cfg, tmp_path, log=logs.append)
    assert second.cached and second.manifest == m
    assert (second.root / "clients" / m.clients[0].id / "train" / "marker").exists()
    assert any("no tokenisation" in line for line in logs)

    # a different seed is a different fingerprint
    assert fingerprint(small_config("seed=1")) != fingerprint(cfg)
    assert not list(tmp_path.glob(".*.partial"))
