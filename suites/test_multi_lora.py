"""Suite: many LoRA adapters on one base model, fewer adapter slots than adapters.

A multi-LoRA server batches requests for different adapters together, but one
engine step serves at most ``max_loras`` distinct adapters: a waiting request
whose adapter is not among those running, when the slots are full, is passed
over until one of them drains completely, and its adapter may then have to be
loaded again. The adapters are made here, PEFT-format with seeded random
weights at ranks 8, 16, 32 and 64 (:mod:`batchbench.workload.lora`), and the engine is
started once with two adapter slots (``BatchingConfig.max_loras=2``,
``max_lora_rank=64``). Three traffic splits are sent closed loop, interleaved
and repeated:

- ``fit``: an even split across two adapters, as many as the slots;
- ``over``: an even split across all four, twice the slots;
- ``heavy``: the four, one of them taking 5/8 of the traffic.

What the mechanism predicts, and is asserted:

- ``fit``: nothing waits for a slot (the engine's own count of requests passed
  over for a transient limit stays 0), and the two adapters are served alike:
  Jain's index of their request speeds is at least ``FAIR_MIN``;
- ``over``: the engine passes requests over (that count rises above 0), its
  own LoRA gauge never shows more adapters served than slots, and a request
  whose adapter has no slot waits for a running group's remaining decode (up
  to ``OUTPUT`` steps, where one with a slot waits one): the slowest adapter's
  TTFT p50 over the fastest's is larger than with all adapters fitting
  (measured 2.5x and 6.1x against 1.04x and 1.02x, 2 vCPUs). The run's TTFT
  as a whole need not rise on a CPU (p50 measured 328 against 318 ms, and 417
  against 229 ms; p90 1040 against 787 ms, and 2903 against 522): with fewer
  requests running each step is cheaper, so the adapters holding a slot get
  their first token sooner than they would beside all the others;
- ``heavy``: the heavy adapter almost always holds a slot, so the light ones
  take turns at the other: their TTFT p50 is above the heavy adapter's.

Each claim is a figure over the repeats (the spread paired pass by pass, the
others a run's own ratio), decided by its interval
(:class:`batchbench.pytest_plugin.IntervalChecks`).
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import Any

import pytest

from batchbench.adapters.base import EngineCannotRunHere
from batchbench.adapters.registry import engine_class
from batchbench.analysis.repeats import Estimate, RepeatProtocol, Repeats, paired
from batchbench.core.config import BatchingConfig
from batchbench.experiment.harness import Harness
from batchbench.fixtures import tiny_model_dir
from batchbench.load.runner import MeasuredRun
from batchbench.pytest_plugin import IntervalChecks
from batchbench.workload.lora import Lora, make_lora
from batchbench.workload.requests import Arrival, Lengths, Workload, WorkloadSpec

RANKS = (8, 16, 32, 64)
SLOTS = 2
REQUESTS = 24
CONCURRENCY = 8
PROMPT = (16, 64)
OUTPUT = 48
#: Passes over the three splits; more, up to MAX_REPEATS, while a claim's interval straddles its limit.
REPEATS = 3
MAX_REPEATS = 5
#: The heavy adapter's weight against 1 for each light one (5/8 of the traffic with three light ones).
HEAVY_WEIGHT = 5.0
#: Jain's index of the adapters' request speeds when every adapter fits a slot.
FAIR_MIN = 0.9


def make_loras(dest: Path, model_dir: Path) -> tuple[Lora, ...]:
    return tuple(make_lora(model_dir, dest / f"lora-{i}-r{r}", f"lora-{i}-r{r}", r, seed=7)
                 for i, r in enumerate(RANKS))


def warm_up(over: Workload) -> Workload:
    """The first full batch of ``over``, not recorded: every adapter has been loaded once before any run."""
    first = over.requests[:CONCURRENCY]
    return Workload(dataclasses.replace(over.spec, num_requests=len(first)), first)


def workloads(names: tuple[str, ...]) -> dict[str, Workload]:
    """The three splits; the same prompts and lengths in each (one seed), only the adapters differ."""
    def build(loras: tuple[str, ...], weights: tuple[float, ...] = ()) -> Workload:
        return WorkloadSpec("multi-lora", REQUESTS, prompt=Lengths.uniform(*PROMPT), output=Lengths.fixed(OUTPUT),
                            arrival=Arrival("closed", concurrency=CONCURRENCY), seed=11, loras=loras,
                            lora_weights=weights).build()

    return {"fit": build(names[:SLOTS]), "over": build(names),
            "heavy": build(names, (HEAVY_WEIGHT,) + (1.0,) * (len(names) - 1))}


def test_adapters_beyond_the_slots_wait_for_one(
    harness: Harness, engine_name: str, tmp_path_factory: pytest.TempPathFactory,
    pytestconfig: pytest.Config, benchmark: Any,
) -> None:
    if not engine_class(engine_name).capabilities.lora:
        pytest.skip(f"engine {engine_name!r} cannot serve LoRA adapters (Capabilities.lora is False)")
    loras = make_loras(tmp_path_factory.mktemp("lora"), tiny_model_dir())
    wls = workloads(tuple(a.name for a in loras))
    config = BatchingConfig(max_loras=SLOTS, max_lora_rank=max(RANKS))
    try:
        with harness.private_engine(engine_name, config, loras=loras) as engine:
            harness.replay(engine, warm_up(wls["over"]))  # each adapter loaded, a full batch's shapes seen

            def measure(split: str, repeat: int) -> MeasuredRun:
                result = harness.measure(engine, wls[split], tag=f"lora-{split}", benchmark=(
                    benchmark if split == "over" and repeat == REPEATS - 1 else None),
                    labels={"suite": "multi_lora", "split": split, "repeat": repeat})
                assert result.summary.failed == 0, result.summary.failures
                return result

            series: dict[str, Repeats[MeasuredRun]] = {split: Repeats() for split in wls}
            # Every split each pass, again while a claim's interval straddles its limit.
            for split, repeat in RepeatProtocol(repeats=REPEATS, max_repeats=MAX_REPEATS, alternate=True,
                                                together=True, look_once=True,
                                                settled=lambda _: claims(wls, series).decided
                                                ).schedule(series):
                result = measure(split, repeat)
                series[split].add(result, result.machine)
    except EngineCannotRunHere as exc:
        if pytestconfig.getoption("--require-engines"):
            pytest.fail(f"--require-engines: {exc}", pytrace=False)
        pytest.skip(str(exc))
    runs = {split: reps.runs for split, reps in series.items()}
    ttft = {split: statistics.median(r.summary.ttft.p50 for r in rs if r.summary.ttft) for split, rs in runs.items()}
    tails = {split: statistics.median(r.summary.ttft.p90 for r in rs if r.summary.ttft) for split, rs in runs.items()}
    fairness = {split: statistics.median(r.summary.lora_fairness for r in rs if r.summary.lora_fairness)
                for split, rs in runs.items()}
    per_lora = {split: {name: statistics.median(lora_ttft(r, name) for r in rs)
                           for name in wls[split].spec.loras} for split, rs in runs.items()}
    samples = {split: [s for r in rs for s in r.samples] for split, rs in runs.items()}
    has_gauges = all(s.waiting_deferred is not None for ss in samples.values() for s in ss)
    deferred = {split: max((s.waiting_deferred or 0.0 for s in ss), default=0.0) for split, ss in samples.items()}
    served = {split: max((len(s.loras_active or ()) for s in ss), default=0) for split, ss in samples.items()}
    print(f"\n{engine_name}, max_loras={SLOTS}, {len(runs['fit'])} runs each (medians):")
    for split in runs:
        print(f"  {split:5s} TTFT p50 {ttft[split] * 1000:5.0f} ms, p90 {tails[split] * 1000:5.0f} ms; Jain "
              f"{fairness[split]:.3f}; most deferred {deferred[split]:.0f}; most adapters served {served[split]}; "
              "TTFT p50 per adapter (ms): " + ", ".join(f"{n} {v * 1000:.0f}" for n, v in per_lora[split].items()))
    benchmark.extra_info.update({"ttft_p50": ttft, "ttft_p90": tails, "fairness": fairness,
                                 "per_adapter_ttft_p50": per_lora, "most_deferred": deferred,
                                 "most_adapters_served": served})
    if has_gauges:
        assert deferred["fit"] == 0, f"adapters that fit the slots, yet requests deferred: {deferred['fit']}"
        assert deferred["over"] > 0, "four adapters in two slots, yet the engine never passed a request over"
        assert max(served.values()) <= SLOTS, f"more adapters served at once than {SLOTS} slots: {served}"
    claims(wls, series).finish(f"{engine_name}, max_loras={SLOTS}")


def spread(run: MeasuredRun) -> float | None:
    """Slowest over fastest adapter's TTFT p50 in one run."""
    ttfts = [lora_ttft(run, name) for name in run.summary.loras or {}]
    return max(ttfts) / min(ttfts) if ttfts and min(ttfts) > 0 else None


