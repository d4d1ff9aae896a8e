"""The embedded offline corpus: generated multilingual news classification (XGLUE NC schema).

Rows have XGLUE NC's columns (``news_title``, ``news_body``, ``news_category`` as a
ClassLabel over XGLUE's 10 categories) plus ``language``. The generator is built so
that the language clusters *matter*, which is what B-HFL exploits:

- each language has its own vocabulary (pseudo-words from its own syllables) and
  its own category prior;
- some tokens are shared by all languages (neutral words: numbers, entity names);
- shared *cue* words mean different categories in different languages: cue slot j
  signals category ``perm_lang[j]``, so a cue that says "sports" in one language says
  "finance" in another. A single global model sees contradictory evidence; a
  per-language model does not;
- language-specific topic words carry a weaker, non-conflicting signal.

Everything derives from the seed: the same seed gives the same corpus, byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
from datasets import ClassLabel, Dataset, Features, Value
from datasets.table import InMemoryTable

from bhfl_core.rng import generator

CATEGORIES = (
    "foodanddrink",
    "sports",
    "travel",
    "finance",
    "lifestyle",
    "news",
    "entertainment",
    "health",
    "video",
    "autos",
)
FEATURES = Features(
    {
        "news_title": Value("string"),
        "news_body": Value("string"),
        "news_category": ClassLabel(names=list(CATEGORIES)),
        "language": Value("string"),
    }
)

_SYLLABLES = {
    "en": [
        "ba",
        "be",
        "bi",
        "bo",
        "bu",
        "da",
        "de",
        "di",
        "do",
        "ka",
        "ke",
        "ki",
        "ko",
        "la",
        "le",
        "li",
        "lo",
        "ma",
        "me",
        "mi",
        "mo",
        "na",
        "ne",
        "ni",
        "no",
        "ra",
        "re",
        "ri",
        "ro",
        "sa",
        "se",
        "si",
        "so",
        "ta",
        "te",
        "ti",
        "to",
        "wa",
        "we",
        "th",
        "sh",
    ],
    "de": [
        "ach",
        "bei",
        "dor",
        "ein",
        "fra",
        "gen",
        "hal",
        "kei",
        "lan",
        "mei",
        "nor",
        "rau",
        "sch",
        "ste",
        "tze",
        "ung",
        "ver",
        "wal",
        "zei",
        "ber",
        "dam",
        "fel",
        "gur",
        "hei",
    ],
    "es": [
        "ca",
        "ce",
        "ci",
        "co",
        "cu",
        "ga",
        "gue",
        "lla",
        "lle",
        "llo",
        "ña",
        "ñe",
        "ño",
        "pa",
        "pe",
        "pi",
        "po",
        "que",
        "qui",
        "ra",
        "rre",
        "ta",
        "to",
        "cha",
        "che",
        "cho",
        "za",
        "zo",
    ],
    "fr": [
        "eau",
        "oui",
        "gne",
        "ché",
        "lé",
        "mé",
        "rè",
        "tè",
        "ain",
        "ien",
        "eur",
        "oir",
        "ette",
        "que",
        "pou",
        "vou",
        "jou",
        "sou",
        "cœ",
        "bé",
        "dé",
        "fé",
        "gé",
    ],
    "ru": [
        "ба",
        "ва",
        "га",
        "да",
        "жи",
        "за",
        "ка",
        "ла",
        "ма",
        "на",
        "па",
        "ра",
        "са",
        "та",
        "фа",
        "ха",
        "ча",
        "ша",
        "щи",
        "бы",
        "вы",
        "ды",
        "мы",
        "ны",
        "ры",
        "сы",
        "ты",
        "ль",
        "ть",
    ],
}
_SHARED_SYLLABLES = ["xo", "zy", "qu", "vex", "tor", "ion", "ax", "ul", "ix", "oz"]
_NEUTRAL = [str(n) for n in (2019, 2020, 2021, 2022, 2023, 2024, 10, 12, 25, 100)]


@dataclass(frozen=True)
class LanguageModel:
    """The generative parameters of one language."""

    prior: np.ndarray  # category prior, shape (10,)
    filler: list[str]
    topics: list[list[str]]  # topic words per category
    cue_slot_of_category: np.ndarray  # category -> cue slot


def _words(rng: np.random.Generator, syllables: list[str], count: int, taken: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < count:
        word = "".join(rng.choice(syllables, size=int(rng.integers(2, 4))))
        if word not in taken:
            taken.add(word)
            out.append(word)
    return out


def _shared_vocab(seed: int) -> tuple[list[list[str]], list[str]]:
    rng = generator(seed, "embedded", "shared")
    taken: set[str] = set()
    cues = [_words(rng, _SHARED_SYLLABLES, 3, taken) for _ in CATEGORIES]  # 3 cue words per slot
    neutral = _NEUTRAL + _words(rng, _SHARED_SYLLABLES, 30, taken)
    return cues, neutral


def language_model(seed: int, language: str) -> LanguageModel:
    if language not in _SYLLABLES:
        raise ValueError(f"the embedded corpus has no language {language!r}; available: {sorted(_SYLLABLES)}")
    rng = generator(seed, "embedded", "language", language)
    taken: set[str] = set()
    syllables = _SYLLABLES[language]
    return LanguageModel(
        prior=rng.dirichlet(np.full(len(CATEGORIES), 1.5)),
        filler=_words(rng, syllables, 120, taken),
        topics=[_words(rng, syllables, 10, taken) for _ in CATEGORIES],
        cue_slot_of_category=rng.permutation(len(CATEGORIES)),
    )


def generate_pool(seed: int, language: str, size: int, cue_strength: float, topic_strength: float) -> Dataset:
    """``size`` documents of one language, labels drawn from the language prior.

    The draws are whole-pool arrays in a fixed order (labels, lengths, then one array
    per token-level decision), so the corpus is a function of (seed, language, size,
    strengths). Memory stays a few bytes per token: the token-level arrays are drawn
    in chunks (the same stream as one call: ``_draws``) and narrowed to int8 as they
    are drawn, words are 2-byte ids into one vocabulary table, and the texts are
    assembled as Arrow strings without a Python object per token (``_join_words``).
    """
    lm = language_model(seed, language)
    cues, neutral = _shared_vocab(seed)
    rng = generator(seed, "embedded", "documents", language)
    k = len(CATEGORIES)
    labels = rng.choice(k, size=size, p=lm.prior)
    title_len = rng.integers(4, 9, size=size)
    body_len = rng.integers(20, 41, size=size)
    doc_len = title_len + body_len
    token_label = np.repeat(labels.astype(np.int8), doc_len)
    n = len(token_label)

    # Each token is a shared cue (18%), a language topic word (12%), a shared neutral
    # word (15%) or language filler (55%); cues and topics point at the document's
    # label with probability cue_strength / topic_strength, else at a random category.
    kind = _draws(rng.random, n, lambda u: np.searchsorted(_KIND_EDGES, u, side="right"), np.int8)
    noisy = _draws(lambda m: rng.integers(k, size=m, dtype=np.int32), n, lambda v: v, np.int8)
    slot_of_category = lm.cue_slot_of_category.astype(np.int8)
    cue = _draws(rng.random, n, lambda u: u < cue_strength, np.bool_)
    cue_slot = np.where(cue, slot_of_category[token_label], noisy)
    del cue
    topic = np.where(_draws(rng.random, n, lambda u: u < topic_strength, np.bool_), token_label, noisy)
    del noisy, token_label
    # one table of every word: cue slots (a row each), topics (a row per category), neutral, filler
    tables = [np.array(t, dtype=object) for t in (cues, lm.topics, neutral, lm.filler)]
    widths = [t.shape[-1] for t in tables]
    starts = np.cumsum([0] + [t.size for t in tables])
    vocabulary = [str(w) for t in tables for w in t.ravel()]
    # pick % width for every width from one remainder (each width divides the lcm), and the word it picks
    lcm = math.lcm(*widths)
    pick = _draws(lambda m: rng.integers(1 << 30, size=m, dtype=np.int32), n, lambda v: v % lcm, _small(lcm))
    word = _choose_words(kind, cue_slot, topic, pick, starts, widths, _small(len(vocabulary)))
    del pick, kind, cue_slot, topic

    # a document is its title (first title_len tokens), then its body
    edges = np.zeros(n + 1, dtype=np.int8)  # +1 where a document starts, -1 where its body starts
    doc_start = np.cumsum(doc_len) - doc_len
    edges[doc_start] = 1
    edges[doc_start + title_len] = -1
    in_title = np.cumsum(edges[:-1], dtype=np.int8).astype(bool)
    del edges
    title_words, body_words = word[in_title], word[~in_title]
    del word, in_title
    titles = _join_words(vocabulary, title_words, np.cumsum(title_len))
    del title_words
    bodies = _join_words(vocabulary, body_words, np.cumsum(body_len))
    del body_words
    columns = [titles, bodies, pa.array(labels, pa.int64()), pa.array([language] * size, pa.string())]
    table = InMemoryTable(pa.Table.from_arrays(columns, schema=FEATURES.arrow_schema))
    # named by its arguments: without a fingerprint, datasets would pickle the whole table to hash it
    key = json.dumps(["embedded", seed, language, size, cue_strength, topic_strength])
    return Dataset(table, fingerprint=hashlib.sha256(key.encode()).hexdigest()[:16])


_KIND_EDGES = np.array([0.18, 0.30, 0.45])  # cue < 0.18 <= topic < 0.30 <= neutral < 0.45 <= filler
_CHUNK = 1 << 20  # draws per step of the chunked draws
_JOIN_CHUNK = 1 << 17  # tokens per step of the text assembly (its index arrays take 8 bytes per text byte)


def _choose_words(
    kind: np.ndarray,
    cue_slot: np.ndarray,
    topic: np.ndarray,
    pick: np.ndarray,
    starts: np.ndarray,
    widths: list[int],
    dtype: type[np.signedinteger],
) -> np.ndarray:
    """Each token's word id: row ``cue_slot`` of the cue table, ``topic`` of the topics, or neutral or filler."""
    word = np.empty(len(kind), dtype=dtype)
    for i in range(0, len(kind), _CHUNK):
        s = slice(i, i + _CHUNK)
        p, kd = pick[s].astype(np.int32), kind[s]
        word[s] = np.where(
            kd == 0,
            starts[0] + cue_slot[s].astype(np.int32) * widths[0] + p % widths[0],
            np.where(
                kd == 1,
                starts[1] + topic[s].astype(np.int32) * widths[1] + p % widths[1],
                np.where(kd == 2, starts[2] + p % widths[2], starts[3] + p % widths[3]),
            ),
        )
    return word


