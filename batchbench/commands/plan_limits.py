"""``batchbench plan --gpu NAME``: the time half of the plan, the curve on paper, printed step by step.

The arithmetic is :mod:`batchbench.analysis.bounds`'s; here it is written out the way the memory plan is, each
step with the figures it multiplies, then a row per concurrency and one row worked through in full, so a reader
can redo it by hand.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from batchbench.analysis.bounds import BoundPoint, Limits
from batchbench.analysis.theory import dtype_bytes

#: Concurrencies the curve is printed at when --concurrency is not given.
DEFAULT_LEVELS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.3f} ms"


def _count(n: float) -> str:
    """A count as the memory plan writes one: 69.50 B (billions), 1.32 M, 128."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f}"


def _peak(lim: Limits, dtype: str) -> str:
    return f"{lim.gpu.peak_flops(dtype) / 1e12:,.1f} TFLOPS ({dtype})"


def _regimes(lim: Limits) -> str:
    p, ridge, one = lim.plan, lim.ridge(), lim.decode_step(1)
    if ridge is None:
        kv_s = one.kv_bytes / lim.gpu.bandwidth
        text = (f"memory-bandwidth-bound at every batch: one sequence's KV reads ({_ms(kv_s)}) outlast its FLOPs "
                f"({_ms(one.compute_s)}), so no batch reaches the ridge")
    else:
        text = f"memory-bandwidth-bound up to batch {ridge - 1:,}, compute-bound from {ridge:,} (the ridge)"
        if p.memory_bound_from is not None and ridge >= p.memory_bound_from:
            text += ", which the KV cache does not reach"
    balance = lim.kv_balance()
    reached = p.memory_bound_from is None or balance < p.memory_bound_from
    return (f"{text}; KV reads pass the weight reads from batch {balance:,} ("
            + ("below it batching is nearly free" if reached else "the KV cache runs out first")
            + f"); memory-bound (KV) from {p.memory_bound_from:,}: {p.workload_fit:,} fit at full length, at most "
            f"{max(p.workload_fit or 0, lim.resident):,} decode at once")


def _steps(lim: Limits) -> list[str]:
    p, s, gpu, tp = lim.plan, lim.shape, lim.gpu, lim.plan.tp
    one, pre = lim.decode_step(1), lim.prefill()
    if s.experts is None:
        read, at = f"{_count(s.dense_parameters)} matmul parameters", ""
    else:
        read = (f"{_count(s.dense_parameters)} dense matmul parameters + the experts a batch touches "
                f"({s.experts_per_token} of {s.experts.routed} a token, uniform routing)")
        at = " at batch 1"
    step8 = (f"8 weights read   {read} (the embedding lookup is free) x {dtype_bytes(p.weight_dtype)} B "
             f"({p.weight_dtype}) / {tp} GPU(s) = {one.weight_bytes:,.0f} B per GPU per step{at}")
    context = lim.mean_context
    return [
        f"the limit on paper: {tp} x {gpu.name}, {gpu.memory_tb_s:g} TB/s HBM, {gpu.bf16_tflops:,g} TFLOPS bf16"
        + (f" / {gpu.fp8_tflops:,g} fp8" if gpu.fp8_tflops else "") + f" dense, {gpu.link} at {gpu.link_gb_s:g} GB/s "
        "per direction (datasheets cited in accelerators.toml)",
        step8,
        f"9 KV read        {p.prompt_len:,} + {p.output_len:,} / 2 = {context:,.1f} tokens on average x "
        f"{p.kv_bytes_per_token_per_gpu:,} B per GPU = {one.kv_bytes:,.0f} B per sequence per step",
        f"10 FLOPs         2 x {_count(s.active_parameters)} active parameters / {tp} = {one.linear_flops:,.0f} per "
        f"sequence at {_peak(lim, p.weight_dtype)} + attention {context:,.1f} tokens x {s.layers} layers x 2 x "
        f"{s.heads} heads x {sum(s.decode_widths)} (QK + AV widths) / {tp} = {one.attention_flops:,.0f} at "
        f"{_peak(lim, p.kv_dtype)}",
        "11 all-reduce    " + ("none at TP 1" if tp == 1 else
                                f"2 per layer x {s.layers} layers x 2 ({tp} - 1) / {tp} x batch x {s.hidden:,} x 2 B "
                                f"(bf16) / {gpu.link_gb_s:g} GB/s = {_ms(one.allreduce_s)} per sequence"),
        f"12 regimes       {_regimes(lim)}",
        f"13 prefill       {pre.tokens:,} tokens alone: {(pre.linear_flops + pre.attention_flops) / 1e12:,.2f} TFLOP "
        f"({_ms(pre.compute_s)}) vs {(pre.weight_bytes + pre.kv_bytes) / 1e9:,.2f} GB ({_ms(pre.bandwidth_s)}), "
        f"+ {_ms(pre.allreduce_s)} all-reduce: TTFT >= {_ms(pre.seconds)} without queueing ({pre.bound}-bound)",
    ]


