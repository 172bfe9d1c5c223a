"""OpenAI chat completions: the one request function and stream reader every chat-capable engine shares.

``POST /v1/chat/completions`` with ``messages`` and ``stream: true`` streams ``data:`` chunks whose
``choices[0].delta`` carries the answer (``content``) or, on a server that splits a reasoning model's thinking
out, the reasoning (``reasoning``: vLLM 0.32's ``DeltaMessage`` in ``vllm/entrypoints/generate/base/protocol.py``;
``reasoning_content`` in earlier vLLM and in DeepSeek's API), then (``stream_options.include_usage``) a chunk with
``choices: []`` and the engine's ``usage``, then ``data: [DONE]``. vLLM 0.32 (``chat_completion/serving.py``,
``chat_completion_stream_generator``) opens with a chunk of ``{"role": "assistant", "content": ""}``, carries the
running usage on every chunk with ``continuous_usage_stats`` (how many tokens a chunk brought is the rise of
``completion_tokens``), and counts reasoning tokens in ``usage.completion_tokens_details.reasoning_tokens`` when it
runs a reasoning parser; SGLang puts ``reasoning_tokens`` in ``usage`` itself.

Each chunk is timed as it arrives, like a completions chunk: reasoning and answer tokens alike make the time to
first token and the inter-token gaps; reasoning tokens are also counted apart, and the first answer token's time
is kept (time to first output token). A server that sends no usage at all still gives counts: the served model's
tokenizer over the streamed text where one is known, else one token per streamed piece, and the record says which.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from batchbench.adapters.base import ChunkSink, StreamProtocolError, Usage, UsageSource, server_timings
from batchbench.adapters.http import parse_json_event
from batchbench.workload.requests import Request

if TYPE_CHECKING:
    from batchbench.adapters.openai_compat import OpenAICompletionsEngine

CHAT_PATH = "/v1/chat/completions"


def token_ids_text(token_ids: Sequence[int]) -> str:
    """A prompt's text where only its token ids are known and no tokenizer is: the ids as decimal numbers,
    space-separated (deterministic, dependency-free; not the same number of tokens)."""
    return " ".join(str(t) for t in token_ids)


def messages(request: Request, prompt_text: Callable[[Sequence[int]], str]) -> list[dict[str, str]]:
    """The request's chat messages: its own (a chat workload's), else one user message of its prompt as text
    (a token-id workload such as the engines' warm-up)."""
    if request.messages is not None:
        return [{"role": role, "content": content} for role, content in request.messages]
    return [{"role": "user", "content": prompt_text(request.prompt_token_ids)}]


def chat_body(model: str, request: Request, prompt_text: Callable[[Sequence[int]], str], *,
              exact_length: bool = True) -> dict[str, Any]:
    """The JSON body: messages, the output length, streamed with the engine's usage on every chunk.

    ``exact_length``: also ``min_tokens`` and ``ignore_eos`` (vLLM 0.32's ``ChatCompletionRequest`` extensions,
    also taken by SGLang, llama.cpp and LMDeploy), so the answer is exactly ``max_tokens`` long as on completions.
    """
    body: dict[str, Any] = {
        "model": request.lora or model,
        "messages": messages(request, prompt_text),
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if exact_length:
        body["min_tokens"] = request.max_tokens
        body["ignore_eos"] = True
    return body


def usage_of(doc: dict[str, Any], source: UsageSource = "engine", timings: dict[str, float] | None = None) -> Usage:
    """A ``usage`` object as :class:`Usage`, its reasoning tokens where the engine counts them."""
    details = doc.get("completion_tokens_details")
    reasoning = details.get("reasoning_tokens") if isinstance(details, dict) else doc.get("reasoning_tokens")
    return Usage(doc.get("prompt_tokens"), doc.get("completion_tokens"),
                 reasoning if isinstance(reasoning, int) else None, source, timings)


class ChatEvents:
    """One chat stream's events, read as they arrive: checked, counted (reasoning apart) and handed to the sink."""

    __slots__ = (
        "answered",
        "completed",
        "count_text",
        "done",
        "engine",
        "finished",
        "got_usage",
        "last_choice_usage",
        "last_t",
        "pieces",
        "rid",
        "sink",
    )

    def __init__(self, engine: OpenAICompletionsEngine, rid: str, sink: ChunkSink,
                 count_text: Callable[[str], int] | None = None) -> None:
        self.engine, self.rid, self.sink = engine, rid, sink
        self.done = self.got_usage = self.answered = False
        #: The choice gave its finish_reason: the answer is complete, whether or not [DONE] follows.
        self.finished = False
        self.completed = 0  # output tokens the engine (or the pieces) counted so far
        self.last_t = 0.0
        self.last_choice_usage: tuple[float, Usage] | None = None
        #: The served model's tokenizer, counting the streamed text where the engine sends no usage.
        self.count_text = count_text
        self.pieces: list[str] = []

    def read(self, data: bytes, t: float) -> None:
        if self.done:  # after [DONE] nothing is the engine's answer
            return
        if data == b"[DONE]":
            self.done = True
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
        self.last_t = t
        if not choices:
            if isinstance(usage, dict):
                self.got_usage = True
                self.sink.usage(t, usage_of(usage))
            return
        choice = choices[0]
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(delta, dict):
            raise StreamProtocolError(name, f"chat chunk without a delta: {event!r:.200}", request_id=rid)
        reasoning = delta.get("reasoning") or delta.get("reasoning_content")
        content = delta.get("content")
        finish = choice.get("finish_reason") or None
        self.finished = self.finished or finish is not None
        if (total := self.engine.running_total(event)) is not None:
            n, self.completed = total - self.completed, total
        else:  # no running total: one token per piece that carried text
            n = 1 if reasoning or content else 0
            self.completed += n
        if self.count_text is not None:
            self.pieces += (reasoning or "", content or "")
        if reasoning and not content:
            self.sink.reasoning(t, n, finish)
            return
        # A piece with both (the reasoning ends within it) is counted as the answer's: it is where the answer began.
        if not n and finish is None:
            return
        if n and not self.answered:
            self.answered = True
            self.sink.first_output(t)
        self.sink.tokens(t, n, finish)
        if finish is not None and isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            # The engine's totals on its last choice event (llama.cpp's server), kept until the stream ends: a
            # usage event of its own after it has the last word.
            self.last_choice_usage = (t, usage_of(usage, "engine-last-choice", server_timings(event)))

    def finish(self) -> None:
        """After the response: a stream that never ended is an error (one closed after its finish_reason without
        ``data: [DONE]`` has ended: ``transformers serve`` 5.19 sends none); one without usage is counted here."""
        if not self.done and not self.finished:
            raise StreamProtocolError(self.engine.name, "stream ended before [DONE]", request_id=self.rid)
        if self.got_usage:
            return
        if self.last_choice_usage is not None:
            self.sink.usage(*self.last_choice_usage)
        elif self.count_text is not None:
            self.sink.usage(self.last_t, Usage(None, self.count_text("".join(self.pieces)), source="tokenizer"))
        else:
            self.sink.usage(self.last_t, Usage(None, self.completed, source="chunks"))