def claims(wls: dict[str, Workload], series: dict[str, Repeats[MeasuredRun]]) -> IntervalChecks:
    """The suite's claims on the runs so far, each over the repeats (module docstring)."""
    checks = IntervalChecks()
    quiet = {split: [r for r, load in zip(reps.runs, reps.loads) if not load.disturbed]
             for split, reps in series.items()}
    checks.check("two adapters in two slots: Jain's index of their request speeds",
                 Estimate.of([r.summary.lora_fairness for r in quiet["fit"] if r.summary.lora_fairness is not None]),
                 FAIR_MIN, "above", of=(series["fit"],))
    checks.check("slowest over fastest adapter's TTFT p50, four adapters over two",
                 paired(series["over"], series["fit"], spread), 1.0, "above",
                 of=(series["over"], series["fit"]))
    heavy, *light = wls["heavy"].spec.loras
    checks.check("the light adapters' TTFT p50 (the fastest of them) over the heavy one's", Estimate.of(
        [min(lora_ttft(r, name) for name in light) / lora_ttft(r, heavy) for r in quiet["heavy"]]), 1.0, "above",
        of=(series["heavy"],))
    return checks


def lora_ttft(run: MeasuredRun, name: str) -> float:
    loras = run.summary.loras or {}
    ttft = loras[name].ttft if name in loras else None
    assert ttft is not None, f"no TTFT for adapter {name!r}"
    return ttft.p50


def test_the_splits_send_what_the_prediction_assumes() -> None:
    wls = workloads(tuple(f"lora-{i}" for i in range(len(RANKS))))
    count = {split: {name: sum(r.lora == name for r in wl.requests) for name in wl.spec.loras}
             for split, wl in wls.items()}
    assert count["fit"] == {"lora-0": 12, "lora-1": 12}
    assert set(count["over"].values()) == {6}
    assert count["heavy"] == {"lora-0": 15, "lora-1": 3, "lora-2": 3, "lora-3": 3}
    prompts = {split: [r.prompt_token_ids for r in wl.requests] for split, wl in wls.items()}
    assert prompts["fit"] == prompts["over"] == prompts["heavy"]
