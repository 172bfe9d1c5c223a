"""Where the curve becomes memory-bound, against what the KV arithmetic predicted, and what comes before it.

Regime 3 begins at the first point past the sweet spot (:mod:`batchbench.analysis.regimes`). It is memory-bound
only where the KV cache shows why (usage at the danger line, or preemptions); a plateau without that evidence is
compute-saturated (the engine reports its cache, and it is not full) or saturated (no KV data), and said as such,
so a cache a quarter full is never called memory-bound. The prediction is the planner's
(:func:`batchbench.analysis.planner.fit_in_capacity`) on the run's own model config, cache and workload, or the
sweep design's ``kv_fit`` label: the first measured concurrency above the number of sequences that fit is where
memory-bound should begin.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from batchbench.analysis.findings.points import Point, PointFindings
from batchbench.analysis.planner import CapacityFit
from batchbench.analysis.regimes import Regime, RegimeReport


@dataclass(frozen=True)
class MemoryBound:
    """Regime 3 of one curve: where it begins and as what, and where (if anywhere) it is memory-bound."""

    #: The first point past the sweet spot, and its regime.
    concurrency: int
    regime: Regime
    kv_usage_peak: float | None
    kv_fit_predicted: int | None
    #: The first measured concurrency above the predicted fit, where memory-bound should begin (None: no prediction).
    predicted_onset: int | None
    evidence: tuple[str, ...]
    #: The planner's arithmetic behind the prediction, from the model's config (None: no local config).
    kv_plan: CapacityFit | None = None
    #: The first memory-bound point (None: none within the sweep), its KV usage and preemptions.
    memory_bound_from: int | None = None
    memory_kv_usage_peak: float | None = None
    memory_preemptions: float | None = None
    #: The highest KV usage over the regime-3 points before the first memory-bound one (None: no KV data there).
    kv_usage_before: float | None = None

    @property
    def matches_prediction(self) -> bool | None:
        if self.predicted_onset is None:
            return None
        return self.memory_bound_from == self.predicted_onset

    JSON_DERIVED: ClassVar[tuple[str, ...]] = ("matches_prediction",)


def _most_common(values: Iterable[Any]) -> Any:
    present = Counter(v for v in values if v is not None)
    return present.most_common(1)[0][0] if present else None


def memory_bound(report: RegimeReport, points: Sequence[Point], found: Sequence[PointFindings]) -> MemoryBound | None:
    """Regime 3 of the curve with the prediction beside it; None when the sweep never left the sweet spot."""
    third = report.in_regime("memory-bound", "compute-saturated", "saturated")
    if not third:
        return None
    by_c = {p.concurrency: p for p in found}
    first = by_c[third[0].concurrency]
    memory = next((p for p in third if p.regime == "memory-bound"), None)
    before = [by_c[p.concurrency].kv_usage_peak for p in third
              if memory is None or p.concurrency < memory.concurrency]
    fit = _most_common(r.kv_fit for p in points for r in p.runs)
    above = sorted(p.concurrency for p in found if p.valid and fit is not None and p.concurrency > fit)
    return MemoryBound(first.concurrency, third[0].regime, first.kv_usage_peak, fit, above[0] if above else None,
                       first.run_ids, _most_common(r.kv_plan for p in points for r in p.runs),
                       memory_bound_from=memory.concurrency if memory is not None else None,
                       memory_kv_usage_peak=by_c[memory.concurrency].kv_usage_peak if memory is not None else None,
                       memory_preemptions=by_c[memory.concurrency].preemptions if memory is not None else None,
                       kv_usage_before=max((v for v in before if v is not None), default=None))


def _memory_evidence(m: MemoryBound) -> str:
    """``KV 98% full, 3 preemptions``: why a point is memory-bound."""
    parts = [f"KV {m.memory_kv_usage_peak:.0%} full"] if m.memory_kv_usage_peak is not None else []
    if m.memory_preemptions:
        parts.append(f"{m.memory_preemptions:.0f} preemptions")
    return ", ".join(parts)


def _plateau(m: MemoryBound) -> str | None:
    """``compute-saturated from 4 (KV at most 25% full, no preemptions)``: regime 3 before memory-bound, if any."""
    if m.regime == "memory-bound":
        return None
    if m.regime == "saturated":
        return f"no KV data (the engine reports no KV cache): saturated from batch {m.concurrency}"
    kv = f"KV at most {m.kv_usage_before:.0%} full" if m.kv_usage_before is not None else "no KV usage read"
    return f"compute-saturated from batch {m.concurrency} ({kv}, no preemptions: compute, not the cache, limits it)"


def clause(m: MemoryBound) -> str:
    """``, compute-saturated from 4 (...), memory-bound from 16 (KV 98% full; planned: ...)``: what the curve sentence
    adds."""
    parts = [plateau] if (plateau := _plateau(m)) is not None else []
    if m.memory_bound_from is not None:
        evidence = [e] if (e := _memory_evidence(m)) else []
        if m.kv_plan is not None:
            k = m.kv_plan
            evidence.append(f"planned: {k.kv_capacity_tokens:,} KV tokens at {k.kv_bytes_per_token:,} B/token hold "
                            f"{k.fit} sequences of {k.sequence_tokens} tokens")
        elif m.kv_fit_predicted is not None:
            evidence.append(f"predicted fit {m.kv_fit_predicted}")
        parts.append(f"memory-bound from {m.memory_bound_from}" + (f" ({'; '.join(evidence)})" if evidence else ""))
    return "".join(f", {part}" for part in parts)


def decision(m: MemoryBound | None, has_kv_data: bool) -> str:
    """The answer to "where does it become memory-bound?", one line."""
    if m is None:
        return "not reached within the sweep"
    if m.memory_bound_from is None:
        plateau = _plateau(m)
        assert plateau is not None
        return f"not memory-bound within the sweep: {plateau}" if has_kv_data else plateau
    text = f"batch {m.memory_bound_from}"
    if evidence := _memory_evidence(m):
        text += f" ({evidence})"
    if (plateau := _plateau(m)) is not None:
        text += f", after a plateau: {plateau}"
    if m.kv_plan is not None:
        k = m.kv_plan
        planned = f"the plan fits {k.fit} sequences of {k.sequence_tokens} tokens in {k.kv_capacity_tokens:,} tokens"
    elif m.kv_fit_predicted is not None:
        planned = f"the design fits {m.kv_fit_predicted} sequences"
    else:
        return text
    verdict = ("as predicted" if m.matches_prediction
               else f"predicted from {m.predicted_onset}" if m.predicted_onset is not None else "no prediction")
    return f"{text}; {planned}: {verdict}"
