"""The parties of a secure-aggregation round, each holding only what it would hold in Bonawitz et al. 2017.

A simulation in one process (or a worker and the orchestrator), with the protocol's
information flow:

- ``RoundDealer``: the set-up rounds 0 and 1 (key advertisement, share distribution),
  done by the orchestrator for everyone. Every party's secrets derive by HKDF from the
  round's 32-byte root: derived from (run seed, server, round) (``randomness: seeded``,
  runs repeat) or drawn from ``os.urandom`` when the round is planned
  (``randomness: secure``). It hands each client object its own secrets, its
  neighbours' public keys and the shares its neighbours sent it; the server object gets
  the public keys only. (A real client draws its own keys and sends its shares encrypted
  to each neighbour through the server; no PKI, no authenticated channels here.)
- ``SecAggClient``: its key material (X25519 private key = HKDF of it), its self-mask
  seed, its neighbours' public keys and, for the unmasking round, the shares it received.
  It masks its vector (round 2) and, asked by the server (round 4), reveals for each
  neighbour either the share of its self-mask seed (it survived) or of its key (it
  dropped), never both for one neighbour, and nothing if fewer than the threshold survived.
- ``SecAggServer``: the public keys, the mask graph, the masked sum and the shares the
  survivors hand it. It removes the self-masks of the survivors and the pairwise masks of
  the dropped; it never holds a survivor's key material nor a dropped client's self seed.

No consistency checks against a malicious server (round 3's signatures) are simulated.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

import torch

from bhfl_core.algorithm.csprng import prg
from bhfl_core.algorithm.secagg_crypto import (
    SECRET_BYTES,
    Share,
    agreed_seed,
    combine,
    hkdf,
    polynomial,
    private_key,
    public_bytes,
    share,
)
from bhfl_core.algorithm.secagg_graph import mask_graph


class SecureAggregationError(RuntimeError):
    """A round whose masks cannot be removed, or a request a party refuses: it fails rather than leak or publish
    garbage."""


KEY, SELF = "key", "self"  # the two secrets a client shares: its key material, its self-mask seed


def self_mask_seed(seed: bytes, context: bytes) -> bytes:
    """The AES key of a client's self-mask stream, from its 16-byte self-mask seed and the round."""
    return hkdf(seed, b"bhfl secagg self mask " + context)


class SecAggClient:
    """One client of one round: its own secrets, its neighbours' public keys, the shares it received (module doc)."""

    def __init__(
        self,
        name: str,
        context: bytes,
        secrets: tuple[bytes, bytes],
        neighbour_keys: Mapping[str, bytes],
        threshold: int,
        received: Mapping[str, Mapping[str, Share]] | None = None,
    ) -> None:
        self.name, self.context, self.threshold = name, context, threshold
        self._material, self._self_seed = secrets  # its key material and self-mask seed: never sent whole
        self.neighbour_keys = dict(neighbour_keys)
        self.received = {kind: dict(shares) for kind, shares in (received or {}).items()}  # kind -> owner -> share
        self._answered: dict[str, str] = {}  # owner -> the kind of share revealed for it

    def masks(self, numel: int, bits: int) -> torch.Tensor:
        """``PRG(b_u) + sum_{v in N(u), u<v} PRG(s_uv) - sum_{v in N(u), v<u} PRG(s_uv)`` modulo ``2**bits``."""
        out = prg(self_mask_seed(self._self_seed, self.context), numel, bits)
        own, modulus = private_key(self._material), (1 << bits) - 1
        for other, public in self.neighbour_keys.items():
            pair = prg(agreed_seed(own, public, self.context), numel, bits)
            out = (out + pair if self.name < other else out - pair).bitwise_and_(modulus)
        return out

    def respond(self, survivors: Collection[str], dropped: Collection[str]) -> dict[str, Share]:
        """Round 4: for each owner it holds shares of, the share of its self seed (a survivor) or of its key (dropped).

        Refused (``SecureAggregationError``): fewer survivors than the threshold, a party
        named both survivor and dropped, this client named dropped, or an owner whose
        other share was revealed before (both would open its vector).
        """
        survived, gone = set(survivors), set(dropped)
        if len(survived) < self.threshold:
            raise SecureAggregationError(
                f"{self.name!r} refuses to reveal shares: {len(survived)} survivors, fewer than the threshold "
                f"{self.threshold}"
            )
        if survived & gone or self.name in gone:
            raise SecureAggregationError(f"{self.name!r} refuses an unmasking request naming a party both ways")
        out = {}
        for owner in self.received.get(KEY, {}):
            if owner not in survived and owner not in gone:
                continue
            kind = SELF if owner in survived else KEY
            if self._answered.setdefault(owner, kind) != kind:
                raise SecureAggregationError(
                    f"{self.name!r} refuses to reveal the {kind} share of {owner!r}: it revealed the other before"
                )
            out[owner] = self.received[kind][owner]
        return out


