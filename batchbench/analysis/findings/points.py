"""Runs read into points: one (engine, layout, concurrency) and every run of it, with its figures.

Every topic of the findings starts here. A results document becomes a :class:`Measurement` (one run,
judged by :mod:`batchbench.analysis.validity`); the runs of one engine, layout and concurrency are a
:class:`Point`; a point's figures are :class:`~batchbench.analysis.repeats.Estimate` s over its valid runs (the
mean with a 95% t-interval, the one method of :mod:`batchbench.analysis.repeats`), and :class:`PointFindings`
holds them with the point's regime, its SLO verdict and why any of its runs was left out.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from batchbench.analysis.accelerators import Accelerator
from batchbench.analysis.planner import CapacityFit, PlanError, fit_in_capacity, parameter_count
from batchbench.analysis.quantiles import Quantile, pooled
from batchbench.analysis.regimes import Regime, SweepPoint
from batchbench.analysis.repeats import DEFAULT_PRECISION, Estimate
from batchbench.analysis.run_bounds import RunLimit, run_limit
from batchbench.analysis.validity import Validity, check_run, document_summary
from batchbench.core import codec
from batchbench.core.config import BatchingConfig
from batchbench.core.records import RequestRecord
from batchbench.fixtures import shipped_model_dir
from batchbench.measures.metrics import Summary, latencies, summarize
from batchbench.measures.slo import Slo, Verdict
from batchbench.measures.speculation import SpeculationCounters
from batchbench.results.document import RunDocument

#: The layouts the main job runs, in the order findings list them: the two batching layouts of the curve,
#: then the padding pair (a batch with one long prompt, and one of short prompts only).
LAYOUTS = ("continuous", "static-waves", "padded-mixed", "homogeneous")
#: Layouts that are single batches compared with each other, not curves over concurrency.
PADDING_LAYOUTS = ("padded-mixed", "homogeneous")


def _dist(name: str, stat: str) -> Callable[[Summary], float | None]:
    def get(summary: Summary) -> float | None:
        dist = getattr(summary.steady or summary, name)
        return None if dist is None else float(getattr(dist, stat))
    return get


#: The per-run figures of a point, by the key findings and the report use.
FIGURES: dict[str, Callable[[Summary], float | None]] = {
    # A closed loop's point of the curve is its steady state (metrics.SteadyState): neither the opening burst nor
    # the drain, which weigh more the shorter a run is, bends it. Other arrivals: the whole run.
    "output_tok_s": lambda s: s.curve_throughput,
    "ttft_p50_s": _dist("ttft", "p50"),
    "ttft_p99_s": _dist("ttft", "p99"),
    "tpot_p50_s": _dist("tpot", "p50"),
    "tpot_p99_s": _dist("tpot", "p99"),
    "e2e_p50_s": _dist("e2e", "p50"),
    "run_output_tok_s": lambda s: s.output_token_throughput,
    "goodput_req_s": lambda s: s.goodput,
    "mean_decoding": lambda s: s.mean_decoding,
    # The GPUs' energy over the run (None: no GPU telemetry; the summary's energy says why).
    "tokens_per_joule": lambda s: s.energy.tokens_per_joule if s.energy is not None else None,
    "joules_per_request": lambda s: s.energy.joules_per_request if s.energy is not None else None,
    "usd_per_m_output_tokens": lambda s: s.energy.cost_per_million_output_tokens if s.energy is not None else None,
}
#: The figure a point's repeats are run until it is precise (``batchbench run --precision``).
KEY_FIGURE = "output_tok_s"
#: The percentiles a point also gives pooled over its repeats' requests, each with its own order-statistic interval
#: (:mod:`batchbench.analysis.quantiles`): figure key -> (per-request latency, quantile).
TAILS: dict[str, tuple[str, float]] = {"ttft_p50_s": ("ttft", 0.5), "ttft_p99_s": ("ttft", 0.99),
                                       "tpot_p50_s": ("tpot", 0.5), "tpot_p99_s": ("tpot", 0.99)}


class ModelScale(NamedTuple):
    """The served model's size, from its config."""

    parameters: int
    layers: int


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
    #: The precision its repeats were run to (a share; None: not run to one), and the job's time limit they were
    #: fitted into (None: not recorded).
    precision_target: float | None = None
    time_limit_s: float | None = None
    #: How big the served model is, and whether it ran on this host's CPU (None: not known): what a ranking of
    #: engines may be carried over to.
    model: ModelScale | None = None
    on_cpu: bool | None = None
    engine_report: Mapping[str, Any] = field(default_factory=dict, repr=False)
    records: tuple[RequestRecord, ...] = field(default=(), repr=False)
    #: The engine's batching configuration (None: unreadable) and its speculation counters' growth.
    batching: BatchingConfig | None = field(default=None, repr=False)
    speculation: SpeculationCounters | None = None
    #: The run's bound on paper (:mod:`batchbench.analysis.run_bounds`), or why it has none.
    limit: RunLimit | None = None
    no_limit: str | None = None

    @property
    def valid(self) -> bool:
        return self.validity.valid

    def value(self, figure: str) -> float | None:
        """One of :data:`FIGURES` from the summary."""
        return None if self.summary is None else FIGURES[figure](self.summary)

    def sweep_point(self) -> SweepPoint | None:
        """This run as :mod:`batchbench.analysis.regimes` sees it (None: no throughput or TTFT measured): its
        throughput is the key figure, the one every sentence about the curve quotes."""
        s = self.summary
        if s is None or s.ttft is None:
            return None
        return SweepPoint(self.concurrency, FIGURES[KEY_FIGURE](s) or 0.0, s.ttft.p50, s.ttft.p99,
                          self.kv_usage_peak, self.preemptions, self.waiting_peak)

    def latencies(self, metric: str) -> list[float]:
        """The run's samples of ``metric``: those its summary's distribution is of
        (:func:`~batchbench.measures.metrics.latencies`)."""
        return latencies(self.records, self.summary.steady if self.summary is not None else None, metric)

    def ordered_records(self) -> list[RequestRecord]:
        """Records in the workload's send order (request ids end in their zero-padded index)."""
        return sorted(self.records, key=lambda r: r.request_id)


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

    def estimate(self, figure: str) -> Estimate | None:
        """The figure over the used runs (:class:`~batchbench.analysis.repeats.Estimate`); None where no run has it."""
        return Estimate.of([v for r in self.used if (v := r.value(figure)) is not None])

    @property
    def precision_target(self) -> float | None:
        """The precision its repeats were run to (the tightest its runs name; None: none was asked)."""
        targets = [r.precision_target for r in self.runs if r.precision_target is not None]
        return min(targets) if targets else None

    def thin(self, figure: str = KEY_FIGURE) -> bool:
        """Whether ``figure``'s interval is too thin to decide on (:meth:`Estimate.thin`, at the precision asked,
        else :data:`~batchbench.analysis.repeats.DEFAULT_PRECISION`): such a point takes no part in choosing the
        sweet spot, the peak or the SLO boundary."""
        found = self.estimate(figure)
        return found is not None and found.thin(self.precision_target or DEFAULT_PRECISION)

    def sweep_point(self) -> SweepPoint | None:
        """The point as :mod:`batchbench.analysis.regimes` classifies it: the mean of each figure over the used runs
        (its throughput the key figure's estimate, the value its sentences quote), the highest of the memory
        evidence (a full cache that happened once did happen)."""
        points = [p for r in self.used if (p := r.sweep_point()) is not None]
        key = self.estimate(KEY_FIGURE)
        if not points or key is None:
            return None
        return SweepPoint(self.concurrency, key.value,
                          statistics.fmean(p.ttft_p50 for p in points), statistics.fmean(p.ttft_p99 for p in points),
                          peak(p.kv_usage_peak for p in points), peak(p.preemptions for p in points),
                          peak(p.waiting_peak for p in points))


