"""The answer across engines: which engine, at which batch size, gives the most goodput within the SLO.

Read from each engine's continuous-load curve (the layout a server runs): the point of most goodput among those
that meet the SLO (:class:`~batchbench.analysis.findings.slo.MaxGoodput`); without an SLO, the point of most
output tokens/s. The pick is the engine whose figure is highest; the runner-up follows with the ratio of the two
(:class:`~batchbench.analysis.findings.comparisons.Comparison`: the engines ran one after another, so the interval
is Welch's, not paired). Where that interval holds 1 the two are within noise, and the answer says so and what would
separate them. One table gives every engine's best throughput and best goodput beside the pick's, and the scope
clause (a toy model, a CPU) is said once for all of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from batchbench.analysis.findings.comparisons import Comparison, Metric
from batchbench.analysis.findings.slo import UNDECIDED
from batchbench.analysis.findings.text import ratio as ratio_text
from batchbench.analysis.findings.text import tok
from batchbench.analysis.findings.text import undecided as undecided_text
from batchbench.analysis.repeats import DEFAULT_PRECISION, Estimate

if TYPE_CHECKING:  # the layouts' findings are assembled from every topic, this one included
    from batchbench.analysis.findings import LayoutFindings

#: The curve the pick is read from: the load a server runs.
LAYOUT = "continuous"
Verdict = Literal["ahead", "within noise", "undecided", "no interval", "alone"]


@dataclass(frozen=True)
class Standing:
    """One engine's row of the cross-engine table: its best figures on the continuous curve, and its goodput (or,
    without an SLO, its throughput) against the pick's."""

    engine: str
    #: The most output tokens/s and the batch size it was measured at (None: no valid point).
    throughput: Estimate | None
    throughput_at: int | None
    #: The most goodput (requests/s) among the points that meet the SLO, and where (None: no point meets it).
    goodput: Estimate | None
    goodput_at: int | None
    #: Its figure over the pick's (None for the pick itself, or where no ratio can be formed).
    to_pick: Estimate | None


@dataclass(frozen=True)
class Pick:
    """The engine and batch size to run for the SLO, the runner-up against it, and every engine's standing."""

    #: What was ranked: goodput within the SLO, or (no SLO given) output tokens/s.
    metric: Metric
    engine: str | None
    batch_size: int | None
    #: The pick's figure: goodput in requests/s (output tokens/s without an SLO).
    figure: Estimate | None
    runner_up: str | None
    runner_up_batch_size: int | None
    #: The pick's figure over the runner-up's, with its interval.
    ratio: Estimate | None
    verdict: Verdict
    standings: tuple[Standing, ...]
    #: Why a ranking from these runs does not carry over (a toy model, a CPU): said once, for every figure.
    scope: str | None
    #: Why there is no pick (no engine meets the SLO at any batch size measured, or none is shown to); None when
    #: there is one.
    none_because: str | None = None
    #: The precision the runner-up's ratio is judged at (that of the comparison it comes from).
    precision: float = DEFAULT_PRECISION

    @property
    def noun(self) -> str:
        return "goodput" if self.metric == "max goodput under the SLO" else "output tokens/s"

    @property
    def unit(self) -> str:
        return "req/s of goodput" if self.metric == "max goodput under the SLO" else "output tokens/s"

    def sentences(self) -> list[str]:
        """The answer's first lines: the pick, the runner-up against it (or within noise, and what would separate
        them), and the scope once."""
        if self.engine is None or self.figure is None:
            return [f"No pick: {self.none_because}."]
        what = "the most goodput within the SLO" if self.metric == "max goodput under the SLO" \
            else "the most output tokens/s (no SLO given)"
        out = [f"Pick: {self.engine} at batch {self.batch_size}, {what}: {self.figure.format(tok)} {self.unit}."]
        if self.runner_up is not None and self.ratio is not None:
            shown = ratio_text(self.ratio)
            if self.verdict == "ahead":
                out.append(f"Runner-up: {self.runner_up} at batch {self.runner_up_batch_size}; {self.engine} gives "
                           f"{shown} the {self.noun} of {self.runner_up} (the interval excludes 1).")
            elif self.verdict == "undecided":
                out.append(f"Runner-up: {self.runner_up} at batch {self.runner_up_batch_size}; the pick against it is "
                           f"{undecided_text(self.ratio, self.precision)} (--repeats, or a longer --time-limit).")
            elif self.verdict == "within noise":
                out.append(f"Runner-up: {self.runner_up} at batch {self.runner_up_batch_size}, within noise of the "
                           f"pick ({shown}: no difference beyond the ±{self.precision:.0%} asked). Either will do; "
                           "only a finer precision (--precision, more --repeats) could separate them.")
            else:
                out.append(f"Runner-up: {self.runner_up} at batch {self.runner_up_batch_size} ({shown}): too few "
                           "runs for an interval; run again with --repeats 3 to compare them.")
        if self.scope:
            out.append(f"Every engine ranking here was measured {self.scope}.")
        return out

    def to_json(self) -> dict[str, object]:
        """What report.json keeps under ``findings.pick``."""
        def interval(e: Estimate | None) -> dict[str, object] | None:
            return None if e is None else {"value": e.value, "low": e.low, "high": e.high, "n": e.n}

        return {"metric": self.metric, "engine": self.engine, "batch_size": self.batch_size,
                "figure": interval(self.figure), "unit": self.unit, "runner_up": self.runner_up,
                "runner_up_batch_size": self.runner_up_batch_size, "ratio": interval(self.ratio),
                "verdict": self.verdict, "scope": self.scope, "none_because": self.none_because,
                "standings": [{"engine": s.engine, "throughput": interval(s.throughput),
                               "throughput_at": s.throughput_at, "goodput": interval(s.goodput),
                               "goodput_at": s.goodput_at, "to_pick": interval(s.to_pick)} for s in self.standings]}


