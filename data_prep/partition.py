"""Language-clustered federated partitions of a labelled pool.

For each language: a language-balanced proxy train/test share is carved out first
(the same number of documents per language; drawn i.i.d. from the language's pool;
none when ``data.proxy.source`` names a separate proxy corpus, which ``draw_proxy``
splits the same way), then clients are drawn from the rest with

- long-tailed sizes: lognormal(log(median), sigma), or a power law (Pareto with
  minimum ``min`` and exponent ``exponent``), rounded and clipped to [min, max];
- Dirichlet label skew: client label distribution q ~ Dir(alpha * K * prior), where
  prior is the language's label distribution (so clients are skewed *around* their
  language). A client's examples are drawn label by label from q; when a label's
  pool runs out, q is renormalised over the labels that remain;
- a per-client train/test split (``test_fraction``, at least one example each).

Proxy, client train and client test sets never overlap; pool rows no client or
proxy split takes are the (counted) unused remainder. Everything derives from the
seed and the language, so the partition is identical for the same seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from bhfl_core.config.data import DataConfig, SizeDistribution
from bhfl_core.config.topology import client_ids
from bhfl_core.rng import generator

__all__ = [
    "ClientSplit",
    "Partition",
    "PartitionError",
    "client_ids",
    "client_sizes",
    "draw_proxy",
    "partition_pool",
    "pool_size_needed",
]


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


def client_sizes(sizes: SizeDistribution, count: int, seed: int, language: str) -> np.ndarray:
    """Total (train + test) sizes of a language's clients."""
    rng = generator(seed, "partition", "sizes", language)
    if sizes.distribution == "powerlaw":
        raw = sizes.min * (1.0 + rng.pareto(sizes.exponent, size=count))  # Pareto(x_m = min, alpha = exponent)
    else:
        raw = rng.lognormal(mean=np.log(sizes.median), sigma=sizes.sigma, size=count)
    return np.clip(np.round(raw), sizes.min, sizes.max).astype(np.int64)


def _pool_proxy(spec: DataConfig) -> tuple[int, int]:
    """Proxy rows per language carved from the client pool (none when the proxy is a separate corpus)."""
    if spec.proxy.source is not None:
        return 0, 0
    return spec.proxy.train_per_language, spec.proxy.test_per_language


def pool_size_needed(spec: DataConfig, seed: int, language: str) -> int:
    """How many pool documents of ``language`` the partition will consume."""
    return sum(_pool_proxy(spec)) + int(client_sizes(spec.sizes, spec.clients_per_language, seed, language).sum())


def _draw_labels(rng: np.random.Generator, left: np.ndarray, q: np.ndarray, size: int) -> np.ndarray:
    """The labels of a client's ``size`` rows, in draw order; ``left`` (rows left per label) is updated.

    Row by row, the rule is: draw a label from ``q`` restricted to the labels with rows
    left (uniform over them if ``q`` gives those none), take one of its rows. It is
    drawn here a stretch at a time, with the stream of ``rng.choice(K, p=...)`` called
    once per row (one uniform each, inverted through the cdf): all uniforms first, then
    each stretch of rows that share the same available labels is inverted at once; a
    stretch ends with the row that takes a label's last row (at most K stretches).
    """
    u = rng.random(size)
    labels = np.empty(size, dtype=np.int64)
    k = len(q)
    done = 0
    while done < size:
        available = left > 0
        weights = q * available
        if weights.sum() <= 0:
            weights = available.astype(float)
        cdf = (weights / weights.sum()).cumsum()  # as Generator.choice: cumsum of p, then / its last value
        cdf /= cdf[-1]
        drawn = cdf.searchsorted(u[done:], side="right")
        taken = np.cumsum(drawn[:, None] == np.flatnonzero(available), axis=0)  # per available label, after each draw
        out = np.flatnonzero((taken >= left[available]).any(axis=1))
        stop = int(out[0]) + 1 if len(out) else len(drawn)  # the stretch ends with the row that empties a label
        labels[done : done + stop] = drawn[:stop]
        left -= np.bincount(drawn[:stop], minlength=k)
        done += stop
    return labels


