"""One measured run: workload → load generator → engine → records → results file.

The engine is already started (engines are expensive to start and are shared
across runs); this module wires the load generator, the metrics scraper and
the results writer together and guarantees that the results document is
written however the run ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchbench.adapters.base import Engine
from batchbench.core import environment
from batchbench.core.clock import now
from batchbench.core.config import SCRAPE_INTERVAL_S, EngineDescription, LoadConfig
from batchbench.core.records import RequestRecord
from batchbench.core.server_metrics import ServerMetrics
from batchbench.load import pinning
from batchbench.load.loadgen import LoadGenerator
from batchbench.load.ray_workers import RayWorkerPool
from batchbench.load.scraper import Scraper
from batchbench.load.workers import Pool, WorkerPool, partition
from batchbench.measures.client_load import ClientLoad, ClientMeter
from batchbench.measures.gpu import GpuOptions, GpuSample, GpuTelemetry, energy_of
from batchbench.measures.guardrails import server_summary
from batchbench.measures.machine_load import MachineLoad, MachineMeter
from batchbench.measures.metrics import Summary, summarize
from batchbench.measures.slices import Slice, stage_windows, time_slices
from batchbench.measures.slo import Slo
from batchbench.results.document import RunFooter, RunHeader, RunLabels, ScrapeStats, WorkerReport
from batchbench.results.journal import JournalWriter, ResultsWriteError
from batchbench.workload.requests import Workload
from batchbench.workload.stages import boundaries


@dataclass
class MeasuredRun:
    """Everything one run measured, as written to ``path``."""

    path: Path
    records: list[RequestRecord]
    samples: list[ServerMetrics]
    summary: Summary
    engine_report: dict[str, Any]
    duration_s: float
    status: str
    #: How busy the load generator itself was (is the harness the bottleneck?).
    client: ClientLoad
    #: Who held the machine's CPU (were these the engine's figures?). Whether these two loads make the run
    #: invalid is the analysis stage's verdict (``batchbench.analysis.validity.load_reasons``), not the runner's.
    machine: MachineLoad
    #: A staged load's stages, each its own window (empty: not staged).
    stages: list[Slice] = field(default_factory=list)
    #: Each load-generator worker (empty: sent from this process alone).
    workers: list[WorkerReport] = field(default_factory=list)


class _Journal:
    """A run's journal, and what a write it refuses does (the results folder full, read-only...): the first one
    stops the run, by cancelling its sending (nothing more could be kept), and is raised once the run is down."""

    def __init__(self, writer: JournalWriter, on_record: Callable[[RequestRecord], None] | None) -> None:
        self.writer, self.on_record = writer, on_record
        self.failed: ResultsWriteError | None = None
        #: The load generator's run, once started: what a refused write cancels.
        self.sending: asyncio.Future[list[RequestRecord]] | None = None

    def _stop(self, exc: ResultsWriteError) -> None:
        if self.failed is None:
            self.failed = exc
            if self.sending is not None:
                self.sending.cancel()

    def record(self, r: RequestRecord) -> None:
        try:
            self.writer.record(r)
        except ResultsWriteError as exc:
            self._stop(exc)
            return
        if self.on_record is not None:
            self.on_record(r)

    def sample(self, s: ServerMetrics) -> None:
        try:
            self.writer.sample(s)
        except ResultsWriteError as exc:
            self._stop(exc)

    def gpu_sample(self, s: GpuSample) -> None:
        """On the GPU meter's thread: a refused write is left to the next record or sample, on the loop."""
        with contextlib.suppress(ResultsWriteError):
            self.writer.gpu_sample(s)


def _summary(records: list[RequestRecord], duration: float, workload: Workload, slo: Slo | None,
             telemetry: GpuTelemetry, gpu_hour_cost: float | None) -> Summary:
    """The run's summary: its records' figures under the SLO's per-request limits, and the GPUs' energy."""
    ttft_slo_s, tpot_slo_s = slo.request_limits() if slo is not None else (None, None)
    summary = summarize(records, duration_s=duration, ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s,
                        closed_loop=workload.closed_loop)
    ok = [r for r in records if r.ok]
    return dataclasses.replace(summary, energy=energy_of(
        telemetry, output_tokens=sum(r.output_tokens for r in ok), ok_requests=len(ok), duration_s=duration,
        gpu_hour_cost=gpu_hour_cost))


def _footer(status: str, error: str | None, duration: float, records: list[RequestRecord], scraper: Scraper,
            workload: Workload, load: LoadConfig, summary: Summary, report: dict[str, Any], client: ClientLoad,
            machine: MachineLoad, telemetry: GpuTelemetry, workers: list[WorkerReport]) -> RunFooter:
    """How the run ended and what it measured, with its time slices and stages (where asked for) as windows."""
    slices = [] if load.slice_s is None else time_slices(records, scraper.samples, width_s=load.slice_s,
                                                         duration_s=duration)
    plan = workload.spec.stages
    stages = stage_windows(records, scraper.samples, edges=boundaries(plan), labels=[s.label for s in plan],
                           duration_s=duration) if plan else []
    return RunFooter(
        status=status, error=error, finished_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"), duration_s=duration,
        engine_report=report,
        scrape=ScrapeStats(failures=scraper.failures, last_error=scraper.last_error, scrapes=scraper.scrapes,
                           mean_scrape_s=scraper.scrape_time_s / scraper.scrapes if scraper.scrapes else None),
        summary=summary, guardrails=server_summary(scraper.samples), client=client, machine=machine,
        gpu=telemetry, slices=slices, stages=stages, workers=workers,
    )


