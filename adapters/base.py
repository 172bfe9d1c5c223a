"""The one interface every engine adapter implements.

The load generator only ever talks to :class:`Engine`; each adapter maps the
engine-neutral :class:`BatchingConfig` onto its engine's own options, turns the
engine's wire format into :class:`Chunk` objects stamped on arrival, and
normalises the engine's Prometheus names into :class:`ServerMetrics`. Nothing
above this layer knows which engine it is measuring.
"""

from __future__ import annotations

import asyncio
import os
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol, Self

from batchbench.core import codec
from batchbench.core.clock import now
from batchbench.core.config import BatchingConfig, Capabilities, KVLayout
from batchbench.core.environment import cuda_visible_devices
from batchbench.core.eventloop import cancel_and_wait
from batchbench.core.greedy import GreedyOutputs
from batchbench.core.placement import EngineCpus
from batchbench.core.server_metrics import ServerMetrics
from batchbench.workload.lora import Lora
from batchbench.workload.requests import Request

#: Where a request's token counts came from: the engine's own usage report, else (a server that sends none) the
#: served model's tokenizer over the streamed text, else one token per streamed piece.
#: Where a request's token totals came from: the engine's usage (on an event of its own, as OpenAI sends it, or on the
#: last choice event, as llama.cpp's server does), else counted here (the served tokenizer, or one per piece).
UsageSource = Literal["engine", "engine-last-choice", "tokenizer", "chunks"]


@dataclass(frozen=True, slots=True)
class Usage:
    """Token totals as the engine itself reports them; never re-tokenised, unless ``source`` says otherwise (a
    server that sent no usage at all)."""

    prompt_tokens: int | None
    completion_tokens: int | None
    #: Of the completion tokens, those the engine says were reasoning (``completion_tokens_details``); None: it
    #: does not say.
    reasoning_tokens: int | None = None
    source: UsageSource = "engine"
    #: The server's own timing of the request where it sends one (llama.cpp's ``timings``: ``prompt_n``,
    #: ``prompt_ms``, ``predicted_n``, ``predicted_ms``, ``cache_n``), kept beside batchbench's own for validity.
    timings: dict[str, float] | None = None


#: The fields of a server's per-request ``timings`` kept in a record (llama.cpp's ``tools/server/server-task.cpp``).
SERVER_TIMINGS = ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "cache_n")


def server_timings(event: dict[str, Any]) -> dict[str, float] | None:
    """An event's ``timings`` (llama.cpp's server sends them with its totals), the numeric :data:`SERVER_TIMINGS`
    only; None where it sends none."""
    timings = event.get("timings")
    if not isinstance(timings, dict):
        return None
    return {k: v for k in SERVER_TIMINGS if isinstance(v := timings.get(k), int | float)} or None


@dataclass(frozen=True, slots=True)
class Chunk:
    """One streamed piece of a response, stamped with :func:`now` on arrival.

    ``n_tokens`` is the engine's own count of output tokens in this piece (a
    piece may carry several). The final piece may carry ``usage`` and a
    ``finish_reason`` and no tokens at all.
    """

    t: float
    n_tokens: int
    usage: Usage | None = None
    finish_reason: str | None = None
    #: On the first piece only, where the adapter knows it: when the request was written to the connection
    #: (:func:`now`). Later than the load generator's own stamp, taken before the adapter built the request,
    #: so the client's own preparation is not counted as the engine's latency.
    sent: float | None = None
    #: The piece's tokens are reasoning (a chat stream's ``reasoning`` / ``reasoning_content`` delta), not the
    #: answer.
    reasoning: bool = False
    #: The first piece of the answer in a chat stream (where time to first output token is taken).
    first_output: bool = False


class ChunkSink(Protocol):
    """Where a stream's pieces go as they arrive, without an object per piece: the load generator's record.

    :meth:`Engine.stream_into` calls it; what it raises ends the stream and is raised by ``stream_into``.
    """

    def sent(self, t: float) -> None:
        """The request was written to the connection at ``t`` (:func:`now`), later than the caller's own stamp."""

    def tokens(self, t: float, n: int, finish_reason: str | None = None) -> None:
        """A piece that arrived at ``t`` carried ``n`` output tokens (the engine's own count; 0 with a finish
        reason alone)."""

    def usage(self, t: float, usage: Usage) -> None:
        """The engine's own token totals arrived at ``t``."""

    def reasoning(self, t: float, n: int, finish_reason: str | None = None) -> None:
        """A piece that arrived at ``t`` carried ``n`` reasoning tokens: tokens like any other (TTFT, ITL, the
        limit), also counted apart."""

    def first_output(self, t: float) -> None:
        """A chat stream's first piece of the answer (not reasoning) arrived at ``t``; called just before its
        :meth:`tokens`. Chat streams only: the completions path stays as it is."""


