"""Suite: prefix caching with shared system prompts, on and off.

Many production prompts open with one of a few long system prompts. An engine
with a prefix cache keeps the KV of a prefix it has computed and, for the next
request that opens with it, prefills only the rest. The workload: ``GROUPS``
shared prefixes of 3/4 of the context, each followed by a short prompt of the
request's own, sent closed loop. The same engine runs with prefix caching on
and off (two live engines, runs alternated); before every run the runner
empties the cache (``Engine.reset_cache``, the engine's own reset route), so
no run measures a cache the previous run warmed.

What the mechanism predicts, and is asserted:

- hit rate, by the engine's own counters (prompt tokens found in the cache over
  prompt tokens looked up during the run): with the cache emptied first, the
  first request of each group misses, and every later one finds its whole
  prefix, so the hit rate is ``(requests - groups) x prefix / prompt tokens``
  (measured 0.8644 against 0.864 predicted, in every run). Off, nothing is
  hit;
- TTFT: cached, a request prefills its own short prompt only, so its TTFT p50
  is a fraction of the uncached one, where every request prefills the whole
  prefix (requests one at a time, so no queueing hides it; measured 0.45x on
  2 vCPUs with the tiny model; the ratio paired pass by pass over the repeats,
  its interval asserted below 0.7x);
- every run of the cached engine says its cache was emptied first
  (``RunHeader.cache_reset``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from batchbench.adapters.base import Engine
from batchbench.adapters.registry import engine_class
from batchbench.analysis.repeats import Estimate, RepeatProtocol, Repeats, paired
from batchbench.core import codec
from batchbench.core.config import BatchingConfig
from batchbench.core.server_metrics import ServerMetrics, prefix_cache_hit_rate
from batchbench.experiment.harness import Harness
from batchbench.load.runner import MeasuredRun
from batchbench.pytest_plugin import IntervalChecks
from batchbench.results.document import RunDocument
from batchbench.workload.profiles import Profile, get_profile
from batchbench.workload.requests import Arrival, Lengths, Workload, WorkloadSpec

#: Shared prefixes (system prompts) and requests per group.
GROUPS = 4
USERS = 8
#: Each request's own prompt after the prefix, and its output: short, the suite is about prefill.
OWN_PROMPT = (8, 32)
OUTPUT = 8
#: One at a time: TTFT is then the request's own prefill, with no queueing behind others' steps.
CONCURRENCY = 1
REPEATS = 3
MAX_REPEATS = 6
#: Cached TTFT p50 over uncached must be below this. Measured 0.45 (12.7 ms against 28.0 ms, 2 vCPUs, load ~3):
#: what the cache saves is the prefix's prefill, and the rest of a TTFT (HTTP, the request's own prompt, one
#: decode step) is not small beside it for the tiny model; 0.7 leaves ~1.5x of margin.
TTFT_RATIO_MAX = 0.7
#: The measured hit rate may fall short of the prediction by this share (blocks straddling the prefix's end).
HIT_SLACK = 0.1


def workload(profile: Profile) -> Workload:
    """GROUPS prefixes of 3/4 of the context, USERS requests each, interleaved (request i uses prefix i % GROUPS)."""
    return WorkloadSpec("shared-prefixes", GROUPS * USERS, prompt=Lengths.uniform(*OWN_PROMPT),
                        output=Lengths.fixed(OUTPUT), arrival=Arrival("closed", concurrency=CONCURRENCY),
                        prefix_tokens=3 * profile.max_model_len // 4, prefix_groups=GROUPS, seed=3).build()


def predicted_hit_rate(wl: Workload) -> float:
    """Every request after its group's first finds the whole prefix; the firsts find nothing."""
    prefix = wl.spec.prefix_tokens
    return (len(wl.requests) - wl.spec.prefix_groups) * prefix / sum(r.prompt_len for r in wl.requests)




