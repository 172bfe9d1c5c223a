"""How figures read in the findings' sentences: one formatter per kind of number, so every topic says a figure
the same way."""

from __future__ import annotations

import math

from batchbench.analysis.quantiles import Quantile
from batchbench.analysis.repeats import MIN_DECIDING_REPEATS, Estimate, t_quantile


def tok(v: float) -> str:
    """Tokens (or requests) per second: ``1234``, ``56.7``, ``8.90``."""
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def _ms_number(seconds: float) -> str:
    v = seconds * 1000
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}" if v >= 1 else f"{v:.2f}"


def ms(seconds: float) -> str:
    """A latency in milliseconds: ``84 ms``, ``5.2 ms``."""
    return f"{_ms_number(seconds)} ms"


def ms_estimate(e: Estimate) -> str:
    """A latency with its interval: ``84 [70–98] ms``."""
    return f"{e.format(_ms_number)} ms"


def ms_quantile(q: Quantile) -> str:
    """A pooled percentile with its own interval, ``?`` for an end too few requests bound: ``84.0 [70.1–?] ms``."""
    low = "?" if q.low is None else _ms_number(q.low)
    high = "?" if q.high is None else _ms_number(q.high)
    return f"{_ms_number(q.value)} [{low}–{high}] ms"


def times(v: float) -> str:
    """A ratio: ``x1.39``; ``x∞`` for an unbounded one."""
    return f"x{v:.2f}" if math.isfinite(v) else "x∞"


def ratio(r: Estimate) -> str:
    """A ratio with its interval: ``x1.39 [1.21–1.60]`` (``x1.39, n=1`` without one)."""
    if r.low is None or r.high is None:
        return f"{times(r.value)} (n={r.n}, no interval)"
    return f"{times(r.value)} [{times(r.low)[1:]}–{times(r.high)[1:]}]"


def undecided(r: Estimate, precision: float) -> str:
    """A ratio too wide to decide at the precision asked (:meth:`Estimate.undecided_at`), with its cause where
    known: ``undecided: x0.91 [0.46–1.81] holds 1 but leaves open differences up to 81%, more than the ±5% asked
    (n=2: ...); more repeats would decide it``."""
    if r.n < MIN_DECIDING_REPEATS:
        cause = (f"n={r.n}: with {r.n - 1} degree{'s' if r.n != 2 else ''} of freedom Student's t puts "
                 f"{t_quantile(r.n - 1):.1f} standard errors on each side")
    else:
        cause = f"the runs' own spread over n={r.n}"
    return (f"undecided: {ratio(r)} holds 1 but leaves open differences up to {r.largest_undetected or 0.0:.0%}, "
            f"more than the ±{precision:.0%} asked ({cause}); more repeats would decide it")


def estimate(e: Estimate, unit: str = "tok/s") -> str:
    """A figure with its interval and unit: ``1,050 [1,000–1,100] tok/s``."""
    return e.format(tok) + f" {unit}"


def share(v: float) -> str:
    """A share as a percentage: ``12%``."""
    return f"{v:.0%}"
