"""The time bounds on paper: hand-derived figures on round numbers, properties of the physics, MoE and MLA, and a
measured point's share of its bound."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from batchbench.analysis.accelerators import Accelerator, accelerators, find_accelerator
from batchbench.analysis.bound_share import percent, share_of_bound
from batchbench.analysis.bounds import Limits, expected_experts, limits, mean_attended
from batchbench.analysis.planner import PlanError, plan
from batchbench.commands.plan import load_config

GiB = 1 << 30


@functools.cache
def _shipped(name: str) -> dict[str, Any]:
    return load_config(name)[1]


def gpu(**changes: Any) -> Accelerator:
    """A made-up GPU of round figures (1 TB/s, 100 TFLOPS bf16, 200 fp8, 100 GB/s link, 80 GiB)."""
    plain = Accelerator(name="round", aliases=(), nvml_names=(), memory_gb=80, memory_tb_s=1.0, bf16_tflops=100,
                        fp8_tflops=200, link_gb_s=100, link="", note=None, sources={})
    return dataclasses.replace(plain, **changes)


#: A small dense model of round shapes: 2 layers, hidden 1024, 8 heads of 128, 2 KV heads, MLP 4096, vocab 1000.
SMALL = {"num_hidden_layers": 2, "hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 2,
         "head_dim": 128, "intermediate_size": 4096, "vocab_size": 1000}


# --------------------------------------------------------------------------- hand-derived figures


def test_a_decode_step_by_hand() -> None:
    """Parameters a token runs through: attention 2 x (2 x 1024 x 1024 + 2 x 1024 x 256) = 5,242,880, MLP
    2 x 3 x 1024 x 4096 = 25,165,824, output projection 1000 x 1024 = 1,024,000: 31,432,704 (the embedding lookup
    is free). At TP 2 in bf16 a GPU reads 31,432,704 B of weights; KV per token per GPU 2 x 2 layers x 1 head x 128
    x 2 B = 1,024 B; 4 sequences at 100 + 50 / 2 = 125 tokens read 512,000 B. Memory: 31,944,704 B / 1e12 B/s;
    compute: 2 x 31,432,704 x 4 / 2 FLOPs at 100 TFLOPS plus attention 4 x 125 x 2 layers x 2 x 8 heads x 256 / 2;
    all-reduce: 2 x 2 layers x 2 (2 - 1) / 2 x 4 x 1024 x 2 B / 100 GB/s."""
    step = limits(SMALL, gpu(), prompt_len=100, output_len=50, tp=2).decode_step(4)
    assert step.weight_bytes == 31_432_704 and step.kv_bytes == 512_000
    assert step.linear_flops == 125_730_816 and step.attention_flops == 2_048_000
    assert step.bandwidth_s == pytest.approx(31_944_704 / 1e12)
    assert step.compute_s == pytest.approx((125_730_816 + 2_048_000) / 100e12)
    assert step.allreduce_s == pytest.approx(2 * 2 * 1 * 4 * 1024 * 2 / 100e9)
    assert step.seconds == pytest.approx(31_944_704 / 1e12 + 32_768 / 100e9) and step.bound == "bandwidth"


def test_a_prefill_by_hand() -> None:
    """1000 prompt tokens at TP 1, fp8 weights: linear 2 x ((31,432,704 - 1,024,000) x 1000 + 1,024,000) FLOPs at the
    fp8 peak (the output projection runs for the last token only), causal attention 2 x 8 x 256 x 2 layers x
    500,500 pairs at the bf16 peak (bf16 KV); bytes 31,432,704 of weights and 1000 x 2,048 B of KV written."""
    pre = limits(SMALL, gpu(), prompt_len=1000, output_len=50, weight_dtype="fp8").prefill()
    linear = 2 * ((31_432_704 - 1_024_000) * 1000 + 1_024_000)
    assert pre.linear_flops == linear and pre.attention_flops == 2 * 8 * 256 * 2 * 500_500
    assert pre.compute_s == pytest.approx(linear / 200e12 + pre.attention_flops / 100e12)
    assert pre.bandwidth_s == pytest.approx((31_432_704 + 1000 * 2048) / 1e12)
    assert pre.allreduce_s == 0 and pre.bound == "compute" and pre.seconds == pre.compute_s


def test_the_ridge_of_a_short_context_by_hand() -> None:
    """TP 1, bf16, 1+2 tokens (mean context 2): per sequence compute 2 x 31,432,704 / 100e12 + attention
    2 x 2 x 2 x 8 x 256 / 100e12 s, KV 2 x 2,048 / 1e12 s; weights 62,865,408 B / 1e12. The ridge is the least B
    with B x (compute - KV) >= weights: 62,865,408e-12 / (628,654,08e-13 + 163.84e-12 ... ) by the exact sums."""
    lim = limits(SMALL, gpu(), prompt_len=1, output_len=2)
    per_seq = (2 * 31_432_704 + 2 * 2 * 2 * 8 * 256) / 100e12 - 2 * 2048 / 1e12
    assert lim.ridge() == math.ceil(62_865_408 / 1e12 / per_seq)
    assert lim.decode_step(lim.ridge() - 1).bound == "bandwidth" == lim.decode_step(1).bound
    assert lim.decode_step(lim.ridge()).bound == "compute"


def test_long_contexts_never_turn_compute_bound() -> None:
    """Llama-3-70B at 4k on an H100: one sequence's KV reads (3,750 x 163,840 B at TP 2) take longer than its
    FLOPs, so no batch is compute-bound."""
    lim = limits(_shipped("Llama-3-70B"), find_accelerator("H100"), prompt_len=3500, output_len=500, tp=2,
                 weight_dtype="fp8")
    assert lim.ridge() is None
    assert all(lim.decode_step(b).bound == "bandwidth" for b in (1, 64, 10_000))


def test_past_the_fit_the_bound_is_the_resident_batchs() -> None:
    lim = limits(_shipped("Llama-3-70B"), find_accelerator("H100"), prompt_len=5000, output_len=500, tp=2,
                 weight_dtype="fp8")
    fit = lim.plan.workload_fit
    assert fit == 46 and lim.plan.memory_bound_from == 47
    assert lim.resident == math.floor(lim.plan.kv_capacity_tokens / 5250) == 48
    last, over, far = lim.curve([fit, fit + 1, 10_000])
    assert (last.bound, last.fits, last.running) == ("bandwidth", True, 46)
    assert (over.bound, over.fits, over.running) == ("kv", False, 47)
    assert (far.bound, far.running) == ("kv", 48) and far.tpot_s == lim.decode_step(48).seconds


def test_nothing_fits_is_an_answer() -> None:
    """Mixtral-8x7B in bf16 (93 GB) on one 80 GiB H100: every row is memory-bound and no token comes out."""
    row = limits(_shipped("Mixtral-8x7B"), find_accelerator("H100"), prompt_len=100, output_len=100).point(1)
    assert (row.bound, row.running, row.tpot_s, row.output_tok_s, row.step) == ("kv", 0, None, 0.0, None)
    assert row.ttft_s > 0


def test_an_output_of_one_token_has_no_tpot() -> None:
    with pytest.raises(PlanError, match="at least 2 tokens"):
        limits(SMALL, gpu(), prompt_len=10, output_len=1)


# --------------------------------------------------------------------------- MoE and MLA


def test_mixtral_active_parameters_are_the_cards_12_9b() -> None:
    """2 of 8 experts per token: with the embedding, 12.9B active of 46.7B (Mistral's model card)."""
    lim = limits(_shipped("Mixtral-8x7B"), find_accelerator("H200"), prompt_len=100, output_len=100)
    assert lim.shape.active_parameters + lim.plan.parameters.embedding == pytest.approx(12.9e9, rel=0.01)


def test_deepseek_v3_active_parameters_are_the_cards_37b() -> None:
    """8 of 256 routed experts and the shared one: 37B activated of 671B (DeepSeek's model card); MLA decodes over
    the 576-wide latent and prefills over 192-wide heads, and every GPU reads all of the latent."""
    lim = limits(_shipped("DeepSeek-V3"), find_accelerator("H200"), prompt_len=1000, output_len=100, tp=8,
                 weight_dtype="fp8")
    assert lim.shape.active_parameters + lim.plan.parameters.embedding == pytest.approx(37e9, rel=0.03)
    assert lim.shape.decode_widths == (576, 512) and lim.shape.prefill_widths == (192, 128)
    assert lim.decode_step(1).kv_bytes == pytest.approx(1050 * 61 * 576 * 2)


def test_a_batch_touches_experts_as_uniform_routing_expects() -> None:
    """One token reads its 2 experts of 8 a layer; many tokens read all 8 (every matrix but the embedding, whose
    lookup is free); the weights read grow with the batch."""
    lim = limits(_shipped("Mixtral-8x7B"), find_accelerator("H200"), prompt_len=100, output_len=100, tp=2)
    moe = lim.shape.experts
    assert moe is not None and (moe.moe_layers, moe.routed) == (32, 8)
    assert lim.shape.parameters_read(1) == pytest.approx(lim.shape.active_parameters)
    par = lim.plan.parameters
    assert lim.shape.parameters_read(10_000) == pytest.approx(par.total - par.norms - par.embedding)
    assert lim.decode_step(1).weight_bytes < lim.decode_step(4).weight_bytes < lim.decode_step(64).weight_bytes


def test_a_moe_config_without_experts_per_token_names_it() -> None:
    cfg = {k: v for k, v in _shipped("Mixtral-8x7B").items() if k != "num_experts_per_tok"}
    with pytest.raises(PlanError, match="'num_experts_per_tok'"):
        limits(cfg, find_accelerator("H200"), prompt_len=10, output_len=10)


@given(st.integers(1, 512), st.integers(1, 16), st.floats(1, 1e6))
def test_expected_experts_is_between_one_tokens_and_all(routed: int, per_token: int, tokens: float) -> None:
    assume(per_token <= routed)
    touched = expected_experts(routed, per_token, tokens)
    assert per_token - 1e-9 <= touched <= min(routed, per_token * tokens) + 1e-9
    assert expected_experts(routed, per_token, tokens + 1) >= touched


# --------------------------------------------------------------------------- the context a step reads


@given(st.integers(1, 3000), st.integers(2, 600), st.one_of(st.none(), st.integers(1, 4000)), st.integers(1, 8))
def test_mean_attended_is_the_mean_over_the_steps(prompt: int, output: int, window: int | None, layers: int) -> None:
    windowed = 0 if window is None else layers // 2
    steps = [prompt + t - 1 for t in range(2, output + 1)]
    per_step = [((layers - windowed) * n + windowed * (n if window is None else min(n, window))) / layers
                for n in steps]
    assert mean_attended(prompt, output, window, windowed, layers) == pytest.approx(sum(per_step) / len(per_step))


# --------------------------------------------------------------------------- properties of the physics

MODELS = ["Llama-3-8B", "Llama-3-70B", "Llama-3.1-405B", "Qwen2.5-72B", "Mixtral-8x7B", "DeepSeek-V3"]


@st.composite
def setups(draw: st.DrawFn) -> Limits:
    """A shipped model on a GPU of the table, a TP its heads divide, dtypes, and a workload within its context."""
    name = draw(st.sampled_from(MODELS))
    prompt, output = draw(st.integers(1, 6000)), draw(st.integers(2, 2000))
    assume(prompt + output <= 8192)
    dtypes = st.sampled_from(["bf16", "fp8"])
    return limits(_shipped(name), draw(st.sampled_from(accelerators())), model=name, prompt_len=prompt,
                  output_len=output, tp=draw(st.sampled_from([1, 2, 4, 8])), weight_dtype=draw(dtypes),
                  kv_dtype=draw(dtypes), memory_bytes=draw(st.sampled_from([None, 1 << 42])))


batches = st.integers(1, 4096)


@given(setups(), batches, batches)
def test_more_sequences_never_make_a_step_faster_nor_fewer_tokens(lim: Limits, a: int, b: int) -> None:
    small, large = sorted((a, b))
    low, high = lim.point(small), lim.point(large)
    if low.tpot_s is not None and high.tpot_s is not None:
        assert low.tpot_s <= high.tpot_s * (1 + 1e-12)
    assert low.output_tok_s <= high.output_tok_s * (1 + 1e-12)
    step_low, step_high = lim.decode_step(small), lim.decode_step(large)
    assert step_low.seconds <= step_high.seconds and small / step_low.seconds <= large / step_high.seconds * (1 + 1e-12)


@given(setups(), batches)
def test_bandwidth_bound_below_the_ridge_compute_bound_from_it(lim: Limits, batch: int) -> None:
    ridge = lim.ridge()
    expected = "bandwidth" if ridge is None or batch < ridge else "compute"
    assert lim.decode_step(batch).bound == expected


@given(setups(), batches)
def test_kv_reads_pass_the_weights_from_the_balance_on(lim: Limits, batch: int) -> None:
    step = lim.decode_step(batch)
    assert (step.kv_bytes >= step.weight_bytes) == (batch >= lim.kv_balance())


@given(setups(), batches)
def test_a_faster_gpu_never_raises_a_bound(lim: Limits, batch: int) -> None:
    for faster in ({"memory_tb_s": 2 * lim.gpu.memory_tb_s}, {"link_gb_s": 2 * lim.gpu.link_gb_s},
                   {"bf16_tflops": 2 * lim.gpu.bf16_tflops}):
        quick = dataclasses.replace(lim, gpu=dataclasses.replace(lim.gpu, **faster))
        assert quick.decode_step(batch).seconds <= lim.decode_step(batch).seconds
        assert quick.prefill().seconds <= lim.prefill().seconds
    doubled = dataclasses.replace(lim, gpu=dataclasses.replace(lim.gpu, memory_tb_s=2 * lim.gpu.memory_tb_s))
    assert doubled.decode_step(batch).bandwidth_s == pytest.approx(lim.decode_step(batch).bandwidth_s / 2)


@given(setups(), batches)
def test_the_kv_onset_is_the_planners(lim: Limits, batch: int) -> None:
    """The curve turns memory-bound exactly where the planner, run on its own, says the workload does."""
    p = lim.plan
    planned = plan(_shipped(p.model), memory_bytes=p.memory_bytes, tp=p.tp, weight_dtype=p.weight_dtype,
                   kv_dtype=p.kv_dtype, prompt_len=p.prompt_len, output_len=p.output_len)
    assert planned.memory_bound_from is not None
    row = lim.point(batch)
    assert (row.bound == "kv") == (batch >= planned.memory_bound_from) == (not row.fits)
    assert row.running <= max(planned.workload_fit or 0, lim.resident)


@given(setups(), batches)
def test_the_step_is_at_least_each_of_its_parts(lim: Limits, batch: int) -> None:
    step = lim.decode_step(batch)
    assert step.seconds >= step.weight_bytes / lim.gpu.bandwidth
    assert step.seconds >= step.linear_flops / lim.gpu.peak_flops("fp8")
    assert (step.allreduce_s > 0) == (lim.plan.tp > 1)


# --------------------------------------------------------------------------- a measured point's share


def curve_70b() -> tuple[Limits, Any]:
    lim = limits(_shipped("Llama-3-70B"), find_accelerator("H100"), prompt_len=5000, output_len=500, tp=2,
                 weight_dtype="fp8")
    return lim, lim.curve([1, 32, 100])


def test_a_share_reads_as_a_sentence() -> None:
    _, curve = curve_70b()
    row = curve[1]
    share = share_of_bound(curve, 32, output_tok_s=0.41 * row.output_tok_s)
    assert share.output_tok_s_share == pytest.approx(0.41) and share.tpot_share is None
    assert share.sentence() == "41% of the memory-bandwidth limit at batch 32" and not share.beats_bound
    by_tpot = share_of_bound(curve, 32, tpot_s=row.tpot_s / 0.5)
    assert by_tpot.tpot_share == pytest.approx(0.5) and by_tpot.sentence().startswith("50% of the memory-bandwidth")
    kv = share_of_bound(curve, 100, output_tok_s=curve[2].output_tok_s / 4, tpot_s=curve[2].tpot_s * 2)
    assert kv.sentence() == "25% of the KV-memory limit at batch 100" and kv.tpot_share == pytest.approx(0.5)


def test_a_share_past_the_limit_says_the_inputs_are_wrong() -> None:
    _, curve = curve_70b()
    share = share_of_bound(curve, 1, output_tok_s=curve[0].output_tok_s * 1.2)
    assert share.beats_bound and "past the limit" in share.sentence()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"concurrency": 32}, "output tokens/s or its TPOT"),
    ({"concurrency": 32, "tpot_s": 0.0}, "tpot_s must be more than 0"),
    ({"concurrency": 7, "output_tok_s": 10.0}, "no row at concurrency 7 \\(it has 1, 32, 100\\)"),
])
def test_a_share_names_what_it_cannot_compare(kwargs: dict[str, Any], message: str) -> None:
    _, curve = curve_70b()
    with pytest.raises(ValueError, match=message):
        share_of_bound(curve, **kwargs)


def test_no_share_where_nothing_fits() -> None:
    curve = limits(_shipped("Mixtral-8x7B"), find_accelerator("H100"), prompt_len=100, output_len=100).curve([1])
    with pytest.raises(ValueError, match="not one sequence fits"):
        share_of_bound(curve, 1, output_tok_s=5.0, tpot_s=0.1)


def test_a_share_under_one_percent_keeps_two_figures() -> None:
    assert percent(0.41) == "41%" and percent(0.01) == "1%"
    assert percent(0.00011850889) == "0.012%" and percent(0.0009) == "0.09%"
