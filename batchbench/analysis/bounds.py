"""The physical limit of serving on paper: the least time a decode step and a prefill can take on a GPU.

The KV planner (:mod:`batchbench.analysis.planner`) says how many sequences fit; this says how fast they can go at
best. For a model config, a GPU (:mod:`batchbench.analysis.accelerators`), tensor parallelism over ``tp`` GPUs,
weight and KV dtypes, and a workload of ``prompt_len`` + ``output_len`` tokens, per GPU:

- a decode step at batch B moves the weights once (all of a dense model; a mixture of experts' shared part and the
  experts its B tokens touch) plus the batch's KV at its mean context (prompt + output / 2 tokens), and computes
  2 FLOPs per matmul parameter a token runs through plus attention's QK^T and AV over that context; it takes at
  least the larger of bytes / HBM bandwidth and FLOPs / dense peak, plus, under TP, two ring all-reduces per layer
  of B x hidden activations over the GPU link (2 (TP - 1) / TP x bytes / link bandwidth);
- hence the TPOT lower bound (the mean step), the output tokens/s upper bound (B / TPOT), and the ridge: the least
  B at which the step's compute time reaches its memory time (decode turns compute-bound), or none when each
  sequence's KV reads take longer than its FLOPs (long contexts: the step never turns);
- a prefill of the prompt alone (no queueing) takes at least its FLOPs (the linear layers for every prompt token,
  the output projection for the last, causal attention) over the peak, or its bytes over the bandwidth if longer:
  the TTFT lower bound;
- from the planner, the concurrency from which the KV cache runs out (memory-bound): past it at most the sequences
  the cache holds on average (its capacity over the mean context) decode at once, so the bound stops improving.

These are bounds, so every simplification makes them lower (never higher), and a measurement must never beat
them: datasheet peaks, not achievable throughput (no kernel overheads, launch gaps, CPU scheduling or sampling);
bytes and FLOPs overlap perfectly; only weights and KV reads are counted as traffic (no activations, no KV writes
in decode); only matmul and attention FLOPs (no norms, softmax, rotary or sampling); the embedding lookup is free
(B rows of it); the all-reduces have no latency and nothing else is exchanged (no vocab-parallel gathers), though
they do not overlap with compute (engines' decode does not overlap them). Every matrix is in the weight dtype, as
the planner counts; matmuls run at the weight dtype's peak (fp8 where the weights are 1 byte and the GPU has fp8
tensor cores, else bf16) and attention at the KV dtype's; activations are all-reduced in bf16. The mean step at
mean context is exact for the mean TPOT because a step's time is linear in the KV tokens it reads; prefills an
engine interleaves with decode steps only add to them, so they are left out, and B / TPOT leaves out the arriving
requests' prefill work. The one figure that is an expectation, not a floor: a mixture of experts' bytes count the
expected distinct experts B tokens touch under uniform routing (real routers are skewed and touch fewer, so a MoE
measurement can come slightly under the bytes term); experts are split over the TP ranks as tensor parallel, not
expert parallel. MLA (DeepSeek-V3) decodes in the absorbed form (scores over kv_lora_rank + qk_rope_head_dim per
head, values over kv_lora_rank) and prefills in the expanded one (qk_nope + qk_rope, v_head_dim), as engines do.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

from batchbench.analysis.accelerators import Accelerator
from batchbench.analysis.planner import Experts, Plan, PlanError, experts, plan
from batchbench.analysis.theory import dtype_bytes

__all__ = ["ACTIVATION_BYTES", "Bound", "BoundPoint", "DecodeStep", "Limits", "ModelShape", "Prefill",
           "expected_experts", "limits", "mean_attended"]

Bound = Literal["bandwidth", "compute", "kv"]
#: Bytes of one activation element all-reduced under TP: bf16, whatever the weights' dtype.
ACTIVATION_BYTES = 2


def expected_experts(routed: int, per_token: int, tokens: float) -> float:
    """Distinct experts ``tokens`` tokens touch in one layer on average when each picks ``per_token`` of ``routed``
    uniformly: routed x (1 - (1 - per_token / routed) ** tokens), which is at most min(routed, per_token x tokens)."""
    return float(routed * (1 - (1 - per_token / routed) ** tokens))


def _mean_min(lo: int, hi: int, window: int) -> float:
    """The mean of min(x, window) over the whole numbers lo..hi."""
    if window >= hi:
        return (lo + hi) / 2
    if window <= lo:
        return float(window)
    below = (lo + window) * (window - lo + 1) / 2
    return (below + (hi - window) * window) / (hi - lo + 1)


def mean_attended(prompt_len: int, output_len: int, window: int | None = None, windowed_layers: int = 0,
                  layers: int = 1) -> float:
    """Tokens a decode step attends to, averaged over a request's steps and the layers: the step that makes output
    token t (t = 2..output_len) reads prompt_len + t - 1 tokens, prompt_len + output_len / 2 on average; a windowed
    layer reads at most ``window`` of them."""
    full = prompt_len + output_len / 2
    if window is None or windowed_layers == 0:
        return full
    capped = _mean_min(prompt_len + 1, prompt_len + output_len - 1, window)
    return ((layers - windowed_layers) * full + windowed_layers * capped) / layers


def _causal_pairs(tokens: int, window: int | None) -> int:
    """(query, key) pairs of causal attention over ``tokens`` tokens: sum of min(i, window) for i = 1..tokens."""
    if window is None or window >= tokens:
        return tokens * (tokens + 1) // 2
    return window * (window + 1) // 2 + (tokens - window) * window


@dataclass(frozen=True)
class ModelShape:
    """What the bounds need of a model, from its config and the planner's parameter count."""

    layers: int
    hidden: int
    heads: int
    #: Matmul parameters every token runs through: attention, dense MLPs, shared experts, routers, output projection.
    dense_parameters: int
    #: The output projection (vocab x hidden), which a prefill runs for its last token only.
    output_parameters: int
    experts: Experts | None
    experts_per_token: int
    #: Per-head widths of attention's scores (QK^T) and values (AV), in decode and in prefill.
    decode_widths: tuple[int, int]
    prefill_widths: tuple[int, int]
    sliding_window: int | None
    windowed_layers: int

    @property
    def active_parameters(self) -> int:
        """Matmul parameters one token runs through: the dense part and its routed experts."""
        if self.experts is None:
            return self.dense_parameters
        return self.dense_parameters + self.experts.moe_layers * self.experts_per_token * self.experts.expert_parameters

    def parameters_read(self, tokens: float) -> float:
        """Matmul parameters a step over ``tokens`` tokens reads: the dense part and the experts they touch."""
        if self.experts is None:
            return float(self.dense_parameters)
        moe = self.experts
        touched = expected_experts(moe.routed, self.experts_per_token, tokens)
        return self.dense_parameters + moe.moe_layers * touched * moe.expert_parameters


