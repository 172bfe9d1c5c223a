"""Fixtures the harness's own tests share (the suites' fixtures come from batchbench's pytest plugin)."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from batchbench.adapters.launch.cleanup import CleanupRegistry


@pytest.fixture
def registry() -> Iterator[CleanupRegistry]:
    """A cleanup registry of the test's own; the process's signal handlers are put back after it."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    r = CleanupRegistry()
    try:
        yield r
    finally:
        r.teardown()
        r.uninstall()
        for sig, handler in saved.items():
            signal.signal(sig, handler)
