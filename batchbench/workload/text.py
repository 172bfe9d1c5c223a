"""Text that is exactly a given number of tokens under the served model's tokenizer: a chat endpoint's prompts.

A chat endpoint takes text, not token ids, yet a workload asks for prompts of exact lengths, the same for every
engine. So a prompt of ``n`` tokens is made of ``n`` words drawn (seeded) from the tokenizer's own vocabulary:
pieces that are one token on their own and letters only (`` the``, `` engine``). With a byte-level BPE whose
pre-tokenizer splits at spaces (GPT-2's, Llama 3's, the tiny model's) such pieces tokenise one each, so the text is
``n`` tokens at once; any other tokenizer is checked as well, and the text is grown or cut a piece at a time until
it tokenises to exactly ``n``, or refused. The words mean nothing, as the tiny model's random weights do; what
counts is the length.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from functools import cached_property

from batchbench.workload.tokenizer import Tokenizer

#: The most token ids looked at for words: a 128k vocabulary holds plenty among its first ids, and decoding every
#: id of it one by one would cost seconds.
MAX_IDS_SCANNED = 32_768
#: Fewer words than this is no vocabulary to draw prompts from.
MIN_WORDS = 16


class TextMaker:
    """Seeded text of exact token lengths for one tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    @cached_property
    def words(self) -> tuple[str, ...]:
        """The vocabulary's one-token pieces of letters, by id (so a seed draws the same words everywhere): those
        that open with a space where there are enough (the text is then words apart, each one token), else all."""
        found = []
        for token_id in range(min(self.tokenizer.vocab_size, MAX_IDS_SCANNED)):
            piece = self.tokenizer.decode([token_id])
            letters = piece.strip()
            if len(letters) >= 2 and letters.isascii() and letters.isalpha() and \
                    self.tokenizer.encode(piece) == [token_id]:
                found.append(piece)
        spaced = [piece for piece in found if piece.startswith(" ")]
        if len(spaced) >= MIN_WORDS:
            return tuple(spaced)
        if len(found) < MIN_WORDS:
            raise ValueError(f"tokenizer {self.tokenizer.source!r}: its vocabulary has {len(found)} one-token words, "
                             f"too few to make prompts of (at least {MIN_WORDS})")
        return tuple(found)

    def text(self, n: int, rng: random.Random) -> tuple[str, tuple[int, ...]]:
        """Text of exactly ``n`` tokens, and its token ids; ValueError when this tokenizer cannot be made to give
        exactly ``n`` (it merges across the words in ways a piece at a time cannot undo)."""
        if n < 1:
            raise ValueError(f"a prompt has at least one token, not {n}")
        pieces = [rng.choice(self.words) for _ in range(n)]
        for _ in range(2 * n + 32):
            ids = self.tokenizer.encode("".join(pieces))
            if len(ids) == n:
                return "".join(pieces), tuple(ids)
            if len(ids) > n and len(pieces) > 1:
                pieces.pop()
            else:
                pieces.append(rng.choice(self.words))
        raise ValueError(f"tokenizer {self.tokenizer.source!r}: no text of exactly {n} tokens found from its "
                         "one-token words (it merges across them)")

    def like(self, token_ids: Sequence[int]) -> str:
        """Text that the server tokenising it counts as ``len(token_ids)`` prompt tokens, special tokens it adds
        (a BOS: :attr:`Tokenizer.added`) included: for a server that refuses token-id prompts. A word per id where
        that tokenises one each, so prompts that share a prefix of ids share a prefix of text (a prefix cache
        still sees it); else seeded by the ids, so the same prompt is the same text on every engine."""
        n = max(1, len(token_ids) - self.tokenizer.added)
        words = self.words
        text = "".join(words[t % len(words)] for t in token_ids[:n])
        if len(self.tokenizer.encode(text)) == n:
            return text
        seed = hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()
        return self.text(n, random.Random(seed))[0]
