"""Findings: what a sweep of runs says, per engine and layout, in numbers and in plain English.

One module turns results documents into the answer the CLI prints, the suites
check and the report shows, so none of them reads a curve its own way:

- **the curve**: each layout's points (concurrency levels) labelled with their
  regime by :func:`batchbench.regimes.classify_regimes` over the medians of
  their repeats (:func:`batchbench.regimes.median_of`): the sweet spot, and where
  the memory-bound (or saturated) regime starts, next to the KV fit predicted
  from the model and the cache (the ``kv_fit`` run label);
- **continuous over static**: at each concurrency both layouts ran, the
  throughput ratio, with its mechanism: requests decoding on average in each
  layout against the ideal the output lengths allow
  (:func:`batchbench.theory.continuous_idle_fraction`,
  :func:`~batchbench.theory.waves_idle_fraction`);
- **padding**: a batch with one long prompt against a homogeneous one, the
  padded share predicted by :func:`batchbench.theory.padding_fraction` and the
  latency it cost;
- **speculative decoding**: where one engine and layout ran with and without speculation
  (:mod:`batchbench.speculation`), TPOT's speedup at each batch size, the acceptance rate by the engine's own
  counters, and the crossover batch size from which speculation stops paying;
- **an SLO** (:class:`batchbench.slo.Slo`): the point of most goodput that meets
  it, the first point above that fails it and why, and the recommended
  latency-pool and throughput-pool sizes.

Every figure is an :class:`Estimate`: the median with an interval. With two or
more repeats the interval is the repeats' range (the repeat protocol,
:mod:`batchbench.repeats`); a single run has no repeats to spread, so its
statistics are bootstrapped over its requests (seeded, deterministic). That
interval says how much the run's own requests disagree (a p99 over few of
them is wide), not how much the next run would: on a shared machine runs
differ by more, which only repeats show. A ratio of two estimates spans from
the lowest to the highest quotient of their intervals, and is **within
noise** when that range contains 1.

Every run is judged by :mod:`batchbench.validity` first. A point is valid
when at least one of its runs is; its figures come from its valid runs only.
Invalid points stay in the output with their reasons and are left out of
sweet spots, goodput and recommendations, never dropped silently; a point
that cannot say something (one concurrency, no static layout, an SLO
percentile its samples do not support) says so instead of guessing.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeVar

from batchbench import parity
from batchbench.adapters.base import BatchingConfig
from batchbench.metrics import Summary, mean_decoding, meets_slos, percentile, summarize, tpot
from batchbench.parity import Parity
from batchbench.planner import CapacityFit, PlanError, fit_in_capacity
from batchbench.records import RequestRecord
from batchbench.regimes import REGIME_RANK, Regime, RegimeReport, SweepPoint, classify_regimes, median_of
from batchbench.repeats import Interval
from batchbench.results import RunDocument, discover
from batchbench.slo import Slo, Verdict
from batchbench.speculation import SpecCounters, crossover
from batchbench.theory import continuous_idle_fraction, padding_fraction, waves_idle_fraction
from batchbench.validity import Validity, check_run, document_summary

__all__ = [
    "BOOTSTRAP_CONFIDENCE",
    "BOOTSTRAP_RESAMPLES",
    "LAYOUTS",
    "Estimate",
    "Findings",
    "LayoutFindings",
    "Measurement",
    "Point",
    "PointFindings",
    "Speculation",
    "SpeculationAt",
    "bootstrap",
    "findings_from_dir",
    "findings_from_documents",
    "findings_from_points",
    "points_from_documents",
]

T = TypeVar("T")
Method = Literal["repeats", "bootstrap"]

#: The layouts the main job runs, in the order findings list them: the two batching layouts of the curve,
#: then the padding pair (a batch with one long prompt, and one of short prompts only).
LAYOUTS = ("continuous", "static-waves", "padded-mixed", "homogeneous")
#: Layouts that are single batches compared with each other, not curves over concurrency.
PADDING_LAYOUTS = ("padded-mixed", "homogeneous")
#: Resamples of a single run's requests; a 95% percentile interval of a bootstrap is stable to a few percent
#: of its width from about a thousand (Efron and Tibshirani, An Introduction to the Bootstrap, ch. 13).
BOOTSTRAP_RESAMPLES = 1000
BOOTSTRAP_CONFIDENCE = 0.95


# --------------------------------------------------------------------------- estimates


@dataclass(frozen=True)
class Estimate:
    """A figure with its interval: the median of the repeats and their range, or a single run's statistic and
    its bootstrap percentile interval. ``n``: repeats, or requests resampled."""

    median: float
    low: float
    high: float
    n: int
    method: Method

    def __post_init__(self) -> None:
        if not self.low <= self.median <= self.high:
            raise ValueError(f"an estimate needs low <= median <= high, not {self.low}, {self.median}, {self.high}")

    @classmethod
    def of_repeats(cls, values: Sequence[float]) -> Estimate | None:
        """The repeat protocol's median and min-max (:class:`batchbench.repeats.Interval`); None for no value."""
        found = Interval.of(values)
        return None if found is None else cls(found.median, found.low, found.high, found.n, "repeats")

    def ratio(self, other: Estimate) -> Estimate | None:
        """``self / other``: the quotient of the medians, from the lowest to the highest quotient of the intervals.
        None when ``other``'s median is 0 (no ratio); an upper end of infinity when its low end is 0."""
        if other.median <= 0 or self.low < 0 or other.low < 0:
            return None
        method: Method = "repeats" if self.method == other.method == "repeats" else "bootstrap"
        high = self.high / other.low if other.low > 0 else math.inf
        return Estimate(self.median / other.median, self.low / other.high, high, min(self.n, other.n), method)

    @property
    def within_noise(self) -> bool:
        """For a ratio: whether its interval contains 1 (the two figures cannot be told apart)."""
        return self.low <= 1.0 <= self.high

    def format(self, fmt: Callable[[float], str]) -> str:
        """``812 [788–888]``."""
        return f"{fmt(self.median)} [{fmt(self.low)}–{fmt(self.high)}]"

    def to_dict(self) -> dict[str, Any]:
        return {"median": self.median, "low": self.low, "high": self.high if math.isfinite(self.high) else None,
                "n": self.n, "method": self.method}


def bootstrap(
    items: Sequence[T],
    statistics_of: Callable[[Sequence[T]], Mapping[str, float | None]],
    *,
    seed: int | str,
    resamples: int = BOOTSTRAP_RESAMPLES,
    confidence: float = BOOTSTRAP_CONFIDENCE,
) -> dict[str, Estimate | None]:
    """Each statistic of ``items`` with its bootstrap percentile interval, from the same resamples.

    ``statistics_of`` computes every statistic of a sample at once (by name; None where one is
    undefined), so work they share (a sorted list) is done once per resample. The median is each
    statistic of ``items`` themselves (None when it has none); the interval holds the middle
    ``confidence`` of its values over ``resamples`` resamples with replacement (resamples where it is
    undefined are left out), widened to contain the median where a skewed statistic put it outside.
    ``seed`` makes it deterministic (a string seeds :class:`random.Random` the same on every machine).
    """
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, not {resamples}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), not {confidence!r}")
    points = dict(statistics_of(items))
    drawn: dict[str, list[float]] = {name: [] for name in points}
    rng = random.Random(seed)
    for _ in range(resamples if items else 0):
        for name, value in statistics_of(rng.choices(items, k=len(items))).items():
            if points.get(name) is not None and value is not None:
                drawn[name].append(value)
    tail = (1 - confidence) / 2 * 100
    found: dict[str, Estimate | None] = {}
    for name, point in points.items():
        if point is None:
            found[name] = None
            continue
        values = drawn[name] or [point]
        low, high = percentile(values, tail), percentile(values, 100 - tail)
        found[name] = Estimate(point, min(low, point), max(high, point), len(items), "bootstrap")
    return found


# --------------------------------------------------------------------------- one run, one point


