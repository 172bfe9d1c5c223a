"""The capacity search: the highest load level (concurrency, or request rate) at which a run meets an SLO.

Pure and engine-free: :class:`Search` says which level to measure next and is told each outcome, so the
CLI can drive it from its event loop and the tests from a closed-form latency model.

- **Bracketing.** From ``start``, the level doubles while it passes, up to ``max_level``; if ``start``
  fails, it halves while it fails, down to ``min_level``. Either way two levels then bracket the
  capacity: ``lo`` passed and ``hi`` failed.
- **Bisection** between them: over whole numbers for concurrency (until ``hi = lo + 1``, so the
  answer is exact), or to a relative ``tolerance`` for rates (until ``hi - lo <= tolerance * lo``).
  At most about ``2 * log2(max_level / min_level)`` levels are measured.
- **Repeats.** Each level is measured up to ``repeats`` times and passes only if **every** repeat met
  the SLO: a capacity is a promise, so a level that missed once is not one to plan on. The first
  failing repeat settles the level (the remaining repeats would not change the verdict), and the
  goodput reported for a level is the median over its repeats.
- **Memoised.** A level is never measured twice; every measured level is in the result, in order.
- **Noise.** The search assumes a higher level is never easier to serve. When measurements break that
  (a noisy level), the answer is still a level that passed every repeat with the next level at the
  search's resolution having failed, i.e. a real boundary; but levels above a failure are never
  visited, so a higher passing level past a failure would not be found. That is the conservative
  reading of a noisy curve.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


class Outcome(Protocol):
    """What one measured run says about the SLO (:class:`Trial`, or anything shaped like it)."""

    @property
    def met(self) -> bool: ...

    @property
    def failed(self) -> tuple[str, ...]: ...

    @property
    def goodput(self) -> float | None: ...


@dataclass(frozen=True)
class Trial:
    """One run's verdict: met or not, the objectives that failed (``ttft_p99=0.31s>200ms``), goodput."""

    met: bool
    failed: tuple[str, ...] = ()
    goodput: float | None = None


@dataclass(frozen=True)
class LevelOutcomes:
    """One measured level and its repeats' outcomes, in the order they were measured."""

    level: float
    outcomes: tuple[Outcome, ...]

    @property
    def met(self) -> bool:
        """Every repeat met the SLO."""
        return all(o.met for o in self.outcomes)

    @property
    def failed(self) -> tuple[str, ...]:
        """The objectives the first failing repeat missed; empty when the level passed."""
        return next((o.failed for o in self.outcomes if not o.met), ())

    @property
    def goodput(self) -> float | None:
        """Median goodput over the repeats that report one."""
        values = [o.goodput for o in self.outcomes if o.goodput is not None]
        return statistics.median(values) if values else None

    def to_dict(self) -> dict[str, Any]:
        return {"level": self.level, "met": self.met, "failed": list(self.failed), "goodput": self.goodput,
                "repeats": [{"met": o.met, "failed": list(o.failed), "goodput": o.goodput} for o in self.outcomes]}


@dataclass(frozen=True)
class CapacityResult:
    """The capacity found, the level above it that failed and why, and every level measured."""

    #: The highest level that passed (None: even the lowest level tried failed).
    capacity: float | None
    #: Median goodput (requests/s within the SLO) at the capacity.
    goodput: float | None
    #: The lowest failing level above the capacity (None: nothing failed up to ``max_level``).
    first_failing: float | None
    #: The objectives that level missed, e.g. ``("ttft_p99=0.31s>200ms",)``.
    failed: tuple[str, ...]
    #: Every level measured, in the order measured.
    points: tuple[LevelOutcomes, ...]

    @property
    def reached_max(self) -> bool:
        """The search stopped at its ceiling: the true capacity may be higher."""
        return self.capacity is not None and self.first_failing is None

    def to_dict(self) -> dict[str, Any]:
        return {"capacity": self.capacity, "goodput": self.goodput, "first_failing": self.first_failing,
                "failed": list(self.failed), "reached_max": self.reached_max,
                "points": [p.to_dict() for p in self.points]}


