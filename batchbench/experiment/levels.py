"""One measured load level (a "point") of ``bench`` and ``capacity``: warm-up, run, verdict, parity, one line.

A point is one run of the plan's workload at one concurrency or rate, written as a results document
like every run. A point whose requests all failed (the engine died, every request timed out) is a
*failed* point with the reason; it is still written and still counted. :class:`EngineSession` keeps one
engine for a sequence of points and starts it again after it died, so the points after a crash are
measured on a live engine rather than all failing the same way.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from batchbench.adapters.base import Engine
from batchbench.analysis.accelerators import Accelerator
from batchbench.analysis.capacity import Trial
from batchbench.core.config import BatchingConfig, LoadConfig
from batchbench.core.exits import EXIT_ENGINE, EXIT_FAILURES, EXIT_OK
from batchbench.core.server_metrics import prefix_cache_hit_rate
from batchbench.experiment.engines import StartingEngines
from batchbench.experiment.outcome import died, failure_lines, verdict_lines, write_report
from batchbench.experiment.workload import LevelKind, PreparedWorkload
from batchbench.load.engines import EngineCache
from batchbench.load.loadgen import LoadGenerator
from batchbench.load.ray_workers import LATE_START_S
from batchbench.load.runner import MeasuredRun, run
from batchbench.measures import parity
from batchbench.measures.gpu import GpuOptions
from batchbench.measures.slo import Slo, Verdict
from batchbench.results.document import RunLabels, WorkerReport
from batchbench.results.journal import ResultsWriteError


@dataclass(frozen=True)
class PointResult:
    """What one run at one level measured, with its verdict, parity and whether it failed outright."""

    engine: str
    kind: LevelKind
    level: float
    repeat: int
    result: MeasuredRun
    status: Literal["ok", "failed"]
    #: Why the point failed (None when it did not).
    reason: str | None
    verdict: Verdict | None
    parity: parity.Parity

    @property
    def engine_died(self) -> str | None:
        return died(self.result)

    def outcome(self) -> Trial:
        """The point as the capacity search sees it: a failed point misses the SLO, for its reason."""
        if self.status == "failed":
            return Trial(False, (self.reason or "failed",), self.result.summary.goodput)
        assert self.verdict is not None, "a capacity search always has an SLO"
        return Trial(self.verdict.met, self.verdict.failed, self.result.summary.goodput)

    def to_dict(self) -> dict[str, Any]:
        s = self.result.summary
        return {
            "engine": self.engine, self.kind: _level_json(self.kind, self.level), "repeat": self.repeat,
            "status": self.status, "reason": self.reason, "path": self.result.path.name,
            "requests": s.requests, "ok": s.ok, "output_token_throughput": s.output_token_throughput,
            "goodput": s.goodput, "slo": self.verdict.to_dict() if self.verdict else None,
            "parity": self.parity.to_dict(),
        }


def _level_json(kind: LevelKind, level: float) -> float | str:
    """A concurrency as a whole number, a rate as a number or ``"inf"`` (JSON has no infinity)."""
    if kind == "concurrency":
        return int(level)
    return "inf" if math.isinf(level) else level


def level_text(kind: LevelKind, level: float) -> str:
    """``c=4`` or ``rate=2.5/s``: how a level reads in lines and tags."""
    if kind == "concurrency":
        return f"c={int(level)}"
    return "rate=inf" if math.isinf(level) else f"rate={level:g}/s"


def _why_failed(result: MeasuredRun, timeout_s: float) -> str | None:
    """Why no request of the run succeeded; None when some did."""
    s = result.summary
    if s.ok or not s.requests:
        return None if s.requests else "no request was sent"
    if (gone := died(result)) is not None:
        return f"the engine died or is unreachable: {gone}"
    if s.failures.get("timeout") == s.requests:
        return f"all {s.requests} requests timed out (--request-timeout {timeout_s:g}s)"
    return f"all {s.requests} requests failed: {failure_lines(result, timeout_s)[0].removeprefix('failed: ')}"


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f}ms"


def _line(point: PointResult) -> str:
    s = point.result.summary
    head = f"  {point.engine} {level_text(point.kind, point.level)} #{point.repeat}:"
    if point.status == "failed":
        return f"{head} FAILED: {point.reason} -> {point.result.path}"
    text = (f"{head} {s.ok}/{s.requests} ok, {s.output_token_throughput:.1f} out tok/s, "
            f"TTFT p50 {_ms(s.ttft.p50 if s.ttft else None)} p99 {_ms(s.ttft.p99 if s.ttft else None)}, "
            f"TPOT p50 {_ms(s.tpot.p50 if s.tpot else None)}")
    if s.reasoning_tokens is not None and s.reasoning_tokens.max > 0:  # a reasoning stream: its answer came later
        text += (f", TTFO p50 {_ms(s.ttfo.p50 if s.ttfo else None)} p99 {_ms(s.ttfo.p99 if s.ttfo else None)}, "
                 f"{s.reasoning_tokens.mean:.1f} reasoning tok/req")
    if (hit := prefix_cache_hit_rate(point.result.samples)) is not None:  # the engine's own counters
        text += f", prefix cache hit {hit:.1%}"
    if point.verdict is not None:
        share = f" ({s.goodput_fraction:.0%})" if s.goodput_fraction is not None else ""
        met = "SLO met" if point.verdict.met else f"SLO failed: {', '.join(point.verdict.failed)}"
        text += f", goodput {s.goodput:.2f} req/s{share}, {met}"
    stages = "".join(f"\n      stage {w.label} ({w.start_s:g}–{w.end_s:g} s): {w.sent} sent, {w.failed} failed, "
                     f"{w.output_token_throughput:.1f} out tok/s, TTFT p50 {_ms(w.ttft.p50 if w.ttft else None)} "
                     f"p99 {_ms(w.ttft.p99 if w.ttft else None)}" for w in point.result.stages)
    workers = "".join(f"\n      {line}" for line in worker_lines(point.result.workers))
    return f"{text} -> {point.result.path}{stages}{workers}"


def worker_lines(reports: list[WorkerReport]) -> list[str]:
    """What the user must know of a run's workers: where Ray put them and how their clocks compared, which
    started late, which were lost (nothing for local processes that all finished)."""
    lines = []
    on_ray = [r for r in reports if r.pool == "ray"]
    if on_ray:
        hosts = sorted({_where(r) for r in on_ray})
        offsets = [abs(r.clock_offset_s) for r in on_ray if r.clock_offset_s is not None]
        rtts = [r.clock_rtt_s for r in on_ray if r.clock_rtt_s is not None]
        clocks = (f"; clocks within {1e3 * max(offsets):.2f} ms of the driver's (±{1e3 * max(rtts) / 2:.2f} ms)"
                  if offsets and rtts else "")
        lines.append(f"workers: {len(on_ray)} on Ray, {len({r.node for r in on_ray})} node(s) "
                     f"({', '.join(hosts)}){clocks}")
    for r in reports:
        if r.start_late_s is not None and r.start_late_s > LATE_START_S:
            lines.append(f"worker {r.index} ({_where(r)}) began {1e3 * r.start_late_s:.1f} ms after the start instant")
        if r.lost is not None:
            at = f" at {r.lost_at_s:.1f} s" if r.lost_at_s is not None else ""
            lines.append(f"worker {r.index} ({_where(r)}) was LOST{at}: {r.lost}; {r.records} of its {r.requests} "
                         "records came back, the rest are failed (worker_died)")
    return lines


def _where(report: WorkerReport) -> str:
    """A worker's host, and its IP where Ray gave one: across a network, the address to look for."""
    return f"{report.host} {report.ip}" if report.ip else report.host


