"""An engine's greedy answer to a few fixed prompts: the evidence that two engines computed with the same weights.

The main job asks every engine that can say for the first tokens it would generate greedily for the same prompts
(:data:`PROMPTS`); where two engines serve the same seeded weights, the report states how far their answers agree
(:mod:`batchbench.analysis.agreement`): identical workloads shown by identical work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: The tokens asked of each prompt.
N_TOKENS = 16
#: Eight prompts of 8 to 43 token ids, fixed (no tokenizer needed: ids below 2,003 exist in every shipped vocabulary).
PROMPTS: tuple[tuple[int, ...], ...] = tuple(
    tuple((17 * i + 31 * j) % 2000 + 3 for j in range(8 + 5 * i)) for i in range(8))


@dataclass(frozen=True)
class GreedyOutputs:
    """One engine's greedy output token ids for :data:`PROMPTS`, and what it computed them with."""

    engine: str
    #: The weights, in words (e.g. "seeded bf16", "seeded, widened to f32 in a GGUF", "vLLM's dummy weights").
    weights: str
    #: Which seeded weights they are (the model key), or None for weights of the engine's own: only answers from
    #: the same source are compared.
    source: str | None
    tokens: tuple[tuple[int, ...], ...]

    def to_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "weights": self.weights, "source": self.source,
                "tokens": [list(t) for t in self.tokens]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GreedyOutputs:
        return cls(str(data["engine"]), str(data["weights"]), data.get("source"),
                   tuple(tuple(int(i) for i in t) for t in data["tokens"]))
