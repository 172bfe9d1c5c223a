"""What only the TGI adapter does (text prompts, no ignore-EOS, /info); the shared contract is in
tests/test_adapter_contract.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator

import pytest

from batchbench.adapters.base import EngineHTTPError, Usage
from batchbench.adapters.prometheus import Samples
from batchbench.adapters.tgi import TGIEngine, token_ids_text
from batchbench.core.config import BatchingConfig, ModelRef
from batchbench.fixtures import wire_dir
from batchbench.fixtures.protocol.tgi import TGIServer
from tests.adapter_helpers import collect, recorded, request

WIRE = wire_dir("tgi")
MODEL = ModelRef("batchbench/tiny-llama", max_model_len=512)


@pytest.fixture
def server() -> Iterator[TGIServer]:
    with TGIServer(token_delay=0.002, max_running=4, max_queue=2, kv_capacity_tokens=4096,
                   max_total_tokens=512) as srv:
        yield srv


@pytest.fixture
async def engine(server: TGIServer) -> AsyncIterator[TGIEngine]:
    async with TGIEngine(model=MODEL, url=server.url, startup_timeout=5) as eng:
        yield eng  # type: ignore[misc]


def test_payload_sends_the_ids_as_text_and_asks_for_details() -> None:
    payload = TGIEngine(model=MODEL, url="http://tgi.test").payload(request(prompt=(17, 203, 99, 1024), max_tokens=4))
    assert payload["inputs"] == token_ids_text((17, 203, 99, 1024)) == "17 203 99 1024"
    assert payload["parameters"]["details"] is True


async def test_prompt_text_is_pluggable_and_the_count_still_comes_from_tgi(server: TGIServer) -> None:
    eng = TGIEngine(model=MODEL, url=server.url, prompt_text=lambda ids: " ".join(["w"] * 2 * len(ids)))
    async with eng:
        chunks = await collect(eng, request(prompt=(5, 6, 7), max_tokens=2))
    assert chunks[-1].usage == Usage(prompt_tokens=7, completion_tokens=2)


async def test_an_early_eos_is_reported_with_the_engines_count(server: TGIServer, engine: TGIEngine) -> None:
    server.eos_after = 3  # TGI cannot be told to ignore EOS
    chunks = await collect(engine, request(max_tokens=6))
    assert sum(c.n_tokens for c in chunks) == 3
    assert chunks[-1].usage == Usage(prompt_tokens=5, completion_tokens=3)
    assert chunks[-1].finish_reason == "eos_token"


async def test_generation_error_event_keeps_tgis_status(server: TGIServer, engine: TGIEngine) -> None:
    server.fault = "error_event"
    with pytest.raises(EngineHTTPError, match="generation") as info:
        await collect(engine, request("gen-1"))
    assert info.value.status == 424


async def test_describe_carries_info_and_the_kv_budget(engine: TGIEngine) -> None:
    await engine.scrape()
    doc = engine.describe()
    assert doc["engine"] == "tgi" and doc["mode"] == "url"
    assert doc["version"] == "3.3.6-dev0"
    assert doc["limits"]["max_concurrent_requests"] == 6
    assert doc["limits"]["max_total_tokens"] == 512
    assert doc["kv_capacity_tokens"] == 4096
    assert doc["exact_output_length"] is False


def test_server_args_map_the_batching_config_exactly() -> None:
    eng = TGIEngine(
        BatchingConfig(max_batch_size=16, max_batched_tokens=1024, kv_capacity_tokens=8192, memory_fraction=0.5),
        model=ModelRef("org/model", max_model_len=512), url="http://tgi.test",
        max_concurrent_requests=512, max_waiting_tokens=10, waiting_served_ratio=1.2, dtype="bfloat16",
    )
    assert eng.server_args(eng.batching, host="0.0.0.0", port=3000) == [
        "--model-id", "org/model", "--hostname", "0.0.0.0", "--port", "3000",
        "--max-total-tokens", "512", "--max-input-tokens", "511",
        "--max-batch-size", "16", "--max-batch-prefill-tokens", "1024", "--max-batch-total-tokens", "8192",
        "--cuda-memory-fraction", "0.5", "--max-concurrent-requests", "512", "--max-waiting-tokens", "10",
        "--waiting-served-ratio", "1.2", "--dtype", "bfloat16",
    ]
    defaults = TGIEngine(model=ModelRef("org/model"), url="http://tgi.test")
    assert defaults.server_args(defaults.batching, host="127.0.0.1", port=8080) == [
        "--model-id", "org/model", "--hostname", "127.0.0.1", "--port", "8080",
    ]


def test_configs_tgi_cannot_run_are_refused_up_front() -> None:
    with pytest.raises(ValueError, match="continuous"):
        TGIEngine(BatchingConfig(mode="static"), model=MODEL, url="http://tgi.test")
    with pytest.raises(ValueError, match="chunked-prefill"):
        TGIEngine(BatchingConfig(chunked_prefill=True), model=MODEL, url="http://tgi.test")
    with pytest.raises(ValueError, match="max-batch-total-tokens"):
        TGIEngine(BatchingConfig(kv_capacity_tokens=256), model=MODEL, url="http://tgi.test")

    class NoLaunch:
        pass

    with pytest.raises(ValueError, match="random weights"):
        TGIEngine(model=ModelRef("m", dummy_weights=True), launch=NoLaunch())  # type: ignore[arg-type]
    assert TGIEngine.capabilities.batching_modes == frozenset({"continuous"})


async def test_recorded_info_and_a_2x_style_kv_budget() -> None:
    info = json.loads((WIRE / "info.json").read_text())
    assert {"model_id", "max_concurrent_requests", "max_input_tokens", "max_total_tokens", "version"} <= set(info)
    eng = TGIEngine(model=MODEL, url="http://tgi.test")
    eng.client = recorded(json.dumps({**info, "max_batch_total_tokens": 20000}).encode())
    loaded = await eng.load_info()
    assert loaded["model_id"] == "batchbench/tiny-llama"
    assert eng.kv_capacity_tokens == 20000
    await eng.client.aclose()


def test_series_not_yet_touched_read_as_zero_on_a_live_tgi_only() -> None:
    eng = TGIEngine(model=MODEL, url="http://tgi.test")
    fresh = eng.normalize(Samples.parse("# TYPE tgi_request_count counter\ntgi_request_count 0\n"))
    assert (fresh.running, fresh.waiting, fresh.rejections) == (0, 0, 0)
    assert fresh.kv_usage is None and fresh.kv_capacity_tokens is None
    other = eng.normalize(Samples.parse("# TYPE something_else gauge\nsomething_else 1\n"))
    assert (other.running, other.waiting, other.rejections) == (None, None, None)
