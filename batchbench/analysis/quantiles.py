"""A percentile of pooled requests with its own interval, distribution-free, from order statistics.

A run's p99 from 80 requests is about its largest TTFT, and the mean of such maxima over repeats says nothing of
how far the true p99 could be. Pooling a point's requests over its repeats and bounding the percentile by order
statistics needs no assumption about the latencies' distribution: with ``B`` the number of samples below the true
q-quantile, ``B ~ Binomial(n, q)``, so the k-th smallest sample lies above it with probability ``P(B <= k - 1)``.
The interval ``[X_(l), X_(u)]`` takes the largest ``l`` and the smallest ``u`` whose tails are each at most
``(1 - confidence) / 2``: at least ``confidence`` coverage, whatever the distribution. Where even the smallest (or
largest) sample is not far enough out, that end does not exist: a p99 needs ``0.99 ** n <= 0.025``, 368 samples,
before it has an upper bound at 95%; with fewer it is marked as too few, with the count it would need (MLPerf's
LoadGen likewise sets a minimum query count for tail latency).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

from batchbench.analysis.repeats import CONFIDENCE
from batchbench.measures.metrics import percentile

#: Where a quantile lies against a limit (:meth:`Quantile.against`).
Side = Literal["within", "beyond", "straddles", "too few"]


@dataclass(frozen=True)
class Quantile:
    """The ``q``-quantile of ``n`` pooled samples, with its distribution-free interval; an end is None where ``n``
    is too small to bound the quantile on that side."""

    q: float
    value: float
    low: float | None
    high: float | None
    n: int
    #: Samples a two-sided bound at this confidence needs.
    needed: int

    JSON_DERIVED: ClassVar[tuple[str, ...]] = ("bounded",)

    @property
    def bounded(self) -> bool:
        return self.low is not None and self.high is not None

    def against(self, limit: float) -> Side:
        """Where the quantile lies against ``limit``: its whole interval within it or beyond it, an interval that
        straddles it, or too few samples to bound it on the side that would decide."""
        if self.low is not None and self.low > limit:
            return "beyond"
        if self.high is not None and self.high <= limit:
            return "within"
        return "straddles" if self.bounded else "too few"

    def reachable(self, runs: int, max_runs: int) -> bool:
        """Whether more runs like the ``runs`` it pools (their samples on average), up to ``max_runs`` in all,
        would give it the samples it needs to be bounded."""
        return not self.bounded and runs > 0 and self.n + self.n / runs * (max_runs - runs) >= self.needed


def _cdf(n: int, q: float) -> list[float]:
    """``P(B <= k)`` for ``k = 0..n``, ``B ~ Binomial(n, q)``, summed in log space (no overflow for large n)."""
    if q <= 0.0 or q >= 1.0:
        raise ValueError(f"q must be strictly between 0 and 1, not {q}")
    log_q, log_p = math.log(q), math.log1p(-q)
    total, out = 0.0, []
    for k in range(n + 1):
        log_pmf = math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * log_q + (n - k) * log_p
        total += math.exp(log_pmf)
        out.append(min(total, 1.0))
    return out


def order_ranks(n: int, q: float, confidence: float = CONFIDENCE) -> tuple[int | None, int | None]:
    """The 1-based ranks ``(l, u)`` of the order statistics bounding the ``q``-quantile of ``n`` samples (module
    docstring); None for an end ``n`` cannot give."""
    tail = (1.0 - confidence) / 2
    cdf = _cdf(n, q)
    # X_(k) lies above the quantile with probability P(B <= k - 1) = cdf[k - 1]; below it with 1 - cdf[k - 1].
    low = max((k for k in range(1, n + 1) if cdf[k - 1] <= tail), default=None)
    high = min((k for k in range(1, n + 1) if 1.0 - cdf[k - 1] <= tail), default=None)
    return low, high


def needed(q: float, confidence: float = CONFIDENCE) -> int:
    """The fewest samples whose order statistics bound the ``q``-quantile on both sides: the smallest sample must be
    below it, and the largest above it, each with the tail's confidence."""
    tail = (1.0 - confidence) / 2
    return max(math.ceil(math.log(tail) / math.log(q)), math.ceil(math.log(tail) / math.log1p(-q)))


def pooled(values: Sequence[float], q: float, confidence: float = CONFIDENCE) -> Quantile | None:
    """The ``q``-quantile of ``values`` (as :func:`~batchbench.measures.metrics.percentile` reports it) with its
    order-statistic interval; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    low, high = order_ranks(len(ordered), q, confidence)
    value = percentile(ordered, q * 100)
    # From a handful of samples the interpolated estimate can fall just outside the order statistics' interval:
    # widened to hold it, which only adds coverage.
    return Quantile(q, value, None if low is None else min(ordered[low - 1], value),
                    None if high is None else max(ordered[high - 1], value), len(ordered), needed(q, confidence))
