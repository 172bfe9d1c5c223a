"""Energy: what the GPUs spent per unit of work along each curve, and where the most work per joule was.

Batching is as much an energy question as a speed one: a GPU draws a good part of its power whatever the batch,
so tokens per joule grow with the batch until it saturates, the same knee the throughput curve has. The
figures come from each run's summary (:class:`batchbench.measures.gpu.Energy`, over the GPU telemetry); where a
run has none, its reason is said once per engine (on a CPU host: ``no NVML: ...``).
"""

from __future__ import annotations

from collections.abc import Sequence

from batchbench.analysis.findings.points import PADDING_LAYOUTS, Point
from batchbench.analysis.repeats import Estimate


def _tokens_per_joule(v: float) -> str:
    return f"{v:.3g}"


def sentences(points: Sequence[Point]) -> list[str]:
    """Per engine and curve layout: tokens per joule at the curve's ends and at its best, joules per request and
    the cost per million output tokens there; an engine without energy figures: why, once."""
    out: list[str] = []
    for engine in sorted({p.engine for p in points}):
        curves: dict[str, list[Point]] = {}
        for p in points:
            if p.engine == engine and p.layout not in PADDING_LAYOUTS:
                curves.setdefault(p.layout, []).append(p)
        measured = False
        for layout, curve in curves.items():
            curve.sort(key=lambda p: p.concurrency)
            found = [(p, e) for p in curve if (e := p.estimate("tokens_per_joule")) is not None]
            if not found:
                continue
            measured = True
            (first, low), (last, high) = found[0], found[-1]
            best, most = max(found, key=lambda pe: pe[1].value)
            text = (f"{engine}, {layout}: {_tokens_per_joule(low.value)} output tokens per joule at batch "
                    f"{first.concurrency}")
            if len(found) > 1:
                text += f", {_tokens_per_joule(high.value)} at batch {last.concurrency}"
            text += f"; the most at batch {best.concurrency}: {most.format(_tokens_per_joule)}"
            if (jpr := best.estimate("joules_per_request")) is not None:
                text += f", {jpr.format(lambda v: f'{v:.3g}')} J per request"
            if (cost := best.estimate("usd_per_m_output_tokens")) is not None:
                text += f", {_usd(cost)} per million output tokens at {_price(best)}"
            out.append(text + ".")
        if not measured:
            why = next((r.summary.energy.unavailable for p in points if p.engine == engine for r in p.used
                        if r.summary is not None and r.summary.energy is not None), None)
            out.append(f"{engine}: no energy figures ({why or 'no GPU telemetry in these documents'}).")
    return out


def _usd(cost: Estimate) -> str:
    return cost.format(lambda v: f"${v:.3g}")


def _price(point: Point) -> str:
    prices = {r.summary.energy.gpu_hour_cost for r in point.used
              if r.summary is not None and r.summary.energy is not None}
    return " / ".join(f"${p:g} per GPU-hour" for p in sorted(p for p in prices if p is not None))
