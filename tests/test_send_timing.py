"""The open loop's send timing: the timerfd timer (batchbench.load.timer) and the collector held off while a run
sends (batchbench.load.collector). Their cost and the schedule lag they buy are benchmarked in
tests/test_loadgen_benchmark.py (printed with -s); here, what must hold whatever the machine's load."""

from __future__ import annotations

import asyncio
import gc
import os
import sys
from collections.abc import Callable

import pytest

from batchbench.core import eventloop
from batchbench.core.clock import now
from batchbench.load import collector
from batchbench.load.collector import Paused
from batchbench.load.timer import SendTimer

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {"asyncio": asyncio.new_event_loop,
                                                             "cli": eventloop.new_event_loop}


def _on(loop_kind: str, coro_fn: Callable[[], object]) -> object:
    with asyncio.Runner(loop_factory=LOOPS[loop_kind]) as runner:
        return runner.run(coro_fn())  # type: ignore[arg-type]


@pytest.mark.parametrize("loop_kind", sorted(LOOPS))
@pytest.mark.parametrize("precise", [True, False])
def test_the_timer_never_returns_before_its_time(loop_kind: str, precise: bool) -> None:
    async def main() -> list[float]:
        early = []
        with SendTimer() as timer:
            if not precise:
                timer.close()  # the fallback: the loop's timer, then yield until the time
            assert timer.precise == (precise and sys.platform.startswith("linux"))
            start = now()
            for k in range(40):
                deadline = start + 0.001 + k * 0.0007
                await timer.until(deadline)
                early.append(deadline - now())
        return early

    early = _on(loop_kind, main)
    assert isinstance(early, list) and max(early) <= 0


def test_a_time_already_past_returns_at_once_and_the_timer_follows_its_loop() -> None:
    timer = SendTimer()
    try:
        async def main() -> float:
            before = now()
            await timer.until(before - 1.0)
            await timer.until(now() + 0.002)
            return now() - before

        for loop_kind in sorted(LOOPS):  # one timer, re-registered on each loop it is awaited on
            took = _on(loop_kind, main)
            assert isinstance(took, float) and took >= 0.002
    finally:
        timer.close()
    timer.close()  # twice: nothing left to release


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timerfd is Linux's")
def test_the_timer_releases_its_descriptor() -> None:
    timer = SendTimer()
    fd = timer._fd
    assert fd >= 0
    timer.close()
    assert not timer.precise
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(fd)


def test_the_collector_is_held_off_for_the_outermost_block_and_restored_after() -> None:
    assert gc.isenabled()
    with Paused():
        assert not gc.isenabled()
        with Paused():  # another generator in the same process, at once
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()
    try:
        with Paused():
            pass
        assert not gc.isenabled()  # off before: left off
    finally:
        gc.enable()


def test_paused_cycles_are_collected_once_they_pass_the_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cycles made while paused (a failed request's exception and traceback) do not grow without bound."""
    monkeypatch.setattr(collector, "GUARD_OBJECTS", 2_000)

    class Node:
        def __init__(self) -> None:
            self.me = self

    with Paused():
        gc.collect(0)  # start from an empty young generation
        for _ in range(5_000):
            Node()
            Paused.check()
        assert gc.get_count()[0] <= 2_000 + 10
    gc.collect()
