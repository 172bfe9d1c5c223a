"""Tests for batchbench.analysis.regimes: synthetic sweeps whose regimes are known by construction."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchbench.analysis.regimes import (
    PEAK_SHARE,
    REGIME_RANK,
    SweepPoint,
    classify_regimes,
    corroborated_best,
    gain_per_doubling,
    median_of,
    point_from_run,
    steady_state_ttfts,
)
from batchbench.analysis.theory import kv_fit_concurrency
from batchbench.core.records import RequestRecord
from batchbench.core.server_metrics import ServerMetrics
from batchbench.measures.guardrails import KV_DANGER
from batchbench.measures.metrics import summarize

#: Sweeps of 2..10 powers of two from 1, like the profiles' sweeps.
levels = st.integers(min_value=2, max_value=10).map(lambda n: [2**i for i in range(n)])


def curve(concurrencies: list[int], knee: int, *, per_request: float = 10.0, after: list[float] | None = None,
          kv: list[float | None] | None = None, preemptions: list[float | None] | None = None,
          waiting: list[float | None] | None = None) -> list[SweepPoint]:
    """Linear throughput up to index ``knee``, then ``after[i]`` x the knee's throughput (flat by default).

    TTFT stays at one prefill (0.05 s) up to the knee and grows with the queue past it.
    """
    n = len(concurrencies)
    points = []
    for i, c in enumerate(concurrencies):
        if i <= knee:
            throughput, ttft = per_request * c, 0.05
        else:
            factor = after[i - knee - 1] if after is not None else 1.0
            throughput, ttft = per_request * concurrencies[knee] * factor, 0.05 * c / concurrencies[knee]
        points.append(SweepPoint(
            concurrency=c, throughput=throughput, ttft_p50=ttft, ttft_p99=2 * ttft,
            kv_usage_peak=kv[i] if kv is not None else None,
            preemptions=preemptions[i] if preemptions is not None else None,
            waiting_peak=waiting[i] if waiting is not None else None,
        ))
    assert len(points) == n
    return points


@st.composite
def monotone_then_flat(draw: st.DrawFn) -> tuple[list[SweepPoint], int]:
    """A linear ramp to a knee, then a plateau that stays within PEAK_SHARE of the knee and never passes its peak
    by more than that (so the knee is the first point within PEAK_SHARE of the peak), or falls."""
    cs = draw(levels)
    knee = draw(st.integers(min_value=0, max_value=len(cs) - 1))
    after = draw(st.lists(st.floats(min_value=0.3, max_value=1 / PEAK_SHARE - 1e-6), min_size=len(cs) - knee - 1,
                          max_size=len(cs) - knee - 1))
    # The point before the knee (half the knee's throughput) must stay under PEAK_SHARE of the peak.
    return curve(cs, knee, after=after), knee


@given(monotone_then_flat())
def test_monotone_then_flat_gives_ordered_labels_and_the_true_knee(case: tuple[list[SweepPoint], int]) -> None:
    points, knee = case
    report = classify_regimes(points)
    regimes = [p.regime for p in report.points]
    assert regimes == ["under-utilised"] * knee + ["sweet-spot"] + ["saturated"] * (len(points) - knee - 1)
    assert report.sweet_spot == points[knee].concurrency
    assert not report.has_kv_data


@given(st.lists(st.floats(min_value=0.0, max_value=1e4), min_size=1, max_size=8), st.data())
def test_the_sweet_spot_is_the_smallest_batch_within_the_peak_share(throughputs: list[float],
                                                                    data: st.DataObject) -> None:
    """Whatever the curve's shape: nothing below the sweet spot reaches PEAK_SHARE of the peak, the sweet spot does,
    and no point is ever labelled memory-bound without memory evidence."""
    n = len(throughputs)
    kv = data.draw(st.lists(st.one_of(st.none(), st.floats(0, 1)), min_size=n, max_size=n))
    pre = data.draw(st.lists(st.one_of(st.none(), st.floats(0, 50)), min_size=n, max_size=n))
    points = [SweepPoint(2**i, t, 0.1, 0.2, k, q) for i, (t, k, q) in enumerate(zip(throughputs, kv, pre))]
    report = classify_regimes(points)
    peak = max(throughputs)
    sweet = [p.concurrency for p in points].index(report.sweet_spot)
    assert throughputs[sweet] >= PEAK_SHARE * peak
    assert all(t < PEAK_SHARE * peak for t in throughputs[:sweet])
    for p in report.points:
        kv = p.point.kv_usage_peak
        evidence = (kv is not None and kv >= KV_DANGER) or bool(p.point.preemptions)
        if p.regime == "memory-bound":
            assert evidence
        if p.concurrency > report.sweet_spot and not evidence:
            assert p.regime == ("compute-saturated" if report.has_kv_data else "saturated")


@given(monotone_then_flat(), st.data())
def test_labels_never_go_back(case: tuple[list[SweepPoint], int], data: st.DataObject) -> None:
    """Whatever the memory signals, regimes only move forward and memory-bound never precedes under-utilised."""
    points, _ = case
    n = len(points)
    kv = data.draw(st.lists(st.one_of(st.none(), st.floats(0, 1)), min_size=n, max_size=n))
    pre = data.draw(st.lists(st.one_of(st.none(), st.floats(0, 50)), min_size=n, max_size=n))
    noisy = [SweepPoint(p.concurrency, p.throughput, p.ttft_p50, p.ttft_p99, k, q) for p, k, q in zip(points, kv, pre)]
    report = classify_regimes(noisy)
    ranks = [REGIME_RANK[p.regime] for p in report.points]
    assert ranks == sorted(ranks)
    regimes = [p.regime for p in report.points]
    assert regimes.count("sweet-spot") == 1
    if "memory-bound" in regimes and "under-utilised" in regimes:
        assert regimes.index("under-utilised") < regimes.index("memory-bound")


@given(levels, st.data())
def test_full_kv_past_the_knee_is_memory_bound(cs: list[int], data: st.DataObject) -> None:
    knee = data.draw(st.integers(min_value=0, max_value=len(cs) - 2))
    kv = [min(1.0, 0.9 * c / cs[knee]) for c in cs]  # fills as concurrency grows, full from the knee on
    report = classify_regimes(curve(cs, knee, kv=kv))
    assert [p.regime for p in report.points[knee + 1:]] == ["memory-bound"] * (len(cs) - knee - 1)
    assert report.has_kv_data
    assert all(p.memory_pressure for p in report.points[knee + 1:])


def test_each_memory_signal_alone_makes_memory_bound_and_a_queue_alone_does_not() -> None:
    cs = [1, 2, 4, 8, 16]
    low_kv = [0.1, 0.2, 0.4, 0.5, 0.5]
    by_kv = classify_regimes(curve(cs, 2, kv=[0.1, 0.2, 0.4, 0.86, 0.99]))
    by_preemption = classify_regimes(curve(cs, 2, kv=low_kv, preemptions=[0, 0, 0, 3, 9]))
    for report in (by_kv, by_preemption):
        assert [p.regime for p in report.points] == ["under-utilised"] * 2 + ["sweet-spot"] + ["memory-bound"] * 2
    # A plateau on a KV engine whose cache is not full is not memory, even with requests waiting (the batch cap,
    # or a compute-bound step, holds them): compute-saturated.
    plain = classify_regimes(curve(cs, 2, kv=low_kv, preemptions=[0] * 5, waiting=[0, 0, 0, 4, 12]))
    assert [p.regime for p in plain.points][3:] == ["compute-saturated", "compute-saturated"]


def test_a_cache_a_quarter_full_is_compute_saturated_not_memory_bound() -> None:
    """The shared slow machine's hf-continuous curve: flat from batch 2 with the cache at 25%, full from 16."""
    points = [SweepPoint(c, t, 0.1, 0.2, kv, 0.0, w) for c, t, kv, w in [
        (1, 191, 0.03, 0), (2, 257, 0.25, 1), (4, 314, 0.5, 2), (8, 360, 0.95, 3), (16, 311, 1.0, 9),
        (32, 303, 1.0, 25)]]
    report = classify_regimes(points)
    assert report.labels == {1: "under-utilised", 2: "under-utilised", 4: "under-utilised", 8: "sweet-spot",
                             16: "memory-bound", 32: "memory-bound"}
    early = classify_regimes([SweepPoint(c, t, 0.1, 0.2, kv, 0.0) for c, t, kv in [
        (1, 100, 0.05), (2, 180, 0.25), (4, 190, 0.5), (8, 185, 0.95), (16, 180, 1.0)]])
    assert early.labels == {1: "under-utilised", 2: "sweet-spot", 4: "compute-saturated", 8: "memory-bound",
                            16: "memory-bound"}


