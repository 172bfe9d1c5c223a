"""The OpenAI-compatible streaming completions protocol, shared by vLLM and trtllm-serve.

Both servers stream ``POST /v1/completions`` as Server-Sent Events: one
``data:`` JSON object per chunk with ``choices``, a last chunk with
``choices: []`` and the engine's own ``usage`` (asked for with
``stream_options.include_usage``), then ``data: [DONE]``. Subclasses give
the request body (:meth:`payload`); the stream, the token counting and the
error mapping are the same for both and live here once. An engine whose
capabilities list the ``chat`` endpoint is sent ``POST /v1/chat/completions``
instead when asked (``--endpoint chat``), through :mod:`batchbench.adapters.chat`.
"""

from __future__ import annotations

import functools
from abc import abstractmethod
from collections.abc import AsyncIterator, Sequence
from typing import Any, ClassVar

from batchbench.adapters.base import (
    Chunk,
    ChunkSink,
    EngineError,
    EngineHTTPError,
    EngineRejected,
    StreamProtocolError,
    Usage,
    chunks_of,
    server_timings,
)
from batchbench.adapters.chat import CHAT_PATH, ChatEvents, chat_body, token_ids_text
from batchbench.adapters.http import OVERLOAD_STATUSES, dumps, parse_json_event
from batchbench.adapters.served import ServedEngine
from batchbench.adapters.stream_client import StreamClient
from batchbench.workload.requests import Request


class OpenAICompletionsEngine(ServedEngine):
    completions_path: ClassVar[str] = "/v1/completions"
    chat_path: ClassVar[str] = CHAT_PATH
    #: The completions stream's own client (health, metrics and control routes go through ``client``).
    streams: StreamClient | None = None

    @abstractmethod
    def payload(self, request: Request) -> dict[str, Any]:
        """The JSON body: token-id prompt, exact output length, streaming with usage."""

    def chat_payload(self, request: Request) -> dict[str, Any]:
        """The chat completions body (:func:`~batchbench.adapters.chat.chat_body`): messages, an exact output length,
        streaming with usage."""
        return chat_body(self.model.request_name, request, self.prompt_text)

    def prompt_text(self, token_ids: Sequence[int]) -> str:
        """A chat prompt's text where a request has token ids alone (the warm-up): the served model's tokenizer's
        decoding where known, else the ids as numbers."""
        return self.text_tokenizer.decode(token_ids) if self.text_tokenizer is not None else token_ids_text(token_ids)

    def request_headers(self, request: Request) -> dict[str, str] | None:
        return None

    async def start(self) -> None:
        await super().start()
        assert self.base_url is not None
        self.streams = StreamClient(self.name, self.base_url, self.auth)

    async def stop(self) -> None:
        if self.streams is not None:
            await self.streams.aclose()
            self.streams = None
        await super().stop()

    def url_twin(self) -> OpenAICompletionsEngine:
        """As :meth:`ServedEngine.url_twin`, without this engine's stream client: the twin opens its own."""
        twin = super().url_twin()
        assert isinstance(twin, OpenAICompletionsEngine)
        twin.streams = None
        return twin

    async def report(self) -> dict[str, Any]:
        """How the server treated kept-alive connections, where it closed them after responses
        (:attr:`StreamClient.fresh_only`): said once in the run's notes."""
        report = await super().report()
        if self.streams is not None and self.streams.fresh_only is not None:
            report["connections"] = self.streams.fresh_only
        return report

    def stream(self, request: Request) -> AsyncIterator[Chunk]:
        return chunks_of(functools.partial(self.stream_into, request))

    async def stream_into(self, request: Request, sink: ChunkSink) -> None:
        """Each event is read as its bytes arrive (:class:`StreamClient`) and goes straight to ``sink``."""
        assert self.streams is not None, "stream_into() before start()"
        if self.endpoint == "chat":
            await self._stream_chat(request, sink)
            return
        rid = request.request_id
        events = _CompletionEvents(self, rid, sink)
        async with self.failures_explained(rid):
            await self.streams.post(self.completions_path, dumps(self.payload(request)), on_event=events.read,
                                    request_id=rid, headers=self.request_headers(request), on_sent=sink.sent)
        events.end()
        if not events.got_usage:
            raise StreamProtocolError(
                self.name, "no usage before [DONE], on an event of its own or the last choice "
                "(stream_options.include_usage ignored?)", request_id=rid,
            )

    async def _stream_chat(self, request: Request, sink: ChunkSink) -> None:
        """One chat completions request, its events read as they arrive (:class:`ChatEvents`)."""
        assert self.streams is not None
        rid = request.request_id
        events = ChatEvents(self, rid, sink, self.text_tokenizer.count if self.text_tokenizer is not None else None)
        async with self.failures_explained(rid):
            await self.streams.post(self.chat_path, dumps(self.chat_payload(request)), on_event=events.read,
                                    request_id=rid, headers=self.request_headers(request), on_sent=sink.sent)
        events.finish()

    def running_total(self, event: dict[str, Any]) -> int | None:
        """The output tokens the engine says it has sent as of this event, where it says so on every event: the
        running ``usage.completion_tokens`` (vLLM's and SGLang's ``continuous_usage_stats``); None where it does
        not. An adapter whose engine counts elsewhere (llama.cpp's per-event ``timings``) overrides it."""
        usage = event.get("usage")
        total = usage.get("completion_tokens") if isinstance(usage, dict) else None
        return total if isinstance(total, int) else None

    def count_tokens(self, event: dict[str, Any], choices: list[dict[str, Any]], completed: int) -> tuple[int, int]:
        """Output tokens in one chunk, and the running total the engine reported so far.

        In order of preference: the chunk's ``token_ids`` (vLLM ``return_token_ids``,
        trtllm ``detokenize: false``); the rise of the engine's running total (:meth:`running_total`); one per
        choice.
        """
        if len(choices) == 1:  # the usual chunk, counted without building lists
            ids = choices[0].get("token_ids")
            if isinstance(ids, list):
                return len(ids), completed + len(ids)
        with_ids: list[list[int]] = [c["token_ids"] for c in choices if isinstance(c.get("token_ids"), list)]
        if with_ids:
            n = sum(len(ids) for ids in with_ids)
            return n, completed + n
        if (total := self.running_total(event)) is not None:
            return total - completed, total
        return len(choices), completed + len(choices)

    def error_event(self, event: dict[str, Any], rid: str) -> EngineError:
        """An error sent inside the stream: overload → rejected, a status → HTTP error, else protocol error.

        vLLM nests it (``{"error": {"message", "code"}}``), trtllm-serve does not.
        """
        nested = event.get("error")
        inner: dict[str, Any] = nested if isinstance(nested, dict) else event
        code = inner.get("code") if isinstance(inner.get("code"), int) else None
        message = f"error in stream: {inner.get('message') or event.get('error')}"
        if code in OVERLOAD_STATUSES:
            return EngineRejected(self.name, message, status=code, request_id=rid)
        if code is not None:
            return EngineHTTPError(self.name, message, status=code, request_id=rid)
        return StreamProtocolError(self.name, message, request_id=rid)


