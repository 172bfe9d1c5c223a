"""Findings: what a folder of runs says, as typed decisions and sentences. Takes results documents, gives
:class:`Findings` (the CLI prints them, the suites check them, the report shows them).

One package turns runs into the answer, so none of its users reads a curve its own way. Each topic
keeps its type, its computation and its sentence together:

- :mod:`~batchbench.analysis.findings.points`: runs read into points (engine, layout, concurrency), each figure an
  :class:`~batchbench.analysis.repeats.Estimate` over the point's valid runs (the mean with a 95% t-interval);
- :mod:`~batchbench.analysis.findings.curve`: the curve's regimes, its sweet spot, the batch size of most throughput;
- :mod:`~batchbench.analysis.findings.memory`: where it becomes memory-bound, against the KV plan;
- :mod:`~batchbench.analysis.findings.batching`: continuous over static batching, and its mechanism;
- :mod:`~batchbench.analysis.findings.padding`: what a batch with one long prompt costs;
- :mod:`~batchbench.analysis.findings.limit`: each point's share of the physical limit on paper at its batch size
  (on a GPU the accelerators table lists), or why there is no limit to set beside it;
- :mod:`~batchbench.analysis.findings.energy`: tokens per joule, joules per request and cost along each curve;
- :mod:`~batchbench.analysis.findings.loras`: whether a multi-LoRA run's adapters were served alike;
- :mod:`~batchbench.analysis.findings.slo`: each point against the SLO, the most goodput, the largest batch within it;
- :mod:`~batchbench.analysis.findings.comparisons`: engines against each other;
- :mod:`~batchbench.analysis.findings.speculation`, :mod:`~batchbench.analysis.findings.turns`: speculative
  decoding, conversations;
- :mod:`~batchbench.analysis.findings.invalid`: the runs left out, by cause;
- :mod:`~batchbench.analysis.findings.decisions`: the answer, one line per question and engine.

Every run is judged by :mod:`batchbench.analysis.validity` first. A point is valid when at least one of its runs
is; its figures come from its valid runs only. Invalid runs stay in the output with their reasons and
are left out of every finding, never dropped silently; a finding that cannot be drawn (one concurrency,
no static layout, an interval that straddles a limit) says so instead of guessing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from batchbench.analysis.accelerators import Accelerator
from batchbench.analysis.findings import (
    batching,
    comparisons,
    curve,
    energy,
    invalid,
    loras,
    memory,
    padding,
    pick,
    speculation,
    turns,
)
from batchbench.analysis.findings.batching import ContinuousOverStatic
from batchbench.analysis.findings.comparisons import Comparison
from batchbench.analysis.findings.curve import MostThroughput, SweetSpot
from batchbench.analysis.findings.decisions import (
    QUESTIONS,
    EngineDecisions,
    TailShort,
    TooThin,
    precision_sentence,
)
from batchbench.analysis.findings.invalid import InvalidRun
from batchbench.analysis.findings.limit import AgainstLimit, against_limit, no_row_sentence
from batchbench.analysis.findings.memory import MemoryBound
from batchbench.analysis.findings.padding import PaddingCost
from batchbench.analysis.findings.pick import Pick
from batchbench.analysis.findings.points import (
    LAYOUTS,
    PADDING_LAYOUTS,
    Measurement,
    Point,
    PointFindings,
    layout_rank,
    point_findings,
    points_from_documents,
)
from batchbench.analysis.findings.slo import LatencyPool, MaxGoodput, SloAt, latency_pool, max_goodput, slo_at
from batchbench.analysis.findings.speculation import Speculation
from batchbench.analysis.repeats import CONFIDENCE, MIN_DECIDING_REPEATS
from batchbench.core import codec
from batchbench.measures import parity
from batchbench.measures.parity import Parity
from batchbench.measures.slo import Slo
from batchbench.results.document import RunDocument

__all__ = [
    "LAYOUTS",
    "PADDING_LAYOUTS",
    "QUESTIONS",
    "EngineDecisions",
    "EngineFindings",
    "Findings",
    "LayoutFindings",
    "Measurement",
    "Point",
    "PointFindings",
    "findings_from_documents",
    "findings_from_points",
    "points_from_documents",
]


@dataclass(frozen=True)
class LayoutFindings:
    """One engine's findings in one layout."""

    engine: str
    layout: str
    points: tuple[PointFindings, ...]
    sweet_spot: SweetSpot | None
    memory_bound: MemoryBound | None
    most_throughput: MostThroughput | None
    #: Each point against the SLO, by concurrency (empty without an SLO).
    slo_points: dict[int, SloAt]
    max_goodput: MaxGoodput | None
    latency_pool: LatencyPool | None
    #: Whether the engine reported KV usage (what regime 3 is called: memory-bound or saturated).
    has_kv_data: bool
    #: Why there is no curve to read (one valid point, a padding layout); None when there is one.
    no_curve: str | None = None
    #: Each valid point against the physical limit on paper, or why there is none (None: a padding layout).
    limit: AgainstLimit | None = None

    def point(self, concurrency: int) -> PointFindings | None:
        return next((p for p in self.points if p.concurrency == concurrency), None)

    @property
    def valid_points(self) -> list[PointFindings]:
        return [p for p in self.points if p.valid]

    def to_dict(self) -> dict[str, Any]:
        """Each point with its SLO and limit beside it (they are kept apart here, by concurrency), then the
        findings over the curve."""
        shares = self.limit.points if self.limit is not None else {}
        return {"points": [codec.encode(p) | codec.encode({"slo": self.slo_points.get(p.concurrency),
                                                           "limit": shares.get(p.concurrency)})
                           for p in self.points],
                **codec.encode({"sweet_spot": self.sweet_spot, "memory_bound": self.memory_bound,
                                "most_throughput": self.most_throughput, "max_goodput": self.max_goodput,
                                "latency_pool": self.latency_pool, "no_curve": self.no_curve, "limit": self.limit})}


