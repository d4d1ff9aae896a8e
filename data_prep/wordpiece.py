"""A WordPiece vocabulary that is a function of the training text alone.

Why not ``tokenizers.trainers.WordPieceTrainer``: its BPE trainer breaks ties between
equally frequent merges by token id (``Merge::cmp``: count, then the pair's ids), and
it gives the continuing-subword tokens (``##x``) their ids in the iteration order of a
Rust ``HashMap`` of the words, whose keys are drawn at random in every process. So
two trainings on the same text merge tied pairs in different orders and keep
different intermediate subwords: on the default experiment's proxy text, 10 of 160
fresh processes got ``##ma``/``kima`` instead of ``##abu``/``##mabu`` (same size,
every later id shifted), with or without ``TOKENIZERS_PARALLELISM``, on one core or
two, whatever ``PYTHONHASHSEED`` (measured: docs/data.md; upstream
huggingface/tokenizers#1794, fix proposed in #2066). Sorting ids afterwards cannot
repair a different *set* of tokens.

This module runs the same algorithm (byte-pair merges over pre-tokenised words,
WordPiece's ``##`` prefix for a piece that continues a word) with every order fixed:

1. **Word counts** are a multiset of the words the tokenizer's own normaliser and
   pre-tokeniser produce: integer sums, independent of the order texts come in.
2. **Initial tokens**: the special tokens (given order), every character of the
   words sorted by code point, then ``##`` + every character seen after a word's
   first position, sorted. Their ids are their positions: a function of the set.
3. **Each merge** takes the pair with the highest count; among equal counts the
   smallest ``(left id, right id)`` — the library's tie rule, on ids that are now
   fixed. A merged token gets the next id (or its existing one when the string is
   already a token), so every id is a function of the merges before it. The merge
   is applied to *every* occurrence (left to right, non-overlapping; the library
   merges only in the words its heap entry lists, one more place where push order,
   a hash map's, decides) and the pair counts are updated exactly, so the state
   after each merge is a function of the state before it. The heap holds ``(-count, left id, right id)`` entries: tuples
   in a total order, so whatever its internal layout, a pop returns the one entry
   that order puts first; an entry whose count is no longer the pair's current
   count is skipped, and every count change pushes a fresh entry, so the first
   valid pop is the true maximum.
4. **Stop** when the vocabulary has ``vocab_size`` tokens or no pair is left.

By induction the token list is a function of the word multiset, hence of the text;
nothing iterates a hash-ordered collection of strings, and nothing runs in
parallel. The result is loaded into a ``tokenizers`` WordPiece model
(data_prep/tokenizer.py), so encoding stays the library's.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from itertools import pairwise
from typing import Any

PREFIX = "##"


def word_counts(texts: Iterable[str], normalizer: Any, pre_tokenizer: Any) -> Counter[str]:
    """How often each pre-tokenised word occurs (what ``Tokenizer.train`` feeds its trainer)."""
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(word for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text)))
    return counts


def _merge(seq: list[int], left: int, right: int, new: int) -> list[int]:
    """``seq`` with every ``left right`` replaced by ``new``, left to right, non-overlapping."""
    out: list[int] = []
    i = 0
    while i < len(seq):
        if i + 1 < len(seq) and seq[i] == left and seq[i + 1] == right:
            out.append(new)
            i += 2
        else:
            out.append(seq[i])
            i += 1
    return out


def learn_vocabulary(counts: Mapping[str, int], vocab_size: int, special_tokens: Sequence[str]) -> list[str]:
    """The vocabulary in the order it was built: special tokens, characters, ``##`` characters, merges."""
    words = sorted(counts)
    tokens = list(dict.fromkeys(special_tokens))
    tokens += sorted({c for w in words for c in w} - set(tokens))
    tokens += [PREFIX + c for c in sorted({c for w in words for c in w[1:]})]
    ids = {t: i for i, t in enumerate(tokens)}
    seqs = [[ids[w[0]], *(ids[PREFIX + c] for c in w[1:])] for w in words if w]
    weights = [counts[w] for w in words if w]

    pair_count: Counter[tuple[int, int]] = Counter()
    where: defaultdict[tuple[int, int], set[int]] = defaultdict(set)  # words that may hold the pair
    for i, seq in enumerate(seqs):
        for pair in pairwise(seq):
            pair_count[pair] += weights[i]
            where[pair].add(i)
    heap = [(-n, a, b) for (a, b), n in pair_count.items()]
    heapq.heapify(heap)

    while len(tokens) < vocab_size and heap:
        neg, a, b = heapq.heappop(heap)
        if pair_count.get((a, b)) != -neg:
            continue  # stale: the pair's count changed since this entry was pushed
        text = tokens[a] + tokens[b].removeprefix(PREFIX)  # the right piece always continues a word
        if text not in ids:
            ids[text] = len(tokens)
            tokens.append(text)
        new = ids[text]
        changed: set[tuple[int, int]] = set()
        for i in sorted(where.pop((a, b))):
            old = seqs[i]
            seq = _merge(old, a, b, new)
            if seq == old:
                continue
            for pair in pairwise(old):
                pair_count[pair] -= weights[i]
                changed.add(pair)
            for pair in pairwise(seq):
                pair_count[pair] += weights[i]
                where[pair].add(i)
                changed.add(pair)
            seqs[i] = seq
        for pair in sorted(changed):
            if pair_count[pair] > 0:
                heapq.heappush(heap, (-pair_count[pair], *pair))
            else:
                del pair_count[pair]
    return tokens
