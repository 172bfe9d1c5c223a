"""The capacity search (:mod:`batchbench.analysis.capacity`): exact on monotone models, logarithmic, sane under
noise."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchbench.analysis.capacity import Search, Trial, search


def _threshold(limit: float, calls: list[float]) -> object:
    """A monotone model: a level passes exactly when it is at most ``limit``; records every call."""
    def measure(level: float) -> Trial:
        calls.append(level)
        met = level <= limit
        return Trial(met, () if met else (f"ttft_p99={level:g}s>{limit:g}s",), goodput=level if met else 0.0)
    return measure


@given(limit=st.integers(0, 2000), start=st.integers(1, 64), max_level=st.integers(64, 1024))
def test_a_monotone_model_gives_exactly_the_largest_passing_concurrency_in_logarithmic_steps(
        limit: int, start: int, max_level: int) -> None:
    calls: list[float] = []
    result = search(_threshold(limit, calls), start=start, max_level=max_level)
    if limit < 1:
        assert result.capacity is None and result.first_failing == 1
    elif limit >= max_level:
        assert result.capacity == max_level and result.first_failing is None and result.reached_max
    else:
        assert result.capacity == limit and result.first_failing == limit + 1
        assert result.failed == (f"ttft_p99={limit + 1}s>{limit}s",)
        assert result.goodput == limit
    assert len(calls) == len(set(calls)), "a level was measured twice"
    assert len(calls) <= 2 * math.ceil(math.log2(max_level)) + 3


@given(limit=st.floats(0.05, 250.0), start=st.floats(0.5, 8.0), tolerance=st.sampled_from([0.01, 0.05, 0.2]))
def test_a_monotone_model_gives_the_largest_passing_rate_within_the_tolerance(
        limit: float, start: float, tolerance: float) -> None:
    calls: list[float] = []
    result = search(_threshold(limit, calls), start=start, max_level=256.0, min_level=0.01, integer=False,
                    tolerance=tolerance)
    assert result.capacity is not None and result.first_failing is not None
    assert result.capacity <= limit < result.first_failing <= result.capacity * (1 + tolerance)
    assert len(calls) <= math.ceil(math.log2(256 / 0.01)) + math.ceil(math.log2(1 / tolerance)) + 3


@given(seed=st.integers(0, 10_000), start=st.integers(1, 32))
def test_under_noise_the_answer_is_still_a_measured_boundary(seed: int, start: int) -> None:
    rng = random.Random(seed)
    verdicts: dict[float, bool] = {}

    def noisy(level: float) -> Trial:  # a non-monotone curve: each level passes or not at random
        verdicts.setdefault(level, rng.random() < 0.6)
        return Trial(verdicts[level], () if verdicts[level] else ("e2e_p99=x>y",))

    result = search(noisy, start=start, max_level=256)
    measured = {p.level: p.met for p in result.points}
    if result.capacity is not None:
        assert measured[result.capacity]
    if result.first_failing is not None:
        assert not measured[result.first_failing]
    if result.capacity is not None and result.first_failing is not None:
        assert result.first_failing == result.capacity + 1
    elif result.capacity is None:
        assert result.first_failing == 1
    else:
        assert result.capacity == 256


def test_a_level_passes_only_if_every_repeat_meets_the_slo_and_one_miss_settles_it() -> None:
    calls: list[float] = []

    def flaky_above_5(level: float) -> Trial:
        calls.append(level)
        # Levels above 5 miss on their second repeat only: the median of three would pass them.
        met = level <= 5 or calls.count(level) != 2
        return Trial(met, () if met else ("tpot_p99=60ms>50ms",), goodput=float(level))

    result = search(flaky_above_5, start=4, max_level=64, repeats=3)
    assert result.capacity == 5 and result.first_failing == 6 and result.failed == ("tpot_p99=60ms>50ms",)
    assert calls.count(5) == 3 and calls.count(6) == 2  # the miss on repeat 2 settles level 6
    assert [p.level for p in result.points] == [4, 8, 6, 5]


def test_the_search_refuses_inconsistent_bounds_and_out_of_turn_measurements() -> None:
    with pytest.raises(ValueError, match="start"):
        Search(start=8, max_level=4)
    with pytest.raises(ValueError, match="whole-number"):
        Search(start=1.5, max_level=4)
    s = Search(start=2, max_level=8)
    with pytest.raises(ValueError, match="expected a measurement at 2"):
        s.add(3, Trial(True))
