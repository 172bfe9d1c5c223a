"""Engines against each other: each pair's figures as a ratio with its interval.

Per layout both engines ran, the throughput each gives at its own best (:class:`MostThroughput`), and
with an SLO the most goodput each gives under it. One engine is ahead only when the ratio's interval
excludes 1; otherwise the sentence gives the largest difference the data leaves open.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from batchbench.analysis.findings.points import layout_rank
from batchbench.analysis.findings.text import ratio as ratio_text
from batchbench.analysis.repeats import Estimate

if TYPE_CHECKING:  # the layouts' findings are assembled from every topic, this one included
    from batchbench.analysis.findings import LayoutFindings

Metric = Literal["most throughput", "max goodput under the SLO"]


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

    @property
    def verdict(self) -> str:
        """``vllm ahead``, ``hf-static ahead`` or ``within noise``."""
        if self.ratio.differs_from_one:
            return f"{self.a if self.ratio.value > 1 else self.b} ahead"
        return "within noise"

    def sentence(self) -> str:
        """``continuous: hf-static gives x2.33 [1.95–2.78] the output tokens/s of vllm, each at its best batch size
        (8 against 16).``, or the largest difference the data leaves open."""
        what, where = (("output tokens/s", "each at its best batch size") if self.metric == "most throughput"
                       else ("goodput", "each at its most goodput under the SLO"))
        if self.ratio.differs_from_one:
            flip = self.ratio.value < 1
            winner, loser = (self.b, self.a) if flip else (self.a, self.b)
            at = (self.at_b, self.at_a) if flip else (self.at_a, self.at_b)
            shown = self.ratio.inverse() if flip else self.ratio
            return (f"{self.layout}: {winner} gives {ratio_text(shown)} the {what} of {loser}, {where} "
                    f"({at[0]} against {at[1]}).")
        if self.ratio.largest_undetected is not None:
            return (f"{self.layout}: {self.a} and {self.b} give the same {what} within noise, {where} "
                    f"({self.at_a} and {self.at_b}): no difference larger than {self.ratio.largest_undetected:.0%} "
                    f"detected ({ratio_text(self.ratio)}).")
        return f"{self.layout}: {self.a} gives {ratio_text(self.ratio)} the {what} of {self.b}, {where} (n=1)."

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "layout": self.layout, "a": self.a, "b": self.b, "ratio": self.ratio.to_dict(),
                "at_a": self.at_a, "at_b": self.at_b, "verdict": self.verdict}


def comparisons(engines: Mapping[str, Mapping[str, LayoutFindings]]) -> list[Comparison]:
    found: list[Comparison] = []
    names = sorted(engines)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            for layout in sorted(set(engines[a]) & set(engines[b]), key=layout_rank):
                fa, fb = engines[a][layout], engines[b][layout]
                ta, tb = fa.most_throughput, fb.most_throughput
                if ta is not None and tb is not None and (r := ta.output_tok_s.ratio(tb.output_tok_s)) is not None:
                    found.append(Comparison("most throughput", layout, a, b, r, ta.concurrency, tb.concurrency))
                ga, gb = fa.max_goodput, fb.max_goodput
                if ga is not None and gb is not None and ga.goodput_req_s is not None and gb.goodput_req_s is not None \
                        and (r := ga.goodput_req_s.ratio(gb.goodput_req_s)) is not None:
                    found.append(Comparison("max goodput under the SLO", layout, a, b, r, ga.concurrency,
                                            gb.concurrency))
    return found