@dataclass(frozen=True)
class Measurement:
    """One run of one point, reduced to what findings use."""

    run_id: str
    #: The document's path relative to the folder it was found in (None: given as a document).
    source: str | None
    engine: str
    layout: str
    concurrency: int
    repeat: int | None
    #: The run's summary; under the findings' SLO when it differs from the one the run was measured under.
    summary: Summary | None
    duration_s: float | None
    #: The SLO's verdict on this run (None: no SLO, or nothing measured).
    verdict: Verdict | None
    validity: Validity
    kv_usage_peak: float | None
    preemptions: float | None
    waiting_peak: float | None
    #: Run labels: sequences of the sweep's workload the KV cache is predicted to hold, and its capacity.
    kv_fit: int | None
    kv_capacity_tokens: int | None
    #: The planner's arithmetic for the run's KV cache and workload (None: no local model config or no capacity).
    kv_plan: CapacityFit | None = None
    engine_report: Mapping[str, Any] = field(default_factory=dict, repr=False)
    records: tuple[RequestRecord, ...] = field(default=(), repr=False)
    #: The engine's batching configuration (``BatchingConfig.to_dict()``) and its speculation counters' growth.
    batching: Mapping[str, Any] = field(default_factory=dict, repr=False)
    spec: SpecCounters | None = None

    @property
    def valid(self) -> bool:
        return self.validity.valid

    def value(self, metric: str) -> float | None:
        """One of the figures findings report (see ``_RUN_FIGURES``), from the summary."""
        return None if self.summary is None else _RUN_FIGURES[metric](self.summary)

    def sweep_point(self) -> SweepPoint | None:
        """This run as :mod:`batchbench.regimes` sees it (None: no throughput or TTFT measured)."""
        s = self.summary
        if s is None or s.ttft is None:
            return None
        return SweepPoint(self.concurrency, s.output_token_throughput, s.ttft.p50, s.ttft.p99,
                          self.kv_usage_peak, self.preemptions, self.waiting_peak)

    def ordered_records(self) -> list[RequestRecord]:
        """Records in the workload's send order (request ids end in their zero-padded index)."""
        return sorted(self.records, key=lambda r: r.request_id)


def _dist(name: str, stat: str) -> Callable[[Summary], float | None]:
    def get(summary: Summary) -> float | None:
        dist = getattr(summary, name)
        return None if dist is None else float(getattr(dist, stat))
    return get


#: The per-run figures of a point: from a stored summary (repeats), and below from records (the bootstrap).
_RUN_FIGURES: dict[str, Callable[[Summary], float | None]] = {
    "output_tok_s": lambda s: s.output_token_throughput,
    "ttft_p50_s": _dist("ttft", "p50"),
    "ttft_p99_s": _dist("ttft", "p99"),
    "tpot_p50_s": _dist("tpot", "p50"),
    "tpot_p99_s": _dist("tpot", "p99"),
    "e2e_p50_s": _dist("e2e", "p50"),
    "goodput_req_s": lambda s: s.goodput,
    "mean_decoding": lambda s: s.mean_decoding,
}


class _Request(NamedTuple):
    """One request's share of a run's figures, computed once (a bootstrap resamples these, not the records)."""

    ok: bool
    ttft: float | None
    tpot: float | None
    e2e: float | None
    tokens: int
    #: Its contribution to the mean requests decoding (:func:`batchbench.metrics.mean_decoding`).
    decoding: float
    good: bool


def _requests(records: Sequence[RequestRecord], duration: float,
              limits: tuple[float | None, float | None] | None) -> list[_Request]:
    return [_Request(r.ok, r.ttft_s if r.ok else None, tpot(r), r.e2e_s if r.ok else None,
                     r.output_tokens if r.ok else 0, mean_decoding([r], duration) if r.ok else 0.0,
                     limits is not None and meets_slos(r, *limits))
            for r in records]


def _request_statistics(duration: float, goodput: bool) -> Callable[[Sequence[_Request]], dict[str, float | None]]:
    """The figures of ``_RUN_FIGURES`` from a (resampled) run's requests, as :func:`batchbench.metrics.summarize`
    computes them from its records, so a bootstrap's median is the summary's figure."""

    def pct(values: list[float], q: float) -> float | None:
        return percentile(values, q) if values else None

    def figures(rs: Sequence[_Request]) -> dict[str, float | None]:
        ttfts = sorted(r.ttft for r in rs if r.ttft is not None)
        tpots = sorted(r.tpot for r in rs if r.tpot is not None)
        found = {
            "output_tok_s": sum(r.tokens for r in rs) / duration,
            "ttft_p50_s": pct(ttfts, 50),
            "ttft_p99_s": pct(ttfts, 99),
            "tpot_p50_s": pct(tpots, 50),
            "tpot_p99_s": pct(tpots, 99),
            "e2e_p50_s": pct([r.e2e for r in rs if r.e2e is not None], 50),
            "mean_decoding": math.fsum(r.decoding for r in rs),
        }
        if goodput:
            found["goodput_req_s"] = sum(1 for r in rs if r.good) / duration
        return found

    return figures


@dataclass(frozen=True)
class Point:
    """Every run of one (engine, layout, concurrency)."""

    engine: str
    layout: str
    concurrency: int
    runs: tuple[Measurement, ...]

    @property
    def valid_runs(self) -> tuple[Measurement, ...]:
        return tuple(r for r in self.runs if r.valid)

    @property
    def valid(self) -> bool:
        return bool(self.valid_runs)

    @property
    def used(self) -> tuple[Measurement, ...]:
        """The runs its figures come from: the valid ones, or all of them for an invalid point (shown, flagged)."""
        return self.valid_runs or self.runs

    def sweep_point(self) -> SweepPoint | None:
        """The medians of its used runs (:func:`batchbench.regimes.median_of`); None when none measured TTFT."""
        points = [p for r in self.used if (p := r.sweep_point()) is not None]
        return median_of(points) if points else None


def _label_int(labels: Mapping[str, Any], key: str) -> int | None:
    value = labels.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _kv_plan(doc: RunDocument, capacity: int | None) -> CapacityFit | None:
    """The planner (:func:`batchbench.planner.fit_in_capacity`) on the run's own figures: the served model's
    config.json where it is a local folder, the cache's capacity and block size from the sweep's labels, and the
    workload's longest prompt and output; None when any is missing (a model at a URL, a run without a KV design)."""
    design = doc.header.labels.get("design")
    block = design.get("block_size") if isinstance(design, dict) else None
    model = doc.header.engine.get("model")
    path = model.get("path") if isinstance(model, dict) else None
    prompt, output = (doc.header.workload.get(k, {}).get("max") for k in ("prompt_tokens", "output_tokens"))
    if not (capacity and isinstance(block, int) and isinstance(path, str) and isinstance(prompt, int)
            and isinstance(output, int)):
        return None
    try:
        config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
        return fit_in_capacity(config, capacity, block_size=block, prompt_len=prompt, output_len=output,
                               kv_dtype=str(config.get("torch_dtype") or "bf16"))
    except (OSError, ValueError, PlanError):
        return None  # no readable config here (the run was measured elsewhere): the report shows the rest


def _layout_and_concurrency(doc: RunDocument) -> tuple[str, int] | None:
    """From the run's labels; else from its arrival (closed loop: continuous, waves: static-waves)."""
    labels = doc.header.labels
    spec = doc.header.workload.get("spec")
    arrival = spec.get("arrival") if isinstance(spec, dict) else None
    arrival = arrival if isinstance(arrival, dict) else {}
    layout = labels.get("layout")
    if not isinstance(layout, str):
        layout = {"closed": "continuous", "waves": "static-waves"}.get(str(arrival.get("kind")))
    concurrency = _label_int(labels, "concurrency")
    if concurrency is None and isinstance(arrival.get("concurrency"), int):
        concurrency = arrival["concurrency"]
    if layout is None or concurrency is None or concurrency < 1:
        return None
    return layout, concurrency


def _batching_label(batching: Mapping[str, Any]) -> str:
    try:
        return BatchingConfig(**batching).label()
    except (TypeError, ValueError):  # a config this version does not know: a stable stand-in
        return json.dumps(dict(batching), sort_keys=True, default=str)


def _engine_keys(docs: Sequence[RunDocument]) -> list[str]:
    """The engine name, or ``name [batching]`` where one engine ran under several batching configs
    (their curves are different engines' curves)."""
    configs: dict[str, set[str]] = {}
    for doc in docs:
        configs.setdefault(doc.header.engine_name, set()).add(_batching_label(doc.header.batching))
    return [name if len(configs[name]) == 1 else f"{name} [{_batching_label(doc.header.batching)}]"
            for doc in docs for name in [doc.header.engine_name]]


