"""The exit statuses every ``batchbench`` command and measuring step returns (docs/main-job.md lists them)."""

from __future__ import annotations

#: A stop by SIGTERM or SIGHUP exits 128 + the signal's number (143, 129), not one of these.
EXIT_OK, EXIT_FAILURES, EXIT_USAGE, EXIT_ENGINE, EXIT_WRITE, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130


class UsageError(Exception):
    """A bad option or combination, found before anything starts: the command line says it in one line and exits
    :data:`EXIT_USAGE` (``batchbench.commands.common.usage_errors`` raises it from the ValueError a rule raised)."""
