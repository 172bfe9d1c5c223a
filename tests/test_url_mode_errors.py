"""An engine at a wrong URL fails in seconds with a message that names the URL and says why."""

from __future__ import annotations

import asyncio
import http.server
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchbench.adapters.base import ConnectionRefused, EngineError, EngineNotHealthy
from batchbench.adapters.http import check_url
from batchbench.adapters.launch.local import free_port
from batchbench.adapters.served import URL_REFUSED_FOR_S, ServedModel, pick_served_model, served_models
from batchbench.adapters.vllm import VLLMEngine
from batchbench.core.config import ModelRef
from batchbench.core.exits import EXIT_ENGINE
from batchbench.fixtures.protocol import ProtocolServer, start_server


@pytest.fixture(scope="module")
def plain_http_server() -> Iterator[str]:
    """A web server that is not an engine: 404 on /health, with an HTML page."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


async def _connect(url: str, grace_s: float = 20.0) -> tuple[float, EngineError]:
    """Seconds until connecting to ``url`` failed (it must fail), and the error."""
    engine = VLLMEngine(model=ModelRef("m"), url=url, startup_timeout=grace_s)
    t0 = time.monotonic()
    with pytest.raises(EngineError) as info:
        async with engine:
            pass
    return time.monotonic() - t0, info.value


async def test_a_host_that_does_not_resolve_fails_at_once() -> None:
    elapsed, error = await _connect("http://no-such-host.invalid:8000")
    assert elapsed < 5
    assert error.permanent and "'no-such-host.invalid'" in str(error) and "does not resolve" in str(error)


async def test_https_to_a_plain_http_port_fails_at_once(plain_http_server: str) -> None:
    elapsed, error = await _connect(f"https://{plain_http_server}")
    assert elapsed < 5
    assert "TLS handshake" in str(error) and "http://" in str(error)


async def test_a_server_that_is_not_an_engine_fails_at_once_without_its_whole_page(plain_http_server: str) -> None:
    elapsed, error = await _connect(f"http://{plain_http_server}")
    assert elapsed < 5
    assert f"http://{plain_http_server} is not a vllm server" in str(error) and "HTTP 404" in str(error)
    assert len(str(error)) < 400


async def test_nothing_listening_fails_within_the_refusal_bound_not_the_start_up_grace() -> None:
    # Someone else's server is up, or nothing listens there: the 20 s start-up grace is for a server that accepts
    # connections and is not ready yet.
    elapsed, error = await _connect("http://127.0.0.1:1", grace_s=20.0)
    assert URL_REFUSED_FOR_S <= elapsed < URL_REFUSED_FOR_S + 1.5
    assert isinstance(error, ConnectionRefused)
    assert "cannot connect to http://127.0.0.1:1: connection refused for 2.0s: nothing listens there" in str(error)


async def test_a_server_that_starts_listening_within_the_refusal_bound_is_waited_for() -> None:
    port = free_port()
    server = start_server("vllm", port=port)
    server.stop()  # the port is free again: refused until the server below binds it

    async def listen_later() -> ProtocolServer:
        await asyncio.sleep(URL_REFUSED_FOR_S / 2)
        return await asyncio.to_thread(start_server, "vllm", port=port)

    later = asyncio.ensure_future(listen_later())
    engine = VLLMEngine(model=ModelRef("batchbench/tiny-llama"), url=f"http://127.0.0.1:{port}", startup_timeout=20)
    try:
        async with engine:
            assert engine.startup_s is not None and engine.startup_s >= URL_REFUSED_FOR_S / 2
    finally:
        await later
        later.result().stop()


async def test_a_server_that_never_answers_its_health_check_fails_at_the_url_grace_naming_the_url() -> None:
    # A socket that listens and never accepts: the kernel completes the connection, nothing ever answers.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        elapsed, error = await _connect(url, grace_s=1.0)
    assert 0.9 < elapsed < 4
    assert isinstance(error, EngineNotHealthy) and f"nothing healthy answered at {url}" in str(error)
    assert "the health check sent no answer before the 1s start-up timeout" in str(error)


@pytest.mark.parametrize(("given", "root"), [
    ("http://host:8000/v1", "http://host:8000"),
    ("http://host:8000/v1/", "http://host:8000"),
    ("http://host:8000/", "http://host:8000"),
    ("https://host/prefix/v1", "https://host/prefix/v1"),  # only a bare /v1 is the OpenAI base path
])
def test_the_openai_base_url_people_paste_is_accepted(given: str, root: str) -> None:
    assert check_url("vllm", given) == root


@pytest.mark.parametrize("command", ["run", "bench"])
def test_the_cli_gives_up_on_a_url_that_refuses_connections_within_seconds(command: str, tmp_path: Path) -> None:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "batchbench", command, "--engine", "vllm", "--engine-url",
                           "vllm=http://127.0.0.1:1", "--results-dir", str(tmp_path), "--request-timeout", "10"],
                          capture_output=True, text=True, timeout=60, check=False)
    # The interpreter's start and imports (2-3 s on 2 vCPUs) and the refusal bound: within 3 s of the first try.
    assert time.monotonic() - t0 < URL_REFUSED_FOR_S + 8
    assert proc.returncode == EXIT_ENGINE, proc.stderr
    assert "http://127.0.0.1:1" in proc.stderr and "connection refused" in proc.stderr


def test_the_served_model_is_found_by_name_or_by_the_path_it_was_loaded_from(tmp_path: Path) -> None:
    # vLLM 0.32's /v1/models: the base model (id: its served name, root: its path) and a LoRA adapter on it.
    listing = {"object": "list", "data": [
        {"id": "llama", "object": "model", "root": str(tmp_path / "llama"), "parent": None},
        {"id": "sql-lora", "object": "model", "root": "/adapters/sql", "parent": "llama"}]}
    served = served_models(listing)
    assert served == [ServedModel("llama", str(tmp_path / "llama"))]  # adapters are not base models
    for given in (None, "llama", str(tmp_path / "llama"), str(tmp_path / "x" / ".." / "llama")):
        assert pick_served_model(given, served, "here").name == "llama"
    with pytest.raises(ValueError, match=r"--model sql-lora: here serves no such model; it serves: llama \(from "):
        pick_served_model("sql-lora", served, "here")
    with pytest.raises(ValueError, match="here lists no model on /v1/models"):
        pick_served_model(None, served_models({"data": []}), "here")
