"""Data preparation: shards, manifest, tokenizer round-trip, and the fingerprint cache."""

import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from data_prep.prepare import DamagedCacheError, fingerprint, load_shard, preflight, prepare_data
from tests.small import small_config

pytestmark = pytest.mark.integration


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
    (first.root / "clients" / "marker").write_text("kept")
    second = prepare_data(cfg, tmp_path, log=logs.append)
    assert second.cached and second.manifest == m
    assert (second.root / "clients" / "marker").exists()
    assert any("no tokenisation" in line for line in logs)

    # a different seed is a different fingerprint
    assert fingerprint(small_config("seed=1")) != fingerprint(cfg)
    assert not list(tmp_path.glob(".*.partial"))


def test_a_damaged_cache_entry_is_named_and_never_reused(tmp_path):
    """A shard file cut short, missing, or a manifest cut short after the entry was committed: one error naming
    the file (before any work: the CLI's preflight too), the entry left as it is; deleted, it is prepared afresh."""
    cfg = small_config()
    entry = prepare_data(cfg, tmp_path, log=lambda _: None).root
    files = {p.relative_to(entry): p.read_bytes() for p in sorted(entry.rglob("*")) if p.is_file()}
    damages = {
        "clients/train.arrow": lambda p: p.write_bytes(files[Path("clients/train.arrow")][:-1000]),
        "proxy/test.arrow": lambda p: p.unlink(),
        "manifest.json": lambda p: p.write_bytes(files[Path("manifest.json")][:500]),
    }
    for name, damage in damages.items():
        damage(entry / name)
        for check in (lambda: prepare_data(cfg, tmp_path, log=lambda _: None), lambda: preflight(cfg, tmp_path)):
            with pytest.raises(DamagedCacheError, match=rf"entry {entry} is damaged: {entry / name} .*`rm -r {entry}`"):
                check()
        assert sorted(p.name for p in tmp_path.iterdir()) == [entry.name]  # nothing rebuilt beside it
        (entry / name).write_bytes(files[Path(name)])

    shutil.rmtree(entry)  # what the message says to do: the same bytes again
    again = prepare_data(cfg, tmp_path, log=lambda _: None)
    assert not again.cached and {p.relative_to(entry): p.read_bytes() for p in entry.rglob("*") if p.is_file()} == files


def test_proxy_shards_record_language_rows_for_group_proxy_splits(tmp_path):
    from tasks.context import RunContext

    cfg = small_config("data.proxy.servers=[root, server]")
    assert fingerprint(cfg) == fingerprint(small_config())  # who holds proxy data is not part of the data
    prepared = prepare_data(cfg, tmp_path, log=lambda _: None)
    rows = prepared.manifest.proxy_train.language_rows
    assert rows == {"en": (0, 30), "de": (30, 60), "fr": (60, 90)}  # contiguous, 30 per language, in config order

    ctx = RunContext(tmp_path / "run", cfg, prepared.root, prepared.manifest)
    full = ctx.proxy("train")
    west = ctx.proxy("train", "west")  # small config: west = [en, fr], east = [de]
    assert len(west["labels"]) == 60
    assert torch.equal(west["input_ids"], torch.cat([full["input_ids"][0:30], full["input_ids"][60:90]]))
    assert torch.equal(ctx.proxy("train", "edge-de")["labels"], full["labels"][30:60])
    assert ctx.proxy("train", "root") is full


