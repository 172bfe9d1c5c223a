"""Datasets, length distributions, the tiny model's tokenizer, workload parity and runs of a set duration."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import ClassVar

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchbench.adapters.base import Chunk, Engine
from batchbench.core.config import Capabilities, LoadConfig
from batchbench.core.records import RequestRecord
from batchbench.fixtures import tiny_model_dir
from batchbench.load import loadgen, timer
from batchbench.load.loadgen import LoadGenerator
from batchbench.measures import parity
from batchbench.workload import datasets, tokenizer
from batchbench.workload.requests import Arrival, Lengths, Request, WorkloadSpec


@given(value=st.integers(1, 10_000))
def test_a_bare_number_is_a_fixed_length(value: int) -> None:
    assert Lengths.parse(str(value)) == Lengths.fixed(value) == Lengths.parse(f"fixed:{value}")
    assert Lengths.parse(str(value)).max_value == value


@given(low=st.integers(1, 500), span=st.integers(0, 500), seed=st.integers(0, 1000))
def test_uniform_lengths_parse_and_never_draw_above_their_max(low: int, span: int, seed: int) -> None:
    lengths = Lengths.parse(f"uniform:{low}:{low + span}")
    rng = random.Random(seed)
    assert all(low <= lengths.draw(rng, i) <= lengths.max_value == low + span for i in range(50))


@given(median=st.floats(1, 2000), sigma=st.floats(0, 2), seed=st.integers(0, 1000))
def test_an_unbounded_lognormal_is_clipped_at_its_three_sigma_point(median: float, sigma: float, seed: int) -> None:
    lengths = Lengths.parse(f"lognormal:{median}:{sigma}")
    assert lengths.median == median and lengths.sigma == sigma and lengths.low == 1
    assert lengths.max_value >= median * 2.718281828 ** (3 * sigma) > lengths.max_value - 1
    rng = random.Random(seed)
    assert all(1 <= lengths.draw(rng, i) <= lengths.max_value for i in range(50))
    assert Lengths.parse(f"lognormal:{median}:{sigma}:2:3000").max_value == 3000


@pytest.mark.parametrize("text", ["", "x", "uniform:3", "lognormal:1:2:3", "fixed:0", "normal:3:4", "mixed:1:2"])
def test_a_length_that_does_not_parse_names_itself(text: str) -> None:
    with pytest.raises(ValueError, match="lengths"):
        Lengths.parse(text)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_jsonl_dataset_keeps_its_token_ids_and_output_lengths_in_file_order_cycled(tmp_path: Path) -> None:
    path = _write(tmp_path / "d.jsonl", '{"prompt_token_ids": [5, 6, 7], "output_len": 2}\n\n'
                                        '{"prompt_token_ids": [9]}\n')
    data = datasets.load(path)
    assert [e.where for e in data.entries] == [f"{path}:1", f"{path}:3"] and not data.needs_tokenizer
    w = datasets.build_workload(data, num_requests=5, output=Lengths.fixed(7), arrival=Arrival("poisson", rate=4))
    assert [(r.prompt_token_ids, r.max_tokens) for r in w.requests] == [
        ((5, 6, 7), 2), ((9,), 7), ((5, 6, 7), 2), ((9,), 7), ((5, 6, 7), 2)]
    assert [r.arrival_s for r in w.requests] == sorted(r.arrival_s for r in w.requests) and w.requests[-1].arrival_s
    overridden = datasets.build_workload(data, num_requests=2, output=Lengths.fixed(7), override_output=True)
    assert [r.max_tokens for r in overridden.requests] == [7, 7]
    assert w.hash() == datasets.build_workload(data, num_requests=5, output=Lengths.fixed(7),
                                               arrival=Arrival("poisson", rate=4)).hash()


def test_token_ids_outside_the_vocabulary_name_the_line(tmp_path: Path) -> None:
    data = datasets.load(_write(tmp_path / "d.jsonl", '{"prompt_token_ids": [1]}\n{"prompt_token_ids": [5000]}\n'))
    with pytest.raises(datasets.DatasetError, match=r"d.jsonl:2: token id 5000 is outside the model's vocabulary"):
        datasets.build_workload(data, num_requests=2, output=Lengths.fixed(4), vocab_size=2048)


def test_the_tiny_model_ships_a_tokenizer_of_its_vocabulary_size() -> None:
    tok = tokenizer.load(str(tiny_model_dir()))
    assert tok.vocab_size <= json.loads((tiny_model_dir() / "config.json").read_text())["vocab_size"]
    ids = tok.encode("Continuous batching beats static waves.")
    assert 0 < len(ids) < len("Continuous batching beats static waves.") and all(2 < i < 2048 for i in ids)


def test_a_sharegpt_dataset_takes_the_first_human_turn_and_the_replys_token_count(tmp_path: Path) -> None:
    conversations = [
        {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "Hello there"},
                           {"from": "gpt", "value": "General Kenobi, you are a bold one"}]},
        {"conversations": [{"from": "gpt", "value": "nobody asked"}]},
        {"conversations": []},
    ]
    path = _write(tmp_path / "sg.json", json.dumps(conversations))
    data = datasets.load(path)
    assert data.skipped == 2 and data.needs_tokenizer and data.entries[0].where == f"{path} item 1"
    tok = tokenizer.load(str(tiny_model_dir()))
    w = datasets.build_workload(data, num_requests=1, output=Lengths.fixed(99), tokenize=tok.encode,
                                vocab_size=tok.vocab_size)
    (request,) = w.requests
    assert list(request.prompt_token_ids) == tok.encode("Hello there")
    assert request.max_tokens == len(tok.encode("General Kenobi, you are a bold one"))
    with pytest.raises(datasets.DatasetError, match=r"sg.json item 1: text needs the served model's tokenizer"):
        datasets.build_workload(data, num_requests=1, output=Lengths.fixed(4))


@pytest.mark.parametrize(("content", "message"), [
    ('[{"conversations": [{"from": "human", "value": ""}, {"from": "gpt", "value": "x"}]}]',
     r"item 1: value must be non-empty text"),
    ('[{"turns": []}]', r"item 1: expected \{\"conversations\""),
    ('[{"conversations": [{"from": "gpt", "value": "x"}]}]', r"no prompts in it \(1 conversation"),
    ('[\n{"conversations": [}\n]', r"sg.json:2: not JSON"),
    ('{"prompt": "a", "prompt_token_ids": [3]}', r"sg.json:1: give exactly one of prompt"),
])
def test_a_malformed_dataset_names_the_file_and_where(tmp_path: Path, content: str, message: str) -> None:
    with pytest.raises(datasets.DatasetError, match=message):
        datasets.load(_write(tmp_path / "sg.json", content))


def _record(prompt_len: int, prompt_tokens: int | None, max_tokens: int, completion: int | None) -> RequestRecord:
    return RequestRecord(request_id="r", prompt_len=prompt_len, max_tokens=max_tokens, scheduled_s=0.0, ok=True,
                         prompt_tokens=prompt_tokens, completion_tokens=completion)


def test_parity_flags_engines_that_served_other_lengths_than_the_workloads() -> None:
    same = parity.check([_record(4, 4, 8, 8), _record(5, None, 8, None)])
    assert same.ok and same.checked == 1 and same.warning() is None
    retokenised = parity.check([_record(4, 6, 8, 8), _record(4, 4, 8, 3)])
    assert (retokenised.prompt_mismatches, retokenised.output_mismatches) == (1, 1)
    warning = retokenised.warning()
    assert warning is not None and "1 of 2 requests' prompt token counts differ" in warning
    assert "request r: prompt 6 tokens, workload 4" in warning


class Instant(Engine):
    """Answers every request with one token, moving a virtual clock (``now``) on by a second each time."""

    name: ClassVar[str] = "instant"
    capabilities: ClassVar[Capabilities] = Capabilities(server_metrics=False)

    async def start(self) -> None:
        pass

    async def wait_healthy(self, timeout: float) -> None:
        pass

    async def stop(self) -> None:
        pass

    now = 0.0

    async def stream(self, request: Request) -> AsyncIterator[Chunk]:
        self.now += 1.0
        yield Chunk(self.now, 1)


@pytest.mark.parametrize("arrival", [Arrival("closed", concurrency=2), Arrival("waves", concurrency=2)])
async def test_a_closed_loop_of_a_set_duration_sends_nothing_after_it(monkeypatch: pytest.MonkeyPatch,
                                                                       arrival: Arrival) -> None:
    engine = Instant()
    monkeypatch.setattr(loadgen, "now", lambda: engine.now)
    workload = WorkloadSpec("w", 50, output=Lengths.fixed(1), arrival=arrival).build()
    records = await LoadGenerator(engine, workload, config=LoadConfig(send_until_s=10.0)).run(t0=0.0)
    assert 10 <= len(records) < 50
    assert all(r.sent_s < 10.0 for r in records)


async def test_an_open_loop_of_a_set_duration_releases_nothing_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = itertools.count()  # moves one second each time it is read: the deadline passes after a few releases
    monkeypatch.setattr(loadgen, "now", lambda: float(next(clock)))
    monkeypatch.setattr(timer, "now", lambda: float(next(clock)))  # the send timer reads the same clock
    workload = WorkloadSpec("w", 50, output=Lengths.fixed(1), arrival=Arrival("poisson", rate=1000.0)).build()
    records = await LoadGenerator(Instant(), workload, config=LoadConfig(send_until_s=10.0)).run(t0=0.0)
    assert 0 < len(records) < 10
