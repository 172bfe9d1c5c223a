"""hf-static: the classic static-batching baseline, real compute, in process.

Requests are gathered into a batch, left-padded to the longest prompt and run
through Hugging Face transformers' ``generate()`` as one tensor. Nothing joins
a running batch; every slot decodes until the longest request of the batch is
done. Pad tokens in prefill and the decode steps of finished slots are counted
exactly (see :meth:`HFStaticEngine.report`): that waste is what continuous
batching removes.

The model is the tiny Llama config in fixtures/ with seeded random weights,
so nothing is downloaded; any local Llama-style config directory works.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

from batchbench.adapters.base import (
    BatchingConfig,
    Capabilities,
    Chunk,
    Engine,
    EngineDied,
    EngineNotHealthy,
    ModelRef,
    Usage,
)
from batchbench.adapters.spec import EngineSpec
from batchbench.clock import now
from batchbench.fixtures import tiny_model_dir
from batchbench.server_metrics import ServerMetrics
from batchbench.workload import Request

#: Marks the end of one request's token stream on its queue.
_END = -1


@dataclass
class BatchStat:
    """Accounting for one padded batch, in token slots."""

    size: int
    prompt_lens: list[int]
    output_lens: list[int]
    padded_prompt_len: int
    decode_steps: int
    started_s: float
    #: None while the batch is still decoding.
    duration_s: float | None

    @property
    def prompt_pad_tokens(self) -> int:
        return self.size * self.padded_prompt_len - sum(self.prompt_lens)

    @property
    def idle_decode_slots(self) -> int:
        return self.size * self.decode_steps - sum(self.output_lens)


@dataclass
class _Pending:
    request: Request
    queue: asyncio.Queue[int]


class HFStaticEngine(Engine):
    """Static batching with padding, over transformers ``generate()``.

    BatchingConfig mapping: max_batch_size is the padded batch size (default
    8); a batch closes when it is full or ``batch_window_s`` after its first
    request arrived. max_batched_tokens, chunked prefill and KV capacity have
    no meaning here and are refused, and so is speculative decoding:
    ``generate()``'s prompt lookup (``prompt_lookup_num_tokens``) is assisted
    generation, which transformers 5.19 refuses for more than one sequence
    ("assisted generate is only supported for batch_size = 1",
    ``generation/utils.py``), so it cannot speculate over a padded batch.
    """

    name: ClassVar[str] = "hf-static"
    capabilities: ClassVar[Capabilities] = Capabilities(
        batching_modes=frozenset({"static"}), server_metrics=True, pads_batches=True
    )

    def __init__(
        self,
        batching: BatchingConfig | None = None,
        *,
        model: ModelRef | None = None,
        seed: int = 0,
        dtype: str = "bfloat16",
        batch_window_s: float = 0.02,
        threads: int | None = None,
        startup_timeout: float = 120.0,
    ) -> None:
        super().__init__(batching or BatchingConfig(mode="static", max_batch_size=8), startup_timeout=startup_timeout)
        b = self.batching
        if b.max_batched_tokens is not None or b.chunked_prefill or b.kv_capacity_tokens is not None:
            raise ValueError(
                "engine 'hf-static' pads whole batches: max_batched_tokens, chunked_prefill and "
                "kv_capacity_tokens do not apply (set only max_batch_size)"
            )
        self.max_batch_size = b.max_batch_size or 8
        #: A Llama-style config folder; its weights are always seeded random ones (nothing is downloaded).
        self.model_dir = Path(model.path) if model is not None else tiny_model_dir()
        self.seed = seed
        self.dtype = dtype
        self.batch_window_s = batch_window_s
        self.threads = threads
        self.batches: list[BatchStat] = []
        self._model: Any = None
        self._pending: asyncio.Queue[_Pending] | None = None
        self._worker: asyncio.Task[None] | None = None
        self._running = 0
        #: Requests served in full since start (the ``completed`` counter of :meth:`scrape`).
        self._completed = 0
        self._error: BaseException | None = None
        self._t0 = now()
        self.startup_s: float | None = None
        self.versions: dict[str, str] = {}

    def _load(self) -> Any:
        import torch
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM

        if self.threads:
            torch.set_num_threads(self.threads)
        config = AutoConfig.from_pretrained(self.model_dir)
        torch.manual_seed(self.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, self.dtype))
        model.eval()
        self.versions = {"torch": torch.__version__, "transformers": transformers.__version__}
        return model

    async def start(self) -> None:
        self._t0 = now()
        self._pending = asyncio.Queue()
        self._error = None
        self._completed = 0
        try:
            self._model = await asyncio.to_thread(self._load)
        except (OSError, ValueError) as exc:  # no such folder, no config.json in it, a config transformers refuses
            raise EngineNotHealthy(self.name, f"cannot load the model config from {self.model_dir}: {exc}",
                                   permanent=True) from exc
        self._worker = asyncio.create_task(self._batch_loop(), name="hf-static-batcher")
        self.startup_s = now() - self._t0

    async def wait_healthy(self, timeout: float) -> None:
        if self._model is None:
            raise EngineNotHealthy(self.name, "model not loaded (start() not called or failed)")
        if self._worker is None or self._worker.done():
            raise EngineDied(self.name, f"batcher is not running: {self._error!r}")

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
            self._worker = None
        self._model = None

    async def _batch_loop(self) -> None:
        assert self._pending is not None
        loop = asyncio.get_running_loop()
        try:
            while True:
                batch = [await self._pending.get()]
                deadline = loop.time() + self.batch_window_s
                while len(batch) < self.max_batch_size:
                    timeout = deadline - loop.time()
                    if timeout <= 0 and self._pending.empty():
                        break
                    try:
                        batch.append(await asyncio.wait_for(self._pending.get(), max(timeout, 0)))
                    except TimeoutError:
                        break
                self._running = len(batch)
                started = now()
                plens, olens = [p.request.prompt_len for p in batch], [p.request.max_tokens for p in batch]
                # Recorded before it runs: a request's stream ends with its own last token, so a run
                # can end while the slots of its last batch are still decoding.
                stat = BatchStat(size=len(batch), prompt_lens=plens, output_lens=olens, padded_prompt_len=max(plens),
                                 decode_steps=max(olens), started_s=started - self._t0, duration_s=None)
                self.batches.append(stat)
                await asyncio.to_thread(self._generate, batch, loop)
                stat.duration_s = now() - started
                self._running = 0
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the batcher dying must fail every waiting request, not hang them
            self._error = exc
            while self._pending is not None and not self._pending.empty():
                self._pending.get_nowait().queue.put_nowait(_END)
            raise

    def _generate(self, batch: list[_Pending], loop: asyncio.AbstractEventLoop) -> None:
        """Run one padded batch; push each request's tokens to its queue as they are decoded."""
        import torch
        from transformers.generation.streamers import BaseStreamer

        pad = self._model.config.pad_token_id or 0
        width = max(p.request.prompt_len for p in batch)
        rows = [[pad] * (width - p.request.prompt_len) + list(p.request.prompt_token_ids) for p in batch]
        mask = [[0] * (width - p.request.prompt_len) + [1] * p.request.prompt_len for p in batch]
        steps = max(p.request.max_tokens for p in batch)
        wants = [p.request.max_tokens for p in batch]

        class _PerStep(BaseStreamer):
            """Receives one token per slot per decode step; the first put is the prompt."""

            def __init__(self) -> None:
                self.step = -1

            def put(self, value: Any) -> None:
                self.step += 1
                if self.step == 0:
                    return
                for i, p in enumerate(batch):
                    if self.step <= wants[i]:
                        loop.call_soon_threadsafe(p.queue.put_nowait, self.step)
                        if self.step == wants[i]:
                            loop.call_soon_threadsafe(p.queue.put_nowait, _END)

            def end(self) -> None:
                pass

        streamer = _PerStep()
        with torch.inference_mode():
            self._model.generate(
                input_ids=torch.tensor(rows),
                attention_mask=torch.tensor(mask),
                max_new_tokens=steps,
                min_new_tokens=steps,  # ignore EOS: every request gets exactly its max_tokens
                do_sample=False,
                pad_token_id=pad,
                streamer=streamer,
            )

    async def stream(self, request: Request) -> AsyncIterator[Chunk]:
        if self._pending is None or self._worker is None or self._worker.done():
            raise EngineDied(self.name, f"not running ({self._error!r})", request_id=request.request_id)
        queue: asyncio.Queue[int] = asyncio.Queue()
        await self._pending.put(_Pending(request, queue))
        produced = 0
        while True:
            item = await queue.get()
            t = now()
            if item == _END:
                break
            produced += 1
            yield Chunk(t=t, n_tokens=1)
        if produced < request.max_tokens:
            raise EngineDied(self.name, f"batcher failed: {self._error!r}", request_id=request.request_id)
        self._completed += 1
        yield Chunk(t=now(), n_tokens=0, usage=Usage(request.prompt_len, produced), finish_reason="length")

    async def scrape(self) -> ServerMetrics:
        return ServerMetrics(
            t=now(), running=float(self._running),
            waiting=float(self._pending.qsize()) if self._pending is not None else None,
            completed=float(self._completed),
        )

    def describe(self) -> dict[str, Any]:
        return {
            "engine": self.name,
            "batching": self.batching.to_dict(),
            "model": {"path": self.model_dir.name, "dummy_weights": True, "seed": self.seed, "dtype": self.dtype},
            "batch_window_s": self.batch_window_s,
            "versions": self.versions,
            "startup_s": self.startup_s,
        }

    def report(self) -> dict[str, Any]:
        pad = sum(b.prompt_pad_tokens for b in self.batches)
        prompt_slots = sum(b.size * b.padded_prompt_len for b in self.batches)
        idle = sum(b.idle_decode_slots for b in self.batches)
        decode_slots = sum(b.size * b.decode_steps for b in self.batches)
        return {
            "batches": [asdict(b) | {"prompt_pad_tokens": b.prompt_pad_tokens,
                                     "idle_decode_slots": b.idle_decode_slots} for b in self.batches],
            "prompt_pad_tokens": pad,
            "prompt_pad_fraction": pad / prompt_slots if prompt_slots else None,
            "idle_decode_slots": idle,
            "decode_idle_fraction": idle / decode_slots if decode_slots else None,
        }

    def begin_run(self) -> None:
        self.batches = []
        self._t0 = now()


SPEC = EngineSpec(
    name="hf-static",
    engine_class=HFStaticEngine,
    summary="transformers generate() over left-padded batches: real static batching with real padding, in process",
    embedded=True,
    in_process=True,
    container=False,
)
