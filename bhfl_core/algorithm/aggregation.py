"""Weighted sums of flat parameter vectors: add tensors and weights, divide late.

A ``WeightedSum`` is what travels from workers to their server: a worker that trains
several clients folds them into one running sum, so client models never sit in memory
together, and the server merges the workers' partial sums. Which clients a worker
gets depends on the placement and the number of workers, so the mean must not depend
on the order or grouping of the inputs — not even in the last bit, or runs with 1, 2
and 4 workers drift apart. A float64 sum rounds, differently for each grouping; the
float32 mean shows it rarely (~1e-9 per element), but over 1e8 parameters and many
rounds it does. This sum does not round at all in the range documented on the class,
and the mean is rounded once, at the end, to the float32 nearest the exact mean.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from fractions import Fraction

import numpy as np
import torch

from bhfl_core.algorithm import exact_kernels
from bhfl_core.algorithm.exact_kernels import array

Allocator = Callable[[str, int, torch.dtype], torch.Tensor]
"""Zeroed storage for a sum's part: ``(name, numel, dtype) -> tensor``."""
CLOSED = "mean"
"""The part a closed sum consists of (``close``), and sends: ``hi`` and ``lo`` may never leave their process."""

_CHUNK = 1 << 18
"""Elements per pass on a CPU: an ``add`` works in 3 scratch buffers of 2 MiB (cache-sized) whatever the model size."""
_GPU_CHUNK = 1 << 24
"""Elements per pass on a GPU: 128 MiB scratch buffers, so a 110M-parameter fold is 7 passes of ~10 kernels each,
not 420 (kernel launches, not memory, bound a GPU fold in small chunks; ``mean`` waits for the GPU once per pass)."""

_BELOW_FLOAT32 = (1 << 29) - 1
"""The 29 bits of a float64 significand below float32's 23: the part a float32 cast rounds away."""
_TIE = 1 << 28
"""Those bits of a value exactly half-way between two float32s."""
_NEAR_TIE = 64
"""float64 units (at least 2**-47 |q|) around a tie within which ``mean`` checks its rounding exactly."""
_FLOAT32_TINY = 2.0**-126
"""The smallest normal float32: below it float32 rounds at another bit, so ``mean`` checks exactly."""

_SPLITTER = 134217729.0
"""2**27 + 1: Veltkamp's constant, splits a float64 into two 26-bit halves whose products are exact."""
_FUSED_MIN = 1 << 22
"""Elements from which a CPU sum uses the fused loops (exact_kernels.py): 4M parameters, where a fold saves
~8 ms and numba's one-time import (~1 s a process) pays for itself within a run; smaller models never import it."""
_NEAR_CAPACITY = 1 << 16
"""Indices a fused ``mean`` collects before it stops to round them exactly (near ties: ~1 in 4M for random
values, up to ~1% for some structured ones, such as inputs that are multiples of each other)."""


