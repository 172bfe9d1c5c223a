"""Tests for batchbench.workload.requests: reproducible, valid, correctly distributed workloads."""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import statistics
import subprocess
import sys
from collections import Counter
from dataclasses import astuple, replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchbench.workload import requests as wl
from batchbench.workload.requests import (
    FIRST_ORDINARY_TOKEN,
    Arrival,
    Lengths,
    Request,
    Workload,
    WorkloadSpec,
    interleave,
)

REPO = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------
# strategies

seeds = st.integers(min_value=0, max_value=2**63)
bounds = st.tuples(st.integers(1, 300), st.integers(0, 300)).map(lambda t: (t[0], t[0] + t[1]))


@st.composite
def lengths(draw: st.DrawFn, max_high: int = 64) -> Lengths:
    kind = draw(st.sampled_from(["fixed", "uniform", "lognormal", "mixed"]))
    if kind == "fixed":
        return Lengths.fixed(draw(st.integers(1, max_high)))
    low = draw(st.integers(1, max_high))
    high = draw(st.integers(low, max_high))
    if kind == "uniform":
        return Lengths.uniform(low, high)
    if kind == "lognormal":
        median = draw(st.floats(0.01, 1e4, allow_nan=False))
        sigma = draw(st.floats(0.0, 3.0, allow_nan=False))
        return Lengths.lognormal(median, sigma, low, high)
    return Lengths.mixed(low, high, draw(st.integers(1, 8)))


arrivals = st.one_of(
    st.just(Arrival()),
    st.builds(Arrival, kind=st.just("poisson"), rate=st.floats(1e-3, 1e4)),
    st.builds(Arrival, kind=st.just("gamma"), rate=st.floats(1e-3, 1e4), burstiness=st.floats(0.05, 20.0)),
    st.builds(Arrival, kind=st.sampled_from(["closed", "waves"]), concurrency=st.integers(1, 64)),
)

open_loop_arrivals = st.one_of(
    st.just(Arrival()),
    st.builds(Arrival, kind=st.just("poisson"), rate=st.floats(1e-3, 1e4)),
    st.builds(Arrival, kind=st.just("gamma"), rate=st.floats(1e-3, 1e4), burstiness=st.floats(0.05, 20.0)),
)


@st.composite
def specs(draw: st.DrawFn, arrival: st.SearchStrategy[Arrival] = arrivals) -> WorkloadSpec:
    return WorkloadSpec(
        name=draw(st.sampled_from(["a", "chat", "batch-x"])),
        num_requests=draw(st.integers(1, 16)),
        prompt=draw(lengths()),
        output=draw(lengths()),
        arrival=draw(arrival),
        seed=draw(seeds),
        vocab_size=draw(st.integers(FIRST_ORDINARY_TOKEN + 1, 50_000)),
        priority=draw(st.sampled_from([None, "interactive", "batch"])),
    )


def gaps_of(times: list[float]) -> list[float]:
    return [b - a for a, b in zip([0.0, *times[:-1]], times, strict=True)]


def coefficient_of_variation(values: list[float]) -> float:
    return statistics.pstdev(values) / statistics.fmean(values)


# ---------------------------------------------------------------------------
# determinism

#: A small fixed spec and the hash it must build to. This literal was computed
#: once and is deliberately NOT recomputed by the test: if it changes, the
#: generator (RNG seeding, draw order, rounding, canonical encoding) changed and
#: workloads are no longer reproducible across machines and versions, so results
#: recorded elsewhere stop being comparable. Update it only for an intended,
#: announced break of workload reproducibility.
GOLDEN_SPEC = WorkloadSpec(
    "golden", 8,
    prompt=Lengths.uniform(4, 16),
    output=Lengths.lognormal(16, 0.5, 2, 64),
    arrival=Arrival("poisson", rate=4.0),
    seed=1234,
    vocab_size=512,
)
GOLDEN_HASH = "f73ab0ffb354ad4134e59270bf739682dd60dd2868aa7b2df05a7925e7513b55"


def test_golden_hash_is_stable_across_machines() -> None:
    w = GOLDEN_SPEC.build()
    assert w.hash() == GOLDEN_HASH
    # A spot check of content, so a failure also says *what* moved.
    assert w.requests[0].request_id == "golden-00000"
    assert w.requests[0].prompt_token_ids[:3] == (279, 450, 488)
    assert w.requests[0].max_tokens == 26
    assert w.requests[0].arrival_s == 0.229765


