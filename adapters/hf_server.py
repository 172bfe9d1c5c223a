"""The transformers server behind hf-static and hf-continuous: one model, two batchers, a process of its own.

``python -m batchbench.adapters.hf_server --model DIR [--batching static|continuous] [--max-batch-size N]
[--batch-window-s 0.02] [--max-batch-tokens T] [--kv-blocks B] [--block-size 16] [--memory-fraction F]
 [--device auto|cpu|cuda] [--threads T] [--dtype bfloat16] [--seed 0] [--host 127.0.0.1]
[--port 0]``

Why a process: run inside the load generator, the model's steps held the GIL that the event loop stamping
every chunk needs, so the client's clock was the engine's. Served over HTTP, both are timed on the client's clock
exactly as vLLM is (:class:`batchbench.adapters.hf_static.HFStaticEngine`,
:class:`batchbench.adapters.hf_continuous.HFContinuousEngine`).

The batchers (:mod:`batchbench.adapters.hf_batchers`): static (padded batches through ``generate()``, hf-static) or
continuous (transformers' continuous batching over a paged KV cache, hf-continuous). Either serves each request
exactly its ``max_tokens``. The weights are seeded random ones of the Llama-style config in ``--model`` (a folder
with a config.json); nothing is downloaded. ``--device auto`` puts the model on the GPU when torch sees one.

Routes, on aiohttp.web:

- ``POST /v1/completions``: the OpenAI completions stream as vLLM 0.32 writes it (the fields
  :mod:`batchbench.adapters.openai_compat` reads): the prompt as a list of token ids, ``max_tokens``,
  ``stream: true``; one event per token per request as each decode step ends (the batcher's thread hands
  each step to the event loop with ``call_soon_threadsafe``), with the running ``usage.completion_tokens``
  under ``stream_options.continuous_usage_stats``, ``finish_reason: "length"`` on the last, a usage-only
  event under ``stream_options.include_usage``, then ``data: [DONE]``. It serves one model and does not
  check the request's ``model``. A request it cannot serve is a 400 with vLLM's error body; a batch that
  raises ends each of its streams with vLLM's in-stream error event (code 500).
- ``GET /health`` (a 503 naming the error once the continuous batcher's loop has died); ``GET /v1/models``;
  ``GET /metrics``: Prometheus text, ``batchbench_hf_num_requests_running``, ``batchbench_hf_num_requests_waiting``
  (gauges), ``batchbench_hf_request_success_total`` (a counter) and, for the continuous batcher once its cache
  exists, ``batchbench_hf_kv_cache_usage_perc`` (a fraction, as vLLM's) and ``batchbench_hf_kv_cache_capacity_tokens``.
- ``GET /batchbench/report``: the batcher's accounting since ``POST /batchbench/begin_run`` (the static batcher's
  padding per batch); ``GET /batchbench/info``: the server's settings, package versions and start-up times.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from batchbench.adapters.hf_batchers import Batcher, ContinuousBatcher, StaticBatcher
from batchbench.core import eventloop
from batchbench.core.clock import now

#: The continuous batcher's KV cache on the CPU when ``--kv-blocks`` is not given. transformers 5.19 sizes it from
#: free memory wherever it runs, which on the CPU is 90% of the host's RAM (74,176 blocks of 16 tokens, about 20 GB,
#: 29 s to allocate, for the tiny model on a 24 GiB machine): far beyond what a CPU run can fill.
CPU_KV_TOKENS = 65536


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
    #: The padded batch (static), or the most requests one step may hold (continuous; None: transformers' default).
    max_batch_size: int | None
    #: Static only: how long a batch waits for more requests after its first.
    batch_window_s: float | None
    threads: int | None
    torch_threads: int | None
    versions: dict[str, str]
    #: Seconds to import torch and transformers, and to build the model from its config.
    import_s: float | None
    build_s: float | None
    #: "static" or "continuous": which batcher serves.
    batching: str = "static"
    #: Where the model runs ("cpu", "cuda:0").
    device: str = "cpu"
    #: Continuous only: the step's token budget, the KV blocks asked for (None: sized by transformers from free
    #: accelerator memory) and the tokens a block holds.
    max_batch_tokens: int | None = None
    kv_blocks: int | None = None
    block_size: int | None = None


class _CacheGauges(Collector):
    """The batcher's KV-cache gauges, written only while it has a cache: Prometheus has no "unknown" value, and
    a 0 would read as an empty cache."""

    def __init__(self, batcher: Batcher) -> None:
        self.batcher = batcher

    def collect(self) -> Iterator[GaugeMetricFamily]:
        usage, capacity = self.batcher.kv_usage(), self.batcher.kv_capacity_tokens()
        if usage is not None:
            yield GaugeMetricFamily("batchbench_hf_kv_cache_usage_perc", "Fraction of the paged KV cache in use",
                                    value=usage)
        if capacity is not None:
            yield GaugeMetricFamily("batchbench_hf_kv_cache_capacity_tokens", "Tokens the paged KV cache holds",
                                    value=capacity)


def make_app(batcher: Batcher, info: ServerInfo) -> web.Application:
    """The routes of the module docstring over ``batcher``; the batcher runs while the app does."""
    registry = CollectorRegistry()
    Gauge("batchbench_hf_num_requests_running", "Requests being generated",
          registry=registry).set_function(lambda: batcher.running)
    Gauge("batchbench_hf_num_requests_waiting", "Requests waiting to be scheduled",
          registry=registry).set_function(lambda: batcher.num_waiting)
    registry.register(_CacheGauges(batcher))
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
        except ConnectionError:  # the client went away: a continuous batcher frees its slot, a static batch cannot
            if pending.cancel is not None:
                pending.cancel()
        return response

    async def health(_: web.Request) -> web.Response:
        failure = batcher.failure()
        if failure is not None:
            return web.json_response(_error_body(503, f"the generation loop stopped: {failure}", "ServiceUnavailable"),
                                     status=503, dumps=_dumps)
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

    async def greedy(request: web.Request) -> web.Response:
        try:
            prompts, n = _parse_greedy(orjson.loads(await request.read()), info.vocab_size)
        except (orjson.JSONDecodeError, ValueError) as exc:
            return _bad_request(str(exc))
        tokens = await _greedy_tokens(batcher, prompts, n)
        body = _error_body(500, tokens, "InternalServerError") if isinstance(tokens, str) else \
            {"tokens": tokens, "dtype": info.dtype, "seed": info.seed}
        return web.json_response(body, status=500 if isinstance(tokens, str) else 200, dumps=_dumps)

    async def batching(app: web.Application) -> Any:
        task = asyncio.create_task(batcher.run(), name=f"hf-{info.batching}-batcher")
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # the continuous batcher's thread is stopped, not left

    app = web.Application()
    app.add_routes([web.post("/v1/completions", completions), web.get("/health", health),
                    web.get("/v1/models", models), web.get("/metrics", metrics),
                    web.get("/batchbench/report", report), web.post("/batchbench/begin_run", begin_run),
                    web.get("/batchbench/info", describe), web.post("/batchbench/greedy", greedy)])
    app.cleanup_ctx.append(batching)
    return app


def _parse_greedy(body: Any, vocab_size: int) -> tuple[list[list[int]], int]:
    """``{prompts: [[ids]], max_tokens: n}``; ValueError naming what is wrong."""
    prompts, n = (body.get("prompts"), body.get("max_tokens")) if isinstance(body, dict) else (None, None)
    if not (isinstance(prompts, list) and prompts and all(isinstance(p, list) and p and all(
            type(t) is int and 0 <= t < vocab_size for t in p) for p in prompts)):
        raise ValueError(f"prompts must be a non-empty list of non-empty lists of token ids in [0, {vocab_size})")
    if type(n) is not int or n < 1:
        raise ValueError("max_tokens must be a positive integer")
    return prompts, n


async def _greedy_tokens(batcher: Batcher, prompts: list[list[int]], n: int) -> list[list[int]] | str:
    """The prompts' first ``n`` tokens, submitted at once and batched as any requests are; or why they failed."""
    asked = [batcher.submit(p, n, keep_tokens=True) for p in prompts]
    for pending in asked:
        while (step := await pending.steps.get()) != n:
            if isinstance(step, str):
                return step
    return [list(p.tokens or []) for p in asked]


