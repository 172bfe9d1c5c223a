"""How close a measured point comes to its physical limit: "41% of the bandwidth limit at batch 32".

A measured curve alone cannot say whether an engine is near what the GPU allows or far from it; beside the bound on
paper (:mod:`batchbench.analysis.bounds`) each point gets its share of the limit at its own concurrency. A share is
measured / bound for output tokens per second (the bound is a ceiling) and bound / measured for TPOT (the bound is
a floor), so both read the same way: 100% is the hardware's limit, and more than 100% means a measurement beat a
bound it cannot beat, so the bound's inputs (GPU, TP, dtypes, lengths) or the measurement are wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from batchbench.analysis.bounds import Bound, BoundPoint

__all__ = ["BoundShare", "percent", "share_of_bound"]

#: How each binding resource is named in a sentence.
_LIMIT = {"bandwidth": "memory-bandwidth", "compute": "compute", "kv": "KV-memory"}


def percent(share: float) -> str:
    """A share as a percentage: whole percents from 1% up, two significant figures below (a tiny model on a big
    GPU comes to 0.012% of its limit, which "0%" would hide)."""
    return f"{share:.0%}" if share >= 0.01 else f"{share * 100:.2g}%"


@dataclass(frozen=True)
class BoundShare:
    """A measured point's share of the bound at its concurrency (None where that figure was not measured)."""

    concurrency: int
    bound: Bound
    output_tok_s_share: float | None
    tpot_share: float | None

    @property
    def share(self) -> float:
        """The share a sentence gives: tokens per second's where measured, else TPOT's."""
        value = self.output_tok_s_share if self.output_tok_s_share is not None else self.tpot_share
        assert value is not None
        return value

    @property
    def beats_bound(self) -> bool:
        """Whether either figure is past the limit (more than a rounding's worth): the inputs or the run are wrong."""
        return any(s is not None and s > 1 + 1e-9 for s in (self.output_tok_s_share, self.tpot_share))

    def sentence(self) -> str:
        """"41% of the memory-bandwidth limit at batch 32" (and why a share past 100% cannot be)."""
        text = f"{percent(self.share)} of the {_LIMIT[self.bound]} limit at batch {self.concurrency}"
        if self.beats_bound:
            text += " (past the limit: the GPU, TP, dtypes or lengths the bound assumes are not the run's)"
        return text


def share_of_bound(curve: Sequence[BoundPoint], concurrency: int, *, output_tok_s: float | None = None,
                   tpot_s: float | None = None) -> BoundShare:
    """The share of the bound of a point measured at ``concurrency`` with ``output_tok_s`` and/or ``tpot_s``, against
    the curve's row at that concurrency; a ValueError when neither figure is given or positive, or when the curve has
    no row at that concurrency (make the curve at the measured concurrencies: ``Limits.curve``)."""
    if output_tok_s is None and tpot_s is None:
        raise ValueError("a measured point needs its output tokens/s or its TPOT")
    for name, value in (("output_tok_s", output_tok_s), ("tpot_s", tpot_s)):
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be more than 0, not {value!r}")
    row = next((p for p in curve if p.concurrency == concurrency), None)
    if row is None:
        raise ValueError(f"the curve has no row at concurrency {concurrency} "
                         f"(it has {', '.join(str(p.concurrency) for p in curve) or 'none'})")
    tok_share = None if output_tok_s is None or row.output_tok_s == 0 else output_tok_s / row.output_tok_s
    tpot_share = None if tpot_s is None or row.tpot_s is None else row.tpot_s / tpot_s
    if tok_share is None and tpot_share is None:
        raise ValueError(f"the bound at concurrency {concurrency} has no figure to compare with: not one sequence "
                         "fits in the KV cache")
    return BoundShare(concurrency, row.bound, tok_share, tpot_share)
