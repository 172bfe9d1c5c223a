"""RoutedEngine: routing by priority, merged metrics and description, against fake engines."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from batchbench.adapters.base import Chunk, Engine, EngineRejected, Usage
from batchbench.adapters.router import RoutedEngine, UnroutableRequest
from batchbench.core import codec
from batchbench.core.clock import now
from batchbench.core.config import BatchingConfig, Capabilities, LoadConfig
from batchbench.core.server_metrics import ServerMetrics
from batchbench.load.loadgen import LoadGenerator
from batchbench.load.runner import run
from batchbench.results import document as results
from batchbench.workload.requests import Arrival, Lengths, Request, WorkloadSpec, interleave


class FakeEngine(Engine):
    """An in-process engine that streams ``max_tokens`` one-token chunks and remembers what it served."""

    name: ClassVar[str] = "fake"
    capabilities: ClassVar[Capabilities] = Capabilities(chunked_prefill=True, reports_kv_capacity=True)

    def __init__(self, label: str, metrics: ServerMetrics | None = None, *, batching: BatchingConfig | None = None,
                 reject: bool = False) -> None:
        super().__init__(batching)
        self.label = label
        self.metrics = metrics
        self.reject = reject
        self.served: list[str] = []
        self.started = self.stopped = False
        self.health_checks = 0
        self.runs_begun = 0

    async def start(self) -> None:
        self.started = True

    async def wait_healthy(self, timeout: float) -> None:
        self.health_checks += 1

    async def stop(self) -> None:
        self.stopped = True

    async def stream(self, request: Request) -> AsyncIterator[Chunk]:
        if self.reject:
            raise EngineRejected(self.name, "overloaded", status=503, request_id=request.request_id)
        self.served.append(request.request_id)
        for i in range(request.max_tokens):
            await asyncio.sleep(0)
            last = i == request.max_tokens - 1
            yield Chunk(now(), 1, usage=Usage(request.prompt_len, request.max_tokens) if last else None,
                        finish_reason="length" if last else None)

    async def scrape(self) -> ServerMetrics | None:
        return self.metrics

    def describe(self) -> dict[str, Any]:
        return {"engine": self.name, "label": self.label, "batching": codec.encode(self.batching)}

    async def begin_run(self) -> None:
        self.runs_begun += 1
        self.served = []

    async def report(self) -> dict[str, Any]:
        return {"served": len(self.served)}


def request(rid: str, priority: str | None, max_tokens: int = 3) -> Request:
    return Request(rid, (5, 6, 7), max_tokens, priority=priority)


async def collect(engine: Engine, req: Request) -> list[Chunk]:
    return [chunk async for chunk in engine.stream(req)]


@pytest.fixture
def pools() -> tuple[FakeEngine, FakeEngine]:
    return FakeEngine("latency"), FakeEngine("throughput")


async def test_each_priority_goes_to_its_pool_and_the_rest_to_the_default(pools: tuple[FakeEngine, FakeEngine]) -> None:
    latency, throughput = pools
    router = RoutedEngine({"interactive": latency, "batch": throughput}, default="batch")
    for req in (request("i1", "interactive"), request("b1", "batch"), request("u1", None),
                request("x1", "bulk"), request("i2", "interactive")):
        chunks = await collect(router, req)
        assert sum(c.n_tokens for c in chunks) == 3 and chunks[-1].finish_reason == "length"
    assert latency.served == ["i1", "i2"]
    assert throughput.served == ["b1", "u1", "x1"]
    assert (await router.report())["routed"] == {"interactive": 2, "batch": 3}


async def test_without_a_default_an_unknown_priority_fails_that_request_only(
    pools: tuple[FakeEngine, FakeEngine],
) -> None:
    latency, throughput = pools
    router = RoutedEngine({"interactive": latency, "batch": throughput})
    with pytest.raises(UnroutableRequest, match="'bulk' names no route") as info:
        await collect(router, request("x1", "bulk"))
    assert info.value.kind == "unroutable" and info.value.request_id == "x1"
    with pytest.raises(UnroutableRequest):
        await collect(router, request("u1", None))
    await collect(router, request("i1", "interactive"))
    assert latency.served == ["i1"] and throughput.served == []
    assert (await router.report())["unroutable"] == 2


async def test_load_generator_records_the_routing_failure_and_the_pools_own_errors() -> None:
    """Failures keep their kind through the router, so the records say why."""
    rejecting = FakeEngine("throughput", reject=True)
    router = RoutedEngine({"interactive": FakeEngine("latency"), "batch": rejecting})
    wl = WorkloadSpec("w", 1, prompt=Lengths.fixed(4), output=Lengths.fixed(2), priority="batch").build()
    odd = WorkloadSpec("o", 1, prompt=Lengths.fixed(4), output=Lengths.fixed(2), priority="bulk").build()
    records = await LoadGenerator(router, interleave("mixed", wl, odd)).run()
    kinds = {r.request_id: r.error_kind for r in records}
    assert kinds == {"w-00000": "rejected", "o-00000": "unroutable"}


def test_routes_are_validated(pools: tuple[FakeEngine, FakeEngine]) -> None:
    latency, _ = pools
    with pytest.raises(ValueError, match="at least one route"):
        RoutedEngine({})
    with pytest.raises(ValueError, match="default route 'batch' is not one of the routes: interactive"):
        RoutedEngine({"interactive": latency}, default="batch")


async def test_scrape_sums_queues_and_counters_and_takes_the_fullest_kv_cache() -> None:
    a = FakeEngine("a", ServerMetrics(t=1.0, running=2, waiting=1, kv_usage=0.25, kv_capacity_tokens=1000,
                                      preemptions=3, rejections=None))
    b = FakeEngine("b", ServerMetrics(t=2.0, running=5, waiting=0, kv_usage=0.75, kv_capacity_tokens=3000,
                                      preemptions=1, rejections=None))
    c = FakeEngine("c", None)  # an engine without server metrics adds nothing
    router = RoutedEngine({"interactive": a, "batch": b, "other": c})
    before = now()
    sample = await router.scrape()
    assert sample is not None
    assert (sample.running, sample.waiting, sample.kv_usage) == (7, 1, 0.75)
    assert (sample.kv_capacity_tokens, sample.preemptions, sample.rejections) == (4000, 4, None)
    assert sample.t >= before  # stamped by the router, on the harness clock


async def test_scrape_counts_a_shared_pool_once_and_is_none_without_metrics() -> None:
    shared = FakeEngine("shared", ServerMetrics(t=0.0, running=4, waiting=2, kv_usage=0.5, rejections=1))
    router = RoutedEngine({"interactive": shared, "batch": shared})
    sample = await router.scrape()
    assert sample is not None and (sample.running, sample.waiting, sample.rejections) == (4, 2, 1)
    assert await RoutedEngine({"batch": FakeEngine("quiet")}).scrape() is None


def test_describe_lists_each_pool_once_with_its_routes() -> None:
    latency = FakeEngine("latency", batching=BatchingConfig(max_batch_size=4))
    throughput = FakeEngine("throughput", batching=BatchingConfig(max_batch_size=64))
    router = RoutedEngine({"interactive": latency, "batch": throughput, "bulk": throughput}, default="batch")
    doc = router.describe()
    assert doc["engine"] == "routed" and doc["default_route"] == "batch"
    assert [(p["name"], p["routes"], p["engine"]["label"]) for p in doc["pools"]] == [
        ("interactive", ["interactive"], "latency"),
        ("batch+bulk", ["batch", "bulk"], "throughput"),
    ]
    assert doc["pools"][0]["engine"]["batching"]["max_batch_size"] == 4
    json.dumps(doc)  # goes into the results document as is


def test_capabilities_are_what_every_pool_can_do() -> None:
    class Static(FakeEngine):
        capabilities: ClassVar[Capabilities] = Capabilities(
            batching_modes=frozenset({"static"}), server_metrics=False, pads_batches=True, chunked_prefill=False,
        )

    router = RoutedEngine({"interactive": FakeEngine("a"), "batch": Static("b", batching=BatchingConfig("static"))})
    caps = router.capabilities
    assert caps.batching_modes == {"static", "continuous"} and caps.server_metrics and caps.pads_batches
    assert not caps.chunked_prefill and not caps.reports_kv_capacity
    assert RoutedEngine({"batch": FakeEngine("c")}).capabilities.chunked_prefill
    assert RoutedEngine.capabilities.chunked_prefill is False  # the class-level view is untouched


async def test_the_router_neither_starts_nor_stops_its_pools(pools: tuple[FakeEngine, FakeEngine]) -> None:
    latency, throughput = pools
    router = RoutedEngine({"interactive": latency, "batch": latency, "bulk": throughput})
    async with router:
        pass
    assert latency.health_checks == 1 and throughput.health_checks == 1  # each pool checked once
    assert not (latency.started or latency.stopped or throughput.started or throughput.stopped)


async def test_a_run_through_the_router_is_recorded_like_one_engine(
    pools: tuple[FakeEngine, FakeEngine], tmp_path: Path,
) -> None:
    latency, throughput = pools
    latency.metrics = ServerMetrics(t=0.0, running=1, waiting=0)
    throughput.metrics = ServerMetrics(t=0.0, running=3, waiting=2)
    router = RoutedEngine({"interactive": latency, "batch": throughput}, default="batch")
    interactive = WorkloadSpec("chat", 6, prompt=Lengths.fixed(8), output=Lengths.fixed(4),
                               arrival=Arrival("poisson", rate=200.0), seed=1, priority="interactive").build()
    batch = WorkloadSpec("bulk", 4, prompt=Lengths.fixed(16), output=Lengths.fixed(6),
                         arrival=Arrival("poisson", rate=200.0), seed=2, priority="batch").build()
    router.routed = {"stale": 9}
    result = await run(router, interleave("mixed", interactive, batch), results_dir=tmp_path,
                       load=LoadConfig(scrape_interval_s=0.01))
    assert result.summary.ok == 10
    assert sorted(latency.served) == [r.request_id for r in interactive.requests]
    assert sorted(throughput.served) == [r.request_id for r in batch.requests]
    assert latency.runs_begun == throughput.runs_begun == 1
    assert result.engine_report == {"routed": {"interactive": 6, "batch": 4}, "unroutable": 0,
                                    "pools": {"interactive": {"served": 6}, "batch": {"served": 4}}}
    assert result.samples and all(s.running == 4 and s.waiting == 2 for s in result.samples)
    doc = results.load(result.path)
    assert [p["name"] for p in doc.header.engine.details["pools"]] == ["interactive", "batch"]
