"""The steps of a data preparation (``prepare.py`` runs them) and the fingerprint that keys their output.

pool -> partition -> proxy -> tokenizer -> shards -> edges -> manifest. Every file the
steps write is a function of what ``fingerprint`` hashes (seed, data config, local
source files, tokenizer identity, ``FORMAT_VERSION``), so a cache entry is named by it.

Only the rows the partition uses are tokenised, once, with ``datasets.map``
(batched, written to an Arrow file, so memory stays bounded for large sources);
each client's train/test shard and the proxy shards are then slices of it saved
with ``save_to_disk`` (memory-mapped Arrow when read back: ``prepare.load_shard``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bhfl_core.config.base import ConfigError
from bhfl_core.config.data import EmbeddedSource, XglueSource
from bhfl_core.config.schema import ExperimentConfig, dump
from bhfl_core.learning.models import TINY
from bhfl_core.learning.task_kinds import get_task_kind
from data_prep.clustering import assign_edges
from data_prep.manifest import ClientEntry, Manifest, Shard
from data_prep.partition import Partition, draw_proxy, partition_pool
from data_prep.sources import (
    LABEL,
    PAIR,
    TEXT,
    TextTable,
    load_proxy_source,
    source_signature,
    xglue_split,
)
from data_prep.tokenizer import hub_tokenizer, train_wordpiece

if TYPE_CHECKING:
    from datasets import Dataset

# 4: a tokenizer that is a function of the text (a version-3 entry may hold one of the trainer's other draws);
# 3: sources, task, clusters/edges, special token ids, report; 2: proxy language row ranges
FORMAT_VERSION = 4
INPUT_COLUMNS = ("input_ids", "attention_mask", "token_type_ids")


def fingerprint(config: ExperimentConfig) -> str:
    resolved = dump(config)
    model = resolved["model"]
    data = resolved["data"]
    key = {
        "format": FORMAT_VERSION,
        "seed": config.seed,
        "data": {**data, "proxy": {k: v for k, v in data["proxy"].items() if k != "servers"}},
        "files": source_signature(config),
        "tokenizer": {
            "name": model["name"],
            "revision": model["revision"],
            "max_length": model["max_length"],
            "truncation": model["truncation"],
            "vocab_size": model["tiny"]["vocab_size"] if model["name"] == TINY else None,
        },
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ProxyRows:
    """The proxy train/test rows and the table they index (the client pool, or a separate corpus)."""

    table: TextTable
    train: list[int]
    test: list[int]
    description: str
    from_pool: bool  # rows index the client pool (then tokenised together with the clients' rows)


@dataclass(frozen=True)
class TokenisedShards:
    clients: list[tuple[Shard, Shard]]
    proxy_train: Shard
    proxy_test: Shard
    client_tokens: dict[str, np.ndarray]  # training token ids per client (k-means on tokens only)


# ---------------------------------------------------------------- steps


def partition_step(config: ExperimentConfig, pool: TextTable) -> Partition:
    if pool.labels is None:
        raise ValueError("the client pool has no labels")  # sources always label the pool they return
    return partition_pool(pool.labels, pool.languages, config.data, config.seed, len(pool.label_names))


def proxy_step(config: ExperimentConfig, pool: TextTable, part: Partition) -> ProxyRows:
    spec = config.data.proxy
    if spec.source is None:
        return ProxyRows(pool, part.proxy_train, part.proxy_test, "pool", from_pool=True)
    languages = config.data.source.languages
    need = spec.train_per_language + spec.test_per_language
    table = load_proxy_source(spec.source, languages, need, config.seed, pool.label_names)
    wanted = languages if (spec.source.per_language or spec.source.language_column) else ["*"]
    per = len(languages) if wanted == ["*"] else 1  # a corpus without languages: the same total
    train, test = draw_proxy(
        table.languages, wanted, spec.train_per_language * per, spec.test_per_language * per, config.seed
    )
    where = spec.source.repo or spec.source.data_files
    return ProxyRows(table, train, test, f"separate corpus {where}", from_pool=False)


def tokenizer_step(config: ExperimentConfig, proxy: ProxyRows, work: Path) -> tuple[Any, str]:
    """A WordPiece trained on the proxy train split (tiny model: public text only), or the model's own."""
    model = config.model
    if model.name != TINY:
        return hub_tokenizer(model), model.name
    rows = proxy.table.data.select(proxy.train)

    def texts():
        for batch in rows.iter(batch_size=1000):
            pairs = batch[PAIR] if PAIR in batch else [None] * len(batch[TEXT])
            yield from (f"{a} {b}" if b is not None else a for a, b in zip(batch[TEXT], pairs))

    return train_wordpiece(texts(), model.tiny.vocab_size, model.max_length, work / "tokenizer"), "tokenizer"


