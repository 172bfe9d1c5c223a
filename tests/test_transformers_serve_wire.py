"""``transformers serve``'s recorded wire format (``fixtures/wire/transformers-serve/``, transformers 5.19.0) read by
the generic engine without a server: streams that end without ``[DONE]``, token-id prompts and extensions refused,
and a ``/v1/models`` that fails or lists nothing while the model is served."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchbench.adapters import generic, served
from batchbench.adapters.base import EngineError, EngineHTTPError, StreamProtocolError
from batchbench.adapters.generic import OpenAIServerEngine
from batchbench.adapters.openai_compat import OpenAICompletionsEngine
from batchbench.adapters.served import ServedModel, pick_served_model, served_models
from batchbench.core.config import ModelRef
from batchbench.fixtures import tiny_model_dir, wire_dir
from batchbench.workload import tokenizer
from batchbench.workload.requests import Request
from batchbench.workload.text import TextMaker
from tests.adapter_helpers import collect, replay

WIRE = wire_dir("transformers-serve")
MODEL = ModelRef("tiny-llama", max_model_len=256)
#: The recorded request: 8 output tokens (fixtures/wire/transformers-serve/README.md).
REQUEST = Request("r-1", (1, 2, 3, 4, 5), 8)
TINY = tokenizer.load(str(tiny_model_dir()))


def _refusal(name: str) -> tuple[int, str]:
    body, status = (WIRE / name).read_text().rsplit("\n", 2)[:2]
    return int(status), body


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_a_stream_that_ends_after_its_finish_reason_without_done_is_complete(endpoint: str) -> None:
    engine = OpenAIServerEngine(model=MODEL, url="http://engine.test", endpoint=endpoint)
    replay(engine, (WIRE / f"{endpoint}_stream.sse").read_bytes())
    chunks = await collect(engine, REQUEST)
    assert sum(c.n_tokens for c in chunks if c.usage is None) == 8
    usage = chunks[-1].usage
    assert usage is not None and usage.source == "engine-last-choice" and usage.completion_tokens == 8
    # " the engine a cat" is 5 tokens; on chat the template's own come on top.
    assert usage.prompt_tokens == 5 if endpoint == "completions" else usage.prompt_tokens > 5


async def test_a_stream_cut_before_its_finish_reason_is_still_an_error() -> None:
    engine = OpenAIServerEngine(model=MODEL, url="http://engine.test")
    events = (WIRE / "completions_stream.sse").read_bytes().split(b"\n\n")
    replay(engine, b"\n\n".join(e for e in events if b"finish_reason" not in e))
    with pytest.raises(StreamProtocolError, match=re.escape("stream ended before [DONE]")):
        await collect(engine, REQUEST)


async def test_refused_extensions_then_token_ids_turn_each_off_for_good(monkeypatch: pytest.MonkeyPatch) -> None:
    """As the server checks them: the extensions (422), then the prompt's type (400). Every request in flight is
    sent again without what was refused, even one refused after another turned it off."""
    sent: list[dict[str, object]] = []
    extensions, token_ids = _refusal("extensions_refused.txt"), _refusal("token_ids_refused.txt")

    async def server(self: OpenAIServerEngine, request: Request, sink: object) -> None:
        body = self.payload(request)
        sent.append(body)
        # r-2 was sent, with the extensions, before r-1's refusal turned them off: refused as they were.
        if "ignore_eos" in body or (request.request_id == "r-2" and sent[-2]["prompt"] != body["prompt"]):
            status, said = extensions
            raise EngineHTTPError("openai", f"HTTP {status} from /v1/completions: {said}", status=status)
        if not isinstance(body["prompt"], str):
            status, said = token_ids
            raise EngineHTTPError("openai", f"HTTP {status} from /v1/completions: {said}", status=status)

    monkeypatch.setattr(OpenAICompletionsEngine, "stream_into", server)
    engine = OpenAIServerEngine(model=MODEL, url="http://127.0.0.1:9", text_tokenizer=TINY)
    await engine.stream_into(Request("r-1", tuple(range(40, 72)), 8), None)  # type: ignore[arg-type]
    assert engine.plain and engine.as_text and len(sent) == 3
    prompt = sent[-1]["prompt"]
    assert isinstance(prompt, str) and len(TINY.encode(prompt)) == 32
    assert "ignore_eos" not in sent[-1] and "prompts as token ids" in engine.describe()["unavailable"]
    await engine.stream_into(Request("r-2", tuple(range(80, 96)), 8), None)  # type: ignore[arg-type]
    assert len(sent) == 5 and isinstance(sent[-1]["prompt"], str)


async def test_without_a_tokenizer_that_loads_a_refusal_of_token_ids_says_what_to_give(
        monkeypatch: pytest.MonkeyPatch) -> None:
    status, said = _refusal("token_ids_refused.txt")

    async def server(self: OpenAIServerEngine, request: Request, sink: object) -> None:
        self.payload(request)
        raise EngineHTTPError("openai", f"HTTP {status}: {said}", status=status)

    monkeypatch.setattr(OpenAICompletionsEngine, "stream_into", server)
    engine = OpenAIServerEngine(model=ModelRef("/no/such/model"), url="http://127.0.0.1:9")
    with pytest.raises(EngineError, match=r"refuses token-id prompts.*--tokenizer"):
        await engine.stream_into(REQUEST, None)  # type: ignore[arg-type]


@given(st.lists(st.integers(0, 2047), min_size=1, max_size=64), st.lists(st.integers(0, 2047), max_size=16))
def test_text_for_token_ids_is_as_long_and_keeps_a_shared_prefix(ids: list[int], more: list[int]) -> None:
    maker = TextMaker(TINY)
    text = maker.like(ids)
    assert len(TINY.encode(text)) + TINY.added == len(ids)
    assert maker.like(ids) == text  # the same prompt is the same text, on every engine
    if len(maker.like([*ids, *more]).split(" ")) > len(text.split(" ")):
        assert maker.like([*ids, *more]).startswith(text)


def test_an_empty_or_failing_models_list_takes_the_model_given() -> None:
    assert pick_served_model("/models/tiny", served_models({"object": "list", "data": []}), "here") == \
        ServedModel("/models/tiny", listed=False)
    with pytest.raises(ValueError, match="lists no model on /v1/models: give --model"):
        pick_served_model(None, [], "here")


async def test_health_falls_back_to_health_where_the_models_list_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    status, said = _refusal("models_no_cache.txt")
    seen: list[str] = []

    async def get_text(client: object, name: str, path: str, **_: object) -> str:
        seen.append(path)
        if path == "/v1/models":
            raise EngineHTTPError("openai", f"HTTP {status}: {said}", status=status)
        return '{"status":"ok"}'

    monkeypatch.setattr(served, "get_text", get_text)
    monkeypatch.setattr(generic, "get_text", get_text)
    engine = OpenAIServerEngine(model=MODEL, url="http://engine.test")
    engine.client = object()  # type: ignore[assignment]
    assert await engine.probe_health()
    assert seen == ["/v1/models", "/health"]


@pytest.mark.parametrize(("status", "said", "refused"), [
    (400, "prompt must be a string.", "token-ids"),
    (422, "body.prompt: Input should be a valid string", "token-ids"),
    (422, "Unexpected fields in the request: {'ignore_eos', 'min_tokens'}", "extensions"),
    (400, "This model's maximum context length is 512 tokens. However, your prompt contains 600 input tokens", None),
    (400, "Server is pinned to 'tiny-llama'; requested 'other'.", None),
    (500, "prompt must be a string.", None),
])
def test_only_a_refusal_of_what_it_can_do_without_is_taken_as_one(status: int, said: str, refused: str | None) -> None:
    engine = OpenAIServerEngine(model=MODEL, url="http://engine.test")
    assert engine._refused(EngineHTTPError("openai", f"HTTP {status}: {said}", status=status)) == refused
