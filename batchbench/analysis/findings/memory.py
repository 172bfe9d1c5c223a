"""Where the curve becomes memory-bound, against what the KV arithmetic predicted.

Regime 3 begins at the first point past the sweet spot (:mod:`batchbench.analysis.regimes`); it is memory-bound
on an engine whose KV cache shows why (usage at the danger line, preemptions, a growing queue). The
prediction is the planner's (:func:`batchbench.analysis.planner.fit_in_capacity`) on the run's own model config,
cache and workload, or the sweep design's ``kv_fit`` label: the first measured concurrency above the
number of sequences that fit is where it should begin.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from batchbench.analysis.findings.points import Point, PointFindings
from batchbench.analysis.planner import CapacityFit
from batchbench.analysis.regimes import Regime, RegimeReport


@dataclass(frozen=True)
class MemoryBound:
    concurrency: int
    regime: Regime
    kv_usage_peak: float | None
    kv_fit_predicted: int | None
    #: The first measured concurrency above the predicted fit, where regime 3 should begin (None: no prediction).
    predicted_onset: int | None
    evidence: tuple[str, ...]
    #: The planner's arithmetic behind the prediction, from the model's config (None: no local config).
    kv_plan: CapacityFit | None = None

    @property
    def matches_prediction(self) -> bool | None:
        return None if self.predicted_onset is None else self.predicted_onset == self.concurrency

    def to_dict(self) -> dict[str, Any]:
        return {"concurrency": self.concurrency, "regime": self.regime, "kv_usage_peak": self.kv_usage_peak,
                "kv_fit_predicted": self.kv_fit_predicted, "predicted_onset": self.predicted_onset,
                "kv_plan": None if self.kv_plan is None else self.kv_plan.to_dict(),
                "matches_prediction": self.matches_prediction, "evidence": list(self.evidence)}


def _most_common(values: Iterable[Any]) -> Any:
    present = Counter(v for v in values if v is not None)
    return present.most_common(1)[0][0] if present else None


def memory_bound(report: RegimeReport, points: Sequence[Point], found: Sequence[PointFindings]) -> MemoryBound | None:
    """The first point of regime 3 with the prediction beside it; None when the sweep never left regime 2."""
    third = report.in_regime("memory-bound", "saturated")
    if not third:
        return None
    first = next(p for p in found if p.concurrency == third[0].concurrency)
    fit = _most_common(r.kv_fit for p in points for r in p.runs)
    above = sorted(p.concurrency for p in found if p.valid and fit is not None and p.concurrency > fit)
    return MemoryBound(first.concurrency, third[0].regime, first.kv_usage_peak, fit, above[0] if above else None,
                       first.run_ids, _most_common(r.kv_plan for p in points for r in p.runs))


def clause(m: MemoryBound) -> str:
    """``, memory-bound from 8 (KV 98% full; planned: ...)``: what the curve sentence adds."""
    evidence = []
    if m.kv_usage_peak is not None:
        evidence.append(f"KV {m.kv_usage_peak:.0%} full")
    if m.kv_plan is not None:
        k = m.kv_plan
        evidence.append(f"planned: {k.kv_capacity_tokens:,} KV tokens at {k.kv_bytes_per_token:,} B/token hold "
                        f"{k.fit} sequences of {k.sequence_tokens} tokens")
    elif m.kv_fit_predicted is not None:
        evidence.append(f"predicted fit {m.kv_fit_predicted}")
    return f", {m.regime} from {m.concurrency}" + (f" ({'; '.join(evidence)})" if evidence else "")


def decision(m: MemoryBound | None, has_kv_data: bool) -> str:
    """The answer to "where does it become memory-bound?", one line."""
    if m is None:
        return "not reached within the sweep"
    if m.regime == "saturated":
        text = f"saturated (no KV limit shown) from batch {m.concurrency}"
        return text + ("" if has_kv_data else ": the engine reports no KV cache")
    text = f"from batch {m.concurrency}"
    if m.kv_usage_peak is not None:
        text += f" (KV {m.kv_usage_peak:.0%} full)"
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
