"""Number formatting shared by the Markdown and HTML reports.

Results store seconds, fractions and per-second rates as raw floats; people
read milliseconds and percentages. One formatter per unit keeps every table
consistent, and ``None`` (no data: the engine does not expose it, or no
request succeeded) always reads "n/a", never a misleading 0.
"""

from __future__ import annotations

import math

NA = "n/a"


def num(value: object) -> float | None:
    """``value`` as a finite float, or None for anything else (missing, text, NaN, bool)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    f = float(value)
    return f if math.isfinite(f) else None


def _adaptive(value: float) -> str:
    """Enough decimals to be readable at any magnitude, without false precision."""
    mag = abs(value)
    if mag >= 100:
        return f"{value:.0f}"
    if mag >= 10:
        return f"{value:.1f}"
    if mag >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def ms(seconds: object) -> str:
    """Seconds as milliseconds."""
    v = num(seconds)
    return NA if v is None else _adaptive(v * 1000.0)


def rate(per_second: object) -> str:
    """A throughput (tokens or requests per second)."""
    v = num(per_second)
    return NA if v is None else f"{v:.1f}" if abs(v) >= 10 else _adaptive(v)


def pct(fraction: object) -> str:
    """A fraction in [0, 1] as a percentage."""
    v = num(fraction)
    return NA if v is None else f"{v * 100:.1f}%"


def count(value: object) -> str:
    """A count (may arrive as a float from Prometheus)."""
    v = num(value)
    if v is None:
        return NA
    return f"{v:.0f}" if v == int(v) else f"{v:.1f}"


def number(value: object) -> str:
    """A plain quantity (seconds, a mean count): as many decimals as its size needs."""
    v = num(value)
    return NA if v is None else _adaptive(v)


def delta_pct(value: float | None) -> str:
    """A signed percent change."""
    return NA if value is None else f"{value:+.1f}%"