def test_prefix_caching_serves_shared_prefixes_from_the_cache(
    harness: Harness, start_engine: Callable[..., Engine], engine_name: str, benchmark: Any
) -> None:
    if not engine_class(engine_name).capabilities.prefix_caching:
        pytest.skip(f"engine {engine_name!r} cannot switch prefix caching (Capabilities.prefix_caching is False)")
    if harness.max_live_engines < 2:
        pytest.skip(f"--max-live-engines {harness.max_live_engines}: the comparison alternates two live engines")
    wl = workload(harness.profile)
    engines = {on: start_engine(engine_name, BatchingConfig(prefix_caching=on)) for on in (True, False)}
    # The first scrape of a run can come after its first requests: read the counters right before it too.
    before: dict[tuple[bool, int], ServerMetrics | None] = {}

    def measure(on: bool, repeat: int) -> MeasuredRun:
        before[(on, repeat)] = harness.scrape(engines[on])
        result = harness.measure(engines[on], wl, tag=f"prefix-{'on' if on else 'off'}", benchmark=(
            benchmark if on and repeat == REPEATS - 1 else None),
            labels={"suite": "prefix_caching", "prefix_caching": on, "repeat": repeat})
        assert result.summary.failed == 0, result.summary.failures
        return result

    series: dict[bool, Repeats[MeasuredRun]] = {True: Repeats(), False: Repeats()}

    def judged() -> tuple[IntervalChecks, Estimate | None]:
        ratio = paired(series[True], series[False], lambda r: r.summary.ttft.p50 if r.summary.ttft else None)
        checks = IntervalChecks()
        checks.check("cached TTFT p50 over uncached", ratio, TTFT_RATIO_MAX, "below", of=list(series.values()))
        return checks, ratio

    # Both engines in every pass, again while the TTFT ratio's interval straddles its limit.
    for on, repeat in RepeatProtocol(repeats=REPEATS, max_repeats=MAX_REPEATS, together=True, look_once=True,
                                     settled=lambda _: judged()[0].decided).schedule(series):
        result = measure(on, repeat)
        series[on].add(result, result.machine)
    rates = {on: [prefix_cache_hit_rate([s for s in (before[(on, i)],) if s is not None] + r.samples)
                  for i, r in enumerate(reps.runs)] for on, reps in series.items()}
    checks, ratio = judged()
    ttft = {on: [r.summary.ttft.p50 for r in reps.runs if r.summary.ttft] for on, reps in series.items()}
    predicted = predicted_hit_rate(wl)
    benchmark.extra_info.update({"hit_rates": {str(k): v for k, v in rates.items()}, "predicted_hit_rate": predicted,
                                 "ttft_p50": {str(k): v for k, v in ttft.items()},
                                 "ttft_ratio": codec.encode(ratio)})
    shown = "n/a" if ratio is None else ratio.format(lambda v: f"x{v:.2f}")
    print(f"\n{engine_name}: hit rate on {rates[True]} (predicted {predicted:.3f}), off {rates[False]}; "
          f"TTFT p50 cached over uncached {shown}")

    if all(rate is None for rate in rates[True]):
        pytest.skip(f"engine {engine_name!r} exposes no prefix-cache counters: the hit rate cannot be checked")
    assert all(RunDocument.load(r.path).header.cache_reset for r in series[True].runs), "a cached run began warm"
    for rate in rates[True]:
        assert rate is not None and predicted * (1 - HIT_SLACK) <= rate <= min(1.0, predicted * (1 + HIT_SLACK))
    assert all(not rate for rate in rates[False]), f"prefix caching off, yet hits: {rates[False]}"
    checks.finish(f"{engine_name}, limit x{TTFT_RATIO_MAX}")


def test_the_workload_shares_its_prefixes_as_the_prediction_assumes() -> None:
    wl = workload(get_profile("quick"))
    prefix = wl.spec.prefix_tokens
    heads = {r.prompt_token_ids[:prefix] for r in wl.requests}
    assert len(heads) == GROUPS and all(r.prompt_len + r.max_tokens <= 2048 for r in wl.requests)
    assert 0.8 < predicted_hit_rate(wl) < 1.0