def partition_pool(
    labels: np.ndarray, languages: np.ndarray, spec: DataConfig, seed: int, num_labels: int
) -> Partition:
    """Partition pool rows (given their labels and languages) into proxy splits and clients."""
    out = Partition()
    for language in spec.source.languages:
        rows = np.flatnonzero(languages == language)
        rng = generator(seed, "partition", "draw", language)
        rows = rows[rng.permutation(len(rows))]
        sizes = client_sizes(spec.sizes, spec.clients_per_language, seed, language)
        n_proxy_train, n_proxy_test = _pool_proxy(spec)
        need = n_proxy_train + n_proxy_test + int(sizes.sum())
        if len(rows) < need:
            raise PartitionError(
                f"data.sizes: language {language!r}: the pool has {len(rows)} documents but the proxy split and "
                f"{len(sizes)} clients need {need}; lower data.sizes / data.clients_per_language / data.proxy "
                "or add data"
            )
        out.proxy_train += sorted(rows[:n_proxy_train].tolist())
        out.proxy_test += sorted(rows[n_proxy_train : n_proxy_train + n_proxy_test].tolist())
        rest = rows[n_proxy_train + n_proxy_test :]
        # each label's rows are a stack: a client takes a label's rows from its end
        by_label = [rest[labels[rest] == c] for c in range(num_labels)]
        stacked = np.concatenate(by_label)
        left = np.array([len(b) for b in by_label], dtype=np.int64)
        first = np.cumsum(left) - left  # where each label's stack starts in ``stacked``
        prior = left.astype(float)
        prior = (prior + 1e-3) / (prior + 1e-3).sum()
        for cid, size in zip(client_ids(language, len(sizes)), sizes):
            q = rng.dirichlet(spec.dirichlet_alpha * num_labels * prior)
            before = left.copy()
            drawn = _draw_labels(rng, left, q, int(size))
            # the r-th row of label c this client takes is by_label[c][before[c] - 1 - r]
            order = np.argsort(drawn, kind="stable")
            counts = np.bincount(drawn, minlength=num_labels)
            rank = np.empty(len(drawn), dtype=np.int64)
            rank[order] = np.arange(len(drawn)) - np.repeat(np.cumsum(counts) - counts, counts)
            mine = stacked[first[drawn] + before[drawn] - 1 - rank]
            mine = mine[rng.permutation(len(mine))]
            n_test = min(len(mine) - 1, max(1, round(spec.test_fraction * len(mine))))
            train, test = np.sort(mine[n_test:]).tolist(), np.sort(mine[:n_test]).tolist()
            out.clients.append(ClientSplit(cid, language, train, test))
        out.unused += int(left.sum())
    return out


def draw_proxy(
    languages: np.ndarray, wanted: list[str], train: int, test: int, seed: int
) -> tuple[list[int], list[int]]:
    """Proxy train/test rows of a separate proxy corpus: ``train`` + ``test`` per language, disjoint.

    Rows are grouped by language (in ``wanted`` order; sorted within a language), so
    a server can take its languages' share as contiguous row ranges.
    """
    out_train: list[int] = []
    out_test: list[int] = []
    for language in wanted:
        rows = np.flatnonzero(languages == language)
        if len(rows) < train + test:
            raise PartitionError(
                f"data.proxy: the proxy corpus has {len(rows)} rows of language {language!r}, "
                f"train_per_language + test_per_language need {train + test}"
            )
        rows = rows[generator(seed, "proxy", "draw", language).permutation(len(rows))]
        out_train += sorted(rows[:train].tolist())
        out_test += sorted(rows[train : train + test].tolist())
    return out_train, out_test
