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
from batchbench.load.workers import WorkerPool, partition
from batchbench.measures.client_load import ClientLoad, ClientMeter
from batchbench.measures.gpu import GpuMeter, GpuOptions, GpuSample, GpuTelemetry, energy_of
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


@dataclass(frozen=True)
class RunOptions:
    """How one run is made and kept, beside its engine and workload (:func:`run`'s keywords, typed)."""

    results_dir: Path
    tag: str = ""
    load: LoadConfig = field(default_factory=LoadConfig)
    slo: Slo | None = None
    labels: RunLabels = field(default_factory=RunLabels)
    on_record: Callable[[RequestRecord], None] | None = None
    reset_cache: bool = True
    gpu: GpuOptions = field(default_factory=GpuOptions)

    @property
    def interval_s(self) -> float:
        return self.load.scrape_interval_s or SCRAPE_INTERVAL_S


@dataclass
class _Prepared:
    """A run set up and not yet timed: where it is written, what sends it, what meters the GPUs."""

    engine: Engine
    workload: Workload
    options: RunOptions
    path: Path
    journal: _Journal
    generator: LoadGenerator | WorkerPool | RayWorkerPool
    pool: WorkerPool | RayWorkerPool | None
    client_pin: pinning.ClientPin | None
    cache_reset: bool | None
    gpu_meter: GpuMeter
    #: Why the workers could not start (raised once the header is written: a partial document is left).
    pool_failed: BaseException | None


@dataclass
class _Timed:
    """A run's clock and the meters running beside it."""

    t0: float
    scraper: Scraper
    meter: ClientMeter
    machine_meter: MachineMeter


async def run(engine: Engine, workload: Workload, *, results_dir: Path, tag: str = "",
              load: LoadConfig | None = None, slo: Slo | None = None,
              labels: RunLabels | dict[str, Any] | None = None,
              on_record: Callable[[RequestRecord], None] | None = None, reset_cache: bool = True,
              gpu: GpuOptions | None = None) -> MeasuredRun:
    """Replay ``workload`` against the running ``engine`` and write its results document.

    ``load``: how it is sent (its ``workers``: load-generator processes to send from, :mod:`batchbench.load.workers`;
    1 sends from this event loop). ``slo``: goodput counts the requests within its limits. ``on_record`` sees each
    finished request after it is journalled (a progress display): it runs on the measuring loop, so it must be
    cheap. ``reset_cache``: empty the engine's prefix cache first, so a cache the previous run warmed is never
    measured as this run's speed (``False`` only when that is the point). ``gpu``: how the GPUs the engine uses
    are sampled through the run (default: on, every ``load.scrape_interval_s``; on a host without NVML the
    document says why there are no figures). The parts, in order: :func:`_prepare`, :func:`_write_header`,
    :func:`_start`, the sending, :func:`_finish`, which writes the document however the sending ended.
    """
    typed = labels if isinstance(labels, RunLabels) else RunLabels.of(labels)  # a suite's own keys: its bag
    options = RunOptions(results_dir, tag, load or LoadConfig(), slo, typed, on_record, reset_cache,
                         gpu or GpuOptions())
    prepared = await _prepare(engine, workload, options)
    await _write_header(prepared)
    timed = await _start(prepared)
    status, error = "complete", None
    try:
        with timed.meter:
            async with timed.scraper:
                prepared.journal.sending = asyncio.ensure_future(prepared.generator.run(timed.t0))
                await prepared.journal.sending
    except (Exception, asyncio.CancelledError) as exc:
        status, error = "interrupted", f"{type(exc).__name__}: {exc}"
        if prepared.journal.failed is None:  # a refused write is raised by _finish, once the run is stopped
            raise
    finally:
        measured = await _finish(prepared, timed, status, error)
    return measured