def _uses_token_types(config: ExperimentConfig) -> bool:
    """Whether the model has token-type (segment) embeddings: BERT-like yes, DistilBERT no."""
    if config.model.name == TINY:
        return True
    from transformers import AutoConfig

    return (
        int(
            getattr(AutoConfig.from_pretrained(config.model.name, revision=config.model.revision), "type_vocab_size", 0)
            or 0
        )
        > 0
    )


def _encoder(config: ExperimentConfig, tokenizer: Any, pair: bool, labelled: bool) -> Callable[[dict], dict]:
    """Batched tokenisation into model inputs (+ ``labels`` where the rows are labelled).

    ``token_type_ids`` are the tokenizer's when it returns them, zeros when it does not
    but the model has token-type embeddings (what the model would assume anyway), and
    absent for models without them (DistilBERT rejects the argument).
    """
    model = config.model
    truncation = model.truncation if pair else True
    zero_types = _uses_token_types(config)

    def encode(batch: dict[str, list]) -> dict[str, list]:
        enc = tokenizer(
            batch[TEXT],
            batch[PAIR] if pair else None,
            truncation=truncation,
            max_length=model.max_length,
            padding="max_length",
        )
        out = {c: enc[c] for c in INPUT_COLUMNS if c in enc}
        if "token_type_ids" not in out and zero_types:
            out["token_type_ids"] = [[0] * len(ids) for ids in out["input_ids"]]
        if labelled:
            out["labels"] = batch[LABEL]
        return out

    return encode


def _tokenise(
    config: ExperimentConfig, tokenizer: Any, table: TextTable, rows: np.ndarray, cache_file: Path, fp: str
) -> Dataset:
    """Tokenise the selected rows once (batched ``map`` into an Arrow file: bounded memory)."""
    subset = table.data.select(rows.tolist())
    encode = _encoder(config, tokenizer, table.pair, LABEL in subset.column_names)
    return subset.map(
        encode,
        batched=True,
        batch_size=1000,
        remove_columns=subset.column_names,
        cache_file_name=str(cache_file),
        new_fingerprint=fp,
        desc="tokenising",
    )


def _language_rows(row_languages: np.ndarray) -> dict[str, tuple[int, int]]:
    """[start, stop) per language of a shard whose rows are grouped by language."""
    out: dict[str, tuple[int, int]] = {}
    for lang in dict.fromkeys(row_languages.tolist()):
        idx = np.flatnonzero(row_languages == lang)
        if idx[-1] - idx[0] + 1 != len(idx):
            raise AssertionError(f"proxy rows of language {lang!r} are not contiguous")
        out[lang] = (int(idx[0]), int(idx[-1]) + 1)
    return out