@settings(max_examples=60, deadline=None)
@given(specs())
def test_same_spec_builds_identical_workload(spec: WorkloadSpec) -> None:
    a, b = spec.build(), spec.build()
    assert a == b
    assert a.requests == b.requests
    assert a.hash() == b.hash()
    assert a.canonical_bytes() == b.canonical_bytes()
    # An equal spec constructed separately builds the same thing too.
    assert replace(spec).build().hash() == a.hash()


@settings(max_examples=60, deadline=None)
@given(seeds, seeds)
def test_different_seed_gives_different_hash(seed_a: int, seed_b: int) -> None:
    if seed_a == seed_b:
        seed_b = seed_a + 1
    # Enough entropy (4 x 16 tokens from ~2k) that a collision is not a real possibility.
    base = WorkloadSpec("s", 4, prompt=Lengths.fixed(16), output=Lengths.fixed(8), vocab_size=2048)
    a, b = replace(base, seed=seed_a).build(), replace(base, seed=seed_b).build()
    assert a.hash() != b.hash()
    assert [r.prompt_token_ids for r in a.requests] != [r.prompt_token_ids for r in b.requests]


@settings(max_examples=40, deadline=None)
@given(specs())
def test_hash_covers_every_request_field(spec: WorkloadSpec) -> None:
    w = spec.build()
    r = w.requests[-1]
    changed = [
        replace(r, request_id=r.request_id + "x"),
        replace(r, prompt_token_ids=(*r.prompt_token_ids, FIRST_ORDINARY_TOKEN)),
        replace(r, max_tokens=r.max_tokens + 1),
        replace(r, arrival_s=r.arrival_s + 1e-6),
        replace(r, priority="other" if r.priority != "other" else None),
    ]
    for other in changed:
        assert Workload(spec, (*w.requests[:-1], other)).hash() != w.hash(), other


SUBPROCESS_SPEC = (
    "WorkloadSpec('sub', 12, prompt=Lengths.lognormal(20, 0.9, 2, 80), output=Lengths.mixed(8, 64, 4),"
    " arrival=Arrival('gamma', rate=3.0, burstiness=0.5), seed=99, vocab_size=4096, priority='batch')"
)
SUBPROCESS_CODE = (
    "import json, dataclasses\n"
    "from batchbench.workload.requests import *\n"
    f"w = {SUBPROCESS_SPEC}.build()\n"
    "print(json.dumps([w.hash(), [dataclasses.astuple(r) for r in w.requests]]))\n"
)


@pytest.mark.parametrize("hashseed", ["0", "1", "4242"])
def test_build_is_identical_in_a_fresh_interpreter(hashseed: str) -> None:
    """String hashing is randomised per process; the workload must not depend on it."""
    env = {**os.environ, "PYTHONHASHSEED": hashseed}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-c", SUBPROCESS_CODE], check=False, cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    child_hash, child_requests = json.loads(out.stdout)
    here = eval(SUBPROCESS_SPEC, vars(wl)).build()
    assert child_hash == here.hash()
    assert [Request(r[0], tuple(r[1]), *r[2:]) for r in child_requests] == list(here.requests)
    assert json.loads(json.dumps([astuple(r) for r in here.requests])) == child_requests


@settings(max_examples=40, deadline=None)
@given(specs(), arrivals)
def test_arrival_stream_is_independent_of_lengths_and_tokens(spec: WorkloadSpec, arrival: Arrival) -> None:
    """Separate RNG streams: changing how requests arrive must not change what they are."""
    a, b = spec.build(), replace(spec, arrival=arrival).build()
    assert [(r.request_id, r.prompt_token_ids, r.max_tokens) for r in a.requests] == [
        (r.request_id, r.prompt_token_ids, r.max_tokens) for r in b.requests
    ]


# ---------------------------------------------------------------------------
# lengths


@settings(max_examples=100)
@given(bounds, seeds)
def test_uniform_draws_stay_in_bounds(lo_hi: tuple[int, int], seed: int) -> None:
    low, high = lo_hi
    dist, rng = Lengths.uniform(low, high), random.Random(seed)
    assert all(low <= dist.draw(rng, i) <= high for i in range(200))


@settings(max_examples=100)
@given(bounds, st.floats(0.01, 1e5), st.floats(0.0, 4.0), seeds)
def test_lognormal_draws_are_clipped_to_bounds(lo_hi: tuple[int, int], median: float, sigma: float,
                                               seed: int) -> None:
    low, high = lo_hi
    dist, rng = Lengths.lognormal(median, sigma, low, high), random.Random(seed)
    draws = [dist.draw(rng, i) for i in range(200)]
    assert all(isinstance(d, int) and low <= d <= high for d in draws)