class WeightedSum:
    """Running ``sum_i w_i * x_i`` and ``sum_i w_i`` over float32 vectors, as a float64 double-double.

    The sum is kept as two float64 tensors, ``hi + lo``: every input is folded in
    with Knuth's error-free TwoSum, so ``hi`` is the rounded sum and ``lo`` collects
    exactly what rounding dropped. Exactness rests on two assumptions:

    - each product ``w_i * x_i`` is exact in float64: ``x_i`` is float32 (24-bit
      significand) and ``w_i`` an integer below 2**29 (29 bits; 24 + 29 = 53). The
      weights here are example counts. A non-integer weight still works but makes
      the mean depend (rarely, in the last bit) on the order again;
    - per element, the exact sum fits the ~106 bits of ``hi + lo``. It does when
      ``N * W * max|x| / min|x| <= 2**80`` (N inputs, total weight W, the extremes
      over the non-zero inputs of that element), e.g. 1000 clients with 10**6
      examples whose values of one parameter lie within a factor 10**15 of each
      other. Beyond that (e.g. +-2**60 cancelling beside 2**-60 in one element) the
      error is still below about ``2 * N * 2**-106 * sum w|x|``, but the mean's last
      bit may then depend on the order.

    Under these assumptions ``hi + lo`` is the exact sum, whatever the order of the
    ``add`` and ``merge`` calls, and ``mean()`` is the correctly rounded float32 of
    exact sum / exact weight: bit-identical across groupings.

    Costs (110M elements, one core of a 2-core AMD EPYC VM, pages already touched): a
    sum holds two float64 vectors (1.6 GiB, twice a float64 sum, and twice the bytes a
    worker sends). On a CPU, sums of ``_FUSED_MIN`` elements or more run in fused loops
    (exact_kernels.py): ``add`` 0.07 s (torch's in-place chunked passes: 0.25 s; a
    float32 ``add_``, a plain loop's fold: 0.025 s), ``merge`` 0.10 s (0.28 s), ``mean``
    0.08 s (0.41 s). On a GPU the torch passes run over 16M-element chunks.
    """

    def __init__(
        self, total: torch.Tensor | None = None, weight: float = 0.0, allocate: Allocator | None = None
    ) -> None:
        """An empty sum, or one read back from a stored ``total`` (``lo = 0``; the tensor is taken over, not copied).

        ``allocate(name, numel, dtype)`` (optional) gives the storage of ``hi`` (written in
        full by the first vector before it is read, so it may come uninitialised) and of
        ``lo`` (zeroed) when the first vector arrives: a worker folds straight into shared memory
        (``Transfer.allocate`` in bhfl_core/store/transfer.py, via tasks/fold_storage.py), so
        its sum leaves the process without a copy. Without it the sum lives on the first
        vector's device.
        """
        self.hi: torch.Tensor | None = None if total is None else total.to(torch.float64).contiguous()
        self.lo: torch.Tensor | None = None if self.hi is None else torch.zeros_like(self.hi)
        self.weight = float(weight)
        self._allocate = allocate
        self._closed: torch.Tensor | None = None  # the mean, once ``close`` replaced the sum by it

    @classmethod
    def of(cls, hi: torch.Tensor, lo: torch.Tensor, weight: float) -> WeightedSum:
        """A sum from its two parts as ``parts`` gave them (taken over, not copied)."""
        out = cls(weight=weight)
        out.hi, out.lo = hi, lo
        return out

    @classmethod
    def closed_of(cls, mean: torch.Tensor, weight: float) -> WeightedSum:
        """A closed sum from its mean as ``parts`` gave it (taken over, not copied)."""
        out = cls(weight=weight)
        out._closed = mean
        return out

    def parts(self) -> dict[str, torch.Tensor]:
        """``hi`` and ``lo`` by name, or a closed sum's ``mean`` (empty for an empty sum): what travels."""
        if self._closed is not None:
            return {CLOSED: self._closed}
        return {} if self.hi is None or self.lo is None else {"hi": self.hi, "lo": self.lo}

    def close(self) -> None:
        """Replace the sum by its mean: for the one partial of a whole round, where it was folded.

        The mean is the same float32 wherever it is computed (exact float64 operations,
        the same on a CPU and a GPU), so a worker that trained all of a round's children
        computes it on its device and sends 4 bytes per parameter instead of the sum's 16,
        and the parent has no mean to compute. A closed sum takes no more contributions;
        merged into an empty one it is taken over as it is.
        """
        if self._closed is not None or self.hi is None:
            return
        out = self._allocate(CLOSED, self.hi.numel(), torch.float32) if self._allocate is not None else None
        self._closed = self.mean(out)
        self.hi = self.lo = None

    def add(self, vector: torch.Tensor, weight: float) -> None:
        """Fold one float32 input with weight ``weight`` (its number of training examples).

        ``vector`` may live on another device than the sum: it is copied chunk by chunk.
        """
        if not weight > 0:
            raise ValueError(f"aggregation weight must be positive, got {weight}")
        self._check_open()
        if self.hi is None or self.lo is None:
            n = vector.numel()
            if self._allocate is not None:
                hi, lo = self._allocate("hi", n, torch.float64), self._allocate("lo", n, torch.float64)
                self.hi, self.lo = hi.view(vector.shape), lo.view(vector.shape)
            else:
                self.hi = torch.empty(vector.shape, dtype=torch.float64, device=vector.device)
                self.lo = torch.zeros(vector.shape, dtype=torch.float64, device=vector.device)
            if self._fuses(vector):
                exact_kernels.kernels()["scale_into"](array(self.hi), array(vector), float(weight))
            else:
                size = _chunk_size(self.hi)
                for hi, x in zip(_chunked(self.hi, size), _chunked(vector, size)):
                    hi.copy_(x).mul_(weight)  # exact: float32 x integer < 2**29
        else:
            self._check_shape(vector)
            if self._fuses(vector):
                exact_kernels.kernels()["add_into"](array(self.hi), array(self.lo), array(vector), float(weight))
            else:
                for hi, lo, x, (p, s, t) in _chunks(self.hi, self.lo, vector):
                    p.copy_(x).mul_(weight)
                    _two_sum_into(hi, lo, p, s, t)
        self.weight += float(weight)

    def merge(self, other: WeightedSum, consume: bool = False) -> None:
        """Fold another partial sum (e.g. from another worker): TwoSum of the ``hi`` parts, ``lo`` parts added.

        ``consume``: ``other`` is not used afterwards, so an empty sum takes over its
        storage instead of copying it (a parent folding its workers' sums).
        """
        if other._closed is not None:
            if not self.empty:
                raise ValueError("a closed sum (a whole round's mean) cannot join other contributions")
            self._closed, self.weight = other._closed, other.weight
            return
        self._check_open()
        if other.hi is None or other.lo is None:
            return
        if self.hi is None or self.lo is None:
            self.hi, self.lo = (other.hi, other.lo) if consume else (other.hi.clone(), other.lo.clone())
        elif self._fuses(other.hi, other.lo):
            self._check_shape(other.hi)
            exact_kernels.kernels()["merge_into"](array(self.hi), array(self.lo), array(other.hi), array(other.lo))
        else:
            self._check_shape(other.hi)
            size = _chunk_size(self.hi)
            for (hi, lo, x, (p, s, t)), y in zip(_chunks(self.hi, self.lo, other.hi), _chunked(other.lo, size)):
                p.copy_(x)
                _two_sum_into(hi, lo, p, s, t)
                lo.add_(t.copy_(y))  # through the scratch: ``other`` may live on another device
        self.weight += other.weight

    @property
    def empty(self) -> bool:
        return self.hi is None and self._closed is None

    @property
    def total(self) -> torch.Tensor | None:
        """``sum_i w_i * x_i`` rounded once to float64 (None when empty).

        What is stored (bhfl_core/store/node_store.py); ``WeightedSum(total, weight)`` reads
        it back as exactly that float64 value, so a stored sum stays deterministic.
        """
        self._check_open()
        return None if self.hi is None or self.lo is None else self.hi + self.lo

    def mean(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 nearest to (exact sum) / (total weight), ties to even (into ``out``, if given).

        Per element: ``s = RN(hi + lo)`` depends on the exact sum only (it is that sum
        rounded once), so ``q = s / w`` is a function of the exact sum, within 2**-52 |q|
        of the exact quotient. Rounding ``q`` to float32 is then right unless a float32
        tie lies within that distance, i.e. unless the 29 bits of ``q``'s significand
        below float32's are within a few units of ``100...0``; those elements (and
        float32 subnormals, rounded at another bit) are checked: an exact quotient
        (``q * w == hi + lo``, e.g. the mean of two neighbouring floats) is right as it
        is, the others (rare) are rounded with exact rational arithmetic. Bit tests on
        ``q`` keep the common path to a few passes over each cache-sized chunk (or one
        fused loop, exact_kernels.py).
        """
        if self._closed is not None:
            return self._closed
        if self.hi is None or self.lo is None:
            raise ValueError("cannot average an empty WeightedSum")
        if out is None:
            out = torch.empty(self.hi.shape, dtype=torch.float32, device=self.hi.device)
        out = out.view(self.hi.shape)
        if self._fuses(out):
            self._fused_mean(out)
            return out
        w = self.weight
        size = _chunk_size(self.hi)
        n = min(size, self.hi.numel())
        q_buf = torch.empty(n, dtype=torch.float64, device=self.hi.device)
        bits_buf = torch.empty(n, dtype=torch.int64, device=self.hi.device)
        for hi, lo, f in zip(_chunked(self.hi, size), _chunked(self.lo, size), _chunked(out, size)):
            q, low = q_buf[: hi.numel()], bits_buf[: hi.numel()]
            torch.add(hi, lo, out=q).div_(w)
            f.copy_(q)
            torch.bitwise_and(q.view(torch.int64), _BELOW_FLOAT32, out=low).sub_(_TIE).abs_()
            near = ((low <= _NEAR_TIE) | ((f.abs() < _FLOAT32_TINY) & (f != 0))).nonzero().flatten()
            if len(near):
                _round_exactly(hi, lo, w, f, near)
        return out

    def _fused_mean(self, out: torch.Tensor) -> None:
        """``mean`` in the fused loop (exact_kernels.py), stopping to round each batch of near ties exactly."""
        assert self.hi is not None and self.lo is not None
        hi, lo, f = self.hi.reshape(-1), self.lo.reshape(-1), out.reshape(-1)
        near = np.empty(_NEAR_CAPACITY, dtype=np.int64)
        q_block, round_mean = exact_kernels.block_buffer(), exact_kernels.kernels()["round_mean"]
        start = 0
        while start < hi.numel():
            start, found = round_mean(
                array(hi), array(lo), self.weight, array(f), start, near, q_block,
                _BELOW_FLOAT32, _TIE, _NEAR_TIE, _FLOAT32_TINY,
            )  # fmt: skip
            if found:
                _round_exactly(hi, lo, self.weight, f, torch.from_numpy(near[:found].copy()))

    def _fuses(self, *others: torch.Tensor) -> bool:
        """Whether this operation takes the fused CPU loops: a large sum on the CPU, every operand fit for them."""
        assert self.hi is not None and self.lo is not None
        return self.hi.numel() >= _FUSED_MIN and exact_kernels.fused(self.hi, self.lo, *others)

    def _check_open(self) -> None:
        if self._closed is not None:
            raise ValueError("a closed sum (a whole round's mean) takes no more contributions")

    def _check_shape(self, vector: torch.Tensor) -> None:
        assert self.hi is not None
        if vector.shape != self.hi.shape:
            raise ValueError(
                f"cannot add a vector of shape {tuple(vector.shape)} to a sum of shape {tuple(self.hi.shape)}"
            )


def _round_exactly(hi: torch.Tensor, lo: torch.Tensor, w: float, f: torch.Tensor, near: torch.Tensor) -> None:
    """Settle ``f[near]``, the float32 means whose rounding ``q = (hi + lo) / w`` cannot decide (``mean``).

    An exact quotient (``q * w == hi + lo``, e.g. the mean of two neighbouring floats) is
    right as it is; the others (rare) are rounded with exact rational arithmetic.
    """
    w_hi = w * _SPLITTER - (w * _SPLITTER - w)
    w_lo = w - w_hi
    q = (hi[near] + lo[near]) / w
    s, e = _two_sum(hi[near], lo[near])
    p, pe = _two_prod(q, w, w_hi, w_lo)
    inexact = near[(p != s) | (pe != e)]
    exact_mean = [
        _nearest_float32((Fraction(a) + Fraction(b)) / Fraction(w))
        for a, b in zip(hi[inexact].tolist(), lo[inexact].tolist())
    ]
    f[inexact] = torch.tensor(exact_mean, dtype=torch.float32, device=f.device)


def _chunk_size(tensor: torch.Tensor) -> int:
    """Elements per pass over a sum living where ``tensor`` lives (the results do not depend on it: every
    operation is elementwise)."""
    return _CHUNK if tensor.device.type == "cpu" else _GPU_CHUNK


def _chunked(tensor: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Consecutive flat views of ``size`` elements (the last one shorter)."""
    return list(torch.split(tensor.reshape(-1), size))


