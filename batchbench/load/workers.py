"""Several load-generator processes for one run, when one event loop cannot carry the load.

One event loop ingests some tens of thousands of chunks a second per core (tests/test_loadgen_benchmark.py);
past that its timestamps wait for it and it offers less load than asked, and the client becomes what it
measures. :class:`WorkerPool` splits a run's workload across processes, each running the unchanged
:class:`~batchbench.load.loadgen.LoadGenerator` on an event loop of its own against the engine's running server
(``Engine.url_twin``: a child never starts an engine), and streams every record back to the parent as it
finishes, so the one journal gets each record even if a child dies later.

- **One clock.** Every process reads :func:`batchbench.core.clock.now`, ``time.perf_counter``, which is
  CLOCK_MONOTONIC on Linux: one system-wide clock, so the parent's ``t0`` means the same instant in every
  child and their records line up (tests/test_workers.py proves both).
- **Open loop** (offline, Poisson, gamma) is split by request, round robin; each request keeps its own
  ``arrival_s`` from the shared ``t0``, so the schedule is exactly the single-process one.
- **Closed loop**: the concurrency is split as evenly as possible, and each worker takes the requests in
  proportion to its share (interleaved) and pulls them in order from its own part. A shared cross-process
  queue would rebalance the last requests of a run, but costs a round trip per request on the send path
  and a LoadGenerator that knows about it; with lengths drawn from one distribution the parts end together.
- **Static waves** need every worker to finish a wave before the next one starts: refused (one process).

CPUs: with a placement, worker ``i`` pins itself to the placement's client CPU ``i`` (round robin where there are
fewer; the first is the measuring process's too, which only collects records then) as the first thing it does,
and says where it runs when it is ready (:attr:`WorkerPool.pinned`, for the results' placement record).

Children are started with the ``spawn`` context (a fresh interpreter: never a fork of a running event loop),
which costs about a second of start-up per run, before ``t0``. A child stops on SIGTERM (its in-flight
requests become ``cancelled`` records, sent like the others) and when the parent's end of its pipe closes
(the parent died); it ignores SIGINT, which the terminal sends the whole process group: the parent decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing
import os
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Self

from batchbench.adapters.base import Engine
from batchbench.core import eventloop
from batchbench.core.clock import now
from batchbench.core.config import LoadConfig
from batchbench.core.placement import CpuPlacement
from batchbench.core.records import RequestRecord
from batchbench.load.loadgen import LoadGenerator
from batchbench.load.pinning import Pinned, pin_self
from batchbench.measures.client_load import ClientLoad, ClientMeter
from batchbench.results.document import WorkerReport
from batchbench.workload.requests import Request, Workload

#: Chunks a second one worker is given at most when choosing the number of workers: a core ingests ~45k
#: (~20-23 µs of CPU each, docs/measurement.md); at half that its loop is idle half the time, so a chunk
#: rarely waits for it.
CHUNKS_PER_WORKER = 20_000
#: Streams one worker keeps open at most when the chunk rate is not known in advance (closed loop, offline):
#: 256 streams at 80 tokens/s each is the budget above.
STREAMS_PER_WORKER = 256
#: How long children may take to start (import, connect) before the run gives up on them.
START_TIMEOUT_S = 120.0
#: After SIGTERM, how long children have to send their last records before they are killed.
STOP_GRACE_S = 5.0
#: ``error_kind`` of the records of requests a dead worker took with it.
WORKER_DIED = "worker_died"


def shares(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` as evenly as possible, larger shares first (10, 4 -> 3, 3, 2, 2)."""
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def partition(workload: Workload, workers: int) -> list[Workload]:
    """The workload as ``workers`` parts (fewer when it has fewer requests, or a smaller concurrency).

    Every request is in exactly one part, with its ``arrival_s`` unchanged; a part keeps the requests'
    order. Raises ValueError for static waves, which one process must send."""
    arrival = workload.arrival
    if arrival.kind == "waves":
        raise ValueError("static waves start each wave when the previous one has finished in every process: "
                         "they are sent from one process (workers=1)")
    n = max(1, min(workers, len(workload.requests), arrival.concurrency if arrival.kind == "closed" else workers))
    # Request i goes to the owner of slot i mod len(slots); a worker holds as many slots as its share of the
    # concurrency (one each in open loop), so each part's size follows its share. Slots are dealt round by
    # round (0, 1, 0 for shares 2, 1), so the first n requests go one to each worker: no part is empty.
    concurrency = shares(arrival.concurrency, n) if arrival.kind == "closed" else [1] * n
    slots = [k for r in range(concurrency[0]) for k, share in enumerate(concurrency) if share > r]
    parts: list[list[Request]] = [[] for _ in range(n)]
    for i, request in enumerate(workload.requests):
        parts[slots[i % len(slots)]].append(request)
    return [Workload(replace(workload.spec, num_requests=len(part),
                             arrival=replace(arrival, concurrency=c) if arrival.kind == "closed" else arrival),
                     tuple(part))
            for part, c in zip(parts, concurrency)]


