"""The answer as decisions: the questions batchbench exists for, one line each, per engine.

For each engine, from its continuous curve (the layout a server runs): the batch size for the most
throughput (a throughput pool), the largest batch that keeps the SLO's TTFT objectives (a latency
pool's ``max_num_seqs``), continuous against static batching, what padding costs, and where it becomes
memory-bound against the plan. Each line states its figure with the interval and what it rests on; a
line the data cannot answer says why instead of guessing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from batchbench.analysis.findings import batching, memory, padding
from batchbench.analysis.findings.batching import ContinuousOverStatic
from batchbench.analysis.findings.curve import MostThroughput, SweetSpot
from batchbench.analysis.findings.memory import MemoryBound
from batchbench.analysis.findings.padding import PaddingCost
from batchbench.analysis.findings.slo import UNDECIDED, LatencyPool, SloAt
from batchbench.analysis.findings.text import estimate, ms
from batchbench.analysis.findings.text import ratio as ratio_text
from batchbench.analysis.regimes import PEAK_SHARE
from batchbench.analysis.repeats import DEFAULT_PRECISION, MIN_DECIDING_REPEATS
from batchbench.core import codec
from batchbench.measures.slo import Slo

#: The questions, in the order the answer gives them (their keys in report.json).
QUESTIONS = {
    "throughput": "Batch size for throughput (sweet spot)",
    "latency": "Largest batch within the TTFT SLO",
    "batching": "Continuous vs static batching",
    "padding": "Cost of padding",
    "memory": "Memory-bound from",
}


@dataclass(frozen=True)
class TooThin:
    """An engine's curve points with too few repeats to decide on (left out of the sweet spot, the peak and the SLO
    verdicts), and what deciding them would have cost."""

    concurrencies: tuple[int, ...]
    #: Seconds the runs each lacks (to :data:`~batchbench.analysis.repeats.MIN_DECIDING_REPEATS`) take, at the mean
    #: length of its own runs.
    more_runs_s: float
    #: Seconds of one pass over every measurement of the engine, each at its runs' mean length.
    pass_s: float
    #: The job's time limit the runs were fitted into (None: not recorded).
    time_limit_s: float | None


@dataclass(frozen=True)
class TailShort:
    """The SLO's candidate batch (the largest whose pooled TTFT p99 is within the limit, above any shown to hold it)
    with too few requests to bound its p99, and what the requests it lacks would take here."""

    concurrency: int
    lacking: int
    #: Seconds those requests take at the mean pace of the point's runs.
    more_s: float
    #: The job's time limit the runs were fitted into (None: not recorded).
    time_limit_s: float | None


@dataclass(frozen=True)
class EngineDecisions:
    """One engine's answers, with the typed findings each rests on (the report links them)."""

    engine: str
    #: The curve layout they come from (``continuous`` where it ran).
    layout: str | None
    throughput: MostThroughput | None
    sweet_spot: SweetSpot | None
    latency_pool: LatencyPool | None
    continuous_over_static: ContinuousOverStatic | None
    padding_cost: PaddingCost | None
    memory_bound: MemoryBound | None
    has_kv_data: bool
    #: Why continuous and static could not be compared, where they could not.
    batching_missing: str | None = None
    #: Valid points of the curve whose key figure did not reach the precision target (their concurrencies).
    imprecise: tuple[int, ...] = ()
    precision_target: float | None = None
    too_thin: TooThin | None = None
    #: Why the curve has no regimes to read (one valid point, or too few repeats at the others).
    no_curve: str | None = None
    tail_short: TailShort | None = None

    def answers(self, slo: Slo | None) -> dict[str, str]:
        """Each question's one-line answer, by :data:`QUESTIONS` key."""
        return {"throughput": self._throughput(), "latency": self._latency(slo),
                "batching": batching.decision(self.continuous_over_static, self.batching_missing),
                "padding": padding.decision(self.padding_cost),
                "memory": memory.decision(self.memory_bound, self.has_kv_data)}

    def _throughput(self) -> str:
        """The sweet spot (:data:`~batchbench.analysis.regimes.PEAK_SHARE` of the peak), with the peak beside it, each
        with its own figures; then the batch sizes the data could not place."""
        return self._sweet_spot() + self._unplaced()

    def _sweet_spot(self) -> str:
        t, sweet = self.throughput, self.sweet_spot
        if t is None or sweet is None:
            return self.no_curve or "no valid point"
        tok = f": {estimate(sweet.output_tok_s)}" if sweet.output_tok_s is not None else ""
        if sweet.end_of_sweep:
            return (f"batch {sweet.concurrency}{tok}, still scaling at the largest batch measured: no sweet spot "
                    "within the sweep")
        text = f"batch {sweet.concurrency}{tok}"
        if sweet.peak_concurrency is None:
            among = "the most of the batch sizes placed" if any(c > sweet.concurrency for c in t.too_thin) \
                else "the most measured"
            return f"{text}, {among}; more requests add latency, not throughput"
        peak = f": {estimate(sweet.peak_output_tok_s)}" if sweet.peak_output_tok_s is not None else ""
        share = f", {ratio_text(sweet.share_of_peak)} of it" if sweet.share_of_peak is not None else ""
        return (f"{text}, within {1 - PEAK_SHARE:.0%} of the most measured (batch {sweet.peak_concurrency}{peak}"
                f"{share}); more requests add latency, not throughput")

    def _unplaced(self) -> str:
        """``; undecided against it: batch 16; too few repeats to place: batch 1, 32`` for the points the curve's
        choice could not use."""
        t, sweet = self.throughput, self.sweet_spot
        if t is None:
            return ""
        # The sweet spot's own place against the peak is the interval its share of it already shows.
        undecided = [c for c in t.undecided if sweet is None or c != sweet.concurrency]
        said = [f"; {what}: batch {', '.join(map(str, cs))}"
                for what, cs in (("undecided against it", undecided), ("too few repeats to place", t.too_thin)) if cs]
        return "".join(said)

    def _latency(self, slo: Slo | None) -> str:
        """The largest batch that holds the SLO's TTFT objectives; then the point that stopped the walk; then the
        points too thin to judge, by why (each with its count of requests where that is why)."""
        pool = self.latency_pool
        if slo is None or pool is None:
            return "no SLO given" if slo is None else "no valid point"
        after = f"; batch {pool.stopped_at.concurrency}: {'; '.join(pool.stopped_at.failed())}" \
            if pool.stopped_at is not None else ""
        after += "".join(_too_thin_text(why, [t for t in pool.too_thin if t.judgement == why]) for why in UNDECIDED)
        above = pool.stopped_at is not None or any(t.concurrency > (pool.concurrency or 0) for t in pool.too_thin)
        if pool.at is None:
            if pool.stopped_at is None:
                return "undecided" + after
            if pool.too_thin:
                return "none decided" + after
            return (f"none: batch {pool.stopped_at.concurrency} already misses it "
                    f"({'; '.join(pool.stopped_at.failed())})")
        held = "; ".join(o.text() for o in pool.at.objectives)
        return f"batch {pool.concurrency} ({held}){', the largest measured' if not above else ''}{after}"


    def to_dict(self, slo: Slo | None) -> dict[str, Any]:
        return {"engine": self.engine, "layout": self.layout, "answers": self.answers(slo),
                **codec.encode({"throughput": self.throughput, "sweet_spot": self.sweet_spot,
                                "latency_pool": self.latency_pool,
                                "continuous_over_static": self.continuous_over_static,
                                "padding_cost": self.padding_cost, "memory_bound": self.memory_bound,
                                "imprecise": self.imprecise, "precision_target": self.precision_target,
                                "too_thin": self.too_thin})}


