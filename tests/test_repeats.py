"""The repeat protocol: interleaved passes, re-measuring until settled, quiet runs, the t-interval."""

from __future__ import annotations

import math
import random
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchbench.analysis.repeats import (
    Estimate,
    RepeatProtocol,
    Repeats,
    median,
    paired,
    precise,
    t_quantile,
    why_no_estimate,
)
from batchbench.core import codec
from batchbench.measures.machine_load import BUSY_SHARE, MachineLoad
from batchbench.pytest_plugin import IntervalChecks

QUIET, BUSY = MachineLoad(0.01), MachineLoad(BUSY_SHARE + 0.1)
positive = st.floats(min_value=1e-3, max_value=1e6, allow_nan=False)


def test_t_quantiles_are_the_tables_and_fall_towards_the_normal() -> None:
    assert t_quantile(1) == 12.7062 and t_quantile(4) == 2.7764 and t_quantile(30) == 2.0423
    assert t_quantile(math.inf) == 1.959964
    # Between rows, by 1/df: df=50 is 2.0086 to four decimals; beyond the table it approaches 1.96.
    assert abs(t_quantile(50) - 2.0086) < 5e-4 and 1.96 < t_quantile(1000) < 1.9625
    with pytest.raises(ValueError, match="at least one degree of freedom"):
        t_quantile(0.5)


@given(st.floats(min_value=1, max_value=1e6), st.floats(min_value=1, max_value=1e6))
def test_a_t_quantile_never_grows_with_more_degrees_of_freedom(a: float, b: float) -> None:
    low, high = sorted((a, b))
    assert t_quantile(high) <= t_quantile(low)


def test_an_estimate_is_the_mean_with_its_t_interval_on_the_log_scale_for_a_positive_figure() -> None:
    found = Estimate.of([3.0, 1.0, 10.0])
    mean, sd = 14 / 3, statistics.stdev([3.0, 1.0, 10.0])
    assert found is not None and (found.value, found.n, found.method) == (pytest.approx(mean), 3, "t-log")
    spread = 4.3027 * sd / mean / math.sqrt(3)
    assert (found.low, found.high) == (pytest.approx(mean * math.exp(-spread)), pytest.approx(mean * math.exp(spread)))
    assert 0 < found.low < mean - 1  # where mean ± half would have crossed 0 (and been clamped there)
    signed = Estimate.of([-3.0, 1.0, 10.0])
    assert signed is not None and signed.method == "t"
    assert signed.low == pytest.approx(8 / 3 - 4.3027 * signed.sd / math.sqrt(3))
    assert Estimate.of([0.0, 0.0]) == Estimate(0.0, 0.0, 0.0, 2, "t", 0.0)
    assert codec.encode(found) == {"value": found.value, "low": found.low, "high": found.high, "n": 3,
                                   "method": "t-log", "sd": found.sd, "confidence": 0.95}
    assert codec.decode(Estimate, codec.encode(found)) == found
    one = Estimate.of([5.0])
    assert one == Estimate(5.0, None, None, 1) and one.relative_half_width is None and not one.precise(1.0)
    assert one.format(str) == "5.0 (n=1)" and one.describe() == "n=1, no interval"
    assert Estimate.of([]) is None
    assert median([1.0, 2.0]) == 1.5
    with pytest.raises(ValueError, match="the median of no values"):
        median([])
    with pytest.raises(ValueError, match="low <= value <= high"):
        Estimate(1.0, 2.0, 3.0, 3)


@given(st.lists(positive, min_size=2, max_size=20))
def test_an_interval_holds_its_mean_and_narrows_as_the_same_values_repeat(values: list[float]) -> None:
    found, twice = Estimate.of(values), Estimate.of(values * 2)
    assert found is not None and twice is not None
    assert found.low <= found.value <= found.high and found.n == len(values)
    assert twice.value == pytest.approx(found.value)
    assert twice.high - twice.low <= (found.high - found.low) * (1 + 1e-9)


def test_about_95_of_intervals_cover_the_true_mean() -> None:
    """The interval's promise, checked by simulation (seeded): 2000 samples of 4 normal repeats."""
    rng = random.Random(11)
    covered = 0
    for _ in range(2000):
        found = Estimate.of([rng.gauss(100, 10) for _ in range(4)])
        covered += found.low <= 100 <= found.high  # type: ignore[union-attr,operator]
    assert 0.93 <= covered / 2000 <= 0.97


@given(st.lists(positive, min_size=2, max_size=8), st.lists(positive, min_size=2, max_size=8))
def test_a_ratio_is_the_ratio_of_the_means_and_its_interval_holds_it(a: list[float], b: list[float]) -> None:
    ea, eb = Estimate.of(a), Estimate.of(b)
    r = ea.ratio(eb)  # type: ignore[union-attr,arg-type]
    assert r is not None and r.method == "t-ratio" and r.n == min(len(a), len(b))
    assert r.value == pytest.approx(ea.value / eb.value)  # type: ignore[union-attr]
    assert r.low <= r.value * (1 + 1e-9) and r.value <= r.high * (1 + 1e-9)
    assert r.differs_from_one == (r.low > 1 or r.high < 1)


