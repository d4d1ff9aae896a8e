"""Prepare an experiment's data: pool -> partition -> tokenizer -> pre-tokenised shards.

The result is cached under ``<cache>/<fingerprint>/`` where the fingerprint hashes
everything the data depends on (seed, data config, tokenizer/model identity, format
version). The folder is built under a temporary name and renamed when complete, so
a crash never leaves a half-written cache; a second run with the same config finds
the manifest and does no generation or tokenisation.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
from datasets import Dataset, concatenate_datasets, load_from_disk

from bhfl_core.config import ExperimentConfig, dump
from bhfl_core.models import TINY
from bhfl_core.topology import edge_id
from data_prep.embedded import CATEGORIES, generate_pool
from data_prep.manifest import MANIFEST_NAME, ClientEntry, Manifest, Shard
from data_prep.partition import partition_pool, pool_size_needed
from data_prep.tokenizer import load_tokenizer, train_wordpiece

FORMAT_VERSION = 2  # 2: proxy shards record per-language row ranges
MODEL_COLUMNS = ["input_ids", "attention_mask", "token_type_ids", "labels"]


def fingerprint(config: ExperimentConfig) -> str:
    resolved = dump(config)
    model = resolved["model"]
    key = {
        "format": FORMAT_VERSION,
        "seed": config.seed,
        "data": {**resolved["data"], "proxy": {k: v for k, v in resolved["data"]["proxy"].items() if k != "servers"}},
        "tokenizer": {"name": model["name"], "max_length": model["max_length"],
                      "vocab_size": model["tiny"]["vocab_size"] if model["name"] == TINY else None},
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class PreparedData:
    root: Path
    manifest: Manifest
    cached: bool

    def path(self, relative: str) -> Path:
        return self.root / relative


def _embedded_pool(config: ExperimentConfig) -> Dataset:
    src = config.data.source
    pools = []
    for lang in src.languages:
        need = pool_size_needed(config.data, config.seed, lang)
        pools.append(generate_pool(config.seed, lang, int(need * 1.3) + 50, src.shared_cue_strength, src.topic_strength))
    return concatenate_datasets(pools)


def _label_hist(labels: np.ndarray, rows: list[int]) -> list[int]:
    return np.bincount(labels[rows], minlength=len(CATEGORIES)).tolist()


def _language_rows(row_languages: np.ndarray) -> dict[str, tuple[int, int]]:
    """[start, stop) per language of a shard whose rows are grouped by language."""
    out: dict[str, tuple[int, int]] = {}
    for lang in dict.fromkeys(row_languages.tolist()):
        idx = np.flatnonzero(row_languages == lang)
        if idx[-1] - idx[0] + 1 != len(idx):
            raise AssertionError(f"proxy rows of language {lang!r} are not contiguous")
        out[lang] = (int(idx[0]), int(idx[-1]) + 1)
    return out


def prepare_data(config: ExperimentConfig, cache_root: Path, log: Callable[[str], None] = print) -> PreparedData:
    fp = fingerprint(config)
    final = cache_root / fp
    if (final / MANIFEST_NAME).exists():
        log(f"data cache hit {final}: reusing pre-tokenised shards, no tokenisation")
        return PreparedData(final, Manifest.read(final), cached=True)

    log(f"preparing data (fingerprint {fp}) in {final}")
    datasets.disable_progress_bars()
    work = cache_root / f".{fp}.partial"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)

    pool = _embedded_pool(config)
    labels = np.asarray(pool["news_category"])
    languages = np.asarray(pool["language"])
    part = partition_pool(labels, languages, config.data, config.seed, len(CATEGORIES))

    model = config.model
    if model.name == TINY:
        proxy_text = pool.select(part.proxy_train)
        texts = (f"{t} {b}" for t, b in zip(proxy_text["news_title"], proxy_text["news_body"]))
        tokenizer = train_wordpiece(texts, model.tiny.vocab_size, model.max_length, work / "tokenizer")
        tokenizer_ref = "tokenizer"
    else:
        tokenizer = load_tokenizer(model.name)
        tokenizer_ref = model.name

    def encode(batch: dict[str, list]) -> dict[str, list]:
        enc = tokenizer(batch["news_title"], batch["news_body"], truncation="longest_first",
                        max_length=model.max_length, padding="max_length")
        enc["labels"] = batch["news_category"]
        return dict(enc)

    tokenized = pool.map(encode, batched=True, batch_size=1000, remove_columns=pool.column_names, desc="tokenising")
    if "token_type_ids" not in tokenized.column_names:
        tokenized = tokenized.add_column("token_type_ids", [[0] * model.max_length] * len(tokenized))
    tokenized = tokenized.select_columns(MODEL_COLUMNS)

    def shard(rows: list[int], relative: str, by_language: bool = False) -> Shard:
        tokenized.select(rows).save_to_disk(str(work / relative))
        ranges = _language_rows(languages[rows]) if by_language else {}
        return Shard(path=relative, size=len(rows), label_hist=_label_hist(labels, rows), language_rows=ranges)

    clients = [
        ClientEntry(id=c.id, language=c.language, edge=edge_id(c.language),
                    train=shard(c.train, f"clients/{c.id}/train"), test=shard(c.test, f"clients/{c.id}/test"))
        for c in part.clients
    ]
    manifest = Manifest(
        fingerprint=fp, source=config.data.source.kind, task="classification", labels=list(CATEGORIES),
        tokenizer=tokenizer_ref, vocab_size=len(tokenizer), pad_token_id=int(tokenizer.pad_token_id or 0),
        clients=clients, proxy_train=shard(part.proxy_train, "proxy/train", by_language=True),
        proxy_test=shard(part.proxy_test, "proxy/test", by_language=True),
        unused_pool_rows=part.unused,
    )
    manifest.write(work)
    shutil.rmtree(final, ignore_errors=True)
    work.rename(final)
    log(f"prepared {len(clients)} clients, proxy {manifest.proxy_train.size}/{manifest.proxy_test.size} (train/test)")
    return PreparedData(final, manifest, cached=False)


def load_shard(path: Path) -> dict:
    """A pre-tokenised shard as a dict of tensors (memory-mapped Arrow underneath)."""
    return load_from_disk(str(path)).with_format("torch")[:]
