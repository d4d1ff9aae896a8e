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
- ``y_u = q_u + PRG(b_u) + sum_{v in U1, u < v} PRG(s_uv) - sum_{v in U1, v < u} PRG(s_uv)``
  modulo ``2**bits``: ``b_u`` is its self-mask seed, ``s_uv`` the seed it agreed with ``v``
  by Diffie-Hellman (``secagg_crypto.py``). Every ``y_u`` alone is uniformly distributed.

Workers add masked vectors modulo ``2**bits`` and send that sum; the server merges, then
(``finalize``) removes what does not cancel: every contributor's self-mask (its seed
recovered from the other survivors' Shamir shares) and, for each client of ``U1`` that
never sent its vector (``U2`` are those who did), the pairwise masks the survivors added
with it (its key recovered from their shares). Fewer survivors than the ``threshold``:
the round fails with an error naming the server. What is left is ``sum_{u in U2} q_u``
exactly: the same integer however the children were batched or ordered. The mean input is
``theta + sum / (2**fraction_bits sum_u w_u)`` (with DP: ``theta + (sum + noise) / m``,
noise added by the server after unmasking). Example counts ``w_u`` are not hidden.

Quantisation error: each value is rounded once, so the mean is within
``|U2| 2**-(fraction_bits + 1) / sum_u w_u`` of the exact mean of the clamped updates, per
coordinate (plus float64 rounding of the final division).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from bhfl_core.algorithm.node_state import Caller
from bhfl_core.algorithm.privacy_params import SecAggParams
from bhfl_core.algorithm.secagg_crypto import agreed_seed, combine, key_seed, public_key, secret_key, split
from bhfl_core.rng import derive_seed

MEMBER = "member."  # wire numbers: one key per contributor


class SecureAggregationError(RuntimeError):
    """A round whose masks cannot be removed (too few survivors): it fails rather than publish garbage."""


class RoundKeys:
    """One round's simulated key material: every party's keys, self-mask seeds and Shamir shares of both."""

    def __init__(self, params: SecAggParams, round_of: Caller, peers: Sequence[str]) -> None:
        self.params, self.where, self.peers = params, round_of.key, tuple(peers)
        self._secret: dict[str, int] = {}

    def material(self, party: str) -> int:
        return key_seed(self.params.mask_seed, self.where, "key", party)

    def secret(self, party: str) -> int:
        if party not in self._secret:
            self._secret[party] = secret_key(self.material(party))
        return self._secret[party]

    def public(self, party: str) -> int:
        return public_key(self.secret(party))

    def self_seed(self, party: str) -> int:
        return derive_seed(self.params.mask_seed, self.where, "self", party)

    def shares(self, owner: str, secret: int, what: str) -> dict[str, tuple[int, int]]:
        """The Shamir shares of ``owner``'s ``secret``, by holder (every party of ``U1`` holds one)."""
        seed = derive_seed(self.params.mask_seed, self.where, "shares", what, owner)
        return dict(zip(self.peers, split(secret, len(self.peers), self.params.threshold, seed), strict=True))


