"""Suite: token budget (max_num_batched_tokens) vs sequence cap (max_num_seqs), chunked prefill on and off.

Short interactive requests stream open loop; a burst of K long prompts (close
to max_model_len) lands a quarter of the way in. What the short requests
queued behind the burst see is decided by the engine's scheduler. For an
iteration-level scheduler with a per-step token budget, a sequence cap and a
per-request prefill cap (the capabilities this suite needs; the adapter of the
engine measured here cites the scheduler source and version this was read
from), it goes like this:

- Each step has a token budget, ``max_num_batched_tokens``. Running requests
  are served first (a decode costs one token), then waiting requests in
  arrival order (fcfs) while budget and seats (``max_num_seqs``) remain.
- Chunked prefill off: a waiting prompt longer than the budget left stops
  admission for the step (``break``), so whatever arrived after it waits.
  The engine refuses to start with chunked prefill off and a budget below
  max_model_len (``Engine.check_config`` says so up front), so the unchunked
  cells use exactly max_model_len: each long prompt is one step, and a short
  request arriving with the burst waits K long steps.
- Chunked prefill on: a prompt takes ``min(rest of its prompt, budget left)``.
  Decodes admitted before the long prompt still get their token every step,
  but the long prompt then takes all the budget they leave, step after step,
  so a short request arriving behind the burst still waits until the whole
  burst is prefilled (in budget-sized chunks: more steps than unchunked).
  Chunking alone does not lower short-request TTFT.
- ``long_prefill_token_threshold`` T caps the tokens one prefill takes per
  step, for running and waiting requests alike (not applied when a request is
  the only one eligible). The K prompts of the burst are then prefilled side
  by side, T tokens each per step, and with K x T well under the budget every
  step keeps budget for newcomers: a short request is admitted in the next
  step. That is the setting under which chunked prefill lowers short-request
  TTFT. (This threshold is the scheduler's knob for it, not a cap on how many
  partial prefills run at once. It is only set with chunking on: with chunking
  off it would still cut a prompt to T tokens, i.e. chunk it.)

The threshold is BatchingConfig.prefill_chunk_tokens, which engines without
such a cap refuse (Capabilities.prefill_chunk_cap).

Grid (quick profile: max_model_len 2048, long prompts of 1920 tokens, a burst
of K = 16, T = 32; the full profile scales the sizes with max_model_len):

==========================  =======  ======  =====  =========  ===========
cell                        chunked  budget  seqs   threshold  profiles
==========================  =======  ======  =====  =========  ===========
unchunked                   off      2048    all    -          quick, full
chunked                     on       1024    all    -          quick, full
chunked-lpt                 on       1024    all    64         quick, full
chunked-lpt-seqs10          on       1024    10     64         full
unchunked-seqs10            off      2048    10     -          full
chunked-lpt-budget2048      on       2048    all    64         full
==========================  =======  ======  =====  =========  ===========

"all" seats is every request of a run, so the cap never binds; 10 seats is
the burst alone, so while it is in the engine short requests wait for seats.
Quick runs the cells the assertions compare (each config is a server
start, ~30-70 s on 2 CPUs); the full profile's other cells are reported, with
their seat caps checked.

What is asserted, and why only that:

- The TTFT of the short requests that arrive with the burst (the first
  ``BEHIND`` after it; the worst of them per run) is well below both unchunked
  and chunked without the threshold. In steps, a short request behind the
  burst waits the step in flight and its own, instead of K long steps
  (unchunked) or every chunk of the burst (chunked), and a capped step
  (K x T = 512 prefill tokens) costs less than a 1920-token one. Those
  requests, not the run's TTFT p99, are what the scheduler decides: the p99
  of ~30-60 short requests is their maximum, and on 2 vCPUs a stall of
  ~0.2-0.3 s anywhere in the run sets it (CI measured the capped cell's p99
  at 0.25 s against 0.33 s unchunked with K = 10). The p99 is reported.
- The mechanism: with the threshold the burst's prompts are prefilled side by
  side and get their first token in the same step; without it, one after
  another.
- Not ITL: the threshold trades K long steps for L / T = 60 capped ones, and
  the ITL p99 of the short requests is then set by the worst of those 60
  (stalls from other processes over a window twice as long, a hiccup of up
  to ~0.3 s measured when the burst is admitted) rather than by a 1920-token
  step: measured lower or higher than unchunked depending on the run.
- Not throughput: the run is open loop at a rate every cell sustains, so
  throughput is the offered load in every cell (it tells cells apart only
  when one falls behind). Both are reported per cell.

Each comparison alternates the two cells' runs (both engines live), so a
slow period of the machine hits both, and takes the best of each cell's runs:
on a small shared machine other processes stall the engine or the client now
and then, which only ever adds latency, while what the scheduler does is the
same every time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from batchbench.adapters.base import Engine
from batchbench.adapters.registry import engine_class, specs
from batchbench.analysis.repeats import RepeatProtocol, Repeats, paired
from batchbench.core import codec
from batchbench.core.config import BatchingConfig
from batchbench.core.records import RequestRecord
from batchbench.experiment.harness import Harness
from batchbench.load.runner import MeasuredRun
from batchbench.measures.metrics import Distribution, itl_samples
from batchbench.pytest_plugin import IntervalChecks
from batchbench.workload.profiles import Profile, get_profile
from batchbench.workload.requests import Arrival, Lengths, Workload, WorkloadSpec, interleave

#: Long prompts in the burst (K): unchunked, a short request behind them waits K long steps. 16, not 10: with
#: ~25-35 ms per 1920-token step on CI's cores, 10 long steps (~0.3 s) were within the machine's stalls.
BURST = 16
#: The short requests that arrive with the burst: the first BEHIND after it (~0.4 s of arrivals at SHORT_RATE).
BEHIND = 3
LONG_OUTPUT = 16
#: How long before one short request the burst lands (see :func:`workload`).
BURST_LEAD_S = 0.02
#: At most the threshold, so a short prompt is prefilled in one step even when the cap applies to it.
SHORT_PROMPT_MAX = 32
#: Fixed, so every short request weighs the same in the pooled ITL.
SHORT_OUTPUT = 24
#: Short requests per run and their Poisson rate: a stream one engine serves with a few seats
#: (~4 s of arrivals in quick, ~30 s in full), so a seat cap that binds is the burst's doing. What quick asserts
#: happens within ~1 s of the burst; its ~3 s of shorts after that are what a run needs to drain it.
SHORTS = {"quick": 32, "full": 240}
SHORT_RATE = 8.0
#: Measured repetitions per cell and comparison, after an unrecorded one; each claim is a ratio paired pass by
#: pass over them, decided by its interval (the table shows each metric's best). 3, not 2: one stall (~0.2-0.3 s
#: on 2 vCPUs) in the few hundred ms the burst's neighbours wait is rare, but with 2 runs both had one too often.
REPEATS = 3
#: Passes at most, while a claim's interval straddles its limit (each comparison alternates two live engines).
MAX_REPEATS = 5

# A short request arriving with the burst waits K long steps unchunked, and all K x ceil(L / budget)
# chunk steps of the burst chunked without the threshold; with it, the step in flight and its own, of
# K x T = 512 prefill tokens, which cost less than a 1920-token step. So in steps the ratio is at most
# 2 / K = 0.125. Measured (best of 3, alternated, machine load ~2.7 on 2 vCPUs): 0.27 vs unchunked
# (0.20s vs 0.74s), 0.13 vs chunked (0.06s vs 0.50s); the capped cell's spread is the hiccup when the
# burst is admitted. Asserting < 0.6 leaves a margin of ~2x over the worst measured ratio.
TTFT_RATIO_MAX = 0.6
# The burst's first tokens: side by side they come in one step once all K are admitted; one after another
# they are a step apart each, (K - 1) long steps, >= 9 x ~70 ms when quiet. The side-by-side spread is not
# ~0 in practice: the K long bodies reach the engine over a few steps (measured 35-114 ms on 2 vCPUs at half
# speed under tools/slow-machine), so the pass-by-pass ratio's interval can straddle the limit for 3 passes
# and take the 5 MAX_REPEATS allows. Asserting a quarter of the serial spread leaves room for that.
SPREAD_RATIO_MAX = 0.25


@dataclass(frozen=True)
class Cell:
    name: str
    config: BatchingConfig
    #: Run in the quick profile too; else only in full.
    quick: bool


@dataclass(frozen=True)
class Sizes:
    max_model_len: int
    long_prompt: int
    small_budget: int
    threshold: int
    shorts: int
    seats_all: int
    seats_few: int


def sizes(profile: Profile) -> Sizes:
    m = profile.max_model_len
    small_budget = m // 2  # below the long prompt, so a long prompt really is chunked
    shorts = SHORTS[profile.name]
    return Sizes(max_model_len=m, long_prompt=m - m // 16, small_budget=small_budget,
                 threshold=small_budget // 32,  # K x T = half the budget: the rest is left for newcomers
                 shorts=shorts, seats_all=shorts + BURST, seats_few=BURST)


def grid(profile: Profile) -> list[Cell]:
    s = sizes(profile)
    m, b, t = s.max_model_len, s.small_budget, s.threshold

    def cell(name: str, chunked: bool, budget: int, seqs: int, lpt: int, quick: bool) -> Cell:
        config = BatchingConfig(max_batch_size=seqs, max_batched_tokens=budget, chunked_prefill=chunked,
                                prefill_chunk_tokens=lpt or None)
        return Cell(name, config, quick)

    return [
        # Unchunked cells: the budget can only be max_model_len (the engine refuses less), and no threshold.
        cell("unchunked", False, m, s.seats_all, 0, True),
        cell("chunked", True, b, s.seats_all, 0, True),
        cell("chunked-lpt", True, b, s.seats_all, t, True),
        cell(f"chunked-lpt-seqs{s.seats_few}", True, b, s.seats_few, t, False),
        cell(f"unchunked-seqs{s.seats_few}", False, m, s.seats_few, 0, False),
        cell(f"chunked-lpt-budget{m}", True, m, s.seats_all, t, False),
    ]


def workload(profile: Profile, *, seed: int = 7) -> Workload:
    """Short interactive requests (Poisson), and BURST long prompts together a quarter of the way in."""
    s = sizes(profile)
    shorts = WorkloadSpec("short", s.shorts, prompt=Lengths.uniform(16, SHORT_PROMPT_MAX),
                          output=Lengths.fixed(SHORT_OUTPUT), arrival=Arrival("poisson", rate=SHORT_RATE),
                          seed=seed, priority="interactive").build()
    # The burst lands 20 ms before a short request (the one nearest a quarter of the way in), so that request
    # arrives with it, queued behind it, as the arithmetic below assumes, whatever an engine step costs.
    # Placed between two arrivals (as it was), the first short behind the burst waited K long steps minus the
    # gap before it came: ~0.6 s with ~70 ms steps, but only ~0.27 s with the ~35-45 ms steps measured since,
    # within the capped cell's stalls (~0.2 s, anywhere in the run). 1 ms was too close: the burst's sixteen
    # 1920-token bodies take the server longer to read than a short one, which then got in first.
    quarter = 0.25 * shorts.requests[-1].arrival_s
    with_burst = min(shorts.requests, key=lambda r: abs(r.arrival_s - quarter))
    burst_at = round(max(0.0, with_burst.arrival_s - BURST_LEAD_S), 6)
    longs = WorkloadSpec("long", BURST, prompt=Lengths.fixed(s.long_prompt), output=Lengths.fixed(LONG_OUTPUT),
                         arrival=Arrival("offline"), seed=seed + 1, priority="batch").build()
    longs = Workload(longs.spec, tuple(dataclasses.replace(r, arrival_s=burst_at) for r in longs.requests))
    return interleave("short-with-long-burst", shorts, longs)


# --------------------------------------------------------------------------- measuring


def _p99(values: list[float]) -> float:
    dist = Distribution.of(values)
    assert dist is not None, "no samples"
    return dist.p99


def _of(records: list[RequestRecord], priority: str) -> list[RequestRecord]:
    return [r for r in records if r.priority == priority]


def run_metrics(result: MeasuredRun) -> dict[str, float]:
    """One run: the worst TTFT of the short requests that arrive with the burst, the short requests' TTFT and
    ITL p99, the run's throughput, and when the burst's prompts got their first tokens."""
    shorts, longs = _of(result.records, "interactive"), _of(result.records, "batch")
    firsts = [r.chunk_times[0] for r in longs]
    burst_at = min(r.scheduled_s for r in longs)
    behind = sorted((r for r in shorts if r.scheduled_s >= burst_at), key=lambda r: r.scheduled_s)[:BEHIND]
    return {
        "behind_burst_ttft": max(r.ttft_s for r in behind if r.ttft_s is not None),
        "short_ttft_p99": _p99([r.ttft_s for r in shorts if r.ttft_s is not None]),
        "short_itl_p99": _p99([x for r in shorts for x in itl_samples(r)]),
        "throughput_tok_s": result.summary.total_token_throughput,
        "long_ttft_max": max(r.ttft_s for r in longs if r.ttft_s is not None),
        "long_first_token_spread_s": max(firsts) - min(firsts),
        "max_running": max((s.running for s in result.samples if s.running is not None), default=0.0),
    }


#: Metrics where more is better; every other one is a time, where less is.
HIGHER_IS_BETTER = ("throughput_tok_s",)


def best(runs: list[dict[str, float]]) -> dict[str, float]:
    """Per metric, the best repetition: interference from outside the engine only makes things worse."""
    out = {key: (max if key in HIGHER_IS_BETTER else min)(r[key] for r in runs) for key in runs[0]}
    out["max_running"] = max(r["max_running"] for r in runs)  # a bound checked over every run
    return out


class CellRunner:
    """Measured runs of the grid's cells, each engine warmed up on the workload before its first."""

    def __init__(self, harness: Harness, start_engine: Callable[..., Engine], engine_name: str, wl: Workload) -> None:
        self.harness, self.start_engine, self.engine_name, self.wl = harness, start_engine, engine_name, wl
        self.runs: dict[str, list[dict[str, float]]] = {}
        self._warm: set[int] = set()

    def engine(self, cell: Cell) -> Engine:
        engine = self.start_engine(self.engine_name, cell.config)
        if id(engine) not in self._warm:
            # The workload once, unrecorded: the engine cache's warm-up stops at 256-token prompts, and a
            # fresh engine's first run of this workload (steps of sizes it had not run before) was measured
            # several times slower than the runs after it.
            self.harness.replay(engine, self.wl)
            self._warm.add(id(engine))
        return engine

    def measure(self, cell: Cell, engine: Engine, benchmark: Any = None) -> MeasuredRun:
        c = cell.config
        repeat = len(self.runs.setdefault(cell.name, []))
        labels = {"suite": "token_budget", "cell": cell.name, "chunked": c.chunked_prefill, "repeat": repeat,
                  "budget": c.max_batched_tokens, "seqs": c.max_batch_size,
                  "prefill_chunk_tokens": c.prefill_chunk_tokens}
        result = self.harness.measure(engine, self.wl, tag=f"{cell.name}-r{repeat}", labels=labels,
                                      benchmark=benchmark)
        assert result.summary.failed == 0, f"{cell.name}: {result.summary.failures}"
        self.runs[cell.name].append(run_metrics(result))
        return result

    def alternate(self, a: Cell, b: Cell, judge: Callable[[Repeats[MeasuredRun], Repeats[MeasuredRun]], IntervalChecks],
                  benchmark: Any = None) -> tuple[Repeats[MeasuredRun], Repeats[MeasuredRun]]:
        """Runs of two cells alternating (both engines live), so that a slow period of the machine hits both:
        REPEATS passes, then more, up to MAX_REPEATS, while ``judge``'s claims on the pairs are undecided."""
        cells = {a.name: a, b.name: b}
        engines = {a.name: self.engine(a), b.name: self.engine(b)}
        series: dict[str, Repeats[MeasuredRun]] = {a.name: Repeats(), b.name: Repeats()}
        protocol = RepeatProtocol(repeats=REPEATS, max_repeats=MAX_REPEATS, together=True, look_once=True,
                                  settled=lambda _: judge(series[a.name], series[b.name]).decided)
        for name, i in protocol.schedule(series):
            result = self.measure(cells[name], engines[name], benchmark if name == b.name and i == 0 else None)
            series[name].add(result, result.machine)
        return series[a.name], series[b.name]


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = [f"{'cell':<24} {'behind burst TTFT':>17} {'short TTFT p99':>14} {'short ITL p99':>13} {'tok/s':>7} "
             f"{'long TTFT max':>13} {'burst spread':>12}"]
    for name, m in results.items():
        lines.append(f"{name:<24} {m['behind_burst_ttft']:>16.3f}s {m['short_ttft_p99']:>13.3f}s "
                     f"{m['short_itl_p99']:>12.3f}s {m['throughput_tok_s']:>7.0f} {m['long_ttft_max']:>12.2f}s "
                     f"{m['long_first_token_spread_s']:>11.3f}s")
    return "\n".join(lines)


