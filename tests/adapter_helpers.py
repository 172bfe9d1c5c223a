"""Helpers the adapter tests share: requests, collecting a stream, a client that answers a recorded body."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from batchbench.adapters.base import Chunk, Engine
from batchbench.adapters.http import HttpClient
from batchbench.workload import Request


def request(rid: str = "req-1", prompt: tuple[int, ...] = (11, 12, 13, 14), max_tokens: int = 6) -> Request:
    return Request(rid, prompt, max_tokens)


async def collect(engine: Engine, req: Request) -> list[Chunk]:
    return [chunk async for chunk in engine.stream(req)]


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
