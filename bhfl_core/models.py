"""Model construction through the transformers Auto* API.

``tiny-bert`` builds a small BERT from a config (no download) sized by the config;
any other name goes through ``AutoModelForSequenceClassification.from_pretrained``,
so switching to ``bert-base-multilingual-cased`` is a config change.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForSequenceClassification, BertConfig

from bhfl_core.config import ModelConfig

TINY = "tiny-bert"


def build_classifier(model: ModelConfig, labels: list[str], vocab_size: int, pad_token_id: int, seed: int) -> nn.Module:
    """A sequence classifier; weights initialised from ``seed`` (tiny) or the checkpoint (hub)."""
    id2label = dict(enumerate(labels))
    label2id = {name: i for i, name in id2label.items()}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if model.name == TINY:
            t = model.tiny
            config = BertConfig(
                vocab_size=vocab_size, hidden_size=t.hidden_size, num_hidden_layers=t.num_hidden_layers,
                num_attention_heads=t.num_attention_heads, intermediate_size=t.intermediate_size,
                max_position_embeddings=max(64, model.max_length), hidden_dropout_prob=t.dropout,
                attention_probs_dropout_prob=t.dropout, pad_token_id=pad_token_id,
                num_labels=len(labels), id2label=id2label, label2id=label2id,
            )
            return AutoModelForSequenceClassification.from_config(config)
        return AutoModelForSequenceClassification.from_pretrained(
            model.name, num_labels=len(labels), id2label=id2label, label2id=label2id
        )
