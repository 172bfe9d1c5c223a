"""The contract every served adapter keeps, written once and run against each engine's protocol server.

One row per engine: its adapter, its personality of the protocol server (fixtures/protocol/), its
wire recordings (fixtures/wire/<engine>/) and what differs between engines. Adding an engine is one
row here; tests that only make sense for one engine live in tests/test_<engine>_adapter.py.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from batchbench.adapters.base import (
    EngineError,
    EngineHTTPError,
    EngineNotHealthy,
    EngineRejected,
    EngineUnreachable,
    StreamProtocolError,
    Usage,
)
from batchbench.adapters.generic import OpenAIServerEngine
from batchbench.adapters.http import make_client
from batchbench.adapters.prometheus import Samples
from batchbench.adapters.served import ServedEngine
from batchbench.adapters.sglang import SGLangEngine
from batchbench.adapters.tgi import TGIEngine
from batchbench.adapters.trtllm import TRTLLMEngine
from batchbench.adapters.vllm import VLLMEngine
from batchbench.core.config import ModelRef
from batchbench.fixtures import wire_dir
from batchbench.fixtures.protocol import ProtocolServer, personalities, read_sse
from tests.adapter_helpers import collect, replay, request

ROOT = Path(__file__).resolve().parent.parent
#: Every live test runs against a server of this shape: 4 decoding, 2 waiting, a 4096-token KV budget.
SERVER_SHAPE = {"token_delay": 0.002, "max_running": 4, "max_queue": 2, "kv_capacity_tokens": 4096,
                "max_total_tokens": 512}

#: Expected KV usage while the metrics test holds 4 running sequences: [(value, abs tolerance)].
KVCheck = Callable[[ProtocolServer, dict[str, int]], list[tuple[float, float]]]


def reserved_share(server: ProtocolServer, state: dict[str, int]) -> list[tuple[float, float]]:
    # Reserved as prompt + max new tokens per sequence (4 words + BOS, 200 new), so it does not move.
    return [(state["reserved_tokens"] / 4096, 1e-9), (4 * (5 + 200) / 4096, 1e-9)]


def used_blocks_share(server: ProtocolServer, state: dict[str, int]) -> list[tuple[float, float]]:
    used_blocks = server.call(lambda: server.used_blocks(server.batcher))  # type: ignore[attr-defined]
    return [(used_blocks / 128, 4 / 128), (state["used_tokens"] / 4096, 4 * 32 / 4096)]


def used_tokens_share(server: ProtocolServer, state: dict[str, int]) -> list[tuple[float, float]]:
    # Tokens in use grow by 4 per step; the scrape came a step or two before the state was read.
    return [(state["used_tokens"] / 4096, 4 * 3 / 4096)]


@dataclass(frozen=True)
class Row:
    engine: str
    adapter: type[ServedEngine]
    model: ModelRef
    #: What the engine counts for the prompt (11, 12, 13, 14): TGI takes text ("11 12 13 14" + BOS).
    prompt_tokens: int
    #: A usage-only chunk closes the stream (OpenAI style); else the usage rides on the last token (TGI).
    usage_chunk: bool
    #: The status a full queue is rejected with, and text its message carries.
    full_status: int
    full_text: str
    kv_usage: KVCheck
    #: /metrics counts rejections (so 0, then 1 after one).
    counts_rejections: bool
    preemptions: float | None
    idle_kv_usage: float | None
    #: The error of a stream that ends without its final event.
    incomplete: str
    #: prompt + max_tokens past max_total_tokens: (status, message).
    too_long: tuple[int, str]
    unhealthy: str
    # ---- recordings (None: none for this engine)
    request_file: str | None = None
    #: (file, tokens per chunk, index of the chunk with the finish reason, usage)
    stream_file: tuple[str, list[int], int, Usage] | None = None
    #: (file, HTTP status of the answer, error type, its status, message)
    error_files: tuple[tuple[str, int, type[EngineError], int, str], ...] = ()
    #: (file, expected ServerMetrics fields)
    metrics_file: tuple[str, dict[str, float | None]] | None = None
    sse_prefix: str = "data: "
    #: Text the recordings' README must carry (the version checked).
    readme: str | None = None

    def __str__(self) -> str:
        return self.engine

    @property
    def server(self) -> type[ProtocolServer]:
        return personalities()[self.engine]

    def make(self, url: str, **kwargs: Any) -> ServedEngine:
        return self.adapter(model=self.model, url=url, **kwargs)


TINY = ModelRef("batchbench/tiny-llama", served_name="tiny-llama", max_model_len=512)

ROWS = [
    Row(
        "tgi", TGIEngine, ModelRef("batchbench/tiny-llama", max_model_len=512), prompt_tokens=5, usage_chunk=False,
        full_status=429, full_text="overloaded", kv_usage=reserved_share, counts_rejections=True,
        preemptions=None, idle_kv_usage=0.0, incomplete="without the final event",
        too_long=(422, "must be <= 512"), unhealthy="unhealthy",
        request_file="generate_stream_request.json",
        stream_file=("generate_stream.sse", [1, 1, 1, 1], 3, Usage(5, 4)),
        error_files=(
            ("overloaded_event.sse", 200, EngineRejected, 429, "overloaded"),
            ("error_event.sse", 200, EngineHTTPError, 424, "generation"),
            ("validation_event.sse", 200, EngineHTTPError, 422, "validation"),
            ("overloaded_429.json", 429, EngineRejected, 429, "HTTP 429 from /generate_stream: Model is overloaded"),
        ),
        metrics_file=("metrics.prom", {"running": 3, "waiting": 2, "kv_capacity_tokens": 16000,
                                       "kv_usage": 1200 / 16000, "rejections": 4, "preemptions": None}),
        sse_prefix="data:", readme="v3.3.7",
    ),
    Row(
        "trtllm", TRTLLMEngine, TINY, prompt_tokens=4, usage_chunk=True,
        full_status=429, full_text="Too many requests", kv_usage=used_blocks_share, counts_rejections=False,
        preemptions=None, idle_kv_usage=None, incomplete=r"before \[DONE\]",
        too_long=(400, "max_seq_len"), unhealthy="LLM is unavailable",
        request_file="completions_request.json",
        stream_file=("completions_stream.sse", [1, 1, 1, 1, 0], 3, Usage(4, 4)),
        error_files=(
            ("overloaded_429.json", 429, EngineRejected, 429, "Too many requests"),
            ("error_response_400.json", 400, EngineHTTPError, 400, "should not exceed max_seq_len"),
            ("validation_error_400.json", 400, EngineHTTPError, 400, "Extra inputs are not permitted"),
        ),
        metrics_file=("prometheus_metrics.prom", {"running": 3, "waiting": 2, "kv_usage": 0.09375,
                                                  "kv_capacity_tokens": 4096}),
        readme="TensorRT-LLM 1.x",
    ),
    Row(
        "sglang", SGLangEngine, TINY, prompt_tokens=4, usage_chunk=True,
        full_status=503, full_text="The request queue is full", kv_usage=used_tokens_share, counts_rejections=False,
        preemptions=0.0, idle_kv_usage=0.0, incomplete=r"before \[DONE\]",
        too_long=(400, "maximum context length of 512 tokens"), unhealthy="HTTP 503",
        request_file="completions_request.json",
        stream_file=("completions_stream.sse", [1, 1, 1, 1, 0], 3, Usage(4, 4)),
        error_files=(
            ("queue_full_event.sse", 200, EngineRejected, 503, "The request queue is full"),
            ("error_event.sse", 200, EngineHTTPError, 400, "Detokenizer manager exited"),
            ("error_response_400.json", 400, EngineHTTPError, 400, "maximum context length"),
        ),
        metrics_file=("metrics.prom", {"running": 3, "waiting": 2, "kv_usage": 0.15, "kv_capacity_tokens": 8192,
                                       "preemptions": 1, "rejections": None}),
        readme="0.5.23",
    ),
    Row(
        "vllm", VLLMEngine, TINY, prompt_tokens=4, usage_chunk=True,
        full_status=429, full_text="server overloaded", kv_usage=used_tokens_share, counts_rejections=True,
        preemptions=0.0, idle_kv_usage=0.0, incomplete=r"before \[DONE\]",
        too_long=(400, "maximum context length is 512 tokens"), unhealthy="HTTP 503",
    ),
    Row(
        # Any OpenAI-compatible server: vLLM's shapes, no metrics batchbench can read, health from /v1/models.
        "openai", OpenAIServerEngine, TINY, prompt_tokens=4, usage_chunk=True,
        full_status=429, full_text="server overloaded", kv_usage=used_tokens_share, counts_rejections=False,
        preemptions=None, idle_kv_usage=None, incomplete=r"before \[DONE\]",
        too_long=(400, "maximum context length is 512 tokens"), unhealthy="HTTP 503",
    ),
]
WIRE_ROWS = [row for row in ROWS if row.readme is not None]


@pytest.fixture(params=ROWS, ids=str)
def row(request: pytest.FixtureRequest) -> Row:
    return request.param


@pytest.fixture
def server(row: Row) -> Iterator[ProtocolServer]:
    srv = row.server(**SERVER_SHAPE)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
async def engine(row: Row, server: ProtocolServer) -> AsyncIterator[ServedEngine]:
    assert server.url is not None
    async with row.make(server.url, startup_timeout=5) as eng:
        yield eng  # type: ignore[misc]


# ---------------------------------------------------------------- streaming


async def test_streams_exact_token_counts_and_the_engines_own_usage(row: Row, engine: ServedEngine) -> None:
    chunks = await collect(engine, request(max_tokens=6))
    token_chunks = chunks[:-1] if row.usage_chunk else chunks
    assert [c.n_tokens for c in token_chunks] == [1] * 6
    assert token_chunks[-1].finish_reason == "length"
    assert all(c.usage is None for c in chunks[:-1])
    # The prompt count is the engine's own (TGI: 4 words + BOS in the protocol server), never re-counted here.
    assert chunks[-1].usage == Usage(prompt_tokens=row.prompt_tokens, completion_tokens=6)
    if row.usage_chunk:
        assert chunks[-1].n_tokens == 0


async def test_chunk_timestamps_increase(row: Row, server: ProtocolServer, engine: ServedEngine) -> None:
    server.tune(token_delay=0.005)
    chunks = await collect(engine, request(max_tokens=8))
    times = [c.t for c in (chunks[:-1] if row.usage_chunk else chunks)]
    assert all(b > a for a, b in itertools.pairwise(times))
    assert chunks[-1].t >= times[-1]
    assert times[-1] - times[0] >= 7 * 0.004


async def test_concurrent_streams_each_get_their_own_tokens(row: Row, engine: ServedEngine) -> None:
    results = await asyncio.gather(*(collect(engine, request(f"c-{i}", max_tokens=2 + i)) for i in range(4)))
    for i, chunks in enumerate(results):
        assert sum(c.n_tokens for c in chunks) == 2 + i
        assert chunks[-1].usage == Usage(prompt_tokens=row.prompt_tokens, completion_tokens=2 + i)


# ---------------------------------------------------------------- metrics


async def test_metrics_match_the_servers_live_state(row: Row, server: ProtocolServer, engine: ServedEngine) -> None:
    if not row.adapter.capabilities.server_metrics:
        assert await engine.scrape() is None  # nothing it can read: the engine's description says what is missing
        assert "server metrics" in engine.describe()["unavailable"]
        return
    server.tune(token_delay=0.02)
    tasks = [asyncio.create_task(collect(engine, request(f"m-{i}", max_tokens=200))) for i in range(6)]
    try:
        await server.wait_until(lambda s: s["running"] == 4 and s["waiting"] == 2 and s["iteration"] >= 3)
        await asyncio.sleep(0.05)  # at least one step with this state reaches statistics read per step
        sample = await engine.scrape()
        state = server.state()
        assert sample is not None
        assert (sample.running, sample.waiting) == (4, 2)
        assert sample.kv_capacity_tokens == 4096
        for expected, tolerance in row.kv_usage(server, state):
            assert sample.kv_usage == pytest.approx(expected, abs=tolerance)
        assert sample.preemptions == row.preemptions
        assert sample.rejections == (0 if row.counts_rejections else None)

        # The queue is full: rejected, with the engine, the request and the engine's reason named.
        with pytest.raises(EngineRejected) as info:
            await collect(engine, request("over-1", max_tokens=2))
        assert info.value.status == row.full_status
        assert f"'{row.engine}'" in str(info.value) and "over-1" in str(info.value)
        assert row.full_text in str(info.value)
        sample = await engine.scrape()
        assert sample is not None and sample.rejections == (1 if row.counts_rejections else None)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await server.wait_until(lambda s: s["running"] == 0 and s["waiting"] == 0)
    await engine.scrape()  # drains statistics of the last busy steps where an engine keeps them (trtllm)
    idle = await engine.scrape()
    assert idle is not None and (idle.running, idle.waiting) == (0, 0)
    assert idle.kv_usage == row.idle_kv_usage and idle.kv_capacity_tokens == 4096


# ---------------------------------------------------------------- failures


@pytest.mark.parametrize("status", [429, 503])
async def test_overload_statuses_are_rejections_naming_engine_and_request(
    row: Row, server: ProtocolServer, engine: ServedEngine, status: int,
) -> None:
    server.fault = str(status)
    with pytest.raises(EngineRejected) as info:
        await collect(engine, request("rej-7"))
    assert info.value.status == status
    assert info.value.engine == row.engine and info.value.request_id == "rej-7"
    assert f"'{row.engine}'" in str(info.value) and "rej-7" in str(info.value)


async def test_malformed_event_is_a_protocol_error(server: ProtocolServer, engine: ServedEngine) -> None:
    server.fault = "malformed"
    with pytest.raises(StreamProtocolError, match="malformed stream event") as info:
        await collect(engine, request("bad-1"))
    assert info.value.request_id == "bad-1"


async def test_truncated_stream_is_a_protocol_error(server: ProtocolServer, engine: ServedEngine) -> None:
    server.fault = "truncated"
    with pytest.raises(StreamProtocolError, match="connection broke mid-stream"):
        await collect(engine, request("cut-1"))


async def test_stream_without_its_final_event_is_a_protocol_error(
    row: Row, server: ProtocolServer, engine: ServedEngine,
) -> None:
    server.fault = "incomplete"
    with pytest.raises(StreamProtocolError, match=row.incomplete):
        await collect(engine, request("short-1"))


async def test_too_long_a_request_is_an_http_error(row: Row, engine: ServedEngine) -> None:
    status, message = row.too_long
    with pytest.raises(EngineHTTPError, match=message) as info:
        await collect(engine, request("long-1", max_tokens=600))
    assert info.value.status == status


async def test_a_hanging_server_is_left_to_the_callers_deadline(server: ProtocolServer, engine: ServedEngine) -> None:
    server.fault = "hang"
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(collect(engine, request("hang-1")), 0.3)


async def test_wrong_url_is_unreachable_with_a_clear_message(row: Row) -> None:
    eng = row.make("http://127.0.0.1:9", startup_timeout=0.3)
    await eng.start()
    try:
        with pytest.raises(EngineUnreachable, match=r"cannot connect to http://127\.0\.0\.1:9") as info:
            await collect(eng, request("nowhere-1"))
        assert info.value.request_id == "nowhere-1"
        if row.adapter.capabilities.server_metrics:  # an engine without metrics reads nothing, so fails nothing
            with pytest.raises(EngineUnreachable, match="cannot connect"):
                await eng.scrape()
    finally:
        await eng.stop()
    with pytest.raises(EngineNotHealthy, match="cannot connect"):
        async with row.make("http://127.0.0.1:9", startup_timeout=0.3):
            pass
    with pytest.raises(EngineUnreachable, match="invalid URL"):
        row.make("engine-host:8080")


async def test_unhealthy_server_never_becomes_ready(row: Row, server: ProtocolServer) -> None:
    server.fault = "unhealthy"
    assert server.url is not None
    with pytest.raises(EngineNotHealthy, match=row.unhealthy):
        async with row.make(server.url, startup_timeout=0.3):
            pass


# ---------------------------------------------------------------- the server as a program


async def test_protocol_server_runs_as_a_module_for_url_mode(row: Row) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "batchbench.fixtures.protocol", row.engine, "--port", "0", "--token-delay", "0.001",
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
        url = line.strip().rsplit(" ", 1)[-1]
        assert url.startswith("http://127.0.0.1:"), line
        async with row.make(url, startup_timeout=5) as eng:
            chunks = await collect(eng, request(max_tokens=3))
        assert chunks[-1].usage == Usage(prompt_tokens=row.prompt_tokens, completion_tokens=3)
        async with make_client(url) as client, client.request("GET", row.adapter.health_path) as response:
            assert response.status == 200
    finally:
        proc.terminate()
        await proc.wait()


# ---------------------------------------------------------------- recorded wire formats


@pytest.mark.parametrize("row", WIRE_ROWS, ids=str)
def test_payload_is_the_recorded_request(row: Row) -> None:
    assert row.request_file is not None
    payload = row.make("http://engine.test").payload(request(prompt=(17, 203, 99, 1024), max_tokens=4))
    assert payload == json.loads((wire_dir(row.engine) / row.request_file).read_text())


@pytest.mark.parametrize("row", WIRE_ROWS, ids=str)
async def test_recorded_stream_parses_into_chunks(row: Row) -> None:
    assert row.stream_file is not None
    name, tokens, finish_at, usage = row.stream_file
    eng = row.make("http://engine.test")
    replay(eng, (wire_dir(row.engine) / name).read_bytes())
    chunks = await collect(eng, request(max_tokens=4))
    assert [c.n_tokens for c in chunks] == tokens
    assert chunks[finish_at].finish_reason == "length"
    assert chunks[-1].usage == usage
    await eng.client.aclose()


@pytest.mark.parametrize(("row", "name", "http_status", "error", "status", "text"), [
    (row, *case) for row in WIRE_ROWS for case in row.error_files
], ids=lambda v: str(v) if isinstance(v, Row | str) else None)
async def test_recorded_errors_map_to_error_types(
    row: Row, name: str, http_status: int, error: type[EngineError], status: int, text: str,
) -> None:
    eng = row.make("http://engine.test")
    replay(eng, (wire_dir(row.engine) / name).read_bytes(), status=http_status)
    with pytest.raises(error, match=text) as info:
        await collect(eng, request("rec-1"))
    assert isinstance(info.value, EngineRejected | EngineHTTPError)
    assert info.value.status == status and info.value.request_id == "rec-1"
    await eng.client.aclose()


@pytest.mark.parametrize("row", WIRE_ROWS, ids=str)
def test_recorded_metrics_normalize(row: Row) -> None:
    assert row.metrics_file is not None
    name, expected = row.metrics_file
    sample = row.make("http://engine.test").normalize(Samples.parse((wire_dir(row.engine) / name).read_text()))
    for key, value in expected.items():
        got = getattr(sample, key)
        assert got == (pytest.approx(value) if value is not None else None), key


@pytest.mark.parametrize("row", WIRE_ROWS, ids=str)
def test_recorded_files_parse(row: Row) -> None:
    wire = wire_dir(row.engine)
    for path in sorted(wire.glob("*.sse")):
        payloads = read_sse(path)
        assert payloads, path.name
        events = [json.loads(p) for p in payloads if p != "[DONE]"]
        assert events, path.name
    assert row.stream_file is not None
    stream = wire / row.stream_file[0]
    assert stream.read_text().startswith(row.sse_prefix + "{")  # TGI (axum) writes no space, the others do
    if row.usage_chunk:
        payloads = read_sse(stream)
        assert payloads[-1] == "[DONE]"
        last = json.loads(payloads[-2])
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
    for path in sorted(wire.glob("*.json")):
        assert isinstance(json.loads(path.read_text()), (dict, list)), path.name
    assert row.readme is not None and row.readme in (wire / "README.md").read_text()
