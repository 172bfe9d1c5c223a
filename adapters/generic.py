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
  "Unrecognized request argument supplied: ignore_eos") is sent OpenAI's fields alone from then on, the refused
  request once more; answers then end where the model stops, and the description (so the report) says so.
"""

from __future__ import annotations

from typing import Any, ClassVar

from batchbench.adapters.base import ChunkSink, EngineHTTPError
from batchbench.adapters.chat import chat_body
from batchbench.adapters.openai_compat import OpenAICompletionsEngine
from batchbench.adapters.prometheus import Samples
from batchbench.adapters.spec import EngineSpec
from batchbench.core.clock import now
from batchbench.core.config import BatchingConfig, Capabilities
from batchbench.core.server_metrics import ServerMetrics
from batchbench.workload.requests import Request

#: What batchbench cannot have from a server it knows only by its OpenAI routes.
UNAVAILABLE = ("server metrics (KV-cache usage and capacity, queue depth, preemptions, server-side rejections, "
               "prefix-cache hits, speculation counters): a generic OpenAI-compatible server exposes none that "
               "batchbench can read; its batching configuration cannot be set or checked")
#: The request fields beyond OpenAI's API that ask for an exact output length and usage on every chunk.
EXTENSIONS = ("min_tokens", "ignore_eos", "continuous_usage_stats")
#: Said in the description once the server refused them.
REFUSED = ("exact output lengths: the server refused min_tokens/ignore_eos (fields beyond OpenAI's API), so each "
           "answer ends where the model stops; the parity check compares its length with the one asked")


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

    def payload(self, request: Request) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": request.lora or self.model.request_name,
            "prompt": list(request.prompt_token_ids),
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
        """As for vLLM; a refusal of the :data:`EXTENSIONS` (a 400 naming one, before any token: the warm-up's
        first request) turns them off for good and sends the request again without them."""
        try:
            await super().stream_into(request, sink)
        except EngineHTTPError as exc:
            if self.plain or exc.status not in (400, 422) or not any(name in str(exc) for name in EXTENSIONS):
                raise
            self.plain = True
            await super().stream_into(request, sink)

    async def scrape(self) -> ServerMetrics | None:
        """No metrics batchbench can read (:data:`UNAVAILABLE`)."""
        return None

    def normalize(self, samples: Samples) -> ServerMetrics:
        return ServerMetrics(t=now())

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "unavailable": f"{UNAVAILABLE}; {REFUSED}" if self.plain else UNAVAILABLE}


SPEC = EngineSpec(
    name="openai",
    engine_class=OpenAIServerEngine,
    summary="any OpenAI-compatible server at a URL (completions or chat): no launch, no server metrics",
    container=False,
)
