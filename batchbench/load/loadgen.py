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

Multi-turn sessions (a workload with ``turns``) run closed loop over
``concurrency`` conversations: each sends its turns in order, a turn only
once the previous answer is complete and the user's think time has passed.
That moment is the turn's scheduled send time, so latency is still measured
from when the user would have sent it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

from batchbench.adapters.base import Engine, EngineError, StreamProtocolError, Usage
from batchbench.core.clock import now
from batchbench.core.config import LoadConfig
from batchbench.core.records import RequestRecord
from batchbench.load.collector import Paused
from batchbench.load.timer import SendTimer
from batchbench.workload.requests import Request, Workload


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
        with Paused():  # no collector pauses in the schedule (load/collector.py)
            if sessions := self.workload.sessions():
                await self._sessions(sessions, arrival.concurrency)
            elif arrival.open_loop:
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

        timer = SendTimer()  # each send at its time to within ~0.1 ms, without spinning (load/timer.py)
        try:
            for request in self.workload.requests:
                scheduled = self.t0 + request.arrival_s
                await timer.until(scheduled)
                await slots.acquire()
                if self._past_deadline():
                    slots.release()
                    break
                tasks.append(asyncio.create_task(release(request, scheduled)))
            await asyncio.gather(*tasks)
        finally:
            timer.close()
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

    async def _sessions(self, sessions: list[tuple[Request, ...]], concurrency: int) -> None:
        """``concurrency`` users, each taking the next conversation when its last one ends.

        A turn is scheduled when the previous answer's stream closed (the client has the whole answer only
        then) plus its think time. A failed turn ends its conversation: the turns after it are recorded as
        failed with ``error_kind`` ``"not_sent"``, so a run's request count never hides them.
        """
        queue: Iterator[tuple[Request, ...]] = iter(sessions)

        async def user() -> None:
            for turns in queue:  # a shared iterator: each conversation is taken once
                if self._past_deadline():
                    return
                previous: RequestRecord | None = None
                for k, request in enumerate(turns):
                    if previous is None:
                        scheduled = now()
                    else:
                        scheduled = self.t0 + (previous.closed_s or 0.0) + request.think_s
                        if (delay := scheduled - now()) > 0:
                            await asyncio.sleep(delay)
                        if self._past_deadline():
                            return
                    previous = await self._send(request, scheduled)
                    if not previous.ok:
                        self._not_sent(turns[k + 1:], previous)
                        break

        await asyncio.gather(*(user() for _ in range(concurrency)))

    def _not_sent(self, turns: tuple[Request, ...], failed: RequestRecord) -> None:
        """Records for the turns a conversation never sent because ``failed`` (an earlier turn) failed."""
        at = now() - self.t0
        for request in turns:
            record = RequestRecord(
                request_id=request.request_id, prompt_len=request.prompt_len, max_tokens=request.max_tokens,
                scheduled_s=at, sent_s=at, done_s=at, closed_s=at, priority=request.priority,
                session=request.session, turn=request.turn, error_kind="not_sent",
                error=f"not sent: turn {failed.turn} of session {failed.session} ({failed.request_id}) failed "
                      f"first ({failed.error_kind})")
            self.records.append(record)
            self.on_record(record)

    def _past_deadline(self) -> bool:
        until = self.config.send_until_s
        return until is not None and now() - self.t0 >= until

    async def _send(self, request: Request, scheduled: float, wave: int | None = None) -> RequestRecord:
        self.in_flight += 1
        record = RequestRecord(
            request_id=request.request_id,
            prompt_len=request.prompt_len,
            max_tokens=request.max_tokens,
            scheduled_s=scheduled - self.t0,
            priority=request.priority,
            wave=wave,
            in_flight_at_send=self.in_flight,
            session=request.session,
            turn=request.turn,
            lora=request.lora,
        )
        record.sent_s = now() - self.t0
        sink = _RecordSink(record, self.t0, request.max_tokens)
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                await self.engine.stream_into(request, sink)
            record.ok = True
        except TooManyTokens as cut:
            # An endless or runaway stream: what it sent past the limit is not the engine's answer to this
            # request, and must not count as its throughput.
            error = cut.error(self.engine.name, request)
            record.error_kind, record.error = error.kind, str(error)
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
            Paused.check()
        return record


class TooManyTokens(Exception):
    """Raised by a request's sink, through the engine's stream, when the stream passes max_tokens (the load
    generator's records and the engines' warm-up both check it). Not an EngineError: the engine's handlers of
    its own failures (a dead server?) have nothing to explain here."""

    def __init__(self, received: int) -> None:
        super().__init__(received)
        self.received = received

    def error(self, engine: str, request: Request) -> StreamProtocolError:
        """What the request is recorded as: a protocol error naming the limit and what came."""
        return StreamProtocolError(engine, f"the stream sent more than max_tokens={request.max_tokens} tokens "
                                   f"({self.received} so far); cut", request_id=request.request_id)


class _RecordSink:
    """The :class:`ChunkSink` of one request: each piece goes straight into its record, nothing kept besides."""

    __slots__ = ("limit", "received", "record", "sends", "t0")

    def __init__(self, record: RequestRecord, t0: float, limit: int) -> None:
        self.record, self.t0, self.limit, self.received, self.sends = record, t0, limit, 0, 0

    def sent(self, t: float) -> None:
        """Each send of the request: a second one (the adapter's client sent it again on a fresh connection after a
        kept-alive one closed unanswered) is counted, and its send time is the one its latencies start from."""
        self.record.sent_s = t - self.t0
        self.sends += 1
        if self.sends > 1:
            self.record.resent = self.sends - 1

    def tokens(self, t: float, n: int, finish_reason: str | None = None) -> None:
        if n:
            self.received += n
            if self.received > self.limit:
                raise TooManyTokens(self.received)
            self.record.chunk_times.append(t - self.t0)
            self.record.chunk_tokens.append(n)
        if finish_reason is not None:
            self.record.finish_reason = finish_reason

    def usage(self, t: float, usage: Usage) -> None:
        self.record.prompt_tokens = usage.prompt_tokens
        self.record.completion_tokens = usage.completion_tokens
        if usage.reasoning_tokens is not None:  # the engine's own count wins over the pieces'
            self.record.reasoning_tokens = usage.reasoning_tokens
        # The last usage the stream carried wins (a running one, then the final totals): its form with it.
        self.record.usage_from = None if usage.source == "engine" else usage.source
        if usage.timings is not None:
            self.record.engine_timings = usage.timings

    def reasoning(self, t: float, n: int, finish_reason: str | None = None) -> None:
        self.tokens(t, n, finish_reason)
        if n:
            self.record.reasoning_tokens = (self.record.reasoning_tokens or 0) + n

    def first_output(self, t: float) -> None:
        if self.record.first_output_s is None:
            self.record.first_output_s = t - self.t0
