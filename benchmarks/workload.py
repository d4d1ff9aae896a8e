"""The throughput workload of ../shared/bench/WORKLOAD.md, exactly: data, model, plain FedAvg loop.

- ``generate()``: 5 "languages" x 20 clients of token sequences and the held-out test
  set, drawn from numpy's PCG64 streams as the spec orders them; ``fingerprint()`` must
  give ``43eff8d1bf6eb5cd``.
- ``fedavg_loop()``: the plain single-process FedAvg loop of the spec (1 torch thread,
  per-client seed for dropout and example order, fresh SGD, example-weighted float32
  average over all parameters), for any cohorts and per-client seeds: with the spec's
  own draws (``reference_cohorts``/``reference_seed``) it reproduces the reference
  outcome (norm 23.7341, accuracy 0.632 at 10x5); with ``bhfl_draws`` it does exactly
  the client trainings ``bhfl run`` does on the same data.
- ``write_prepared()`` / ``bhfl_config()``: the workload as a bhfl prepared-data folder
  (``data.source.kind: prepared``) and the flat-tree experiment that runs it.

Run ``python benchmarks/workload.py`` to check the fingerprint and the reference outcome.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

LANGUAGES, PER_LANGUAGE, SEQ, VOCAB, TOPICS, SLICE = 5, 20, 32, 8000, 10, 1500
FINGERPRINT = "43eff8d1bf6eb5cd"
REFERENCE = {(10, 5): (23.7341, 0.632), (50, 3): (23.6433, 0.483)}  # (K, R) -> (final L2 norm, test accuracy)
SEED = 1234  # the model's init seed; bhfl's config uses it as its seed (init offset 0)


@dataclass(frozen=True)
class Workload:
    clients: list[tuple[np.ndarray, np.ndarray]]  # c = 20 l + j: (x int64 [n, 32], y int64 [n])
    languages: list[int]
    test: tuple[np.ndarray, np.ndarray]


def _sequences(rng: np.random.Generator, language: int, topics: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sequences of one language with the given intended topics; label = the topic block with most tokens."""
    n = len(topics)
    u = rng.random((n, SEQ))
    offset = rng.integers(0, 2, (n, SEQ))
    own = rng.integers(0, SLICE, (n, SEQ))
    shared = rng.integers(2, 500, (n, SEQ))
    base = 500 + SLICE * language
    block = base + 2 * topics[:, None] + offset
    x = np.where(u < 0.35, block, np.where(u < 0.80, base + own, shared)).astype(np.int64)
    x[:, 0] = block[:, 0]
    in_block = (x >= base) & (x < base + 2 * TOPICS)
    counts = np.stack([((x - base) // 2 == k) & in_block for k in range(TOPICS)], axis=-1).sum(axis=1)
    return x, counts.argmax(axis=1).astype(np.int64)  # argmax: ties go to the lowest block


def generate() -> Workload:
    rng = np.random.default_rng(1234)
    clients, languages = [], []
    for language in range(LANGUAGES):
        for _ in range(PER_LANGUAGE):
            n = int(np.clip(round(rng.lognormal(mean=5.0, sigma=1.0)), 16, 512))
            p = rng.dirichlet([0.5] * TOPICS)
            topics = rng.choice(TOPICS, size=n, p=p)
            clients.append(_sequences(rng, language, topics))
            languages.append(language)
    test_rng = np.random.default_rng(1235)
    parts = [_sequences(test_rng, language, np.arange(200) % TOPICS) for language in range(LANGUAGES)]
    test = (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
    return Workload(clients, languages, test)


def initial_model() -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(SEED)
    return BertForSequenceClassification(BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
        max_position_embeddings=64, num_labels=TOPICS))


def fingerprint(work: Workload, model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for x, y in work.clients:
        h.update(x.tobytes())
        h.update(y.tobytes())
    h.update(work.test[0].tobytes())
    h.update(work.test[1].tobytes())
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().to(torch.float32).numpy().tobytes())
    return h.hexdigest()[:16]


def reference_cohorts(k: int, rounds: int) -> list[list[int]]:
    rng = np.random.default_rng(1236)
    return [sorted(rng.choice(LANGUAGES * PER_LANGUAGE, k, replace=False).tolist()) for _ in range(rounds)]


def reference_seed(round_1based: int, cid: int) -> int:
    return 1234 + 1000 * round_1based + cid


def client_id(cid: int) -> str:
    return f"l{cid // PER_LANGUAGE}-{cid % PER_LANGUAGE:02d}"


def bhfl_draws(seed: int, k: int, rounds: int) -> tuple[list[list[int]], Callable[[int, int], int]]:
    """The cohorts and client seeds ``bhfl run`` uses on the workload's flat tree (bhfl_core/rng.py).

    The root samples its children (clients in manifest order) per root round; a
    non-persistent client's round counter stays 0 and its caller is ``root:<round>``.
    """
    from bhfl_core.rng import derive_seed, sample_cohort

    ids = list(range(LANGUAGES * PER_LANGUAGE))
    cohorts = [sample_cohort(ids, k, seed, "root", r) for r in range(rounds)]
    return cohorts, lambda round_1based, cid: derive_seed(seed, "train", client_id(cid), 0, f"root:{round_1based - 1}")


@dataclass
class LoopResult:
    flat: torch.Tensor  # final global model, trainable parameters flattened (float32)
    norm: float
    accuracy: float
    first_training: float  # wall clock
    last_aggregate: float
    trainings: int


def _accuracy(model: torch.nn.Module, test: tuple[np.ndarray, np.ndarray]) -> float:
    model.eval()
    x, y = torch.from_numpy(test[0]), torch.from_numpy(test[1])
    with torch.no_grad():
        preds = torch.cat([model(input_ids=x[i:i + 250]).logits.argmax(-1) for i in range(0, len(x), 250)])
    return float((preds == y).float().mean())


def fedavg_loop(work: Workload, cohorts: Sequence[Sequence[int]], seed_of: Callable[[int, int], int]) -> LoopResult:
    """The spec's plain single-process FedAvg loop over ``cohorts`` (round r = index + 1)."""
    torch.set_num_threads(1)
    model = initial_model()
    params = list(model.parameters())
    global_weights = [p.detach().clone() for p in params]
    data = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in work.clients]
    first = 0.0
    for r, cohort in enumerate(cohorts, start=1):
        total = sum(len(data[c][1]) for c in cohort)
        new = [torch.zeros_like(w) for w in global_weights]
        for cid in cohort:  # client-id order (cohorts are sorted)
            first = first or time.time()
            with torch.no_grad():
                for p, w in zip(params, global_weights):
                    p.copy_(w)
            x, y = data[cid]
            seed = seed_of(r, cid)
            torch.manual_seed(seed)  # dropout
            g = torch.Generator().manual_seed(seed)  # example order
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            model.train()
            perm = torch.randperm(len(y), generator=g)
            for i in range(0, len(y), 16):
                idx = perm[i:i + 16]
                loss = model(input_ids=x[idx], labels=y[idx]).loss
                opt.zero_grad()
                loss.backward()
                opt.step()
            with torch.no_grad():
                for acc, p in zip(new, params):
                    acc.add_(p.detach() * (len(y) / total))
        global_weights = new
    last = time.time()
    with torch.no_grad():
        for p, w in zip(params, global_weights):
            p.copy_(w)
    flat = torch.cat([w.reshape(-1) for w in global_weights])
    return LoopResult(flat, float(flat.norm()), _accuracy(model, work.test), first, last,
                      sum(len(c) for c in cohorts))


def write_prepared(work: Workload, folder: Path) -> Path:
    """The workload as a bhfl prepared-data folder: client train shards, empty client test
    shards (the spec has no per-client test data), the test set as the proxy test split."""
    from datasets import Dataset, Features, Sequence as Seq, Value

    from data_prep.manifest import ClientEntry, Manifest, Shard

    features = Features({"input_ids": Seq(Value("int64"), length=SEQ), "labels": Value("int64")})

    def shard(x: np.ndarray, y: np.ndarray, relative: str) -> Shard:
        Dataset.from_dict({"input_ids": x.tolist(), "labels": y.tolist()}, features=features).save_to_disk(
            str(folder / relative))
        return Shard(path=relative, size=len(y), label_hist=np.bincount(y, minlength=TOPICS).tolist() if len(y) else [])

    empty = np.zeros((0, SEQ), np.int64), np.zeros(0, np.int64)
    clients = []
    for cid, ((x, y), language) in enumerate(zip(work.clients, work.languages)):
        name = client_id(cid)
        clients.append(ClientEntry(id=name, language=f"l{language}", edge=f"edge-l{language}", cluster=f"l{language}",
                                   train=shard(x, y, f"clients/{name}/train"), test=shard(*empty, f"clients/{name}/test")))
    model = initial_model()
    manifest = Manifest(
        fingerprint=fingerprint(work, model), source="benchmark workload (shared/bench/WORKLOAD.md)",
        task="classification", labels=[str(k) for k in range(TOPICS)], tokenizer="none (token ids)",
        vocab_size=VOCAB, pad_token_id=0, special_ids=[0, 1], clients=clients, proxy_train=shard(*empty, "proxy/train"),
        proxy_test=shard(*work.test, "proxy/test"), unused_pool_rows=0)
    manifest.write(folder)
    return folder


def bhfl_config(prepared: Path, k: int, rounds: int, extra: Sequence[str] = ()) -> list[str]:
    """``--set`` overrides of configs/embedded.yaml that make ``bhfl run`` this workload (flat FedAvg)."""
    return [
        f"name=throughput-{k}x{rounds}", f"seed={SEED}", "model.init_seed_offset=0",
        f"data.source={{kind: prepared, path: '{prepared}', languages: [l0, l1, l2, l3, l4]}}",
        "model.tiny={vocab_size: 8000, hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 2, "
        "intermediate_size: 128, dropout: 0.1}",
        "model.max_length=32", "tree.flat=true", "tree.groups={}",
        f"tree.root={{rounds: {rounds}, cohort: {k}, proxy_train: false}}",
        "tree.client={persistent: false, eta_down: 1.0, train: {optimizer: sgd, lr: 0.05, epochs: 1, batch_size: 16}}",
        "eval.client_models=false", *extra,
    ]


def main() -> None:
    work = generate()
    fp = fingerprint(work, initial_model())
    sizes = [len(y) for _, y in work.clients]
    print(f"fingerprint {fp} ({'matches' if fp == FINGERPRINT else 'DIFFERS from'} {FINGERPRINT}); "
          f"{sum(sizes)} examples, client sizes {min(sizes)} / {float(np.median(sizes))} / {max(sizes)}")
    for (k, rounds), (norm, acc) in REFERENCE.items():
        out = fedavg_loop(work, reference_cohorts(k, rounds), reference_seed)
        print(json.dumps({"setting": f"{k}x{rounds}", "norm": round(out.norm, 4), "accuracy": round(out.accuracy, 3),
                          "reference": [norm, acc], "seconds": round(out.last_aggregate - out.first_training, 1)}))


if __name__ == "__main__":
    main()
