"""Results documents of runs that never happened, built from the real types, whose answers are known.

Shared by the findings and validity tests: a run is described by its figures (throughput, TTFT, how
many requests, KV usage) and turned into the records, summary, guardrails and loads a real run's
document holds, so what findings compute from them can be checked against the figures put in.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from batchbench.core.config import EngineDescription
from batchbench.core.records import RequestRecord
from batchbench.core.server_metrics import ServerMetrics
from batchbench.measures.client_load import ClientLoad
from batchbench.measures.guardrails import server_summary
from batchbench.measures.machine_load import MachineLoad
from batchbench.measures.metrics import summarize
from batchbench.measures.slices import time_slices
from batchbench.results.document import RunDocument, RunFooter, RunHeader, RunLabels
from batchbench.workload.requests import Arrival, WorkloadSpec, WorkloadSummary


@dataclass
class RunSpec:
    """One synthetic run: ``requests`` requests of ``tokens`` output tokens each, whose TTFTs are ``ttft`` x (1 +
    up to ``jitter``), over a duration that makes the output throughput ``throughput`` tokens/s."""

    engine: str = "alpha"
    layout: str = "continuous"
    concurrency: int = 1
    repeat: int = 0
    throughput: float = 100.0
    ttft: float = 0.05
    jitter: float = 0.2
    requests: int = 240
    tokens: int = 10
    #: Share of the run each request spends decoding (sets the mean requests decoding).
    decoding: float | None = None
    kv_usage: float | None = None
    waiting: float | None = None
    preemptions: float | None = None
    failed: int = 0
    arrival: str | None = None
    lag: float = 0.0
    client_busy: float = 0.1
    foreign: float | None = 0.01
    status: str = "complete"
    labels: dict[str, Any] = field(default_factory=dict)
    #: Output lengths per request (default: ``tokens`` each); prompt lengths likewise.
    outputs: list[int] | None = None
    prompts: list[int] | None = None
    wave: int | None = None
    seed: int = 0
    batching: dict[str, Any] = field(default_factory=lambda: {"mode": "continuous"})
    engine_report: dict[str, Any] = field(default_factory=dict)
    #: Windows of this many seconds into the footer's slices (None: not sliced).
    slice_s: float | None = None
    #: Summarise it as a closed loop: with a steady state, whose throughput differs from the whole run's (by how
    #: much depends on ``send_span``, the share of the run over which its requests are sent).
    closed_loop: bool = False
    send_span: float = 0.5


def records_of(spec: RunSpec, duration: float) -> list[RequestRecord]:
    rng = random.Random(f"{spec.seed}:{spec.engine}:{spec.layout}:{spec.concurrency}:{spec.repeat}")
    outputs = spec.outputs or [spec.tokens] * spec.requests
    prompts = spec.prompts or [16] * len(outputs)
    found = []
    for i, (out, prompt) in enumerate(zip(outputs, prompts)):
        sent = duration * i / len(outputs) * spec.send_span
        ttft = spec.ttft * (1 + spec.jitter * rng.random())
        span = (spec.decoding or 0.0) * duration
        gap = span / (out - 1) if out > 1 else 0.0
        times = [sent + ttft + k * gap for k in range(out)]
        ok = i >= spec.failed
        found.append(RequestRecord(
            request_id=f"w-{i:05d}", prompt_len=prompt, max_tokens=out, scheduled_s=sent - spec.lag, sent_s=sent,
            done_s=times[-1] if ok else None, chunk_times=times if ok else [], chunk_tokens=[1] * out if ok else [],
            completion_tokens=out if ok else None, ok=ok, error_kind=None if ok else "timeout",
            error=None if ok else "timed out",
            wave=(i // spec.concurrency) if spec.wave is not None else None,
        ))
    return found


def document(spec: RunSpec) -> RunDocument:
    outputs = spec.outputs or [spec.tokens] * spec.requests
    ok_tokens = sum(outputs[spec.failed:])
    duration = ok_tokens / spec.throughput
    records = records_of(spec, duration)
    samples = [ServerMetrics(t=t, kv_usage=spec.kv_usage, waiting=spec.waiting,
                             preemptions=None if spec.preemptions is None else spec.preemptions * t)
               for t in (0.0, 1.0)]
    arrival = spec.arrival or ("waves" if spec.layout in ("static-waves", "padded-mixed", "homogeneous") else "closed")
    header = RunHeader(
        run_id=f"{spec.engine}-{spec.layout}-c{spec.concurrency}-r{spec.repeat}",
        engine=EngineDescription.of({"engine": spec.engine, "batching": spec.batching}),
        workload=WorkloadSummary(name="synthetic", hash="0" * 64, spec=WorkloadSpec(
            "synthetic", len(records), arrival=Arrival(arrival, concurrency=spec.concurrency))),  # type: ignore[arg-type]
        labels=RunLabels.of({"suite": "main", "layout": spec.layout, "concurrency": spec.concurrency,
                             "repeat": spec.repeat, "warmed_up": True, **spec.labels}),
    )
    footer = None if spec.status == "partial" else RunFooter(
        status=spec.status, duration_s=duration,
        summary=summarize(records, duration_s=duration, closed_loop=spec.closed_loop),
        guardrails=server_summary(samples), client=ClientLoad(spec.client_busy * duration, duration, spec.client_busy),
        machine=MachineLoad(spec.foreign), engine_report=spec.engine_report,
        slices=[] if spec.slice_s is None else time_slices(records, samples, width_s=spec.slice_s, duration_s=duration),
    )
    return RunDocument(header=header, records=records, server_metrics=samples, footer=footer)


def sweep(levels: tuple[int, ...] = (1, 2, 4, 8, 16, 32), *, fit: int = 8, per_slot: float = 100.0,
          repeats: int = 1, **more: Any) -> list[RunDocument]:
    """A KV-limited continuous engine: throughput min(c, fit) x ``per_slot``; past the fit the cache is 95% full,
    c - fit requests wait, and TTFT grows by (c / fit - 1) generations of 0.5 s."""
    docs = []
    for r in range(repeats):
        for c in levels:
            past = c > fit
            docs.append(document(RunSpec(
                concurrency=c, repeat=r, throughput=min(c, fit) * per_slot * (1 + 0.02 * r),
                ttft=0.05 + (c / fit - 1) * 0.5 if past else 0.05, kv_usage=0.95 if past else 0.9 * c / fit * 0.9,
                waiting=float(c - fit) if past else 0.0, labels={"kv_fit": fit}, **more)))
    return docs