def _measure(doc: RunDocument, source: str | None, engine: str, layout: str, concurrency: int,
             slo: Slo | None) -> Measurement:
    summary = document_summary(doc)
    footer = doc.footer
    duration = footer.duration_s if footer is not None and footer.duration_s else (
        doc.observed_duration_s() if summary is not None else None)
    limits = slo.request_limits() if slo is not None else None
    stored = (doc.header.slo.ttft_s, doc.header.slo.tpot_s)
    if summary is not None and limits is not None and limits != stored and duration:
        # Goodput counts requests within the limits; the run counted its own (or none).
        summary = summarize(doc.records, duration_s=duration, ttft_slo_s=limits[0], tpot_slo_s=limits[1])
    guard = doc.guardrails()
    labels = doc.header.labels
    return Measurement(
        run_id=doc.header.run_id or source or "?", source=source, engine=engine, layout=layout,
        concurrency=concurrency, repeat=_label_int(labels, "repeat"), summary=summary, duration_s=duration,
        verdict=slo.check(summary) if slo is not None and summary is not None else None,
        validity=check_run(doc, slo=slo, summary=summary),
        kv_usage_peak=guard.kv_usage_peak, preemptions=guard.preemptions, waiting_peak=guard.waiting_peak,
        kv_fit=_label_int(labels, "kv_fit"), kv_capacity_tokens=_label_int(labels, "kv_capacity_tokens"),
        kv_plan=_kv_plan(doc, _label_int(labels, "kv_capacity_tokens")),
        engine_report=footer.engine_report if footer is not None else {}, records=tuple(doc.records),
        batching=dict(doc.header.batching), spec=SpecCounters.over(doc.server_metrics),
    )


def _with_sources(docs: Iterable[RunDocument | tuple[str, RunDocument]]) -> list[tuple[str | None, RunDocument]]:
    return [(d[0], d[1]) if isinstance(d, tuple) else (None, d) for d in docs]


def points_from_documents(
    docs: Iterable[RunDocument | tuple[str, RunDocument]], *, slo: Slo | None = None, suite: str | None = None,
    skipped: list[str] | None = None,
) -> list[Point]:
    """Group runs into points by (engine, layout, concurrency), each run judged by :mod:`batchbench.validity`.

    ``docs``: documents, or (source, document) pairs as :func:`batchbench.results.discover` finds them.
    ``suite``: only runs labelled with this suite. A run without a layout and concurrency (a label, or
    a closed-loop or waves arrival to read them from) is no point of a curve: it is left out, and
    ``skipped`` (when given) gets a line naming it.
    """
    pairs = [(src, doc) for src, doc in _with_sources(docs)
             if suite is None or doc.header.labels.get("suite") == suite]
    grouped: dict[tuple[str, str, int], list[Measurement]] = {}
    for (source, doc), engine in zip(pairs, _engine_keys([doc for _, doc in pairs])):
        found = _layout_and_concurrency(doc)
        if found is None:
            if skipped is not None:
                skipped.append(f"{source or doc.header.run_id}: no layout and concurrency (labels or arrival)")
            continue
        layout, concurrency = found
        grouped.setdefault((engine, layout, concurrency), []).append(
            _measure(doc, source, engine, layout, concurrency, slo))
    return [Point(engine, layout, c, tuple(sorted(runs, key=lambda r: (r.repeat is None, r.repeat, r.run_id))))
            for (engine, layout, c), runs in sorted(grouped.items(), key=lambda kv: _point_order(kv[0]))]


def _layout_rank(layout: str) -> tuple[int, str]:
    return (LAYOUTS.index(layout), "") if layout in LAYOUTS else (len(LAYOUTS), layout)


def _point_order(key: tuple[str, str, int]) -> tuple[Any, ...]:
    engine, layout, c = key
    return engine, _layout_rank(layout), c


# --------------------------------------------------------------------------- the findings' types


@dataclass(frozen=True)
class PointFindings:
    """One point's figures, regime, SLO verdict and validity."""

    concurrency: int
    figures: dict[str, Estimate | None]
    meets_slo: bool | None
    #: The objectives it failed, as ``ttft_p99=310ms>200ms``.
    slo_failed: tuple[str, ...]
    #: Each objective's value: the median over the used runs (None: a run had no samples, or no SLO).
    slo_values: dict[str, float | None]
    regime: Regime | None
    valid: bool
    invalid_reasons: tuple[str, ...]
    kv_usage_peak: float | None
    preemptions: float | None
    waiting_peak: float | None
    run_ids: tuple[str, ...]
    #: Invalid runs of a valid point, left out of its figures: (run id, reasons).
    excluded_runs: tuple[tuple[str, tuple[str, ...]], ...] = ()
    #: Percentiles shown that their samples do not support, and why an SLO verdict could not be given.
    percentile_notes: tuple[str, ...] = ()
    slo_notes: tuple[str, ...] = ()
    #: Multi-turn conversations: each turn's mean prompt and TTFT p50 (median over the used runs).
    turns: tuple[TurnTtft, ...] = ()

    def figure(self, key: str) -> Estimate | None:
        return self.figures.get(key)

    def to_dict(self) -> dict[str, Any]:
        def iv(key: str) -> dict[str, Any] | None:
            found = self.figures.get(key)
            return None if found is None else found.to_dict()

        return {
            "concurrency": self.concurrency,
            **{key: iv(key) for key in _RUN_FIGURES},
            "meets_slo": self.meets_slo, "slo_failed": list(self.slo_failed), "slo_values": dict(self.slo_values),
            "regime": self.regime,
            "valid": self.valid, "invalid_reasons": list(self.invalid_reasons),
            "kv_usage_peak": self.kv_usage_peak, "preemptions": self.preemptions, "waiting_peak": self.waiting_peak,
            "run_ids": list(self.run_ids),
            "excluded_runs": [{"run_id": run, "reasons": list(reasons)} for run, reasons in self.excluded_runs],
            "percentile_note": "; ".join(self.percentile_notes) or None,
            "slo_note": "; ".join(self.slo_notes) or None,
            "ttft_by_turn": [t._asdict() for t in self.turns],
        }


class TurnTtft(NamedTuple):
    """One turn of a point's conversations: how long its prompts were, and its TTFT p50."""

    turn: int
    prompt_tokens: float
    ttft_p50_s: float | None


def _turns(runs: Sequence[Measurement]) -> tuple[TurnTtft, ...]:
    """Each turn's mean prompt (from the records) and TTFT p50, the median of the runs' own p50s (their
    summaries): the context grows with the turn, and this is how TTFT follows it. Empty without sessions."""
    prompts: dict[int, list[int]] = {}
    for r in (rec for run in runs for rec in run.records if rec.turn is not None):
        prompts.setdefault(r.turn, []).append(r.prompt_len)  # type: ignore[arg-type]
    found = []
    for turn in sorted(prompts):
        p50s = [d.p50 for run in runs if run.summary is not None and run.summary.ttft_by_turn
                and (d := run.summary.ttft_by_turn.get(str(turn))) is not None]
        found.append(TurnTtft(turn, statistics.fmean(prompts[turn]), statistics.median(p50s) if p50s else None))
    return tuple(found)


def _ivd(found: Estimate | None) -> dict[str, Any] | None:
    return None if found is None else found.to_dict()


@dataclass(frozen=True)
class SweetSpot:
    concurrency: int
    output_tok_s: Estimate | None
    ttft_p99_s: Estimate | None
    evidence: tuple[str, ...]
    #: The sweep still scaled at its last point: the knee lies beyond what was measured.
    end_of_sweep: bool

    def to_dict(self) -> dict[str, Any]:
        return {"concurrency": self.concurrency, "output_tok_s": _ivd(self.output_tok_s),
                "ttft_p99_s": _ivd(self.ttft_p99_s), "evidence": list(self.evidence), "end_of_sweep": self.end_of_sweep}


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

    def to_dict(self) -> dict[str, Any]:
        return {"concurrency": self.concurrency, "regime": self.regime, "kv_usage_peak": self.kv_usage_peak,
                "kv_fit_predicted": self.kv_fit_predicted, "predicted_onset": self.predicted_onset,
                "kv_plan": None if self.kv_plan is None else self.kv_plan.to_dict(),
                "matches_prediction": None if self.predicted_onset is None
                else self.predicted_onset == self.concurrency, "evidence": list(self.evidence)}