def test_token_budget_vs_sequence_cap(
    harness: Harness, start_engine: Callable[..., Engine], engine_name: str, benchmark: Any
) -> None:
    capabilities = engine_class(engine_name).capabilities
    if not capabilities.chunked_prefill:
        pytest.skip(f"engine {engine_name!r} cannot switch chunked prefill (Capabilities.chunked_prefill is False)")
    if not capabilities.prefill_chunk_cap:
        pytest.skip(f"engine {engine_name!r} has no per-request prefill cap (Capabilities.prefill_chunk_cap is "
                    "False): the grid compares chunking with and without one")
    if harness.max_live_engines < 2:
        pytest.skip(f"--max-live-engines {harness.max_live_engines}: the comparisons alternate two live engines")
    profile = harness.profile
    s = sizes(profile)
    cells = {c.name: c for c in grid(profile) if c.quick or profile.name != "quick"}
    runner = CellRunner(harness, start_engine, engine_name, workload(profile))

    # Each baseline alternates with the capped cell; each comparison pairs the capped runs of its own period.
    capped_cell = cells["chunked-lpt"]

    def judge(name: str) -> Callable[[Repeats[MeasuredRun], Repeats[MeasuredRun]], IntervalChecks]:
        def claims(baseline: Repeats[MeasuredRun], capped: Repeats[MeasuredRun]) -> IntervalChecks:
            checks = IntervalChecks()
            # The mechanism: capped, the burst's prompts advance side by side and get their first tokens in one
            # step; uncapped (chunked or not) they are prefilled one after another.
            checks.check(f"the burst's first-token spread, chunked-lpt over {name}",
                         paired(capped, baseline, lambda r: run_metrics(r)["long_first_token_spread_s"]),
                         SPREAD_RATIO_MAX, "below", of=(capped, baseline))
            checks.check(f"the TTFT of the short requests arriving with the burst (worst of the first {BEHIND}), "
                         f"chunked-lpt with a {s.threshold}-token threshold over {name}",
                         paired(capped, baseline, lambda r: run_metrics(r)["behind_burst_ttft"]), TTFT_RATIO_MAX,
                         "below", of=(capped, baseline))
            return checks
        return claims

    pairs = {name: runner.alternate(cells[name], capped_cell, judge(name), benchmark if name == "chunked" else None)
             for name in ("unchunked", "chunked")}
    for name, cell in cells.items():  # the full profile's other cells: reported, with their seat caps checked
        if name not in ("unchunked", "chunked", "chunked-lpt"):
            engine = runner.engine(cell)
            for _ in range(REPEATS):
                runner.measure(cell, engine)
    results: dict[str, dict[str, Any]] = {name: best(runs) | {"repeats": runs} for name, runs in runner.runs.items()}
    benchmark.extra_info.update({"cells": results, "sizes": dataclasses.asdict(s), "burst": BURST})
    print(f"\n{table(results)}")

    for name, m in results.items():
        seats = cells[name].config.max_batch_size
        assert seats is not None and m["max_running"] <= seats, f"{name}: {m['max_running']} running, {seats} seats"
    checks = IntervalChecks()
    for name, (baseline, capped) in pairs.items():
        found = judge(name)(baseline, capped)
        checks.failed += found.failed
        checks.undecided += found.undecided
        ratio = paired(capped, baseline, lambda r: run_metrics(r)["short_ttft_p99"])
        benchmark.extra_info[f"ttft_p99_ratio_chunked_lpt_over_{name}"] = codec.encode(ratio)
    checks.finish(table(results))