@dataclass(frozen=True)
class EngineFindings:
    """Every layout of one engine, what compares its layouts, and its decisions."""

    engine: str
    layouts: dict[str, LayoutFindings]
    continuous_over_static: ContinuousOverStatic | None
    padding_cost: PaddingCost | None
    decisions: EngineDecisions


@dataclass(frozen=True)
class Findings:
    """Everything the runs say (module docstring); :meth:`to_dict` is what report.json stores."""

    slo: Slo | None
    engines: dict[str, EngineFindings]
    comparisons: tuple[Comparison, ...]
    #: The answer's sentences after the decisions: engines against each other, runs left out, precision (≤ ~10).
    answer: tuple[str, ...]
    #: Every topic's sentence, per engine and layout: what the report gives below the answer.
    details: tuple[str, ...]
    invalid_runs: tuple[InvalidRun, ...] = ()
    runs: int = 0
    #: Documents that are no point of a curve, each named with why.
    skipped: tuple[str, ...] = ()
    #: Per engine, whether it served the workload as written, by its own token counts
    #: (:mod:`batchbench.measures.parity`).
    parity: dict[str, Parity] = field(default_factory=dict)
    speculation: tuple[Speculation, ...] = ()
    #: The engine and batch size to run for the SLO, against the runner-up (None: no engine curve).
    pick: Pick | None = None

    def layout(self, engine: str, layout: str) -> LayoutFindings | None:
        found = self.engines.get(engine)
        return None if found is None else found.layouts.get(layout)

    @property
    def decisions(self) -> list[EngineDecisions]:
        return [e.decisions for e in self.engines.values()]

    def to_dict(self) -> dict[str, Any]:
        return {
            "slo": codec.encode(self.slo),
            "questions": dict(QUESTIONS),
            "decisions": [d.to_dict(self.slo) for d in self.decisions],
            "answer": list(self.answer),
            "details": list(self.details),
            "engines": {name: {"layouts": {layout: f.to_dict() for layout, f in e.layouts.items()},
                               **codec.encode({"continuous_over_static": e.continuous_over_static,
                                               "padding_cost": e.padding_cost})}
                        for name, e in self.engines.items()},
            **codec.encode({"comparisons": self.comparisons, "runs": self.runs, "invalid_runs": self.invalid_runs}),
            "invalid_by_kind": invalid.by_kind(self.invalid_runs),
            **codec.encode({"skipped": self.skipped, "parity": self.parity, "speculation": self.speculation}),
            "pick": self.pick.to_json() if self.pick is not None else None,
            "intervals": f"the mean of a point's valid repeats with its {CONFIDENCE:.0%} Student-t interval (on the "
                         "log scale for positive figures); ratios: "
                         f"the ratio of the means, {CONFIDENCE:.0%} interval by the delta method on the log scale, "
                         "paired pass by pass where both were measured side by side (Welch's degrees of freedom "
                         "otherwise)",
        }