@dataclass(frozen=True)
class MaxGoodput:
    concurrency: int
    goodput_req_s: Estimate | None
    output_tok_s: Estimate | None
    #: The first valid point above it that fails the SLO: (concurrency, failed objectives).
    first_failing: tuple[int, tuple[str, ...]] | None
    evidence: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        failing = None if self.first_failing is None else {
            "concurrency": self.first_failing[0], "failed": list(self.first_failing[1])}
        return {"concurrency": self.concurrency, "goodput_req_s": _ivd(self.goodput_req_s),
                "output_tok_s": _ivd(self.output_tok_s), "first_failing": failing, "evidence": list(self.evidence)}


@dataclass(frozen=True)
class Occupancy:
    """Continuous over static waves at one concurrency: the throughput ratio and its mechanism."""

    ratio: Estimate
    mean_decoding: float | None
    static_mean_decoding: float | None
    #: What the output lengths allow: N x (1 - idle share) of each layout (batchbench.theory).
    ideal_mean_decoding: float | None
    ideal_static_mean_decoding: float | None
    evidence: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"ratio": self.ratio.to_dict(), "within_noise": self.ratio.within_noise,
                "mean_decoding": self.mean_decoding, "ideal_mean_decoding": self.ideal_mean_decoding,
                "static_mean_decoding": self.static_mean_decoding,
                "ideal_static_mean_decoding": self.ideal_static_mean_decoding, "evidence": list(self.evidence)}


@dataclass(frozen=True)
class ContinuousOverStatic:
    at: dict[int, Occupancy]
    #: The concurrency the headline (and ``within_noise``) is about: the sweet spot where static ran there too,
    #: else the highest concurrency both ran.
    concurrency: int

    @property
    def headline(self) -> Occupancy:
        return self.at[self.concurrency]

    def to_dict(self, sweet_spot: int | None) -> dict[str, Any]:
        at_sweet = self.at.get(sweet_spot) if sweet_spot is not None else None
        return {"at": {str(c): o.to_dict() for c, o in sorted(self.at.items())},
                "at_sweet_spot": None if at_sweet is None else at_sweet.ratio.to_dict(),
                "concurrency": self.concurrency, "within_noise": self.headline.ratio.within_noise}


@dataclass(frozen=True)
class PaddingAt:
    """A batch with one long prompt (padded-mixed) against a homogeneous one, at one batch size."""

    padded_fraction_predicted: float
    #: E2E p50 of the mixed batch over the homogeneous one's, and TTFT p50 likewise.
    latency_ratio: Estimate | None
    ttft_ratio: Estimate | None
    #: What the mixed batch costs over the homogeneous one in real prompt tokens, and padded to its longest prompt.
    real_token_ratio: float
    padded_token_ratio: float
    #: The engine's own pad fraction (a padding engine's report), median over runs; None if it reports none.
    measured_pad_fraction: float | None
    evidence: tuple[str, ...]

    @property
    def pays_for_padding(self) -> bool | None:
        """Whether the mixed batch cost more than its real tokens explain, beyond noise (the latency ratio's low
        end above the real-token ratio): what an engine that pads shows. None without a latency ratio.
        (An engine that packs sequences may still exceed it a little: attention grows with the long prompt.)"""
        return None if self.latency_ratio is None else self.latency_ratio.low > self.real_token_ratio

    def to_dict(self) -> dict[str, Any]:
        return {"padded_fraction_predicted": self.padded_fraction_predicted,
                "latency_ratio": _ivd(self.latency_ratio), "ttft_ratio": _ivd(self.ttft_ratio),
                "within_noise": None if self.latency_ratio is None else self.latency_ratio.within_noise,
                "real_token_ratio": self.real_token_ratio, "padded_token_ratio": self.padded_token_ratio,
                "measured_pad_fraction": self.measured_pad_fraction, "pays_for_padding": self.pays_for_padding,
                "evidence": list(self.evidence)}


@dataclass(frozen=True)
class PaddingCost:
    at: dict[int, PaddingAt]
    #: The batch size the headline keys are about: the largest measured.
    concurrency: int

    def to_dict(self) -> dict[str, Any]:
        return {**self.at[self.concurrency].to_dict(), "concurrency": self.concurrency,
                "at": {str(c): p.to_dict() for c, p in sorted(self.at.items())}}


@dataclass(frozen=True)
class Recommendation:
    latency_pool_max_num_seqs: int | None
    throughput_pool_concurrency: int | None
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {"latency_pool_max_num_seqs": self.latency_pool_max_num_seqs,
                "throughput_pool_concurrency": self.throughput_pool_concurrency, "why": self.why}


@dataclass(frozen=True)
class LayoutFindings:
    """One engine's findings in one layout."""

    engine: str
    layout: str
    points: tuple[PointFindings, ...]
    sweet_spot: SweetSpot | None
    memory_bound_from: MemoryBound | None
    max_goodput_under_slo: MaxGoodput | None
    continuous_over_static: ContinuousOverStatic | None
    padding_cost: PaddingCost | None
    recommended: Recommendation
    #: Why there is no curve to read (one valid point, a padding layout); None when there is one.
    no_curve: str | None = None

    def point(self, concurrency: int) -> PointFindings | None:
        return next((p for p in self.points if p.concurrency == concurrency), None)

    @property
    def valid_points(self) -> list[PointFindings]:
        return [p for p in self.points if p.valid]

    def to_dict(self) -> dict[str, Any]:
        return {
            "points": [p.to_dict() for p in self.points],
            "sweet_spot": None if self.sweet_spot is None else self.sweet_spot.to_dict(),
            "memory_bound_from": None if self.memory_bound_from is None else self.memory_bound_from.to_dict(),
            "max_goodput_under_slo": None if self.max_goodput_under_slo is None
            else self.max_goodput_under_slo.to_dict(),
            "continuous_over_static": None if self.continuous_over_static is None
            else self.continuous_over_static.to_dict(self.sweet_spot.concurrency if self.sweet_spot else None),
            "padding_cost": None if self.padding_cost is None else self.padding_cost.to_dict(),
            "recommended": self.recommended.to_dict(),
            "no_curve": self.no_curve,
        }


@dataclass(frozen=True)
class Comparison:
    """One figure of two engines, as ``a / b``."""

    metric: str
    layout: str
    a: str
    b: str
    ratio: Estimate

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "layout": self.layout, "a": self.a, "b": self.b,
                "ratio": self.ratio.to_dict(), "within_noise": self.ratio.within_noise}


@dataclass(frozen=True)
class SpeculationAt:
    """One batch size measured with and without speculation."""

    concurrency: int
    tpot_without: Estimate | None
    tpot_with: Estimate | None
    #: TPOT without over TPOT with (> 1: speculation pays).
    speedup: Estimate | None
    #: Accepted over drafted tokens, and tokens per drafted step, by the engine's counters (median of the runs).
    acceptance_rate: float | None
    tokens_per_step: float | None
    #: Both points valid (:mod:`batchbench.validity`); an invalid pair is shown but not used for the crossover.
    valid: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {"concurrency": self.concurrency, "tpot_p50_without_s": _ivd(self.tpot_without),
                "tpot_p50_with_s": _ivd(self.tpot_with), "speedup": _ivd(self.speedup),
                "acceptance_rate": self.acceptance_rate, "tokens_per_step": self.tokens_per_step,
                "valid": self.valid}


@dataclass(frozen=True)
class Speculation:
    """One engine and layout with speculation against without (the same configuration otherwise)."""

    engine: str
    layout: str
    #: The two curves' engine keys, as the layouts' findings name them.
    with_key: str
    without_key: str
    method: str
    draft_tokens: int
    at: tuple[SpeculationAt, ...]
    #: The first valid batch size at which the median speedup is <= 1; None: speculation paid at every valid one.
    crossover: int | None

    def to_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "layout": self.layout, "with": self.with_key, "without": self.without_key,
                "method": self.method, "draft_tokens": self.draft_tokens, "points": [a.to_dict() for a in self.at],
                "crossover": self.crossover,
                "largest_measured": max((a.concurrency for a in self.at if a.valid), default=None)}