# --------------------------------------------------------------------------- no engine needed


def grid_engines() -> list[type[Engine]]:
    """Every registered engine this suite can run: chunked prefill switchable and a per-request prefill cap."""
    return [spec.engine_class for spec in specs().values()
            if spec.engine_class.capabilities.chunked_prefill and spec.engine_class.capabilities.prefill_chunk_cap]


@pytest.mark.parametrize("profile_name", ["quick", "full"])
def test_every_cell_is_a_config_the_engines_start_with(profile_name: str) -> None:
    profile = get_profile(profile_name)
    s = sizes(profile)
    assert s.long_prompt + LONG_OUTPUT <= s.max_model_len  # the long prompts are served, not refused
    assert s.long_prompt > s.small_budget  # ... and really chunked in the small-budget cells
    assert BURST * s.threshold + s.seats_all + SHORT_PROMPT_MAX <= s.small_budget  # room for newcomers, always
    assert s.threshold >= SHORT_PROMPT_MAX  # a short prompt is never cut by the cap
    assert s.seats_few == BURST < s.seats_all
    names = [c.name for c in grid(profile)]
    assert len(set(names)) == len(names) and {"unchunked", "chunked", "chunked-lpt"} <= set(names)
    engines = grid_engines()
    assert engines, "no registered engine can run the grid"
    for cls in engines:
        for c in grid(profile):
            cls.check_config(c.config, max_model_len=s.max_model_len)  # raises ValueError if it would refuse
        # Unchunked, a budget below max_model_len: a long prompt never fits.
        with pytest.raises(ValueError, match="max_batched_tokens >= max_model_len"):
            cls.check_config(BatchingConfig(max_batched_tokens=512, chunked_prefill=False), max_model_len=2048)


def test_the_burst_lands_among_the_short_requests() -> None:
    wl = workload(get_profile("quick"))
    shorts = [r for r in wl.requests if r.priority == "interactive"]
    longs = [r for r in wl.requests if r.priority == "batch"]
    assert len(shorts) == SHORTS["quick"] and len(longs) == BURST and len({r.arrival_s for r in longs}) == 1
    assert sum(r.arrival_s > longs[0].arrival_s for r in shorts) >= len(shorts) // 2  # most queue behind it