async def serve(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, str]:
    """Start serving ``app``; (its runner, to clean up, and its base URL: the port chosen when ``port`` is 0)."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=2048)  # a burst of connects beyond asyncio's 100 would lose SYNs
    await site.start()
    bound_host, bound_port = runner.addresses[0][:2]
    return runner, f"http://{bound_host}:{bound_port}"


def build_model(model_dir: Path, *, seed: int, dtype: str, threads: int | None,
                device: str = "cpu") -> tuple[Any, dict[str, Any]]:
    """The causal LM of ``model_dir``'s config with seeded random weights on ``device`` ("auto": the GPU when torch
    sees one), and what :class:`ServerInfo` takes from it (versions, device, thread count, import and build times)."""
    started = now()
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    imported = now()
    if threads:
        torch.set_num_threads(threads)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(seed)
    with torch.device(device):  # the weights are made where they run: an 8B model is not built on the CPU first
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.eval()
    return model, {
        "vocab_size": config.vocab_size, "max_model_len": getattr(config, "max_position_embeddings", None),
        "pad_token_id": config.pad_token_id or 0, "torch_threads": torch.get_num_threads(),
        "device": str(model.device),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "import_s": imported - started, "build_s": now() - imported,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m batchbench.adapters.hf_server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path, help="a Llama-style config folder (config.json)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model /v1/models lists (default: the folder's name)")
    parser.add_argument("--batching", choices=("static", "continuous"), default="static",
                        help="padded batches through generate() (hf-static) or transformers' continuous batching")
    parser.add_argument("--max-batch-size", type=int, default=None,
                        help="static: requests per padded batch (default 8); continuous: most requests per step")
    parser.add_argument("--batch-window-s", type=float, default=0.02,
                        help="static: how long a batch waits for more requests after its first")
    parser.add_argument("--max-batch-tokens", type=int, default=None,
                        help="continuous: tokens per step, prefill chunks and decodes together")
    parser.add_argument("--kv-blocks", type=int, default=None,
                        help="continuous: KV-cache blocks (default: on a GPU transformers sizes it from free memory; "
                             f"on the CPU {CPU_KV_TOKENS} tokens' worth)")
    parser.add_argument("--block-size", type=int, default=16, help="continuous: tokens per KV-cache block")
    parser.add_argument("--memory-fraction", type=float, default=None,
                        help="continuous: fraction of free GPU memory the KV cache may take")
    parser.add_argument("--device", default="auto", help="auto (the GPU when torch sees one), cpu, cuda, cuda:N")
    parser.add_argument("--threads", type=int, default=None, help="torch's threads (and OMP_NUM_THREADS)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0, help="seeds the random weights")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on start)")
    args = parser.parse_args(argv)
    counts = (args.max_batch_size, args.threads, args.max_batch_tokens, args.kv_blocks, args.block_size)
    if any(n is not None and n < 1 for n in counts) or args.batch_window_s < 0:
        parser.error("--max-batch-size, --threads, --max-batch-tokens, --kv-blocks and --block-size must be at "
                     "least 1, --batch-window-s not negative")
    if args.memory_fraction is not None and not 0 < args.memory_fraction <= 1:
        parser.error("--memory-fraction must be in (0, 1]")
    static = args.batching == "static"
    name = f"hf-{args.batching}"
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # read by torch's OpenMP when it is imported
    if not (args.model / "config.json").is_file():
        sys.exit(f"{name} server: cannot load the model config from {args.model}: no config.json there")
    print(f"{name} server: building {args.model.name} with seeded random weights", flush=True)
    try:
        model, built = build_model(args.model, seed=args.seed, dtype=args.dtype, threads=args.threads,
                                   device=args.device)
    except (OSError, ValueError, AttributeError, RuntimeError) as exc:  # a config transformers refuses, a dtype
        # torch lacks, a device it does not have
        sys.exit(f"{name} server: cannot build the model from {args.model}: {exc}")
    pad_token_id = built.pop("pad_token_id")
    if not static and args.kv_blocks is None and built["device"] == "cpu":
        args.kv_blocks = CPU_KV_TOKENS // args.block_size
    max_batch_size = (args.max_batch_size or 8) if static else args.max_batch_size
    info = ServerInfo(model=args.model.name, served_model_name=args.served_model_name or args.model.name,
                      seed=args.seed, dtype=args.dtype, max_batch_size=max_batch_size,
                      batch_window_s=args.batch_window_s if static else None, threads=args.threads,
                      batching=args.batching, **built, **({} if static else {
                          "max_batch_tokens": args.max_batch_tokens, "kv_blocks": args.kv_blocks,
                          "block_size": args.block_size}))

    async def run() -> None:
        batcher: Batcher
        if static:
            batcher = StaticBatcher(model, max_batch_size=max_batch_size, batch_window_s=args.batch_window_s,
                                    pad_token_id=pad_token_id)
        else:
            batcher = ContinuousBatcher(model, max_requests=max_batch_size, max_batch_tokens=args.max_batch_tokens,
                                        kv_blocks=args.kv_blocks, block_size=args.block_size,
                                        memory_fraction=args.memory_fraction)
        runner, url = await serve(make_app(batcher, info), args.host, args.port)
        print(f"{name} server: imports {info.import_s:.2f}s, model {info.build_s:.2f}s on {info.device}; "
              f"listening on {url}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    with contextlib.suppress(KeyboardInterrupt):
        eventloop.run(run())


if __name__ == "__main__":
    main()