def results_path(results_dir: Path, engine: Engine, workload: Workload, tag: str = "") -> Path:
    """A unique, readable file name: engine, config, workload, tag, time."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    name = "_".join(p for p in (engine.name, engine.batching.label(), workload.name, tag, stamp) if p)
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", name)
    return Path(results_dir) / f"{name}-{uuid.uuid4().hex[:6]}.json"


async def run(
    engine: Engine,
    workload: Workload,
    *,
    results_dir: Path,
    tag: str = "",
    load: LoadConfig | None = None,
    slo: Slo | None = None,
    labels: dict[str, Any] | None = None,
    on_record: Callable[[RequestRecord], None] | None = None,
    reset_cache: bool = True,
    gpu: GpuOptions | None = None,
) -> MeasuredRun:
    """Replay ``workload`` against the running ``engine`` and write its results document.

    ``load``: how it is sent (its ``workers``: load-generator processes to send from, :mod:`batchbench.load.workers`;
    1 sends from this event loop). ``slo``: goodput counts the requests within its limits. ``on_record`` sees each
    finished request after it is journalled (a progress display): it runs on the measuring loop, so it must be
    cheap. ``reset_cache``: empty the engine's prefix cache first, so a cache the previous run warmed is never
    measured as this run's speed (``False`` only when that is the point). ``gpu``: how the GPUs the engine uses
    are sampled through the run (default: on, every ``load.scrape_interval_s``; on a host without NVML the
    document says why there are no figures).
    """
    load = load or LoadConfig()
    gpu = gpu or GpuOptions()
    on_ray = load.worker_pool == "ray"
    if load.workers > 1 or on_ray:  # as many as the workload can be split into (ValueError for waves: before anything)
        load = dataclasses.replace(load, workers=len(partition(workload, load.workers)))
    cache_reset = await engine.reset_cache() if reset_cache else None
    path = results_path(results_dir, engine, workload, tag)
    journal = _Journal(JournalWriter(path), on_record)
    client_pin = pinning.current()
    pool: Pool | None = None
    generator: LoadGenerator | Pool
    if load.workers > 1 or on_ray:
        # The workers start before t0 (they take a moment, and the schedule must not wait for them) and before
        # the header, which records the CPUs each one reports; one that fails still leaves a partial document.
        kind = RayWorkerPool if on_ray else WorkerPool
        generator = pool = kind(engine, workload, workers=load.workers, on_record=journal.record, config=load,
                                placement=client_pin.placement if client_pin is not None else None)
    else:
        generator = LoadGenerator(engine, workload, on_record=journal.record, config=load)
    pool_failed: BaseException | None = None
    if pool is not None:
        try:
            await pool.start()
        except BaseException as exc:  # start() stopped every child
            pool_failed = exc
    interval_s = load.scrape_interval_s or SCRAPE_INTERVAL_S
    gpu_meter = gpu.meter(*engine.gpu_devices(), interval_s=interval_s, on_sample=journal.gpu_sample)
    try:
        journal.writer.begin(RunHeader(
            run_id=path.stem, started_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            engine=EngineDescription.of(engine.describe()),
            workload=workload.describe(), load=load, slo=slo, environment=environment.capture(),
            labels=RunLabels.of(labels), cache_reset=cache_reset,
            placement=pinning.placement_record(engine, client_pin, pool.pinned if pool is not None else ()),
            gpus=(dataclasses.replace(gpu_meter.selection, declared=gpu.declared) if gpu.declared is not None
                  else gpu_meter.selection),
        ))
    except ResultsWriteError:
        if pool is not None and pool_failed is None:
            await pool.close()
        raise
    try:
        if pool_failed is not None:
            raise pool_failed
        await engine.begin_run()
        t0 = now() + (pool.start_lead_s if pool is not None else 0.0)  # workers elsewhere are told it ahead
        scraper = Scraper(engine, interval_s=interval_s, t0=t0, on_sample=journal.sample)
        meter = ClientMeter()
        machine_meter = MachineMeter.for_engine(engine, pool.pids if pool is not None else frozenset())
        machine_meter.start()
        gpu_meter.start(t0)
    except BaseException:
        gpu_meter.stop()
        if pool is not None:
            await pool.close()
        journal.writer.close()  # the journal's writer thread stops with the header written: a partial run
        raise
    status, error = "complete", None
    try:
        with meter:
            async with scraper:
                journal.sending = asyncio.ensure_future(generator.run(t0))
                await journal.sending
    except (Exception, asyncio.CancelledError) as exc:
        status, error = "interrupted", f"{type(exc).__name__}: {exc}"
        if journal.failed is None:  # a refused write is raised below, once the run is stopped
            raise
    finally:
        try:
            # Not below a microsecond: a run stopped before its start instant (Ray's workers get it a moment
            # ahead) measured nothing, and no duration is zero.
            duration = max(now() - t0, 1e-6)
            machine = machine_meter.result()  # while the workers still run: an ended process is not seen
            gpu_telemetry = gpu_meter.stop()
            if pool is not None:
                await pool.close()
            summary = _summary(generator.records, duration, workload, slo, gpu_telemetry, gpu.gpu_hour_cost)
            report = await engine.report()
            client = meter.result(generator.records) if pool is None else \
                ClientLoad.combined([meter.result(), *pool.client_loads])
            if journal.failed is not None:
                journal.writer.abandon()
                raise journal.failed
            footer = _footer(status, error, duration, generator.records, scraper, workload, load, summary, report,
                             client, machine, gpu_telemetry, pool.reports if pool is not None else [])
            journal.writer.finish(footer)
        finally:
            journal.writer.close()  # where the footer could not be written: every record handed over still is
    return MeasuredRun(path, generator.records, scraper.samples, summary, report, duration, status, client, machine,
                       footer.stages, footer.workers)
