"""The metrics scraper's schedule: fixed ticks, missed ticks skipped, failures counted."""

from __future__ import annotations

import asyncio
from itertools import pairwise
from typing import cast

from batchbench.adapters.base import Engine, EngineUnreachable
from batchbench.core.clock import now
from batchbench.core.server_metrics import ServerMetrics, prefix_cache_hit_rate
from batchbench.load.scraper import Scraper

INTERVAL_S = 0.02


class SlowMetrics:
    """An engine whose metrics endpoint answers at once except for the stalls it is given."""

    name = "slow"

    def __init__(self, stalls: dict[int, float]) -> None:
        self.stalls = stalls  # scrape number -> seconds it hangs
        self.started: list[float] = []

    async def scrape(self) -> ServerMetrics | None:
        self.started.append(now())
        stall = self.stalls.get(len(self.started) - 1, 0.0)
        if stall == float("inf"):
            raise EngineUnreachable(self.name, "connection refused")
        await asyncio.sleep(stall)
        return ServerMetrics(t=now(), running=1)


async def scrape_for(engine: SlowMetrics, seconds: float, timeout_s: float = 10.0) -> Scraper:
    scraper = Scraper(cast(Engine, engine), interval_s=INTERVAL_S, timeout_s=timeout_s, t0=now())
    async with scraper:
        await asyncio.sleep(seconds)
    return scraper


async def test_a_slow_scrape_skips_the_ticks_it_missed_instead_of_bursting() -> None:
    engine = SlowMetrics({2: 10 * INTERVAL_S})
    await scrape_for(engine, 20 * INTERVAL_S)
    after_stall = engine.started[2:]
    assert len(after_stall) >= 3
    # Catching up would start ~10 scrapes back to back once the stall ends.
    gaps = [b - a for a, b in pairwise(after_stall[1:])]
    assert min(gaps) > INTERVAL_S / 2
    # and the series stays on its grid: no more scrapes than ticks
    assert len(engine.started) <= 20 + 1


async def test_samples_are_timed_from_the_run_start() -> None:
    engine = SlowMetrics({})
    scraper = await scrape_for(engine, 5 * INTERVAL_S)
    ts = [s.t for s in scraper.samples]
    assert ts == sorted(ts) and 0 <= ts[0] < 5 * INTERVAL_S


async def test_a_hung_or_failing_scrape_is_counted_and_the_series_goes_on() -> None:
    engine = SlowMetrics({1: 1.0, 3: float("inf")})
    scraper = await scrape_for(engine, 10 * INTERVAL_S, timeout_s=2 * INTERVAL_S)
    assert scraper.failures == 2
    assert "connection refused" in (scraper.last_error or "")
    assert len(scraper.samples) == len(engine.started) - 2 >= 3


async def test_the_observer_counts_its_scrapes_and_the_time_they_took() -> None:
    engine = SlowMetrics({1: 3 * INTERVAL_S})  # one slow answer among quick ones
    scraper = await scrape_for(engine, 10 * INTERVAL_S)
    assert scraper.scrapes == len(engine.started)  # the final scrape at the run's end included
    assert 3 * INTERVAL_S <= scraper.scrape_time_s < 3 * INTERVAL_S + scraper.scrapes * INTERVAL_S


def test_the_prefix_cache_hit_rate_is_over_the_counters_deltas_and_none_without_two_readings() -> None:
    def at(t: float, queries: float | None, hits: float | None) -> ServerMetrics:
        return ServerMetrics(t=t, prefix_cache_queries=queries, prefix_cache_hits=hits)

    assert prefix_cache_hit_rate([at(0, 100, 40), at(1, None, None), at(2, 300, 190)]) == 0.75
    assert prefix_cache_hit_rate([at(0, 100, 40), at(1, None, None)]) is None
    assert prefix_cache_hit_rate([at(0, 100, 40), at(1, 100, 40)]) is None


class SlowToStop(SlowMetrics):
    """A first scrape that hangs and takes a while to wind down when cancelled (closing its connection); the
    scrapes after it answer at once."""

    async def scrape(self) -> ServerMetrics | None:
        self.started.append(now())
        if len(self.started) > 1:
            return None
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            await asyncio.sleep(0.1)
            raise
        return None


async def test_a_cancel_that_lands_while_the_scraper_stops_is_not_lost() -> None:
    """Ctrl-C or SIGTERM cancels the run while its scraper winds down: the run must still end cancelled (the bare
    ``cancel(); suppress(CancelledError): await`` swallowed it, and the command went on measuring)."""
    engine = SlowToStop({})
    scraper = Scraper(cast(Engine, engine), interval_s=INTERVAL_S, timeout_s=10.0, t0=now())
    went_on = asyncio.Event()

    async def run_ending() -> None:
        async with scraper:
            while not engine.started:
                await asyncio.sleep(0.01)
        went_on.set()  # what comes after the run: never reached once cancelled

    run = asyncio.create_task(run_ending())
    while not engine.started:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # inside __aexit__, waiting for the cancelled scrape
    run.cancel()
    done, _ = await asyncio.wait([run], timeout=5)
    assert done and run.cancelled() and not went_on.is_set()


async def test_a_caller_already_unwinding_still_waits_for_the_scraper() -> None:
    """Cleaning up after a cancellation (the runner folding its journal) stops the scraper and goes on."""
    engine = SlowToStop({})
    scraper = Scraper(cast(Engine, engine), interval_s=INTERVAL_S, timeout_s=10.0, t0=now())
    cleaned = asyncio.Event()

    async def cancelled_then_cleans_up() -> None:
        await scraper.__aenter__()
        try:
            await asyncio.sleep(10)
        finally:
            await scraper.__aexit__(None, None, None)  # the in-flight scrape winds down; not a new cancel
            cleaned.set()

    task = asyncio.create_task(cancelled_then_cleans_up())
    while not engine.started:
        await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.wait([task], timeout=5)
    assert task.cancelled() and cleaned.is_set()
