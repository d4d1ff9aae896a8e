"""Shards on disk: a few Arrow files, each client a row range; what is read back is what was written.

Real files throughout: rows written with ``ShardWriter`` and read back through
``load_shard`` (memory-mapped, only the rows asked for), a prepared folder whose
clients' rows are compared with the tokenizer's own output on their pool rows, and the
batched encoder compared with a plain tokenizer call for three kinds of tokenizers.
"""

from pathlib import Path

import numpy as np
import pytest
import torch

from data_prep.prepare import load_shard, prepare_data
from data_prep.shards import ShardWriter, load_shards, parse_path, read_numpy, read_rows, row_range, token_schema
from tests.small import small_config

WIDTH = 8


def _write(path, batches):
    """Random token rows in batches of the given sizes; returns all rows written, per column."""
    rng = np.random.default_rng(0)
    written = []
    with ShardWriter(path, token_schema(("input_ids", "attention_mask", "token_type_ids"), WIDTH, True)) as w:
        for n in batches:
            rows = {
                "input_ids": rng.integers(0, 30_000, (n, WIDTH)),
                "attention_mask": rng.integers(0, 2, (n, WIDTH)),
                "token_type_ids": rng.integers(0, 2, (n, WIDTH)),
                "labels": rng.integers(0, 10, n),
            }
            w.write(rows)
            written.append(rows)
    return {k: np.concatenate([b[k] for b in written]) for k in written[0]}


def test_a_clients_rows_read_back_are_the_rows_written(tmp_path):
    file = tmp_path / "clients" / "train.arrow"
    rows = _write(file, [5, 0, 7, 3])  # ranges below cross record batches
    for start, stop in [(0, 15), (3, 9), (4, 5), (12, 15), (6, 6)]:
        shard = load_shard(tmp_path / row_range("clients/train.arrow", start, stop))
        assert list(shard) == ["input_ids", "attention_mask", "token_type_ids", "labels"]  # written order
        for name, values in shard.items():
            assert values.dtype == torch.int64  # as datasets' torch format gives them
            assert np.array_equal(values.numpy(), rows[name][start:stop])
        assert shard["input_ids"].shape == (stop - start, WIDTH)
    whole = load_shard(file)
    assert np.array_equal(whole["labels"].numpy(), rows["labels"])
    # consecutive ranges are one read; others are concatenated in the order asked for
    paths = [row_range("clients/train.arrow", a, b) for a, b in [(0, 4), (4, 9), (12, 15), (9, 12)]]
    joined = load_shards(tmp_path, paths)
    order = [*range(9), *range(12, 15), *range(9, 12)]
    assert np.array_equal(joined["input_ids"].numpy(), rows["input_ids"][order])
    with pytest.raises(ValueError, match=r"rows \[10, 16\) are not in .*train.arrow \(15 rows\)"):
        read_rows(file, 10, 16)
    assert parse_path("clients/train.arrow[3:9]") == ("clients/train.arrow", (3, 9))
    assert parse_path("clients/en-00/train") == ("clients/en-00/train", None)


