"""``batchbench capacity --slo ttft_p99=200ms,...``: the highest concurrency (or rate) that meets the SLO.

The search (:mod:`batchbench.analysis.capacity`) doubles the level from ``--start`` while it meets the SLO (up to
``--max``), then bisects between the last level that met it and the first that did not: to the exact
whole number for concurrency (``--by concurrency``, the default), to ``--tolerance`` (relative) for
rates (``--by rate``). Each level is run up to ``--repeats`` times and meets the SLO only if every
repeat does (a capacity is a promise; the first miss settles the level). A level whose requests all
failed (timeouts, the engine died) misses it, for that reason. The workload options are ``bench``'s.

It prints, per engine, the capacity with its goodput and the first failing level with the objective
it missed, and writes every run's results document, ``capacity.json`` (every level measured, with its
verdicts) and the report into ``RESULTS_DIR/capacity-YYYYmmdd-HHMMSS-xxxx``.

Exit status: 0 a capacity was found for every engine; 1 some engine met the SLO at no level tried;
2 a usage error (nothing started); 3 an engine could not run or died; 4 the results folder refused a write;
130 interrupted (Ctrl-C), 143/129 stopped by SIGTERM/SIGHUP, which finish as Ctrl-C does.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchbench.adapters.base import EngineError
from batchbench.adapters.registry import EngineOptions
from batchbench.analysis.accelerators import Accelerator
from batchbench.analysis.capacity import CapacityResult, Search
from batchbench.commands.common import (
    check_lora_specs,
    interrupted_by,
    interrupted_status,
    make_run_dir,
    one_batching,
    serve_loras,
    served_models_at_urls,
    usage_errors,
)
from batchbench.core import eventloop
from batchbench.core.config import BatchingConfig
from batchbench.core.exits import EXIT_FAILURES, EXIT_OK, EXIT_USAGE
from batchbench.core.option_values import positive_number
from batchbench.core.options import Command, option
from batchbench.experiment.engines import StartingEngines, place_client
from batchbench.experiment.levels import EngineSession, PointResult, finish, level_text, write_summary
from batchbench.experiment.progress import Progress
from batchbench.experiment.workload import LevelKind, PreparedWorkload, WorkloadArgs, prepare_workload
from batchbench.measures.slo import Slo
from batchbench.options import EngineArgs, TelemetryArgs, gpu_option, with_load_processes

#: Where the search goes down to when ``--start`` fails and ``--min`` is not given: batch 1, or ``--start`` over this.
_MIN_CONCURRENCY = 1.0
_RATE_FLOOR = 64


@dataclass(frozen=True)
class CapacityArgs:
    """``batchbench capacity``'s options, each declared once (the workload's are ``bench``'s, ``--slo`` required,
    ``--stages`` left out)."""

    engine: EngineArgs
    telemetry: TelemetryArgs
    workload: WorkloadArgs
    by: LevelKind = option("--by", default="concurrency", choices=["concurrency", "rate"],
                           help="search over requests in flight (closed loop) or requests/s (open loop) (default "
                                "%(default)s)")
    start: float = option("--start", default=1.0, type=positive_number, help="first level tried (default %(default)g)")
    max_level: float = option("--max", default=1024.0, type=positive_number,
                              help="highest level tried (default %(default)g)")
    min_level: float | None = option(
        "--min", type=positive_number,
        help=f"lowest level tried when --start fails (default {_MIN_CONCURRENCY:g} for concurrency, "
             f"start/{_RATE_FLOOR} for rate)")
    tolerance: float = option(
        "--tolerance", default=0.1, type=positive_number,
        help="rates: stop when the bracket is within this fraction of the capacity (default %(default)g)")
    gpu: Accelerator | None = gpu_option()

    @property
    def slo(self) -> Slo:
        """The SLO searched for (``--slo``, which capacity requires)."""
        assert self.workload.slo is not None, "--slo is required"
        return self.workload.slo

    def search(self) -> Search:
        """The search over levels; ValueError for bounds that cannot be searched."""
        integer = self.by == "concurrency"
        min_level = self.min_level or (_MIN_CONCURRENCY if integer else self.start / _RATE_FLOOR)
        return Search(start=self.start, max_level=self.max_level, integer=integer, min_level=min_level,
                      tolerance=self.tolerance, repeats=self.workload.repeats)


@dataclass
class CapacityMeasured:
    """What the invocation measured: every point, each engine's search result, and engines that could not run."""

    points: list[PointResult] = field(default_factory=list)
    results: dict[str, CapacityResult] = field(default_factory=dict)
    engine_problems: dict[str, str] = field(default_factory=dict)

    def document(self, kind: LevelKind, args: CapacityArgs) -> dict[str, Any]:
        return {"command": "capacity", "by": kind, "slo": args.slo.to_dict(),
                "rule": "a level meets the SLO only if every repeat does", "repeats": args.workload.repeats,
                "engines": {name: r.to_dict() for name, r in self.results.items()},
                "runs": [p.to_dict() for p in self.points], "engine_problems": dict(self.engine_problems)}


