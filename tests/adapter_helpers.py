"""Helpers the adapter tests share: requests, collecting a stream, waiting on the metrics, a client that answers a
recorded body."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from batchbench.adapters.base import Chunk, Engine
from batchbench.adapters.http import HttpClient
from batchbench.adapters.launch import llamacpp_build
from batchbench.adapters.openai_compat import OpenAICompletionsEngine
from batchbench.adapters.stream_client import StreamClient, _Connection
from batchbench.core.clock import now
from batchbench.core.server_metrics import ServerMetrics
from batchbench.results import document as results
from batchbench.workload.requests import Request


def request(rid: str = "req-1", prompt: tuple[int, ...] = (11, 12, 13, 14), max_tokens: int = 6) -> Request:
    return Request(rid, prompt, max_tokens)


async def collect(engine: Engine, req: Request) -> list[Chunk]:
    return [chunk async for chunk in engine.stream(req)]


async def scrape_until(engine: Engine, settled: Callable[[ServerMetrics], bool], *, timeout_s: float = 5.0,
                       every_s: float = 0.02) -> ServerMetrics | None:
    """The engine's metrics once ``settled`` holds for them, else the last read when ``timeout_s`` runs out (None:
    it has none). A stream ends with its last token a moment before the engine's own bookkeeping of it does."""
    deadline = now() + timeout_s
    while (sample := await engine.scrape()) is not None and not settled(sample) and now() < deadline:
        await asyncio.sleep(every_s)
    return sample


class RecordedAnswer:
    """A response holding a recorded body, delivered in one piece (the shape of aiohttp's ClientResponse the
    adapters use: ``status``, ``read()``, ``content.iter_any()``)."""

    def __init__(self, status: int, body: bytes) -> None:
        self.status, self.body = status, body
        self.content = self

    async def __aenter__(self) -> RecordedAnswer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def read(self) -> bytes:
        return self.body

    async def iter_any(self) -> AsyncIterator[bytes]:
        yield self.body


class Recorded(HttpClient):
    """A client whose every answer is a recorded body, without a connection."""

    def __init__(self, body: bytes, status: int) -> None:
        super().__init__("http://engine.test")
        self.body, self.status = body, status

    def request(self, method: str, path: str, **options: Any) -> RecordedAnswer:  # type: ignore[override]
        return RecordedAnswer(self.status, self.body)


def recorded(body: bytes, status: int = 200) -> Recorded:
    """A client whose every answer is a recorded body."""
    return Recorded(body, status)


class _ReplayTransport(asyncio.Transport):
    """Answers the request written to it with a recorded HTTP response, in one read."""

    def __init__(self, conn: _Connection, response: bytes) -> None:
        super().__init__()
        self.conn, self.response, self.closed = conn, response, False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        asyncio.get_running_loop().call_soon(self.conn.data_received, self.response)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


class RecordedStreams(StreamClient):
    """The streaming client answering every POST with a recorded body: the real HTTP and SSE parsing and
    error mapping, without a socket."""

    def __init__(self, engine: str, body: bytes, status: int) -> None:
        super().__init__(engine, "http://engine.test")
        self.response = f"HTTP/1.1 {status} Recorded\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body

    async def _connection(self, request_id: str) -> tuple[_Connection, bool]:
        conn = _Connection(self)
        conn.connection_made(_ReplayTransport(conn, self.response))
        return conn, False


def replay(engine: Engine, body: bytes, status: int = 200) -> None:
    """Make every answer ``engine`` gets a recorded body: its client's, and its stream's where it has its own."""
    engine.client = recorded(body, status)  # type: ignore[attr-defined]
    if isinstance(engine, OpenAICompletionsEngine):
        engine.streams = RecordedStreams(engine.name, body, status)

def bench_openai(tmp_path: Path, *argv: str) -> tuple[subprocess.CompletedProcess[str], list[results.RunDocument]]:
    """``batchbench bench ARGV`` run as a user runs it, its results in ``tmp_path``: how it ended, and the generic
    engine's results documents (for the tests of real servers reached as ``--engine openai``)."""
    done = subprocess.run([sys.executable, "-m", "batchbench", "bench", *argv, "--results-dir", str(tmp_path),
                           "--no-report"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    return done, [results.load(p) for p in sorted(tmp_path.glob("bench-*/openai_*.json"))]


def llamacpp_server() -> Path:
    """The llama.cpp server built here; skips where it is not (fails with ``BATCHBENCH_REQUIRE_LLAMACPP=1``, which
    ``.ci/run`` sets: there its tests must run)."""
    if llamacpp_build.built() is None:
        reason = "llama.cpp's server is not built here (./bootstrap.sh builds it)"
        if os.environ.get("BATCHBENCH_REQUIRE_LLAMACPP") == "1":
            pytest.fail(f"BATCHBENCH_REQUIRE_LLAMACPP=1, but {reason}", pytrace=False)
        pytest.skip(reason)
    return llamacpp_build.server_path()