class EngineSession:
    """One engine across many points: started once, started again after it died, given up when it cannot start."""

    def __init__(self, engines: StartingEngines, cache: EngineCache, name: str,
                 batching: BatchingConfig | None, gpu: GpuOptions | None = None) -> None:
        """``gpu``: how each run reads the engine's GPUs (default: NVML telemetry on, no price)."""
        self.engines, self.cache = engines, cache
        self.gpu = gpu
        self.progress = engines.progress
        self.name = name
        self.batching = batching

    async def engine(self) -> Engine:
        """The running engine; raises EngineError (or ImportError) when it cannot be started."""
        return await self.engines.get(self.cache, self.name, self.batching)

    async def measure(self, work: PreparedWorkload, kind: LevelKind, level: float, repeat: int, *, run_dir: Path,
                      suite: str, slo: Slo | None, load: LoadConfig) -> PointResult:
        """Warm up, run and judge one level; prints its line (and any warnings) as it ends."""
        engine = await self.engine()
        workload = work.workload(kind, level)
        if (warm := work.warmup_workload(workload)) is not None:
            await LoadGenerator(engine, warm, config=load).run()
        labels = RunLabels(suite=suite, repeat=repeat, slo=str(slo) if slo is not None else None,
                           concurrency=int(level) if kind == "concurrency" else None,
                           rate=_level_json(kind, level) if kind == "rate" else None)
        with self.progress.run(len(workload.requests), f"{self.name} {level_text(kind, level)} #{repeat}") as bar:
            result = await run(engine, workload, results_dir=run_dir, tag=level_text(kind, level),
                               load=dataclasses.replace(load, workers=work.workers_for(workload)), slo=slo,
                               labels=labels, on_record=bar.observe, gpu=self.gpu)
            reason = _why_failed(result, load.request_timeout_s)
            point = PointResult(self.name, kind, level, repeat, result, "failed" if reason else "ok", reason,
                                slo.check(result.summary) if slo else None, parity.check(result.records))
            bar.finish(_line(point))
        if point.status == "ok":
            for line in failure_lines(result, load.request_timeout_s):
                self.progress.print(f"      {line}")
        notes = [*verdict_lines(result), *(f"warning: {w}" for w in filter(None, [point.parity.warning()])),
                 *filter(None, [point.parity.template_text()])]
        for line in notes:
            self.progress.print(f"      {line}")
        if point.engine_died is not None:
            self.progress.print(f"batchbench: {self.name} died during {level_text(kind, level)} #{repeat}; starting "
                                "it again for the next point", err=True)
            await self.cache.release(self.name, self.batching)
        return point


