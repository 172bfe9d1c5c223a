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
  for an exact output length (taken by vLLM, SGLang, llama.cpp and LMDeploy; ignored or refused elsewhere, and the
  parity check flags an answer of another length), ``stream_options`` asking for usage on every chunk. A server
  that sends no usage is counted by the served model's tokenizer or its streamed pieces, and the parity check
  says which.
"""

from __future__ import annotations

from typing import Any, ClassVar

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

    def payload(self, request: Request) -> dict[str, Any]:
        return {
            "model": request.lora or self.model.request_name,
            "prompt": list(request.prompt_token_ids),
            "max_tokens": request.max_tokens,
            "min_tokens": request.max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }

    async def scrape(self) -> ServerMetrics | None:
        """No metrics batchbench can read (:data:`UNAVAILABLE`)."""
        return None

    def normalize(self, samples: Samples) -> ServerMetrics:
        return ServerMetrics(t=now())

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "unavailable": UNAVAILABLE}


SPEC = EngineSpec(
    name="openai",
    engine_class=OpenAIServerEngine,
    summary="any OpenAI-compatible server at a URL (completions or chat): no launch, no server metrics",
    container=False,
)
