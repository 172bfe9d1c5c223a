"""The served model's tokenizer, for datasets written as text (``batchbench bench --dataset``).

Workloads are token ids, so that every engine is asked for exactly the same prompt; a text dataset is
tokenised once, here, with the tokenizer of the model the engines serve (transformers' AutoTokenizer,
from a model folder or a Hugging Face id). Text is encoded without special tokens (no BOS): engines
are sent token ids and take them as they are, so the prompt length is the text's own tokens. The
embedded tiny model ships a tokenizer of its own (:func:`batchbench.fixtures.tiny_model_dir`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Tokenizer:
    """A loaded tokenizer: where it came from, its vocabulary size and text -> token ids."""

    source: str
    vocab_size: int
    _encode: Callable[[str], Any]

    def encode(self, text: str) -> list[int]:
        return list(self._encode(text))


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
    return Tokenizer(source, len(hf), lambda text: hf(text, add_special_tokens=False)["input_ids"])
