"""The two batchers behind the transformers server (:mod:`batchbench.adapters.hf_server`): static and continuous
batching over the same model, the same kernels, the same process.

- :class:`StaticBatcher` (hf-static): requests are gathered into a batch until it holds ``max_batch_size`` or
  ``batch_window_s`` after its first request arrived, left-padded to the longest prompt and run through
  ``generate()`` as one tensor with ``min_new_tokens = max_new_tokens`` = the batch's longest output, so EOS never
  ends a request early. Nothing joins a running batch; every slot decodes until the longest request is done. Pad
  tokens in prefill and the decode steps of finished slots are counted exactly per batch (:class:`BatchStat`): the
  waste continuous batching removes.
- :class:`ContinuousBatcher` (hf-continuous): transformers' own continuous batching
  (``model.init_continuous_batching()``, a paged KV cache and a scheduler stepping in a thread of its own,
  checked against transformers 5.19's ``generation/continuous_batching``): a request joins the running batch at the
  next step, a finished one leaves it, a prompt longer than the step's token budget is prefilled over several steps.

Both hand a request's decode steps to the event loop as they end (:class:`Pending`), so the server's stream code is
one for both.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from batchbench.core.clock import now

#: A request's queue carries decode steps (ints, its tokens so far) or, when its batch failed, the reason.
Step = int | str


@dataclass
class BatchStat:
    """Accounting for one padded batch, in token slots. ``size`` and ``padded_prompt_len`` are first the batch as
    formed, then the shape of the prompt tensor ``generate()`` handed its streamer (the model's own input): the pad
    fraction is what the model was given, not what the batcher meant to give it."""

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
class Pending:
    """One request waiting for, or in, a batch; its stream reads ``steps``."""

    prompt: list[int]
    max_tokens: int
    steps: asyncio.Queue[Step]
    #: Called when the client goes away: a continuous batcher frees the request's slot; a static batch cannot.
    cancel: Callable[[], None] | None = None
    #: The token ids generated, where asked for (a list: ``POST /batchbench/greedy``); None: only counted.
    tokens: list[int] | None = None


class Batcher(Protocol):
    """What the server asks of a batcher (:class:`StaticBatcher`, :class:`ContinuousBatcher`)."""

    @property
    def running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    def submit(self, prompt: list[int], max_tokens: int, *, keep_tokens: bool = False) -> Pending: ...
    def kv_usage(self) -> float | None: ...
    def kv_capacity_tokens(self) -> int | None: ...
    def failure(self) -> str | None: ...
    def begin_run(self) -> None: ...
    def report(self) -> dict[str, Any]: ...
    async def run(self) -> None: ...


class StaticBatcher:
    """Gathers requests into padded batches and runs each through ``model.generate()`` in a worker thread.

    ``model`` is a transformers causal LM (anything with its ``generate(input_ids=, attention_mask=,
    max_new_tokens=, min_new_tokens=, do_sample=, pad_token_id=, streamer=)`` and the ``device`` its inputs go
    to).
    """

    def __init__(self, model: Any, *, max_batch_size: int, batch_window_s: float, pad_token_id: int) -> None:
        self.model = model
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_s
        self.pad_token_id = pad_token_id
        self.waiting: asyncio.Queue[Pending] = asyncio.Queue()
        #: Requests in the batch being generated (0 between batches).
        self.running = 0
        self.batches: list[BatchStat] = []
        self._t0 = now()

    def submit(self, prompt: list[int], max_tokens: int, *, keep_tokens: bool = False) -> Pending:
        pending = Pending(prompt, max_tokens, asyncio.Queue(), tokens=[] if keep_tokens else None)
        self.waiting.put_nowait(pending)
        return pending

    @property
    def num_waiting(self) -> int:
        return self.waiting.qsize()

    def kv_usage(self) -> float | None:
        """None: ``generate()`` allocates each batch's cache for that batch; there is no shared pool to fill."""
        return None

    def kv_capacity_tokens(self) -> int | None:
        return None

    def failure(self) -> str | None:
        """None: a batch that raises fails its own requests and the next batch is served."""
        return None

    def begin_run(self) -> None:
        """Accounting afresh: one server serves many runs."""
        self.batches = []
        self._t0 = now()

    def report(self) -> dict[str, Any]:
        """The batches since :meth:`begin_run`, each with its pad tokens and idle decode slots, and the totals."""
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

    async def run(self) -> None:
        """Form and run batches until cancelled. A batch that raises fails its own requests, not the batcher."""
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._gather(loop)
            self.running = len(batch)
            started = now()
            plens, olens = [len(p.prompt) for p in batch], [p.max_tokens for p in batch]
            # Recorded before it runs: a request's stream ends with its own last token, so a run can end
            # while the slots of its last batch are still decoding.
            stat = BatchStat(size=len(batch), prompt_lens=plens, output_lens=olens, padded_prompt_len=max(plens),
                             decode_steps=max(olens), started_s=started - self._t0, duration_s=None)
            self.batches.append(stat)
            try:
                await asyncio.to_thread(self._generate, batch, loop, stat)
            except Exception as exc:  # whatever generate() raised is the error of the batch's requests
                if stat in self.batches:  # it was not served: it is no batch of the accounting
                    self.batches.remove(stat)
                for pending in batch:  # a stream that already ended never reads it
                    pending.steps.put_nowait(f"batch failed: {type(exc).__name__}: {exc}")
            else:
                stat.duration_s = now() - started
            finally:
                self.running = 0

    async def _gather(self, loop: asyncio.AbstractEventLoop) -> list[Pending]:
        """The next batch: the first waiting request, then more until full or the window after it closes."""
        batch = [await self.waiting.get()]
        deadline = loop.time() + self.batch_window_s
        while len(batch) < self.max_batch_size:
            timeout = deadline - loop.time()
            if timeout <= 0 and self.waiting.empty():
                break
            try:
                batch.append(await asyncio.wait_for(self.waiting.get(), max(timeout, 0)))
            except TimeoutError:
                break
        return batch

    def _generate(self, batch: list[Pending], loop: asyncio.AbstractEventLoop, stat: BatchStat) -> None:
        """Run one padded batch (in a worker thread); each decode step is handed to the loop as it ends, and the
        prompt tensor's shape to ``stat``."""
        import torch
        from transformers.generation.streamers import BaseStreamer

        pad, width = self.pad_token_id, max(len(p.prompt) for p in batch)
        rows = [[pad] * (width - len(p.prompt)) + p.prompt for p in batch]
        mask = [[0] * (width - len(p.prompt)) + [1] * len(p.prompt) for p in batch]
        steps = max(p.max_tokens for p in batch)

        def stepped(step: int, new: list[int] | None) -> None:
            for row, pending in enumerate(batch):
                if step <= pending.max_tokens:
                    if pending.tokens is not None and new is not None:
                        pending.tokens.append(new[row])
                    pending.steps.put_nowait(step)

        keep = any(p.tokens is not None for p in batch)

        def given(rows: int, width: int) -> None:
            stat.size, stat.padded_prompt_len = rows, width

        class PerStep(BaseStreamer):
            """Called once per decode step with the batch's new tokens; the first call is the prompt."""

            def __init__(self) -> None:
                self.step = -1

            def put(self, value: Any) -> None:
                self.step += 1
                if self.step:
                    loop.call_soon_threadsafe(stepped, self.step, value.reshape(-1).tolist() if keep else None)
                else:  # the prompt as the model got it: [rows, width]
                    loop.call_soon_threadsafe(given, *value.shape)

            def end(self) -> None:
                pass

        with torch.inference_mode():
            self.model.generate(
                input_ids=torch.tensor(rows, device=self.model.device),
                attention_mask=torch.tensor(mask, device=self.model.device),
                max_new_tokens=steps,
                min_new_tokens=steps,  # ignore EOS: every request gets exactly its max_tokens
                do_sample=False,
                pad_token_id=pad,
                streamer=PerStep(),
            )




class ContinuousBatcher:
    """transformers' continuous batching manager behind the same interface as :class:`StaticBatcher`.

    Its settings are the manager's (``ContinuousBatchingConfig``): ``max_requests`` requests per step at most
    (``max_requests_per_batch``), ``max_batch_tokens`` tokens per step (prefill chunks and decodes together), a KV
    cache of ``kv_blocks`` blocks of ``block_size`` tokens (None: transformers sizes it from the accelerator's free
    memory, ``memory_fraction`` of it). Block sharing across requests (transformers' prefix cache) is off: it has
    no hit counters to measure it by, and the suites replay identical prompts, so a cache would measure the replay.
    Every request decodes exactly its ``max_tokens`` (EOS is -1: never).
    A client that goes away is cancelled: its slot frees at the next step, as it would in vLLM.
    """

    def __init__(self, model: Any, *, max_requests: int | None, max_batch_tokens: int | None,
                 kv_blocks: int | None, block_size: int, memory_fraction: float | None = None) -> None:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        config = ContinuousBatchingConfig(
            page_size=block_size, num_blocks=kv_blocks, max_batch_tokens=max_batch_tokens,
            max_requests_per_batch=max_requests, max_memory_percent=memory_fraction,
            allow_block_sharing=False)
        generation = GenerationConfig(do_sample=False, eos_token_id=-1)  # -1: no EOS, every request its max_tokens
        self.manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=config)
        self.block_size = block_size
        self._ids = itertools.count()
        self._started = 0
        self._finished = 0

    def submit(self, prompt: list[int], max_tokens: int, *, keep_tokens: bool = False) -> Pending:
        pending = Pending(prompt, max_tokens, asyncio.Queue(), tokens=[] if keep_tokens else None)
        request_id = f"r{next(self._ids)}"
        pending.cancel = lambda: self.manager.cancel_request(request_id)

        def deliver(output: Any) -> None:  # on the event loop (the manager calls it with call_soon_threadsafe)
            if output.error is not None:
                pending.steps.put_nowait(f"generation failed: {output.error}")
            elif output.generated_tokens:
                if pending.tokens is not None:
                    pending.tokens[:] = output.generated_tokens
                pending.steps.put_nowait(len(output.generated_tokens))
            if output.is_finished():
                self._finished += 1

        self.manager.register_result_handler(request_id, deliver)
        if self.manager.add_request(prompt, request_id=request_id, max_new_tokens=max_tokens, streaming=True,
                                    eos_token_id=-1) is None:  # the manager refused it: its loop has stopped
            pending.steps.put_nowait(f"generation failed: {self.failure() or 'the generation loop is not running'}")
        else:
            self._started += 1
        return pending

    @property
    def running(self) -> int:
        """Requests the scheduler has admitted (prefilling or decoding)."""
        processor = self.manager.batch_processor
        return len(processor.scheduler.active_requests) if processor is not None else 0

    @property
    def num_waiting(self) -> int:
        """Requests not yet admitted: those in the manager's input queue and those its scheduler holds back."""
        processor = self.manager.batch_processor
        held = len(processor.scheduler.waiting_requests) if processor is not None else 0
        return self.manager.input_queue.qsize() + held

    def kv_usage(self) -> float | None:
        """Fraction of the paged KV cache in use (None before the first request created the cache)."""
        processor = self.manager.batch_processor
        return None if processor is None else 1.0 - float(processor.cache.compute_free_capacity())

    def kv_capacity_tokens(self) -> int | None:
        """The cache's capacity in tokens: its blocks times the tokens a block holds."""
        processor = self.manager.batch_processor
        return None if processor is None else int(processor.cache.num_blocks) * self.block_size

    def failure(self) -> str | None:
        """Why the generation loop stopped for good, if it did."""
        error = self.manager.background_thread_status.fatal_error
        return None if error is None else f"{type(error).__name__}: {error}"

    def begin_run(self) -> None:
        self._started = self._finished = 0

    def report(self) -> dict[str, Any]:
        """Requests started and finished since :meth:`begin_run`, and the cache's size."""
        return {"requests_started": self._started, "requests_finished": self._finished,
                "kv_capacity_tokens": self.kv_capacity_tokens(), "block_size": self.block_size}

    async def run(self) -> None:
        """Run the manager's generation thread until cancelled, then stop it (the requests in it fail)."""
        self.manager.start()
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.to_thread(self.manager.stop, block=True, timeout=10, hard_stop=True)
