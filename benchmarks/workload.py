"""The throughput workload of ../shared/bench/WORKLOAD.md, exactly: data, model, plain FedAvg loop.

- ``generate()``: 5 "languages" x 20 clients of token sequences and the held-out test
  set, drawn from numpy's PCG64 streams in the order the spec gives; ``fingerprint()``
  must give ``43eff8d1bf6eb5cd`` (numpy does not promise bit-identical streams across
  versions, so this is checked, not assumed).
- ``fedavg_loop()``: the spec's plain single-process FedAvg loop (1 torch thread,
  per-client seed for dropout and example order, fresh SGD, example-weighted float32
  average over all parameters) for any cohorts and per-client seeds. With the spec's
  own draws (``reference_cohorts`` / ``reference_seed``) it reproduces the reference
  outcome; with ``bhfl_draws`` it does exactly the client trainings ``bhfl run`` does.
- ``write_prepared()`` / ``workload_config()``: the workload as a bhfl prepared-data
  folder (``data.source.kind: prepared``) and the flat FedAvg experiment that runs it.

``python benchmarks/workload.py [--settings 10x5 50x3]`` checks the fingerprint and the
reference outcome of each setting (exit status 1 when either differs).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from bhfl_core.config.schema import ExperimentConfig

LANGUAGES, PER_LANGUAGE, SEQ, VOCAB, TOPICS, SLICE = 5, 20, 32, 8000, 10, 1500
FINGERPRINT = "43eff8d1bf6eb5cd"
REFERENCE = {(10, 5): (23.7341, 0.632), (50, 3): (23.6433, 0.483)}  # (K, R) -> (final L2 norm, test accuracy)
SEED = 1234  # the model's init seed; the bhfl config uses it as its seed (init offset 0) to build the same model
LR, BATCH = 0.05, 16
TINY = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 128,
}

SeedOf = Callable[[int, int], int]  # (1-based round, client index) -> the client training's seed


@dataclass(frozen=True)
class Workload:
    clients: list[tuple[np.ndarray, np.ndarray]]  # c = 20 l + j: (x int64 [n, 32], y int64 [n])
    languages: list[int]  # l of each client
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


def initial_model(size: dict[str, int] | None = None) -> torch.nn.Module:
    """The spec's model (``size`` overrides its dimensions, e.g. BERT-base for GPU runs)."""
    from transformers import BertConfig, BertForSequenceClassification

    dims = {k: v for k, v in TINY.items() if k != "vocab_size"} | (size or {})
    torch.manual_seed(SEED)
    return BertForSequenceClassification(
        BertConfig(vocab_size=VOCAB, max_position_embeddings=64, num_labels=TOPICS, **dims)
    )


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


# ---------------------------------------------------------------- who trains when, with which seed


def reference_cohorts(k: int, rounds: int) -> list[list[int]]:
    rng = np.random.default_rng(1236)
    return [sorted(rng.choice(LANGUAGES * PER_LANGUAGE, k, replace=False).tolist()) for _ in range(rounds)]


def reference_seed(round_1based: int, cid: int) -> int:
    return 1234 + 1000 * round_1based + cid


def language_name(language: int) -> str:
    return f"l{language}"


def client_id(cid: int) -> str:
    return f"{language_name(cid // PER_LANGUAGE)}-{cid % PER_LANGUAGE:02d}"


def bhfl_draws(config: ExperimentConfig) -> tuple[list[list[int]], SeedOf]:
    """The cohorts and client seeds ``bhfl run`` draws for ``config`` (a flat tree over the prepared workload).

    Read off bhfl's own code paths: the tree built from the config and the data
    manifest, the root sampling its children (clients in manifest order) per root
    round (``bhfl_core.rng.sample_cohort``, as bhfl_core/algorithm/engine.py does), and a
    client's TRAIN seed ``derive_seed(seed, "train", client, round, caller)``
    (tasks/client_training.py) where a non-persistent client's round counter stays 0
    and the caller is the root round ``root:<r0>`` (flows/experiment.py). Clients are
    returned as indices into the manifest, which ``write_prepared`` writes in workload order.
    """
    from bhfl_core.config.topology import ClientInfo, build_tree
    from bhfl_core.rng import derive_seed, sample_cohort
    from data_prep.manifest import Manifest

    manifest = Manifest.read(Path(config.data.source.path))  # type: ignore[union-attr]  (a prepared source)
    tree = build_tree(config, [ClientInfo(c.id, c.language, c.train.size, c.edge, c.cluster) for c in manifest.clients])
    root = tree.root
    children = tree.children(root.id)
    if not all(c.is_leaf and not c.settings.persistent for c in children):
        raise ValueError(
            "bhfl_draws needs a flat tree of non-persistent clients (tree.flat, tree.client.persistent: false)"
        )
    index = {c.id: i for i, c in enumerate(manifest.clients)}
    cohorts = [
        [index[c.id] for c in sample_cohort(children, root.settings.cohort, config.seed, root.id, r)]
        for r in range(root.settings.rounds)
    ]

    def seed_of(round_1based: int, cid: int) -> int:
        return derive_seed(config.seed, "train", manifest.clients[cid].id, 0, f"{root.id}:{round_1based - 1}")

    return cohorts, seed_of


