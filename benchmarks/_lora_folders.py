"""Model folders in ``save_pretrained`` layout for benchmarks/lora_experiment.py: what a user who
downloaded BERT-base or XLM-R base has on disk, built here from configs (the hub cannot be reached).

The weights are random (config-built, seeded); the tokenizer is trained on the generated
multilingual corpus the experiment runs on (data_prep.embedded, the five default
languages): BERT's WordPiece for the BERT folder, a SentencePiece-style Unigram for the
XLM-R one. That corpus has about 2,200 distinct word pieces, so the tokenizer has that
many; the embedding matrix keeps the real checkpoint's rows (BERT-base's 30,522,
XLM-R base's 250,002; the rows above the tokenizer's ids are never looked up), so the
model has the real parameter count (109.5M and 278M with their heads): what full
fine-tuning sends, stores and holds in memory is BERT-base's and XLM-R's, and the encoder,
where the adapters sit, has the real dimensions. ``size="tiny"`` is a one-layer model with
the tokenizer's own vocabulary, for tests. The folder holds the encoder and a masked-LM
head, as a pretraining checkpoint does: ``bhfl run`` gives it a new classification head
from the seed.
"""

from __future__ import annotations

from pathlib import Path

LANGUAGES = ("en", "de", "es", "fr", "ru")
BASE = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072}
TINY = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}
VOCAB = {"bert": 30_522, "xlmr": 250_002}  # the real checkpoints' embedding rows


def corpus(documents_per_language: int = 400, seed: int = 0) -> list[str]:
    """Titles and bodies of the generated corpus (the embedded source's generator), all five languages."""
    from data_prep.embedded import generate_pool

    texts = []
    for language in LANGUAGES:
        pool = generate_pool(seed, language, documents_per_language, 0.6, 0.25)
        texts += [f"{title} {body}" for title, body in zip(pool["news_title"], pool["news_body"], strict=True)]
    return texts


def write_folder(architecture: str, size: str, folder: Path) -> int:
    """Write a ``bert`` or ``xlmr`` model of ``size`` (``base`` or ``tiny``) and its tokenizer; the tokenizer's size."""
    import torch

    dims = BASE if size == "base" else TINY
    vocab = 30_522 if size == "base" else 600  # the tokenizer's target: the corpus gives fewer
    rows = VOCAB.get(architecture, 0) if size == "base" else 0
    texts = corpus(400 if size == "base" else 100)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if architecture == "bert":
            return _bert(folder, texts, vocab, rows, dims)
        if architecture == "xlmr":
            return _xlmr(folder, texts, vocab, rows, dims)
    raise ValueError(f"architecture: {architecture!r} is not one of bert, xlmr")


def _bert(folder: Path, texts: list[str], vocab: int, rows: int, dims: dict[str, int]) -> int:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertForMaskedLM, BertTokenizerFast

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=False)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=vocab, special_tokens=special))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    keys = ("pad_token", "unk_token", "cls_token", "sep_token", "mask_token")
    BertTokenizerFast(tokenizer_object=tok, **dict(zip(keys, special, strict=True))).save_pretrained(folder)
    config = BertConfig(vocab_size=max(rows, tok.get_vocab_size()), max_position_embeddings=512, pad_token_id=0, **dims)
    BertForMaskedLM(config).save_pretrained(folder)
    return tok.get_vocab_size()


def _xlmr(folder: Path, texts: list[str], vocab: int, rows: int, dims: dict[str, int]) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import XLMRobertaConfig, XLMRobertaForMaskedLM, XLMRobertaTokenizerFast

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    special = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tok.train_from_iterator(texts, trainers.UnigramTrainer(vocab_size=vocab, special_tokens=special, unk_token="<unk>"))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    XLMRobertaTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", sep_token="</s>", cls_token="<s>",
        unk_token="<unk>", pad_token="<pad>", mask_token="<mask>",
    ).save_pretrained(folder)  # fmt: skip
    config = XLMRobertaConfig(
        vocab_size=max(rows, tok.get_vocab_size()), max_position_embeddings=514, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, **dims,
    )  # fmt: skip
    XLMRobertaForMaskedLM(config).save_pretrained(folder)
    return tok.get_vocab_size()
