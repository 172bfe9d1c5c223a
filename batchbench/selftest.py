"""The load generator measured against a server whose truth is known: check the client before trusting a run.

A protocol server (:mod:`batchbench.fixtures.protocol`, vLLM's wire format) runs in a process of its own and
streams one token per chunk every ``interval_s`` (plus its own overhead), and records when each step handed
its tokens out (``GET /batchbench/steps``): the true interval of each level is the median gap between the
server's steps during it, on the same host clock the client stamps chunks with.
The client is the real measuring path (:func:`batchbench.runner.run`: load generator, adapter, journal,
scraper, client meter). Closed-loop concurrency doubles from 1 until two levels in a row are invalid; one
open-loop Poisson step follows at the request rate of the highest valid level. Each level reports what the
client did and cost (chunks/s, CPU per chunk, chunks/s per client core), how far its figures are from the
truth (ITL p50 against the server's step interval p50; TTFT p50, one to two intervals on this server: a
request joins the batch at the next step and gets its first token at the one after; schedule lag for the
Poisson step) and whether :mod:`batchbench.validity` calls the run valid (loop busy,
loop lag, read bursts). The **saturation point** is the highest valid level before two invalid ones in a
row (:func:`saturation_point`): up to there the client's figures are the server's; beyond, runs are marked
invalid.

The server shares the host with the client: at high levels its own loop falls behind; its step record
shows that, so the ITL error stays the client's own (``server_interval_p50_ms`` against ``interval_s``
shows the server's lateness).
"""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from batchbench import validity
from batchbench.adapters.base import Engine, ModelRef
from batchbench.adapters.launch.local import free_port
from batchbench.adapters.vllm import VLLMEngine
from batchbench.loadgen import LoadConfig
from batchbench.metrics import percentile
from batchbench.runner import RunResult, run
from batchbench.workload import Arrival, Lengths, WorkloadSpec

#: The served model's name (the protocol server serves no weights).
MODEL = "selftest"


@dataclass(frozen=True)
class Settings:
    """One self-test: the server's interval, the requests, and how long each level sends."""

    interval_s: float = 0.01
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
    #: The median gap between the server's steps during the level: the truth ITL p50 is checked against.
    server_interval_p50_ms: float | None
    itl_p50_ms: float | None
    itl_p50_error_ms: float | None
    ttft_p50_ms: float | None
    schedule_lag_p99_ms: float | None
    loop_lag_p50_ms: float | None
    loop_lag_p99_ms: float | None
    busy_fraction: float
    burst_share: float | None
    valid: bool
    reasons: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return f"c={self.load:g}" if self.arrival == "closed" else f"poisson {self.load:.0f}/s"


@dataclass(frozen=True)
class Report:
    interval_s: float
    levels: tuple[Level, ...]
    poisson: Level | None
    #: The highest valid closed-loop concurrency before the levels stayed invalid (None: none was valid).
    saturation: int | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def level_figures(result: RunResult, arrival: Arrival, server_steps: list[float], cpu_s: float) -> Level:
    """One level's figures from its run; ``server_steps``: the server's step times during it; ``cpu_s``: the
    client process's CPU over the run."""
    s, client = result.summary, result.client
    judged = validity.check(s, status=result.status, arrival=arrival.kind, client=client, warmed_up=True)
    chunks = sum(len(r.chunk_times) for r in result.records)
    itl = s.itl_per_chunk.p50 if s.itl_per_chunk is not None else None
    gaps = [b - a for a, b in itertools.pairwise(server_steps)]
    truth = percentile(gaps, 50) if gaps else None
    return Level(
        arrival=arrival.kind,
        load=float(arrival.concurrency if arrival.kind == "closed" else arrival.rate),
        requests=s.requests,
        chunks=chunks,
        chunks_per_s=chunks / result.duration_s,
        cpu_us_per_chunk=1e6 * cpu_s / chunks if chunks else math.inf,
        chunks_per_core_s=chunks / cpu_s if cpu_s > 0 else math.inf,
        server_interval_p50_ms=_ms(truth),
        itl_p50_ms=_ms(itl),
        itl_p50_error_ms=_ms(itl - truth) if itl is not None and truth is not None else None,
        ttft_p50_ms=_ms(s.ttft.p50) if s.ttft is not None else None,
        schedule_lag_p99_ms=_ms(s.schedule_lag.p99) if arrival.open_loop and s.schedule_lag is not None else None,
        loop_lag_p50_ms=_ms(client.loop_lag_p50_s),
        loop_lag_p99_ms=_ms(client.loop_lag_p99_s),
        busy_fraction=client.busy_fraction,
        burst_share=client.burst_share,
        valid=judged.valid,
        reasons=judged.reasons,
    )


