"""The agreement check the main job's report states: each engine's greedy answer to the same prompts through its own
adapter and batching, on the same seeded weights (:mod:`batchbench.core.greedy`, :mod:`batchbench.analysis.agreement`).

Measured here (8 prompts, 16 tokens): hf-static's padded batch and hf-continuous's paged one agree token for token;
llama.cpp's f32 GGUF of the same bf16 weights agrees on 86% of tokens (6 of 8 outputs whole, the median first
difference at token 8): near-ties broken apart by rounding, after which the continuations differ. vLLM serves its own
dummy weights and is compared with none.
"""

from __future__ import annotations

import asyncio

import pytest

from batchbench.adapters.registry import EngineOptions, make_engine
from batchbench.analysis.agreement import agreements
from batchbench.core.greedy import N_TOKENS, PROMPTS, GreedyOutputs
from tests.adapter_helpers import llamacpp_server

pytestmark = [pytest.mark.engine]


async def _answers(names: list[str]) -> list[GreedyOutputs]:
    answers = []
    for name in names:
        async with make_engine(name, None, EngineOptions()) as engine:
            answer = await engine.greedy(PROMPTS, N_TOKENS)
            assert answer is not None, name
            answers.append(answer)
    return answers


def test_engines_on_the_same_seeded_weights_give_the_same_greedy_answers() -> None:
    llamacpp_server()
    answers = asyncio.run(_answers(["hf-static", "hf-continuous", "llamacpp"]))
    assert all(len(a.tokens) == len(PROMPTS) and all(len(t) == N_TOKENS for t in a.tokens) for a in answers)
    assert len({a.source for a in answers}) == 1 and answers[0].source is not None
    pairs, alone = agreements(answers)
    assert alone == [] and len(pairs) == 3
    share = {(p.a.engine, p.b.engine): p.share for p in pairs}
    assert share[("hf-static", "hf-continuous")] >= 0.9, share  # one dtype, one library: padding must not matter
    assert min(share.values()) >= 0.6, share  # f32 against bf16: near-ties only
    assert all(p.same_outputs >= len(PROMPTS) // 2 for p in pairs), pairs