def test_a_ratio_tells_apart_what_differs_and_not_what_overlaps() -> None:
    assert Estimate.of([140, 150, 160]).ratio(Estimate.of([100, 105, 110])).differs_from_one  # type: ignore
    same = Estimate.of([100, 110, 120]).ratio(Estimate.of([95, 105, 115]))  # type: ignore[union-attr,arg-type]
    assert same is not None and same.differs_from_one is False
    assert same.largest_undetected == pytest.approx(max(same.high - 1, 1 - same.low))
    assert Estimate.of([2.0]).ratio(Estimate.of([1.0])) == Estimate(2.0, None, None, 1, "t-ratio")  # type: ignore
    assert Estimate.of([1.0, 2.0]).ratio(Estimate.of([0.0, 0.0])) is None  # type: ignore[union-attr,arg-type]


@given(st.lists(st.tuples(positive, positive), min_size=2, max_size=8), st.floats(min_value=0.5, max_value=2.0))
def test_a_paired_ratio_is_the_ratio_of_the_means_and_a_shared_drift_does_not_widen_it(
        pairs: list[tuple[float, float]], drift: float) -> None:
    r = Estimate.paired_ratio(pairs)
    assert r is not None and r.method == "t-ratio-paired" and r.n == len(pairs)
    assert r.value == pytest.approx(statistics.fmean(a for a, _ in pairs) / statistics.fmean(b for _, b in pairs))
    assert r.low <= r.value * (1 + 1e-9) and r.value <= r.high * (1 + 1e-9)
    # Both runs of one pair slowed alike: the same ratio, no wider (every pair at one ratio is exact).
    same = Estimate.paired_ratio([(2.0 * b * drift ** i, b * drift ** i) for i, (_, b) in enumerate(pairs)])
    assert same is not None and same.value == pytest.approx(2.0) and same.high - same.low == pytest.approx(0, abs=1e-9)
    assert r.inverse().value == pytest.approx(1 / r.value) and r.inverse().method == "t-ratio-paired"


def test_precise_settles_once_the_interval_is_narrow_enough() -> None:
    settled = precise(lambda v: v, 0.05)
    reps: Repeats[float] = Repeats()
    for value in (100.0, 120.0):
        reps.add(value, QUIET)
    assert not settled(reps)
    for value in (110.0, 110.0, 111.0, 109.0, 110.0, 110.0):
        reps.add(value, QUIET)
    assert settled(reps)
    with pytest.raises(ValueError, match="a precision target is a share above 0"):
        precise(lambda v: v, 0.0)


def test_kept_runs_are_the_quiet_ones_when_there_are_enough() -> None:
    reps: Repeats[float] = Repeats()
    for value, load in ((100.0, QUIET), (10.0, BUSY), (120.0, MachineLoad(None))):
        reps.add(value, load)
    assert reps.quiet == [100.0, 120.0]  # an unmeasurable load counts as quiet
    assert reps.kept(min_quiet=2) == [100.0, 120.0] and reps.kept(min_quiet=3) == [100.0, 10.0, 120.0]
    assert reps.estimate(lambda v: v) == Estimate.of([100.0, 120.0])
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


def test_extra_passes_measure_only_what_the_focus_names() -> None:
    order: list[tuple[str, int]] = []

    def measure(key: str, r: int) -> tuple[str, MachineLoad]:
        order.append((key, r))
        return key, BUSY  # never settled

    focused = RepeatProtocol(repeats=1, max_repeats=3, focus=lambda series: {"b"})
    focused.run(["a", "b", "c"], measure, load=lambda run: run[1])
    assert order == [("a", 0), ("b", 0), ("c", 0), ("b", 1), ("b", 2)]


def test_a_spent_budget_stops_extra_passes_and_none_is_not_kept() -> None:
    calls: list[int] = []

    def measure(key: str, r: int) -> float | None:
        calls.append(r)
        return None if r == 0 else 1.0

    series = RepeatProtocol(repeats=1, max_repeats=5, budget_s=0.0).run(["a"], measure, load=lambda _: BUSY)
    assert calls == [0] and len(series["a"]) == 0
    with pytest.raises(ValueError, match="repeats must be at least 1"):
        RepeatProtocol(repeats=0)
    with pytest.raises(ValueError, match=r"max_repeats \(2\) is below repeats \(3\)"):
        RepeatProtocol(repeats=3, max_repeats=2)


def _series(*loads: MachineLoad, value: float | None = 1.0) -> Repeats[float | None]:
    repeats: Repeats[float | None] = Repeats()
    for load in loads:
        repeats.add(value, load)
    return repeats


def test_a_claim_without_an_estimate_says_why_and_the_undecided_line_carries_it() -> None:
    a, b = _series(BUSY, QUIET, BUSY), _series(QUIET, BUSY, MachineLoad(0.9))
    assert paired(a, b, lambda v: v) is None
    said = why_no_estimate((a, b))
    assert said == ("no estimate: 3 of 3 passes had a disturbed run (other processes took up to 90% of the "
                    "machine's CPU)")
    checks = IntervalChecks()
    assert checks.check("cached over uncached", None, 0.5, "below", of=(a, b)) is None
    assert checks.undecided == [f"cached over uncached: {said}, expected below 0.5"]
    # One quiet pass whose figure is missing; then every pass quiet and none with the figure; then nothing.
    missing: Repeats[float | None] = Repeats()
    missing.add(1.0, BUSY)
    missing.add(None, QUIET)
    assert paired(missing, _series(QUIET, QUIET), lambda v: v) is None
    some = why_no_estimate((missing, _series(QUIET, QUIET)))
    assert some.startswith("no estimate: 1 of 2 passes") and some.endswith("; the quiet passes lack the figure")
    assert why_no_estimate((_series(QUIET, QUIET, value=None),)) == (
        "no estimate: the figure is missing (or not positive) in all 2 quiet passes")
    assert why_no_estimate((Repeats(),)) == "no estimate: nothing was measured"
