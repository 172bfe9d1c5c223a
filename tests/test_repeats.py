"""The repeat protocol: interleaved passes, re-measuring until settled, quiet runs, median and min-max."""

from __future__ import annotations

import pytest

from batchbench.machine_load import BUSY_SHARE, MachineLoad
from batchbench.repeats import Interval, RepeatProtocol, Repeats, median

QUIET, BUSY = MachineLoad(0.01), MachineLoad(BUSY_SHARE + 0.1)


def test_interval_is_the_median_and_min_max() -> None:
    iv = Interval.of([3.0, 1.0, 10.0])
    assert iv == Interval(3.0, 1.0, 10.0, 3)
    assert iv.format(".1f") == "3.0 (1.0-10.0)"
    assert iv.to_dict() == {"median": 3.0, "min": 1.0, "max": 10.0, "n": 3}
    assert Interval.of([]) is None
    assert median([1.0, 2.0]) == 1.5
    with pytest.raises(ValueError):
        median([])


def test_kept_runs_are_the_quiet_ones_when_there_are_enough() -> None:
    reps: Repeats[float] = Repeats()
    for value, load in ((100.0, QUIET), (10.0, BUSY), (120.0, MachineLoad(None))):
        reps.add(value, load)
    assert reps.quiet == [100.0, 120.0]  # an unmeasurable load counts as quiet
    assert reps.kept(min_quiet=2) == [100.0, 120.0] and reps.kept(min_quiet=3) == [100.0, 10.0, 120.0]
    assert reps.interval(lambda v: v) == Interval(110.0, 100.0, 120.0, 2)
    assert reps.foreign_shares == [0.01, BUSY_SHARE + 0.1, None]


def test_passes_interleave_and_alternate() -> None:
    order: list[tuple[str, int]] = []

    def measure(key: str, r: int) -> float:
        order.append((key, r))
        return 1.0

    RepeatProtocol(repeats=2, alternate=True).run(["a", "b", "c"], measure, load=lambda _: QUIET)
    assert order == [("a", 0), ("b", 0), ("c", 0), ("c", 1), ("b", 1), ("a", 1)]


def test_unsettled_measurements_are_measured_again_up_to_the_limit() -> None:
    loads = {"a": [BUSY, BUSY, BUSY, QUIET], "b": [QUIET] * 4}
    order: list[tuple[str, int]] = []

    def measure(key: str, r: int) -> tuple[str, MachineLoad]:
        order.append((key, r))
        return key, loads[key][r]

    series = RepeatProtocol(repeats=2, max_repeats=4).run(["a", "b"], measure, load=lambda run: run[1])
    assert order == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("a", 3)]
    assert len(series["a"].quiet) == 1 and len(series["b"]) == 2
    # Together: a paired comparison is measured again as a pair, and stops once both are settled.
    order.clear()
    RepeatProtocol(repeats=2, max_repeats=4, together=True).run(["a", "b"], measure, load=lambda run: run[1])
    assert order == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2), ("a", 3), ("b", 3)]


def test_a_spent_budget_stops_extra_passes_and_none_is_not_kept() -> None:
    calls: list[int] = []

    def measure(key: str, r: int) -> float | None:
        calls.append(r)
        return None if r == 0 else 1.0

    series = RepeatProtocol(repeats=1, max_repeats=5, budget_s=0.0).run(["a"], measure, load=lambda _: BUSY)
    assert calls == [0] and len(series["a"]) == 0
    with pytest.raises(ValueError):
        RepeatProtocol(repeats=0)
    with pytest.raises(ValueError):
        RepeatProtocol(repeats=3, max_repeats=2)
