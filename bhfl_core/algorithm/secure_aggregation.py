"""Secure aggregation at a server (simulated, as in Bonawitz et al. 2017): the server sees only masked vectors.

A server with the ``secagg`` wrapper (``secure_aggregation:``) folds its children with ``SecAggRule``
(``secagg_rule.py``). Each child
``u`` of the round's called cohort ``U1`` (``RoundPlan.peers``) turns its update into a
vector of integers modulo ``2**bits`` and masks it where it is folded (the worker that
trained it, or the orchestrator for a child server):

- ``v_u = w_u (x_u - theta)`` (its example-weighted update against the model it was sent;
  with ``dp`` around it, its clipped update with weight 1 instead: ``dp_rule.py``), each
  value clamped to what ``|U1|`` of them can sum without wrapping (counted:
  ``secagg/clamped_values``), then fixed point: ``q_u = round(v_u 2**fraction_bits)``;
- ``y_u = q_u + PRG(b_u) + sum_{v in N(u), u < v} PRG(s_uv) - sum_{v in N(u), v < u} PRG(s_uv)``
  modulo ``2**bits``: ``b_u`` is its self-mask seed, ``s_uv`` the seed it agreed with
  neighbour ``v`` by X25519 and HKDF, PRG is AES-256-CTR (``secagg_crypto.py``); ``N(u)``
  is every other member of ``U1`` (``graph: complete``) or its ``k`` neighbours on SecAgg+'s
  sparse graph (``secagg_graph.py``). Every ``y_u`` alone is uniformly distributed.

Workers add masked vectors modulo ``2**bits`` and send that sum; the server merges, then
(``finalize``) removes what does not cancel, as the protocol's parties
(``secagg_parties.py``: a client object per member, a server object holding public keys,
the masked sum and the shares handed to it): every contributor's self-mask (its seed
rebuilt from ``threshold`` of its surviving neighbours' Shamir shares) and, for each
client of ``U1`` that never sent its vector (``U2`` are those who did), the pairwise masks
its surviving neighbours added with it (its key rebuilt from their shares). Fewer
survivors, or surviving holders of a secret, than the ``threshold``: the round fails with
an error naming the server. What is left is ``sum_{u in U2} q_u`` exactly: the same
integer however the children were batched or ordered, and whatever the keys (seeded or
drawn from the OS). The mean input is ``theta + sum / (2**fraction_bits sum_u w_u)`` (with
DP: ``theta + (sum + noise) / m``, noise added by the server after unmasking). Example
counts ``w_u`` are not hidden.

Quantisation error: each value is rounded once, so the mean is within
``|U2| 2**-(fraction_bits + 1) / sum_u w_u`` of the exact mean of the clamped updates, per
coordinate (plus float64 rounding of the final division).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

import torch

from bhfl_core.algorithm.node_state import Caller
from bhfl_core.algorithm.privacy_params import SecAggParams
from bhfl_core.algorithm.secagg_crypto import hkdf
from bhfl_core.algorithm.secagg_parties import RoundDealer, SecAggServer, SecureAggregationError
from bhfl_core.rng import derive_seed

__all__ = ["MaskedSum", "SecureAggregationError", "round_root", "unwire"]

MEMBER = "member."  # wire numbers: one key per contributor


def round_root(params: SecAggParams, round_of: Caller, drawn: bytes = b"") -> bytes:
    """The 32 bytes every key, seed and share of the round derives from: ``drawn`` (from the OS when the round was
    planned, ``randomness: secure``) or derived from the node's mask seed and the round (``seeded``)."""
    if params.randomness == "secure":
        if len(drawn) != 32:
            raise ValueError("secure aggregation with randomness: secure needs the round's root drawn at its plan")
        return drawn
    return hkdf(params.mask_seed.to_bytes(8, "big"), b"bhfl secagg round " + round_of.key.encode())


COUNTER = "counter."  # wire numbers: the names of the counters masked after the update's values


