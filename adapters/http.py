"""HTTP plumbing shared by every networked adapter.

One client per engine (:class:`HttpClient`, one aiohttp session and its connection pool), one
place that maps transport failures and HTTP status codes onto the :mod:`adapters.base` error
types, and one place that splits a Server-Sent Events body into events, so vLLM, TGI, SGLang and
TensorRT-LLM connect, fail and stream the same way.

aiohttp rather than httpx: on the streaming path, which runs once per chunk, httpx + httpcore + h11
cost the load generator about half of its CPU per chunk (tests/test_loadgen_benchmark.py, profiled
in the commit that moved here); httpcore also wrote a request's headers and body in two writes with
an event-loop turn between, and assigned requests to pooled connections in O(connections x queued).
aiohttp parses responses in C and writes headers and body in one write.
"""

from __future__ import annotations

import asyncio
import errno
import json
import socket
import ssl
from collections.abc import AsyncIterable, AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from types import SimpleNamespace
from typing import Any, Protocol, cast

import aiohttp
import yarl

from batchbench.adapters.auth import AUTH_STATUSES, Auth, auth_failure
from batchbench.adapters.base import (
    ConnectionRefused,
    EngineError,
    EngineHTTPError,
    EngineRejected,
    EngineUnreachable,
    StreamProtocolError,
)
from batchbench.adapters.sse import SSESplitter
from batchbench.core.clock import now

try:  # orjson parses a stream event several times faster than json; it is optional
    import orjson
except ImportError:  # pragma: no cover - exercised where orjson is not installed
    orjson = None  # type: ignore[assignment]

#: Status codes an overloaded engine answers with; counted as rejections.
OVERLOAD_STATUSES = frozenset({429, 503})
#: Seconds to open a connection. A stream has no other client-side timeout (see :class:`HttpClient`).
CONNECT_TIMEOUT_S = 10.0
#: Seconds a whole-document request (health, /v1/models, /metrics, a control route) may take: these answer at
#: once on a live server, and one that never answers must not hold up an engine's start or a run's end.
CALL_TIMEOUT_S = 30.0
_JSON_HEADERS = {"Content-Type": "application/json"}


class SentStamp:
    """When a request's bytes were handed to the socket: :func:`now` just before the write, None until then.

    The load generator stamps a request before the adapter even builds it; this stamp is the latest
    the client can take, so the time the client spent preparing a request, finding a connection and
    getting through the event loop is not counted as the engine's latency.
    """

    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t: float | None = None


async def _stamp_sent(session: aiohttp.ClientSession, ctx: SimpleNamespace,
                      params: aiohttp.TraceRequestChunkSentParams) -> None:
    """aiohttp's hook just before a body is written (headers and body go out together, in one write)."""
    stamp = ctx.trace_request_ctx
    if stamp is not None and stamp.t is None:
        stamp.t = now()


class ByteStream(Protocol):
    def iter_any(self) -> AsyncIterator[bytes]:
        """Each piece of the body as soon as it arrives."""


class Response(Protocol):
    """What the adapters use of a response (aiohttp's ``ClientResponse`` is one)."""

    status: int
    content: ByteStream

    async def read(self) -> bytes:
        """The whole body."""


class HttpClient:
    """An engine's HTTP client: one aiohttp session, so every request reuses one connection pool.

    The pool has no limit of its own: the load generator bounds the requests in flight, and a pool
    smaller than that bound would queue requests where the load generator cannot see it. Only
    connecting has a timeout: the load generator owns per-request deadlines, and a long decode
    legitimately goes quiet between chunks. The session is opened on first use, inside the running
    event loop, as aiohttp requires. Every request carries ``auth``'s headers (an API key, the user's own).
    """

    def __init__(self, base_url: str, auth: Auth | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.auth = auth or Auth()
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[str, yarl.URL] = {}

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            trace = aiohttp.TraceConfig()
            trace.on_request_chunk_sent.append(_stamp_sent)
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S),
                trace_configs=[trace],
                headers=self.auth.http_headers(),
            )
        return self._session

    def url(self, path: str) -> yarl.URL:
        """The server's root joined with ``path`` (a root that has a path prefix keeps it), built once per path."""
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = yarl.URL(self.base_url + path, encoded="%" in path)
        return url

    def request(
        self, method: str, path: str, *, body: bytes | None = None, params: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None, sent: SentStamp | None = None,
    ) -> AbstractAsyncContextManager[Response]:
        """``async with client.request(...) as response``; ``sent`` is stamped just before the body is written."""
        return cast("AbstractAsyncContextManager[Response]", self._open().request(
            method, self.url(path), data=body, params=params, headers=headers, trace_request_ctx=sent))

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> HttpClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def make_client(base_url: str, auth: Auth | None = None) -> HttpClient:
    """The client an engine at ``base_url`` is reached with, sending ``auth``'s headers."""
    return HttpClient(base_url, auth)


