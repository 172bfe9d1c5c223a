"""The OpenAI-compatible streaming completions protocol, shared by vLLM and trtllm-serve.

Both servers stream ``POST /v1/completions`` as Server-Sent Events: one
``data:`` JSON object per chunk with ``choices``, a last chunk with
``choices: []`` and the engine's own ``usage`` (asked for with
``stream_options.include_usage``), then ``data: [DONE]``. Subclasses give
the request body (:meth:`payload`); the stream, the token counting and the
error mapping are the same for both and live here once.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import AsyncIterator
from typing import Any, ClassVar

from batchbench.adapters.base import Chunk, EngineError, EngineHTTPError, EngineRejected, StreamProtocolError, Usage
from batchbench.adapters.http import OVERLOAD_STATUSES, SentStamp, parse_json_event, post_stream, sse_data
from batchbench.adapters.served import ServedEngine
from batchbench.clock import now
from batchbench.workload import Request


class OpenAICompletionsEngine(ServedEngine):
    completions_path: ClassVar[str] = "/v1/completions"

    @abstractmethod
    def payload(self, request: Request) -> dict[str, Any]:
        """The JSON body: token-id prompt, exact output length, streaming with usage."""

    def request_headers(self, request: Request) -> dict[str, str] | None:
        return None

    async def stream(self, request: Request) -> AsyncIterator[Chunk]:
        assert self.client is not None, "stream() before start()"
        rid = request.request_id
        stamp = SentStamp()
        async with self.failures_explained(rid), post_stream(
            self.client, self.name, self.completions_path, self.payload(request), request_id=rid,
            headers=self.request_headers(request), sent=stamp,
        ) as body:
            done = got_usage = False
            completed = 0
            sent = stamp.t  # handed on with the first chunk
            async for data in sse_data(body):
                t = now()
                if data == "[DONE]":
                    done = True
                    break
                event = parse_json_event(self.name, data, rid)
                if not isinstance(event, dict):
                    raise StreamProtocolError(self.name, f"stream event is not an object: {data[:200]!r}",
                                              request_id=rid)
                if "error" in event or event.get("object") == "error":
                    raise self.error_event(event, rid)
                choices, usage = event.get("choices"), event.get("usage")
                if not isinstance(choices, list):
                    raise StreamProtocolError(self.name, f"stream event without choices: {event!r:.200}",
                                              request_id=rid)
                if not choices:
                    if not isinstance(usage, dict):
                        raise StreamProtocolError(
                            self.name, f"chunk with neither choices nor usage: {event!r:.200}", request_id=rid,
                        )
                    got_usage = True
                    totals = Usage(usage.get("prompt_tokens"), usage.get("completion_tokens"))
                    yield Chunk(t=t, n_tokens=0, usage=totals, sent=sent)
                    sent = None
                    continue
                n_tokens, completed = self.count_tokens(choices, usage, completed)
                finish = next((c.get("finish_reason") for c in choices if c.get("finish_reason")), None)
                yield Chunk(t=t, n_tokens=n_tokens, finish_reason=finish, sent=sent)
                sent = None
            if not done:
                raise StreamProtocolError(self.name, "stream ended before [DONE]", request_id=rid)
            if not got_usage:
                raise StreamProtocolError(
                    self.name, "no usage chunk before [DONE] (stream_options.include_usage ignored?)", request_id=rid,
                )

    @staticmethod
    def count_tokens(choices: list[dict[str, Any]], usage: Any, completed: int) -> tuple[int, int]:
        """Output tokens in one chunk, and the running total the engine reported so far.

        In order of preference: the chunk's ``token_ids`` (vLLM ``return_token_ids``,
        trtllm ``detokenize: false``); the rise of the cumulative
        ``usage.completion_tokens`` (``continuous_usage_stats``); one per choice.
        """
        with_ids: list[list[int]] = [c["token_ids"] for c in choices if isinstance(c.get("token_ids"), list)]
        if with_ids:
            n = sum(len(ids) for ids in with_ids)
            return n, completed + n
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            total = usage["completion_tokens"]
            return total - completed, total
        return len(choices), completed + len(choices)

    def error_event(self, event: dict[str, Any], rid: str) -> EngineError:
        """An error sent inside the stream: overload → rejected, a status → HTTP error, else protocol error.

        vLLM nests it (``{"error": {"message", "code"}}``), trtllm-serve does not.
        """
        inner = event.get("error") if isinstance(event.get("error"), dict) else event
        code = inner.get("code") if isinstance(inner.get("code"), int) else None
        message = f"error in stream: {inner.get('message') or event.get('error')}"
        if code in OVERLOAD_STATUSES:
            return EngineRejected(self.name, message, status=code, request_id=rid)
        if code is not None:
            return EngineHTTPError(self.name, message, status=code, request_id=rid)
        return StreamProtocolError(self.name, message, request_id=rid)
