"""The KV memory planner: from a model's ``config.json``, what fits in one accelerator's memory, before measuring.

A serving engine keeps the weights and then fills what its memory fraction leaves with KV cache; how
many sequences it can batch follows from that. :func:`plan` does the arithmetic an operator would do
by hand, step by step, with :mod:`batchbench.analysis.theory`'s functions (the same ones the suites check
engines against):

1. parameters, estimated from the config's shapes (embeddings, attention, gated MLP or experts, norms;
   biases and small latent norms left out), and the weights' bytes per GPU (split evenly over ``tp``);
2. KV bytes per token: 2 (K, V) x layers x KV heads x head_dim x bytes (MHA, GQA, MQA alike), or
   layers x (kv_lora_rank + qk_rope_head_dim) x bytes under MLA; per GPU, each tensor-parallel rank
   caches its share of the KV heads (at least one), and all of an MLA latent;
3. memory left for KV per GPU: memory x fraction - weights;
4. capacity: whole blocks of KV tokens in it (every rank holds the same tokens, so it is the model's);
5. sequences: how many context-length sequences fit, and for a workload (prompt + output) the most
   that fit at once (:func:`batchbench.analysis.theory.kv_fit_concurrency`'s rule) and the concurrency from
   which the workload is memory-bound: one more.

Sliding-window layers hold at most ``sliding_window`` tokens of a sequence. A sequence's footprint is
its tokens averaged over the layers (a windowed layer counts min(tokens, window)), in whole blocks; an
engine that pages full and windowed layers separately rounds each group to blocks (and may keep a
block more for a window that straddles blocks), so its figure can differ by a block or two per
sequence. Capacity in tokens is counted as if every layer held every token.

Not counted: activations, CUDA graphs and other buffers that engines also take from the memory
fraction, so an engine reports somewhat less than this plan's capacity.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any

from batchbench.analysis.theory import (
    dtype_bytes,
    is_mla,
    kv_bytes_per_token_of_config,
    kv_capacity_tokens,
    kv_fit_sequences,
    kv_heads_per_rank,
)

__all__ = ["DEFAULT_CONTEXT", "CapacityFit", "Experts", "GiB", "KVShape", "ParameterCount", "Plan", "PlanError",
           "experts", "fit_in_capacity", "plan"]

GiB = 1 << 30
#: The context length sequences are planned at unless one is given (a common serving max_model_len).
DEFAULT_CONTEXT = 8192


class PlanError(ValueError):
    """A config or an input the planner cannot plan from; the message names the field and why."""


@dataclass(frozen=True)
class ParameterCount:
    """Estimated parameters by part, so the estimate can be checked against a model card."""

    embedding: int
    lm_head: int
    attention: int
    mlp: int
    norms: int

    @property
    def total(self) -> int:
        return self.embedding + self.lm_head + self.attention + self.mlp + self.norms


@dataclass(frozen=True)
class KVShape:
    """What a token's KV cache is made of: the figures the bytes per token are the product of."""

    #: "MHA", "GQA", "MQA" or "MLA".
    attention: str
    layers: int
    #: KV heads of the model and of one tensor-parallel rank; None under MLA (one latent, no heads).
    kv_heads: int | None
    kv_heads_per_gpu: int | None
    head_dim: int | None
    #: kv_lora_rank + qk_rope_head_dim under MLA, else None.
    latent_dim: int | None
    #: Tokens a windowed layer holds at most, and how many layers are windowed (0: none).
    sliding_window: int | None
    windowed_layers: int


