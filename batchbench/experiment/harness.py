"""What a comparison test needs: started engines and measured, recorded runs.

Suites use only the public methods: :meth:`Harness.engine` (shared, cached engines),
:meth:`Harness.private_engine` (an unshared engine with its own options, always stopped),
:meth:`Harness.measure` (a recorded run), :meth:`Harness.repeat` (recorded runs of one workload, whose
estimates have an interval), :meth:`Harness.replay` (an unrecorded one) and
:meth:`Harness.scrape` (the engine's server metrics now). The event loop underneath is the
harness's own business.

Engines and the load generator live on one event loop in a background
thread for the whole pytest session, so suites are plain synchronous tests
and pytest-benchmark can time a run for real (``benchmark.pedantic`` calls
a synchronous function, which here blocks until the run on the loop is done).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable, Coroutine, Hashable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from batchbench.adapters.base import Engine, EngineCannotRunHere
from batchbench.adapters.launch.cleanup import REGISTRY as LAUNCHED
from batchbench.adapters.registry import EngineOptions, make_engine
from batchbench.analysis.repeats import Repeats
from batchbench.core import codec
from batchbench.core.config import BatchingConfig, LoadConfig
from batchbench.core.records import RequestRecord
from batchbench.core.server_metrics import ServerMetrics
from batchbench.experiment.workload import sent_as
from batchbench.load.engines import MAX_LIVE_ENGINES, EngineCache
from batchbench.load.loadgen import LoadGenerator
from batchbench.load.pinning import ClientPin, pin_thread
from batchbench.load.runner import MeasuredRun, run
from batchbench.measures.gpu import GpuOptions
from batchbench.workload.profiles import Profile
from batchbench.workload.requests import Workload

T = TypeVar("T")


class LoopThread:
    """An asyncio loop running in a daemon thread; ``call(coro)`` runs a coroutine there and waits."""

    def __init__(self, new_loop: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop) -> None:
        """``new_loop``: asyncio's loop for the suites (engines start from this thread); the load generator's
        benchmark also measures the command line's (:func:`batchbench.core.eventloop.new_event_loop`)."""
        self.loop = new_loop()
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


async def _pin_loop_thread(options: EngineOptions) -> ClientPin:
    """Runs on the loop's thread: pins that thread alone (and the threads it starts: the journal's, to_thread's)."""
    return pin_thread(options)


