"""The three regimes of the latency-throughput curve, read off a concurrency sweep.

A closed-loop sweep (1, 2, 4, ... requests in flight) traces how an engine
trades latency for throughput. Three regimes appear in order:

1. **under-utilised**: the engine has idle capacity; more concurrency still
   buys throughput.
2. **sweet spot**: the smallest batch size whose throughput is within
   :data:`PEAK_SHARE` of the most the sweep measured. One definition, used by
   the answer, the report's figures and the suites: past it, more requests
   add latency (by Little's law, a closed loop's latency is its concurrency
   over its throughput), not throughput.
3. past the sweet spot, named by what the measurements show:
   **memory-bound** where the KV cache shows why (usage at the danger line
   :data:`~batchbench.measures.guardrails.KV_DANGER`, or preemptions): extra
   requests wait for blocks, throughput is flat or falls (preempted requests
   are recomputed) and TTFT p99 rises sharply; **compute-saturated** where the
   engine reports its KV cache and it is not full (the engine's compute, a CPU
   core, is the limit: a plateau, not a memory wall); **saturated** where the
   engine reports no KV cache at all (a static batcher past its padded batch):
   queueing is all the numbers can show.

Everything here is a pure function of the measured points, so the rules can
be tested on synthetic curves and applied to any engine's sweep.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from batchbench.analysis.repeats import Estimate, median
from batchbench.core.records import RequestRecord
from batchbench.core.server_metrics import ServerMetrics
from batchbench.measures.guardrails import KV_DANGER
from batchbench.measures.metrics import Distribution, Summary

__all__ = [
    "PEAK_SHARE",
    "REGIME_RANK",
    "LabelledPoint",
    "Placed",
    "Regime",
    "RegimeReport",
    "SweepPoint",
    "against_peak",
    "classify_regimes",
    "corroborated_best",
    "gain_per_doubling",
    "median_of",
    "point_from_run",
    "steady_state_ttfts",
]

Regime = Literal["under-utilised", "sweet-spot", "memory-bound", "compute-saturated", "saturated"]

#: Regimes in the order a sweep meets them; the three names of regime 3 share a rank.
REGIME_RANK: dict[Regime, int] = {"under-utilised": 0, "sweet-spot": 1, "memory-bound": 2, "compute-saturated": 2,
                                  "saturated": 2}

#: The sweet spot is the smallest batch size whose throughput is at least this share of the most measured: within
#: 10% of the peak, a difference an operator would trade for the smaller batch's shorter queue (and about the
#: spread of one run on a noisy two-vCPU machine, so noise rarely moves it by more than one sweep step).
PEAK_SHARE = 0.9


Placed = Literal["apart", "as good", "undecided"]


def against_peak(ratio: Estimate | None) -> Placed | None:
    """Where a point's throughput over the peak's (a ratio with its interval) places it: ``apart`` when the interval
    excludes 1, ``as good`` when it holds 1 within the sweet spot's margin ([:data:`PEAK_SHARE`, 1 / PEAK_SHARE]),
    ``undecided`` when it holds 1 but reaches past the margin (the data can tell neither); None without an
    interval."""
    if ratio is None or ratio.low is None or ratio.high is None:
        return None
    if ratio.differs_from_one:
        return "apart"
    return "as good" if ratio.low >= PEAK_SHARE and ratio.high <= 1 / PEAK_SHARE else "undecided"


@dataclass(frozen=True)
class SweepPoint:
    """One concurrency level of a sweep, as measured (or the median over its repeats: :func:`median_of`).

    ``kv_usage_peak`` (fraction of capacity), ``preemptions`` (during the run)
    and ``waiting_peak`` (requests queued engine-side) are None when the engine
    does not expose them.
    """

    concurrency: int
    throughput: float
    ttft_p50: float
    ttft_p99: float
    kv_usage_peak: float | None = None
    preemptions: float | None = None
    waiting_peak: float | None = None

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, not {self.concurrency!r}")
        for name in ("throughput", "ttft_p50", "ttft_p99", "kv_usage_peak", "preemptions", "waiting_peak"):
            value = getattr(self, name)
            if value is not None and (math.isnan(value) or value < 0):
                raise ValueError(f"{name} must be a number >= 0, not {value!r}")


@dataclass(frozen=True)
class LabelledPoint:
    """A sweep point with its regime and the evidence the label rests on."""

    point: SweepPoint
    regime: Regime
    #: Throughput gain per doubling of concurrency from the previous point (None for the first).
    gain_from_previous: float | None
    #: Its throughput over the sweep's highest (1.0 at the peak).
    share_of_peak: float
    #: Memory evidence: KV usage >= KV_DANGER, or preemptions during the run.
    memory_pressure: bool
    #: TTFT p99 over the sweet spot's TTFT p99 (inf when the sweet spot's is 0).
    ttft_p99_ratio: float

    @property
    def concurrency(self) -> int:
        return self.point.concurrency


@dataclass(frozen=True)
class RegimeReport:
    """Every point labelled, in increasing concurrency, and the sweet spot."""

    points: tuple[LabelledPoint, ...]
    sweet_spot: int
    #: Whether the engine reported its KV cache: regime 3 is memory-bound or compute-saturated, else saturated.
    has_kv_data: bool
    peak_share: float
    kv_danger: float

    @property
    def labels(self) -> dict[int, Regime]:
        return {p.concurrency: p.regime for p in self.points}

    @property
    def sweet(self) -> LabelledPoint:
        return next(p for p in self.points if p.regime == "sweet-spot")

    def in_regime(self, *regimes: Regime) -> list[LabelledPoint]:
        return [p for p in self.points if p.regime in regimes]

    def table(self) -> list[dict[str, object]]:
        """One JSON-able row per point, for benchmark extra_info and reports."""
        return [
            {
                "concurrency": p.concurrency,
                "regime": p.regime,
                "throughput": p.point.throughput,
                "ttft_p50": p.point.ttft_p50,
                "ttft_p99": p.point.ttft_p99,
                "kv_usage_peak": p.point.kv_usage_peak,
                "preemptions": p.point.preemptions,
                "waiting_peak": p.point.waiting_peak,
                "gain_from_previous": p.gain_from_previous,
                "share_of_peak": p.share_of_peak,
                "ttft_p99_ratio": p.ttft_p99_ratio,
            }
            for p in self.points
        ]


def gain_per_doubling(c_from: int, t_from: float, c_to: int, t_to: float) -> float:
    """Throughput gain per doubling of concurrency between two points: (t_to/t_from)^(1/log2(c_to/c_from)) - 1.

    Normalising per doubling makes steps of different sizes comparable
    (1 → 4 is two doublings), and a perfectly linear curve gives 1.0 for
    every pair. A zero starting throughput gains infinitely from any
    positive one (and nothing from zero).
    """
    if c_to <= c_from:
        raise ValueError(f"c_to must exceed c_from, not {c_from} → {c_to}")
    if t_from <= 0:
        return math.inf if t_to > 0 else 0.0
    return float((t_to / t_from) ** (1.0 / math.log2(c_to / c_from)) - 1.0)


def classify_regimes(
    points: Sequence[SweepPoint], *, peak_share: float = PEAK_SHARE, kv_danger: float = KV_DANGER
) -> RegimeReport:
    """Label each sweep point with its regime and find the sweet spot.

    Rules, in increasing concurrency:

    - The **sweet spot** is the first point whose throughput reaches ``peak_share`` of the sweep's highest. A
      sweep that still scales at its end has its sweet spot at (or near) the last point: regime 3 was not reached.
    - Every point below it is **under-utilised**.
    - Every point past it is in regime 3: more concurrency no longer buys a worthwhile gain, so it only adds
      latency. It is **memory-bound** only with memory evidence at that point: KV usage >= ``kv_danger``, or
      preemptions. A plateau without it is **compute-saturated** on an engine that reports its KV cache (the cache
      is not what limits it), and **saturated** on one that reports none.

    The labels therefore always come out in regime order, and memory-bound never precedes under-utilised. The
    TTFT spike that marks regime 3 is reported per point (``ttft_p99_ratio``) for the caller to check against its
    own physics rather than being a threshold buried here.
    """
    if not points:
        raise ValueError("a sweep needs at least one point")
    if not 0 < peak_share <= 1:
        raise ValueError(f"peak_share must be in (0, 1], not {peak_share!r}")
    if not 0 < kv_danger <= 1:
        raise ValueError(f"kv_danger must be in (0, 1], not {kv_danger!r}")
    ordered = sorted(points, key=lambda p: p.concurrency)
    levels = [p.concurrency for p in ordered]
    if len(set(levels)) != len(levels):
        raise ValueError(f"each concurrency must appear once (combine repeats with median_of), not {levels}")

    peak = max(p.throughput for p in ordered)
    knee = next(i for i, p in enumerate(ordered) if p.throughput >= peak_share * peak)
    sweet = ordered[knee]
    has_kv = any(p.kv_usage_peak is not None for p in ordered)

    labelled = []
    for i, p in enumerate(ordered):
        pressure = (p.kv_usage_peak is not None and p.kv_usage_peak >= kv_danger) or bool(p.preemptions)
        regime: Regime
        if i < knee:
            regime = "under-utilised"
        elif i == knee:
            regime = "sweet-spot"
        elif pressure:
            regime = "memory-bound"
        else:
            regime = "compute-saturated" if has_kv else "saturated"
        previous = None if i == 0 else gain_per_doubling(
            ordered[i - 1].concurrency, ordered[i - 1].throughput, p.concurrency, p.throughput)
        ratio = p.ttft_p99 / sweet.ttft_p99 if sweet.ttft_p99 > 0 else math.inf
        share = p.throughput / peak if peak > 0 else 1.0
        labelled.append(LabelledPoint(p, regime, previous, share, pressure, ratio))
    return RegimeReport(tuple(labelled), sweet.concurrency, has_kv, peak_share, kv_danger)


def corroborated_best(values: Sequence[float], agreement: float) -> float | None:
    """The highest value that another repeat comes within ``agreement`` of (from below); None if none does.

    A measurement whose repeats never agree has not converged: one lucky or
    unlucky second decided it. Whether this exists says when to stop
    repeating.
    """
    if not 0 <= agreement < 1:
        raise ValueError(f"agreement must be in [0, 1), not {agreement!r}")
    ordered = sorted(values, reverse=True)
    for best, runner_up in itertools.pairwise(ordered):
        if runner_up >= (1 - agreement) * best:
            return best
    return None


def median_of(repeats: Sequence[SweepPoint]) -> SweepPoint:
    """Combine repeated measurements of one concurrency by their medians (memory evidence: the highest).

    The median is the repeat protocol's (:mod:`batchbench.analysis.repeats`); which repeats to combine (the
    quiet ones) is the caller's :meth:`~batchbench.analysis.repeats.Repeats.kept`.

    Where the speed a run sees varies both ways (a stall slows a run; a short
    run can also land in an unusually fast second), the median is the
    estimate that neither a single stalled nor a single lucky repeat moves:
    the knee of a sweep is decided by ratios between neighbouring points, and
    one fluke at one point would shift it.
    """
    if not repeats:
        raise ValueError("median_of needs at least one repeat")
    levels = {p.concurrency for p in repeats}
    if len(levels) != 1:
        raise ValueError(f"repeats of one point must share a concurrency, not {sorted(levels)}")

    def peak(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return max(present) if present else None

    return SweepPoint(
        concurrency=repeats[0].concurrency,
        throughput=median([p.throughput for p in repeats]),
        ttft_p50=median([p.ttft_p50 for p in repeats]),
        ttft_p99=median([p.ttft_p99 for p in repeats]),
        kv_usage_peak=peak([p.kv_usage_peak for p in repeats]),
        preemptions=peak([p.preemptions for p in repeats]),
        waiting_peak=peak([p.waiting_peak for p in repeats]),
    )


def steady_state_ttfts(records: Sequence[RequestRecord], concurrency: int) -> list[float]:
    """TTFTs of a closed-loop run's ok requests, without its opening burst.

    A closed loop starts by sending ``concurrency`` requests at once, so
    their prompts are prefilled together, a cost (and, on a static batcher,
    an alignment) that the loop never sees again once requests come and go
    one by one. Those first ``concurrency`` sends are left out, unless
    nothing else is left.
    """
    ok = sorted((r for r in records if r.ok and r.ttft_s is not None), key=lambda r: r.sent_s)
    steady = ok[concurrency:] or ok
    return [r.ttft_s for r in steady if r.ttft_s is not None]


def point_from_run(
    concurrency: int,
    summary: Summary,
    samples: Sequence[ServerMetrics],
    baseline: ServerMetrics | None = None,
    *,
    records: Sequence[RequestRecord] | None = None,
) -> SweepPoint:
    """The sweep point one run measured: its summary plus the peaks of its scraped server metrics.

    With ``records``, TTFT percentiles are the closed loop's steady state
    (:func:`steady_state_ttfts`); else the summary's. Preemptions are a
    counter since engine start, so the run's own are the last sample minus
    ``baseline`` (a scrape taken just before the run; the first sample of the
    run when none is given).
    """
    ttfts = steady_state_ttfts(records, concurrency) if records is not None else None
    ttft = Distribution.of(ttfts) if ttfts is not None else summary.ttft
    if ttft is None:
        raise ValueError(f"the run at concurrency {concurrency} has no successful request to take TTFT from")

    def peak(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return max(present) if present else None

    preemptions = None
    start = baseline if baseline is not None else (samples[0] if samples else None)
    if samples and start is not None and samples[-1].preemptions is not None and start.preemptions is not None:
        preemptions = max(0.0, samples[-1].preemptions - start.preemptions)
    return SweepPoint(
        concurrency=concurrency,
        throughput=summary.output_token_throughput,
        ttft_p50=ttft.p50,
        ttft_p99=ttft.p99,
        kv_usage_peak=peak([s.kv_usage for s in samples]),
        preemptions=preemptions,
        waiting_peak=peak([s.waiting for s in samples]),
    )
