"""What only the SGLang adapter does (its flags, /server_info, /flush_cache); the shared contract is in
tests/test_adapter_contract.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator

import pytest

from batchbench.adapters.base import EngineHTTPError
from batchbench.adapters.sglang import SGLangEngine
from batchbench.core.config import BatchingConfig, ModelRef
from batchbench.fixtures import wire_dir
from batchbench.fixtures.protocol.sglang import SGLangServer
from tests.adapter_helpers import collect, recorded, request

WIRE = wire_dir("sglang")
MODEL = ModelRef("batchbench/tiny-llama", served_name="tiny-llama", max_model_len=512)


@pytest.fixture
def server() -> Iterator[SGLangServer]:
    with SGLangServer(token_delay=0.002, max_running=4, max_queue=2, kv_capacity_tokens=4096,
                      max_total_tokens=512) as srv:
        yield srv


@pytest.fixture
async def engine(server: SGLangServer) -> AsyncIterator[SGLangEngine]:
    async with SGLangEngine(model=MODEL, url=server.url, startup_timeout=5, flush_timeout_s=0.2) as eng:
        yield eng  # type: ignore[misc]


def test_server_args_map_the_batching_config_exactly() -> None:
    eng = SGLangEngine(
        BatchingConfig(max_batch_size=16, max_batched_tokens=1024, kv_capacity_tokens=8192, memory_fraction=0.5),
        model=ModelRef("org/model", served_name="m", max_model_len=512, dummy_weights=True), url="http://s.test",
        schedule_policy="lpm", max_queued_requests=64, dtype="bfloat16",
    )
    assert eng.server_args(eng.batching, host="0.0.0.0", port=30000) == [
        "--model-path", "org/model", "--host", "0.0.0.0", "--port", "30000", "--enable-metrics",
        "--disable-radix-cache", "--served-model-name", "m", "--load-format", "dummy", "--context-length", "512",
        "--dtype", "bfloat16", "--max-running-requests", "16", "--max-prefill-tokens", "1024",
        "--chunked-prefill-size", "1024", "--max-total-tokens", "8192", "--mem-fraction-static", "0.5",
        "--schedule-policy", "lpm", "--max-queued-requests", "64",
    ]
    unchunked = SGLangEngine(BatchingConfig(max_batched_tokens=2048, chunked_prefill=False),
                             model=ModelRef("org/model"), url="http://s.test")
    assert unchunked.server_args(unchunked.batching, host="127.0.0.1", port=1) == [
        "--model-path", "org/model", "--host", "127.0.0.1", "--port", "1", "--enable-metrics",
        "--disable-radix-cache", "--max-prefill-tokens", "2048", "--chunked-prefill-size", "-1",
    ]


def test_configs_sglang_cannot_run_are_refused_up_front() -> None:
    with pytest.raises(ValueError, match="continuous"):
        SGLangEngine(BatchingConfig(mode="static"), model=MODEL, url="http://s.test")
    with pytest.raises(ValueError, match="no per-request cap on prefill tokens"):
        SGLangEngine(BatchingConfig(prefill_chunk_tokens=64), model=MODEL, url="http://s.test")


async def test_server_info_gives_the_version_and_the_kv_pool(engine: SGLangEngine) -> None:
    doc = engine.describe()
    assert doc["engine"] == "sglang" and doc["mode"] == "url"
    assert doc["version"] == "0.5.23" and doc["kv_capacity_tokens"] == 4096
    assert doc["radix_cache"] is None  # someone else started it: whatever they chose


async def test_older_servers_answer_on_get_server_info() -> None:
    info = json.loads((WIRE / "server_info.json").read_text())
    eng = SGLangEngine(model=MODEL, url="http://s.test")
    eng.client = recorded(json.dumps(info).encode())
    loaded = await eng.load_server_info()
    assert loaded is not None and loaded["max_total_num_tokens"] == 8192
    assert (eng.version, eng.kv_capacity_tokens) == ("0.5.23", 8192)
    await eng.client.aclose()


async def test_reset_cache_flushes_an_idle_server(server: SGLangServer, engine: SGLangEngine) -> None:
    await collect(engine, request(max_tokens=3))
    assert await engine.reset_cache() is True
    assert server.flushes == 1


async def test_reset_cache_refused_while_requests_run(server: SGLangServer, engine: SGLangEngine) -> None:
    server.tune(token_delay=0.05)
    busy = asyncio.create_task(collect(engine, request("busy-1", max_tokens=100)))
    try:
        await server.wait_until(lambda s: s["running"] == 1)
        with pytest.raises(EngineHTTPError, match="Timed out waiting for idle state") as info:
            await engine.reset_cache()
        assert info.value.status == 400 and server.flushes == 0
    finally:
        busy.cancel()
        await asyncio.gather(busy, return_exceptions=True)


async def test_recorded_flush_answers() -> None:
    eng = SGLangEngine(model=MODEL, url="http://s.test")
    eng.client = recorded((WIRE / "flush_cache_200.txt").read_bytes())
    assert await eng.reset_cache() is True
    await eng.client.aclose()
    eng.client = recorded((WIRE / "flush_cache_400.txt").read_bytes(), status=400)
    with pytest.raises(EngineHTTPError, match="Flush cache failed"):
        await eng.reset_cache()
    await eng.client.aclose()
