"""hf-static: real static batching over transformers generate(), with exact padding accounting."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from batchbench.adapters.base import BatchingConfig, EngineNotHealthy, ModelRef
from batchbench.adapters.hf_static import HFStaticEngine
from batchbench.loadgen import LoadGenerator
from batchbench.runner import run
from batchbench.theory import decode_idle_fraction, padding_fraction
from batchbench.workload import Arrival, Lengths, Request, WorkloadSpec

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[cpu]')")
pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
async def hf() -> AsyncIterator[HFStaticEngine]:
    async with HFStaticEngine(BatchingConfig(mode="static", max_batch_size=8)) as engine:
        yield engine


async def test_mixed_batch_pads_exactly_as_computed(hf: HFStaticEngine, tmp_path: Path) -> None:
    """One long prompt among seven short ones: the engine pads every short one to the long one."""
    wl = WorkloadSpec("mixed", 8, prompt=Lengths.mixed(short=6, long=96, period=8), output=Lengths.uniform(2, 20),
                      arrival=Arrival("waves", concurrency=8), seed=5).build()
    before = await hf.scrape()
    result = await run(hf, wl, results_dir=tmp_path)
    assert result.summary.ok == 8
    after = await hf.scrape()  # the engine's own count of finished requests
    assert before.completed is not None and after.completed == before.completed + 8
    (batch,) = result.engine_report["batches"]
    prompt_lens = [r.prompt_len for r in wl.requests]
    assert sorted(batch["prompt_lens"]) == sorted(prompt_lens) and batch["padded_prompt_len"] == 96
    assert result.engine_report["prompt_pad_fraction"] == pytest.approx(padding_fraction(prompt_lens))
    assert result.engine_report["prompt_pad_tokens"] == 7 * (96 - 6)
    outputs = [r.max_tokens for r in wl.requests]
    assert result.engine_report["decode_idle_fraction"] == pytest.approx(decode_idle_fraction(outputs))
    # An in-process engine's machine load is measured (everything but this process is foreign) and stored.
    stored = json.loads(result.path.read_text())["machine"]
    share = result.machine.foreign_share
    assert share is not None and 0.0 <= share <= 1.0 and stored["foreign_share"] == share


async def test_every_request_gets_exactly_its_tokens(hf: HFStaticEngine) -> None:
    wl = WorkloadSpec("exact", 5, prompt=Lengths.uniform(3, 30), output=Lengths.uniform(1, 24), seed=2).build()
    records = await LoadGenerator(hf, wl).run()
    by_id = {r.request_id: r for r in records}
    for request in wl.requests:
        record = by_id[request.request_id]
        assert record.ok and record.completion_tokens == request.max_tokens == sum(record.chunk_tokens)
        assert record.prompt_tokens == request.prompt_len


async def test_a_late_request_waits_for_the_running_batch(hf: HFStaticEngine) -> None:
    """Static batching: nothing joins a batch in flight, so the latecomer's TTFT includes the rest of it."""
    hf.begin_run()
    first = [Request(f"early-{i}", (5, 6, 7, 8), 48) for i in range(4)]
    late = Request("late", (5, 6, 7, 8), 2)
    tasks = [asyncio.create_task(_first_token_and_end(hf, r)) for r in first]
    await asyncio.sleep(0.3)  # the first batch is decoding by now
    late_first, _ = await _first_token_and_end(hf, late)
    early_ends = [end for _, end in await asyncio.gather(*tasks)]
    sizes = [b["size"] for b in hf.report()["batches"]]
    assert sizes == [4, 1]
    assert late_first >= max(early_ends)  # its first token only after the whole first batch finished


async def _first_token_and_end(engine: HFStaticEngine, request: Request) -> tuple[float, float]:
    times = [chunk.t async for chunk in engine.stream(request) if chunk.n_tokens]
    return times[0], times[-1]


def test_options_that_do_not_apply_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot run continuous batching"):
        HFStaticEngine(BatchingConfig(mode="continuous"))
    with pytest.raises(ValueError, match="kv_capacity_tokens"):
        HFStaticEngine(BatchingConfig(mode="static", kv_capacity_tokens=1024))


async def test_a_model_folder_without_a_config_fails_its_start_with_the_folder_named(tmp_path: Path) -> None:
    engine = HFStaticEngine(BatchingConfig(mode="static"), model=ModelRef(str(tmp_path)))
    with pytest.raises(EngineNotHealthy, match=f"cannot load the model config from {tmp_path}") as info:
        await engine.start()
    assert info.value.permanent  # a retry cannot help