def shards_step(
    config: ExperimentConfig,
    tokenizer: Any,
    pool: TextTable,
    part: Partition,
    proxy: ProxyRows,
    work: Path,
    log: Callable[[str], None],
) -> TokenisedShards:
    fp = fingerprint(config)
    tmp = work / ".tokenised"
    tmp.mkdir(exist_ok=True)
    num_labels = len(pool.label_names)
    same_table = proxy.from_pool
    client_rows = [r for c in part.clients for r in (*c.train, *c.test)]
    used = np.unique(np.asarray(client_rows + (proxy.train + proxy.test if same_table else []), dtype=np.int64))
    log(f"tokenising {len(used)} pool rows with {type(tokenizer).__name__} (max_length {config.model.max_length})")
    tokens = _tokenise(config, tokenizer, pool, used, tmp / "pool.arrow", fp + "-pool")

    def save(
        table: TextTable,
        tokenised: Dataset,
        index: np.ndarray,
        rows: list[int],
        relative: str,
        by_language: bool = False,
    ) -> Shard:
        tokenised.select(np.searchsorted(index, rows).tolist()).save_to_disk(str(work / relative))
        hist = np.bincount(table.labels[rows], minlength=num_labels).tolist() if table.labels is not None else []
        ranges = _language_rows(table.languages[rows]) if by_language and rows else {}
        return Shard(path=relative, size=len(rows), label_hist=hist, language_rows=ranges)

    clients = [
        (
            save(pool, tokens, used, c.train, f"clients/{c.id}/train"),
            save(pool, tokens, used, c.test, f"clients/{c.id}/test"),
        )
        for c in part.clients
    ]
    if same_table:
        p_tokens, p_index = tokens, used
    else:
        p_index = np.unique(np.asarray(proxy.train + proxy.test, dtype=np.int64))
        log(f"tokenising {len(p_index)} proxy rows")
        p_tokens = _tokenise(config, tokenizer, proxy.table, p_index, tmp / "proxy.arrow", fp + "-proxy")
    proxy_train = save(
        proxy.table, p_tokens, used if same_table else p_index, proxy.train, "proxy/train", by_language=True
    )
    proxy_test = save(
        proxy.table, p_tokens, used if same_table else p_index, proxy.test, "proxy/test", by_language=True
    )

    client_tokens: dict[str, np.ndarray] = {}
    clustering = config.data.clustering
    if getattr(clustering, "features", None) == "tokens":
        special = np.asarray(sorted(set(tokenizer.all_special_ids)))
        for c in part.clients:
            block = tokens.select(np.searchsorted(used, c.train).tolist()).with_format("numpy")
            ids = np.asarray(block["input_ids"])
            keep = np.asarray(block["attention_mask"]).astype(bool) & ~np.isin(ids, special)
            client_tokens[c.id] = ids[keep]
    return TokenisedShards(clients, proxy_train, proxy_test, client_tokens)


def edges_step(config: ExperimentConfig, part: Partition, shards: TokenisedShards) -> list[tuple[str, str]]:
    hists = np.array([train.label_hist for train, _ in shards.clients], dtype=np.float64)
    return assign_edges(config, part.clients, hists, lambda c: shards.client_tokens[c.id])


def describe_source(config: ExperimentConfig) -> tuple[str, str]:
    """(where the pool comes from, what is held out) for the manifest."""
    source = config.data.source
    if isinstance(source, EmbeddedSource):
        return "embedded", ""
    assert isinstance(source, XglueSource)
    where = (
        f"local parquet {source.local_dir}" if source.local_dir else f"hub {source.repo}@{source.revision or 'default'}"
    )
    pools = ", ".join(f"{lang}={xglue_split(source, lang)}" for lang in source.languages)
    held = ", ".join(f"test.{lang}" for lang in source.languages)
    return f"xglue/{source.config} from {where}; pools: {pools}", held


def manifest_step(
    config: ExperimentConfig,
    pool: TextTable,
    part: Partition,
    proxy: ProxyRows,
    tokenizer: Any,
    tokenizer_ref: str,
    shards: TokenisedShards,
    edges: list[tuple[str, str]],
    work: Path,
) -> Manifest:
    source, held_out = describe_source(config)
    clients = [
        ClientEntry(id=c.id, language=c.language, edge=edge, cluster=cluster, train=train, test=test)
        for c, (train, test), (edge, cluster) in zip(part.clients, shards.clients, edges)
    ]
    manifest = Manifest(
        fingerprint=fingerprint(config),
        source=source,
        task=config.data.task,
        labels=pool.label_names,
        tokenizer=tokenizer_ref,
        vocab_size=len(tokenizer),
        pad_token_id=int(tokenizer.pad_token_id or 0),
        mask_token_id=tokenizer.mask_token_id,
        special_ids=sorted(set(tokenizer.all_special_ids)),
        clustering=config.data.clustering.kind,
        clients=clients,
        proxy_source=proxy.description,
        proxy_train=shards.proxy_train,
        proxy_test=shards.proxy_test,
        unused_pool_rows=part.unused,
        held_out=held_out,
    )
    if get_task_kind(config.data.task).needs_mask_token and manifest.mask_token_id is None:
        raise ConfigError(
            f"model.name: the tokenizer of {config.model.name!r} has no mask token; data.task: "
            f"{config.data.task} needs a masked-LM model (e.g. bert-base-multilingual-cased, "
            "xlm-roberta-base)"
        )
    manifest.write(work)
    return manifest
