"""What suites ask engines instead of their names: counters, KV layout, config checks, merged capabilities."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import ClassVar

import pytest

from batchbench.adapters.base import Chunk, Engine
from batchbench.adapters.hf_static import HFStaticEngine
from batchbench.adapters.prometheus import Samples
from batchbench.adapters.registry import specs
from batchbench.adapters.router import RoutedEngine
from batchbench.adapters.tgi import TGIEngine
from batchbench.adapters.trtllm import TRTLLMEngine
from batchbench.adapters.vllm import VLLMEngine
from batchbench.core.clock import now
from batchbench.core.config import BatchingConfig, Capabilities, KVLayout, ModelRef
from batchbench.core.server_metrics import ServerMetrics
from batchbench.fixtures import wire_dir
from batchbench.workload.requests import Request

MODEL = ModelRef("m", max_model_len=2048)

VLLM_METRICS = """\
vllm:num_requests_running{model_name="m"} 2.0
vllm:request_success_total{finished_reason="length",model_name="m"} 40.0
vllm:request_success_total{finished_reason="stop",model_name="m"} 2.0
vllm:request_success_created{finished_reason="stop",model_name="m"} 1.7e9
"""


def test_every_adapter_says_how_many_requests_its_engine_finished() -> None:
    vllm = VLLMEngine(model=MODEL, url="http://vllm.test").normalize(Samples.parse(VLLM_METRICS))
    assert vllm.completed == 42  # every finish reason
    tgi = TGIEngine(model=MODEL, url="http://tgi.test")
    assert tgi.normalize(Samples.parse((wire_dir("tgi") / "metrics.prom").read_text())).completed == 31
    trtllm = TRTLLMEngine(model=MODEL, url="http://trtllm.test", metrics_source="prometheus")
    prom = (wire_dir("trtllm") / "prometheus_metrics.prom").read_text()
    assert trtllm.normalize(Samples.parse(prom)).completed == 31
    # The iteration statistics are drained per read: no cumulative count comes from there.
    assert TRTLLMEngine(model=MODEL, url="http://trtllm.test").normalize_iterations([]).completed is None


class Counting(Engine):
    name: ClassVar[str] = "counting"
    capabilities: ClassVar[Capabilities] = Capabilities(chunked_prefill=True, prefill_chunk_cap=True)

    def __init__(self, completed: float | None, groups: frozenset[int] | None = frozenset()) -> None:
        super().__init__()
        self.completed, self.groups = completed, groups

    async def start(self) -> None: ...

    async def wait_healthy(self, timeout: float) -> None: ...

    async def stop(self) -> None: ...

    async def stream(self, request: Request) -> AsyncIterator[Chunk]:
        yield Chunk(now(), 1)

    async def scrape(self) -> ServerMetrics:
        return ServerMetrics(t=now(), completed=self.completed)

    def server_process_groups(self) -> frozenset[int] | None:
        return self.groups


async def test_the_router_sums_its_pools_counts_and_keeps_their_prefill_cap() -> None:
    a, b = Counting(3), Counting(4)
    router = RoutedEngine({"interactive": a, "batch": b})
    sample = await router.scrape()
    assert sample is not None and sample.completed == 7
    assert router.capabilities.prefill_chunk_cap and router.capabilities.chunked_prefill
    # A layout caps prefill chunks only if every pool does.
    uncapped = dataclasses.replace(Counting.capabilities, prefill_chunk_cap=False)

    class Uncapped(Counting):
        capabilities: ClassVar[Capabilities] = uncapped

    assert not RoutedEngine({"interactive": a, "batch": Uncapped(1)}).capabilities.prefill_chunk_cap


def test_the_router_owns_its_pools_processes() -> None:
    assert RoutedEngine({"a": Counting(0, frozenset({11})), "b": Counting(0, frozenset({12}))}
                        ).server_process_groups() == {11, 12}
    assert RoutedEngine({"a": Counting(0, frozenset({11})), "b": Counting(0, None)}).server_process_groups() is None


def test_a_kv_layout_predicts_the_reported_capacity() -> None:
    assert KVLayout(32).reported_capacity(100) == 96  # whole blocks
    assert KVLayout(32).blocks(100) == 4  # asked for: rounded up
    assert KVLayout(128, 2048, reports_full_length_requests=True).reported_capacity(1 << 20) == 1 << 20
    assert KVLayout(32, 200, reports_full_length_requests=True).reported_capacity(66 * 32) == 1885
    with pytest.raises(ValueError, match="needs max_model_len"):
        KVLayout(32, reports_full_length_requests=True)


def test_the_engines_own_kv_layout_and_space() -> None:
    local = VLLMEngine(BatchingConfig(kv_capacity_tokens=4096), model=MODEL, launch=object(),  # type: ignore[arg-type]
                       cpu_kv_cache_gib=1.0)
    assert local.kv_layout() == KVLayout(32, 2048, reports_full_length_requests=True)
    assert local.kv_space_bytes() == 1 << 30
    default = VLLMEngine(model=MODEL, launch=object(), cpu_kv_cache_gib=1.0)  # type: ignore[arg-type]
    layout = default.kv_layout()
    assert layout is not None and layout.block_tokens == 128
    at_url = VLLMEngine(model=MODEL, url="http://vllm.test", cpu_kv_cache_gib=1.0)
    assert at_url.kv_space_bytes() is None  # whoever runs it chose its KV space
    assert VLLMEngine(model=MODEL, url="http://vllm.test").kv_layout() is None  # sized from accelerator memory
    assert HFStaticEngine().kv_layout() is None and HFStaticEngine().kv_space_bytes() is None
    log = "INFO ... Overriding num_gpu_blocks=32768 with num_gpu_blocks_override=66\n"
    assert VLLMEngine.kv_block_override(log) == (32768, 66) and VLLMEngine.kv_block_override("nothing") is None
    assert HFStaticEngine.kv_block_override(log) is None


@pytest.mark.parametrize(("config", "refused"), [
    (BatchingConfig(max_batched_tokens=512, chunked_prefill=False), "chunked prefill off"),
    (BatchingConfig(max_batched_tokens=8, max_batch_size=16), "must be >= max_batch_size"),
    (BatchingConfig(prefill_chunk_tokens=4096), "cannot exceed max_model_len"),
    (BatchingConfig(kv_capacity_tokens=2048), "below max_model_len"),
    (BatchingConfig(max_batched_tokens=2048, chunked_prefill=False), None),
    (BatchingConfig(max_batched_tokens=512), None),  # chunking left to the engine
    (BatchingConfig(kv_capacity_tokens=2080), None),
])
def test_config_checks_say_before_a_launch_what_the_engine_refuses(config: BatchingConfig, refused: str | None) -> None:
    if refused is None:
        VLLMEngine.check_config(config, max_model_len=2048)
        VLLMEngine(config, model=MODEL, url="http://vllm.test")
    else:
        with pytest.raises(ValueError, match=refused):
            VLLMEngine.check_config(config, max_model_len=2048)
        with pytest.raises(ValueError, match=refused):
            VLLMEngine(config, model=MODEL, url="http://vllm.test")
    assert VLLMEngine.min_kv_capacity_tokens(2048) == 2080
    assert HFStaticEngine.min_kv_capacity_tokens(2048) == 2048


def test_static_batching_is_asked_of_the_spec() -> None:
    for spec in specs().values():
        config = spec.batch_of(8)
        if spec.engine_class.capabilities.pads_batches:
            assert config == BatchingConfig(mode="static", max_batch_size=8)
        if "continuous" in spec.engine_class.capabilities.batching_modes:
            assert config is None
