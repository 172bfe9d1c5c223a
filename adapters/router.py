"""Several started engines behind one :class:`~adapters.base.Engine`, routed by request priority.

In a real deployment a gateway sends interactive traffic to a latency pool
(small batches, short queues) and batch traffic to a throughput pool (large
batches), on a priority header; here :attr:`batchbench.workload.requests.Request.priority`
plays that header. The load generator, the runner and the results see one
engine: records, the scraped series and the engine description cover every
pool, so a split layout is measured exactly like a single engine.

The router does not own its pools: whoever started them (the harness) stops
them. Entering or leaving ``async with router`` only checks that every pool
is healthy.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any, ClassVar

from batchbench.adapters.base import Chunk, ChunkSink, Engine, EngineError
from batchbench.core import codec
from batchbench.core.clock import now
from batchbench.core.config import BatchingConfig, BatchingMode, Capabilities
from batchbench.core.placement import EngineCpus
from batchbench.core.server_metrics import ServerMetrics
from batchbench.workload.requests import Request


class UnroutableRequest(EngineError):
    """A request whose priority names no route, on a router without a default."""

    kind = "unroutable"


def _merge_capabilities(engines: Iterable[Engine]) -> Capabilities:
    """What the routed layout can do: what every pool can do (a mode, metrics: what some pool can)."""
    caps = [e.capabilities for e in engines]
    return Capabilities(
        batching_modes=frozenset().union(*(c.batching_modes for c in caps)),
        server_metrics=any(c.server_metrics for c in caps),
        pads_batches=any(c.pads_batches for c in caps),
        reports_kv_capacity=all(c.reports_kv_capacity for c in caps),
        chunked_prefill=all(c.chunked_prefill for c in caps),
        prefill_chunk_cap=all(c.prefill_chunk_cap for c in caps),
        exact_output_length=all(c.exact_output_length for c in caps),
        prefix_caching=all(c.prefix_caching for c in caps),
        speculation_methods=frozenset.intersection(*(c.speculation_methods for c in caps)) if caps else frozenset(),
    )


def _sum(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _max(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


class RoutedEngine(Engine):
    """Routes each request to the pool its priority names: ``routes[request.priority]``.

    ``RoutedEngine({"interactive": latency_pool, "batch": throughput_pool}, default="batch")``
    sends interactive requests to the latency pool and everything else
    (batch, untagged, unknown priorities) to the throughput pool. Without a
    ``default`` an unknown priority fails that request with
    :class:`UnroutableRequest` (recorded as ``unroutable``), never silently
    lands on some pool. Several routes may name the same engine: it is one
    pool, listed once.
    """

    name: ClassVar[str] = "routed"
    #: The class-level view; each router also has the merged capabilities of its pools (see __init__).
    capabilities: ClassVar[Capabilities] = Capabilities(batching_modes=frozenset({"static", "continuous"}))

    def __init__(self, routes: Mapping[str, Engine], *, default: str | None = None) -> None:
        if not routes:
            raise ValueError("a routed engine needs at least one route")
        if default is not None and default not in routes:
            raise ValueError(f"default route {default!r} is not one of the routes: {', '.join(routes)}")
        self.routes: dict[str, Engine] = dict(routes)
        self.default = default
        #: Distinct engines, each with the routes that reach it, in route order.
        self.pools: list[tuple[tuple[str, ...], Engine]] = []
        for key, engine in self.routes.items():
            for i, (keys, pooled) in enumerate(self.pools):
                if pooled is engine:
                    self.pools[i] = ((*keys, key), pooled)
                    break
            else:
                self.pools.append(((key,), engine))
        merged = _merge_capabilities(engine for _, engine in self.pools)
        # An instance attribute shadows the class-level view: the layout can do what its pools can.
        self.capabilities = merged  # type: ignore[misc]
        mode: BatchingMode = "continuous" if "continuous" in merged.batching_modes else "static"
        super().__init__(BatchingConfig(mode=mode))
        self.routed: dict[str, int] = {}
        self.unroutable = 0

    # ------------------------------------------------------------------ routing

    def route_of(self, request: Request) -> str:
        """The route a request takes: its priority if that is a route, else the default."""
        if request.priority is not None and request.priority in self.routes:
            return request.priority
        if self.default is not None:
            return self.default
        raise UnroutableRequest(
            self.name,
            f"priority {request.priority!r} names no route (routes: {', '.join(self.routes)}) and there is no default",
            request_id=request.request_id,
        )

    def pool_for(self, request: Request) -> Engine:
        return self.routes[self.route_of(request)]

    def _take_route(self, request: Request) -> Engine:
        """The pool this request goes to, counted."""
        try:
            key = self.route_of(request)
        except UnroutableRequest:
            self.unroutable += 1
            raise
        self.routed[key] = self.routed.get(key, 0) + 1
        return self.routes[key]

    async def stream(self, request: Request) -> AsyncIterator[Chunk]:
        async for chunk in self._take_route(request).stream(request):
            yield chunk

    async def stream_into(self, request: Request, sink: ChunkSink) -> None:
        """The pool's own path (its cost per chunk, not a chunk object's)."""
        await self._take_route(request).stream_into(request, sink)

    # ------------------------------------------------------------------ lifecycle (the pools are not ours)

    async def start(self) -> None:
        """Nothing to launch: the pools are started engines."""

    async def wait_healthy(self, timeout: float) -> None:
        await asyncio.gather(*(engine.wait_healthy(timeout) for _, engine in self.pools))

    async def stop(self) -> None:
        """Leaves the pools running: whoever started them stops them."""

    # ------------------------------------------------------------------ observation

    async def scrape(self) -> ServerMetrics | None:
        """One sample for the whole layout: queue depths, counters and capacities summed, KV usage the fullest pool's.

        A pool whose scrape fails fails the whole sample (the scraper counts
        it): a sum over the pools that answered would under-report queues.
        """
        samples = [s for s in await asyncio.gather(*(e.scrape() for _, e in self.pools)) if s is not None]
        if not samples:
            return None
        return ServerMetrics(
            t=now(),
            running=_sum(s.running for s in samples),
            waiting=_sum(s.waiting for s in samples),
            kv_usage=_max(s.kv_usage for s in samples),
            kv_capacity_tokens=_sum(s.kv_capacity_tokens for s in samples),
            preemptions=_sum(s.preemptions for s in samples),
            rejections=_sum(s.rejections for s in samples),
            completed=_sum(s.completed for s in samples),
            prefix_cache_queries=_sum(s.prefix_cache_queries for s in samples),
            prefix_cache_hits=_sum(s.prefix_cache_hits for s in samples),
            spec_drafts=_sum(s.spec_drafts for s in samples),
            spec_draft_tokens=_sum(s.spec_draft_tokens for s in samples),
            spec_accepted_tokens=_sum(s.spec_accepted_tokens for s in samples),
        )

    async def reset_cache(self) -> bool:
        """Every pool's cache emptied; True only if each pool cleared its own."""
        cleared = await asyncio.gather(*(engine.reset_cache() for _, engine in self.pools))
        return all(cleared)

    def server_process_groups(self) -> frozenset[int] | None:
        """Every pool's own processes; None when some pool's are not known."""
        groups: set[int] = set()
        for _, engine in self.pools:
            found = engine.server_process_groups()
            if found is None:
                return None
            groups |= found
        return frozenset(groups)

    def cpu_placement(self) -> EngineCpus:
        """The pools' CPUs together, where every pool runs alike (e.g. local processes); else not known."""
        placed = [engine.cpu_placement() for _, engine in self.pools]
        wheres = {p.where for p in placed}
        if len(wheres) != 1 or any(p.cpus is None for p in placed):
            return EngineCpus(wheres.pop() if len(wheres) == 1 else "not known")
        refused = next((p.refused for p in placed if p.refused is not None), None)
        return EngineCpus(placed[0].where, frozenset().union(*(p.cpus or () for p in placed)), refused)

    @staticmethod
    def pool_name(keys: tuple[str, ...]) -> str:
        return "+".join(keys)

    def describe(self) -> dict[str, Any]:
        return {
            "engine": self.name,
            "batching": codec.encode(self.batching),
            "default_route": self.default,
            "pools": [
                {"name": self.pool_name(keys), "routes": list(keys), "engine": engine.describe()}
                for keys, engine in self.pools
            ],
        }

    async def begin_run(self) -> None:
        self.routed = {}
        self.unroutable = 0
        for _, engine in self.pools:
            await engine.begin_run()

    async def report(self) -> dict[str, Any]:
        return {
            "routed": dict(self.routed),
            "unroutable": self.unroutable,
            "pools": {self.pool_name(keys): await engine.report() for keys, engine in self.pools},
        }
