"""Multi-LoRA without an engine: adapters made here, the traffic split, the engine mapping and refusals, fairness."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from safetensors.numpy import load_file

from batchbench.adapters.prometheus import Samples
from batchbench.adapters.registry import EngineOptions, engine_names, make_engine
from batchbench.adapters.vllm import VLLMEngine
from batchbench.cli import main
from batchbench.core.config import BatchingConfig, LoadConfig, ModelRef
from batchbench.core.exits import EXIT_USAGE
from batchbench.core.records import RequestRecord
from batchbench.fixtures import tiny_model_dir
from batchbench.fixtures.protocol.vllm import VLLMServer
from batchbench.load.runner import run
from batchbench.measures.metrics import jain_index, summarize
from batchbench.reports.build import build_report
from batchbench.results import document as results
from batchbench.workload.lora import Lora, LoraSpec, make_lora, materialize
from batchbench.workload.requests import Arrival, Lengths, WorkloadSpec, split_traffic

MODEL = ModelRef("tiny", max_model_len=512)
allocations = st.lists(st.one_of(st.just(0.0), st.floats(min_value=1e-6, max_value=1e9)),
                       min_size=1, max_size=20).filter(any)


@given(allocations)
def test_jain_index_lies_between_one_over_n_and_one(values: list[float]) -> None:
    assert 1 / len(values) - 1e-12 <= jain_index(values) <= 1.0


@given(allocations, st.floats(min_value=1e-3, max_value=1e3))
def test_jain_index_does_not_change_with_scale(values: list[float], scale: float) -> None:
    assert jain_index([v * scale for v in values]) == pytest.approx(jain_index(values), rel=1e-9)


@given(st.floats(min_value=1e-6, max_value=1e6), st.integers(1, 20))
def test_jain_index_is_one_for_equal_shares(value: float, n: int) -> None:
    assert jain_index([value] * n) == pytest.approx(1.0)


@given(allocations)
def test_jain_index_is_one_only_for_equal_shares(values: list[float]) -> None:
    if max(values) > min(values) * (1 + 1e-6):
        assert jain_index(values) < 1.0


def test_jain_index_of_one_taking_everything_is_one_over_n() -> None:
    assert jain_index([3.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="all-zero"):
        jain_index([0.0, 0.0])


@given(st.lists(st.floats(min_value=0.1, max_value=10), min_size=1, max_size=6), st.integers(1, 200))
def test_the_split_gives_each_adapter_its_share_at_every_prefix(weights: list[float], n: int) -> None:
    names = tuple(f"a{i}" for i in range(len(weights)))
    order = split_traffic(names, tuple(weights), n)
    total = sum(weights)
    for prefix in (n // 2, n):
        for name, w in zip(names, weights):
            assert abs(order[:prefix].count(name) - w / total * prefix) < len(names)


def test_an_even_split_is_round_robin_and_no_adapters_means_the_base_model() -> None:
    assert split_traffic(("a", "b", "c"), (), 7) == ["a", "b", "c", "a", "b", "c", "a"]
    assert split_traffic((), (), 3) == [None, None, None]
    wl = WorkloadSpec("w", 4, loras=("a", "b")).build()
    assert [r.lora for r in wl.requests] == ["a", "b", "a", "b"]
    assert WorkloadSpec("w", 4).build().hash() != wl.hash()


def test_a_made_adapter_is_peft_format_at_its_rank_and_the_same_for_the_same_seed(tmp_path: Path) -> None:
    a = make_lora(tiny_model_dir(), tmp_path / "a", "a", 32, seed=1)
    b = make_lora(tiny_model_dir(), tmp_path / "b", "a", 32, seed=1)
    config = json.loads((a.path / "adapter_config.json").read_text())
    assert config["r"] == 32 and config["peft_type"] == "LORA"
    tensors = load_file(str(a.path / "adapter_model.safetensors"))
    q_a = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    v_b = tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    assert q_a.shape == (32, 256) and v_b.shape == (128, 32)  # v_proj out: 2 KV heads x 64
    assert (a.path / "adapter_model.safetensors").read_bytes() == (b.path / "adapter_model.safetensors").read_bytes()


def test_adapters_on_the_command_line_are_ranks_to_make_or_directories(tmp_path: Path) -> None:
    specs = LoraSpec.parse_list(f"8,64,mine={tmp_path / 'a'}")
    assert [(s.name, s.rank) for s in specs[:2]] == [("lora-0-r8", 8), ("lora-1-r64", 64)]
    make_lora(tiny_model_dir(), tmp_path / "a", "mine", 16)
    made = materialize(specs, tiny_model_dir(), tmp_path / "made")
    assert [a.rank for a in made] == [8, 64, 16]
    for bad in ("0", "x", "a=", "8,a=b,a=c"):
        with pytest.raises(ValueError, match="--lora-adapters"):
            LoraSpec.parse_list(bad)


def test_vllm_serves_adapters_with_its_own_lora_flags(tmp_path: Path) -> None:
    loras = (Lora("a", tmp_path / "a", 8), Lora("b", tmp_path / "b", 64))
    engine = VLLMEngine(BatchingConfig(max_loras=2, max_lora_rank=64), model=MODEL, launch=object(),  # type: ignore[arg-type]
                        loras=loras)
    args = engine.server_args(engine.batching, host="h", port=1)
    assert "--enable-lora" in args
    assert args[args.index("--max-loras") + 1] == "2" and args[args.index("--max-lora-rank") + 1] == "64"
    modules = args[args.index("--lora-modules") + 1:]
    assert [json.loads(m)["name"] for m in modules] == ["a", "b"]
    plain = VLLMEngine(model=MODEL, launch=object())  # type: ignore[arg-type]
    assert "--enable-lora" not in plain.server_args(plain.batching, host="h", port=1)


def test_a_rank_above_max_lora_rank_is_refused_by_name_before_any_engine_starts(tmp_path: Path) -> None:
    big = (Lora("big", tmp_path, 64),)
    options = EngineOptions(loras=big)
    with pytest.raises(ValueError, match=r"'big' has rank 64, above BatchingConfig.max_lora_rank=32"):
        make_engine("vllm", BatchingConfig(max_lora_rank=32), options)
    with pytest.raises(ValueError, match=r"max_lora_rank=16, the engine's default"):
        make_engine("vllm", None, options)
    with pytest.raises(ValueError, match=r"max_lora_rank=48 \(--max-lora-rank\) must be one of"):
        VLLMEngine.check_config(BatchingConfig(max_lora_rank=48))


@pytest.mark.parametrize("name", [n for n in engine_names() if n != "vllm"])
def test_engines_without_a_lora_mapping_refuse_it_by_name(name: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_loras"):
        make_engine(name, BatchingConfig(max_loras=2, mode="static" if name == "hf-static" else "continuous"),
                    EngineOptions(urls=((name, "http://x.test"),)))
    with pytest.raises(ValueError, match="cannot serve LoRA adapters"):
        make_engine(name, None, EngineOptions(loras=(Lora("a", tmp_path, 8),)))


def test_batching_parses_the_lora_knobs() -> None:
    config = BatchingConfig.parse("max_loras=4,max_lora_rank=64")
    assert config == BatchingConfig(max_loras=4, max_lora_rank=64) and config.label().endswith("loras4-lorarank64")
    with pytest.raises(ValueError, match="max_loras"):
        BatchingConfig(max_loras=0)


def test_vllm_lora_gauges_are_read() -> None:
    text = (
        '# TYPE vllm:lora_requests_info gauge\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 100.0\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="b,a",waiting_lora_adapters="b,a"} 200.0\n'
        '# TYPE vllm:num_requests_waiting_by_reason gauge\n'
        'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 1.0\n'
        'vllm:num_requests_waiting_by_reason{engine="0",reason="deferred"} 3.0\n'
    )
    metrics = VLLMEngine(model=MODEL, url="http://vllm.test").normalize(Samples.parse(text))
    assert metrics.loras_active == ["a", "b"] and metrics.waiting_deferred == 3.0


def test_the_summary_is_split_by_adapter_with_its_fairness() -> None:
    def record(i: int, lora: str, e2e: float) -> RequestRecord:
        return RequestRecord(f"r{i}", 4, 10, scheduled_s=0.0, sent_s=0.0, done_s=e2e, chunk_times=[e2e / 2, e2e],
                             chunk_tokens=[5, 5], ok=True, lora=lora)

    summary = summarize([record(0, "a", 1.0), record(1, "a", 1.0), record(2, "b", 3.0)], duration_s=3.0)
    assert summary.loras is not None and summary.loras["a"].requests == 2
    assert summary.loras["a"].request_speed == pytest.approx(10.0)
    assert summary.loras["b"].output_token_throughput == pytest.approx(10 / 3)
    assert summary.lora_fairness == pytest.approx(jain_index([10.0, 10 / 3]))
    assert summarize([RequestRecord("x", 4, 1, 0.0)], duration_s=1.0).loras is None


@pytest.mark.parametrize("command", [["bench"], ["capacity", "--slo", "ttft_p99=200ms"]])
def test_the_cli_refuses_a_rank_above_max_lora_rank_before_anything_starts(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    code = main([*command, "--engine", "vllm", "--lora-adapters", "8,64", "--batching", "max_lora_rank=32",
                 "--results-dir", str(tmp_path / "results")])
    assert code == EXIT_USAGE and not (tmp_path / "results").exists()
    assert "'lora-1-r64' has rank 64, above BatchingConfig.max_lora_rank=32" in capsys.readouterr().err


async def test_a_run_with_adapters_reports_each_adapters_share_and_their_fairness(tmp_path: Path) -> None:
    """Records carry the adapter each request asked for (the payload's model), the summary splits by adapter, and
    the report shows the per-adapter table with Jain's index."""
    server = VLLMServer(model="fake-model", token_delay=0.001, max_running=64, max_queue=64, kv_capacity_tokens=4096,
                        loras=("a8", "b16"))
    await server.start_async()
    try:
        wl = WorkloadSpec("lora", 12, prompt=Lengths.fixed(8), output=Lengths.fixed(4),
                          arrival=Arrival("closed", concurrency=4), loras=("a8", "b16"),
                          lora_weights=(2.0, 1.0)).build()
        async with VLLMEngine(model=ModelRef("fake-model"), url=server.url, startup_timeout=10.0) as engine:
            result = await run(engine, wl, results_dir=tmp_path / "runs", load=LoadConfig(request_timeout_s=10.0))
    finally:
        await server.stop_async()
    summary = results.load(result.path).footer.summary  # type: ignore[union-attr]
    assert summary is not None and summary.loras is not None
    assert {name: a.requests for name, a in summary.loras.items()} == {"a8": 8, "b16": 4}
    assert summary.lora_fairness is not None and 0.5 <= summary.lora_fairness <= 1.0
    build_report(tmp_path / "runs", tmp_path / "report")
    report = (tmp_path / "report" / "report.md").read_text(encoding="utf-8")
    assert "LoRA adapters" in report and "Jain's index" in report and "b16" in report
