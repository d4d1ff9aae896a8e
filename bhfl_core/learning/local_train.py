"""TRAIN and EVAL loops over pre-tokenised tensors, for any transformers model.

The model instance is reused across clients (the caller loads a flat vector into it
first); the optimiser is created per call, i.e. local optimiser state is not kept
between rounds (as in FedAvg/FedOPT). Batches are trimmed to their longest sequence,
so padding to ``max_length`` at tokenisation time costs little compute.

FedProx (``TrainParams.mu > 0``): TRAIN minimises ``loss + (mu/2)·||theta − theta0||²``
where ``theta0`` is the model the call started from (a client: the parent's model it
received, after down-aggregation; a server's proxy TRAIN: its aggregated model). The
term is applied through the gradient, not the loss: after ``backward()`` each trainable
parameter's ``.grad`` gets ``mu·(p − p0)``, exactly the term's gradient, before
``optimizer.step()`` (so AdamW's moments and SGD's weight decay see loss + proximal
gradient, as they would with the term in the loss). That is one fused update per step
instead of a second autograd graph over every parameter, and the reported loss stays the
task loss (comparable across ``mu``; what the ``loss`` residual selector ranks). ``mu = 0``
takes none of this path: no anchor copy, no extra op. Ditto's personal model uses the
same term with an explicit anchor (the model the client received), ``lambda`` as ``mu``.

Held-out rows (``split_holdout``): a node whose NODEOPT tunes on held-out data
(``interp``) keeps a fixed share of its training rows out of TRAIN, drawn once from
(seed, node), so the rows it tunes on are never trained on in any round;
``held_out_loss`` scores a model on them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from bhfl_core.algorithm.tree import TrainParams, held_out_rows
from bhfl_core.algorithm.tree import planned_steps as planned_steps  # noqa: PLC0414 (where callers find it)
from bhfl_core.learning.dp_sgd import batch_ids, noise_only_step, private_training
from bhfl_core.learning.params import trainable_parameters

Batch = dict[str, torch.Tensor]
BatchTransform = Callable[[Batch, torch.Generator], Batch]


_NARROW = (torch.int8, torch.int16, torch.int32)


def compact(table: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``table`` with each int64 column in the narrowest of int8 / int16 / int32 that holds its values.

    For tables kept in memory for long (the test table a worker scores every model on);
    ``widened`` gives a batch of it back in int64, so models see the very same inputs.
    """
    out: dict[str, torch.Tensor] = {}
    for name, column in table.items():
        if column.dtype == torch.int64 and column.numel():
            low, high = int(column.min()), int(column.max())
            narrow = next((t for t in _NARROW if torch.iinfo(t).min <= low and high <= torch.iinfo(t).max), None)
            out[name] = column.to(narrow) if narrow is not None else column
        else:
            out[name] = column
    return out


def widened(batch: Batch) -> Batch:
    """A batch of a ``compact`` table in int64 again (columns that were never narrowed pass as they are)."""
    return {k: v.long() if v.dtype in _NARROW else v for k, v in batch.items()}


def _batches(data: Mapping[str, torch.Tensor], order: torch.Tensor, batch_size: int) -> Iterator[Batch]:
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        batch = widened({k: v[idx] for k, v in data.items()})
        if "attention_mask" in batch:
            width = int(batch["attention_mask"].sum(dim=1).max())
            batch = {k: (v[:, :width] if v.dim() == 2 and k != "labels" else v) for k, v in batch.items()}
            if "labels" in batch and batch["labels"].dim() == 2:
                batch["labels"] = batch["labels"][:, :width]
        yield batch


def _optimizer(model: nn.Module, params: TrainParams) -> torch.optim.Optimizer:
    weights = trainable_parameters(model)
    if params.optimizer == "adamw":
        return torch.optim.AdamW(weights, lr=params.lr, weight_decay=params.weight_decay)
    if params.optimizer == "sgd":
        return torch.optim.SGD(weights, lr=params.lr, weight_decay=params.weight_decay)
    raise ValueError(f"unknown local optimizer {params.optimizer!r} (use 'adamw' or 'sgd')")


class _Proximal:
    """FedProx's ``(mu/2)·||theta − theta0||²`` over the trainable parameters, added to their gradients.

    Only trainable parameters (those that are federated, as ``get_flat`` sees them; a tied
    parameter once) are anchored; buffers (BERT's ``position_ids``, a norm's running
    statistics) are not parameters of the objective and evolve as they would without
    the term. A trainable parameter that got no gradient from the batch (unused in the
    forward pass) still gets the proximal one, ``mu·(p − p0)`` (zero until it moves), as
    if the term were in the loss.
    """

    def __init__(self, model: nn.Module, mu: float, anchor: torch.Tensor | None = None) -> None:
        self.mu = mu
        self.params: list[torch.Tensor] = list(trainable_parameters(model))
        if anchor is None:  # the parameters the call started from, once per TRAIN call
            self.anchor = [p.detach().clone() for p in self.params]
        else:  # a flat vector in ``get_flat``'s layout
            device = self.params[0].device
            parts = torch.split(anchor.to(device), [p.numel() for p in self.params])
            self.anchor = [part.view_as(p).to(p.dtype) for part, p in zip(parts, self.params)]

    @torch.no_grad()
    def add_gradient(self) -> None:
        grads: list[torch.Tensor] = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        torch._foreach_add_(grads, torch._foreach_sub(self.params, self.anchor), alpha=self.mu)


