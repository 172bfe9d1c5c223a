"""A pooled percentile's own interval (batchbench.analysis.quantiles): distribution-free coverage pinned by
simulation on known distributions, its ends checked against their definition, and a p99 from too few requests
marked as such with the count it needs."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchbench.analysis.findings.slo import ObjectiveAt
from batchbench.analysis.quantiles import _cdf, needed, order_ranks, pooled
from batchbench.measures.slo import Slo


@pytest.mark.parametrize(("name", "draw", "quantile"), [
    ("exponential", lambda rng: rng.expovariate(1.0), lambda q: -math.log(1 - q)),
    ("lognormal", lambda rng: rng.lognormvariate(0.0, 1.0),
     lambda q: math.exp(1.0 * __import__("statistics").NormalDist().inv_cdf(q))),
    ("uniform", lambda rng: rng.random(), lambda q: q),
])
@pytest.mark.parametrize(("q", "n"), [(0.99, 400), (0.99, 1000), (0.5, 30), (0.5, 200), (0.9, 60)])
def test_the_interval_covers_the_true_quantile_at_least_95_percent_of_the_time(name: str, draw, quantile,  # type: ignore[no-untyped-def]
                                                                                 q: float, n: int) -> None:
    rng = random.Random(f"{name}-{q}-{n}")
    truth, trials, covered = quantile(q), 600, 0
    for _ in range(trials):
        found = pooled([draw(rng) for _ in range(n)], q)
        assert found is not None and found.bounded
        covered += found.low <= truth <= found.high  # type: ignore[operator]
    # At least 95% by construction (each tail at most 2.5%); 600 trials put 95% within about ±1.8%.
    assert covered / trials >= 0.93, covered / trials


@given(st.integers(1, 600), st.sampled_from([0.5, 0.9, 0.95, 0.99]))
def test_each_end_is_the_furthest_order_statistic_whose_tail_is_at_most_2_5_percent(n: int, q: float) -> None:
    low, high = order_ranks(n, q)
    cdf = _cdf(n, q)
    if low is not None:
        assert cdf[low - 1] <= 0.025 and (low == n or cdf[low] > 0.025)
    else:
        assert cdf[0] > 0.025
    if high is not None:
        assert 1 - cdf[high - 1] <= 0.025 and (high == 1 or 1 - cdf[high - 2] > 0.025)
    else:
        assert 1 - cdf[n - 1] > 0.025
    # Both ends exist exactly from the count needed on.
    assert (low is not None and high is not None) == (n >= needed(q))


@given(st.lists(st.floats(0.0, 10.0), min_size=1, max_size=500), st.sampled_from([0.5, 0.99]))
def test_the_value_lies_within_its_interval(values: list[float], q: float) -> None:
    found = pooled(values, q)
    assert found is not None
    assert (found.low is None or found.low <= found.value) and (found.high is None or found.value <= found.high)


def test_a_p99_from_80_requests_is_marked_too_few_with_the_count_it_needs() -> None:
    assert needed(0.99) == 368 and needed(0.5) == 6
    found = pooled([0.01 * (i + 1) for i in range(80)], 0.99)
    assert found is not None and not found.bounded and found.high is None and found.low is not None
    at = ObjectiveAt(Slo.parse("ttft_p99=2s").objectives[0], None, pooled=found)
    assert at.judgement == "too few requests"  # 0.79 s, well within 2 s, but nothing bounds it above
    assert at.text() == "ttft_p99 792 [770–?] ms (n=80) vs 2,000 ms"
    assert at.why() == "too few requests: a p99 needs 368"
