"""A local server that speaks vLLM's OpenAI completions wire format, and misbehaves on demand.

It streams exactly ``max_tokens`` tokens per request, one SSE event each
with ``token_ids`` as vLLM 0.32 does (see tests/test_vllm_engine.py for the
real server), serves a bounded number of requests at once (the rest wait, as
in a saturated engine), and can be told per request id (the adapter's
``X-Request-Id`` header) to fail (429, 503, a malformed event, a truncated
stream, a hung stream, an error event) or to send two tokens per event.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field


@dataclass
class FakeVLLM:
    token_delay_s: float = 0.0
    #: Requests decoded at once; the others queue (server-side waiting).
    slots: int = 1024
    healthy: bool = True
    #: Request id → fault mode.
    faults: dict[str, str] = field(default_factory=dict)
    served: int = 0
    port: int = 0
    _server: asyncio.Server | None = None
    _sem: asyncio.Semaphore | None = None
    _running: int = 0
    _waiting: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> FakeVLLM:
        self._sem = asyncio.Semaphore(self.slots)
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            # close_clients() exists from 3.13; hung handlers are cancelled with their tasks otherwise.
            if hasattr(self._server, "close_clients"):
                self._server.close_clients()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            if method == "GET":
                await self._get(path, writer)
            else:
                await self._complete(json.loads(body), headers.get("x-request-id", ""), writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _get(self, path: str, writer: asyncio.StreamWriter) -> None:
        if path == "/health":
            status, body = (200, b"") if self.healthy else (503, b'{"error": "starting"}')
        elif path == "/metrics":
            status, body = 200, self.metrics_text().encode()
        elif path == "/v1/models":
            status, body = 200, b'{"object": "list", "data": [{"id": "fake-model"}]}'
        else:
            status, body = 404, b'{"error": "not found"}'
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        await writer.drain()

    def metrics_text(self) -> str:
        return (
            f'vllm:num_requests_running{{model_name="fake-model"}} {self._running}\n'
            f'vllm:num_requests_waiting{{model_name="fake-model"}} {self._waiting}\n'
            f'vllm:kv_cache_usage_perc{{model_name="fake-model"}} {min(1.0, self._running / self.slots)}\n'
            '# TYPE vllm:num_preemptions counter\n'
            'vllm:num_preemptions_total{model_name="fake-model"} 0\n'
            'vllm:cache_config_info{block_size="16",kv_cache_size_tokens="4096"} 1\n'
        )

    async def _complete(self, payload: dict, request_id: str, writer: asyncio.StreamWriter) -> None:
        fault = self.faults.get(request_id, "ok")
        if fault in ("429", "503"):
            body = json.dumps({"error": {"message": "server overloaded", "code": int(fault)}}).encode()
            writer.write(f"HTTP/1.1 {fault} X\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            await writer.drain()
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")

        async def send(data: str) -> None:
            event = f"data: {data}\n\n".encode()
            writer.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
            await writer.drain()

        assert self._sem is not None
        self._waiting += 1
        async with self._sem:
            self._waiting -= 1
            self._running += 1
            try:
                n = payload["max_tokens"]
                step = 2 if fault == "pairs" else 1  # several tokens per event, as engines may send
                for i in range(0, n, step):
                    if self.token_delay_s:
                        await asyncio.sleep(self.token_delay_s)
                    if i == 1 and fault == "malformed":
                        await send("{not json")
                        return
                    if i == 2 and fault == "truncate":
                        return  # connection closes without the terminating chunk
                    if i == 1 and fault == "hang":
                        await asyncio.sleep(3600)
                    if i == 1 and fault == "error_event":
                        await send(json.dumps({"error": {"message": "engine blew up", "code": 500}}))
                        return
                    ids = list(range(100 + i, 100 + min(n, i + step)))
                    choice = {"index": 0, "text": "", "token_ids": ids,
                              "finish_reason": "length" if i + step >= n else None}
                    await send(json.dumps({"id": request_id, "choices": [choice]}))
                usage = {"prompt_tokens": len(payload["prompt"]), "completion_tokens": n,
                         "total_tokens": len(payload["prompt"]) + n}
                await send(json.dumps({"id": request_id, "choices": [], "usage": usage}))
                await send("[DONE]")
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                self.served += 1
            finally:
                self._running -= 1


async def _serve_forever(port: int, token_delay_s: float) -> None:
    server = FakeVLLM(token_delay_s=token_delay_s)
    server._sem = asyncio.Semaphore(server.slots)
    server._server = await asyncio.start_server(server._handle, "127.0.0.1", port)
    print(f"fake vLLM serving on 127.0.0.1:{port}", flush=True)
    await server._server.serve_forever()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="a fake vLLM server, for load-generator benchmarks")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-delay", type=float, default=0.0)
    args = parser.parse_args()
    asyncio.run(_serve_forever(args.port, args.token_delay))
