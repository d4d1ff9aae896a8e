"""A run's trivial baselines read from a hand-made prepared folder (manifest and shards), by hand."""

import math

import pytest
from datasets import Dataset, Features, Sequence, Value

from data_prep.manifest import ClientEntry, Manifest, Shard
from flows.tracking.baselines import trivial_baseline
from tasks.context import RunContext
from tests.small import small_config

WIDTH = 6
FEATURES = Features({k: Sequence(Value("int64"), length=WIDTH) for k in ("input_ids", "attention_mask")})


def _unread(size: int, hist: list[int]) -> Shard:
    return Shard(path="never/read", size=size, label_hist=hist)


def _manifest(task: str, clients: list[ClientEntry], proxy_train: Shard, proxy_test: Shard, **tokenizer) -> Manifest:
    return Manifest(
        fingerprint="hand-0001",
        source="by hand",
        task=task,
        labels=["x", "y", "z"] if task == "classification" else [],
        tokenizer="none (token ids)",
        vocab_size=10,
        pad_token_id=0,
        clients=clients,
        proxy_train=proxy_train,
        proxy_test=proxy_test,
        unused_pool_rows=0,
        **tokenizer,
    )


def _client(cid: str, train: Shard, test: Shard) -> ClientEntry:
    return ClientEntry(id=cid, language=cid[:2], edge=f"edge-{cid[:2]}", cluster=cid[:2], train=train, test=test)


def test_majority_label_from_the_manifest_alone(tmp_path):
    clients = [
        _client("en-00", _unread(8, [5, 3, 0]), _unread(4, [2, 1, 1])),
        _client("de-00", _unread(6, [1, 1, 4]), _unread(4, [0, 3, 1])),
    ]
    manifest = _manifest("classification", clients, _unread(3, [0, 2, 1]), _unread(8, [4, 4, 0]))
    baseline = trivial_baseline(RunContext(tmp_path / "run", small_config(), tmp_path / "nowhere", manifest))
    assert baseline is not None and baseline.kind.name == "majority"
    accuracy = {name: scores["accuracy"] for name, scores in baseline.scores.items()}
    assert accuracy == {"en-00": 0.5, "de-00": 0.25, "union": 0.25, "proxy": 0.5}
    assert baseline.scores["de-00"]["macro_f1"] == pytest.approx(0.2)


def _shard(folder, relative: str, rows: list[list[int]]) -> Shard:
    """Rows of token ids, padded with 0 to WIDTH; the attention mask covers the ids given."""
    ids = [row + [0] * (WIDTH - len(row)) for row in rows]
    mask = [[1] * len(row) + [0] * (WIDTH - len(row)) for row in rows]
    Dataset.from_dict({"input_ids": ids, "attention_mask": mask}, features=FEATURES).save_to_disk(
        str(folder / relative)
    )
    return Shard(path=relative, size=len(rows), label_hist=[])


def test_unigram_perplexity_on_the_masked_test_tokens(tmp_path):
    """Every test row holds one real token between [CLS] (2) and [SEP] (3): the evaluation always masks it."""
    data = tmp_path / "data"
    clients = [
        _client(
            "en-00",
            _shard(data, "en/train", [[2, 5, 5, 3], [2, 6, 3]]),
            _shard(data, "en/test", [[2, 5, 3], [2, 7, 3]]),
        ),
        _client("de-00", _shard(data, "de/train", [[2, 8, 8, 8, 3]]), _shard(data, "de/test", [[2, 8, 3]])),
    ]
    manifest = _manifest(
        "mlm",
        clients,
        _shard(data, "proxy/train", [[2, 9, 9, 3]]),
        _shard(data, "proxy/test", [[2, 9, 3]]),
        mask_token_id=4,
        special_ids=[0, 1, 2, 3, 4],
    )
    baseline = trivial_baseline(RunContext(tmp_path / "run", small_config(), data, manifest))
    assert baseline is not None and baseline.kind.name == "unigram"
    ppl = {name: scores["perplexity"] for name, scores in baseline.scores.items()}
    # p(t) = (n_t + 1) / (N + V), V = 10
    # en: train 5, 5, 6 (N = 3): targets 5 (3/13) and 7 (1/13)
    assert ppl["en-00"] == pytest.approx(math.sqrt(13 / 3 * 13))
    assert ppl["de-00"] == pytest.approx(13 / 4)  # train 8, 8, 8: target 8
    # union: all clients' training tokens (N = 6) on all their targets 5, 7, 8
    assert ppl["union"] == pytest.approx((16 / 3 * 16 * 16 / 4) ** (1 / 3))
    assert ppl["proxy"] == pytest.approx(12 / 3)  # the proxy train split's tokens 9, 9: target 9
