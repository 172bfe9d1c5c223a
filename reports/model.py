"""One run as the report sees it: the stored summary plus the few figures a document does not store.

The harness already summarised each run (``batchbench.measures.metrics.summarize``
and ``batchbench.measures.guardrails.server_summary``, stored in the document's
footer); the report reads those numbers and never recomputes them its own
way, so a report can never disagree with the harness. It reads documents
only through :class:`batchbench.results.document.RunDocument`. Only what a document
does not hold is derived here, with the harness's own helpers: TTFT per
batch-size bucket, and (for a journal left by a killed run, which has no
footer) the summary via ``summarize`` and the guardrails via
``RunDocument.guardrails``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from batchbench.analysis.findings.limit import RunShare, run_share
from batchbench.core import codec
from batchbench.core.config import BatchingConfig, EngineDescription
from batchbench.core.server_metrics import ServerMetrics
from batchbench.measures.gpu import Energy, GpuSelection
from batchbench.measures.guardrails import Guardrails
from batchbench.measures.metrics import Summary, summarize, ttft_by_bucket
from batchbench.measures.slices import Slice
from batchbench.reports.fmt import num
from batchbench.results.document import Placement, RunDocument, RunLabels
from batchbench.workload.requests import WorkloadSummary

#: Batch-size bucket edges for TTFT: buckets 1, 2-3, 4-7, 8-15, 16+.
BUCKET_EDGES = (1, 2, 4, 8, 16)

Better = Literal["lower", "higher"]


@dataclass(frozen=True)
class MetricSpec:
    """A key metric: where it lives in the summary (attribute names), its unit and which direction is better."""

    key: str
    title: str
    unit: Literal["ms", "rate", "fraction"]
    better: Better
    path: tuple[str, ...]


#: The metrics rows carry, comparisons rank and baselines diff, in display order.
KEY_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("ttft_p50", "TTFT p50 (ms)", "ms", "lower", ("ttft", "p50")),
    MetricSpec("ttft_p99", "TTFT p99 (ms)", "ms", "lower", ("ttft", "p99")),
    MetricSpec("tpot_p50", "TPOT p50 (ms)", "ms", "lower", ("tpot", "p50")),
    MetricSpec("itl_p99", "ITL p99 (ms)", "ms", "lower", ("itl", "p99")),
    MetricSpec("e2e_p50", "E2E p50 (ms)", "ms", "lower", ("e2e", "p50")),
    MetricSpec("e2e_p99", "E2E p99 (ms)", "ms", "lower", ("e2e", "p99")),
    MetricSpec("output_token_throughput", "Output tok/s", "rate", "higher", ("output_token_throughput",)),
    MetricSpec("request_throughput", "Requests/s", "rate", "higher", ("request_throughput",)),
    MetricSpec("goodput", "Goodput (req/s)", "rate", "higher", ("goodput",)),
    MetricSpec("rejection_rate", "Rejection rate", "fraction", "lower", ("rejection_rate",)),
)
METRICS_BY_KEY = {m.key: m for m in KEY_METRICS}
assert all(m.path[0] in Summary.__dataclass_fields__ for m in KEY_METRICS)


@dataclass
class ReportedRun:
    """One results document, reduced to what the report shows."""

    source: str
    run_id: str
    engine: str
    workload: WorkloadSummary
    status: str
    error: str | None
    started_at: str | None
    duration_s: float | None
    #: The harness's summary; for a cut-short journal, ``summarize`` over its records.
    summary: Summary | None
    summary_source: Literal["document", "derived", "none"]
    #: What the engine's own metrics said during the run (batchbench.measures.guardrails).
    server: Guardrails
    samples: list[ServerMetrics]
    engine_report: dict[str, Any]
    engine_description: EngineDescription
    environment: dict[str, Any]
    ttft_buckets: dict[str, dict[str, Any] | None] | None
    #: TTFTs of ok requests, for the CDF plot (None when the records could not be read).
    ttfts: list[float] | None
    notes: list[str] = field(default_factory=list)
    #: The CPUs the engine and the load generator ran on (None: not recorded).
    placement: Placement | None = None
    #: The run's metrics over fixed windows (``--slice``; empty: not sliced).
    slices: list[Slice] = field(default_factory=list)
    #: A staged load's stages, each its own window (empty: not staged).
    stages: list[Slice] = field(default_factory=list)
    #: The labels typed, as the document has them (what the design asked of the run: its fit, its suite).
    run_labels: RunLabels = field(default_factory=RunLabels)
    #: Its share of its own bound on paper (None: a CPU run, a GPU without a row): how ``compare`` sets runs on
    #: two GPUs side by side.
    of_limit: RunShare | None = None
    #: The GPUs the engine ran on as the run sampled them (or as ``--gpu`` declared them for an engine at a URL):
    #: this host's own GPUs may not be the engine's.
    engine_gpus: tuple[str, ...] = ()

    @property
    def fills_by_design(self) -> bool:
        """A main-job run at or past the batch size its KV cache was sized to hold (the fit): its cache is meant to
        fill there (the knee and the memory-bound end of the curve the sweep measures on purpose)."""
        labels = self.run_labels
        return labels.suite == "main" and labels.kv_fit is not None and labels.concurrency is not None \
            and labels.concurrency >= labels.kv_fit

    @property
    def partial(self) -> bool:
        return self.status != "complete"

    @property
    def batching(self) -> BatchingConfig | None:
        return self.engine_description.batching

    @property
    def batching_label(self) -> str:
        return self.engine_description.batching_label

    @property
    def workload_name(self) -> str:
        return self.workload.name

    @property
    def workload_hash(self) -> str:
        return self.workload.hash

    @property
    def workload_key(self) -> tuple[str, str]:
        return (self.workload_name, self.workload_hash)

    def labels_text(self) -> str:
        return labels_text(dict(self.run_labels.items()))

    def display_name(self) -> str:
        """Engine, batching label and labels: unique enough to head a column."""
        return display_name(self.engine, self.batching_label, dict(self.run_labels.items()))

    def metric(self, key: str) -> float | None:
        return metric_of(self.summary, METRICS_BY_KEY[key].path)

    def nan_metric(self, key: str) -> bool:
        """Whether the stored figure is NaN (a division by zero upstream): never a value to rank."""
        node: Any = self.summary
        for part in METRICS_BY_KEY[key].path:
            node = getattr(node, part, None)
        return isinstance(node, float) and math.isnan(node)

    def pad_fraction(self) -> float | None:
        return num(self.engine_report.get("prompt_pad_fraction"))

    def decode_idle_fraction(self) -> float | None:
        return num(self.engine_report.get("decode_idle_fraction"))

    def mean_decoding(self) -> float | None:
        """Mean requests decoding at once (None in documents written before it was stored)."""
        return num(self.summary.mean_decoding) if self.summary is not None else None

    def reasoned(self) -> bool:
        """Whether any of the run's streams reasoned (then TTFO differs from TTFT)."""
        r = self.summary.reasoning_tokens if self.summary is not None else None
        return r is not None and r.max > 0

    def prompt_counts(self) -> tuple[float, float] | None:
        """Mean prompt tokens per request as sent and as the engine counted them (over the ok requests it
        counted); None where it counted none. On a chat endpoint the difference is the chat template's."""
        s = self.summary
        if s is None or s.prompt_tokens_sent is None or s.prompt_tokens_engine is None:
            return None
        return s.prompt_tokens_sent.mean, s.prompt_tokens_engine.mean

    def energy(self) -> Energy | None:
        """The GPUs' energy and cost figures, with why they are empty (None in documents written before them)."""
        return self.summary.energy if self.summary is not None else None

    def serving(self) -> dict[str, Any]:
        """What was served, and where: runs that differ in any of it are never one series."""
        return serving_identity(self.engine_description)

    def to_row(self) -> dict[str, Any]:
        """The machine-readable row of report.json (also what a later build reads as its baseline)."""
        s = self.summary
        return {
            "source": self.source,
            "run_id": self.run_id,
            "engine": self.engine,
            "serving": self.serving(),
            "batching": codec.encode(self.batching),
            "batching_label": self.batching_label,
            "workload": {"name": self.workload_name, "hash": self.workload_hash},
            "labels": dict(self.run_labels.items()),
            "status": self.status,
            "error": self.error,
            "started_at": self.started_at,
            "duration_s": self.duration_s,
            "summary_source": self.summary_source,
            "requests": s.requests if s is not None else None,
            "ok": s.ok if s is not None else None,
            "failed": s.failed if s is not None else None,
            "failures": dict(s.failures) if s is not None else None,
            "metrics": {m.key: self.metric(m.key) for m in KEY_METRICS},
            "prompt_pad_fraction": self.pad_fraction(),
            "decode_idle_fraction": self.decode_idle_fraction(),
            "mean_decoding": self.mean_decoding(),
            "energy": None if (e := self.energy()) is None else dataclasses.asdict(e),
            "server": codec.encode(self.server) | {"danger_zone": self.server.danger_zone},
            "ttft_by_bucket": self.ttft_buckets,
            "notes": self.notes,
            # Where it ran: what a comparison of two hosts, GPUs or quotas names when it differs.
            "environment": {k: self.environment.get(k) for k in ENVIRONMENT_KEYS if k in self.environment}
            | ({"engine_gpus": ", ".join(self.engine_gpus)} if self.engine_gpus else {}),
            "of_limit": codec.encode(self.of_limit),
        }