@dataclass(frozen=True)
class Findings:
    """Everything the runs say (module docstring); :meth:`to_dict` is what the report and report.json read."""

    slo: Slo | None
    sentences: tuple[str, ...]
    engines: dict[str, dict[str, LayoutFindings]]
    comparisons: tuple[Comparison, ...]
    #: Documents that are no point of a curve, each named with why.
    skipped: tuple[str, ...] = ()
    seed: int = 0
    #: Per engine, whether it served the workload as written, by its own token counts (:mod:`batchbench.parity`).
    parity: dict[str, Parity] = dataclasses.field(default_factory=dict)
    speculation: tuple[Speculation, ...] = ()

    def layout(self, engine: str, layout: str) -> LayoutFindings | None:
        return self.engines.get(engine, {}).get(layout)

    @property
    def invalid_points(self) -> list[tuple[str, str, PointFindings]]:
        return [(engine, layout, p) for engine, layouts in self.engines.items()
                for layout, found in layouts.items() for p in found.points if not p.valid]

    def to_dict(self) -> dict[str, Any]:
        return {
            "slo": None if self.slo is None else self.slo.to_dict(),
            "sentences": list(self.sentences),
            "engines": {engine: {layout: f.to_dict() for layout, f in layouts.items()}
                        for engine, layouts in self.engines.items()},
            "comparisons": [c.to_dict() for c in self.comparisons],
            "invalid_points": [{"engine": engine, "layout": layout, "concurrency": p.concurrency,
                                "reasons": list(p.invalid_reasons)} for engine, layout, p in self.invalid_points],
            "skipped": list(self.skipped),
            "parity": {engine: p.to_dict() for engine, p in self.parity.items()},
            "speculation": [sp.to_dict() for sp in self.speculation],
            "intervals": {"repeats": "median and min-max of the valid repeats",
                          "bootstrap": f"a single run: its statistic and the middle {BOOTSTRAP_CONFIDENCE:.0%} of "
                                       f"{BOOTSTRAP_RESAMPLES} resamples of its requests (seed {self.seed})"},
        }


# --------------------------------------------------------------------------- computing them


def _figures(point: Point, slo: Slo | None, seed: int) -> dict[str, Estimate | None]:
    """Each figure of the point: the repeats' median and range over its used runs, or (one run) the bootstrap."""
    runs = point.used
    keys = [k for k in _RUN_FIGURES if k != "goodput_req_s" or slo is not None]
    if len(runs) >= 2:
        return {k: Estimate.of_repeats([v for r in runs if (v := r.value(k)) is not None]) for k in keys}
    run = runs[0]
    if run.summary is None or not run.duration_s:
        return dict.fromkeys(keys)
    limits = slo.request_limits() if slo is not None else None
    requests = _requests(run.records, run.duration_s, limits)
    return bootstrap(requests, _request_statistics(run.duration_s, slo is not None), seed=f"{seed}:{run.run_id}")


def _slo_values(point: Point, slo: Slo) -> dict[str, float | None]:
    """Each objective's value at the point: the median over its used runs (None when a run had no samples)."""
    values: dict[str, float | None] = {}
    for objective in slo.objectives:
        found = [r.verdict.values.get(objective.name) if r.verdict is not None else None for r in point.used]
        present = [v for v in found if v is not None]
        values[objective.name] = statistics.median(present) if present and len(present) == len(found) else None
    return values


def _slo_verdict(point: Point, slo: Slo, values: dict[str, float | None]
                 ) -> tuple[bool | None, tuple[str, ...], tuple[str, ...]]:
    """(meets, failed objectives, why it cannot say): the SLO against the medians of the used runs' values,
    judged by :meth:`Slo.verdict` as one run is judged. None for an invalid point, or one whose objectives'
    percentiles its samples do not support."""
    notes = tuple(dict.fromkeys(reason for r in point.used for reason in r.validity.slo_reasons))
    if notes or not point.valid:
        return None, (), notes
    verdict = slo.verdict(values)
    return verdict.met, verdict.failed, ()