def auto_workers(workload: Workload, cores: int | None = None) -> int:
    """Workers for this load: the expected chunk rate (open loop at a rate: requests/s x mean output tokens,
    one token a chunk at most) over :data:`CHUNKS_PER_WORKER`, else the streams kept open over
    :data:`STREAMS_PER_WORKER`; at least 1, at most the machine's cores."""
    arrival = workload.arrival
    if arrival.kind == "waves" or not workload.requests:
        return 1
    if arrival.kind in ("poisson", "gamma", "timed"):
        mean_output = sum(r.max_tokens for r in workload.requests) / len(workload.requests)
        need = math.ceil(arrival.rate * mean_output / CHUNKS_PER_WORKER)
    else:
        streams = arrival.concurrency if arrival.kind == "closed" else len(workload.requests)
        need = math.ceil(streams / STREAMS_PER_WORKER)
    return max(1, min(need, cores or os.cpu_count() or 1))


class WorkerError(RuntimeError):
    """The worker processes could not be started."""


@dataclass
class _Child:
    """One worker process as the parent sees it."""

    index: int
    part: Workload
    process: BaseProcess
    conn: Connection
    ready: asyncio.Future[None]
    ended: asyncio.Future[None]
    finished: set[str] = field(default_factory=set)
    load: ClientLoad | None = None
    ended_at: float | None = None
    pinned: Pinned | None = None


class Pool:
    """What the two kinds of worker pool share: a workload split into parts, one per worker, each sent against the
    engine's running server (``Engine.url_twin``), every record handed to ``on_record`` as it comes back and kept in
    ``records``; ``start()`` (or ``async with``) before the run's ``t0``, ``close()`` whatever happens.
    :class:`WorkerPool` runs the workers as processes of this host, ``ray_workers.RayWorkerPool`` as Ray actors."""

    def __init__(self, engine: Engine, workload: Workload, *, workers: int,
                 on_record: Callable[[RequestRecord], None] = lambda record: None,
                 config: LoadConfig | None = None, placement: CpuPlacement | None = None) -> None:
        self.twin = engine.url_twin()  # ValueError here, before anything starts, for an in-process engine
        self.workload = workload
        self.config = config or LoadConfig()
        self.parts = partition(workload, workers)
        self.on_record = on_record
        self.placement = placement
        self.records: list[RequestRecord] = []
        self.t0 = 0.0

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Start the workers and wait until each is ready; WorkerError (everything started stopped) if not."""
        try:
            await self._launch()
        except BaseException:
            await self.close()
            raise

    async def _launch(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    @property
    def start_lead_s(self) -> float:
        """How far ahead of now the run's ``t0`` must be set for every worker to have it in time (processes of this
        host read the same clock: no lead; workers on other hosts are told the instant over the network)."""
        return 0.0

    @property
    def pids(self) -> frozenset[int]:
        """The ids of this host's processes that are the harness, not other work on the machine."""
        raise NotImplementedError

    @property
    def pinned(self) -> list[Pinned]:
        """Each started worker's CPUs as it reported them when ready, in worker order."""
        raise NotImplementedError

    @property
    def client_loads(self) -> list[ClientLoad]:
        """Each worker's own load-generator load (a worker that was lost sent none)."""
        raise NotImplementedError

    @property
    def reports(self) -> list[WorkerReport]:
        """Each worker as the results document keeps it."""
        raise NotImplementedError

    def part_config(self, index: int) -> LoadConfig:
        """Worker ``index``'s load config: its share of the run's bound on requests in flight (at least one)."""
        return replace(self.config, max_in_flight=max(1, shares(self.config.max_in_flight, len(self.parts))[index]))

    def take(self, record: RequestRecord) -> None:
        """A record back from a worker (or made for one that was lost): kept, and handed on."""
        self.records.append(record)
        self.on_record(record)

    def lose(self, part: Workload, finished: set[str], died_s: float, why: str) -> None:
        """Failed records for the requests of a lost worker's ``part`` that never came back (:func:`lost_records`)."""
        for record in lost_records(part, finished, died_s, self.config.send_until_s, why):
            self.take(record)


