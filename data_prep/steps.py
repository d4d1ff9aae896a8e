"""The steps of a data preparation (``prepare.py`` runs them) and the fingerprint that keys their output.

pool -> partition -> proxy -> tokenizer -> shards -> edges -> manifest. Every file the
steps write is a function of what ``fingerprint`` hashes (seed, data config, local
source files, tokenizer identity, ``FORMAT_VERSION``), so a cache entry is named by it.

Only the rows the partition uses are tokenised, once, in batches on a few threads
(the tokenizers library encodes outside the GIL), straight into four Arrow files:
the clients' train rows client after client, their test rows, the proxy train and
test rows (data_prep/shards.py). A client's shard is a row range of a file; memory
stays bounded by a few batches whatever the number of clients.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bhfl_core.config.base import ConfigError
from bhfl_core.config.data import EmbeddedSource, XglueSource
from bhfl_core.config.schema import ExperimentConfig, dump
from bhfl_core.learning.models import TINY
from bhfl_core.learning.task_kinds import get_task_kind
from data_prep.clustering import assign_edges
from data_prep.manifest import ClientEntry, ClientTable, Manifest, Shard
from data_prep.partition import Partition, draw_proxy, partition_pool
from data_prep.proxy_source import load_proxy_source
from data_prep.shards import ShardWriter, parse_path, read_numpy, row_range, token_schema
from data_prep.source_checks import source_signature
from data_prep.sources import PAIR, TEXT, TextTable, xglue_split
from data_prep.tokenizer import hub_tokenizer, train_wordpiece

# 5: four Arrow files, a client's shard a row range of them (was: a save_to_disk folder per client split);
# 4: a tokenizer that is a function of the text (a version-3 entry may hold one of the trainer's other draws);
# 3: sources, task, clusters/edges, special token ids, report; 2: proxy language row ranges
FORMAT_VERSION = 5
INPUT_COLUMNS = ("input_ids", "attention_mask", "token_type_ids")
CLIENTS_TRAIN, CLIENTS_TEST = "clients/train.arrow", "clients/test.arrow"
PROXY_TRAIN, PROXY_TEST = "proxy/train.arrow", "proxy/test.arrow"
BATCH_ROWS = 2048  # rows per tokenizer call and per record batch of the files (fixed: the bytes depend on it)


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
    train_file: Path  # the clients' train rows (k-means on tokens reads them back)
    special_ids: tuple[int, ...]

    def client_tokens(self, index: int) -> np.ndarray:
        """The token ids of client ``index``'s training rows, padding and special tokens left out."""
        _, rows = parse_path(self.clients[index][0].path)
        block = read_numpy(self.train_file, *(rows or (None, None)))
        ids = block["input_ids"]
        keep = block["attention_mask"].astype(bool) & ~np.isin(ids, self.special_ids)
        return ids[keep]


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
    if len(proxy.train) == 0:  # a vocabulary of the special tokens alone: every word the unknown token
        raise ConfigError(
            f"data.proxy.train_per_language: {config.data.proxy.train_per_language} leaves no proxy train text to "
            f"learn model.name {TINY}'s vocabulary from (its WordPiece is trained on the proxy train split alone: "
            "public text, never client text; docs/data.md); set it above 0, or use a model with its own tokenizer."
        )
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


