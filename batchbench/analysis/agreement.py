"""How far two engines' greedy answers agree (:mod:`batchbench.core.greedy`): a correctness check, not a speed.

Two engines that serve the same seeded weights and decode greedily should produce the same tokens, but for
near-ties that their kernels' rounding breaks apart differently (and a narrower dtype makes more of them): after the
first such difference the two continuations are different texts. So each pair is stated as the share of positions
that agree, the outputs identical in full, and where the first difference fell.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass

from batchbench.core.greedy import GreedyOutputs


@dataclass(frozen=True)
class Agreement:
    """One pair of engines' answers to the same prompts."""

    a: GreedyOutputs
    b: GreedyOutputs
    #: Positions with the same token, and positions compared (each output's shorter length).
    same_tokens: int
    tokens: int
    same_outputs: int
    outputs: int
    #: The median index (0-based) of the first differing token over the outputs that differ; None: none differ.
    first_difference: float | None

    @property
    def share(self) -> float:
        return self.same_tokens / self.tokens if self.tokens else 0.0


def agreement(a: GreedyOutputs, b: GreedyOutputs) -> Agreement:
    """Compare ``a`` and ``b`` output by output, position by position."""
    pairs = list(zip(a.tokens, b.tokens, strict=False))
    same = sum(x == y for ta, tb in pairs for x, y in zip(ta, tb, strict=False))
    tokens = sum(min(len(ta), len(tb)) for ta, tb in pairs)
    firsts = [next((i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), min(len(ta), len(tb)))
              for ta, tb in pairs if ta != tb]
    return Agreement(a, b, same, tokens, len(pairs) - len(firsts), len(pairs),
                     statistics.median(firsts) if firsts else None)


def agreements(answers: list[GreedyOutputs]) -> tuple[list[Agreement], list[GreedyOutputs]]:
    """Every pair of answers computed from the same seeded weights, and the answers compared with none (weights
    of their own, or no other engine on theirs)."""
    pairs = [agreement(a, b) for a, b in itertools.combinations(answers, 2)
             if a.source is not None and a.source == b.source]
    paired = {id(x) for p in pairs for x in (p.a, p.b)}
    return pairs, [a for a in answers if id(a) not in paired]
