"""The load generator's self-check: is the client the bottleneck, are its timestamps late?"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from pathlib import Path

import pytest

from batchbench import results
from batchbench.client_load import BUSY_LIMIT, LAG_LIMIT_S, ClientLoad, LoopMonitor
from reports.model import client_notes


def spin(seconds: float) -> None:
    """Hold the loop's thread on the CPU, as a flood of chunks to parse would."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def test_a_loop_held_on_the_cpu_is_saturated_and_stamps_late() -> None:
    async with LoopMonitor() as monitor:
        await asyncio.sleep(0.03)
        spin(0.3)
        await asyncio.sleep(0.01)
    load = monitor.result()
    assert load.loop_lag_max_s is not None and load.loop_lag_max_s >= 0.25
    assert load.busy_fraction >= 0.6 and load.cpu_s >= 0.25
    assert load.late_stamps  # one late beat among a few dozen is the p99


async def test_an_idle_loop_is_neither() -> None:
    async with LoopMonitor() as monitor:
        await asyncio.sleep(0.3)
    load = monitor.result()
    assert load.heartbeats >= 10  # the heartbeat really ran
    assert load.busy_fraction < 0.5 and not load.saturated
    assert 0.25 <= load.wall_s < 1.0


async def test_an_engine_computing_in_another_thread_is_not_client_load() -> None:
    """hf-static runs generate() in a worker thread of this process: its CPU is not the client's."""
    data = b"x" * (1 << 20)

    def compute() -> None:
        end = time.perf_counter() + 0.3
        while time.perf_counter() < end:
            hashlib.sha256(data).digest()  # releases the GIL, like torch kernels

    async with LoopMonitor() as monitor:
        worker = threading.Thread(target=compute)
        worker.start()
        await asyncio.to_thread(worker.join)
    assert monitor.result().busy_fraction < 0.5


def test_warnings_name_the_cause() -> None:
    quiet = ClientLoad(0.1, 10.0, 0.01, 900, 0.0002, 0.001, 0.004)
    assert quiet.warnings() == [] and client_notes(quiet.to_dict()) == []
    stalled = ClientLoad(0.1, 10.0, 0.01, 900, 0.0002, 0.4, 1.2)
    (only,) = stalled.warnings()
    assert "400.0 ms late" in only and "other processes took its core" in only and not stalled.saturated
    busy = ClientLoad(9.5, 10.0, 0.95, 300, 0.003, 0.02, 0.05)
    assert busy.saturated and busy.late_stamps and len(busy.warnings()) == 2
    assert "limited the load" in busy.warnings()[0] and "other processes" not in busy.warnings()[1]
    assert ClientLoad(8.0, 10.0, BUSY_LIMIT, 1, None, LAG_LIMIT_S, LAG_LIMIT_S).saturated


def test_the_document_round_trips_and_a_malformed_one_is_named() -> None:
    load = ClientLoad(9.5, 10.0, 0.95, 300, 0.003, 0.02, 0.05)
    doc = load.to_dict()
    assert doc["saturated"] and doc["late_stamps"] and ClientLoad.from_dict(doc) == load
    with pytest.raises(ValueError, match="not a client-load document"):
        ClientLoad.from_dict({"cpu_s": 1.0})
    assert client_notes(doc) == load.warnings()
    assert client_notes({"cpu_s": "x"})[0].startswith("client load unreadable")


async def test_every_results_document_says_how_busy_the_client_was(tmp_path: Path) -> None:
    from adapters.served import ModelRef
    from adapters.vllm import VLLMEngine
    from batchbench.runner import run
    from fixtures.workloads import Arrival, Lengths, WorkloadSpec
    from tests.fake_vllm import FakeVLLM

    server = await FakeVLLM(token_delay_s=0.002).start()
    try:
        wl = WorkloadSpec("client", 8, prompt=Lengths.fixed(4), output=Lengths.fixed(16),
                          arrival=Arrival("closed", concurrency=4)).build()
        async with VLLMEngine(model=ModelRef("fake-model"), url=server.url) as engine:
            result = await run(engine, wl, results_dir=tmp_path)
    finally:
        await server.stop()
    doc = results.load(result.path)
    assert doc["client"] == result.client.to_dict()
    assert result.client.heartbeats > 0 and 0 < result.client.wall_s <= result.duration_s + 0.05
