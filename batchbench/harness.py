"""What a comparison test needs: started engines and measured, recorded runs.

Engines and the load generator live on one event loop in a background
thread for the whole pytest session, so suites are plain synchronous tests
and pytest-benchmark can time a run for real (``benchmark.pedantic`` calls
a synchronous function, which here blocks until the run on the loop is done).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from batchbench.adapters.base import BatchingConfig, Engine
from batchbench.adapters.launch.cleanup import REGISTRY as LAUNCHED
from batchbench.adapters.registry import EngineOptions, make_engine
from batchbench.loadgen import LoadConfig
from batchbench.pool import EnginePool
from batchbench.profiles import Profile
from batchbench.runner import RunResult, run
from batchbench.workload import Workload

T = TypeVar("T")


class LoopThread:
    """An asyncio loop running in a daemon thread; ``call(coro)`` runs a coroutine there and waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="batchbench-loop", daemon=True)
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except KeyboardInterrupt:
            future.cancel()
            raise

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


class Harness:
    """Session-wide engines, options and results directory for the suites."""

    def __init__(self, options: EngineOptions, profile: Profile, results_dir: Path, *, max_live: int = 2) -> None:
        self.options = options
        self.profile = profile
        self.results_dir = results_dir
        # Servers are started on the loop's thread, where no signal handler can be installed: install
        # them here (the session's main thread) so a SIGTERM/SIGHUP/Ctrl-C of pytest stops them too.
        LAUNCHED.install()
        self.loop = LoopThread()
        self.pool = EnginePool(lambda name, batching: make_engine(name, batching, options), max_live=max_live)

    def engine(self, name: str, batching: BatchingConfig | None = None) -> Engine:
        """A started engine (shared: started once per name and config)."""
        return self.loop.call(self.pool.get(name, batching))

    def release(self, name: str, batching: BatchingConfig | None = None) -> None:
        self.loop.call(self.pool.release(name, batching))

    def measure(
        self,
        engine: Engine,
        workload: Workload,
        *,
        tag: str = "",
        labels: dict[str, Any] | None = None,
        benchmark: Any = None,
        load: LoadConfig | None = None,
        **run_options: Any,
    ) -> RunResult:
        """Run ``workload`` on ``engine`` and write its results document.

        With a pytest-benchmark fixture, the run is also recorded there (one
        round, the serving metrics in ``extra_info``) so that
        ``pytest-benchmark compare`` works between nightly runs.
        """
        load = load or LoadConfig(request_timeout_s=self.profile.request_timeout_s)
        labels = {"profile": self.profile.name, **(labels or {})}

        def once() -> RunResult:
            return self.loop.call(run(engine, workload, results_dir=self.results_dir, tag=tag, load=load,
                                      labels=labels, **run_options))

        if benchmark is None:
            return once()
        result: RunResult = benchmark.pedantic(once, rounds=1, iterations=1, warmup_rounds=0)
        benchmark.extra_info.update({
            "engine": engine.name,
            "batching": engine.batching.label(),
            "workload": workload.name,
            "workload_hash": workload.hash(),
            "results": str(result.path),
            "labels": labels,
            "summary": result.summary.to_dict(),
        })
        return result

    def close(self) -> None:
        try:
            self.loop.call(self.pool.close())
        finally:
            self.loop.close()