def _too_thin_text(why: str, points: list[SloAt]) -> str:
    """``; too few requests to judge batch 1 (n=9), 2 (n=18): a p99 needs 368`` (or ``too few repeats``)."""
    if not points:
        return ""
    if why != "too few requests":
        return f"; {why} to judge batch {', '.join(str(t.concurrency) for t in points)}"
    counts, needs = _request_counts(points)
    return f"; {why} to judge batch {', '.join(counts)}: {_needs_text(needs)}"


def _request_counts(points: list[SloAt]) -> tuple[list[str], dict[str, int]]:
    """``["1 (n=9)", "2 (n=18)"]`` for points too few requests judge (each with its fewest), and the requests each
    of their percentiles needs (``{"p99": 368}``)."""
    counts: list[str] = []
    needs: dict[str, int] = {}
    for at in points:
        few = [o.pooled for o in at.objectives if o.judgement == "too few requests" and o.pooled is not None]
        counts.append(f"{at.concurrency} (n={min(q.n for q in few)})" if few else str(at.concurrency))
        needs.update({f"p{q.q * 100:g}": q.needed for q in few})
    return counts, needs


def _needs_text(needs: dict[str, int]) -> str:
    """``a p50 needs 6, a p99 needs 368``."""
    return ", ".join(f"a {p} needs {n}" for p, n in sorted(needs.items()))


