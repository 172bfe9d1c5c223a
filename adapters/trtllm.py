"""NVIDIA TensorRT-LLM's ``trtllm-serve`` (PyTorch backend), OpenAI-compatible.

Names checked against TensorRT-LLM 1.x sources as stored on the main line
(the 1.0.0 docs and the ``tensorrt_llm/commands/serve.py``,
``serve/openai_protocol.py``, ``serve/openai_server.py``,
``serve/postprocess_handlers.py``, ``executor/result.py``,
``llmapi/llm_args.py``, ``_torch/pyexecutor/py_executor.py`` and
``metrics/collector.py`` files; see ``fixtures/wire/trtllm/README.md``):

- POST /v1/completions takes ``prompt`` as a list of token ids (used as
  given, no tokenisation), ``max_tokens``, ``ignore_eos`` (exact output
  length), ``top_k: 1`` (greedy) and ``stream_options`` with
  ``include_usage`` (a last chunk with ``choices: []`` and the engine's own
  ``usage``) and ``continuous_usage_stats`` (every chunk carries the running
  ``usage.completion_tokens``). The request model forbids unknown fields (a
  400), so nothing else is sent.
- Output tokens per chunk: ``choices[].token_ids`` when present (only with
  ``detokenize: false``, which newer trtllm-serve accept: ``return_token_ids=
  True``); otherwise the difference of the cumulative
  ``usage.completion_tokens`` between chunks (exact, speculative decoding
  included); only if neither is there, one token per choice object.
- GET /metrics is **not Prometheus**: a JSON list of per-iteration statistics
  (``numActiveRequests``, ``numQueuedRequests``, ``kvCacheStats.{usedNumBlocks,
  maxNumBlocks, tokensPerBlock}``, ``inflightBatchingStats`` ...), drained on
  every read, filled only with ``enable_iter_perf_stats: true``, and each read
  waits ~2 s for more statistics before answering. Newer versions started with
  ``return_perf_metrics: true`` also serve Prometheus text on
  /prometheus/metrics (``trtllm_num_requests_running``, ...):
  ``metrics_source="prometheus"`` reads that instead.
- trtllm-serve has no admission limit (no 429 of its own: requests queue) and
  does not send error events: a failure inside a stream drops the connection.

Batching: trtllm-serve flags ``--max_batch_size``, ``--max_num_tokens``,
``--max_seq_len``, ``--kv_cache_free_gpu_memory_fraction``; everything without
a flag goes into the LLM API options YAML (``--extra_llm_api_options``, also
spelt ``--config`` in newer versions): ``kv_cache_config.max_tokens``,
``enable_chunked_prefill``, and the batching mode as
``scheduler_config.capacity_scheduler_policy`` (``GUARANTEED_NO_EVICT``,
trtllm-serve's default, for continuous in-flight batching; ``STATIC_BATCH``
for real static batching, which the PyTorch backend's capacity scheduler
implements by admitting new requests only into an empty batch; the TensorRT
backend's ``batching_type: STATIC`` does not exist for PyTorch). A YAML
``kv_cache_config`` replaces the one built from the flags wholesale, so the
memory fraction is repeated there.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from batchbench.adapters.base import EngineHTTPError, StreamProtocolError
from batchbench.adapters.http import get_json, get_text
from batchbench.adapters.openai_compat import OpenAICompletionsEngine
from batchbench.adapters.prometheus import Samples
from batchbench.adapters.spec import EngineSpec
from batchbench.core.clock import now
from batchbench.core.config import BatchingConfig, Capabilities
from batchbench.core.server_metrics import ServerMetrics
from batchbench.workload.requests import Request

MetricsSource = Literal["iterations", "prometheus"]
#: Prometheus text of newer trtllm-serve started with ``return_perf_metrics: true``.
PROMETHEUS_PATH = "/prometheus/metrics"


def to_yaml(doc: Mapping[str, Any], indent: int = 0) -> str:
    """A small block-YAML writer for nested mappings of scalars (no PyYAML needed).

    Strings are double-quoted JSON strings, which YAML reads as the same string.
    """
    lines = []
    pad = " " * indent
    for key, value in doc.items():
        if isinstance(value, Mapping):
            lines.append(f"{pad}{key}:")
            lines.append(to_yaml(value, indent + 2))
        else:
            lines.append(f"{pad}{key}: {json.dumps(value)}")
    return "\n".join(lines)


def deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


class TRTLLMEngine(OpenAICompletionsEngine):
    """trtllm-serve: in-flight (continuous) batching, or real static batching via STATIC_BATCH.

    BatchingConfig mapping: mode → ``scheduler_config.capacity_scheduler_policy``
    (YAML); max_batch_size → ``--max_batch_size``; max_batched_tokens →
    ``--max_num_tokens``; chunked_prefill → ``enable_chunked_prefill`` (YAML);
    kv_capacity_tokens → ``kv_cache_config.max_tokens`` (YAML);
    memory_fraction → ``--kv_cache_free_gpu_memory_fraction`` and
    ``kv_cache_config.free_gpu_memory_fraction``. Block reuse (prefix caching)
    is off, as for vLLM. ModelRef's max_model_len → ``--max_seq_len``;
    dummy_weights → ``load_format: DUMMY``. Speculative decoding is refused
    (check_config names speculative_method): TensorRT-LLM's NGram drafting is an
    LLM API ``speculative_config`` this adapter has not been checked against.

    The YAML must exist where the server runs: :meth:`server_files` gives
    ``{options_path: content}`` for the launch to write or mount before it
    starts the server (``options_path`` is as the server sees it).
    """

    name: ClassVar[str] = "trtllm"
    capabilities: ClassVar[Capabilities] = Capabilities(
        batching_modes=frozenset({"static", "continuous"}),
        server_metrics=True,
        pads_batches=False,
        reports_kv_capacity=True,
        chunked_prefill=True,
    )

    def __init__(
        self,
        batching: BatchingConfig | None = None,
        *,
        backend: str = "pytorch",
        options_path: str = "batchbench-trtllm-options.yaml",
        extra_options: Mapping[str, Any] | None = None,
        tokenizer: str | None = None,
        return_token_ids: bool = False,
        metrics_source: MetricsSource = "iterations",
        **served: Any,
    ) -> None:
        super().__init__(batching, **served)
        if metrics_source not in ("iterations", "prometheus"):
            raise ValueError(
                f"engine 'trtllm': metrics_source must be 'iterations' or 'prometheus', not {metrics_source!r}")
        self.backend = backend
        self.options_path = options_path
        self.extra_options = dict(extra_options or {})
        self.tokenizer = tokenizer
        self.return_token_ids = return_token_ids
        self.metrics_source: MetricsSource = metrics_source
        self.version: str | None = None
        self.kv_capacity_tokens: float | None = None
        self.last_iteration: dict[str, Any] | None = None

    # ------------------------------------------------------------------ launch

    def llm_api_options(self, batching: BatchingConfig) -> dict[str, Any]:
        """The LLM API options (TorchLlmArgs fields) that have no trtllm-serve flag."""
        kv_cache: dict[str, Any] = {"enable_block_reuse": False}
        if batching.memory_fraction is not None:
            kv_cache["free_gpu_memory_fraction"] = batching.memory_fraction
        if batching.kv_capacity_tokens is not None:
            kv_cache["max_tokens"] = batching.kv_capacity_tokens
        options: dict[str, Any] = {
            # /metrics stays an empty list without it (PyTorch backend).
            "enable_iter_perf_stats": True,
            "scheduler_config": {
                "capacity_scheduler_policy": "STATIC_BATCH" if batching.mode == "static" else "GUARANTEED_NO_EVICT",
            },
            "kv_cache_config": kv_cache,
        }
        if batching.chunked_prefill is not None:
            options["enable_chunked_prefill"] = batching.chunked_prefill
        if self.model.dummy_weights:
            options["load_format"] = "DUMMY"
        return deep_merge(options, self.extra_options)

    def llm_api_options_yaml(self, batching: BatchingConfig | None = None) -> str:
        batching = batching or self.batching
        header = f"# batchbench: TensorRT-LLM LLM API options for {self.name} {batching.label()}\n"
        return header + to_yaml(self.llm_api_options(batching)) + "\n"

    def server_files(self, batching: BatchingConfig) -> dict[str, str]:
        """Files the server needs before it starts, path (as the server sees it) → content."""
        return {self.options_path: self.llm_api_options_yaml(batching)}

    def server_args(self, batching: BatchingConfig, *, host: str, port: int) -> list[str]:
        args = [self.model.path, "--host", host, "--port", str(port), "--backend", self.backend]
        if self.tokenizer is not None:
            args += ["--tokenizer", self.tokenizer]
        if batching.max_batch_size is not None:
            args += ["--max_batch_size", str(batching.max_batch_size)]
        if batching.max_batched_tokens is not None:
            args += ["--max_num_tokens", str(batching.max_batched_tokens)]
        if self.model.max_model_len is not None:
            args += ["--max_seq_len", str(self.model.max_model_len)]
        if batching.memory_fraction is not None:
            args += ["--kv_cache_free_gpu_memory_fraction", str(batching.memory_fraction)]
        args += ["--extra_llm_api_options", self.options_path]
        return args

    async def wait_healthy(self, timeout: float) -> None:
        await super().wait_healthy(timeout)
        assert self.client is not None
        try:
            doc = await get_json(self.client, self.name, "/version")
        except EngineHTTPError:
            doc = None
        if isinstance(doc, dict) and doc.get("version") is not None:
            self.version = str(doc["version"])

    # ------------------------------------------------------------------ requests

    def payload(self, request: Request) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "model": self.model.request_name,
            "prompt": list(request.prompt_token_ids),
            "max_tokens": request.max_tokens,
            "ignore_eos": True,
            "top_k": 1,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        if self.return_token_ids:
            payload["detokenize"] = False
        return payload

    # ------------------------------------------------------------------ metrics

    async def scrape(self) -> ServerMetrics | None:
        if self.client is None:
            return None
        if self.metrics_source == "prometheus":
            return self.normalize(Samples.parse(await get_text(self.client, self.name, PROMETHEUS_PATH)))
        return self.normalize_iterations(await get_json(self.client, self.name, "/metrics"))

    def normalize_iterations(self, stats: Any) -> ServerMetrics:
        """Map /metrics' iteration statistics (the latest iteration) onto ServerMetrics.

        The endpoint drains: an empty list means no iteration ran since the
        last read, so nothing was running or queued (a queued request is
        scheduled at the next iteration); KV usage is then unknown. Its
        ``numCompletedRequests`` is per iteration, and drained iterations are
        lost, so no cumulative ``completed`` count comes from here.
        """
        if not isinstance(stats, list):
            raise StreamProtocolError(self.name, f"/metrics is not a JSON list: {stats!r:.200}")
        entries = [json.loads(s) if isinstance(s, str) else s for s in stats]
        entries = [e for e in entries if isinstance(e, dict)]
        if not entries:
            return ServerMetrics(t=now(), running=0.0, waiting=0.0, kv_capacity_tokens=self.kv_capacity_tokens)
        latest = max(entries, key=lambda e: e.get("iter", -1) if isinstance(e.get("iter"), int) else -1)
        self.last_iteration = latest
        kv = latest.get("kvCacheStats") or {}
        max_blocks, used, per_block = kv.get("maxNumBlocks"), kv.get("usedNumBlocks"), kv.get("tokensPerBlock")
        if max_blocks is not None and per_block is not None:
            self.kv_capacity_tokens = float(max_blocks * per_block)
        return ServerMetrics(
            t=now(),
            running=_number(latest.get("numActiveRequests")),
            waiting=_number(latest.get("numQueuedRequests")),
            kv_usage=float(used) / max_blocks if used is not None and max_blocks else None,
            kv_capacity_tokens=self.kv_capacity_tokens,
            preemptions=None,
            rejections=None,
        )

    def normalize(self, samples: Samples) -> ServerMetrics:
        """/prometheus/metrics (newer trtllm-serve with ``return_perf_metrics: true``)."""
        max_blocks = samples.sum("trtllm_kv_cache_max_blocks")
        per_block = samples.sum("trtllm_kv_cache_tokens_per_block")
        used = samples.sum("trtllm_kv_cache_used_blocks")
        if max_blocks is not None and per_block is not None:
            self.kv_capacity_tokens = max_blocks * per_block
        kv_usage = samples.sum("trtllm_kv_cache_utilization")
        if kv_usage is None and used is not None and max_blocks:
            kv_usage = used / max_blocks
        return ServerMetrics(
            t=now(),
            running=samples.sum("trtllm_num_requests_running"),
            waiting=samples.sum("trtllm_num_requests_waiting"),
            kv_usage=kv_usage,
            kv_capacity_tokens=self.kv_capacity_tokens,
            preemptions=None,
            rejections=None,
            completed=samples.sum("trtllm_request_success_total"),
        )

    def describe(self) -> dict[str, Any]:
        doc = super().describe()
        doc.update(
            version=self.version,
            backend=self.backend,
            llm_api_options=self.llm_api_options(self.batching),
            metrics_source=self.metrics_source,
            token_counting="token_ids" if self.return_token_ids else "usage.completion_tokens deltas",
            kv_capacity_tokens=self.kv_capacity_tokens,
            exact_output_length=True,
        )
        return doc


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


SPEC = EngineSpec(
    name="trtllm",
    engine_class=TRTLLMEngine,
    summary="TensorRT-LLM trtllm-serve 1.x (PyTorch backend), inflight or static batching",
)
