"""Engines as an experiment starts them: one live at a time, each start on the progress display, and
the load generator pinned where the placement says."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from batchbench.adapters.base import Engine
from batchbench.adapters.registry import EngineOptions, make_engine
from batchbench.core.config import BatchingConfig
from batchbench.experiment.progress import EngineStart, Progress
from batchbench.load.engines import EngineCache
from batchbench.load.pinning import pinned_process


@contextmanager
def place_client(options: EngineOptions) -> Iterator[None]:
    """This whole process, the load generator, on the placement's first client CPU for the block, which starts
    the engines (a launched engine sets its own CPUs), having said where everything goes; the OS refusing is
    said too, and recorded in every results document, but does not stop the measurement."""
    with pinned_process(options) as pin:
        if pin.placement is None:
            print(f"batchbench: no CPU placement: {pin.unplaced}")
        else:
            print(f"batchbench: {pin.placement.describe()}")
        if pin.refused is not None:
            print(f"batchbench: warning: the load generator is not pinned: {pin.refused}", file=sys.stderr)
        yield


#: In a log (nothing redrawn), how often a start that waits says how far it got.
LOG_DETAIL_EVERY_S = 10.0


class StartingEngines:
    """Engines for a command's :class:`~batchbench.load.engines.EngineCache`, each start shown on the progress display.

    The cache makes an engine (this class is its factory) inside its own ``get``, so the start is shown around
    that call and the engine, once made, gives the display its timeout and server log to follow.
    """

    def __init__(self, options: EngineOptions, progress: Progress) -> None:
        self.options, self.progress = options, progress
        self._start: EngineStart | None = None
        self._detail_logged = time.monotonic()

    def make(self, name: str, batching: BatchingConfig | None) -> Engine:
        engine = make_engine(name, batching, self.options)
        if self._start is not None:
            self._start.attach(engine.startup_timeout, engine.server_log)
        return engine

    def cache(self, warm_up_timeout_s: float) -> EngineCache:
        """An engine cache holding one live engine at a time (measured engines never share the machine), each
        warm-up request bounded by ``warm_up_timeout_s`` (the command's request timeout)."""
        return EngineCache(self.make, max_live=1, warm_up_timeout_s=warm_up_timeout_s, phase=self.phase,
                           warm_up_report=self.warm_up_report)

    def phase(self, what: str, timeout_s: float | None) -> None:
        """The start under way waits for ``what`` now: on the live display, and as a line in a log (where
        nothing is redrawn, a start that hangs would otherwise say nothing at all)."""
        if self._start is None:
            return
        self._start.wait_for(what, timeout_s)
        if not self.progress.live:
            bound = f" (at most {timeout_s:g}s)" if timeout_s else ""
            self.progress.print(f"batchbench: {self._start.name}: waiting for {what}{bound}")

    def warm_up_report(self, text: str) -> None:
        """Which warm-up request the start waits for: on the live display as it changes, in a log at most every
        :data:`LOG_DETAIL_EVERY_S` (a sign of life, not a line a second)."""
        if self._start is None:
            return
        self._start.detail = text
        if not self.progress.live and time.monotonic() - self._detail_logged >= LOG_DETAIL_EVERY_S:
            self._detail_logged = time.monotonic()
            self.progress.print(f"batchbench: {self._start.name}: warm-up: {text}")

    async def get(self, cache: EngineCache, name: str, batching: BatchingConfig | None) -> Engine:
        """The live engine, or one started now with its start on the display."""
        if cache.is_live(name, batching):
            return await cache.get(name, batching)
        with self.progress.engine_starting(name) as start:
            self._start = start
            try:
                return await cache.get(name, batching)
            finally:
                self._start = None
