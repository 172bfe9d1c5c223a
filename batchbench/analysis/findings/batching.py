"""Continuous over static batching: the throughput ratio at each batch size both ran, and its mechanism.

The same requests are sent as a closed loop (a slot refills as soon as a request ends) and as static
waves (the next wave waits for the longest request of this one). The ratio of their throughputs is an
:class:`~batchbench.analysis.repeats.Estimate` ratio; the mechanism is the mean number of requests decoding in
each layout against what the output lengths allow (:func:`batchbench.analysis.theory.continuous_idle_fraction`,
:func:`~batchbench.analysis.theory.waves_idle_fraction`): continuous batching gains exactly by keeping the slots
that static waves leave idle busy, and an engine that batches statically gains nothing from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from batchbench.analysis.findings.points import Measurement, Point, PointFindings
from batchbench.analysis.findings.points import ratio as points_ratio
from batchbench.analysis.findings.text import ratio as ratio_text
from batchbench.analysis.findings.text import undecided as undecided_text
from batchbench.analysis.repeats import DEFAULT_PRECISION, Estimate
from batchbench.analysis.theory import continuous_idle_fraction, waves_idle_fraction


@dataclass(frozen=True)
class Occupancy:
    """Continuous over static waves at one concurrency: the throughput ratio and its mechanism."""

    ratio: Estimate
    mean_decoding: float | None
    static_mean_decoding: float | None
    #: What the output lengths allow: N x (1 - idle share) of each layout (batchbench.analysis.theory).
    ideal_mean_decoding: float | None
    ideal_static_mean_decoding: float | None
    evidence: tuple[str, ...]
    #: TPOT p50 of each layout (mean over the runs): throughput is about requests decoding over TPOT, so where
    #: more requests decoding bought no throughput, each step cost more with more requests in it.
    tpot_p50_s: float | None = None
    static_tpot_p50_s: float | None = None
    #: The precision the points were measured to: a ratio that holds 1 but is wider decides nothing.
    precision: float = DEFAULT_PRECISION

    @property
    def within_noise(self) -> bool:
        """Whether the data cannot tell the two layouts apart (no interval: it cannot either)."""
        return self.ratio.differs_from_one is not True

    JSON_DERIVED: ClassVar[tuple[str, ...]] = ("within_noise",)


@dataclass(frozen=True)
class ContinuousOverStatic:
    at: dict[int, Occupancy]
    #: The concurrency the headline is about: the sweet spot where static ran there too, else the highest both ran.
    concurrency: int

    @property
    def headline(self) -> Occupancy:
        return self.at[self.concurrency]

    JSON_DERIVED: ClassVar[tuple[str, ...]] = ("headline",)


def _ideal_decoding(run: Measurement) -> tuple[float, float] | None:
    """(continuous, static waves) mean requests decoding the run's output lengths allow: N x (1 - idle share)."""
    outputs = [r.output_tokens if r.ok else r.max_tokens for r in run.ordered_records()]
    if not outputs or sum(outputs) == 0:
        return None
    n = run.concurrency
    return n * (1 - continuous_idle_fraction(outputs, n)), n * (1 - waves_idle_fraction(outputs, n))


def continuous_over_static(continuous: list[PointFindings], static: list[PointFindings], points: dict[int, Point],
                           static_points: dict[int, Point], sweet_spot: int | None) -> ContinuousOverStatic | None:
    """At every concurrency with a valid point in both layouts; ``points`` and ``static_points``: the two layouts'
    runs, by concurrency (the throughput ratio pairs them pass by pass,
    :func:`~batchbench.analysis.findings.points.ratio`; the continuous records give the ideal occupancy)."""
    by_c = {p.concurrency: p for p in static if p.valid}
    at: dict[int, Occupancy] = {}
    for p in continuous:
        s = by_c.get(p.concurrency)
        ratio = points_ratio(points[p.concurrency], static_points[p.concurrency], "output_tok_s") \
            if s is not None and p.valid else None
        if ratio is None or s is None:
            continue
        ideal = _ideal_decoding(points[p.concurrency].used[0])
        md, smd = p.figure("mean_decoding"), s.figure("mean_decoding")
        tpot, stpot = p.figure("tpot_p50_s"), s.figure("tpot_p50_s")
        asked = [t for t in (p.precision_target, s.precision_target) if t is not None]
        at[p.concurrency] = Occupancy(ratio, md.value if md else None, smd.value if smd else None,
                                      ideal[0] if ideal else None, ideal[1] if ideal else None, p.run_ids + s.run_ids,
                                      tpot.value if tpot else None, stpot.value if stpot else None,
                                      max(asked, default=DEFAULT_PRECISION))
    if not at:
        return None
    return ContinuousOverStatic(at, sweet_spot if sweet_spot in at else max(at))


#: Requests decoding on average more than this many times static waves' is continuous batching doing its job.
OCCUPANCY_GAIN = 1.1


def mechanism(o: Occupancy) -> str:
    """``7.4 requests decoding on average vs 5.3 (ideal 7.9 vs 5.6)``, or "" where it was not measured; where
    continuous batching kept more requests decoding yet gave no more throughput, the TPOTs say why."""
    if o.mean_decoding is None or o.static_mean_decoding is None:
        return ""
    text = f"{o.mean_decoding:.1f} requests decoding on average vs {o.static_mean_decoding:.1f}"
    if o.ideal_mean_decoding is not None and o.ideal_static_mean_decoding is not None:
        text += f" (ideal {o.ideal_mean_decoding:.1f} vs {o.ideal_static_mean_decoding:.1f})"
    busier = o.static_mean_decoding > 0 and o.mean_decoding > OCCUPANCY_GAIN * o.static_mean_decoding
    if busier and not o.ratio.differs_from_one and o.tpot_p50_s is not None and o.static_tpot_p50_s is not None:
        text += (f", but at TPOT p50 {o.tpot_p50_s * 1000:.1f} ms vs {o.static_tpot_p50_s * 1000:.1f} ms: each step "
                 "cost more with more requests in it (compute-bound)")
        if not o.ratio.undecided_at(o.precision):
            text += ", so the fuller batch bought no throughput"
    return text


def decision(c: ContinuousOverStatic | None, missing: str | None = None) -> str:
    """The answer to "continuous or static?", one line: the gain with its interval and mechanism, or the
    largest difference the data leaves open."""
    if c is None:
        return f"cannot be compared ({missing or 'no batch size with both layouts valid'})"
    o = c.headline
    why = mechanism(o)
    if o.ratio.differs_from_one:
        if o.ratio.value > 1:
            text = f"continuous at batch {c.concurrency}: {ratio_text(o.ratio)} the throughput of static waves"
        else:
            text = (f"static waves at batch {c.concurrency}: continuous gives only {ratio_text(o.ratio)} their "
                    "throughput")
    elif o.ratio.undecided_at(o.precision):
        text = f"at batch {c.concurrency}, {undecided_text(o.ratio, o.precision)}"
    elif o.ratio.largest_undetected is not None:
        text = (f"no difference larger than {o.ratio.largest_undetected:.0%} detected at batch {c.concurrency} "
                f"({ratio_text(o.ratio)})")
    else:
        text = f"{ratio_text(o.ratio)} at batch {c.concurrency}: too few repeats to tell"
    return f"{text}; {why}" if why else text
