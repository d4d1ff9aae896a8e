"""Sample-level DP-SGD inside one TRAIN call, with Opacus's per-sample gradients and DP optimizer.

Opacus's ``PrivacyEngine.make_private`` wants to own the data loader; TRAIN draws its own
seeded Poisson batches (``local_train._poisson_batches``: Opacus's uniform sampler, each row
in each batch with chance ``batch_size / rows``), so this uses the two parts the engine is
made of: ``GradSampleModule`` (hooks that compute every example's gradient) and
``DPOptimizer`` (clips each example's gradient to ``max_grad_norm``, sums, adds Gaussian
noise of std ``noise_multiplier * max_grad_norm`` from a generator seeded by the call's
seed, divides by the expected batch size, then steps). The hooks are removed when the
call ends, so the worker's reused model is plain again for the next client.

Two things transformers models need under per-sample gradients: position and token-type
ids given per example (a broadcast ``[1, L]`` buffer would give their embeddings a
per-sample gradient of batch 1), which ``batch_ids`` adds.

Accounting: ``algorithm/privacy_accounting.py::sample_epsilon``.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from bhfl_core.algorithm.privacy_params import DpSgdParams

Batch = dict[str, torch.Tensor]

# Opacus's per-sample hooks sit on modules whose inputs (token ids) need no gradient; torch
# says so on every backward pass. It is how Opacus works, not a problem of the run.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with respect")


@contextmanager
def private_training(
    model: nn.Module, optimizer: torch.optim.Optimizer, params: DpSgdParams, batch_size: int, seed: int
) -> Iterator[tuple[nn.Module, torch.optim.Optimizer]]:
    """``(module, optimizer)`` to train with: per-sample gradients and the DP optimizer; hooks removed at the end."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    module = GradSampleModule(model)
    noise = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    private = DPOptimizer(
        optimizer,
        noise_multiplier=params.noise_multiplier,
        max_grad_norm=params.max_grad_norm,
        expected_batch_size=batch_size,
        generator=noise,
    )
    try:
        yield module, private
    finally:
        module._close()  # removes the hooks and the per-sample gradients


def noise_only_step(optimizer: torch.optim.Optimizer) -> None:
    """A DP-SGD step on a batch that drew no row: no per-example gradient, so the update is the noise alone.

    Skipping the step would tell an observer of the model that the batch was empty, which
    depends on how many rows there are: the Poisson analysis counts the noised step.
    """
    from opacus.optimizers import DPOptimizer

    assert isinstance(optimizer, DPOptimizer)
    for p in optimizer.params:
        p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def batch_ids(model: nn.Module, batch: Batch) -> Batch:
    """The batch with per-example position and token-type ids where the model's forward takes them."""
    if "input_ids" not in batch:
        return batch
    ids = batch["input_ids"]
    accepted = inspect.signature(model.forward).parameters  # ~30 us a batch, against milliseconds of training
    extra: Batch = {}
    if "position_ids" in accepted and "position_ids" not in batch:
        extra["position_ids"] = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    if "token_type_ids" in accepted and "token_type_ids" not in batch:
        extra["token_type_ids"] = torch.zeros_like(ids)
    return {**batch, **extra}