def _comparison(compared: Sequence[Comparison], metric: Metric, a: str, b: str) -> Comparison | None:
    return next((c for c in compared if c.metric == metric and c.layout == LAYOUT and {c.a, c.b} == {a, b}), None)


def _ratio_of(compared: Sequence[Comparison], metric: Metric, a: str, b: str) -> Estimate | None:
    """``a / b`` of one metric on the continuous curve, from the pair's comparison (which is named in order)."""
    c = _comparison(compared, metric, a, b)
    return None if c is None else c.ratio if c.a == a else c.ratio.inverse()


def pick(curves: Mapping[str, LayoutFindings], compared: Sequence[Comparison], *, has_slo: bool,
         scope: str | None) -> Pick | None:
    """The pick across the engines' continuous curves (``curves``: engine -> its continuous findings); None with
    fewer than one engine curve."""
    if not curves:
        return None
    metric: Metric = "max goodput under the SLO" if has_slo else "most throughput"

    def figure(f: LayoutFindings) -> tuple[Estimate | None, int | None]:
        if has_slo:
            g = f.max_goodput
            return (g.goodput_req_s, g.concurrency) if g is not None else (None, None)
        t = f.most_throughput
        return (t.output_tok_s, t.concurrency) if t is not None else (None, None)

    ranked = sorted(((name, *figure(f)) for name, f in curves.items()),
                    key=lambda r: -(r[1].value if r[1] is not None else -1.0))
    best, best_figure, best_at = ranked[0]
    if best_figure is None:
        undecided = any(at.valid and at.judgement in UNDECIDED for f in curves.values() for at in f.slo_points.values())
        why = ("no engine has a valid point on its continuous curve" if not has_slo
               else "no engine is shown to meet the SLO at any batch size measured: those that could had too few "
                    "requests or repeats to decide; see each engine's largest batch within it" if undecided
               else "no engine meets the SLO at any batch size measured: see each engine's largest batch within it")
        return Pick(metric, None, None, None, None, None, None, "alone", _standings(curves, compared, metric, None),
                    scope, why)
    second = next(((name, at) for name, value, at in ranked[1:] if value is not None), None)
    ratio = _ratio_of(compared, metric, best, second[0]) if second is not None else None
    found = _comparison(compared, metric, best, second[0]) if second is not None else None
    precision = found.precision if found is not None else DEFAULT_PRECISION
    verdict: Verdict = "alone" if second is None else "no interval" if ratio is None or ratio.differs_from_one is None \
        else "ahead" if ratio.differs_from_one else "undecided" if ratio.undecided_at(precision) else "within noise"
    return Pick(metric, best, best_at, best_figure, second[0] if second else None, second[1] if second else None,
                ratio, verdict, _standings(curves, compared, metric, best), scope, None, precision)


def _standings(curves: Mapping[str, LayoutFindings], compared: Sequence[Comparison], metric: Metric,
               best: str | None) -> tuple[Standing, ...]:
    rows = []
    for name, f in sorted(curves.items()):
        t, g = f.most_throughput, f.max_goodput
        to_pick = _ratio_of(compared, metric, name, best) if best is not None and name != best else None
        rows.append(Standing(name, t.output_tok_s if t else None, t.concurrency if t else None,
                             g.goodput_req_s if g else None, g.concurrency if g else None, to_pick))
    return tuple(rows)
