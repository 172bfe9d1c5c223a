"""``batchbench run``: the main job, without pytest.

Runs the standard comparison (chat-like traffic as continuous closed-loop
load and as static waves of the same size) on each selected engine, writes
one results document per run and builds the report. The same engines,
options and workloads as the pytest suites, for people who want figures
rather than assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from adapters.base import EngineError
from adapters.registry import EMBEDDED_ENGINES, ENGINES, EngineOptions, make_engine, parse_engine_urls
from batchbench.loadgen import LoadConfig
from batchbench.pool import EnginePool
from batchbench.profiles import Profile, chat_workload, get_profile
from batchbench.runner import RunResult, run
from fixtures.workloads import Arrival


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchbench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="run the standard comparison and build the report")
    run_p.add_argument("--engine", action="append", default=[], choices=sorted(ENGINES),
                       help=f"engine (repeatable; default: {' '.join(EMBEDDED_ENGINES)})")
    run_p.add_argument("--engine-url", action="append", default=[], metavar="NAME=URL")
    run_p.add_argument("--model", default=None)
    run_p.add_argument("--launch", default="auto", choices=["auto", "local", "docker"])
    run_p.add_argument("--profile", default="quick", choices=["quick", "full"])
    run_p.add_argument("--results-dir", type=Path, default=Path("results"))
    run_p.add_argument("--seed", type=int, default=0)
    run_p.add_argument("--no-report", action="store_true", help="write results only")
    return parser


async def _compare(engines: list[str], options: EngineOptions, profile: Profile, results_dir: Path,
                   seed: int) -> list[RunResult]:
    workload = chat_workload(profile, seed=seed)
    layouts = {
        "continuous": workload,
        "static-waves": workload.with_arrival(Arrival("waves", concurrency=profile.concurrency)),
    }
    load = LoadConfig(request_timeout_s=profile.request_timeout_s)
    results: list[RunResult] = []
    pool = EnginePool(lambda name, batching: make_engine(name, batching, options), max_live=1)
    try:
        for name in engines:
            try:
                engine = await pool.get(name)
            except (EngineError, ImportError) as exc:
                print(f"batchbench: skipping {name}: {exc}", file=sys.stderr)
                continue
            print(f"batchbench: {name} ready (started in {getattr(engine, 'startup_s', 0) or 0:.1f}s)")
            for tag, wl in layouts.items():
                result = await run(engine, wl, results_dir=results_dir, tag=tag, load=load,
                                   labels={"layout": tag, "concurrency": profile.concurrency})
                s = result.summary
                print(f"  {tag:>13}: {s.ok}/{s.requests} ok, {s.output_token_throughput:.1f} out tok/s, "
                      f"TTFT p50 {_ms(s.ttft.p50 if s.ttft else None)} p99 {_ms(s.ttft.p99 if s.ttft else None)}"
                      f" -> {result.path}")
                for warning in result.client.warnings():
                    print(f"  {'':>13}  warning: {warning}")
                results.append(result)
            await pool.release(name)
    finally:
        await pool.close()
    return results


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f}ms"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    engines = args.engine or list(EMBEDDED_ENGINES)
    profile = get_profile(args.profile)
    try:
        urls = parse_engine_urls(args.engine_url, engines)
    except ValueError as exc:
        print(f"batchbench: {exc}", file=sys.stderr)
        return 2
    options = EngineOptions(model=args.model, urls=urls, launch=args.launch, max_model_len=profile.max_model_len,
                            log_dir=args.results_dir / "server-logs")
    results = asyncio.run(_compare(engines, options, profile, args.results_dir, args.seed))
    if not results:
        print("batchbench: no engine could be run; nothing measured", file=sys.stderr)
        return 1
    if not args.no_report:
        from reports.build import ReportError, build

        try:
            out = build(args.results_dir, args.results_dir / "report")
        except ReportError as exc:
            print(f"batchbench: results written, but no report: {exc}", file=sys.stderr)
            return 1
        print(f"batchbench: report written to {out}")
    return 0 if all(r.summary.failed == 0 for r in results) else 1