def _model_shape(config: Mapping[str, Any], p: Plan) -> ModelShape:
    """The shape of a config the planner has already checked (so the fields it read are there and valid)."""
    heads, kv, par = config["num_attention_heads"], p.kv, p.parameters
    moe = experts(config)
    per_token: Any = 0
    routed_parameters = 0
    if moe is not None:
        per_token = config.get("num_experts_per_tok")
        if isinstance(per_token, bool) or not isinstance(per_token, int) or not 1 <= per_token <= moe.routed:
            raise PlanError(f"config.json's 'num_experts_per_tok' must be a whole number from 1 to {moe.routed} "
                            f"(the routed experts), not {per_token!r}")
        routed_parameters = moe.moe_layers * moe.routed * moe.expert_parameters
    if kv.latent_dim is not None:
        rank = config["kv_lora_rank"]
        decode = (kv.latent_dim, rank)
        prefill = (config["qk_nope_head_dim"] + config["qk_rope_head_dim"], config["v_head_dim"])
    else:
        assert kv.head_dim is not None
        decode = prefill = (kv.head_dim, kv.head_dim)
    return ModelShape(
        layers=kv.layers, hidden=config["hidden_size"], heads=heads,
        dense_parameters=par.attention + par.mlp - routed_parameters + par.embedding,
        output_parameters=par.embedding, experts=moe, experts_per_token=per_token, decode_widths=decode,
        prefill_widths=prefill, sliding_window=kv.sliding_window, windowed_layers=kv.windowed_layers)


@dataclass(frozen=True, kw_only=True)
class _Work:
    """What one pass over the model moves and computes on one GPU, and the least time of each."""

    weight_bytes: float
    kv_bytes: float
    linear_flops: float
    attention_flops: float
    bandwidth_s: float
    compute_s: float
    allreduce_s: float

    @property
    def seconds(self) -> float:
        """The least time of the pass: the larger of memory and compute time, then the all-reduces."""
        return max(self.bandwidth_s, self.compute_s) + self.allreduce_s

    @property
    def bound(self) -> Bound:
        """Which resource the pass's time is set by (a tie is compute's: the ridge is where compute catches up)."""
        return "compute" if self.compute_s >= self.bandwidth_s else "bandwidth"


@dataclass(frozen=True, kw_only=True)
class DecodeStep(_Work):
    """One decode step of ``batch`` sequences, a token each."""

    batch: int


@dataclass(frozen=True, kw_only=True)
class Prefill(_Work):
    """The prompt's prefill alone: the TTFT lower bound without queueing."""

    tokens: int


