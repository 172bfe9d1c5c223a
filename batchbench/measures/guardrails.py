"""Operational guardrails from the scraped server time series.

What an operator watches on a serving fleet: how full the KV cache gets and
for how long it sits in the danger zone (>= 85%: the next burst preempts or
queues), queue depth, preemptions and rejections during the run.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from batchbench.core.server_metrics import ServerMetrics

#: KV-cache usage from which an engine is one burst away from preempting or queueing: the one threshold of
#: "the cache is full" (the guardrails' danger zone, regime 3's memory pressure, the report's danger line).
#: A paged engine admits a request when its prompt's blocks fit and grows it a block at a time, so a cache
#: that is 85% used cannot take one more sequence of a few blocks without waiting or preempting on any
#: realistically sized cache.
KV_DANGER = 0.85


def _values(samples: Sequence[ServerMetrics], field: str) -> list[tuple[float, float]]:
    return [(s.t, v) for s in samples if (v := getattr(s, field)) is not None]


def _increase(samples: Sequence[ServerMetrics], field: str) -> float | None:
    """Growth of a cumulative counter over the run (counters run since engine start).

    Only rises count, so an engine restarted mid-run (counter back to zero) does not subtract.
    """
    values = [v for _, v in _values(samples, field)]
    if len(values) < 2:
        return None
    return sum(max(0.0, b - a) for a, b in itertools.pairwise(values))


@dataclass(frozen=True)
class Guardrails:
    """What one run's scrapes say about the engine's headroom (None: the engine does not expose it)."""

    #: Scrapes taken during the run.
    samples: int
    kv_usage_peak: float | None
    kv_danger_threshold: float
    #: Scrapes that carried a KV usage, and those of them at or above the threshold.
    kv_samples: int
    kv_danger_samples: int
    #: Whether KV usage reached the danger zone (None: no KV usage exposed), and when first.
    kv_danger_entered: bool | None
    kv_danger_first_s: float | None
    kv_danger_time_s: float | None
    kv_capacity_tokens: float | None
    waiting_peak: float | None
    running_peak: float | None
    #: Counter increases during this run (the counters are cumulative since engine start).
    preemptions: float | None
    rejections: float | None

    @property
    def danger_zone(self) -> bool:
        return self.kv_danger_samples > 0


def server_summary(samples: Sequence[ServerMetrics]) -> Guardrails:
    """Peaks, counter increases and the KV danger-zone flag of one run's scrapes.

    Time in the danger zone is the sum of the intervals that start at a
    sample at or above the threshold: the scrape interval is the resolution.
    """
    samples = sorted(samples, key=lambda s: s.t)
    kv = _values(samples, "kv_usage")
    danger_s = sum(t1 - t0 for (t0, v), (t1, _) in itertools.pairwise(kv) if v >= KV_DANGER)
    entered = next((t for t, v in kv if v >= KV_DANGER), None)
    waiting = [v for _, v in _values(samples, "waiting")]
    running = [v for _, v in _values(samples, "running")]
    capacity = [v for _, v in _values(samples, "kv_capacity_tokens")]
    return Guardrails(
        samples=len(samples),
        kv_usage_peak=max((v for _, v in kv), default=None),
        kv_danger_threshold=KV_DANGER,
        kv_samples=len(kv),
        kv_danger_samples=sum(1 for _, v in kv if v >= KV_DANGER),
        kv_danger_entered=entered is not None if kv else None,
        kv_danger_first_s=entered,
        kv_danger_time_s=danger_s if kv else None,
        kv_capacity_tokens=capacity[-1] if capacity else None,
        waiting_peak=max(waiting, default=None),
        running_peak=max(running, default=None),
        preemptions=_increase(samples, "preemptions"),
        rejections=_increase(samples, "rejections"),
    )
