"""llama.cpp's C++ server (``llama-server``): built here from the pinned sdist, a local process, a container, or a URL.

In a container (``--launch docker``; the default on a GPU host) the GGUF is made here as for a local run and its
folder mounted read-only: the image is llama.cpp's own CUDA server image on a GPU host, and on a CPU host
``batchbench-llamacpp`` (``docker/images.sh llamacpp``: Debian 12 with the build this machine made).

Flags, request fields, stream fields, routes and metric names were checked against llama.cpp 0c1e57098 (the
``vendor/llama.cpp`` of llama-cpp-python 0.3.36; :mod:`batchbench.adapters.launch.llamacpp_build`), the paths below
relative to it; ``fixtures/wire/llamacpp/`` holds the recorded exchanges:

- Slots and the KV cache (``tools/server/server.cpp``, ``server-context.cpp``): ``-np`` parallel slots, one
  sequence each, and ``-c`` the context in tokens. Without ``--kv-unified`` the cache is split evenly: each slot
  owns ``c / np`` tokens of it, and a request waits (deferred) until a slot is free, never for cells. With
  ``--kv-unified`` all slots share one pool, and a pool that runs out fails every request in flight with a 500
  (``server-context.cpp`` on a failed decode): batchbench never starts it that way.
- Batching (``server-context.cpp``, "batch any pending prompts without exceeding n_batch", run when
  ``params_base.cont_batching || batch.size() == 0``): with ``--cont-batching`` (the default) a new prompt joins the
  step that decodes the running slots; with ``--no-cont-batching`` it starts only in a step where no slot decodes,
  so requests are taken in waves: static batching, without padding. ``-b``/``-ub``: tokens per decode call.
- ``POST /v1/completions`` takes a token-id prompt, ``max_tokens``, ``ignore_eos`` (exactly ``max_tokens`` unless
  the slot's context fills: then ``finish_reason`` length, earlier), ``cache_prompt`` and ``timings_per_token``.
  Its usage comes on the last choice event, not on one of its own, whatever ``stream_options`` says
  (``server-task.cpp``); that event also carries the server's own ``timings`` of the request (``prompt_n``,
  ``prompt_ms``: the prefill, without the queue; ``predicted_n``, ``predicted_ms``: from the end of the prefill to
  the last token). A streamed event is not a token: a token that ends inside a UTF-8 character is held back and
  sent with the next, so each event's ``timings.predicted_n`` (``timings_per_token``) counts the tokens.
- The connection closes after every streamed response although the server answers ``Keep-Alive``
  (``server-http.cpp``'s chunked provider returns false after its last chunk, which cpp-httplib reads as a
  cancel): batchbench's stream client sends such a request again on a fresh connection and then stops reusing
  them (:mod:`batchbench.adapters.stream_client`).
- ``/metrics`` with ``--metrics`` (``server-task.cpp``): ``llamacpp:requests_processing`` (slots busy),
  ``llamacpp:requests_deferred`` (requests waiting for a slot), token counters; no KV gauge. ``/props``:
  ``total_slots``, each slot's ``n_ctx``, the build. ``/health``: 503 while loading, then 200.

KV usage as batchbench reports it is the share of the cache the busy slots own (``requests_processing`` over the
slots): with the cache split per slot, a sequence holds its slot's whole part, and a full set of busy slots is
the memory limit a waiting request meets.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from batchbench.adapters.base import EngineError, EngineHTTPError
from batchbench.adapters.http import get_json, post_json
from batchbench.adapters.launch import gguf, llamacpp_build, weights
from batchbench.adapters.launch.local import LocalProcess
from batchbench.adapters.openai_compat import OpenAICompletionsEngine
from batchbench.adapters.prometheus import Samples
from batchbench.adapters.spec import EngineSpec, LocalRun
from batchbench.core.clock import now
from batchbench.core.config import BatchingConfig, Capabilities, KVLayout
from batchbench.core.greedy import GreedyOutputs
from batchbench.core.server_metrics import ServerMetrics
from batchbench.fixtures import chat_template, shipped_model_dir, tiny_model_dir
from batchbench.workload.requests import Request

#: Slots when the config sets neither a seat cap nor a KV size: the quick profile's largest concurrency, so the
#: engine's default configuration queues no request of the suites' (llama-server's own auto choice is 4, which
#: would serve a wave of 8 in two halves). The cache is then 32 sequences of max_model_len: 64k tokens, 64 MiB of
#: the tiny model's f16 KV.
DEFAULT_SLOTS = 32
#: Where a launched server finds batchbench's chat template (its working directory: ``server_files``).
CHAT_TEMPLATE_FILE = "batchbench-chat-template.jinja"


class LlamaCppEngine(OpenAICompletionsEngine):
    """llama.cpp's server: slots over a KV cache split per slot, continuous batching by its own switch.

    BatchingConfig mapping: mode continuous/static → ``--cont-batching``/``--no-cont-batching``;
    max_batch_size → ``-np`` (slots: sequences at once); kv_capacity_tokens → ``-c`` (the whole cache, split over
    the slots: each gets ``c / np`` tokens, which must hold the longest sequence, ``max_model_len``); without a
    seat cap the slots are as many as the cache holds sequences of ``max_model_len``; max_batched_tokens →
    ``-b``/``-ub`` (tokens per decode call); prefix_caching → ``--cache-prompt``/``--no-cache-prompt`` (off unless
    asked for, as vLLM's: the suites replay identical prompts). Threads: one per CPU of the engine's placement
    (``-t``, ``-tb``), else llama.cpp's own choice.
    """

    name: ClassVar[str] = "llamacpp"
    metric_prefixes: ClassVar[tuple[str, ...] | None] = ("llamacpp:",)
    capabilities: ClassVar[Capabilities] = Capabilities(
        batching_modes=frozenset({"continuous", "static"}),
        server_metrics=True,
        reports_kv_capacity=True,
        prefix_caching=True,
        endpoints=frozenset({"completions", "chat"}),
    )
    #: A sequence holds one slot's whole part of the cache: the slot is the block (:meth:`kv_layout`).
    kv_per_slot: ClassVar[bool] = True

    def __init__(self, batching: BatchingConfig | None = None, **served: Any) -> None:
        super().__init__(batching, **served)
        #: The server's slots and its cache (its own /props once started; the launch's arguments before).
        self.slots: int | None = None
        self.kv_capacity_tokens: int | None = None
        self.version: str | None = None
        #: The GGUF a launched server serves (made from the model by :func:`gguf.ensure_gguf`).
        self.gguf: Path | None = None

    # ------------------------------------------------------------------ configuration

    @classmethod
    def check_config(cls, batching: BatchingConfig, *, max_model_len: int | None = None) -> None:
        super().check_config(batching, max_model_len=max_model_len)
        if batching.chunked_prefill is not None:
            raise ValueError(f"engine {cls.name!r} always splits a long prompt over decode calls of -b tokens; "
                             "leave BatchingConfig.chunked_prefill unset (max_batched_tokens sets -b)")
        if batching.memory_fraction is not None:
            raise ValueError(f"engine {cls.name!r} sizes its cache in tokens (-c): leave "
                             "BatchingConfig.memory_fraction unset, set kv_capacity_tokens")
        slots, ctx = cls.layout_of(batching, max_model_len)
        if max_model_len is not None and ctx // slots < max_model_len:
            raise ValueError(f"engine {cls.name!r}: kv_capacity_tokens={ctx} over {slots} slots gives each "
                             f"{ctx // slots} tokens, less than a sequence of {max_model_len} (max_model_len): "
                             f"give at least {slots * max_model_len}, or fewer slots (max_batch_size)")

    @staticmethod
    def layout_of(batching: BatchingConfig, max_model_len: int | None) -> tuple[int, int]:
        """(slots, context tokens) of a config: the seat cap, else as many sequences of ``max_model_len`` as the
        cache holds; the cache, else a slot of ``max_model_len`` each."""
        seq = max_model_len or 2048
        ctx = batching.kv_capacity_tokens
        slots = batching.max_batch_size or (max(1, ctx // seq) if ctx else DEFAULT_SLOTS)
        return slots, ctx or slots * seq

    def kv_layout(self) -> KVLayout | None:
        """Each slot's part of the cache is the unit a sequence takes (module docstring)."""
        slots, ctx = self.layout_of(self.batching, self.model.max_model_len)
        return KVLayout(block_tokens=ctx // slots, max_model_len=self.model.max_model_len)

    # ------------------------------------------------------------------ launch

    def server_args(self, batching: BatchingConfig, *, host: str, port: int) -> list[str]:
        slots, ctx = self.layout_of(batching, self.model.max_model_len)
        args = ["-m", str(self.model_file()), "--host", host, "--port", str(port), "--metrics",
                "-np", str(slots), "-c", str(ctx), "--no-kv-unified",
                "--cont-batching" if batching.mode == "continuous" else "--no-cont-batching",
                "--cache-prompt" if batching.prefix_caching else "--no-cache-prompt",
                "--no-webui", "--verbosity", "2"]  # warnings and errors: its default logs ten lines a request
        if self.model.served_name:
            args += ["--alias", self.model.served_name]
        if batching.max_batched_tokens is not None:
            args += ["-b", str(batching.max_batched_tokens), "-ub", str(batching.max_batched_tokens)]
        if self.cpus:
            args += ["-t", str(len(self.cpus)), "-tb", str(len(self.cpus))]
        if self.on_gpu():
            args += ["-ngl", "all"]  # every layer on the GPU: its default, "auto", fits what memory allows
        if self.endpoint == "chat" and shipped_model_dir(Path(self.model.path).name) is not None:
            args += ["--chat-template-file", CHAT_TEMPLATE_FILE]
        return args

    def on_gpu(self) -> bool:
        """The server runs on a GPU: the local CUDA build (:data:`llamacpp_build.CUDA_ENV`), or a container given
        GPUs (the CUDA image)."""
        if self.launch is None:  # at a URL: started by someone else
            return False
        if isinstance(self.launch, LocalProcess):
            return llamacpp_build.cuda_archs_from_env() is not None
        gpus = getattr(self.launch, "gpus", [])  # a container's: None is every GPU
        return gpus is None or bool(gpus)

    def server_files(self, batching: BatchingConfig) -> dict[str, str]:
        if self.endpoint == "chat" and shipped_model_dir(Path(self.model.path).name) is not None:
            return {CHAT_TEMPLATE_FILE: chat_template().read_text(encoding="utf-8")}
        return {}

    def model_file(self) -> Path:
        """The GGUF the server loads: the model as GGUF, made once where it is a config folder
        (:func:`gguf.ensure_gguf`: the shipped models with the HF engines' seeded weights)."""
        if self.gguf is None:
            try:
                self.gguf = gguf.ensure_gguf(Path(self.model.path), seeded=self.model.dummy_weights)
            except (gguf.ConversionError, llamacpp_build.BuildError) as exc:
                raise EngineError(self.name, str(exc), permanent=True) from exc
        return self.gguf

    @classmethod
    def container_model(cls, local: Path, *, seeded: bool) -> tuple[Path, str | None]:
        """The GGUF, made here (once, as for a local run) and mounted by its folder: the server reads one file, not
        a model folder."""
        try:
            made = gguf.ensure_gguf(local, seeded=seeded)
        except (gguf.ConversionError, llamacpp_build.BuildError) as exc:
            raise EngineError(cls.name, str(exc), permanent=True) from exc
        return made.parent, made.name

    async def wait_healthy(self, timeout: float) -> None:
        await super().wait_healthy(timeout)
        await self.load_props()

    async def load_props(self) -> None:
        """``GET /props``: its slots, each slot's context (so the cache) and its build."""
        assert self.client is not None
        try:
            props = await get_json(self.client, self.name, "/props")
        except EngineHTTPError:
            return  # a server without /props (someone else's proxy): the launch's figures stand
        if not isinstance(props, dict):
            return
        slots = props.get("total_slots")
        settings = props.get("default_generation_settings")
        n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
        if isinstance(slots, int) and slots > 0:
            self.slots = slots
            if isinstance(n_ctx, int):
                self.kv_capacity_tokens = slots * n_ctx
        if isinstance(props.get("build_info"), str):
            self.version = props["build_info"]

    async def greedy(self, prompts: Sequence[Sequence[int]], n: int) -> GreedyOutputs | None:
        """``POST /completion`` with ``return_tokens``, the prompts at once (the server's slots batch them). The
        source is the seeded weights' key where the GGUF was made here from a shipped model's seeded weights."""
        assert self.client is not None, "greedy() before start()"

        async def one(prompt: Sequence[int]) -> tuple[int, ...]:
            assert self.client is not None
            answer = await post_json(self.client, self.name, "/completion", {
                "prompt": list(prompt), "n_predict": n, "temperature": 0, "ignore_eos": True, "return_tokens": True,
                "cache_prompt": False}, timeout_s=120)
            return tuple(int(t) for t in answer["tokens"])

        tokens = tuple(await asyncio.gather(*(one(p) for p in prompts)))
        folder = Path(self.model.path)
        seeded = self.model.dummy_weights and (folder / "config.json").is_file()
        return GreedyOutputs(self.name, "seeded bf16, widened to f32 in a GGUF" if seeded else "the GGUF's own",
                             weights.model_key(folder, seeded=True) if seeded else None, tokens)

    # ------------------------------------------------------------------ requests

    def payload(self, request: Request) -> dict[str, Any]:
        return {
            "model": self.model.request_name,
            "prompt": list(request.prompt_token_ids),
            "max_tokens": request.max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "timings_per_token": True,
            "cache_prompt": bool(self.batching.prefix_caching),
        }

    def chat_payload(self, request: Request) -> dict[str, Any]:
        return {**super().chat_payload(request), "timings_per_token": True,
                "cache_prompt": bool(self.batching.prefix_caching)}

    def running_total(self, event: dict[str, Any]) -> int | None:
        """The tokens generated so far, from the event's ``timings.predicted_n`` (``timings_per_token``): an event
        may carry two tokens (module docstring), so one per event would miscount."""
        timings = event.get("timings")
        total = timings.get("predicted_n") if isinstance(timings, dict) else None
        return total if isinstance(total, int) else super().running_total(event)

    # ------------------------------------------------------------------ metrics

    def normalize(self, samples: Samples) -> ServerMetrics:
        running = samples.sum("llamacpp:requests_processing")
        slots = self.slots or self.layout_of(self.batching, self.model.max_model_len)[0]
        return ServerMetrics(
            t=now(),
            running=running,
            waiting=samples.sum("llamacpp:requests_deferred"),
            kv_usage=None if running is None or not slots else min(1.0, running / slots),
            kv_capacity_tokens=self.kv_capacity_tokens,
            preemptions=None,
            rejections=None,
        )

    def describe(self) -> dict[str, Any]:
        doc = super().describe()
        built = llamacpp_build.built()
        doc.update(version=self.version, slots=self.slots, kv_capacity_tokens=self.kv_capacity_tokens,
                   build=built if self.launch is not None else None,
                   gguf=gguf.describe(self.gguf) if self.gguf is not None else None,
                   prompt_cache=bool(self.batching.prefix_caching) if self.launch is not None else None,
                   exact_output_length=True)
        return doc


def _server_program() -> tuple[str, ...]:
    """The cached build's path (built by ``bootstrap.sh`` or on first use: :func:`prepare`); the CUDA build's where
    :data:`llamacpp_build.CUDA_ENV` names its architectures."""
    return (str(llamacpp_build.server_path(llamacpp_build.cuda_archs_from_env())),)


def prepare() -> None:
    """Build the server here if the cache has none (minutes, once per version); raise EngineError in one line
    where it cannot be (no compiler, no network)."""
    try:
        llamacpp_build.ensure_server(cuda_archs=llamacpp_build.cuda_archs_from_env())
    except llamacpp_build.BuildError as exc:
        raise EngineError("llamacpp", str(exc), permanent=True) from exc


SPEC = EngineSpec(
    name="llamacpp",
    engine_class=LlamaCppEngine,
    summary=f"llama.cpp's C++ server (llama-server {llamacpp_build.LLAMA_CPP_COMMIT}, built from "
            f"llama-cpp-python {llamacpp_build.VERSION}'s sdist): slots over a split KV cache, its own "
            "continuous/static switch",
    embedded=True,
    local=LocalRun(program=_server_program(), prepare=prepare, env_unset=("LLAMA_ARG_",)),
    container=True,  # images.toml: llama.cpp's own CUDA image on a GPU host, docker/images.sh's CPU image here
    start_estimate_s=5.0,
)


def main() -> int:
    """``python -m batchbench.adapters.llamacpp``: build the server (``bootstrap.sh`` does, so the main job's first
    run finds it) and the shipped model's GGUF; one line and exit 1 where it cannot be built."""
    try:
        path = llamacpp_build.ensure_server()
        gguf.ensure_gguf(tiny_model_dir(), seeded=True)
    except (llamacpp_build.BuildError, gguf.ConversionError) as exc:
        print(f"batchbench: {exc}", file=sys.stderr)
        return 1
    print(f"batchbench: llama.cpp's server: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
