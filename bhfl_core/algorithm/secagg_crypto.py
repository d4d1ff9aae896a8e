"""The primitives secure aggregation stands on, all real (the ``cryptography`` package); only their use is simulated.

Bonawitz et al. 2017 ("Practical secure aggregation for privacy-preserving machine
learning") needs three:

- **Key agreement**: X25519 (RFC 7748). Each party has a private key and publishes its
  public key; two parties derive the same shared secret without sending it, and
  **HKDF-SHA256** (RFC 5869) turns it into a 32-byte mask seed bound to the round.
- **A PRG** expanding a seed into a mask vector: ``csprng.prg``, AES-256 in counter mode.
- **Shamir secret sharing** over the prime field ``2^130 - 5``: a 16-byte secret split
  into shares, any ``threshold`` of which give it back (Lagrange interpolation at 0) and
  fewer say nothing about it. What a party shares is its 16-byte *key material* (its X25519
  private key is ``HKDF(material)``: 128 bits, X25519's own security level) and its 16-byte
  self-mask seed.

Where the randomness comes from (derived from the run seed, or drawn from the OS) is
the caller's: ``secagg_parties.RoundDealer``.
"""

from __future__ import annotations

from collections.abc import Sequence

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from bhfl_core.algorithm.csprng import prg_bytes

SHAMIR_PRIME = 2**130 - 5  # Poly1305's prime: holds any 16-byte secret
SECRET_BYTES = 16

Share = tuple[int, int]
"""A Shamir share ``(x, f(x))``: the holder's point and the polynomial's value there."""


def hkdf(material: bytes, info: bytes, length: int = 32) -> bytes:
    """HKDF-SHA256 of ``material`` (no salt), bound to ``info``: what every key and seed here derives through."""
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info).derive(material)


def private_key(material: bytes) -> X25519PrivateKey:
    """The X25519 private key behind 16 bytes of key material (what a party secret-shares)."""
    return X25519PrivateKey.from_private_bytes(hkdf(material, b"bhfl secagg x25519"))


def public_bytes(key: X25519PrivateKey) -> bytes:
    """The 32-byte public key a party advertises."""
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def agreed_seed(own: X25519PrivateKey, their_public: bytes, context: bytes) -> bytes:
    """The 32-byte pairwise mask seed: HKDF of the X25519 shared secret, bound to ``context`` (the round).

    The same from either side: ``agreed_seed(a, pub(b)) == agreed_seed(b, pub(a))``.
    """
    shared = own.exchange(X25519PublicKey.from_public_bytes(their_public))
    return hkdf(shared, b"bhfl secagg pair mask " + context)


def polynomial(secret: bytes, threshold: int, entropy: bytes) -> list[int]:
    """Shamir's polynomial for ``secret``: the secret at 0, ``threshold - 1`` coefficients drawn from ``entropy``.

    Each coefficient is 32 bytes of AES-CTR output reduced modulo the 130-bit prime (a bias
    below ``2^-120``).
    """
    if threshold < 1:
        raise ValueError(f"a Shamir threshold must be at least 1, got {threshold}")
    stream = prg_bytes(entropy, 32 * (threshold - 1))
    drawn = [int.from_bytes(stream[32 * i : 32 * i + 32], "big") % SHAMIR_PRIME for i in range(threshold - 1)]
    return [int.from_bytes(secret, "big"), *drawn]


def share(coefficients: Sequence[int], x: int) -> Share:
    """The share held at point ``x`` (``x >= 1``; 0 is the secret): Horner's rule modulo the prime."""
    value = 0
    for c in reversed(coefficients):
        value = (value * x + c) % SHAMIR_PRIME
    return x, value


def interpolate(shares: Sequence[Share]) -> int:
    """The polynomial through ``shares`` (distinct points) evaluated at 0: Lagrange interpolation modulo the prime.

    With at least the threshold's number of shares this is the secret; with fewer it is
    *some* field element, and every secret is equally consistent with them.
    """
    secret = 0
    for i, (x_i, y_i) in enumerate(shares):
        numerator, denominator = 1, 1
        for j, (x_j, _) in enumerate(shares):
            if i != j:
                numerator = numerator * -x_j % SHAMIR_PRIME
                denominator = denominator * (x_i - x_j) % SHAMIR_PRIME
        secret = (secret + y_i * numerator * pow(denominator, -1, SHAMIR_PRIME)) % SHAMIR_PRIME
    return secret


def combine(shares: Sequence[Share]) -> bytes:
    """The 16-byte secret behind ``shares`` (at least the threshold's number); a value past 16 bytes is refused."""
    secret = interpolate(shares)
    if secret >= 1 << (8 * SECRET_BYTES):
        raise ValueError("these shares do not interpolate to a 16-byte secret (too few, or not of one polynomial)")
    return secret.to_bytes(SECRET_BYTES, "big")