def write_summary(path: Path, doc: dict[str, Any]) -> None:
    """The invocation's own summary (every point's verdict, parity, failure reason) beside its results documents.

    Rewritten after every point, so an interrupted sweep keeps what it measured; the report builder lists it
    among the other JSON files it does not read."""
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:  # the last summary that was written stays; no half-written one beside it
        tmp.unlink(missing_ok=True)
        raise ResultsWriteError(path, exc) from None


def finish(run_dir: Path, points: list[PointResult], engine_problems: dict[str, str], *, no_report: bool,
           slo: Slo | None, status: int | None = None, gpu: Accelerator | None = None) -> int:
    """The exit status (unless given) and the report (its limit on paper for ``gpu`` where given), as every
    measuring command ends."""
    if not points:
        print("batchbench: no engine could be run; nothing measured", file=sys.stderr)
        return EXIT_ENGINE
    if status is None:
        clean = all(p.status == "ok" and p.result.summary.failed == 0 for p in points)
        status = EXIT_OK if clean else EXIT_FAILURES
    if engine_problems or any(p.engine_died for p in points):
        status = EXIT_ENGINE
        for name, why in engine_problems.items():
            print(f"batchbench: {name}: {why}", file=sys.stderr)
    return status if no_report else write_report(run_dir, status, slo, details=True, gpu=gpu)