#: The environment fields a report row carries (:meth:`ReportedRun.to_row`): what makes two sides' machines differ.
ENVIRONMENT_KEYS = ("hostname", "cpu", "cpu_count", "cpu_quota", "gpus", "platform", "packages", "batchbench_commit")


#: Server arguments that name where a launched server listens: a new port each start, not a difference.
_ADDRESS_FLAGS = frozenset({"--host", "--port", "--hostname"})


def serving_identity(description: EngineDescription) -> dict[str, Any]:
    """The model, server arguments, engine version and (at a URL) endpoint of an engine's description.

    A 202 tok/s server and a 1,100 tok/s one once merged into one "median of 5" because none of this
    was compared; a launched server's address is left out (it is a fresh port each start).
    """
    args = description.server_args
    kept: list[str] | None = None
    if args is not None:
        kept, skip = [], False
        for arg in args:
            if skip:
                skip = False
            elif arg in _ADDRESS_FLAGS:
                skip = True
            else:
                kept.append(arg)
    mode = description.mode
    return {
        "model": description.model.path if description.model is not None else None,
        "mode": mode,
        "url": description.url if mode == "url" else None,
        "server_args": kept,
        "version": description.details.get("version"),
    }


def metric_of(summary: Summary | None, path: tuple[str, ...]) -> float | None:
    """A number inside a summary (``("ttft", "p50")``: the p50 of its TTFT distribution), or None."""
    node: Any = summary
    for part in path:
        node = getattr(node, part, None)
    return num(node)