def _layout_findings(engine: str, layout: str, points: Sequence[Point], slo: Slo | None) -> LayoutFindings:
    report, no_curve = (None, f"{layout} is a padding comparison, not a curve") if layout in PADDING_LAYOUTS \
        else curve.classify(points)
    regime_at = report.labels if report is not None else {}
    found = tuple(point_findings(p, regime_at.get(p.concurrency) if p.valid else None) for p in points)
    by_c = {p.concurrency: p for p in found}
    measured = {p.concurrency: p for p in points}
    slos = {p.concurrency: slo_at(p, slo) for p in points} if slo is not None else {}
    # Judged against the SLO wherever the points could make a curve, even where too few repeats left none to read
    # regimes from: each point's verdict (too few repeats among them) still stands.
    has_curve = report is not None or (layout not in PADDING_LAYOUTS and sum(p.valid for p in points) >= 2)
    return LayoutFindings(
        engine, layout, found,
        sweet_spot=curve.sweet_spot(report, by_c, measured) if report is not None else None,
        memory_bound=memory.memory_bound(report, points, found) if report is not None else None,
        most_throughput=curve.most_throughput(report, found, measured) if report is not None else None,
        slo_points=slos,
        max_goodput=max_goodput(found, slos) if slo is not None and has_curve else None,
        latency_pool=latency_pool(found, slos) if slo is not None and has_curve else None,
        has_kv_data=report.has_kv_data if report is not None else False,
        no_curve=no_curve, limit=None if layout in PADDING_LAYOUTS else against_limit(points, found))


def _engine_findings(engine: str, points: Sequence[Point], slo: Slo | None) -> EngineFindings:
    grouped: dict[str, list[Point]] = {}
    for p in points:
        grouped.setdefault(p.layout, []).append(p)
    ordered = {layout: sorted(ps, key=lambda p: p.concurrency)
               for layout, ps in sorted(grouped.items(), key=lambda kv: layout_rank(kv[0]))}
    layouts = {layout: _layout_findings(engine, layout, ps, slo) for layout, ps in ordered.items()}
    by_c = {layout: {p.concurrency: p for p in ps} for layout, ps in ordered.items()}
    cont, static = layouts.get("continuous"), layouts.get("static-waves")
    cos, missing = None, None
    if cont is not None and static is not None:
        cos = batching.continuous_over_static(list(cont.points), list(static.points), by_c["continuous"],
                                              by_c["static-waves"], cont.sweet_spot.concurrency if cont.sweet_spot
                                              else None)
    if cos is None:
        missing = ("no static-waves run" if static is None else "no continuous run" if cont is None
                   else "no batch size with both layouts valid")
    mixed, plain = layouts.get("padded-mixed"), layouts.get("homogeneous")
    cost = padding.padding_cost(list(mixed.points), list(plain.points), by_c["padded-mixed"], by_c["homogeneous"]) \
        if mixed is not None and plain is not None else None
    main = cont if cont is not None and cont.no_curve is None else next(
        (f for f in layouts.values() if f.no_curve is None), cont)
    imprecise = tuple(p.concurrency for p in main.points if p.valid and p.precise is False) if main else ()
    targets = [p.precision_target for p in main.points if p.precision_target is not None] if main else []
    decisions = EngineDecisions(
        engine, main.layout if main else None, main.most_throughput if main else None,
        main.sweet_spot if main else None, main.latency_pool if main else None, cos, cost,
        main.memory_bound if main else None, main.has_kv_data if main else False, missing, imprecise,
        min(targets) if targets else None, _too_thin(main, ordered) if main else None,
        main.no_curve if main else None, _tail_short(main, ordered) if main else None)
    return EngineFindings(engine, layouts, cos, cost, decisions)


