"""Who masks with whom: the complete graph of Bonawitz et al. 2017, or SecAgg+'s sparse one (Bell et al. 2020).

With the complete graph every pair of a round's cohort shares a pairwise mask and every
party holds a share of every other's secrets: ``m - 1`` masks per client, ``m^2`` in all.
SecAgg+ ("Secure single-server aggregation with (poly)logarithmic overhead") masks each
client with ``k = O(log m)`` neighbours only, and shares its secrets with them only (the
Shamir threshold is then per neighbourhood): ``k`` masks per client, flat in the cohort.

The sparse graph here is the Harary graph ``H(k, m)`` (each client joined to the ``k/2``
nearest on each side of a ring) over the cohort in a shuffled order. Why not Bell et
al.'s random k-regular (Erdos-Renyi style) graph: the Harary graph is exactly k-regular
and k-connected for every even ``k < m`` (no rejection sampling, no isolated or
under-connected client whose neighbourhood is too small for the threshold), and a client
finds its neighbours from its ring position alone. The shuffle is drawn per round from
the round's root secret (``secagg_parties.RoundDealer``: seeded, or from the OS), so which
clients share masks changes every round and, with ``randomness: secure``, cannot be
predicted. ``k`` must be even (odd ``k`` needs an even cohort, and cohorts change size
with dropouts); ``k >= m - 1`` is the complete graph.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def mask_graph(peers: Sequence[str], neighbours: int | None, entropy: bytes) -> dict[str, tuple[str, ...]]:
    """Each peer's neighbours (in the cohort's order): all others (``neighbours`` None, or ``>= len(peers) - 1``)
    or the Harary graph ``H(neighbours, len(peers))`` over a shuffle keyed by ``entropy``."""
    m = len(peers)
    if neighbours is None or neighbours >= m - 1:
        return {p: tuple(q for q in peers if q != p) for p in peers}
    if neighbours < 2 or neighbours % 2:
        raise ValueError(f"a sparse mask graph needs an even number of neighbours of at least 2, got {neighbours}")
    ring = sorted(peers, key=lambda p: hashlib.sha256(entropy + p.encode()).digest())
    position = {p: i for i, p in enumerate(ring)}
    order = {p: i for i, p in enumerate(peers)}
    half = neighbours // 2
    out = {}
    for p in peers:
        i = position[p]
        near = {ring[(i + d) % m] for d in range(-half, half + 1) if d}
        out[p] = tuple(sorted(near, key=order.__getitem__))
    return out
