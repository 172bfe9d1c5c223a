"""The streaming POST of the OpenAI-compatible engines: one callback per read, no task woken per chunk.

This is the load generator's per-chunk path, so it is built for cost. Each connection is an
``asyncio.Protocol``: a read arrives in :meth:`_Connection.data_received`, is stamped once with
:func:`now`, parsed as HTTP by httptools (llhttp in C, the parser uvicorn uses: chunked transfer encoding,
keep-alive), split into Server-Sent Events (:class:`SSESplitter`) and each event handed to the caller's
handler right there. The task that sent the request sleeps until the response is complete.

A server that closes its connections after each streamed response (llama.cpp's ``llama-server`` does, although it
answers ``Keep-Alive``) makes a request written on a kept-alive connection meet a closed socket: no byte of an
answer comes back, so the server never saw it. Such a request is sent again once, on a fresh connection, with
its own send time (the time lost is not its TTFT), and counted (:attr:`StreamClient.resent`); from then on every
request gets a fresh connection (:attr:`StreamClient.fresh_only`, with why). A request that got any byte of an
answer is never sent again: the engine must not see a request twice.

Why not aiohttp here (it still serves every other request, :mod:`batchbench.adapters.http`): it hands a
body to its reader through a buffered StreamReader, wakes the reading task for each piece and passes the
piece up through async iterators; profiled at concurrency 64 (tests/test_loadgen_benchmark.py), that
machinery and the generator layers above it were over half of the client's CPU per chunk, and no
maintained client offers a body callback instead. What is written here is only the glue: a request head,
a pool of kept-alive connections, and errors mapped as :mod:`batchbench.adapters.http` maps them.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Mapping

import httptools
import yarl

from batchbench.adapters.auth import AUTH_STATUSES, Auth
from batchbench.adapters.base import EngineUnreachable, StreamProtocolError
from batchbench.adapters.http import CONNECT_TIMEOUT_S, connect_failure, refusal
from batchbench.adapters.sse import SSESplitter
from batchbench.core.clock import now

#: Reuse a kept-alive connection only this long after its last response: uvicorn (vLLM's, SGLang's server)
#: closes idle connections after 5 s (``timeout_keep_alive``), and other servers and proxies sooner.
MAX_IDLE_S = 2.0

#: A kept-alive connection the server closes this soon after a response was closed because of it: it closes its
#: connections after streams (an idle timeout closes them seconds later).
CLOSED_AFTER_RESPONSE_S = 0.5

#: Called with each event's ``data`` payload and the time its read arrived; what it raises ends the stream.
EventHandler = Callable[[bytes, float], None]
#: Most bytes of an error response kept for its message.
_ERROR_BODY_BYTES = 64 * 1024


class _Unanswered(StreamProtocolError):
    """The connection closed before any byte of an answer: the server did not take the request."""


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection; one exchange at a time (the pool hands it to one request)."""

    def __init__(self, pool: StreamClient) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.lost = False
        #: When it was last handed back to the pool (a connection idle too long is not reused), and when its last
        #: response was complete.
        self.idle_since = self.completed_at = 0.0
        self._done: asyncio.Future[None] | None = None

    def begin(self, on_event: EventHandler, request_id: str) -> asyncio.Future[None]:
        """Prepare for the next response: ``on_event`` gets its events; the future resolves when it is complete."""
        self._done = asyncio.get_running_loop().create_future()
        self._request_id = request_id
        self._parser = httptools.HttpResponseParser(self)
        self._on_event = on_event
        self._splitter = SSESplitter()
        self._bodies: list[bytes] = []  # the body's pieces in this read, split together once it is parsed
        self._t = 0.0
        self.status = 0
        self.keep_alive = False
        self._sized = False  # a Content-Length or chunked body: its end is in the bytes, not at close
        self.answered = False  # any byte of the response arrived
        self._error: BaseException | None = None
        self.error_body = bytearray()
        return self._done

    # ---------------------------------------------------------------- asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport: create_connection made it

    def data_received(self, data: bytes) -> None:
        if self._done is None or self._done.done():  # bytes nobody asked for: the connection is not reusable
            self.close()
            return
        self._t = now()
        self.answered = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._error = self._error or StreamProtocolError(self.pool.engine, f"malformed HTTP response ({exc})",
                                                             request_id=self._request_id)
        self._events()
        if self._error is not None:
            self._finish(self._error)

    def _events(self) -> None:
        """Hand the events completed by this read's body pieces (one piece per HTTP chunk) to the handler."""
        bodies = self._bodies
        if not bodies or self._error is not None:
            return
        body = bodies[0] if len(bodies) == 1 else b"".join(bodies)
        bodies.clear()
        try:
            for data in self._splitter.feed(body):
                self._on_event(data, self._t)
        except BaseException as exc:  # the handler's verdict (a malformed event, an error event, a cut)
            self._error = exc

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.pool.forget(self)
        if self._done is None or self._done.done():
            if self.completed_at and now() - self.completed_at < CLOSED_AFTER_RESPONSE_S and self.keep_alive:
                self.pool.closes_after_responses()  # it said keep-alive, then closed
            return
        if not self.answered:
            self._finish(_Unanswered(self.pool.engine, "the connection closed before any answer",
                                     request_id=self._request_id))
            return
        if self.status and not self._sized:  # a body that ends when the connection closes
            self.on_message_complete()
            return
        detail = f"{type(exc).__name__}: {exc}" if exc is not None else "closed by the server"
        self._finish(StreamProtocolError(self.pool.engine, f"connection broke mid-stream ({detail})",
                                         request_id=self._request_id))

    # ---------------------------------------------------------------- httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value.lower()):
            self._sized = True

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.keep_alive = self._parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        if self.status == 200:
            self._bodies.append(body)
        elif len(self.error_body) < _ERROR_BODY_BYTES:
            self.error_body += body

    def on_message_complete(self) -> None:
        self.completed_at = self._t
        self._events()
        if self._error is None and self.status == 200:
            try:
                for data in self._splitter.close():
                    self._on_event(data, self._t)
            except BaseException as exc:
                self._error = exc
        self._finish(self._error)

    # ---------------------------------------------------------------- ends

    def _finish(self, error: BaseException | None) -> None:
        assert self._done is not None
        if self._done.done():
            return
        if error is None:
            self._done.set_result(None)
        else:
            self.keep_alive = False
            self._done.set_exception(error)

    def close(self) -> None:
        self.keep_alive = False
        if self.transport is not None:
            self.transport.close()