class Encoder:
    """Batched tokenisation into model inputs as numpy arrays (+ ``labels`` where the rows are labelled).

    The ids, masks and token types are what ``tokenizer(texts, pairs, truncation=...,
    max_length=..., padding="max_length")`` returns. A fast tokenizer is called once so
    that transformers configures its backend (truncation, padding, special tokens) as
    for every call; then each thread encodes with its own copy of that backend
    (``encode_batch_fast``: the same encodings without character offsets; it releases
    the GIL), and the columns transformers would return (``model_input_names``) are
    read from the encodings directly. Other tokenizers are called as they are.

    ``token_type_ids`` are the tokenizer's when it returns them, zeros when it does not
    but the model has token-type embeddings (what the model would assume anyway), and
    absent for models without them (DistilBERT rejects the argument).
    """

    def __init__(self, config: ExperimentConfig, tokenizer: Any, pair: bool, labelled: bool) -> None:
        model = config.model
        self.pair, self.labelled = pair, labelled
        self.width = model.max_length
        self._tokenizer = tokenizer
        self._kwargs = {
            "truncation": model.truncation if pair else True,
            "max_length": model.max_length,
            "padding": "max_length",
        }
        sample = tokenizer(["x"], ["x"] if pair else None, **self._kwargs)  # configures a fast backend, as any call
        returned = [c for c in INPUT_COLUMNS if c in sample]
        self.zero_types = "token_type_ids" not in returned and _uses_token_types(config)
        self.columns = tuple(returned + (["token_type_ids"] if self.zero_types else []))
        self._returned = returned
        fast = getattr(tokenizer, "is_fast", False)
        self._backend = copy.deepcopy(tokenizer.backend_tokenizer) if fast else None  # as the call above left it
        self._local = threading.local()

    def __call__(self, texts: list[str], pairs: list[str] | None, labels: np.ndarray | None) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray]
        if self._backend is not None:
            backend = getattr(self._local, "backend", None)
            if backend is None:
                backend = self._local.backend = copy.deepcopy(self._backend)
            # encode_batch_fast: encode_batch without the character offsets (unused here), ~25% faster
            encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
            encodings = encode(list(zip(texts, pairs)) if pairs is not None else texts)
            attribute = {"input_ids": "ids", "attention_mask": "attention_mask", "token_type_ids": "type_ids"}
            out = {c: self._array([getattr(e, attribute[c]) for e in encodings]) for c in self._returned}
        else:
            enc = self._tokenizer(texts, pairs, **self._kwargs)
            out = {c: self._array(enc[c]) for c in self._returned}
        if self.zero_types:
            out["token_type_ids"] = np.zeros((len(texts), self.width), dtype=np.int8)
        if self.labelled:
            assert labels is not None
            out["labels"] = labels
        return out

    def _array(self, rows: list[list[int]]) -> np.ndarray:
        values = np.array(rows, dtype=np.int64).reshape(len(rows), -1)
        if values.shape[1] != self.width:
            raise ValueError(f"the tokenizer gave sequences of {values.shape[1]} tokens, not model.max_length")
        return values