class Harness:
    """Session-wide engines, options and results directory for the suites."""

    def __init__(self, options: EngineOptions, profile: Profile, results_dir: Path, *, max_live: int = MAX_LIVE_ENGINES,
                 gpu: GpuOptions | None = None) -> None:
        self.options = options
        #: How every measured run reads the engines' GPUs (``--gpu-hour-cost``, ``--no-gpu-telemetry``).
        self.gpu = gpu or GpuOptions()
        self.profile = profile
        self.results_dir = results_dir
        # Servers are started on the loop's thread, where no signal handler can be installed: install
        # them here (the session's main thread) so a SIGTERM/SIGHUP/Ctrl-C of pytest stops them too.
        LAUNCHED.install()
        self._loop = LoopThread()
        #: The load generator's share of the session's CPU placement: only the loop thread is pinned (the tests
        #: around it keep every CPU); engines it launches set their own.
        self.client_pin = self._loop.call(_pin_loop_thread(options))
        self._engines = EngineCache(lambda name, batching: make_engine(name, batching, options), max_live=max_live,
                                    warm_up_timeout_s=profile.request_timeout_s)
        self._send = sent_as(options)
        #: When each started server (by launch key) goes quiet after its last run: another's run waits for it.
        self._quiet_at: dict[Hashable, float] = {}

    @property
    def max_live_engines(self) -> int:
        """How many shared engines may run at once (``--max-live-engines``)."""
        return self._engines.max_live

    def engine(self, name: str, batching: BatchingConfig | None = None) -> Engine:
        """A started, warmed-up engine (shared: started once per name and config).

        Raises :class:`EngineCannotRunHere` when this environment cannot run it.
        """
        started = not self._engines.is_live(name, batching)
        engine = self._loop.call(self._engines.get(name, batching))
        if started:  # its warm-up just ran: it spins as after a run
            self._quiet_at[engine.launch_key()] = time.monotonic() + engine.idle_spin_s
        return engine

    def release(self, name: str, batching: BatchingConfig | None = None) -> None:
        """Stop a shared engine now (e.g. after a test that pushed it past its limits)."""
        self._loop.call(self._engines.release(name, batching))

    @contextmanager
    def private_engine(self, name: str, batching: BatchingConfig | None = None, **overrides: Any) -> Iterator[Engine]:
        """An unshared engine, launched here with the session's options changed by ``overrides``
        (e.g. ``max_model_len=256``), healthy inside the ``with`` and always stopped after it.

        Not warmed up: the caller decides what its first requests are. Raises
        :class:`EngineCannotRunHere` when the engine cannot run here, including when the session
        reaches it at a URL (whoever runs it there chose its configuration).
        """
        if self.options.url_for(name) is not None:
            raise EngineCannotRunHere(name, "is reached at a URL; a private engine must be launched here with its "
                                            f"own configuration ({batching.label() if batching else 'default'})")
        options = dataclasses.replace(self.options, **overrides)
        try:
            engine = make_engine(name, batching, options)
        except ImportError as exc:
            raise EngineCannotRunHere(name, f"cannot run here: {exc}") from exc
        self._loop.call(engine.__aenter__())  # stops what it started if it never becomes healthy
        try:
            yield engine
        finally:
            self._loop.call(engine.__aexit__(None, None, None))

    def sent(self, workload: Workload) -> Workload:
        """The workload as the engines are sent it: on a chat endpoint (``--endpoint chat``) its requests as chat
        messages of the same token lengths under the served model's tokenizer (:func:`sent_as`), else as it is."""
        return self._send(workload)

    def scrape(self, engine: Engine) -> ServerMetrics | None:
        """The engine's server metrics now (None: it has none)."""
        return self._loop.call(engine.scrape())

    def replay(self, engine: Engine, workload: Workload, load: LoadConfig | None = None) -> list[RequestRecord]:
        """Run ``workload`` on ``engine`` without recording it (e.g. to warm an engine up on it)."""
        with self._alone(engine):
            return self._loop.call(LoadGenerator(engine, self.sent(workload), config=load).run())

    @contextmanager
    def _alone(self, engine: Engine) -> Iterator[None]:
        """Run on ``engine`` once every other engine run here has gone quiet (:attr:`Engine.idle_spin_s`): a suite
        that alternates two live engines would otherwise measure each beside the other's idle spin."""
        key = engine.launch_key()
        wait = max((t for k, t in self._quiet_at.items() if k != key), default=0.0) - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        try:
            yield
        finally:
            self._quiet_at[key] = time.monotonic() + engine.idle_spin_s

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
    ) -> MeasuredRun:
        """Run ``workload`` on ``engine`` and write its results document.

        With a pytest-benchmark fixture, the run is also recorded there (one
        round, the serving metrics in ``extra_info``) so that
        ``pytest-benchmark compare`` works between nightly runs.
        """
        load = load or LoadConfig(request_timeout_s=self.profile.request_timeout_s)
        labels = {"profile": self.profile.name, **(labels or {})}
        workload = self.sent(workload)

        def once() -> MeasuredRun:
            return self._loop.call(run(engine, workload, results_dir=self.results_dir, tag=tag, load=load,
                                      labels=labels, **{"gpu": self.gpu, **run_options}))

        with self._alone(engine):
            if benchmark is None:
                return once()
            result: MeasuredRun = benchmark.pedantic(once, rounds=1, iterations=1, warmup_rounds=0)
        benchmark.extra_info.update({
            "engine": engine.name,
            "batching": engine.batching.label(),
            "workload": workload.name,
            "workload_hash": workload.hash(),
            "results": str(result.path),
            "labels": labels,
            "summary": codec.encode(result.summary),
        })
        return result

    def repeat(self, engine: Engine, workload: Workload, times: int = 3, *, tag: str = "",
               labels: dict[str, Any] | None = None) -> Repeats[MeasuredRun]:
        """``workload`` on ``engine`` ``times`` times, each run recorded (labelled with its ``repeat``): a figure's
        estimate over them (:meth:`Repeats.estimate`) has a 95% interval, which
        :class:`~batchbench.pytest_plugin.IntervalChecks` decides a claim by; one run's figure has none."""
        if times < 2:
            raise ValueError(f"times={times}: an interval needs at least two runs")
        runs: Repeats[MeasuredRun] = Repeats()
        for repeat in range(times):
            result = self.measure(engine, workload, tag=tag, labels={**(labels or {}), "repeat": repeat})
            runs.add(result, result.machine)
        return runs

    def close(self) -> None:
        try:
            self._loop.call(self._engines.close())
        finally:
            self._loop.close()