def test_uniform_bounds_are_inclusive() -> None:
    rng = random.Random(7)
    assert {Lengths.uniform(3, 6).draw(rng, i) for i in range(2000)} == {3, 4, 5, 6}


def test_lognormal_median_and_spread() -> None:
    """Unclipped, the sample median is near ``median`` and log-lengths have sd near ``sigma``.

    n = 20000: the sample median's relative standard error is about
    1.25 * sigma / sqrt(n) < 1%, and integer rounding moves it by < 0.5 of 200;
    the 5% tolerance is many standard errors wide and catches swapped parameters.
    """
    rng = random.Random(2024)
    dist = Lengths.lognormal(200.0, 0.6, low=1, high=10**9)
    draws = [dist.draw(rng, i) for i in range(20_000)]
    assert statistics.median(draws) == pytest.approx(200, rel=0.05)
    assert statistics.pstdev([math.log(d) for d in draws]) == pytest.approx(0.6, rel=0.05)


@settings(max_examples=50)
@given(st.integers(1, 10_000), seeds)
def test_fixed_is_fixed(value: int, seed: int) -> None:
    dist, rng = Lengths.fixed(value), random.Random(seed)
    assert {dist.draw(rng, i) for i in range(100)} == {value}


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 32), st.integers(1, 64), st.integers(1, 10), st.integers(1, 40), seeds)
def test_mixed_puts_one_long_every_period_first_is_long(short: int, long: int, period: int, n: int,
                                                        seed: int) -> None:
    spec = WorkloadSpec("m", n, prompt=Lengths.mixed(short, long, period), output=Lengths.mixed(short, long, period),
                        seed=seed)
    w = spec.build()
    expected = [long if i % period == 0 else short for i in range(n)]
    assert [r.prompt_len for r in w.requests] == expected
    assert [r.max_tokens for r in w.requests] == expected
    assert w.requests[0].max_tokens == long
    if long != short:
        # exactly one long in each complete window of `period`
        for start in range(0, n - period + 1, period):
            window = expected[start:start + period]
            assert window.count(long) == 1


@settings(max_examples=80, deadline=None)
@given(specs())
def test_built_requests_are_valid(spec: WorkloadSpec) -> None:
    w = spec.build()
    assert len(w.requests) == spec.num_requests
    assert len({r.request_id for r in w.requests}) == spec.num_requests
    for i, r in enumerate(w.requests):
        assert r.request_id == f"{spec.name}-{i:05d}"
        assert r.priority == spec.priority
        assert r.prompt_len >= 1 and r.max_tokens >= 1
        assert all(FIRST_ORDINARY_TOKEN <= t < spec.vocab_size for t in r.prompt_token_ids)
        for dist, n in ((spec.prompt, r.prompt_len), (spec.output, r.max_tokens)):
            if dist.kind == "fixed":
                assert n == dist.value
            elif dist.kind in ("uniform", "lognormal"):
                assert dist.low <= n <= dist.high


def test_small_vocab_tokens_cover_the_ordinary_range() -> None:
    """With a tiny vocabulary every ordinary id appears, and no special one does."""
    w = WorkloadSpec("v", 50, prompt=Lengths.fixed(40), vocab_size=FIRST_ORDINARY_TOKEN + 5, seed=3).build()
    seen = Counter(t for r in w.requests for t in r.prompt_token_ids)
    assert set(seen) == set(range(FIRST_ORDINARY_TOKEN, FIRST_ORDINARY_TOKEN + 5))


# ---------------------------------------------------------------------------
# arrivals


@settings(max_examples=100, deadline=None)
@given(arrivals, st.integers(1, 300), seeds)
def test_schedule_is_non_decreasing_and_microsecond_rounded(arrival: Arrival, n: int, seed: int) -> None:
    times = arrival.schedule(random.Random(seed), n)
    assert len(times) == n
    assert all(t >= 0 for t in times)
    assert all(a <= b for a, b in itertools.pairwise(times))
    assert all(round(t, 6) == t for t in times)
    assert all(float(f"{t:.6f}") == t for t in times)
    if not arrival.open_loop or arrival.kind == "offline":
        assert times == [0.0] * n


@pytest.mark.parametrize("kind", ["offline", "closed", "waves"])
def test_non_scheduled_kinds_arrive_at_zero(kind: str) -> None:
    w = WorkloadSpec("z", 50, arrival=Arrival(kind, concurrency=4), seed=5).build()
    assert [r.arrival_s for r in w.requests] == [0.0] * 50
    assert w.arrival.open_loop is (kind == "offline")


