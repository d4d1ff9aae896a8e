"""Decompositions at one thread: a server's SVD whose bits must not depend on the machine it runs on.

LAPACK splits the sums of a large decomposition by thread: a 768 x 768 float64 SVD gave
four different results at 1, 2, 4 and 8 threads (square matrices from 256 on differ;
up to 192 they did not). The servers' decompositions (``aggregation: exact``'s fold,
``adapter_rule.refactorise``, and its product-space steps, ``adapter_mix.py``) run in
the orchestrator, at the threads its cores leave over from the workers, or in a Prefect
task thread at whatever that thread was given; without a fixed count an exact run's
models would depend on the machine and on the number of workers. One thread for the
call gives the same bits everywhere for one torch build (not across BLAS libraries or
builds). torch's thread count is the calling thread's (OpenMP's per-thread setting:
checked, a thread that sets 1 leaves the others' count and results as they were), so
other threads' work is not slowed. The cost: one core for the call, 0.3-0.6 s for a
768 x 768 SVD on this project's 2-core machines, where the orchestrator had one thread
anyway.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def one_thread() -> Iterator[None]:
    """Run the block with the calling thread's torch (and LAPACK) threads set to 1; restored after it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
