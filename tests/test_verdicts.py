"""The function behind every suite's verdict, tested directly: ``decide()`` on every position of an interval against
its limit, and ``IntervalChecks.finish()``'s fail / skip / pass with every claim counted for the session's summary."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchbench.analysis.repeats import Estimate, decide
from batchbench.pytest_plugin import CLAIMS, Claim, IntervalChecks, claims_summary

finite = st.floats(-1e6, 1e6, allow_nan=False)


@st.composite
def intervals(draw: st.DrawFn) -> Estimate:
    low, high = sorted((draw(finite), draw(finite)))
    return Estimate(draw(st.floats(low, high)), low, high, n=draw(st.integers(2, 10)))


@given(intervals(), finite)
def test_above_holds_only_when_the_whole_interval_is_above(found: Estimate, limit: float) -> None:
    assert found.low is not None and found.high is not None
    verdict = decide(found, limit, "above")
    assert verdict is (True if found.low > limit else False if found.high < limit else None)


@given(intervals(), finite)
def test_below_holds_only_when_the_whole_interval_is_below(found: Estimate, limit: float) -> None:
    assert found.low is not None and found.high is not None
    verdict = decide(found, limit, "below")
    assert verdict is (True if found.high < limit else False if found.low > limit else None)


@given(intervals(), finite)
def test_above_and_below_are_mirror_images(found: Estimate, limit: float) -> None:
    mirrored = Estimate(-found.value, -found.high, -found.low, found.n)  # type: ignore[operator]
    assert decide(found, limit, "above") is decide(mirrored, -limit, "below")


@pytest.mark.parametrize("found", [None, Estimate(2.0, None, None, 1)])
def test_no_interval_decides_nothing_however_far_the_value(found: Estimate | None) -> None:
    assert decide(found, 0.0, "above") is None and decide(found, 1e9, "below") is None


@pytest.fixture
def claims() -> Iterator[list[Claim]]:
    saved = list(CLAIMS)
    CLAIMS.clear()
    yield CLAIMS
    CLAIMS[:] = saved


HOLDS, FAILS, STRADDLES = Estimate(2.0, 1.5, 2.5, 3), Estimate(0.5, 0.4, 0.6, 3), Estimate(1.0, 0.5, 1.5, 3)


@given(st.lists(st.sampled_from(["holds", "fails", "straddles", "not made"]), max_size=6))
def test_finish_fails_on_any_failed_claim_else_skips_on_any_undecided_else_passes(kinds: list[str]) -> None:
    checks = IntervalChecks()
    for i, kind in enumerate(kinds):
        if kind == "not made":
            checks.not_made(f"claim {i}", "GPU only")
        else:
            found = {"holds": HOLDS, "fails": FAILS, "straddles": STRADDLES}[kind]
            checks.check(f"claim {i}", found, 1.0, "above")
    before = len(CLAIMS)
    try:
        if "fails" in kinds:
            with pytest.raises(pytest.fail.Exception, match="expected above 1"):
                checks.finish("context")
        elif "straddles" in kinds:
            with pytest.raises(pytest.skip.Exception, match="undecided, the interval straddles the limit"):
                checks.finish("context")
        else:
            checks.finish("context")  # held claims and claims not made here: the test passes
        recorded = CLAIMS[before:]
        assert sorted(c.outcome for c in recorded) == sorted(
            {"holds": "held", "fails": "failed", "straddles": "undecided", "not made": "not made"}[k] for k in kinds)
    finally:
        del CLAIMS[before:]


def test_the_summary_counts_each_outcome_and_names_the_undecided_and_unmade(claims: list[Claim]) -> None:
    checks = IntervalChecks()
    checks.check("occupancy", HOLDS, 1.0, "above")
    checks.check("TTFT ratio", STRADDLES, 1.0, "below")
    checks.not_made("throughput", "GPU only")
    with pytest.raises(pytest.skip.Exception):
        checks.finish()
    lines = claims_summary(claims)
    assert lines[0] == ("claims: 2 made, 1 held, 0 failed, 1 undecided (interval straddles its limit), 1 not made "
                        "on this hardware")
    assert any(line.startswith("  undecided: ") and "TTFT ratio" in line for line in lines)
    assert any(line.startswith("  not made: ") and "throughput: GPU only" in line for line in lines)
    assert claims_summary([]) == []
