"""The load generator measured against a server whose truth is known: check the client before trusting a run.

The fast stream server (:mod:`batchbench.fixtures.protocol.fast`, vLLM's wire format at almost no CPU per
chunk, so the server does not saturate before the client) runs in a process of its own: the first token
``ttft_s`` after each request arrives, then one token per chunk every ``interval_s``, on a 1 ms grid. It
measures what it did (``GET /batchbench/truth``: its TTFT, the gap between a stream's chunks, how late its
ticks ran) on the same host clock the client stamps chunks with; each level's errors are the client's
figures minus the server's. Where the host has two CPUs or more and lets a process choose its CPUs, the
server runs on one and the client on another (:func:`placement`), so neither takes the other's CPU.
The client is the real measuring path (:func:`batchbench.load.runner.run`: load generator, adapter, journal,
scraper, client meter). Closed-loop concurrency doubles from 1 until two levels in a row are invalid; one
open-loop Poisson step follows at the request rate of the highest valid level. Each level reports what the
client did and cost (chunks/s, CPU per chunk, chunks/s per client core), how far its figures are from the
truth (ITL p50 and TTFT p50 against the server's; schedule lag for the Poisson step) and whether
:mod:`batchbench.analysis.validity` calls the run valid (loop busy, loop lag, read bursts), and if not, of which kind:
the client's own limit ("client saturated") or other work on the host holding the CPU ("machine
contention", with who held it: the server runs at a URL, so it counts among the other processes). The
**saturation point** is the highest valid level before two invalid ones in a row (:func:`saturation_point`):
up to there the client's figures are the server's; beyond, runs are marked invalid.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from batchbench.adapters.base import Engine
from batchbench.adapters.launch.local import free_port
from batchbench.adapters.vllm import VLLMEngine
from batchbench.analysis import validity
from batchbench.core import eventloop
from batchbench.core.config import LoadConfig, ModelRef
from batchbench.load.runner import MeasuredRun, run
from batchbench.workload.requests import Arrival, Lengths, WorkloadSpec

#: The served model's name (the server serves no weights).
MODEL = "selftest"


@dataclass(frozen=True)
class Settings:
    """One self-test: the server's timing, the requests, and how long each level sends."""

    interval_s: float = 0.01
    ttft_s: float = 0.02
    #: Output tokens per request (one chunk each).
    tokens: int = 32
    #: Seconds each level keeps sending (requests in flight then finish).
    level_s: float = 1.5
    max_concurrency: int = 1024
    #: Levels tried, in order (default: 1, 2, 4, ... up to max_concurrency).
    levels: tuple[int, ...] = ()
    #: Stop after this many invalid levels in a row.
    stop_after_invalid: int = 2
    poisson: bool = True

    def ladder(self) -> tuple[int, ...]:
        if self.levels:
            return self.levels
        return tuple(2 ** k for k in range(int(math.log2(self.max_concurrency)) + 1))

    @property
    def request_s(self) -> float:
        """One request's time on the server: its first token, then the others one interval apart."""
        return self.ttft_s + (self.tokens - 1) * self.interval_s


@dataclass(frozen=True)
class Level:
    """One level's figures (times in ms; errors are measured minus the server's truth)."""

    arrival: str
    #: Closed loop: requests in flight; Poisson: requests per second.
    load: float
    requests: int
    chunks: int
    chunks_per_s: float
    #: The client process's CPU (all its threads) per chunk, and chunks per second of it: per client core.
    cpu_us_per_chunk: float
    chunks_per_core_s: float
    #: The server's own ITL p50 (the gap between a stream's chunks as it wrote them) and TTFT p50 (arrival to
    #: first chunk written) during the level: the truth the client's figures are checked against.
    server_itl_p50_ms: float | None
    itl_p50_ms: float | None
    itl_p50_error_ms: float | None
    server_ttft_p50_ms: float | None
    ttft_p50_ms: float | None
    ttft_p50_error_ms: float | None
    schedule_lag_p99_ms: float | None
    loop_lag_p50_ms: float | None
    loop_lag_p99_ms: float | None
    busy_fraction: float
    burst_share: float | None
    valid: bool
    reasons: tuple[str, ...] = ()
    #: Each reason's kind (:data:`batchbench.analysis.validity.REASON_KINDS`): "client saturated" is this client's
    #: limit, "machine contention" other work on the host holding the CPU its loop waited for.
    reason_kinds: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return f"c={self.load:g}" if self.arrival == "closed" else f"poisson {self.load:.0f}/s"


