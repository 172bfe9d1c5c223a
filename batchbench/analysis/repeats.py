"""The one repeat protocol: repeats, the quiet-run filter, and the estimate with its confidence interval.

A run on a shared machine is one sample of that machine's noise (on two vCPUs the same run's
throughput moves by tens of percent from one minute to the next), so a figure worth comparing
comes from repeats. Everything that repeats a measurement (the CLI, the suites, the report) does it
the same way:

- **Repeats, interleaved.** :class:`RepeatProtocol` schedules passes: each pass measures every
  measurement once, in order (reversed on odd passes with ``alternate``, so a slow spell of the
  machine does not always hit the same end), so a slow period hits all of them alike. After the
  first ``repeats`` passes, more passes (up to ``max_repeats``; no run starts once ``budget_s`` has
  passed) measure again what is not yet ``settled`` (:func:`precise`: its interval is narrow enough)
  among what is in ``focus`` (what decides the caller's answer); with ``together``, all of them again
  while any is not, so a comparison stays paired. A claim decided by its interval (a suite's) is looked at twice
  with ``look_once``: after ``repeats`` passes, and, where that did not decide it, after ``max_repeats``; looking
  after every pass until the interval clears its limit would make each look another chance of a wrong verdict.
- **Quiet runs.** Each run carries the machine's load during it
  (:class:`batchbench.measures.machine_load.MachineLoad`); a *disturbed* run (other processes took over
  :data:`batchbench.measures.machine_load.BUSY_SHARE` of the CPU) is reported but not used:
  :meth:`Repeats.kept` is the quiet runs where there are at least ``min_quiet`` of them, else all.
- **The estimate.** :class:`Estimate` is the mean of the kept values with its 95% confidence
  interval from Student's t distribution over the repeats: on the log scale for a positive figure (every rate,
  latency and count batchbench measures; ``method="t-log"``), so the interval cannot cross zero and is never
  clamped there, else as it is (``method="t"``); and the ratio of two
  such means with a 95% interval by the delta method on the log scale: paired where the two were
  measured pass by pass side by side (``method="t-ratio-paired"``: the machine's slow spells, which
  both share, cancel), else from the two sets of repeats alone (``method="t-ratio"``). One
  method for every figure of every point, so two cells of a table always mean the same thing; a
  figure with one repeat has no interval (``n=1``, ``low`` and ``high`` None) and says so; one from fewer
  than :data:`MIN_DECIDING_REPEATS` whose interval is wider than the precision asked is *thin*
  (:meth:`Estimate.thin`): nothing is decided on it. A
  single run's requests are not resampled instead: their spread says how much one run's requests
  disagree, not how much the next run would.

A suite may reduce its kept runs differently where its docstring says why (the best of them, when
interference only ever makes a run worse); the schedule and the quiet filter are still these.
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from collections.abc import Callable, Collection, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Literal, TypeVar

from batchbench.measures.machine_load import MachineLoad

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)

Method = Literal["t", "t-log", "t-ratio", "t-ratio-paired"]
_MEANS = ("t", "t-log")
_RATIOS = ("t-ratio", "t-ratio-paired")

#: The confidence of every interval batchbench reports.
CONFIDENCE = 0.95
#: The share of its mean a figure's interval is repeated down to where the caller asks for no other
#: (``batchbench run --precision``).
DEFAULT_PRECISION = 0.05
#: Repeats an interval needs before anything is decided on it, unless it is already within the precision asked.
#: Two repeats give Student's t one degree of freedom: the standard deviation comes from a single difference, so
#: the interval's width is itself a coin toss (x12.7 the standard error, or a lucky narrow one). From three, the
#: quantile is 4.3 and the width means what it says.
MIN_DECIDING_REPEATS = 3
#: Student's t distribution's 97.5% quantile (two-sided 95%) by degrees of freedom, to four decimals. Written out
#: because these 34 constants are all batchbench needs of a statistics library (scipy would be ~40 MB more in
#: every install); between rows the quantile is interpolated in 1/df, the standard way to read a t table, which
#: is exact to three decimals here.
_T975 = ((1, 12.7062), (2, 4.3027), (3, 3.1824), (4, 2.7764), (5, 2.5706), (6, 2.4469), (7, 2.3646),
         (8, 2.3060), (9, 2.2622), (10, 2.2281), (11, 2.2010), (12, 2.1788), (13, 2.1604), (14, 2.1448),
         (15, 2.1314), (16, 2.1199), (17, 2.1098), (18, 2.1009), (19, 2.0930), (20, 2.0860), (21, 2.0796),
         (22, 2.0739), (23, 2.0687), (24, 2.0639), (25, 2.0595), (26, 2.0555), (27, 2.0518), (28, 2.0484),
         (29, 2.0452), (30, 2.0423), (40, 2.0211), (60, 2.0003), (120, 1.9799))
_Z975 = 1.959964
_DF = [df for df, _ in _T975]


def t_quantile(df: float) -> float:
    """The two-sided 95% quantile of Student's t with ``df`` degrees of freedom (``df`` >= 1, not necessarily
    whole: Welch's df is not); the normal's 1.96 as ``df`` grows without bound."""
    if not df >= 1:
        raise ValueError(f"a t quantile needs at least one degree of freedom, not {df!r}")
    if math.isinf(df):
        return _Z975
    i = bisect.bisect_left(_DF, df)
    if i < len(_DF) and _DF[i] == df:
        return _T975[i][1]
    (d0, q0), (d1, q1) = (_T975[i - 1], _T975[i]) if i < len(_DF) else (_T975[-1], (math.inf, _Z975))
    w = (1 / d0 - 1 / df) / (1 / d0 - 1 / d1)  # 1/inf is 0: the last row runs out towards the normal
    return q0 + w * (q1 - q0)


@dataclass(frozen=True)
class Estimate:
    """A figure from repeats: the mean of ``n`` values and its 95% confidence interval (module docstring).

    ``low``/``high`` are None when there is no interval (one repeat, or a ratio whose parts have none).
    """

    value: float
    low: float | None
    high: float | None
    n: int
    method: Method = "t"
    #: The values' sample standard deviation (a mean with n >= 2; None otherwise): what a ratio needs.
    sd: float | None = None

    def __post_init__(self) -> None:
        if (self.low is None) != (self.high is None):
            raise ValueError("an interval has both ends or neither")
        if self.low is not None and not self.low <= self.value <= self.high:  # type: ignore[operator]
            raise ValueError(f"an estimate needs low <= value <= high, not {self.low}, {self.value}, {self.high}")

    @classmethod
    def of(cls, values: Sequence[float]) -> Estimate | None:
        """The mean of ``values`` with its 95% t-interval; None for no values.

        Values that are never negative with a positive mean (every figure batchbench measures: rates, latencies,
        counts) get the interval on the log scale, by the delta method as for ratios:
        ``mean * exp(± t * (sd / mean) / sqrt(n))``. It cannot reach zero, where such a mean cannot go, and it is
        asymmetric as their spread is (a slow run can take twice as long; a fast one cannot take no time), where a
        symmetric interval had to be clamped at zero and then claimed a mean of 0 possible. Other values get the
        plain symmetric t-interval (``method="t"``)."""
        if not values:
            return None
        n = len(values)
        mean = math.fsum(values) / n
        if n < 2:
            return cls(mean, None, None, 1)
        sd = statistics.stdev(values, mean)
        t = t_quantile(n - 1)
        if mean > 0 and min(values) >= 0:
            spread = t * sd / mean / math.sqrt(n)
            return cls(mean, mean * math.exp(-spread), mean * math.exp(spread), n, "t-log", sd)
        half = t * sd / math.sqrt(n)
        return cls(mean, mean - half, mean + half, n, "t", sd)

    @property
    def relative_half_width(self) -> float | None:
        """Half the interval's width over the value: ±0.05 is "within 5%". None without an interval, and
        infinite for a value of 0 with a spread."""
        if self.low is None or self.high is None:
            return None
        half = (self.high - self.low) / 2
        if self.value == 0:
            return 0.0 if half == 0 else math.inf
        return half / abs(self.value)

    def precise(self, target: float) -> bool:
        """Whether the interval is within ``target`` (a share, 0.05 for ±5%) of the value."""
        share = self.relative_half_width
        return share is not None and share <= target

    def thin(self, target: float) -> bool:
        """Whether the interval is too thin to decide on: from fewer than :data:`MIN_DECIDING_REPEATS` repeats and
        wider than ``target`` (the precision asked). A comparison or a verdict on it is undecided, whichever side
        its interval falls: that width may be a fluke of one degree of freedom. (One repeat has no interval at all:
        it is judged on its value and says n=1.)"""
        return self.low is not None and self.n < MIN_DECIDING_REPEATS and not self.precise(target)

    def ratio(self, other: Estimate) -> Estimate | None:
        """``self / other``, two means of repeats: the ratio of the means with a 95% interval by the delta method
        on the log scale, ``exp(log(r) ± t * sqrt(sa²/(na·ma²) + sb²/(nb·mb²)))`` with Welch–Satterthwaite
        degrees of freedom. None when either mean is not positive (no ratio); no interval when either side has
        fewer than two repeats."""
        if self.method not in _MEANS or other.method not in _MEANS or self.value <= 0 or other.value <= 0:
            return None
        value = self.value / other.value
        n = min(self.n, other.n)
        if self.sd is None or other.sd is None:
            return Estimate(value, None, None, n, "t-ratio")
        va, vb = (self.sd / self.value) ** 2 / self.n, (other.sd / other.value) ** 2 / other.n
        if va + vb == 0:
            return Estimate(value, value, value, n, "t-ratio")
        df = (va + vb) ** 2 / (va ** 2 / (self.n - 1) + vb ** 2 / (other.n - 1))
        spread = t_quantile(max(df, 1.0)) * math.sqrt(va + vb)
        return Estimate(value, value * math.exp(-spread), value * math.exp(spread), n, "t-ratio")

    @classmethod
    def paired_ratio(cls, pairs: Sequence[tuple[float, float]]) -> Estimate | None:
        """``mean(a) / mean(b)`` of pairs measured side by side (one per pass), with a 95% interval by the delta
        method on the log scale that keeps their covariance: each pair's ``a/mean(a) - b/mean(b)`` is its share of
        the log ratio's error, and their t-interval is the log ratio's. A slow spell of the machine that slowed
        both runs of a pair moves neither share. None when either mean is not positive; no interval for one
        pair."""
        if not pairs:
            return None
        ma, mb = math.fsum(a for a, _ in pairs) / len(pairs), math.fsum(b for _, b in pairs) / len(pairs)
        if ma <= 0 or mb <= 0:
            return None
        value = ma / mb
        if len(pairs) < 2:
            return cls(value, None, None, 1, "t-ratio-paired")
        errors = [a / ma - b / mb for a, b in pairs]
        spread = t_quantile(len(pairs) - 1) * statistics.stdev(errors, 0.0) / math.sqrt(len(pairs))
        return cls(value, value * math.exp(-spread), value * math.exp(spread), len(pairs), "t-ratio-paired")

    def inverse(self) -> Estimate:
        """For a ratio ``a / b``: ``b / a``, its interval inverted with it."""
        if self.method not in _RATIOS or self.value <= 0:
            raise ValueError("only a positive ratio has an inverse")
        if self.low is None or self.high is None:
            return Estimate(1 / self.value, None, None, self.n, self.method)
        return Estimate(1 / self.value, 1 / self.high, 1 / self.low, self.n, self.method)

    @property
    def differs_from_one(self) -> bool | None:
        """For a ratio: whether its interval excludes 1 (the two figures differ); None without an interval."""
        if self.low is None or self.high is None:
            return None
        return self.low > 1 or self.high < 1

    @property
    def largest_undetected(self) -> float | None:
        """For a ratio within noise: the largest difference its interval leaves open, as a share (0.12: "no
        difference larger than 12% detected"); None without an interval."""
        if self.low is None or self.high is None:
            return None
        return max(self.high - 1, 1 - self.low, 0.0)

    def undecided_at(self, precision: float) -> bool:
        """For a ratio: its interval holds 1 yet leaves open a difference larger than ``precision`` (a share, 0.05
        for ±5%): it shows neither a difference nor its absence at the precision asked, so it is no finding."""
        return self.differs_from_one is False and (self.largest_undetected or 0.0) > precision

    def describe(self) -> str:
        """What the interval is, in words, for a caption: ``95% t-interval, n=5``."""
        if self.low is None:
            return f"n={self.n}, no interval"
        what = {"t": "t-interval", "t-log": "t-interval on the log scale", "t-ratio": "interval of the ratio",
                "t-ratio-paired": "paired interval of the ratio"}[self.method]
        return f"{CONFIDENCE:.0%} {what}, n={self.n}"

    def format(self, fmt: Callable[[float], str]) -> str:
        """``812 [788–888]``, or ``812 (n=1)`` without an interval."""
        if self.low is None or self.high is None:
            return f"{fmt(self.value)} (n={self.n})"
        return f"{fmt(self.value)} [{fmt(self.low)}–{fmt(self.high)}]"

    @property
    def confidence(self) -> float:
        """The interval's confidence level (:data:`CONFIDENCE`)."""
        return CONFIDENCE

    #: Written with the estimate for a reader of report.json, ignored when read back.
    JSON_DERIVED: ClassVar[tuple[str, ...]] = ("confidence",)


def median(values: Sequence[float]) -> float:
    """The median of repeated values (ValueError when there is none): for suites that reduce repeats robustly."""
    if not values:
        raise ValueError("the median of no values")
    return statistics.median(values)


@dataclass
class Repeats(Generic[T]):
    """Repeated runs of one measurement, each with the machine's load during it."""

    runs: list[T] = field(default_factory=list)
    loads: list[MachineLoad] = field(default_factory=list)

    def add(self, run: T, load: MachineLoad) -> None:
        self.runs.append(run)
        self.loads.append(load)

    def __len__(self) -> int:
        return len(self.runs)

    @property
    def quiet(self) -> list[T]:
        """The runs the machine was quiet for (or whose load could not be measured)."""
        return [run for run, load in zip(self.runs, self.loads) if not load.disturbed]

    @property
    def foreign_shares(self) -> list[float | None]:
        return [load.foreign_share for load in self.loads]

    def kept(self, min_quiet: int = 1) -> list[T]:
        """The runs a figure comes from: the quiet ones where there are at least ``min_quiet``, else all."""
        quiet = self.quiet
        return quiet if len(quiet) >= min_quiet else list(self.runs)

    def estimate(self, value: Callable[[T], float | None], *, min_quiet: int = 1) -> Estimate | None:
        """:class:`Estimate` of ``value`` over the kept runs (runs where it is None left out)."""
        return Estimate.of([v for run in self.kept(min_quiet) if (v := value(run)) is not None])


def paired(a: Repeats[T], b: Repeats[T], value: Callable[[T], float | None]) -> Estimate | None:
    """``value`` of ``a`` over ``b``, two measurements run side by side in every pass (run i of each), paired by
    pass (:meth:`Estimate.paired_ratio`) over the passes where both runs were quiet and have the value: a slow
    spell of the machine that slowed both runs of a pass cancels."""
    pairs = [(va, vb) for ra, la, rb, lb in zip(a.runs, a.loads, b.runs, b.loads)
             if not la.disturbed and not lb.disturbed and (va := value(ra)) is not None
             and (vb := value(rb)) is not None]
    return Estimate.paired_ratio(pairs)


def why_no_estimate(series: Sequence[Repeats[Any]]) -> str:
    """Why a claim over these repeats (measured pass by pass, side by side) has no estimate, for the line that
    calls it undecided: the passes with a disturbed run and how disturbed, or the figure missing where they were
    quiet. A bare "no estimate" once hid, run after run, that every pass of a suite was disturbed."""
    passes = min((len(s) for s in series), default=0)
    if passes == 0:
        return "no estimate: nothing was measured"
    disturbed = [i for i in range(passes) if any(s.loads[i].disturbed for s in series)]
    if not disturbed:
        return f"no estimate: the figure is missing (or not positive) in all {passes} quiet passes"
    shares = [load.foreign_share for s in series for load in s.loads[:passes] if load.disturbed]
    said = (f"no estimate: {len(disturbed)} of {passes} passes had a disturbed run (other processes took up to "
            f"{max(share or 0.0 for share in shares):.0%} of the machine's CPU)")
    return said if len(disturbed) == passes else f"{said}; the quiet passes lack the figure"


Expect = Literal["above", "below"]


def decide(found: Estimate | None, limit: float, expect: Expect) -> bool | None:
    """Whether an estimate is on the ``expect`` side of ``limit``, by its interval: True when the whole interval
    is, False when the whole interval is on the other side, None when it straddles the limit (or there is no
    interval): the data cannot tell, and a claim must not be decided on its value alone."""
    if found is None or found.low is None or found.high is None:
        return None
    low, high = (found.low, found.high) if expect == "above" else (-found.high, -found.low)
    bound = limit if expect == "above" else -limit
    return True if low > bound else False if high < bound else None


def has_quiet_run(repeats: Repeats[Any]) -> bool:
    return bool(repeats.quiet)


def precise(value: Callable[[Any], float | None], target: float, *, min_quiet: int = 1
            ) -> Callable[[Repeats[Any]], bool]:
    """A ``settled`` test for :class:`RepeatProtocol`: the kept runs' estimate of ``value`` is within ``target``
    (a share of the value: 0.05 is ±5%)."""
    if not target > 0:
        raise ValueError(f"a precision target is a share above 0, not {target!r}")

    def settled(repeats: Repeats[Any]) -> bool:
        found = repeats.estimate(value, min_quiet=min_quiet)
        return found is not None and found.precise(target)

    return settled


@dataclass(frozen=True)
class RepeatProtocol:
    """When to measure what again (module docstring); the same for every caller."""

    #: Passes over every measurement, whatever happens.
    repeats: int = 1
    #: Passes in all at most (None: ``repeats``).
    max_repeats: int | None = None
    #: Whether a measurement's repeats so far are enough (default: it has a quiet run).
    settled: Callable[[Repeats[Any]], bool] = has_quiet_run
    #: Measure every measurement again while any is not settled (a paired comparison).
    together: bool = False
    #: Consult ``settled`` once, after the first ``repeats`` passes; where anything is unsettled then, run every
    #: pass up to ``max_repeats`` without looking again. For a claim decided on its interval: two looks in all
    #: (then, and the caller's after the last pass), each wrong in one direction at most 2.5% of the time, so at
    #: most 5% a direction over both, where stopping at the first pass whose interval clears the limit gives every
    #: pass another chance (simulated in tests/test_verdicts.py).
    look_once: bool = False
    #: Reverse the order on odd passes.
    alternate: bool = False
    #: No run past the first ``repeats`` passes starts after this many seconds of measuring.
    budget_s: float | None = None
    #: The measurements extra passes may measure again, given the series so far (None: all): where a caller knows
    #: which figures decide its answer, the budget goes to them. A sequence is also the order to measure them in
    #: (what the answer needs most first, so a budget that runs out mid-pass ran out on what mattered least).
    focus: Callable[[Mapping[Any, Repeats[Any]]], Collection[Any]] | None = None
    #: Whether a run of a measurement still fits the caller's time (None: always): a run that does not is not
    #: started (a wall-clock bound the caller must keep); a shorter one later in the pass still may be, and the
    #: schedule ends with the first extra pass in which nothing fits.
    fits: Callable[[Any], bool] | None = None

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"repeats must be at least 1, not {self.repeats}")
        if self.max_repeats is not None and self.max_repeats < self.repeats:
            raise ValueError(f"max_repeats ({self.max_repeats}) is below repeats ({self.repeats})")

    def schedule(self, series: Mapping[K, Repeats[Any]], *, started: float | None = None) -> Iterator[tuple[K, int]]:
        """(measurement, pass) in the order to measure them, deciding each extra pass on ``series`` as it
        stands then: the caller adds each run to ``series[key]`` before asking for the next. ``started``: when
        the budget began (default: now)."""
        started = time.perf_counter() if started is None else started
        looked: tuple[list[K], bool] | None = None  # look_once: what the one look sent on, and in which order
        for r in range(self.max_repeats or self.repeats):
            todo, extra = list(series), r >= self.repeats
            ordered = False
            if extra and looked is not None:
                todo, ordered = list(looked[0]), looked[1]  # every pass to the last, nothing looked at again
            elif extra:
                eligible = self.focus(series) if self.focus is not None else todo
                ordered = isinstance(eligible, Sequence) and not self.together
                wanted = list(eligible) if ordered else [key for key in todo if key in eligible]
                unsettled = [key for key in wanted if key in series and not self.settled(series[key])]
                if not unsettled:
                    return
                todo = todo if self.together else unsettled
                if self.look_once:
                    looked = (todo, ordered)
            if self.alternate and r % 2 == 1 and not ordered:
                todo.reverse()
            started_any = False
            for key in todo:
                if extra and self.over_budget(started):
                    return
                if self.fits is not None and not self.fits(key):
                    continue
                started_any = True
                yield key, r
            if extra and not started_any:
                return

    def over_budget(self, started: float) -> bool:
        """Whether the budget counted from ``started`` is spent (never, without one)."""
        return self.budget_s is not None and time.perf_counter() - started > self.budget_s

    def run(
        self,
        keys: Sequence[K],
        measure: Callable[[K, int], T | None],
        load: Callable[[T], MachineLoad] = lambda run: run.machine,  # type: ignore[attr-defined]
    ) -> dict[K, Repeats[T]]:
        """Measure ``keys`` by this protocol; ``measure(key, pass)`` returns a run (None: nothing to keep)
        and ``load(run)`` the machine's load during it (a :class:`~batchbench.load.runner.MeasuredRun`'s by default)."""
        series: dict[K, Repeats[T]] = {key: Repeats() for key in keys}
        for key, r in self.schedule(series):
            found = measure(key, r)
            if found is not None:
                series[key].add(found, load(found))
        return series