async def _prepare(engine: Engine, workload: Workload, options: RunOptions) -> _Prepared:
    """Empty the engine's cache, choose the results file, and make what sends the workload: this loop's load
    generator, or worker processes (started here, before t0: they take a moment, and the schedule must not wait
    for them; one that fails still leaves a partial document)."""
    load = options.load
    on_ray = load.worker_pool == "ray"
    if load.workers > 1 or on_ray:  # as many as the workload can be split into (ValueError for waves: before anything)
        load = dataclasses.replace(load, workers=len(partition(workload, load.workers)))
        options = dataclasses.replace(options, load=load)
    cache_reset = await engine.reset_cache() if options.reset_cache else None
    path = results_path(options.results_dir, engine, workload, options.tag)
    journal = _Journal(JournalWriter(path), options.on_record)
    client_pin = pinning.current()
    pool: WorkerPool | RayWorkerPool | None = None
    generator: LoadGenerator | WorkerPool | RayWorkerPool
    if load.workers > 1 or on_ray:
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
    gpu_meter = options.gpu.meter(*engine.gpu_devices(), interval_s=options.interval_s, on_sample=journal.gpu_sample)
    return _Prepared(engine, workload, options, path, journal, generator, pool, client_pin, cache_reset, gpu_meter,
                     pool_failed)


async def _write_header(p: _Prepared) -> None:
    """The document's header: what runs, where (the CPUs each worker reports), how; a results folder that takes
    nothing stops the run here, with the workers closed."""
    gpu, selection = p.options.gpu, p.gpu_meter.selection
    try:
        p.journal.writer.begin(RunHeader(
            run_id=p.path.stem, started_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            engine=EngineDescription.of(p.engine.describe()), workload=p.workload.describe(), load=p.options.load,
            slo=p.options.slo, environment=environment.capture(), labels=p.options.labels,
            cache_reset=p.cache_reset,
            placement=pinning.placement_record(p.engine, p.client_pin, p.pool.pinned if p.pool else ()),
            gpus=dataclasses.replace(selection, declared=gpu.declared) if gpu.declared is not None else selection,
        ))
    except ResultsWriteError:
        if p.pool is not None and p.pool_failed is None:
            await p.pool.close()
        raise


async def _start(p: _Prepared) -> _Timed:
    """Start the engine's accounting, the clock and the meters; whatever fails leaves the header as a partial run,
    with the workers and meters stopped."""
    try:
        if p.pool_failed is not None:
            raise p.pool_failed
        await p.engine.begin_run()
        t0 = now() + (p.pool.start_lead_s if p.pool is not None else 0.0)  # workers elsewhere are told it ahead
        timed = _Timed(t0, Scraper(p.engine, interval_s=p.options.interval_s, t0=t0, on_sample=p.journal.sample),
                       ClientMeter(), MachineMeter.for_engine(p.engine, p.pool.pids if p.pool else frozenset()))
        timed.machine_meter.start()
        p.gpu_meter.start(t0)
    except BaseException:
        p.gpu_meter.stop()
        if p.pool is not None:
            await p.pool.close()
        p.journal.writer.close()  # the journal's writer thread stops with the header written: a partial run
        raise
    return timed


async def _finish(p: _Prepared, timed: _Timed, status: str, error: str | None) -> MeasuredRun:
    """Stop the meters and workers, summarise, and write the footer: the document is whole however the sending
    ended; a write the folder refused during the run is raised here, once everything is stopped."""
    try:
        # Not below a microsecond: a run stopped before its start instant (Ray's workers get it a moment ahead)
        # measured nothing, and no duration is zero.
        duration = max(now() - timed.t0, 1e-6)
        machine = timed.machine_meter.result()  # while the workers still run: an ended process is not seen
        gpu_telemetry = p.gpu_meter.stop()
        if p.pool is not None:
            await p.pool.close()
        records = p.generator.records
        summary = _summary(records, duration, p.workload, p.options.slo, gpu_telemetry, p.options.gpu.gpu_hour_cost)
        report = await p.engine.report()
        client = timed.meter.result(records) if p.pool is None else \
            ClientLoad.combined([timed.meter.result(), *p.pool.client_loads])
        if p.journal.failed is not None:
            p.journal.writer.abandon()
            raise p.journal.failed
        footer = _footer(status, error, duration, records, timed.scraper, p.workload, p.options.load, summary,
                         report, client, machine, gpu_telemetry, p.pool.reports if p.pool is not None else [])
        p.journal.writer.finish(footer)
    finally:
        p.journal.writer.close()  # where the footer could not be written: every record handed over still is
    return MeasuredRun(p.path, records, timed.scraper.samples, summary, report, duration, status, client, machine,
                       footer.stages, footer.workers)