@dataclass(frozen=True)
class Report:
    interval_s: float
    ttft_s: float
    #: Where the server and the client ran (:func:`placement`).
    placement: str
    levels: tuple[Level, ...]
    poisson: Level | None
    #: The highest valid closed-loop concurrency before the levels stayed invalid (None: none was valid).
    saturation: int | None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _error(measured: float | None, truth: float | None) -> float | None:
    return measured - truth if measured is not None and truth is not None else None


def _p50(truth: dict[str, Any], key: str) -> float | None:
    spread = truth.get(key)
    return float(spread["p50"]) if spread else None


def level_figures(result: MeasuredRun, arrival: Arrival, truth: dict[str, Any], cpu_s: float) -> Level:
    """One level's figures from its run; ``truth``: the server's account of the level (GET /batchbench/truth);
    ``cpu_s``: the client process's CPU over the run."""
    s, client = result.summary, result.client
    judged = validity.check(s, status=result.status, arrival=arrival.kind, client=client, machine=result.machine,
                            warmed_up=True)
    chunks = sum(len(r.chunk_times) for r in result.records)
    itl = s.itl_per_chunk.p50 if s.itl_per_chunk is not None else None
    ttft = s.ttft.p50 if s.ttft is not None else None
    server_itl, server_ttft = _p50(truth, "itl_s"), _p50(truth, "ttft_s")
    return Level(
        arrival=arrival.kind,
        load=float(arrival.concurrency if arrival.kind == "closed" else arrival.rate),
        requests=s.requests,
        chunks=chunks,
        chunks_per_s=chunks / result.duration_s,
        cpu_us_per_chunk=1e6 * cpu_s / chunks if chunks else math.inf,
        chunks_per_core_s=chunks / cpu_s if cpu_s > 0 else math.inf,
        server_itl_p50_ms=_ms(server_itl),
        itl_p50_ms=_ms(itl),
        itl_p50_error_ms=_ms(_error(itl, server_itl)),
        server_ttft_p50_ms=_ms(server_ttft),
        ttft_p50_ms=_ms(ttft),
        ttft_p50_error_ms=_ms(_error(ttft, server_ttft)),
        schedule_lag_p99_ms=_ms(s.schedule_lag.p99) if arrival.open_loop and s.schedule_lag is not None else None,
        loop_lag_p50_ms=_ms(client.loop_lag_p50_s),
        loop_lag_p99_ms=_ms(client.loop_lag_p99_s),
        busy_fraction=client.busy_fraction,
        burst_share=client.burst_share,
        valid=judged.valid,
        reasons=judged.reasons,
        reason_kinds=judged.kinds,
    )


async def measure(url: str, engine: Engine, arrival: Arrival, settings: Settings, results_dir: Path) -> Level:
    """One level: ``settings.level_s`` of sending (closed loop: enough requests to keep every slot busy)."""
    if arrival.kind == "closed":
        n = arrival.concurrency * (math.ceil(settings.level_s / settings.request_s) + 1)
    else:
        n = math.ceil(arrival.rate * settings.level_s) + 1
    workload = WorkloadSpec(f"selftest-{arrival.kind}", n, prompt=Lengths.fixed(4),
                            output=Lengths.fixed(settings.tokens), arrival=arrival).build()
    load = LoadConfig(request_timeout_s=60.0, send_until_s=settings.level_s)
    await server_truth(url)  # forget what the server did before this level
    cpu = time.process_time()
    result = await run(engine, workload, results_dir=results_dir, load=load, reset_cache=False)
    cpu = time.process_time() - cpu
    return level_figures(result, arrival, await server_truth(url), cpu)