@dataclass(frozen=True)
class Plan:
    """The planner's inputs and every intermediate figure; bytes are per GPU unless named ``_total``."""

    model: str
    memory_bytes: int
    memory_fraction: float
    weight_dtype: str
    kv_dtype: str
    tp: int
    context: int
    block_size: int
    prompt_len: int | None
    output_len: int | None
    parameters: ParameterCount
    weight_bytes_total: int
    weight_bytes: int
    kv: KVShape
    kv_bytes_per_token: int
    kv_bytes_per_token_per_gpu: int
    usable_bytes: int
    kv_memory_bytes: int
    kv_capacity_tokens: int
    kv_capacity_blocks: int
    #: KV tokens one context-length sequence holds (layer-averaged under sliding windows), in whole blocks.
    sequence_tokens: int
    max_sequences: int
    #: The workload's sequence (prompt + output - 1 tokens: the last output token is never fed back), in blocks.
    workload_sequence_tokens: int | None
    workload_fit: int | None
    #: The first concurrency at which the workload's sequences no longer all fit: fit + 1.
    memory_bound_from: int | None
    #: Why nothing is left for the KV cache (the weights take all the memory); None when something is.
    problem: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types; the parameter total beside its parts, so a reader need not add them up."""
        out = asdict(self)
        out["parameters"]["total"] = self.parameters.total
        return out


def _int_field(config: Mapping[str, Any], name: str, *, minimum: int = 1) -> int:
    value = config.get(name)
    if value is None:
        raise PlanError(f"config.json has no {name!r}, which the planner needs")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PlanError(f"config.json's {name!r} must be a whole number >= {minimum}, not {value!r}")
    return value


def _head_dim(config: Mapping[str, Any]) -> int:
    """The config's ``head_dim``, else hidden_size / attention heads (transformers' default)."""
    if config.get("head_dim") is not None:
        return _int_field(config, "head_dim")
    return _int_field(config, "hidden_size") // _int_field(config, "num_attention_heads")


def _windows(config: Mapping[str, Any], layers: int) -> tuple[int | None, int]:
    """(sliding window, windowed layers), as transformers reads them: ``layer_types`` when the config lists
    them, else ``sliding_window`` on the layers from ``max_window_layers`` up (Qwen2; 0, all layers, for
    Mistral), unless ``use_sliding_window`` is false."""
    types = config.get("layer_types")
    if types is not None:
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise PlanError(f"config.json's layer_types has {unknown}: only full and sliding attention are planned")
        if len(types) != layers:
            raise PlanError(f"config.json lists {len(types)} layer_types for {layers} layers")
        windowed = types.count("sliding_attention")
        return (_int_field(config, "sliding_window"), windowed) if windowed else (None, 0)
    if config.get("sliding_window") is None or config.get("use_sliding_window") is False:
        return None, 0
    window = _int_field(config, "sliding_window")
    first = _int_field(config, "max_window_layers", minimum=0) if "max_window_layers" in config else 0
    windowed = max(0, layers - first)
    return (window, windowed) if windowed else (None, 0)


def _kv_shape(config: Mapping[str, Any], tp: int) -> KVShape:
    layers = _int_field(config, "num_hidden_layers")
    heads = _int_field(config, "num_attention_heads")
    if heads % tp:
        raise PlanError(f"tensor parallelism {tp} does not divide the {heads} attention heads")
    window, windowed = _windows(config, layers)
    if is_mla(config):
        latent = _int_field(config, "kv_lora_rank") + _int_field(config, "qk_rope_head_dim")
        return KVShape("MLA", layers, None, None, None, latent, window, windowed)
    kv_heads = heads if config.get("num_key_value_heads") is None else _int_field(config, "num_key_value_heads")
    try:
        per_gpu = kv_heads_per_rank(kv_heads, tp)
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    kind = "MHA" if kv_heads == heads else "MQA" if kv_heads == 1 else "GQA"
    return KVShape(kind, layers, kv_heads, per_gpu, _head_dim(config), None, window, windowed)


def _attention_parameters(config: Mapping[str, Any], kv: KVShape, hidden: int) -> int:
    """One layer's attention projections (biases left out)."""
    heads = _int_field(config, "num_attention_heads")
    if kv.latent_dim is not None:  # MLA: Q through its own low-rank latent when q_lora_rank is set
        nope, rope = _int_field(config, "qk_nope_head_dim"), _int_field(config, "qk_rope_head_dim")
        v_dim, kv_rank = _int_field(config, "v_head_dim"), _int_field(config, "kv_lora_rank")
        q_rank = config.get("q_lora_rank")
        q = (hidden * q_rank + q_rank * heads * (nope + rope)) if q_rank else hidden * heads * (nope + rope)
        return q + hidden * kv.latent_dim + kv_rank * heads * (nope + v_dim) + heads * v_dim * hidden
    assert kv.head_dim is not None and kv.kv_heads is not None
    return 2 * hidden * heads * kv.head_dim + 2 * hidden * kv.kv_heads * kv.head_dim


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts layout as the planner counts it: which layers hold experts, how many, how large.

    The time bounds (:mod:`batchbench.analysis.bounds`) read it too: a token's FLOPs use only the experts it is
    routed to, and a step's bytes only the experts its batch touches."""

    #: Layers whose MLP is routed experts (the others are dense MLPs of intermediate_size).
    moe_layers: int
    #: Routed experts per MoE layer, and shared experts every token uses besides.
    routed: int
    shared: int
    #: Parameters of one expert (gate, up, down: 3 x hidden x its intermediate size).
    expert_parameters: int


