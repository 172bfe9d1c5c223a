"""``batchbench bench``: one workload of your own against any engine, at each concurrency or rate given.

The workload is synthetic lengths (``--input-len``, ``--output-len``: a number, or a distribution
such as ``uniform:64:256`` or ``lognormal:128:0.8``) or a dataset (``--dataset FILE``: JSONL prompts,
token ids or text, or ShareGPT JSON; text is tokenised with the served model's tokenizer). The same
requests are sent at every level: ``--concurrency 1,4,16`` keeps that many in flight (closed loop),
``--rate 2,8,inf`` sends that many per second (``--arrival poisson|gamma``; ``inf`` all at once).
Each level is run ``--repeats`` times; each run writes a results document into a folder of its own,
``RESULTS_DIR/bench-YYYYmmdd-HHMMSS-xxxx``, with ``bench.json`` (every run's SLO verdict, workload
parity and failure reason) and the report.

With ``--slo ttft_p99=200ms,tpot_p99=50ms`` each run is checked against the objectives, and goodput
counts the requests within the TTFT and TPOT limits. Each run also checks workload parity: an engine
whose own prompt or output token counts differ from the workload's is flagged.

A level whose requests all fail (the engine died, every request timed out) is recorded as failed with
the reason; the sweep goes on (an engine that died is started again), or stops there with
``--stop-on-error``.

Exit status: 0 every run succeeded; 1 measured, but some requests or levels failed; 2 a usage error
(nothing started); 3 an engine could not run or died; 4 the results folder refused a write; 130 interrupted
(Ctrl-C), 143/129 stopped by SIGTERM/SIGHUP, which finish as Ctrl-C does (what was measured is on disk).
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
from batchbench.core.exits import EXIT_USAGE
from batchbench.core.option_values import concurrency_list, rate_list
from batchbench.core.options import Command, option
from batchbench.experiment.engines import StartingEngines, place_client
from batchbench.experiment.levels import EngineSession, PointResult, finish, level_text, write_summary
from batchbench.experiment.progress import Progress
from batchbench.experiment.workload import LevelKind, PreparedWorkload, WorkloadArgs, prepare_workload, timed_levels
from batchbench.measures.slo import Slo
from batchbench.options import EngineArgs, TelemetryArgs, gpu_option, with_load_processes
from batchbench.workload.profiles import PROFILES


@dataclass(frozen=True)
class BenchArgs:
    """``batchbench bench``'s options, each declared once."""

    engine: EngineArgs
    telemetry: TelemetryArgs
    workload: WorkloadArgs
    concurrency: tuple[int, ...] | None = option(
        "--concurrency", type=concurrency_list, metavar="LIST", exclusive="levels",
        help="requests kept in flight; a comma list is a sweep (default: the profile's, "
             f"{PROFILES['quick'].concurrency} quick)")
    rate: list[float] | None = option(
        "--rate", type=rate_list, metavar="LIST", exclusive="levels",
        help="requests sent per second (inf: all at once); a comma list is a sweep")
    stop_on_error: bool = option(
        "--stop-on-error", default=False, action="store_true",
        help="stop the sweep at the first level that fails outright",
        negation=("--keep-going", "measure every level even after one failed (the default)"))
    gpu: Accelerator | None = gpu_option()


@dataclass
class Sweep:
    """What one invocation measured, and which engines could not run (name -> why)."""

    points: list[PointResult] = field(default_factory=list)
    engine_problems: dict[str, str] = field(default_factory=dict)

    def document(self, kind: LevelKind, slo: Slo | None, notes: list[str]) -> dict[str, Any]:
        return {"command": "bench", "by": kind, "slo": slo.to_dict() if slo else None, "notes": notes,
                "runs": [p.to_dict() for p in self.points], "engine_problems": dict(self.engine_problems)}


async def _sweep(engines: tuple[str, ...], options: EngineOptions, batching: BatchingConfig | None,
                 work: PreparedWorkload, kind: LevelKind, levels: list[float], args: BenchArgs, run_dir: Path,
                 timeout_s: float, sweep: Sweep, progress: Progress) -> None:
    w = args.workload
    engines_here = StartingEngines(options, progress)
    cache = engines_here.cache(timeout_s)
    load = work.load(timeout_s, w.scrape_interval)
    try:
        for name in engines:
            session = EngineSession(engines_here, cache, name, batching, args.telemetry.gpu(args.gpu))
            try:
                for level in levels:
                    for repeat in range(w.repeats):
                        point = await session.measure(work, kind, level, repeat, run_dir=run_dir, suite="bench",
                                                      slo=w.slo, load=load)
                        sweep.points.append(point)
                        write_summary(run_dir / "bench.json", sweep.document(kind, w.slo, work.notes))
                        if point.status == "failed" and args.stop_on_error:
                            raise _Stop(f"{level_text(kind, level)} #{repeat} failed: {point.reason}")
            except (EngineError, ImportError) as exc:
                progress.print(f"batchbench: {name} cannot run: {exc}", err=True)
                sweep.engine_problems[name] = str(exc)
            except _Stop as stop:
                progress.print(f"batchbench: {name}: stopping the sweep (--stop-on-error): {stop}", err=True)
            await cache.release(name, batching)
    finally:
        await cache.close()
        write_summary(run_dir / "bench.json", sweep.document(kind, w.slo, work.notes))


class _Stop(Exception):
    """--stop-on-error: a level failed outright."""


def main(args: BenchArgs) -> int:
    w = args.workload
    profile = args.engine.sizes
    with usage_errors():
        replay = timed_levels(w, args.concurrency, args.rate)
        kind: LevelKind = "rate" if args.rate is not None or replay is not None else "concurrency"
        levels = replay or args.rate or [float(c) for c in args.concurrency or (profile.concurrency,)]
        engines, options = args.engine.resolve()
        batching = one_batching(args.engine.batching, "bench", engines)
        served = served_models_at_urls(engines, options)
        work = prepare_workload(w, profile, kind=kind, levels=levels, served=served)
        check_lora_specs(w.loras, engines, batching)
        options = dataclasses.replace(options, text_tokenizer=work.tokenizer)
        options = with_load_processes(options, args.engine.cpus, work.most_workers(kind, levels))
    if (run_dir := make_run_dir(args.engine.results_dir, "bench")) is None:
        return EXIT_USAGE
    with usage_errors():
        options = serve_loras(w.loras, options, run_dir, w.seed)
    for note in work.notes:
        print(f"batchbench: {note}")
    sweep = Sweep()
    timeout_s = w.request_timeout or profile.request_timeout_s
    progress = Progress.for_terminal()
    try:
        with place_client(options), progress:
            eventloop.run(_sweep(engines, options, batching, work, kind, levels, args, run_dir, timeout_s, sweep,
                                 progress))
    except KeyboardInterrupt as stop:
        print(f"\nbatchbench: {interrupted_by(stop)}; {len(sweep.points)} finished run(s), any cut-short run "
              f"(status interrupted) and bench.json are in {run_dir}", file=sys.stderr)
        return interrupted_status(stop)
    return finish(run_dir, sweep.points, sweep.engine_problems, no_report=w.no_report, slo=w.slo, gpu=args.gpu)


COMMAND = Command("bench", "your workload (lengths or a dataset) at each concurrency or rate, with SLOs", __doc__,
                  BenchArgs, main)
