"""Load-generator workers on a Ray cluster (``--workers ray:N``): load from many hosts, one exact results document.

One client host carries some tens of thousands of chunks a second per core; a serving cluster behind a router
needs more. :class:`RayWorkerPool` places N workers as Ray actors (a placement group of N one-CPU bundles,
spread over the cluster's nodes), each sending its part of the workload with the unchanged
:class:`~batchbench.load.loadgen.LoadGenerator` on an event loop of its own. The partition is the local workers'
(:func:`batchbench.load.workers.partition`), so a run is the same requests at the same times whether it is split
over processes or hosts.

- **Clocks.** Each host measures its own requests: every timestamp is a duration on the sender's monotonic
  clock from its own copy of the start instant, so host clocks need not agree for latencies, and a schedule
  lag is against that host's copy of the schedule. Only the start instant crosses hosts: before the run the
  driver measures each worker's wall-clock offset (NTP's estimate from the round trip of least delay, kept
  in the results with its round trip), sends the instant as the driver's wall time, and each worker turns it
  into its own monotonic time. A worker that begins late says by how much (``start_late_s``).
- **Exact merge.** Records stream back every :data:`BATCH_S` (a Ray streaming generator fed by a delivery thread
  that wakes on that clock, not per record), and the driver journals each as it arrives: the results document holds
  every record and its percentiles are computed from all of them (nothing is merged from histograms). Each worker's
  own client load (loop lag, CPU, read bursts) comes back at its end and is combined into the run's validity as the
  local workers' are (:meth:`batchbench.measures.client_load.ClientLoad.combined`); the footer keeps each worker's,
  with its host, node, CPUs, clock offset and start.
- **Faults.** A worker whose actor or node dies, or that sends nothing (not even its heartbeat, every
  :data:`HEARTBEAT_S`) for :data:`SILENCE_S`, is lost: what it delivered is kept, its requests that never came
  back are failed records (``worker_died``, naming the worker, its host and what happened), and the others go
  on. Whatever way the run ends, :meth:`RayWorkerPool.close` kills its actors and removes its placement group;
  a Ray this process started is shut down when the process exits (Ray's own exit hook, or
  :func:`disconnect`). Ctrl-C cancels the run: every worker is told to stop (its in-flight requests come back
  as ``cancelled`` records), then killed after :data:`STOP_GRACE_S`. SIGTERM and SIGHUP (:data:`CLEANUP`) kill
  the actors, remove the placement group and shut down a Ray started here before the signal takes its course.

Ray is an optional dependency (``pip install 'batchbench[ray]'``), imported only here and only when asked for.
Every node must have the same batchbench installed (checked at start). The engine's URL must be one the
workers' nodes reach: a loopback URL is refused for a worker on another node.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import ipaddress
import logging
import os
import queue
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import yarl

from batchbench.adapters.base import Engine
from batchbench.adapters.launch.cleanup import CleanupRegistry
from batchbench.core import eventloop
from batchbench.core.clock import now
from batchbench.core.config import LoadConfig
from batchbench.core.placement import CpuPlacement
from batchbench.core.records import RequestRecord
from batchbench.load.loadgen import LoadGenerator
from batchbench.load.pinning import Pinned, pin_self
from batchbench.load.timer import SendTimer
from batchbench.load.workers import START_TIMEOUT_S, STOP_GRACE_S, Pool, WorkerError
from batchbench.measures.client_load import ClientLoad, ClientMeter
from batchbench.results.document import WorkerReport
from batchbench.workload.requests import Workload

#: What to install when Ray is missing.
RAY_MISSING = "workers on Ray need Ray: pip install 'batchbench[ray]'"
#: Through Ray Client an actor's generator call returns one object, not a stream (Ray 2.60.0: ``ClientObjectRef``
#: has no ``__anext__``; found by tests/test_ray_cluster.py), so the workers' records cannot stream to the driver:
#: the driver runs on a node of the cluster instead, as ``ray job submit`` and a KubeRay RayJob run it.
RAY_CLIENT_REFUSED = ("--ray-address {address}: Ray Client cannot carry the workers' record streams (its calls return "
                      "one object, not a stream), so batchbench must run on a node of the cluster: on this host "
                      "'ray start --address HEAD:6379 --num-cpus 0' (no workers land on it), then --ray-address "
                      "HEAD:6379; or 'ray job submit', which sets $RAY_ADDRESS")
#: A worker's records reach the driver at most this long after they finish (one batch per delivery).
BATCH_S = 0.05
#: A worker with nothing to deliver says it is alive this often.
HEARTBEAT_S = 0.5
#: A worker that delivers nothing, not even a heartbeat, for this long is lost (or the request timeout, if less).
SILENCE_S = 10.0
#: How often the driver checks that the cluster's head (its GCS, which every Ray call goes through) answers, and how
#: long it may not before the run ends: Ray itself waits 60 s for a lost GCS, then ends the driver's process outright
#: (its core worker's ``gcs_rpc_server_reconnect_timeout_s``), which would leave the run's journal unfolded.
HEAD_PROBE_S = 1.0
HEAD_SILENCE_S = 3.0
#: Round trips to each worker to estimate its clock's offset (the one of least delay is kept).
CLOCK_PROBES = 7
#: The start instant is at least this far ahead when it is sent, so every worker has it in time.
MIN_LEAD_S = 0.25
#: A worker that begins this long after the start instant is reported as late.
LATE_START_S = 0.005
#: The namespace of the actors batchbench places (their names: ``batchbench-<run>-<i>``).
NAMESPACE = "batchbench"
#: How long a TCP connection to the Ray address may take before it is called unreachable.
PROBE_S = 3.0
#: The object store of a Ray batchbench starts on this host: records and workload parts are small.
LOCAL_OBJECT_STORE_BYTES = 256 * 2**20


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise WorkerError(RAY_MISSING) from None
    return ray


def unusable(address: str | None) -> str | None:
    """Why workers on Ray cannot be had at ``address`` (None: a Ray started here), found in seconds: Ray is not
    installed, or nothing answers at the address's port. ``ray.init`` itself retries an address that does not
    answer for minutes; a port that answers but is not Ray's is left to it. None: try it."""
    if importlib.util.find_spec("ray") is None:
        return RAY_MISSING
    if address is None or address == "auto":
        return None
    if address.startswith("ray://"):
        return RAY_CLIENT_REFUSED.format(address=address)
    try:
        host, port = _host_port(address)
    except ValueError:
        return f"--ray-address {address!r} is not HOST:PORT (the head's GCS port, 6379 unless changed)"
    try:
        with socket.create_connection((host, port), timeout=PROBE_S):
            return None
    except OSError as exc:
        return f"nothing answers at the Ray address {address} within {PROBE_S:g}s ({exc}): is the cluster's head up?"