def peak(values: Iterable[float | None]) -> float | None:
    """The highest of the values given (None: none): memory evidence that happened once did happen."""
    present = [v for v in values if v is not None]
    return max(present) if present else None


def ratio(a: Point, b: Point, figure: str) -> Estimate | None:
    """``figure`` of ``a`` over ``b``: paired by pass where every run of each that has the figure was measured in a
    pass with one of the other, at least two passes (the main job measures a comparison's two runs side by side:
    :meth:`Estimate.paired_ratio`), else from their repeats alone (:meth:`Estimate.ratio`). Either way its value is
    the ratio of the two means a sentence quotes beside it: pairing a subset would quote the subset's. None where
    either has no such figure."""
    ours = {r.repeat: v for r in a.used if r.repeat is not None and (v := r.value(figure)) is not None}
    theirs = {r.repeat: v for r in b.used if r.repeat is not None and (v := r.value(figure)) is not None}
    every = sum(r.value(figure) is not None for r in a.used), sum(r.value(figure) is not None for r in b.used)
    if a.valid and b.valid and ours.keys() == theirs.keys() and len(ours) >= 2 and every == (len(ours),) * 2:
        return Estimate.paired_ratio([(ours[k], theirs[k]) for k in sorted(ours)])
    ea, eb = a.estimate(figure), b.estimate(figure)
    return ea.ratio(eb) if ea is not None and eb is not None else None


