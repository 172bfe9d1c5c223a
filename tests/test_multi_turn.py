"""Multi-turn conversations: the workload's growing contexts, the load generator's turn order, TTFT by turn."""

from __future__ import annotations

import itertools
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchbench.adapters.vllm import VLLMEngine
from batchbench.cli import main
from batchbench.core.config import LoadConfig, ModelRef
from batchbench.core.exits import EXIT_USAGE
from batchbench.core.records import RequestRecord
from batchbench.fixtures.protocol.vllm import VLLMServer
from batchbench.load.loadgen import LoadGenerator
from batchbench.load.runner import run
from batchbench.measures.metrics import Distribution, summarize, ttft_by_turn
from batchbench.results import document as results
from batchbench.workload.requests import Arrival, Lengths, ThinkTime, WorkloadSpec
from tests.server_process import serving


def sessions_spec(sessions: int = 3, turns: int = 3, *, think: ThinkTime | None = None, seed: int = 0,
                  concurrency: int = 2, prefix: int = 0) -> WorkloadSpec:
    return WorkloadSpec("chat", sessions * turns, prompt=Lengths.uniform(2, 9), output=Lengths.uniform(1, 6),
                        arrival=Arrival("closed", concurrency=concurrency), seed=seed, turns=turns,
                        think=think or ThinkTime(), prefix_tokens=prefix)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 5), st.integers(0, 2**32), st.integers(0, 12))
def test_each_turn_carries_the_whole_conversation_so_far(sessions: int, turns: int, seed: int, prefix: int) -> None:
    wl = sessions_spec(sessions, turns, seed=seed, prefix=prefix).build()
    convs = wl.sessions() if turns > 1 else []
    assert len(convs) == (sessions if turns > 1 else 0)
    for s, conv in enumerate(convs):
        assert [r.session for r in conv] == [s] * turns and [r.turn for r in conv] == list(range(1, turns + 1))
        for before, after in itertools.pairwise(conv):
            # The previous prompt, then exactly as many answer tokens as the previous turn generates, then more.
            assert after.prompt_token_ids[:before.prompt_len] == before.prompt_token_ids
            assert after.prompt_len >= before.prompt_len + before.max_tokens + 2
        assert conv[-1].prompt_len + conv[-1].max_tokens <= wl.spec.max_context()
    assert wl.hash() == sessions_spec(sessions, turns, seed=seed, prefix=prefix).build().hash()


def test_think_times_are_seeded_exponential_and_only_between_turns() -> None:
    wl = sessions_spec(200, 3, think=ThinkTime("exponential", 2.0), seed=5, concurrency=1).build()
    firsts = [r.think_s for r in wl.requests if r.turn == 1]
    later = [r.think_s for r in wl.requests if r.turn != 1]
    assert set(firsts) == {0.0} and all(t > 0 for t in later)
    assert 1.7 < sum(later) / len(later) < 2.3  # 400 draws of mean 2: the standard error is 0.1
    assert all(round(t, 6) == t for t in later)
    fixed = sessions_spec(2, 3, think=ThinkTime("fixed", 0.25), seed=5).build()
    assert [r.think_s for r in fixed.requests] == [0.0, 0.25, 0.25] * 2
    # The think times are part of what every engine is given: the hash covers them.
    assert fixed.hash() != sessions_spec(2, 3, think=ThinkTime("fixed", 0.5), seed=5).build().hash()


@pytest.mark.parametrize(("text", "expected"), [("0.5", ThinkTime("fixed", 0.5)), ("0", ThinkTime()),
                                                 ("exp:2", ThinkTime("exponential", 2.0))])
def test_think_time_parses(text: str, expected: ThinkTime) -> None:
    assert ThinkTime.parse(text) == expected


@pytest.mark.parametrize(("text", "message"), [("-1", ">= 0"), ("exp:0", "mean > 0"), ("poisson:2", "exp:MEAN"),
                                               ("soon", "SECONDS"), ("inf", "finite")])