def _host_port(address: str) -> tuple[str, int]:
    url = yarl.URL(f"gcs://{address}")
    if not url.host or url.explicit_port is None:
        raise ValueError(address)
    return url.host, url.explicit_port


def _version() -> str:
    try:
        return metadata.version("batchbench")
    except metadata.PackageNotFoundError:  # pragma: no cover - a source tree that was never installed
        return "unknown"


# --------------------------------------------------------------------------- the worker (a Ray actor)


class Worker:
    """One worker's body, run as a Ray actor (:func:`_actor_class`): its own event loop on a thread of its own.

    ``prepare`` pins it and starts the load generator's loop with the engine's client; ``run`` is a streaming
    generator that starts the part at the agreed instant and yields ``(records, events)`` batches until it is
    done; ``stop`` cancels the part from another call (the actor takes two calls at once)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self._out: queue.SimpleQueue[RequestRecord | tuple[str, Any]] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._main: asyncio.Task[None] | None = None
        self._go: asyncio.Future[tuple[float, float]] | None = None
        self._ready = threading.Event()
        self._ended = threading.Event()  # set once "done" is queued: the last delivery follows at once
        self._failed: str | None = None
        self._thread: threading.Thread | None = None

    def hello(self) -> dict[str, Any]:
        """Who and where it is: the driver checks the version and whether the engine is reachable from here."""
        ray = _ray()
        return {"host": socket.gethostname(), "node": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address(), "pid": os.getpid(), "version": _version()}

    def clock(self) -> float:
        """Its wall clock now (the driver's offset estimate)."""
        return time.time()

    def prepare(self, engine: Engine, part: Workload, config: LoadConfig, cpu: int | None) -> list[int]:
        """Pin to ``cpu`` (None: as placed), start the loop and the engine's client; its CPUs, or WorkerError."""
        pinned = pin_self(cpu)  # first: the loop's thread inherits it
        self._thread = threading.Thread(target=self._serve, args=(engine, part, config), daemon=True,
                                        name=f"batchbench-ray-worker-{self.index}")
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            raise WorkerError(f"worker {self.index}: its engine client did not start within {START_TIMEOUT_S:g}s")
        if self._failed is not None:
            raise WorkerError(f"worker {self.index}: {self._failed}")
        return sorted(pinned.cpus)

    def run(self, start_wall: float, offset_s: float) -> Iterator[tuple[list[RequestRecord], list[tuple[str, Any]]]]:
        """Start at the driver's wall time ``start_wall`` (this clock is ``offset_s`` ahead); yield deliveries."""
        assert self._loop is not None and self._go is not None, "run() before prepare()"
        self._loop.call_soon_threadsafe(self._go.set_result, (start_wall, offset_s))
        quiet_since = time.monotonic()
        while True:
            # Woken every BATCH_S (at once when the part ends): one Ray object a delivery, not one a record, and
            # no thread switch per record. A loop thread that ended without saying so ends the stream too (the
            # driver calls the worker lost).
            ended = self._ended.wait(BATCH_S) or not (self._thread is not None and self._thread.is_alive())
            records: list[RequestRecord] = []
            events: list[tuple[str, Any]] = []
            with contextlib.suppress(queue.Empty):
                while True:
                    item = self._out.get_nowait()
                    if isinstance(item, RequestRecord):
                        records.append(item)
                    else:
                        events.append(item)
            if records or events or time.monotonic() - quiet_since >= HEARTBEAT_S:
                yield records, events
                quiet_since = time.monotonic()
            if ended and self._out.empty():
                return

    def stop(self) -> None:
        """Cancel the part: its in-flight requests become ``cancelled`` records, delivered like the others."""
        if self._loop is not None and self._main is not None:
            self._loop.call_soon_threadsafe(self._main.cancel)

    def _serve(self, engine: Engine, part: Workload, config: LoadConfig) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            eventloop.run(_send_part(self, engine, part, config))


async def _send_part(worker: Worker, engine: Engine, part: Workload, config: LoadConfig) -> None:
    """The worker's loop thread: its engine client, then its part from the agreed instant. Not a method: Ray makes
    an actor class with any ``async def`` an async actor, whose calls all wait on one event loop (``stop`` then
    waited for ``run`` to end)."""
    loop = worker._loop = asyncio.get_running_loop()
    worker._main = asyncio.current_task()
    worker._go = loop.create_future()
    try:
        await engine.start()  # at a URL: only the HTTP client
    except Exception as exc:
        worker._failed = f"{type(exc).__name__}: {exc}"
        worker._ready.set()
        return
    worker._ready.set()
    out = worker._out
    cpu0 = time.process_time()
    meter = ClientMeter()
    generator = LoadGenerator(engine, part, on_record=out.put, config=config)
    try:
        start_wall, offset_s = await worker._go
        # The agreed instant on this host's monotonic clock: its wall time here, less the wall time now.
        t0 = now() + (start_wall + offset_s - time.time())
        with SendTimer() as timer:
            await timer.until(t0)
        out.put(("started", now() - t0))
        with meter:
            await generator.run(t0)
    finally:
        try:
            out.put(("done", (meter.result(generator.records), time.process_time() - cpu0)))
            worker._ended.set()
        finally:
            await engine.stop()


def _actor_class() -> Any:
    """:class:`Worker` as a Ray actor class: one CPU, two calls at once (``run`` streams while ``stop`` may come)."""
    ray = _ray()
    return ray.remote(num_cpus=1, max_concurrency=2, max_restarts=0)(Worker)


# --------------------------------------------------------------------------- the driver


def connect(address: str | None, cpus: int) -> Any:
    """This process's connection to Ray: to the cluster at ``address``, or a Ray started here with at least
    ``cpus`` logical CPUs (kept for the process's later runs, shut down when it exits); the ``ray`` module."""
    if (why := unusable(address)) is not None:
        raise WorkerError(why)
    ray = _ray()
    if ray.is_initialized():
        ours = _connection.get("address")
        if ours == address and (address is not None or ray.cluster_resources().get("CPU", 0) >= cpus):
            return ray
        ray.shutdown()
    options: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING, "namespace": NAMESPACE}
    # ray.init replaces SIGTERM's handler with one that raises SystemExit wherever the main thread is (the run's
    # loop, mid-callback); batchbench keeps what it had: die of the signal, or the launch registry's teardown.
    # Our actors and placement group are the job's: the cluster removes them when this driver is gone, and a
    # Ray started here shares this process's fate.
    on_sigterm = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    try:
        if address is None:
            # "local": a new Ray even where one already runs on this host (a bare ray.init would join that one).
            ray.init(address="local", num_cpus=max(cpus, os.cpu_count() or 1), include_dashboard=False,
                     object_store_memory=LOCAL_OBJECT_STORE_BYTES, **options)
        else:
            ray.init(address=address, **options)
    except Exception as exc:  # ConnectionError, a bad address, a version mismatch: Ray's own message
        where = f"the Ray cluster at {address}" if address else "a Ray on this host"
        raise WorkerError(f"cannot connect to {where}: {type(exc).__name__}: {exc}") from exc
    finally:
        if on_sigterm is not None:
            signal.signal(signal.SIGTERM, on_sigterm)
    _connection["address"] = address
    if address is None:
        CLEANUP.register("ray", disconnect, "the Ray started for the load generator")
    CLEANUP.install()
    return ray


