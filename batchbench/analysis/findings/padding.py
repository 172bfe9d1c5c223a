"""Padding: a batch with one long prompt against a homogeneous one, and what the difference cost.

The main job's padding pair sends waves of the engine's batch size, all short prompts or one long
prompt among them, with the same outputs. The share of the mixed batch's prompt slots that are padding
is predicted by :func:`batchbench.analysis.theory.padding_fraction` from the lengths alone (and a padding engine
reports its own); the latency ratio (an :class:`~batchbench.analysis.repeats.Estimate` ratio of the two E2E
p50s) says whether the engine paid for the padded slots or only for the real tokens: an engine that
pads pays more than its real tokens explain, one that packs sequences does not.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import ClassVar

from batchbench.analysis.findings.points import Measurement, Point, PointFindings
from batchbench.analysis.findings.points import ratio as points_ratio
from batchbench.analysis.findings.text import ratio as ratio_text
from batchbench.analysis.repeats import Estimate
from batchbench.analysis.theory import padding_fraction


@dataclass(frozen=True)
class PaddingAt:
    """A batch with one long prompt (padded-mixed) against a homogeneous one, at one batch size."""

    padded_fraction_predicted: float
    #: E2E p50 of the mixed batch over the homogeneous one's, and TTFT p50 likewise.
    latency_ratio: Estimate | None
    ttft_ratio: Estimate | None
    #: What the mixed batch costs over the homogeneous one in real prompt tokens, and padded to its longest prompt.
    real_token_ratio: float
    padded_token_ratio: float
    #: The engine's own pad fraction (a padding engine's report), median over runs; None if it reports none.
    measured_pad_fraction: float | None
    evidence: tuple[str, ...]

    @property
    def pays_for_padding(self) -> bool | None:
        """Whether the mixed batch cost more than its real tokens explain, beyond noise (the latency ratio's low
        end above the real-token ratio): what an engine that pads shows. None without a latency interval.
        (An engine that packs sequences may still exceed it a little: attention grows with the long prompt.)"""
        if self.latency_ratio is None or self.latency_ratio.low is None:
            return None
        return self.latency_ratio.low > self.real_token_ratio

    JSON_DERIVED: ClassVar[tuple[str, ...]] = ("pays_for_padding",)


@dataclass(frozen=True)
class PaddingCost:
    at: dict[int, PaddingAt]
    #: The batch size the headline is about: the largest measured.
    concurrency: int

    @property
    def headline(self) -> PaddingAt:
        return self.at[self.concurrency]

    JSON_DERIVED: ClassVar[tuple[str, ...]] = ("headline",)


def _padded_share(run: Measurement) -> tuple[float, int, int] | None:
    """(padded share, padded slots, real tokens) of a run's prompts batched as it sent them: by wave, else in
    sends of its concurrency."""
    records = run.ordered_records()
    if not records:
        return None
    waves: dict[int, list[int]] = {}
    for i, r in enumerate(records):
        waves.setdefault(r.wave if r.wave is not None else i // run.concurrency, []).append(r.prompt_len)
    slots = sum(len(lens) * max(lens) for lens in waves.values())
    padded = sum(padding_fraction(lens) * len(lens) * max(lens) for lens in waves.values())
    return (padded / slots if slots else 0.0), slots, sum(len_ for lens in waves.values() for len_ in lens)


def padding_cost(mixed: list[PointFindings], homogeneous: list[PointFindings], mixed_points: dict[int, Point],
                 homogeneous_points: dict[int, Point]) -> PaddingCost | None:
    by_c = {p.concurrency: p for p in homogeneous if p.valid}
    at: dict[int, PaddingAt] = {}
    for p in mixed:
        h = by_c.get(p.concurrency)
        if h is None or not p.valid:
            continue
        shares = _padded_share(mixed_points[p.concurrency].used[0])
        plain = _padded_share(homogeneous_points[p.concurrency].used[0])
        if shares is None or plain is None or plain[2] == 0:
            continue

        mixed_point, plain_point = mixed_points[p.concurrency], homogeneous_points[p.concurrency]
        reported = [v for r in mixed_points[p.concurrency].used
                    if isinstance(v := r.engine_report.get("prompt_pad_fraction"), int | float)]
        at[p.concurrency] = PaddingAt(shares[0], points_ratio(mixed_point, plain_point, "e2e_p50_s"),
                                      points_ratio(mixed_point, plain_point, "ttft_p50_s"), shares[2] / plain[2],
                                      shares[1] / plain[2], statistics.median(reported) if reported else None,
                                      p.run_ids + h.run_ids)
    return PaddingCost(at, max(at)) if at else None


def decision(cost: PaddingCost | None) -> str:
    """The answer to "what does padding cost?", one line, in the engine's own terms: an engine that reports its
    padding (it pads prompts to the batch's longest) is told what the padded slots cost it; one that reports none
    (it packs sequences: continuous batchers, llama.cpp's slots) is told what the one long prompt cost it instead,
    beside what padding would have made of it."""
    if cost is None:
        return "not measured (no valid padding pair)"
    p = cost.headline
    pads = p.measured_pad_fraction is not None
    if pads:
        pad = (f"{p.padded_fraction_predicted:.0%} of its prompt slots are padding (the engine reports "
               f"{p.measured_pad_fraction:.0%})")
    else:
        pad = "it reports no padding"
    if p.latency_ratio is None:
        return f"one long prompt in a batch of {cost.concurrency}: {pad}; latency not measured"
    if pads:
        verdict = {True: "it pays for the padded slots", False: "no more than its real tokens explain",
                   None: "too few repeats to say whether it pays for them"}[p.pays_for_padding]
        return (f"one long prompt in a batch of {cost.concurrency} takes {ratio_text(p.latency_ratio)} the latency "
                f"of a homogeneous batch ({p.real_token_ratio:.1f}x the real tokens, {p.padded_token_ratio:.1f}x "
                f"padded); {pad}: {verdict}")
    verdict = {True: "more than those tokens explain, as if it padded",
               False: "what those tokens explain: it does not pay for padding",
               None: "too few repeats to say what it pays for"}[p.pays_for_padding]
    return (f"one long prompt in a batch of {cost.concurrency} takes {ratio_text(p.latency_ratio)} the latency of a "
            f"homogeneous batch for {p.real_token_ratio:.1f}x its real prompt tokens ({pad}; padded to the longest "
            f"they would be {p.padded_token_ratio:.1f}x): {verdict}")