async def _find(engines: tuple[str, ...], options: EngineOptions, batching: BatchingConfig | None,
                work: PreparedWorkload, kind: LevelKind, args: CapacityArgs, run_dir: Path, timeout_s: float,
                found: CapacityMeasured, progress: Progress) -> None:
    engines_here = StartingEngines(options, progress)
    cache = engines_here.cache(timeout_s)
    load = work.load(timeout_s, args.workload.scrape_interval)
    try:
        for name in engines:
            session = EngineSession(engines_here, cache, name, batching, args.telemetry.gpu(args.gpu))
            search = args.search()
            try:
                while (level := search.next_level()) is not None:
                    repeat = sum(len(p.outcomes) for p in search.result().points if p.level == level)
                    point = await session.measure(work, kind, level, repeat, run_dir=run_dir, suite="capacity",
                                                  slo=args.slo, load=load)
                    found.points.append(point)
                    search.add(level, point.outcome())
                    found.results[name] = search.result()
                    write_summary(run_dir / "capacity.json", found.document(kind, args))
            except (EngineError, ImportError) as exc:
                progress.print(f"batchbench: {name} cannot run: {exc}", err=True)
                found.engine_problems[name] = str(exc)
                continue
            found.results[name] = result = search.result()
            progress.print(_verdict_line(name, kind, result))
            await cache.release(name, batching)
    finally:
        await cache.close()
        write_summary(run_dir / "capacity.json", found.document(kind, args))


def _verdict_line(name: str, kind: LevelKind, result: CapacityResult) -> str:
    """The answer: the capacity and its goodput, and the first failing level with what it missed."""
    failing = ""
    if result.first_failing is not None:
        failing = f"; first failing {level_text(kind, result.first_failing)}: {', '.join(result.failed)}"
    if result.capacity is None:
        return f"  {name}: no level met the SLO{failing}"
    goodput = f"{result.goodput:.2f} req/s" if result.goodput is not None else "n/a"
    ceiling = " (the --max tried: the capacity may be higher)" if result.reached_max else ""
    return f"  {name}: capacity {level_text(kind, result.capacity)}{ceiling}, goodput {goodput}{failing}"


def main(args: CapacityArgs) -> int:
    w = args.workload
    profile = args.engine.sizes
    kind: LevelKind = args.by
    with usage_errors():
        engines, options = args.engine.resolve()
        batching = one_batching(args.engine.batching, "capacity", engines)
        args.search()  # its bounds are checked before anything starts
        served = served_models_at_urls(engines, options)
        work = prepare_workload(w, profile, kind=kind, levels=[args.start, args.max_level], served=served)
        check_lora_specs(w.loras, engines, batching)
        options = dataclasses.replace(options, text_tokenizer=work.tokenizer)
        options = with_load_processes(options, args.engine.cpus,
                                      work.most_workers(kind, [args.start, args.max_level]))
    if (run_dir := make_run_dir(args.engine.results_dir, "capacity")) is None:
        return EXIT_USAGE
    with usage_errors():
        options = serve_loras(w.loras, options, run_dir, w.seed)
    print(f"batchbench: SLO {args.slo}")
    for note in work.notes:
        print(f"batchbench: {note}")
    found = CapacityMeasured()
    timeout_s = w.request_timeout or profile.request_timeout_s
    progress = Progress.for_terminal()
    try:
        with place_client(options), progress:
            eventloop.run(_find(engines, options, batching, work, kind, args, run_dir, timeout_s, found, progress))
    except KeyboardInterrupt as stop:
        print(f"\nbatchbench: {interrupted_by(stop)}; {len(found.points)} finished run(s), any cut-short run "
              f"(status interrupted) and capacity.json are in {run_dir}", file=sys.stderr)
        return interrupted_status(stop)
    status = EXIT_OK if all(r.capacity is not None for r in found.results.values()) else EXIT_FAILURES
    return finish(run_dir, found.points, found.engine_problems, no_report=w.no_report, slo=args.slo,
                  status=status, gpu=args.gpu)


COMMAND = Command("capacity", "the highest concurrency (or rate) that meets an SLO", __doc__, CapacityArgs, main,
                  leave_out=("stages",), required=("slo",))