def test_separate_proxy_corpus_per_language_for_masked_lm(tmp_path):
    from datasets import Dataset

    for lang in ("en", "de", "fr"):
        Dataset.from_dict({"text": [f"{lang} web page {i} says w{i % 9}" for i in range(70)]}).to_parquet(
            str(tmp_path / f"web.{lang}.parquet")
        )
    cfg = small_config(
        "data.task=mlm",
        f"data.proxy.source={{data_files: '{tmp_path}/web.{{lang}}.parquet'}}",
        "data.proxy.servers=[root, west]",
    )
    logs: list[str] = []
    prepared = prepare_data(cfg, tmp_path / "cache", log=logs.append)
    m = prepared.manifest
    assert m.task == "mlm" and m.mask_token_id == 4 and m.proxy_source.startswith("separate corpus")
    assert m.proxy_train.language_rows == {"en": (0, 30), "de": (30, 60), "fr": (60, 90)} and m.proxy_test.size == 60
    assert m.proxy_train.label_hist == []  # an unlabelled corpus
    proxy = load_shard(prepared.path(m.proxy_train.path))
    assert set(proxy) == {"input_ids", "attention_mask", "token_type_ids"}
    # nothing was carved from the client pool for the proxy: the clients drew from all of it
    assert m.unused_pool_rows + sum(c.train.size + c.test.size for c in m.clients) == sum(
        int(n * 1.3) + 50
        for n in (
            sum(c.train.size + c.test.size for c in m.clients if c.language == lang) for lang in ("en", "de", "fr")
        )
    )
    # the tokenizer was trained on the proxy corpus (public text): its words are in the vocabulary
    tok = AutoTokenizer.from_pretrained(prepared.path(m.tokenizer))
    assert "web" in tok.get_vocab()
    again = prepare_data(cfg, tmp_path / "cache", log=logs.append)
    assert again.cached and "no tokenisation" in logs[-1]


def test_a_second_preparation_of_the_same_data_waits_and_reuses_it(tmp_path):
    """Two experiments of a sweep sharing their data: one builds the entry, the other waits for it, nothing clashes."""
    cfg = small_config()
    second_logs: list[str] = []
    second_waits = threading.Event()

    def second_log(line: str) -> None:
        second_logs.append(line)
        if line.startswith("waiting for another preparation"):
            second_waits.set()

    with ThreadPoolExecutor(1) as pool:
        second: Future | None = None

        def step(name, fn, *args):
            nonlocal second
            if second is None:  # the first preparation holds the entry's lock now: start the second
                second = pool.submit(prepare_data, cfg, tmp_path, second_log)
                assert second_waits.wait(30), f"the second preparation did not wait: {second_logs}"
            return fn(*args)

        first = prepare_data(cfg, tmp_path, log=lambda _: None, step=step)
        assert second is not None
        reused = second.result(60)
    assert not first.cached and reused.cached and reused.root == first.root and reused.manifest == first.manifest
    assert "prepared meanwhile" in second_logs[-1]
    assert reused.seconds > first.seconds / 2  # it waited for most of the first one's work, and says so
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.root.name]  # no partial folder, no lock file


def test_a_large_generated_pool_goes_through_disk_and_changes_nothing(tmp_path, monkeypatch):
    """Above SPILL_BYTES a generated language is written to the entry's scratch folder and memory-mapped: same data."""
    from data_prep import sources

    cfg = small_config()
    in_memory = sources.load_pool(cfg, tmp_path / "scratch")
    assert not (tmp_path / "scratch").exists()  # the small pool stays in memory
    kept = prepare_data(cfg, tmp_path / "memory", log=lambda _: None)
    monkeypatch.setattr(sources, "SPILL_BYTES", 0)
    on_disk = sources.load_pool(cfg, tmp_path / "scratch")
    assert sorted(p.name for p in (tmp_path / "scratch").iterdir()) == ["de.arrow", "en.arrow", "fr.arrow"]
    assert on_disk.data.features == in_memory.data.features and on_disk.data[:] == in_memory.data[:]
    assert np.array_equal(on_disk.languages, in_memory.languages) and np.array_equal(on_disk.labels, in_memory.labels)
    spilled = prepare_data(cfg, tmp_path / "disk", log=lambda _: None)

    def files(root):
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    assert files(spilled.root) == files(kept.root)  # the scratch folder is gone, every byte the same