def experts(config: Mapping[str, Any]) -> Experts | None:
    """The config's experts (Mixtral's num_local_experts, DeepSeek's n_routed_experts), None for a dense model; a
    :class:`PlanError` for a layout the planner does not count, so it is never counted as dense."""
    layers, hidden = _int_field(config, "num_hidden_layers"), _int_field(config, "hidden_size")
    if "num_local_experts" in config:  # Mixtral: every layer holds its experts at intermediate_size
        return Experts(layers, _int_field(config, "num_local_experts"), 0,
                       3 * hidden * _int_field(config, "intermediate_size"))
    if "n_routed_experts" in config:  # DeepSeek: dense first layers, then routed + shared experts
        shared = _int_field(config, "n_shared_experts", minimum=0) if "n_shared_experts" in config else 0
        first = _int_field(config, "first_k_dense_replace", minimum=0) if "first_k_dense_replace" in config else 0
        freq = _int_field(config, "moe_layer_freq") if "moe_layer_freq" in config else 1
        moe = sum(1 for i in range(layers) if i >= first and i % freq == 0)
        return Experts(moe, _int_field(config, "n_routed_experts"), shared,
                       3 * hidden * _int_field(config, "moe_intermediate_size"))
    if "num_experts" in config:
        raise PlanError("config.json has 'num_experts': this mixture-of-experts layout is not one the planner "
                        "counts (Mixtral's num_local_experts and DeepSeek's n_routed_experts are)")
    return None


def _mlp_parameters(config: Mapping[str, Any], layers: int, hidden: int) -> int:
    """Every layer's gated MLP (gate, up, down: 3 x hidden x intermediate), or its experts and router."""
    dense = 3 * hidden * _int_field(config, "intermediate_size")
    moe = experts(config)
    if moe is None:
        return layers * dense
    per_layer = (moe.routed + moe.shared) * moe.expert_parameters + hidden * moe.routed
    return moe.moe_layers * per_layer + (layers - moe.moe_layers) * dense


def _parameters(config: Mapping[str, Any], kv: KVShape) -> ParameterCount:
    hidden, vocab = _int_field(config, "hidden_size"), _int_field(config, "vocab_size")
    embedding = vocab * hidden
    return ParameterCount(
        embedding=embedding,
        lm_head=0 if config.get("tie_word_embeddings") else embedding,
        attention=kv.layers * _attention_parameters(config, kv, hidden),
        mlp=_mlp_parameters(config, kv.layers, hidden),
        norms=(2 * kv.layers + 1) * hidden,
    )


def parameter_count(config: Mapping[str, Any]) -> int:
    """The model's parameters, estimated from its config's shapes (as :func:`plan` counts them)."""
    return _parameters(config, _kv_shape(config, 1)).total


def _held_tokens(tokens: int, kv: KVShape) -> int:
    """KV tokens a sequence of ``tokens`` holds, averaged over the layers: a windowed layer holds at most the
    window. Rounded up, so a footprint is never under-counted."""
    if kv.sliding_window is None:
        return tokens
    full = kv.layers - kv.windowed_layers
    return math.ceil((full * tokens + kv.windowed_layers * min(tokens, kv.sliding_window)) / kv.layers)


def _in_blocks(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size) * block_size


@dataclass(frozen=True)
class CapacityFit:
    """Steps 4-5 alone, for a cache whose capacity is known (what an engine reports) rather than planned from
    memory: the report checks a run's memory-bound onset against this, with the same arithmetic as :func:`plan`."""

    kv_bytes_per_token: int
    kv_capacity_tokens: int
    #: The capacity's bytes at the model's KV bytes per token (whole blocks of it are usable).
    kv_memory_bytes: int
    block_size: int
    #: The workload's sequence (prompt + output - 1 tokens), layer-averaged under sliding windows, in blocks.
    sequence_tokens: int
    fit: int
    #: The first concurrency at which the sequences no longer all fit: fit + 1.
    memory_bound_from: int


def fit_in_capacity(config: Mapping[str, Any], capacity_tokens: int, *, block_size: int, prompt_len: int,
                    output_len: int, kv_dtype: str = "bf16") -> CapacityFit:
    """How many ``prompt_len`` + ``output_len`` sequences of this model a cache of ``capacity_tokens`` holds at
    once; a :class:`PlanError` naming the field or input when the config or an input cannot be planned from."""
    for name, value in (("capacity_tokens", capacity_tokens), ("block_size", block_size),
                        ("prompt_len", prompt_len), ("output_len", output_len)):
        if value < 1:
            raise PlanError(f"{name} must be >= 1, not {value!r}")
    try:
        per_token = kv_bytes_per_token_of_config(config, dtype=kv_dtype)
    except (KeyError, ValueError) as exc:
        raise PlanError(f"cannot size this config's KV cache: {exc}") from None
    sequence = _in_blocks(_held_tokens(prompt_len + output_len - 1, _kv_shape(config, 1)), block_size)
    fit = kv_fit_sequences(capacity_tokens, sequence, block_size)
    return CapacityFit(per_token, capacity_tokens, capacity_tokens // block_size * block_size * per_token,
                       block_size, sequence, fit, fit + 1)