class StreamClient:
    """POSTs that answer with an event stream, to one server, over a pool of kept-alive connections.

    The pool has no limit: the load generator bounds the requests in flight. Only connecting has a
    timeout: the load generator owns per-request deadlines, and a long decode legitimately goes quiet
    between chunks. A request is never retried (an engine must not see a request twice). Every request
    carries ``auth``'s headers, written into the request head once here rather than per request.
    """

    def __init__(self, engine: str, base_url: str, auth: Auth | None = None) -> None:
        self.engine = engine
        self.auth = auth or Auth()
        self._auth_head = "".join(f"{name}: {value}\r\n" for name, value in self.auth.http_headers().items())
        self.base_url = base_url.rstrip("/")
        url = yarl.URL(self.base_url)
        # yarl gives the scheme's default port where the URL names none (only a URL without a scheme has none).
        self._host, self._port = url.raw_host or "", url.port or 80
        self._ssl = ssl.create_default_context() if url.scheme == "https" else None
        self._prefix = url.raw_path.rstrip("/")
        authority = f"[{self._host}]" if ":" in self._host else self._host
        if url.explicit_port is not None:
            authority += f":{url.explicit_port}"
        self._authority = authority
        self._idle: list[_Connection] = []
        #: Requests sent again on a fresh connection after a kept-alive one closed unanswered (module docstring).
        self.resent = 0
        #: Why every request now gets a fresh connection (None: kept-alive connections are reused).
        self.fresh_only: str | None = None

    def closes_after_responses(self) -> None:
        """The server closed a kept-alive connection just after its response: reuse none from now on."""
        if self.fresh_only is None:
            self.fresh_only = ("the server closes its connections after a response, although it answers "
                               "keep-alive: a fresh connection per request since then")
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    async def post(self, path: str, body: bytes, *, on_event: EventHandler, request_id: str,
                   headers: Mapping[str, str] | None = None, on_sent: Callable[[float], None] | None = None) -> None:
        """POST a JSON ``body``; hand each event of the 200 response to ``on_event`` as its read arrives; return
        when the response is complete. ``on_sent`` gets the time just before the request is written. Failures
        are :mod:`batchbench.adapters.base` errors naming the engine and request (whatever ``on_event``
        raises is raised as it is)."""
        extra = "".join(f"{name}: {value}\r\n" for name, value in headers.items()) if headers else ""
        head = (f"POST {self._prefix}{path} HTTP/1.1\r\nHost: {self._authority}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n{self._auth_head}{extra}\r\n").encode("latin-1")
        conn, reused = await self._connection(request_id)
        try:
            await self._exchange(conn, head + body, on_event, request_id, on_sent)
        except _Unanswered:
            if not reused:
                raise
            # A kept-alive connection the server had closed: it never saw the request (module docstring).
            self.resent += 1
            self.closes_after_responses()
            conn, _ = await self._connection(request_id)
            await self._exchange(conn, head + body, on_event, request_id, on_sent)
        if conn.status != 200:
            where = f"{self.base_url}{path}" if conn.status in AUTH_STATUSES else path
            raise refusal(self.engine, conn.status, where, bytes(conn.error_body), self.auth, request_id=request_id)

    async def _exchange(self, conn: _Connection, request: bytes, on_event: EventHandler, request_id: str,
                        on_sent: Callable[[float], None] | None) -> None:
        """Write one request on ``conn`` and wait for its whole answer; keep the connection for the next where the
        server lets it be kept."""
        done = conn.begin(on_event, request_id)
        assert conn.transport is not None
        if on_sent is not None:
            on_sent(now())
        conn.transport.write(request)
        try:
            await done
        except BaseException:  # failed, or cancelled (the caller's deadline): the connection is in an unknown state
            conn.close()
            raise
        if conn.keep_alive and not conn.lost and self.fresh_only is None:
            conn.idle_since = now()
            self._idle.append(conn)
        else:
            conn.close()

    async def _connection(self, request_id: str) -> tuple[_Connection, bool]:
        """An idle kept-alive connection, else a new one; and whether it was kept alive (reused)."""
        while self._idle:
            conn = self._idle.pop()
            if conn.lost or conn.transport is None or conn.transport.is_closing():
                continue
            if now() - conn.idle_since > MAX_IDLE_S:
                # The server may be closing it this very moment: a request written into that close is reset
                # before any answer (seen in CI between runs), and requests are never retried.
                conn.close()
                continue
            return conn, True
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self), self._host, self._port, ssl=self._ssl,
                    server_hostname=self._host if self._ssl is not None else None,
                )
        except TimeoutError as exc:
            raise EngineUnreachable(self.engine, f"cannot connect to {self.base_url}: no connection within "
                                    f"{CONNECT_TIMEOUT_S:g}s", request_id=request_id) from exc
        except OSError as exc:  # refused, unreachable, does not resolve, TLS refused (ssl.SSLError is an OSError)
            raise connect_failure(self.engine, self.base_url, exc, request_id=request_id) from exc
        return conn, False

    def forget(self, conn: _Connection) -> None:
        """A connection closed: it is not handed out again."""
        if conn in self._idle:
            self._idle.remove(conn)

    async def aclose(self) -> None:
        """Close every idle connection (those in use close when their request ends)."""
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
