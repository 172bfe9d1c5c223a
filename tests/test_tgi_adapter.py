"""The TGI adapter against the TGI protocol server and the recorded TGI wire formats."""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

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
from batchbench.adapters.tgi import TGIEngine, token_ids_text
from batchbench.fixtures.protocol_servers import TGIServer, read_sse, wire_dir
from batchbench.workload import Request

WIRE = wire_dir("tgi")
MODEL = ModelRef("batchbench/tiny-llama", max_model_len=512)
ROOT = Path(__file__).resolve().parent.parent


def request(rid: str = "req-1", prompt: tuple[int, ...] = (11, 12, 13, 14), max_tokens: int = 6) -> Request:
    return Request(rid, prompt, max_tokens)


async def collect(engine: TGIEngine, req: Request) -> list[Chunk]:
    return [chunk async for chunk in engine.stream(req)]


@pytest.fixture
def server() -> Iterator[TGIServer]:
    srv = TGIServer(token_delay=0.002, max_running=4, max_queue=2, kv_capacity_tokens=4096, max_total_tokens=512)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
async def engine(server: TGIServer) -> AsyncIterator[TGIEngine]:
    eng = TGIEngine(model=MODEL, url=server.url, startup_timeout=5)
    async with eng:
        yield eng


def recorded(body: bytes, status: int = 200, content_type: str = "text/event-stream") -> httpx.AsyncClient:
    """A client whose every answer is a recorded body."""
    def handler(_: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=body, headers={"content-type": content_type})
    return httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://tgi.test")


# ---------------------------------------------------------------- streaming


async def test_streams_one_token_per_event_and_the_engines_own_usage(engine: TGIEngine) -> None:
    chunks = await collect(engine, request(max_tokens=6))
    assert [c.n_tokens for c in chunks] == [1] * 6
    assert all(c.usage is None for c in chunks[:-1])
    # The prompt count is TGI's input_length (4 words + BOS in the protocol server), not len(prompt_token_ids).
    assert chunks[-1].usage == Usage(prompt_tokens=5, completion_tokens=6)
    assert chunks[-1].finish_reason == "length"


async def test_chunk_timestamps_increase(server: TGIServer, engine: TGIEngine) -> None:
    server.token_delay = server.batcher.token_delay = 0.005  # type: ignore[union-attr]
    chunks = await collect(engine, request(max_tokens=8))
    times = [c.t for c in chunks]
    assert all(b > a for a, b in itertools.pairwise(times))
    assert times[-1] - times[0] >= 7 * 0.004


async def test_payload_sends_text_and_asks_for_details(engine: TGIEngine) -> None:
    payload = engine.payload(request(prompt=(17, 203, 99, 1024), max_tokens=4))
    assert payload == json.loads((WIRE / "generate_stream_request.json").read_text())
    assert payload["inputs"] == token_ids_text((17, 203, 99, 1024)) == "17 203 99 1024"


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


async def test_concurrent_streams_each_get_their_own_tokens(engine: TGIEngine) -> None:
    results = await asyncio.gather(*(collect(engine, request(f"c-{i}", max_tokens=3 + i)) for i in range(4)))
    for i, chunks in enumerate(results):
        assert sum(c.n_tokens for c in chunks) == 3 + i
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3 + i


# ---------------------------------------------------------------- metrics


async def test_metrics_match_the_servers_live_state(server: TGIServer, engine: TGIEngine) -> None:
    server.token_delay = server.batcher.token_delay = 0.02  # type: ignore[union-attr]
    tasks = [asyncio.create_task(collect(engine, request(f"m-{i}", max_tokens=200))) for i in range(6)]
    try:
        state = await server.wait_until(lambda s: s["running"] == 4 and s["waiting"] == 2)
        sample = await engine.scrape()
        assert sample is not None
        assert (sample.running, sample.waiting) == (4, 2)
        assert sample.kv_capacity_tokens == 4096
        assert sample.kv_usage == pytest.approx(state["reserved_tokens"] / 4096)
        assert sample.kv_usage == pytest.approx(4 * (5 + 200) / 4096)
        assert sample.rejections == 0 and sample.preemptions is None

        # Queue full: TGI answers an "overloaded" error event inside a 200 stream.
        with pytest.raises(EngineRejected) as info:
            await collect(engine, request("over-1", max_tokens=2))
        assert info.value.status == 429
        assert "'tgi'" in str(info.value) and "over-1" in str(info.value) and "overloaded" in str(info.value)
        sample = await engine.scrape()
        assert sample is not None and sample.rejections == 1
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await server.wait_until(lambda s: s["running"] == 0 and s["waiting"] == 0)
    idle = await engine.scrape()
    assert idle is not None and (idle.running, idle.waiting, idle.kv_usage) == (0, 0, 0)