async def server_truth(url: str) -> dict[str, Any]:
    """What the fast server did since the last call (it forgets it): ``ttft_s``, ``itl_s`` and
    ``tick_late_s`` as {n, p50, p99, max} in seconds, or None where nothing was written."""
    async with httpx.AsyncClient(timeout=10.0) as client:
        response = await client.get(url + "/batchbench/truth")
        response.raise_for_status()
        return dict(response.json())


def saturation_point(levels: list[Level], invalid_in_a_row: int = 2) -> int | None:
    """The highest valid closed-loop level before the first ``invalid_in_a_row`` invalid levels in a row.

    One invalid level between valid ones is a stall of a shared host (its reasons say so), not the client's
    limit; the limit is where the levels stay invalid."""
    point, run = None, 0
    for level in levels:
        run = 0 if level.valid else run + 1
        if run >= invalid_in_a_row:
            break
        if level.valid:
            point = int(level.load)
    return point


@dataclass(frozen=True)
class SelftestCpus:
    """The CPUs the server and the client run on (None: wherever the scheduler puts them)."""

    server: int | None = None
    client: int | None = None

    def describe(self) -> str:
        if self.server is None or self.client is None:
            return "server and client share this host's CPUs (fewer than two available, or no CPU affinity here)"
        return f"server pinned to CPU {self.server}, client to CPU {self.client}"


def placement() -> SelftestCpus:
    """The first two CPUs this process may use, one for the server and one for the client, where there are two
    and the OS lets a process choose (Linux: ``os.sched_setaffinity``): the client's CPU per chunk and its lag
    are then its own, not shared with the server it measures."""
    if not hasattr(os, "sched_setaffinity"):
        return SelftestCpus()
    cpus = sorted(os.sched_getaffinity(0))
    return SelftestCpus(cpus[0], cpus[1]) if len(cpus) >= 2 else SelftestCpus()


@contextmanager
def pinned(cpu: int | None) -> Iterator[None]:
    """The calling thread, and the threads it starts meanwhile, on ``cpu`` for the block (None: unchanged)."""
    if cpu is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


async def ramp(url: str, settings: Settings, on_level: Callable[[Level], None] = lambda level: None, *,
               where: SelftestCpus | None = None) -> Report:
    """Closed-loop levels up the ladder, then the Poisson step (module docstring), against the server at ``url``."""
    levels: list[Level] = []
    poisson = None
    with tempfile.TemporaryDirectory(prefix="batchbench-selftest-") as tmp:
        async with VLLMEngine(model=ModelRef(MODEL), url=url) as engine:
            warm = WorkloadSpec("selftest-warm-up", 1, prompt=Lengths.fixed(4), output=Lengths.fixed(2)).build()
            await run(engine, warm, results_dir=Path(tmp), reset_cache=False)
            invalid_in_a_row = 0
            for concurrency in settings.ladder():
                level = await measure(url, engine, Arrival("closed", concurrency=concurrency), settings, Path(tmp))
                levels.append(level)
                on_level(level)
                invalid_in_a_row = 0 if level.valid else invalid_in_a_row + 1
                if invalid_in_a_row >= settings.stop_after_invalid:
                    break
            saturation = saturation_point(levels, settings.stop_after_invalid)
            if settings.poisson and saturation is not None:
                rate = saturation / settings.request_s
                poisson = await measure(url, engine, Arrival("poisson", rate=rate), settings, Path(tmp))
                on_level(poisson)
    where = where or SelftestCpus()
    return Report(settings.interval_s, settings.ttft_s, where.describe(), tuple(levels), poisson, saturation)


