"""Partition properties (hypothesis), power-law sizes, separate proxy corpora, edges and k-means clusters."""

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from bhfl_core.config.data import DataConfig, EmbeddedSource, KMeansClustering, ProxySource, ProxySpec, SizeDistribution
from bhfl_core.config.topology import ClientInfo, build_tree, language_edges, placeholder_clients
from data_prep.clustering import assign_edges, kmeans_labels, token_features
from data_prep.partition import ClientSplit, PartitionError, client_sizes, draw_proxy, partition_pool, pool_size_needed
from tests.small import small_config

LANGS = ("en", "fr", "ru")


def _spec(clients, alpha, sizes, proxy_train, proxy_test, external):
    source = ProxySource(data_files="unused.parquet", label_column="label") if external else None
    return DataConfig(
        source=EmbeddedSource(languages=list(LANGS)),
        clients_per_language=clients,
        dirichlet_alpha=alpha,
        sizes=sizes,
        test_fraction=0.25,
        proxy=ProxySpec(train_per_language=proxy_train, test_per_language=proxy_test, source=source),
    )


sizes_strategy = st.one_of(
    st.builds(
        lambda m, s, lo: SizeDistribution(distribution="lognormal", median=m, sigma=s, min=lo, max=300),
        st.integers(5, 60),
        st.floats(0.0, 1.5),
        st.integers(2, 12),
    ),
    st.builds(
        lambda e, lo: SizeDistribution(distribution="powerlaw", exponent=e, min=lo, max=300),
        st.floats(0.3, 3.0),
        st.integers(2, 12),
    ),
)


@settings(max_examples=40, deadline=None)
@given(
    clients=st.integers(1, 5),
    alpha=st.floats(0.05, 5.0),
    sizes=sizes_strategy,
    proxy_train=st.integers(0, 20),
    proxy_test=st.integers(0, 20),
    external=st.booleans(),
    spare=st.integers(0, 30),
    seed=st.integers(0, 10**6),
)
def test_partition_is_disjoint_covering_sized_and_reproducible(
    clients, alpha, sizes, proxy_train, proxy_test, external, spare, seed
):
    spec = _spec(clients, alpha, sizes, proxy_train, proxy_test, external)
    n = {lang: pool_size_needed(spec, seed, lang) + spare for lang in LANGS}
    languages = np.concatenate([np.full(n[lang], lang) for lang in LANGS])
    labels = np.random.default_rng(seed).integers(0, 10, size=len(languages))
    part = partition_pool(labels, languages, spec, seed, 10)
    assert part == partition_pool(labels, languages, spec, seed, 10)  # identical for the same seed
    clients_rows = [i for c in part.clients for i in c.train + c.test]
    used = part.proxy_train + part.proxy_test + clients_rows
    assert len(used) == len(set(used))  # disjoint
    assert len(used) + part.unused == len(languages)  # each pool row: one client split, a proxy split, or unused
    assert part.unused == len(LANGS) * spare
    for c in part.clients:
        assert len(c.train) >= 1 and len(c.test) >= 1 and len(c.train) + len(c.test) >= sizes.min
        assert len(c.train) + len(c.test) <= sizes.max
        assert set(languages[c.train + c.test]) == {c.language}
    # a separate proxy corpus takes nothing from the pool; otherwise the proxy is language-balanced
    expected_proxy = 0 if external else proxy_train
    assert all((languages[part.proxy_train] == lang).sum() == expected_proxy for lang in LANGS)


def test_power_law_sizes_have_a_minimum_and_a_heavy_tail():
    sizes = SizeDistribution(distribution="powerlaw", exponent=1.2, min=20, max=100_000)
    drawn = client_sizes(sizes, 4000, seed=3, language="de")
    assert drawn.min() == 20 and np.array_equal(drawn, client_sizes(sizes, 4000, seed=3, language="de"))
    # Pareto(x_m=20, a=1.2): P(X > 40) = 2^-1.2 = 0.435, P(X > 200) = 10^-1.2 = 0.063
    assert abs((drawn > 40).mean() - 0.435) < 0.03 and abs((drawn > 200).mean() - 0.063) < 0.015
    lognormal = client_sizes(SizeDistribution(median=50, sigma=0.5, min=2, max=10_000), 4000, 3, "de")
    assert abs(np.median(lognormal) - 50) <= 2