class WorkerPool(Pool):
    """A run's load sent from ``workers`` processes; the same ``run(t0)`` and ``records`` as LoadGenerator.

    ``async with WorkerPool(...) as pool:`` (or ``start()`` ... ``close()``) starts the children, before the
    run's ``t0`` since they take a moment, and always stops them; ``await pool.run(t0)`` sends the workload.
    ``on_record`` is called in this process, on its event loop, for every record as it comes back. A child
    that dies mid-run ends its part there: each request it took with it is recorded as failed
    (``worker_died``, saying which process and how it ended), the others' parts go on. With a ``placement``
    each child runs on its client CPU (:meth:`CpuPlacement.client_cpu`).
    """

    def __init__(self, engine: Engine, workload: Workload, *, workers: int,
                 on_record: Callable[[RequestRecord], None] = lambda record: None,
                 config: LoadConfig | None = None, placement: CpuPlacement | None = None) -> None:
        super().__init__(engine, workload, workers=workers, on_record=on_record, config=config, placement=placement)
        self._children: list[_Child] = []

    @property
    def pids(self) -> frozenset[int]:
        """The worker processes' ids (they are the harness, not other work on the machine)."""
        return frozenset(c.process.pid for c in self._children if c.process.pid is not None)

    @property
    def pinned(self) -> list[Pinned]:
        """Each started child's CPUs as it reported them when ready, in worker order."""
        return [c.pinned for c in self._children if c.pinned is not None]

    @property
    def client_loads(self) -> list[ClientLoad]:
        """Each child's own load-generator load (a child that died sent none)."""
        return [c.load for c in self._children if c.load is not None]

    async def _launch(self) -> None:
        """Start the children and wait until each is connected and ready."""
        loop = asyncio.get_running_loop()
        context = multiprocessing.get_context("spawn")
        for index, part in enumerate(self.parts):
            ours, theirs = context.Pipe()
            cpu = self.placement.client_cpu(index) if self.placement is not None else None
            process = context.Process(target=_child_main, args=(self.twin, part, self.part_config(index), theirs,
                                                                cpu),
                                      name=f"batchbench-worker-{index}", daemon=True)
            process.start()
            theirs.close()  # the child holds the only writing end: its death closes the pipe
            child = _Child(index, part, process, ours, loop.create_future(), loop.create_future())
            self._children.append(child)
            loop.add_reader(ours.fileno(), self._readable, child)
        await asyncio.wait([c.ready for c in self._children], timeout=START_TIMEOUT_S)
        failures = [child.ready.exception() if child.ready.done() else WorkerError(
            f"load-generator worker {child.index} did not start within {START_TIMEOUT_S:g}s")
            for child in self._children]
        if (first := next((f for f in failures if f is not None), None)) is not None:
            raise first

    async def run(self, t0: float | None = None) -> list[RequestRecord]:
        """Send every part from ``t0`` on (every process reads the same clock); all records, in arrival order."""
        self.t0 = now() if t0 is None else t0
        for child in self._children:
            with contextlib.suppress(OSError):  # one that died meanwhile: its end is being seen to
                child.conn.send(self.t0)
        try:
            await asyncio.wait([c.ended for c in self._children])
        except asyncio.CancelledError:
            await self._stop()
            raise
        for child in self._children:
            if child.load is None:  # it ended without saying it was done: it died
                self._lost(child)
        return self.records

    async def close(self) -> None:
        """Stop every child still running (SIGTERM, then SIGKILL after a grace) and release the pipes."""
        await self._stop()
        loop = asyncio.get_running_loop()
        for child in self._children:
            if not child.conn.closed:
                loop.remove_reader(child.conn.fileno())
                child.conn.close()
            child.process.join()

    async def _stop(self) -> None:
        running = [c for c in self._children if c.process.is_alive()]
        for child in running:
            child.process.terminate()
        pending = [c.ended for c in running if not c.ended.done()]
        if pending:
            await asyncio.wait(pending, timeout=STOP_GRACE_S)
        for child in running:
            if child.process.is_alive():
                child.process.kill()

    def _readable(self, child: _Child) -> None:
        """Everything the child has sent so far; at its end of the pipe, its end."""
        try:
            while child.conn.poll():
                self._message(child, child.conn.recv())
        except (EOFError, OSError):
            child.ended_at = now()
            asyncio.get_running_loop().remove_reader(child.conn.fileno())
            child.conn.close()
            child.process.join(timeout=1.0)  # its pipe closed as it exited: its status is a moment away
            if not child.ready.done():
                child.ready.set_exception(WorkerError(
                    f"load-generator worker {child.index} exited before it was ready ({_exit(child.process)})"))
            if not child.ended.done():
                child.ended.set_result(None)

    def _message(self, child: _Child, message: tuple[str, Any]) -> None:
        kind, value = message
        if kind == "record":
            child.finished.add(value.request_id)
            self.take(value)
        elif kind == "ready":
            child.pinned = value
            child.ready.set_result(None)
        elif kind == "done":
            child.load = value
        elif kind == "failed" and not child.ready.done():  # it could not start (e.g. its HTTP client)
            child.ready.set_exception(WorkerError(f"load-generator worker {child.index}: {value}"))

    def _lost(self, child: _Child) -> None:
        """Records for the requests a dead child took with it."""
        died = (child.ended_at or now()) - self.t0
        self.lose(child.part, child.finished, died, f"load-generator worker {child.index} (pid {child.process.pid}) "
                  f"{_exit(child.process)} before this request's record came back")

    @property
    def reports(self) -> list[WorkerReport]:
        """Each worker as the results document keeps it (one host: one clock, no offset to measure)."""
        host = socket.gethostname()
        return [WorkerReport(
            index=c.index, pool="processes", host=host, pid=c.process.pid,
            cpus=sorted(c.pinned.cpus) if c.pinned is not None and c.pinned.cpus else None,
            requests=len(c.part.requests), records=len(c.finished), client=c.load,
            lost=None if c.load is not None else f"{_exit(c.process)}",
            lost_at_s=None if c.load is not None or c.ended_at is None else c.ended_at - self.t0)
            for c in self._children]