def _point_findings(point: Point, slo: Slo | None, seed: int, regime: Regime | None) -> PointFindings:
    used = point.used
    values = _slo_values(point, slo) if slo is not None else {}
    meets, failed, slo_notes = _slo_verdict(point, slo, values) if slo is not None else (None, (), ())
    several = len(point.runs) > 1
    invalid = () if point.valid else tuple(dict.fromkeys(
        f"{r.run_id}: {reason}" if several else reason for r in point.runs for reason in r.validity.reasons))
    pct_notes = tuple(dict.fromkeys(n for r in used for n in r.validity.percentile_notes))

    def peak(values: Iterable[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return max(present) if present else None

    return PointFindings(
        concurrency=point.concurrency, figures=_figures(point, slo, seed), meets_slo=meets, slo_failed=failed,
        slo_values=values,
        regime=regime, valid=point.valid, invalid_reasons=invalid,
        kv_usage_peak=peak(r.kv_usage_peak for r in used), preemptions=peak(r.preemptions for r in used),
        waiting_peak=peak(r.waiting_peak for r in used), run_ids=tuple(r.run_id for r in used),
        excluded_runs=tuple((r.run_id, r.validity.reasons) for r in point.runs if point.valid and not r.valid),
        percentile_notes=pct_notes, slo_notes=slo_notes, turns=_turns(used),
    )


def _most_common(values: Iterable[int | None]) -> int | None:
    present = Counter(v for v in values if v is not None)
    return present.most_common(1)[0][0] if present else None


def _regimes(points: Sequence[Point]) -> tuple[RegimeReport | None, str | None]:
    """The regimes of a layout's valid points, or why there are none."""
    swept = [(p, sp) for p in points if p.valid and (sp := p.sweep_point()) is not None]
    if len(swept) < 2:
        measured = ", ".join(str(p.concurrency) for p, _ in swept) or "none"
        return None, f"{len(swept)} valid concurrency measured ({measured}): no curve to read regimes from"
    return classify_regimes([sp for _, sp in swept]), None


def _layout_findings(engine: str, layout: str, points: Sequence[Point], slo: Slo | None, seed: int) -> LayoutFindings:
    report, no_curve = (None, f"{layout} is a padding comparison, not a curve") if layout in PADDING_LAYOUTS \
        else _regimes(points)
    labels = report.labels if report is not None else {}
    found = tuple(_point_findings(p, slo, seed, labels.get(p.concurrency) if p.valid else None) for p in points)
    by_c = {p.concurrency: p for p in found}

    sweet = None
    memory = None
    if report is not None:
        s = by_c[report.sweet_spot]
        sweet = SweetSpot(s.concurrency, s.figure("output_tok_s"), s.figure("ttft_p99_s"), s.run_ids,
                          end_of_sweep=report.sweet_spot == report.points[-1].concurrency)
        third = report.in_regime("memory-bound", "saturated")
        if third:
            first = by_c[third[0].concurrency]
            fit = _most_common(r.kv_fit for p in points for r in p.runs)
            above = sorted(p.concurrency for p in found if p.valid and fit is not None and p.concurrency > fit)
            plans = Counter(r.kv_plan for p in points for r in p.runs if r.kv_plan is not None)
            memory = MemoryBound(first.concurrency, third[0].regime, first.kv_usage_peak, fit,
                                 above[0] if above else None, first.run_ids,
                                 plans.most_common(1)[0][0] if plans else None)
    goodput = _max_goodput(found, slo) if slo is not None else None
    return LayoutFindings(engine, layout, found, sweet, memory, goodput, None, None,
                          _recommend(found, slo, sweet, goodput, no_curve), no_curve)


def _max_goodput(points: Sequence[PointFindings], slo: Slo) -> MaxGoodput | None:
    meeting = [p for p in points if p.valid and p.meets_slo and p.figure("goodput_req_s") is not None]
    if not meeting:
        return None
    best = max(meeting, key=lambda p: (p.figure("goodput_req_s").median, -p.concurrency))  # type: ignore[union-attr]
    failing = next((p for p in points if p.valid and p.concurrency > best.concurrency and p.meets_slo is False), None)
    return MaxGoodput(best.concurrency, best.figure("goodput_req_s"), best.figure("output_tok_s"),
                      None if failing is None else (failing.concurrency, failing.slo_failed), best.run_ids)


def _ttft_slo(slo: Slo | None) -> Slo | None:
    if slo is None:
        return None
    ttft = tuple(o for o in slo.objectives if o.metric == "ttft")
    return Slo(ttft) if ttft else None


def _recommend(points: Sequence[PointFindings], slo: Slo | None, sweet: SweetSpot | None,
               goodput: MaxGoodput | None, no_curve: str | None) -> Recommendation:
    """The latency pool: the largest concurrency up to which every valid point holds the SLO's TTFT objectives
    (without one: the sweet spot). The throughput pool: the most goodput (without an SLO: throughput) of a
    valid point before regime 3, where more requests only queue."""
    valid = [p for p in points if p.valid]
    if no_curve is not None:
        return Recommendation(None, None, f"no recommendation: {no_curve}")
    ttft = _ttft_slo(slo)
    why: list[str] = []
    latency: int | None = None
    if ttft is not None:
        stopped = ""  # why the walk up the curve stopped: the first point that fails, or cannot be judged
        for p in valid:
            unsupported = [n for n in p.slo_notes if any(f" {o.name} " in n for o in ttft.objectives)]
            if unsupported:
                stopped = f"the TTFT objectives cannot be judged at {p.concurrency} ({unsupported[0]})"
                break
            verdict = ttft.verdict(p.slo_values)
            if not verdict.met:
                stopped = f"{', '.join(verdict.failed)} at {p.concurrency}"
                break
            latency = p.concurrency
        if latency is not None:
            why.append(f"latency pool {latency}: the largest batch holding {ttft}")
            why += [stopped] if stopped else []
        else:
            why.append(f"no latency pool: {stopped or f'{ttft} fails from the lowest concurrency'}")
    else:
        latency = sweet.concurrency if sweet is not None else None
        why.append(f"latency pool {latency}: the sweet spot (no TTFT objective given)")
    ahead = [p for p in valid if p.regime is not None and REGIME_RANK[p.regime] < 2]
    if slo is not None:
        candidates = [p for p in ahead if p.figure("goodput_req_s") is not None]
        best = max(candidates, key=lambda p: p.figure("goodput_req_s").median, default=None)  # type: ignore
        what = "most goodput"
    else:
        candidates = [p for p in ahead if p.figure("output_tok_s") is not None]
        best = max(candidates, key=lambda p: p.figure("output_tok_s").median, default=None)  # type: ignore
        what = "most output tokens/s"
    throughput = best.concurrency if best is not None else None
    why.append(f"throughput pool {throughput}: the {what} before the memory-bound/saturated regime"
               if throughput is not None else "no throughput pool: no valid point before regime 3")
    return Recommendation(latency, throughput, "; ".join(why))


def _ideal_decoding(run: Measurement) -> tuple[float, float] | None:
    """(continuous, static waves) mean requests decoding the run's output lengths allow: N x (1 - idle share)."""
    outputs = [r.output_tokens if r.ok else r.max_tokens for r in run.ordered_records()]
    if not outputs or sum(outputs) == 0:
        return None
    n = run.concurrency
    return n * (1 - continuous_idle_fraction(outputs, n)), n * (1 - waves_idle_fraction(outputs, n))


def _continuous_over_static(cont: LayoutFindings, static: LayoutFindings, points: dict[int, Point]
                            ) -> ContinuousOverStatic | None:
    at: dict[int, Occupancy] = {}
    for p in cont.valid_points:
        s = static.point(p.concurrency)
        a, b = p.figure("output_tok_s"), s.figure("output_tok_s") if s is not None and s.valid else None
        ratio = a.ratio(b) if a is not None and b is not None else None
        if ratio is None or s is None:
            continue
        ideal = _ideal_decoding(points[p.concurrency].used[0])
        md, smd = p.figure("mean_decoding"), s.figure("mean_decoding")
        at[p.concurrency] = Occupancy(ratio, md.median if md else None, smd.median if smd else None,
                                      ideal[0] if ideal else None, ideal[1] if ideal else None, p.run_ids + s.run_ids)
    if not at:
        return None
    sweet = cont.sweet_spot.concurrency if cont.sweet_spot is not None else None
    return ContinuousOverStatic(at, sweet if sweet in at else max(at))


def _padded_share(run: Measurement) -> tuple[float, int, int] | None:
    """(padded share, padded slots, real tokens) of a run's prompts batched as it sent them: by wave, else in
    sends of its concurrency."""
    records = run.ordered_records()
    if not records:
        return None
    waves: dict[int, list[int]] = {}
    for i, r in enumerate(records):
        waves.setdefault(r.wave if r.wave is not None else i // run.concurrency, []).append(r.prompt_len)
    slots = sum(len(lens) * max(lens) for lens in waves.values())
    padded = sum(padding_fraction(lens) * len(lens) * max(lens) for lens in waves.values())
    return (padded / slots if slots else 0.0), slots, sum(len_ for lens in waves.values() for len_ in lens)


def _padding_cost(mixed: LayoutFindings, homogeneous: LayoutFindings, mixed_points: dict[int, Point],
                  homogeneous_points: dict[int, Point]) -> PaddingCost | None:
    at: dict[int, PaddingAt] = {}
    for p in mixed.valid_points:
        h = homogeneous.point(p.concurrency)
        if h is None or not h.valid:
            continue
        shares = _padded_share(mixed_points[p.concurrency].used[0])
        plain = _padded_share(homogeneous_points[p.concurrency].used[0])
        if shares is None or plain is None or plain[2] == 0:
            continue

        def ratio(key: str, h: PointFindings = h, p: PointFindings = p) -> Estimate | None:
            a, b = p.figure(key), h.figure(key)
            return a.ratio(b) if a is not None and b is not None else None

        reported = [v for r in mixed_points[p.concurrency].used
                    if isinstance(v := r.engine_report.get("prompt_pad_fraction"), int | float)]
        at[p.concurrency] = PaddingAt(shares[0], ratio("e2e_p50_s"), ratio("ttft_p50_s"), shares[2] / plain[2],
                                      shares[1] / plain[2], statistics.median(reported) if reported else None,
                                      p.run_ids + h.run_ids)
    return PaddingCost(at, max(at)) if at else None


def _comparisons(engines: dict[str, dict[str, LayoutFindings]], slo: Slo | None) -> list[Comparison]:
    """Each pair of engines, per layout: throughput at their sweet spots (else at the highest concurrency both ran
    validly), and with an SLO the most goodput under it."""
    found: list[Comparison] = []
    names = sorted(engines)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            for layout in sorted(set(engines[a]) & set(engines[b]), key=_layout_rank):
                fa, fb = engines[a][layout], engines[b][layout]
                if fa.sweet_spot is not None and fb.sweet_spot is not None:
                    pair = (fa.sweet_spot.output_tok_s, fb.sweet_spot.output_tok_s, "output_tok_s at sweet spot")
                else:
                    common = sorted({p.concurrency for p in fa.valid_points} & {p.concurrency for p in fb.valid_points})
                    pa, pb = (fa.point(common[-1]), fb.point(common[-1])) if common else (None, None)
                    pair = (pa.figure("output_tok_s") if pa else None, pb.figure("output_tok_s") if pb else None,
                            f"output_tok_s at concurrency {common[-1]}" if common else "")
                goodputs = (fa.max_goodput_under_slo, fb.max_goodput_under_slo)
                pairs = [pair]
                if slo is not None and goodputs[0] is not None and goodputs[1] is not None:
                    pairs.append((goodputs[0].goodput_req_s, goodputs[1].goodput_req_s, "max goodput under SLO"))
                for ea, eb, metric in pairs:
                    ratio = ea.ratio(eb) if ea is not None and eb is not None else None
                    if ratio is not None:
                        found.append(Comparison(metric, layout, a, b, ratio))
    return found


def _without_speculation(batching: Mapping[str, Any]) -> BatchingConfig | None:
    try:
        config = BatchingConfig(**batching)
    except (TypeError, ValueError):
        return None
    return dataclasses.replace(config, speculative_method=None, speculative_tokens=None)


def _speculation(points: Sequence[Point], seed: int) -> list[Speculation]:
    """Pair each curve run with speculation with the curve of the same engine, layout and otherwise equal
    batching configuration run without; per batch size both measured, TPOT p50's ratio and the counters."""
    curves: dict[tuple[str, str], list[Point]] = {}
    for p in points:
        if p.used and p.layout not in PADDING_LAYOUTS:
            curves.setdefault((p.engine, p.layout), []).append(p)
    found: list[Speculation] = []
    for (key, layout), with_points in curves.items():
        batching = with_points[0].used[0].batching
        config = _without_speculation(batching)
        if config is None or batching.get("speculative_method") is None:
            continue
        name = key.split(" [", 1)[0]
        partner = next(((k, ps) for (k, lay), ps in curves.items() if lay == layout and k != key
                        and k.split(" [", 1)[0] == name and ps[0].used[0].batching.get("speculative_method") is None
                        and _without_speculation(ps[0].used[0].batching) == config), None)
        if partner is None:
            continue
        without = {p.concurrency: p for p in partner[1]}
        at: list[SpeculationAt] = []
        for p in sorted(with_points, key=lambda q: q.concurrency):
            if p.concurrency not in without:
                continue
            on, off = _figures(p, None, seed).get("tpot_p50_s"), _figures(without[p.concurrency], None, seed).get(
                "tpot_p50_s")
            counters = [r.spec for r in p.used if r.spec is not None]
            rates = [c.acceptance_rate for c in counters if c.acceptance_rate is not None]
            steps = [c.tokens_per_step for c in counters if c.tokens_per_step is not None]
            at.append(SpeculationAt(p.concurrency, off, on, off.ratio(on) if off is not None and on is not None
                                    else None, statistics.median(rates) if rates else None,
                                    statistics.median(steps) if steps else None,
                                    p.valid and without[p.concurrency].valid))
        if not at:
            continue
        speedups = {a.concurrency: a.speedup.median for a in at if a.speedup is not None and a.valid}
        draft = BatchingConfig(**batching).draft_tokens or 0
        found.append(Speculation(name, layout, key, partner[0], str(batching["speculative_method"]), draft,
                                 tuple(at), crossover(speedups)))
    return found


def findings_from_points(points: Sequence[Point], *, slo: Slo | None = None, seed: int = 0,
                         skipped: Sequence[str] = ()) -> Findings:
    """Findings of grouped points (:func:`points_from_documents`); ``seed`` seeds the bootstraps."""
    grouped: dict[str, dict[str, list[Point]]] = {}
    for p in points:
        grouped.setdefault(p.engine, {}).setdefault(p.layout, []).append(p)
    engines: dict[str, dict[str, LayoutFindings]] = {}
    for engine in sorted(grouped):
        layouts = {layout: sorted(ps, key=lambda p: p.concurrency)
                   for layout, ps in sorted(grouped[engine].items(), key=lambda kv: _layout_rank(kv[0]))}
        found = {layout: _layout_findings(engine, layout, ps, slo, seed) for layout, ps in layouts.items()}
        by_c = {layout: {p.concurrency: p for p in ps} for layout, ps in layouts.items()}
        if "continuous" in found and "static-waves" in found:
            cos = _continuous_over_static(found["continuous"], found["static-waves"], by_c["continuous"])
            found["continuous"] = dataclasses.replace(found["continuous"], continuous_over_static=cos)
        if "padded-mixed" in found and "homogeneous" in found:
            cost = _padding_cost(found["padded-mixed"], found["homogeneous"], by_c["padded-mixed"],
                                 by_c["homogeneous"])
            found["padded-mixed"] = dataclasses.replace(found["padded-mixed"], padding_cost=cost)
        engines[engine] = found
    comparisons = _comparisons(engines, slo)
    parities = {engine: parity.check([r for p in points if p.engine == engine for run in p.runs for r in run.records])
                for engine in engines}
    draft = Findings(slo, (), engines, tuple(comparisons), tuple(skipped), seed, parities,
                     tuple(_speculation(points, seed)))
    return dataclasses.replace(draft, sentences=tuple(sentences(draft)))


def findings_from_documents(docs: Iterable[RunDocument | tuple[str, RunDocument]], *, slo: Slo | None = None,
                            seed: int = 0, suite: str | None = None) -> Findings:
    """The findings of results documents (or (source, document) pairs): the entry point of the CLI and the
    report. ``slo``: judge goodput and the SLO against it (None: no SLO findings); ``suite``: only runs
    labelled with this suite."""
    skipped: list[str] = []
    points = points_from_documents(docs, slo=slo, suite=suite, skipped=skipped)
    return findings_from_points(points, slo=slo, seed=seed, skipped=skipped)


def findings_from_dir(path: str | Path, *, slo: Slo | None = None, seed: int = 0, suite: str | None = None,
                      exclude: str | Path | None = None) -> Findings:
    """The findings of every results document under a run folder (:func:`batchbench.results.discover`);
    unreadable files are listed in ``skipped``."""
    found = discover(path, exclude=exclude)
    skipped: list[str] = list(found.warnings)
    points = points_from_documents(found.documents, slo=slo, suite=suite, skipped=skipped)
    return findings_from_points(points, slo=slo, seed=seed, skipped=skipped)


# --------------------------------------------------------------------------- sentences


def _tok(v: float) -> str:
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def _x(v: float) -> str:
    return f"{v:.2f}" if math.isfinite(v) else "∞"


def _ratio_text(r: Estimate) -> str:
    return f"{_x(r.median)}x [{_x(r.low)}–{_x(r.high)}]"


def _curve_sentence(f: LayoutFindings) -> str:
    head = f"{f.engine}, {f.layout}:"
    if f.no_curve is not None:
        return f"{head} {f.no_curve}."
    assert f.sweet_spot is not None
    parts: list[str] = []
    under = [p.concurrency for p in f.points if p.regime == "under-utilised"]
    if under:
        parts.append(f"under-utilised up to batch {max(under)}")
    s = f.sweet_spot
    tok = f" ({s.output_tok_s.format(_tok)} tok/s)" if s.output_tok_s is not None else ""
    if s.end_of_sweep:
        parts.append(f"still scaling at batch {s.concurrency}{tok}, the largest measured: no knee within the sweep")
    else:
        parts.append(f"sweet spot at {s.concurrency}{tok}")
    m = f.memory_bound_from
    if m is not None:
        evidence = []
        if m.kv_usage_peak is not None:
            evidence.append(f"KV {m.kv_usage_peak:.0%} full")
        if m.kv_plan is not None:
            k = m.kv_plan
            evidence.append(f"planned: {k.kv_capacity_tokens} KV tokens at {k.kv_bytes_per_token} B/token hold "
                            f"{k.fit} sequences of {k.sequence_tokens} tokens")
        elif m.kv_fit_predicted is not None:
            evidence.append(f"predicted fit {m.kv_fit_predicted}")
        parts.append(f"{m.regime} from {m.concurrency}" + (f" ({'; '.join(evidence)})" if evidence else ""))
    return f"{head} {', '.join(parts)}."


def _occupancy_sentence(engine: str, c: ContinuousOverStatic) -> str:
    o = c.headline
    text = (f"{engine}: continuous batching gives {_ratio_text(o.ratio)} the throughput of static waves at batch "
            f"{c.concurrency}")
    if o.ratio.within_noise:
        text += ", within noise"
    if o.mean_decoding is not None and o.static_mean_decoding is not None:
        text += f": {o.mean_decoding:.1f} requests decoding on average vs {o.static_mean_decoding:.1f}"
        if o.ideal_mean_decoding is not None and o.ideal_static_mean_decoding is not None:
            text += f" (ideal {o.ideal_mean_decoding:.1f} vs {o.ideal_static_mean_decoding:.1f})"
    return text + "."


def _slo_sentence(f: LayoutFindings, slo: Slo) -> str:
    head = f"{f.engine}, {f.layout}, under {slo}:"
    g = f.max_goodput_under_slo
    if g is None:
        judged = [p for p in f.valid_points if p.meets_slo is not None]
        if not judged:
            notes = next((p.slo_notes[0] for p in f.valid_points if p.slo_notes), "no valid point")
            return f"{head} the data cannot say whether any point meets it ({notes})."
        first = judged[0]
        return f"{head} no valid point meets it; batch {first.concurrency} fails ({', '.join(first.slo_failed)})."
    text = f"{head} the most goodput is at batch {g.concurrency}"
    figures = [f"{g.goodput_req_s.format(_tok)} req/s"] if g.goodput_req_s is not None else []
    if g.output_tok_s is not None:
        figures.append(f"{_tok(g.output_tok_s.median)} tok/s")
    if figures:
        text += f" ({', '.join(figures)})"
    if g.first_failing is not None:
        text += f"; batch {g.first_failing[0]} fails it ({', '.join(g.first_failing[1])})"
    return text + "."


def _recommend_sentence(f: LayoutFindings) -> str | None:
    r = f.recommended
    if r.latency_pool_max_num_seqs is None and r.throughput_pool_concurrency is None:
        return None
    parts = []
    if r.latency_pool_max_num_seqs is not None:
        parts.append(f"a latency pool with max_num_seqs={r.latency_pool_max_num_seqs}")
    if r.throughput_pool_concurrency is not None:
        parts.append(f"a throughput pool at concurrency {r.throughput_pool_concurrency}")
    return f"Recommended for {f.engine} ({f.layout}): {' and '.join(parts)} ({r.why})."


def _padding_sentence(engine: str, cost: PaddingCost) -> str:
    p = cost.at[cost.concurrency]
    text = (f"{engine}: a batch of {cost.concurrency} with one long prompt is predicted to be "
            f"{p.padded_fraction_predicted:.1%} padding")
    if p.measured_pad_fraction is not None:
        text += f" (the engine reports {p.measured_pad_fraction:.1%})"
    if p.latency_ratio is not None:
        text += (f"; it took {_ratio_text(p.latency_ratio)} as long as a homogeneous batch (real tokens "
                 f"{p.real_token_ratio:.1f}x, padded {p.padded_token_ratio:.1f}x): "
                 + ("more than its real tokens explain" if p.pays_for_padding
                    else "no more than its real tokens explain, within noise"))
    return text + "."


def _speculation_sentence(sp: Speculation) -> str:
    first = sp.at[0]
    counters = ""
    if first.acceptance_rate is not None and first.tokens_per_step is not None:
        counters = (f", {first.acceptance_rate:.0%} of drafts accepted and {first.tokens_per_step:.2f} tokens per "
                    f"drafted step at batch {first.concurrency}")
    valid = [a for a in sp.at if a.valid]
    gains = ", ".join(f"x{_x(a.speedup.median)} at {a.concurrency}" for a in valid if a.speedup is not None)
    text = (f"{sp.engine}, {sp.layout}: {sp.method} speculation ({sp.draft_tokens} draft tokens{counters}) "
            f"changes TPOT p50 by {gains or 'n/a'} (without over with)")
    left_out = [str(a.concurrency) for a in sp.at if not a.valid]
    if left_out:
        text += f" (batch {', '.join(left_out)} left out: an invalid point)"
    if sp.crossover is not None:
        return text + f"; it stops paying from batch {sp.crossover}."
    if not valid:
        return text + "; no valid batch size says where it stops paying."
    return text + f"; it still pays at batch {max(a.concurrency for a in valid)}, the largest measured."


#: Short names for validity's reasons, by a phrase each reason of that kind contains (batchbench.validity).
_REASON_KINDS = (("other processes took", "machine busy"), ("the load generator", "client saturated"),
                 ("lagged their schedule", "schedule lag"), ("not warmed up", "not warmed up"),
                 ("failed", "failed requests"), ("no request succeeded", "failed requests"),
                 ("cut short", "cut short"))


def _by_kind(reason_lists: Iterable[Sequence[str]]) -> str:
    """``machine busy: 19, failed requests: 2``: how many of the points or runs had each kind of first reason."""
    counts: dict[str, int] = {}
    for reasons in reason_lists:
        reason = reasons[0] if reasons else "?"
        kind = next((name for phrase, name in _REASON_KINDS if phrase in reason), reason)
        counts[kind] = counts.get(kind, 0) + 1
    return ", ".join(f"{kind}: {n}" for kind, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def _levels(points: Sequence[tuple[str, str, PointFindings]]) -> str:
    """``vllm continuous at 1, 2; hf-static static-waves at 8``: the points, grouped by engine and layout."""
    grouped: dict[tuple[str, str], list[int]] = {}
    for engine, layout, p in points:
        grouped.setdefault((engine, layout), []).append(p.concurrency)
    return "; ".join(f"{e} {layout} at {', '.join(map(str, sorted(cs)))}" for (e, layout), cs in grouped.items())


def _turns_sentence(engine: str, layout: str, p: PointFindings) -> str | None:
    """How TTFT follows the conversation's growing context, first turn against last."""
    timed = [t for t in p.turns if t.ttft_p50_s is not None]
    if len(timed) < 2:
        return None
    first, last = timed[0], timed[-1]
    ratio = f" (x{last.ttft_p50_s / first.ttft_p50_s:.2f})" if first.ttft_p50_s else ""  # type: ignore[operator]
    return (f"{engine} {layout} at concurrency {p.concurrency}: over {last.turn}-turn conversations, TTFT p50 goes "
            f"from {first.ttft_p50_s * 1000:.1f} ms at turn {first.turn} ({first.prompt_tokens:.0f} prompt tokens) "
            f"to {last.ttft_p50_s * 1000:.1f} ms at turn {last.turn} ({last.prompt_tokens:.0f}){ratio}.")


def sentences(findings: Findings) -> list[str]:
    """The answer in plain English, most important first: engines against each other, then each engine's curve,
    what continuous batching bought, the SLO, the recommendation, padding; last what was left out and why."""
    out: list[str] = []
    for c in findings.comparisons:
        verdict = "within noise" if c.ratio.within_noise else f"{c.a} {'ahead' if c.ratio.median > 1 else 'behind'}"
        what = ("the most goodput under the SLO of {b}" if c.metric == "max goodput under SLO"
                else "the output tokens/s of {b} at their sweet spots" if c.metric == "output_tok_s at sweet spot"
                else "the output tokens/s of {b} at " + c.metric.removeprefix("output_tok_s at "))
        out.append(f"{c.layout}: {c.a} gives {_ratio_text(c.ratio)} {what.format(b=c.b)} ({verdict}).")
    for engine, layouts in findings.engines.items():
        for layout, f in layouts.items():
            if layout not in PADDING_LAYOUTS:
                out.append(_curve_sentence(f))
        cont, static = layouts.get("continuous"), layouts.get("static-waves")
        if cont is not None and cont.continuous_over_static is not None:
            out.append(_occupancy_sentence(engine, cont.continuous_over_static))
        elif cont is not None or static is not None:
            missing = "static-waves" if static is None else "continuous" if cont is None else "both at one concurrency"
            out.append(f"{engine}: continuous batching cannot be compared with static waves (no valid {missing} "
                       "point).")
        for layout, f in layouts.items():
            if findings.slo is not None and layout not in PADDING_LAYOUTS:
                out.append(_slo_sentence(f, findings.slo))
            if (text := _recommend_sentence(f)) is not None:
                out.append(text)
        out += [text for layout, f in layouts.items() for p in f.points
                if (text := _turns_sentence(engine, layout, p)) is not None]
        mixed = layouts.get("padded-mixed")
        if mixed is not None and mixed.padding_cost is not None:
            out.append(_padding_sentence(engine, mixed.padding_cost))
    for sp in findings.speculation:
        out.append(_speculation_sentence(sp))
    for engine, served in findings.parity.items():
        if (warning := served.warning()) is not None:
            out.append(f"{engine}: {warning}.")
    invalid = findings.invalid_points
    if invalid:
        out.append(f"{len(invalid)} point(s) invalid, shown but left out of the findings ("
                   f"{_by_kind(p.invalid_reasons[:1] for _, _, p in invalid)}): {_levels(invalid)}.")
    excluded = [(e, layout, p) for e, ls in findings.engines.items() for layout, f in ls.items()
                for p in f.points if p.excluded_runs]
    if excluded:
        count = sum(len(p.excluded_runs) for _, _, p in excluded)
        out.append(f"{count} invalid run(s) left out of otherwise valid points ("
                   f"{_by_kind(reasons[:1] for _, _, p in excluded for _, reasons in p.excluded_runs)}): "
                   f"{_levels(excluded)}; each run and its reason is in the report.")
    if findings.skipped:
        out.append(f"{len(findings.skipped)} document(s) not used: {'; '.join(findings.skipped)}.")
    return out
