"""The one repeat protocol: repeats, the quiet-run filter, and the median with its interval.

A run on a shared machine is one sample of that machine's noise (on two vCPUs the same run's
throughput moves by tens of percent from one minute to the next), so a figure worth comparing
comes from repeats. Everything that repeats a measurement (the CLI, the suites, the report) does it
the same way:

- **Repeats, interleaved.** :class:`RepeatProtocol` schedules passes: each pass measures every
  measurement once, in order (reversed on odd passes with ``alternate``, so a slow spell of the
  machine does not always hit the same end), so a slow period hits all of them alike. After the
  first ``repeats`` passes, more passes (up to ``max_repeats``, none starting once ``budget_s`` has
  passed) measure again what is not yet ``settled``; with ``together``, all of them again while any
  is not, so a comparison stays paired.
- **Quiet runs.** Each run carries the machine's load during it
  (:class:`batchbench.machine_load.MachineLoad`); a *disturbed* run (other processes took over
  :data:`batchbench.machine_load.BUSY_SHARE` of the CPU) is reported but not used:
  :meth:`Repeats.kept` is the quiet runs where there are at least ``min_quiet`` of them, else all.
- **Median and interval.** :class:`Interval` is the median of the kept values with their
  **min-max** range (not a confidence interval: with a handful of repeats the whole range is what a
  reader can trust), written ``median (min-max)``.

A suite may reduce its kept runs differently where its docstring says why (the best of them, when
interference only ever makes a run worse); the schedule and the quiet filter are still these.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from batchbench.machine_load import MachineLoad

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Interval:
    """The median of a set of repeated values and their min-max range."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Interval | None:
        """None when there is no value."""
        if not values:
            return None
        return cls(statistics.median(values), min(values), max(values), len(values))

    def format(self, spec: str = ".1f") -> str:
        """``median (min-max)``."""
        return f"{self.median:{spec}} ({self.low:{spec}}-{self.high:{spec}})"

    def to_dict(self) -> dict[str, Any]:
        return {"median": self.median, "min": self.low, "max": self.high, "n": self.n}


def median(values: Sequence[float]) -> float:
    """The median of repeated values (ValueError when there is none)."""
    found = Interval.of(values)
    if found is None:
        raise ValueError("the median of no values")
    return found.median


@dataclass
class Repeats(Generic[T]):
    """Repeated runs of one measurement, each with the machine's load during it."""

    runs: list[T] = field(default_factory=list)
    loads: list[MachineLoad] = field(default_factory=list)

    def add(self, run: T, load: MachineLoad) -> None:
        self.runs.append(run)
        self.loads.append(load)

    def __len__(self) -> int:
        return len(self.runs)

    @property
    def quiet(self) -> list[T]:
        """The runs the machine was quiet for (or whose load could not be measured)."""
        return [run for run, load in zip(self.runs, self.loads) if not load.disturbed]

    @property
    def foreign_shares(self) -> list[float | None]:
        return [load.foreign_share for load in self.loads]

    def kept(self, min_quiet: int = 1) -> list[T]:
        """The runs a figure comes from: the quiet ones where there are at least ``min_quiet``, else all."""
        quiet = self.quiet
        return quiet if len(quiet) >= min_quiet else list(self.runs)

    def interval(self, value: Callable[[T], float], *, min_quiet: int = 1) -> Interval | None:
        """Median and min-max of ``value`` over the kept runs."""
        return Interval.of([value(run) for run in self.kept(min_quiet)])


def has_quiet_run(repeats: Repeats[Any]) -> bool:
    return bool(repeats.quiet)


@dataclass(frozen=True)
class RepeatProtocol:
    """When to measure what again (module docstring); the same for every caller."""

    #: Passes over every measurement, whatever happens.
    repeats: int = 1
    #: Passes in all at most (None: ``repeats``).
    max_repeats: int | None = None
    #: Whether a measurement's repeats so far are enough (default: it has a quiet run).
    settled: Callable[[Repeats[Any]], bool] = has_quiet_run
    #: Measure every measurement again while any is not settled (a paired comparison).
    together: bool = False
    #: Reverse the order on odd passes.
    alternate: bool = False
    #: No pass past ``repeats`` starts after this many seconds of measuring.
    budget_s: float | None = None

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"repeats must be at least 1, not {self.repeats}")
        if self.max_repeats is not None and self.max_repeats < self.repeats:
            raise ValueError(f"max_repeats ({self.max_repeats}) is below repeats ({self.repeats})")

    def schedule(self, series: Mapping[K, Repeats[Any]]) -> Iterator[tuple[K, int]]:
        """(measurement, pass) in the order to measure them, deciding each extra pass on ``series`` as it
        stands then: the caller adds each run to ``series[key]`` before asking for the next."""
        started = time.perf_counter()
        for r in range(self.max_repeats or self.repeats):
            todo = list(series)
            if r >= self.repeats:
                if self.budget_s is not None and time.perf_counter() - started > self.budget_s:
                    return
                unsettled = [key for key in todo if not self.settled(series[key])]
                if not unsettled:
                    return
                todo = todo if self.together else unsettled
            if self.alternate and r % 2 == 1:
                todo.reverse()
            for key in todo:
                yield key, r

    def run(
        self,
        keys: Sequence[K],
        measure: Callable[[K, int], T | None],
        load: Callable[[T], MachineLoad] = lambda run: run.machine,  # type: ignore[attr-defined]
    ) -> dict[K, Repeats[T]]:
        """Measure ``keys`` by this protocol; ``measure(key, pass)`` returns a run (None: nothing to keep)
        and ``load(run)`` the machine's load during it (a :class:`~batchbench.runner.RunResult`'s by default)."""
        series: dict[K, Repeats[T]] = {key: Repeats() for key in keys}
        for key, r in self.schedule(series):
            found = measure(key, r)
            if found is not None:
                series[key].add(found, load(found))
        return series
