"""API keys and headers: parsed strictly, sent with every request, never shown, and a 401/403 said at once."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from batchbench.adapters.auth import Auth, EngineUnauthorized, auth_from, parse_headers
from batchbench.adapters.base import EngineError
from batchbench.adapters.generic import OpenAIServerEngine
from batchbench.adapters.http import get_json, make_client
from batchbench.adapters.launch.secrets import REDACTED
from batchbench.adapters.registry import EngineOptions, make_engine
from batchbench.adapters.served import fetch_served_models
from batchbench.adapters.vllm import VLLMEngine
from batchbench.core.config import ModelRef
from batchbench.fixtures.protocol import ProtocolServer, start_server
from tests.adapter_helpers import collect, request

KEY = "sk-test-9f8e7d6c5b4a"


@pytest.fixture
def keyed() -> Iterator[ProtocolServer]:
    server = start_server("vllm", token_delay=0.001, api_key=KEY, model="tiny-llama")
    try:
        yield server
    finally:
        server.stop()


def test_the_key_defaults_to_openai_api_key_and_a_flag_wins() -> None:
    assert auth_from(None, [], {"OPENAI_API_KEY": KEY}).api_key == KEY
    assert auth_from("other-key", [], {"OPENAI_API_KEY": KEY}).api_key == "other-key"
    assert auth_from(None, [], {}).api_key is None
    assert auth_from(None, [], {"OPENAI_API_KEY": ""}).api_key is None  # set but empty: no key


def test_headers_parse_strictly_and_name_the_header_never_its_value() -> None:
    assert parse_headers(["X-Tenant=team-a", "X-Trace = on=off"]) == (("X-Tenant", "team-a"), ("X-Trace", "on=off"))
    for bad, said in (("X-Tenant", "expected NAME=VALUE"), ("Bad Name=v", "expected NAME=VALUE"),
                      ("Content-Length=5", "writes this header itself"), ("X-A=1\r\nX-B: 2", "printable ASCII")):
        with pytest.raises(ValueError, match=said) as info:
            parse_headers([bad])
        assert "1\r\nX-B" not in str(info.value)
    with pytest.raises(ValueError, match="given twice"):
        parse_headers(["X-A=1", "x-a=2"])
    with pytest.raises(ValueError, match="both set the Authorization header"):
        auth_from(KEY, ["Authorization=Bearer other"], {})
    with pytest.raises(ValueError, match=r"\$OPENAI_API_KEY: an API key is printable ASCII") as refused:
        auth_from(None, [], {"OPENAI_API_KEY": "two words"})
    assert "two words" not in str(refused.value)


def test_auth_never_shows_its_values() -> None:
    auth = Auth(KEY, (("X-Api-Key", "hdr-secret-123"),))
    for shown in (repr(auth), str(auth.describe()), repr(EngineOptions(auth=auth))):
        assert KEY not in shown and "hdr-secret-123" not in shown
    assert auth.describe() == {"api_key": REDACTED, "headers": {"X-Api-Key": REDACTED}}
    assert auth.http_headers() == {"X-Api-Key": "hdr-secret-123", "Authorization": f"Bearer {KEY}"}
    assert auth.redact(f"echo {KEY} and hdr-secret-123") == f"echo {REDACTED} and {REDACTED}"
    engine = make_engine("vllm", None, EngineOptions(urls=(("vllm", "http://h:1"),), auth=auth))
    assert KEY not in str(engine.describe()) and engine.describe()["auth"]["api_key"] == REDACTED


async def test_every_request_carries_the_key_and_headers(keyed: ProtocolServer) -> None:
    seen: list[dict[str, str]] = []
    route = keyed.route

    async def spy(req, resp):  # type: ignore[no-untyped-def]
        seen.append(dict(req.headers))
        return await route(req, resp)

    keyed.route = spy  # type: ignore[method-assign]
    assert keyed.url is not None
    auth = Auth(KEY, (("X-Tenant", "team-a"),))
    async with VLLMEngine(model=ModelRef(""), url=keyed.url, auth=auth, startup_timeout=5) as engine:
        chunks = await collect(engine, request(max_tokens=3))
        await engine.scrape()
    assert sum(c.n_tokens for c in chunks) == 3
    # the health check, /v1/models, the stream (its own client) and /metrics alike
    assert len(seen) >= 4 and all(h["authorization"] == f"Bearer {KEY}" and h["x-tenant"] == "team-a" for h in seen)


@pytest.mark.parametrize(("auth", "said"), [
    (Auth(), "wants an API key: give --api-key KEY"),
    (Auth("wrong-key-000"), "refused the API key or headers sent"),
])
async def test_a_401_is_a_permanent_error_naming_the_url_and_the_key_never(
        keyed: ProtocolServer, auth: Auth, said: str) -> None:
    assert keyed.url is not None
    t0 = time.monotonic()
    with pytest.raises(EngineUnauthorized, match=said) as info:
        async with OpenAIServerEngine(model=ModelRef(""), url=keyed.url, auth=auth, startup_timeout=20):
            pass
    assert time.monotonic() - t0 < 5  # not after the start-up timeout: waiting would not let it in
    assert info.value.permanent and info.value.status == 401 and info.value.kind == "unauthorized"
    assert f"{keyed.url}/v1/models" in str(info.value) and "wrong-key-000" not in str(info.value)
    with pytest.raises(EngineUnauthorized, match=said):
        await fetch_served_models("openai", keyed.url, auth)
    assert await fetch_served_models("openai", keyed.url, Auth(KEY)) is not None


async def test_a_stream_refused_for_its_key_is_an_unauthorized_record(keyed: ProtocolServer) -> None:
    """vLLM guards /v1 only: its health passes without a key, the stream then says what is wrong."""
    assert keyed.url is not None
    engine = VLLMEngine(model=ModelRef("tiny-llama"), url=keyed.url)
    await engine.start()
    try:
        with pytest.raises(EngineUnauthorized, match=f"HTTP 401 from {keyed.url}/v1/completions") as info:
            await collect(engine, request("r-401"))
        assert info.value.request_id == "r-401"
    finally:
        await engine.stop()


async def test_a_servers_error_echoing_a_secret_is_redacted() -> None:
    server = start_server("vllm", token_delay=0.001)
    try:
        assert server.url is not None
        secret = "hdr-secret-echoed"
        server.check_request = lambda body: (400, {"error": {"message": f"bad header {secret}", "code": 400}})
        engine = VLLMEngine(model=ModelRef("m"), url=server.url, auth=Auth(None, (("X-Key", secret),)))
        await engine.start()
        try:
            with pytest.raises(EngineError) as info:
                await collect(engine, request())
        finally:
            await engine.stop()
        assert secret not in str(info.value) and REDACTED in str(info.value)
        async with make_client(server.url, Auth(None, (("X-Key", secret),))) as client:
            assert await get_json(client, "vllm", "/v1/models")
    finally:
        server.stop()


async def test_a_model_given_does_not_hide_a_refused_models_lookup(keyed: ProtocolServer) -> None:
    """vLLM's /health is open: the /v1/models look-up is where a missing key shows, named or not by --model."""
    assert keyed.url is not None
    with pytest.raises(EngineUnauthorized, match="wants an API key"):
        async with VLLMEngine(model=ModelRef("tiny-llama"), url=keyed.url, startup_timeout=5):
            pass
