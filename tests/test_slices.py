"""Time slices (batchbench/measures/slices.py): every request, token and gap falls in exactly one window, each
where it happened; a run with ``slice_s`` writes its windows into the results document, which reads back."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchbench.core.records import RequestRecord
from batchbench.core.server_metrics import ServerMetrics
from batchbench.measures.slices import time_slices
from batchbench.results import document as results
from batchbench.results.schema import json_schema


@st.composite
def _records(draw: st.DrawFn) -> tuple[list[RequestRecord], float]:
    duration = draw(st.floats(0.5, 30))
    records = []
    for i in range(draw(st.integers(0, 30))):
        sent = draw(st.floats(0, duration * 0.9))
        gaps = draw(st.lists(st.floats(0.001, 0.5), max_size=6))
        times, t = [], sent
        for g in gaps:
            t = min(t + g, duration)
            times.append(t)
        ok = bool(times) and draw(st.booleans())
        records.append(RequestRecord(f"r{i}", 4, len(times), scheduled_s=sent, sent_s=sent,
                                     done_s=times[-1] if times else sent, chunk_times=times,
                                     chunk_tokens=[1] * len(times), ok=ok))
    return records, duration


@given(_records(), st.floats(0.1, 10))
def test_every_request_token_and_gap_is_in_one_window(case: tuple[list[RequestRecord], float], width: float) -> None:
    records, duration = case
    slices = time_slices(records, [], width_s=width, duration_s=duration)
    assert slices[0].start_s == 0 and slices[-1].end_s == pytest.approx(duration)
    assert all(a.end_s == pytest.approx(b.start_s) for a, b in itertools.pairwise(slices))
    assert all(s.end_s - s.start_s <= width + 1e-6 for s in slices)
    assert sum(s.sent for s in slices) == len(records) == sum(s.finished for s in slices)
    assert sum(s.failed for s in slices) == sum(1 for r in records if not r.ok)
    assert sum(s.output_tokens for s in slices) == sum(len(r.chunk_times) for r in records)
    assert sum(s.ttft.count for s in slices if s.ttft) == sum(1 for r in records if r.ok)
    assert sum(s.itl.count for s in slices if s.itl) == sum(len(r.chunk_times) - 1 for r in records if r.ok)
    for r in records:  # a request's TTFT is in the window it was sent in
        if r.ok and r.ttft_s is not None:
            homes = [w for w in slices if w.start_s - 1e-6 <= r.sent_s <= w.end_s + 1e-6]  # 1 or 2 at an edge
            assert any(w.ttft is not None and w.ttft.min <= r.ttft_s <= w.ttft.max for w in homes)


def test_windows_show_a_slowdown_the_whole_run_averages_away() -> None:
    # 2 s at 10 tokens/s, then 2 s at 2: the whole run reads 6, the windows say what happened.
    fast = [RequestRecord("f", 4, 20, scheduled_s=0, sent_s=0, done_s=2, ok=True,
                          chunk_times=[0.1 * k - 0.05 for k in range(1, 21)], chunk_tokens=[1] * 20)]
    slow = [RequestRecord("s", 4, 4, scheduled_s=2, sent_s=2, done_s=4, ok=True,
                          chunk_times=[2.5, 3.0, 3.5, 3.99], chunk_tokens=[1] * 4)]
    samples = [ServerMetrics(t=0.5, kv_usage=0.2, waiting=0), ServerMetrics(t=1.5, kv_usage=0.4, waiting=2),
               ServerMetrics(t=3.0, kv_usage=0.9, waiting=5), ServerMetrics(t=9.0, kv_usage=1.0)]
    first, second = time_slices(fast + slow, samples, width_s=2, duration_s=4)
    assert (first.output_token_throughput, second.output_token_throughput) == (pytest.approx(10), pytest.approx(2))
    assert first.itl is not None and first.itl.p50 == pytest.approx(0.1)
    assert second.itl is not None and second.itl.p50 == pytest.approx(0.5)
    assert (first.kv_usage_mean, first.kv_usage_max, first.waiting_max) == (pytest.approx(0.3), 0.4, 2)
    assert (second.kv_usage_max, second.waiting_mean) == (0.9, 5)  # the sample after the run is not counted
    with pytest.raises(ValueError, match="longer than 0"):
        time_slices([], [], width_s=0, duration_s=1)
    assert time_slices([], [], width_s=1, duration_s=0) == []


async def test_a_sliced_run_writes_its_windows(tmp_path: Path) -> None:
    from batchbench.adapters.vllm import VLLMEngine
    from batchbench.core.config import LoadConfig, ModelRef
    from batchbench.fixtures.protocol.vllm import VLLMServer
    from batchbench.load.runner import run
    from batchbench.workload.requests import Arrival, Lengths, WorkloadSpec

    server = VLLMServer(model="fake-model", token_delay=0.01)
    await server.start_async()
    try:
        wl = WorkloadSpec("sliced", 12, prompt=Lengths.fixed(4), output=Lengths.fixed(20),
                          arrival=Arrival("closed", concurrency=3)).build()
        async with VLLMEngine(model=ModelRef("fake-model"), url=server.url) as engine:
            result = await run(engine, wl, results_dir=tmp_path, load=LoadConfig(scrape_interval_s=0.05, slice_s=0.2))
            plain = await run(engine, wl, results_dir=tmp_path)
    finally:
        await server.stop_async()
    raw = json.loads(result.path.read_text(encoding="utf-8"))
    assert list(jsonschema.Draft202012Validator(json_schema()).iter_errors(raw)) == []
    doc = results.load(result.path)
    assert doc.footer is not None and doc.header.load.slice_s == 0.2
    windows = doc.footer.slices
    assert len(windows) >= 2 and sum(w.sent for w in windows) == 12
    assert sum(w.output_tokens for w in windows) == 12 * 20
    assert any(w.kv_usage_mean is not None or w.waiting_mean is not None for w in windows)
    unsliced = results.load(plain.path)
    assert unsliced.footer is not None and unsliced.footer.slices == []