def test_bad_think_times_are_named(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ThinkTime.parse(text)


@pytest.mark.parametrize(("make", "message"), [
    (lambda: WorkloadSpec("w", 7, turns=3, arrival=Arrival("closed")), "not whole sessions of 3 turns"),
    (lambda: WorkloadSpec("w", 6, turns=3), "sessions run closed loop"),
    (lambda: WorkloadSpec("w", 6, turns=0), "at least one turn"),
    (lambda: sessions_spec().build().with_arrival(Arrival("poisson", rate=2.0)), "sessions run closed loop"),
])
def test_sessions_that_cannot_run_are_refused(make, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


@pytest.fixture
async def fake() -> AsyncIterator[VLLMServer]:
    server = VLLMServer(model="fake-model", token_delay=0.002, max_running=64, max_queue=64,
                        kv_capacity_tokens=4096, fault_after=1)
    await server.start_async()
    yield server
    await server.stop_async()


def engine_at(url: str) -> VLLMEngine:
    return VLLMEngine(model=ModelRef("fake-model"), url=url, startup_timeout=10.0)


async def test_a_turn_is_sent_only_after_the_previous_answer_and_its_think_time(fake: VLLMServer) -> None:
    wl = sessions_spec(4, 3, think=ThinkTime("exponential", 0.05), seed=1, concurrency=2).build()
    async with engine_at(fake.url) as engine:
        records = await LoadGenerator(engine, wl).run()
    assert len(records) == 12 and all(r.ok for r in records)
    by_id = {r.request_id: r for r in records}
    for conv in wl.sessions():
        recs = [by_id[r.request_id] for r in conv]
        assert [(r.session, r.turn) for r in recs] == [(t.session, t.turn) for t in conv]
        for (prev, nxt), request in zip(itertools.pairwise(recs), conv[1:]):
            assert nxt.scheduled_s == pytest.approx(prev.closed_s + request.think_s, abs=1e-9)
            assert nxt.sent_s >= prev.done_s + request.think_s
    # Two users: never more than two conversations' turns in flight.
    assert max(r.in_flight_at_send for r in records) <= 2


async def test_a_failed_turn_ends_its_session_and_the_rest_are_recorded_not_sent(fake: VLLMServer) -> None:
    wl = sessions_spec(2, 4, seed=2, concurrency=2).build()
    failing = wl.sessions()[0][1]  # the second turn of the first session
    fake.request_faults[failing.request_id] = "503"
    async with engine_at(fake.url) as engine:
        records = await LoadGenerator(engine, wl).run()
    assert len(records) == 8
    first = sorted((r for r in records if r.session == 0), key=lambda r: r.turn or 0)
    assert [r.error_kind for r in first] == [None, "rejected", "not_sent", "not_sent"]
    assert failing.request_id in (first[2].error or "") and all(r.ok for r in records if r.session == 1)
    summary = summarize(records, duration_s=1.0)
    assert summary.failures == {"not_sent": 2, "rejected": 1}
    assert summary.ttft_by_turn is not None and summary.ttft_by_turn["3"] is not None
    assert summary.ttft_by_turn["3"].count == 1  # the failed session's later turns are not fast turns


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), st.floats(0.001, 5.0), st.booleans()), min_size=1, max_size=40))
def test_ttft_by_turn_groups_the_ok_requests_by_their_turn(rows: list[tuple[int, float, bool]]) -> None:
    records = [RequestRecord(f"r{i}", 8, 2, 0.0, ok=ok, chunk_times=[ttft, ttft + 0.1], chunk_tokens=[1, 1],
                             session=i, turn=turn) for i, (turn, ttft, ok) in enumerate(rows)]
    random.Random(0).shuffle(records)
    found = ttft_by_turn(records)
    assert list(found) == sorted({turn for turn, _, _ in rows})
    for turn, dist in found.items():
        expected = Distribution.of(t for k, t, ok in rows if k == turn and ok)
        assert (dist is None) == (expected is None)
        if dist is not None and expected is not None:
            assert dist.count == expected.count and dist.p50 == pytest.approx(expected.p50)
    assert ttft_by_turn([RequestRecord("single", 8, 2, 0.0, ok=True, chunk_times=[0.1], chunk_tokens=[1])]) == {}


async def test_sessions_and_ttft_by_turn_land_in_the_results_document(fake: VLLMServer, tmp_path: Path) -> None:
    wl = sessions_spec(2, 3, seed=3).build()
    async with engine_at(fake.url) as engine:
        result = await run(engine, wl, results_dir=tmp_path, load=LoadConfig(request_timeout_s=10.0))
    doc = results.load(result.path)
    assert sorted((r.session, r.turn) for r in doc.records) == [(s, k) for s in range(2) for k in (1, 2, 3)]
    assert doc.footer is not None and doc.footer.summary is not None
    by_turn = doc.footer.summary.ttft_by_turn
    assert by_turn is not None and sorted(by_turn) == ["1", "2", "3"] and by_turn["1"] is not None
    assert doc.header.workload.spec is not None and doc.header.workload.spec.turns == 3


NOWHERE = ["--engine", "vllm", "--engine-url", "vllm=http://127.0.0.1:9"]


@pytest.mark.parametrize(("extra", "message"), [
    (["--turns", "0"], "--turns: must be"),
    (["--turns", "3", "--rate", "2"], "give --concurrency (conversations at once), not --rate"),
    (["--turns", "3", "--num-requests", "10"], "--num-requests 10 is not whole conversations of --turns 3"),
    (["--think-time", "1"], "--think-time is the pause between turns of a conversation: add --turns"),
    (["--turns", "2", "--think-time", "exp:-1"], "--think-time"),
    (["--turns", "8", "--input-len", "200", "--output-len", "64"], "per turn x 8 turns (--turns) exceeds"),
])
def test_bad_turn_options_are_usage_errors_before_any_engine_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str) -> None:
    try:
        code = main(["bench", *NOWHERE, "--results-dir", str(tmp_path), *extra])
    except SystemExit as exit_info:
        code = exit_info.code  # type: ignore[assignment]
    captured = capsys.readouterr()
    assert code == EXIT_USAGE and message in captured.err, captured.err
    assert not list(tmp_path.iterdir())


def test_bench_runs_conversations_and_reports_ttft_by_turn(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with serving("batchbench.fixtures.protocol", "vllm", "--token-delay", "0.001", "--max-running", "64") as url:
        code = main(["bench", "--engine", "vllm", "--engine-url", f"vllm={url}", "--turns", "3", "--think-time",
                     "exp:0.01", "--input-len", "16", "--output-len", "4", "--num-requests", "6", "--concurrency",
                     "2", "--warmup", "2", "--results-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    (run_dir,) = tmp_path.glob("bench-*")
    (doc,) = [results.load(p) for p in run_dir.glob("vllm_*.json")]
    assert sorted((r.session, r.turn) for r in doc.records) == [(s, k) for s in (0, 1) for k in (1, 2, 3)]
    assert [r.prompt_len for r in sorted(doc.records, key=lambda r: r.request_id)] == [16, 36, 56] * 2
    report = (run_dir / "report" / "report.md").read_text()
    assert "TTFT by turn" in report
    assert "over 3-turn conversations, TTFT p50 goes from" in out, out