def _prg(seed: int, numel: int, bits: int) -> torch.Tensor:
    return torch.randint(0, 2**bits, (numel,), generator=torch.Generator().manual_seed(seed), dtype=torch.int64)


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
        self, params: SecAggParams, round_of: Caller, peers: Sequence[str], reference: torch.Tensor | None = None
    ) -> None:
        self.params, self.round_of, self.peers = params, round_of, tuple(peers)
        self.reference = reference
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
        many of its values were clamped."""
        scale = 2.0**self.params.fraction_bits
        bound = ((2 ** (self.params.bits - 1) - 1) // max(len(self.peers), 1)) / scale
        clamped = int((values.abs() > bound).sum())
        values = values.clamp(-bound, bound)
        return torch.round(values * scale).to(torch.int64) & self.modulus_mask, clamped

    def masks(self, member: str, numel: int, keys: RoundKeys) -> torch.Tensor:
        """``PRG(b_u) + sum_{u<v} PRG(s_uv) - sum_{v<u} PRG(s_uv)`` modulo ``2**bits``."""
        bits = self.params.bits
        out = _prg(keys.self_seed(member), numel, bits)
        for other in self.peers:
            if other == member:
                continue
            pair = _prg(agreed_seed(keys.secret(member), keys.public(other)), numel, bits)
            out = (out + pair if member < other else out - pair) & self.modulus_mask
        return out

    def add(self, member: str, update: torch.Tensor, weight: float, counts: Mapping[str, int] | None = None) -> None:
        """Mask and add ``weight * update`` (``update``: the member's update, any float dtype and device) and its
        counters (``counts``: named 0/1 flags of the caller's, after the clamped count)."""
        if member not in self.peers:
            raise ValueError(f"{member!r} is not in the round's cohort {list(self.peers)}: it holds no pairwise keys")
        keys = RoundKeys(self.params, self.round_of, self.peers)
        q, clamped = self.quantised(update.detach().reshape(-1).to("cpu", torch.float64) * weight)
        named = {"clamped": clamped, **dict(sorted((counts or {}).items()))}
        if self.counters and tuple(named) != self.counters:
            raise ValueError(f"counters {tuple(named)} cannot join a fold of {self.counters}")
        self.counters = tuple(named)
        q = torch.cat([q, torch.tensor(list(named.values()), dtype=torch.int64)])
        masked = (q + self.masks(member, q.numel(), keys)) & self.modulus_mask
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
        dropped = [p for p in self.peers if p not in self.members]
        t = self.params.threshold
        if len(survivors) < t:
            raise SecureAggregationError(
                f"secure aggregation at {self.round_of.node_id!r} (round {self.round_of.round}): "
                f"{len(survivors)} of {len(self.peers)} children sent their masked update, fewer than the threshold "
                f"{t}, so the masks cannot be removed (secure_aggregation.threshold)"
            )
        keys = RoundKeys(self.params, self.round_of, self.peers)
        numel, bits, total = self.masked.numel(), self.params.bits, self.masked.cpu()
        for member in survivors:  # self-masks: seeds recovered from t survivors' shares
            seed = combine(_held(keys.shares(member, keys.self_seed(member), "self"), survivors, t))
            total = (total - _prg(seed, numel, bits)) & self.modulus_mask
        for gone in dropped:  # pairwise masks with a client that never sent: its key from the survivors' shares
            secret = secret_key(combine(_held(keys.shares(gone, keys.material(gone), "key"), survivors, t)))
            for member in survivors:
                pair = _prg(agreed_seed(secret, keys.public(member)), numel, bits)
                total = (total - pair if member < gone else total + pair) & self.modulus_mask
        half = 2 ** (bits - 1)
        self._open = torch.where(total >= half, total - 2**bits, total)
        return self._open

    def summed(self) -> torch.Tensor:
        """The unmasked sum of the weighted updates (float64, flat): ``sum_{u in U2} q_u / 2**fraction_bits``."""
        return self.unmasked()[: -len(self.counters)].to(torch.float64) / 2.0**self.params.fraction_bits

    def totals(self) -> dict[str, int]:
        """The counters summed over the members, unmasked with the update (no batch's own count is ever seen)."""
        return dict(zip(self.counters, self.unmasked()[-len(self.counters) :].tolist(), strict=True))

    def wire(self) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        tensors = {} if self.masked is None else {"masked": self.masked}
        numbers = {"weight": self.total_weight, **{f"{COUNTER}{name}": 1.0 for name in self.counters}}
        return tensors, {**numbers, **{f"{MEMBER}{m}": 1.0 for m in self.members}}

    def secagg_metrics(self) -> dict[str, float]:
        return {
            "secagg/clamped_values": float(self.totals()["clamped"]),
            "secagg/recovered_clients": float(len([p for p in self.peers if p not in self.members])),
        }


def _held(shares: Mapping[str, tuple[int, int]], survivors: Sequence[str], threshold: int) -> list[tuple[int, int]]:
    """The shares the first ``threshold`` survivors hand the server."""
    return [shares[s] for s in survivors[:threshold]]


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
