"""The load generator's self-check: was the client itself the bottleneck?"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from pathlib import Path

import pytest

from batchbench import results
from batchbench.client_load import BUSY_LIMIT, ClientLoad, ClientMeter
from batchbench.reports.model import build_run
from batchbench.results import RunDocument, RunFooter, RunHeader


def client_notes(client: dict[str, object]) -> list[str]:
    """What the report says about a document whose footer has this ``client`` section."""
    header = RunHeader(run_id="r", engine={"engine": "e", "batching": {}}, workload={"name": "w", "hash": ""})
    raw = RunDocument(header=header, footer=RunFooter(status="complete")).to_dict() | {"client": client}
    return build_run("r.json", RunDocument.from_dict(raw)).notes


def spin(seconds: float) -> None:
    """Hold the loop's thread on the CPU, as a flood of chunks to parse would."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def test_a_loop_held_on_the_cpu_is_saturated() -> None:
    with ClientMeter() as meter:
        await asyncio.sleep(0.01)
        spin(0.3)
    load = meter.result()
    assert load.cpu_s >= 0.25 and load.busy_fraction >= BUSY_LIMIT and load.saturated


async def test_an_idle_loop_is_not() -> None:
    with ClientMeter() as meter:
        await asyncio.sleep(0.3)
    load = meter.result()
    assert 0.25 <= load.wall_s < 1.0 and load.busy_fraction < 0.5 and not load.saturated


async def test_an_engine_computing_in_another_thread_is_not_client_load() -> None:
    """hf-static runs generate() in a worker thread of this process: its CPU is not the client's."""
    data = b"x" * (1 << 20)

    def compute() -> None:
        end = time.perf_counter() + 0.3
        while time.perf_counter() < end:
            hashlib.sha256(data).digest()  # releases the GIL, like torch kernels

    with ClientMeter() as meter:
        worker = threading.Thread(target=compute)
        worker.start()
        await asyncio.to_thread(worker.join)
    assert meter.result().busy_fraction < 0.5


def test_warnings_and_the_document() -> None:
    quiet = ClientLoad(0.1, 10.0, 0.01)
    assert quiet.warnings() == [] and client_notes(quiet.to_dict()) == []
    busy = ClientLoad(9.5, 10.0, 0.95)
    (only,) = busy.warnings()
    assert "busy 95%" in only and "limited the load" in only
    doc = busy.to_dict()
    assert doc["saturated"] and ClientLoad.from_dict(doc) == busy and client_notes(doc) == busy.warnings()
    assert ClientLoad(8.0, 10.0, BUSY_LIMIT).saturated
    with pytest.raises(ValueError, match="not a client-load document"):
        ClientLoad.from_dict({"cpu_s": 1.0})
    assert client_notes({"cpu_s": "x", "wall_s": 1, "busy_fraction": 0})[0].startswith("client load unreadable")


async def test_every_results_document_says_how_busy_the_client_was(tmp_path: Path) -> None:
    from batchbench.adapters.base import ModelRef
    from batchbench.adapters.vllm import VLLMEngine
    from batchbench.fixtures.protocol.vllm import VLLMServer
    from batchbench.runner import run
    from batchbench.workload import Arrival, Lengths, WorkloadSpec

    server = VLLMServer(model="fake-model", token_delay=0.002, max_running=1024)
    await server.start_async()
    try:
        wl = WorkloadSpec("client", 8, prompt=Lengths.fixed(4), output=Lengths.fixed(16),
                          arrival=Arrival("closed", concurrency=4)).build()
        async with VLLMEngine(model=ModelRef("fake-model"), url=server.url) as engine:
            result = await run(engine, wl, results_dir=tmp_path)
    finally:
        await server.stop_async()
    doc = results.load(result.path)
    assert doc.footer is not None and doc.footer.client == result.client
    assert doc.to_dict()["client"] == result.client.to_dict()
    assert 0 < result.client.wall_s <= result.duration_s + 0.05 and 0 < result.client.cpu_s
