"""Hugging Face text-generation-inference (TGI): its native /generate_stream API.

Names checked against TGI v3.3.7 (tag ``v3.3.7``; the router reports version
``3.3.6-dev0`` there), in ``router/src/lib.rs`` (GenerateParameters,
StreamResponse, StreamDetails, Info, ErrorResponse), ``router/src/server.rs``
(routes, the SSE stream, metric registration), ``router/src/infer/mod.rs``
(error types), ``router/src/validation.rs``, ``backends/v3/src/{lib,backend,
queue}.rs`` (the batching gauges) and ``launcher/src/main.rs`` (flags):

- POST /generate_stream with ``{"inputs": str, "parameters": {...}}``; every
  SSE event (``data:{...}``, no space) carries exactly one token; the last one
  has ``generated_text`` and, with ``details: true``, ``details`` =
  ``{finish_reason, generated_tokens, seed, input_length}``. ``input_length``
  is TGI's own count of prompt tokens; the record's prompt count comes from
  there and nothing is re-tokenised here.
- Errors inside the stream are ``{"error": ..., "error_type": ...}`` events.
  TGI 3.x sends "Model is overloaded" (``max_concurrent_requests`` exceeded)
  on /generate_stream as such an event after a 200, not as an HTTP 429 (only
  the non-streaming routes answer 429); both are mapped to EngineRejected.
- The ``text-generation`` client package is not used: it pins
  ``huggingface-hub<1.0``, which conflicts with transformers 5 in the same
  environment. batchbench's own HTTP client speaks the (small) protocol instead.

Limitations of TGI's API that the records must live with:

- **No token-id input.** TGI tokenises ``inputs`` itself. The prompt token
  ids are turned into text by ``prompt_text`` (default: the ids as decimal
  numbers joined by spaces, deterministic and dependency-free). That text is
  *not* the same number of tokens as ``prompt_token_ids``; pass
  ``prompt_text=lambda ids: tokenizer.decode(ids)`` with the served model's
  tokenizer to get close. Either way the recorded prompt length is TGI's
  ``input_length``. ``decoder_input_details`` (prompt token ids back) is
  refused by TGI on the streaming route, so it is never sent.
- **No ignore-EOS.** GenerateParameters has no such field; the router
  hard-codes ``ignore_eos_token: false`` (``validation.rs``). A sequence may
  end before ``max_new_tokens``: the final chunk then says
  ``finish_reason="eos_token"`` and the usage carries TGI's real
  ``generated_tokens``, never the requested count.
- **No static batching, no chunked-prefill switch.** TGI batches continuously;
  static waves are sent by the load generator. Chunking follows the attention
  backend (flashinfer/flashdecoding with prefix caching), not a flag.
- **KV capacity.** ``--max-batch-total-tokens`` is ignored (with a warning) by
  flash-attention models, which size the KV cache from memory
  (``--cuda-memory-fraction``). The effective value is the
  ``tgi_batch_max_total_tokens`` gauge (TGI 3.x; /info carried
  ``max_batch_total_tokens`` up to 2.x), which is what is reported.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, ClassVar

from batchbench.adapters.base import Chunk, EngineError, EngineHTTPError, EngineRejected, StreamProtocolError, Usage
from batchbench.adapters.chat import token_ids_text
from batchbench.adapters.http import SentStamp, get_json, parse_json_event, post_stream, sse_data
from batchbench.adapters.prometheus import Samples
from batchbench.adapters.served import ServedEngine
from batchbench.adapters.spec import EngineSpec
from batchbench.core.clock import now
from batchbench.core.config import BatchingConfig, Capabilities, ModelRef
from batchbench.core.server_metrics import ServerMetrics
from batchbench.workload.requests import Request

#: TGI's HTTP status for each error_type (``impl From<InferError> for StatusCode``);
#: used for error events that arrive inside a 200 stream.
ERROR_STATUS = {
    "generation": 424,
    "overloaded": 429,
    "validation": 422,
    "template_error": 422,
    "missing_template_variable": 422,
    "tool_error": 422,
}
#: error_types that mean the stream itself broke, not the request.
STREAM_BROKEN = frozenset({"incomplete_generation", "incomplete_generation_stream"})


class TGIEngine(ServedEngine):
    """text-generation-inference: continuous batching only (router-side batching with a token budget).

    BatchingConfig mapping (``text-generation-launcher`` flags):
    max_batch_size → ``--max-batch-size``; max_batched_tokens →
    ``--max-batch-prefill-tokens``; kv_capacity_tokens →
    ``--max-batch-total-tokens`` (see the module note: flash-attention models
    ignore it); memory_fraction → ``--cuda-memory-fraction``;
    speculative_method=ngram → ``--speculate`` draft_tokens (TGI's metrics have
    no draft/accepted token counters, so ServerMetrics' stay unknown). ModelRef's
    max_model_len → ``--max-total-tokens`` and ``--max-input-tokens``
    (max_model_len - 1). TGI-only knobs: ``max_concurrent_requests`` (TGI's
    default 128; beyond it requests are rejected as overloaded),
    ``max_waiting_tokens``, ``waiting_served_ratio``, ``dtype``.
    """

    name: ClassVar[str] = "tgi"
    capabilities: ClassVar[Capabilities] = Capabilities(
        batching_modes=frozenset({"continuous"}),
        server_metrics=True,
        reports_kv_capacity=True,
        chunked_prefill=False,
        exact_output_length=False,  # the router hard-codes ignore_eos_token: false
        speculation_methods=frozenset({"ngram"}),
    )

    def __init__(
        self,
        batching: BatchingConfig | None = None,
        *,
        prompt_text: Callable[[Sequence[int]], str] = token_ids_text,
        max_concurrent_requests: int | None = None,
        max_waiting_tokens: int | None = None,
        waiting_served_ratio: float | None = None,
        dtype: str | None = None,
        **served: Any,
    ) -> None:
        super().__init__(batching, **served)
        if self.batching.chunked_prefill is not None:
            raise ValueError(
                "engine 'tgi' has no chunked-prefill switch (it follows the attention backend); "
                "leave BatchingConfig.chunked_prefill unset"
            )
        cap, max_len = self.batching.kv_capacity_tokens, self.model.max_model_len
        if cap is not None and max_len is not None and max_len > cap:
            # text-generation-launcher refuses this combination before starting anything.
            raise ValueError(
                f"engine 'tgi': max_model_len={max_len} (--max-total-tokens) must be <= kv_capacity_tokens={cap} "
                "(--max-batch-total-tokens)"
            )
        if self.launch is not None and self.model.dummy_weights:
            raise ValueError("engine 'tgi' cannot initialise random weights; give it a model with real weights")
        self.prompt_text = prompt_text
        self.max_concurrent_requests = max_concurrent_requests
        self.max_waiting_tokens = max_waiting_tokens
        self.waiting_served_ratio = waiting_served_ratio
        self.dtype = dtype
        self.info: dict[str, Any] | None = None
        #: The engine's own KV budget in tokens (/info up to 2.x, the gauge in 3.x).
        self.kv_capacity_tokens: float | None = None

    # ------------------------------------------------------------------ launch

    def server_args(self, batching: BatchingConfig, *, host: str, port: int) -> list[str]:
        args = ["--model-id", self.model.path, "--hostname", host, "--port", str(port)]
        max_len = self.model.max_model_len
        if max_len is not None:
            args += ["--max-total-tokens", str(max_len), "--max-input-tokens", str(max_len - 1)]
        if batching.max_batch_size is not None:
            args += ["--max-batch-size", str(batching.max_batch_size)]
        if batching.max_batched_tokens is not None:
            args += ["--max-batch-prefill-tokens", str(batching.max_batched_tokens)]
        if batching.kv_capacity_tokens is not None:
            args += ["--max-batch-total-tokens", str(batching.kv_capacity_tokens)]
        if batching.memory_fraction is not None:
            args += ["--cuda-memory-fraction", str(batching.memory_fraction)]
        if batching.speculative_method == "ngram":
            # TGI 3.3 speculates by n-gram lookup when the model has no Medusa heads (docs/source/conceptual/
            # speculation.md); ``--speculate N`` drafts N tokens per step.
            args += ["--speculate", str(batching.draft_tokens)]
        if self.max_concurrent_requests is not None:
            args += ["--max-concurrent-requests", str(self.max_concurrent_requests)]
        if self.max_waiting_tokens is not None:
            args += ["--max-waiting-tokens", str(self.max_waiting_tokens)]
        if self.waiting_served_ratio is not None:
            args += ["--waiting-served-ratio", str(self.waiting_served_ratio)]
        if self.dtype is not None:
            args += ["--dtype", self.dtype]
        return args

    async def discover_model(self) -> ModelRef:
        """URL mode: TGI serves one model and says which in /info (its requests name none, so --model stays as
        given)."""
        if self.model.request_name:
            return self.model
        info = await self.load_info()
        served = str(info.get("model_id") or "")
        return ModelRef(served, served_name=served or "tgi", max_model_len=self.model.max_model_len)

    async def wait_healthy(self, timeout: float) -> None:
        await super().wait_healthy(timeout)
        await self.load_info()

    async def load_info(self) -> dict[str, Any]:
        """GET /info: model id, limits and version; the KV budget if this TGI still reports it there."""
        assert self.client is not None, "load_info() before start()"
        info = await get_json(self.client, self.name, "/info")
        if not isinstance(info, dict):
            raise StreamProtocolError(self.name, f"/info is not a JSON object: {info!r:.200}")
        self.info = info
        if info.get("max_batch_total_tokens") is not None:
            self.kv_capacity_tokens = float(info["max_batch_total_tokens"])
        return info

    # ------------------------------------------------------------------ requests

    def payload(self, request: Request) -> dict[str, Any]:
        return {
            "inputs": self.prompt_text(request.prompt_token_ids),
            "parameters": {
                "max_new_tokens": request.max_tokens,
                "details": True,
                "decoder_input_details": False,
                "do_sample": False,
                "return_full_text": False,
                "stop": [],
            },
        }

    async def stream(self, request: Request) -> AsyncIterator[Chunk]:
        assert self.client is not None, "stream() before start()"
        rid = request.request_id
        stamp = SentStamp()
        async with self.failures_explained(rid), post_stream(
            self.client, self.name, "/generate_stream", self.payload(request), request_id=rid, sent=stamp,
        ) as body:
            finished = False
            sent = stamp.t  # handed on with the first chunk
            async for data in sse_data(body):
                t = now()
                event = parse_json_event(self.name, data, rid)
                if not isinstance(event, dict):
                    raise StreamProtocolError(self.name, f"stream event is not an object: {data[:200]!r}",
                                              request_id=rid)
                if "error" in event:
                    raise self.error_event(event, rid)
                chunk = self._chunk(event, t, rid, sent)
                sent = None
                yield chunk
                if chunk.usage is not None:
                    finished = True
                    break
            if not finished:
                raise StreamProtocolError(
                    self.name, "stream ended without the final event carrying details", request_id=rid,
                )

    def _chunk(self, event: dict[str, Any], t: float, rid: str, sent: float | None) -> Chunk:
        if not isinstance(event.get("token"), dict):
            raise StreamProtocolError(self.name, f"stream event without a token: {event!r:.200}", request_id=rid)
        if event.get("generated_text") is None:
            return Chunk(t=t, n_tokens=1, sent=sent)
        details = event.get("details")
        if not isinstance(details, dict) or not isinstance(details.get("generated_tokens"), int):
            raise StreamProtocolError(
                self.name, f"final event without details.generated_tokens: {event!r:.200}", request_id=rid,
            )
        input_length = details.get("input_length")
        return Chunk(
            t=t,
            n_tokens=1,
            usage=Usage(input_length if isinstance(input_length, int) else None, details["generated_tokens"]),
            finish_reason=details.get("finish_reason"),
            sent=sent,
        )

    def error_event(self, event: dict[str, Any], rid: str) -> EngineError:
        error_type = str(event.get("error_type") or "unknown")
        message = f"error event in stream ({error_type}): {event.get('error')}"
        if error_type == "overloaded":
            return EngineRejected(self.name, message, status=429, request_id=rid)
        if error_type in STREAM_BROKEN:
            return StreamProtocolError(self.name, message, request_id=rid)
        return EngineHTTPError(self.name, message, status=ERROR_STATUS.get(error_type, 500), request_id=rid)

    # ------------------------------------------------------------------ metrics

    def normalize(self, samples: Samples) -> ServerMetrics:
        live = any(name.startswith("tgi_") for name in samples.by_name)
        # metrics-rs renders a series only once it was touched: absent on a live TGI means 0.
        zero = 0.0 if live else None

        def value(*names: str) -> float | None:
            found = samples.sum(*names)
            return found if found is not None else zero

        capacity = samples.sum("tgi_batch_max_total_tokens")
        if capacity is not None and capacity > 0:
            self.kv_capacity_tokens = capacity
        capacity = self.kv_capacity_tokens
        reserved = samples.sum("tgi_batch_current_max_tokens")
        kv_usage = None
        if capacity:
            kv_usage = min(1.0, max(0.0, (reserved or 0.0) / capacity)) if live else None
        overloaded = [
            v for name in ("tgi_request_failure_total", "tgi_request_failure")
            for labels, v in samples.by_name.get(name, []) if labels.get("err") == "overloaded"
        ]
        return ServerMetrics(
            t=now(),
            running=value("tgi_batch_current_size"),
            waiting=value("tgi_queue_size"),
            kv_usage=kv_usage,
            kv_capacity_tokens=capacity,
            preemptions=None,
            rejections=sum(overloaded) if overloaded else zero,
            completed=value("tgi_request_success", "tgi_request_success_total"),
        )

    def describe(self) -> dict[str, Any]:
        doc = super().describe()
        info = self.info or {}
        doc.update(
            version=info.get("version"),
            served_model=info.get("model_id"),
            limits={
                key: info.get(key)
                for key in ("max_concurrent_requests", "max_input_tokens", "max_total_tokens",
                            "max_batch_total_tokens", "max_client_batch_size")
                if key in info
            },
            kv_capacity_tokens=self.kv_capacity_tokens,
            prompt_encoding=getattr(self.prompt_text, "__name__", repr(self.prompt_text)),
            exact_output_length=False,
        )
        return doc


SPEC = EngineSpec(
    name="tgi",
    engine_class=TGIEngine,
    summary="Hugging Face text-generation-inference 3.3.x, continuous batching; takes text, cannot ignore EOS",
)
