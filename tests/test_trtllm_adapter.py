"""What only the trtllm-serve adapter does (detokenize, the options YAML, iteration statistics, static
batching); the shared contract is in tests/test_adapter_contract.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest

from batchbench.adapters.base import StreamProtocolError, Usage
from batchbench.adapters.http import make_client
from batchbench.adapters.trtllm import TRTLLMEngine, to_yaml
from batchbench.core.config import BatchingConfig, ModelRef
from batchbench.fixtures import wire_dir
from batchbench.fixtures.protocol import read_sse
from batchbench.fixtures.protocol.trtllm import TRTLLMServer
from tests.adapter_helpers import collect, replay, request

WIRE = wire_dir("trtllm")
MODEL = ModelRef("batchbench/tiny-llama", served_name="tiny-llama", max_model_len=512)


@pytest.fixture
def server() -> Iterator[TRTLLMServer]:
    with TRTLLMServer(token_delay=0.002, max_running=4, max_queue=2, kv_capacity_tokens=4096,
                      max_total_tokens=512) as srv:
        yield srv


async def test_token_ids_are_counted_when_the_server_returns_them(server: TRTLLMServer) -> None:
    eng = TRTLLMEngine(model=MODEL, url=server.url, return_token_ids=True)
    assert eng.payload(request())["detokenize"] is False
    async with eng:
        chunks = await collect(eng, request(max_tokens=5))
    assert sum(c.n_tokens for c in chunks) == 5
    assert chunks[-1].usage == Usage(prompt_tokens=4, completion_tokens=5)


async def test_the_server_refuses_fields_trtllm_serve_does_not_know(server: TRTLLMServer) -> None:
    payload = {**TRTLLMEngine(model=MODEL, url="http://trtllm.test").payload(request()), "return_token_ids": True}
    assert server.url is not None
    async with make_client(server.url) as client, client.request(
        "POST", "/v1/completions", body=json.dumps(payload).encode(), headers={"Content-Type": "application/json"},
    ) as response:
        assert response.status == 400
        assert "Extra inputs are not permitted" in json.loads(await response.read())["error"]


async def test_prometheus_metrics_of_newer_versions(server: TRTLLMServer) -> None:
    server.tune(token_delay=0.02)
    eng = TRTLLMEngine(model=MODEL, url=server.url, metrics_source="prometheus")
    async with eng:
        tasks = [asyncio.create_task(collect(eng, request(f"p-{i}", max_tokens=100))) for i in range(5)]
        try:
            await server.wait_until(lambda s: s["running"] == 4 and s["waiting"] == 1)
            sample = await eng.scrape()
            assert sample is not None and (sample.running, sample.waiting) == (4, 1)
            assert sample.kv_capacity_tokens == 4096
            assert 0 < sample.kv_usage < 0.2  # type: ignore[operator]
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def test_static_batching_admits_only_into_an_empty_batch() -> None:
    with TRTLLMServer(token_delay=0.01, max_running=4, static_batch=True) as srv:
        eng = TRTLLMEngine(BatchingConfig(mode="static"), model=MODEL, url=srv.url)
        async with eng:
            first = asyncio.create_task(collect(eng, request("s-1", max_tokens=30)))
            await srv.wait_until(lambda s: s["running"] == 1)
            second = asyncio.create_task(collect(eng, request("s-2", max_tokens=3)))
            await srv.wait_until(lambda s: s["waiting"] == 1)
            assert srv.state()["running"] == 1  # a free slot, but the batch is not empty
            done = await asyncio.gather(first, second)
        assert [sum(c.n_tokens for c in chunks) for chunks in done] == [30, 3]


def test_server_args_map_the_batching_config_exactly() -> None:
    eng = TRTLLMEngine(
        BatchingConfig(max_batch_size=16, max_batched_tokens=1024, kv_capacity_tokens=8192, memory_fraction=0.5),
        model=ModelRef("org/model", max_model_len=512), url="http://trtllm.test", tokenizer="org/tok",
        options_path="/opt/batchbench/options.yaml",
    )
    assert eng.server_args(eng.batching, host="0.0.0.0", port=8000) == [
        "org/model", "--host", "0.0.0.0", "--port", "8000", "--backend", "pytorch", "--tokenizer", "org/tok",
        "--max_batch_size", "16", "--max_num_tokens", "1024", "--max_seq_len", "512",
        "--kv_cache_free_gpu_memory_fraction", "0.5", "--extra_llm_api_options", "/opt/batchbench/options.yaml",
    ]
    defaults = TRTLLMEngine(model=ModelRef("org/model"), url="http://trtllm.test")
    assert defaults.server_args(defaults.batching, host="127.0.0.1", port=8001) == [
        "org/model", "--host", "127.0.0.1", "--port", "8001", "--backend", "pytorch",
        "--extra_llm_api_options", "batchbench-trtllm-options.yaml",
    ]


def test_llm_api_options_carry_what_has_no_flag() -> None:
    static = BatchingConfig(mode="static", chunked_prefill=True, kv_capacity_tokens=8192, memory_fraction=0.5)
    eng = TRTLLMEngine(static, model=ModelRef("m", dummy_weights=True), url="http://trtllm.test",
                       extra_options={"kv_cache_config": {"tokens_per_block": 64}, "print_iter_log": True})
    assert eng.llm_api_options(static) == {
        "enable_iter_perf_stats": True,
        "scheduler_config": {"capacity_scheduler_policy": "STATIC_BATCH"},
        "kv_cache_config": {
            "enable_block_reuse": False, "free_gpu_memory_fraction": 0.5, "max_tokens": 8192, "tokens_per_block": 64,
        },
        "enable_chunked_prefill": True,
        "load_format": "DUMMY",
        "print_iter_log": True,
    }
    continuous = TRTLLMEngine(model=MODEL, url="http://trtllm.test")
    assert continuous.llm_api_options(continuous.batching) == {
        "enable_iter_perf_stats": True,
        "scheduler_config": {"capacity_scheduler_policy": "GUARANTEED_NO_EVICT"},
        "kv_cache_config": {"enable_block_reuse": False},
    }
    files = eng.server_files(static)
    assert list(files) == ["batchbench-trtllm-options.yaml"]
    yaml = pytest.importorskip("yaml")
    assert yaml.safe_load(files["batchbench-trtllm-options.yaml"]) == eng.llm_api_options(static)
    assert TRTLLMEngine.capabilities.batching_modes == frozenset({"static", "continuous"})


def test_to_yaml_writes_block_mappings() -> None:
    text = to_yaml({"a": {"b": "X Y", "c": 1.5, "d": None}, "e": False})
    assert text == 'a:\n  b: "X Y"\n  c: 1.5\n  d: null\ne: false'
    with pytest.raises(ValueError, match="metrics_source"):
        TRTLLMEngine(model=MODEL, url="http://trtllm.test", metrics_source="json")  # type: ignore[arg-type]


async def test_without_continuous_usage_each_choice_counts_one() -> None:
    stripped = []
    for payload in read_sse(WIRE / "completions_stream.sse"):
        if payload != "[DONE]":
            event = json.loads(payload)
            if event["choices"]:
                event["usage"] = None
            payload = json.dumps(event)
        stripped.append(f"data: {payload}\n\n")
    eng = TRTLLMEngine(model=MODEL, url="http://trtllm.test")
    replay(eng, "".join(stripped).encode())
    chunks = await collect(eng, request(max_tokens=4))
    assert [c.n_tokens for c in chunks] == [1, 1, 1, 1, 0]
    await eng.client.aclose()


def _without_usage(payload: str) -> str:
    if payload == "[DONE]":
        return payload
    event = json.loads(payload)
    event.pop("usage", None)
    return json.dumps(event)


async def test_a_stream_without_usage_is_a_protocol_error() -> None:
    """No usage event of its own and none on the last choice event (where llama.cpp puts it): nothing the engine
    counted, so an error rather than a guess."""
    payloads = [_without_usage(p) for p in read_sse(WIRE / "completions_stream.sse")
                if p == "[DONE]" or json.loads(p)["choices"]]
    eng = TRTLLMEngine(model=MODEL, url="http://trtllm.test")
    replay(eng, "".join(f"data: {p}\n\n" for p in payloads).encode())
    with pytest.raises(StreamProtocolError, match="no usage before"):
        await collect(eng, request())
    await eng.client.aclose()


def test_recorded_iteration_statistics_normalize() -> None:
    eng = TRTLLMEngine(model=MODEL, url="http://trtllm.test")
    stats = json.loads((WIRE / "metrics.json").read_text())
    sample = eng.normalize_iterations(stats)
    assert (sample.running, sample.waiting) == (3, 2)  # the latest iteration (154)
    assert sample.kv_usage == pytest.approx(12 / 128)
    assert sample.kv_capacity_tokens == 128 * 32
    assert eng.last_iteration is not None and eng.last_iteration["iter"] == 154
    # Some versions' docs show the list items as JSON strings; read those the same way.
    assert eng.normalize_iterations([json.dumps(s) for s in stats]).running == 3
    empty = eng.normalize_iterations([])
    assert (empty.running, empty.waiting, empty.kv_usage, empty.kv_capacity_tokens) == (0, 0, None, 4096)
    with pytest.raises(StreamProtocolError, match="not a JSON list"):
        eng.normalize_iterations({"iter": 1})