def _small(bound: int) -> type[np.signedinteger]:
    """The integer type for values below ``bound`` (2 bytes when they fit)."""
    return np.int16 if bound < 1 << 15 else np.int32


def _draws(draw: Callable[[int], np.ndarray], n: int, fn: Callable[[np.ndarray], np.ndarray], dtype) -> np.ndarray:
    """``fn`` of ``n`` draws, narrowed to ``dtype``, drawn a chunk at a time.

    ``draw(m)`` is ``rng.random(m)`` or ``rng.integers(high, size=m, dtype=np.int32)``
    with ``high`` < 2**32: drawn in chunks, both give the same stream as one call (numpy
    draws each double from one 64-bit output, and keeps the other half of a 64-bit
    output for the next 32-bit draw in the bit generator itself; the int32 dtype draws
    the same values as the default int64: tests/data/test_embedded.py), without an
    8-byte temporary per token.
    """
    out = np.empty(n, dtype=dtype)
    for i in range(0, n, _CHUNK):
        out[i : i + _CHUNK] = fn(draw(min(_CHUNK, n - i)))
    return out


def _join_words(vocabulary: list[str], word: np.ndarray, ends: np.ndarray) -> pa.StringArray:
    """The strings ``" ".join(vocabulary[w] for w in word[a:b])`` for consecutive ``[a, b)`` ending at ``ends``.

    Byte for byte what Python's join gives, built as one Arrow string array: each
    token is its word's UTF-8 bytes followed by a space, or without the space where a
    string ends, gathered by index from one table of both forms, a chunk of tokens at
    a time. Strings are non-empty. ``word`` is overwritten (with the form ids).
    """
    encoded = [w.encode() for w in vocabulary]
    forms = [w + b" " for w in encoded] + encoded  # id v: the word and a space; id V + v: the word alone
    form_len = np.array([len(f) for f in forms], dtype=np.int64)
    form_start = np.cumsum(form_len) - form_len
    form_bytes = np.frombuffer(b"".join(forms), dtype=np.uint8)
    form = word if len(forms) <= np.iinfo(word.dtype).max else word.astype(np.int32)
    form[ends - 1] += len(encoded)
    steps = range(0, len(form), _JOIN_CHUNK)
    data = np.empty(sum(int(form_len[form[i : i + _JOIN_CHUNK]].sum()) for i in steps), dtype=np.uint8)
    offsets = np.zeros(len(ends) + 1, dtype=np.int64)
    written = 0  # bytes written before the chunk
    for i in steps:
        f = form[i : i + _JOIN_CHUNK]
        length = form_len[f]
        token_end = np.cumsum(length)
        # byte j of the chunk is form_bytes[form_start[f] + j - (where its token starts in the chunk)]
        gather = np.repeat(form_start[f] - (token_end - length), length) + np.arange(int(token_end[-1]))
        data[written : written + len(gather)] = form_bytes[gather]
        here = slice(*np.searchsorted(ends, [i, i + len(f)], side="right"))  # the strings that end in the chunk
        offsets[1:][here] = written + token_end[ends[here] - 1 - i]
        written += len(gather)
    return pa.StringArray.from_buffers(len(ends), pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(data))
