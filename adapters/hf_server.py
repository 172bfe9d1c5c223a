"""hf-static's server: static batching over transformers ``generate()``, in a process of its own.

``python -m batchbench.adapters.hf_server --model DIR [--max-batch-size 8] [--batch-window-s 0.02]
[--threads T] [--dtype bfloat16] [--device auto] [--seed 0] [--host 127.0.0.1] [--port 0]``

Why a process: run inside the load generator, the model's steps held the GIL that the event loop stamping
every chunk needs, so the client's clock was the engine's. Served over HTTP, hf-static is timed on the
client's clock exactly as vLLM is (:class:`batchbench.adapters.hf_static.HFStaticEngine`).

The batcher (:class:`StaticBatcher`): requests are gathered into a batch until it holds ``max_batch_size``
or ``batch_window_s`` after its first request arrived, left-padded to the longest prompt and run through
``generate()`` as one tensor with ``min_new_tokens = max_new_tokens`` = the batch's longest output, so
EOS never ends a request early. Nothing joins a running batch; every slot decodes until the longest
request is done, and each request is served exactly its ``max_tokens``. Pad tokens in prefill and the
decode steps of finished slots are counted exactly per batch (:class:`BatchStat`): the waste continuous
batching removes. The weights are seeded random ones of the Llama-style config in ``--model`` (a folder
with a config.json), made where they are used (``--device``: the first visible GPU when torch sees one, else the
CPU; made on the GPU itself, an 8B model's 16 GB of bf16 never pass through host memory); nothing is downloaded.

Routes, on aiohttp.web:

- ``POST /v1/completions``: the OpenAI completions stream as vLLM 0.32 writes it (the fields
  :mod:`batchbench.adapters.openai_compat` reads): the prompt as a list of token ids, ``max_tokens``,
  ``stream: true``; one event per token per request as each decode step ends (the generate thread hands
  each step to the event loop with ``call_soon_threadsafe``), with the running ``usage.completion_tokens``
  under ``stream_options.continuous_usage_stats``, ``finish_reason: "length"`` on the last, a usage-only
  event under ``stream_options.include_usage``, then ``data: [DONE]``. It serves one model and does not
  check the request's ``model``. A request it cannot serve is a 400 with vLLM's error body; a batch that
  raises ends each of its streams with vLLM's in-stream error event (code 500).
- ``GET /health``; ``GET /v1/models``; ``GET /metrics``: Prometheus text, ``batchbench_hf_num_requests_running``,
  ``batchbench_hf_num_requests_waiting`` (gauges) and ``batchbench_hf_request_success_total`` (a counter).
- ``GET /batchbench/report``: the batches since ``POST /batchbench/begin_run`` (:meth:`StaticBatcher.report`);
  ``GET /batchbench/info``: the server's settings, package versions and start-up times.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from batchbench.core import eventloop
from batchbench.core.clock import now

#: A request's queue carries decode steps (ints, its tokens so far) or, when its batch failed, the reason.
Step = int | str


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
class Pending:
    """One request waiting for, or in, a batch; its stream reads ``steps``."""

    prompt: list[int]
    max_tokens: int
    steps: asyncio.Queue[Step]


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

    def submit(self, prompt: list[int], max_tokens: int) -> Pending:
        pending = Pending(prompt, max_tokens, asyncio.Queue())
        self.waiting.put_nowait(pending)
        return pending

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
                await asyncio.to_thread(self._generate, batch, loop)
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

    def _generate(self, batch: list[Pending], loop: asyncio.AbstractEventLoop) -> None:
        """Run one padded batch (in a worker thread); each decode step is handed to the loop as it ends."""
        import torch
        from transformers.generation.streamers import BaseStreamer

        pad, width = self.pad_token_id, max(len(p.prompt) for p in batch)
        rows = [[pad] * (width - len(p.prompt)) + p.prompt for p in batch]
        mask = [[0] * (width - len(p.prompt)) + [1] * len(p.prompt) for p in batch]
        steps = max(p.max_tokens for p in batch)

        def stepped(step: int) -> None:
            for pending in batch:
                if step <= pending.max_tokens:
                    pending.steps.put_nowait(step)

        class PerStep(BaseStreamer):
            """Called once per decode step with the batch's new tokens; the first call is the prompt."""

            def __init__(self) -> None:
                self.step = -1

            def put(self, value: Any) -> None:
                self.step += 1
                if self.step:
                    loop.call_soon_threadsafe(stepped, self.step)

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