@pytest.mark.parametrize("rate", [0.5, 8.0, 250.0])
def test_poisson_mean_gap_is_one_over_rate(rate: float) -> None:
    """Mean exponential gap is 1/rate.

    n = 20000 gaps: the sample mean's relative standard error is 1/sqrt(n) ~ 0.7%
    (and microsecond rounding telescopes to < 1e-6/n in the mean), so a 5%
    tolerance is ~7 standard errors: it never flakes at a fixed seed yet catches
    a rate used as a mean or a factor-of-two error. Poisson gaps also have a
    coefficient of variation of 1.
    """
    n = 20_000
    times = Arrival("poisson", rate=rate).schedule(random.Random(11), n)
    assert times[-1] / n == pytest.approx(1 / rate, rel=0.05)
    assert coefficient_of_variation(gaps_of(times)) == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_gamma_burstiness_orders_the_coefficient_of_variation(seed: int) -> None:
    """Gamma gaps with shape k have mean 1/rate and CV 1/sqrt(k): k < 1 burstier than Poisson, k > 1 smoother.

    With n = 20000 the CVs' standard errors are a few percent (largest for
    k = 0.25, ~2%), against expected CVs of 2, 1 and 0.5: the ordering holds
    with a margin of tens of standard errors, and 15% bounds on the absolute
    values are still far outside the noise.
    """
    n, rate = 20_000, 10.0

    def cv_and_mean(arrival: Arrival) -> tuple[float, float]:
        times = arrival.schedule(random.Random(seed), n)
        return coefficient_of_variation(gaps_of(times)), times[-1] / n

    cv_bursty, mean_bursty = cv_and_mean(Arrival("gamma", rate=rate, burstiness=0.25))
    cv_poisson, mean_poisson = cv_and_mean(Arrival("poisson", rate=rate))
    cv_gamma1, _ = cv_and_mean(Arrival("gamma", rate=rate, burstiness=1.0))
    cv_smooth, mean_smooth = cv_and_mean(Arrival("gamma", rate=rate, burstiness=4.0))

    assert cv_bursty > cv_poisson > cv_smooth
    assert cv_bursty == pytest.approx(2.0, rel=0.15)
    assert cv_gamma1 == pytest.approx(1.0, rel=0.15)
    assert cv_smooth == pytest.approx(0.5, rel=0.15)
    for mean in (mean_bursty, mean_poisson, mean_smooth):
        assert mean == pytest.approx(1 / rate, rel=0.05)


# ---------------------------------------------------------------------------
# with_arrival and interleave


@settings(max_examples=60, deadline=None)
@given(specs(), arrivals)
def test_with_arrival_changes_only_arrival(spec: WorkloadSpec, arrival: Arrival) -> None:
    w = spec.build()
    v = w.with_arrival(arrival)
    assert v.arrival == arrival
    assert len(v.requests) == len(w.requests)
    for old, new in zip(w.requests, v.requests, strict=True):
        assert (new.request_id, new.prompt_token_ids, new.max_tokens, new.priority) == (
            old.request_id, old.prompt_token_ids, old.max_tokens, old.priority)
    expected_times = arrival.schedule(random.Random(f"{spec.seed}:arrivals"), len(w.requests))
    assert [r.arrival_s for r in v.requests] == expected_times
    # It is exactly the workload the spec with that arrival builds, and going back restores the original.
    assert v == replace(spec, arrival=arrival).build()
    assert v.with_arrival(spec.arrival) == w
    assert w.with_arrival(spec.arrival).hash() == w.hash()


@settings(max_examples=60, deadline=None)
@given(st.lists(specs(arrival=open_loop_arrivals), min_size=1, max_size=4))
def test_interleave_sorted_deterministic_and_complete(spec_list: list[WorkloadSpec]) -> None:
    parts = [replace(s, name=f"p{k}").build() for k, s in enumerate(spec_list)]
    merged = interleave("mix", *parts)
    times = [r.arrival_s for r in merged.requests]
    assert times == sorted(times)
    assert Counter(merged.requests) == Counter(r for p in parts for r in p.requests)
    assert len(merged.requests) == sum(len(p.requests) for p in parts)
    assert merged.spec.num_requests == len(merged.requests)
    assert merged.name == "mix"
    again = interleave("mix", *parts)
    assert again == merged and again.hash() == merged.hash()
    # Within one part the send order is preserved.
    for p in parts:
        ids = {r.request_id for r in p.requests}
        assert [r for r in merged.requests if r.request_id in ids] == list(p.requests)