def test_separate_proxy_draw_is_disjoint_balanced_and_seeded():
    langs = np.array(["en"] * 50 + ["de"] * 40 + ["xx"] * 10)
    train, test = draw_proxy(langs, ["en", "de"], 15, 10, seed=1)
    assert not set(train) & set(test) and len(train) == 30 and len(test) == 20
    assert list(langs[train]) == ["en"] * 15 + ["de"] * 15  # grouped by language, in config order
    assert (train, test) == draw_proxy(langs, ["en", "de"], 15, 10, seed=1)
    assert draw_proxy(langs, ["en", "de"], 15, 10, seed=2) != (train, test)
    with pytest.raises(PartitionError, match=r"data\.proxy: the proxy corpus has 40 rows of language 'de'"):
        draw_proxy(langs, ["en", "de"], 30, 20, seed=1)


@given(count=st.integers(1, 40), edges=st.integers(1, 40))
def test_language_edges_are_contiguous_near_equal_blocks(count, edges):
    assume(edges <= count)
    assigned = language_edges("de", count, edges)
    names = list(dict.fromkeys(assigned))
    assert len(names) == edges and assigned == sorted(assigned, key=names.index)  # contiguous blocks
    sizes = [assigned.count(e) for e in names]
    assert max(sizes) - min(sizes) <= 1
    assert names == (["edge-de"] if edges == 1 else [f"edge-de-{k}" for k in range(edges)])


def test_kmeans_recovers_planted_clusters_deterministically():
    rng = np.random.default_rng(0)
    centres = np.eye(3).repeat(3, axis=1)  # three disjoint label groups over 9 labels
    truth = np.array([2, 0, 1, 1, 2, 0, 0, 2, 1, 1, 0, 2])
    hists = rng.poisson(40 * centres[truth] + 0.2)
    labels = kmeans_labels(hists / hists.sum(1, keepdims=True), 3, seed=7)
    # the same partition as the truth, named by first appearance (client 0's cluster is c0)
    assert labels[0] == 0 and len(set(zip(labels.tolist(), truth.tolist()))) == 3
    assert np.array_equal(labels, kmeans_labels(hists / hists.sum(1, keepdims=True), 3, seed=7))
    with pytest.raises(PartitionError, match="needs 4 distinct client embeddings"):
        kmeans_labels(np.ones((5, 3)), 4, seed=0)


def test_token_features_are_mean_hashed_token_frequencies():
    feats = token_features([np.array([1, 1, 9, 5]), np.array([], dtype=np.int64)], buckets=8)
    assert feats[0].tolist() == [0, 0.75, 0, 0, 0, 0.25, 0, 0] and feats[1].sum() == 0  # 9 mod 8 = 1


def test_kmeans_edges_build_the_tree_with_cluster_groups():
    cfg = small_config(
        "data.clustering={kind: kmeans, clusters: 2}", "tree.groups={g1: [c0], g2: [c1]}", "tree.edge.cohort=1"
    )
    assert isinstance(cfg.data.clustering, KMeansClustering)
    clients = [ClientSplit(f"{lang}-0{i}", lang, [0], [1]) for lang in ("en", "de", "fr") for i in range(3)]
    hists = np.array([[9, 1], [8, 0], [0, 7], [9, 0], [1, 9], [0, 8], [7, 1], [0, 9], [8, 2]], dtype=float)
    edges = assign_edges(cfg, clients, hists, lambda c: np.zeros(0, dtype=np.int64))
    assert edges[0] == ("edge-c0", "c0") and {e for e, _ in edges} == {"edge-c0", "edge-c1"}
    tree = build_tree(cfg, [ClientInfo(c.id, c.language, 1, e, k) for c, (e, k) in zip(clients, edges)])
    assert tree["edge-c0"].parent == "g1" and tree["edge-c1"].parent == "g2"
    assert set(tree["edge-c0"].children) == {c.id for c, (e, _) in zip(clients, edges) if e == "edge-c0"}
    assert tree["en-00"].group == "en" and tree["edge-c1"].group == "c1"  # clients keep their language (proxy shares)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["data.clustering={edges_per_language: 4}"],
            "data: clustering.edges_per_language (4) exceeds clients_per_language (3)",
        ),
        (
            ["data.clustering={kind: kmeans, clusters: 10}", "tree.groups={}"],
            "clustering.clusters (10) exceeds the number of clients (9)",
        ),
        (
            ["data.clustering={kind: kmeans, clusters: 2}"],
            "tree.groups.west: cluster 'en' is not in data.clustering (k-means clusters) ['c0', 'c1']",
        ),
        (
            ["data.clustering={kind: kmeans, features: words}"],
            "data.clustering.features: Input should be 'label_hist' or 'tokens'",
        ),
        (["data.source={kind: hub}"], "data.source: kind must be one of: embedded, xglue"),
        (
            ["data.source={kind: xglue, config: paws-x, languages: [en, ru]}"],
            "data.source: languages ['ru'] are not in XGLUE 'paws-x'",
        ),
        (
            ["data.proxy.source={repo: some/corpus}"],
            "proxy.source.label_column: a classification task trains on proxy labels",
        ),
        (["data.task=mlm", "data.proxy.source={repo: a/b, data_files: x.parquet}"], "set exactly one of repo"),
        (
            ["data.task=mlm", "data.proxy.source={repo: a/b}", "data.proxy.servers=[root, west]"],
            "proxy.servers: only the root can hold a proxy corpus without languages",
        ),
        (["data.sizes={distribution: zipf}"], "data.sizes.distribution: Input should be 'lognormal' or 'powerlaw'"),
        (
            ["data.source={kind: xglue, languages: [en, de, fr], pool_split: validation.de}", "tree.groups={}"],
            "data.source: pool_split: 'validation.de' has no {lang}, so languages ['de', 'fr'] would all draw",
        ),
        (
            ["data.source={kind: xglue, languages: [en, de], train_languages: [en, de]}", "tree.groups={}"],
            "data.source: train_split: 'train' has no {lang}, so languages ['en', 'de'] would all draw",
        ),
        (
            ["data.source.languages=[en, xx, de]", "tree.groups={}"],
            "data.source.languages: the embedded corpus has no language ['xx'] (it has ['de', 'en', 'es', 'fr', 'ru'])",
        ),
        (["model.truncation=middle"], "model.truncation"),
    ],
)
def test_data_config_errors_name_the_key(overrides, message):
    from bhfl_core.config.base import ConfigError

    with pytest.raises(ConfigError) as err:
        small_config(*overrides)
    assert message in str(err.value)


