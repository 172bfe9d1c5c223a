"""Multi-LoRA serving: whether every adapter's requests were served alike, or some waited for a slot.

A request for an adapter beyond the engine's slots (vLLM ``max_loras``) waits until a step can take it, so with
more adapters than slots, or one adapter taking most of the traffic, some adapters' users see slower requests.
The figures are each run's per-adapter summary (:class:`batchbench.measures.metrics.LoraSummary`), medians over a
point's runs: the spread of the adapters' TTFT p50 and Jain's index of their request speeds (1: served alike).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from batchbench.analysis.findings.points import Point


def sentences(points: Sequence[Point]) -> list[str]:
    """One sentence per point whose runs named LoRA adapters; none for a point without."""
    out = []
    for p in points:
        runs = [r.summary for r in p.used if r.summary is not None and r.summary.loras]
        if not runs:
            continue
        names = sorted({name for s in runs for name in s.loras or {}})
        ttft = {name: statistics.median(t for s in runs if (a := (s.loras or {}).get(name)) is not None
                                        and a.ttft is not None and (t := a.ttft.p50) is not None)
                for name in names
                if any(a.ttft is not None for s in runs if (a := (s.loras or {}).get(name)) is not None)}
        text = f"{p.engine} {p.layout} at {p.concurrency}: {len(names)} LoRA adapters"
        if len(ttft) >= 2:
            fast, slow = min(ttft, key=ttft.__getitem__), max(ttft, key=ttft.__getitem__)
            text += (f", TTFT p50 from {ttft[fast] * 1000:.1f} ms ({fast}) to {ttft[slow] * 1000:.1f} ms ({slow}), "
                     f"x{ttft[slow] / ttft[fast]:.2f}" if ttft[fast] > 0 else "")
        fairness = [s.lora_fairness for s in runs if s.lora_fairness is not None]
        if fairness:
            text += (f"; Jain's fairness of their request speeds {statistics.median(fairness):.3f} "
                     "(1: every adapter's users served alike)")
        out.append(text + ".")
    return out
