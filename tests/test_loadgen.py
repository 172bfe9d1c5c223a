"""The load generator, the vLLM wire format and fault handling, against the vLLM protocol server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from batchbench.adapters.base import EngineNotHealthy, EngineUnreachable
from batchbench.adapters.vllm import VLLMEngine
from batchbench.core.clock import now
from batchbench.core.config import LoadConfig, ModelRef
from batchbench.core.records import RequestRecord
from batchbench.fixtures.protocol.vllm import VLLMServer
from batchbench.load.loadgen import LoadGenerator
from batchbench.load.runner import run
from batchbench.measures.metrics import itl_samples, summarize
from batchbench.results import document as results
from batchbench.workload.requests import Arrival, Lengths, Workload, WorkloadSpec


def workload(n: int, *, out: int = 5, arrival: Arrival | None = None, name: str = "t") -> Workload:
    return WorkloadSpec(name, n, prompt=Lengths.fixed(8), output=Lengths.fixed(out),
                        arrival=arrival or Arrival("offline")).build()


def fake_vllm(**kwargs: object) -> VLLMServer:
    """The vLLM protocol server in the test's own event loop: as wide as the load, faults after one token."""
    options: dict = {"model": "fake-model", "token_delay": 0.0, "max_running": 1024, "max_queue": 1024,
                     "kv_capacity_tokens": 4096, "fault_after": 1}
    return VLLMServer(**{**options, **kwargs})


@pytest.fixture
async def fake() -> AsyncIterator[VLLMServer]:
    server = fake_vllm()
    await server.start_async()
    yield server
    await server.stop_async()


def engine_at(url: str, timeout: float = 10.0) -> VLLMEngine:
    return VLLMEngine(model=ModelRef("fake-model"), url=url, startup_timeout=timeout)


async def test_records_use_the_engines_token_counts(fake: VLLMServer) -> None:
    wl = workload(4, out=7)
    async with engine_at(fake.url) as engine:
        records = await LoadGenerator(engine, wl).run()
    assert len(records) == 4 and all(r.ok for r in records)
    for r in records:
        assert r.chunk_tokens == [1] * 7
        assert (r.prompt_tokens, r.completion_tokens, r.finish_reason) == (8, 7, "length")
        assert r.chunk_times == sorted(r.chunk_times) and r.sent_s <= r.chunk_times[0]
        # E2E ends at the last token; the stream's close (after [DONE]) is kept apart.
        assert r.done_s == r.chunk_times[-1] and r.closed_s is not None and r.closed_s >= r.done_s


async def test_multi_token_chunks_count_every_token(fake: VLLMServer) -> None:
    wl = workload(1, out=6)
    fake.request_faults[wl.requests[0].request_id] = "pairs"
    async with engine_at(fake.url) as engine:
        (record,) = await LoadGenerator(engine, wl).run()
    assert record.chunk_tokens == [2, 2, 2] and record.output_tokens == 6
    itl = itl_samples(record)
    assert len(itl) == 4  # the first chunk's tokens are TTFT; each later chunk's gap is shared by its two tokens
    assert sum(itl) == pytest.approx(record.chunk_times[-1] - record.chunk_times[0])
    # Per chunk (what vllm bench serve reports) there are half as many samples, each twice as long.
    per_chunk = summarize([record], duration_s=1.0).itl_per_chunk
    assert per_chunk is not None and per_chunk.count == 2
    assert per_chunk.mean == pytest.approx(2 * sum(itl) / len(itl))


async def test_open_loop_sends_on_schedule_while_the_engine_is_slow(fake: VLLMServer) -> None:
    """No coordinated omission: a slow engine does not slow the arrivals, and its queueing shows in latency."""
    fake.tune(max_running=1, token_delay=0.01)  # one request at a time, 50 ms each
    wl = workload(8, out=5, arrival=Arrival("poisson", rate=100.0))
    async with engine_at(fake.url) as engine:
        records = await LoadGenerator(engine, wl).run()
    by_id = {r.request_id: r for r in records}
    for request in wl.requests:
        r = by_id[request.request_id]
        # sent when scheduled (event-loop jitter only), not when the previous answer came back
        assert r.sent_s - request.arrival_s < 0.03
    last = max(records, key=lambda r: r.done_s or 0)
    # served one at a time: the last finishes after ~8 x 50 ms, and its latency includes the wait
    assert last.done_s >= 0.35
    assert max(r.e2e_s or 0 for r in records) >= 0.25


async def test_client_bound_shows_as_schedule_lag(fake: VLLMServer) -> None:
    """When the client's own in-flight bound holds a request back, the wait is reported, not hidden."""
    fake.tune(token_delay=0.01)
    wl = workload(5, out=5, arrival=Arrival("offline"))
    async with engine_at(fake.url) as engine:
        records = await LoadGenerator(engine, wl, config=LoadConfig(max_in_flight=1)).run()
    lags = sorted(r.schedule_lag_s for r in records)
    assert lags[0] < 0.02 and lags[-1] >= 4 * 0.05 * 0.9
    for r in records:
        assert r.e2e_from_schedule_s == pytest.approx(r.e2e_s + r.schedule_lag_s)
    s = summarize(records, duration_s=1.0)
    assert s.e2e_from_schedule.max > s.e2e.max


async def test_closed_loop_holds_concurrency(fake: VLLMServer) -> None:
    fake.tune(token_delay=0.002)
    wl = workload(12, out=4, arrival=Arrival("closed", concurrency=3))
    async with engine_at(fake.url) as engine:
        records = await LoadGenerator(engine, wl).run()
    assert all(r.ok for r in records) and len(records) == 12
    assert max(r.in_flight_at_send for r in records) == 3