class SecAggServer:
    """What the server of one round holds: public keys, the mask graph, masked sums, shares handed in (module doc)."""

    def __init__(
        self,
        node_id: str,
        context: bytes,
        threshold: int,
        bits: int,
        public_keys: Mapping[str, bytes],
        graph: Mapping[str, Sequence[str]],
    ) -> None:
        self.node_id, self.context, self.threshold, self.bits = node_id, context, threshold, bits
        self.public_keys, self.graph = dict(public_keys), {p: tuple(n) for p, n in graph.items()}
        self.shares: dict[str, dict[str, list[Share]]] = {KEY: {}, SELF: {}}  # kind -> owner -> shares handed in
        self.recovered: dict[str, dict[str, bytes]] = {KEY: {}, SELF: {}}  # kind -> owner -> secret rebuilt

    def unmask(self, total: torch.Tensor, survivors: Sequence[str], ask: Callable[[str], SecAggClient]) -> torch.Tensor:
        """The sum of the survivors' vectors: ``total`` (their masked vectors summed) less every mask not cancelled.

        ``ask``: how the server reaches a survivor in round 4 (the simulated channel).
        """
        peers = tuple(self.public_keys)
        dropped = [p for p in peers if p not in survivors]
        for member in survivors:
            for owner, got in ask(member).respond(survivors, dropped).items():
                self.shares[SELF if owner in survivors else KEY].setdefault(owner, []).append(got)
        numel, modulus = total.numel(), (1 << self.bits) - 1
        for member in survivors:  # self-masks
            seed = self._recover(SELF, member)
            total = (total - prg(self_mask_seed(seed, self.context), numel, self.bits)).bitwise_and_(modulus)
        for gone in dropped:  # the pairwise masks the survivors added with a client that never sent
            if not any(n in survivors for n in self.graph[gone]):
                continue  # no survivor masked with it: nothing to remove
            key = private_key(self._recover(KEY, gone))
            for member in (n for n in self.graph[gone] if n in survivors):
                pair = prg(agreed_seed(key, self.public_keys[member], self.context), numel, self.bits)
                total = (total - pair if member < gone else total + pair).bitwise_and_(modulus)
        return total

    def _recover(self, kind: str, owner: str) -> bytes:
        got = self.shares[kind].get(owner, [])
        if len(got) < self.threshold:
            what = "self-mask seed" if kind == SELF else "key"
            raise SecureAggregationError(
                f"secure aggregation at {self.node_id!r}: {len(got)} shares of {owner!r}'s {what} came back, fewer "
                f"than the threshold {self.threshold}, so its masks cannot be removed (secure_aggregation.threshold)"
            )
        self.recovered[kind][owner] = secret = combine(got[: self.threshold])
        return secret


class RoundDealer:
    """The simulated set-up of one round (rounds 0 and 1): every party's secrets from the root, shares dealt.

    Only the orchestrator's glue (``secure_aggregation.MaskedSum``) holds one; it hands
    each party object its part. Per client, the work is its neighbourhood's: its own keys,
    its neighbours' public keys, the shares its neighbours dealt it.
    """

    def __init__(
        self, root: bytes, context: bytes, peers: Sequence[str], neighbours: int | None, threshold: int
    ) -> None:
        self._root, self.context, self.peers, self.threshold = root, context, tuple(peers), threshold
        self.graph = mask_graph(self.peers, neighbours, hkdf(root, b"bhfl secagg graph " + context))
        self._point = {p: i + 1 for i, p in enumerate(self.peers)}  # each party's Shamir x
        self._publics: dict[str, bytes] = {}
        self._polynomials: dict[tuple[str, str], list[int]] = {}

    def _secret(self, kind: str, party: str) -> bytes:
        return hkdf(self._root, f"bhfl secagg {kind} {party} ".encode() + self.context, SECRET_BYTES)

    def public(self, party: str) -> bytes:
        if party not in self._publics:
            self._publics[party] = public_bytes(private_key(self._secret(KEY, party)))
        return self._publics[party]

    def public_keys(self) -> dict[str, bytes]:
        return {p: self.public(p) for p in self.peers}

    def client(self, party: str, with_shares: bool = False) -> SecAggClient:
        """``party``'s client object: to mask (round 2), or with the shares dealt to it to answer round 4."""
        received = None
        if with_shares:
            holders = (party, *self.graph[party])  # it holds a share of its own secrets and of each neighbour's
            received = {k: {o: share(self._polynomial(k, o), self._point[party]) for o in holders} for k in (KEY, SELF)}
        return SecAggClient(
            party,
            self.context,
            (self._secret(KEY, party), self._secret(SELF, party)),
            {n: self.public(n) for n in self.graph[party]},
            self.threshold,
            received,
        )

    def _polynomial(self, kind: str, owner: str) -> list[int]:
        if (kind, owner) not in self._polynomials:
            entropy = hkdf(self._root, f"bhfl secagg shamir {kind} {owner} ".encode() + self.context)
            self._polynomials[kind, owner] = polynomial(self._secret(kind, owner), self.threshold, entropy)
        return self._polynomials[kind, owner]
