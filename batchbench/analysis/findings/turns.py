"""Multi-turn conversations: how TTFT follows the growing context, first turn against last."""

from __future__ import annotations

from batchbench.analysis.findings.points import PointFindings


def sentence(engine: str, layout: str, p: PointFindings) -> str | None:
    """None for a point without at least two timed turns."""
    timed = [t for t in p.turns if t.ttft_p50_s is not None]
    if len(timed) < 2:
        return None
    first, last = timed[0], timed[-1]
    ratio = f" (x{last.ttft_p50_s / first.ttft_p50_s:.2f})" if first.ttft_p50_s else ""  # type: ignore[operator]
    return (f"{engine} {layout} at concurrency {p.concurrency}: over {last.turn}-turn conversations, TTFT p50 goes "
            f"from {first.ttft_p50_s * 1000:.1f} ms at turn {first.turn} ({first.prompt_tokens:.0f} prompt tokens) "
            f"to {last.ttft_p50_s * 1000:.1f} ms at turn {last.turn} ({last.prompt_tokens:.0f}){ratio}.")
