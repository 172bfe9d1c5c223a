"""Workload parity: did the engine get the workload it was meant to get?

The workload fixes each prompt's token count and asks for an exact output length. An engine that
re-tokenises (TGI takes text, so token ids become text and back), or stops at end-of-sequence where it
cannot ignore it, serves other lengths, and its figures are then not comparable with the others'. The
engine's own counts (its usage report) are checked against the workload's, and a difference is
flagged, never corrected.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
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

    @property
    def ok(self) -> bool:
        return not self.prompt_mismatches and not self.output_mismatches

    def warning(self) -> str | None:
        """One line for the user, or None when the engine served the workload as written."""
        if self.ok:
            return None
        parts = [f"{n} of {self.checked} requests' {what} token counts differ from the workload's"
                 for n, what in ((self.prompt_mismatches, "prompt"), (self.output_mismatches, "output")) if n]
        return f"workload parity: {'; '.join(parts)} (first: {self.example}); figures are not comparable as-is"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def check(records: Sequence[RequestRecord]) -> Parity:
    """Compare each request's engine-reported prompt and (for finished requests) output counts with the workload's."""
    checked = prompt = output = 0
    example = None
    for r in records:
        if r.prompt_tokens is not None:
            checked += 1
            if r.prompt_tokens != r.prompt_len:
                prompt += 1
                example = example or f"request {r.request_id}: prompt {r.prompt_tokens} tokens, workload {r.prompt_len}"
        if r.ok and r.completion_tokens is not None and r.completion_tokens != r.max_tokens:
            output += 1
            example = example or (f"request {r.request_id}: output {r.completion_tokens} tokens, "
                                  f"workload {r.max_tokens}")
    return Parity(checked, prompt, output, example)
