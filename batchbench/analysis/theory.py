"""Analytic theory: what batching and KV sizing should cost, from lengths and model configs alone.

Measurement lives in :mod:`batchbench.measures.metrics` (what a run's records say);
here are the predictions the suites compare measurements with: the padding
and idle slots of static batches, the idle slots of continuous batching,
and how many tokens (and sequences) a KV cache of a given size holds.
Every function is pure and engine-neutral; how a particular engine rounds
or reports its cache is its adapter's (:class:`batchbench.core.config.KVLayout`).
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
    "dtype_bytes",
    "is_mla",
    "kv_bytes_per_token_of_config",
    "kv_cache_bytes_per_token",
    "kv_capacity_tokens",
    "kv_fit_concurrency",
    "kv_fit_sequences",
    "kv_heads_per_rank",
    "mla_kv_cache_bytes_per_token",
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


#: Bytes per element of the dtypes weights or a KV cache may be kept in, under the names model configs
#: (``torch_dtype``) and engines' flags (vLLM's ``--kv-cache-dtype fp8_e4m3``) give them.
DTYPE_BYTES = {
    "float32": 4, "fp32": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype``; a ValueError naming the known ones otherwise (a typo must not size a cache)."""
    try:
        return DTYPE_BYTES[dtype.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}: one of {', '.join(DTYPE_BYTES)}") from None


def mla_kv_cache_bytes_per_token(num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int,
                                 bytes_per_element: int) -> int:
    """KV-cache bytes one token occupies under multi-head latent attention (DeepSeek-V2/V3): layers x
    (kv_lora_rank + qk_rope_head_dim) x bytes.

    MLA caches one compressed latent per token and layer, shared by K and V and by every head (no factor
    of 2, no head count), plus the decoupled RoPE key; that is what makes its cache a fraction of GQA's.
    """
    for name, value in (("num_layers", num_layers), ("kv_lora_rank", kv_lora_rank),
                        ("qk_rope_head_dim", qk_rope_head_dim), ("bytes_per_element", bytes_per_element)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, not {value!r}")
    return num_layers * (kv_lora_rank + qk_rope_head_dim) * bytes_per_element


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads one tensor-parallel rank caches: the heads split evenly, at least one per rank.

    With fewer KV heads than ranks each head is replicated on ``tp / num_kv_heads`` ranks (vLLM does
    this), so the count must divide evenly one way or the other; otherwise a ValueError.
    """
    if num_kv_heads < 1 or tp < 1:
        raise ValueError(f"num_kv_heads and tp must be >= 1, not {num_kv_heads!r} and {tp!r}")
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(f"tensor parallelism {tp} does not divide the {num_kv_heads} KV heads "
                         f"(nor do they divide it): the heads cannot be split evenly across ranks")
    return max(1, num_kv_heads // tp)


def is_mla(config: Mapping[str, Any]) -> bool:
    """Whether a Hugging Face config uses multi-head latent attention (it names a ``kv_lora_rank``)."""
    return config.get("kv_lora_rank") is not None


def kv_bytes_per_token_of_config(
    config: Mapping[str, Any], *, dtype: str = "bfloat16", kv_heads: int | None = None, tp: int = 1
) -> int:
    """KV bytes per token of a Hugging Face model config (``config.json`` as a dict), on one of ``tp``
    tensor-parallel ranks (``tp=1``: the whole model's).

    ``kv_heads`` overrides the config's KV heads (e.g. MHA: all attention heads);
    ``head_dim`` defaults to hidden_size / attention heads, as transformers does.
    Under tensor parallelism each rank caches its share of the KV heads
    (:func:`kv_heads_per_rank`); an MLA model's latent is not split by head, so
    every rank caches all of it (:func:`mla_kv_cache_bytes_per_token`), as vLLM does.
    """
    layers, size = config["num_hidden_layers"], dtype_bytes(dtype)
    if is_mla(config):
        return mla_kv_cache_bytes_per_token(layers, config["kv_lora_rank"], config["qk_rope_head_dim"], size)
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    per_rank = kv_heads_per_rank(kv_heads or config.get("num_key_value_heads") or heads, tp)
    return kv_cache_bytes_per_token(layers, per_rank, head_dim, size)


def kv_fit_sequences(capacity_tokens: int, sequence_tokens: int, block_size: int) -> int:
    """How many sequences each holding ``sequence_tokens`` of KV fit in a paged cache at once.

    Each sequence takes whole blocks of its own (blocks are never shared between sequences here: no
    prefix caching), and the cache holds ``capacity_tokens // block_size`` blocks.
    """
    if capacity_tokens < 0:
        raise ValueError(f"capacity_tokens must be >= 0, not {capacity_tokens!r}")
    for name, value in (("sequence_tokens", sequence_tokens), ("block_size", block_size)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, not {value!r}")
    return (capacity_tokens // block_size) // math.ceil(sequence_tokens / block_size)


def kv_fit_concurrency(capacity_tokens: int, prompt_len: int, output_len: int, block_size: int) -> int:
    """How many sequences of one shape fit in a paged KV cache at once: regime 3's predicted onset.

    A sequence holds KV for its prompt and every output token but the last
    (the last one is returned, never fed back), in whole blocks
    (:func:`kv_fit_sequences`). Past this concurrency a closed loop keeps
    more sequences in flight than the cache can hold.
    """
    for name, value in (("capacity_tokens", capacity_tokens), ("prompt_len", prompt_len),
                        ("output_len", output_len), ("block_size", block_size)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, not {value!r}")
    return kv_fit_sequences(capacity_tokens, prompt_len + output_len - 1, block_size)
