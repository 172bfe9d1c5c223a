"""The fast stream server (batchbench.fixtures.protocol.fast): vLLM's stream as the adapter reads it, on its grid.

Timing is checked on medians with millisecond tolerances (a loaded 2-core machine delays single chunks by
more, rarely the median), against the nominal grid and against the server's own account of what it did.
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from batchbench import selftest
from batchbench.adapters import stream_client
from batchbench.adapters.vllm import VLLMEngine
from batchbench.core.config import ModelRef
from batchbench.core.records import RequestRecord
from batchbench.fixtures.protocol import fast
from batchbench.load.loadgen import LoadGenerator
from batchbench.workload.requests import Arrival, Lengths, WorkloadSpec

SETTINGS = selftest.Settings(ttft_s=0.02, interval_s=0.01)


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """In a process of its own, so the client under test does not share its loop or CPU time."""
    with selftest.fast_server(SETTINGS) as url:
        yield url


async def stream(url: str, requests: int, concurrency: int, tokens: int, prompt: int = 7) -> list[RequestRecord]:
    workload = WorkloadSpec("fast", requests, prompt=Lengths.fixed(prompt), output=Lengths.fixed(tokens),
                            arrival=Arrival("closed", concurrency=concurrency)).build()
    async with VLLMEngine(model=ModelRef(""), url=url) as engine:  # the model the server lists
        return await LoadGenerator(engine, workload).run()


def truth(url: str) -> dict[str, Any]:
    return dict(httpx.get(url + "/batchbench/truth").json())


async def test_the_vllm_adapter_reads_exact_counts_and_the_finish_reason(server: str) -> None:
    records = await stream(server, requests=3, concurrency=3, tokens=5, prompt=11)
    for r in records:
        assert r.ok, r.error
        assert r.chunk_tokens == [1] * 5 and r.completion_tokens == 5 and r.prompt_tokens == 11
        assert r.finish_reason == "length"


def events(url: str, **fields: Any) -> list[Any]:
    body = {"model": "m", "prompt": [5, 6], "max_tokens": 2, "stream": True} | fields
    text = httpx.post(url + "/v1/completions", json=body).text
    payloads = [block.removeprefix("data: ") for block in text.split("\n\n") if block]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def test_its_chunks_are_vllms(server: str) -> None:
    """vLLM 0.32's shapes (serving.py: the chunk dumped with exclude_unset, so every choice field and usage only
    when continuous; the usage chunk with exclude_none)."""
    first, last, usage = events(server, stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert list(first) == ["id", "object", "created", "model", "choices", "usage"] and first["model"] == "m"
    assert list(first["choices"][0]) == ["index", "text", "logprobs", "finish_reason", "stop_reason",
                                         "prompt_token_ids", "token_ids"]
    assert first["usage"] == {"prompt_tokens": 2, "total_tokens": 3, "completion_tokens": 1}
    assert [first["choices"][0]["finish_reason"], last["choices"][0]["finish_reason"]] == [None, "length"]
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 2, "total_tokens": 4, "completion_tokens": 2}
    first, last = events(server, return_token_ids=True)
    assert "usage" not in first and first["choices"][0]["prompt_token_ids"] == [5, 6]
    assert last["choices"][0]["prompt_token_ids"] is None and len(last["choices"][0]["token_ids"]) == 1
    (only,) = events(server, return_token_ids=True, max_tokens=1)  # the echo beside the end of the stream
    assert only["choices"][0]["prompt_token_ids"] == [5, 6] and only["choices"][0]["finish_reason"] == "length"


async def test_ttft_and_itl_are_its_grid_and_its_own_account(server: str) -> None:
    truth(server)  # forget what came before
    records = await stream(server, requests=16, concurrency=8, tokens=20)
    told = truth(server)
    assert told["chunks"] == 16 * 20
    server_ttft, server_itl = told["ttft_s"]["p50"], told["itl_s"]["p50"]
    # The arrival rounds to the nearest 1 ms tick, and a timer fires up to about a millisecond late on a quiet
    # machine; at a load average of 5 on two cores the server's own TTFT p50 was 24 ms and its ITL p50 11 ms.
    assert 0.0195 <= server_ttft < 0.030 and abs(server_itl - 0.010) < 0.0025, told
    ttft = statistics.median(r.ttft_s for r in records if r.ttft_s is not None)
    itl = statistics.median(b - a for r in records for a, b in zip(r.chunk_times, r.chunk_times[1:]))
    # The client's clock starts before the request leaves and stops after the chunk arrives.
    assert 0 <= ttft - server_ttft < 0.005 and abs(itl - server_itl) < 0.002, (ttft, itl, told)


async def test_concurrent_streams_each_get_every_token(server: str) -> None:
    truth(server)
    records = await stream(server, requests=256, concurrency=128, tokens=8)
    assert len(records) == 256 and all(r.ok and r.chunk_tokens == [1] * 8 for r in records)
    assert truth(server)["chunks"] == 256 * 8


def test_a_model_is_discovered_and_metrics_scraped(server: str) -> None:
    async def check() -> None:
        async with VLLMEngine(model=ModelRef(""), url=server) as engine:
            assert engine.model.request_name == selftest.MODEL
            metrics = await engine.scrape()
            assert metrics is not None and metrics.running == 0

    asyncio.run(check())


def test_timing_off_its_grid_is_refused() -> None:
    with pytest.raises(ValueError, match="interval"):
        fast.Timing(ttft_s=0.02, interval_s=0.0005)
    assert fast.ticks(0.01) == 10


class InThread:
    """The server on a thread of this process, with every exception its loop sees collected."""

    def __init__(self) -> None:
        self.errors: list[dict[str, Any]] = []
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(lambda loop, context: self.errors.append(context))
        self.server = fast.FastServer(timing=fast.Timing(ttft_s=0.002, interval_s=0.002))
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def leave_mid_stream(url: str, *, reset: bool) -> None:
    """Ask for 500 tokens, read the first chunk, and go: closed cleanly, or reset (SO_LINGER 0)."""
    host, port = url.removeprefix("http://").split(":")
    body = b'{"model":"m","prompt":[1],"max_tokens":500,"stream":true}'
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        received = b""
        while b"data:" not in received:
            received += sock.recv(65536)
        if reset:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def test_a_client_that_leaves_mid_stream_does_not_break_it() -> None:
    served = InThread()
    try:
        leave_mid_stream(served.url, reset=False)
        leave_mid_stream(served.url, reset=True)
        records = asyncio.run(stream(served.url, requests=4, concurrency=2, tokens=10))
        assert all(r.ok and r.completion_tokens == 10 for r in records)
        deadline = time.monotonic() + 5  # the streams left behind are dropped once the loss reaches the server
        while served.server.running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert served.server.running == 0
        assert not served.errors, served.errors
    finally:
        served.close()


async def test_a_connection_idle_past_the_limit_is_not_reused(server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kept-alive connection is reused while fresh, and replaced once it has been idle longer than a server
    may keep it open (uvicorn closes at 5 s; writing into that close resets the request)."""
    client = stream_client.StreamClient("vllm", server)
    body = json.dumps({"model": "fake-model", "prompt": [5, 6, 7], "max_tokens": 2, "stream": True}).encode()
    try:
        await client.post("/v1/completions", body, on_event=lambda data, t: None, request_id="r0")
        (first,) = client._idle
        await client.post("/v1/completions", body, on_event=lambda data, t: None, request_id="r1")
        assert client._idle == [first]  # fresh: reused
        monkeypatch.setattr(stream_client, "MAX_IDLE_S", 0.0)
        await asyncio.sleep(0.01)
        await client.post("/v1/completions", body, on_event=lambda data, t: None, request_id="r2")
        assert len(client._idle) == 1 and client._idle[0] is not first and first.transport.is_closing()
    finally:
        await client.aclose()
