"""The served model's tokenizer, for datasets written as text (``batchbench bench --dataset``) and chat prompts.

Workloads are token ids, so that every engine is asked for exactly the same prompt; a text dataset is
tokenised once, here, with the tokenizer of the model the engines serve (transformers' AutoTokenizer,
from a model folder or a Hugging Face id). Text is encoded without special tokens (no BOS): engines
are sent token ids and take them as they are, so the prompt length is the text's own tokens. The
embedded tiny model ships a tokenizer of its own (:func:`batchbench.fixtures.tiny_model_dir`).

A chat endpoint takes text, so there the tokenizer also goes the other way (:meth:`Tokenizer.decode`,
:mod:`batchbench.workload.text`): text that is a given number of tokens. A :class:`Tokenizer` pickles (the
transformers tokenizer it holds does), so an engine that counts a stream's text with it can be sent to another
process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Tokenizer:
    """A loaded tokenizer: where it came from, its vocabulary size, text -> token ids and back."""

    source: str
    vocab_size: int
    hf: Any

    def encode(self, text: str) -> list[int]:
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.hf.decode(list(token_ids), skip_special_tokens=False, clean_up_tokenization_spaces=False))

    def count(self, text: str) -> int:
        """How many tokens ``text`` is (a chat stream's text, where the engine sends no usage)."""
        return len(self.encode(text))


def load(source: str) -> Tokenizer:
    """AutoTokenizer for a model folder or Hugging Face id; ValueError saying why it cannot be loaded."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError(f"tokenizer {source!r}: text datasets need transformers "
                         "(pip install 'batchbench[text]')") from None
    try:
        hf = AutoTokenizer.from_pretrained(source)
    except Exception as exc:  # transformers raises OSError, ValueError, HTTP errors... all mean "not loadable"
        raise ValueError(f"tokenizer {source!r} cannot be loaded: {type(exc).__name__}: {exc}") from None
    return Tokenizer(source, len(hf), hf)