def selftest(settings: Settings, on_level: Callable[[Level], None] = lambda level: None, *,
             where: SelftestCpus | None = None) -> Report:
    """The whole self-test: the fast server started on its CPU, this thread (the client) pinned to the other,
    the ramp on the command line's event loop; ``where`` defaults to :func:`placement`."""
    where = where or placement()
    with fast_server(settings, cpu=where.server) as url, pinned(where.client):
        return eventloop.run(ramp(url, settings, on_level, where=where))


@contextmanager
def fast_server(settings: Settings, *, cpu: int | None = None, timeout_s: float = 30.0) -> Iterator[str]:
    """The fast stream server in a process of its own (on ``cpu`` where given); yields its URL.

    Its stderr goes to a temporary file, not a pipe nobody reads while it serves (a full pipe would stall it).
    Stopped however the block ends (Ctrl-C included): terminated, then killed if it has not gone in 5 s."""
    port = free_port()
    with tempfile.TemporaryFile() as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "batchbench.fixtures.protocol.fast", "--port", str(port), "--model", MODEL,
             "--ttft", repr(settings.ttft_s), "--interval", repr(settings.interval_s)],
            stdout=subprocess.DEVNULL, stderr=stderr)
        url = f"http://127.0.0.1:{port}"
        try:
            if cpu is not None:
                os.sched_setaffinity(proc.pid, {cpu})
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    stderr.seek(0)
                    err = stderr.read().decode(errors="replace").strip()[-500:]
                    raise RuntimeError(f"the fast server exited with status {proc.returncode}: {err}")
                try:
                    if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the fast server did not answer /health within {timeout_s:g}s")
                time.sleep(0.05)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


HEADER = (f"{'level':>14} {'chunks/s':>9} {'us CPU/chunk':>12} {'chunks/s/core':>13} {'server ITL':>10} "
          f"{'ITL p50 err':>11} {'server TTFT':>11} {'TTFT p50 err':>12} {'sched lag p99':>13} "
          f"{'loop lag p50/p99':>16} {'busy':>5} {'bursts':>6}  verdict")


def line(level: Level) -> str:
    """One table row (:data:`HEADER`), times in ms."""
    lag = f"{_num(level.loop_lag_p50_ms, '.2f')}/{_num(level.loop_lag_p99_ms, '.2f')}"
    kinds = ", ".join(dict.fromkeys(level.reason_kinds))
    verdict = "valid" if level.valid else f"INVALID ({kinds}): " + "; ".join(level.reasons)
    return (f"{level.label:>14} {level.chunks_per_s:9.0f} {level.cpu_us_per_chunk:12.1f} "
            f"{level.chunks_per_core_s:13.0f} {_num(level.server_itl_p50_ms, '10.3f')} "
            f"{_num(level.itl_p50_error_ms, '+11.3f')} {_num(level.server_ttft_p50_ms, '11.2f')} "
            f"{_num(level.ttft_p50_error_ms, '+12.3f')} {_num(level.schedule_lag_p99_ms, '13.2f')} {lag:>16} "
            f"{level.busy_fraction:5.0%} {_num(level.burst_share, '6.0%')}  {verdict}")


def conclusion(report: Report) -> str:
    """The answer in one sentence."""
    if report.saturation is None:
        return ("no level was valid (the reasons are above): the client, or other work on this host, kept its "
                "timestamps late even at the lowest load; rerun on a quiet host before trusting a run from it")
    top = next(lv for lv in report.levels if lv.load == report.saturation)
    return (f"saturation point: concurrency {report.saturation} ({top.chunks_per_s:.0f} chunks/s, ITL p50 "
            f"{_num(top.itl_p50_error_ms, '+.3f')} ms from the server's {_num(top.server_itl_p50_ms, '.3f')} ms, "
            f"TTFT p50 {_num(top.ttft_p50_error_ms, '+.3f')} ms from the server's "
            f"{_num(top.server_ttft_p50_ms, '.2f')} ms); runs past it are marked invalid")
