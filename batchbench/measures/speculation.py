"""Speculative decoding's arithmetic: what a run's counters say, and where speculation stops paying.

A proposer drafts ``k`` tokens; one step of the model verifies them and keeps the longest correct prefix plus
one token of its own. A drafted step therefore emits ``1 + accepted`` tokens, so over a run

- the **acceptance rate** is accepted / drafted tokens (the engine's own counters, not the client's guess), and
- the **tokens per drafted step** are ``1 + accepted / drafts``: the most per-token latency speculation can save
  at a batch where a verifying step costs no more than a plain one.

A verifying step carries ``k + 1`` tokens per sequence. While a step's cost hardly grows with its tokens
(memory-bound decoding on an accelerator) those extra tokens are nearly free; as the batch grows the step
becomes compute-bound, costs grow with the tokens, and the gain shrinks. The **crossover** is the first batch
size at which TPOT with speculation is no better than without.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from batchbench.core.server_metrics import ServerMetrics


@dataclass(frozen=True)
class SpeculationCounters:
    """How the engine's speculation counters grew over one run."""

    drafts: float
    draft_tokens: float
    accepted_tokens: float

    @classmethod
    def over(cls, samples: Sequence[ServerMetrics]) -> SpeculationCounters | None:
        """The growth between the first and the last scrape that carry all three counters; None when fewer than
        two do (the engine does not count, or speculation is off and the counters are absent)."""
        known = [s for s in samples if None not in (s.spec_drafts, s.spec_draft_tokens, s.spec_accepted_tokens)]
        if len(known) < 2:
            return None
        first, last = known[0], known[-1]
        return cls(drafts=last.spec_drafts - first.spec_drafts,  # type: ignore[operator]
                   draft_tokens=last.spec_draft_tokens - first.spec_draft_tokens,  # type: ignore[operator]
                   accepted_tokens=last.spec_accepted_tokens - first.spec_accepted_tokens)  # type: ignore[operator]

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over drafted tokens; None when nothing was drafted."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens > 0 else None

    @property
    def tokens_per_step(self) -> float | None:
        """Tokens a drafted step emitted on average: its accepted drafts and the model's own token."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts > 0 else None


def speedup(tpot_without: float, tpot_with: float) -> float:
    """How many times faster tokens come with speculation: TPOT without over TPOT with (> 1: it pays)."""
    if tpot_without <= 0 or tpot_with <= 0:
        raise ValueError(f"TPOTs must be positive, not {tpot_without!r} and {tpot_with!r}")
    return tpot_without / tpot_with


def crossover(speedups: Mapping[int, float]) -> int | None:
    """The smallest batch size at which speculation no longer pays (speedup <= 1); None: it pays at every batch
    size measured."""
    return next((batch for batch in sorted(speedups) if speedups[batch] <= 1), None)