def build_run(source: str, doc: RunDocument) -> ReportedRun:
    """Reduce a results document to a :class:`ReportedRun`."""
    header, footer = doc.header, doc.footer
    notes: list[str] = list(doc.problems)
    records = doc.records
    summary = footer.summary if footer is not None else None
    summary_source: Literal["document", "derived", "none"] = "document"
    duration = footer.duration_s if footer is not None else None
    if summary is None:
        summary_source = "none"
        if records:
            duration = doc.observed_duration_s()
            try:
                summary = summarize(records, duration_s=duration, closed_loop=doc.header.closed_loop) \
                    if duration > 0 else None
            except ValueError as exc:  # inconsistent records: report the run without figures
                notes.append(f"no stored summary, and the records cannot be summarised: {exc}")
            else:
                if summary is not None:
                    summary_source = "derived"
                    notes.append("no stored summary (run cut short): summarised from the journal's records "
                                 "with batchbench.measures.metrics.summarize over the observed duration")
    if (unavailable := header.engine.details.get("unavailable")) is not None:
        notes.append(f"not measurable on engine {header.engine_name!r}: {unavailable}")
    if footer is not None and footer.client is not None:
        notes += footer.client.warnings()
    if footer is not None and footer.machine is not None:
        notes += footer.machine.warnings()
    ttft_buckets: dict[str, dict[str, Any] | None] | None = None
    ttfts = sorted(t for r in records if r.ok and (t := r.ttft_s) is not None)
    sized = [r for r in records if r.in_flight_at_send >= BUCKET_EDGES[0]]
    if sized:
        buckets = ttft_by_bucket(sized, lambda r: r.in_flight_at_send, BUCKET_EDGES)
        ttft_buckets = codec.encode(buckets)
    return ReportedRun(
        source=source,
        run_id=header.run_id or source,
        engine=header.engine_name,
        workload=header.workload,
        status=doc.status,
        error=footer.error if footer is not None and footer.error else None,
        started_at=header.started_at or None,
        duration_s=num(duration),
        summary=summary,
        summary_source=summary_source,
        server=doc.guardrails(),
        samples=doc.server_metrics,
        engine_report=footer.engine_report if footer is not None else {},
        engine_description=header.engine,
        environment=header.environment,
        ttft_buckets=ttft_buckets,
        ttfts=ttfts,
        notes=notes,
        placement=header.placement,
        run_labels=header.labels,
        slices=footer.slices if footer is not None else [],
        stages=footer.stages if footer is not None else [],
        of_limit=run_share(doc, summary),
        engine_gpus=_engine_gpus(header.gpus),
    )


def _engine_gpus(selection: GpuSelection | None) -> tuple[str, ...]:
    """The sampled devices' names, else the GPU declared for the engine; none where neither is known."""
    if selection is None:
        return ()
    return tuple(d.name for d in selection.devices) or ((selection.declared,) if selection.declared else ())


#: Labels a run carries for the findings (what suite wrote it, the precision its repeats ran to, the sweep's design)
#: rather than to tell it from its neighbours: left out of its name, kept in its document and its series.
BOOKKEEPING_LABELS = frozenset({"suite", "warmed_up", "precision", "design", "fit", "kv_fit", "kv_capacity_tokens"})


def labels_text(labels: dict[str, Any]) -> str:
    """The labels that tell a run apart, as ``key=value`` words sorted by key (not :data:`BOOKKEEPING_LABELS`)."""
    return " ".join(f"{k}={v}" for k, v in sorted(labels.items(), key=lambda kv: str(kv[0]))
                    if k not in BOOKKEEPING_LABELS)


def display_name(engine: object, batching_label: object, labels: dict[str, Any]) -> str:
    """How a run, a report row or a series is named: ``engine [batching] key=value ...``."""
    text = labels_text(labels)
    return f"{engine} [{batching_label}]" + (f" {text}" if text else "")


def canonical(value: Any) -> str:
    """A stable text form of a JSON value, for grouping equal environments or labels."""
    return json.dumps(value, sort_keys=True, default=str)
