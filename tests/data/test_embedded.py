"""The embedded corpus: XGLUE NC schema, determinism, and cluster structure that matters."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from bhfl_core.config.data import DataConfig, EmbeddedSource, ProxySpec, SizeDistribution
from data_prep.embedded import CATEGORIES, FEATURES, _shared_vocab, generate_pool, language_model
from data_prep.partition import partition_pool, pool_size_needed


def test_schema_and_determinism():
    a = generate_pool(3, "de", 50, 0.6, 0.25)
    b = generate_pool(3, "de", 50, 0.6, 0.25)
    assert a.features == FEATURES
    assert a.features["news_category"].names == list(CATEGORIES) and len(CATEGORIES) == 10
    assert a[:] == b[:]
    assert a[:] != generate_pool(4, "de", 50, 0.6, 0.25)[:]
    assert set(a["language"]) == {"de"}


def test_languages_have_own_vocabulary_priors_and_conflicting_cues():
    seed = 0
    models = {lang: language_model(seed, lang) for lang in ("en", "de", "es", "fr", "ru")}
    vocab = {lang: set(m.filler) | {w for t in m.topics for w in t} for lang, m in models.items()}
    assert all(not (vocab[a] & vocab[b]) for a in vocab for b in vocab if a < b)  # disjoint vocabularies
    priors = np.stack([m.prior for m in models.values()])
    assert np.abs(priors - priors.mean(0)).max() > 0.05  # category priors differ by language
    slots = np.stack([m.cue_slot_of_category for m in models.values()])
    # the same shared cue slot signals different categories in different languages
    assert any(len(set(slots[:, c])) > 1 for c in range(len(CATEGORIES)))
    cues, neutral = _shared_vocab(seed)
    docs = list(generate_pool(seed, "en", 200, 0.6, 0.25)["news_body"]) + list(
        generate_pool(seed, "ru", 200, 0.6, 0.25)["news_body"]
    )
    shared = {w for c in cues for w in c} | set(neutral)
    assert sum(any(w in shared for w in d.split()) for d in docs) == len(docs)  # shared tokens in every language


def test_cue_words_predict_labels_within_a_language_not_across():
    """A per-language cue->label lookup is accurate; the same lookup fails on another language."""
    seed = 0
    cues, _ = _shared_vocab(seed)
    slot_of_word = {w: s for s, words in enumerate(cues) for w in words}

    def cue_vote(text):
        counts = np.zeros(10)
        for w in text.split():
            if w in slot_of_word:
                counts[slot_of_word[w]] += 1
        return int(counts.argmax())

    def fit(rows):
        table = np.zeros((10, 10))
        for body, label in rows:
            table[cue_vote(body), label] += 1
        return table.argmax(1)

    def rows(lang):
        ds = generate_pool(seed, lang, 1200, 0.6, 0.25)
        return list(zip(ds["news_body"], ds["news_category"]))

    en, de = rows("en"), rows("de")
    en_map, de_map = fit(en[:800]), fit(de[:800])
    own = np.mean([en_map[cue_vote(b)] == y for b, y in en[800:]])  # held-out English documents
    cross = np.mean([de_map[cue_vote(b)] == y for b, y in en[800:]])  # German cue meanings on English
    assert own > 0.6 and cross < own - 0.3


def _spec(clients, alpha, median, sigma, min_size, proxy_train, proxy_test):
    return DataConfig(
        source=EmbeddedSource(languages=["en", "fr"]),
        clients_per_language=clients,
        dirichlet_alpha=alpha,
        sizes=SizeDistribution(median=median, sigma=sigma, min=min_size, max=400),
        test_fraction=0.2,
        proxy=ProxySpec(train_per_language=proxy_train, test_per_language=proxy_test),
    )


@settings(max_examples=25, deadline=None)
@given(
    clients=st.integers(1, 6),
    alpha=st.floats(0.05, 5.0),
    median=st.integers(5, 60),
    sigma=st.floats(0.0, 1.5),
    min_size=st.integers(2, 10),
    proxy_train=st.integers(0, 30),
    proxy_test=st.integers(0, 30),
    seed=st.integers(0, 10**6),
)
def test_partition_properties(clients, alpha, median, sigma, min_size, proxy_train, proxy_test, seed):
    spec = _spec(clients, alpha, median, sigma, min_size, proxy_train, proxy_test)
    rng = np.random.default_rng(seed)
    n = {lang: pool_size_needed(spec, seed, lang) + int(rng.integers(0, 20)) for lang in ("en", "fr")}
    languages = np.array(["en"] * n["en"] + ["fr"] * n["fr"])
    labels = rng.integers(0, 10, size=len(languages))
    part = partition_pool(labels, languages, spec, seed, 10)
    again = partition_pool(labels, languages, spec, seed, 10)
    assert part == again  # identical for the same seed
    used = part.proxy_train + part.proxy_test + [i for c in part.clients for i in c.train + c.test]
    assert len(used) == len(set(used))  # disjoint
    assert len(used) + part.unused == len(languages)  # covers the pool
    assert len(part.clients) == 2 * clients
    for c in part.clients:
        assert len(c.train) >= 1 and len(c.test) >= 1 and len(c.train) + len(c.test) >= min_size
        assert set(languages[c.train + c.test]) == {c.language}
    proxy_langs = languages[part.proxy_train]
    assert (proxy_langs == "en").sum() == (proxy_langs == "fr").sum() == proxy_train  # language-balanced


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=40),
    seed=st.integers(0, 1000),
    chunk=st.sampled_from([1, 3, 64, 1 << 17]),
)
def test_joined_words_are_pythons_join_byte_for_byte(lengths, seed, chunk):
    """The vectorised text assembly (Arrow strings from word ids) equals ``" ".join``, multi-byte words included."""
    from unittest import mock

    from data_prep import embedded

    vocabulary = ["a", "ber", "ña", "cœur", "щи", "2024", "xo", "ба́ра"]
    word = np.random.default_rng(seed).integers(len(vocabulary), size=sum(lengths)).astype(np.int32)
    ends = np.cumsum(lengths)
    with mock.patch.object(embedded, "_JOIN_CHUNK", chunk):  # chunks that cut strings anywhere
        joined = embedded._join_words(vocabulary, word.copy(), ends).to_pylist()  # (it overwrites the ids)
    assert joined == [" ".join(vocabulary[w] for w in word[e - n : e]) for e, n in zip(ends, lengths)]


def test_chunked_draws_are_one_call(monkeypatch):
    """generate_pool draws its token-level arrays in chunks: the stream it relies on is numpy's of one call."""
    from data_prep import embedded

    monkeypatch.setattr(embedded, "_CHUNK", 7)
    rng, reference = np.random.default_rng(5), np.random.default_rng(5)
    drawn = embedded._draws(rng.random, 50, lambda u: u < 0.3, np.bool_)
    assert drawn.tolist() == (reference.random(50) < 0.3).tolist()
    for high in (10, 1 << 30):  # int32 draws in chunks: the values of one default (int64) call
        chunked = embedded._draws(lambda m, h=high: rng.integers(h, size=m, dtype=np.int32), 51, lambda v: v, np.int64)
        assert chunked.tolist() == reference.integers(high, size=51).tolist()
    assert rng.random() == reference.random()
