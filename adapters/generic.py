"""Any OpenAI-compatible server someone else runs (``--engine openai --engine-url openai=URL``).

llama.cpp's server, Ollama, LMDeploy, a gateway (LiteLLM, an inference gateway, KServe), a hosted API: whatever
speaks OpenAI's ``/v1/completions`` or ``/v1/chat/completions`` streams and lists its models on ``/v1/models``.
batchbench knows nothing more of it, so:

- it is never launched, only reached at a URL;
- its health is ``GET /v1/models`` answering (the one route every such server has; a 401/403 there says at once
  that it wants a key, or refused the one sent);
- it has no server metrics batchbench can read: KV-cache usage and capacity, queue depth, preemptions,
  rejections counted by the server, prefix-cache hits and speculation counters stay unknown
  (:data:`UNAVAILABLE`, said in its description and so in the report), and nothing about its batching can be
  set or checked, so suites that need any of it skip with the reason;
- requests are as for vLLM (:mod:`batchbench.adapters.openai_compat`, :mod:`batchbench.adapters.chat`): token-id
  prompts on completions (the default), messages on chat, ``max_tokens`` with ``min_tokens`` and ``ignore_eos``
  for an exact output length (taken by vLLM, SGLang, llama.cpp and LMDeploy; ignored elsewhere, and the parity
  check flags an answer of another length), ``stream_options`` asking for usage on every chunk. A server that
  sends no usage is counted by the served model's tokenizer or its streamed pieces, and the parity check says
  which;
- a server that refuses those extensions (OpenAI's own API, a gateway checking against its schema: 400
  "Unrecognized request argument supplied: ignore_eos"; ``transformers serve`` 5.19: 422 "Unexpected fields in the
  request") is sent OpenAI's fields alone from then on, the refused request once more; answers then end where the
  model stops, and the description (so the report) says so;
- a server that refuses token-id prompts (``transformers serve`` 5.19, ``cli/serving/completion.py``: 400 "prompt
  must be a string.") is sent text from then on: text that the served model's tokenizer (``--tokenizer``, else the
  served model's folder) makes the same number of prompt tokens (:meth:`TextMaker.like`), which the engine's own
  prompt counts check (the parity check); the description says so;
- a server whose ``/v1/models`` fails with a server error (``transformers serve`` lists models from the Hub cache
  only, and answers 500 where there is no cache folder) is healthy when its ``/health`` answers.
"""

from __future__ import annotations

import re
from functools import cached_property
from typing import Any, ClassVar

from batchbench.adapters.base import ChunkSink, EngineError, EngineHTTPError
from batchbench.adapters.chat import chat_body
from batchbench.adapters.http import get_text
from batchbench.adapters.openai_compat import OpenAICompletionsEngine
from batchbench.adapters.prometheus import Samples
from batchbench.adapters.spec import EngineSpec
from batchbench.core.clock import now
from batchbench.core.config import BatchingConfig, Capabilities
from batchbench.core.server_metrics import ServerMetrics
from batchbench.workload import tokenizer
from batchbench.workload.requests import Request
from batchbench.workload.text import TextMaker

#: What batchbench cannot have from a server it knows only by its OpenAI routes.
UNAVAILABLE = ("server metrics (KV-cache usage and capacity, queue depth, preemptions, server-side rejections, "
               "prefix-cache hits, speculation counters): a generic OpenAI-compatible server exposes none that "
               "batchbench can read; its batching configuration cannot be set or checked")
#: The request fields beyond OpenAI's API that ask for an exact output length and usage on every chunk.
EXTENSIONS = ("min_tokens", "ignore_eos", "continuous_usage_stats")
#: Said in the description once the server refused them.
REFUSED = ("exact output lengths: the server refused min_tokens/ignore_eos (fields beyond OpenAI's API), so each "
           "answer ends where the model stops; the parity check compares its length with the one asked")
#: A refusal of token-id prompts: the prompt named as wanting text ("prompt must be a string.", "prompt: Input should
#: be a valid string"); not a prompt refused for its length ("maximum context length ... your prompt contains").
TOKEN_IDS_REFUSED = re.compile(r"\bprompt\b.*\b(string|str|text)\b", re.IGNORECASE)
#: Said in the description once the server refused token-id prompts.
AS_TEXT = ("prompts as token ids: the server refused them, so each prompt was sent as text its tokenizer makes the "
           "same number of tokens (the parity check compares the engine's own prompt counts)")