def test_the_config_knows_the_embedded_corpus_languages():
    from bhfl_core.config.data import EMBEDDED_LANGUAGES
    from data_prep.embedded import _SYLLABLES

    assert sorted(_SYLLABLES) == list(EMBEDDED_LANGUAGES)


def test_several_edges_per_language_keep_languages_under_their_groups():
    cfg = small_config("data.clustering={edges_per_language: 2}", "tree.edge.cohort=1")
    tree = build_tree(cfg, placeholder_clients(cfg))
    assert tree["west"].children == ("edge-en-0", "edge-en-1", "edge-fr-0", "edge-fr-1")
    assert tree["edge-en-0"].children == ("en-00", "en-01") and tree["edge-en-1"].children == ("en-02",)
    assert tree["edge-en-1"].group == "en"


def _draw_row_by_row(rng, by_label, q, size):
    """The rule ``_draw_labels`` vectorises, as partition_pool ran it before: a label per row, then its last row."""
    taken = []
    for _ in range(size):
        available = np.array([len(b) > 0 for b in by_label])
        weights = q * available
        if weights.sum() <= 0:
            weights = available.astype(float)
        label = int(rng.choice(len(q), p=weights / weights.sum()))
        taken.append(by_label[label].pop())
    return taken


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(0, 12), min_size=2, max_size=10),
    concentration=st.sampled_from([0.001, 0.05, 1.0, 20.0]),
    zeros=st.lists(st.booleans(), min_size=10, max_size=10),
    fill=st.floats(0.1, 1.0),
    seed=st.integers(0, 10**6),
)
def test_vectorised_label_draws_are_the_row_by_row_draws(counts, concentration, zeros, fill, seed):
    """Same rows, same order, same generator state after: labels running out, q zero on every label left."""
    from data_prep.partition import _draw_labels

    k = len(counts)
    size = int(fill * sum(counts))
    assume(size >= 1)
    q = np.random.default_rng(seed).dirichlet(np.full(k, concentration)) * ~np.array(zeros[:k])
    stacks = [list(range(100 * c, 100 * c + n)) for c, n in enumerate(counts)]
    row_by_row, vectorised = np.random.default_rng(seed + 1), np.random.default_rng(seed + 1)
    expected = _draw_row_by_row(row_by_row, [list(s) for s in stacks], q, size)
    left = np.array(counts, dtype=np.int64)
    labels = _draw_labels(vectorised, left, q, size)
    rank = [int((labels[:i] == label).sum()) for i, label in enumerate(labels)]  # earlier draws of the same label
    assert [stacks[label][counts[label] - 1 - r] for label, r in zip(labels, rank)] == expected
    assert left.tolist() == [n - int((labels == c).sum()) for c, n in enumerate(counts)]
    assert vectorised.random() == row_by_row.random()
