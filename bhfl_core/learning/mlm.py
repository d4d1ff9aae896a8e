"""Masked language modelling: BERT's token masking and grouped masked-token NLL.

``mask_tokens`` is the training-time corruption (BERT's 80/10/10 rule), plugged into
``local_train.train_model`` through its ``transform`` hook, so TRAIN is the same loop
for classification and MLM. ``grouped_lm_stats`` is the MLM counterpart of
``local_train.grouped_confusions``: per test group it returns *sums* (masked-token
NLL, masked-token count), which add up over unions of groups exactly like confusion
matrices do; loss = sum / count and perplexity = exp(loss) are computed from them.

Evaluation masks are drawn once from ``seed`` over the whole table (``with_eval_masks``,
once per run), so every model scored on the same table with the same seed, on all of it
or on some clients' rows, sees the same masked positions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from bhfl_core.learning.local_train import BatchTransform

IGNORE_INDEX = -100  # transformers' cross-entropy ignore index


@dataclass(frozen=True)
class MaskingSpec:
    """What masking needs to know about the tokenizer, and the masking rate."""

    special_ids: tuple[int, ...]
    mask_token_id: int
    vocab_size: int
    probability: float = 0.15


def mask_tokens(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    special_ids: Iterable[int],
    mask_token_id: int,
    vocab_size: int,
    probability: float,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(masked_input_ids, labels)`` under BERT's rule; ``labels`` is -100 where not masked.

    Each real (attended, non-special) token is selected with ``probability``; a
    selected token becomes the mask token 80% of the time, a uniformly random token
    10%, and stays unchanged 10%. A row with maskable tokens but no selected one gets
    one selected uniformly at random: short sequences would otherwise give batches
    with no target at all, whose mean loss is 0/0 = NaN and would poison the weights.
    """
    ids = input_ids.clone()
    maskable = ~torch.isin(ids, torch.tensor(sorted(set(special_ids)), dtype=ids.dtype))
    if attention_mask is not None:
        maskable &= attention_mask.bool()
    chosen = (torch.rand(ids.shape, generator=generator) < probability) & maskable
    empty = maskable.any(dim=1) & ~chosen.any(dim=1)
    if bool(empty.any()):
        # one uniformly random maskable position per empty row: argmax of noise over maskable slots
        noise = torch.rand(ids.shape, generator=generator).masked_fill(~maskable, -1.0)
        pick = torch.zeros_like(chosen)
        pick[torch.arange(len(ids)), noise.argmax(dim=1)] = True
        chosen |= pick & empty[:, None]
    labels = torch.where(chosen, ids, torch.full_like(ids, IGNORE_INDEX))
    action = torch.rand(ids.shape, generator=generator)
    to_mask = chosen & (action < 0.8)
    to_random = chosen & (action >= 0.8) & (action < 0.9)
    ids[to_mask] = mask_token_id
    random_ids = torch.randint(vocab_size, ids.shape, generator=generator, dtype=ids.dtype)
    ids[to_random] = random_ids[to_random]
    return ids, labels


def mlm_transform(spec: MaskingSpec) -> BatchTransform:
    """A ``train_model`` transform that masks each batch with the training generator."""

    def transform(batch: dict[str, torch.Tensor], generator: torch.Generator) -> dict[str, torch.Tensor]:
        ids, labels = mask_tokens(
            batch["input_ids"],
            batch.get("attention_mask"),
            spec.special_ids,
            spec.mask_token_id,
            spec.vocab_size,
            spec.probability,
            generator,
        )
        return {**{k: v for k, v in batch.items() if k != "labels"}, "input_ids": ids, "labels": labels}

    return transform


