"""A metric's distribution over clients, and the per-client tables of the report.

"Best / worst 10%" of a distribution over clients is the mean over the best / worst
``ceil(10% of n)`` clients (at least one), where best means highest for accuracy and
macro-F1 and lowest for loss and perplexity. Over a sample of clients (``eval.clients:
N``) the mean carries a 95% interval for the mean over all of them, its ends clipped to
the metric's bounds (an accuracy in [0, 1]) as ``bhfl compare`` clips its intervals over
seeds (``seeds.interval``): a t-interval is symmetric around the mean, so with a few
clients near a bound it runs past a value no client can have.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from bhfl_core.store.tables import table_csv


def _tail_mean(values: Sequence[float], fraction: float, highest: bool) -> float:
    clean = sorted((v for v in values if not math.isnan(v)), reverse=highest)
    if not clean:
        return float("nan")
    k = max(1, math.ceil(fraction * len(clean)))
    return sum(clean[:k]) / k


def worst_fraction_mean(values: Sequence[float], fraction: float = 0.1, higher_is_better: bool = True) -> float:
    """Mean of the worst ``fraction`` of values (at least one): lowest when higher is better."""
    return _tail_mean(values, fraction, highest=not higher_is_better)


def best_fraction_mean(values: Sequence[float], fraction: float = 0.1, higher_is_better: bool = True) -> float:
    return _tail_mean(values, fraction, highest=higher_is_better)


@dataclass(frozen=True)
class Distribution:
    """A metric's distribution over clients; ``variance`` is the population variance (ddof 0).

    ``of``: the clients the ``n`` stand for: ``n`` when every client was scored (one without a value, NaN from
    an empty test split, is left out of both); more when
    they are a sample (``eval.clients: N``), and then ``mean_low``/``mean_high`` is the
    95% interval of the mean over all ``of`` (a t-interval with the finite-population
    correction, clipped to the metric's bounds); for a complete population it is the mean itself.
    """

    n: int
    mean: float
    median: float
    best10: float
    worst10: float
    variance: float
    of: int = 0
    mean_low: float = math.nan
    mean_high: float = math.nan


STATS = ("mean", "median", "best10", "worst10", "variance")


Bounds = tuple[float, float]


def _mean_interval(t: torch.Tensor, mean: float, of: int, bounds: Bounds | None) -> tuple[float, float]:
    """95% interval of the mean over ``of`` clients from the sample ``t`` (drawn without replacement), within
    ``bounds``."""
    n = len(t)
    if of <= n:
        return mean, mean
    if n < 2:
        return math.nan, math.nan
    from scipy.stats import t as student

    half = float(student.ppf(0.975, n - 1)) * float(t.std(unbiased=True)) / math.sqrt(n) * math.sqrt((of - n) / of)
    low, high = bounds if bounds is not None else (-math.inf, math.inf)
    return max(mean - half, low), min(mean + half, high)


def distribution(
    values: Sequence[float], higher_is_better: bool, of: int | None = None, bounds: Bounds | None = None
) -> Distribution:
    """The distribution of ``values`` (NaNs left out); ``of``: how many clients they are a sample of; ``bounds``:
    the range the metric cannot leave (``TaskMetrics.bounds``), which the mean's interval is clipped to."""
    clean = [v for v in values if not math.isnan(v)]
    if not clean:
        nan = float("nan")
        return Distribution(0, nan, nan, nan, nan, nan, of or 0)
    t = torch.tensor(clean, dtype=torch.float64)
    ordered = sorted(clean)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    mean = float(t.mean())
    # ``values`` that are every one of the ``of`` clients are the whole population, whether or not some are NaN
    # (an empty test split: a client with no value, not one left unsampled): its mean is exact, no interval
    total = len(clean) if of is None or of <= len(values) else of
    return Distribution(
        len(clean),
        mean,
        median,
        best_fraction_mean(clean, 0.1, higher_is_better),
        worst_fraction_mean(clean, 0.1, higher_is_better),
        float(t.var(unbiased=False)),
        total,
        *_mean_interval(t, mean, total, bounds),
    )


@dataclass(frozen=True)
class DistRow:
    model: str
    level: int
    population: str  # 'subtree' (the model's own clients) or 'all'
    metric: str
    dist: Distribution


@dataclass(frozen=True)
class ClientRow:
    client: str
    group: str
    relation: str
    model: str
    metric: str
    value: float
    gain_vs_local: float  # NaN where no local-only baseline ran


def distribution_csv(rows: Sequence[DistRow]) -> str:
    """One row per (model, population, metric); ``of`` and the mean's interval say what a sample stands for."""
    return table_csv(
        ["model", "level", "population", "metric", "n", *STATS, "of", "mean_low", "mean_high"],
        (
            [
                r.model,
                r.level,
                r.population,
                r.metric,
                r.dist.n,
                *(f"{getattr(r.dist, s):.6f}" for s in STATS),
                r.dist.of,
                f"{r.dist.mean_low:.6f}",
                f"{r.dist.mean_high:.6f}",
            ]
            for r in rows
        ),
    )


def clients_csv(rows: Sequence[ClientRow]) -> str:
    return table_csv(
        ["client", "group", "relation", "model", "metric", "value", "gain_vs_local"],
        ([r.client, r.group, r.relation, r.model, r.metric, f"{r.value:.6f}", f"{r.gain_vs_local:.6f}"] for r in rows),
    )