def refusal(engine: str, status: int, where: str, body: bytes, auth: Auth, *,
            request_id: str | None = None) -> EngineError:
    """A non-success answer from ``where`` as an error naming it: 401/403 as the endpoint wanting credentials (or
    refusing those sent), an overload as a rejection, anything else as an HTTP error; the server's words
    shortened and stripped of every secret sent."""
    detail = auth.redact(error_text(body))
    if status in AUTH_STATUSES:
        return auth_failure(engine, status, where, sent_key=auth.sends_credentials, detail=detail,
                            request_id=request_id)
    message = f"HTTP {status} from {where}: {detail}"
    if status in OVERLOAD_STATUSES:
        return EngineRejected(engine, message, status=status, request_id=request_id)
    return EngineHTTPError(engine, message, status=status, request_id=request_id)


def check_url(engine: str, url: str) -> str:
    """Validate a user-given engine URL early, with a message that names it.

    The OpenAI-style base URL people paste (``http://host:port/v1``) is accepted: the adapters add
    their own paths (``/v1/completions``, ``/health``, ``/metrics``) to the server's root.
    """
    try:
        parsed = yarl.URL(url)
        parsed.port  # noqa: B018 - a port that is not a number raises here
    except (ValueError, TypeError) as exc:
        raise EngineUnreachable(engine, f"invalid URL {url!r}: {exc}", permanent=True) from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise EngineUnreachable(engine, f"invalid URL {url!r}: expected http(s)://host:port", permanent=True)
    root = str(parsed).rstrip("/")
    return root.removesuffix("/v1") if parsed.path.rstrip("/") == "/v1" else root


def connect_failure(engine: str, base_url: str, exc: BaseException, *,
                    request_id: str | None = None) -> EngineUnreachable:
    """A failure to connect to ``base_url`` as EngineUnreachable, permanent when waiting cannot fix it."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, socket.gaierror | aiohttp.ClientConnectorDNSError):
            return EngineUnreachable(engine, f"host {yarl.URL(base_url).host!r} of {base_url} does not resolve "
                                     f"({cause})", request_id=request_id, permanent=True)
        if isinstance(cause, ssl.SSLError | aiohttp.ClientSSLError):
            return EngineUnreachable(engine, f"TLS handshake with {base_url} failed ({cause}); is it a "
                                     "plain-HTTP port (http://, not https://)?", request_id=request_id, permanent=True)
        if isinstance(cause, ConnectionRefusedError) or getattr(cause, "errno", None) == errno.ECONNREFUSED:
            return ConnectionRefused(engine, f"cannot connect to {base_url}: connection refused",
                                     request_id=request_id)
        cause = cause.__cause__ or cause.__context__
    return EngineUnreachable(engine, f"cannot connect to {base_url}: {exc}", request_id=request_id)


def loads(data: str | bytes | bytearray) -> Any:
    """Parse JSON: with orjson where installed, falling back to json for what orjson refuses and json reads
    (NaN, lone surrogates), so the choice of parser does not change what parses. One difference remains:
    orjson reads an integer beyond 64 bits as a float; the events read here carry none (token ids, counts)."""
    if orjson is not None:
        try:
            return orjson.loads(data)
        except ValueError:
            pass
    if not isinstance(data, str):  # what orjson refused as UTF-8 reads as the text a decoder would make of it
        data = bytes(data).decode("utf-8", "replace")
    return json.loads(data)


def dumps(doc: Any) -> bytes:
    """Serialise a request body (orjson where installed)."""
    if orjson is not None:
        return orjson.dumps(doc)
    return json.dumps(doc, separators=(",", ":")).encode()


def error_text(body: bytes) -> str:
    """An error body as a short message: an engine's JSON error message, else the start of the text."""
    text = body.decode("utf-8", "replace").strip()
    try:
        doc = loads(text)
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
    client: HttpClient, engine: str, path: str, payload: dict[str, Any], *, request_id: str,
    headers: dict[str, str] | None = None, sent: SentStamp | None = None,
) -> AsyncIterator[AsyncIterator[bytes]]:
    """POST a JSON body and yield the response body's pieces as they arrive, errors mapped to EngineError types.

    ``sent`` is stamped just before the request is written.
    """
    all_headers = _JSON_HEADERS if headers is None else {**_JSON_HEADERS, **headers}
    try:
        async with client.request("POST", path, body=dumps(payload), headers=all_headers, sent=sent) as response:
            if response.status != 200:
                where = f"{client.base_url}{path}" if response.status in AUTH_STATUSES else path
                raise refusal(engine, response.status, where, await response.read(), client.auth,
                              request_id=request_id)
            yield response.content.iter_any()
    except aiohttp.ClientConnectorError as exc:
        raise connect_failure(engine, client.base_url, exc, request_id=request_id) from exc
    except aiohttp.ServerTimeoutError as exc:  # only connecting has a timeout
        raise EngineUnreachable(engine, f"cannot connect to {client.base_url}: no connection within "
                                f"{CONNECT_TIMEOUT_S:g}s", request_id=request_id) from exc
    except aiohttp.ClientError as exc:
        raise StreamProtocolError(
            engine, f"connection broke mid-stream ({type(exc).__name__}: {exc or 'no detail'})", request_id=request_id
        ) from exc


