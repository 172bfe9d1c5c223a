"""The event loop the command line measures on: uvloop where it is installed, asyncio's own otherwise.

The load generator's CPU per streamed chunk is what limits how much load one client can offer and how
late its timestamps are (tests/test_loadgen_benchmark.py); uvloop's loop, written on libuv in Cython,
runs the same callbacks for less. The pytest side keeps asyncio's loop: pytest-asyncio owns the tests'
loops, and the suites' loop thread (:class:`batchbench.experiment.harness.LoopThread`) starts engines from a thread
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


#: The task :func:`run` runs, while it runs (what :func:`interrupt` cancels).
_main: asyncio.Task[Any] | None = None
#: What :func:`run` raises once its cancelled task has finished (set by :func:`interrupt`).
_interrupted_by: BaseException | None = None


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on :func:`new_event_loop` (Ctrl-C cancels ``main`` the same way); after
    :func:`interrupt`, the exception it was given."""
    global _interrupted_by
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        try:
            return runner.run(_as_main(main))
        except asyncio.CancelledError:
            if _interrupted_by is not None:
                raise _interrupted_by from None
            raise
        finally:
            _interrupted_by = None


async def _as_main(main: Coroutine[Any, Any, T]) -> T:
    global _main
    _main = asyncio.current_task()
    try:
        return await main
    finally:
        _main = None


def interrupt(exc: BaseException) -> bool:
    """Stop the coroutine :func:`run` runs as asyncio stops it on Ctrl-C: cancel it, so every ``finally`` on its
    way out runs in order on a live loop (runs folded, workers asked for their last records), then have
    :func:`run` raise ``exc``. For a signal handler in the main thread; False when nothing runs (raise then)."""
    global _interrupted_by
    if _main is None or _main.done():
        return False
    _interrupted_by = exc
    _main.cancel()
    # As asyncio's Runner does on Ctrl-C: wake a loop blocked in select() with a long timeout, which a
    # cancellation from a signal handler alone would not.
    _main.get_loop().call_soon_threadsafe(lambda: None)
    return True


async def cancel_and_wait(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` and wait until it has finished, without swallowing a cancellation of the caller.

    Written out because the usual ``task.cancel(); with suppress(CancelledError): await task`` loses a
    cancellation of the *caller* that lands while it waits (a Ctrl-C or SIGTERM then leaves the command
    running). Only a cancellation that arrived during the wait is raised (``Task.cancelling`` rose): a caller
    already unwinding from one, cleaning up, still waits for ``task`` and goes on with its cleanup.
    """
    current = asyncio.current_task()
    before = current.cancelling() if current is not None else 0
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        if current is not None and current.cancelling() > before:
            raise
