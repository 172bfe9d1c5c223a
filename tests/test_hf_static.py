"""hf-static: real static batching over transformers generate() in a launched server, exact padding accounting."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from batchbench.adapters.base import EngineNotHealthy
from batchbench.adapters.hf_static import HFStaticEngine
from batchbench.adapters.launch.local import LocalProcess
from batchbench.adapters.registry import EngineOptions, make_engine
from batchbench.analysis.theory import decode_idle_fraction, padding_fraction
from batchbench.cli import main
from batchbench.core.config import BatchingConfig, ModelRef
from batchbench.core.exits import EXIT_OK
from batchbench.load.loadgen import LoadGenerator
from batchbench.load.runner import run
from batchbench.results.document import RunDocument
from batchbench.workload.requests import Arrival, Lengths, Request, WorkloadSpec

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[cpu]')")
pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
async def hf() -> AsyncIterator[HFStaticEngine]:
    async with HFStaticEngine(BatchingConfig(mode="static", max_batch_size=8), threads=1) as engine:
        yield engine


async def test_mixed_batch_pads_exactly_as_computed(hf: HFStaticEngine, tmp_path: Path) -> None:
    """One long prompt among seven short ones: the engine pads every short one to the long one."""
    wl = WorkloadSpec("mixed", 8, prompt=Lengths.mixed(short=6, long=96, period=8), output=Lengths.uniform(2, 20),
                      arrival=Arrival("waves", concurrency=8), seed=5).build()
    before = await hf.scrape()
    result = await run(hf, wl, results_dir=tmp_path)
    assert result.summary.ok == 8
    after = await hf.scrape()  # the engine's own count of finished requests
    assert before is not None and after is not None
    assert before.completed is not None and after.completed == before.completed + 8
    (batch,) = result.engine_report["batches"]
    prompt_lens = [r.prompt_len for r in wl.requests]
    assert sorted(batch["prompt_lens"]) == sorted(prompt_lens) and batch["padded_prompt_len"] == 96
    assert result.engine_report["prompt_pad_fraction"] == pytest.approx(padding_fraction(prompt_lens))
    assert result.engine_report["prompt_pad_tokens"] == 7 * (96 - 6)
    outputs = [r.max_tokens for r in wl.requests]
    assert result.engine_report["decode_idle_fraction"] == pytest.approx(decode_idle_fraction(outputs))
    # The server's processes are the engine's own: the machine load counts everything else, and is stored.
    stored = json.loads(result.path.read_text())
    share = result.machine.foreign_share
    assert share is not None and 0.0 <= share <= 1.0 and stored["machine"]["foreign_share"] == share
    described = stored["engine"]
    assert described["model"] == {"path": "tiny-llama", "dummy_weights": True, "seed": 0, "dtype": "bfloat16"}
    assert described["threads"] == 1 and set(described["versions"]) == {"torch", "transformers"}


async def test_every_request_gets_exactly_its_tokens(hf: HFStaticEngine) -> None:
    wl = WorkloadSpec("exact", 5, prompt=Lengths.uniform(3, 30), output=Lengths.uniform(1, 24), seed=2).build()
    records = await LoadGenerator(hf, wl).run()
    by_id = {r.request_id: r for r in records}
    for request in wl.requests:
        record = by_id[request.request_id]
        assert record.ok and record.completion_tokens == request.max_tokens == sum(record.chunk_tokens)
        assert record.prompt_tokens == request.prompt_len
        assert record.chunk_tokens == [1] * request.max_tokens  # one event per token, each counted by the engine


async def test_a_batchs_requests_get_their_first_tokens_together(hf: HFStaticEngine) -> None:
    """Static batching seen from the client: every request of a batch has its first token before any has its
    second (one decode step serves them all), and the engine ran them as one batch."""
    await hf.begin_run()
    wave = [Request(f"w-{i}", tuple(range(5, 5 + 4 * (i + 1))), 8 + 4 * i) for i in range(4)]
    times = await asyncio.gather(*(_token_times(hf, r) for r in wave))
    assert max(t[0] for t in times) < min(t[1] for t in times)
    (batch,) = (await hf.report())["batches"]
    assert batch["size"] == 4 and batch["padded_prompt_len"] == 16 and batch["prompt_pad_tokens"] == 12 + 8 + 4


async def test_a_late_request_waits_for_the_running_batch(hf: HFStaticEngine) -> None:
    """Static batching: nothing joins a batch in flight, so the latecomer's TTFT includes the rest of it."""
    await hf.begin_run()
    decoding = asyncio.Event()
    first = [Request(f"early-{i}", (5, 6, 7, 8), 48) for i in range(4)]
    late = Request("late", (5, 6, 7, 8), 2)
    tasks = [asyncio.create_task(_token_times(hf, r, decoding)) for r in first]
    await decoding.wait()  # sent once the first batch has its first token: 47 of its steps are still to come
    late_times = await _token_times(hf, late)
    early_ends = [times[-1] for times in await asyncio.gather(*tasks)]
    sizes = [b["size"] for b in (await hf.report())["batches"]]
    assert sizes == [4, 1]
    assert late_times[0] >= max(early_ends)  # its first token only after the whole first batch finished


