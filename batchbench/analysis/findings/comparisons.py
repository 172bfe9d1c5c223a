"""Engines against each other: each pair's figures as a ratio with its interval.

Per layout both engines ran, the throughput each gives at its own best (:class:`MostThroughput`), and
with an SLO the most goodput each gives under it. One engine is ahead only when the ratio's interval
excludes 1; otherwise the sentence gives the largest difference the data leaves open. Where the runs make a
ranking unsafe to carry over (a toy model, engines on a CPU, where per-step framework overhead decides it), the
sentence says so in a clause (:func:`scope`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

from batchbench.analysis.findings.points import Measurement, ModelScale, layout_rank
from batchbench.analysis.findings.text import ratio as ratio_text
from batchbench.analysis.findings.text import undecided as undecided_text
from batchbench.analysis.repeats import DEFAULT_PRECISION, Estimate

if TYPE_CHECKING:  # the layouts' findings are assembled from every topic, this one included
    from batchbench.analysis.findings import LayoutFindings

Metric = Literal["most throughput", "max goodput under the SLO"]

#: Each layout in words, as a ratio's sentence names it.
LAYOUT_WORDS = {"continuous": "Under continuous load", "static-waves": "In static waves",
                "padded-mixed": "In padded batches with one long prompt", "homogeneous": "In batches of equal prompts"}
#: Below this many parameters a model is a toy: its steps are too small for the engines' kernels to decide a
#: ranking (the embedded default has 2.5 M).
TOY_PARAMETERS = 1_000_000_000


@dataclass(frozen=True)
class Scope:
    """What a pair's runs were measured on, as far as the documents say."""

    #: The smallest model either engine served (parameters, layers); None: not known.
    model: ModelScale | None
    #: Either engine ran on this host's CPU.
    on_cpu: bool


def scope(runs: Iterable[Measurement]) -> Scope:
    """The scope of some runs: the smallest model among them and whether any ran on a CPU."""
    runs = list(runs)
    models = [r.model for r in runs if r.model is not None]
    return Scope(min(models, default=None), any(r.on_cpu for r in runs))


def caveat(found: Scope) -> str | None:
    """Why a ranking from runs of this scope does not carry over, in a clause; None when nothing says it does not."""
    toy = found.model is not None and found.model.parameters < TOY_PARAMETERS
    if not toy and not found.on_cpu:
        return None
    where = []
    if found.on_cpu:
        where.append("on a CPU")
    if toy:
        assert found.model is not None
        where.append(f"with a {found.model.layers}-layer, {found.model.parameters / 1e6:.1f} M-parameter toy model")
    return f"{' '.join(where)}: framework overhead decides this, it does not carry over to a GPU or a real model"


@dataclass(frozen=True)
class Comparison:
    """One figure of two engines, as ``a / b``, and the batch size each gave it at."""

    metric: Metric
    layout: str
    a: str
    b: str
    ratio: Estimate
    at_a: int
    at_b: int
    #: Why the ranking does not carry over (None: nothing known says so).
    caveat: str | None = None
    #: The precision the points were measured to (a share): a ratio that holds 1 but is wider is undecided.
    precision: float = DEFAULT_PRECISION

    @property
    def verdict(self) -> str:
        """``vllm ahead``, ``hf-static ahead``, ``within noise`` or ``undecided`` (wider than the precision)."""
        if self.ratio.differs_from_one:
            return f"{self.a if self.ratio.value > 1 else self.b} ahead"
        return "undecided" if self.ratio.undecided_at(self.precision) else "within noise"

    def sentence(self, *, caveat: bool = True) -> str:
        """``Under continuous load, hf-static gives x2.33 [1.95–2.78] the output tokens/s of vllm, each at its best
        batch size (8 against 16).``, or the largest difference the data leaves open; the caveat after it (unless
        said once elsewhere)."""
        what, where = (("output tokens/s", "each at its best batch size") if self.metric == "most throughput"
                       else ("goodput", "each at its most goodput under the SLO"))
        layout = LAYOUT_WORDS.get(self.layout, f"In {self.layout}")
        if self.ratio.differs_from_one:
            flip = self.ratio.value < 1
            winner, loser = (self.b, self.a) if flip else (self.a, self.b)
            at = (self.at_b, self.at_a) if flip else (self.at_a, self.at_b)
            shown = self.ratio.inverse() if flip else self.ratio
            text = (f"{layout}, {winner} gives {ratio_text(shown)} the {what} of {loser}, {where} "
                    f"({at[0]} against {at[1]})")
        elif self.ratio.undecided_at(self.precision):
            text = f"{layout}, {self.a} against {self.b}, {where} ({self.at_a} and {self.at_b}): " \
                f"{undecided_text(self.ratio, self.precision)}"
        elif self.ratio.largest_undetected is not None:
            text = (f"{layout}, {self.a} and {self.b} give the same {what} within noise, {where} "
                    f"({self.at_a} and {self.at_b}): no difference larger than {self.ratio.largest_undetected:.0%} "
                    f"detected ({ratio_text(self.ratio)})")
        else:
            text = f"{layout}, {self.a} gives {ratio_text(self.ratio)} the {what} of {self.b}, {where} (n=1)"
        return f"{text}; {self.caveat}." if self.caveat and caveat else f"{text}."

    JSON_DERIVED: ClassVar[tuple[str, ...]] = ("verdict",)


def comparisons(engines: Mapping[str, Mapping[str, LayoutFindings]],
                scopes: Mapping[str, Scope] | None = None) -> list[Comparison]:
    """Every pair of engines in every layout both ran; ``scopes``: each engine's (:func:`scope`), for the caveat."""
    found: list[Comparison] = []
    names = sorted(engines)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            both = None
            if scopes is not None and a in scopes and b in scopes:
                sa, sb = scopes[a], scopes[b]
                models = [m for m in (sa.model, sb.model) if m is not None]
                both = caveat(Scope(min(models, default=None), sa.on_cpu or sb.on_cpu))
            for layout in sorted(set(engines[a]) & set(engines[b]), key=layout_rank):
                fa, fb = engines[a][layout], engines[b][layout]
                asked = [t for p in (*fa.points, *fb.points) if (t := p.precision_target) is not None]
                precision = max(asked, default=DEFAULT_PRECISION)
                ta, tb = fa.most_throughput, fb.most_throughput
                if ta is not None and tb is not None and (r := ta.output_tok_s.ratio(tb.output_tok_s)) is not None:
                    found.append(Comparison("most throughput", layout, a, b, r, ta.concurrency, tb.concurrency, both,
                                            precision))
                ga, gb = fa.max_goodput, fb.max_goodput
                if ga is not None and gb is not None and ga.goodput_req_s is not None and gb.goodput_req_s is not None \
                        and (r := ga.goodput_req_s.ratio(gb.goodput_req_s)) is not None:
                    found.append(Comparison("max goodput under the SLO", layout, a, b, r, ga.concurrency,
                                            gb.concurrency, both, precision))
    return found