def _chunks(
    hi: torch.Tensor, lo: torch.Tensor, x: torch.Tensor
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]]:
    """(hi, lo, x) chunk views with three float64 scratch buffers of the chunk's length, allocated once."""
    size = _chunk_size(hi)
    scratch = [torch.empty(min(size, hi.numel()), dtype=torch.float64, device=hi.device) for _ in range(3)]
    for h, low, v in zip(_chunked(hi, size), _chunked(lo, size), _chunked(x, size)):
        yield h, low, v, [b[: h.numel()] for b in scratch]


def _two_sum_into(hi: torch.Tensor, lo: torch.Tensor, p: torch.Tensor, s: torch.Tensor, t: torch.Tensor) -> None:
    """``(hi, lo) += p`` in place: ``hi = RN(hi + p)``, ``lo +=`` the exact rounding error (Knuth's TwoSum).

    Six float64 operations, valid for any magnitudes; ``p`` is consumed, ``s`` and
    ``t`` are scratch.
    """
    torch.add(hi, p, out=s)  # s = RN(hi + p)
    torch.sub(s, hi, out=t)  # t = the part of s that came from p
    p.sub_(t)  # what of p was lost
    torch.sub(s, t, out=t)  # t = the part of s that came from hi
    hi.sub_(t).add_(p)  # hi = what of hi was lost + what of p was lost = the exact error
    lo.add_(hi)
    hi.copy_(s)


def _two_sum(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(RN(a + b), the exact error): a + b == s + e exactly."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _two_prod(a: torch.Tensor, b: float, b_hi: float, b_lo: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RN(a * b), the exact error) by Dekker's product (no FMA in torch); ``b_hi + b_lo`` is ``b``'s Veltkamp split."""
    p = a * b
    c = a * _SPLITTER
    a_hi = c - (c - a)
    a_lo = a - a_hi
    return p, ((a_hi * b_hi - p) + a_hi * b_lo + a_lo * b_hi) + a_lo * b_lo


def _nearest_float32(q: Fraction) -> float:
    """The float32 nearest to ``q``, ties to even, by exact comparison with its neighbours."""
    guess = np.float32(float(q))  # within one float32 ulp: float() rounds correctly, the cast rounds again
    candidates = (np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf)))
    best = min(candidates, key=lambda c: (abs(Fraction(float(c)) - q), int(np.array(c).view(np.uint32)) & 1))
    return float(best)
