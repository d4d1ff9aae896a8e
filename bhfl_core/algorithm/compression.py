"""Compressed updates on the upward half of a tree edge: what a child sends its parent.

A parent's ``aggregate.compress`` makes each of its children send, at the end of its
execution, a compressed version of its *update* ``theta_T - phi`` (``phi``: the model the
parent sent it) instead of its model; the parent folds ``phi + decode(payload)`` with
its rule, exactly as it would fold the model. Two compressors:

- ``int8``: stochastic 8-bit quantisation (QSGD, Alistarh et al. 2017, with one scale
  per ``block`` values: ``scale = max|x| / 127``, ``q = floor(x / scale + u)``, ``u ~
  U[0, 1)``). Unbiased; ``n + 4 * ceil(n / block)`` bytes for ``n`` values.
- ``topk``: the ``ceil(fraction * n)`` entries of largest magnitude, as int32 indices and
  float32 values (``8 k`` bytes). Ties at the threshold go to the lowest indices, so the
  choice never depends on a kernel's order.

With ``error_feedback`` (Seide et al. 2014; Karimireddy et al. 2019, EF-SGD) the sender
adds what earlier compressions left out (its residual ``e``) before compressing and keeps
the new remainder: ``c = C(u + e)``, ``e' = u + e - decode(c)``. The residual is part of
the sender's ``NodeState`` (``feedback``), committed with its last round, so a resumed run
continues with it. The payload itself is state too (``sent``): a sender re-run after a
crash hands back exactly what it sent.

Every draw comes from a CPU generator seeded by (seed, sender, round, caller), moved to
the tensor's device: the same inputs give the same payload, bit for bit, whether a CPU
or a GPU worker compresses them (a CUDA generator draws other numbers from the same seed).

A compressor never hides a fault. An update ``u + e`` with a NaN or infinite value is
not compressed as if it were finite (top-k would rank NaN nowhere and send nothing of
it, int8 would send zeros): ``compress_update`` raises ``NonFiniteUpdate`` naming the
sender and its round, unless the parent has the ``zeroing`` or ``dp`` wrapper (both fold it as no update, counted)
(``nonfinite: "send"``, set at tree build: ``aggregation_settings._compress``). Then the
payload carries the fault as it is, at its usual size: int8 gives a block holding a
non-finite value the scale NaN (that block decodes to NaN), top-k ranks non-finite
entries above every finite one and sends their values. The parent decodes a non-finite
model, which zeroing counts and zeroes as it does an uncompressed child's. The sender's
residual is not touched by such an update (nothing of it was delivered, and a NaN
residual would poison every later payload): it keeps the one it had.

Under secure aggregation at the parent only ``int8`` is accepted (the config refuses
``topk``: masking makes every upload dense, so its ``8 k`` bytes would be a false count);
``comm/up_bytes`` then counts the int8 payloads, not the masked vectors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from bhfl_core.algorithm.node_state import RoundKey

KINDS = ("int8", "topk")
NONFINITE = ("error", "send")  # a non-finite update: raise at the sender, or send it for the parent's zeroing
LEVELS = 127  # int8 payload values lie in [-127, 127]: symmetric, so the mean stays unbiased


@dataclass(frozen=True)
class CompressParams:
    """A parent's compression of its children's updates (``aggregate.compress``)."""

    kind: str
    fraction: float = 0.01  # topk: share of entries sent
    block: int = 512  # int8: values per float32 scale
    error_feedback: bool = True
    nonfinite: str = "error"  # "send" where the parent zeroes non-finite updates (its ``zeroing`` or ``dp`` wrapper)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown compression {self.kind!r}; choose one of {list(KINDS)}")
        if self.nonfinite not in NONFINITE:
            raise ValueError(f"compress.nonfinite must be one of {list(NONFINITE)}, got {self.nonfinite!r}")
        if not 0 < self.fraction <= 1:
            raise ValueError(f"compress.fraction must be in (0, 1], got {self.fraction}")
        if self.block < 1:
            raise ValueError(f"compress.block must be at least 1, got {self.block}")


class NonFiniteUpdate(FloatingPointError):
    """A sender's update holds NaN or infinite values and its parent does not zero such updates."""


Payload = dict[str, "torch.Tensor"]
"""A compressed update as named tensors: ``q`` and ``scale`` (int8), ``index`` and ``value`` (topk)."""


def encode(update: torch.Tensor, params: CompressParams, seed: int) -> Payload:
    """The payload for a flat float32 ``update`` (``seed``: int8's rounding draws)."""
    if params.kind == "int8":
        return _quantize(update, params.block, seed)
    return _top_k(update, params.fraction)


def decode(payload: Payload, numel: int, params: CompressParams) -> torch.Tensor:
    """The float32 update a payload stands for (length ``numel``, on the payload's device)."""
    import torch

    if params.kind == "int8":
        q, scale = payload["q"], payload["scale"]
        blocks = scale.numel()
        padded = torch.zeros(blocks * params.block, dtype=torch.float32, device=q.device)
        padded[:numel] = q.to(torch.float32)
        return (padded.view(blocks, params.block) * scale.view(-1, 1)).view(-1)[:numel]
    out = torch.zeros(numel, dtype=torch.float32, device=payload["value"].device)
    out[payload["index"].long()] = payload["value"]
    return out


