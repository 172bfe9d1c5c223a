"""Benchmark: what the load generator itself costs per streamed chunk.

The harness must not be the bottleneck it measures. The vLLM protocol server runs
in its own process (so its CPU is not counted), streams tokens as fast as it
can, and the client's own CPU time per chunk is recorded with pytest-benchmark:
``pytest tests/test_loadgen_benchmark.py --benchmark-json=out.json``. At the
recorded cost per chunk, one core ingests ``1 / cost`` tokens/s, which must stay
far above what the engines under test produce.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from batchbench.adapters.base import ModelRef
from batchbench.adapters.vllm import VLLMEngine
from batchbench.harness import LoopThread
from batchbench.loadgen import LoadGenerator
from batchbench.workload import Arrival, Lengths, WorkloadSpec
from tests.server_process import serving

REQUESTS, TOKENS, CONCURRENCY = 256, 64, 64


@pytest.fixture(scope="module")
def fake_server() -> Iterator[str]:
    with serving("batchbench.fixtures.protocol", "vllm", "--model", "fake-model", "--token-delay", "0",
                 "--max-running", "1024") as url:
        yield url


def test_client_cost_per_chunk(fake_server: str, benchmark: Any) -> None:
    workload = WorkloadSpec("bench", REQUESTS, prompt=Lengths.fixed(16), output=Lengths.fixed(TOKENS),
                            arrival=Arrival("closed", concurrency=CONCURRENCY)).build()
    loop = LoopThread()

    async def once() -> tuple[list, float]:
        async with VLLMEngine(model=ModelRef("fake-model"), url=fake_server) as engine:
            cpu = time.process_time()
            records = await LoadGenerator(engine, workload).run()
            return records, time.process_time() - cpu

    try:
        records, cpu_s = benchmark.pedantic(lambda: loop.call(once()), rounds=3, iterations=1, warmup_rounds=1)
    finally:
        loop.close()
    assert len(records) == REQUESTS and all(r.ok and r.output_tokens == TOKENS for r in records)
    chunks = sum(len(r.chunk_times) for r in records)
    benchmark.extra_info.update({
        "chunks": chunks,
        "client_cpu_s": cpu_s,
        "client_cpu_us_per_chunk": 1e6 * cpu_s / chunks,
        "client_chunks_per_cpu_s": chunks / cpu_s,
    })