class _Events:
    """One request's stream events, as vLLM 0.32 serializes a completions stream (``CompletionStreamResponse``)."""

    def __init__(self, model: str, prompt_tokens: int, *, continuous: bool) -> None:
        self.head = b'data: {"id":"cmpl-%s","object":"text_completion","created":%d,"model":%s,"choices":' % (
            os.urandom(8).hex().encode(), int(time.time()), orjson.dumps(model))
        self.prompt_tokens, self.continuous = prompt_tokens, continuous

    def _usage(self, n: int) -> bytes:
        return b'{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d}' % (
            self.prompt_tokens, self.prompt_tokens + n, n)

    def token(self, n: int, last: bool) -> bytes:
        usage = b',"usage":' + self._usage(n) if self.continuous else b""
        finish = b'"length"' if last else b"null"
        return b'%s[{"index":0,"text":"","logprobs":null,"finish_reason":%s,"stop_reason":null}]%s}\n\n' % (
            self.head, finish, usage)

    def usage(self, n: int) -> bytes:
        return b'%s[],"usage":%s}\n\n' % (self.head, self._usage(n))


def _error_body(status: int, message: str, kind: str) -> dict[str, Any]:
    """vLLM's ErrorResponse."""
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def _bad_request(message: str) -> web.Response:
    return web.json_response(_error_body(400, message, "BadRequestError"), status=400, dumps=_dumps)


def _dumps(doc: Any) -> str:
    return orjson.dumps(doc).decode()


def _parse(body: Any, vocab_size: int) -> tuple[list[int], int, dict[str, Any]]:
    """(prompt ids, max_tokens, stream_options) of a completions request; ValueError saying what is wrong."""
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    prompt, max_tokens = body.get("prompt"), body.get("max_tokens")
    if not (isinstance(prompt, list) and prompt and all(type(t) is int and 0 <= t < vocab_size for t in prompt)):
        raise ValueError(f"prompt must be a non-empty list of token ids in [0, {vocab_size})")
    if type(max_tokens) is not int or max_tokens < 1:
        raise ValueError("max_tokens must be a positive integer")
    if body.get("stream") is not True:
        raise ValueError("this server only streams: give stream: true")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ValueError("stream_options must be an object")
    return prompt, max_tokens, options


@dataclass(frozen=True)
class ServerInfo:
    """What ``GET /batchbench/info`` answers: the settings the server runs with, for the adapter's describe()."""

    model: str
    served_model_name: str
    vocab_size: int
    max_model_len: int | None
    seed: int
    dtype: str
    max_batch_size: int
    batch_window_s: float
    threads: int | None
    torch_threads: int | None
    versions: dict[str, str]
    #: Where the model runs (``cpu``, ``cuda:0``).
    device: str
    #: Seconds to import torch and transformers, and to build the model from its config.
    import_s: float | None
    build_s: float | None


def make_app(batcher: StaticBatcher, info: ServerInfo) -> web.Application:
    """The routes of the module docstring over ``batcher``; the batcher runs while the app does."""
    registry = CollectorRegistry()
    Gauge("batchbench_hf_num_requests_running", "Requests in the batch being generated",
          registry=registry).set_function(lambda: batcher.running)
    Gauge("batchbench_hf_num_requests_waiting", "Requests waiting for a batch",
          registry=registry).set_function(lambda: batcher.waiting.qsize())
    success = Counter("batchbench_hf_request_success", "Requests served in full", registry=registry)
    done = b"data: [DONE]\n\n"

    async def completions(request: web.Request) -> web.StreamResponse:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            return _bad_request(f"the request body is not JSON: {exc}")
        try:
            prompt, max_tokens, options = _parse(body, info.vocab_size)
        except ValueError as exc:
            return _bad_request(str(exc))
        events = _Events(info.served_model_name, len(prompt), continuous=bool(options.get("continuous_usage_stats")))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        pending = batcher.submit(prompt, max_tokens)
        try:
            while True:
                step = await pending.steps.get()
                if isinstance(step, str):
                    await response.write(b"data: %s\n\n" % orjson.dumps(_error_body(500, step, "InternalServerError")))
                    break
                await response.write(events.token(step, step == max_tokens))
                if step == max_tokens:
                    if options.get("include_usage"):
                        await response.write(events.usage(step))
                    success.inc()
                    break
            await response.write(done)
            await response.write_eof()
        except ConnectionError:  # the client went away; its slot decodes on (nothing leaves a static batch)
            pass
        return response

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(_: web.Request) -> web.Response:
        card = {"id": info.served_model_name, "object": "model", "created": int(time.time()),
                "owned_by": "batchbench", "root": info.model, "parent": None, "max_model_len": info.max_model_len}
        return web.json_response({"object": "list", "data": [card]}, dumps=_dumps)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def report(_: web.Request) -> web.Response:
        return web.json_response(batcher.report(), dumps=_dumps)

    async def begin_run(_: web.Request) -> web.Response:
        batcher.begin_run()
        return web.json_response({"ok": True})

    async def describe(_: web.Request) -> web.Response:
        return web.json_response(asdict(info), dumps=_dumps)

    async def batching(app: web.Application) -> Any:
        task = asyncio.create_task(batcher.run(), name="hf-static-batcher")
        yield
        task.cancel()

    app = web.Application()
    app.add_routes([web.post("/v1/completions", completions), web.get("/health", health),
                    web.get("/v1/models", models), web.get("/metrics", metrics),
                    web.get("/batchbench/report", report), web.post("/batchbench/begin_run", begin_run),
                    web.get("/batchbench/info", describe)])
    app.cleanup_ctx.append(batching)
    return app


