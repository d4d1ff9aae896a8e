"""Which edge server each client belongs to: by language, or by k-means over a cheap client embedding.

Language clustering needs no data (``bhfl_core.config.topology.language_edges``: one edge per
language, or contiguous blocks of a language's clients). K-means clusters clients
whose data look alike, for datasets without natural clusters: the embedding is the
client's normalised training label histogram or its mean token-frequency vector
(token ids hashed into ``token_buckets`` buckets, padding and special tokens left
out). scikit-learn's KMeans (k-means++, ``n_init=10``) with a seed derived from the
experiment seed makes the assignment deterministic; clusters are renamed by first
appearance (the cluster of the first client is ``c0``), so names do not depend on
the solver's internal label order.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import numpy as np

from bhfl_core.config.data import KMeansClustering
from bhfl_core.config.schema import ExperimentConfig
from bhfl_core.config.topology import edge_id, language_edges
from bhfl_core.rng import derive_seed
from data_prep.partition import ClientSplit, PartitionError


def label_features(label_hists: np.ndarray) -> np.ndarray:
    """Rows normalised to label distributions (an empty client is all zeros)."""
    totals = label_hists.sum(axis=1, keepdims=True)
    return np.divide(label_hists, totals, out=np.zeros(label_hists.shape, dtype=np.float64), where=totals > 0)


def token_features(token_ids: Sequence[np.ndarray], buckets: int) -> np.ndarray:
    """Mean token-frequency vector per client: ``bincount(ids mod buckets) / number of tokens``."""
    out = np.zeros((len(token_ids), buckets), dtype=np.float64)
    for i, ids in enumerate(token_ids):
        if len(ids):
            out[i] = np.bincount(ids % buckets, minlength=buckets) / len(ids)
    return out


def kmeans_labels(features: np.ndarray, k: int, seed: int) -> np.ndarray:
    """Cluster index per row, renumbered by first appearance; every cluster non-empty."""
    from sklearn.cluster import KMeans
    from sklearn.exceptions import ConvergenceWarning

    distinct = len(np.unique(features, axis=0))
    if distinct < k:
        raise PartitionError(
            f"data.clustering.clusters: k-means needs {k} distinct client embeddings, "
            f"the clients have {distinct}; lower clusters or use features: tokens"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        raw = KMeans(n_clusters=k, n_init=10, random_state=derive_seed(seed, "kmeans") % 2**32).fit_predict(features)
    order = {c: i for i, c in enumerate(dict.fromkeys(raw.tolist()))}
    return np.array([order[c] for c in raw.tolist()], dtype=np.int64)


def assign_edges(
    config: ExperimentConfig,
    clients: Sequence[ClientSplit],
    label_hists: np.ndarray,
    client_tokens: Callable[[ClientSplit], np.ndarray],
) -> list[tuple[str, str]]:
    """``(edge id, cluster)`` of every client, in ``clients`` order.

    ``label_hists[i]`` is client i's training label histogram; ``client_tokens(c)``
    returns the token ids of c's training rows (only called for ``features: tokens``).
    """
    clustering = config.data.clustering
    if not isinstance(clustering, KMeansClustering):
        out: list[tuple[str, str]] = []
        for lang in config.data.source.languages:
            mine = [c for c in clients if c.language == lang]
            out += [(e, lang) for e in language_edges(lang, len(mine), clustering.edges_per_language)]
        order = {
            c.id: i
            for i, c in enumerate(c for lang in config.data.source.languages for c in clients if c.language == lang)
        }
        return [out[order[c.id]] for c in clients]
    if clustering.features == "label_hist":
        features = label_features(label_hists)
    else:
        features = token_features([client_tokens(c) for c in clients], clustering.token_buckets)
    labels = kmeans_labels(features, clustering.clusters, config.seed)
    return [(edge_id(f"c{k}"), f"c{k}") for k in labels.tolist()]
