"""The agreement between two engines' greedy answers (batchbench.analysis.agreement), checked against its
definition over generated answers."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from batchbench.analysis.agreement import agreement, agreements
from batchbench.core.greedy import GreedyOutputs

outputs = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=12).map(tuple), min_size=1, max_size=6)


def _answer(engine: str, tokens: list[tuple[int, ...]], source: str | None = "seeded") -> GreedyOutputs:
    return GreedyOutputs(engine, "w", source, tuple(tokens))


@given(outputs)
def test_an_answer_agrees_with_itself_wholly(tokens: list[tuple[int, ...]]) -> None:
    same = agreement(_answer("a", tokens), _answer("b", tokens))
    assert same.share == 1.0 and same.same_outputs == same.outputs == len(tokens)
    assert same.first_difference is None


@given(outputs, outputs)
def test_agreement_is_symmetric_and_counts_positions(left: list[tuple[int, ...]],
                                                     right: list[tuple[int, ...]]) -> None:
    ab, ba = agreement(_answer("a", left), _answer("b", right)), agreement(_answer("b", right), _answer("a", left))
    assert (ab.same_tokens, ab.tokens, ab.same_outputs, ab.first_difference) == \
        (ba.same_tokens, ba.tokens, ba.same_outputs, ba.first_difference)
    expected = sum(x == y for a, b in zip(left, right, strict=False) for x, y in zip(a, b, strict=False))
    assert ab.same_tokens == expected <= ab.tokens


def test_the_first_difference_is_the_median_index_over_the_outputs_that_differ() -> None:
    a = _answer("a", [(1, 2, 3, 4), (1, 2, 3, 4), (1, 2, 3, 4)])
    b = _answer("b", [(1, 2, 3, 4), (9, 2, 3, 4), (1, 2, 3, 9)])
    found = agreement(a, b)
    assert found.first_difference == 1.5 and found.same_outputs == 1 and found.same_tokens == 10


def test_only_answers_from_the_same_weights_are_paired() -> None:
    x, y = _answer("x", [(1,)], "k1"), _answer("y", [(1,)], "k1")
    own, other = _answer("vllm", [(2,)], None), _answer("z", [(1,)], "k2")
    pairs, alone = agreements([x, own, y, other])
    assert [(p.a.engine, p.b.engine) for p in pairs] == [("x", "y")]
    assert [a.engine for a in alone] == ["vllm", "z"]
