"""The answer as decisions: the questions batchbench exists for, one line each, per engine.

For each engine, from its continuous curve (the layout a server runs): the batch size for the most
throughput (a throughput pool), the largest batch that keeps the SLO's TTFT objectives (a latency
pool's ``max_num_seqs``), continuous against static batching, what padding costs, and where it becomes
memory-bound against the plan. Each line states its figure with the interval and what it rests on; a
line the data cannot answer says why instead of guessing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchbench.analysis.findings import batching, memory, padding
from batchbench.analysis.findings.batching import ContinuousOverStatic
from batchbench.analysis.findings.curve import MostThroughput, SweetSpot
from batchbench.analysis.findings.memory import MemoryBound
from batchbench.analysis.findings.padding import PaddingCost
from batchbench.analysis.findings.slo import LatencyPool
from batchbench.analysis.findings.text import estimate, ms
from batchbench.analysis.findings.text import ratio as ratio_text
from batchbench.analysis.regimes import PEAK_SHARE
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

    def answers(self, slo: Slo | None) -> dict[str, str]:
        """Each question's one-line answer, by :data:`QUESTIONS` key."""
        return {"throughput": self._throughput(), "latency": self._latency(slo),
                "batching": batching.decision(self.continuous_over_static, self.batching_missing),
                "padding": padding.decision(self.padding_cost),
                "memory": memory.decision(self.memory_bound, self.has_kv_data)}

    def _throughput(self) -> str:
        """The sweet spot (:data:`~batchbench.analysis.regimes.PEAK_SHARE` of the peak), with the peak beside it."""
        t, sweet = self.throughput, self.sweet_spot
        if t is None or sweet is None:
            return "no valid point"
        tok = f": {estimate(sweet.output_tok_s)}" if sweet.output_tok_s is not None else ""
        if sweet.end_of_sweep:
            return (f"batch {sweet.concurrency}{tok}, still scaling at the largest batch measured: no sweet spot "
                    "within the sweep")
        text = f"batch {sweet.concurrency}{tok}"
        if sweet.peak_concurrency is None:
            return text + ", the most measured; more requests add latency, not throughput"
        share = f", {ratio_text(sweet.share_of_peak)} of it" if sweet.share_of_peak is not None else ""
        return (f"{text}, within {1 - PEAK_SHARE:.0%} of the most measured (batch {sweet.peak_concurrency}: "
                f"{estimate(t.output_tok_s)}{share}); more requests add latency, not throughput")

    def _latency(self, slo: Slo | None) -> str:
        pool = self.latency_pool
        if slo is None or pool is None:
            return "no SLO given" if slo is None else "no valid point"
        if pool.concurrency is None:
            assert pool.stopped_at is not None
            return (f"none: batch {pool.stopped_at.concurrency} already misses it "
                    f"({'; '.join(pool.stopped_at.failed())})")
        assert pool.at is not None
        held = "; ".join(o.text() for o in pool.at.objectives)
        text = f"batch {pool.concurrency} ({held})"
        if pool.stopped_at is not None:
            text += f"; batch {pool.stopped_at.concurrency}: {'; '.join(pool.stopped_at.failed())}"
        else:
            text += ", the largest measured"
        return text

    def to_dict(self, slo: Slo | None) -> dict[str, Any]:
        return {"engine": self.engine, "layout": self.layout, "answers": self.answers(slo),
                **codec.encode({"throughput": self.throughput, "sweet_spot": self.sweet_spot,
                                "latency_pool": self.latency_pool,
                                "continuous_over_static": self.continuous_over_static,
                                "padding_cost": self.padding_cost, "memory_bound": self.memory_bound,
                                "imprecise": self.imprecise, "precision_target": self.precision_target})}


def precision_sentence(decisions: list[EngineDecisions]) -> str | None:
    """Which points did not reach the precision target within the time budget (their intervals are shown)."""
    short = [f"{d.engine} at {', '.join(map(str, d.imprecise))}" for d in decisions if d.imprecise]
    targets = {d.precision_target for d in decisions if d.precision_target is not None}
    if not short or not targets:
        return None
    return (f"Not within ±{min(targets):.0%} in the time budget (wider intervals, shown as measured): "
            f"{'; '.join(short)}.")


def slo_text(slo: Slo | None) -> str:
    """``TTFT p99 ≤ 500 ms`` for the latency question's heading."""
    if slo is None:
        return "no SLO"
    return ", ".join(f"{o.metric.upper()} {o.stat} ≤ {ms(o.limit_s)}" for o in slo.objectives)
