"""Suite: a latency pool and a throughput pool, routed by priority, vs one mixed pool.

Interactive requests (short prompts and outputs, Poisson) stream while a
batch job lands: many long-ish prompts with long outputs, all at once. Two
layouts serve the same traffic:

- split: two instances of a continuous-batching server, a latency pool (few seats) for interactive
  traffic and a throughput pool (many seats) for batch traffic, behind
  :class:`adapters.router.RoutedEngine` (``Request.priority`` plays the
  gateway's priority header);
- mixed: one instance (the throughput pool's config) serving everything.

The throughput pool is the engine's default config: its own seat count, which is many (the continuous
batchers measured here default to 128 seats on a CPU and 256 to 1024 on a GPU; their adapters cite where), and
what an operator gets untuned. It is also the server the other suites share, so this suite starts one server,
not two.

In the mixed pool an interactive request that arrives after the batch job
queues behind it: a first-come-first-served scheduler admits waiting requests
in arrival order, and a batch prompt being prefilled takes all the token budget
the running decodes leave, so interactive TTFT includes the batch job's whole
prefill. In the split layout the latency pool's queue only ever holds
interactive requests.

On GPUs each pool would have its own device and the split layout would win
outright. Here both instances share the same 2 CPU cores, and isolation
is far weaker than that: a CPU engine with requests in flight keeps both
cores busy by itself (a 2-thread OpenMP team in its worker, busy-polling
loops between its processes), so two engines with work in flight each run at
a fraction of their solo speed, and how the OS splits the cores between them
varies from run to run. Measured on an otherwise quiet machine, the batch job
took 3.5-4x longer in the split layout than in the mixed pool, and the latency
pool's interactive TTFT p99 came out 2-3x the mixed pool's (0.45-0.8x when
other load already saturated the machine). On CI the batch job took only
1.16x longer while the interactive TTFT p99 was 3.26x the mixed pool's: the
cores went to the throughput pool, and the batch job's slowdown does not
bound the latency pool's. Nor does the latency pool's own queue: with the
machine otherwise loaded, the starved latency pool held 29 interactive
requests at once against its 24 seats. So on shared cores the TTFT
comparison is reported (with the measured contention and the latency pool's
peak of requests in flight), not asserted: the split layout's advantage rests
on the pools not sharing compute, which this machine cannot give. What is
asserted holds on any hardware:

- routing: the latency pool served exactly the interactive requests and the
  throughput pool exactly the batch ones, by each engine's own count of
  finished requests (``ServerMetrics.completed``) as well as the router's, so
  no interactive request ever queued behind a batch prompt in the split
  layout, which is what the mixed pool cannot avoid.

Batch throughput is reported, not bounded: on these cores it is set by how
much CPU two busy-polling engines leave each other, with no bound from first
principles (measured 0.25-0.3x the mixed pool's quiet, 0.6-0.9x under outside
load).

Each layout is measured a few times, alternating, and each metric is the best
of its repetitions: interference from other processes only ever makes a run
worse, and alternating exposes both layouts to the same slow periods.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchbench.adapters.base import Engine
from batchbench.adapters.registry import engine_class
from batchbench.adapters.router import RoutedEngine
from batchbench.analysis.repeats import RepeatProtocol
from batchbench.core.config import BatchingConfig
from batchbench.core.records import RequestRecord
from batchbench.experiment.harness import Harness
from batchbench.load.runner import MeasuredRun
from batchbench.measures.metrics import Distribution
from batchbench.workload.profiles import Profile, get_profile
from batchbench.workload.requests import Arrival, Lengths, Request, Workload, WorkloadSpec, interleave

INTERACTIVE, BATCH = "interactive", "batch"
#: Measured repetitions per layout, alternating; each metric is the best of these.
REPEATS = 3
#: Interactive requests per run and their Poisson rate (quick: ~4 s of arrivals, as long as the batch job takes in
#: the split layout; full: ~20 s).
INTERACTIVE_REQUESTS = {"quick": 16, "full": 320}
INTERACTIVE_RATE = {"quick": 4.0, "full": 16.0}
#: The batch job: this many requests landing together, BATCH_AT_S after the interactive stream starts.
BATCH_REQUESTS = {"quick": 32, "full": 512}
BATCH_AT_S = 1.0

def pool_configs(profile: Profile) -> dict[str, BatchingConfig | None]:
    """Latency pool: few seats, so its decode batch stays small (but enough for the interactive stream
    even when its steps are slowed by sharing the CPU); throughput pool: the engine's default, many (module
    docstring). The latency pool comes first: started second, it would stop the shared default server."""
    return {INTERACTIVE: BatchingConfig(max_batch_size=3 * profile.concurrency), BATCH: None}


def workload(profile: Profile, *, seed: int = 21) -> Workload:
    """Interactive chat turns (Poisson) and a batch job landing at once BATCH_AT_S in."""
    m = profile.max_model_len
    interactive = WorkloadSpec(
        INTERACTIVE, INTERACTIVE_REQUESTS[profile.name], prompt=Lengths.uniform(16, 64),
        output=Lengths.fixed(profile.output_median // 2),
        arrival=Arrival("poisson", rate=INTERACTIVE_RATE[profile.name]), seed=seed, priority=INTERACTIVE,
    ).build()
    batch = WorkloadSpec(
        BATCH, BATCH_REQUESTS[profile.name], prompt=Lengths.uniform(m // 8, m // 2),
        output=Lengths.fixed(2 * profile.output_median), arrival=Arrival("offline"), seed=seed + 1, priority=BATCH,
    ).build()
    batch = Workload(batch.spec, tuple(dataclasses.replace(r, arrival_s=BATCH_AT_S) for r in batch.requests))
    return interleave("interactive-with-batch-job", interactive, batch)


def served_count(harness: Harness, engine: Engine) -> float | None:
    """Requests the engine itself says it finished (``ServerMetrics.completed``, all reasons); None: it
    does not count them."""
    sample = harness.scrape(engine)
    return sample.completed if sample is not None else None


def served_since(harness: Harness, pools: dict[str, Engine], before: dict[str, float], total: int) -> dict[str, int]:
    """Requests each pool finished since ``before``. An engine may count a request after its last chunk
    is sent, so the count may trail the client by a moment: read until every request is counted (5 s at
    most)."""
    deadline = time.monotonic() + 5.0
    while True:
        served = {route: round((served_count(harness, e) or 0.0) - before[route]) for route, e in pools.items()}
        if sum(served.values()) >= total or time.monotonic() > deadline:
            return served
        time.sleep(0.1)


def _of(records: list[RequestRecord], priority: str) -> list[RequestRecord]:
    return [r for r in records if r.priority == priority]


def _of_requests(wl: Workload, priority: str) -> list[Request]:
    return [r for r in wl.requests if r.priority == priority]


def layout_metrics(result: MeasuredRun) -> dict[str, float]:
    """Interactive TTFT p99 and batch throughput (the batch job's tokens over its own span)."""
    interactive, batch = _of(result.records, INTERACTIVE), _of(result.records, BATCH)
    ttft = Distribution.of(r.ttft_s for r in interactive if r.ttft_s is not None)
    # Peak of interactive requests in flight: above the latency pool's seats, its own queue held some.
    assert ttft is not None
    span = max(r.done_s or 0.0 for r in batch) - min(r.sent_s for r in batch)
    return {
        "interactive_ttft_p99": ttft.p99,
        "interactive_ttft_p50": ttft.p50,
        "batch_output_tok_s": sum(r.output_tokens for r in batch) / span,
        "batch_span_s": span,
        "interactive_peak_in_flight": peak_in_flight(interactive),
    }


def peak_in_flight(records: list[RequestRecord]) -> int:
    """Most requests between send and finish at any moment (a finish at t frees its seat before a send at t)."""
    events = sorted([(r.sent_s, 1) for r in records] + [(r.done_s or r.sent_s, -1) for r in records],
                    key=lambda e: (e[0], e[1]))
    peak = current = 0
    for _, step in events:
        current += step
        peak = max(peak, current)
    return peak


def best(runs: list[dict[str, float]]) -> dict[str, float]:
    """Per metric, the best repetition (throughput: the highest; times: the lowest)."""
    higher_is_better = ("batch_output_tok_s",)
    out = {key: (max if key in higher_is_better else min)(r[key] for r in runs) for key in runs[0]}
    out["interactive_peak_in_flight"] = max(r["interactive_peak_in_flight"] for r in runs)  # the worst run's
    return out


def table(results: dict[str, dict[str, float]]) -> str:
    lines = [f"{'layout':<8} {'interactive TTFT p99':>20} {'p50':>8} {'peak in flight':>14} {'batch tok/s':>12} "
             f"{'batch span':>11}"]
    for name, m in results.items():
        lines.append(f"{name:<8} {m['interactive_ttft_p99']:>19.3f}s {m['interactive_ttft_p50']:>7.3f}s "
                     f"{m['interactive_peak_in_flight']:>14.0f} {m['batch_output_tok_s']:>12.0f} "
                     f"{m['batch_span_s']:>10.2f}s")
    return "\n".join(lines)


def test_latency_and_throughput_pools_vs_one_mixed_pool(
    harness: Harness, start_engine: Callable[..., Engine], engine_name: str, benchmark: Any
) -> None:
    if "continuous" not in engine_class(engine_name).capabilities.batching_modes:
        pytest.skip(f"engine {engine_name!r}: the layout needs two instances of a continuous-batching server "
                    "started here with their own configs")
    if harness.max_live_engines < 2:
        pytest.skip(f"--max-live-engines {harness.max_live_engines}: the split layout keeps two engines running")
    profile = harness.profile
    configs = pool_configs(profile)
    pools = {route: start_engine(engine_name, config) for route, config in configs.items()}  # both live now
    before_all = {route: served_count(harness, e) for route, e in pools.items()}
    if any(count is None for count in before_all.values()):
        pytest.skip(f"engine {engine_name!r} does not count the requests it finished (ServerMetrics.completed): "
                    "routing cannot be checked by the engines' own count")
    layouts: dict[str, Engine] = {
        "split": RoutedEngine(pools, default=BATCH),
        "mixed": pools[BATCH],
    }
    wl = workload(profile)
    n_interactive, n_batch = len(_of_requests(wl, INTERACTIVE)), len(_of_requests(wl, BATCH))

    def measure_layout(name: str, repeat: int) -> MeasuredRun:
        before = {route: served_count(harness, e) or 0.0 for route, e in pools.items()}
        last = repeat == REPEATS - 1 and name == "split"
        result = harness.measure(layouts[name], wl, tag=name, benchmark=benchmark if last else None,
                                 labels={"suite": "pools", "layout": name, "repeat": repeat,
                                         "pools": {k: c.label() if c else "default" for k, c in configs.items()}})
        served = served_since(harness, pools, before, n_interactive + n_batch)
        assert result.summary.failed == 0, f"{name}: {result.summary.failures}"
        if name == "split":
            # Every interactive request went to the latency pool and nothing else did, by the engines' count.
            assert served == {INTERACTIVE: n_interactive, BATCH: n_batch}, served
            assert result.engine_report["routed"] == {INTERACTIVE: n_interactive, BATCH: n_batch}
        else:
            assert served == {INTERACTIVE: 0, BATCH: n_interactive + n_batch}, served
        return result

    # The repeat protocol's interleaved passes; every repetition counts (best of, module docstring).
    series = RepeatProtocol(repeats=REPEATS).run(list(layouts), measure_layout)
    runs = {name: [layout_metrics(r) for r in reps.runs] for name, reps in series.items()}
    results = {name: best(r) for name, r in runs.items()}
    split, mixed = results["split"], results["mixed"]
    ttft_ratio = split["interactive_ttft_p99"] / mixed["interactive_ttft_p99"]
    contention = split["batch_span_s"] / mixed["batch_span_s"]
    benchmark.extra_info.update({
        "layouts": results, "repeats": runs, "ttft_p99_ratio_split_over_mixed": ttft_ratio,
        "batch_throughput_ratio_split_over_mixed": split["batch_output_tok_s"] / mixed["batch_output_tok_s"],
        "contention": contention,
    })
    print(f"\n{table(results)}\ncontention (batch job's span, split / mixed): {contention:.2f}; "
          f"interactive TTFT p99 split / mixed: {ttft_ratio:.2f} (reported, not asserted: module docstring)")


@pytest.mark.parametrize("profile_name", ["quick", "full"])
def test_the_batch_job_lands_while_interactive_traffic_streams(profile_name: str) -> None:
    profile = get_profile(profile_name)
    wl = workload(profile)
    assert all(r.prompt_len + r.max_tokens <= profile.max_model_len for r in wl.requests)
    interactive, batch = _of_requests(wl, INTERACTIVE), _of_requests(wl, BATCH)
    assert {r.arrival_s for r in batch} == {BATCH_AT_S}
    assert sum(r.arrival_s > BATCH_AT_S for r in interactive) > len(interactive) // 2
    batch_tokens = sum(r.prompt_len + r.max_tokens for r in batch)
    interactive_tokens = sum(r.prompt_len + r.max_tokens for r in interactive)
    assert interactive_tokens < batch_tokens / 5  # the latency pool's share of the work is small
    latency, throughput = pool_configs(profile).values()
    # The latency pool's seats are fewer than the engines' defaults where the profile runs (quick: 24 against 128
    # on a CPU; full: 192 against 256 or more on a GPU); the throughput pool keeps the engine's own.
    assert latency is not None and 0 < (latency.max_batch_size or 0) < {"quick": 128, "full": 256}[profile_name]
    assert throughput is None


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 20)), max_size=30))
def test_peak_in_flight_is_the_most_requests_open_at_one_moment(spans: list[tuple[int, int]]) -> None:
    records = [RequestRecord(request_id=str(i), prompt_len=1, max_tokens=1, scheduled_s=float(sent),
                             sent_s=float(sent), done_s=float(sent + length))
               for i, (sent, length) in enumerate(spans)]
    # Half-open [sent, done): a request done at t is not in flight at t; brute force over every send time.
    brute = max((sum(r.sent_s <= t < (r.done_s or 0.0) for r in records) for t in (r.sent_s for r in records)),
                default=0)
    assert peak_in_flight(records) == brute