def _too_thin(main: LayoutFindings, points: dict[str, list[Point]]) -> TooThin | None:
    """The main curve's points too thin to decide on, by their key figure or an SLO objective, and what the runs
    they lack, and one pass over the engine's measurements, take at their runs' mean lengths."""
    thin = sorted({p.concurrency for p in main.points if p.valid and p.thin}
                  | {c for c, at in main.slo_points.items() if at.valid and at.judgement == "too few repeats"})
    if not thin:
        return None
    by_c = {p.concurrency: p for p in points[main.layout]}
    every = [p for ps in points.values() for p in ps]
    limits = [r.time_limit_s for p in every for r in p.runs if r.time_limit_s is not None]
    return TooThin(tuple(thin), sum(_mean_run_s(by_c[c]) * max(0, MIN_DECIDING_REPEATS - len(by_c[c].used))
                                    for c in thin),
                   sum(_mean_run_s(p) for p in every), max(limits) if limits else None)


def _tail_short(main: LayoutFindings, points: dict[str, list[Point]]) -> TailShort | None:
    """The SLO's candidate batch where too few requests bound its p99 (:class:`TailShort`); None where there is
    none, or it is decided."""
    pool = main.latency_pool
    if pool is None:
        return None
    above = [(t.concurrency, o.pooled) for t in pool.too_thin if t.concurrency > (pool.concurrency or 0)
             for o in t.objectives if o.judgement == "too few requests" and o.pooled is not None
             and o.pooled.value <= o.objective.limit_s]
    if not above:
        return None
    c, q = max(above, key=lambda cq: cq[0])
    runs = [r for r in next(p for p in points[main.layout] if p.concurrency == c).used if r.duration_s and r.records]
    if not runs:
        return None
    pace = math.fsum(r.duration_s / len(r.records) for r in runs) / len(runs)  # type: ignore[operator]
    limits = [r.time_limit_s for r in runs if r.time_limit_s is not None]
    return TailShort(c, q.needed - q.n, (q.needed - q.n) * pace, max(limits) if limits else None)


def _mean_run_s(point: Point) -> float:
    durations = [r.duration_s for r in point.runs if r.duration_s]
    return math.fsum(durations) / len(durations) if durations else 0.0


def _details(engines: dict[str, EngineFindings], slo: Slo | None) -> list[str]:
    """Every topic's sentence, engine by engine: the curve of each layout (with where it becomes memory-bound),
    continuous against static, padding, the SLO, conversations."""
    out: list[str] = []
    for name, e in engines.items():
        for layout, f in e.layouts.items():
            if layout in PADDING_LAYOUTS:
                continue
            text = curve.curve_sentence(name, layout, f.points, f.sweet_spot, f.no_curve)
            out.append(text if f.no_curve is not None
                       else text + (memory.clause(f.memory_bound) if f.memory_bound else "") + ".")
            if f.limit is not None and (limit := f.limit.sentence(name, layout)) is not None:
                out.append(limit)
            if slo is not None and f.no_curve is None:
                out.append(f"{name}, {layout}, under {slo}: " + _goodput_text(f) + ".")
        if (no_row := no_row_sentence(name, [f.limit for f in e.layouts.values() if f.limit is not None])):
            out.append(no_row)
        out.append(f"{name}: continuous vs static batching: {e.decisions.answers(slo)['batching']}.")
        if e.padding_cost is not None:
            out.append(f"{name}: padding: {padding.decision(e.padding_cost)}.")
        out += [sentence for layout, f in e.layouts.items() for p in f.points
                if (sentence := turns.sentence(name, layout, p)) is not None]
    return out


