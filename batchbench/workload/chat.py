"""A workload as chat messages, for a chat endpoint: the same lengths, as text of exactly those many tokens.

:func:`as_chat` turns a built workload of token ids into the requests a chat endpoint is sent: each prompt
becomes text of exactly its length under the served model's tokenizer (:class:`~batchbench.workload.text.TextMaker`,
seeded by the workload's seed and the request's id, so every engine gets identical messages), a shared prefix
becomes one system message per group, and a multi-turn conversation becomes the growing message list a chat
client sends: every earlier user message, a stand-in answer of the answer's exact length as the assistant's, then
the new user message. ``prompt_token_ids`` become the messages' own tokens (the prompt as sent; the engine's chat
template adds its own, which the parity check measures).
"""

from __future__ import annotations

import random
from dataclasses import replace

from batchbench.workload.requests import Request, Workload
from batchbench.workload.text import TextMaker
from batchbench.workload.tokenizer import Tokenizer

Message = tuple[str, str]


def as_chat(workload: Workload, tokenizer: Tokenizer) -> Workload:
    """The workload's requests as chat messages of the same token lengths (a request that has messages already
    keeps them). ValueError when the tokenizer cannot make text of a length asked for."""
    maker = TextMaker(tokenizer)
    spec = workload.spec
    made: dict[str, tuple[str, tuple[int, ...]]] = {}

    def text(key: str, n: int) -> tuple[str, tuple[int, ...]]:
        if key not in made:
            made[key] = maker.text(n, random.Random(f"{spec.seed}:text:{key}"))
        return made[key]

    def prefix(index: int) -> tuple[list[Message], tuple[int, ...]]:
        if not spec.prefix_tokens:
            return [], ()
        system, ids = text(f"prefix:{index % spec.prefix_groups}", spec.prefix_tokens)
        return [("system", system)], ids

    converted: dict[str, Request] = {}
    single = [r for r in workload.requests if r.session is None and r.messages is None]
    for index, request in enumerate(single):
        messages, ids = prefix(index)
        user, user_ids = text(request.request_id, request.prompt_len - len(ids))
        converted[request.request_id] = replace(request, messages=(*messages, ("user", user)),
                                                prompt_token_ids=ids + user_ids)
    for turns in workload.sessions():
        if any(t.messages is not None for t in turns):
            continue
        messages, ids = prefix(turns[0].session or 0)
        answer = 0
        for turn in turns:
            if answer:  # the previous answer's stand-in, as the assistant said it
                said, said_ids = text(f"{turn.request_id}:answer", answer)
                messages, ids = [*messages, ("assistant", said)], ids + said_ids
            user, user_ids = text(turn.request_id, turn.prompt_len - len(ids))
            messages, ids = [*messages, ("user", user)], ids + user_ids
            converted[turn.request_id] = replace(turn, messages=tuple(messages), prompt_token_ids=ids)
            answer = turn.max_tokens
    return Workload(spec, tuple(converted.get(r.request_id, r) for r in workload.requests))
