"""Compressed models on the downward half of a tree edge: what a server broadcasts to its children.

Double-Squeeze (Tang et al. 2019, Algorithm 1) compresses both directions, each with its
own error feedback: the workers their gradients, the server the averaged update it sends
back, ``v_t = C(g_t + delta_{t-1})``, ``delta_t = g_t + delta_{t-1} - v_t``, and every
worker moves the model it holds by ``v_t``. In a tree the server's "update" is the change
of its model between broadcasts, so with ``tree.<level>.compress_down`` a server keeps
``x_hat``, the model its children hold (``NodeState.down_ref``), and each round sends

    c_t = C(theta_t - x_hat_{t-1}),     x_hat_t = x_hat_{t-1} + decode(c_t),

which is that recursion written on models: its error-feedback residual ``delta_t =
theta_t - x_hat_t`` is what the children's model is short of the server's, carried into
the next payload, so nothing a payload leaves out is lost (by induction ``x_hat_t +
delta_t = theta_t``). The first broadcast is the model itself (``x_hat_0 = theta_0``, no
residual). Error feedback is therefore always on: without it (compressing ``theta_t -
theta_{t-1}``) the children's model would drift from the server's without bound.

The children train from ``x_hat_t`` (their ``phi``), so what they send up is an update
of ``x_hat_t``. The server folds their models against ``x_hat_t`` (the reference its
rule clips or masks around) and adds ``delta_t`` back to everything the fold says about
models (``rebase``): the mean input becomes ``theta_t + mean(theta_i - x_hat_t)``, as
in Double-Squeeze, where the server applies the workers' averaged update to its own
model, not to the compressed copy. A server's own proxy TRAIN alongside its children
starts from ``theta_t``: its model is moved onto ``x_hat_t`` before the fold (``- delta``).

Bytes (``comm/down_bytes``): a child that holds ``x_hat_{t-1}`` receives the payload; one
that does not (not called the round before, or ``persistent: false``: it keeps nothing
between calls) receives ``x_hat_t`` whole, as float32. The payloads are ``int8``/``topk``
as on the way up (``compression.py``), their rounding drawn from a CPU generator seeded
by (seed, server, round, caller). A non-finite server model is an error naming it: a
compressor never hides a fault. Residuals sent down (``down_posts``) travel uncompressed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from bhfl_core.algorithm.compression import CompressParams, NonFiniteUpdate, decode, encode, payload_bytes

if TYPE_CHECKING:
    from bhfl_core.algorithm.aggregation_rule import FoldedRound
    from bhfl_core.algorithm.node_state import RoundKey

BYTES_PER_VALUE = 4  # a dense broadcast: the float32 vector


@dataclass(frozen=True)
class Broadcast:
    """One round's broadcast: ``model`` (``x_hat_t``, what every child receives), the server's residual ``delta``
    (``theta_t - x_hat_t``), one payload's bytes (None: this broadcast was the model itself)."""

    model: torch.Tensor
    delta: torch.Tensor
    payload_bytes: int | None
    change: float = 0.0  # ||theta_t - x_hat_{t-1}||: what this round had to send

    def bytes_to(self, holding: int, receivers: int) -> int:
        """What the round sent ``receivers`` children, ``holding`` of whom hold the previous ``x_hat``."""
        dense = self.model.numel() * BYTES_PER_VALUE
        if self.payload_bytes is None:
            return receivers * dense
        return holding * self.payload_bytes + (receivers - holding) * dense

    def error(self) -> float:
        """``||delta_t|| / ||theta_t - x_hat_{t-1}||``: the share of this round's change the payload left for later."""
        return 0.0 if self.payload_bytes is None else float(self.delta.norm()) / max(self.change, 1e-30)


def broadcast(
    theta: torch.Tensor, reference: torch.Tensor | None, params: CompressParams, seed: int, key: RoundKey
) -> Broadcast:
    """The round's broadcast of ``theta`` to children that hold ``reference`` (``x_hat_{t-1}``; None: the first)."""
    if reference is None:
        return Broadcast(theta, torch.zeros_like(theta), None)
    change = theta - reference.to(theta.device)
    if not bool(torch.isfinite(change).all()):
        bad = int((~torch.isfinite(change)).sum())
        raise NonFiniteUpdate(
            f"{key.node_id}: its model to broadcast in round {key.round} (called by {key.caller.key or 'the run'}) "
            f"has {bad} non-finite values of {change.numel()}: it diverged. Compressing it ({params.kind}) would "
            "hide that, so it is not sent; lower the learning rate, or add zeroing to its aggregate.wrap"
        )
    payload = encode(change, params, seed)
    model = reference.to(theta.device) + decode(payload, change.numel(), params)
    return Broadcast(model, theta - model, payload_bytes(payload), float(change.norm()))


def rebase(folded: FoldedRound, delta: torch.Tensor) -> FoldedRound:
    """The fold of children that trained from ``x_hat``, said of the server's model: ``delta`` added to the
    individual models and residual candidates, and kept for ``node_up`` to add to the mean input."""
    folded.models = {member: model + delta.to(model.device) for member, model in folded.models.items()}
    folded.candidates = [replace(c, theta=c.theta + delta.to(c.theta.device)) for c in folded.candidates]
    folded.shift = delta
    return folded
