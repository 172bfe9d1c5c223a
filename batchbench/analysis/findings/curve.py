"""The curve: each layout's regimes, its sweet spot, and the batch size that gives the most throughput.

The regimes come from :func:`batchbench.analysis.regimes.classify_regimes` over the points' means of the key figure
(the steady state's output tokens/s, what every sentence quotes), and with them the one sweet spot every part of
batchbench names: the smallest batch size whose throughput is within :data:`~batchbench.analysis.regimes.PEAK_SHARE`
of the most measured (past it, more requests add latency, not throughput). Beside it, its throughput as a share of
the peak's, with the interval of that ratio (paired pass by pass where the two were measured side by side). The
**most throughput** is that same peak, with the batch sizes whose throughput the data shows to be as good (the
ratio's interval holds 1 and stays within the sweet spot's margin) and those it cannot tell (an interval that holds
1 but reaches past the margin).

A point whose key figure is too thin to decide on (:meth:`~batchbench.analysis.findings.points.Point.thin`: fewer
than three repeats and an interval wider than the precision asked) takes no part: it gets no regime, is neither
the sweet spot nor the peak nor within noise of it, and the answer lists it as undecided.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from batchbench.analysis.findings.points import KEY_FIGURE, Point, PointFindings, ratio
from batchbench.analysis.findings.text import estimate
from batchbench.analysis.regimes import PEAK_SHARE, RegimeReport, against_peak, classify_regimes
from batchbench.analysis.repeats import Estimate


def classify(points: Sequence[Point]) -> tuple[RegimeReport | None, str | None]:
    """The regimes of a layout's valid points that are not too thin to decide on, or why there are none."""
    swept = [sp for p in points if p.valid and not p.thin() and (sp := p.sweep_point()) is not None]
    if len(swept) < 2:
        measured = ", ".join(str(sp.concurrency) for sp in swept) or "none"
        thin = [str(p.concurrency) for p in points if p.valid and p.thin()]
        if thin:
            return None, (f"undecided: too few repeats to place batch {', '.join(thin)}, and {len(swept)} other "
                          f"valid batch size ({measured}) is no curve to read regimes from")
        return None, f"{len(swept)} valid concurrency measured ({measured}): no curve to read regimes from"
    return classify_regimes(swept), None


def peak_of(report: RegimeReport) -> int:
    """The batch size of the most throughput on a classified curve (the smallest, where two tie)."""
    return max(report.points, key=lambda p: (p.point.throughput, -p.concurrency)).concurrency


@dataclass(frozen=True)
class SweetSpot:
    concurrency: int
    output_tok_s: Estimate | None
    ttft_p99_s: Estimate | None
    evidence: tuple[str, ...]
    #: The sweep still scaled at its last point: the knee lies beyond what was measured.
    end_of_sweep: bool
    #: The batch size of the most throughput, its throughput, and the sweet spot's throughput over it (None: the
    #: sweet spot is the peak).
    peak_concurrency: int | None = None
    share_of_peak: Estimate | None = None
    peak_output_tok_s: Estimate | None = None

    @property
    def definition(self) -> str:
        """What a sweet spot is, for a reader of report.json."""
        return f"the smallest batch size whose throughput is at least {PEAK_SHARE:.0%} of the most measured"

    JSON_DERIVED: ClassVar[tuple[str, ...]] = ("definition",)


def sweet_spot(report: RegimeReport, by_c: dict[int, PointFindings], points: dict[int, Point]) -> SweetSpot:
    """The sweet spot of a classified curve, with its share of the peak (:func:`peak_of`): every figure it carries
    is the named point's own."""
    s = by_c[report.sweet_spot]
    peak = peak_of(report)
    at_peak = peak != s.concurrency
    # A larger batch measured with too few repeats to place: the sweep's end is undecided, not reached.
    beyond = any(p.valid and p.concurrency > report.points[-1].concurrency for p in by_c.values())
    return SweetSpot(s.concurrency, s.figure(KEY_FIGURE), s.figure("ttft_p99_s"), s.run_ids,
                     end_of_sweep=report.sweet_spot == report.points[-1].concurrency and not beyond,
                     peak_concurrency=peak if at_peak else None,
                     share_of_peak=ratio(points[s.concurrency], points[peak], KEY_FIGURE) if at_peak else None,
                     peak_output_tok_s=by_c[peak].figure(KEY_FIGURE) if at_peak else None)


@dataclass(frozen=True)
class MostThroughput:
    """The valid point of highest mean throughput, and the points within noise of it (module docstring)."""

    concurrency: int
    output_tok_s: Estimate
    #: Every valid concurrency whose throughput the data shows as good as the best's (the best included): the
    #: ratio's interval holds 1 and stays within [PEAK_SHARE, 1 / PEAK_SHARE].
    within_noise: tuple[int, ...]
    evidence: tuple[str, ...]
    #: Valid concurrencies the data cannot place: their ratio's interval holds 1 but reaches past that margin.
    undecided: tuple[int, ...] = ()
    #: Valid concurrencies too thin to compare (module docstring).
    too_thin: tuple[int, ...] = ()


def most_throughput(report: RegimeReport, found: Sequence[PointFindings], points: dict[int, Point]
                    ) -> MostThroughput | None:
    """The peak of the classified curve (:func:`peak_of`), each other valid point against it by the ratio of their
    throughputs (paired pass by pass where they were measured side by side)."""
    by_c = {p.concurrency: p for p in found}
    peak = peak_of(report)
    top = by_c[peak].figure(KEY_FIGURE)
    if top is None:
        return None
    tied, undecided = [peak], []
    for p in found:
        if not p.valid or p.thin or p.concurrency == peak:
            continue
        placed = against_peak(ratio(points[p.concurrency], points[peak], KEY_FIGURE))
        if placed == "as good":
            tied.append(p.concurrency)
        elif placed == "undecided":
            undecided.append(p.concurrency)
    return MostThroughput(peak, top, tuple(sorted(tied)), by_c[peak].run_ids, tuple(sorted(undecided)),
                          tuple(p.concurrency for p in found if p.valid and p.thin))


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