def test_interleave_ties_keep_the_given_order() -> None:
    a = WorkloadSpec("a", 3, seed=1).build()
    b = WorkloadSpec("b", 2, seed=2).build()
    assert interleave("ab", a, b).requests == a.requests + b.requests
    assert interleave("ba", b, a).requests == b.requests + a.requests


def test_interleave_mixes_by_arrival() -> None:
    chat = WorkloadSpec("chat", 50, arrival=Arrival("poisson", rate=20.0), seed=1, priority="interactive").build()
    batch = WorkloadSpec("batch", 50, arrival=Arrival("poisson", rate=20.0), seed=2, priority="batch").build()
    merged = interleave("mix", chat, batch)
    priorities = [r.priority for r in merged.requests]
    # Not simply concatenated: the two streams actually interleave.
    assert priorities != sorted(priorities) and priorities != sorted(priorities, reverse=True)
    assert Counter(priorities) == {"interactive": 50, "batch": 50}


# ---------------------------------------------------------------------------
# invalid inputs


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Arrival("poisson", rate=-1.0), r"poisson arrivals need rate > 0, not -1\.0"),
        (lambda: Arrival("poisson", rate=0.0), r"rate > 0"),
        (lambda: Arrival("gamma", rate=float("nan")), r"gamma arrivals need rate > 0"),
        (lambda: Arrival("gamma", rate=1.0, burstiness=0.0), r"burstiness > 0"),
        (lambda: Arrival("closed", concurrency=0), r"closed arrivals need concurrency >= 1, not 0"),
        (lambda: Arrival("waves", concurrency=-3), r"waves arrivals need concurrency >= 1, not -3"),
        (lambda: Arrival("bursty"), r"unknown arrival kind 'bursty'"),
        (lambda: Lengths.uniform(10, 5), r"1 <= low <= high"),
        (lambda: Lengths.lognormal(32, 0.5, low=64, high=8), r"1 <= low <= high"),
        (lambda: Lengths.uniform(0, 5), r"1 <= low <= high"),
        (lambda: Lengths.fixed(0), r"value >= 1"),
        (lambda: Lengths("zipf"), r"unknown length distribution 'zipf'"),
        (lambda: Lengths.lognormal(0.0, 0.5), r"median > 0"),
        (lambda: Lengths.lognormal(32.0, -1.0), r"sigma >= 0"),
        (lambda: Lengths.mixed(8, 64, 0), r"mixed period must be >= 1, not 0"),
        (lambda: WorkloadSpec("w", 0), r"at least one request, not 0"),
        (lambda: WorkloadSpec("w", -2), r"at least one request"),
        (lambda: WorkloadSpec("w", 1, vocab_size=FIRST_ORDINARY_TOKEN), r"vocab_size must exceed"),
    ],
)
def test_invalid_inputs_raise_readable_value_errors(make, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


@given(st.integers(0, 64), st.integers(1, 5), st.integers(1, 40), st.integers(0, 2**16))
def test_shared_prefixes_open_every_prompt_of_their_group(prefix: int, groups: int, n: int, seed: int) -> None:
    spec = WorkloadSpec("p", n, prompt=Lengths.uniform(1, 16), prefix_tokens=prefix, prefix_groups=groups, seed=seed)
    wl = spec.build()
    own = WorkloadSpec("p", n, prompt=Lengths.uniform(1, 16), seed=seed).build()
    for i, (r, alone) in enumerate(zip(wl.requests, own.requests)):
        first = wl.requests[i % groups]
        assert r.prompt_token_ids[:prefix] == first.prompt_token_ids[:prefix]  # the group's prefix
        assert r.prompt_token_ids[prefix:] == alone.prompt_token_ids  # then its own prompt, as without prefixes
        assert r.prompt_len == prefix + alone.prompt_len
    if prefix >= 4 and groups > 1 and n > 1:  # different groups, different prefixes (4 random ids never collide)
        assert wl.requests[0].prompt_token_ids[:prefix] != wl.requests[1].prompt_token_ids[:prefix]


def test_a_shared_prefix_is_seeded_tokens_not_one_token_repeated() -> None:
    wl = WorkloadSpec("p", 4, prompt=Lengths.fixed(2), prefix_tokens=64, prefix_groups=2, seed=3).build()
    prefix = wl.requests[0].prompt_token_ids[:64]
    assert len(set(prefix)) > 32  # a prefix was once one token 64 times: each token drew a fresh generator
    assert prefix != wl.requests[1].prompt_token_ids[:64] and prefix == wl.requests[2].prompt_token_ids[:64]
