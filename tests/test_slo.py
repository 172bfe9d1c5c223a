"""SLO parsing and checking: what ``--slo`` accepts, refuses, and how a run is judged against it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchbench.core.records import RequestRecord
from batchbench.measures.metrics import summarize
from batchbench.measures.slo import Slo, parse_duration


def record(i: int, ttft: float, gap: float, tokens: int = 4) -> RequestRecord:
    times = [ttft + k * gap for k in range(tokens)]
    return RequestRecord(request_id=f"r{i}", prompt_len=8, max_tokens=tokens, scheduled_s=0.0, sent_s=0.0,
                         done_s=times[-1], chunk_times=times, chunk_tokens=[1] * tokens, completion_tokens=tokens,
                         ok=True)


def test_parse_reads_each_objective_and_its_unit() -> None:
    slo = Slo.parse("ttft_p99=200ms, tpot_p50=0.05s,e2e_max=2s")
    assert [(o.metric, o.stat, o.limit_s) for o in slo.objectives] == [
        ("ttft", "p99", 0.2), ("tpot", "p50", 0.05), ("e2e", "max", 2.0)]
    assert str(slo) == "ttft_p99<=200ms,tpot_p50<=50ms,e2e_max<=2s"


@pytest.mark.parametrize(("text", "words"), [
    ("", "expected METRIC_STAT=LIMIT"),
    ("ttft_p99", "expected METRIC_STAT=LIMIT"),
    ("ttft_p98=200ms", "STAT one of"),
    ("latency_p99=200ms", "METRIC one of"),
    ("ttft_p99=200", "with a unit"),
    ("ttft_p99=0ms", "more than 0"),
    ("ttft_p99=200ms,,tpot_p99=1s", "expected METRIC_STAT=LIMIT"),
    ("ttft_p99=1s,ttft_p99=2s", "given twice"),
])
def test_parse_refuses_with_the_users_text(text: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        Slo.parse(text)


@given(st.floats(min_value=1e-3, max_value=1e4, allow_nan=False), st.sampled_from(["ms", "s", "us"]))
def test_duration_round_trip(value: float, unit: str) -> None:
    scale = {"ms": 1e-3, "s": 1.0, "us": 1e-6}[unit]
    assert parse_duration(f"{value!r}{unit}") == pytest.approx(value * scale)


@given(st.lists(st.floats(min_value=0.001, max_value=2.0), min_size=1, max_size=40),
       st.floats(min_value=0.001, max_value=2.0))
def test_met_exactly_when_the_statistic_is_within_the_limit(ttfts: list[float], limit: float) -> None:
    summary = summarize([record(i, t, 0.01) for i, t in enumerate(ttfts)], duration_s=10.0)
    verdict = Slo.parse(f"ttft_max={limit!r}s").check(summary)
    assert verdict.met == (max(ttfts) <= limit)
    assert verdict.values["ttft_max"] == max(ttfts)
    assert bool(verdict.failed) != verdict.met


def test_a_metric_without_samples_fails_its_objective() -> None:
    one_token = [record(0, 0.1, 0.01, tokens=1)]  # no TPOT: one output token
    verdict = Slo.parse("tpot_p99=50ms,ttft_p99=1s").check(summarize(one_token, duration_s=1.0))
    assert not verdict.met and verdict.failed == ("tpot_p99=no samples>50ms",)


def test_request_limits_are_the_tightest_per_metric() -> None:
    assert Slo.parse("ttft_p99=300ms,ttft_p50=100ms,e2e_p99=5s").request_limits() == (0.1, None)
    assert Slo.parse("tpot_p99=40ms").request_limits() == (None, 0.04)


@given(st.lists(st.tuples(st.floats(min_value=0.001, max_value=1.0), st.integers(0, 6)), min_size=1, max_size=30),
       st.floats(min_value=0.001, max_value=2.0))
def test_a_ttfo_objective_judges_the_answers_first_token_after_the_reasoning(
        streams: list[tuple[float, int]], limit: float) -> None:
    """``ttfo_*``: the first token of the answer, after a chat stream's reasoning tokens; TTFT is the first token
    of any kind, so a run can meet a TTFT objective and fail the TTFO one at the same limit."""
    records = []
    for i, (ttft, reasoning) in enumerate(streams):
        r = record(i, ttft, 0.05, tokens=reasoning + 2)
        r.reasoning_tokens = reasoning or None
        r.first_output_s = r.chunk_times[reasoning]
        records.append(r)
    summary = summarize(records, duration_s=10.0)
    ttfos = [t + 0.05 * k for t, k in streams]
    verdict = Slo.parse(f"ttfo_max={limit!r}s,ttft_max={limit!r}s").check(summary)
    assert verdict.values["ttfo_max"] == pytest.approx(max(ttfos))
    assert ("ttfo_max" in " ".join(verdict.failed)) == (max(ttfos) > limit)
    assert ("ttft_max" in " ".join(verdict.failed)) == (max(t for t, _ in streams) > limit)
