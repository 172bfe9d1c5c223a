"""Speculative decoding: one engine and layout with speculation against the same configuration without.

Per batch size both ran, TPOT p50's ratio (without over with: above 1 speculation pays) with its
interval, and the engine's own acceptance counters (:mod:`batchbench.measures.speculation`); the crossover is
the first valid batch size at which the ratio's value is at most 1.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from batchbench.analysis.findings.points import PADDING_LAYOUTS, Point
from batchbench.analysis.findings.text import times
from batchbench.analysis.repeats import Estimate
from batchbench.core.config import BatchingConfig
from batchbench.measures.speculation import crossover


@dataclass(frozen=True)
class SpeculationAt:
    """One batch size measured with and without speculation."""

    concurrency: int
    tpot_p50_without_s: Estimate | None
    tpot_p50_with_s: Estimate | None
    #: TPOT without over TPOT with (> 1: speculation pays).
    speedup: Estimate | None
    #: Accepted over drafted tokens, and tokens per drafted step, by the engine's counters (median of the runs).
    acceptance_rate: float | None
    tokens_per_step: float | None
    #: Both points valid (:mod:`batchbench.analysis.validity`); an invalid pair is shown but not used for the crossover.
    valid: bool = True


@dataclass(frozen=True)
class Speculation:
    """One engine and layout with speculation against without (the same configuration otherwise)."""

    engine: str
    layout: str
    #: The two curves' engine keys, as the layouts' findings name them.
    with_key: str = field(metadata={"json": "with"})
    without_key: str = field(metadata={"json": "without"})
    method: str
    draft_tokens: int
    at: tuple[SpeculationAt, ...] = field(metadata={"json": "points"})
    #: The first valid batch size at which the speedup is <= 1; None: speculation paid at every valid one.
    crossover: int | None

    @property
    def largest_measured(self) -> int | None:
        return max((a.concurrency for a in self.at if a.valid), default=None)

    JSON_DERIVED: ClassVar[tuple[str, ...]] = ("largest_measured",)


def _without_speculation(batching: BatchingConfig) -> BatchingConfig:
    return dataclasses.replace(batching, speculative_method=None, speculative_tokens=None)


def speculation(points: Sequence[Point]) -> list[Speculation]:
    """Pair each curve run with speculation with the curve of the same engine, layout and otherwise equal
    batching configuration run without; per batch size both measured, TPOT p50's ratio and the counters."""
    curves: dict[tuple[str, str], list[Point]] = {}
    for p in points:
        if p.used and p.layout not in PADDING_LAYOUTS:
            curves.setdefault((p.engine, p.layout), []).append(p)
    found: list[Speculation] = []
    for (key, layout), with_points in curves.items():
        batching = with_points[0].used[0].batching
        if batching is None or batching.speculative_method is None:
            continue
        config = _without_speculation(batching)
        name = key.split(" [", 1)[0]
        partner = next(((k, ps) for (k, lay), ps in curves.items() if lay == layout and k != key
                        and k.split(" [", 1)[0] == name and (other := ps[0].used[0].batching) is not None
                        and other.speculative_method is None and _without_speculation(other) == config), None)
        if partner is None:
            continue
        without = {p.concurrency: p for p in partner[1]}
        at: list[SpeculationAt] = []
        for p in sorted(with_points, key=lambda q: q.concurrency):
            if p.concurrency not in without:
                continue
            on, off = p.estimate("tpot_p50_s"), without[p.concurrency].estimate("tpot_p50_s")
            counters = [r.speculation for r in p.used if r.speculation is not None]
            rates = [c.acceptance_rate for c in counters if c.acceptance_rate is not None]
            steps = [c.tokens_per_step for c in counters if c.tokens_per_step is not None]
            at.append(SpeculationAt(p.concurrency, off, on, off.ratio(on) if off is not None and on is not None
                                    else None, statistics.median(rates) if rates else None,
                                    statistics.median(steps) if steps else None,
                                    p.valid and without[p.concurrency].valid))
        if not at:
            continue
        speedups = {a.concurrency: a.speedup.value for a in at if a.speedup is not None and a.valid}
        draft = batching.draft_tokens or 0
        found.append(Speculation(name, layout, key, partner[0], batching.speculative_method, draft,
                                 tuple(at), crossover(speedups)))
    return found


def sentence(sp: Speculation) -> str:
    first = sp.at[0]
    counters = ""
    if first.acceptance_rate is not None and first.tokens_per_step is not None:
        counters = (f", {first.acceptance_rate:.0%} of drafts accepted and {first.tokens_per_step:.2f} tokens per "
                    f"drafted step at batch {first.concurrency}")
    valid = [a for a in sp.at if a.valid]
    gains = ", ".join(f"{times(a.speedup.value)} at {a.concurrency}" for a in valid if a.speedup is not None)
    text = (f"{sp.engine}, {sp.layout}: {sp.method} speculation ({sp.draft_tokens} draft tokens{counters}) "
            f"changes TPOT p50 by {gains or 'n/a'} (without over with)")
    left_out = [str(a.concurrency) for a in sp.at if not a.valid]
    if left_out:
        text += f" (batch {', '.join(left_out)} left out: an invalid point)"
    if sp.crossover is not None:
        return text + f"; it stops paying from batch {sp.crossover}."
    if not valid:
        return text + "; no valid batch size says where it stops paying."
    return text + f"; it still pays at batch {sp.largest_measured}, the largest measured."
