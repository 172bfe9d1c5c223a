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

import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import httpx

#: How long the one probe of the Hugging Face Hub waits before a tokenizer name is looked up in its cache alone.
HUB_PROBE_S = 1.0


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

    @cached_property
    def added(self) -> int:
        """How many tokens the tokenizer adds to any text of its own accord (a BOS): what a server that tokenises a
        text prompt itself counts beyond the text's own tokens."""
        return len(self.hf("a", add_special_tokens=True)["input_ids"]) - len(self.encode("a"))


def load(source: str) -> Tokenizer:
    """AutoTokenizer for a model folder or Hugging Face id; ValueError saying why it cannot be loaded."""
    offline = not Path(source).is_dir() and (unreachable := _hub_unreachable()) is not None
    if offline and not _cached(source):  # said before transformers' seconds of importing
        raise ValueError(f"tokenizer {source!r} cannot be loaded: no such folder here nor in the Hugging Face "
                         f"cache, and the Hub cannot be reached ({unreachable}): give --tokenizer with the served "
                         "model's tokenizer folder")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError(f"tokenizer {source!r}: text datasets need transformers "
                         "(pip install 'batchbench[text]')") from None
    try:
        # Offline, only the Hugging Face cache: the Hub client would retry for ~40 s before failing.
        hf = AutoTokenizer.from_pretrained(source, local_files_only=offline)
    except Exception as exc:  # transformers raises OSError, ValueError, HTTP errors... all mean "not loadable"
        raise ValueError(f"tokenizer {source!r} cannot be loaded: {type(exc).__name__}: {exc}") from None
    return Tokenizer(source, len(hf), hf)


def _cached(repo_id: str) -> bool:
    """Whether the Hugging Face cache holds a tokenizer of ``repo_id`` (no network)."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        return any(isinstance(try_to_load_from_cache(repo_id, name), str)
                   for name in ("tokenizer_config.json", "tokenizer.json"))
    except HFValidationError:  # not a valid hub id at all
        return False


def _hub_unreachable() -> str | None:
    """Why the Hugging Face Hub cannot be asked for a tokenizer (offline mode, or no answer within a second to one
    probe), or None when it answers."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    try:
        httpx.head(endpoint, timeout=HUB_PROBE_S)
    except httpx.HTTPError as exc:
        return f"{endpoint}: {type(exc).__name__}"
    return None