class _CompletionEvents:
    """One stream's events, read as they arrive: checked, counted and handed to the sink."""

    __slots__ = ("completed", "done", "engine", "finished", "got_usage", "last_choice_usage", "rid", "sink")

    def __init__(self, engine: OpenAICompletionsEngine, rid: str, sink: ChunkSink) -> None:
        self.engine, self.rid, self.sink = engine, rid, sink
        self.done = self.got_usage = False
        #: A choice gave its finish_reason: the answer is complete, whether or not [DONE] follows.
        self.finished = False
        self.completed = 0  # output tokens the engine reported so far
        #: The totals on the last choice event, kept until [DONE]: a usage event of its own has the last word.
        self.last_choice_usage: tuple[float, Usage] | None = None

    def end(self) -> None:
        """After the response: a stream closed after its finish_reason without ``data: [DONE]`` has ended all the
        same (``transformers serve`` 5.19 sends none: ``cli/serving/completion.py``, ``sse_gen``); one closed before
        its answer finished has not."""
        if not self.done:
            if not self.finished:
                raise StreamProtocolError(self.engine.name, "stream ended before [DONE]", request_id=self.rid)
            self._close()

    def _close(self) -> None:
        """The stream's end: the totals kept from the last choice event are the engine's usage, unless a usage
        event of its own came."""
        self.done = True
        if not self.got_usage and self.last_choice_usage is not None:
            self.got_usage = True
            self.sink.usage(*self.last_choice_usage)

    def read(self, data: bytes, t: float) -> None:
        if self.done:  # after [DONE] nothing is the engine's answer
            return
        if data == b"[DONE]":
            self._close()
            return
        name, rid = self.engine.name, self.rid
        event = parse_json_event(name, data, rid)
        if not isinstance(event, dict):
            raise StreamProtocolError(name, f"stream event is not an object: {event!r:.200}", request_id=rid)
        if "error" in event or event.get("object") == "error":
            raise self.engine.error_event(event, rid)
        choices, usage = event.get("choices"), event.get("usage")
        if not isinstance(choices, list):
            raise StreamProtocolError(name, f"stream event without choices: {event!r:.200}", request_id=rid)
        if not choices:
            if not isinstance(usage, dict):
                raise StreamProtocolError(name, f"chunk with neither choices nor usage: {event!r:.200}",
                                          request_id=rid)
            self.got_usage = True
            self.sink.usage(t, Usage(usage.get("prompt_tokens"), usage.get("completion_tokens")))
            return
        n_tokens, self.completed = self.engine.count_tokens(event, choices, self.completed)
        if len(choices) == 1:
            finish = choices[0].get("finish_reason") or None
        else:
            finish = next((c.get("finish_reason") for c in choices if c.get("finish_reason")), None)
        self.finished = self.finished or finish is not None
        self.sink.tokens(t, n_tokens, finish)
        if finish is not None and isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            # The engine's totals on its last choice event rather than on one of their own (llama.cpp's server,
            # tools/server/server-task.cpp at 0c1e57098): its own counts all the same.
            self.last_choice_usage = (t, Usage(usage.get("prompt_tokens"), usage["completion_tokens"],
                                               source="engine-last-choice", timings=server_timings(event)))