async def measure(url: str, engine: Engine, arrival: Arrival, settings: Settings, results_dir: Path) -> Level:
    """One level: ``settings.level_s`` of sending (closed loop: enough requests to keep every slot busy)."""
    if arrival.kind == "closed":
        n = arrival.concurrency * (math.ceil(settings.level_s / (settings.tokens * settings.interval_s)) + 1)
    else:
        n = math.ceil(arrival.rate * settings.level_s) + 1
    workload = WorkloadSpec(f"selftest-{arrival.kind}", n, prompt=Lengths.fixed(4),
                            output=Lengths.fixed(settings.tokens), arrival=arrival).build()
    load = LoadConfig(request_timeout_s=60.0, send_until_s=settings.level_s)
    await server_steps(url)  # forget the steps before this level
    cpu = time.process_time()
    result = await run(engine, workload, results_dir=results_dir, load=load, reset_cache=False)
    cpu = time.process_time() - cpu
    return level_figures(result, arrival, await server_steps(url), cpu)


async def server_steps(url: str) -> list[float]:
    """The protocol server's step times since the last call (and it forgets them)."""
    async with httpx.AsyncClient(timeout=10.0) as client:
        response = await client.get(url + "/batchbench/steps")
        response.raise_for_status()
        return [float(t) for t in response.json()["step_times"]]


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


async def ramp(url: str, settings: Settings, on_level: Callable[[Level], None] = lambda level: None) -> Report:
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
                rate = saturation / (settings.tokens * settings.interval_s)
                poisson = await measure(url, engine, Arrival("poisson", rate=rate), settings, Path(tmp))
                on_level(poisson)
    return Report(settings.interval_s, tuple(levels), poisson, saturation)


@contextmanager
def protocol_server(interval_s: float, *, timeout_s: float = 30.0) -> Iterator[str]:
    """The vLLM protocol server in a process of its own, stepping every ``interval_s``; yields its URL.

    Stopped however the block ends (Ctrl-C included): terminated, then killed if it has not gone in 5 s."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchbench.fixtures.protocol", "vllm", "--port", str(port), "--model", MODEL,
         "--token-delay", repr(interval_s), "--max-running", "1000000", "--max-queue", "1000000",
         "--kv-capacity-tokens", str(10**12), "--max-total-tokens", "100000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise RuntimeError(f"the protocol server exited with status {proc.returncode}: {err.strip()[-500:]}")
            try:
                if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the protocol server did not answer /health within {timeout_s:g}s")
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


HEADER = (f"{'level':>14} {'chunks/s':>9} {'us CPU/chunk':>12} {'chunks/s/core':>13} {'server p50':>10} "
          f"{'ITL p50 err':>11} "
          f"{'TTFT p50':>9} {'sched lag p99':>13} {'loop lag p50/p99':>16} {'busy':>5} {'bursts':>6}  verdict")


def line(level: Level) -> str:
    """One table row (:data:`HEADER`), times in ms."""
    lag = f"{_num(level.loop_lag_p50_ms, '.2f')}/{_num(level.loop_lag_p99_ms, '.2f')}"
    verdict = "valid" if level.valid else "INVALID: " + "; ".join(level.reasons)
    return (f"{level.label:>14} {level.chunks_per_s:9.0f} {level.cpu_us_per_chunk:12.1f} "
            f"{level.chunks_per_core_s:13.0f} {_num(level.server_interval_p50_ms, '10.3f')} "
            f"{_num(level.itl_p50_error_ms, '+11.3f')} "
            f"{_num(level.ttft_p50_ms, '9.2f')} {_num(level.schedule_lag_p99_ms, '13.2f')} {lag:>16} "
            f"{level.busy_fraction:5.0%} {_num(level.burst_share, '6.0%')}  {verdict}")


def conclusion(report: Report) -> str:
    """The answer in one sentence."""
    if report.saturation is None:
        return ("no level was valid (the reasons are above): the client, or other work on this host, kept its "
                "timestamps late even at the lowest load; rerun on a quiet host before trusting a run from it")
    top = next(lv for lv in report.levels if lv.load == report.saturation)
    return (f"saturation point: concurrency {report.saturation} ({top.chunks_per_s:.0f} chunks/s, ITL p50 "
            f"{_num(top.itl_p50_error_ms, '+.3f')} ms from the server's {_num(top.server_interval_p50_ms, '.3f')} "
            f"ms, nominal {report.interval_s * 1000:g} ms); "
            "runs past it are marked invalid")