class MaskedSum:
    """A SecAgg server's running fold: the sum of masked vectors modulo ``2**bits``, and who contributed.

    ``reference``: the model the children were sent, where the fold computes their updates
    itself (``secagg`` around the mean); None inside ``dp``, which hands it clipped updates.
    Each masked vector is the member's quantised update followed by its counters (how many
    of its values were clamped; inside ``dp``, whether it was clipped and whether it was not
    finite), masked like the rest: the server learns only their totals, never one batch's.
    """

    def __init__(
        self,
        params: SecAggParams,
        round_of: Caller,
        peers: Sequence[str],
        reference: torch.Tensor | None = None,
        drawn: bytes = b"",
    ) -> None:
        self.params, self.round_of, self.peers = params, round_of, tuple(peers)
        self.reference = reference
        self._drawn = drawn  # the round's root drawn from the OS at its plan (randomness: secure), else empty
        self._dealer: RoundDealer | None = None
        self.server: SecAggServer | None = None  # the server party, once it unmasked (what it holds: tests)
        self.masked: torch.Tensor | None = None
        self.total_weight = 0.0
        self.members: list[str] = []
        self.counters: tuple[str, ...] = ()
        self._open: torch.Tensor | None = None  # the unmasked sum, once computed

    @property
    def weight(self) -> float:
        return self.total_weight

    @property
    def empty(self) -> bool:
        return self.masked is None

    @property
    def modulus_mask(self) -> int:
        return (1 << self.params.bits) - 1

    def quantised(self, values: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``q_u``: a member's weighted update (float64) in fixed point, modulo ``2**bits``, clamped first; and how
        many of its values were clamped. Under distributed DP the clamp leaves room for the children's noise
        (``noise_headroom``) and ``q_u`` also gets its own noise (``noised``)."""
        scale = 2.0**self.params.fraction_bits
        room = 2 ** (self.params.bits - 1) - 1 - noise_headroom(self.params, len(self.peers))
        bound = (room // max(len(self.peers), 1)) / scale
        clamped = int((values.abs() > bound).sum())
        values = values.clamp(-bound, bound)
        q = torch.round(values * scale).to(torch.int64)
        return q & self.modulus_mask, clamped

    def noised(self, q: torch.Tensor, member: str) -> torch.Tensor:
        """Distributed DP at the member: ``q`` (signed) back within L2 ``clip * 2**fraction_bits`` after rounding
        (truncated towards zero, so rounding cannot raise the sensitivity), plus ``N_Z(0, client_noise^2)``."""
        import numpy as np

        from bhfl_core.algorithm.discrete_gaussian import sample

        norm_bound = self.params.client_norm
        norm = float(torch.linalg.vector_norm(q.to(torch.float64)))
        if norm > norm_bound:
            q = torch.trunc(q.to(torch.float64) * (norm_bound / norm)).to(torch.int64)
        if self.params.randomness == "secure":
            rng = np.random.default_rng(int.from_bytes(os.urandom(32), "big"))
        else:
            rng = np.random.default_rng(derive_seed(self.params.mask_seed, "dp-noise", self.round_of.key, member))
        return q + torch.from_numpy(sample(self.params.client_noise, q.numel(), rng))

    def dealer(self) -> RoundDealer:
        """The round's simulated set-up (``secagg_parties.RoundDealer``), made once per fold."""
        if self._dealer is None:
            root = round_root(self.params, self.round_of, self._drawn)
            context = self.round_of.key.encode()
            self._dealer = RoundDealer(root, context, self.peers, self.params.neighbours, self.params.threshold)
        return self._dealer

    def add(self, member: str, update: torch.Tensor, weight: float, counts: Mapping[str, int] | None = None) -> None:
        """Mask and add ``weight * update`` (``update``: the member's update, any float dtype and device) and its
        counters (``counts``: named 0/1 flags of the caller's, after the clamped count)."""
        if member not in self.peers:
            raise ValueError(f"{member!r} is not in the round's cohort {list(self.peers)}: it holds no pairwise keys")
        q, clamped = self.quantised(update.detach().reshape(-1).to("cpu", torch.float64) * weight)
        named = {"clamped": clamped, **dict(sorted((counts or {}).items()))}
        if self.params.client_noise:  # distributed DP: the noise is the child's; no exact count may reach the server
            q, named = self.noised(_signed(q, self.params.bits), member) & self.modulus_mask, {}
        if self.counters and tuple(named) != self.counters:
            raise ValueError(f"counters {tuple(named)} cannot join a fold of {self.counters}")
        self.counters = tuple(named)
        q = torch.cat([q, torch.tensor(list(named.values()), dtype=torch.int64)])
        masks = self.dealer().client(member).masks(q.numel(), self.params.bits)  # round 2, at the member
        masked = (q + masks) & self.modulus_mask
        self.masked = masked if self.masked is None else (self.masked + masked) & self.modulus_mask
        self.members.append(member)
        self.total_weight += float(weight)

    def merge(self, other: MaskedSum) -> None:
        if other.masked is None:
            return
        self.masked = other.masked if self.masked is None else (self.masked + other.masked) & self.modulus_mask
        self.members.extend(other.members)
        self.total_weight += other.total_weight
        self.counters = self.counters or other.counters

    def unmasked(self) -> torch.Tensor:
        """``sum_{u in U2} q_u`` as signed integers (the counters' totals last): every mask that does not cancel
        removed, from recovered seeds."""
        if self.masked is None:
            raise ValueError("cannot unmask an empty secure-aggregation fold")
        if self._open is not None:
            return self._open
        survivors = [p for p in self.peers if p in self.members]
        t = self.params.threshold
        if len(survivors) < t:
            raise SecureAggregationError(
                f"secure aggregation at {self.round_of.node_id!r} (round {self.round_of.round}): "
                f"{len(survivors)} of {len(self.peers)} children sent their masked update, fewer than the threshold "
                f"{t}, so the masks cannot be removed (secure_aggregation.threshold)"
            )
        dealer = self.dealer()
        self.server = SecAggServer(
            self.round_of.node_id, dealer.context, t, self.params.bits, dealer.public_keys(), dealer.graph
        )
        total = self.server.unmask(self.masked.cpu(), survivors, lambda member: dealer.client(member, with_shares=True))
        bits = self.params.bits
        half = 2 ** (bits - 1)
        self._open = torch.where(total >= half, total - 2**bits, total)
        return self._open

    def summed(self) -> torch.Tensor:
        """The unmasked sum of the weighted updates (float64, flat): ``sum_{u in U2} q_u / 2**fraction_bits``."""
        total = self.unmasked()
        return total[: total.numel() - len(self.counters)].to(torch.float64) / 2.0**self.params.fraction_bits

    def totals(self) -> dict[str, int]:
        """The counters summed over the members, unmasked with the update (no batch's own count is ever seen)."""
        if not self.counters:  # distributed DP sends none
            return {}
        return dict(zip(self.counters, self.unmasked()[-len(self.counters) :].tolist(), strict=True))

    def wire(self) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        tensors = {} if self.masked is None else {"masked": self.masked}
        numbers = {"weight": self.total_weight, **{f"{COUNTER}{name}": 1.0 for name in self.counters}}
        return tensors, {**numbers, **{f"{MEMBER}{m}": 1.0 for m in self.members}}

    def secagg_metrics(self) -> dict[str, float]:
        return {
            "secagg/clamped_values": float(self.totals().get("clamped", float("nan"))),
            "secagg/recovered_clients": float(len([p for p in self.peers if p not in self.members])),
        }


def noise_headroom(params: SecAggParams, members: int) -> int:
    """What the clamp keeps free in the field for distributed DP's noise: 12 standard deviations of ``members``
    children's discrete Gaussians (a wrap-around chance below 1e-32 per value; none without distributed DP)."""
    return math.ceil(12 * params.client_noise * math.sqrt(members)) if params.client_noise else 0


def _signed(q: torch.Tensor, bits: int) -> torch.Tensor:
    return torch.where(q >= 2 ** (bits - 1), q - 2**bits, q)


def unwire(
    params: SecAggParams,
    round_of: Caller,
    peers: Sequence[str],
    tensors: Mapping[str, torch.Tensor],
    numbers: Mapping[str, float],
) -> MaskedSum:
    """A ``MaskedSum`` from the wire (no reference: the parent merges it into its own fold)."""
    out = MaskedSum(params, round_of, peers)
    out.masked = tensors.get("masked")
    out.total_weight = float(numbers.get("weight", 0.0))
    named = [k[len(COUNTER) :] for k in numbers if k.startswith(COUNTER)]  # in add's order: clamped, then sorted
    out.counters = tuple(["clamped", *sorted(n for n in named if n != "clamped")]) if named else ()
    out.members = [k[len(MEMBER) :] for k in numbers if k.startswith(MEMBER)]
    return out
