"""The main job's design (batchbench.analysis.main_job): runs sized by time, the time limit split, the padding pair."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchbench.analysis.main_job import (
    MANDATORY_SHARE,
    MAX_GENERATIONS,
    MIN_GENERATIONS,
    REPORT_BASE_S,
    Calibration,
    EngineSweep,
    TimeLimit,
    engine_sweep,
    generations_for,
    padding_pair,
)
from batchbench.analysis.repeats import RepeatProtocol, Repeats
from batchbench.core.records import RequestRecord
from batchbench.experiment.main_job import EngineMeasurement
from batchbench.load.runner import MeasuredRun
from batchbench.measures.client_load import ClientLoad
from batchbench.measures.machine_load import MachineLoad
from batchbench.measures.metrics import summarize
from batchbench.workload.profiles import get_profile

LEVELS = (1, 2, 4, 8, 16, 32)


def sweep(name: str = "vllm", generations: int = 4) -> EngineSweep:
    return dataclasses.replace(engine_sweep(name, get_profile("quick"), at_url=False, levels=LEVELS),
                               generations=generations)


def test_runs_are_rounds_of_their_clients_and_past_the_fit_a_full_queue() -> None:
    s = sweep(generations=3)
    fit = s.design.fit
    assert fit == 8
    assert [s.requests(c) for c in LEVELS] == [3, 6, 12, 24, 16 + 24, 32 + 24]
    # Continuous and static waves at the fit send the same requests; the static waves are whole waves of the fit.
    continuous, waves = s.workload(("continuous", fit)), s.workload(("static-waves", fit))
    assert continuous.requests == waves.requests and len(waves.requests) % fit == 0
    assert waves.arrival.kind == "waves" and continuous.arrival.kind == "closed"
    # In a pass each comparison's runs stand side by side.
    assert s.keys[3:7] == [("continuous", 8), ("static-waves", 8), ("homogeneous", 8), ("padded-mixed", 8)]


def test_the_padding_pair_is_the_classic_ratio_at_half_the_context() -> None:
    pair = padding_pair(256, 8, waves=4)
    mixed = [r.prompt_len for r in pair["padded-mixed"].requests]
    plain = [r.prompt_len for r in pair["homogeneous"].requests]
    assert len(mixed) == len(plain) == 32 and set(plain) == {3} and sorted(set(mixed)) == [3, 128]
    assert mixed.count(128) == 4  # one long prompt in every wave
    long = max(r.prompt_len for r in padding_pair(32768, 32)["padded-mixed"].requests)
    assert long == 4096  # never longer than the classic case


def pass_s(s: EngineSweep, generation_s: float) -> float:
    return sum(s.expected_s(key, Calibration(generation_s)) for key in s.keys)


@given(st.floats(0.01, 5.0), st.floats(1.0, 600.0), st.integers(1, 4))
def test_runs_are_as_long_as_the_share_allows(generation_s: float, share_s: float, repeats: int) -> None:
    s = sweep()
    g = generations_for(s, Calibration(generation_s), share_s, repeats)
    assert MIN_GENERATIONS <= g <= MAX_GENERATIONS
    sized = dataclasses.replace(s, generations=g)
    if g > MIN_GENERATIONS:  # the mandatory passes fit their part of the share...
        assert repeats * pass_s(sized, generation_s) <= MANDATORY_SHARE * share_s + 1e-9
    if g < MAX_GENERATIONS:  # ... and one generation more would not
        longer = dataclasses.replace(s, generations=g + 1)
        assert repeats * pass_s(longer, generation_s) > MANDATORY_SHARE * share_s
    # A machine twice as slow never gets longer runs.
    assert generations_for(s, Calibration(2 * generation_s), share_s, repeats) <= g


def test_a_slow_machine_gets_short_runs_and_a_fast_one_long_ones() -> None:
    s = sweep()
    assert generations_for(s, Calibration(1.4), 70.0, 2) == MIN_GENERATIONS
    assert generations_for(s, Calibration(0.15), 80.0, 2) == MAX_GENERATIONS


def test_the_time_limit_is_split_over_the_engines_with_the_report_kept() -> None:
    limit = TimeLimit(300.0, time.perf_counter())
    first = limit.share(3, starts_to_come_s=10.0)
    assert first == pytest.approx((300 - REPORT_BASE_S - 10) / 3, abs=0.5)
    limit.runs = 100
    assert limit.report_s() > REPORT_BASE_S
    assert limit.fits(10.0) and not limit.fits(300.0)
    gone = TimeLimit(10.0, time.perf_counter() - 20.0)
    assert gone.share(1, 0.0) == 0.0 and not gone.fits(0.0)


def test_a_run_that_no_longer_fits_is_skipped_and_a_shorter_one_still_runs() -> None:
    series: dict[str, Repeats[int]] = {"long": Repeats(), "short": Repeats()}
    protocol = RepeatProtocol(repeats=2, fits=lambda key: key == "short")
    assert list(protocol.schedule(series)) == [("short", 0), ("short", 1)]
    # An extra pass in which nothing fits ends the schedule (no pass after it is tried).
    calls: list[str] = []

    def fits(key: str) -> bool:
        calls.append(key)
        return False

    extra = RepeatProtocol(repeats=1, max_repeats=5, settled=lambda _: False, fits=fits)
    assert list(extra.schedule({"a": Repeats()})) == [] and calls == ["a", "a"]


def test_a_run_after_a_tail_run_is_expected_as_long_as_itself() -> None:
    """The SLO's tail run at batch 8 held 400 requests in 10 s; the next ordinary run there (24 requests) is
    expected to take 0.6 s at that pace, not 10 s, and so still fits a share that 10 s would overrun. A tail run of
    400 more is expected to take 10 s again, and does not fit."""
    s = sweep(generations=3)
    key = ("continuous", 8)
    records = [_ok_record(i) for i in range(400)]
    tail = MeasuredRun(path=Path("r.json"), records=records, samples=[], summary=summarize(records, duration_s=10.0),
                       engine_report={}, duration_s=10.0, status="complete",
                       client=ClientLoad(cpu_s=0.0, wall_s=10.0, busy_fraction=0.0), machine=MachineLoad(None))
    measured = EngineMeasurement("vllm", None, s, Calibration(0.1), share=5.0,  # type: ignore[arg-type]
                                 measuring=time.perf_counter(), sent=lambda w: w,
                                 series={key: Repeats()}, workloads={key: s.workload(key)})
    measured.series[key].add(tail, MachineLoad(None))
    limit = TimeLimit(300.0, time.perf_counter())
    assert len(measured.workloads[key].requests) == 24
    assert measured.fits(key, limit) and not measured.fits(key, limit, requests=400)


def _ok_record(i: int) -> RequestRecord:
    return RequestRecord(request_id=f"r{i}", prompt_len=4, max_tokens=4, scheduled_s=0.0, sent_s=0.0, done_s=1.0,
                         chunk_times=[0.5], chunk_tokens=[4], ok=True)
