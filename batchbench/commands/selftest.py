"""``batchbench selftest``: can this host's client be trusted? The load generator against a server of known truth.

Starts a protocol server in its own process (vLLM's wire format, one token per chunk every ``--interval``
plus its overhead; it records when each step really ran: the truth), doubles closed-loop concurrency until
the client's runs turn invalid, then runs one Poisson step, and prints per level: chunks/s, client CPU per
chunk, chunks/s per client core, ITL p50 error against the server's step interval, TTFT p50, schedule lag,
event-loop lag, read-burst share and the verdict; last, the saturation point: the highest concurrency whose
figures are still the server's (:mod:`batchbench.selftest`).
Run it on the host that will drive a GPU run, before trusting that run's figures.

Exit status: 0 done; 1 not even one stream was measured validly; 130 interrupted (the server is stopped).
"""

from __future__ import annotations

import argparse
import json
import sys

from batchbench import eventloop, selftest
from batchbench.commands.common import (
    EXIT_FAILURES,
    EXIT_INTERRUPTED,
    EXIT_OK,
    concurrency_list,
    positive_int,
    positive_seconds,
)


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``batchbench selftest`` to the top-level parser."""
    defaults = selftest.Settings()
    p = sub.add_parser("selftest", help="measure the load generator against a built-in server of known timing",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--interval", type=positive_seconds, default=defaults.interval_s, metavar="S",
                   help=f"the server's time between steps, one token each (default {defaults.interval_s:g})")
    p.add_argument("--tokens", type=positive_int, default=defaults.tokens, help="output tokens per request")
    p.add_argument("--level-seconds", type=positive_seconds, default=defaults.level_s, metavar="S",
                   help=f"how long each level sends (default {defaults.level_s:g})")
    p.add_argument("--max-concurrency", type=positive_int, default=defaults.max_concurrency,
                   help=f"the top of the doubling ladder (default {defaults.max_concurrency})")
    p.add_argument("--levels", type=concurrency_list, default=(), metavar="C,C,...",
                   help="closed-loop concurrencies to try instead of the doubling ladder")
    p.add_argument("--no-poisson", action="store_true", help="skip the open-loop Poisson step")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    p.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    settings = selftest.Settings(interval_s=args.interval, tokens=args.tokens, level_s=args.level_seconds,
                                 max_concurrency=args.max_concurrency, levels=args.levels,
                                 poisson=not args.no_poisson)

    def show(level: selftest.Level) -> None:
        if not args.json:
            print(selftest.line(level), flush=True)

    if not args.json:
        print(f"batchbench selftest: server interval {settings.interval_s * 1000:g} ms, {settings.tokens} tokens "
              f"per request, {settings.level_s:g} s per level (times in ms)\n{selftest.HEADER}", flush=True)
    try:
        with selftest.protocol_server(settings.interval_s) as url:
            report = eventloop.run(selftest.ramp(url, settings, show))
    except KeyboardInterrupt:
        print("batchbench selftest: interrupted (the server is stopped)", file=sys.stderr)
        return EXIT_INTERRUPTED
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        print(selftest.conclusion(report))
    return EXIT_OK if report.saturation is not None else EXIT_FAILURES