class TurnTtft(NamedTuple):
    """One turn of a point's conversations: how long its prompts were, and its TTFT p50."""

    turn: int
    prompt_tokens: float
    ttft_p50_s: float | None


@dataclass(frozen=True)
class PointFindings:
    """One point's figures, regime, SLO verdict, precision and validity."""

    concurrency: int
    figures: dict[str, Estimate | None]
    regime: Regime | None
    valid: bool
    #: Why the point is invalid (every run invalid): the runs' reasons.
    invalid_reasons: tuple[str, ...]
    kv_usage_peak: float | None
    preemptions: float | None
    waiting_peak: float | None
    run_ids: tuple[str, ...]
    #: Invalid runs of a valid point, left out of its figures: (run id, reasons).
    excluded_runs: tuple[tuple[str, tuple[str, ...]], ...] = ()
    #: Percentiles shown that their samples do not support.
    percentile_notes: tuple[str, ...] = ()
    #: The precision its repeats were run to, and whether the key figure reached it (None: no target).
    precision_target: float | None = None
    #: Multi-turn conversations: each turn's mean prompt and TTFT p50 (median over the used runs).
    turns: tuple[TurnTtft, ...] = ()
    #: :data:`TAILS`, pooled over the used runs' requests, each with its own interval (or marked too few).
    tails: dict[str, Quantile] = field(default_factory=dict)

    def figure(self, key: str) -> Estimate | None:
        return self.figures.get(key)

    @property
    def thin(self) -> bool:
        """Whether the key figure is too thin to decide on (:meth:`Point.thin`)."""
        found = self.figure(KEY_FIGURE)
        return found is not None and found.thin(self.precision_target or DEFAULT_PRECISION)

    @property
    def precise(self) -> bool | None:
        """Whether the key figure's interval is within the precision target (None: no target was set)."""
        if self.precision_target is None:
            return None
        found = self.figure(KEY_FIGURE)
        return found is not None and found.precise(self.precision_target)

    def to_dict(self) -> dict[str, Any]:
        return {
            "concurrency": self.concurrency,
            **{key: codec.encode(self.figures.get(key)) for key in FIGURES},
            "regime": self.regime,
            "valid": self.valid, "invalid_reasons": list(self.invalid_reasons),
            "kv_usage_peak": self.kv_usage_peak, "preemptions": self.preemptions, "waiting_peak": self.waiting_peak,
            "run_ids": list(self.run_ids),
            "excluded_runs": [{"run_id": run, "reasons": list(reasons)} for run, reasons in self.excluded_runs],
            "percentile_note": "; ".join(self.percentile_notes) or None,
            "precision_target": self.precision_target, "precise": self.precise, "thin": self.thin,
            "ttft_by_turn": [t._asdict() for t in self.turns],
            "pooled": codec.encode(self.tails),
        }


