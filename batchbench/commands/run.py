"""``batchbench run``: the main job, without pytest.

Runs the standard comparison (chat-like traffic as continuous closed-loop
load and as static waves of the same size) on each selected engine, writes
one results document per run and builds the report. Each layout is run
``--repeats`` times, interleaved, because one run on a shared machine is one
sample of its noise: the report and the summary printed at the end give the
median and the min-max of the repeats (:mod:`batchbench.repeats`; the summary
line leaves out runs the machine was disturbed for, when there are quiet ones).
The same engines,
options and workloads as the pytest suites, for people who want figures
rather than assertions.

Each invocation writes into a folder of its own under ``--results-dir``
(``RESULTS_DIR/run-YYYYmmdd-HHMMSS-xxxx``) and builds its report from that
folder alone, so runs of different invocations are never merged by accident.

Exit status: 0 every engine ran and every request succeeded; 1 measured, but
some requests failed; 2 a usage error (nothing started); 3 an engine could
not run or died (the others' results and the report are still written);
130 interrupted (Ctrl-C; what was measured is on disk).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass, field
from pathlib import Path

from batchbench.adapters.base import BatchingConfig, Engine, EngineError
from batchbench.adapters.registry import EngineOptions, make_engine
from batchbench.commands.common import (
    EXIT_ENGINE,
    EXIT_FAILURES,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    died,
    failure_lines,
    make_run_dir,
    positive_int,
    positive_seconds,
)
from batchbench.engines import EngineCache
from batchbench.loadgen import LoadConfig
from batchbench.options import add_engine_arguments, engine_options
from batchbench.profiles import Profile, chat_workload, get_profile
from batchbench.progress import EngineStart, Progress
from batchbench.repeats import RepeatProtocol, Repeats
from batchbench.runner import RunResult, run
from batchbench.workload import Arrival


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``batchbench run`` to the top-level parser."""
    run_p = sub.add_parser("run", help="the main job: run the standard comparison and build the report",
                           description=__doc__)
    add_engine_arguments(run_p.add_argument)
    run_p.add_argument("--seed", type=int, default=0)
    run_p.add_argument("--repeats", type=positive_int, default=3,
                       help="runs of each layout, interleaved; the report gives their median and range (default 3)")
    run_p.add_argument("--request-timeout", type=positive_seconds, default=None, metavar="SECONDS",
                       help="per-request deadline over the whole stream (default: the profile's, 120 s quick)")
    run_p.add_argument("--no-report", action="store_true", help="write results only")
    run_p.set_defaults(handler=main)


@dataclass
class Outcome:
    """What the main job measured, and which engines could not run or died (name -> why)."""

    results: list[RunResult] = field(default_factory=list)
    engine_problems: dict[str, str] = field(default_factory=dict)


async def _compare(engines: list[str], options: EngineOptions, profile: Profile, results_dir: Path,
                   seed: int, repeats: int, request_timeout_s: float, outcome: Outcome, progress: Progress) -> None:
    workload = chat_workload(profile, seed=seed)
    layouts = {
        "continuous": workload,
        "static-waves": workload.with_arrival(Arrival("waves", concurrency=profile.concurrency)),
    }
    load = LoadConfig(request_timeout_s=request_timeout_s)
    starting: list[EngineStart] = []  # the start under way: the cache makes the engine inside it

    def make(name: str, batching: BatchingConfig | None) -> Engine:
        engine = make_engine(name, batching, options)
        if starting:
            starting[-1].attach(engine.startup_timeout, engine.server_log)
        return engine

    cache = EngineCache(make, max_live=1)
    protocol = RepeatProtocol(repeats=repeats)
    points = len(engines) * len(layouts) * repeats
    try:
        for name in engines:
            try:
                with progress.engine_starting(name) as start:
                    starting[:] = [start]
                    engine = await cache.get(name)
            except (EngineError, ImportError) as exc:
                progress.print(f"batchbench: skipping {name}: {exc}", err=True)
                outcome.engine_problems[name] = str(exc)
                continue
            by_layout: dict[str, Repeats[RunResult]] = {tag: Repeats() for tag in layouts}
            # Driven by hand rather than protocol.run: the runs are awaited on this loop.
            for tag, repeat in protocol.schedule(by_layout):
                progress.sweep(len(outcome.results) + 1, points, f"{name} {tag} #{repeat}")
                with progress.run(len(layouts[tag].requests), f"{tag:>13} #{repeat}") as bar:
                    result = await run(engine, layouts[tag], results_dir=results_dir, tag=tag, load=load,
                                       labels={"layout": tag, "concurrency": profile.concurrency, "repeat": repeat},
                                       on_record=bar.observe)
                    s = result.summary
                    bar.finish(f"  {tag:>13} #{repeat}: {s.ok}/{s.requests} ok, {s.output_token_throughput:.1f} out "
                               f"tok/s, TTFT p50 {_ms(s.ttft.p50 if s.ttft else None)} p99 "
                               f"{_ms(s.ttft.p99 if s.ttft else None)} -> {result.path}")
                for line in failure_lines(result, load.request_timeout_s):
                    progress.print(f"  {'':>16}  {line}")
                for warning in result.warnings():
                    progress.print(f"  {'':>16}  warning: {warning}")
                by_layout[tag].add(result, result.machine)
                outcome.results.append(result)
                if (why := died(result)) is not None:
                    outcome.engine_problems[name] = f"died during {tag} #{repeat}: {why}"
                    progress.print(f"batchbench: {name} died during {tag} #{repeat}; its remaining runs are "
                                   f"skipped: {why}", err=True)
                    break
            if name not in outcome.engine_problems:
                progress.print(_throughput_line(name, by_layout))
            await cache.release(name)
    finally:
        await cache.close()