# ---------------------------------------------------------------- the plain loop


@dataclass
class LoopResult:
    flat: torch.Tensor  # final global model, trainable parameters flattened in model.parameters() order (float32)
    norm: float  # L2, computed in float64
    accuracy: float
    first_training: float  # wall clock (time.time) when the first client training started
    last_aggregate: float  # wall clock when the last round's aggregate was complete
    round_seconds: list[float]  # per round: from its first training (round 1) or the previous aggregate
    trainings: int


def accuracy(model: torch.nn.Module, test: tuple[np.ndarray, np.ndarray]) -> float:
    """Test accuracy of ``model`` in eval mode (on the model's device)."""
    device = next(model.parameters()).device
    model.eval()
    x, y = torch.from_numpy(test[0]).to(device), torch.from_numpy(test[1]).to(device)
    with torch.no_grad():
        preds = torch.cat([model(input_ids=x[i : i + 250]).logits.argmax(-1) for i in range(0, len(x), 250)])
    return float((preds == y).float().mean())


def flat_accuracy(flat: torch.Tensor, test: tuple[np.ndarray, np.ndarray], size: dict[str, int] | None = None) -> float:
    """Test accuracy of a flat parameter vector (e.g. a bhfl run's root model) in the spec's model."""
    model = initial_model(size)
    torch.nn.utils.vector_to_parameters(flat.clone(), model.parameters())  # a private copy: nothing trains here
    return accuracy(model, test)