def test_kv_threshold_is_inclusive_and_configurable() -> None:
    cs = [1, 2, 4]
    assert classify_regimes(curve(cs, 1, kv=[0.1, 0.5, KV_DANGER])).labels[4] == "memory-bound"
    assert classify_regimes(curve(cs, 1, kv=[0.1, 0.5, 0.7])).labels[4] == "compute-saturated"
    assert classify_regimes(curve(cs, 1, kv=[0.1, 0.5, 0.7]), kv_danger=0.7).labels[4] == "memory-bound"


def test_without_kv_data_regime_three_is_saturated_even_with_a_queue() -> None:
    report = classify_regimes(curve([1, 2, 4, 8, 16, 32], 3, waiting=[0, 0, 0, 0, 8, 24]))
    assert report.labels == {1: "under-utilised", 2: "under-utilised", 4: "under-utilised", 8: "sweet-spot",
                             16: "saturated", 32: "saturated"}


@given(levels, st.data())
def test_a_stall_below_or_past_the_knee_does_not_move_it(cs: list[int], data: st.DataObject) -> None:
    """A stall only lowers one point's throughput (by up to 40% here); the knee of a linear-then-flat curve stays
    where it is unless the stalled point is the knee itself (a stall past it leaves the knee at the peak)."""
    knee = data.draw(st.integers(min_value=0, max_value=len(cs) - 1))
    hit = data.draw(st.integers(min_value=0, max_value=len(cs) - 1).filter(lambda i: i != knee))
    loss = data.draw(st.floats(min_value=0.0, max_value=0.4))
    points = curve(cs, knee)
    p = points[hit]
    points[hit] = SweepPoint(p.concurrency, p.throughput * (1 - loss), p.ttft_p50, p.ttft_p99)
    assert classify_regimes(points).sweet_spot == cs[knee]