class _Precision:
    """``train.precision``: the forward pass in fp32, or under torch autocast in bf16 / fp16.

    Parameters, gradients and optimizer states stay float32 (the federated model is the
    float32 vector either way); only the forward's matmuls run in the lower precision.
    fp16 scales the loss so small gradients do not underflow (``torch.amp.GradScaler``,
    whose scale is a deterministic function of the gradients it sees). fp32 adds nothing
    to the step.
    """

    def __init__(self, precision: str, device: torch.device) -> None:
        self.dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        self.device_type = device.type
        self.scaler = torch.amp.GradScaler(device.type) if self.dtype is torch.float16 else None

    def autocast(self) -> AbstractContextManager[object]:
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        """Gradients of ``loss``, unscaled (fp16), so a proximal term added next sees true gradients."""
        if self.scaler is None:
            loss.backward()  # type: ignore[no-untyped-call]
            return
        self.scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step (fp16: skipped when a gradient overflowed, and the scale adapted)."""
        if self.scaler is None:
            optimizer.step()
        else:
            self.scaler.step(optimizer)
            self.scaler.update()


@dataclass(frozen=True)
class TrainResult:
    loss: float
    steps: int
    examples: int


def train_model(
    model: nn.Module,
    data: Mapping[str, torch.Tensor],
    params: TrainParams,
    seed: int,
    device: torch.device,
    transform: BatchTransform | None = None,
    anchor: torch.Tensor | None = None,
) -> TrainResult:
    """Train in place for ``params.epochs`` epochs (or ``max_steps``); data order from ``seed``.

    With ``params.mu > 0`` the proximal term anchors the model to ``anchor`` (a flat
    vector; default: its parameters at the start of this call, module docstring); the
    returned loss is the task loss alone.
    """
    n = len(next(iter(data.values())))
    if n == 0:
        return TrainResult(loss=float("nan"), steps=0, examples=0)
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # dropout, if the model has any
    optimizer = _optimizer(model, params)
    proximal = _Proximal(model, params.mu, anchor) if params.mu > 0 else None
    precision = _Precision(params.precision, device)
    model.train()
    dp = params.dp_sgd
    with (
        private_training(model, optimizer, dp, params.batch_size, seed) if dp else nullcontext((model, optimizer)) as (
            module,
            optimizer,
        )
    ):
        steps = 0
        losses: list[tuple[torch.Tensor, int]] = []  # (batch loss on the device, batch size): read once, at the end
        for _ in range(params.epochs):
            epoch = (
                _poisson_batches(data, n, params.batch_size, generator) if dp else _shuffled(data, n, params, generator)
            )
            for raw in epoch:
                if raw is None:  # a Poisson draw of no row: the step is the noise alone (dp_sgd.py)
                    noise_only_step(optimizer)
                    steps += 1
                    if params.max_steps is not None and steps >= params.max_steps:
                        return _result(losses)
                    continue
                batch = transform(raw, generator) if transform is not None else raw
                batch = _to_device(batch, device)
                with precision.autocast():
                    out = module(**(batch_ids(model, batch) if dp else batch))
                precision.backward(out.loss, optimizer)
                if proximal is not None:
                    proximal.add_gradient()
                precision.step(optimizer)
                optimizer.zero_grad(set_to_none=True)
                losses.append((out.loss.detach(), len(batch["labels"])))
                steps += 1
                if params.max_steps is not None and steps >= params.max_steps:
                    return _result(losses)
    return _result(losses)


def _shuffled(
    data: Mapping[str, torch.Tensor], n: int, params: TrainParams, generator: torch.Generator
) -> Iterator[Batch]:
    """One epoch in a shuffled order: ``ceil(n / batch_size)`` batches of ``batch_size`` rows (the last fewer)."""
    return _batches(data, torch.randperm(n, generator=generator), params.batch_size)


def _poisson_batches(
    data: Mapping[str, torch.Tensor], n: int, batch_size: int, generator: torch.Generator
) -> Iterator[Batch | None]:
    """One DP-SGD epoch: ``ceil(n / batch_size)`` batches, each row in each independently with chance
    ``batch_size / n`` (Opacus's ``UniformWithReplacementSampler``; None for a batch that drew no row).

    Poisson batches are what DP-SGD's accountant assumes (``privacy_accounting.sample_epsilon``);
    shuffled fixed-size batches are not covered by it. As many steps as a shuffled epoch,
    so a client's step count (``tree.planned_steps``) does not depend on the draw.
    """
    rate = min(1.0, batch_size / n)
    for _ in range(-(-n // batch_size)):
        rows = (torch.rand(n, generator=generator) < rate).nonzero().flatten()
        yield {k: v[rows] for k, v in data.items()} if len(rows) else None


def _to_device(batch: Batch, device: torch.device) -> Batch:
    """A batch on the training device; to a GPU through pinned memory, without waiting.

    An attention mask of ones masks nothing: it is left out (checked here, on the CPU),
    since transformers would otherwise look at it on the GPU in every forward
    (``padding_mask.all()`` to skip building a mask), a wait per step; the model takes
    the very same path either way.

    A plain copy from pageable memory makes the CPU wait for every kernel queued before
    it (PyTorch synchronizes the stream after such a copy), so each step would start only
    once the GPU finished the last one. From pinned memory, with ``non_blocking``, the copy
    is queued like a kernel (the pinned block is kept until the copy has run). Same data.
    """
    if "attention_mask" in batch and bool(batch["attention_mask"].all()):
        batch = {k: v for k, v in batch.items() if k != "attention_mask"}
    if device.type != "cuda":
        return {k: v.to(device) for k, v in batch.items()}
    # (a caller's data already on a GPU cannot be pinned, and needs no staging)
    return {k: v.pin_memory().to(device, non_blocking=True) if v.is_cpu else v.to(device) for k, v in batch.items()}


def _result(losses: list[tuple[torch.Tensor, int]]) -> TrainResult:
    """The example-weighted mean loss of a TRAIN call, read from the device once.

    Reading each batch's loss as it comes (``float(loss)``) would make the CPU wait for
    the GPU every step, so the GPU would idle while the next step's kernels are queued:
    at BERT-base size and small batches, about half the GPU's time. The sum is the same
    float64 sum over the same float32 values, in the same order.
    """
    if not losses:
        return TrainResult(float("nan"), 0, 0)
    values = torch.stack([loss for loss, _ in losses]).tolist()
    loss_sum, seen = 0.0, 0
    for value, (_, size) in zip(values, losses):
        loss_sum += value * size
        seen += size
    return TrainResult(loss_sum / seen, len(losses), seen)


def split_holdout(
    data: Mapping[str, torch.Tensor], fraction: float, seed: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(kept, held)``: ``round(fraction * n)`` rows (at least 1, at most n - 1) held out, drawn from ``seed``.

    ``fraction == 0`` or fewer than two rows hold nothing out. Both parts keep the
    rows' original order.
    """
    n = len(next(iter(data.values())))
    k = held_out_rows(n, fraction)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    held, kept = order[:k].sort().values, order[k:].sort().values
    return {name: v[kept] for name, v in data.items()}, {name: v[held] for name, v in data.items()}


@torch.no_grad()
def held_out_loss(
    model: nn.Module,
    data: Mapping[str, torch.Tensor],
    batch_size: int,
    device: torch.device,
    seed: int,
    transform: BatchTransform | None = None,
) -> float:
    """The model's mean task loss over ``data`` (row-weighted; NaN for no rows), in eval mode.

    ``transform`` (masked LM) draws from a generator seeded by ``seed``, so candidates
    scored with the same seed see the same masks.
    """
    n = len(next(iter(data.values())))
    if n == 0:
        return float("nan")
    generator = torch.Generator().manual_seed(seed)
    model.eval()
    total, seen = 0.0, 0
    for raw in _batches(data, torch.arange(n), batch_size):
        batch = transform(raw, generator) if transform is not None else raw
        out = model(**{k: v.to(device) for k, v in batch.items()})
        size = len(batch["labels"])
        total += float(out.loss) * size
        seen += size
    return total / seen


@torch.no_grad()
def grouped_confusions(
    model: nn.Module,
    data: Mapping[str, torch.Tensor],
    groups: torch.Tensor,
    num_groups: int,
    num_labels: int,
    batch_size: int,
    device: torch.device,
) -> torch.Tensor:
    """``confusion[group, true, pred]`` of a sequence classifier over rows tagged with ``groups``.

    Scoring many small test splits in one pass (rows sorted by length, full batches)
    instead of split by split keeps evaluation cost proportional to the rows, not to
    the number of clients.
    """
    model.eval()
    lengths = data["attention_mask"].sum(dim=1) if "attention_mask" in data else torch.zeros(len(groups))
    order = torch.argsort(lengths, stable=True)
    cells = num_labels * num_labels
    flat = torch.zeros(num_groups * cells, dtype=torch.int64)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        batch = next(_batches(data, idx, len(idx)))
        labels = batch.pop("labels")
        preds = model(**{k: v.to(device) for k, v in batch.items()}).logits.argmax(dim=-1).cpu()
        # the batch's cells only: a bincount over every group's cells would allocate and add the whole table
        # (8 MB at 10,000 clients) once a batch; counts are integers, so the sum is the same in any order
        seen, counts = torch.unique(groups[idx] * cells + labels * num_labels + preds, return_counts=True)
        flat.index_add_(0, seen, counts)
    return flat.view(num_groups, num_labels, num_labels)