def tokeniser_threads() -> int:
    """Threads that encode at once: the cores this process may use (at most 4)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(4, cores))


def _batches(table: TextTable, rows: np.ndarray) -> Iterator[tuple[list[str], list[str] | None, np.ndarray | None]]:
    """The texts (and pairs, labels) of ``rows`` of ``table``, ``BATCH_ROWS`` at a time, in order."""
    columns = [TEXT, PAIR] if table.pair else [TEXT]
    view = table.data.with_format("arrow", columns=columns)
    for i in range(0, len(rows), BATCH_ROWS):
        chunk = rows[i : i + BATCH_ROWS]
        batch = view[chunk.tolist()]
        pairs = batch.column(PAIR).to_pylist() if table.pair else None
        yield batch.column(TEXT).to_pylist(), pairs, table.labels[chunk] if table.labels is not None else None


def write_tokenised(encoder: Encoder, table: TextTable, rows: np.ndarray, path: Path, threads: int) -> None:
    """Tokenise ``rows`` of ``table``, in order, into the Arrow file ``path``.

    Batches are encoded on ``threads`` threads, a few ahead of the writer (bounded
    memory), and written in order, one record batch each: the file does not depend on
    the number of threads.
    """
    schema = token_schema(encoder.columns, encoder.width, encoder.labelled)
    with ShardWriter(path, schema) as writer, ThreadPoolExecutor(threads) as pool:
        pending: deque = deque()
        for batch in _batches(table, rows):
            pending.append(pool.submit(encoder, *batch))
            if len(pending) > 2 * threads:
                writer.write(pending.popleft().result())
        while pending:
            writer.write(pending.popleft().result())


def _language_rows(row_languages: np.ndarray) -> dict[str, tuple[int, int]]:
    """[start, stop) per language of a shard whose rows are grouped by language."""
    out: dict[str, tuple[int, int]] = {}
    for lang in dict.fromkeys(row_languages.tolist()):
        idx = np.flatnonzero(row_languages == lang)
        if idx[-1] - idx[0] + 1 != len(idx):
            raise AssertionError(f"proxy rows of language {lang!r} are not contiguous")
        out[lang] = (int(idx[0]), int(idx[-1]) + 1)
    return out


def _histograms(labels: np.ndarray | None, sizes: np.ndarray, num_labels: int) -> np.ndarray:
    """Label counts of consecutive blocks of ``sizes`` rows, a row per block (no columns when unlabelled)."""
    if labels is None:
        return np.zeros((len(sizes), 0), dtype=np.int64)
    block = np.repeat(np.arange(len(sizes)), sizes)
    return np.bincount(block * num_labels + labels, minlength=len(sizes) * num_labels).reshape(-1, num_labels)


def shards_step(
    config: ExperimentConfig,
    tokenizer: Any,
    pool: TextTable,
    part: Partition,
    proxy: ProxyRows,
    work: Path,
    log: Callable[[str], None],
) -> TokenisedShards:
    started = time.perf_counter()
    threads = tokeniser_threads()
    num_labels = len(pool.label_names)
    clients = part.clients
    train_sizes = np.array([len(c.train) for c in clients], dtype=np.int64)
    test_sizes = np.array([len(c.test) for c in clients], dtype=np.int64)
    train_rows = np.array([r for c in clients for r in c.train], dtype=np.int64)
    test_rows = np.array([r for c in clients for r in c.test], dtype=np.int64)
    total = len(train_rows) + len(test_rows) + len(proxy.train) + len(proxy.test)
    log(
        f"tokenising {total} rows with {type(tokenizer).__name__} (max_length {config.model.max_length}, "
        f"{threads} thread{'s' if threads > 1 else ''})"
    )
    encoder = Encoder(config, tokenizer, pool.pair, pool.labels is not None)
    write_tokenised(encoder, pool, train_rows, work / CLIENTS_TRAIN, threads)
    write_tokenised(encoder, pool, test_rows, work / CLIENTS_TEST, threads)
    if not proxy.from_pool:
        encoder = Encoder(config, tokenizer, proxy.table.pair, proxy.table.labels is not None)
    train_proxy, test_proxy = (np.asarray(rows, dtype=np.int64) for rows in (proxy.train, proxy.test))
    write_tokenised(encoder, proxy.table, train_proxy, work / PROXY_TRAIN, threads)
    write_tokenised(encoder, proxy.table, test_proxy, work / PROXY_TEST, threads)
    seconds = time.perf_counter() - started
    log(f"tokenised {total} rows in {seconds:.1f} s ({total / max(seconds, 1e-9):.0f} rows/s)")

    def shards(file: str, rows: np.ndarray, sizes: np.ndarray) -> list[Shard]:
        hists = _histograms(pool.labels[rows] if pool.labels is not None else None, sizes, num_labels)
        ends = np.cumsum(sizes)
        return [
            Shard(path=row_range(file, int(end - size), int(end)), size=int(size), label_hist=hist.tolist())
            for end, size, hist in zip(ends, sizes, hists)
        ]

    def proxy_shard(file: str, rows: np.ndarray) -> Shard:
        table = proxy.table
        hist = np.bincount(table.labels[rows], minlength=num_labels).tolist() if table.labels is not None else []
        ranges = _language_rows(table.languages[rows]) if len(rows) else {}
        return Shard(path=file, size=len(rows), label_hist=hist, language_rows=ranges)

    return TokenisedShards(
        clients=list(zip(shards(CLIENTS_TRAIN, train_rows, train_sizes), shards(CLIENTS_TEST, test_rows, test_sizes))),
        proxy_train=proxy_shard(PROXY_TRAIN, train_proxy),
        proxy_test=proxy_shard(PROXY_TEST, test_proxy),
        train_file=work / CLIENTS_TRAIN,
        special_ids=tuple(sorted(set(tokenizer.all_special_ids))),
    )


def edges_step(config: ExperimentConfig, part: Partition, shards: TokenisedShards) -> list[tuple[str, str]]:
    hists = np.array([train.label_hist for train, _ in shards.clients], dtype=np.float64)
    index = {c.id: i for i, c in enumerate(part.clients)}
    return assign_edges(config, part.clients, hists, lambda c: shards.client_tokens(index[c.id]))


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
    clients = ClientTable.of(
        [
            ClientEntry(id=c.id, language=c.language, edge=edge, cluster=cluster, train=train, test=test)
            for c, (train, test), (edge, cluster) in zip(part.clients, shards.clients, edges)
        ]
    )
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
