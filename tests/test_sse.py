"""Server-Sent Events splitting (adapters.http.sse_data): every event whole, however the bytes arrive and
whatever the line endings. The stamp of a chunk is taken when sse_data yields it, so this is also a timing test."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchbench.adapters import http
from batchbench.adapters.base import StreamProtocolError
from batchbench.adapters.http import sse_data


async def arriving(pieces: list[bytes]) -> AsyncIterator[bytes]:
    """A response body that arrives in the given pieces, as TCP segments would."""
    for piece in pieces:
        yield piece


def split_at(body: bytes, cuts: list[int]) -> list[bytes]:
    edges = [0, *sorted({c % (len(body) + 1) for c in cuts}), len(body)]
    return [body[a:b] for a, b in itertools.pairwise(edges)]


def events_of(pieces: list[bytes]) -> list[str]:
    async def collect() -> list[str]:
        return [data async for data in sse_data(arriving(pieces))]

    return asyncio.run(collect())


#: Payload lines: any text without line breaks (JSON, "[DONE]", non-ASCII).
payload_line = st.text(st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)), max_size=30)


@given(
    events=st.lists(st.lists(payload_line, min_size=1, max_size=3), min_size=1, max_size=6),
    eol=st.sampled_from(["\n", "\r\n", "\r"]),
    space=st.booleans(),
    noise=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12),
)
def test_every_event_comes_out_whole(
    events: list[list[str]], eol: str, space: bool, noise: bool, cuts: list[int]
) -> None:
    body = ""
    for lines in events:
        if noise:
            body += f": keep-alive comment{eol}event: message{eol}id: 7{eol}"
        body += "".join(f"data:{' ' if space else ''}{line}{eol}" for line in lines) + eol
    pieces = split_at(body.encode(), cuts)
    # The specification drops one space after "data:", whoever wrote it.
    sent = [[line if space or not line.startswith(" ") else line[1:] for line in lines] for lines in events]
    assert events_of(pieces) == ["\n".join(lines) for lines in sent]


def test_each_event_is_yielded_as_soon_as_its_blank_line_arrives() -> None:
    """The stamp is taken when sse_data yields, so it must not wait for the next piece."""
    arrived: list[int] = []

    async def watched() -> AsyncIterator[bytes]:
        for i, piece in enumerate([b'data: {"a": 1}\r\n', b"\r\n", b'data: {"a": 2}\r\n\r', b"\ndata: [DONE]"]):
            arrived.append(i)
            yield piece

    async def collect() -> list[tuple[str, int]]:
        return [(d, arrived[-1]) async for d in sse_data(watched())]

    assert asyncio.run(collect()) == [('{"a": 1}', 1), ('{"a": 2}', 2), ("[DONE]", 3)]


@pytest.mark.parametrize("eol", ["\n", "\r\n", "\r"])
def test_a_break_anywhere_in_the_stream_changes_nothing(eol: str) -> None:
    """Every single cut, and one byte at a time: a CRLF torn in two is one line end, not two."""
    events = [['{"text": "a"}', '{"more": "é"}'], ["[DONE]"]]
    body = "".join("".join(f"data: {line}{eol}" for line in lines) + eol for lines in events).encode()
    want = ["\n".join(lines) for lines in events]
    for cut in range(len(body) + 1):
        assert events_of([body[:cut], body[cut:]]) == want, (eol, cut)
    assert events_of([body[i:i + 1] for i in range(len(body))]) == want


def test_a_very_long_line_in_many_reads_is_one_event(benchmark) -> None:
    """One 4 MiB event in 4 KiB reads (a runaway engine, a huge prompt echo). Its cost is in the benchmark:
    the unfinished line is appended to in place, not copied again on every read."""
    payload = "x" * (4 << 20)
    body = f"data: {payload}\n\ndata: [DONE]\n\n".encode()
    pieces = [body[i:i + 4096] for i in range(0, len(body), 4096)]
    events = benchmark.pedantic(events_of, args=(pieces,), rounds=3, iterations=1)
    assert events == [payload, "[DONE]"]


@pytest.mark.parametrize("text", ['{"a": NaN}', '{"s": "\\ud800"}', '{"t": "line\u2028sep"}', '[1, 2.5, "é"]',
                                  '{"id": 18446744073709551615, "n": -9223372036854775808}'])
def test_events_parse_as_json_reads_them_with_or_without_orjson(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """orjson where installed, json otherwise: what parses, and to what, does not depend on it."""
    want = json.loads(text)
    got = http.parse_json_event("vllm", text, "r")
    monkeypatch.setattr(http, "orjson", None)
    without = http.parse_json_event("vllm", text, "r")
    assert repr(got) == repr(without) == repr(want)
    with pytest.raises(StreamProtocolError, match="malformed stream event"):
        http.parse_json_event("vllm", text[:-1], "r")
