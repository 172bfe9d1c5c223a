"""The one clock of the harness.

Every timestamp in a record, a server-metrics sample or a schedule comes from :func:`now`, taken in
the client when the event reaches it, so client and engine clocks are never mixed.
"""

from __future__ import annotations

import time


def now() -> float:
    """Monotonic, high-resolution seconds (``time.perf_counter``: CLOCK_MONOTONIC on Linux)."""
    return time.perf_counter()