async def serve(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, str]:
    """Start serving ``app``; (its runner, to clean up, and its base URL: the port chosen when ``port`` is 0)."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=2048)  # a burst of connects beyond asyncio's 100 would lose SYNs
    await site.start()
    bound_host, bound_port = runner.addresses[0][:2]
    return runner, f"http://{bound_host}:{bound_port}"


def build_model(model_dir: Path, *, seed: int, dtype: str, threads: int | None,
                device: str = "auto") -> tuple[Any, dict[str, Any]]:
    """The causal LM of ``model_dir``'s config with seeded random weights, made on ``device`` (``auto``: the first
    visible GPU where torch sees one, else the CPU), and what :class:`ServerInfo` takes from it (versions, thread
    count, device, import and build times)."""
    started = now()
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    imported = now()
    if threads:
        torch.set_num_threads(threads)
    config = AutoConfig.from_pretrained(model_dir)
    where = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    torch.manual_seed(seed)  # seeds every device's generator
    with where:  # parameters are allocated and initialised there
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.eval()
    return model, {
        "vocab_size": config.vocab_size, "max_model_len": getattr(config, "max_position_embeddings", None),
        "pad_token_id": config.pad_token_id or 0, "torch_threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "device": str(next(model.parameters()).device), "import_s": imported - started, "build_s": now() - imported,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m batchbench.adapters.hf_server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path, help="a Llama-style config folder (config.json)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model /v1/models lists (default: the folder's name)")
    parser.add_argument("--max-batch-size", type=int, default=8, help="requests per padded batch")
    parser.add_argument("--batch-window-s", type=float, default=0.02,
                        help="how long a batch waits for more requests after its first")
    parser.add_argument("--threads", type=int, default=None, help="torch's threads (and OMP_NUM_THREADS)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="auto",
                        help="where the model runs: auto (the first visible GPU, else the CPU), cpu, cuda, cuda:N")
    parser.add_argument("--seed", type=int, default=0, help="seeds the random weights")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on start)")
    args = parser.parse_args(argv)
    if args.max_batch_size < 1 or args.batch_window_s < 0 or (args.threads is not None and args.threads < 1):
        parser.error("--max-batch-size and --threads must be at least 1, --batch-window-s not negative")
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # read by torch's OpenMP when it is imported
    if not (args.model / "config.json").is_file():
        sys.exit(f"hf-static server: cannot load the model config from {args.model}: no config.json there")
    print(f"hf-static server: building {args.model.name} with seeded random weights", flush=True)
    try:
        model, built = build_model(args.model, seed=args.seed, dtype=args.dtype, threads=args.threads,
                                   device=args.device)
    except (OSError, ValueError, AttributeError, RuntimeError) as exc:  # a config refused, a dtype or device missing
        sys.exit(f"hf-static server: cannot build the model from {args.model}: {exc}")
    pad_token_id = built.pop("pad_token_id")
    info = ServerInfo(model=args.model.name, served_model_name=args.served_model_name or args.model.name,
                      seed=args.seed, dtype=args.dtype, max_batch_size=args.max_batch_size,
                      batch_window_s=args.batch_window_s, threads=args.threads, **built)

    async def run() -> None:
        batcher = StaticBatcher(model, max_batch_size=args.max_batch_size, batch_window_s=args.batch_window_s,
                                pad_token_id=pad_token_id)
        runner, url = await serve(make_app(batcher, info), args.host, args.port)
        print(f"hf-static server: imports {info.import_s:.2f}s, model {info.build_s:.2f}s; listening on {url}",
              flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        eventloop.run(run())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
