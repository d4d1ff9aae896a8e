"""What secure aggregation costs a round: key agreement, the mask PRG, masking and unmasking, beside the plain sum.

Prints, on this machine, one CPU thread:

1. key agreement per pair: the 1536-bit MODP Diffie-Hellman this project used before
   (RFC 3526 group 5, reimplemented here as it was: ``pow`` and SHA-256) against X25519
   plus HKDF-SHA256 (``secagg_crypto.agreed_seed``), and a key pair of each;
2. the mask PRG for a vector of 1M values: AES-256-CTR (``csprng.prg``, used) against
   ``torch.randint`` on a seeded CPU generator (used before) and numpy's Philox;
3. a round of ``MaskedSum`` (``secure_aggregation.py``) for cohorts of 10, 100 and 300 on
   a vector of ``--numel`` values, complete graph against SecAgg+'s sparse one (k = 2
   ceil(log2 m)), with 10% of the cohort dropped after masking: masking all members (what
   the workers do, summed over clients), unmasking (the server, with the survivors'
   shares), and the plain float64 sum of the same updates measured in the same run.

Run:  .venv/bin/python benchmarks/secagg.py [--numel 100000] [--cohorts 10 100 300]
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import time
from collections.abc import Callable

import numpy as np
import torch

from bhfl_core.algorithm.csprng import prg
from bhfl_core.algorithm.node_state import Caller
from bhfl_core.algorithm.privacy_params import SecAggParams
from bhfl_core.algorithm.secagg_crypto import agreed_seed, private_key, public_bytes
from bhfl_core.algorithm.secure_aggregation import MaskedSum

MODP_1536 = int(  # RFC 3526, group 5: what bhfl_core/algorithm/secagg_crypto.py used before X25519
    "FFFFFFFFFFFFFFFFC90FDAA22168C234C4C6628B80DC1CD129024E088A67CC74020BBEA63B139B22514A08798E3404DD"
    "EF9519B3CD3A431B302B0A6DF25F14374FE1356D6D51C245E485B576625E7EC6F44C42E9A637ED6B0BFF5CB6F406B7ED"
    "EE386BFB5A899FA5AE9F24117C4B1FE649286651ECE45B3DC2007CB8A163BF0598DA48361C55D39A69163FA8FD24CF5F"
    "83655D23DCA3AD961C62F356208552BB9ED529077096966D670C354E4ABC9804F1746C08CA237327FFFFFFFFFFFFFFFF",
    16,
)


def per_call(fn: Callable[[], object], repeat: int) -> float:
    """Seconds per call of ``fn``, best of three batches of ``repeat`` (after one warm-up call)."""
    fn()
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - start) / repeat)
    return best


def key_agreement() -> None:
    sk = int.from_bytes(hashlib.sha256(b"a").digest(), "big")
    peer = pow(2, int.from_bytes(hashlib.sha256(b"b").digest(), "big"), MODP_1536)

    def modp() -> int:
        shared = pow(peer, sk, MODP_1536)
        return int.from_bytes(hashlib.sha256(shared.to_bytes(192, "big")).digest()[:8], "big") >> 1

    own, other = private_key(os.urandom(16)), public_bytes(private_key(os.urandom(16)))
    old, new = per_call(modp, 200), per_call(lambda: agreed_seed(own, other, b"edge:1"), 2000)
    ratio = old / new
    print(f"key agreement per pair: MODP-1536 DH {old * 1e6:8.1f} us   X25519+HKDF {new * 1e6:6.1f} us ({ratio:.0f}x)")
    old_pair = per_call(lambda: pow(2, sk, MODP_1536), 200)
    new_pair = per_call(lambda: public_bytes(private_key(os.urandom(16))), 2000)
    print(f"key pair:               MODP-1536    {old_pair * 1e6:8.1f} us   X25519      {new_pair * 1e6:6.1f} us")


def prgs(numel: int = 1_000_000, bits: int = 48) -> None:
    seed = os.urandom(32)
    aes = per_call(lambda: prg(seed, numel, bits), 10)
    gen = torch.Generator()
    mt = per_call(lambda: torch.randint(0, 2**bits, (numel,), generator=gen.manual_seed(7), dtype=torch.int64), 10)
    philox = per_call(lambda: np.random.Generator(np.random.Philox(key=7)).integers(0, 2**bits, numel), 10)
    print(
        f"mask PRG, {numel:,} values: AES-256-CTR {aes * 1e3:.2f} ms   torch.randint (MT19937) {mt * 1e3:.2f} ms   "
        f"numpy Philox {philox * 1e3:.2f} ms"
    )


def round_cost(m: int, neighbours: int | None, numel: int) -> tuple[float, float, float]:
    """Seconds to mask every member, to unmask (10% dropped after masking), and of the plain sum."""
    peers = [f"c{i:03d}" for i in range(m)]
    threshold = (neighbours or m) // 2 + 1
    params = SecAggParams(threshold, mask_seed=3, neighbours=neighbours)
    gen = torch.Generator().manual_seed(m)
    updates = {p: torch.randn(numel, generator=gen, dtype=torch.float64) * 1e-2 for p in peers}
    dropped = set(peers[::10])
    fold = MaskedSum(params, Caller("edge", 1), peers)
    start = time.perf_counter()
    for p in peers:
        if p not in dropped:
            fold.add(p, updates[p], 1.0)
    masking = time.perf_counter() - start
    start = time.perf_counter()
    fold.unmasked()
    unmasking = time.perf_counter() - start
    start = time.perf_counter()
    plain = torch.zeros(numel, dtype=torch.float64)
    for p in peers:
        if p not in dropped:
            plain += updates[p]
    return masking, unmasking, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=100_000)
    parser.add_argument("--cohorts", type=int, nargs="+", default=[10, 100, 300])
    args = parser.parse_args()
    torch.set_num_threads(1)
    key_agreement()
    prgs()
    print(f"\na round on {args.numel:,} values, 10% dropped after masking (seconds; masking summed over clients):")
    print(f"{'cohort':>6} {'graph':>12} {'masking':>9} {'per client':>10} {'unmasking':>9} {'plain sum':>9}")
    for m in args.cohorts:
        k = min(2 * math.ceil(math.log2(m)), (m - 1) // 2 * 2)
        for label, neighbours in (("complete", None), (f"sparse k={k}", k)):
            masking, unmasking, plain = round_cost(m, neighbours, args.numel)
            survivors = m - len(range(0, m, 10))
            print(
                f"{m:>6} {label:>12} {masking:9.3f} {masking / survivors:10.4f} {unmasking:9.3f} {plain:9.4f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
