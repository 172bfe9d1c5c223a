"""HTTP plumbing shared by every networked adapter.

One place maps transport failures and HTTP status codes onto the
:mod:`adapters.base` error types, and one place splits a Server-Sent Events
body into events, so vLLM, TGI and TensorRT-LLM fail and stream the same way.
"""

from __future__ import annotations

import json
import socket
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from batchbench.adapters.base import (
    EngineHTTPError,
    EngineRejected,
    EngineUnreachable,
    StreamProtocolError,
)

#: Status codes an overloaded engine answers with; counted as rejections.
OVERLOAD_STATUSES = frozenset({429, 503})


def make_client(base_url: str, *, max_connections: int = 1024) -> httpx.AsyncClient:
    """A client sized so the connection pool never throttles the load generator.

    No read timeout: the load generator owns per-request deadlines, and a long
    decode legitimately goes quiet between chunks.
    """
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    timeout = httpx.Timeout(connect=10.0, read=None, write=30.0, pool=None)
    return httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout)


def check_url(engine: str, url: str) -> str:
    """Validate a user-given engine URL early, with a message that names it.

    The OpenAI-style base URL people paste (``http://host:port/v1``) is accepted: the adapters add
    their own paths (``/v1/completions``, ``/health``, ``/metrics``) to the server's root.
    """
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as exc:
        raise EngineUnreachable(engine, f"invalid URL {url!r}: {exc}", permanent=True) from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise EngineUnreachable(engine, f"invalid URL {url!r}: expected http(s)://host:port", permanent=True)
    root = str(parsed).rstrip("/")
    return root.removesuffix("/v1") if parsed.path.rstrip("/") == "/v1" else root