async def test_describe_carries_info_and_the_kv_budget(engine: TGIEngine) -> None:
    await engine.scrape()
    doc = engine.describe()
    assert doc["engine"] == "tgi" and doc["mode"] == "url"
    assert doc["version"] == "3.3.6-dev0"
    assert doc["limits"]["max_concurrent_requests"] == 6
    assert doc["limits"]["max_total_tokens"] == 512
    assert doc["kv_capacity_tokens"] == 4096
    assert doc["exact_output_length"] is False


# ---------------------------------------------------------------- failures


@pytest.mark.parametrize("status", [429, 503])
async def test_overload_statuses_are_rejections_naming_engine_and_request(
    server: TGIServer, engine: TGIEngine, status: int,
) -> None:
    server.fault = str(status)
    with pytest.raises(EngineRejected) as info:
        await collect(engine, request("rej-7"))
    assert info.value.status == status
    assert info.value.engine == "tgi" and info.value.request_id == "rej-7"
    assert "'tgi'" in str(info.value) and "rej-7" in str(info.value)


async def test_malformed_event_is_a_protocol_error(server: TGIServer, engine: TGIEngine) -> None:
    server.fault = "malformed"
    with pytest.raises(StreamProtocolError, match="malformed stream event") as info:
        await collect(engine, request("bad-1"))
    assert info.value.request_id == "bad-1"


async def test_truncated_stream_is_a_protocol_error(server: TGIServer, engine: TGIEngine) -> None:
    server.fault = "truncated"
    with pytest.raises(StreamProtocolError, match="connection broke mid-stream"):
        await collect(engine, request("cut-1"))


async def test_stream_without_final_details_is_a_protocol_error(server: TGIServer, engine: TGIEngine) -> None:
    server.fault = "incomplete"
    with pytest.raises(StreamProtocolError, match="without the final event"):
        await collect(engine, request("short-1"))


async def test_generation_error_event_keeps_tgis_status(server: TGIServer, engine: TGIEngine) -> None:
    server.fault = "error_event"
    with pytest.raises(EngineHTTPError, match="generation") as info:
        await collect(engine, request("gen-1"))
    assert info.value.status == 424


async def test_validation_error_event_is_an_http_error(engine: TGIEngine) -> None:
    with pytest.raises(EngineHTTPError, match="must be <= 512") as info:
        await collect(engine, request("long-1", max_tokens=600))
    assert info.value.status == 422


async def test_a_hanging_server_is_left_to_the_callers_deadline(server: TGIServer, engine: TGIEngine) -> None:
    server.fault = "hang"
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(collect(engine, request("hang-1")), 0.3)


async def test_wrong_url_is_unreachable_with_a_clear_message() -> None:
    eng = TGIEngine(model=MODEL, url="http://127.0.0.1:9", startup_timeout=0.3)
    await eng.start()
    try:
        with pytest.raises(EngineUnreachable, match=r"cannot connect to http://127\.0\.0\.1:9") as info:
            await collect(eng, request("nowhere-1"))
        assert info.value.request_id == "nowhere-1"
    finally:
        await eng.stop()
    with pytest.raises(EngineNotHealthy, match="cannot connect"):
        async with TGIEngine(model=MODEL, url="http://127.0.0.1:9", startup_timeout=0.3):
            pass
    with pytest.raises(EngineUnreachable, match="invalid URL"):
        TGIEngine(model=MODEL, url="tgi-host:8080")


async def test_unhealthy_server_never_becomes_ready(server: TGIServer) -> None:
    server.fault = "unhealthy"
    with pytest.raises(EngineNotHealthy, match="unhealthy"):
        async with TGIEngine(model=MODEL, url=server.url, startup_timeout=0.3):
            pass


# ---------------------------------------------------------------- launcher flags


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


# ---------------------------------------------------------------- recorded wire formats


