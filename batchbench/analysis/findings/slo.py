"""The SLO: each point judged against it, the most goodput under it, and the largest batch that holds it.

A percentile objective (``ttft_p99``) is judged on the point's requests pooled over its repeats, by the
percentile's distribution-free interval (:mod:`batchbench.analysis.quantiles`): the point **meets** it when the
interval's upper end is within the limit, **fails** it when its lower end is beyond, and is **near the limit** when
the interval straddles it. Where the requests are too few to bound the percentile on the side that would decide
(a p99 needs 368 for an upper bound at 95%), it is judged **too few requests**, with the count it would need: the
mean of each run's own p99, a run's largest TTFT or so, says nothing of how far the true p99 could be. A mean or
max objective is judged on the estimate over the runs of each run's own value
(:class:`~batchbench.analysis.repeats.Estimate`) the same way, and one too thin to decide on
(:meth:`~batchbench.analysis.repeats.Estimate.thin`: fewer than three repeats and an interval wider than the
precision asked) is judged **too few repeats**. A decision built on an undecided point says so rather than
picking a side.

The latency pool is sized by walking up the curve while every point meets the SLO's TTFT objectives
(all of its objectives when it has none on TTFT): the last such point is the largest batch that holds
them, and the first other point says why the walk stopped. A point too thin to judge neither holds nor stops
the walk: it is named beside the answer as undecided.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from batchbench.analysis.findings.points import Point, PointFindings
from batchbench.analysis.findings.text import ms, ms_estimate, ms_quantile
from batchbench.analysis.quantiles import Quantile, Side, pooled
from batchbench.analysis.repeats import DEFAULT_PRECISION, Estimate
from batchbench.core import codec
from batchbench.measures.slo import Objective, Slo

Judgement = Literal["meets", "fails", "near the limit", "too few repeats", "too few requests", "unknown"]
#: A pooled percentile's judgement by where its interval lies against the limit.
_POOLED: dict[Side, Judgement] = {"within": "meets", "beyond": "fails", "straddles": "near the limit",
                                  "too few": "too few requests"}
#: Judgements of data too thin to decide: they neither hold nor stop the latency pool's walk.
UNDECIDED: tuple[Judgement, ...] = ("too few repeats", "too few requests")


@dataclass(frozen=True)
class ObjectiveAt:
    """One objective at one point: its value over the runs, its pooled percentile, and the judgement."""

    objective: Objective
    #: The estimate over the runs of each run's own value (what a mean or max objective is judged on).
    value: Estimate | None
    #: Whether that value is too thin to decide on (module docstring).
    thin: bool = False
    #: A percentile objective's value over the point's requests pooled over its repeats, with its own interval
    #: (None: a mean or max objective, or documents without their records, judged on the runs' values).
    pooled: Quantile | None = None

    @property
    def judgement(self) -> Judgement:
        limit = self.objective.limit_s
        if (q := self.pooled) is not None:
            return _POOLED[q.against(limit)]
        v = self.value
        if v is None:
            return "unknown"
        if self.thin:
            return "too few repeats"
        low, high = (v.low, v.high) if v.low is not None and v.high is not None else (v.value, v.value)
        return "meets" if high <= limit else "fails" if low > limit else "near the limit"

    def text(self) -> str:
        """``ttft_p99 84 [70–98] ms (n=420) vs 500 ms``; a mean's ``tpot_mean 12 ms [11–13] vs 50 ms``."""
        name, limit = self.objective.name, ms(self.objective.limit_s)
        if (q := self.pooled) is not None:
            return f"{name} {ms_quantile(q)} (n={q.n}) vs {limit}"
        value = "no samples" if self.value is None else ms_estimate(self.value)
        return f"{name} {value} vs {limit}"

    def why(self) -> str:
        """The judgement as said beside the value: ``too few requests: a p99 needs 368``."""
        if self.judgement == "too few requests" and self.pooled is not None:
            return f"too few requests: a {self.objective.stat} needs {self.pooled.needed}"
        return self.judgement

    def to_dict(self) -> dict[str, Any]:
        return {"objective": self.objective.name, "limit_s": self.objective.limit_s,
                "value": codec.encode(self.value), "thin": self.thin, "pooled": codec.encode(self.pooled),
                "judgement": self.judgement}