def _table(curve: Sequence[BoundPoint]) -> list[str]:
    out = [f"{'batch':>7}  {'TPOT >=':>12}  {'tok/s <=':>10}  {'TTFT >=':>12}  {'bound':<9}  KV"]
    for row in curve:
        tpot = "-" if row.tpot_s is None else _ms(row.tpot_s)
        fit = "fits" if row.fits else f"does not fit: {row.running:,} decode at once"
        out.append(f"{row.concurrency:>7,}  {tpot:>12}  {row.output_tok_s:>10,.1f}  {_ms(row.ttft_s):>12}  "
                   f"{row.bound:<9}  {fit}")
    return out


def _worked(lim: Limits, row: BoundPoint) -> str:
    """One row's arithmetic in plain figures, from the steps above to its TPOT and tokens/s."""
    step, gpu, b = row.step, lim.gpu, row.running
    assert step is not None and row.tpot_s is not None
    p = lim.plan
    return (f"batch {row.concurrency:,} worked: bytes {step.weight_bytes:,.0f} + {b:,} x "
            f"{step.kv_bytes / b:,.0f} = {step.weight_bytes + step.kv_bytes:,.0f} B / {gpu.bandwidth:.4g} B/s = "
            f"{_ms(step.bandwidth_s)}; FLOPs {b:,} x {step.linear_flops / b:,.0f} / "
            f"{gpu.peak_flops(p.weight_dtype):.4g} + {b:,} x {step.attention_flops / b:,.0f} / "
            f"{gpu.peak_flops(p.kv_dtype):.4g} = {_ms(step.compute_s)}; TPOT >= max({_ms(step.bandwidth_s)}, "
            f"{_ms(step.compute_s)}) + {_ms(step.allreduce_s)} all-reduce = {_ms(row.tpot_s)}; tokens/s <= "
            f"{b:,} / {_ms(row.tpot_s)} = {row.output_tok_s:,.1f}")


def limit_lines(lim: Limits, curve: Sequence[BoundPoint]) -> list[str]:
    """The time half of the plan: the steps, the curve, one row worked through, and what the bound leaves out."""
    out = _steps(lim) + _table(curve)
    worked = [row for row in curve if row.step is not None]
    if worked:
        shown = max((row for row in worked if row.fits), key=lambda row: row.concurrency, default=worked[0])
        out.append(_worked(lim, shown))
    out.append("peak datasheet throughput and bandwidth, bytes and FLOPs overlapped, no kernel overheads: a "
               "measurement must never beat these (what they leave out: docs/physical-limit.md)")
    return out


def limits_json(lim: Limits, curve: Sequence[BoundPoint]) -> dict[str, Any]:
    """The plan's figures, the GPU row with its sources, the regimes, and the curve's rows."""
    return {**lim.plan.to_dict(), **lim.to_dict(), "curve": [row.to_dict() for row in curve]}
