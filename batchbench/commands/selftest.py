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
from batchbench.commands.common import interrupted_by, interrupted_status
from batchbench.core import codec
from batchbench.core.exits import EXIT_FAILURES, EXIT_OK
from batchbench.core.option_values import concurrency_list, positive_int, positive_seconds
from batchbench.core.options import Command, option
from batchbench.fixtures.protocol import fast


def whole_ms(text: str) -> float:
    """Seconds that the fast server's grid holds (whole ticks of ``fast.TICK_S``)."""
    seconds = positive_seconds(text)
    try:
        fast.ticks(seconds)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return seconds


_DEFAULTS = selftest.Settings()


@dataclass(frozen=True)
class SelftestArgs:
    """``batchbench selftest``'s options, each declared once (their defaults are :class:`selftest.Settings`')."""

    interval: float = option("--interval", default=_DEFAULTS.interval_s, type=whole_ms, metavar="S",
                             help="the server's time between a stream's tokens (default %(default)g)")
    ttft: float = option("--ttft", default=_DEFAULTS.ttft_s, type=whole_ms, metavar="S",
                         help="the server's time from a request's arrival to its first token (default %(default)g)")
    tokens: int = option("--tokens", default=_DEFAULTS.tokens, type=positive_int,
                         help="output tokens per request (default %(default)s)")
    level_seconds: float = option("--level-seconds", default=_DEFAULTS.level_s, type=positive_seconds, metavar="S",
                                  help="how long each level sends (default %(default)g)")
    max_concurrency: int = option("--max-concurrency", default=_DEFAULTS.max_concurrency, type=positive_int,
                                  help="the top of the doubling ladder (default %(default)s)")
    levels: tuple[int, ...] = option("--levels", default=_DEFAULTS.levels, type=concurrency_list, metavar="C,C,...",
                                     help="closed-loop concurrencies to try instead of the doubling ladder")
    no_poisson: bool = option("--no-poisson", default=not _DEFAULTS.poisson, action="store_true",
                              help="skip the open-loop Poisson step")
    json: bool = option("--json", default=False, action="store_true",
                        help="print the report as JSON instead of a table")


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


COMMAND = Command("selftest", "measure the load generator against a built-in server of known timing", __doc__,
                  SelftestArgs, main)