def disconnect() -> None:
    """Leave Ray (a Ray this process started stops with it)."""
    CLEANUP.discard("ray")
    if "address" in _connection:
        _ray().shutdown()
        _connection.clear()


#: What a SIGTERM or SIGHUP must not leave behind: the actors and placement group of a run (the cluster would
#: remove them once it sees this driver gone) and a Ray started here (whose agents outlive a killed driver by a
#: minute or more). Where the signal would kill the process, torn down, then the signal does what it did before
#: (the launch registry's teardown, or death); where a handler finishes the command as Ctrl-C does (the CLI's),
#: left to it: the run is cancelled, its workers stop and send their last records, the exit hook does the rest.
#: Ctrl-C is not among them: it cancels the run likewise.
CLEANUP = CleanupRegistry((signal.SIGTERM, signal.SIGHUP), defer_to_handlers=True)


#: The address this process connected to (None: a Ray it started), while connected.
_connection: dict[str, str | None] = {}


@dataclass
class _Remote:
    """One worker as the driver sees it."""

    index: int
    part: Workload
    actor: Any
    hello: dict[str, Any] = field(default_factory=dict)
    cpus: list[int] | None = None
    offset_s: float = 0.0
    rtt_s: float | None = None
    finished: set[str] = field(default_factory=set)
    start_late_s: float | None = None
    load: ClientLoad | None = None
    cpu_s: float | None = None
    lost: str | None = None
    lost_at_s: float | None = None
    task: asyncio.Task[None] | None = None

    @property
    def where(self) -> str:
        return (f"worker {self.index} (host {self.hello.get('host', '?')}, ip {self.hello.get('ip', '?')}, pid "
                f"{self.hello.get('pid', '?')})")