class _ChunkQueue:
    """A :class:`ChunkSink` that makes each piece a :class:`Chunk`, for :func:`chunks_of`."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Chunk | None] = asyncio.Queue()
        self._sent: float | None = None
        self._first_output = False

    def sent(self, t: float) -> None:
        self._sent = t

    def tokens(self, t: float, n: int, finish_reason: str | None = None) -> None:
        self.queue.put_nowait(Chunk(t=t, n_tokens=n, finish_reason=finish_reason, sent=self._sent,
                                    first_output=self._first_output))
        self._sent, self._first_output = None, False

    def reasoning(self, t: float, n: int, finish_reason: str | None = None) -> None:
        self.queue.put_nowait(Chunk(t=t, n_tokens=n, finish_reason=finish_reason, sent=self._sent, reasoning=True))
        self._sent = None

    def first_output(self, t: float) -> None:
        self._first_output = True

    def usage(self, t: float, usage: Usage) -> None:
        self.queue.put_nowait(Chunk(t=t, n_tokens=0, usage=usage, sent=self._sent))
        self._sent = None


async def chunks_of(stream_into: Callable[[ChunkSink], Coroutine[Any, Any, None]]) -> AsyncIterator[Chunk]:
    """The pieces a ``stream_into`` call hands its sink, as :class:`Chunk` objects: :meth:`Engine.stream` for
    an engine whose own path is :meth:`Engine.stream_into`. The stream runs in a task of its own; leaving
    the iteration early cancels it, and its failure is raised after the pieces that came before it."""
    sink = _ChunkQueue()
    task = asyncio.create_task(stream_into(sink))
    task.add_done_callback(lambda _: sink.queue.put_nowait(None))
    try:
        while (chunk := await sink.queue.get()) is not None:
            yield chunk
        task.result()
    finally:
        if not task.done():
            await cancel_and_wait(task)


class EngineError(Exception):
    """Any failure of an engine, with the engine (and request) named.

    ``kind`` is a stable machine-readable reason stored in the records.
    """

    kind: ClassVar[str] = "engine_error"

    def __init__(self, engine: str, message: str, *, request_id: str | None = None, permanent: bool = False) -> None:
        self.engine = engine
        self.request_id = request_id
        self.detail = message
        #: Waiting will not change it (a host that does not resolve, TLS to a plain-HTTP port, a server
        #: that is not this engine): health checks stop at once instead of polling until their deadline.
        self.permanent = permanent
        super().__init__(self._text())

    def _text(self) -> str:
        where = f"engine {self.engine!r}" + (f", request {self.request_id}" if self.request_id else "")
        return f"{where}: {self.detail}"

    def with_detail(self, detail: str) -> Self:
        """The same error (type, status, permanence) with a longer message, e.g. the server's log."""
        clone = type(self).__new__(type(self))  # copy.copy would call __init__ with the formatted text
        clone.__dict__.update(self.__dict__)
        clone.detail = detail
        clone.args = (clone._text(),)
        return clone


class EngineUnreachable(EngineError):
    """Nothing answers at the engine's address (wrong URL, not started, died)."""

    kind = "unreachable"


class ConnectionRefused(EngineUnreachable):
    """Nothing listens at the engine's address: the host answered, and refused the connection. A server that
    is starting may still be binding its port; one at a URL someone else runs is either there or not."""


class EngineCannotRunHere(EngineUnreachable):
    """This environment lacks what the engine needs (its package, a Docker engine to launch it in): a reason to
    skip, with this message, wherever the engine is started (the engine cache, a suite's private engine)."""

    kind = "cannot_run_here"


class EngineNotHealthy(EngineError):
    """The engine did not become healthy within the start-up timeout."""

    kind = "not_healthy"


class EngineDied(EngineError):
    """The engine process exited while it was expected to serve."""

    kind = "engine_died"


class EngineRejected(EngineError):
    """The engine refused the request as overloaded (HTTP 429 or 503)."""

    kind = "rejected"

    def __init__(self, engine: str, message: str, *, status: int, request_id: str | None = None) -> None:
        self.status = status
        super().__init__(engine, message, request_id=request_id)


