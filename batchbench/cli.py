"""``batchbench``: the command line. Each subcommand is a module of :mod:`batchbench.commands`.

``batchbench --help`` lists them; ``batchbench COMMAND --help`` gives each one's options.
"""

from __future__ import annotations

import argparse

from batchbench.commands import bench, capacity, plan, report, run, selftest

#: Every subcommand module, in the order ``--help`` lists them; each has ``register(subparsers)``.
COMMANDS = (run, bench, capacity, report, plan, selftest)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="batchbench", description="Compare LLM serving engines on the batch-size vs "
                                  "latency trade-off: sweeps, SLO capacity and reports.")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return int(args.handler(args))