async def _token_times(engine: HFStaticEngine, request: Request, first: asyncio.Event | None = None) -> list[float]:
    """When each of the request's tokens arrived; ``first`` is set as the first one does."""
    times = []
    async for chunk in engine.stream(request):
        if chunk.n_tokens:
            times.append(chunk.t)
            if first is not None:
                first.set()
    return times


async def test_the_engine_runs_in_a_process_of_its_own(hf: HFStaticEngine) -> None:
    assert isinstance(hf.launch, LocalProcess) and hf.launch.pid is not None
    pid = hf.launch.pid
    assert pid != os.getpid() and os.getpgid(pid) != os.getpgid(0)
    assert hf.server_process_groups() == frozenset({os.getpgid(pid)})
    assert hf.server_info is not None and hf.server_info["torch_threads"] == 1  # --threads reached torch


async def test_a_server_run_by_hand_is_reached_at_its_url(hf: HFStaticEngine) -> None:
    assert hf.base_url is not None
    at_url = make_engine("hf-static", None, EngineOptions(urls=(("hf-static", f"{hf.base_url}/v1"),)))
    assert isinstance(at_url, HFStaticEngine) and at_url.launch is None
    async with at_url:
        assert at_url.model.request_name == "tiny-llama"  # asked of the server (/v1/models)
        await at_url.begin_run()
        chunks = [c async for c in at_url.stream(Request("url-1", (5, 6, 7), 3))]
        assert sum(c.n_tokens for c in chunks) == 3
        assert (await at_url.report())["batches"][0]["output_lens"] == [3]
        assert at_url.server_process_groups() is None  # someone else's processes
    wider = HFStaticEngine(BatchingConfig(mode="static", max_batch_size=16), url=hf.base_url, startup_timeout=5)
    with pytest.raises(EngineNotHealthy, match="pads batches of 8, not 16"):
        async with wider:
            pass


def test_bench_sends_to_it_from_several_worker_processes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "--engine", "hf-static", "--input-len", "8", "--output-len", "6", "--num-requests", "16",
                 "--concurrency", "8", "--workers", "2", "--results-dir", str(tmp_path), "--no-report"])
    assert code == EXIT_OK, capsys.readouterr()
    (doc,) = tmp_path.glob("bench-*/hf-static_*.json")
    result = RunDocument.load(doc)
    assert result.header.load.workers == 2 and len(result.records) == 16 and all(r.ok for r in result.records)
    assert sum(b["size"] for b in result.footer.engine_report["batches"]) == 16


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
    assert engine.launch is not None and engine.launch.dead() == "never started"