class RayWorkerPool(Pool):
    """A run's load sent from ``workers`` Ray actors; the same ``start``/``run(t0)``/``close`` and ``records`` as
    :class:`batchbench.load.workers.WorkerPool`, plus :attr:`start_lead_s` (how far ahead of now the run's
    ``t0`` must be for every worker to have it) and :attr:`reports` (each worker, for the footer)."""

    def __init__(self, engine: Engine, workload: Workload, *, workers: int,
                 on_record: Callable[[RequestRecord], None] = lambda record: None,
                 config: LoadConfig | None = None, placement: CpuPlacement | None = None) -> None:
        super().__init__(engine, workload, workers=workers, on_record=on_record, config=config, placement=placement)
        self.url: str = getattr(self.twin, "base_url", None) or ""
        self._remotes: list[_Remote] = []
        self._group: Any = None
        self._ray: Any = None
        self._host_ip = ""
        #: The head's GCS (host, port), and why the run ended without it (None: it answered throughout).
        self._gcs: tuple[str, int] | None = None
        self.head_lost: str | None = None

    @property
    def start_lead_s(self) -> float:
        """How far ahead the start instant is set: several of the slowest clock round trips, at least
        :data:`MIN_LEAD_S`."""
        rtts = [r.rtt_s for r in self._remotes if r.rtt_s is not None]
        return max(MIN_LEAD_S, 10 * max(rtts, default=0.0))

    @property
    def pids(self) -> frozenset[int]:
        """The harness's processes on this host, not other work on the machine: the workers here and, when this
        process started Ray, Ray's own (its children: the GCS, the raylet, their workers)."""
        workers = {r.hello["pid"] for r in self._remotes if r.hello.get("ip") == self._host_ip}
        started_here = "address" in _connection and _connection["address"] is None
        return frozenset(workers | (_descendants(os.getpid()) if started_here else set()))

    @property
    def pinned(self) -> list[Pinned]:
        """The CPUs of the workers on this host, as they reported them (for the placement record)."""
        return [Pinned(frozenset(r.cpus)) for r in self._remotes
                if r.cpus is not None and r.hello.get("ip") == self._host_ip]

    @property
    def client_loads(self) -> list[ClientLoad]:
        return [r.load for r in self._remotes if r.load is not None]

    @property
    def reports(self) -> list[WorkerReport]:
        return [WorkerReport(
            index=r.index, pool="ray", host=r.hello.get("host", "?"), node=r.hello.get("node"),
            ip=r.hello.get("ip"), pid=r.hello.get("pid"), cpus=r.cpus, requests=len(r.part.requests),
            records=len(r.finished),
            clock_offset_s=r.offset_s, clock_rtt_s=r.rtt_s, start_late_s=r.start_late_s, cpu_s=r.cpu_s,
            client=r.load, lost=r.lost, lost_at_s=r.lost_at_s) for r in self._remotes]

    async def _launch(self) -> None:
        """Place the workers, check them, measure their clocks and start their engine clients."""
        n = len(self.parts)
        ray = self._ray = connect(self.config.ray_address, n)
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._host_ip = ray.util.get_node_ip_address()
        self._gcs = _host_port(ray.get_runtime_context().gcs_address)
        run = uuid.uuid4().hex[:8]
        self._group = placement_group([{"CPU": 1}] * n, strategy="SPREAD", name=f"batchbench-{run}")
        CLEANUP.register(id(self), self._remove, f"the {n} Ray workers of a run")
        try:
            await asyncio.wait_for(self._group.ready(), START_TIMEOUT_S)
        except TimeoutError:
            raise WorkerError(
                f"the Ray cluster cannot place {n} workers of one CPU each within {START_TIMEOUT_S:g}s (it has "
                f"{ray.cluster_resources().get('CPU', 0):g} CPUs, {ray.available_resources().get('CPU', 0):g} "
                "free)") from None
        actor = _actor_class()
        self._remotes = [_Remote(i, part, actor.options(
            name=f"batchbench-{run}-{i}", scheduling_strategy=PlacementGroupSchedulingStrategy(
                self._group, placement_group_bundle_index=i)).remote(i)) for i, part in enumerate(self.parts)]
        hellos = await self._within(asyncio.gather(*(r.actor.hello.remote() for r in self._remotes)), "start")
        for remote, hello in zip(self._remotes, hellos):
            remote.hello = hello
            self._check(remote)
        for remote in self._remotes:  # one at a time: round trips measured on a quiet driver
            await self._measure_clock(remote)
        cpus = await self._within(asyncio.gather(*(r.actor.prepare.remote(
            self.twin, r.part, self.part_config(r.index), self._cpu(r)) for r in self._remotes)),
            "start its engine client")
        for remote, pinned in zip(self._remotes, cpus):
            remote.cpus = pinned or None

    async def _within(self, calls: Any, what: str) -> Any:
        try:
            return await asyncio.wait_for(calls, START_TIMEOUT_S)
        except TimeoutError:
            raise WorkerError(f"the Ray workers did not {what} within {START_TIMEOUT_S:g}s") from None
        except self._ray.exceptions.RayError as exc:
            raise WorkerError(f"a Ray worker failed to {what}: {_cause(exc)}") from exc

    def _check(self, remote: _Remote) -> None:
        if (why := refusal(remote.hello, self.url, self._host_ip)) is not None:
            raise WorkerError(f"{remote.where} {why}")

    async def _measure_clock(self, remote: _Remote) -> None:
        probes = []
        for _ in range(CLOCK_PROBES):
            sent = time.time()
            theirs = await self._within(remote.actor.clock.remote(), "answer a clock probe")
            probes.append((sent, theirs, time.time()))
        remote.offset_s, remote.rtt_s = clock_offset(probes)

    def _cpu(self, remote: _Remote) -> int | None:
        """A worker on this host takes its client CPU, as a local worker would; elsewhere Ray placed it."""
        if self.placement is None or remote.hello.get("ip") != self._host_ip:
            return None
        return self.placement.client_cpu(remote.index)

    async def run(self, t0: float | None = None) -> list[RequestRecord]:
        """Every worker sends its part from ``t0`` (this host's monotonic clock; set it :attr:`start_lead_s`
        ahead); all records, in arrival order."""
        self.t0 = now() + self.start_lead_s if t0 is None else t0
        start_wall = time.time() + (self.t0 - now())
        silence = min(SILENCE_S, self.config.request_timeout_s)
        for remote in self._remotes:
            remote.task = asyncio.create_task(self._follow(remote, start_wall, silence))
        tasks = [r.task for r in self._remotes if r.task is not None]
        watch = asyncio.create_task(self._watch_head())
        try:
            await asyncio.wait(tasks)  # not gather: cancelled, it would cancel them before the last records came
        except asyncio.CancelledError:
            await self._stop()
            raise
        finally:
            await eventloop.cancel_and_wait(watch)
        for task in tasks:
            if not task.cancelled():  # cancelled: its worker was lost with the head, and is recorded so
                task.result()  # a failure of the driver's own (a lost worker is not one: it is recorded)
        return self.records

    async def _watch_head(self) -> None:
        """End the run when the cluster's head stops answering for :data:`HEAD_SILENCE_S`: every worker still
        sending is lost (its requests not yet delivered become failed records naming the head), and no further
        Ray call is made, since each would wait for the head."""
        if self._gcs is None:
            return
        silent_since: float | None = None
        while True:
            await asyncio.sleep(HEAD_PROBE_S)
            if await _answers(*self._gcs):
                silent_since = None
                continue
            silent_since = now() if silent_since is None else silent_since
            if now() - silent_since >= HEAD_SILENCE_S:
                break
        host, port = self._gcs
        self.head_lost = f"the cluster's head (its GCS at {host}:{port}) stopped answering for {HEAD_SILENCE_S:g}s"
        for remote in self._remotes:
            if remote.task is not None and not remote.task.done():
                remote.task.cancel()
                self._lose(remote, self.head_lost)

    async def _follow(self, remote: _Remote, start_wall: float, silence_s: float) -> None:
        """Take in one worker's deliveries until it is done or lost."""
        stream = remote.actor.run.remote(start_wall, remote.offset_s)
        try:
            while True:
                try:
                    ref = await asyncio.wait_for(stream.__anext__(), silence_s)
                    records, events = await ref
                except StopAsyncIteration:
                    break
                for record in records:
                    remote.finished.add(record.request_id)
                    self.take(record)
                for kind, value in events:
                    if kind == "started":
                        remote.start_late_s = value
                    elif kind == "done":
                        remote.load, remote.cpu_s = value
        except TimeoutError:
            self._lose(remote, f"sent nothing, not even its heartbeat, for {silence_s:g}s")
        except self._ray.exceptions.RayError as exc:
            self._lose(remote, _cause(exc))
        if remote.load is None and remote.lost is None:
            self._lose(remote, "its stream ended before it said it was done")

    def _lose(self, remote: _Remote, why: str) -> None:
        remote.lost, remote.lost_at_s = why, now() - self.t0
        if self.head_lost is None:
            with contextlib.suppress(Exception):  # it may be gone already: make sure it is
                self._ray.kill(remote.actor, no_restart=True)
        self.lose(remote.part, remote.finished, remote.lost_at_s,
                  f"{remote.where} was lost ({why}) before this request's record came back")

    async def _stop(self) -> None:
        """Tell every running worker to stop, and give them :data:`STOP_GRACE_S` to deliver their last records."""
        running = [r for r in self._remotes if r.task is not None and not r.task.done()]
        for remote in running:
            with contextlib.suppress(Exception):
                remote.actor.stop.remote()
        if running:
            await asyncio.wait([r.task for r in running if r.task is not None], timeout=STOP_GRACE_S)

    async def close(self) -> None:
        """Stop what still runs, kill every actor and remove the placement group (nothing of ours stays)."""
        await self._stop()
        for remote in self._remotes:
            if remote.task is not None and not remote.task.done():
                await eventloop.cancel_and_wait(remote.task)
        self._remove()

    def _remove(self) -> None:
        """Kill every actor and remove the placement group, at once (also from SIGTERM's handler: CLEANUP). Not
        once the head is lost: each call would wait for it, and the cluster's fate is out of the driver's reach."""
        CLEANUP.discard(id(self))
        if self.head_lost is not None:
            self._group = None
            return
        for remote in self._remotes:
            with contextlib.suppress(Exception):
                self._ray.kill(remote.actor, no_restart=True)
        if self._group is not None:
            from ray.util.placement_group import remove_placement_group
            with contextlib.suppress(Exception):
                remove_placement_group(self._group)
            self._group = None


