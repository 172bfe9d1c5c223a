"""Staged load (batchbench/workload/stages.py): the stages parse or say why not, their sends come at each stage's
rate (a ramp's rising), the workload is seeded, and bench reports each stage on its own and the run as a whole."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchbench.cli import main
from batchbench.core.exits import EXIT_OK, EXIT_USAGE
from batchbench.results.document import RunDocument
from batchbench.workload.requests import Arrival, Lengths, WorkloadSpec
from batchbench.workload.stages import Stage, boundaries, parse_stages, schedule
from tests.server_process import serving


def test_stages_parse_and_label_as_written() -> None:
    plan = parse_stages("rate=2:60s, ramp=2-8:30, rate=0.5:2m")
    assert plan == (Stage(2, 60), Stage(2, 30, 8), Stage(0.5, 120))
    assert [s.label for s in plan] == ["rate=2:60s", "ramp=2-8:30s", "rate=0.5:120s"]
    assert boundaries(plan) == [0, 60, 90, 210]
    assert parse_stages(",".join(s.label for s in plan)) == plan


@pytest.mark.parametrize(("text", "message"), [
    ("rate=2", "is not rate=R:SECONDS or ramp=FROM-TO:SECONDS"),
    ("ramp=2:10s", "a ramp goes FROM-TO"),
    ("rate=2-4:10s", "a held rate has one value"),
    ("rate=0:10s", "a held stage needs a rate above 0"),
    ("ramp=0-0:10s", "not both 0"),
    ("rate=2:0s", "lasts more than 0 s"),
    ("", "at least one stage"),
])
def test_a_stage_that_cannot_be_run_is_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_stages(text)


_RATES = st.one_of(st.just(0.0), st.floats(1e-3, 50))  # requests/s: idle, or at least one per 1000 s


@given(_RATES, _RATES, st.floats(0.1, 100), st.floats(0, 1))
def test_a_stage_reaches_each_share_of_its_requests_at_the_time_its_rate_says(
        a: float, b: float, length: float, share: float) -> None:
    if a + b == 0:
        return
    stage = Stage(a, length, b)
    area = share * stage.expected_requests
    t = stage.offset_at(area)
    # The cumulative rate at t, a t + (b - a) t^2 / (2 length), is the area asked for, and t is within the stage.
    assert 0 <= t <= length * (1 + 1e-9)
    assert a * t + (b - a) * t * t / (2 * length) == pytest.approx(area, rel=1e-6, abs=1e-9)


def test_each_stage_sends_at_its_rate_and_a_ramp_rises() -> None:
    plan = parse_stages("rate=5:20s,ramp=5-20:20s,rate=20:20s")
    counts = []
    for seed in range(60):
        times = schedule(plan, random.Random(seed))
        assert times == sorted(times) and times[0] >= 0 and times[-1] <= 60
        counts.append([sum(1 for t in times if lo <= t < hi) for lo, hi in ((0, 20), (20, 30), (30, 40), (40, 60))])
    first, ramp_low, ramp_high, last = (statistics.mean(c[k] for c in counts) for k in range(4))
    assert first == pytest.approx(100, rel=0.06) and last == pytest.approx(400, rel=0.04)
    # The ramp's halves: 5 to 12.5/s over 10 s (87.5 requests) and 12.5 to 20/s (162.5).
    assert ramp_low == pytest.approx(87.5, rel=0.08) and ramp_high == pytest.approx(162.5, rel=0.06)


def test_a_staged_workload_is_seeded_and_timed() -> None:
    plan = parse_stages("rate=4:5s,rate=12:5s")
    n = len(schedule(plan, random.Random("3:arrivals")))
    spec = WorkloadSpec("staged", n, prompt=Lengths.fixed(4), output=Lengths.fixed(2), seed=3, stages=plan,
                        arrival=Arrival("timed", rate=8))
    wl = spec.build()
    assert wl.hash() == spec.build().hash() and [r.arrival_s for r in wl.requests] == sorted(
        r.arrival_s for r in wl.requests)
    with pytest.raises(ValueError, match="arrival kind 'timed'"):
        WorkloadSpec("staged", n, stages=plan, arrival=Arrival("poisson", rate=8))
    with pytest.raises(ValueError, match="send times are the workload's own"):
        wl.with_arrival(wl.arrival)


@pytest.mark.parametrize(("extra", "message"), [
    (["--rate", "2"], "--stages set the rates of the run"),
    (["--concurrency", "2"], "--stages set the rates of the run"),
    (["--num-requests", "20"], "--stages with --num-requests"),
    (["--duration", "5"], "--stages with --duration"),
])
def test_bench_refuses_what_stages_cannot_take(extra: list[str], message: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--engine", "vllm", "--stages", "rate=2:5s", *extra]) == EXIT_USAGE
    assert message in capsys.readouterr().err


def test_stages_that_do_not_parse_are_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", "--engine", "vllm", "--stages", "rate=2"])
    assert exited.value.code == EXIT_USAGE and "is not rate=R:SECONDS" in capsys.readouterr().err


def test_a_three_stage_run_reports_three_stages_and_the_whole(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with serving("batchbench.fixtures.protocol", "vllm", "--token-delay", "0.002", "--max-running", "64") as url:
        code = main(["bench", "--engine", "vllm", "--engine-url", url, "--stages",
                     "rate=10:1.5s,ramp=10-40:1.5s,rate=40:1.5s", "--input-len", "4", "--output-len", "4",
                     "--results-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == EXIT_OK, out
    (doc,) = tmp_path.glob("bench-*/vllm_*.json")
    result = RunDocument.load(doc)
    assert result.footer is not None
    stages = result.footer.stages
    assert [w.label for w in stages] == ["rate=10:1.5s", "ramp=10-40:1.5s", "rate=40:1.5s"]
    assert [w.start_s for w in stages] == [0, 1.5, 3]
    assert sum(w.sent for w in stages) == len(result.records) == result.footer.summary.requests
    assert stages[0].sent < stages[1].sent < stages[2].sent  # 15, 37.5 and 60 requests expected
    assert result.header.workload.spec is not None and result.header.workload.spec.arrival.kind == "timed"
    for w in stages:
        assert f"stage {w.label} ({w.start_s:g}–{w.end_s:g} s): {w.sent} sent" in out
    (md,) = tmp_path.glob("bench-*/report/report.md")
    by_stage = md.read_text()[md.read_text().index("By stage"):]
    assert all(f"{w.label} ({w.start_s:g}–{w.end_s:g})" in by_stage for w in stages)
