"""Workload parity: did the engine get the workload it was meant to get?

The workload fixes each prompt's token count and asks for an exact output length. An engine that
re-tokenises (TGI takes text, so token ids become text and back), or stops at end-of-sequence where it
cannot ignore it, serves other lengths, and its figures are then not comparable with the others'. The
engine's own counts (its usage report) are checked against the workload's, and a difference is
flagged, never corrected.

On a chat endpoint the engine counts the prompt through its chat template, which adds tokens of its own (role
markers, the generation prompt): there the difference is measured and reported as the template's, and only an
engine that counted fewer tokens than were sent is a mismatch. Where the engine sent no usage at all, the counts
came from the served model's tokenizer or from the streamed pieces, and the check says so.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from batchbench.core.records import RequestRecord


@dataclass(frozen=True)
class Parity:
    """How many requests the engine reported counts for, and how many differ from the workload's."""

    #: Requests whose engine reported its own prompt token count.
    checked: int
    prompt_mismatches: int
    output_mismatches: int
    #: The first difference, e.g. ``request r-00003: prompt 131 tokens, workload 128``.
    example: str | None = None
    #: On a chat endpoint: the fewest and most prompt tokens the chat template added to a request (the engine's
    #: count less the tokens sent); None elsewhere, or where the engine counted none.
    template_tokens: tuple[int, int] | None = None
    #: Where the token counts came from, by requests: ``engine`` (its usage), ``tokenizer`` or ``chunks`` (it sent
    #: none: the served model's tokenizer over the streamed text, or one token per streamed piece).
    counted_by: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.prompt_mismatches and not self.output_mismatches

    def warning(self) -> str | None:
        """One line for the user, or None when the engine served the workload as written."""
        notes = []
        if not self.ok:
            parts = [f"{n} of {self.checked} requests' {what} token counts differ from the workload's"
                     for n, what in ((self.prompt_mismatches, "prompt"), (self.output_mismatches, "output")) if n]
            notes.append(f"{'; '.join(parts)} (first: {self.example}); figures are not comparable as-is")
        # "engine-last-choice": the engine's own usage, on its last choice event (llama.cpp's server).
        if other := {k: n for k, n in self.counted_by.items() if not k.startswith("engine")}:
            how = ", ".join(f"{n} from the {'tokenizer' if k == 'tokenizer' else 'streamed pieces (one each)'}"
                            for k, n in sorted(other.items()))
            notes.append(f"the engine sent no token usage for some requests: their counts are batchbench's ({how})")
        return f"workload parity: {'; '.join(notes)}" if notes else None

    def template_text(self) -> str | None:
        """The chat template's cost in a sentence, or None where there is none to tell."""
        if self.template_tokens is None:
            return None
        low, high = self.template_tokens
        spread = f"{low}" if low == high else f"{low}-{high}"
        return f"the chat template added {spread} prompt tokens per request (the engine's count less those sent)"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok,
                "template_tokens": list(self.template_tokens) if self.template_tokens else None}


def check(records: Sequence[RequestRecord], *, chat: bool | None = None) -> Parity:
    """Compare each request's engine-reported prompt and (for finished requests) output counts with the workload's.

    ``chat``: the requests went through the engine's chat template, whose added prompt tokens are measured, not
    counted as mismatches (an engine that counted fewer than were sent still is one). None: as the records say (a
    chat stream's record keeps when its answer began, ``first_output_s``; a completions stream's never does)."""
    if chat is None:
        chat = any(r.first_output_s is not None for r in records)
    checked = prompt = output = 0
    example = None
    added: list[int] = []
    for r in records:
        if r.prompt_tokens is not None:
            checked += 1
            extra = r.prompt_tokens - r.prompt_len
            if chat and extra >= 0:
                added.append(extra)
            elif extra:
                prompt += 1
                example = example or f"request {r.request_id}: prompt {r.prompt_tokens} tokens, workload {r.prompt_len}"
        if r.ok and r.completion_tokens is not None and r.completion_tokens != r.max_tokens:
            output += 1
            example = example or (f"request {r.request_id}: output {r.completion_tokens} tokens, "
                                  f"workload {r.max_tokens}")
    counted_by = Counter(r.usage_from or "engine" for r in records if r.ok)
    return Parity(checked, prompt, output, example, (min(added), max(added)) if added else None,
                  dict(sorted(counted_by.items())))