def payload_bytes(payload: Payload) -> int:
    """What a payload costs on the wire: the bytes of its tensors."""
    return sum(t.numel() * t.element_size() for t in payload.values())


def _quantize(x: torch.Tensor, block: int, seed: int) -> Payload:
    import torch

    n = x.numel()
    blocks = math.ceil(n / block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=x.device)
    padded[:n] = x
    rows = padded.view(blocks, block)
    faulty = ~torch.isfinite(rows).all(dim=1)  # a block with NaN or inf: sent as scale NaN, q 0 (decodes to NaN)
    rows = torch.where(faulty.view(-1, 1), torch.zeros_like(rows), rows)
    scale = rows.abs().amax(dim=1) / LEVELS
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block: any scale gives q = 0
    noise = rounding_draws(rows.shape, seed).to(x.device)
    q = torch.floor(rows / scale.view(-1, 1) + noise).clamp_(-LEVELS, LEVELS).to(torch.int8)
    scale = torch.where(faulty, torch.full_like(scale, math.nan), scale)
    return {"q": q.view(-1)[:n].clone(), "scale": scale}


def rounding_draws(shape: torch.Size | tuple[int, ...], seed: int) -> torch.Tensor:
    """int8's uniform draws ``u ~ U[0, 1)`` for one payload, from a CPU generator seeded by ``seed``.

    On the CPU whatever the tensor's device (the caller moves them): a CUDA generator
    draws other numbers from the same seed, and a payload must not depend on where it was made.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=generator, dtype=torch.float32)


def _top_k(x: torch.Tensor, fraction: float) -> Payload:
    import torch

    n = x.numel()
    k = min(n, max(1, math.ceil(fraction * n)))
    # a NaN or inf ranks above every finite value: a fault is sent, never dropped
    magnitude = x.abs().nan_to_num(nan=math.inf, posinf=math.inf)
    threshold = torch.topk(magnitude, k, sorted=False).values.min()  # the k-th largest magnitude (a value)
    above = torch.nonzero(magnitude > threshold).view(-1)
    at = torch.nonzero(magnitude == threshold).view(-1)[: k - above.numel()]  # ties: lowest indices first
    index = torch.sort(torch.cat([above, at])).values
    return {"index": index.to(torch.int32), "value": x[index].clone()}


@dataclass(frozen=True)
class Sent:
    """What a sender's execution sent up: the payload, and its new error-feedback residual (None: no feedback)."""

    payload: Payload
    feedback: torch.Tensor | None


def compress_update(
    theta: torch.Tensor,
    phi: torch.Tensor,
    feedback: torch.Tensor | None,
    params: CompressParams,
    seed: int,
    key: RoundKey,
) -> Sent:
    """Compress ``theta - phi`` (plus the residual ``feedback`` when ``params.error_feedback``), sent by
    ``key``'s node after ``key``'s round.

    A non-finite update raises ``NonFiniteUpdate`` naming them, or with ``nonfinite:
    "send"`` goes up as it is, the residual unchanged (module docstring).
    """
    import torch

    update = theta - phi.to(theta.device)
    if params.error_feedback and feedback is not None:
        update = update + feedback.to(theta.device)
    finite = bool(torch.isfinite(update).all())
    if not finite and params.nonfinite == "error":
        raise NonFiniteUpdate(_nonfinite_message(update, key, params))
    payload = encode(update, params, seed)
    if not params.error_feedback:
        return Sent(payload, None)
    if not finite:
        return Sent(payload, feedback)
    return Sent(payload, update - decode(payload, update.numel(), params))


def _nonfinite_message(update: torch.Tensor, key: RoundKey, params: CompressParams) -> str:
    import torch

    bad = int((~torch.isfinite(update)).sum())
    nan = int(torch.isnan(update).sum())
    return (
        f"{key.node_id}: its update to send up after round {key.round} (called by {key.caller.key or 'the run'}) has "
        f"{bad} non-finite values of {update.numel()} ({nan} NaN): its model diverged. Compressing it ({params.kind}) "
        "would hide that, so it is not sent; add zeroing to the parent's aggregate.wrap to count such an update "
        "as no update (zeroing/zeroed), or lower the learning rate"
    )


def received_model(phi: torch.Tensor, payload: Payload, params: CompressParams) -> torch.Tensor:
    """The model the parent folds for a child's payload: ``phi + decode(payload)``, on the payload's device.

    (A GPU worker's payload is on its GPU, where the worker folds; one read back from a
    checkpoint is on the CPU. Elementwise float32 arithmetic gives the same bits on both.)
    """
    device = next(iter(payload.values())).device
    return phi.to(device) + decode(payload, phi.numel(), params)
