"""The exit statuses every ``batchbench`` command and measuring step returns (docs/main-job.md lists them)."""

from __future__ import annotations

#: A stop by SIGTERM or SIGHUP exits 128 + the signal's number (143, 129), not one of these.
EXIT_OK, EXIT_FAILURES, EXIT_USAGE, EXIT_ENGINE, EXIT_WRITE, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130
