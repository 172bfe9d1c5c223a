"""hf-continuous: transformers' continuous batching in a launched server, on hf-static's model and kernels.

What makes it continuous, checked on the real engine: a request sent while others decode starts at the next step
(static batching would hold it until the batch ends), a finished request's slot is taken at once, the KV cache is
the size asked for, fills and empties, and a stream the client drops frees its slot.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from batchbench.adapters.base import EngineNotHealthy
from batchbench.adapters.hf_continuous import HFContinuousEngine
from batchbench.adapters.hf_static import HFStaticEngine
from batchbench.cli import main
from batchbench.core.clock import now
from batchbench.core.config import BatchingConfig
from batchbench.core.exits import EXIT_OK
from batchbench.results.document import RunDocument
from batchbench.workload.requests import Request
from tests.adapter_helpers import scrape_until

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[cpu]')")

#: 40 blocks of 16 tokens: four requests of 160 tokens (prompt and output) fill it.
KV_TOKENS = 640


@pytest.fixture(scope="module")
async def hfc() -> AsyncIterator[HFContinuousEngine]:
    config = BatchingConfig(max_batch_size=8, max_batched_tokens=256, kv_capacity_tokens=KV_TOKENS)
    async with HFContinuousEngine(config, threads=1) as engine:
        yield engine


async def _first_and_last(engine: HFContinuousEngine, request: Request) -> tuple[float, float, int]:
    """(first token, last event, tokens) of one stream, on the monotonic clock."""
    first = last = 0.0
    tokens = 0
    async for chunk in engine.stream(request):
        last = now()
        if chunk.n_tokens and not tokens:
            first = last
        tokens += chunk.n_tokens
    return first, last, tokens


@pytest.mark.engine
async def test_a_request_joins_the_running_batch_at_the_next_step(hfc: HFContinuousEngine) -> None:
    long = asyncio.create_task(_first_and_last(hfc, Request("long", tuple(range(3, 35)), 400)))
    await asyncio.sleep(0.3)  # the long request is decoding
    short_first, short_last, short_tokens = await _first_and_last(hfc, Request("short", tuple(range(3, 11)), 4))
    long_first, long_last, long_tokens = await long
    assert (short_tokens, long_tokens) == (4, 400)  # exactly max_tokens: EOS never ends a request
    # Static batching would have held "short" until "long" ended; here it starts and ends while "long" decodes.
    assert long_first < short_first < short_last < long_last


@pytest.mark.engine
async def test_the_kv_cache_is_the_size_asked_for_and_fills_and_empties(hfc: HFContinuousEngine) -> None:
    idle = await hfc.scrape()
    assert idle is not None and idle.kv_capacity_tokens == KV_TOKENS and idle.kv_usage == 0
    # Eight requests of 160 tokens want twice the cache: it fills, and every request is still served in full (the
    # scheduler admits them all on their prompts' blocks, then holds back those it cannot give a next block).
    wave = [Request(f"kv{i}", tuple(range(3 + i, 35 + i)), 128) for i in range(8)]
    tasks = [asyncio.create_task(_first_and_last(hfc, r)) for r in wave]
    peak_running, peak_usage, deadline = 0.0, 0.0, now() + 60
    while not all(t.done() for t in tasks) and now() < deadline:
        sample = await hfc.scrape()
        assert sample is not None
        peak_running = max(peak_running, sample.running or 0)
        peak_usage = max(peak_usage, sample.kv_usage or 0)
        await asyncio.sleep(0.02)
    assert [t[2] for t in await asyncio.gather(*tasks)] == [128] * 8
    assert peak_running >= 4 and peak_usage > 0.9, (peak_running, peak_usage)
    # The scheduler frees a finished request's blocks a moment after its stream ends.
    after = await scrape_until(hfc, lambda m: not (m.running or m.kv_usage))
    assert after is not None and (after.running, after.waiting, after.kv_usage) == (0, 0, 0)


@pytest.mark.engine
async def test_a_dropped_stream_frees_its_slot(hfc: HFContinuousEngine) -> None:
    stream = hfc.stream(Request("dropped", tuple(range(3, 19)), 2000))
    async for _ in stream:
        break
    await stream.aclose()  # the client goes away after its first token
    sample = await scrape_until(hfc, lambda m: not m.running, timeout_s=10, every_s=0.05)
    assert sample is not None and sample.running == 0


@pytest.mark.engine
async def test_a_server_run_by_hand_must_batch_as_configured(hfc: HFContinuousEngine) -> None:
    assert hfc.base_url is not None and hfc.server_info is not None
    assert hfc.server_info["kv_blocks"] == KV_TOKENS // 16 and hfc.server_info["device"] == "cpu"
    same = HFContinuousEngine(BatchingConfig(max_batch_size=8), url=hfc.base_url, startup_timeout=5)
    async with same:
        assert same.model.request_name == "tiny-llama"
        assert sum(c.n_tokens for c in [c async for c in same.stream(Request("u", (5, 6, 7), 3))]) == 3
    other = HFContinuousEngine(BatchingConfig(max_batch_size=16), url=hfc.base_url, startup_timeout=5)
    with pytest.raises(EngineNotHealthy, match="max_batch_size=8, not as configured"):
        async with other:
            pass
    static = HFStaticEngine(url=hfc.base_url, startup_timeout=5)
    with pytest.raises(EngineNotHealthy, match="runs continuous batching, not static: it is engine 'hf-continuous'"):
        async with static:
            pass


@pytest.mark.engine
def test_bench_runs_it_and_records_the_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "--engine", "hf-continuous", "--input-len", "16", "--output-len", "8", "--num-requests",
                 "20", "--concurrency", "4", "--results-dir", str(tmp_path), "--no-report"])
    assert code == EXIT_OK, capsys.readouterr()
    (doc,) = tmp_path.glob("bench-*/hf-continuous_*.json")
    result = RunDocument.load(doc)
    assert len(result.records) == 20 and all(r.ok and r.output_tokens == 8 for r in result.records)
    assert result.header.batching is not None and result.header.batching.mode == "continuous"
    assert result.footer.engine_report["requests_finished"] == 20


def test_what_it_cannot_do_is_refused_before_start() -> None:
    with pytest.raises(ValueError, match="chunked prefill cannot be switched off"):
        HFContinuousEngine(BatchingConfig(chunked_prefill=False))
    with pytest.raises(ValueError, match="cannot run static batching"):
        HFContinuousEngine(BatchingConfig(mode="static", max_batch_size=4))
    with pytest.raises(ValueError, match="cannot switch its prefix caching"):
        HFContinuousEngine(BatchingConfig(prefix_caching=True))
    with pytest.raises(ValueError, match=r"max_batched_tokens \(4\) must be >= max_batch_size \(8\)"):
        HFContinuousEngine(BatchingConfig(max_batch_size=8, max_batched_tokens=4))
    engine = HFContinuousEngine(BatchingConfig(max_batch_size=8, max_batched_tokens=512, kv_capacity_tokens=1000))
    args = engine.server_args(engine.batching, host="h", port=1)
    assert args[args.index("--batching") + 1] == "continuous"
    assert args[args.index("--kv-blocks") + 1] == "63" and args[args.index("--max-batch-tokens") + 1] == "512"
