"""The cryptography secure aggregation stands on, simulated with real arithmetic and seeded keys.

Bonawitz et al. 2017 ("Practical secure aggregation for privacy-preserving machine
learning") needs two primitives, both here in their textbook form:

- **Key agreement** (Diffie-Hellman in the 1536-bit MODP group of RFC 3526): client ``u``
  has a secret key ``sk_u`` and publishes ``g^sk_u``; two clients derive the same seed
  ``H(g^(sk_u sk_v))`` without sending it. The secret keys are *derived* from (run seed,
  server, round, client) instead of drawn from the OS, so runs are reproducible: this is a
  simulation for experiments, not protection against a real adversary.
- **Shamir secret sharing** over the prime field ``2^127 - 1``: a secret split into ``n``
  shares, any ``t`` of which give it back (Lagrange interpolation at 0) and fewer reveal
  nothing. A client shares its secret key and its self-mask seed with its peers, so the
  server can remove the masks of a client that dropped out after masking (from the
  survivors' shares of its key) and the self-masks of those that did not.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

from bhfl_core.rng import derive_seed

# RFC 3526, group 5 (1536-bit MODP), generator 2
MODP_1536 = int(
    "FFFFFFFFFFFFFFFFC90FDAA22168C234C4C6628B80DC1CD129024E088A67CC74020BBEA63B139B22514A08798E3404DD"
    "EF9519B3CD3A431B302B0A6DF25F14374FE1356D6D51C245E485B576625E7EC6F44C42E9A637ED6B0BFF5CB6F406B7ED"
    "EE386BFB5A899FA5AE9F24117C4B1FE649286651ECE45B3DC2007CB8A163BF0598DA48361C55D39A69163FA8FD24CF5F"
    "83655D23DCA3AD961C62F356208552BB9ED529077096966D670C354E4ABC9804F1746C08CA237327FFFFFFFFFFFFFFFF",
    16,
)
GENERATOR = 2
SHAMIR_PRIME = 2**127 - 1


def key_seed(seed: int, *where: str | int) -> int:
    """A party's 126-bit key material (what it secret-shares), derived from ``seed`` and where it is used."""
    return (derive_seed(seed, *where, "high") << 63) | derive_seed(seed, *where, "low")


def secret_key(material: int) -> int:
    """The 256-bit secret exponent behind a party's key material."""
    return int.from_bytes(hashlib.sha256(f"sk:{material}".encode()).digest(), "big")


def public_key(secret: int) -> int:
    return pow(GENERATOR, secret, MODP_1536)


def agreed_seed(own_secret: int, their_public: int) -> int:
    """The 63-bit seed two parties share: a hash of ``g^(sk_u sk_v)``, the same from either side."""
    shared = pow(their_public, own_secret, MODP_1536)
    return int.from_bytes(hashlib.sha256(shared.to_bytes(192, "big")).digest()[:8], "big") >> 1


def split(secret: int, holders: int, threshold: int, seed: int) -> list[tuple[int, int]]:
    """``holders`` Shamir shares ``(x, f(x))`` of ``secret`` (< 2^127 - 1); any ``threshold`` recover it."""
    if not 1 <= threshold <= holders:
        raise ValueError(f"a threshold of {threshold} cannot work with {holders} share holders")
    draw = random.Random(seed)  # the polynomial's coefficients: seeded, so runs repeat
    coefficients = [secret % SHAMIR_PRIME, *(draw.randrange(SHAMIR_PRIME) for _ in range(threshold - 1))]
    return [(x, _polynomial(coefficients, x)) for x in range(1, holders + 1)]


def combine(shares: Sequence[tuple[int, int]]) -> int:
    """The secret behind ``shares`` (at least the threshold's number of them): Lagrange interpolation at 0."""
    secret = 0
    for i, (x_i, y_i) in enumerate(shares):
        numerator, denominator = 1, 1
        for j, (x_j, _) in enumerate(shares):
            if i != j:
                numerator = numerator * -x_j % SHAMIR_PRIME
                denominator = denominator * (x_i - x_j) % SHAMIR_PRIME
        secret = (secret + y_i * numerator * pow(denominator, -1, SHAMIR_PRIME)) % SHAMIR_PRIME
    return secret


def _polynomial(coefficients: Sequence[int], x: int) -> int:
    value = 0
    for c in reversed(coefficients):
        value = (value * x + c) % SHAMIR_PRIME
    return value
