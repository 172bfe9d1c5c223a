"""hf-static: the classic static-batching baseline, real compute, in a server process of its own.

Requests are gathered into a batch, left-padded to the longest prompt and run through Hugging Face
transformers' ``generate()`` as one tensor (:mod:`batchbench.adapters.hf_server`, launched as a local
process or run by hand and reached at a URL). Nothing joins a running batch; every slot decodes until
the longest request of the batch is done. Pad tokens in prefill and the decode steps of finished slots
are counted exactly by the server (see :meth:`HFStaticEngine.report`): that waste is what continuous
batching removes.

The server speaks vLLM's completions stream, so the client side is the OpenAI-compatible one
(:class:`~batchbench.adapters.openai_compat.OpenAICompletionsEngine` over the fast stream client):
hf-static is timed on the client's clock exactly as vLLM is, and its model steps no longer hold the
load generator's GIL.

The model is the tiny Llama config in fixtures/ with seeded random weights, so nothing is downloaded;
any local Llama-style config directory works.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any, ClassVar

from batchbench.adapters.base import EngineCannotRunHere, EngineError, EngineHTTPError, EngineNotHealthy
from batchbench.adapters.http import get_json, post_text
from batchbench.adapters.launch import Launch
from batchbench.adapters.launch.local import LocalProcess
from batchbench.adapters.openai_compat import OpenAICompletionsEngine
from batchbench.adapters.prometheus import Samples
from batchbench.adapters.spec import EngineSpec, LocalRun
from batchbench.core.clock import now
from batchbench.core.config import BatchingConfig, Capabilities, ModelRef
from batchbench.core.server_metrics import ServerMetrics
from batchbench.fixtures import tiny_model_dir
from batchbench.workload.requests import Request

#: The server program in front of :meth:`HFStaticEngine.server_args`.
LOCAL_PROGRAM = (sys.executable, "-m", "batchbench.adapters.hf_server")
#: Padded batch size when BatchingConfig.max_batch_size is unset.
DEFAULT_BATCH_SIZE = 8


class HFStaticEngine(OpenAICompletionsEngine):
    """Static batching with padding, over transformers ``generate()`` in :mod:`batchbench.adapters.hf_server`.

    BatchingConfig mapping: max_batch_size is the padded batch size (``--max-batch-size``, default 8);
    a batch closes when it is full or ``batch_window_s`` after its first request arrived.
    max_batched_tokens, chunked prefill and KV capacity have no meaning here and are refused, and so is
    speculative decoding: ``generate()``'s prompt lookup (``prompt_lookup_num_tokens``) is assisted
    generation, which transformers 5.19 refuses for more than one sequence ("assisted generate is only
    supported for batch_size = 1", ``generation/utils.py``), so it cannot speculate over a padded batch.
    ``threads`` is the server's torch thread count (``--threads``; None: one per CPU it is placed on, else torch's
    default).

    Without ``url`` or ``launch`` the server is launched here as a local process.
    """

    name: ClassVar[str] = "hf-static"
    capabilities: ClassVar[Capabilities] = Capabilities(
        batching_modes=frozenset({"static"}), server_metrics=True, pads_batches=True
    )
    metric_prefixes: ClassVar[tuple[str, ...] | None] = ("batchbench_hf_",)

    def __init__(
        self,
        batching: BatchingConfig | None = None,
        *,
        model: ModelRef | None = None,
        url: str | None = None,
        launch: Launch | None = None,
        seed: int = 0,
        dtype: str = "bfloat16",
        batch_window_s: float = 0.02,
        threads: int | None = None,
        startup_timeout: float = 120.0,
        **served: Any,
    ) -> None:
        if model is None:  # at a URL, the server is asked which model it serves
            model = ModelRef("") if url is not None else \
                ModelRef(str(tiny_model_dir()), dummy_weights=True, served_name=tiny_model_dir().name)
        if url is None and launch is None:
            launch = LocalProcess(list(LOCAL_PROGRAM))
        super().__init__(batching or BatchingConfig(mode="static", max_batch_size=DEFAULT_BATCH_SIZE), model=model,
                         url=url, launch=launch, startup_timeout=startup_timeout, **served)
        self.max_batch_size = self.batching.max_batch_size or DEFAULT_BATCH_SIZE
        #: A Llama-style config folder; its weights are always seeded random ones (nothing is downloaded).
        self.model_dir = Path(self.model.path)
        self.seed = seed
        self.dtype = dtype
        self.batch_window_s = batch_window_s
        #: Torch threads of the server: given, else one per CPU of its placement (``cpus``), else torch's default.
        self.threads = threads if threads is not None else (len(self.cpus) if self.cpus else None)
        #: What the server says it runs (``GET /batchbench/info``), once it is healthy.
        self.server_info: dict[str, Any] | None = None

    @classmethod
    def check_config(cls, batching: BatchingConfig, *, max_model_len: int | None = None) -> None:
        super().check_config(batching, max_model_len=max_model_len)
        b = batching
        if b.max_batched_tokens is not None or b.chunked_prefill or b.kv_capacity_tokens is not None:
            raise ValueError(
                "engine 'hf-static' pads whole batches: max_batched_tokens, chunked_prefill and "
                "kv_capacity_tokens do not apply (set only max_batch_size)"
            )

    def server_args(self, batching: BatchingConfig, *, host: str, port: int) -> list[str]:
        args = ["--model", str(self.model_dir), "--max-batch-size", str(self.max_batch_size),
                "--batch-window-s", f"{self.batch_window_s:g}", "--dtype", self.dtype, "--seed", str(self.seed),
                "--host", host, "--port", str(port)]
        if self.model.served_name:
            args += ["--served-model-name", self.model.served_name]
        if self.threads is not None:
            args += ["--threads", str(self.threads)]
        return args

    async def start(self) -> None:
        if self.launch is not None:
            # Said here, at once, rather than by a server that exits before it listens.
            if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None:
                raise EngineCannotRunHere(self.name, "cannot run here: it needs torch and transformers "
                                          "(pip install -e '.[cpu]')")
            if not (self.model_dir / "config.json").is_file():
                raise EngineNotHealthy(self.name, f"cannot load the model config from {self.model_dir}: "
                                       "no config.json there", permanent=True)
        await super().start()

    async def wait_healthy(self, timeout: float) -> None:
        """Healthy, then its settings read: a server run by hand must batch as this adapter was configured."""
        await super().wait_healthy(timeout)
        assert self.client is not None
        try:
            self.server_info = info = await get_json(self.client, self.name, "/batchbench/info")
        except EngineHTTPError as exc:
            if exc.status == 404:
                raise EngineHTTPError(self.name, f"{self.base_url} is not an hf-static server: {exc.detail}",
                                      status=404, permanent=True) from exc
            raise
        if info.get("max_batch_size") != self.max_batch_size:
            raise EngineNotHealthy(
                self.name, f"the server at {self.base_url} pads batches of {info.get('max_batch_size')}, not "
                f"{self.max_batch_size}: give --batching mode=static,max_batch_size={info.get('max_batch_size')} "
                "or start it with that --max-batch-size", permanent=True)

    def payload(self, request: Request) -> dict[str, Any]:
        return {
            "model": self.model.request_name,
            "prompt": list(request.prompt_token_ids),
            "max_tokens": request.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }

    def normalize(self, samples: Samples) -> ServerMetrics:
        return ServerMetrics(
            t=now(),
            running=samples.sum("batchbench_hf_num_requests_running"),
            waiting=samples.sum("batchbench_hf_num_requests_waiting"),
            completed=samples.sum("batchbench_hf_request_success_total"),
        )

    def describe(self) -> dict[str, Any]:
        """The served engine's description, with the settings the server reports (a server run by hand has its
        own) in the fields hf-static always had."""
        info = self.server_info or {}
        return super().describe() | {
            "model": {"path": info.get("model", self.model_dir.name), "dummy_weights": True,
                      "seed": info.get("seed", self.seed), "dtype": info.get("dtype", self.dtype)},
            "batch_window_s": info.get("batch_window_s", self.batch_window_s),
            "threads": info.get("threads", self.threads),
            "versions": info.get("versions", {}),
            "server_build_s": {"import": info.get("import_s"), "model": info.get("build_s")},
        }

    async def begin_run(self) -> None:
        """``POST /batchbench/begin_run``: the server's batch accounting starts afresh."""
        assert self.client is not None, "begin_run() before start()"
        await post_text(self.client, self.name, "/batchbench/begin_run")

    async def report(self) -> dict[str, Any]:
        """``GET /batchbench/report``: the batches since :meth:`begin_run`, their pad tokens
        (``prompt_pad_tokens``, ``prompt_pad_fraction``) and idle decode slots (``idle_decode_slots``,
        ``decode_idle_fraction``). A server that cannot answer (it died during the run) gives
        ``{"error": why}``: the run's results are still written."""
        assert self.client is not None, "report() before start()"
        try:
            return await get_json(self.client, self.name, "/batchbench/report")  # type: ignore[no-any-return]
        except EngineError as exc:
            return {"error": str(exc)}


SPEC = EngineSpec(
    name="hf-static",
    engine_class=HFStaticEngine,
    summary="transformers generate() over left-padded batches: real static batching with real padding, "
            "in a local server process",
    embedded=True,
    local=LocalRun(program=LOCAL_PROGRAM),
    container=False,
)