async def test_static_waves_wait_for_the_whole_wave(fake: VLLMServer) -> None:
    fake.tune(token_delay=0.002)
    wl = WorkloadSpec("w", 9, prompt=Lengths.fixed(4), output=Lengths.uniform(2, 12),
                      arrival=Arrival("waves", concurrency=4), seed=3).build()
    async with engine_at(fake.url) as engine:
        records = await LoadGenerator(engine, wl).run()
    waves: dict[int, list] = {}
    for r in records:
        waves.setdefault(r.wave, []).append(r)
    assert sorted(len(v) for v in waves.values()) == [1, 4, 4]
    for k in range(2):
        assert min(r.sent_s for r in waves[k + 1]) >= max(r.done_s for r in waves[k])


async def test_faults_fail_only_their_request_with_a_named_reason(fake: VLLMServer) -> None:
    wl = workload(8, out=5)
    modes = ["429", "503", "malformed", "truncated", "hang", "error_event"]
    for request, mode in zip(wl.requests, modes):
        fake.request_faults[request.request_id] = mode
    async with engine_at(fake.url) as engine:
        records = await LoadGenerator(engine, wl, config=LoadConfig(request_timeout_s=1.0)).run()
    by_id = {r.request_id: r for r in records}
    kinds = {mode: by_id[r.request_id].error_kind for r, mode in zip(wl.requests, modes)}
    assert kinds == {"429": "rejected", "503": "rejected", "malformed": "protocol_error",
                     "truncated": "protocol_error", "hang": "timeout", "error_event": "http_error"}
    for request, _ in zip(wl.requests, modes):
        rec = by_id[request.request_id]
        assert not rec.ok and "vllm" in rec.error and request.request_id in rec.error
    assert "HTTP 429" in by_id[wl.requests[0].request_id].error
    assert by_id[wl.requests[4].request_id].chunk_tokens == [1]  # what arrived before the hang is kept
    assert [r.ok for r in records].count(True) == 2
    s = summarize(records, duration_s=1.0)
    assert s.rejected == 2 and s.failed == 6 and s.rejection_rate == pytest.approx(2 / 8)


async def test_wrong_url_and_unhealthy_engine_are_named() -> None:
    with pytest.raises(EngineUnreachable, match="invalid URL"):
        engine_at("localhost:8000")
    with pytest.raises(EngineNotHealthy, match=r"engine 'vllm'.*cannot connect"):
        async with engine_at("http://127.0.0.1:9", timeout=1.0):
            pass
    unhealthy = fake_vllm(fault="unhealthy")
    url = await unhealthy.start_async()
    try:
        with pytest.raises(EngineNotHealthy, match="HTTP 503"):
            async with engine_at(url, timeout=1.0):
                pass
    finally:
        await unhealthy.stop_async()


async def test_url_mode_discovers_the_served_model(fake: VLLMServer) -> None:
    async with VLLMEngine(model=ModelRef(""), url=fake.url) as engine:
        assert engine.model.request_name == "fake-model"
        sample = await engine.scrape()
    assert sample is not None and sample.kv_capacity_tokens == 4096 and sample.running == 0


async def test_interrupted_run_keeps_every_record_measured(fake: VLLMServer, tmp_path: Path) -> None:
    wl = workload(6, out=3)
    fake.request_faults[wl.requests[5].request_id] = "hang"
    async with engine_at(fake.url) as engine:
        task = asyncio.create_task(run(engine, wl, results_dir=tmp_path, load=LoadConfig(request_timeout_s=60)))
        while len(list(tmp_path.glob("*.jsonl"))) == 0 or fake.served < 5:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    (path,) = tmp_path.glob("*.json")
    doc = results.load(path)
    assert doc.footer is not None
    assert doc.status == "interrupted" and doc.footer.error is not None and "CancelledError" in doc.footer.error
    recs = doc.records
    assert sum(r.ok for r in recs) == 5
    assert [r.error_kind for r in recs if not r.ok] == ["cancelled"]
    assert doc.footer.summary is not None and doc.footer.summary.ok == 5
    assert doc.header.workload_hash == wl.hash()


async def test_a_run_that_raises_keeps_every_record_handed_over(fake: VLLMServer, tmp_path: Path) -> None:
    """The journal is written by a thread; an exception mid-run still leaves every record handed to it."""
    wl = workload(40, out=3, arrival=Arrival("closed", concurrency=1))
    seen: list[str] = []

    def on_record(record: RequestRecord) -> None:
        seen.append(record.request_id)
        if len(seen) == 30:
            raise RuntimeError("the progress display broke")

    async with engine_at(fake.url) as engine:
        with pytest.raises(RuntimeError, match="display broke"):
            await run(engine, wl, results_dir=tmp_path, on_record=on_record)
    (path,) = tmp_path.glob("*.json")
    doc = results.load(path)
    assert doc.status == "interrupted" and [r.request_id for r in doc.records] == seen


async def test_the_send_is_stamped_when_the_request_is_written(fake: VLLMServer) -> None:
    """The adapter's stamp (on the first chunk) is later than the load generator's and before any answer."""
    async with engine_at(fake.url) as engine:
        before = now()
        chunks = [chunk async for chunk in engine.stream(workload(1, out=3).requests[0])]
    first = chunks[0].sent
    assert first is not None and before < first < chunks[0].t
    assert all(chunk.sent is None for chunk in chunks[1:])
