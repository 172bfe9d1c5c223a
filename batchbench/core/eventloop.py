"""The event loop the command line measures on: uvloop where it is installed, asyncio's own otherwise.

The load generator's CPU per streamed chunk is what limits how much load one client can offer and how
late its timestamps are (tests/test_loadgen_benchmark.py); uvloop's loop, written on libuv in Cython,
runs the same callbacks for less. The pytest side keeps asyncio's loop: pytest-asyncio owns the tests'
loops, and the suites' loop thread (:class:`batchbench.harness.LoopThread`) starts engines from a thread
that is not the main one, where uvloop's child-process and signal handling is not asyncio's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

try:
    import uvloop
except ImportError:  # pragma: no cover - exercised where uvloop is not installed (Windows)
    uvloop = None  # type: ignore[assignment]

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop where installed, else asyncio's."""
    return uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on :func:`new_event_loop` (Ctrl-C cancels ``main`` the same way)."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)
