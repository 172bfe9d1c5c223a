"""Multi-turn conversations: how TTFT follows the growing context, first turn against last."""

from __future__ import annotations

from batchbench.analysis.findings.points import PointFindings


def sentence(engine: str, layout: str, p: PointFindings) -> str | None:
    """None for a point without at least two timed turns."""
    timed = [(t, ttft) for t in p.turns if (ttft := t.ttft_p50_s) is not None]
    if len(timed) < 2:
        return None
    (first, first_s), (last, last_s) = timed[0], timed[-1]
    ratio = f" (x{last_s / first_s:.2f})" if first_s else ""
    return (f"{engine} {layout} at concurrency {p.concurrency}: over {last.turn}-turn conversations, TTFT p50 goes "
            f"from {first_s * 1000:.1f} ms at turn {first.turn} ({first.prompt_tokens:.0f} prompt tokens) "
            f"to {last_s * 1000:.1f} ms at turn {last.turn} ({last.prompt_tokens:.0f}){ratio}.")
