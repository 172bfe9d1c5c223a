"""SGLang's OpenAI-compatible server (``python -m sglang.launch_server``): a container or a URL.

Flags, request fields, routes and metric names were checked against SGLang 0.5.23 (the PyPI wheel
``sglang-0.5.23``, ``sglang/_version.py``; see ``fixtures/wire/sglang/README.md`` for each file):

- Flags are the fields of ``srt/arg_groups/fields/*.py`` (``--`` + the field name with dashes,
  ``arg_utils._field_to_cli_name``): ``schedule.py`` has ``max_running_requests``,
  ``max_queued_requests``, ``max_total_tokens``, ``chunked_prefill_size`` (-1 turns chunking off),
  ``max_prefill_tokens``, ``mem_fraction_static``, ``schedule_policy`` (fcfs, lpm, ...);
  ``model.py`` ``model_path`` (alias ``--model``), ``context_length``, ``load_format`` (``dummy``),
  ``dtype``; ``serving.py`` ``host``, ``port`` (default 30000), ``served_model_name``;
  ``memory.py`` ``disable_radix_cache``; ``observability.py`` ``enable_metrics``.
- ``POST /v1/completions`` (``srt/entrypoints/openai/serving_completions.py``) takes the prompt as
  token ids (passed on as ``input_ids``), ``ignore_eos`` for an exact output length,
  ``stream_options.include_usage`` / ``continuous_usage_stats`` and ``return_token_ids`` (each
  chunk's ``token_ids`` are its new output tokens). Unknown fields are ignored. An error inside the
  stream is ``{"error": {object, message, type, param, code}}``; a full queue
  (``--max-queued-requests``) is such an event with code 503 inside a 200 stream.
- ``/metrics`` (only with ``--enable-metrics``; ``srt/observability/metrics_collector.py``):
  ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:token_usage`` (a fraction),
  ``sglang:max_total_num_tokens`` (the KV pool in tokens) and the counter
  ``sglang:num_retracted_requests_total`` (requests preempted when the KV cache runs out).
  Nothing counts queue-full rejections, so ``rejections`` stays unknown.
- ``/server_info`` (``/get_server_info`` before it was renamed; both served by 0.5.23) carries
  ``version`` and ``max_total_num_tokens``; ``/health`` answers 200 once the server is up;
  ``POST /flush_cache`` drops the radix (prefix) cache, only while nothing runs or waits (400
  otherwise; ``?timeout=S`` waits up to S seconds for idle).

SGLang does not run here: the 0.5.23 wheel is a CPython 3.11 manylinux build (Rust extensions)
whose requirements pin a CUDA stack (``torch==2.14.1``, ``cuda-python>=13``, ``flashinfer_python
[cu13]``, ``sglang-kernel``, ``nvidia-cutlass-dsl[cu13]``), so it has no local launch
(``SPEC.local`` is None); it is reached in its container or at a URL.
"""

from __future__ import annotations

from statistics import fmean
from typing import Any, ClassVar

from batchbench.adapters.base import EngineHTTPError, StreamProtocolError
from batchbench.adapters.http import get_json, post_text
from batchbench.adapters.openai_compat import OpenAICompletionsEngine
from batchbench.adapters.prometheus import Samples
from batchbench.adapters.spec import EngineSpec
from batchbench.core.clock import now
from batchbench.core.config import BatchingConfig, Capabilities
from batchbench.core.server_metrics import ServerMetrics
from batchbench.workload.requests import Request