def plan(
    config: Mapping[str, Any],
    *,
    model: str = "model",
    memory_bytes: int = 80 * GiB,
    memory_fraction: float = 0.9,
    weight_dtype: str = "bf16",
    kv_dtype: str = "bf16",
    tp: int = 1,
    context: int | None = None,
    block_size: int = 16,
    prompt_len: int | None = None,
    output_len: int | None = None,
) -> Plan:
    """Plan one model on GPUs of ``memory_bytes`` each, ``tp`` of them in tensor parallel; a :class:`PlanError`
    naming the problem when the config lacks a field, a dtype is unknown, ``tp`` does not divide the heads, or an
    input is out of range. Weights that leave no room for KV are an answer (capacity 0, ``problem`` says why).
    ``context`` defaults to :data:`DEFAULT_CONTEXT`, or the model's ``max_position_embeddings`` when shorter."""
    max_context = config.get("max_position_embeddings")
    if context is None:
        context = min(DEFAULT_CONTEXT, max_context) if isinstance(max_context, int) else DEFAULT_CONTEXT
    for name, value in (("tp", tp), ("context", context), ("block_size", block_size), ("memory_bytes", memory_bytes)):
        if value < 1:
            raise PlanError(f"{name} must be >= 1, not {value!r}")
    if not 0 < memory_fraction <= 1:
        raise PlanError(f"the memory fraction must be in (0, 1], not {memory_fraction!r}")
    if (prompt_len is None) != (output_len is None):
        raise PlanError("a workload needs both its prompt and its output length")
    if prompt_len is not None and output_len is not None:
        if prompt_len < 1 or output_len < 1:
            raise PlanError(f"prompt and output lengths must be >= 1, not {prompt_len} and {output_len}")
        if prompt_len + output_len > context:
            raise PlanError(f"a sequence of {prompt_len}+{output_len} tokens does not fit the context of {context}")
    try:
        weight_size = dtype_bytes(weight_dtype)
        dtype_bytes(kv_dtype)  # checked before any other input, so the error names the dtype
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    if isinstance(max_context, int) and context > max_context:
        raise PlanError(f"context {context} is longer than the model's max_position_embeddings ({max_context})")

    kv = _kv_shape(config, tp)
    parameters = _parameters(config, kv)
    weight_total = parameters.total * weight_size
    weights = math.ceil(weight_total / tp)
    per_token = kv_bytes_per_token_of_config(config, dtype=kv_dtype)
    per_token_gpu = kv_bytes_per_token_of_config(config, dtype=kv_dtype, tp=tp)

    usable = math.floor(memory_bytes * Fraction(str(memory_fraction)))
    kv_memory = usable - weights
    problem = None
    if kv_memory <= 0:
        # An answer, not an error: the KV arithmetic still holds, and "nothing fits" is what the user asked.
        problem = (f"the weights ({weights / GiB:,.2f} GiB per GPU) do not fit in {usable / GiB:,.2f} GiB "
                   f"({memory_bytes / GiB:,.2f} GiB x {memory_fraction:g}): more GPUs (--tp), more memory or a "
                   "smaller weight dtype")
        kv_memory = 0
    capacity = kv_capacity_tokens(kv_memory, per_token_gpu, block_size)
    sequence = _in_blocks(_held_tokens(context, kv), block_size)
    workload = fit = None
    if prompt_len is not None and output_len is not None:
        workload = _in_blocks(_held_tokens(prompt_len + output_len - 1, kv), block_size)
        fit = kv_fit_sequences(capacity, workload, block_size)
    return Plan(
        model=model, memory_bytes=memory_bytes, memory_fraction=memory_fraction, weight_dtype=weight_dtype,
        kv_dtype=kv_dtype, tp=tp, context=context, block_size=block_size, prompt_len=prompt_len,
        output_len=output_len, parameters=parameters, weight_bytes_total=weight_total, weight_bytes=weights,
        kv=kv, kv_bytes_per_token=per_token, kv_bytes_per_token_per_gpu=per_token_gpu, usable_bytes=usable,
        kv_memory_bytes=kv_memory, kv_capacity_tokens=capacity, kv_capacity_blocks=capacity // block_size,
        sequence_tokens=sequence, max_sequences=kv_fit_sequences(capacity, sequence, block_size),
        workload_sequence_tokens=workload, workload_fit=fit,
        memory_bound_from=None if fit is None else fit + 1, problem=problem,
    )
