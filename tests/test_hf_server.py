"""hf-static's server program (adapters/hf_server.py) over a stand-in model: its routes, its accounting, its failures.

The stand-in's ``generate()`` makes the calls transformers makes of the streamer (the prompt, then one call per
decode step) without computing anything, so the batcher, the stream and the error paths are tested here in
seconds, without starting an engine; tests/test_hf_static.py runs the real model in a launched server.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from batchbench.adapters.base import EngineHTTPError
from batchbench.adapters.hf_batchers import StaticBatcher
from batchbench.adapters.hf_server import ServerInfo, make_app, serve
from batchbench.adapters.hf_static import HFStaticEngine
from batchbench.adapters.http import make_client
from batchbench.core.clock import now
from batchbench.core.config import BatchingConfig
from batchbench.workload.requests import Request
from tests.adapter_helpers import scrape_until

pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[cpu]')")
pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[cpu]')")

BATCH = 4
INFO = ServerInfo(model="stand-in", served_model_name="stand-in", vocab_size=64, max_model_len=512, seed=0,
                  dtype="bfloat16", max_batch_size=BATCH, batch_window_s=0.05, threads=None, torch_threads=None,
                  versions={}, device="cpu", import_s=None, build_s=None)


@dataclass
class StandIn:
    """``generate()`` as the batcher calls it: one streamer call per step, ``step_s`` apart; the first call
    made raises after ``fail_after`` steps when that is set; ``hold`` keeps every call at its first step."""

    step_s: float = 0.005
    device: str = "cpu"
    fail_after: int | None = None
    hold: threading.Event = field(default_factory=threading.Event)
    calls: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.hold.set()

    def generate(self, *, input_ids: Any, streamer: Any, max_new_tokens: int, **options: Any) -> None:
        self.calls.append({"rows": input_ids.tolist(), "max_new_tokens": max_new_tokens, **options})
        streamer.put(input_ids)
        for step in range(1, max_new_tokens + 1):
            if step == 2:
                self.hold.wait(10)
            if len(self.calls) == 1 and step == self.fail_after:
                raise RuntimeError("boom")
            threading.Event().wait(self.step_s)
            streamer.put(input_ids[:, -1])
        streamer.end()


@pytest.fixture
def model() -> StandIn:
    return StandIn()


@pytest.fixture
async def hf(model: StandIn) -> AsyncIterator[HFStaticEngine]:
    batcher = StaticBatcher(model, max_batch_size=BATCH, batch_window_s=INFO.batch_window_s, pad_token_id=0)
    runner, url = await serve(make_app(batcher, INFO), "127.0.0.1", 0)
    try:
        engine = HFStaticEngine(BatchingConfig(mode="static", max_batch_size=BATCH), url=url, startup_timeout=5)
        async with engine:
            yield engine
    finally:
        await runner.cleanup()


async def _stream(engine: HFStaticEngine, request: Request) -> list[int]:
    return [chunk.n_tokens async for chunk in engine.stream(request)]


async def test_a_padded_batch_streams_each_request_its_tokens_and_is_accounted_exactly(
        hf: HFStaticEngine, model: StandIn) -> None:
    await hf.begin_run()
    wave = [Request(f"r{i}", (1,) * (2 + 3 * i), 1 + 2 * i) for i in range(BATCH)]
    streams = await asyncio.gather(*(_stream(hf, r) for r in wave))
    for request, tokens in zip(wave, streams):
        assert tokens == [1] * request.max_tokens + [0]  # a token per event, then the usage-only event
    (call,) = model.calls
    assert call["max_new_tokens"] == call["min_new_tokens"] == 7 and call["pad_token_id"] == 0
    assert call["rows"][0] == [0] * 9 + [1] * 2 and call["attention_mask"].tolist()[0] == [0] * 9 + [1] * 2
    # The streams end with their last tokens, a moment before generate() returns and the batch's duration is set.
    deadline = now() + 5
    while (report := await hf.report())["batches"][0]["duration_s"] is None and now() < deadline:
        await asyncio.sleep(0.01)
    (batch,) = report["batches"]
    assert batch["padded_prompt_len"] == 11 and batch["duration_s"] > 0
    assert report["prompt_pad_tokens"] == 9 + 6 + 3 and report["prompt_pad_fraction"] == 18 / 44
    assert report["idle_decode_slots"] == 6 + 4 + 2 and report["decode_idle_fraction"] == 12 / 28
    await hf.begin_run()
    assert (await hf.report())["batches"] == []


async def test_a_batch_that_raises_fails_its_requests_at_once_and_the_next_batch_is_served(
        hf: HFStaticEngine, model: StandIn) -> None:
    model.fail_after = 3
    await hf.begin_run()
    started = now()
    results = await asyncio.gather(*(_stream(hf, Request(f"f{i}", (1, 2), 8)) for i in range(3)),
                                   return_exceptions=True)
    assert now() - started < 2.0
    for error in results:
        assert isinstance(error, EngineHTTPError) and error.status == 500
        assert "batch failed: RuntimeError: boom" in str(error)
    assert await _stream(hf, Request("after", (1, 2), 2)) == [1, 1, 0]
    assert [b["size"] for b in (await hf.report())["batches"]] == [1]  # the failed batch served nothing


async def test_the_metrics_show_the_running_batch_and_the_requests_waiting(
        hf: HFStaticEngine, model: StandIn) -> None:
    model.hold.clear()
    tasks = [asyncio.create_task(_stream(hf, Request(f"m{i}", (1, 2), 3))) for i in range(BATCH + 2)]
    try:
        sample = await scrape_until(hf, lambda m: m.running == BATCH, every_s=0.01)
        assert sample is not None and (sample.running, sample.waiting) == (BATCH, 2)
    finally:
        model.hold.set()
    await asyncio.gather(*tasks)
    # The last batch's streams end with their tokens, a moment before generate() returns and its slots are free.
    idle = await scrape_until(hf, lambda m: not m.running, every_s=0.01)
    assert idle is not None and (idle.running, idle.waiting, idle.completed) == (0, 0, BATCH + 2)


@pytest.mark.parametrize(("body", "message"), [
    (b'{"prompt": [1, 64], "max_tokens": 2, "stream": true}', "token ids in [0, 64)"),
    (b'{"prompt": [], "max_tokens": 2, "stream": true}', "non-empty list"),
    (b'{"prompt": [1], "max_tokens": 0, "stream": true}', "max_tokens must be a positive integer"),
    (b'{"prompt": [1], "max_tokens": 2}', "only streams"),
    (b"not json", "the request body is not JSON"),
])
async def test_a_request_it_cannot_serve_is_a_400_saying_why(hf: HFStaticEngine, body: bytes, message: str) -> None:
    assert hf.base_url is not None
    async with make_client(hf.base_url) as client, client.request("POST", "/v1/completions", body=body) as response:
        assert response.status == 400
        doc = await response.json()
    assert doc["error"]["code"] == 400 and message in doc["error"]["message"]


async def test_the_adapter_describes_what_the_server_runs(hf: HFStaticEngine) -> None:
    described = hf.describe()
    assert described["model"]["path"] == "stand-in" and described["batch_window_s"] == INFO.batch_window_s
    assert described["mode"] == "url" and hf.model.request_name == "stand-in"
    args = HFStaticEngine(BatchingConfig(mode="static", max_batch_size=16), threads=2).server_args(
        BatchingConfig(), host="127.0.0.1", port=5)
    assert args[args.index("--max-batch-size") + 1] == "16" and args[args.index("--threads") + 1] == "2"


def test_the_8b_shaped_gpu_default_builds_as_llama_3_8b_where_it_is_asked_to() -> None:
    """Built on the meta device (no memory), the shipped 8B-shaped config is Meta-Llama-3-8B's 8.03 B parameters in
    bf16: the model the server makes on a GPU with seeded random weights (never materialised here)."""
    from batchbench.adapters.hf_server import build_model
    from batchbench.fixtures import gpu_model_dir

    model, built = build_model(gpu_model_dir(), seed=0, dtype="bfloat16", threads=None, device="meta")
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    assert built["device"] == "meta" and str(model.dtype) == "torch.bfloat16"
    assert (built["vocab_size"], built["max_model_len"], built["pad_token_id"]) == (128_256, 8192, 0)