def test_a_sweep_that_still_scales_has_its_sweet_spot_at_the_end() -> None:
    report = classify_regimes(curve([1, 2, 4, 8], 3))
    assert report.labels == {1: "under-utilised", 2: "under-utilised", 4: "under-utilised", 8: "sweet-spot"}


def test_falling_throughput_past_the_knee_is_regime_three() -> None:
    report = classify_regimes(curve([1, 2, 4, 8, 16], 2, after=[0.8, 0.5], kv=[0.1, 0.3, 0.6, 1.0, 1.0]))
    assert report.labels == {1: "under-utilised", 2: "under-utilised", 4: "sweet-spot", 8: "memory-bound",
                             16: "memory-bound"}
    assert [p.ttft_p99_ratio for p in report.points] == pytest.approx([1, 1, 1, 2, 4])
    assert [p.share_of_peak for p in report.points] == pytest.approx([0.25, 0.5, 1, 0.8, 0.5])


def test_a_sublinear_curve_has_its_sweet_spot_where_it_comes_within_the_peak_share() -> None:
    """x1.6, then x1.2 per doubling: 307 is within 10% of the peak 310, 256 is not."""
    points = [SweepPoint(c, t, 0.1, 0.2) for c, t in [(1, 100), (2, 160), (4, 256), (8, 307), (16, 310)]]
    assert classify_regimes(points).labels == {1: "under-utilised", 2: "under-utilised", 4: "under-utilised",
                                              8: "sweet-spot", 16: "saturated"}
    assert classify_regimes(points, peak_share=0.8).sweet_spot == 4


def test_input_order_does_not_matter() -> None:
    points = curve([1, 2, 4, 8, 16], 2, kv=[0.1, 0.2, 0.5, 0.9, 1.0])
    assert classify_regimes(points[::-1]).labels == classify_regimes(points).labels


def test_uneven_steps_are_compared_per_doubling() -> None:
    # 1 → 4 is two doublings: x3 over two doublings is x1.73 each, above the threshold.
    assert gain_per_doubling(1, 100, 4, 300) == pytest.approx(math.sqrt(3) - 1)
    assert gain_per_doubling(2, 100, 4, 200) == pytest.approx(1.0)
    assert gain_per_doubling(1, 0, 2, 5) == math.inf
    assert gain_per_doubling(1, 0, 2, 0) == 0.0
    with pytest.raises(ValueError, match="c_to must exceed c_from"):
        gain_per_doubling(4, 1, 4, 1)


def test_rejects_bad_sweeps() -> None:
    with pytest.raises(ValueError, match="at least one point"):
        classify_regimes([])
    with pytest.raises(ValueError, match="once"):
        classify_regimes([SweepPoint(2, 1, 0.1, 0.1), SweepPoint(2, 2, 0.1, 0.1)])
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        SweepPoint(0, 1, 0.1, 0.1)
    with pytest.raises(ValueError, match="throughput must be a number"):
        SweepPoint(1, math.nan, 0.1, 0.1)
    with pytest.raises(ValueError, match="kv_danger must be in"):
        classify_regimes([SweepPoint(1, 1, 0.1, 0.1)], kv_danger=0)


def test_corroborated_best_needs_a_second_repeat_to_agree() -> None:
    assert corroborated_best([1923, 1095, 1166, 1317, 1278], 0.25) == 1317
    assert corroborated_best([100, 90], 0.25) == 100
    assert corroborated_best([100, 70], 0.25) is None
    assert corroborated_best([100], 0.25) is None
    with pytest.raises(ValueError, match="agreement must be in"):
        corroborated_best([1.0, 1.0], 1.0)


