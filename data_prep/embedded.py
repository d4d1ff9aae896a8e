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

from dataclasses import dataclass

import numpy as np
from datasets import ClassLabel, Dataset, Features, Value

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
    """``size`` documents of one language, labels drawn from the language prior."""
    lm = language_model(seed, language)
    cues, neutral = _shared_vocab(seed)
    rng = generator(seed, "embedded", "documents", language)
    k = len(CATEGORIES)
    labels = rng.choice(k, size=size, p=lm.prior)
    title_len = rng.integers(4, 9, size=size)
    body_len = rng.integers(20, 41, size=size)
    doc_len = title_len + body_len
    token_label = np.repeat(labels, doc_len)
    n = len(token_label)

    # Each token is a shared cue (18%), a language topic word (12%), a shared neutral
    # word (15%) or language filler (55%); cues and topics point at the document's
    # label with probability cue_strength / topic_strength, else at a random category.
    kind = rng.random(n)
    noisy = rng.integers(k, size=n)
    cue_slot = np.where(rng.random(n) < cue_strength, lm.cue_slot_of_category[token_label], noisy)
    topic = np.where(rng.random(n) < topic_strength, token_label, noisy)
    pick = rng.integers(1 << 30, size=n)
    cue_table = np.array(cues, dtype=object)
    topic_table = np.array(lm.topics, dtype=object)
    tokens = np.where(
        kind < 0.18,
        cue_table[cue_slot, pick % cue_table.shape[1]],
        np.where(
            kind < 0.30,
            topic_table[topic, pick % topic_table.shape[1]],
            np.where(
                kind < 0.45,
                np.array(neutral, dtype=object)[pick % len(neutral)],
                np.array(lm.filler, dtype=object)[pick % len(lm.filler)],
            ),
        ),
    )

    titles, bodies = [], []
    ends = np.cumsum(doc_len)
    for end, length, t_len in zip(ends, doc_len, title_len):
        doc = tokens[end - length : end]
        titles.append(" ".join(doc[:t_len]))
        bodies.append(" ".join(doc[t_len:]))
    return Dataset.from_dict(
        {"news_title": titles, "news_body": bodies, "news_category": labels.tolist(), "language": [language] * size},
        features=FEATURES,
    )
