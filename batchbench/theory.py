"""Analytic theory: what batching and KV sizing should cost, from lengths and model configs alone.

Measurement lives in :mod:`batchbench.metrics` (what a run's records say);
here are the predictions the suites compare measurements with: the padding
and idle slots of static batches, the idle slots of continuous batching,
and how many tokens (and sequences) a KV cache of a given size holds.
Every function is pure and engine-neutral; how a particular engine rounds
or reports its cache is its adapter's (:class:`batchbench.adapters.base.KVLayout`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "DTYPE_BYTES",
    "continuous_idle_fraction",
    "decode_idle_fraction",
    "kv_bytes_per_token_of_config",
    "kv_cache_bytes_per_token",
    "kv_capacity_tokens",
    "kv_fit_concurrency",
    "padding_fraction",
    "waves_idle_fraction",
]


# --------------------------------------------------------------------------- static-batching waste


def _check_lengths(lengths: Sequence[int], what: str) -> None:
    if len(lengths) == 0:
        raise ValueError(f"{what}: a batch needs at least one sequence")
    if any(n < 0 for n in lengths):
        raise ValueError(f"{what}: lengths must be >= 0, not {list(lengths)}")


def _idle_fraction(lengths: Sequence[int], what: str) -> float:
    _check_lengths(lengths, what)
    longest = max(lengths)
    if longest == 0:
        return 0.0
    slots = len(lengths) * longest
    return (slots - sum(lengths)) / slots


def padding_fraction(prompt_lens: Sequence[int]) -> float:
    """Share of a left-padded batch's prompt tokens that are padding.

    A static batch pads every prompt to the longest one: pad tokens /
    (batch size x longest prompt). One 4096-token prompt among 31 of 100
    tokens wastes ~94.5% of the prefill compute, the case continuous
    batching avoids.
    """
    return _idle_fraction(prompt_lens, "padding_fraction")


def decode_idle_fraction(output_lens: Sequence[int]) -> float:
    """Share of a static batch's decode slot-steps that do no useful work.

    Every slot decodes until the longest output is done, so idle slot-steps /
    (batch size x longest output). The same arithmetic as
    :func:`padding_fraction`, kept separate because it measures the decode
    phase's waste, not the prefill's.
    """
    return _idle_fraction(output_lens, "decode_idle_fraction")


def _check_slots(output_lens: Sequence[int], n: int, what: str) -> None:
    if n < 1:
        raise ValueError(f"{what}: n must be >= 1, not {n}")
    _check_lengths(output_lens, what)


def waves_idle_fraction(output_lens: Sequence[int], n: int) -> float:
    """Idle decode slot-steps when requests run in order as static batches (waves) of n.

    Each wave lasts as long as its longest output and the next starts only
    then; the last wave may be short. Idle slot-steps / (n x total steps):
    a short last wave leaves slots empty too.
    """
    _check_slots(output_lens, n, "waves_idle_fraction")
    steps = sum(max(output_lens[i:i + n]) for i in range(0, len(output_lens), n))
    return 1 - sum(output_lens) / (n * steps) if steps else 0.0


def continuous_idle_fraction(output_lens: Sequence[int], n: int) -> float:
    """Idle decode slot-steps when requests run in order on n slots that are refilled at once.

    Iteration-level batching: a request starts as soon as a slot frees (list
    scheduling), so slots idle only in the run's tail, when nothing is left
    to start. Never more than :func:`waves_idle_fraction` of the same
    lengths: every request starts no later than its wave would.
    """
    _check_slots(output_lens, n, "continuous_idle_fraction")
    free = [0] * min(n, len(output_lens))
    for length in output_lens:
        heapq.heapreplace(free, free[0] + length)
    steps = max(free)
    return 1 - sum(output_lens) / (n * steps) if steps else 0.0


# --------------------------------------------------------------------------- KV cache sizing


def kv_cache_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_element: int) -> int:
    """KV-cache bytes one token occupies: 2 (K and V) x layers x KV heads x head dim x bytes.

    Uses KV heads, not attention heads: with grouped-query attention several
    query heads share one KV head, which is what shrinks the cache (and so
    raises the batch size that fits).
    """
    for name, value in (
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("bytes_per_element", bytes_per_element),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, not {value!r}")
    return 2 * num_layers * num_kv_heads * head_dim * bytes_per_element


def kv_capacity_tokens(memory_bytes: int, bytes_per_token: int, block_size: int = 1) -> int:
    """Tokens of KV cache that fit in ``memory_bytes``.

    Paged engines allocate whole blocks of ``block_size`` tokens, so capacity
    is the number of whole blocks that fit, times the block size.
    """
    if memory_bytes < 0:
        raise ValueError(f"memory_bytes must be >= 0, not {memory_bytes!r}")
    if bytes_per_token < 1:
        raise ValueError(f"bytes_per_token must be >= 1, not {bytes_per_token!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, not {block_size!r}")
    return (memory_bytes // (bytes_per_token * block_size)) * block_size

#: Bytes per element of the KV dtypes a model config may name.
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def kv_bytes_per_token_of_config(
    config: Mapping[str, Any], *, dtype: str = "bfloat16", kv_heads: int | None = None
) -> int:
    """KV bytes per token of a Hugging Face model config (``config.json`` as a dict).

    ``kv_heads`` overrides the config's KV heads (e.g. MHA: all attention heads);
    ``head_dim`` defaults to hidden_size / attention heads, as transformers does.
    """
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return kv_cache_bytes_per_token(
        config["num_hidden_layers"], kv_heads or config.get("num_key_value_heads", heads), head_dim, DTYPE_BYTES[dtype]
    )


def kv_fit_concurrency(capacity_tokens: int, prompt_len: int, output_len: int, block_size: int) -> int:
    """How many sequences of one shape fit in a paged KV cache at once: regime 3's predicted onset.

    A sequence holds KV for its prompt and every output token but the last
    (the last one is returned, never fed back), in whole blocks; the cache
    holds ``capacity_tokens // block_size`` blocks. Past this concurrency a
    closed loop keeps more sequences in flight than the cache can hold.
    """
    for name, value in (("capacity_tokens", capacity_tokens), ("prompt_len", prompt_len),
                        ("output_len", output_len), ("block_size", block_size)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, not {value!r}")
    blocks_per_sequence = math.ceil((prompt_len + output_len - 1) / block_size)
    return (capacity_tokens // block_size) // blocks_per_sequence
