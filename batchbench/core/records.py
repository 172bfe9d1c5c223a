"""What was measured for one request: the unit every metric is computed from.

All times are seconds on the harness clock (:func:`batchbench.core.clock.now`),
relative to the run's start, so records from one run line up with each other
and with the scraped server time series.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it.

    ``scheduled_s`` is when the workload said to send it (open loop) or when
    its slot/wave freed (closed loop, waves); ``sent_s`` is when it actually
    went out. The gap is client-side queueing, kept so latency can be reported
    both with it (no coordinated omission) and without it.
    """

    request_id: str
    prompt_len: int
    max_tokens: int
    scheduled_s: float
    sent_s: float = 0.0
    #: When the request ended: its last chunk that carried tokens for a successful request (the end of
    #: generation; the stream closes 1-2 ms later, after ``[DONE]``), else when it failed.
    done_s: float | None = None
    #: Arrival time of every chunk that carried output tokens, and how many each carried.
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    #: The engine's own usage report, when it sends one.
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    ok: bool = False
    error_kind: str | None = None
    error: str | None = None
    priority: str | None = None
    #: Static waves: which wave the request belonged to.
    wave: int | None = None
    #: Requests in flight from this client when this one was sent (itself included):
    #: the batch-size bucket its TTFT belongs to.
    in_flight_at_send: int = 0
    #: When the client saw the stream close (after the engine's end-of-stream marker); kept apart from
    #: ``done_s`` so that closing the connection is not counted as the engine's latency.
    closed_s: float | None = None
    #: A turn of a multi-turn conversation: its session and turn (1 first); None for a single request.
    session: int | None = None
    turn: int | None = None
    #: The LoRA adapter the request asked for (None: the base model).
    lora: str | None = field(default=None, metadata={"was": "adapter"})  # "adapter" before v4
    #: Of the output tokens, those that came as reasoning (a chat stream's ``reasoning`` delta): the engine's own
    #: count where its usage gives one, else the streamed reasoning pieces'. None: no reasoning was seen.
    reasoning_tokens: int | None = None
    #: When the first token of the answer (not reasoning) arrived, on a chat stream; None on a completions stream,
    #: where every token is the answer.
    first_output_s: float | None = None
    #: Where the token counts came from when not from a usage event of the engine's own: "engine-last-choice" (the
    #: engine's usage on its last choice event, llama.cpp's server); where it sent none, "tokenizer" (the served
    #: model's tokenizer over the streamed text) or "chunks" (one token per streamed piece). None: its usage event.
    usage_from: str | None = None
    #: Times the request was sent again because the kept-alive connection it went out on had been closed by the
    #: server before any answer (the server never saw it; ``sent_s`` is the last send). 0: sent once.
    resent: int = 0
    #: The server's own timing of the request, where it sends one (llama.cpp: ``prompt_ms`` the prefill without
    #: the queue, ``predicted_ms`` from the prefill's end to the last token, their token counts); None: none sent.
    engine_timings: dict[str, float] | None = None

    @property
    def output_tokens(self) -> int:
        """Output tokens: the engine's usage report when given, else its per-chunk counts."""
        if self.completion_tokens is not None:
            return self.completion_tokens
        return sum(self.chunk_tokens)

    @property
    def schedule_lag_s(self) -> float:
        return self.sent_s - self.scheduled_s

    @property
    def ttft_s(self) -> float | None:
        """Time from send to the first chunk that carried tokens, of any kind (reasoning included)."""
        return self.chunk_times[0] - self.sent_s if self.chunk_times else None

    @property
    def ttfo_s(self) -> float | None:
        """Time from send to the first token of the answer: after the reasoning, where a chat stream reasoned
        first (None when no answer came after it); else the time to first token."""
        if self.first_output_s is not None:
            return self.first_output_s - self.sent_s
        return None if self.reasoning_tokens else self.ttft_s

    @property
    def e2e_s(self) -> float | None:
        """End-to-end latency from the actual send (engine latency)."""
        return None if self.done_s is None else self.done_s - self.sent_s

    @property
    def e2e_from_schedule_s(self) -> float | None:
        """End-to-end latency from the scheduled send (includes client queueing)."""
        return None if self.done_s is None else self.done_s - self.scheduled_s

    def to_dict(self) -> dict[str, Any]:
        """The fields by name, lists copied. Not ``dataclasses.asdict``: its deep copy of every chunk time cost
        more than the rest of journalling a record."""
        doc = {name: getattr(self, name) for name in _FIELDS}
        doc["chunk_times"], doc["chunk_tokens"] = list(self.chunk_times), list(self.chunk_tokens)
        return doc


_FIELDS = tuple(f.name for f in fields(RequestRecord))