def _resident_kb(file) -> int:
    """This process's resident pages of ``file`` (kB, over all its mappings), from /proc/self/smaps."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
            inside = len(fields) > 5 and fields[5] == str(file)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs /proc/self/smaps (Linux)")
def test_a_read_copies_its_rows_and_lets_the_files_pages_go(tmp_path):
    """A worker reads every client's rows over a run; the file's pages must not stay in its memory."""
    file = tmp_path / "clients" / "train.arrow"
    rows = _write(file, [20_000] * 4)  # ~4 MB of token columns
    mapped = read_numpy(file)  # views into the map: their pages are this process's while they are used
    assert int(mapped["input_ids"].sum()) == int(rows["input_ids"].sum())
    assert _resident_kb(file) > 2_000
    shard = read_rows(file, 1_000, 79_000)
    assert _resident_kb(file) < 64  # let go (the old code: ~4,000 kB kept for as long as the map was open)
    assert np.array_equal(shard["input_ids"].numpy(), rows["input_ids"][1_000:79_000])  # its own copy
    assert np.array_equal(mapped["labels"], rows["labels"])  # a view read after let_go reads the file again


def test_shard_files_open_with_datasets(tmp_path):
    from datasets import Dataset

    rows = _write(tmp_path / "train.arrow", [4, 4])
    data = Dataset.from_file(str(tmp_path / "train.arrow"))
    assert data.features["input_ids"].length == WIDTH and data.num_rows == 8
    assert np.array_equal(np.array(data.with_format("numpy")[2:6]["input_ids"]), rows["input_ids"][2:6])


def _tiny_tokenizer(folder):
    from data_prep.embedded import generate_pool
    from data_prep.tokenizer import train_wordpiece

    pool = generate_pool(0, "en", 60, 0.6, 0.25)[:]
    texts = [f"{a} {b}" for a, b in zip(pool["news_title"], pool["news_body"])]
    return train_wordpiece(texts, 300, 32, folder)


def _bert_and_xlmr_tokenizers(texts):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertTokenizerFast, XLMRobertaTokenizerFast

    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.normalizer, wordpiece.pre_tokenizer = normalizers.BertNormalizer(), pre_tokenizers.BertPreTokenizer()
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    wordpiece.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=200, special_tokens=special))
    wordpiece.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    bert = BertTokenizerFast(
        tokenizer_object=wordpiece, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]",
    )  # fmt: skip
    unigram = Tokenizer(models.Unigram())
    unigram.pre_tokenizer = pre_tokenizers.Metaspace()
    special = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    trainer = trainers.UnigramTrainer(vocab_size=200, special_tokens=special, unk_token="<unk>")
    unigram.train_from_iterator(texts, trainer)
    unigram.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    xlmr = XLMRobertaTokenizerFast(
        tokenizer_object=unigram, bos_token="<s>", eos_token="</s>", sep_token="</s>", cls_token="<s>",
        unk_token="<unk>", pad_token="<pad>", mask_token="<mask>",
    )  # fmt: skip
    return bert, xlmr


@pytest.mark.parametrize("truncation", ["longest_first", "only_second"])
def test_the_batched_encoder_gives_what_the_tokenizer_call_gives(tmp_path, truncation):
    """Ids, masks and token types of the threads' backend copies are the transformers call's, for three tokenizers."""
    from data_prep.embedded import generate_pool
    from data_prep.steps import Encoder

    pool = generate_pool(1, "fr", 40, 0.6, 0.25)[:]
    titles, bodies = pool["news_title"], pool["news_body"]
    cfg = small_config(f"model.truncation={truncation}")
    tokenizers = [_tiny_tokenizer(tmp_path / "tiny"), *_bert_and_xlmr_tokenizers(titles + bodies)]
    for tokenizer in tokenizers:
        for pairs in (bodies, None):
            encoder = Encoder(cfg, tokenizer, pair=pairs is not None, labelled=False)
            got = encoder(titles, pairs, None)
            kwargs = {"truncation": truncation if pairs else True, "max_length": 32, "padding": "max_length"}
            expected = tokenizer(titles, pairs, **kwargs)
            returned = [c for c in ("input_ids", "attention_mask", "token_type_ids") if c in expected]
            assert returned and list(got)[: len(returned)] == returned, type(tokenizer).__name__
            for column in returned:
                assert got[column].tolist() == expected[column], (type(tokenizer).__name__, column)
            if "token_type_ids" not in expected:  # zeros: the tiny BERT has token-type embeddings
                assert not got["token_type_ids"].any()


@pytest.mark.integration
def test_prepared_clients_hold_their_pool_rows_tokenised(tmp_path):
    """Each client's rows, read from the files, are its partition rows tokenised by the saved tokenizer."""
    from transformers import AutoTokenizer

    from data_prep.sources import load_pool
    from data_prep.steps import partition_step

    cfg = small_config()
    prepared = prepare_data(cfg, tmp_path, log=lambda _: None)
    m = prepared.manifest
    files = sorted(str(p.relative_to(prepared.root)) for p in prepared.root.rglob("*.arrow"))
    assert files == ["clients/test.arrow", "clients/train.arrow", "proxy/test.arrow", "proxy/train.arrow"]
    assert [c.train.path for c in m.clients[:2]] == [
        f"clients/train.arrow[0:{m.clients[0].train.size}]",
        f"clients/train.arrow[{m.clients[0].train.size}:{m.clients[0].train.size + m.clients[1].train.size}]",
    ]
    pool = load_pool(cfg)
    part = partition_step(cfg, pool)
    tokenizer = AutoTokenizer.from_pretrained(prepared.path(m.tokenizer))
    for client, split in zip(m.clients, part.clients):
        for shard, rows in ((client.train, split.train), (client.test, split.test)):
            texts = pool.data.select(rows)[:]
            expected = tokenizer(
                texts["text"], texts["text_pair"], truncation=True, max_length=32, padding="max_length"
            )
            got = load_shard(prepared.path(shard.path))
            assert got["input_ids"].tolist() == expected["input_ids"]
            assert got["attention_mask"].tolist() == expected["attention_mask"]
            assert got["labels"].tolist() == pool.labels[rows].tolist()
            assert np.bincount(got["labels"].numpy(), minlength=10).tolist() == shard.label_hist


@pytest.mark.integration
def test_a_prepared_cache_entry_is_a_prepared_source_and_short_files_are_named(tmp_path):
    """A cache entry (row-range shards) is a ``data.source.kind: prepared`` folder; a truncated file fails early."""
    import shutil

    from bhfl_core.config.base import ConfigError
    from data_prep.shards import ShardWriter
    from tasks.context import RunContext

    entry = prepare_data(small_config(), tmp_path / "cache", log=lambda _: None).root
    folder = tmp_path / "copy"
    shutil.copytree(entry, folder)
    source = f"data.source={{kind: prepared, path: '{folder}', languages: [en, de, fr]}}"
    prepared = prepare_data(small_config(source), tmp_path / "unused", log=lambda _: None)
    ctx = RunContext(tmp_path / "run", small_config(source), prepared.root, prepared.manifest)
    _, tests, groups = ctx.test_sets("proxy")
    sizes = [c.test.size for c in prepared.manifest.clients] + [prepared.manifest.proxy_test.size]
    assert torch.bincount(groups).tolist() == sizes and len(tests["input_ids"]) == sum(sizes)
    first = prepared.manifest.clients[0]
    assert torch.equal(tests["input_ids"][: first.test.size], ctx.shard(first.test.path)["input_ids"])

    with ShardWriter(folder / "clients" / "test.arrow", token_schema(("input_ids",), 32, True)) as w:
        w.write({"input_ids": np.zeros((3, 32), dtype=np.int64), "labels": np.zeros(3, dtype=np.int64)})
    with pytest.raises(ConfigError, match=r"not the rows of their Arrow file: clients/test.arrow\[\d+:\d+\]"):
        prepare_data(small_config(source), tmp_path / "unused", log=lambda _: None)