def precision_sentence(decisions: list[EngineDecisions]) -> str | None:
    """Which points did not reach the precision target within the time budget (their intervals are shown), and
    which had too few repeats to decide on, with the command that would have given them enough."""
    short = [f"{d.engine} at {', '.join(map(str, d.imprecise))}" for d in decisions if d.imprecise]
    targets = {d.precision_target for d in decisions if d.precision_target is not None}
    target = min(targets) if targets else DEFAULT_PRECISION
    said = []
    if short and targets:
        said.append(f"Not within ±{target:.0%} in the time budget (wider intervals, shown as measured): "
                    f"{'; '.join(short)}.")
    thin = [d.too_thin for d in decisions if d.too_thin is not None]
    if thin:
        where = "; ".join(f"{d.engine} at {', '.join(map(str, d.too_thin.concurrencies))}"
                          for d in decisions if d.too_thin is not None)
        limits = {t.time_limit_s for t in thin}
        # One more mandatory pass keeps the runs as long only if the engine's share grows by two passes: the
        # mandatory passes are sized to half of it (batchbench.analysis.main_job.MANDATORY_SHARE).
        grow = 2 * sum(t.pass_s for t in thin)
        limit = limits.pop() if len(limits) == 1 else None
        command = (f"`batchbench run --repeats {MIN_DECIDING_REPEATS} --time-limit "
                   f"{math.ceil((limit + grow) / 10) * 10:.0f}`" if limit is not None
                   else f"`batchbench run --repeats {MIN_DECIDING_REPEATS}` with a --time-limit about "
                        f"{math.ceil(grow / 10) * 10:.0f} s longer")
        said.append(f"Too few repeats to decide (fewer than {MIN_DECIDING_REPEATS}, an interval wider than "
                    f"±{target:.0%}), so left out of the sweet spot, the peak and the SLO verdicts: {where}. The runs "
                    f"they lack take about {math.ceil(sum(t.more_runs_s for t in thin)):.0f} s here; {command} "
                    f"gives every point {MIN_DECIDING_REPEATS} runs.")
    few = _too_few_requests(decisions)
    if few:
        said.append(few)
    return " ".join(said) or None


def _too_few_requests(decisions: list[EngineDecisions]) -> str | None:
    """Which points had too few requests, pooled over their repeats, to bound an SLO percentile on the side that
    would decide it (:mod:`batchbench.analysis.findings.slo`), with their counts and the count it needs."""
    where: list[str] = []
    needs: dict[str, int] = {}
    for d in decisions:
        thin = [] if d.latency_pool is None else [t for t in d.latency_pool.too_thin
                                                  if t.judgement == "too few requests"]
        if thin:
            counts, need = _request_counts(thin)
            where.append(f"{d.engine} at {', '.join(counts)}")
            needs.update(need)
    if not where:
        return None
    said = (f"Too few requests to bound the SLO's percentile on the side that would decide it (pooled over the "
            f"repeats; {_needs_text(needs)} at 95%), so neither held nor failed: {'; '.join(where)}.")
    short = [d.tail_short for d in decisions if d.tail_short is not None]
    if not short:
        return said
    lacking = "; ".join(f"{d.engine} {d.tail_short.lacking} at batch {d.tail_short.concurrency}"
                        for d in decisions if d.tail_short is not None)
    more = sum(t.more_s for t in short)
    limits = {t.time_limit_s for t in short}
    # The job gives half of each engine's share to its mandatory passes (main_job.MANDATORY_SHARE): twice the time.
    limit = limits.pop() if len(limits) == 1 else None
    command = (f"`batchbench run --time-limit {math.ceil((limit + 2 * more) / 10) * 10:.0f}`" if limit is not None
               else f"a --time-limit about {math.ceil(2 * more):.0f} s longer")
    return (f"{said} The requests the largest batch that could hold the SLO lacks ({lacking}) take about "
            f"{math.ceil(more):.0f} s here; {command} leaves the main job room for them.")


def slo_text(slo: Slo | None) -> str:
    """``TTFT p99 ≤ 500 ms`` for the latency question's heading."""
    if slo is None:
        return "no SLO"
    return ", ".join(f"{o.metric.upper()} {o.stat} ≤ {ms(o.limit_s)}" for o in slo.objectives)