def _goodput_text(f: LayoutFindings) -> str:
    g = f.max_goodput
    if g is None:
        judged = [s for s in f.slo_points.values() if s.valid]
        if not judged:
            return "no valid point to judge"
        return f"no valid point clearly meets it; batch {judged[0].concurrency}: {'; '.join(judged[0].failed())}"
    text = f"the most goodput is at batch {g.concurrency}"
    if g.goodput_req_s is not None:
        text += f" ({g.goodput_req_s.format(lambda v: f'{v:.2f}')} req/s)"
    if g.first_failing is not None:
        text += f"; batch {g.first_failing.concurrency}: {'; '.join(g.first_failing.failed())}"
    return text


def findings_from_points(points: Sequence[Point], *, slo: Slo | None = None, skipped: Sequence[str] = ()) -> Findings:
    """Findings of grouped points (:func:`~batchbench.analysis.findings.points.points_from_documents`)."""
    names = sorted({p.engine for p in points})
    engines = {name: _engine_findings(name, [p for p in points if p.engine == name], slo) for name in names}
    compared = comparisons.comparisons({name: e.layouts for name, e in engines.items()},
                                       {name: comparisons.scope(r for p in points if p.engine == name for r in p.runs)
                                        for name in names})
    gone = invalid.invalid_runs(points)
    runs = sum(len(p.runs) for p in points)
    parities = {name: parity.check([r for p in points if p.engine == name for run in p.runs for r in run.records])
                for name in names}
    speculated = tuple(speculation.speculation(points))
    # The answer's sentences: the pick across engines (the scope said once there), then what was left out; each
    # pair of engines goes to the details, without the scope where it is the pick's.
    everywhere = comparisons.caveat(comparisons.scope(r for p in points for r in p.runs))
    curves = {name: e.layouts[pick.LAYOUT] for name, e in engines.items() if pick.LAYOUT in e.layouts}
    picked = pick.pick(curves, compared, has_slo=slo is not None, scope=everywhere)
    answer = picked.sentences() if picked is not None else []
    answer += [text for text in (invalid.sentence(gone, runs), precision_sentence([e.decisions
                                                                                    for e in engines.values()]))
               if text is not None]
    details = _details(engines, slo)
    details += [c.sentence(caveat=picked is None or c.caveat != everywhere)
                for c in sorted(compared, key=lambda c: c.layout != pick.LAYOUT)]
    details += [speculation.sentence(sp) for sp in speculated]
    details += energy.sentences(points)
    details += loras.sentences(points)
    details += [f"{name}: {warning}." for name, served in parities.items() if (warning := served.warning())]
    if skipped:
        details.append(f"{len(skipped)} document(s) not used: {'; '.join(skipped)}.")
    return Findings(slo, engines, tuple(compared), tuple(answer), tuple(details), gone, runs, tuple(skipped),
                    parities, speculated, picked)


def measured_slo(docs: Iterable[RunDocument]) -> Slo | None:
    """The SLO every one of the runs was measured under (their headers agree on it); None when they name none or
    differ."""
    found = {doc.header.slo for doc in docs}
    return found.pop() if len(found) == 1 else None


def findings_from_documents(docs: Iterable[RunDocument | tuple[str | None, RunDocument]], *, slo: Slo | None = None,
                            suite: str | None = None, gpu: Accelerator | None = None) -> Findings:
    """The findings of results documents (or (source, document) pairs): the entry point of the CLI and the
    report. ``slo``: judge the points against it (None: the one the runs were measured under,
    :func:`measured_slo`, if they agree on one; else no SLO findings); ``suite``: only runs labelled with this
    suite; ``gpu``: the GPU the runs' limit on paper is worked out for, in place of the one their NVML named (an
    engine at a URL)."""
    pairs: list[tuple[str | None, RunDocument]] = [d if isinstance(d, tuple) else (None, d) for d in docs]
    slo = slo if slo is not None else measured_slo(doc for _, doc in pairs)
    skipped: list[str] = []
    points = points_from_documents(pairs, slo=slo, suite=suite, skipped=skipped, gpu=gpu)
    return findings_from_points(points, slo=slo, skipped=skipped)