class EngineHTTPError(EngineError):
    """Any other non-success HTTP answer (a bad option, a 4xx/5xx)."""

    kind = "http_error"

    def __init__(self, engine: str, message: str, *, status: int, request_id: str | None = None,
                 permanent: bool = False) -> None:
        self.status = status
        super().__init__(engine, message, request_id=request_id, permanent=permanent)


class StreamProtocolError(EngineError):
    """The stream was malformed or ended before the engine said it was done."""

    kind = "protocol_error"


class Engine(ABC):
    """An LLM serving engine under test.

    Lifecycle: ``async with engine:`` starts it (or connects to a URL), waits
    until it is healthy and always stops what it started. ``stream()`` may be
    called concurrently from many tasks; it must raise an :class:`EngineError`
    subclass for every failure so the load generator can record the reason.
    """

    #: Registry name used on the command line (``--engine NAME``).
    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]

    #: Tokens per KV-cache block when BatchingConfig.kv_capacity_tokens sizes the cache (it is allocated in
    #: whole blocks); None: the engine's KV capacity cannot be set in blocks.
    kv_block_size: ClassVar[int | None] = None
    #: Blocks the engine keeps back from the cache it is given (never holding a sequence's KV).
    kv_reserved_blocks: ClassVar[int] = 0
    #: The cache is split evenly over ``max_batch_size`` slots, one sequence each (llama.cpp's server): a request
    #: beyond them waits for a slot and never preempts (:func:`batchbench.load.sweep.slot_limited_design`).
    kv_per_slot: ClassVar[bool] = False
    #: The largest LoRA rank the engine serves when BatchingConfig.max_lora_rank is unset (None: no limit known).
    default_max_lora_rank: ClassVar[int | None] = None
    #: How long the server keeps a CPU busy after its last request, waiting for the next one (seconds): another
    #: engine's run started sooner shares a CPU with it. 0: it goes quiet at once.
    idle_spin_s: ClassVar[float] = 0.0

    def __init__(self, batching: BatchingConfig | None = None, *, startup_timeout: float = 300.0) -> None:
        self.batching = batching or BatchingConfig()
        type(self).check_config(self.batching)
        self.startup_timeout = startup_timeout

    @classmethod
    def check_config(cls, batching: BatchingConfig, *, max_model_len: int | None = None) -> None:
        """Raise ValueError, saying why, if the engine would refuse to start with this configuration
        (and this context window, when given); adapters add their engine's own rules."""
        if batching.mode not in cls.capabilities.batching_modes:
            raise ValueError(
                f"engine {cls.name!r} cannot run {batching.mode} batching "
                f"(it supports: {', '.join(sorted(cls.capabilities.batching_modes))})"
            )
        if batching.prefill_chunk_tokens is not None and not cls.capabilities.prefill_chunk_cap:
            raise ValueError(
                f"engine {cls.name!r} has no per-request cap on prefill tokens per step; "
                "leave BatchingConfig.prefill_chunk_tokens unset"
            )
        if batching.prefix_caching is not None and not cls.capabilities.prefix_caching:
            raise ValueError(
                f"engine {cls.name!r}: batchbench cannot switch its prefix caching; "
                "leave BatchingConfig.prefix_caching unset"
            )
        for knob in ("max_loras", "max_lora_rank"):
            if getattr(batching, knob) is not None and not cls.capabilities.lora:
                raise ValueError(f"engine {cls.name!r}: batchbench cannot serve LoRA adapters on it; "
                                 f"leave BatchingConfig.{knob} unset")
        method = batching.speculative_method
        if method is not None and method not in cls.capabilities.speculation_methods:
            has = ", ".join(sorted(cls.capabilities.speculation_methods)) or "none"
            raise ValueError(
                f"engine {cls.name!r} has no speculative decoding by speculative_method={method!r} "
                f"(it has: {has}); leave BatchingConfig.speculative_method unset"
            )

    @classmethod
    def check_loras(cls, batching: BatchingConfig, loras: Sequence[Lora]) -> None:
        """Refuse, naming the adapter and the field, LoRA adapters this engine would not serve as configured:
        said before it starts, not as a failed request later."""
        if not loras:
            return
        if not cls.capabilities.lora:
            raise ValueError(f"engine {cls.name!r}: batchbench cannot serve LoRA adapters on it "
                             f"(--lora-adapters {', '.join(a.name for a in loras)})")
        limit = batching.max_lora_rank if batching.max_lora_rank is not None else cls.default_max_lora_rank
        for lora in loras:
            if limit is not None and lora.rank > limit:
                where = "" if batching.max_lora_rank is not None else ", the engine's default"
                raise ValueError(f"engine {cls.name!r}: LoRA adapter {lora.name!r} has rank {lora.rank}, above "
                                 f"BatchingConfig.max_lora_rank={limit}{where}; raise max_lora_rank to at least "
                                 f"{lora.rank}")

    @classmethod
    def min_kv_capacity_tokens(cls, max_model_len: int) -> int:
        """The smallest ``kv_capacity_tokens`` the engine starts with: one full-length sequence, beside the
        blocks it keeps back."""
        return max_model_len + cls.kv_reserved_blocks * (cls.kv_block_size or 0)

    def kv_layout(self) -> KVLayout | None:
        """How this engine, as configured, lays out and reports its KV cache; None: not known."""
        return None

    def kv_space_bytes(self) -> int | None:
        """The memory this engine was given for its KV cache, in bytes; None when it sizes the cache itself
        (from accelerator memory) or it is not known (an engine at a URL)."""
        return None

    def server_log(self) -> Path | None:
        """The log file of the server this engine launched here, if it has one."""
        return None

    @classmethod
    def kv_block_override(cls, server_log: str) -> tuple[int, int] | None:
        """When the engine was given its KV cache in blocks and its server log says so: (blocks its KV space
        would have held, blocks it was given). None: the log does not say (or the engine does not log it)."""
        return None

    def server_process_groups(self) -> frozenset[int] | None:
        """The process groups of the servers this engine launched: its own processes, not other work.

        Empty: it serves inside this process (nothing of its own elsewhere). None: its processes are
        not known here (an engine at a URL or in a container), so the machine's load cannot be told apart.
        """
        return frozenset()

    def gpu_devices(self) -> tuple[list[str] | None, str]:
        """The GPUs the engine computes on, as CUDA names them (indices or UUIDs; None: not named, every visible
        GPU), and where that was read, in words: the GPU telemetry samples these (:mod:`batchbench.measures.gpu`).
        This default: an engine inside this process, under this process's ``CUDA_VISIBLE_DEVICES``."""
        devices, setting = cuda_visible_devices(os.environ)
        return devices, f"{setting} in the measuring process, where the engine runs"

    def cpu_placement(self) -> EngineCpus:
        """Where the engine runs and on which CPUs, for the results' CPU placement record. This default: inside
        the measuring process, on whatever CPUs it has (a served engine says where its server is)."""
        return EngineCpus("in process")

    @abstractmethod
    async def start(self) -> None:
        """Launch the engine (or check the URL is well-formed); do not wait for health."""

    @abstractmethod
    async def wait_healthy(self, timeout: float) -> None:
        """Return once the engine serves requests; raise EngineNotHealthy/EngineDied otherwise."""

    @abstractmethod
    async def stop(self) -> None:
        """Release everything :meth:`start` acquired. Safe to call twice."""

    @abstractmethod
    def stream(self, request: Request) -> AsyncIterator[Chunk]:
        """Send one request and yield its chunks as they arrive."""

    async def stream_into(self, request: Request, sink: ChunkSink) -> None:
        """Send one request and hand its pieces to ``sink`` as they arrive: the load generator's path.

        This default reads :meth:`stream`; an engine whose per-chunk cost matters writes into the sink
        directly (no object, no task switch per chunk) and gives :meth:`stream` as :func:`chunks_of` of it.
        """
        async for chunk in self.stream(request):
            if chunk.sent is not None:
                sink.sent(chunk.sent)
            if chunk.reasoning:
                sink.reasoning(chunk.t, chunk.n_tokens, chunk.finish_reason)
            elif chunk.n_tokens or chunk.finish_reason is not None:
                if chunk.first_output:
                    sink.first_output(chunk.t)
                sink.tokens(chunk.t, chunk.n_tokens, chunk.finish_reason)
            if chunk.usage is not None:
                sink.usage(chunk.t, chunk.usage)

    async def scrape(self) -> ServerMetrics | None:
        """Read the engine's server-side metrics now; ``None`` if it has none."""
        return None

    def describe(self) -> dict[str, Any]:
        """Engine name, version and effective configuration, for the results."""
        return {"engine": self.name, "batching": codec.encode(self.batching)}

    def launch_key(self) -> Hashable:
        """What decides the server this engine would start: two engines with one key start the same server, so
        the engine cache (:mod:`batchbench.load.engines`) starts it once for both. By default the name and the
        batching config; an engine whose configs can differ without changing what it starts says so."""
        return (self.name, self.batching)

    def url_twin(self) -> Engine:
        """This engine's client side for another process: an adapter at the running server's URL that starts
        nothing (``batchbench.load.workers`` sends part of a run from each of several processes). It must pickle.

        Raises ValueError where there is no server to reach (an engine serving inside this process)."""
        raise ValueError(f"engine {self.name!r} serves inside this process: another process cannot reach it")

    async def begin_run(self) -> None:
        """Start engine-side accounting afresh: one engine instance serves many runs. Async: the accounting
        may be the server's (hf-static's is kept in its own process)."""

    async def reset_cache(self) -> bool:
        """Drop what the engine cached from earlier requests (its prefix cache), so the next run starts cold.

        Optional: the default does nothing. Returns True when the engine cleared its cache, False when it
        has nothing to clear or offers no way to (then runs may see warm prefixes); raises an
        :class:`EngineError` when the engine refuses (e.g. requests still running).
        """
        return False

    async def greedy(self, prompts: Sequence[Sequence[int]], n: int) -> GreedyOutputs | None:
        """Each prompt's first ``n`` greedy output token ids as this engine computes them, with the weights it
        computes with (the report's agreement between engines, :mod:`batchbench.core.greedy`). Optional: None where
        the engine cannot say (the default)."""
        return None

    async def report(self) -> dict[str, Any]:
        """Engine-side accounting gathered since :meth:`begin_run` (e.g. padding), JSON-able.

        Called as a run ends, before its results are written: it must not raise for an engine that died
        (answer what is known, or why nothing is)."""
        return {}

    async def __aenter__(self) -> Engine:
        await self.start()
        try:
            await self.wait_healthy(self.startup_timeout)
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


