"""The load generator: replays a workload against an engine and records every request.

One asyncio event loop, no threads. Open-loop arrivals (offline, Poisson,
gamma) are released on the workload's schedule whatever the engine does, and
each request's latency is also measured from its *scheduled* send time, so a
slow engine cannot hide its queueing by slowing the client down (no
coordinated omission). In-flight requests are bounded (``max_in_flight``);
a request held back by that bound shows the wait as schedule lag.

Closed loop keeps ``concurrency`` requests in flight; static waves send
``concurrency`` requests together and the next wave only when all of them
have finished: static batching emulated at the client, on any engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from batchbench.adapters.base import Engine, EngineError, StreamProtocolError
from batchbench.clock import now
from batchbench.records import RequestRecord
from batchbench.workload import Request, Workload


@dataclass(frozen=True)
class LoadConfig:
    """Client-side limits of one run."""

    #: Per-request deadline covering the whole stream (a hung stream fails here).
    request_timeout_s: float = 120.0
    #: Bound on concurrently open requests in open-loop mode.
    max_in_flight: int = 2048
    #: Send no new request this many seconds after the run starts (a run of a set duration); those in
    #: flight finish, and requests never sent are not recorded. None: send the whole workload.
    send_until_s: float | None = None

    def __post_init__(self) -> None:
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, not {self.request_timeout_s}")
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, not {self.max_in_flight}")
        if self.send_until_s is not None and not self.send_until_s > 0:
            raise ValueError(f"send_until_s must be > 0, not {self.send_until_s}")


class LoadGenerator:
    """Sends one workload; hands each finished record to ``on_record`` at once.

    ``on_record`` is how records reach the results file as the run goes, so
    a crash later in the run loses nothing already measured.
    """

    def __init__(
        self,
        engine: Engine,
        workload: Workload,
        *,
        on_record: Callable[[RequestRecord], None] = lambda record: None,
        config: LoadConfig | None = None,
    ) -> None:
        self.engine = engine
        self.workload = workload
        self.on_record = on_record
        self.config = config or LoadConfig()
        self.records: list[RequestRecord] = []
        self.in_flight = 0
        self.t0 = 0.0

    async def run(self, t0: float | None = None) -> list[RequestRecord]:
        """Send every request; return all records (failed ones included), in completion order."""
        self.t0 = now() if t0 is None else t0
        arrival = self.workload.arrival
        if arrival.open_loop:
            await self._open_loop()
        elif arrival.kind == "closed":
            await self._closed_loop(arrival.concurrency)
        else:
            await self._waves(arrival.concurrency)
        return self.records

    async def _open_loop(self) -> None:
        slots = asyncio.Semaphore(self.config.max_in_flight)
        tasks: list[asyncio.Task[None]] = []

        async def release(request: Request, scheduled: float) -> None:
            try:
                await self._send(request, scheduled)
            finally:
                slots.release()

        try:
            for request in self.workload.requests:
                scheduled = self.t0 + request.arrival_s
                delay = scheduled - now()
                if delay > 0:
                    await asyncio.sleep(delay)
                await slots.acquire()
                if self._past_deadline():
                    slots.release()
                    break
                tasks.append(asyncio.create_task(release(request, scheduled)))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()

    async def _closed_loop(self, concurrency: int) -> None:
        requests: Iterator[Request] = iter(self.workload.requests)

        async def worker() -> None:
            for request in requests:  # a shared iterator: each request is taken once
                if self._past_deadline():
                    return
                await self._send(request, now())

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    async def _waves(self, size: int) -> None:
        requests = self.workload.requests
        for wave, start in enumerate(range(0, len(requests), size)):
            if self._past_deadline():
                return
            scheduled = now()
            await asyncio.gather(*(self._send(r, scheduled, wave) for r in requests[start:start + size]))

    def _past_deadline(self) -> bool:
        until = self.config.send_until_s
        return until is not None and now() - self.t0 >= until

    async def _send(self, request: Request, scheduled: float, wave: int | None = None) -> None:
        self.in_flight += 1
        record = RequestRecord(
            request_id=request.request_id,
            prompt_len=request.prompt_len,
            max_tokens=request.max_tokens,
            scheduled_s=scheduled - self.t0,
            priority=request.priority,
            wave=wave,
            in_flight_at_send=self.in_flight,
            adapter=request.adapter,
        )
        sent = now()
        record.sent_s = sent - self.t0
        received = 0
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                async for chunk in self.engine.stream(request):
                    if chunk.sent is not None:
                        record.sent_s = chunk.sent - self.t0
                    if chunk.n_tokens:
                        received += chunk.n_tokens
                        if received > request.max_tokens:
                            # An endless or runaway stream: what it sent past the limit is not the
                            # engine's answer to this request, and must not count as its throughput.
                            raise StreamProtocolError(
                                self.engine.name, f"the stream sent more than max_tokens={request.max_tokens} "
                                f"tokens ({received} so far); cut", request_id=request.request_id)
                        record.chunk_times.append(chunk.t - self.t0)
                        record.chunk_tokens.append(chunk.n_tokens)
                    if chunk.usage is not None:
                        record.prompt_tokens = chunk.usage.prompt_tokens
                        record.completion_tokens = chunk.usage.completion_tokens
                    if chunk.finish_reason is not None:
                        record.finish_reason = chunk.finish_reason
            record.ok = True
        except EngineError as exc:
            record.error_kind, record.error = exc.kind, str(exc)
        except TimeoutError:
            record.error_kind = "timeout"
            record.error = (
                f"engine {self.engine.name!r}, request {request.request_id}: no complete response within "
                f"{self.config.request_timeout_s:g}s ({sum(record.chunk_tokens)} of {request.max_tokens} "
                "tokens received)"
            )
        except Exception as exc:  # an adapter bug must not lose the rest of the run
            record.error_kind = "client_error"
            record.error = f"engine {self.engine.name!r}, request {request.request_id}: {type(exc).__name__}: {exc}"
        finally:
            if not record.ok and record.error_kind is None:
                record.error_kind, record.error = "cancelled", "the run was interrupted before this request finished"
            record.closed_s = now() - self.t0
            # E2E ends at the last token, as the engine's own e2e histogram does, not when the stream closes.
            record.done_s = record.chunk_times[-1] if record.ok and record.chunk_times else record.closed_s
            self.in_flight -= 1
            self.records.append(record)
            self.on_record(record)
