"""TRAIN's loop leaves the GPU alone between steps: losses read once at the end, masks of ones left out; same bits."""

import torch

from bhfl_core.algorithm.tree import TrainParams
from bhfl_core.learning import local_train
from bhfl_core.learning.local_train import train_model
from bhfl_core.learning.params import get_flat, set_flat
from tests.core.test_fedprox import CPU, _tiny_bert


def test_a_mask_of_ones_is_left_out_and_the_loss_is_the_same_sum_read_once():
    params = TrainParams(lr=3e-2, epochs=2, batch_size=8)
    model, data = _tiny_bert()
    data["attention_mask"] = torch.ones_like(data["attention_mask"])  # no padding: every batch's mask is all ones
    start = get_flat(model)

    # the loop as it was: the mask passed to the model, each batch's loss read as it comes
    n, generator = 40, torch.Generator().manual_seed(5)
    torch.manual_seed(5)
    optimizer, model_losses = local_train._optimizer(model, params), []
    model.train()
    for _ in range(params.epochs):
        for batch in local_train._batches(data, torch.randperm(n, generator=generator), params.batch_size):
            out = model(**batch)
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            model_losses.append((float(out.loss.detach()), len(batch["labels"])))
    reference = get_flat(model)
    want = sum(loss * size for loss, size in model_losses) / sum(size for _, size in model_losses)

    for columns in (data, {k: v for k, v in data.items() if k != "attention_mask"}):
        set_flat(model, start)
        result = train_model(model, columns, params, seed=5, device=CPU)
        assert torch.equal(get_flat(model), reference)
        assert result.loss == want and result.steps == 10 and result.examples == 80


def test_only_a_mask_of_ones_is_left_out():
    padded = {"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]])}
    assert set(local_train._to_device(padded, CPU)) == {"input_ids", "attention_mask"}
    full = {**padded, "attention_mask": torch.ones(2, 3, dtype=torch.long)}
    assert set(local_train._to_device(full, CPU)) == {"input_ids"}
