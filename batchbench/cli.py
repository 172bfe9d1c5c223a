"""``batchbench``: the command line, and the one place its parser is built. Each subcommand is a module of
:mod:`batchbench.commands` with its options' dataclass, whose fields declare the options
(:func:`batchbench.core.options.option`), and its ``COMMAND``.

``batchbench --help`` lists them; ``batchbench COMMAND --help`` gives each one's options.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import signal
import sys

from batchbench.commands import bench, capacity, plan, report, run, selftest
from batchbench.commands.common import interrupted_by, interrupted_status, stop_signals_as_interrupts
from batchbench.core.exits import EXIT_USAGE, EXIT_WRITE, UsageError
from batchbench.core.options import Command, typed_options
from batchbench.results.journal import WRITE_ERRNOS, ResultsWriteError

#: Every subcommand, in the order ``--help`` lists them.
COMMANDS: tuple[Command, ...] = (run.COMMAND, bench.COMMAND, capacity.COMMAND, *report.COMMANDS, plan.COMMAND,
                                 selftest.COMMAND)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="batchbench", description="Compare LLM serving engines on the batch-size vs "
                                  "latency trade-off: sweeps, SLO capacity and reports.")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub)
    return top


def main(argv: list[str] | None = None) -> int:
    """Run one command; SIGTERM and SIGHUP finish it as Ctrl-C does (each command says what it kept), then
    exit 128 + the signal."""
    if hasattr(signal, "SIGUSR1") and sys.__stderr__ is not None:
        # kill -USR1 PID prints every thread's stack to stderr: where a run that will not stop is stuck. To the
        # process's own stderr, which a caller capturing sys.stderr (pytest) leaves in place.
        with contextlib.suppress(ValueError, OSError):
            faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    parsed = vars(parser().parse_args(argv))
    handler = parsed.pop("handler")
    options = typed_options(parsed.pop("options"), parsed)
    with stop_signals_as_interrupts():
        try:
            return int(handler(options))
        except UsageError as exc:
            print(f"batchbench: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except KeyboardInterrupt as stop:  # outside a command's own measuring (its report, its checks)
            print(f"batchbench: {interrupted_by(stop)}", file=sys.stderr)
            return interrupted_status(stop)
        except ResultsWriteError as exc:  # the engines are stopped by now: the commands stop them on the way out
            first = _first_write_error(exc)
            print(f"batchbench: {first}; stopped. What was written before is kept in {first.path.parent} "
                  "(batchbench report reads it)", file=sys.stderr)
            return EXIT_WRITE
        except OSError as exc:
            if exc.errno not in WRITE_ERRNOS:
                raise
            print(f"batchbench: cannot write {exc.filename or 'a result'}: {exc.strerror}; stopped", file=sys.stderr)
            return EXIT_WRITE


def _first_write_error(exc: ResultsWriteError) -> ResultsWriteError:
    """The write that failed first (a run's journal), not a later one on the way out (the summary beside it)."""
    first, cause = exc, exc.__context__
    while cause is not None:
        if isinstance(cause, ResultsWriteError):
            first = cause
        cause = cause.__context__
    return first
