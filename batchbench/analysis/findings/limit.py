"""Each measured point against the physical limit on paper: "41% of the memory-bandwidth limit at batch 32".

A curve alone cannot say whether the engine is near what the GPU allows; beside the bound at the same batch size
(:mod:`batchbench.analysis.bounds`, worked out for each run by :mod:`batchbench.analysis.run_bounds`) each valid
point gets its share of the limit (:mod:`batchbench.analysis.bound_share`). A run without a GPU row (a CPU run,
a GPU the table does not list, a model whose config is not readable here) gets one sentence saying why, not a
share.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from batchbench.analysis.bound_share import BoundShare, share_of_bound
from batchbench.analysis.bounds import BoundPoint
from batchbench.analysis.findings.points import (
    FIGURES,
    Point,
    PointFindings,
    layout_and_concurrency,
    model_config,
)
from batchbench.analysis.run_bounds import RunLimit, Setup, run_limit
from batchbench.core import codec
from batchbench.measures.metrics import Summary
from batchbench.results.document import RunDocument


@dataclass(frozen=True)
class PointShare:
    """One valid point's share of its bound, with the bound's row at its concurrency."""

    share: BoundShare
    bound: BoundPoint

    def to_dict(self) -> dict[str, Any]:
        s, b = self.share, self.bound
        return {"bound": s.bound, "output_tok_s_bound": b.output_tok_s, "tpot_s_bound": b.tpot_s,
                "ttft_s_bound": b.ttft_s, "output_tok_s_share": s.output_tok_s_share, "tpot_share": s.tpot_share,
                "share": s.share, "beats_bound": s.beats_bound, "sentence": s.sentence()}


@dataclass(frozen=True)
class AgainstLimit:
    """One curve against the limit: each valid point's share by concurrency, or why there is no bound."""

    #: The bound most of the curve's runs assume (None: no run has one).
    setup: Setup | None
    points: dict[int, PointShare]
    #: Why the runs have no bound, for a curve without one (None: it has one).
    no_limit: str | None

    def sentence(self, engine: str, layout: str) -> str | None:
        """``alpha, continuous, against the limit on paper (1 x H100 SXM (...), ...): 41% of the memory-bandwidth
        limit at batch 1; ...``; None without a bound (:func:`no_row_sentence` says why, once per engine)."""
        if self.setup is None:
            return None
        shares = "; ".join(p.share.sentence() for _, p in sorted(self.points.items()))
        return (f"{engine}, {layout}, against the limit on paper ({self.setup.text()}): "
                f"{shares or 'no valid point to set beside it'} (the arithmetic: {self.setup.command()}).")

    def to_dict(self) -> dict[str, Any]:
        return {"setup": codec.encode(self.setup), "no_limit": self.no_limit}


def _point_share(point: Point, found: PointFindings) -> PointShare | None:
    """The share of a valid point against the bound most of its runs assume (None: no bound, or no figure)."""
    bounds = Counter(r.limit for r in point.used if r.limit is not None)
    if not found.valid or not bounds:
        return None
    limit: RunLimit = bounds.most_common(1)[0][0]
    tok, tpot = found.figure("output_tok_s"), found.figure("tpot_p50_s")
    tok_s = tok.value if tok is not None and tok.value > 0 else None
    tpot_s = tpot.value if tpot is not None and tpot.value > 0 else None
    if tok_s is None and tpot_s is None:
        return None
    curve = limit.limits.curve([point.concurrency])
    return PointShare(share_of_bound(curve, point.concurrency, output_tok_s=tok_s, tpot_s=tpot_s), curve[0])


def against_limit(points: Sequence[Point], found: Sequence[PointFindings]) -> AgainstLimit:
    """Each valid point's share of its bound; the reason most runs give where none has a bound."""
    by_c = {p.concurrency: p for p in found}
    shares = {p.concurrency: s for p in points if (s := _point_share(p, by_c[p.concurrency])) is not None}
    setups = Counter(r.limit.setup for p in points for r in p.runs if r.limit is not None)
    reasons = Counter(r.no_limit for p in points for r in p.runs if r.no_limit is not None)
    setup = setups.most_common(1)[0][0] if setups else None
    return AgainstLimit(setup, shares, None if setup is not None or not reasons else reasons.most_common(1)[0][0])


def no_row_sentence(engine: str, found: Sequence[AgainstLimit]) -> str | None:
    """``alpha: no limit on paper beside its curves: no GPU row: the engine ran on this host's CPU (...)``, once per
    engine for the curves without a bound; None when every curve has one."""
    reasons = list(dict.fromkeys(a.no_limit for a in found if a.setup is None and a.no_limit))
    return f"{engine}: no limit on paper beside its curves: {'; '.join(reasons)}." if reasons else None


@dataclass(frozen=True)
class RunShare:
    """One run's share of its own bound on paper: what ``compare`` sets side by side for runs on two GPUs, each
    against the limit of the GPU it ran on."""

    share: float
    #: What binds there (``bandwidth``, ``compute``, ...).
    bound: str
    #: The bound's setup (GPU, model, TP, dtypes), as the report names it.
    setup: str


def run_share(doc: RunDocument, summary: Summary | None) -> RunShare | None:
    """The run's output tokens/s and TPOT p50 (a closed loop's steady state, as the curve takes them) against the
    bound's row at its concurrency (:func:`batchbench.analysis.run_bounds.run_limit`, the GPU its NVML named or it
    declared); None without a bound (a CPU run, a GPU the table does not list) or a figure."""
    found = layout_and_concurrency(doc)
    if summary is None or found is None:
        return None
    limit, _ = run_limit(doc, model_config(doc))
    tok, tpot = FIGURES["output_tok_s"](summary), FIGURES["tpot_p50_s"](summary)
    tok_s = tok if tok is not None and tok > 0 else None
    tpot_s = tpot if tpot is not None and tpot > 0 else None
    if limit is None or (tok_s is None and tpot_s is None):
        return None
    c = found[1]
    try:
        s = share_of_bound(limit.limits.curve([c]), c, output_tok_s=tok_s, tpot_s=tpot_s)
    except ValueError:  # not one sequence fits in the KV cache at this batch: no row to compare with
        return None
    return RunShare(s.share, s.bound, limit.setup.text())