async def sse_data(pieces: AsyncIterable[bytes]) -> AsyncIterator[str]:
    """Yield the ``data:`` payload of each Server-Sent Event as soon as it is complete (:class:`SSESplitter`),
    decoded; ``pieces`` is the body as it arrives (reads of any size)."""
    splitter = SSESplitter()
    async for piece in pieces:
        for data in splitter.feed(piece):
            yield data.decode("utf-8", "replace")
    for data in splitter.close():
        yield data.decode("utf-8", "replace")


async def _call(client: HttpClient, engine: str, method: str, path: str, *,
                params: Mapping[str, Any] | None = None, body: Any = None,
                timeout_s: float = CALL_TIMEOUT_S) -> bytes:
    """One whole request (with ``body`` as JSON where given), answered within ``timeout_s``; anything but a 200
    is an EngineError (the body shortened, never a whole HTML page)."""
    data = None if body is None else dumps(body)
    headers = None if body is None else {"Content-Type": "application/json"}
    try:
        async with asyncio.timeout(timeout_s), client.request(method, path, params=params, body=data,
                                                              headers=headers) as response:
            status, body = response.status, await response.read()
    except aiohttp.ClientConnectorError as exc:
        raise connect_failure(engine, client.base_url, exc) from exc
    except aiohttp.ClientError as exc:
        raise EngineUnreachable(engine, f"{path} failed: {type(exc).__name__}: {exc}") from exc
    except TimeoutError as exc:
        raise EngineUnreachable(engine, f"{method} {client.base_url}{path} sent no answer within {timeout_s:g}s") \
            from exc
    if status != 200:
        error = refusal(engine, status, f"{client.base_url}{path}", body, client.auth)
        if isinstance(error, EngineRejected):  # whole-document routes: an overload is an HTTP error like any other
            error = EngineHTTPError(engine, error.detail, status=status)
        raise error
    return body


async def get_json(client: HttpClient, engine: str, path: str) -> Any:
    """GET a JSON document, mapping failures to EngineError types."""
    body = await _call(client, engine, "GET", path)
    try:
        return loads(body)
    except ValueError as exc:
        raise StreamProtocolError(engine, f"{path} did not return JSON: {body[:200]!r}") from exc


async def post_json(client: HttpClient, engine: str, path: str, body: Any, *,
                    timeout_s: float = CALL_TIMEOUT_S) -> Any:
    """POST a JSON document and read the JSON answer, mapping failures to EngineError types."""
    answer = await _call(client, engine, "POST", path, body=body, timeout_s=timeout_s)
    try:
        return loads(answer)
    except ValueError as exc:
        raise StreamProtocolError(engine, f"{path} did not return JSON: {answer[:200]!r}") from exc


async def get_text(client: HttpClient, engine: str, path: str, *, timeout_s: float = CALL_TIMEOUT_S) -> str:
    """GET a text document (health, /metrics) within ``timeout_s``, mapping failures to EngineError types."""
    return (await _call(client, engine, "GET", path, timeout_s=timeout_s)).decode("utf-8", "replace")


async def post_text(client: HttpClient, engine: str, path: str, *, params: dict[str, Any] | None = None) -> str:
    """POST without a body (an engine's control route), mapping failures to EngineError types."""
    return (await _call(client, engine, "POST", path, params=params)).decode("utf-8", "replace")


def parse_json_event(engine: str, data: str | bytes, request_id: str) -> Any:
    """Decode one SSE data payload, naming the engine and request when it is not JSON."""
    try:
        return loads(data)
    except ValueError as exc:
        shown = data[:200] if isinstance(data, str) else bytes(data[:200]).decode("utf-8", "replace")
        raise StreamProtocolError(engine, f"malformed stream event {shown!r}", request_id=request_id) from exc