def lost_records(part: Workload, finished: set[str], died_s: float, send_until_s: float | None,
                 why: str) -> list[RequestRecord]:
    """Failed records (``worker_died``, ``why``) for the requests of ``part`` a lost worker took with it: those
    it had sent or was due to send by ``died_s`` (from the start), that never came back.

    With a deadline (``send_until_s``) requests never sent are not recorded, as in one process: a closed-loop
    part takes its requests in order, so the ones in flight are its first unfinished ``concurrency``; an
    open-loop part's are the unfinished ones already due."""
    missing = [r for r in part.requests if r.request_id not in finished]
    arrival = part.arrival
    if send_until_s is not None:
        missing = ([r for r in missing if r.arrival_s <= died_s] if arrival.open_loop
                   else missing[:arrival.concurrency])
    return [RequestRecord(request_id=r.request_id, prompt_len=r.prompt_len, max_tokens=r.max_tokens,
                          scheduled_s=r.arrival_s if arrival.open_loop else died_s,
                          sent_s=r.arrival_s if arrival.open_loop else died_s,
                          priority=r.priority, error_kind=WORKER_DIED, error=why, closed_s=died_s, done_s=died_s)
            for r in missing]


def _exit(process: BaseProcess) -> str:
    code = process.exitcode
    if code is None:
        return "stopped answering"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def _child_main(engine: Engine, part: Workload, config: LoadConfig, conn: Connection, cpu: int | None) -> None:
    """A worker process: on its client CPU (``cpu``; None: the parent's), its own event loop (the command line's),
    its part of the run, records to ``conn``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent stops us
    pinned = pin_self(cpu)  # first: the loop's threads and the HTTP client's inherit it
    with contextlib.suppress(asyncio.CancelledError):  # stopped: the records were sent as they finished
        eventloop.run(_child(engine, part, config, conn, pinned))


async def _child(engine: Engine, part: Workload, config: LoadConfig, conn: Connection, pinned: Pinned) -> None:
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    loop.add_signal_handler(signal.SIGTERM, main.cancel)

    def send(message: tuple[str, Any]) -> None:
        try:
            conn.send(message)
        except OSError:  # the parent is gone: nobody to measure for
            main.cancel()

    try:
        await engine.start()  # at a URL: only the HTTP client
    except Exception as exc:
        send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    try:
        send(("ready", pinned))
        try:
            t0: float = conn.recv()  # blocking on purpose: nothing else is on this loop yet
        except (EOFError, OSError):
            return  # the parent went before the run started

        def parent_gone() -> None:  # the parent sends nothing after t0: readable means its end closed
            loop.remove_reader(conn.fileno())
            main.cancel()

        loop.add_reader(conn.fileno(), parent_gone)
        # uvloop's add_reader makes the pipe non-blocking, and then a record sent while the parent is behind raises
        # BlockingIOError (after ~90 records); the child must wait for the parent instead.
        os.set_blocking(conn.fileno(), True)
        meter = ClientMeter()
        generator = LoadGenerator(engine, part, on_record=lambda r: send(("record", r)), config=config)
        try:
            with meter:
                await generator.run(t0)
        finally:
            send(("done", meter.result(generator.records)))
    finally:
        await engine.stop()