def _connect_failure(engine: str, client: httpx.AsyncClient, exc: httpx.HTTPError, *,
                     request_id: str | None = None) -> EngineUnreachable:
    """A transport failure as EngineUnreachable, permanent when waiting cannot fix it."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, socket.gaierror):
            return EngineUnreachable(engine, f"host {client.base_url.host!r} of {client.base_url} does not resolve "
                                     f"({cause})", request_id=request_id, permanent=True)
        if isinstance(cause, ssl.SSLError):
            return EngineUnreachable(engine, f"TLS handshake with {client.base_url} failed ({cause}); is it a "
                                     "plain-HTTP port (http://, not https://)?", request_id=request_id, permanent=True)
        cause = cause.__cause__ or cause.__context__
    return EngineUnreachable(engine, f"cannot connect to {client.base_url}: {exc}", request_id=request_id)


def _error_text(body: bytes) -> str:
    text = body.decode("utf-8", "replace").strip()
    try:
        doc = json.loads(text)
    except ValueError:
        # Not an engine's JSON error: an HTML page (a proxy, another server) says nothing in 500 characters.
        return " ".join(text[:200].split()) + (" ..." if len(text) > 200 else "")
    if isinstance(doc, dict):
        err = doc.get("error", doc.get("message", doc))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:500]
    return text[:500]


@asynccontextmanager
async def post_stream(
    client: httpx.AsyncClient, engine: str, path: str, payload: dict[str, Any], *, request_id: str,
    headers: dict[str, str] | None = None,
) -> AsyncIterator[httpx.Response]:
    """POST and yield the streaming response, with errors mapped to EngineError types."""
    try:
        async with client.stream("POST", path, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = await response.aread()
                message = f"HTTP {response.status_code} from {path}: {_error_text(body)}"
                if response.status_code in OVERLOAD_STATUSES:
                    raise EngineRejected(engine, message, status=response.status_code, request_id=request_id)
                raise EngineHTTPError(engine, message, status=response.status_code, request_id=request_id)
            yield response
    except httpx.ConnectError as exc:
        raise _connect_failure(engine, client, exc, request_id=request_id) from exc
    except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
        raise StreamProtocolError(
            engine, f"connection broke mid-stream ({type(exc).__name__}: {exc or 'no detail'})", request_id=request_id
        ) from exc


async def sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """Yield the ``data:`` payload of each Server-Sent Event as soon as it is complete.

    Events are separated by a blank line; multi-line data is joined with
    newlines; lines end with CRLF, LF or CR, as the SSE specification says.
    Comments and other fields are ignored.

    The body is split here, on bytes, rather than with httpx's ``aiter_lines``,
    which gets two things wrong for SSE (tests/test_sse.py): it splits text at
    every Unicode line break (U+2028, U+0085, ...), which JSON strings may hold
    unescaped, so generated text containing one broke the event; and it holds a
    CR that ends a read back until the next read shows whether an LF follows,
    so an event whose CRLF was torn across two reads was stamped only when the
    next bytes arrived. Here a CR ends the line at once and an LF opening the
    next read is dropped.
    """
    data: list[str] = []
    # The unfinished last line, appended to in place: a long line arriving in many reads costs its
    # length once, not once per read (``pending + piece`` copied it all again each time).
    pending = bytearray()
    skip_lf = False  # the last piece ended with CR: an LF opening the next one is the rest of that CRLF
    async for piece in response.aiter_bytes():
        if skip_lf and piece.startswith(b"\n"):
            piece = piece[1:]
        skip_lf = piece.endswith(b"\r")
        if b"\r" in piece:
            piece = piece.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        cut = piece.rfind(b"\n")
        if cut < 0:
            pending += piece
            continue
        pending += piece[:cut]
        lines = pending.split(b"\n")
        pending = bytearray(piece[cut + 1:])
        for line in lines:
            if not line:
                if data:
                    yield "\n".join(data)
                    data = []
            elif line.startswith(b"data:"):
                value = line[6:] if line.startswith(b"data: ") else line[5:]
                data.append(value.decode("utf-8", "replace"))
    if pending.startswith(b"data:"):
        data.append((pending[6:] if pending.startswith(b"data: ") else pending[5:]).decode("utf-8", "replace"))
    if data:
        yield "\n".join(data)


async def _get(client: httpx.AsyncClient, engine: str, path: str) -> httpx.Response:
    """GET ``path``; anything but a 200 is an EngineError (the body shortened, never a whole HTML page)."""
    try:
        response = await client.get(path)
    except httpx.ConnectError as exc:
        raise _connect_failure(engine, client, exc) from exc
    except httpx.HTTPError as exc:
        raise EngineUnreachable(engine, f"{path} failed: {type(exc).__name__}: {exc}") from exc
    if response.status_code != 200:
        raise EngineHTTPError(
            engine, f"HTTP {response.status_code} from {client.base_url}{path}: {_error_text(response.content)}",
            status=response.status_code,
        )
    return response


async def get_json(client: httpx.AsyncClient, engine: str, path: str) -> Any:
    """GET a JSON document, mapping failures to EngineError types."""
    response = await _get(client, engine, path)
    try:
        return response.json()
    except ValueError as exc:
        raise StreamProtocolError(engine, f"{path} did not return JSON: {response.text[:200]!r}") from exc


async def get_text(client: httpx.AsyncClient, engine: str, path: str) -> str:
    """GET a text document (health, /metrics), mapping failures to EngineError types."""
    return (await _get(client, engine, path)).text


async def post_text(client: httpx.AsyncClient, engine: str, path: str, *, params: dict[str, Any] | None = None) -> str:
    """POST without a body (an engine's control route), mapping failures to EngineError types."""
    try:
        response = await client.post(path, params=params)
    except httpx.ConnectError as exc:
        raise EngineUnreachable(engine, f"cannot connect to {client.base_url}: {exc}") from exc
    except httpx.HTTPError as exc:
        raise EngineUnreachable(engine, f"{path} failed: {type(exc).__name__}: {exc}") from exc
    if response.status_code != 200:
        raise EngineHTTPError(
            engine, f"HTTP {response.status_code} from {path}: {_error_text(response.content)}",
            status=response.status_code,
        )
    return response.text


def parse_json_event(engine: str, data: str, request_id: str) -> Any:
    """Decode one SSE data payload, naming the engine and request when it is not JSON."""
    try:
        return json.loads(data)
    except ValueError as exc:
        raise StreamProtocolError(engine, f"malformed stream event {data[:200]!r}", request_id=request_id) from exc
