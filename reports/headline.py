"""The answer's headline figure for one engine: what each batch size buys in throughput and costs in TTFT p99.

Small (about 5 x 3.5 inches) so it sits beside the engine's table on the first screen. Throughput is on x and
TTFT p99 on y, so the knee, where latency climbs without more throughput, is where the line turns up; each point
is labelled with its batch size and carries its interval as error bars, so a reader sees which steps are within
noise. The sweet spot is ringed and named, the SLO is a labelled horizontal line, and a point the findings did not
trust (``valid`` false) is drawn hollow and grey, off the line, so it is seen but not read as part of the curve.
On a GPU the accelerators table lists, the limit on paper is drawn beside the curve, dashed: at each measured batch
size the output tokens/s ceiling at the TTFT floor (:mod:`batchbench.analysis.bounds`), so the gap between a point
and the cross of its batch size is how far the engine is from what the hardware allows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import ScalarFormatter

from batchbench.reports.svg import to_svg

#: Centre, low and high of a figure (a median and its interval).
Interval = tuple[float, float, float]

_INVALID = "#999999"
_SLO = "tab:red"
_BOUND = "#444444"


@dataclass(frozen=True)
class HeadlinePoint:
    """One batch size of an engine's sweep: output tokens/s and TTFT p99 (seconds), each (centre, low, high)."""

    concurrency: int
    output_tok_s: Interval
    ttft_p99_s: Interval
    valid: bool = True


@dataclass(frozen=True)
class BoundMark:
    """The limit on paper at one batch size: the output tokens/s ceiling and the TTFT floor (seconds)."""

    concurrency: int
    output_tok_s: float
    ttft_s: float


def _finite(value: float) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _bars(interval: Interval, scale: float = 1.0) -> tuple[float, float, float]:
    """(centre, below, above) for an error bar: a missing or inverted bound is no bar on that side."""
    centre, low, high = interval
    below = centre - low if _finite(low) and low <= centre else 0.0
    above = high - centre if _finite(high) and high >= centre else 0.0
    return centre * scale, below * scale, above * scale


