"""The curve: each layout's regimes, its sweet spot, and the batch size that gives the most throughput.

The regimes come from :func:`batchbench.analysis.regimes.classify_regimes` over the points' means, and with them
the one sweet spot every part of batchbench names: the smallest batch size whose throughput is within
:data:`~batchbench.analysis.regimes.PEAK_SHARE` of the most measured (past it, more requests add latency, not
throughput). Beside it, its throughput as a share of the peak's, with the interval of that ratio (paired pass by
pass where the two were measured side by side). The **most throughput** is the batch size with the highest mean
(what engines are compared at), with every batch size whose throughput the data cannot tell apart from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from batchbench.analysis.findings.points import KEY_FIGURE, Point, PointFindings, ratio
from batchbench.analysis.findings.text import estimate
from batchbench.analysis.regimes import PEAK_SHARE, RegimeReport, classify_regimes
from batchbench.analysis.repeats import Estimate


def classify(points: Sequence[Point]) -> tuple[RegimeReport | None, str | None]:
    """The regimes of a layout's valid points, or why there are none."""
    swept = [sp for p in points if p.valid and (sp := p.sweep_point()) is not None]
    if len(swept) < 2:
        measured = ", ".join(str(sp.concurrency) for sp in swept) or "none"
        return None, f"{len(swept)} valid concurrency measured ({measured}): no curve to read regimes from"
    return classify_regimes(swept), None


@dataclass(frozen=True)
class SweetSpot:
    concurrency: int
    output_tok_s: Estimate | None
    ttft_p99_s: Estimate | None
    evidence: tuple[str, ...]
    #: The sweep still scaled at its last point: the knee lies beyond what was measured.
    end_of_sweep: bool
    #: The batch size of the most throughput, and the sweet spot's throughput over it (None: it is the peak).
    peak_concurrency: int | None = None
    share_of_peak: Estimate | None = None

    @property
    def definition(self) -> str:
        """What a sweet spot is, for a reader of report.json."""
        return f"the smallest batch size whose throughput is at least {PEAK_SHARE:.0%} of the most measured"

    JSON_DERIVED: ClassVar[tuple[str, ...]] = ("definition",)


def sweet_spot(report: RegimeReport, by_c: dict[int, PointFindings], points: dict[int, Point]) -> SweetSpot:
    """The sweet spot of a classified curve, with its share of the peak (the point of highest mean throughput)."""
    s = by_c[report.sweet_spot]
    peak = max(report.points, key=lambda p: (p.point.throughput, -p.concurrency)).concurrency
    share = None if peak == s.concurrency else ratio(points[s.concurrency], points[peak], KEY_FIGURE)
    return SweetSpot(s.concurrency, s.figure("output_tok_s"), s.figure("ttft_p99_s"), s.run_ids,
                     end_of_sweep=report.sweet_spot == report.points[-1].concurrency,
                     peak_concurrency=None if peak == s.concurrency else peak, share_of_peak=share)


@dataclass(frozen=True)
class MostThroughput:
    """The valid point of highest mean throughput, and the points within noise of it (module docstring)."""

    concurrency: int
    output_tok_s: Estimate
    #: Every valid concurrency whose throughput cannot be told apart from the best's, the best included.
    within_noise: tuple[int, ...]
    evidence: tuple[str, ...]


def most_throughput(points: Sequence[PointFindings]) -> MostThroughput | None:
    measured = [(p, e) for p in points if p.valid and (e := p.figure("output_tok_s")) is not None]
    if not measured:
        return None
    best, top = max(measured, key=lambda pe: (pe[1].value, -pe[0].concurrency))
    tied = []
    for p, e in measured:
        r = e.ratio(top)
        if p is best or (r is not None and r.differs_from_one is False):
            tied.append(p.concurrency)
    return MostThroughput(best.concurrency, top, tuple(sorted(tied)), best.run_ids)


def curve_sentence(engine: str, layout: str, points: Sequence[PointFindings], sweet: SweetSpot | None,
                   no_curve: str | None) -> str:
    """``vllm, continuous: under-utilised up to batch 2, sweet spot at 4 (593 [560–626] tok/s).`` (the memory
    topic adds where regime 3 begins)."""
    head = f"{engine}, {layout}:"
    if no_curve is not None or sweet is None:
        return f"{head} {no_curve or 'no curve'}."
    parts: list[str] = []
    under = [p.concurrency for p in points if p.regime == "under-utilised"]
    if under:
        parts.append(f"under-utilised up to batch {max(under)}")
    tok = f" ({estimate(sweet.output_tok_s)})" if sweet.output_tok_s is not None else ""
    if sweet.end_of_sweep:
        parts.append(f"still scaling at batch {sweet.concurrency}{tok}, the largest measured: no knee within the "
                     "sweep")
    else:
        parts.append(f"sweet spot at {sweet.concurrency}{tok}")
    return f"{head} {', '.join(parts)}"
