"""Helpers the adapter tests share: requests, collecting a stream, a client that answers a recorded body."""

from __future__ import annotations

import httpx

from batchbench.adapters.base import Chunk, Engine
from batchbench.workload import Request


def request(rid: str = "req-1", prompt: tuple[int, ...] = (11, 12, 13, 14), max_tokens: int = 6) -> Request:
    return Request(rid, prompt, max_tokens)


async def collect(engine: Engine, req: Request) -> list[Chunk]:
    return [chunk async for chunk in engine.stream(req)]


def recorded(body: bytes, status: int = 200, content_type: str = "text/event-stream") -> httpx.AsyncClient:
    """A client whose every answer is a recorded body."""
    def handler(_: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=body, headers={"content-type": content_type})
    return httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://engine.test")
