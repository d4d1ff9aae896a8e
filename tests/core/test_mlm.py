"""Masked LM: BERT's 80/10/10 masking and the grouped masked-token NLL statistics."""

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM

from bhfl_core.algorithm.tree import TrainParams
from bhfl_core.learning.local_train import train_model
from bhfl_core.learning.mlm import IGNORE_INDEX, MaskingSpec, grouped_lm_stats, mask_tokens, mlm_transform

SPECIAL = (0, 1, 2, 3, 4)  # pad, unk, cls, sep, mask
MASK, VOCAB = 4, 60


def _table(rows=9, width=14, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (rows, width), generator=g)
    lengths = torch.randint(4, width + 1, (rows,), generator=g)
    attention = (torch.arange(width)[None, :] < lengths[:, None]).long()
    ids[:, 0] = 2
    ids[torch.arange(rows), lengths - 1] = 3
    ids[attention == 0] = 0
    return {"input_ids": ids, "attention_mask": attention, "token_type_ids": torch.zeros_like(ids)}


def test_bert_rule_80_10_10_never_specials_or_padding():
    data = _table(rows=400, width=64, seed=1)
    ids, attention = data["input_ids"], data["attention_mask"]
    masked, labels = mask_tokens(ids, attention, SPECIAL, MASK, VOCAB, 0.15, torch.Generator().manual_seed(3))
    chosen = labels != IGNORE_INDEX
    maskable = (attention == 1) & ~torch.isin(ids, torch.tensor(SPECIAL))
    assert not bool((chosen & ~maskable).any())  # specials and padding are never targets
    assert torch.equal(labels[chosen], ids[chosen]) and torch.equal(masked[~chosen], ids[~chosen])
    share = chosen.sum() / maskable.sum()
    assert abs(float(share) - 0.15) < 0.01
    n = int(chosen.sum())
    to_mask = int((masked[chosen] == MASK).sum())
    unchanged = int((masked[chosen] == ids[chosen]).sum())
    # 80% [MASK]; 10% kept; 10% random (a random token equals the original 1/60 of the time)
    assert abs(to_mask / n - 0.8) < 0.03 and abs(unchanged / n - (0.1 + 0.1 / VOCAB)) < 0.025
    again = mask_tokens(ids, attention, SPECIAL, MASK, VOCAB, 0.15, torch.Generator().manual_seed(3))
    assert torch.equal(again[0], masked) and torch.equal(again[1], labels)  # the generator decides everything


def test_every_row_with_real_tokens_gets_a_target():
    data = _table(rows=50, width=6, seed=2)  # short rows: at 1% many would draw nothing
    _, labels = mask_tokens(
        data["input_ids"], data["attention_mask"], SPECIAL, MASK, VOCAB, 0.01, torch.Generator().manual_seed(0)
    )
    assert ((labels != IGNORE_INDEX).sum(dim=1) >= 1).all()


def _model(seed=0):
    torch.manual_seed(seed)
    return BertForMaskedLM(
        BertConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=64,
        )
    ).eval()


def _reference(model, data, groups, num_groups, seed, spec):
    """Full logits over the padded table, masked positions summed by hand."""
    masked, labels = mask_tokens(
        data["input_ids"],
        data["attention_mask"],
        spec.special_ids,
        spec.mask_token_id,
        spec.vocab_size,
        spec.probability,
        torch.Generator().manual_seed(seed),
    )
    with torch.no_grad():
        logp = torch.log_softmax(
            model(
                input_ids=masked, attention_mask=data["attention_mask"], token_type_ids=data["token_type_ids"]
            ).logits.double(),
            dim=-1,
        )
    out = torch.zeros(num_groups, 2, dtype=torch.float64)
    for r in range(len(masked)):
        for t in range(masked.shape[1]):
            if labels[r, t] != IGNORE_INDEX:
                out[groups[r], 0] -= logp[r, t, labels[r, t]]
                out[groups[r], 1] += 1
    return out


def test_grouped_lm_stats_match_a_hand_sum_and_add_up():
    spec = MaskingSpec(SPECIAL, MASK, VOCAB, 0.3)
    data = _table(rows=11, width=14, seed=4)
    groups = torch.tensor([0, 0, 1, 2, 1, 0, 2, 2, 1, 0, 1])
    model = _model()
    stats = grouped_lm_stats(model, data, groups, 3, 4, torch.device("cpu"), seed=9, masking=spec)
    assert stats.dtype == torch.float64 and stats.shape == (3, 2)
    assert torch.allclose(stats, _reference(model, data, groups, 3, 9, spec), atol=1e-4)
    # the batch size changes nothing (masks are drawn once for the whole table)
    assert torch.allclose(
        stats, grouped_lm_stats(model, data, groups, 3, 32, torch.device("cpu"), 9, masking=spec), atol=1e-5
    )
    # one group per row sums to the grouped stats: unions are sums
    per_row = grouped_lm_stats(model, data, torch.arange(11), 11, 4, torch.device("cpu"), 9, masking=spec)
    summed = torch.zeros(3, 2, dtype=torch.float64).index_add_(0, groups, per_row)
    assert torch.allclose(summed, stats, atol=1e-6)
    assert not torch.equal(stats, grouped_lm_stats(model, data, groups, 3, 4, torch.device("cpu"), 10, masking=spec))
    # an untrained model is about as perplexed as the vocabulary is large
    assert 0.5 * VOCAB < float(torch.exp(stats[:, 0].sum() / stats[:, 1].sum())) < 2 * VOCAB


@pytest.mark.integration
def test_mlm_training_through_the_transform_hook_lowers_the_loss():
    spec = MaskingSpec(SPECIAL, MASK, VOCAB, 0.15)
    data = _table(rows=64, width=12, seed=5)
    data["input_ids"][:, 1:] = torch.where(
        data["attention_mask"][:, 1:] == 1, 7 + (torch.arange(11) % 3), 0
    )  # learnable
    data["input_ids"][torch.arange(64), data["attention_mask"].sum(1) - 1] = 3
    model = _model(1)
    groups = torch.zeros(64, dtype=torch.int64)
    before = grouped_lm_stats(model, data, groups, 1, 64, torch.device("cpu"), 0, masking=spec)
    train_model(
        model,
        data,
        TrainParams(lr=0.01, epochs=8, batch_size=16),
        seed=0,
        device=torch.device("cpu"),
        transform=mlm_transform(spec),
    )
    after = grouped_lm_stats(model, data, groups, 1, 64, torch.device("cpu"), 0, masking=spec)
    assert float(after[0, 0] / after[0, 1]) < 0.5 * float(before[0, 0] / before[0, 1])