def _masked_logits(model: nn.Module, inputs: dict[str, torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
    """Logits at the masked ``positions`` only, shape ``(masked tokens, vocab)``.

    The vocabulary projection of a hub model (e.g. 119k tokens for mBERT) over every
    position of a batch would be batch x length x vocab floats; gathering the hidden
    states of the masked positions just before the projection (a forward pre-hook on
    the output embeddings) makes it masked tokens x vocab. Models without output
    embeddings fall back to the full logits.
    """
    output_embeddings = getattr(model, "get_output_embeddings", None)
    head: nn.Module | None = output_embeddings() if output_embeddings is not None else None
    if head is None:
        logits: torch.Tensor = model(**inputs).logits
        return logits[positions]

    def gather(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return (args[0][positions], *args[1:])

    handle = head.register_forward_pre_hook(gather)
    try:
        masked: torch.Tensor = model(**inputs).logits
        return masked
    finally:
        handle.remove()


MASK_TARGETS = "mlm_targets"  # a prepared table's column: each position's target id, IGNORE_INDEX where unmasked


def with_eval_masks(data: Mapping[str, torch.Tensor], seed: int, masking: MaskingSpec) -> dict[str, torch.Tensor]:
    """``data`` with its evaluation masks applied: ``input_ids`` masked, ``MASK_TARGETS`` the original ids there.

    Drawn once from ``seed`` over the whole table, so a slice of the result (the clients a
    model is scored on) carries exactly the masks those rows have in the whole table.
    """
    gen = torch.Generator().manual_seed(seed)
    masked_ids, targets = mask_tokens(
        data["input_ids"],
        data.get("attention_mask"),
        masking.special_ids,
        masking.mask_token_id,
        masking.vocab_size,
        masking.probability,
        gen,
    )
    return {**data, "input_ids": masked_ids, MASK_TARGETS: targets}


@torch.no_grad()
def grouped_lm_stats(
    model: nn.Module,
    data: Mapping[str, torch.Tensor],
    groups: torch.Tensor,
    num_groups: int,
    batch_size: int,
    device: torch.device,
    seed: int,
    *,
    masking: MaskingSpec,
) -> torch.Tensor:
    """``stats[group] = [summed NLL over masked tokens, number of masked tokens]`` (float64).

    Masked positions are drawn once from ``seed`` for the whole table (so they do not
    depend on the batch size or on which model is scored), unless the table carries them
    already (``with_eval_masks``: prepared once per run, sliced to a model's clients);
    rows are batched sorted by length, like ``grouped_confusions``. A ``labels`` column in
    ``data`` (class labels) is ignored.
    """
    from bhfl_core.learning.local_train import widened

    model.eval()
    if MASK_TARGETS not in data:
        data = with_eval_masks(data, seed, masking)
    targets = data[MASK_TARGETS]
    lengths = data["attention_mask"].sum(dim=1) if "attention_mask" in data else torch.zeros(len(groups))
    order = torch.argsort(lengths, stable=True)
    stats = torch.zeros(num_groups, 2, dtype=torch.float64)
    inputs_all = {k: v for k, v in data.items() if k not in ("labels", MASK_TARGETS)}
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        batch = widened({k: v[idx] for k, v in inputs_all.items()})
        target = targets[idx].long()
        if "attention_mask" in batch:
            width = int(batch["attention_mask"].sum(dim=1).max())
            batch = {k: v[:, :width] for k, v in batch.items()}
            target = target[:, :width]
        positions = target != IGNORE_INDEX
        if not bool(positions.any()):
            continue
        logits = _masked_logits(model, {k: v.to(device) for k, v in batch.items()}, positions.to(device))
        logp = torch.log_softmax(logits.float(), dim=-1)
        nll = -logp.gather(1, target[positions].to(device)[:, None]).squeeze(1).to(torch.float64).cpu()
        row_group = groups[idx][:, None].expand_as(target)[positions]
        # the batch's groups only (a bincount over every group would allocate and add the whole table once a
        # batch: 10,000 clients, ~2,000 batches); bincount adds each bin's weights in row order either way, and
        # adding 0.0 to the groups left out changed no bit, so the sums are the same
        seen, slot = torch.unique(row_group, return_inverse=True)
        stats[seen, 0] += torch.bincount(slot, weights=nll, minlength=len(seen))
        stats[seen, 1] += torch.bincount(slot, minlength=len(seen)).to(torch.float64)
    return stats