def _draw(ax: Axes, points: list[HeadlinePoint], color: str, label: str, *, valid: bool) -> None:
    points = sorted(points, key=lambda p: p.concurrency)
    xs, ys = [_bars(p.output_tok_s) for p in points], [_bars(p.ttft_p99_s, 1000) for p in points]
    ax.errorbar([x for x, _, _ in xs], [y for y, _, _ in ys], xerr=[[b for _, b, _ in xs], [a for _, _, a in xs]],
                yerr=[[b for _, b, _ in ys], [a for _, _, a in ys]], fmt="-o" if valid else "o", color=color,
                markerfacecolor=color if valid else "white", markersize=5, capsize=2, linewidth=1.5, label=label)
    for p, (x, _, _), (y, _, _) in zip(points, xs, ys):
        ax.annotate(f"c={p.concurrency}", (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7, color=color)


def _draw_bound(ax: Axes, bound: Sequence[BoundMark], label: str) -> list[float]:
    """The limit's crosses joined by a dashed line, the largest batch size named; the x values drawn."""
    marks = sorted((b for b in bound if _finite(b.output_tok_s) and b.output_tok_s > 0 and _finite(b.ttft_s)),
                   key=lambda b: b.concurrency)
    if not marks:
        return []
    xs, ys = [b.output_tok_s for b in marks], [b.ttft_s * 1000 for b in marks]
    ax.plot(xs, ys, "--x", color=_BOUND, linewidth=1, markersize=5, label=label)
    ax.annotate(f"c={marks[-1].concurrency}", (xs[-1], ys[-1]), textcoords="offset points", xytext=(-5, 6),
                ha="right", fontsize=7, color=_BOUND)
    return xs


def headline_svg(engine: str, points: Sequence[HeadlinePoint], *, sweet_spot: int | None,
                 slo_ttft_p99_s: float | None, color: str, bound: Sequence[BoundMark] = (),
                 bound_label: str = "limit on paper") -> str | None:
    """The headline figure as SVG (for a :class:`~batchbench.reports.blocks.Plot`); None when no point has both
    a finite throughput and a finite TTFT p99, so there is nothing to draw.

    ``sweet_spot`` is the batch size to ring (nothing is ringed when it is None or names no valid point drawn);
    ``slo_ttft_p99_s`` the TTFT p99 objective in seconds (no line when None or not a positive number); ``color``
    the engine's colour in the report's other figures; ``bound`` the limit on paper at the measured batch sizes
    (none drawn when empty), named ``bound_label`` in the legend.
    """
    drawn = [p for p in points if _finite(p.output_tok_s[0]) and _finite(p.ttft_p99_s[0])]
    if not drawn:
        return None
    fig = Figure(figsize=(5, 3.5), layout="constrained")
    ax = fig.add_subplot()
    valid = [p for p in drawn if p.valid]
    invalid = [p for p in drawn if not p.valid]
    if valid:
        _draw(ax, valid, color, engine, valid=True)
    if invalid:
        _draw(ax, invalid, _INVALID, "invalid (not used)", valid=False)
    xs = [p.output_tok_s[0] for p in drawn]
    bound_xs = _draw_bound(ax, bound, bound_label)
    ring = next((p for p in valid if sweet_spot is not None and p.concurrency == sweet_spot), None)
    if ring is not None:
        x, y = ring.output_tok_s[0], ring.ttft_p99_s[0] * 1000
        ax.plot([x], [y], "o", markersize=16, markerfacecolor="none", markeredgecolor=color, markeredgewidth=1.5)
        # beside the ring, on the side with room: the best throughput is often the rightmost point
        right = x > 0.6 * max(xs + bound_xs)
        ax.annotate(f"sweet spot c={ring.concurrency}", (x, y), textcoords="offset points",
                    xytext=(-10 if right else 10, -16), ha="right" if right else "left", fontsize=8,
                    fontweight="bold", color=color)
    ys = [p.ttft_p99_s[0] * 1000 for p in drawn] + [b.ttft_s * 1000 for b in bound if b.output_tok_s in bound_xs]
    if slo_ttft_p99_s is not None and _finite(slo_ttft_p99_s) and slo_ttft_p99_s > 0:
        slo_ms = slo_ttft_p99_s * 1000
        ax.axhline(slo_ms, color=_SLO, linestyle="--", linewidth=1)
        # at the left, where the small batches are, usually well under the line
        ax.text(0.01, slo_ms, f"TTFT p99 SLO {slo_ms:g} ms", transform=ax.get_yaxis_transform(), ha="left",
                va="bottom", fontsize=7, color=_SLO)
        ys.append(slo_ms)
    if min(ys) > 0 and max(ys) / min(ys) > 20:
        ax.set_yscale("log")  # past the knee latency grows by orders of magnitude
        ax.yaxis.set_major_formatter(ScalarFormatter())  # 100 and 1000 ms, not 10^2 and 10^3
    if bound_xs and max(xs) > 0 and max(bound_xs) / max(xs) > 20:
        ax.set_xscale("log")  # a limit far past the measured curve would squash it against the axis
    else:
        ax.set_xlim(left=0)
    ax.set_xlabel("output tokens/s", fontsize=9)
    ax.set_ylabel("TTFT p99 (ms)", fontsize=9)
    ax.set_title(f"{engine}: throughput against TTFT p99 by batch size" if engine else
                 "Throughput against TTFT p99 by batch size", fontsize=10)
    ax.tick_params(labelsize=8)
    ax.grid(True, alpha=0.3)
    if invalid or bound_xs:
        ax.legend(fontsize=7, loc="best" if bound_xs else "upper left")  # the bound's line runs along the bottom
    return to_svg(fig)
