"""The load generator's limits hold whatever the engine streams."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import ClassVar

from batchbench.adapters.base import Chunk, Engine
from batchbench.core.clock import now
from batchbench.core.config import Capabilities, LoadConfig
from batchbench.load.loadgen import LoadGenerator
from batchbench.workload.requests import Arrival, Lengths, Request, WorkloadSpec


class EndlessEngine(Engine):
    """Streams ``tokens_per_chunk`` tokens a chunk and never stops (a runaway engine)."""

    name: ClassVar[str] = "endless"
    capabilities: ClassVar[Capabilities] = Capabilities()
    tokens_per_chunk = 3

    async def start(self) -> None: ...

    async def wait_healthy(self, timeout: float) -> None: ...

    async def stop(self) -> None: ...

    async def stream(self, request: Request) -> AsyncIterator[Chunk]:
        while True:
            yield Chunk(t=now(), n_tokens=self.tokens_per_chunk)


async def test_an_endless_stream_is_cut_at_max_tokens_as_a_protocol_error() -> None:
    workload = WorkloadSpec("endless", 3, prompt=Lengths.fixed(8), output=Lengths.fixed(10),
                            arrival=Arrival("closed", concurrency=3), seed=0).build()
    records = await LoadGenerator(EndlessEngine(), workload, config=LoadConfig(request_timeout_s=5)).run()
    assert len(records) == 3
    for record in records:
        assert not record.ok and record.error_kind == "protocol_error"
        assert "more than max_tokens=10" in (record.error or "")
        assert sum(record.chunk_tokens) <= 10  # nothing past the limit is kept as output
