"""The TensorRT-LLM (trtllm-serve) adapter against its protocol server and the recorded wire formats."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from batchbench.adapters.base import (
    BatchingConfig,
    Chunk,
    EngineError,
    EngineHTTPError,
    EngineNotHealthy,
    EngineRejected,
    EngineUnreachable,
    ModelRef,
    StreamProtocolError,
    Usage,
)
from batchbench.adapters.http import make_client
from batchbench.adapters.prometheus import Samples
from batchbench.adapters.trtllm import TRTLLMEngine, to_yaml
from batchbench.fixtures.protocol_servers import TRTLLMServer, read_sse, wire_dir
from batchbench.workload import Request

WIRE = wire_dir("trtllm")
MODEL = ModelRef("batchbench/tiny-llama", served_name="tiny-llama", max_model_len=512)


def request(rid: str = "req-1", prompt: tuple[int, ...] = (11, 12, 13, 14), max_tokens: int = 6) -> Request:
    return Request(rid, prompt, max_tokens)


async def collect(engine: TRTLLMEngine, req: Request) -> list[Chunk]:
    return [chunk async for chunk in engine.stream(req)]


@pytest.fixture
def server() -> Iterator[TRTLLMServer]:
    srv = TRTLLMServer(token_delay=0.002, max_running=4, max_queue=2, kv_capacity_tokens=4096, max_total_tokens=512)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
async def engine(server: TRTLLMServer) -> AsyncIterator[TRTLLMEngine]:
    eng = TRTLLMEngine(model=MODEL, url=server.url, startup_timeout=5)
    async with eng:
        yield eng


def recorded(body: bytes, status: int = 200, content_type: str = "text/event-stream") -> httpx.AsyncClient:
    """A client whose every answer is a recorded body."""
    def handler(_: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=body, headers={"content-type": content_type})
    return httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://trtllm.test")


# ---------------------------------------------------------------- streaming


async def test_streams_exact_token_counts_and_the_engines_usage(engine: TRTLLMEngine) -> None:
    chunks = await collect(engine, request(max_tokens=6))
    token_chunks, last = chunks[:-1], chunks[-1]
    assert [c.n_tokens for c in token_chunks] == [1] * 6  # from usage.completion_tokens deltas
    assert token_chunks[-1].finish_reason == "length"
    assert last.n_tokens == 0 and last.usage == Usage(prompt_tokens=4, completion_tokens=6)
    assert all(c.usage is None for c in token_chunks)


async def test_token_ids_are_counted_when_the_server_returns_them(server: TRTLLMServer) -> None:
    eng = TRTLLMEngine(model=MODEL, url=server.url, return_token_ids=True)
    assert eng.payload(request())["detokenize"] is False
    async with eng:
        chunks = await collect(eng, request(max_tokens=5))
    assert sum(c.n_tokens for c in chunks) == 5
    assert chunks[-1].usage == Usage(prompt_tokens=4, completion_tokens=5)


async def test_payload_is_the_recorded_request(engine: TRTLLMEngine) -> None:
    payload = engine.payload(request(prompt=(17, 203, 99, 1024), max_tokens=4))
    assert payload == json.loads((WIRE / "completions_request.json").read_text())


async def test_the_server_refuses_fields_trtllm_serve_does_not_know(server: TRTLLMServer, engine: TRTLLMEngine) -> None:
    payload = {**engine.payload(request()), "return_token_ids": True}
    assert server.url is not None
    async with make_client(server.url) as client:
        response = await client.post("/v1/completions", json=payload)
    assert response.status_code == 400
    assert "Extra inputs are not permitted" in response.json()["error"]


async def test_chunk_timestamps_increase(server: TRTLLMServer, engine: TRTLLMEngine) -> None:
    server.token_delay = server.batcher.token_delay = 0.005  # type: ignore[union-attr]
    chunks = await collect(engine, request(max_tokens=8))
    times = [c.t for c in chunks[:-1]]
    assert all(b > a for a, b in itertools.pairwise(times))
    assert chunks[-1].t >= times[-1]
    assert times[-1] - times[0] >= 7 * 0.004


async def test_concurrent_streams_each_get_their_own_tokens(engine: TRTLLMEngine) -> None:
    results = await asyncio.gather(*(collect(engine, request(f"c-{i}", max_tokens=2 + i)) for i in range(4)))
    for i, chunks in enumerate(results):
        assert sum(c.n_tokens for c in chunks) == 2 + i
        assert chunks[-1].usage == Usage(prompt_tokens=4, completion_tokens=2 + i)


# ---------------------------------------------------------------- metrics


async def test_metrics_match_the_servers_live_state(server: TRTLLMServer, engine: TRTLLMEngine) -> None:
    server.token_delay = server.batcher.token_delay = 0.02  # type: ignore[union-attr]
    tasks = [asyncio.create_task(collect(engine, request(f"m-{i}", max_tokens=200))) for i in range(6)]
    try:
        await server.wait_until(lambda s: s["running"] == 4 and s["waiting"] == 2 and s["iteration"] >= 3)
        await asyncio.sleep(0.05)  # at least one iteration with this state reaches the statistics
        sample = await engine.scrape()
        state = server.state()
        assert sample is not None
        assert (sample.running, sample.waiting) == (4, 2)
        assert sample.kv_capacity_tokens == 4096  # maxNumBlocks * tokensPerBlock
        used_blocks = server.call(lambda: server.used_blocks(server.batcher))  # type: ignore[arg-type]
        assert sample.kv_usage == pytest.approx(used_blocks / 128, abs=4 / 128)
        assert sample.kv_usage == pytest.approx(state["used_tokens"] / 4096, abs=4 * 32 / 4096)
        assert sample.preemptions is None and sample.rejections is None

        # Over the queue limit the protocol server answers 429 (a proxy's answer; trtllm-serve just queues).
        with pytest.raises(EngineRejected) as info:
            await collect(engine, request("over-1", max_tokens=2))
        assert info.value.status == 429
        assert "'trtllm'" in str(info.value) and "over-1" in str(info.value)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await server.wait_until(lambda s: s["running"] == 0 and s["waiting"] == 0)
    await engine.scrape()  # drains the last busy iterations
    idle = await engine.scrape()
    assert idle is not None and (idle.running, idle.waiting) == (0, 0)
    assert idle.kv_usage is None and idle.kv_capacity_tokens == 4096


async def test_prometheus_metrics_of_newer_versions(server: TRTLLMServer) -> None:
    server.token_delay = server.batcher.token_delay = 0.02  # type: ignore[union-attr]
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


# ---------------------------------------------------------------- failures


@pytest.mark.parametrize("status", [429, 503])
async def test_overload_statuses_are_rejections_naming_engine_and_request(
    server: TRTLLMServer, engine: TRTLLMEngine, status: int,
) -> None:
    server.fault = str(status)
    with pytest.raises(EngineRejected) as info:
        await collect(engine, request("rej-7"))
    assert info.value.status == status
    assert info.value.engine == "trtllm" and info.value.request_id == "rej-7"
    assert "'trtllm'" in str(info.value) and "rej-7" in str(info.value)


async def test_malformed_chunk_is_a_protocol_error(server: TRTLLMServer, engine: TRTLLMEngine) -> None:
    server.fault = "malformed"
    with pytest.raises(StreamProtocolError, match="malformed stream event") as info:
        await collect(engine, request("bad-1"))
    assert info.value.request_id == "bad-1"


async def test_dropped_connection_is_a_protocol_error(server: TRTLLMServer, engine: TRTLLMEngine) -> None:
    server.fault = "truncated"
    with pytest.raises(StreamProtocolError, match="connection broke mid-stream"):
        await collect(engine, request("cut-1"))


async def test_stream_without_done_is_a_protocol_error(server: TRTLLMServer, engine: TRTLLMEngine) -> None:
    server.fault = "incomplete"
    with pytest.raises(StreamProtocolError, match=r"before \[DONE\]"):
        await collect(engine, request("short-1"))


async def test_too_long_a_request_is_an_http_error(engine: TRTLLMEngine) -> None:
    with pytest.raises(EngineHTTPError, match="max_seq_len") as info:
        await collect(engine, request("long-1", max_tokens=600))
    assert info.value.status == 400


async def test_a_hanging_server_is_left_to_the_callers_deadline(server: TRTLLMServer, engine: TRTLLMEngine) -> None:
    server.fault = "hang"
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(collect(engine, request("hang-1")), 0.3)


async def test_wrong_url_is_unreachable_with_a_clear_message() -> None:
    eng = TRTLLMEngine(model=MODEL, url="http://127.0.0.1:9", startup_timeout=0.3)
    await eng.start()
    try:
        with pytest.raises(EngineUnreachable, match=r"cannot connect to http://127\.0\.0\.1:9") as info:
            await collect(eng, request("nowhere-1"))
        assert info.value.request_id == "nowhere-1"
        with pytest.raises(EngineUnreachable, match="cannot connect"):
            await eng.scrape()
    finally:
        await eng.stop()
    with pytest.raises(EngineNotHealthy, match="cannot connect"):
        async with TRTLLMEngine(model=MODEL, url="http://127.0.0.1:9", startup_timeout=0.3):
            pass


async def test_unhealthy_server_never_becomes_ready(server: TRTLLMServer) -> None:
    server.fault = "unhealthy"
    with pytest.raises(EngineNotHealthy, match="LLM is unavailable"):
        async with TRTLLMEngine(model=MODEL, url=server.url, startup_timeout=0.3):
            pass


# ---------------------------------------------------------------- launcher flags and options


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


# ---------------------------------------------------------------- recorded wire formats


async def test_recorded_stream_parses_into_chunks() -> None:
    eng = TRTLLMEngine(model=MODEL, url="http://trtllm.test")
    eng.client = recorded((WIRE / "completions_stream.sse").read_bytes())
    chunks = await collect(eng, request(max_tokens=4))
    assert [c.n_tokens for c in chunks] == [1, 1, 1, 1, 0]
    assert chunks[3].finish_reason == "length"
    assert chunks[-1].usage == Usage(prompt_tokens=4, completion_tokens=4)
    await eng.client.aclose()


async def test_without_continuous_usage_each_choice_counts_one() -> None:
    payloads = read_sse(WIRE / "completions_stream.sse")
    stripped = []
    for payload in payloads:
        if payload != "[DONE]":
            event = json.loads(payload)
            if event["choices"]:
                event["usage"] = None
            payload = json.dumps(event)
        stripped.append(f"data: {payload}\n\n")
    eng = TRTLLMEngine(model=MODEL, url="http://trtllm.test")
    eng.client = recorded("".join(stripped).encode())
    chunks = await collect(eng, request(max_tokens=4))
    assert [c.n_tokens for c in chunks] == [1, 1, 1, 1, 0]
    await eng.client.aclose()


async def test_a_stream_without_usage_is_a_protocol_error() -> None:
    payloads = [p for p in read_sse(WIRE / "completions_stream.sse") if p == "[DONE]" or json.loads(p)["choices"]]
    eng = TRTLLMEngine(model=MODEL, url="http://trtllm.test")
    eng.client = recorded("".join(f"data: {p}\n\n" for p in payloads).encode())
    with pytest.raises(StreamProtocolError, match="no usage chunk"):
        await collect(eng, request())
    await eng.client.aclose()


@pytest.mark.parametrize(("name", "status", "error", "text"), [
    ("overloaded_429.json", 429, EngineRejected, "Too many requests"),
    ("error_response_400.json", 400, EngineHTTPError, "should not exceed max_seq_len"),
    ("validation_error_400.json", 400, EngineHTTPError, "Extra inputs are not permitted"),
])
async def test_recorded_error_bodies_map_to_error_types(
    name: str, status: int, error: type[EngineError], text: str,
) -> None:
    eng = TRTLLMEngine(model=MODEL, url="http://trtllm.test")
    eng.client = recorded((WIRE / name).read_bytes(), status=status, content_type="application/json")
    with pytest.raises(error, match=text) as info:
        await collect(eng, request("rec-1"))
    assert isinstance(info.value, EngineRejected | EngineHTTPError)
    assert info.value.status == status and info.value.request_id == "rec-1"
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


def test_recorded_prometheus_metrics_normalize() -> None:
    eng = TRTLLMEngine(model=MODEL, url="http://trtllm.test", metrics_source="prometheus")
    sample = eng.normalize(Samples.parse((WIRE / "prometheus_metrics.prom").read_text()))
    assert (sample.running, sample.waiting) == (3, 2)
    assert sample.kv_usage == pytest.approx(0.09375)
    assert sample.kv_capacity_tokens == 4096


def test_recorded_files_parse() -> None:
    payloads = read_sse(WIRE / "completions_stream.sse")
    assert payloads[-1] == "[DONE]"
    events = [json.loads(p) for p in payloads[:-1]]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4
    assert (WIRE / "completions_stream.sse").read_text().startswith("data: {")
    for path in sorted(WIRE.glob("*.json")):
        assert isinstance(json.loads(path.read_text()), (dict, list)), path.name
    assert "TensorRT-LLM 1.x" in (WIRE / "README.md").read_text()