async def _answers(host: str, port: int) -> bool:
    """Whether something accepts a connection at ``host:port`` within :data:`HEAD_PROBE_S`."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), HEAD_PROBE_S)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


def refusal(hello: dict[str, Any], url: str, driver_ip: str) -> str | None:
    """Why a worker that said ``hello`` cannot send this run (None: it can): it runs another batchbench than
    this driver, or it is on another node and the engine's URL is this host's loopback."""
    ours, theirs = _version(), hello.get("version")
    if theirs != ours:
        return f"runs batchbench {theirs}, this driver {ours}: install the same batchbench on every node"
    if _loopback(_url_host(url)) and hello.get("ip") != driver_ip:
        return (f"is on another node ({hello.get('ip')}) and cannot reach the engine at {url}: give --engine-url "
                "an address the cluster's nodes reach")
    return None


def clock_offset(probes: list[tuple[float, float, float]]) -> tuple[float, float]:
    """Another host's clock minus ours, and the round trip it was measured over, from ``(sent, theirs, back)``
    probes (our clock before asking, their reading, our clock after): NTP's estimate from the probe of least
    round trip, which is off by at most half that round trip, however the delay split between the two ways."""
    sent, theirs, back = min(probes, key=lambda p: p[2] - p[0])
    return theirs - (sent + back) / 2, back - sent


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid``, from /proc (empty where there is none)."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    with open(f"/proc/{entry}/stat") as stat:
                        parent = int(stat.read().rsplit(")", 1)[1].split()[1])
                    children.setdefault(parent, []).append(int(entry))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _cause(exc: BaseException) -> str:
    """A Ray error's first line (its full text repeats the traceback of the worker)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _url_host(url: str) -> str:
    return yarl.URL(url).host or ""


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