@given(st.lists(st.floats(0, 1e4), min_size=2, max_size=8), st.floats(0, 0.9))
def test_corroborated_best_is_the_highest_confirmed_repeat(values: list[float], agreement: float) -> None:
    def confirmed(i: int) -> bool:
        return any(j != i and values[i] >= w >= (1 - agreement) * values[i] for j, w in enumerate(values))

    best = corroborated_best(values, agreement)
    candidates = [v for i, v in enumerate(values) if confirmed(i)]
    assert best == (max(candidates) if candidates else None)


def test_median_of_resists_one_fluke_either_way() -> None:
    measured = [(223, 0.24, 0.2, 0), (319, 0.36, 0.25, None), (153, 0.05, None, 0), (129, 0.9, 0.1, 1)]
    runs = [SweepPoint(2, t, 0.03, p99, kv, pre, None) for t, p99, kv, pre in measured]
    m = median_of(runs)
    assert (m.throughput, m.ttft_p99) == pytest.approx((188, 0.30))
    assert (m.kv_usage_peak, m.preemptions, m.waiting_peak) == (0.25, 1, None)
    assert median_of(runs[:3]).throughput == 223  # neither the stalled 153 nor the lucky 319
    with pytest.raises(ValueError, match="at least one repeat"):
        median_of([])


def test_point_from_run_takes_peaks_and_the_runs_own_preemptions() -> None:
    records = []
    for i, (ttft, n) in enumerate([(0.1, 4), (0.3, 4)]):
        r = RequestRecord(request_id=f"r{i}", prompt_len=8, max_tokens=n, scheduled_s=0.0, sent_s=0.0)
        r.chunk_times = [ttft + 0.01 * k for k in range(n)]
        r.chunk_tokens = [1] * n
        r.done_s, r.ok = r.chunk_times[-1], True
        records.append(r)
    summary = summarize(records, duration_s=2.0)
    samples = [ServerMetrics(t=0.0, waiting=0, kv_usage=0.2, preemptions=7),
               ServerMetrics(t=0.5, waiting=3, kv_usage=0.9, preemptions=9),
               ServerMetrics(t=1.0, waiting=1, kv_usage=0.4, preemptions=10)]
    point = point_from_run(4, summary, samples, baseline=ServerMetrics(t=-0.1, preemptions=6))
    assert (point.concurrency, point.throughput, point.kv_usage_peak, point.preemptions, point.waiting_peak) == (
        4, 4.0, 0.9, 4.0, 3)
    assert (point.ttft_p50, point.ttft_p99) == pytest.approx((0.2, 0.298))
    assert point_from_run(4, summary, samples).preemptions == 3.0  # first sample as the baseline
    assert point_from_run(4, summary, [ServerMetrics(t=0.0)]).kv_usage_peak is None


def test_steady_state_leaves_out_the_opening_burst() -> None:
    """A closed loop of 2 opens with two requests prefilled together (slow TTFT); the rest arrive one by one."""
    records = []
    for i, (sent, ttft) in enumerate([(0.0, 0.5), (0.0, 0.5), (0.6, 0.05), (0.7, 0.06), (1.2, 0.04)]):
        r = RequestRecord(request_id=f"r{i}", prompt_len=8, max_tokens=2, scheduled_s=sent, sent_s=sent)
        r.chunk_times, r.chunk_tokens, r.ok = [sent + ttft, sent + ttft + 0.01], [1, 1], True
        records.append(r)
    failed = RequestRecord(request_id="x", prompt_len=8, max_tokens=2, scheduled_s=0.0, sent_s=0.3)
    assert steady_state_ttfts([*reversed(records), failed], 2) == pytest.approx([0.05, 0.06, 0.04])
    assert steady_state_ttfts(records[:2], 2) == pytest.approx([0.5, 0.5])  # nothing else: keep the burst
    summary = summarize(records, duration_s=2.0)
    assert summary.ttft is not None and summary.ttft.p99 > 0.49
    point = point_from_run(2, summary, [], records=records)
    assert point.ttft_p99 == pytest.approx(0.06, abs=1e-3) and point.throughput == summary.output_token_throughput


@pytest.mark.parametrize(("capacity", "prompt", "output", "block", "fit"), [
    (2112, 192, 64, 32, 8),   # the regimes suite's KV-limited vllm: 66 blocks of 32, 8 blocks per sequence
    (2111, 192, 64, 32, 8),   # a partial block holds nothing
    (2048, 192, 64, 32, 8),
    (2047, 192, 64, 32, 7),
    (1024, 1, 1, 1, 1024),    # one token of KV per sequence (the output's last token is never stored)
    (256, 32, 2, 32, 4),      # 33 tokens spill into a second block
])
def test_kv_fit_concurrency(capacity: int, prompt: int, output: int, block: int, fit: int) -> None:
    assert kv_fit_concurrency(capacity, prompt, output, block) == fit