class OpenAIServerEngine(OpenAICompletionsEngine):
    """An OpenAI-compatible server at a URL: requests and the client's own figures only."""

    name: ClassVar[str] = "openai"
    health_path: ClassVar[str] = "/v1/models"
    capabilities: ClassVar[Capabilities] = Capabilities(
        batching_modes=frozenset({"continuous"}),
        server_metrics=False,
        # ignore_eos is asked for, but whether the server honours it is not known: the parity check says.
        exact_output_length=False,
        endpoints=frozenset({"completions", "chat"}),
    )

    def server_args(self, batching: BatchingConfig, *, host: str, port: int) -> list[str]:
        raise NotImplementedError("an OpenAI-compatible server at a URL is never launched by batchbench")

    #: Whether the server refused the :data:`EXTENSIONS`: every request since is OpenAI's API alone.
    plain: bool = False
    #: Whether the server refused token-id prompts: every prompt since is sent as text (:data:`AS_TEXT`).
    as_text: bool = False

    async def probe_health(self) -> bool:
        """``/v1/models`` answering; where it fails with a server error, ``/health`` answering (module docstring)."""
        try:
            return await super().probe_health()
        except EngineHTTPError as exc:
            if exc.status < 500:
                raise
            assert self.client is not None
            try:
                await get_text(self.client, self.name, "/health")
            except EngineHTTPError:
                raise exc from None  # no health route either: the models list's error says what is wrong
            return True

    @cached_property
    def _text(self) -> TextMaker:
        """The served model's tokenizer as a maker of text prompts: the one given, else the served model's own
        (its folder or hub id as requests name it); EngineError saying what to give where it does not load."""
        if self.text_tokenizer is not None:
            return TextMaker(self.text_tokenizer)
        try:
            return TextMaker(tokenizer.load(self.model.path))
        except ValueError as exc:
            remedy = "" if "--tokenizer" in str(exc) else "; give --tokenizer"
            raise EngineError(self.name, f"the server refuses token-id prompts, and text of the same lengths needs "
                                         f"the served model's tokenizer: {exc}{remedy}", permanent=True) from None

    def payload(self, request: Request) -> dict[str, Any]:
        ids = request.prompt_token_ids
        body: dict[str, Any] = {
            "model": request.lora or self.model.request_name,
            "prompt": self._text.like(ids) if self.as_text else list(ids),
            "max_tokens": request.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if not self.plain:
            body.update(min_tokens=request.max_tokens, ignore_eos=True,
                        stream_options={"include_usage": True, "continuous_usage_stats": True})
        return body

    def chat_payload(self, request: Request) -> dict[str, Any]:
        body = chat_body(self.model.request_name, request, self.prompt_text, exact_length=not self.plain)
        if self.plain:
            body["stream_options"] = {"include_usage": True}
        return body

    async def stream_into(self, request: Request, sink: ChunkSink) -> None:
        """As for vLLM; a refusal of the :data:`EXTENSIONS` or of token-id prompts (a 400 or 422 before any token:
        the warm-up's first request) turns them off for good and sends the request again without them."""
        done_without: set[str] = set()
        while True:
            try:
                await super().stream_into(request, sink)
                return
            except EngineHTTPError as exc:
                refused = self._refused(exc)
                # Each at most once per request: requests in flight together may all be refused before the first
                # turns it off, and a server that refuses the request without it too has said something else.
                if refused is None or refused in done_without:
                    raise
                done_without.add(refused)
                if refused == "extensions":
                    self.plain = True
                else:
                    self.as_text = True

    def _refused(self, refusal: EngineHTTPError) -> str | None:
        """What ``refusal`` refuses that this engine can do without: the :data:`EXTENSIONS`, token-id prompts
        (``token-ids``), or nothing it knows (None)."""
        if refusal.status not in (400, 422):
            return None
        said = str(refusal)
        if any(name in said for name in EXTENSIONS):
            return "extensions"
        if self.endpoint == "completions" and TOKEN_IDS_REFUSED.search(said):
            return "token-ids"
        return None

    async def scrape(self) -> ServerMetrics | None:
        """No metrics batchbench can read (:data:`UNAVAILABLE`)."""
        return None

    def normalize(self, samples: Samples) -> ServerMetrics:
        return ServerMetrics(t=now())

    def describe(self) -> dict[str, Any]:
        unavailable = "; ".join([UNAVAILABLE, *([REFUSED] if self.plain else []), *([AS_TEXT] if self.as_text else [])])
        return {**super().describe(), "unavailable": unavailable}


SPEC = EngineSpec(
    name="openai",
    engine_class=OpenAIServerEngine,
    summary="any OpenAI-compatible server at a URL (completions or chat): no launch, no server metrics",
    container=False,
)