async def test_recorded_stream_parses_into_chunks() -> None:
    eng = TGIEngine(model=MODEL, url="http://tgi.test")
    eng.client = recorded((WIRE / "generate_stream.sse").read_bytes())
    chunks = await collect(eng, request(max_tokens=4))
    assert [c.n_tokens for c in chunks] == [1, 1, 1, 1]
    assert chunks[-1].usage == Usage(prompt_tokens=5, completion_tokens=4)
    assert chunks[-1].finish_reason == "length"
    await eng.client.aclose()


@pytest.mark.parametrize(("name", "error", "status"), [
    ("overloaded_event.sse", EngineRejected, 429),
    ("error_event.sse", EngineHTTPError, 424),
    ("validation_event.sse", EngineHTTPError, 422),
])
async def test_recorded_error_events_map_to_error_types(name: str, error: type[EngineError], status: int) -> None:
    eng = TGIEngine(model=MODEL, url="http://tgi.test")
    eng.client = recorded((WIRE / name).read_bytes())
    with pytest.raises(error) as info:
        await collect(eng, request("rec-1"))
    assert isinstance(info.value, EngineRejected | EngineHTTPError)
    assert info.value.status == status and info.value.request_id == "rec-1"
    await eng.client.aclose()


async def test_recorded_429_body_is_a_rejection() -> None:
    eng = TGIEngine(model=MODEL, url="http://tgi.test")
    eng.client = recorded((WIRE / "overloaded_429.json").read_bytes(), status=429, content_type="application/json")
    with pytest.raises(EngineRejected, match="HTTP 429 from /generate_stream: Model is overloaded"):
        await collect(eng, request())
    await eng.client.aclose()


async def test_recorded_info_and_a_2x_style_kv_budget() -> None:
    info = json.loads((WIRE / "info.json").read_text())
    assert {"model_id", "max_concurrent_requests", "max_input_tokens", "max_total_tokens", "version"} <= set(info)
    eng = TGIEngine(model=MODEL, url="http://tgi.test")
    eng.client = recorded(json.dumps({**info, "max_batch_total_tokens": 20000}).encode(),
                          content_type="application/json")
    loaded = await eng.load_info()
    assert loaded["model_id"] == "batchbench/tiny-llama"
    assert eng.kv_capacity_tokens == 20000
    await eng.client.aclose()


def test_recorded_metrics_normalize() -> None:
    eng = TGIEngine(model=MODEL, url="http://tgi.test")
    sample = eng.normalize(Samples.parse((WIRE / "metrics.prom").read_text()))
    assert (sample.running, sample.waiting) == (3, 2)
    assert sample.kv_capacity_tokens == 16000
    assert sample.kv_usage == pytest.approx(1200 / 16000)
    assert sample.rejections == 4
    assert sample.preemptions is None


def test_series_not_yet_touched_read_as_zero_on_a_live_tgi_only() -> None:
    eng = TGIEngine(model=MODEL, url="http://tgi.test")
    fresh = eng.normalize(Samples.parse("# TYPE tgi_request_count counter\ntgi_request_count 0\n"))
    assert (fresh.running, fresh.waiting, fresh.rejections) == (0, 0, 0)
    assert fresh.kv_usage is None and fresh.kv_capacity_tokens is None
    other = eng.normalize(Samples.parse("# TYPE something_else gauge\nsomething_else 1\n"))
    assert (other.running, other.waiting, other.rejections) == (None, None, None)


def test_recorded_files_parse() -> None:
    for path in sorted(WIRE.glob("*.sse")):
        events = [json.loads(payload) for payload in read_sse(path)]
        assert events, path.name
    assert (WIRE / "generate_stream.sse").read_text().startswith("data:{")  # axum writes no space
    for path in sorted(WIRE.glob("*.json")):
        assert isinstance(json.loads(path.read_text()), dict), path.name
    assert (WIRE / "README.md").read_text().count("v3.3.7") >= 1


# ---------------------------------------------------------------- the server as a program


async def test_protocol_server_runs_as_a_module_for_url_mode() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "batchbench.fixtures.protocol_servers", "tgi", "--port", "0", "--token-delay", "0.001",
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
        url = line.strip().rsplit(" ", 1)[-1]
        assert url.startswith("http://127.0.0.1:"), line
        async with TGIEngine(model=MODEL, url=url, startup_timeout=5) as eng:
            chunks = await collect(eng, request(max_tokens=3))  # type: ignore[arg-type]
        assert chunks[-1].usage == Usage(prompt_tokens=5, completion_tokens=3)
        async with make_client(url) as client:
            assert (await client.get("/health")).status_code == 200
    finally:
        proc.terminate()
        await proc.wait()