#: The least time one health probe is given before it counts as unanswered.
_MIN_PROBE_S = 1.0


@dataclass
class HealthPoller:
    """Polls a readiness probe until it passes, the deadline passes or a liveness check fails.

    Shared by every adapter so they all wait, time out and report the same way.
    """

    engine: str
    interval: float = 0.5
    last_error: str = field(default="no attempt yet")

    async def wait(
        self,
        probe: Callable[[], Awaitable[bool]],
        timeout: float,
        *,
        alive: Callable[[], str | None] | None = None,
        refused_for_s: float | None = None,
    ) -> None:
        """``probe()`` returns True when ready (or raises an EngineError);
        ``alive()`` returns why the engine has died, or None while it lives. ``refused_for_s``: connections
        refused for that long end the wait (an engine at a URL is already up, or is not there at all); None
        waits out the timeout (a server batchbench started binds its port when it is ready to)."""
        deadline = now() + timeout
        refused_since: float | None = None
        while True:
            if alive is not None and (dead := alive()) is not None:
                raise EngineDied(self.engine, f"exited before becoming healthy: {dead}")
            try:
                # Bounded by the deadline too (a server that accepts the connection and never answers must not
                # hold the start past its timeout), yet given at least a second: cut sooner, a probe that was
                # about to fail would lose its real reason (a refused connection) to "no answer".
                async with asyncio.timeout(max(deadline - now(), _MIN_PROBE_S)):
                    if await probe():
                        return
                self.last_error = "not ready yet"
            except EngineError as exc:
                if exc.permanent:
                    raise
                self.last_error = exc.detail
                if not isinstance(exc, ConnectionRefused):
                    refused_since = None
                elif refused_for_s is not None:
                    refused_since = now() if refused_since is None else refused_since
                    if now() - refused_since >= refused_for_s:
                        raise exc.with_detail(f"{exc.detail} for {now() - refused_since:.1f}s: nothing listens "
                                              "there (is the port right, and the server up?)") from exc
            except TimeoutError:
                self.last_error = f"the health check sent no answer before the {timeout:g}s start-up timeout"
            if now() >= deadline:
                raise EngineNotHealthy(
                    self.engine, f"not healthy after {timeout:.0f}s (last answer: {self.last_error})"
                )
            await asyncio.sleep(self.interval)