@dataclass
class Search:
    """Bracketing then bisection; drive it with :meth:`next_level` / :meth:`add`, or use :func:`search`."""

    start: float
    max_level: float
    #: Whole-number levels (concurrency) or real ones (rates).
    integer: bool = True
    min_level: float = 1
    #: Rates: stop when the bracket is within this fraction of the passing level.
    tolerance: float = 0.1
    repeats: int = 1
    _points: dict[float, list[Outcome]] = field(default_factory=dict, init=False)
    _order: list[float] = field(default_factory=list, init=False)
    _lo: float | None = field(default=None, init=False)
    _hi: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not 0 < self.min_level <= self.start <= self.max_level:
            raise ValueError(f"capacity search needs 0 < min ({self.min_level:g}) <= start ({self.start:g}) "
                             f"<= max ({self.max_level:g})")
        if self.integer and not all(float(v).is_integer() for v in (self.min_level, self.start, self.max_level)):
            raise ValueError("a whole-number search needs whole-number min, start and max")
        if not self.integer and not 0 < self.tolerance < 1:
            raise ValueError(f"tolerance must be between 0 and 1, not {self.tolerance:g}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be at least 1, not {self.repeats}")

    def next_level(self) -> float | None:
        """The level to measure next (again, while its repeats are not settled); None when the search is done."""
        if self._order and not self._settled(self._order[-1]):
            return self._order[-1]
        candidate = self._candidate()
        if candidate is not None and candidate in self._points:  # cannot happen with a consistent bracket
            raise AssertionError(f"capacity search would measure {candidate:g} again")
        return candidate

    def add(self, level: float, outcome: Outcome) -> None:
        """One repeat's outcome at ``level`` (the level :meth:`next_level` returned)."""
        if level != self.next_level():
            raise ValueError(f"expected a measurement at {self.next_level()}, not at {level:g}")
        if level not in self._points:
            self._points[level] = []
            self._order.append(level)
        self._points[level].append(outcome)
        if self._settled(level):
            point = self._point(level)
            if point.met:
                self._lo = level if self._lo is None else max(self._lo, level)
            else:
                self._hi = level if self._hi is None else min(self._hi, level)

    def result(self) -> CapacityResult:
        points = tuple(self._point(level) for level in self._order)
        at = self._point(self._lo) if self._lo is not None else None
        failing = self._point(self._hi) if self._hi is not None else None
        return CapacityResult(capacity=self._lo, goodput=at.goodput if at else None, first_failing=self._hi,
                              failed=failing.failed if failing else (), points=points)

    def _point(self, level: float) -> LevelOutcomes:
        return LevelOutcomes(level, tuple(self._points[level]))

    def _settled(self, level: float) -> bool:
        outcomes = self._points.get(level, [])
        return len(outcomes) >= self.repeats or any(not o.met for o in outcomes)

    def _candidate(self) -> float | None:
        lo, hi = self._lo, self._hi
        if lo is None and hi is None:
            return self._level(self.start)
        if hi is None:  # bracketing up
            assert lo is not None
            return None if lo >= self.max_level else self._level(min(lo * 2, self.max_level))
        if lo is None:  # bracketing down
            down = math.floor(hi / 2) if self.integer else hi / 2
            return None if hi <= self.min_level else self._level(max(down, self.min_level))
        if self.integer:
            return None if hi - lo <= 1 else self._level((lo + hi) // 2)
        return None if hi - lo <= self.tolerance * lo else self._level((lo + hi) / 2)

    def _level(self, value: float) -> float:
        return int(value) if self.integer else float(value)


def search(measure: Callable[[float], Outcome], **options: Any) -> CapacityResult:
    """Run a :class:`Search` (``options`` are its fields) with ``measure(level)`` giving one repeat's outcome."""
    s = Search(**options)
    while (level := s.next_level()) is not None:
        s.add(level, measure(level))
    return s.result()
