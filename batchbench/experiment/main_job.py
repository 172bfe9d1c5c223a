"""The main job's measuring (``batchbench run``): each engine started in turn, calibrated, probed for its
greedy answer, and its sweep run by the repeat protocol within its share of the time limit
(:mod:`batchbench.analysis.main_job` is its design)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from batchbench.adapters.base import Engine, EngineError
from batchbench.adapters.registry import EngineOptions, get_spec
from batchbench.analysis.main_job import (
    Calibration,
    EngineSweep,
    Key,
    Repetition,
    TimeLimit,
    engine_sweep,
    generations_for,
    tail_requests,
    usable_throughput,
)
from batchbench.analysis.repeats import Repeats
from batchbench.core.config import LoadConfig
from batchbench.core.greedy import N_TOKENS, PROMPTS, GreedyOutputs
from batchbench.experiment.engines import StartingEngines
from batchbench.experiment.outcome import died, failure_lines, verdict_lines
from batchbench.experiment.progress import Progress
from batchbench.experiment.workload import sent_as
from batchbench.load.loadgen import LoadGenerator
from batchbench.load.runner import MeasuredRun, run
from batchbench.measures.gpu import GpuOptions
from batchbench.measures.slo import Slo
from batchbench.results.greedy import GREEDY_FILE, write_greedy
from batchbench.results.journal import ResultsWriteError
from batchbench.workload.profiles import Profile
from batchbench.workload.requests import Workload


@dataclass
class MainJobOutcome:
    """What the main job measured, and which engines could not run or died (name -> why)."""

    results: list[MeasuredRun] = field(default_factory=list)
    engine_problems: dict[str, str] = field(default_factory=dict)
    #: Runs of the plan (every measurement ``repeats`` times) started so far: the progress line's count.
    planned_done: int = 0
    #: Each engine's greedy answer to the agreement probe, where it gives one (:mod:`batchbench.core.greedy`).
    greedy: list[GreedyOutputs] = field(default_factory=list)


#: How far past its share an engine's mandatory runs may go (a machine slower than its calibration said): the later
#: engines' shares shrink by as much; the job's own bound is kept whatever happens.
MANDATORY_OVERRUN = 1.5


def _start_estimate(name: str, options: EngineOptions) -> float:
    """How long ``name`` is planned to take to start: an engine at a URL is up already."""
    return 1.0 if options.url_for(name) is not None else get_spec(name).start_estimate_s


async def sweep(engines: list[str], options: EngineOptions, profile: Profile, levels: tuple[int, ...],
                 results_dir: Path, repetition: Repetition, load: LoadConfig, slo: Slo, outcome: MainJobOutcome,
                 progress: Progress, limit: TimeLimit, gpu: GpuOptions | None = None) -> None:
    """Each engine in turn: started, its sweep's shapes run once to calibrate, its greedy answer probed, then its
    measurements run within its share of ``limit``; every run lands in ``outcome`` as it ends."""
    # The engine that takes longest to start goes first: when the time is split, its start is behind us.
    order = sorted(engines, key=lambda n: -_start_estimate(n, options))
    sweeps = {name: engine_sweep(name, profile, at_url=options.url_for(name) is not None, levels=levels)
              for name in order}
    planned = sum(len(sweep.keys) for sweep in sweeps.values()) * repetition.repeats
    sent = sent_as(options)
    for i, (name, sweep) in enumerate(sweeps.items()):
        design = sweep.design
        engine_options_here = (dataclasses.replace(options, max_model_len=design.max_model_len)
                               if design.max_model_len is not None and sweep.batching is not None else options)
        engines_here = StartingEngines(engine_options_here, progress)
        cache = engines_here.cache(load.request_timeout_s)
        try:
            try:
                engine = await engines_here.get(cache, name, sweep.batching)
            except (EngineError, ImportError) as exc:
                progress.print(f"batchbench: skipping {name}: {exc}", err=True)
                outcome.engine_problems[name] = str(exc)
                continue
            # The sweep's own shapes once, unrecorded (the engine's warm-up stops short of them), timed: one
            # generation of the fit on this engine and machine, what every run is sized by.
            started = time.perf_counter()
            await LoadGenerator(engine, sent(design.workload(design.fit, design.fit)), config=load).run()
            calibration = Calibration(time.perf_counter() - started)
            await _probe_greedy(name, engine, results_dir, outcome, progress)
            share = limit.share(len(order) - i, sum(_start_estimate(n, options) for n in order[i + 1:]))
            sweep = dataclasses.replace(sweep, generations=generations_for(sweep, calibration, share,
                                                                           repetition.repeats))
            progress.print(f"batchbench: {name}: continuous load at concurrency {', '.join(map(str, levels))}, "
                           f"static waves and the padding pair at {design.fit}, each {repetition.repeats} times, "
                           f"then the points the answer rests on until within ±{repetition.precision:.0%}: "
                           f"{share:.0f} s of the time limit; runs of {sweep.generations} generations "
                           f"({calibration.generation_s:.2f} s each here)")
            measured = EngineMeasurement(name, engine, sweep, calibration, share, time.perf_counter(), sent)
            await measured.run(repetition, slo, results_dir=results_dir, load=load, gpu=gpu, limit=limit,
                               outcome=outcome, progress=progress, planned=planned)
        finally:
            await cache.close()


async def _probe_greedy(name: str, engine: Engine, results_dir: Path, outcome: MainJobOutcome,
                        progress: Progress) -> None:
    """The engine's greedy answer to the fixed prompts, kept beside the results (``greedy.json``) for the report's
    agreement between engines on the same weights. Not a measurement: an engine that cannot answer is said once."""
    try:
        answer = await engine.greedy(PROMPTS, N_TOKENS)
    except EngineError as exc:
        progress.print(f"batchbench: {name}: no greedy answer for the agreement check: {exc}", err=True)
        return
    if answer is not None:
        outcome.greedy.append(answer)
        try:
            write_greedy(results_dir, outcome.greedy)
        except OSError as exc:
            raise ResultsWriteError(results_dir / GREEDY_FILE, exc) from None


@dataclass
class EngineMeasurement:
    """One started engine's part of the main job: its sweep, sized to its share of the time limit, run by the
    repeat protocol, every run's result kept in its series."""

    name: str
    engine: Engine
    sweep: EngineSweep
    calibration: Calibration
    #: Seconds of the time limit this engine's runs may take (extra repeats stop there, mandatory runs a little
    #: past it: MANDATORY_OVERRUN), from ``measuring``.
    share: float
    measuring: float
    #: How a workload is sent (:func:`sent_as`): as it is, or as chat messages.
    sent: Callable[[Workload], Workload]
    series: dict[Key, Repeats[MeasuredRun]] = field(default_factory=dict)
    #: Each measurement's workload as the sweep sizes it (a tail run's is made when it runs).
    workloads: dict[Key, Workload] = field(default_factory=dict)

    def tail(self, key: Key, slo: Slo, repeats: int) -> int | None:
        """Requests of the next run of ``key`` where it is the SLO's tail run (:func:`tail_requests`); only past
        its mandatory runs."""
        return tail_requests(self.series, key, slo) if len(self.series[key]) >= repeats else None

    def fits(self, key: Key, limit: TimeLimit, requests: int | None = None) -> bool:
        """Whether the next run of ``key`` (``requests`` long where it is a tail run, else its workload's length; at
        its last run's pace, else as planned) still fits the job and the share: a run after a tail run is
        expected as long as itself, not as the tail run."""
        runs = self.series[key].runs
        expected = runs[-1].duration_s if runs else self.sweep.expected_s(key, self.calibration)
        if runs:
            planned = requests if requests is not None else len(self.workloads[key].requests)
            expected *= planned / max(1, len(runs[-1].records))
        within_share = time.perf_counter() + expected <= self.measuring + MANDATORY_OVERRUN * self.share
        return limit.fits(expected) and within_share

    async def run(self, repetition: Repetition, slo: Slo, *, results_dir: Path, load: LoadConfig,
                  gpu: GpuOptions | None, limit: TimeLimit, outcome: MainJobOutcome, progress: Progress,
                  planned: int) -> None:
        name, sweep = self.name, self.sweep
        self.workloads = workloads = {key: self.sent(sweep.workload(key)) for key in sweep.keys}
        self.series = {key: Repeats() for key in workloads}
        protocol = repetition.protocol(sweep, slo, self.share,
                                       lambda key: self.fits(key, limit, self.tail(key, slo, repetition.repeats)))
        # Driven by hand rather than protocol.run: the runs are awaited on this loop.
        for (layout, c), repeat in protocol.schedule(self.series, started=self.measuring):
            extra = repeat >= repetition.repeats
            outcome.planned_done += not extra
            progress.sweep(outcome.planned_done, planned, f"{name} {layout} c={c} #{repeat}", left_s=limit.left(),
                           extra=extra)
            # The SLO's candidate batch gets one run long enough to bound its TTFT p99 (tail_requests).
            tail = self.tail((layout, c), slo, repetition.repeats)
            workload = workloads[(layout, c)] if tail is None else self.sent(sweep.workload((layout, c), tail))
            with progress.run(len(workload.requests), f"{layout:>13} c={c:<3} #{repeat}") as bar:
                result = await run(self.engine, workload, results_dir=results_dir, tag=f"{layout}-c{c}", load=load,
                                   slo=slo, labels=sweep.labels(layout, c, repeat, repetition.precision,
                                                                    limit.limit_s, tail),
                                   on_record=bar.observe, gpu=gpu)
                s = result.summary
                bar.finish(f"  {layout:>13} c={c:<3} #{repeat}: {s.ok}/{s.requests} ok, "
                           f"{s.curve_throughput:7.1f} out tok/s, TTFT p50 "
                           f"{_ms(s.ttft.p50 if s.ttft else None)} p99 {_ms(s.ttft.p99 if s.ttft else None)}")
            limit.runs += 1
            for line in failure_lines(result, load.request_timeout_s) + verdict_lines(result):
                progress.print(f"  {'':>22}  {line}")
            self.series[(layout, c)].add(result, result.machine)
            outcome.results.append(result)
            if (why := died(result)) is not None:
                outcome.engine_problems[name] = f"died during {layout} c={c} #{repeat}: {why}"
                progress.print(f"batchbench: {name} died during {layout} c={c} #{repeat}; its remaining runs "
                               f"are skipped: {why}", err=True)
                return
        if short := [f"{layout} c={c}" for (layout, c), runs in self.series.items() if len(runs) < repetition.repeats]:
            progress.print(f"batchbench: {name}: the time limit left {', '.join(short)} with fewer than "
                           f"{repetition.repeats} runs", err=True)
        for line in _throughput_lines(name, self.series, repetition.precision):
            progress.print(line)


def _throughput_lines(engine: str, series: dict[Key, Repeats[MeasuredRun]], precision: float) -> list[str]:
    """Per measurement, the throughput's mean and interval over its usable runs: the curve at a glance."""
    lines = [f"  {engine}: out tok/s, mean [95% interval] over the usable runs (* not within ±{precision:.0%})"]
    for (layout, c), runs in series.items():
        found = runs.estimate(usable_throughput)
        if found is None:
            lines.append(f"    {layout:>13} c={c:<3} no usable run of {len(runs)}")
            continue
        mark = "" if found.precise(precision) else " *"
        lines.append(f"    {layout:>13} c={c:<3} {found.format(lambda v: f'{v:.0f}')} (n={found.n} of "
                     f"{len(runs)}){mark}")
    return lines


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f}ms"
