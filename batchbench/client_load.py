"""How busy the load generator's own event loop was during a run.

The harness must not be the bottleneck it measures. Chunk timestamps are
taken when the event loop gets round to a chunk, so they are late by however
long the loop was busy elsewhere (or the process was off its core). Two
figures say whether that happened, in every results document:

- **busy fraction**: CPU time of the loop's thread over the run's wall time.
  Near 1, ready callbacks queue behind each other and every stamp waits. An
  engine computing in another thread of this process (hf-static) does not
  count: thread CPU time is the loop thread's alone.
- **loop lag**: a heartbeat sleeps ``interval`` and measures how late it
  wakes. Its lag is a direct sample of how late a chunk arriving at that
  moment would have been stamped, whatever the cause (a busy loop, or another
  process taking the core). Its p99 is the timestamp error to quote.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import asdict, dataclass
from typing import Any

from adapters.base import now
from batchbench.metrics import Distribution

#: Heartbeat period: fine enough to see a lag of a few ms, cheap (100 wake-ups a second).
HEARTBEAT_S = 0.01
#: Busy fraction from which the loop counts as saturated: at 80% a chunk that arrives finds the
#: loop busy four times in five and waits for the callbacks queued ahead of it.
BUSY_LIMIT = 0.8
#: Loop-lag p99 from which timestamps are too late to trust for inter-token latency: ITLs of a
#: fast GPU engine are ~10 ms, so a stamp 5 ms late is half an ITL.
LAG_LIMIT_S = 0.005


@dataclass(frozen=True)
class ClientLoad:
    """The load generator's own load over one run."""

    cpu_s: float
    wall_s: float
    busy_fraction: float
    heartbeats: int
    loop_lag_p50_s: float | None
    loop_lag_p99_s: float | None
    loop_lag_max_s: float | None

    @property
    def saturated(self) -> bool:
        """The client itself was the bottleneck: its loop had little idle time left."""
        return self.busy_fraction >= BUSY_LIMIT

    @property
    def late_stamps(self) -> bool:
        """Timestamps were often late, whatever the cause (the client, or other processes)."""
        return (self.loop_lag_p99_s or 0.0) >= LAG_LIMIT_S

    def warnings(self) -> list[str]:
        """Sentences for the user where the client may have distorted the run."""
        out = []
        if self.saturated:
            out.append(f"the load generator's event loop was busy {self.busy_fraction:.0%} of the run: the client "
                       "may have limited the load it offered (run fewer requests per client, or several clients)")
        if self.late_stamps and self.loop_lag_p99_s is not None:
            out.append(f"the load generator's event loop woke {self.loop_lag_p99_s * 1e3:.1f} ms late (p99, max "
                       f"{(self.loop_lag_max_s or 0) * 1e3:.0f} ms): chunk timestamps, and latencies shorter than "
                       "that, may be off by as much"
                       + ("" if self.saturated else " (the loop was not busy: other processes took its core)"))
        return out

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> ClientLoad:
        """The inverse of :meth:`to_dict` (derived keys ignored); ValueError on a malformed document."""
        try:
            return cls(**{name: doc[name] for name in cls.__dataclass_fields__})
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a client-load document: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"saturated": self.saturated, "late_stamps": self.late_stamps,
                               "busy_limit": BUSY_LIMIT, "lag_limit_s": LAG_LIMIT_S}


class LoopMonitor:
    """``async with LoopMonitor() as m:`` around a run; ``m.result()`` afterwards.

    Must be entered on the loop that runs the load generator.
    """

    def __init__(self, interval_s: float = HEARTBEAT_S) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, not {interval_s!r}")
        self.interval_s = interval_s
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None
        self._cpu0 = self._wall0 = 0.0
        self._cpu = self._wall = 0.0

    async def _beat(self) -> None:
        while True:
            t = now()
            await asyncio.sleep(self.interval_s)
            self.lags.append(max(0.0, now() - t - self.interval_s))

    async def __aenter__(self) -> LoopMonitor:
        self._cpu0, self._wall0 = time.thread_time(), now()
        self._task = asyncio.create_task(self._beat())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._cpu, self._wall = time.thread_time() - self._cpu0, now() - self._wall0
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def result(self) -> ClientLoad:
        lag = Distribution.of(self.lags)
        return ClientLoad(
            cpu_s=self._cpu,
            wall_s=self._wall,
            busy_fraction=self._cpu / self._wall if self._wall > 0 else 0.0,
            heartbeats=len(self.lags),
            loop_lag_p50_s=lag.p50 if lag else None,
            loop_lag_p99_s=lag.p99 if lag else None,
            loop_lag_max_s=lag.max if lag else None,
        )
