"""``batchbench selftest``: can this host's client be trusted? The load generator against a server of known truth.

Starts the fast stream server in its own process (vLLM's wire format at almost no CPU per chunk: the first
token ``--ttft`` after a request arrives, then one per chunk every ``--interval``; it records what it really
did: the truth), on one CPU and the client on another where the host has two, doubles closed-loop
concurrency until the client's runs turn invalid, then runs one Poisson step, and prints per level: chunks/s,
client CPU per chunk, chunks/s per client core, ITL p50 and TTFT p50 errors against the server's own,
schedule lag, event-loop lag, read-burst share and the verdict; last, the saturation point: the highest
concurrency whose figures are still the server's (:mod:`batchbench.selftest`).
Run it on the host that will drive a GPU run, before trusting that run's figures.

Exit status: 0 done; 1 not even one stream was measured validly; 130 interrupted (the server is stopped).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

from batchbench import selftest
from batchbench.commands.common import (
    concurrency_list,
    interrupted_by,
    interrupted_status,
    positive_int,
    positive_seconds,
)
from batchbench.core import codec
from batchbench.core.exits import EXIT_FAILURES, EXIT_OK
from batchbench.fixtures.protocol import fast


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``batchbench selftest`` to the top-level parser."""
    defaults = selftest.Settings()
    p = sub.add_parser("selftest", help="measure the load generator against a built-in server of known timing",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--interval", type=whole_ms, default=defaults.interval_s, metavar="S",
                   help=f"the server's time between a stream's tokens (default {defaults.interval_s:g})")
    p.add_argument("--ttft", type=whole_ms, default=defaults.ttft_s, metavar="S",
                   help=f"the server's time from a request's arrival to its first token (default {defaults.ttft_s:g})")
    p.add_argument("--tokens", type=positive_int, default=defaults.tokens, help="output tokens per request")
    p.add_argument("--level-seconds", type=positive_seconds, default=defaults.level_s, metavar="S",
                   help=f"how long each level sends (default {defaults.level_s:g})")
    p.add_argument("--max-concurrency", type=positive_int, default=defaults.max_concurrency,
                   help=f"the top of the doubling ladder (default {defaults.max_concurrency})")
    p.add_argument("--levels", type=concurrency_list, default=(), metavar="C,C,...",
                   help="closed-loop concurrencies to try instead of the doubling ladder")
    p.add_argument("--no-poisson", action="store_true", help="skip the open-loop Poisson step")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    p.set_defaults(handler=main, options=SelftestArgs)


@dataclass(frozen=True)
class SelftestArgs:
    """``batchbench selftest``'s options as parsed."""

    interval: float
    ttft: float
    tokens: int
    level_seconds: float
    max_concurrency: int
    levels: tuple[int, ...] = ()
    no_poisson: bool = False
    json: bool = False


def whole_ms(text: str) -> float:
    """Seconds that the fast server's grid holds (whole ticks of ``fast.TICK_S``)."""
    seconds = positive_seconds(text)
    try:
        fast.ticks(seconds)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return seconds


def main(args: SelftestArgs) -> int:
    settings = selftest.Settings(interval_s=args.interval, ttft_s=args.ttft, tokens=args.tokens,
                                 level_s=args.level_seconds,
                                 max_concurrency=args.max_concurrency, levels=args.levels,
                                 poisson=not args.no_poisson)

    def show(level: selftest.Level) -> None:
        if not args.json:
            print(selftest.line(level), flush=True)

    where = selftest.placement()
    if not args.json:
        print(f"batchbench selftest: server TTFT {settings.ttft_s * 1000:g} ms, then a token every "
              f"{settings.interval_s * 1000:g} ms, {settings.tokens} tokens per request, {settings.level_s:g} s per "
              f"level; {where.describe()} (times in ms)\n{selftest.HEADER}", flush=True)
    try:
        report = selftest.selftest(settings, show, where=where)
    except KeyboardInterrupt as stop:
        print(f"batchbench selftest: {interrupted_by(stop)} (the server is stopped)", file=sys.stderr)
        return interrupted_status(stop)
    if args.json:
        print(json.dumps(codec.encode(report), indent=1))
    else:
        print(selftest.conclusion(report))
    return EXIT_OK if report.saturation is not None else EXIT_FAILURES