@dataclass(frozen=True)
class SloAt:
    """Every objective of the SLO at one point."""

    concurrency: int
    objectives: tuple[ObjectiveAt, ...]
    valid: bool

    @property
    def judgement(self) -> Judgement:
        """Meets when every objective does; fails when any does; unknown for an invalid point or a missing value."""
        found = {o.judgement for o in self.objectives}
        if not self.valid or "unknown" in found:
            return "unknown"
        return next(j for j in ("fails", *UNDECIDED, "near the limit", "meets") if j in found or j == "meets")

    def only(self, metric: str) -> SloAt:
        """The objectives on one metric (``ttft``); all of them where the SLO has none on it."""
        mine = tuple(o for o in self.objectives if o.objective.metric == metric)
        return SloAt(self.concurrency, mine or self.objectives, self.valid)

    def failed(self) -> tuple[str, ...]:
        """The objectives that do not clearly hold, with their values."""
        return tuple(f"{o.text()} ({o.why()})" for o in self.objectives if o.judgement != "meets")

    JSON_DERIVED: ClassVar[tuple[str, ...]] = ("judgement",)


def slo_at(point: Point, slo: Slo) -> SloAt:
    """The SLO at a point: each objective's value over the used runs (their own verdicts' values) and, for a
    percentile, over their requests pooled."""
    objectives = []
    target = point.precision_target or DEFAULT_PRECISION
    for objective in slo.objectives:
        values = [v for r in point.used if r.verdict is not None
                  and (v := r.verdict.values.get(objective.name)) is not None]
        found = Estimate.of(values)
        q = objective.quantile
        tail = None if q is None else pooled([v for r in point.used for v in r.latencies(objective.metric)], q)
        objectives.append(ObjectiveAt(objective, found, found is not None and found.thin(target), tail))
    return SloAt(point.concurrency, tuple(objectives), point.valid)


@dataclass(frozen=True)
class MaxGoodput:
    """The point of most goodput among those that meet the SLO, and the first point above it that does not."""

    concurrency: int
    goodput_req_s: Estimate | None
    output_tok_s: Estimate | None
    #: The first valid point above it that does not meet the SLO, with what it missed.
    first_failing: SloAt | None
    evidence: tuple[str, ...]


def max_goodput(points: Sequence[PointFindings], slos: dict[int, SloAt]) -> MaxGoodput | None:
    meeting = [p for p in points if p.valid and slos[p.concurrency].judgement == "meets"
               and p.figure("goodput_req_s") is not None]
    if not meeting:
        return None
    best = max(meeting, key=lambda p: (p.figure("goodput_req_s").value, -p.concurrency))  # type: ignore[union-attr]
    failing = next((slos[p.concurrency] for p in points if p.valid and p.concurrency > best.concurrency
                    and slos[p.concurrency].judgement != "meets"), None)
    return MaxGoodput(best.concurrency, best.figure("goodput_req_s"), best.figure("output_tok_s"), failing,
                      best.run_ids)


@dataclass(frozen=True)
class LatencyPool:
    """The largest batch whose TTFT objectives hold (a latency pool's max_num_seqs), and where that stops."""

    #: The objectives walked (the SLO's TTFT ones, or all of them where it has none on TTFT).
    objectives: tuple[str, ...]
    #: The largest concurrency up to which every valid point meets them (None: not even the lowest).
    concurrency: int | None
    #: That point's objectives.
    at: SloAt | None
    #: The first point that does not clearly meet them (None: every valid point does).
    stopped_at: SloAt | None
    #: The points below that one too thin to judge (too few repeats or requests): they neither held nor stopped
    #: the walk.
    too_thin: tuple[SloAt, ...] = ()


def latency_pool(points: Sequence[PointFindings], slos: dict[int, SloAt]) -> LatencyPool | None:
    """The walk up the curve (module docstring); None without a valid point."""
    valid = [slos[p.concurrency].only("ttft") for p in points if p.valid]
    if not valid:
        return None
    last: SloAt | None = None
    thin: list[SloAt] = []
    for found in valid:
        if found.judgement in UNDECIDED:
            thin.append(found)
        elif found.judgement != "meets":
            return LatencyPool(_names(found), last.concurrency if last else None, last, found, tuple(thin))
        else:
            last = found
    return LatencyPool(_names(valid[0]), last.concurrency if last else None, last, None, tuple(thin))


def _names(found: SloAt) -> tuple[str, ...]:
    return tuple(str(o.objective) for o in found.objectives)
