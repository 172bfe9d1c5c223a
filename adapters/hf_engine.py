"""What hf-static and hf-continuous share: a transformers server of batchbench's own
(:mod:`batchbench.adapters.hf_server`), launched here or reached at a URL, spoken to as vLLM is.

The two adapters differ only in the batcher they ask the server for and the settings that batcher takes, so a
comparison of the two is one model, one library, one set of kernels, static against continuous batching.
"""

from __future__ import annotations

import importlib.util
import sys
from abc import abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from batchbench.adapters.base import EngineCannotRunHere, EngineError, EngineHTTPError, EngineNotHealthy
from batchbench.adapters.http import get_json, post_json, post_text
from batchbench.adapters.launch import Launch, weights
from batchbench.adapters.launch.local import LocalProcess
from batchbench.adapters.openai_compat import OpenAICompletionsEngine
from batchbench.adapters.prometheus import Samples
from batchbench.core.clock import now
from batchbench.core.config import BatchingConfig, ModelRef
from batchbench.core.greedy import GreedyOutputs
from batchbench.core.server_metrics import ServerMetrics
from batchbench.fixtures import tiny_model_dir
from batchbench.workload.requests import Request

#: The server program in front of :meth:`HFServerEngine.server_args`.
LOCAL_PROGRAM = (sys.executable, "-m", "batchbench.adapters.hf_server")


class HFServerEngine(OpenAICompletionsEngine):
    """An engine served by :mod:`batchbench.adapters.hf_server` with the batcher named by :attr:`batcher`.

    ``threads`` is the server's torch thread count (``--threads``; None: one per CPU it is placed on, else torch's
    default); ``device`` where the model runs (``auto``: the GPU when the server's torch sees one). Without ``url``
    or ``launch`` the server is launched here as a local process.
    """

    #: The server's ``--batching``.
    batcher: ClassVar[str]
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
        threads: int | None = None,
        device: str = "auto",
        startup_timeout: float = 120.0,
        **served: Any,
    ) -> None:
        if model is None:  # at a URL, the server is asked which model it serves
            model = ModelRef("") if url is not None else \
                ModelRef(str(tiny_model_dir()), dummy_weights=True, served_name=tiny_model_dir().name)
        if url is None and launch is None:
            launch = LocalProcess(list(LOCAL_PROGRAM))
        super().__init__(batching, model=model, url=url, launch=launch, startup_timeout=startup_timeout, **served)
        #: A Llama-style config folder; its weights are always seeded random ones (nothing is downloaded).
        self.model_dir = Path(self.model.path)
        self.seed = seed
        self.dtype = dtype
        self.device = device
        #: Torch threads of the server: given, else one per CPU of its placement (``cpus``), else torch's default.
        self.threads = threads if threads is not None else (len(self.cpus) if self.cpus else None)
        #: What the server says it runs (``GET /batchbench/info``), once it is healthy.
        self.server_info: dict[str, Any] | None = None

    def server_args(self, batching: BatchingConfig, *, host: str, port: int) -> list[str]:
        args = ["--model", str(self.model_dir), "--batching", self.batcher, "--dtype", self.dtype,
                "--seed", str(self.seed), "--device", self.device, "--host", host, "--port", str(port)]
        if self.model.served_name:
            args += ["--served-model-name", self.model.served_name]
        if self.threads is not None:
            args += ["--threads", str(self.threads)]
        return args + self.batcher_args(batching)

    @abstractmethod
    def batcher_args(self, batching: BatchingConfig) -> list[str]:
        """The server flags of this adapter's batcher."""

    def check_server(self, info: dict[str, Any]) -> None:
        """Raise EngineNotHealthy (permanent) if a server run by hand batches otherwise than this adapter was
        configured to: its figures would be another configuration's."""

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
                raise EngineHTTPError(self.name, f"{self.base_url} is not a batchbench transformers server: "
                                      f"{exc.detail}", status=404, permanent=True) from exc
            raise
        served = info.get("batching", "static")
        if served != self.batcher:
            raise EngineNotHealthy(self.name, f"the server at {self.base_url} runs {served} batching, not "
                                   f"{self.batcher}: it is engine 'hf-{served}'", permanent=True)
        self.check_server(info)

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
            kv_usage=samples.sum("batchbench_hf_kv_cache_usage_perc"),
            kv_capacity_tokens=samples.sum("batchbench_hf_kv_cache_capacity_tokens"),
        )

    def describe(self) -> dict[str, Any]:
        """The served engine's description, with the settings the server reports (a server run by hand has its
        own)."""
        info = self.server_info or {}
        return super().describe() | {
            "model": {"path": info.get("model", self.model_dir.name), "dummy_weights": True,
                      "seed": info.get("seed", self.seed), "dtype": info.get("dtype", self.dtype)},
            "device": info.get("device", self.device),
            "threads": info.get("threads", self.threads),
            "versions": info.get("versions", {}),
            "server_build_s": {"import": info.get("import_s"), "model": info.get("build_s")},
        }

    async def greedy(self, prompts: Sequence[Sequence[int]], n: int) -> GreedyOutputs | None:
        """``POST /batchbench/greedy``: the prompts batched by this engine's own batcher, greedily. The source is the
        seeded weights' key where the server built the shipped seed and dtype (weights.SEED, weights.DTYPE)."""
        assert self.client is not None, "greedy() before start()"
        answer = await post_json(self.client, self.name, "/batchbench/greedy",
                                 {"prompts": [list(p) for p in prompts], "max_tokens": n}, timeout_s=120)
        seed, dtype = answer.get("seed"), answer.get("dtype")
        own = seed == weights.SEED and dtype == weights.DTYPE and (self.model_dir / "config.json").is_file()
        return GreedyOutputs(self.name, f"seeded (seed {seed}), {dtype}",
                             weights.model_key(self.model_dir, seeded=True) if own else None,
                             tuple(tuple(t) for t in answer["tokens"]))

    async def begin_run(self) -> None:
        """``POST /batchbench/begin_run``: the server's accounting starts afresh."""
        assert self.client is not None, "begin_run() before start()"
        await post_text(self.client, self.name, "/batchbench/begin_run")

    async def report(self) -> dict[str, Any]:
        """``GET /batchbench/report``: the batcher's accounting since :meth:`begin_run`. A server that cannot answer
        (it died during the run) gives ``{"error": why}``: the run's results are still written."""
        assert self.client is not None, "report() before start()"
        try:
            return await get_json(self.client, self.name, "/batchbench/report")
        except EngineError as exc:
            return {"error": str(exc)}
