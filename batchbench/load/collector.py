"""Python's cyclic garbage collector held off while a run sends: its pauses were the open loop's worst lags.

A collection of the oldest generation walks every tracked object: the imports (the CLI holds ~100k, ~420k once
torch and transformers are loaded) and the run's own records, which grow with it. At Poisson 1,000 requests/s (8-token
outputs, against the fast server, client pinned to its own CPU) the schedule lag's p99 was 0.81-0.92 ms with the
collector on and 0.51-0.63 ms held off, the CPU per request within noise of each other
(tests/test_loadgen_benchmark.py, docs/measurement.md). AIPerf does the same in its timing-critical workers (freeze,
then disable).

While paused, the objects that existed before are frozen (``gc.freeze``: moved out of every generation, so the
guard's collections never walk them) and automatic collection is off. The load path keeps what it makes (records)
and frees the rest by reference counting; only cycles wait, a failed request's exception and traceback among
them. So that a long run of failures cannot grow without bound, :meth:`Paused.check` (once per request) collects
the young generation whenever :data:`GUARD_OBJECTS` more objects are tracked than at the last collection: one
pause that walks only what the run made since, every few hundred thousand requests.

Paused once per process however many generators run at once (a count); the collector's state before the first
is restored when the last ends, and what was frozen is unfrozen.
"""

from __future__ import annotations

import gc
from types import TracebackType

#: Net new tracked objects (``gc.get_count()[0]``: allocations less deallocations since the last collection)
#: after which a paused run collects once anyway: a few objects a record, so every ~200k requests.
GUARD_OBJECTS = 1_000_000

_depth = 0
_was_enabled = True


class Paused:
    """``with Paused() as paused:`` holds the collector off for the block; ``paused.check()`` is the guard."""

    __slots__ = ()

    def __enter__(self) -> Paused:
        global _depth, _was_enabled
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
            gc.freeze()
        _depth += 1
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        global _depth
        _depth -= 1
        if _depth == 0:
            gc.unfreeze()
            if _was_enabled:
                gc.enable()

    @staticmethod
    def check() -> None:
        """Collect the young generation if it has grown by :data:`GUARD_OBJECTS` since the last collection."""
        if gc.get_count()[0] > GUARD_OBJECTS:
            gc.collect(0)