class SGLangEngine(OpenAICompletionsEngine):
    """SGLang: continuous batching over a paged KV pool, chunked prefill, RadixAttention prefix cache.

    BatchingConfig mapping: max_batch_size → ``--max-running-requests``; max_batched_tokens →
    ``--max-prefill-tokens`` (the token budget of a prefill batch) and, unless chunking is off,
    ``--chunked-prefill-size`` (the most prompt tokens prefilled per step); chunked_prefill=False →
    ``--chunked-prefill-size -1`` (True keeps SGLang's default chunk size, chunking on);
    kv_capacity_tokens → ``--max-total-tokens``; memory_fraction → ``--mem-fraction-static``;
    speculative_method=ngram → ``--speculative-algorithm NGRAM`` with ``--speculative-num-draft-tokens``
    draft_tokens + 1 (SGLang counts the verified token its draft tree grows from, as EAGLE's
    num_steps x topk + 1 does; the flags as ``arg_groups/fields/spec.py`` of sgl-project/sglang main
    names them, checked after 0.5.23: NGRAM is CUDA-only there). SGLang exposes no draft/accepted
    token counters (an accept-length gauge only), so ServerMetrics' speculation counters stay unknown.
    ModelRef's max_model_len → ``--context-length``; dummy_weights → ``--load-format dummy``.
    SGLang-only knobs: ``schedule_policy`` (``--schedule-policy``), ``max_queued_requests``
    (``--max-queued-requests``: past it requests are rejected), ``dtype``. The radix cache is off
    (``--disable-radix-cache``) as vLLM's prefix caching is: the suites replay identical prompts.
    At a URL someone else's SGLang may cache; :meth:`reset_cache` flushes it.
    """

    name: ClassVar[str] = "sglang"
    metric_prefixes: ClassVar[tuple[str, ...] | None] = (
        "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:max_total_num_tokens",
        "sglang:num_retracted_requests",
    )
    capabilities: ClassVar[Capabilities] = Capabilities(
        batching_modes=frozenset({"continuous"}),
        server_metrics=True,
        reports_kv_capacity=True,
        chunked_prefill=True,
        prefix_caching=True,
        speculation_methods=frozenset({"ngram"}),
    )

    def __init__(
        self,
        batching: BatchingConfig | None = None,
        *,
        schedule_policy: str | None = None,
        max_queued_requests: int | None = None,
        dtype: str | None = None,
        flush_timeout_s: float = 5.0,
        **served: Any,
    ) -> None:
        super().__init__(batching, **served)
        self.schedule_policy = schedule_policy
        self.max_queued_requests = max_queued_requests
        self.dtype = dtype
        self.flush_timeout_s = flush_timeout_s
        self.version: str | None = None
        #: The KV pool in tokens (/server_info's max_total_num_tokens, the gauge of the same name).
        self.kv_capacity_tokens: float | None = None

    # ------------------------------------------------------------------ launch

    def server_args(self, batching: BatchingConfig, *, host: str, port: int) -> list[str]:
        args = ["--model-path", self.model.path, "--host", host, "--port", str(port), "--enable-metrics"]
        if not batching.prefix_caching:  # off unless asked for, as vLLM's (BatchingConfig.prefix_caching)
            args.append("--disable-radix-cache")
        if self.model.served_name:
            args += ["--served-model-name", self.model.served_name]
        if self.model.dummy_weights:
            args += ["--load-format", "dummy"]
        if self.model.max_model_len is not None:
            args += ["--context-length", str(self.model.max_model_len)]
        if self.dtype is not None:
            args += ["--dtype", self.dtype]
        if batching.max_batch_size is not None:
            args += ["--max-running-requests", str(batching.max_batch_size)]
        if batching.max_batched_tokens is not None:
            args += ["--max-prefill-tokens", str(batching.max_batched_tokens)]
        if batching.chunked_prefill is False:
            args += ["--chunked-prefill-size", "-1"]
        elif batching.max_batched_tokens is not None:
            args += ["--chunked-prefill-size", str(batching.max_batched_tokens)]
        if batching.kv_capacity_tokens is not None:
            args += ["--max-total-tokens", str(batching.kv_capacity_tokens)]
        if batching.memory_fraction is not None:
            args += ["--mem-fraction-static", str(batching.memory_fraction)]
        if batching.speculative_method == "ngram":
            assert batching.draft_tokens is not None
            args += ["--speculative-algorithm", "NGRAM",
                     "--speculative-num-draft-tokens", str(batching.draft_tokens + 1)]
        if self.schedule_policy is not None:
            args += ["--schedule-policy", self.schedule_policy]
        if self.max_queued_requests is not None:
            args += ["--max-queued-requests", str(self.max_queued_requests)]
        return args

    async def wait_healthy(self, timeout: float) -> None:
        await super().wait_healthy(timeout)
        await self.load_server_info()

    async def load_server_info(self) -> dict[str, Any] | None:
        """GET /server_info (or /get_server_info of older versions): version and KV pool size."""
        assert self.client is not None, "load_server_info() before start()"
        for path in ("/server_info", "/get_server_info"):
            try:
                info = await get_json(self.client, self.name, path)
            except EngineHTTPError as exc:
                if exc.status == 404:
                    continue
                raise
            if not isinstance(info, dict):
                raise StreamProtocolError(self.name, f"{path} is not a JSON object: {info!r:.200}")
            if info.get("version") is not None:
                self.version = str(info["version"])
            if isinstance(info.get("max_total_num_tokens"), int | float):
                self.kv_capacity_tokens = float(info["max_total_num_tokens"])
            return info
        return None

    # ------------------------------------------------------------------ requests

    def payload(self, request: Request) -> dict[str, Any]:
        return {
            "model": self.model.request_name,
            "prompt": list(request.prompt_token_ids),
            "max_tokens": request.max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "return_token_ids": True,
        }

    async def reset_cache(self) -> bool:
        """``POST /flush_cache``, waiting up to ``flush_timeout_s`` for the server to be idle.

        Raises EngineHTTPError (400) when requests kept it busy. A server started with
        ``--disable-radix-cache`` (as batchbench starts it) flushes an empty cache: still True.
        """
        assert self.client is not None, "reset_cache() before start()"
        await post_text(self.client, self.name, "/flush_cache", params={"timeout": self.flush_timeout_s})
        return True

    # ------------------------------------------------------------------ metrics

    def normalize(self, samples: Samples) -> ServerMetrics:
        capacity = samples.sum("sglang:max_total_num_tokens")
        if capacity:
            self.kv_capacity_tokens = capacity
        # One series per scheduler that logs (attention-TP rank 0 of each DP rank): counts add up,
        # the usage fraction of equal pools is their mean.
        usage = [value for _, value in samples.by_name.get("sglang:token_usage", [])]
        return ServerMetrics(
            t=now(),
            running=samples.sum("sglang:num_running_reqs"),
            waiting=samples.sum("sglang:num_queue_reqs"),
            kv_usage=fmean(usage) if usage else None,
            kv_capacity_tokens=self.kv_capacity_tokens,
            preemptions=samples.sum("sglang:num_retracted_requests_total"),
            rejections=None,
        )

    def describe(self) -> dict[str, Any]:
        doc = super().describe()
        doc.update(
            version=self.version,
            kv_capacity_tokens=self.kv_capacity_tokens,
            schedule_policy=self.schedule_policy,
            radix_cache=False if self.launch is not None else None,
            exact_output_length=True,
        )
        return doc


SPEC = EngineSpec(
    name="sglang",
    engine_class=SGLangEngine,
    summary="SGLang 0.5.23 OpenAI-compatible server: continuous batching, chunked prefill, radix cache off",
)