def point_findings(point: Point, regime: Regime | None) -> PointFindings:
    """A point's figures (each over its used runs), with what was left out and why."""
    used = point.used
    several = len(point.runs) > 1
    invalid = () if point.valid else tuple(dict.fromkeys(
        f"{r.run_id}: {reason}" if several else reason for r in point.runs for reason in r.validity.reasons))
    return PointFindings(
        concurrency=point.concurrency,
        figures={key: point.estimate(key) for key in FIGURES},
        regime=regime, valid=point.valid, invalid_reasons=invalid,
        kv_usage_peak=peak(r.kv_usage_peak for r in used), preemptions=peak(r.preemptions for r in used),
        waiting_peak=peak(r.waiting_peak for r in used), run_ids=tuple(r.run_id for r in used),
        excluded_runs=tuple((r.run_id, r.validity.reasons) for r in point.runs if point.valid and not r.valid),
        percentile_notes=tuple(dict.fromkeys(n for r in used for n in r.validity.percentile_notes)),
        precision_target=point.precision_target, turns=_turns(used),
        tails={key: found for key, (metric, q) in TAILS.items()
               if (found := pooled([v for r in used for v in r.latencies(metric)], q)) is not None},
    )


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


# --------------------------------------------------------------------------- reading documents


def model_config(doc: RunDocument) -> dict[str, Any] | None:
    """The served model's config.json: from the folder the run names where it is readable here, else a shipped
    model's by the folder's name (a run measured elsewhere names its own checkout); None for neither (a model at a
    URL, a hub id)."""
    model = doc.header.engine.model
    path = model.path if model is not None else None
    if not path:
        return None
    for folder in (Path(path), shipped_model_dir(Path(path).name)):
        try:
            if folder is not None:
                return dict(json.loads((folder / "config.json").read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    return None


def _kv_plan(doc: RunDocument, config: Mapping[str, Any] | None, capacity: int | None) -> CapacityFit | None:
    """The planner (:func:`batchbench.analysis.planner.fit_in_capacity`) on the run's own figures: the served model's
    config, the cache's capacity and block size from the sweep's labels, and the workload's longest prompt and
    output; None when any is missing (a model at a URL, a run without a KV design)."""
    design, workload = doc.header.labels.design, doc.header.workload
    block = design.get("block_size") if design is not None else None
    prompt, output = (c.max if c is not None else None for c in (workload.prompt_tokens, workload.output_tokens))
    if not (capacity and config is not None and isinstance(block, int) and prompt and output):
        return None
    try:
        return fit_in_capacity(config, capacity, block_size=block, prompt_len=prompt, output_len=output,
                               kv_dtype=str(config.get("torch_dtype") or "bf16"))
    except (ValueError, PlanError):
        return None  # a config the planner cannot read: the report shows the rest


def _scale(config: Mapping[str, Any] | None) -> ModelScale | None:
    """How big the served model is (None: no config to tell)."""
    try:
        return None if config is None else ModelScale(parameter_count(config), int(config["num_hidden_layers"]))
    except (KeyError, TypeError, ValueError, PlanError):
        return None


def _on_cpu(doc: RunDocument) -> bool | None:
    """Whether the engine ran on this host's CPU: launched here (not at a URL) on a host without a GPU. None for
    an engine at a URL, whose hardware batchbench cannot see."""
    if doc.header.engine.mode == "url":
        return None
    return not doc.header.environment.get("gpus")


def layout_and_concurrency(doc: RunDocument) -> tuple[str, int] | None:
    """From the run's labels; else from its arrival (closed loop: continuous, waves: static-waves)."""
    labels, spec = doc.header.labels, doc.header.workload.spec
    arrival = spec.arrival if spec is not None else None
    layout = labels.layout
    if layout is None and arrival is not None:
        layout = {"closed": "continuous", "waves": "static-waves"}.get(arrival.kind)
    concurrency = labels.concurrency
    if concurrency is None and arrival is not None:
        concurrency = arrival.concurrency
    if layout is None or concurrency is None or concurrency < 1:
        return None
    return layout, concurrency


def _engine_keys(docs: Sequence[RunDocument]) -> list[str]:
    """The engine name, or ``name [batching]`` where one engine ran under several batching configs
    (their curves are different engines' curves)."""
    configs: dict[str, set[str]] = {}
    for doc in docs:
        configs.setdefault(doc.header.engine_name, set()).add(doc.header.batching_label)
    return [name if len(configs[name]) == 1 else f"{name} [{doc.header.batching_label}]"
            for doc in docs for name in [doc.header.engine_name]]


def _measure(doc: RunDocument, source: str | None, engine: str, layout: str, concurrency: int,
             slo: Slo | None, gpu: Accelerator | None) -> Measurement:
    summary = document_summary(doc)
    footer = doc.footer
    duration = footer.duration_s if footer is not None and footer.duration_s else (
        doc.observed_duration_s() if summary is not None else None)
    limits = slo.request_limits() if slo is not None else None
    stored = doc.header.slo.request_limits() if doc.header.slo is not None else (None, None)
    if summary is not None and limits is not None and limits != stored and duration:
        # Goodput counts requests within the limits; the run counted its own (or none).
        summary = dataclasses.replace(  # the records' figures again; the GPUs' energy is the run's own
            summarize(doc.records, duration_s=duration, ttft_slo_s=limits[0], tpot_slo_s=limits[1],
                      closed_loop=summary.steady is not None),  # as the run summarised itself
            energy=summary.energy)
    guard = doc.guardrails()
    labels = doc.header.labels
    config = model_config(doc)
    limit, no_limit = run_limit(doc, config, gpu=gpu)
    return Measurement(
        run_id=doc.header.run_id or source or "?", source=source, engine=engine, layout=layout,
        concurrency=concurrency, repeat=labels.repeat, summary=summary, duration_s=duration,
        verdict=slo.check(summary) if slo is not None and summary is not None else None,
        validity=check_run(doc, slo=slo, summary=summary),
        kv_usage_peak=guard.kv_usage_peak, preemptions=guard.preemptions, waiting_peak=guard.waiting_peak,
        kv_fit=labels.kv_fit, kv_capacity_tokens=labels.kv_capacity_tokens,
        kv_plan=_kv_plan(doc, config, labels.kv_capacity_tokens),
        model=_scale(config), on_cpu=_on_cpu(doc),
        precision_target=labels.precision if labels.precision and labels.precision > 0 else None,
        time_limit_s=labels.time_limit_s,
        engine_report=footer.engine_report if footer is not None else {}, records=tuple(doc.records),
        batching=doc.header.batching, speculation=SpeculationCounters.over(doc.server_metrics),
        limit=limit, no_limit=no_limit,
    )


def layout_rank(layout: str) -> tuple[int, str]:
    """Where a layout sorts: :data:`LAYOUTS` first, in their order, then any other by name."""
    return (LAYOUTS.index(layout), "") if layout in LAYOUTS else (len(LAYOUTS), layout)


def points_from_documents(
    docs: Iterable[RunDocument | tuple[str | None, RunDocument]], *, slo: Slo | None = None, suite: str | None = None,
    skipped: list[str] | None = None, gpu: Accelerator | None = None,
) -> list[Point]:
    """Group runs into points by (engine, layout, concurrency), each run judged by :mod:`batchbench.analysis.validity`.

    ``docs``: documents, or (source, document) pairs as :func:`batchbench.results.discovery.discover` finds them.
    ``suite``: only runs labelled with this suite. A run without a layout and concurrency (a label, or
    a closed-loop or waves arrival to read them from) is no point of a curve: it is left out, and
    ``skipped`` (when given) gets a line naming it. ``gpu``: the GPU every run's bound on paper is worked out for,
    in place of the one its NVML named (:func:`batchbench.analysis.run_bounds.run_limit`).
    """
    pairs: list[tuple[str | None, RunDocument]] = [(d[0], d[1]) if isinstance(d, tuple) else (None, d) for d in docs]
    pairs = [(src, doc) for src, doc in pairs if suite is None or doc.header.labels.suite == suite]
    grouped: dict[tuple[str, str, int], list[Measurement]] = {}
    for (source, doc), engine in zip(pairs, _engine_keys([doc for _, doc in pairs])):
        found = layout_and_concurrency(doc)
        if found is None:
            if skipped is not None:
                skipped.append(f"{source or doc.header.run_id}: no layout and concurrency (labels or arrival)")
            continue
        layout, concurrency = found
        grouped.setdefault((engine, layout, concurrency), []).append(
            _measure(doc, source, engine, layout, concurrency, slo, gpu))
    return [Point(engine, layout, c, tuple(sorted(runs, key=lambda r: (r.repeat is None, r.repeat, r.run_id))))
            for (engine, layout, c), runs in sorted(grouped.items(),
                                                    key=lambda kv: (kv[0][0], layout_rank(kv[0][1]), kv[0][2]))]
