"""Run validity: which runs' figures may be used, and which percentiles their samples support."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchbench.slo import Slo
from batchbench.validity import (
    MAX_SCHEDULE_LAG_S,
    STANDARD_PERCENTILES,
    check_run,
    percentile_note,
    samples_needed,
    stat_percentile,
    supported_percentile,
    supports,
)
from tests.synthetic_runs import RunSpec, document


def test_the_rule_asks_two_samples_beyond_the_percentile() -> None:
    assert [samples_needed(q) for q in (50, 90, 95, 99, 99.9)] == [4, 20, 40, 200, 2000]
    assert supports(199, 99) is False and supports(200, 99) is True
    assert supports(1, 100)  # the maximum needs one sample


@given(st.integers(min_value=0, max_value=10**6), st.integers(min_value=0, max_value=999))
def test_support_is_exactly_two_expected_samples_in_the_tail(n: int, tenths: int) -> None:
    q = tenths / 10  # a percentile written with one decimal, as users write them
    # n x (1 - q/100) >= 2, in integers: n x (1000 - 10q) >= 2000.
    assert supports(n, q) == (n * (1000 - tenths) >= 2000)
    assert supports(n + 1, q) or not supports(n, q)  # more samples never support less


@given(st.integers(min_value=0, max_value=100_000))
def test_the_supported_percentile_is_the_highest_standard_one(n: int) -> None:
    best = supported_percentile(n)
    if best is None:
        assert not any(supports(n, q) for q in STANDARD_PERCENTILES)
    else:
        assert supports(n, best)
        assert not any(supports(n, q) for q in STANDARD_PERCENTILES if q > best)
    for q in STANDARD_PERCENTILES:
        assert (percentile_note("ttft", q, n) is None) == supports(n, q)


def test_the_note_names_what_is_needed_and_what_the_samples_support() -> None:
    assert percentile_note("ttft", 99, 64) == (
        "ttft p99 of 64 requests is near their maximum: p99 needs >= 200 (64 support p95)")
    assert "support no percentile" in (percentile_note("ttft", 99, 3) or "")
    assert stat_percentile("p99") == 99.0 and stat_percentile("max") is None
    with pytest.raises(ValueError):
        samples_needed(100)


def test_a_clean_run_is_valid_and_says_its_warm_up_was_excluded() -> None:
    found = check_run(document(RunSpec(requests=240)))
    assert found.valid and found.slo_valid and found.reasons == ()
    assert found.warm_up == "excluded"
    assert found.samples["ttft"] == 240 and found.supported_percentiles["ttft"] == 99.0
    assert found.percentile_notes == ()


def test_failed_requests_invalidate_the_run_with_their_count_and_kinds() -> None:
    found = check_run(document(RunSpec(requests=100, failed=3)))
    assert not found.valid
    assert found.reasons == ("3 of 100 requests failed (timeout 3)",)
    assert found.failures == {"timeout": 3}


def test_schedule_lag_counts_only_where_there_is_a_schedule() -> None:
    late = MAX_SCHEDULE_LAG_S * 5
    poisson = check_run(document(RunSpec(arrival="poisson", lag=late)))
    assert not poisson.valid and "poisson sends lagged their schedule: p99 50ms > 10ms" in poisson.reasons[0]
    assert check_run(document(RunSpec(arrival="poisson", lag=MAX_SCHEDULE_LAG_S / 2))).valid
    # A closed loop's send waits for a free slot on purpose; offline sends everything at once.
    assert check_run(document(RunSpec(arrival="closed", lag=late))).valid
    assert check_run(document(RunSpec(arrival="offline", lag=late))).valid


def test_a_saturated_client_or_a_busy_machine_invalidates_the_run() -> None:
    client = check_run(document(RunSpec(client_busy=0.9)))
    assert not client.valid and "event loop was busy 90%" in client.reasons[0]
    machine = check_run(document(RunSpec(foreign=0.3)))
    assert not machine.valid and "took 30% of the machine's CPU" in machine.reasons[0]
    unmeasured = check_run(document(RunSpec(foreign=None)))
    assert unmeasured.valid and any("not measured" in n for n in unmeasured.notes)


def test_warm_up_recorded_or_not() -> None:
    cold = check_run(document(RunSpec(labels={"warmed_up": False})))
    assert not cold.valid and cold.warm_up == "included" and "not warmed up" in cold.reasons[0]
    doc = document(RunSpec())
    doc.header = dataclasses.replace(doc.header, labels={k: v for k, v in doc.header.labels.items()
                                                         if k != "warmed_up"})
    unknown = check_run(doc)
    assert unknown.valid and unknown.warm_up == "unknown" and any("warmed_up" in n for n in unknown.notes)


def test_runs_that_did_not_finish_are_invalid() -> None:
    partial = check_run(document(RunSpec(status="partial")))
    assert not partial.valid and "partial" in partial.reasons[0]
    doc = document(RunSpec())
    doc.footer = dataclasses.replace(doc.footer, status="interrupted", error="KeyboardInterrupt: ")
    interrupted = check_run(doc)
    assert not interrupted.valid and interrupted.reasons[0] == "the run was interrupted: KeyboardInterrupt: "


def test_an_slo_percentile_the_samples_do_not_support_voids_only_the_slo_verdict() -> None:
    slo = Slo.parse("ttft_p99=200ms,tpot_p50=1s,e2e_max=5s")
    small = check_run(document(RunSpec(requests=64)), slo=slo)
    assert small.valid and not small.slo_valid
    assert small.slo_reasons == ("the SLO objective ttft_p99 rests on 64 requests: p99 needs >= 200",)
    assert small.percentile_notes[0].startswith("ttft p99 of 64 requests")
    assert check_run(document(RunSpec(requests=200)), slo=slo).slo_valid
    # p50 and max need few samples.
    assert check_run(document(RunSpec(requests=8)), slo=Slo.parse("ttft_p50=1s,ttft_max=2s")).slo_valid


def test_to_dict_is_plain_json() -> None:
    found = check_run(document(RunSpec(requests=64, failed=1)), slo=Slo.parse("ttft_p99=1s")).to_dict()
    assert found["valid"] is False and found["slo_valid"] is False
    assert found["supported_percentiles"]["ttft"] == 95.0 and found["samples"]["ttft"] == 63