@dataclass(frozen=True)
class BoundPoint:
    """One row of the curve on paper: the limits at ``concurrency`` sequences in flight."""

    concurrency: int
    #: Sequences decoding at once: the concurrency, or at most the cache's resident sequences once it runs out.
    running: int
    fits: bool
    bound: Bound
    #: The least mean time per output token; None when not one sequence fits.
    tpot_s: float | None
    #: The most output tokens per second: running / tpot_s (0 when nothing fits).
    output_tok_s: float
    #: The least time to first token, the prompt's prefill without queueing.
    ttft_s: float
    #: The decode step of the running batch (None when nothing fits).
    step: DecodeStep | None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if self.step is not None:
            out["step"]["seconds"] = self.step.seconds
        return out


@dataclass(frozen=True)
class Limits:
    """Everything the bounds of one model on one GPU setup follow from: the plan (memory, KV), the GPU, the shape."""

    plan: Plan
    gpu: Accelerator
    shape: ModelShape

    @property
    def mean_context(self) -> float:
        """Tokens a decode step attends to on average, layer-averaged (:func:`mean_attended`)."""
        p, s = self.plan, self.shape
        assert p.prompt_len is not None and p.output_len is not None
        return mean_attended(p.prompt_len, p.output_len, s.sliding_window, s.windowed_layers, s.layers)

    def _allreduce_s(self, tokens: int) -> float:
        """Two ring all-reduces per layer of ``tokens`` x hidden bf16 activations over the link (none at TP 1)."""
        tp = self.plan.tp
        if tp == 1:
            return 0.0
        size = tokens * self.shape.hidden * ACTIVATION_BYTES
        return 2 * self.shape.layers * 2 * (tp - 1) / tp * size / self.gpu.link_bandwidth

    def _compute_s(self, linear: float, attention: float) -> float:
        """Matmuls at the weight dtype's peak, attention at the KV dtype's (an fp8 cache may run fp8 attention)."""
        gpu, p = self.gpu, self.plan
        return linear / gpu.peak_flops(p.weight_dtype) + attention / gpu.peak_flops(p.kv_dtype)

    def decode_step(self, batch: int) -> DecodeStep:
        """The least time of one decode step of ``batch`` sequences at the mean context (memory permitting)."""
        if batch < 1:
            raise ValueError(f"a batch has at least one sequence, not {batch}")
        p, s, tp, context = self.plan, self.shape, self.plan.tp, self.mean_context
        weights = s.parameters_read(batch) * dtype_bytes(p.weight_dtype) / tp
        kv = batch * context * p.kv_bytes_per_token_per_gpu
        linear = 2 * s.active_parameters * batch / tp
        attention = batch * context * s.layers * 2 * s.heads * sum(s.decode_widths) / tp
        return DecodeStep(batch=batch, weight_bytes=weights, kv_bytes=kv, linear_flops=linear,
                          attention_flops=attention, bandwidth_s=(weights + kv) / self.gpu.bandwidth,
                          compute_s=self._compute_s(linear, attention), allreduce_s=self._allreduce_s(batch))

    def prefill(self) -> Prefill:
        """The least time of the prompt's prefill alone: the output projection runs for its last token only, and
        attention is causal (windowed layers attend to at most their window)."""
        p, s, tp = self.plan, self.shape, self.plan.tp
        assert p.prompt_len is not None
        tokens = p.prompt_len
        weights = s.parameters_read(tokens) * dtype_bytes(p.weight_dtype) / tp
        kv = tokens * p.kv_bytes_per_token_per_gpu
        linear = 2 * ((s.active_parameters - s.output_parameters) * tokens + s.output_parameters) / tp
        pairs = ((s.layers - s.windowed_layers) * _causal_pairs(tokens, None)
                 + s.windowed_layers * _causal_pairs(tokens, s.sliding_window))
        attention = 2 * s.heads * sum(s.prefill_widths) * pairs / tp
        return Prefill(tokens=tokens, weight_bytes=weights, kv_bytes=kv, linear_flops=linear,
                       attention_flops=attention, bandwidth_s=(weights + kv) / self.gpu.bandwidth,
                       compute_s=self._compute_s(linear, attention), allreduce_s=self._allreduce_s(tokens))

    def _first(self, holds: Callable[[DecodeStep], bool], high: int) -> int:
        """The least batch in 1..high whose step ``holds``, for a test that holds at ``high`` and, once it holds,
        at every larger batch (a bisection)."""
        low = 0  # invariant: the test fails at low (or low is 0) and holds at high
        while high - low > 1:
            middle = (low + high) // 2
            if holds(self.decode_step(middle)):
                high = middle
            else:
                low = middle
        return high

    def _all_weights_s(self) -> float:
        """Memory time of every weight (all experts) on one GPU: what a step's weight term tends to."""
        p = self.plan
        return self.shape.parameters_read(math.inf) * dtype_bytes(p.weight_dtype) / p.tp / self.gpu.bandwidth

    def ridge(self) -> int | None:
        """The least batch whose decode step is compute-bound; None when none is, because one sequence's KV reads
        take longer than its FLOPs (the step's memory time then grows faster with the batch than its compute).

        The gap compute - memory is convex in the batch (compute is linear; memory is linear plus a concave expert
        term) and negative at 0, so once a batch is compute-bound every larger one is."""
        one = self.decode_step(1)
        per_sequence = one.compute_s - one.kv_bytes / self.gpu.bandwidth
        if per_sequence <= 0:
            return None
        return self._first(lambda step: step.bound == "compute", math.ceil(self._all_weights_s() / per_sequence) + 1)

    def kv_balance(self) -> int:
        """The least batch whose KV reads reach its weight reads: below it a step is mostly weights, so batching is
        nearly free (TPOT under twice batch 1's where memory binds); above it each sequence adds its own KV time.
        KV reads are linear in the batch and weights concave, so past this batch the KV reads stay ahead."""
        per_sequence = self.decode_step(1).kv_bytes / self.gpu.bandwidth
        high = math.ceil(self._all_weights_s() / per_sequence) + 1
        return self._first(lambda step: step.kv_bytes >= step.weight_bytes, high)

    @property
    def resident(self) -> int:
        """The most sequences the KV cache holds at once on average: its capacity over a sequence's mean footprint
        (the mean context), with no block rounding. More than the planner's fit, which holds every sequence at its
        full length: sequences in flight are at different lengths, so an engine can keep this many decoding."""
        return math.floor(self.plan.kv_capacity_tokens / self.mean_context)

    def point(self, concurrency: int) -> BoundPoint:
        """The row of the curve at ``concurrency`` sequences in flight. Within the planner's fit all of them decode at
        once; past it (``kv``) at most :attr:`resident` do, so the figures stop improving there: over a run, a step's
        sequences cannot hold more KV than the cache on average, whatever an engine queues or preempts."""
        p = self.plan
        assert p.workload_fit is not None
        fits = concurrency <= p.workload_fit
        running = min(concurrency, max(p.workload_fit, self.resident))
        ttft = self.prefill().seconds
        if running == 0:
            return BoundPoint(concurrency, 0, False, "kv", None, 0.0, ttft, None)
        step = self.decode_step(running)
        return BoundPoint(concurrency, running, fits, step.bound if fits else "kv", step.seconds,
                          running / step.seconds, ttft, step)

    def curve(self, levels: Iterable[int]) -> tuple[BoundPoint, ...]:
        """The rows at ``levels``: the curve on paper beside a measured one."""
        return tuple(self.point(level) for level in levels)

    def to_dict(self) -> dict[str, Any]:
        """The inputs, the shape and the regimes as JSON (the plan's own figures are its ``to_dict``)."""
        shape = asdict(self.shape)
        shape["active_parameters"] = self.shape.active_parameters
        return {"gpu": self.gpu.to_dict(), "shape": shape, "mean_context": self.mean_context,
                "ridge_concurrency": self.ridge(), "kv_balance_concurrency": self.kv_balance(),
                "memory_bound_from": self.plan.memory_bound_from, "resident_sequences": self.resident,
                "prefill": {**asdict(self.prefill()), "seconds": self.prefill().seconds}}


def limits(config: Mapping[str, Any], gpu: Accelerator, *, prompt_len: int, output_len: int, model: str = "model",
           tp: int = 1, weight_dtype: str = "bf16", kv_dtype: str = "bf16", memory_bytes: int | None = None,
           memory_fraction: float = 0.9, block_size: int = 16, context: int | None = None) -> Limits:
    """The limits of serving ``prompt_len`` + ``output_len``-token requests of this model on ``tp`` of ``gpu``
    (each of ``memory_bytes``, the GPU's own by default); a :class:`PlanError` naming the problem for anything the
    planner refuses, and for an output of one token (no decode step, no TPOT)."""
    if output_len < 2:
        raise PlanError(f"the time bounds need an output of at least 2 tokens (TPOT is the time between output "
                        f"tokens), not {output_len}")
    p = plan(config, model=model, memory_bytes=gpu.memory_bytes if memory_bytes is None else memory_bytes,
             memory_fraction=memory_fraction, weight_dtype=weight_dtype, kv_dtype=kv_dtype, tp=tp, context=context,
             block_size=block_size, prompt_len=prompt_len, output_len=output_len)
    return Limits(p, gpu, _model_shape(config, p))
