"""Tokenizers: a WordPiece trained on public (proxy) text, or any hub/local tokenizer.

The tiny default model gets a WordPiece tokenizer trained on the root's proxy split
only (public data: training it on client text would leak private vocabulary). Its
vocabulary is learnt by data_prep/wordpiece.py, not by ``tokenizers``' trainer, whose
result depends on a per-process random hash order (that module says why and argues
the determinism); everything else is ``tokenizers``: the normaliser and pre-tokeniser
that split the training text, the WordPiece model, the post-processor and decoder.
It is saved and reloaded through ``PreTrainedTokenizerFast`` so the code path after
this point is the one a hub model takes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from bhfl_core.config.schema import ModelConfig
from bhfl_core.learning.models import ModelSourceError, hub_error
from data_prep.wordpiece import learn_vocabulary, word_counts

if TYPE_CHECKING:  # transformers (~1 s to import) only when a tokenizer is trained or loaded: not on a cache hit
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def train_wordpiece(texts: Iterable[str], vocab_size: int, max_length: int, out_dir: Path) -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast

    normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=False, handle_chinese_chars=True)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    vocab = learn_vocabulary(word_counts(texts, normalizer, pre_tokenizer), vocab_size, SPECIAL_TOKENS)
    tok = Tokenizer(_canonical(vocab))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))],
    )
    tok.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=max_length,
    )
    fast.save_pretrained(out_dir)
    # reload from disk: later runs (and hub models) take exactly this path
    return PreTrainedTokenizerFast.from_pretrained(str(out_dir))


def _canonical(vocab: Sequence[str]) -> models.WordPiece:
    """The vocabulary with ids in a fixed order: special tokens, then the rest sorted.

    Ids then depend on the set of tokens only, not on the order the learner added them
    in (the layout the tokenizers of earlier versions had, so id 0 stays ``[PAD]``).
    """
    ordered = SPECIAL_TOKENS + sorted(set(vocab) - set(SPECIAL_TOKENS))
    return models.WordPiece({t: i for i, t in enumerate(ordered)}, unk_token="[UNK]")


def load_tokenizer(name_or_dir: str | Path, revision: str | None = None) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(name_or_dir), revision=revision)


def hub_tokenizer(model: ModelConfig) -> PreTrainedTokenizerBase:
    """The tokenizer of a hub (or local-folder) model; a clear error when it cannot be loaded or is not the model's."""
    try:
        tokenizer = load_tokenizer(model.name, model.revision)
    except Exception as exc:  # OSError offline / not found: one paragraph, no stack trace
        raise hub_error("tokenizer", model, exc) from None
    _check_vocabulary(tokenizer, model)
    return tokenizer


PADDING_OFFSET_MODELS = ("roberta", "xlm-roberta", "camembert", "xlm-roberta-xl", "data2vec-text")
"""Model types whose position ids start after the padding index (``padding_idx + 1``): XLM-R's 514 rows hold 512."""


def _offset(config: object) -> bool:
    return getattr(config, "model_type", None) in PADDING_OFFSET_MODELS


def _usable_positions(config: object) -> int | None:
    """How many tokens a sequence may have for the model's position embeddings (None: the config does not say)."""
    positions = getattr(config, "max_position_embeddings", None)
    if not isinstance(positions, int):
        return None
    pad = getattr(config, "pad_token_id", None)
    return positions - (pad + 1) if _offset(config) and isinstance(pad, int) else positions


def _check_vocabulary(tokenizer: PreTrainedTokenizerBase, model: ModelConfig) -> None:
    """The tokenizer must have a vocabulary, and every id it gives (and position up to ``model.max_length``) must
    have a row in the model's embeddings.

    Both fail late otherwise: transformers builds a tokenizer of its special tokens alone
    from a folder without tokenizer files (every word becomes the unknown token: silently
    useless data), and an id past the model's ``vocab_size`` (or a sequence longer than
    its position embeddings) is an error in the first training step, after the whole
    preparation.
    """
    from transformers import AutoConfig

    size = len(tokenizer)
    if size <= len(set(tokenizer.all_special_ids)):
        raise ModelSourceError(
            f"model.name: the tokenizer of {model.name!r} has no vocabulary (its {size} tokens are its special "
            "tokens): the folder has no tokenizer files (tokenizer.json, vocab.txt, sentencepiece.bpe.model, ...); "
            "save the model's tokenizer into it (`tokenizer.save_pretrained(DIR)`)."
        )
    try:
        config = AutoConfig.from_pretrained(model.name, revision=model.revision)
    except Exception as exc:
        raise hub_error("model", model, exc) from None
    positions = _usable_positions(config)
    if positions is not None and model.max_length > positions:  # a shape error in the first forward pass
        offset = ", less its padding offset" if _offset(config) else ""
        raise ModelSourceError(
            f"model.max_length: {model.max_length} tokens, but {model.name!r} has position embeddings for "
            f"{positions} (max_position_embeddings in its config.json{offset})"
            f"; set model.max_length to at most {positions}."
        )
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and size > vocab:
        raise ModelSourceError(
            f"model.name: the tokenizer of {model.name!r} has {size} tokens but the model's vocabulary (vocab_size "
            f"in its config.json) has {vocab}: ids {vocab}..{size - 1} have no embedding. The tokenizer is not this "
            "model's: save the model's own tokenizer into the folder."
        )
