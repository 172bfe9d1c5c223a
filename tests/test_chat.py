"""The chat endpoint: requests as messages of exact token lengths, streams parsed as recorded, reasoning apart."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchbench.adapters.base import Usage
from batchbench.adapters.generic import OpenAIServerEngine
from batchbench.adapters.sglang import SGLangEngine
from batchbench.adapters.vllm import VLLMEngine
from batchbench.core.config import LoadConfig, ModelRef
from batchbench.core.records import RequestRecord
from batchbench.fixtures import tiny_model_dir, wire_dir
from batchbench.fixtures.protocol import ProtocolServer, start_server
from batchbench.fixtures.protocol.openai import TEMPLATE_GENERATION_TOKENS, TEMPLATE_TOKENS_PER_MESSAGE
from batchbench.load.loadgen import LoadGenerator
from batchbench.measures import parity
from batchbench.measures.metrics import summarize
from batchbench.workload import datasets, tokenizer
from batchbench.workload.chat import as_chat
from batchbench.workload.requests import Arrival, Lengths, Request, ThinkTime, Workload, WorkloadSpec
from batchbench.workload.text import TextMaker
from tests.adapter_helpers import collect, replay

WIRE = wire_dir("vllm")
TINY = ModelRef("tiny-llama", served_name="tiny-llama", max_model_len=512)


@pytest.fixture(scope="module")
def tiny_tokenizer() -> tokenizer.Tokenizer:
    return tokenizer.load(str(tiny_model_dir()))


def _chat_request(rid: str = "c-1", text: str = " the engine run", max_tokens: int = 4) -> Request:
    return Request(rid, (270, 681, 1000), max_tokens, messages=(("user", text),))


def _chat_engine(cls: type = VLLMEngine, url: str = "http://engine.test", **kwargs: object) -> VLLMEngine:
    return cls(model=TINY, url=url, endpoint="chat", **kwargs)  # type: ignore[no-any-return]


# ---------------------------------------------------------------- the recordings


def test_the_chat_body_is_the_recorded_request() -> None:
    assert _chat_engine().chat_payload(_chat_request()) == json.loads((WIRE / "chat_request.json").read_text())


async def test_the_captured_vllm_chat_stream_parses_into_its_tokens_and_usage() -> None:
    engine = _chat_engine()
    replay(engine, (WIRE / "chat_stream.sse").read_bytes())
    chunks = await collect(engine, _chat_request())
    # the opening role chunk carries no token (its usage says 0); then one token per chunk; then the usage
    assert [c.n_tokens for c in chunks] == [1, 1, 1, 1, 0]
    assert chunks[0].first_output and not any(c.first_output for c in chunks[1:])
    assert chunks[3].finish_reason == "length" and not any(c.reasoning for c in chunks)
    assert chunks[-1].usage == Usage(13, 4)  # the engine's count: 3 tokens sent, 10 of the chat template


async def test_without_running_usage_each_piece_is_a_token_and_the_last_usage_the_totals() -> None:
    engine = _chat_engine()
    replay(engine, (WIRE / "chat_stream_usage_last.sse").read_bytes())
    chunks = await collect(engine, _chat_request())
    assert [c.n_tokens for c in chunks] == [1, 1, 1, 1, 0]
    assert chunks[-1].usage == Usage(13, 4)


async def test_the_reasoning_stream_times_reasoning_and_answer_apart() -> None:
    engine = _chat_engine()
    replay(engine, (WIRE / "reasoning_stream.sse").read_bytes())
    chunks = await collect(engine, _chat_request(max_tokens=6))
    assert [(c.n_tokens, c.reasoning, c.first_output) for c in chunks[:-1]] == [
        (1, True, False), (1, True, False), (1, True, False),
        (2, False, True),  # the end-of-reasoning token streamed no chunk of its own: it rises with the answer's
        (1, False, False)]
    assert chunks[-1].usage == Usage(9, 6, reasoning_tokens=3)


async def test_a_recorded_reasoning_stream_makes_a_record_with_ttft_and_ttfo_apart() -> None:
    engine = _chat_engine()
    replay(engine, (WIRE / "reasoning_stream.sse").read_bytes())
    req = _chat_request(max_tokens=6)
    (record,) = await LoadGenerator(engine, _one(req)).run()
    assert record.ok and record.reasoning_tokens == 3 and record.completion_tokens == 6
    assert record.chunk_tokens == [1, 1, 1, 2, 1]
    assert record.first_output_s == record.chunk_times[3]  # the answer's first token, after the reasoning
    assert record.ttfo_s is not None and record.ttft_s is not None and record.ttfo_s >= record.ttft_s


def _one(req: Request) -> Workload:
    return Workload(WorkloadSpec("one", 1, arrival=Arrival("closed", concurrency=1)), (req,))


# ---------------------------------------------------------------- against the protocol servers


@pytest.fixture
def reasoning_server() -> Iterator[ProtocolServer]:
    server = start_server("openai", token_delay=0.004, reasoning_tokens=3, chat_only=True, model="tiny-llama")
    try:
        yield server
    finally:
        server.stop()


async def test_a_reasoning_server_gives_ttft_and_ttfo_apart_in_the_summary(
        reasoning_server: ProtocolServer, tiny_tokenizer: tokenizer.Tokenizer) -> None:
    wl = as_chat(WorkloadSpec("r", 6, prompt=Lengths.fixed(12), output=Lengths.fixed(8),
                              arrival=Arrival("closed", concurrency=2)).build(), tiny_tokenizer)
    assert reasoning_server.url is not None
    async with _chat_engine(OpenAIServerEngine, reasoning_server.url, startup_timeout=5) as engine:
        records = await LoadGenerator(engine, wl, config=LoadConfig(request_timeout_s=10)).run()
    assert all(r.ok and r.reasoning_tokens == 3 and r.completion_tokens == 8 for r in records)
    summary = summarize(records, duration_s=1.0)
    assert summary.ttft is not None and summary.ttfo is not None and summary.reasoning_tokens is not None
    # three reasoning tokens, 4 ms each, before the answer's first
    assert summary.ttfo.p50 - summary.ttft.p50 >= 3 * 0.003
    assert summary.reasoning_tokens.mean == 3
    check = parity.check(records)
    assert check.ok and check.counted_by == {"engine": 6}
    added = TEMPLATE_TOKENS_PER_MESSAGE + TEMPLATE_GENERATION_TOKENS
    assert check.template_tokens == (added, added)  # the server's template, measured
    assert summary.prompt_tokens_engine is not None and summary.prompt_tokens_sent is not None
    assert summary.prompt_tokens_engine.mean - summary.prompt_tokens_sent.mean == added


async def test_a_chat_only_server_refuses_completions(reasoning_server: ProtocolServer) -> None:
    assert reasoning_server.url is not None
    async with OpenAIServerEngine(model=TINY, url=reasoning_server.url, startup_timeout=5) as engine:
        with pytest.raises(Exception, match="HTTP 404 from /v1/completions"):
            await collect(engine, Request("x", (5, 6, 7), 2))


@pytest.mark.parametrize("with_tokenizer", [True, False])
async def test_a_server_that_sends_no_usage_is_counted_and_the_parity_check_says_how(
        with_tokenizer: bool, tiny_tokenizer: tokenizer.Tokenizer) -> None:
    server = start_server("openai", token_delay=0.001, model="tiny-llama")
    server.usage_options = lambda options: (False, False)  # type: ignore[method-assign]
    try:
        assert server.url is not None
        wl = as_chat(WorkloadSpec("u", 3, prompt=Lengths.fixed(6), output=Lengths.fixed(5),
                                  arrival=Arrival("closed", concurrency=1)).build(), tiny_tokenizer)
        extra = {"text_tokenizer": tiny_tokenizer} if with_tokenizer else {}
        async with _chat_engine(OpenAIServerEngine, server.url, startup_timeout=5, **extra) as engine:
            records = await LoadGenerator(engine, wl).run()
    finally:
        server.stop()
    source = "tokenizer" if with_tokenizer else "chunks"
    assert all(r.ok and r.usage_from == source and r.prompt_tokens is None for r in records)
    # the server's fake tokens are " t123" each: one token per piece, by the pieces and by the tokenizer alike
    assert all(r.completion_tokens is not None and r.completion_tokens >= 5 for r in records)
    if not with_tokenizer:
        assert all(r.completion_tokens == 5 for r in records)
    warning = parity.check(records).warning()
    assert warning is not None and "sent no token usage" in warning


async def test_token_id_requests_go_as_text_the_tokenizer_decodes(tiny_tokenizer: tokenizer.Tokenizer) -> None:
    engine = _chat_engine(text_tokenizer=tiny_tokenizer)
    ids = tuple(tiny_tokenizer.encode(" the engine run"))
    body = engine.chat_payload(Request("w", ids, 3))
    assert body["messages"] == [{"role": "user", "content": " the engine run"}]
    assert _chat_engine().chat_payload(Request("w", (5, 6), 3))["messages"][0]["content"] == "5 6"


def test_an_engine_without_a_chat_route_refuses_the_chat_endpoint_by_name() -> None:
    with pytest.raises(ValueError, match="engine 'sglang' has no chat endpoint"):
        SGLangEngine(model=TINY, url="http://h:1", endpoint="chat")


# ---------------------------------------------------------------- text of exact token lengths


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 400), seed=st.integers(0, 10_000))
def test_text_is_exactly_the_asked_tokens_and_the_same_for_a_seed(n: int, seed: int) -> None:
    tok = tokenizer.load(str(tiny_model_dir()))
    maker = TextMaker(tok)
    text, ids = maker.text(n, random.Random(seed))
    assert len(ids) == n and tok.encode(text) == list(ids)
    assert maker.text(n, random.Random(seed)) == (text, ids)
    assert len(text.split()) == n  # words apart, one token each (what a word-counting server counts)


def test_a_workload_as_chat_keeps_every_length_and_grows_a_conversations_messages(
        tiny_tokenizer: tokenizer.Tokenizer) -> None:
    spec = WorkloadSpec("t", 6, prompt=Lengths.uniform(3, 20), output=Lengths.uniform(2, 9), seed=3, turns=3,
                        think=ThinkTime(), arrival=Arrival("closed", concurrency=2), prefix_tokens=5)
    built = spec.build()
    chat = as_chat(built, tiny_tokenizer)
    assert [r.prompt_len for r in chat.requests] == [r.prompt_len for r in built.requests]
    assert [r.max_tokens for r in chat.requests] == [r.max_tokens for r in built.requests]
    for turns in chat.sessions():
        roles = [[role for role, _ in t.messages or ()] for t in turns]
        assert roles == [["system", "user"], ["system", "user", "assistant", "user"],
                         ["system", "user", "assistant", "user", "assistant", "user"]]
        for earlier, later in itertools.pairwise(turns):
            assert later.messages is not None and earlier.messages is not None
            assert later.messages[:len(earlier.messages)] == earlier.messages  # the list grows, never changes
            said = later.messages[len(earlier.messages)][1]
            assert len(tiny_tokenizer.encode(said)) == earlier.max_tokens  # the answer's stand-in, its length
        for t in turns:
            assert sum(len(tiny_tokenizer.encode(text)) for _, text in t.messages or ()) == t.prompt_len
    assert as_chat(built, tiny_tokenizer).hash() == chat.hash() != built.hash()  # seeded, and not the token ids'


def test_a_sharegpt_conversation_goes_to_chat_as_its_turns(tmp_path: Path,
                                                          tiny_tokenizer: tokenizer.Tokenizer) -> None:
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([{"conversations": [
        {"from": "system", "value": "be brief"}, {"from": "human", "value": "the engine"},
        {"from": "gpt", "value": "it runs"}, {"from": "human", "value": "and the batch"},
        {"from": "gpt", "value": "the batch is full of requests"}, {"from": "human", "value": "no reply"}]}]))
    data = datasets.load(path)
    wl = datasets.build_workload(data, num_requests=2, output=Lengths.fixed(8), tokenize=tiny_tokenizer.encode,
                                 chat=True)
    request = wl.requests[0]
    assert request.messages == (("system", "be brief"), ("user", "the engine"), ("assistant", "it runs"),
                                ("user", "and the batch"))
    assert request.max_tokens == len(tiny_tokenizer.encode("the batch is full of requests"))
    assert request.prompt_len == sum(len(tiny_tokenizer.encode(t)) for _, t in request.messages)
    tokens = tmp_path / "ids.jsonl"
    tokens.write_text('{"prompt_token_ids": [5, 6, 7]}\n')
    with pytest.raises(datasets.DatasetError, match="a chat endpoint takes text"):
        datasets.build_workload(datasets.load(tokens), num_requests=1, output=Lengths.fixed(2),
                                tokenize=tiny_tokenizer.encode, chat=True)


def test_the_parity_check_measures_the_template_and_flags_a_count_below_what_was_sent() -> None:
    def rec(rid: str, sent: int, counted: int) -> RequestRecord:
        return RequestRecord(rid, sent, 4, 0.0, ok=True, prompt_tokens=counted, completion_tokens=4,
                             first_output_s=0.1)

    measured = parity.check([rec("a", 10, 14), rec("b", 20, 26)])
    assert measured.ok and measured.template_tokens == (4, 6)
    assert "added 4-6 prompt tokens" in (measured.template_text() or "")
    below = parity.check([rec("a", 10, 8)])
    assert not below.ok and below.prompt_mismatches == 1
    completions = parity.check([RequestRecord("c", 10, 4, 0.0, ok=True, prompt_tokens=12, completion_tokens=4)])
    assert completions.prompt_mismatches == 1 and completions.template_tokens is None  # no template there
