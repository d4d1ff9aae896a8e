"""Language-clustered federated partitions of a labelled pool.

For each language: a language-balanced proxy train/test share is carved out first
(the same number of documents per language; drawn i.i.d. from the language's pool),
then clients are drawn from the rest with

- long-tailed sizes: lognormal(log(median), sigma) clipped to [min, max];
- Dirichlet label skew: client label distribution q ~ Dir(alpha * K * prior), where
  prior is the language's label distribution (so clients are skewed *around* their
  language). A client's examples are drawn label by label from q; when a label's
  pool runs out, q is renormalised over the labels that remain;
- a per-client train/test split (``test_fraction``, at least one example each).

Proxy, client train and client test sets never overlap. Everything derives from the
seed and the language, so the partition is identical for the same seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from bhfl_core.config import DataConfig, SizeDistribution
from bhfl_core.rng import generator


@dataclass(frozen=True)
class ClientSplit:
    id: str
    language: str
    train: list[int]  # row indices into the pool
    test: list[int]


@dataclass
class Partition:
    clients: list[ClientSplit] = field(default_factory=list)
    proxy_train: list[int] = field(default_factory=list)
    proxy_test: list[int] = field(default_factory=list)
    unused: int = 0


class PartitionError(ValueError):
    """The pool cannot satisfy the partition spec (names the language and the shortfall)."""


def client_ids(language: str, count: int) -> list[str]:
    width = max(2, len(str(count - 1)))
    return [f"{language}-{i:0{width}d}" for i in range(count)]


def client_sizes(sizes: SizeDistribution, count: int, seed: int, language: str) -> np.ndarray:
    """Total (train + test) sizes of a language's clients."""
    rng = generator(seed, "partition", "sizes", language)
    raw = rng.lognormal(mean=np.log(sizes.median), sigma=sizes.sigma, size=count)
    return np.clip(np.round(raw), sizes.min, sizes.max).astype(np.int64)


def pool_size_needed(spec: DataConfig, seed: int, language: str) -> int:
    """How many pool documents of ``language`` the partition will consume."""
    proxy = spec.proxy.train_per_language + spec.proxy.test_per_language
    return proxy + int(client_sizes(spec.sizes, spec.clients_per_language, seed, language).sum())


def _draw_client(rng: np.random.Generator, by_label: list[list[int]], q: np.ndarray, size: int) -> list[int]:
    taken: list[int] = []
    q = q.copy()
    for _ in range(size):
        available = np.array([len(b) > 0 for b in by_label])
        weights = q * available
        if weights.sum() <= 0:
            weights = available.astype(float)
        label = int(rng.choice(len(q), p=weights / weights.sum()))
        taken.append(by_label[label].pop())
    return taken


def partition_pool(labels: np.ndarray, languages: np.ndarray, spec: DataConfig, seed: int, num_labels: int) -> Partition:
    """Partition pool rows (given their labels and languages) into proxy splits and clients."""
    out = Partition()
    for language in spec.source.languages:
        rows = np.flatnonzero(languages == language)
        rng = generator(seed, "partition", "draw", language)
        rows = rows[rng.permutation(len(rows))]
        sizes = client_sizes(spec.sizes, spec.clients_per_language, seed, language)
        n_proxy_train, n_proxy_test = spec.proxy.train_per_language, spec.proxy.test_per_language
        need = n_proxy_train + n_proxy_test + int(sizes.sum())
        if len(rows) < need:
            raise PartitionError(
                f"language {language!r}: the pool has {len(rows)} documents but the proxy split and "
                f"{len(sizes)} clients need {need}; lower data.sizes / data.proxy or add data"
            )
        out.proxy_train += sorted(rows[:n_proxy_train].tolist())
        out.proxy_test += sorted(rows[n_proxy_train : n_proxy_train + n_proxy_test].tolist())
        rest = rows[n_proxy_train + n_proxy_test :]
        by_label = [rest[labels[rest] == c].tolist() for c in range(num_labels)]
        prior = np.array([len(b) for b in by_label], dtype=float)
        prior = (prior + 1e-3) / (prior + 1e-3).sum()
        for cid, size in zip(client_ids(language, len(sizes)), sizes):
            q = rng.dirichlet(spec.dirichlet_alpha * num_labels * prior)
            mine = np.array(_draw_client(rng, by_label, q, int(size)))
            mine = mine[rng.permutation(len(mine))]
            n_test = min(len(mine) - 1, max(1, round(spec.test_fraction * len(mine))))
            out.clients.append(ClientSplit(cid, language, sorted(mine[n_test:].tolist()), sorted(mine[:n_test].tolist())))
        out.unused += sum(len(b) for b in by_label)
    return out
