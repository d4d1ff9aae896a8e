"""The WordPiece vocabulary learner (data_prep/wordpiece.py): BPE merges with every order fixed.

The cross-process check that the whole prepared folder is the same bytes from any
fresh run is tests/data/test_reproducible_prepare.py; here, the algorithm itself.
"""

import random

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import normalizers, pre_tokenizers

from data_prep.wordpiece import learn_vocabulary, word_counts


def test_ties_break_by_ids_fixed_from_the_text():
    # every pair of "abcd" occurs once: a tie at each step. Ids: a b c d (sorted), then ##b ##c ##d (sorted);
    # (a, ##b) has the smallest ids, then (##c, ##d) beats (ab, ##c) because ab is newer than ##c.
    assert learn_vocabulary({"abcd": 1}, 100, []) == ["a", "b", "c", "d", "##b", "##c", "##d", "ab", "##cd", "abcd"]


def test_the_most_frequent_pair_is_merged_first_until_the_vocabulary_is_full():
    counts = {"cd": 3, "ab": 2, "x": 1}
    base = ["[PAD]", "a", "b", "c", "d", "x", "##b", "##d"]
    assert learn_vocabulary(counts, len(base) + 1, ["[PAD]"]) == [*base, "cd"]
    assert learn_vocabulary(counts, 100, ["[PAD]"]) == [*base, "cd", "ab"]  # no pair left: stops short


def test_every_occurrence_is_merged_left_to_right_without_overlap():
    # (##a, ##a) occurs twice in "baaa" (overlapping): merged once, at the left -> b ##aa ##a
    assert learn_vocabulary({"baaa": 1}, 100, []) == ["a", "b", "##a", "##aa", "baa", "baaa"]


def test_word_counts_use_the_tokenizers_own_normaliser_and_pre_tokeniser():
    normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=False, handle_chinese_chars=True)
    counts = word_counts(["Hello, world!", "hello Wörld"], normalizer, pre_tokenizers.BertPreTokenizer())
    assert counts == {"hello": 2, ",": 1, "world": 1, "!": 1, "wörld": 1}


words = st.text(alphabet="abcdef", min_size=1, max_size=7)


@settings(max_examples=60, deadline=None)
@given(counts=st.dictionaries(words, st.integers(1, 3), min_size=1, max_size=40), size=st.integers(0, 120))
def test_vocabulary_is_a_function_of_the_word_counts(counts, size):
    """Small alphabet, small counts: ties everywhere (tokenizers' own trainer draws a new vocabulary per process)."""
    full = learn_vocabulary(counts, 10**6, ["[UNK]"])
    assert len(full) == len(set(full)) and full[0] == "[UNK]"
    assert set(counts) <= set(full)  # without a cut, merging goes on until every word is one token
    initial = len(learn_vocabulary(counts, 0, ["[UNK]"]))  # special tokens, characters, ## characters: always kept
    shuffled = list(counts.items())
    random.Random(size).shuffle(shuffled)
    # the same merges in the same order whatever order the words come in; a smaller vocabulary is a prefix
    assert learn_vocabulary(dict(shuffled), size, ["[UNK]"]) == full[: max(size, initial)]
