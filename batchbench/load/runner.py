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
from batchbench.core.config import SCRAPE_INTERVAL_S, LoadConfig
from batchbench.core.records import RequestRecord
from batchbench.core.server_metrics import ServerMetrics
from batchbench.load import pinning
from batchbench.load.loadgen import LoadGenerator
from batchbench.load.ray_workers import RayWorkerPool
from batchbench.load.scraper import Scraper
from batchbench.load.workers import Pool, WorkerPool, partition
from batchbench.measures.client_load import ClientLoad, ClientMeter
from batchbench.measures.gpu import GpuOptions, GpuSample, energy_of
from batchbench.measures.guardrails import server_summary
from batchbench.measures.machine_load import MachineLoad, MachineMeter
from batchbench.measures.metrics import Summary, summarize
from batchbench.measures.slices import Slice, stage_windows, time_slices
from batchbench.measures.slo import Slo
from batchbench.results.document import (
    JournalWriter,
    ResultsWriteError,
    RunFooter,
    RunHeader,
    ScrapeStats,
    WorkerReport,
)
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
    workers = load.workers
    ttft_slo_s, tpot_slo_s = slo.request_limits() if slo is not None else (None, None)
    cache_reset = await engine.reset_cache() if reset_cache else None
    path = results_path(results_dir, engine, workload, tag)
    writer = JournalWriter(path)
    client_pin = pinning.current()
    # A write the results folder refused (full, read-only...) stops the run: nothing more could be kept.
    write_failed: list[ResultsWriteError] = []
    sending: asyncio.Future[list[RequestRecord]] | None = None

    def stop_writing(exc: ResultsWriteError) -> None:
        if not write_failed:
            write_failed.append(exc)
            if sending is not None:
                sending.cancel()

    def record(r: RequestRecord) -> None:
        try:
            writer.record(r)
        except ResultsWriteError as exc:
            stop_writing(exc)
            return
        if on_record is not None:
            on_record(r)

    def sample(s: ServerMetrics) -> None:
        try:
            writer.sample(s)
        except ResultsWriteError as exc:
            stop_writing(exc)

    def gpu_sample(s: GpuSample) -> None:  # on the GPU meter's thread: the next record or sample stops the run
        with contextlib.suppress(ResultsWriteError):
            writer.gpu_sample(s)

    pool: Pool | None = None
    generator: LoadGenerator | Pool
    if workers > 1 or on_ray:
        # The workers start before t0 (they take a moment, and the schedule must not wait for them) and before
        # the header, which records the CPUs each one reports; one that fails still leaves a partial document.
        kind = RayWorkerPool if on_ray else WorkerPool
        generator = pool = kind(engine, workload, workers=workers, on_record=record, config=load,
                                placement=client_pin.placement if client_pin is not None else None)
    else:
        generator = LoadGenerator(engine, workload, on_record=record, config=load)
    pool_failed: BaseException | None = None
    if pool is not None:
        try:
            await pool.start()
        except BaseException as exc:  # start() stopped every child
            pool_failed = exc
    interval_s = load.scrape_interval_s or SCRAPE_INTERVAL_S
    gpu_meter = gpu.meter(*engine.gpu_devices(), interval_s=interval_s, on_sample=gpu_sample)
    try:
        writer.begin(RunHeader(
            run_id=path.stem,
            started_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            engine=engine.describe(),
            workload=workload.describe(),
            load=load,
            slo=slo,
            environment=environment.capture(),
            labels=labels or {},
            cache_reset=cache_reset,
            placement=pinning.placement_record(engine, client_pin, pool.pinned if pool is not None else ()),
            gpus=gpu_meter.selection,
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
        scraper = Scraper(engine, interval_s=interval_s, t0=t0, on_sample=sample)
        meter = ClientMeter()
        machine_meter = MachineMeter.for_engine(engine, pool.pids if pool is not None else frozenset())
        machine_meter.start()
        gpu_meter.start(t0)
    except BaseException:
        gpu_meter.stop()
        if pool is not None:
            await pool.close()
        writer.close()  # the journal's writer thread stops with the header written: a partial run
        raise
    status, error = "complete", None
    try:
        with meter:
            async with scraper:
                sending = asyncio.ensure_future(generator.run(t0))
                await sending
    except (Exception, asyncio.CancelledError) as exc:
        status, error = "interrupted", f"{type(exc).__name__}: {exc}"
        if not write_failed:  # a refused write is raised below, once the run is stopped
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
            summary = summarize(generator.records, duration_s=duration, ttft_slo_s=ttft_slo_s,
                                tpot_slo_s=tpot_slo_s, closed_loop=workload.closed_loop)
            ok = [r for r in generator.records if r.ok]
            summary = dataclasses.replace(summary, energy=energy_of(
                gpu_telemetry, output_tokens=sum(r.output_tokens for r in ok), ok_requests=len(ok),
                duration_s=duration, gpu_hour_cost=gpu.gpu_hour_cost))
            slices = [] if load.slice_s is None else time_slices(
                generator.records, scraper.samples, width_s=load.slice_s, duration_s=duration)
            plan = workload.spec.stages
            stages = stage_windows(generator.records, scraper.samples, edges=boundaries(plan),
                                   labels=[s.label for s in plan], duration_s=duration) if plan else []
            report = await engine.report()
            reports = pool.reports if pool is not None else []
            client = meter.result(generator.records) if pool is None else \
                ClientLoad.combined([meter.result(), *pool.client_loads])
            if write_failed:
                writer.abandon()
                raise write_failed[0]
            writer.finish(RunFooter(
                status=status,
                error=error,
                finished_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                duration_s=duration,
                engine_report=report,
                scrape=ScrapeStats(failures=scraper.failures, last_error=scraper.last_error, scrapes=scraper.scrapes,
                                   mean_scrape_s=scraper.scrape_time_s / scraper.scrapes if scraper.scrapes else None),
                summary=summary,
                guardrails=server_summary(scraper.samples),
                client=client,
                machine=machine,
                gpu=gpu_telemetry,
                slices=slices,
                stages=stages,
                workers=reports,
            ))
        finally:
            writer.close()  # where the footer could not be written: every record handed over still is (partial)
    return MeasuredRun(path, generator.records, scraper.samples, summary, report, duration, status, client, machine,
                     stages, reports)