def _train_client(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int) -> None:
    """One client training exactly as the spec writes it (model trained in place)."""
    torch.manual_seed(seed)  # dropout
    g = torch.Generator().manual_seed(seed)  # example order
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model.train()
    perm = torch.randperm(len(y), generator=g)
    for i in range(0, len(y), BATCH):
        idx = perm[i : i + BATCH]
        loss = model(input_ids=x[idx], labels=y[idx]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


def fedavg_loop(
    work: Workload,
    cohorts: Sequence[Sequence[int]],
    seed_of: SeedOf,
    device: str = "cpu",
    model_size: dict[str, int] | None = None,
) -> LoopResult:
    """The spec's plain single-process FedAvg loop over ``cohorts`` (round r = index + 1).

    The global weights live in tensors of their own, copied into the model before each
    client (never views of one vector: training would overwrite them), and the new
    global is the float32 sum of (n_c / sum n) x client weights in cohort order.
    """
    torch.set_num_threads(1)
    dev = torch.device(device)
    model = initial_model(model_size).to(dev)
    params = list(model.parameters())
    global_weights = [p.detach().clone() for p in params]
    data = [(torch.from_numpy(x).to(dev), torch.from_numpy(y).to(dev)) for x, y in work.clients]
    first, ends = 0.0, []
    for r, cohort in enumerate(cohorts, start=1):
        total = sum(len(data[c][1]) for c in cohort)
        new = [torch.zeros_like(w) for w in global_weights]
        for cid in cohort:
            first = first or time.time()
            with torch.no_grad():
                for p, w in zip(params, global_weights):
                    p.copy_(w)
            x, y = data[cid]
            _train_client(model, x, y, seed_of(r, cid))
            with torch.no_grad():
                for acc, p in zip(new, params):
                    acc.add_(p.detach() * (len(y) / total))
        global_weights = new
        ends.append(time.time())
    with torch.no_grad():
        for p, w in zip(params, global_weights):
            p.copy_(w)
    flat = torch.cat([w.reshape(-1) for w in global_weights]).cpu()
    rounds = np.diff([first, *ends]).tolist()
    norm = float(flat.double().norm())  # a float32 norm is off by ~1e-4 here (23.64317 for 23.64325 at 50x3)
    return LoopResult(flat, norm, accuracy(model, work.test), first, ends[-1], rounds, sum(len(c) for c in cohorts))


# ---------------------------------------------------------------- the workload as a bhfl experiment


def write_prepared(work: Workload, folder: Path) -> Path:
    """The workload as a bhfl prepared-data folder (``data.source.kind: prepared``; docs/data.md).

    Clients ``l0-00`` .. ``l4-19`` in workload order (c = 20 l + j), language ``l<l>``,
    edge ``edge-l<l>`` (bhfl's one edge per language), train shards = (x, y) as columns
    ``input_ids``, ``labels``; empty client test shards (the spec has none); the test
    set as the proxy test split, no proxy train split. The manifest's fingerprint is
    the workload's. The partition report goes in ``report/`` as bhfl's preparation writes it.
    """
    import datasets
    from datasets import Dataset, Features, Value
    from datasets import Sequence as Seq

    from bhfl_core.config.topology import edge_id
    from data_prep.manifest import ClientEntry, ClientTable, Manifest, Shard
    from data_prep.report import write_report

    datasets.disable_progress_bars()
    features = Features({"input_ids": Seq(Value("int64"), length=SEQ), "labels": Value("int64")})

    def shard(x: np.ndarray, y: np.ndarray, relative: str) -> Shard:
        Dataset.from_dict({"input_ids": x.tolist(), "labels": y.tolist()}, features=features).save_to_disk(
            str(folder / relative)
        )
        return Shard(path=relative, size=len(y), label_hist=np.bincount(y, minlength=TOPICS).tolist())

    empty = np.zeros((0, SEQ), np.int64), np.zeros(0, np.int64)
    clients = []
    for cid, ((x, y), language) in enumerate(zip(work.clients, work.languages)):
        name, lang = client_id(cid), language_name(language)
        clients.append(
            ClientEntry(
                id=name,
                language=lang,
                edge=edge_id(lang),
                cluster=lang,
                train=shard(x, y, f"clients/{name}/train"),
                test=shard(*empty, f"clients/{name}/test"),
            )
        )
    manifest = Manifest(
        fingerprint=fingerprint(work, initial_model()),
        source="benchmark workload (shared/bench/WORKLOAD.md)",
        task="classification",
        labels=[str(k) for k in range(TOPICS)],
        tokenizer="none (token ids)",
        vocab_size=VOCAB,
        pad_token_id=0,
        special_ids=[0, 1],
        clients=ClientTable.of(clients),
        proxy_train=shard(*empty, "proxy/train"),
        proxy_test=shard(*work.test, "proxy/test"),
        unused_pool_rows=0,
    )
    manifest.write(folder)
    write_report(manifest, folder / "report")
    return folder


def workload_config(prepared: Path, k: int, rounds: int) -> dict[str, Any]:
    """The bhfl experiment of one setting: flat FedAvg over the prepared workload, the spec's model and training.

    ``seed`` = the model's init seed with ``init_seed_offset: 0``, so bhfl builds the
    spec's initial model bit for bit; clients are non-persistent (every round starts
    from the root's model) and train with the spec's SGD; only the root model is scored.
    """
    return {
        "name": f"workload-{k}x{rounds}",
        "seed": SEED,
        "data": {
            "source": {
                "kind": "prepared",
                "path": str(prepared),
                "languages": [language_name(lang) for lang in range(LANGUAGES)],
            }
        },
        "model": {"name": "tiny-bert", "tiny": {**TINY, "dropout": 0.1}, "max_length": SEQ, "init_seed_offset": 0},
        "tree": {
            "flat": True,
            "groups": {},
            "root": {"rounds": rounds, "cohort": k, "proxy_train": False},
            "client": {
                "persistent": False,
                "eta_down": 1.0,
                "train": {"optimizer": "sgd", "lr": LR, "epochs": 1, "batch_size": BATCH},
            },
        },
        # the spec evaluates once, after the last round: no server curves (eval.every's default is 1)
        "eval": {"client_models": False, "every": 0},
    }


# ---------------------------------------------------------------- check


def check(settings: Sequence[tuple[int, int]]) -> bool:
    """Fingerprint and reference outcome of each setting, printed; True when all match the spec."""
    work = generate()
    fp = fingerprint(work, initial_model())
    sizes = [len(y) for _, y in work.clients]
    ok = fp == FINGERPRINT
    print(
        f"fingerprint {fp} ({'matches' if ok else 'DIFFERS from'} {FINGERPRINT}); {sum(sizes)} examples, "
        f"client sizes {min(sizes)} / {float(np.median(sizes))} / {max(sizes)}"
    )
    for k, rounds in settings:
        out = fedavg_loop(work, reference_cohorts(k, rounds), reference_seed)
        norm, acc = REFERENCE[(k, rounds)]
        same = round(out.norm, 4) == norm and round(out.accuracy, 3) == acc
        ok &= same
        print(
            json.dumps(
                {
                    "setting": f"{k}x{rounds}",
                    "norm": round(out.norm, 4),
                    "accuracy": round(out.accuracy, 3),
                    "reference": [norm, acc],
                    "matches": same,
                    "seconds": round(out.last_aggregate - out.first_training, 1),
                }
            )
        )
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--settings",
        nargs="+",
        default=["10x5"],
        choices=[f"{k}x{r}" for k, r in REFERENCE],
        help="KxR settings whose reference outcome to reproduce",
    )
    args = parser.parse_args()
    settings = [tuple(int(v) for v in s.split("x")) for s in args.settings]
    sys.exit(0 if check(settings) else 1)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
