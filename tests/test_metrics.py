"""Tests for batchbench.measures.metrics: worked examples plus properties a wrong definition would break."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchbench.analysis.theory import (
    continuous_idle_fraction,
    decode_idle_fraction,
    kv_cache_bytes_per_token,
    kv_capacity_tokens,
    padding_fraction,
    waves_idle_fraction,
)
from batchbench.core import codec
from batchbench.core.records import RequestRecord
from batchbench.measures.metrics import (
    Distribution,
    itl_samples,
    mean_decoding,
    percentile,
    steady_state,
    summarize,
    tpot,
    ttft_by_bucket,
)
from batchbench.measures.slo import Slo

finite = st.floats(min_value=-1e9, max_value=1e9, allow_nan=False, allow_infinity=False)
samples = st.lists(finite, min_size=1, max_size=60)
quantile = st.floats(min_value=0.0, max_value=100.0, allow_nan=False)
lengths = st.lists(st.integers(min_value=1, max_value=10_000), min_size=1, max_size=64)


def reference_percentile(values: list[float], q: float) -> Fraction:
    """Exact rational linear interpolation between closest ranks: rank (n-1)*q/100 in the sorted values."""
    ordered = [Fraction(v) for v in sorted(values)]
    rank = Fraction(q) / 100 * (len(ordered) - 1)
    below = int(rank)  # rank >= 0, so int() is floor
    if below == len(ordered) - 1:
        return ordered[below]
    frac = rank - below
    return ordered[below] * (1 - frac) + ordered[below + 1] * frac


def make_record(
    *,
    request_id: str = "r",
    prompt_len: int = 10,
    scheduled_s: float = 0.0,
    sent_s: float = 0.0,
    chunk_times: list[float] | None = None,
    chunk_tokens: list[int] | None = None,
    done_s: float | None = None,
    ok: bool = True,
    error_kind: str | None = None,
    prompt_tokens: int | None = None,
    completion_tokens: int | None = None,
) -> RequestRecord:
    times = list(chunk_times or [])
    tokens = list(chunk_tokens) if chunk_tokens is not None else [1] * len(times)
    if done_s is None and times:
        done_s = times[-1]
    return RequestRecord(
        request_id=request_id,
        prompt_len=prompt_len,
        max_tokens=sum(tokens) or 1,
        scheduled_s=scheduled_s,
        sent_s=sent_s,
        done_s=done_s,
        chunk_times=times,
        chunk_tokens=tokens,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        ok=ok,
        error_kind=error_kind,
    )


@st.composite
def streamed_records(draw: st.DrawFn) -> RequestRecord:
    """A plausible ok record: queued, sent, streamed in chunks of 1..4 tokens, done."""
    scheduled = draw(st.floats(min_value=0.0, max_value=1e4, allow_nan=False))
    lag = draw(st.floats(min_value=0.0, max_value=10.0, allow_nan=False))
    sent = scheduled + lag
    ttft = draw(st.floats(min_value=0.0, max_value=10.0, allow_nan=False))
    gaps = draw(st.lists(st.floats(min_value=0.0, max_value=1.0, allow_nan=False), max_size=30))
    tokens = draw(st.lists(st.integers(min_value=1, max_value=4), min_size=len(gaps) + 1, max_size=len(gaps) + 1))
    times = [sent + ttft]
    for gap in gaps:
        times.append(times[-1] + gap)
    tail = draw(st.floats(min_value=0.0, max_value=1.0, allow_nan=False))
    return make_record(
        scheduled_s=scheduled, sent_s=sent, chunk_times=times, chunk_tokens=tokens, done_s=times[-1] + tail
    )


# --------------------------------------------------------------------------- percentile


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([1, 2, 3, 4], 50, 2.5),
        ([1, 2, 3, 4], 90, 3.7),  # rank 2.7: 3 + 0.7
        ([15, 20, 35, 40, 50], 40, 29.0),  # rank 1.6: 20 + 0.6 * 15
        ([4, 1, 3, 2], 0, 1.0),  # unsorted input
        ([4, 1, 3, 2], 100, 4.0),
        ([10, 7, 4, 3, 2, 1], 50, 3.5),  # numpy's docs example
        ([7.0], 99, 7.0),
    ],
)
def test_percentile_worked_examples(values: list[float], q: float, expected: float) -> None:
    assert percentile(values, q) == pytest.approx(expected, rel=1e-12)


@given(samples, quantile)
def test_percentile_matches_exact_reference(values: list[float], q: float) -> None:
    scale = max(1.0, max(abs(v) for v in values))
    expected = float(reference_percentile(values, q))
    assert math.isclose(percentile(values, q), expected, rel_tol=1e-12, abs_tol=1e-12 * scale)


@given(samples, st.data())
def test_percentile_hits_order_statistics_exactly(values: list[float], data: st.DataObject) -> None:
    n = len(values)
    k = data.draw(st.integers(min_value=0, max_value=n - 1))
    q = 100.0 if n == 1 else 100.0 * k / (n - 1)
    expected = sorted(values)[n - 1 if n == 1 else k]
    # 100*k/(n-1) is rounded, so the rank may land a hair off k and pick up a sliver of the neighbour.
    scale = max(1.0, max(abs(v) for v in values))
    assert math.isclose(percentile(values, q), expected, rel_tol=1e-12, abs_tol=1e-12 * scale)


@given(samples, quantile, quantile)
def test_percentile_monotone_in_q(values: list[float], q1: float, q2: float) -> None:
    lo, hi = sorted((q1, q2))
    assert percentile(values, lo) <= percentile(values, hi)


@given(samples, quantile)
def test_percentile_within_min_max(values: list[float], q: float) -> None:
    assert min(values) <= percentile(values, q) <= max(values)


@given(samples, quantile)
def test_percentile_ignores_input_order(values: list[float], q: float) -> None:
    assert percentile(values, q) == percentile(list(reversed(values)), q) == percentile(sorted(values), q)


@pytest.mark.parametrize("q", [-0.001, 100.001, float("nan"), float("inf")])
def test_percentile_rejects_q_out_of_range(q: float) -> None:
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0, 2.0], q)


def test_percentile_rejects_empty_input() -> None:
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)


def test_distribution_of() -> None:
    assert Distribution.of([]) is None
    d = Distribution.of(float(i) for i in range(1, 101))
    assert d is not None
    assert (d.count, d.min, d.max) == (100, 1.0, 100.0)
    assert d.mean == pytest.approx(50.5)
    assert d.p50 == pytest.approx(50.5)
    assert d.p90 == pytest.approx(90.1)
    assert d.p99 == pytest.approx(99.01)
    assert set(codec.encode(d)) == {"count", "mean", "min", "p50", "p90", "p99", "max"}


@given(samples)
def test_distribution_is_ordered(values: list[float]) -> None:
    d = Distribution.of(values)
    assert d is not None
    assert d.min <= d.p50 <= d.p90 <= d.p99 <= d.max
    slack = 1e-12 * max(abs(d.min), abs(d.max), 1.0)  # the mean is rounded once
    assert d.min - slack <= d.mean <= d.max + slack


# --------------------------------------------------------------------------- ITL and TPOT


def test_itl_samples_split_multi_token_chunks() -> None:
    # First chunk (TTFT) contributes nothing; a 3-token chunk after 0.3 s gives three samples of 0.1 s.
    r = make_record(sent_s=0.0, chunk_times=[1.0, 1.1, 1.4], chunk_tokens=[2, 1, 3])
    assert itl_samples(r) == pytest.approx([0.1, 0.1, 0.1, 0.1])


def test_itl_samples_single_chunk_is_empty() -> None:
    assert itl_samples(make_record(chunk_times=[0.5], chunk_tokens=[7])) == []
    assert itl_samples(make_record(chunk_times=[], chunk_tokens=[])) == []


def test_itl_samples_rejects_inconsistent_chunks() -> None:
    with pytest.raises(ValueError, match="chunk token counts"):
        itl_samples(make_record(chunk_times=[0.1, 0.2], chunk_tokens=[1]))
    with pytest.raises(ValueError, match="carries 0 tokens"):
        itl_samples(make_record(chunk_times=[0.1, 0.2], chunk_tokens=[1, 0]))


@given(streamed_records())
def test_itl_sum_and_count(record: RequestRecord) -> None:
    itl = itl_samples(record)
    assert len(itl) == sum(record.chunk_tokens[1:])
    gap = record.chunk_times[-1] - record.chunk_times[0]
    assert math.isclose(math.fsum(itl), gap, rel_tol=1e-9, abs_tol=1e-9)
    assert all(s >= 0 for s in itl)


@given(streamed_records())
def test_tpot_is_mean_itl_when_usage_matches_chunks(record: RequestRecord) -> None:
    # Without a usage report output tokens are the chunk counts; TPOT then spreads the same
    # first-to-last gap over every token after the first (the first chunk's extra tokens included).
    t = tpot(record)
    n = sum(record.chunk_tokens)
    if n < 2 or len(record.chunk_times) < 2:
        assert t is None
        return
    assert t is not None
    gap = record.chunk_times[-1] - record.chunk_times[0]
    assert math.isclose(t * (n - 1), gap, rel_tol=1e-9, abs_tol=1e-9)


def test_tpot_worked_examples() -> None:
    r = make_record(chunk_times=[1.0, 1.2, 1.5], chunk_tokens=[1, 1, 1])
    assert tpot(r) == pytest.approx(0.25)
    # The engine's usage count wins over the chunk counts.
    r = make_record(chunk_times=[1.0, 1.2, 1.5], chunk_tokens=[1, 1, 1], completion_tokens=6)
    assert tpot(r) == pytest.approx(0.1)
    assert tpot(make_record(chunk_times=[1.0], chunk_tokens=[1])) is None
    assert tpot(make_record(chunk_times=[1.0, 1.5], chunk_tokens=[1, 1], ok=False, error_kind="http")) is None
    assert tpot(make_record(chunk_times=[1.0, 1.5], chunk_tokens=[1, 1], completion_tokens=1)) is None


# --------------------------------------------------------------------------- static-batching waste


def test_padding_fraction_worked_example() -> None:
    frac = padding_fraction([4096] + [100] * 31)
    assert frac == pytest.approx(31 * (4096 - 100) / (32 * 4096))
    assert frac == pytest.approx(0.9451, abs=5e-5)


@given(lengths)
def test_padding_tokens_are_batch_times_max_minus_sum(lens: list[int]) -> None:
    slots = len(lens) * max(lens)
    pad = padding_fraction(lens) * slots
    assert math.isclose(pad, slots - sum(lens), rel_tol=1e-12, abs_tol=1e-9)
    assert 0.0 <= padding_fraction(lens) < 1.0
    assert (padding_fraction(lens) == 0.0) == (len(set(lens)) == 1)


@given(lengths, st.permutations(range(64)))
def test_padding_fraction_ignores_order(lens: list[int], perm: list[int]) -> None:
    shuffled = [lens[i] for i in perm if i < len(lens)]
    assert padding_fraction(shuffled) == padding_fraction(lens)


def test_decode_idle_fraction_worked_example() -> None:
    # Slots decode 10 steps; the two short ones idle 5 steps each: 10 idle of 30.
    assert decode_idle_fraction([10, 5, 5]) == pytest.approx(1 / 3)
    assert decode_idle_fraction([8, 8, 8, 8]) == 0.0
    assert decode_idle_fraction([1000] + [1] * 15) == pytest.approx(15 * 999 / (16 * 1000))


@given(lengths)
def test_decode_idle_slot_steps(lens: list[int]) -> None:
    steps = len(lens) * max(lens)
    idle = sum(max(lens) - n for n in lens)  # counted per slot, a different route than B*max - sum
    assert math.isclose(decode_idle_fraction(lens) * steps, idle, rel_tol=1e-12, abs_tol=1e-9)


@given(lengths, st.integers(min_value=1, max_value=100))
def test_idle_slot_steps_grow_with_a_longer_straggler(lens: list[int], extra: int) -> None:
    # Appending a sequence longer than all others makes every existing slot idle `extra` steps more.
    longer = max(lens) + extra
    before = decode_idle_fraction(lens) * len(lens) * max(lens)
    after = decode_idle_fraction([*lens, longer]) * (len(lens) + 1) * longer
    assert math.isclose(after, before + extra * len(lens), rel_tol=1e-9)


def test_waste_fractions_reject_empty_batch() -> None:
    with pytest.raises(ValueError, match="at least one sequence"):
        padding_fraction([])
    with pytest.raises(ValueError, match="at least one sequence"):
        decode_idle_fraction([])


def test_waves_and_continuous_idle_worked_example() -> None:
    # Two slots. Waves: [10, 5] takes 10 steps, [5, 2] 5 more: 22 busy of 2 x 15 slot-steps.
    assert waves_idle_fraction([10, 5, 5, 2], 2) == pytest.approx(8 / 30)
    # Refilled at once: the 5s run back to back beside the 10, the 2 starts at step 10: 22 of 2 x 12.
    assert continuous_idle_fraction([10, 5, 5, 2], 2) == pytest.approx(2 / 24)
    # A short last wave leaves slots empty: 3 busy of 2 x 3.
    assert waves_idle_fraction([3], 2) == pytest.approx(0.5)


def simulated_continuous_steps(lens: list[int], n: int) -> int:
    """Steps of iteration-level batching, simulated one step at a time (not by list scheduling)."""
    pending, running, steps = list(lens), [], 0
    while pending or running:
        while len(running) < n and pending:
            running.append(pending.pop(0))
        steps += 1
        running = [left - 1 for left in running if left > 1]
    return steps


slots = st.integers(min_value=1, max_value=12)


@given(st.lists(st.integers(min_value=1, max_value=60), min_size=1, max_size=40), slots)
def test_continuous_idle_matches_a_step_by_step_simulation(lens: list[int], n: int) -> None:
    steps = simulated_continuous_steps(lens, n)
    assert continuous_idle_fraction(lens, n) == pytest.approx(1 - sum(lens) / (n * steps))


@given(lengths, slots)
def test_refilling_slots_never_idles_more_than_waves(lens: list[int], n: int) -> None:
    assert continuous_idle_fraction(lens, n) <= waves_idle_fraction(lens, n) + 1e-12


@given(lengths)
def test_one_full_wave_is_one_static_batch(lens: list[int]) -> None:
    # With exactly as many slots as requests there is one wave and nothing to refill.
    n = len(lens)
    assert waves_idle_fraction(lens, n) == pytest.approx(decode_idle_fraction(lens))
    assert continuous_idle_fraction(lens, n) == pytest.approx(decode_idle_fraction(lens))


@given(lengths)
def test_one_slot_never_idles(lens: list[int]) -> None:
    assert waves_idle_fraction(lens, 1) == pytest.approx(0.0, abs=1e-12)
    assert continuous_idle_fraction(lens, 1) == pytest.approx(0.0, abs=1e-12)


def test_slot_idle_fractions_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="n must be >= 1"):
        waves_idle_fraction([4], 0)
    with pytest.raises(ValueError, match="at least one sequence"):
        continuous_idle_fraction([], 4)


def test_mean_decoding_worked_example() -> None:
    # Decoding 0..2 and 1..2 (the first chunk ends prefill), over a 4 s run: 3 request-seconds / 4 s.
    records = [make_record(chunk_times=[0.0, 1.0, 2.0]), make_record(chunk_times=[1.0, 2.0], done_s=3.5)]
    assert mean_decoding(records, 4.0) == pytest.approx(0.75)
    assert summarize(records, duration_s=4.0).mean_decoding == pytest.approx(0.75)
    # One chunk: the request never decoded after its first token.
    assert mean_decoding([make_record(chunk_times=[1.0])], 2.0) == 0.0
    with pytest.raises(ValueError, match="duration_s"):
        mean_decoding(records, 0.0)


spans = st.lists(st.tuples(st.integers(0, 100), st.integers(1, 50)), min_size=1, max_size=30)


@given(spans)
def test_mean_decoding_is_the_time_average_of_requests_decoding(pairs: list[tuple[int, int]]) -> None:
    # The integral of "how many are decoding now", swept over 0.5 s cells (spans start and end on whole
    # seconds), divided by the run's length: the definition read the other way round.
    records = [make_record(chunk_times=[float(a), float(a + d)]) for a, d in pairs]
    duration = 200.0
    cells = [t + 0.5 for t in range(200)]
    integral = sum(sum(1 for a, d in pairs if a < c < a + d) for c in cells)
    assert mean_decoding(records, duration) == pytest.approx(integral / duration)


# --------------------------------------------------------------------------- KV cache


def test_kv_bytes_gqa_vs_mha() -> None:
    # Llama-3-8B: 32 layers, 32 query heads but 8 KV heads, head dim 128, bf16.
    gqa = kv_cache_bytes_per_token(32, 8, 128, 2)
    mha = kv_cache_bytes_per_token(32, 32, 128, 2)
    assert gqa == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert mha == 512 * 1024
    assert mha == 4 * gqa  # 32 query heads / 8 KV heads
    # The tiny fixture model (2 layers, 2 KV heads of dim 64, bf16).
    assert kv_cache_bytes_per_token(2, 2, 64, 2) == 1024


def test_kv_capacity_counts_whole_blocks() -> None:
    per_token = kv_cache_bytes_per_token(32, 8, 128, 2)
    assert kv_capacity_tokens(1 << 30, per_token) == 8192  # 1 GiB / 128 KiB
    assert kv_capacity_tokens(1 << 30, per_token, block_size=16) == 8192
    # 8191.99 tokens' worth: per-token allocation keeps 8191, 16-token blocks keep 511 whole blocks.
    assert kv_capacity_tokens((1 << 30) - 1, per_token) == 8191
    assert kv_capacity_tokens((1 << 30) - 1, per_token, block_size=16) == 8176
    assert kv_capacity_tokens(0, per_token, block_size=16) == 0


@given(
    st.integers(min_value=0, max_value=1 << 40),
    st.integers(min_value=1, max_value=1 << 20),
    st.integers(min_value=1, max_value=256),
)
def test_kv_capacity_properties(memory: int, per_token: int, block: int) -> None:
    cap = kv_capacity_tokens(memory, per_token, block)
    assert cap % block == 0
    assert cap * per_token <= memory < (cap + block) * per_token
    assert cap <= kv_capacity_tokens(memory, per_token)


def test_kv_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="num_kv_heads"):
        kv_cache_bytes_per_token(32, 0, 128, 2)
    with pytest.raises(ValueError, match="bytes_per_token"):
        kv_capacity_tokens(1024, 0)
    with pytest.raises(ValueError, match="block_size"):
        kv_capacity_tokens(1024, 8, block_size=0)


# --------------------------------------------------------------------------- summarize


def _run() -> list[RequestRecord]:
    """Three ok requests, one HTTP failure, one rejection."""
    return [
        # TTFT 0.1, TPOT 0.1 (4 tokens over 0.3 s), queued 0.5 s.
        make_record(request_id="a", prompt_len=10, scheduled_s=0.0, sent_s=0.5,
                    chunk_times=[0.6, 0.7, 0.8, 0.9], done_s=1.0),
        # TTFT 0.5 (misses a 0.2 s TTFT SLO), TPOT 0.05; the engine counted 12 prompt tokens.
        make_record(request_id="b", prompt_len=10, prompt_tokens=12, scheduled_s=1.0, sent_s=1.0,
                    chunk_times=[1.5, 1.55, 1.6], done_s=1.6),
        # TTFT 0.1, TPOT 0.5 (misses a 0.2 s TPOT SLO); 2 output tokens in one chunk then one more.
        make_record(request_id="c", prompt_len=20, scheduled_s=2.0, sent_s=2.0,
                    chunk_times=[2.1, 3.1], chunk_tokens=[2, 1], done_s=3.2),
        make_record(request_id="d", prompt_len=1000, scheduled_s=3.0, sent_s=3.0, done_s=9.0,
                    chunk_times=[30.0], ok=False, error_kind="http"),
        make_record(request_id="e", prompt_len=1000, scheduled_s=3.0, sent_s=3.0, done_s=3.01,
                    ok=False, error_kind="rejected"),
    ]


def test_summarize_counts_and_throughput() -> None:
    s = summarize(_run(), duration_s=4.0)
    assert (s.requests, s.ok, s.failed, s.rejected) == (5, 3, 2, 1)
    assert s.failures == {"http": 1, "rejected": 1}
    assert s.rejection_rate == pytest.approx(1 / 5)
    assert s.request_throughput == pytest.approx(3 / 4.0)
    # Output tokens of ok requests only: 4 + 3 + 3.
    assert s.output_token_throughput == pytest.approx(10 / 4.0)
    # Prompt tokens: usage when given (12 for b), else prompt_len; failed requests' 2000 excluded.
    assert s.total_token_throughput == pytest.approx((10 + 12 + 20 + 10) / 4.0)


def test_summarize_excludes_failed_from_latency() -> None:
    s = summarize(_run(), duration_s=4.0)
    assert s.ttft is not None and s.e2e is not None and s.e2e_from_schedule is not None
    assert s.ttft.count == 3  # the failed request's 27 s "TTFT" is not there
    assert s.ttft.max == pytest.approx(0.5)
    assert s.e2e.count == 3 and s.e2e.max == pytest.approx(1.2)
    assert s.e2e_from_schedule.max == pytest.approx(1.2)
    assert s.e2e_from_schedule.min == pytest.approx(0.6)  # b: 1.6 - 1.0
    assert s.e2e.min == pytest.approx(0.5)  # a: 1.0 - 0.5
    assert s.schedule_lag is not None and s.schedule_lag.max == pytest.approx(0.5)
    assert s.tpot is not None and s.tpot.count == 3
    assert s.tpot.min == pytest.approx(0.05) and s.tpot.max == pytest.approx(0.5)
    # ITL pooled over tokens after each first chunk: 3 + 2 + 1.
    assert s.itl is not None and s.itl.count == 6
    assert s.itl.mean == pytest.approx((0.3 + 0.1 + 1.0) / 6)


def test_summarize_goodput_with_slos() -> None:
    records = _run()
    assert summarize(records, duration_s=4.0).goodput == pytest.approx(3 / 4.0)  # no SLO: every ok request
    s = summarize(records, duration_s=4.0, ttft_slo_s=0.2)
    assert s.good == 2 and s.goodput == pytest.approx(2 / 4.0)  # b misses
    s = summarize(records, duration_s=4.0, tpot_slo_s=0.2)
    assert s.good == 2  # c misses
    s = summarize(records, duration_s=4.0, ttft_slo_s=0.2, tpot_slo_s=0.2)
    assert s.good == 1 and s.goodput == pytest.approx(1 / 4.0)
    assert s.goodput_fraction == pytest.approx(1 / 5)  # failed requests count as missing
    # Boundaries are inclusive: meeting an SLO exactly counts.
    assert summarize(records, duration_s=4.0, tpot_slo_s=0.5).good == 3


def test_summarize_to_dict_is_json() -> None:
    doc = codec.encode(summarize(_run(), duration_s=4.0, ttft_slo_s=0.2))
    assert json.loads(json.dumps(doc)) == doc
    assert doc["ttft"]["count"] == 3
    assert doc["failures"] == {"http": 1, "rejected": 1}
    empty = codec.encode(summarize([], duration_s=1.0))
    assert json.loads(json.dumps(empty)) == empty
    assert empty["ttft"] is None and empty["rejection_rate"] is None and empty["request_throughput"] == 0.0


def test_summarize_rejects_nonpositive_duration() -> None:
    with pytest.raises(ValueError, match="duration_s"):
        summarize(_run(), duration_s=0.0)


@given(st.lists(streamed_records(), min_size=1, max_size=10))
def test_e2e_from_schedule_at_least_e2e(records: list[RequestRecord]) -> None:
    for r in records:
        assert r.e2e_from_schedule_s is not None and r.e2e_s is not None
        assert r.e2e_from_schedule_s >= r.e2e_s
    s = summarize(records, duration_s=1.0)
    assert s.e2e is not None and s.e2e_from_schedule is not None
    assert s.e2e_from_schedule.max >= s.e2e.max
    assert s.e2e_from_schedule.p50 >= s.e2e.p50 - 1e-9
    assert s.e2e_from_schedule.min >= s.e2e.min


@given(st.lists(streamed_records(), min_size=1, max_size=10), st.floats(min_value=0.01, max_value=1e4))
def test_summarize_throughput_properties(records: list[RequestRecord], duration: float) -> None:
    s = summarize(records, duration_s=duration)
    assert math.isclose(s.request_throughput * duration, len(records))
    assert math.isclose(s.output_token_throughput * duration, sum(sum(r.chunk_tokens) for r in records))
    assert s.total_token_throughput >= s.output_token_throughput
    assert s.goodput == s.request_throughput and s.goodput_fraction == 1.0
    assert s.itl is not None or all(len(r.chunk_times) == 1 for r in records)
    if s.itl is not None:
        assert s.itl.count == sum(sum(r.chunk_tokens[1:]) for r in records)


@given(st.lists(streamed_records(), min_size=1, max_size=10), st.floats(min_value=0.0, max_value=20.0))
def test_goodput_matches_direct_count(records: list[RequestRecord], slo: float) -> None:
    s = summarize(records, duration_s=2.0, ttft_slo_s=slo)
    direct = sum(1 for r in records if r.ttft_s is not None and r.ttft_s <= slo)
    assert s.good == direct
    assert s.goodput == pytest.approx(direct / 2.0)


# --------------------------------------------------------------------------- TTFT by batch-size bucket


def test_ttft_by_bucket_labels_and_grouping() -> None:
    sizes = {"a": 1, "b": 3, "c": 2, "d": 40, "e": 16}
    records = [make_record(request_id=k, sent_s=0.0, chunk_times=[v / 100]) for k, v in sizes.items()]
    records.append(make_record(request_id="x", chunk_times=[9.0], ok=False, error_kind="http"))
    by = ttft_by_bucket(records, lambda r: sizes.get(r.request_id, 1), (1, 2, 4, 8, 16))
    assert list(by) == ["1", "2-3", "4-7", "8-15", "16+"]
    one, two_three, four_seven, eight_fifteen, sixteen_plus = by.values()
    assert one is not None and one.count == 1 and one.max == pytest.approx(0.01)  # failed "x" excluded
    assert two_three is not None and two_three.count == 2
    assert four_seven is None and eight_fifteen is None
    assert sixteen_plus is not None and sixteen_plus.count == 2 and sixteen_plus.min == pytest.approx(0.16)


def test_ttft_by_bucket_rejects_bad_edges_and_sizes() -> None:
    records = [make_record(chunk_times=[0.1])]
    with pytest.raises(ValueError, match="empty"):
        ttft_by_bucket(records, lambda r: 1, ())
    with pytest.raises(ValueError, match="strictly increasing"):
        ttft_by_bucket(records, lambda r: 1, (1, 4, 2))
    with pytest.raises(ValueError, match="below the first edge"):
        ttft_by_bucket(records, lambda r: 0, (1, 2))


@given(st.lists(st.integers(min_value=1, max_value=100), min_size=1, max_size=30))
def test_ttft_by_bucket_partitions_records(sizes: list[int]) -> None:
    records = [make_record(request_id=str(i), chunk_times=[0.01 * i]) for i in range(len(sizes))]
    by = ttft_by_bucket(records, lambda r: sizes[int(r.request_id)], (1, 2, 4, 8, 16, 32))
    assert sum(d.count for d in by.values() if d is not None) == len(records)
    bounds = {"1": (1, 1), "2-3": (2, 3), "4-7": (4, 7), "8-15": (8, 15), "16-31": (16, 31), "32+": (32, 10**9)}
    assert list(by) == list(bounds)
    for label, (lo, hi) in bounds.items():
        d = by[label]
        assert (0 if d is None else d.count) == sum(1 for s in sizes if lo <= s <= hi)


# --------------------------------------------------------------------------- a closed loop's steady state


def closed_loop(clients: int, per_client: int, lifetime: float, tokens: int, *, burst_ttft: float = 0.0,
                stagger: float = 0.0) -> list[RequestRecord]:
    """A perfect closed loop: each client sends its next request the moment the last one ends; a request streams
    ``tokens`` tokens evenly over ``lifetime`` (the first after lifetime / tokens), and the opening round's first
    tokens come ``burst_ttft`` later (every client's prompt prefilled at once). Client i starts at i x ``stagger``."""
    records = []
    for i in range(clients):
        t = i * stagger
        for j in range(per_client):
            delay = burst_ttft if j == 0 else 0.0
            times = [t + delay + (m + 1) * lifetime / tokens for m in range(tokens)]
            records.append(RequestRecord(request_id=f"r{i}-{j}", prompt_len=8, max_tokens=tokens, scheduled_s=t,
                                         sent_s=t, done_s=times[-1], closed_s=times[-1], chunk_times=times,
                                         chunk_tokens=[1] * tokens, completion_tokens=tokens, ok=True))
            t = times[-1]
    return records


@given(st.integers(1, 16), st.integers(3, 12), st.floats(0.05, 2.0), st.integers(2, 64), st.floats(0.0, 1.0))
def test_a_closed_loops_steady_throughput_is_its_clients_over_a_lifetime(
        clients: int, per_client: int, lifetime: float, tokens: int, stagger_share: float) -> None:
    records = closed_loop(clients, per_client, lifetime, tokens, stagger=stagger_share * lifetime / clients)
    found = steady_state(records)
    assert found is not None and found.end_s > found.start_s
    expected = clients * tokens / lifetime
    # Tokens arrive one at a time: the window can hold up to one token per client more or less than the rate.
    slack = clients / found.duration_s
    assert abs(found.output_token_throughput - expected) <= slack + 1e-9 * expected


def test_the_opening_burst_and_the_drain_stay_out_of_the_steady_state() -> None:
    records = closed_loop(4, 6, 1.0, 10, burst_ttft=2.0, stagger=0.1)
    whole = summarize(records, duration_s=max(r.done_s for r in records), closed_loop=True)
    steady = whole.steady
    assert steady is not None
    # The opening round's first tokens waited 2 s more; no request sent in the steady state did.
    assert whole.ttft.max == pytest.approx(2.1) and steady.ttft.max == pytest.approx(0.1)
    assert steady.requests < whole.requests and whole.curve_throughput == steady.output_token_throughput
    assert steady.output_token_throughput == pytest.approx(40.0, rel=0.1)  # 4 clients x 10 tokens a second
    assert whole.output_token_throughput < steady.output_token_throughput  # ramp-up and drain weigh the run down
    assert summarize(records, duration_s=12.0).steady is None  # not a closed loop: no steady state


def test_a_run_no_longer_than_one_round_has_no_steady_state() -> None:
    assert steady_state(closed_loop(8, 1, 1.0, 4)) is None
    assert steady_state([]) is None


def test_an_slo_is_judged_on_the_steady_state_of_a_closed_loop() -> None:
    records = closed_loop(4, 6, 1.0, 10, burst_ttft=2.0)
    summary = summarize(records, duration_s=20.0, closed_loop=True)
    verdict = Slo.parse("ttft_p99=500ms").check(summary)
    assert verdict.met and verdict.values["ttft_p99"] == pytest.approx(0.1)


def test_ttfo_is_the_answers_first_token_where_a_stream_reasoned_else_ttft() -> None:
    plain = make_record(chunk_times=[1.2, 1.3], sent_s=1.0)
    assert plain.ttfo_s == plain.ttft_s == pytest.approx(0.2)
    reasoned = make_record(chunk_times=[1.2, 1.3, 1.5], sent_s=1.0)
    reasoned.reasoning_tokens, reasoned.first_output_s = 2, 1.5
    assert reasoned.ttft_s == pytest.approx(0.2) and reasoned.ttfo_s == pytest.approx(0.5)
    only_reasoning = make_record(chunk_times=[1.2, 1.3], sent_s=1.0)
    only_reasoning.reasoning_tokens = 2  # max_tokens ran out while it reasoned: no answer, no TTFO
    assert only_reasoning.ttfo_s is None
    summary = summarize([plain, reasoned, only_reasoning], duration_s=1.0)
    assert summary.ttfo is not None and summary.ttfo.count == 2 and summary.ttfo.max == pytest.approx(0.5)
    assert summary.reasoning_tokens is not None and summary.reasoning_tokens.count == 2
    assert summarize([plain], duration_s=1.0).reasoning_tokens is None  # nothing reasoned: no such figure