def _throughput_line(engine: str, by_layout: dict[str, Repeats[RunResult]]) -> str:
    """Median (min-max) output tokens/s per layout over its kept runs, and the ratio of the medians: the headline."""
    intervals = {tag: runs.interval(lambda r: r.summary.output_token_throughput) for tag, runs in by_layout.items()}
    parts = [f"{tag} {iv.format() if iv else 'n/a'}" + _kept_note(by_layout[tag]) for tag, iv in intervals.items()]
    continuous, static = intervals["continuous"], intervals["static-waves"]
    ratio = continuous.median / static.median if continuous and static and static.median else float("nan")
    n = max(len(runs) for runs in by_layout.values())
    return (f"  {engine}: out tok/s, median (min-max) of {n}: "
            f"{', '.join(parts)}; continuous/static-waves {ratio:.2f}")


def _kept_note(runs: Repeats[RunResult]) -> str:
    kept = len(runs.kept())
    return "" if kept == len(runs) else f" [{kept} quiet of {len(runs)}]"


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f}ms"


def main(args: argparse.Namespace) -> int:
    profile = get_profile(args.profile)
    try:
        engines, options = engine_options(args.engine, engine_urls=args.engine_url, model=args.model,
                                          launch=args.launch, profile=profile, results_dir=args.results_dir)
        if args.batching:
            raise ValueError("--batching: the main job runs each engine's default configuration; "
                             "use the suites (pytest --batching ...) for a config grid")
    except ValueError as exc:
        print(f"batchbench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        run_dir = make_run_dir(args.results_dir, "run")
    except OSError as exc:
        print(f"batchbench: cannot write results under {args.results_dir}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"batchbench: results in {run_dir}")
    outcome = Outcome()
    timeout_s = args.request_timeout or profile.request_timeout_s
    progress = Progress.for_terminal()
    try:
        with progress:
            asyncio.run(_compare(list(engines), options, profile, run_dir, args.seed, args.repeats, timeout_s,
                                 outcome, progress))
    except KeyboardInterrupt:
        # The runner folded every finished run; a run cut short left its journal: nothing measured is lost.
        # Cut short while the first engine started, nothing was measured: progress's one line said it all.
        if outcome.results or not progress.interrupted:
            print(f"batchbench: interrupted; {len(outcome.results)} finished run(s) and any cut-short run's "
                  f"journal are in {run_dir}", file=sys.stderr)
        return EXIT_INTERRUPTED
    if not outcome.results:
        print("batchbench: no engine could be run; nothing measured", file=sys.stderr)
        return EXIT_ENGINE
    status = EXIT_OK if all(r.summary.failed == 0 for r in outcome.results) else EXIT_FAILURES
    if outcome.engine_problems:
        status = EXIT_ENGINE
        for name, why in outcome.engine_problems.items():
            print(f"batchbench: {name}: {why}", file=sys.stderr)
    if not args.no_report:
        from batchbench.reports.build import ReportError, build

        try:
            out = build(run_dir, run_dir / "report")
        except ReportError as exc:
            print(f"batchbench: results written, but no report: {exc}", file=sys.stderr)
            return max(status, EXIT_FAILURES)
        print(f"batchbench: report written to {out}")
    return status
