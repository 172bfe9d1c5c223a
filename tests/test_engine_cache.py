"""The engine cache: shared started engines, bounded, warmed up, always stopped."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Hashable
from typing import ClassVar

import pytest

from batchbench.adapters.base import Chunk, Engine, EngineCannotRunHere, EngineError, EngineNotHealthy, Usage
from batchbench.core.clock import now
from batchbench.core.config import BatchingConfig, Capabilities
from batchbench.load import engines
from batchbench.load.engines import WARM_UP, EngineCache, EngineFactory, WarmUpHung, warm_up, warm_up_ceiling
from batchbench.workload.requests import Request


class Fake(Engine):
    name: ClassVar[str] = "fake"
    capabilities: ClassVar[Capabilities] = Capabilities()

    def __init__(self, batching: BatchingConfig | None = None, *, fail: Exception | None = None) -> None:
        super().__init__(batching)
        self.fail = fail
        self.events: list[str] = []
        self.served = 0

    async def start(self) -> None:
        self.events.append("start")

    async def wait_healthy(self, timeout: float) -> None:
        if self.fail:
            raise self.fail

    async def stop(self) -> None:
        self.events.append("stop")

    async def stream(self, request: Request) -> AsyncIterator[Chunk]:
        self.served += 1
        yield Chunk(now(), request.max_tokens)
        yield Chunk(now(), 0, Usage(request.prompt_len, request.max_tokens))


def recorded(kind: type[Fake]) -> tuple[list[Fake], EngineFactory]:
    """A factory of ``kind`` engines, and the list of every engine it made."""
    made: list[Fake] = []

    def factory(name: str, batching: BatchingConfig | None) -> Engine:
        made.append(kind(batching))
        return made[-1]

    return made, factory


async def test_engines_are_shared_warmed_and_evicted_oldest_first() -> None:
    made, factory = recorded(Fake)
    cache = EngineCache(factory, max_live=2)
    a = await cache.get("fake", BatchingConfig(max_batch_size=1))
    assert await cache.get("fake", BatchingConfig(max_batch_size=1)) is a
    assert a.served == len(WARM_UP.requests)  # warmed up once, before anything is measured
    b = await cache.get("fake", BatchingConfig(max_batch_size=2))
    await cache.get("fake", BatchingConfig(max_batch_size=1))  # a is now the most recent
    await cache.get("fake", BatchingConfig(max_batch_size=3))  # evicts b
    assert b.events == ["start", "stop"] and a.events == ["start"]
    await cache.close()
    assert all(e.events[-1] == "stop" for e in made) and len(made) == 3


class LabelOnly(Fake):
    """A server told only the batch size: configs that differ elsewhere start the same one."""

    capabilities: ClassVar[Capabilities] = Capabilities(prefix_caching=True)

    def launch_key(self) -> Hashable:
        return (self.name, self.batching.max_batch_size)


async def test_configs_that_start_the_same_server_share_one_start_and_keep_their_own_config() -> None:
    made, factory = recorded(LabelOnly)
    cache = EngineCache(factory, max_live=2)
    default = await cache.get("fake")
    spelled = BatchingConfig(prefix_caching=False)
    shared = await cache.get("fake", spelled)
    assert [e.events for e in made] == [["start"], []]  # one server started, the second config's never was
    assert shared is not default and shared.batching == spelled and default.batching == BatchingConfig()
    assert shared.describe()["batching"]["prefix_caching"] is False  # its results say what it asked for
    assert await cache.get("fake", spelled) is shared and cache.is_live("fake", spelled)
    await cache.get("fake", BatchingConfig(max_batch_size=4))
    await cache.get("fake", BatchingConfig(max_batch_size=8))  # evicts the shared server (least recently used)
    assert made[0].events == ["start", "stop"] and not cache.is_live("fake") and not cache.is_live("fake", spelled)
    again = await cache.get("fake", spelled)  # started anew, as its own
    assert again.batching == spelled and again.events == ["start"]
    starts = sum(e.events.count("start") for e in made)
    back = await cache.get("fake")  # the default, whose server was stopped and is now the other config's again
    assert back.batching == BatchingConfig() and sum(e.events.count("start") for e in made) == starts
    await cache.release("fake")  # the same server, asked for by the other config
    assert again.events == ["start", "stop"]
    await cache.close()
    assert all(e.events in ([], ["start", "stop"]) for e in made)


async def test_a_failed_start_is_remembered_and_unrunnable_engines_are_skippable() -> None:
    calls = 0

    def failing(name: str, batching: BatchingConfig | None) -> Engine:
        nonlocal calls
        calls += 1
        return Fake(batching, fail=EngineNotHealthy("fake", "never healthy"))

    cache = EngineCache(failing)
    for _ in range(2):
        with pytest.raises(EngineNotHealthy, match="never healthy"):
            await cache.get("fake")
    assert calls == 1

    cache = EngineCache(lambda n, b: Fake(b, fail=EngineCannotRunHere("fake", "no docker engine")))
    with pytest.raises(EngineCannotRunHere, match="no docker engine"):
        await cache.get("fake")

    def missing(name: str, batching: BatchingConfig | None) -> Engine:
        raise ImportError("No module named 'vllm'")

    with pytest.raises(EngineCannotRunHere, match="cannot run here: No module named 'vllm'"):
        await EngineCache(missing).get("fake")


class Paced(Fake):
    """Streams one token every ``interval`` seconds; stops for good after ``stall_after`` tokens (None: never)."""

    def __init__(self, interval: float, stall_after: int | None = None) -> None:
        super().__init__()
        self.interval, self.stall_after = interval, stall_after
        self.cancelled = 0

    async def stream(self, request: Request) -> AsyncIterator[Chunk]:
        try:
            for i in range(request.max_tokens):
                if i == self.stall_after:
                    await asyncio.Event().wait()
                await asyncio.sleep(self.interval)
                yield Chunk(now(), 1)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        yield Chunk(now(), 0, Usage(request.prompt_len, request.max_tokens))


async def test_a_warm_up_stream_that_stops_ends_the_warm_up_at_the_silence_bound_and_cancels_the_rest() -> None:
    engine = Paced(0.001, stall_after=3)
    t0 = time.monotonic()
    with pytest.raises(WarmUpHung, match=r"sent nothing for 0\.3s \(after 3 of 16 tokens the stream stopped\)"):
        await warm_up(engine, 0.3)
    assert time.monotonic() - t0 < 0.3 + 0.5  # one bound, not one per round of requests
    assert engine.cancelled == WARM_UP.arrival.concurrency  # every request in flight was cancelled, none left


async def test_a_slow_engine_that_keeps_streaming_is_not_hung() -> None:
    # Each request takes 16 x 0.05 = 0.8 s in all, four times the silence bound: slow, never silent for 0.2 s.
    engine = Paced(0.05)
    await warm_up(engine, 0.2)
    assert engine.cancelled == 0


class Runaway(Fake):
    """Streams a token at a time past max_tokens and never ends."""

    async def stream(self, request: Request) -> AsyncIterator[Chunk]:
        while True:
            await asyncio.sleep(0.001)
            yield Chunk(now(), 1)


async def test_a_warm_up_stream_past_max_tokens_is_cut_as_in_a_measured_run() -> None:
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=r"every warm-up request failed; the first: .*more than max_tokens=16 "
                                          r"tokens \(17 so far\); cut"):
        await warm_up(Runaway(), silence_s=10)
    assert time.monotonic() - t0 < 2


async def test_a_warm_up_stream_that_is_never_silent_yet_too_slow_ends_at_its_ceiling(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engines, "WARM_UP_SECONDS_PER_TOKEN", 0.01)
    silence_s = 0.2
    ceiling = warm_up_ceiling(WARM_UP.requests[0], silence_s)
    assert ceiling == pytest.approx(0.2 + 16 * 0.01)
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=r"not complete after 0\.36s \(\d+ of 16 tokens; at most 0\.2s \+ 0\.01s "
                                          r"per token\)"):
        await warm_up(Paced(0.05), silence_s=silence_s)  # a token every 0.05 s: 0.8 s a request, never silent
    rounds = len(WARM_UP.requests) // WARM_UP.arrival.concurrency
    assert time.monotonic() - t0 < rounds * ceiling + 1


async def test_a_warm_up_says_which_request_it_waits_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engines, "WARM_UP_REPORT_EVERY_S", 0.02)
    said: list[str] = []
    await warm_up(Paced(0.01), silence_s=5, report=said.append)
    assert said and said[0].startswith("0 of 16 done, waiting for warm-up-")
    assert re.search(r"waiting for warm-up-\d+ \(\d+ of 16 tokens, \d+\.\ds\)", said[-1])
