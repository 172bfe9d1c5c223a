"""llama.cpp's recorded wire format (``fixtures/wire/llamacpp/``, captured from llama-server 0c1e57098) read by the
generic engine and by the ``llamacpp`` adapter, without a server: usage on the last choice event, and a streamed
event that carries two tokens (a UTF-8 character split over them) counted from the server's ``timings``."""

from __future__ import annotations

from batchbench.adapters.base import Usage
from batchbench.adapters.generic import OpenAIServerEngine
from batchbench.adapters.llamacpp import LlamaCppEngine
from batchbench.adapters.prometheus import Samples
from batchbench.core.config import BatchingConfig, ModelRef
from batchbench.fixtures import wire_dir
from batchbench.workload.requests import Request
from tests.adapter_helpers import collect, replay

WIRE = wire_dir("llamacpp")
TINY = ModelRef("tiny.gguf", served_name="tiny.gguf", max_model_len=256)
#: The recorded request: 8 prompt tokens, 16 output tokens (fixtures/wire/llamacpp/README.md).
REQUEST = Request("r-1", (1, 2, 3, 4, 5, 6, 7, 8), 16)


async def test_the_generic_engine_takes_the_totals_from_the_last_choice_event() -> None:
    engine = OpenAIServerEngine(model=TINY, url="http://engine.test")
    replay(engine, (WIRE / "completions_stream.sse").read_bytes())
    chunks = await collect(engine, REQUEST)
    # 15 text events for 16 tokens (one carried two): one per event, then the final event's usage, a running total
    # of 16, adds the one missed there. The totals are the engine's own.
    tokens = [c.n_tokens for c in chunks if c.usage is None]
    assert tokens == [1] * 16
    assert chunks[-1].usage == Usage(8, 16, source="engine-last-choice", timings={
        "cache_n": 0, "prompt_n": 8, "prompt_ms": 1.25, "predicted_n": 16, "predicted_ms": 3.843})


async def test_the_llamacpp_engine_counts_each_event_from_the_servers_timings() -> None:
    engine = LlamaCppEngine(BatchingConfig(max_batch_size=4, kv_capacity_tokens=1024), model=TINY,
                            url="http://engine.test")
    replay(engine, (WIRE / "completions_stream_timings.sse").read_bytes())
    chunks = await collect(engine, REQUEST)
    tokens = [c.n_tokens for c in chunks if c.usage is None]
    assert sum(tokens) == 16 and 2 in tokens  # the event whose predicted_n rose by two
    # The server's own timing of the request comes with its totals.
    assert chunks[-1].usage == Usage(8, 16, source="engine-last-choice", timings={
        "cache_n": 7, "prompt_n": 1, "prompt_ms": 0.657, "predicted_n": 16, "predicted_ms": 4.619})


def test_its_metrics_map_to_batchbenchs_names() -> None:
    engine = LlamaCppEngine(BatchingConfig(max_batch_size=4, kv_capacity_tokens=2048), model=TINY,
                            url="http://engine.test")
    sample = engine.normalize(Samples.parse((WIRE / "metrics.prom").read_text()))
    assert sample.running is not None and sample.waiting is not None and sample.kv_usage is not None
    assert 0 <= sample.kv_usage <= 1 and sample.kv_usage == min(1.0, sample.running / 4)
