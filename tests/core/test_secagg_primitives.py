"""Secure aggregation's primitives (secagg_crypto.py, csprng.py, secagg_graph.py) against reference values, and the
secure noise source of ``dp`` (privacy.noise with ``randomness: secure``)."""

import os
from dataclasses import replace

import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from scipy.stats import chisquare, kstest

from bhfl_core.algorithm.csprng import prg, secure_normal
from bhfl_core.algorithm.node_state import RoundKey
from bhfl_core.algorithm.privacy import noise
from bhfl_core.algorithm.privacy_params import PrivacyParams
from bhfl_core.algorithm.secagg_crypto import (
    SHAMIR_PRIME,
    agreed_seed,
    combine,
    hkdf,
    interpolate,
    polynomial,
    private_key,
    public_bytes,
    share,
)
from bhfl_core.algorithm.secagg_graph import mask_graph


def test_hkdf_is_rfc_5869_and_key_agreement_is_symmetric_and_bound_to_the_round():
    # RFC 5869, test case 3 (SHA-256, no salt, no info)
    okm = "8da4e775a563c18f715f802a063c5a31b8a11f5c5ee1879ec3454e5f3c738d2d9d201395faa4b61a96c8"
    assert hkdf(b"\x0b" * 22, b"", 42).hex() == okm
    a, b, c = (private_key(bytes([i]) * 16) for i in (1, 2, 3))
    ab = agreed_seed(a, public_bytes(b), b"edge:1")
    assert ab == agreed_seed(b, public_bytes(a), b"edge:1") and len(ab) == 32
    assert ab not in (agreed_seed(a, public_bytes(c), b"edge:1"), agreed_seed(a, public_bytes(b), b"edge:2"))


def test_the_prg_is_the_aes_256_ctr_keystream_and_uniform_below_two_to_the_bits():
    seed = bytes(range(32))
    ecb = Cipher(algorithms.AES(seed), modes.ECB()).encryptor()  # the keystream by hand: AES_k(0), AES_k(1), ...
    stream = b"".join(ecb.update(i.to_bytes(16, "big")) for i in range(4))
    words = [int.from_bytes(stream[8 * i : 8 * i + 8], "little") for i in range(8)]
    assert prg(seed, 8, 48).tolist() == [w & (2**48 - 1) for w in words]
    top = prg(os.urandom(32), 100_000, 48) >> 40
    assert top.min() >= 0 and chisquare(torch.bincount(top, minlength=256).numpy()).pvalue > 1e-4


def test_shamir_any_threshold_shares_rebuild_the_secret_and_fewer_say_nothing_about_it():
    secret = os.urandom(16)
    t, points = 4, range(1, 8)
    shares = [share(polynomial(secret, t, bytes(32)), x) for x in points]
    assert combine(shares[:t]) == combine([shares[6], shares[1], shares[4], shares[2]]) == secret
    # below the threshold: over fresh polynomials of one secret, t - 1 shares interpolate to unrelated values
    fresh = [polynomial(secret, t, os.urandom(32)) for _ in range(50)]
    guesses = {interpolate([share(coefficients, x) for x in points[: t - 1]]) for coefficients in fresh}
    assert len(guesses) == 50 and int.from_bytes(secret, "big") not in guesses
    assert max(guesses) > SHAMIR_PRIME // 2  # spread over the whole field, not near the secret


def test_the_sparse_graph_is_k_regular_symmetric_and_redrawn_each_round():
    peers = [f"c{i:03d}" for i in range(300)]
    graph = mask_graph(peers, 18, b"round 1")
    assert all(len(n) == 18 and p not in n for p, n in graph.items())
    assert all(p in graph[q] for p, n in graph.items() for q in n)  # symmetric: each pair masks on both sides
    assert graph != mask_graph(peers, 18, b"round 2") and graph == mask_graph(peers, 18, b"round 1")
    complete = mask_graph(peers[:5], 4, b"")  # k >= m - 1: every pair
    assert complete == mask_graph(peers[:5], None, b"") and complete["c000"] == ("c001", "c002", "c003", "c004")


def test_secure_dp_noise_is_gaussian_of_the_asked_std_and_never_repeats():
    seeded = PrivacyParams(clip=1.0, noise_multiplier=1.0, expected=4, population=4, noise_seed=5)
    key = RoundKey("root", 0)
    assert torch.equal(noise(seeded, key, 10, 2.0, "update"), noise(seeded, key, 10, 2.0, "update"))
    secure = replace(seeded, randomness="secure")
    first, second = noise(secure, key, 200_000, 2.0, "update"), noise(secure, key, 200_000, 2.0, "update")
    assert not torch.equal(first, second) and first.dtype == torch.float64
    assert kstest((first / 2.0).numpy(), "norm").pvalue > 1e-4 and abs(float(first.std()) - 2.0) < 0.02
    assert secure_normal(0).shape == (0,)
