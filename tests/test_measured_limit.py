"""Measured points against the physical limit on paper: runs on a (fake-NVML) H100 get each point's share of its
bound in the findings, the report's evidence and the headline figure; a CPU run's report says there is no GPU row
and why."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from batchbench.analysis.accelerators import find_accelerator
from batchbench.analysis.bounds import limits
from batchbench.analysis.findings import findings_from_documents
from batchbench.analysis.run_bounds import run_limit
from batchbench.cli import main
from batchbench.core import codec
from batchbench.core.config import EngineDescription
from batchbench.fixtures import tiny_model_dir
from batchbench.measures.gpu import GpuDevice, GpuOptions, GpuSelection
from batchbench.reports.build import build_report, load_rows
from batchbench.reports.headline import BoundMark, HeadlinePoint, headline_svg
from batchbench.results.document import RunDocument, load
from batchbench.workload.requests import TokenCounts
from tests.fake_nvml import FakeGpu, fake_nvml
from tests.synthetic_runs import sweep

H100_NVML = "NVIDIA H100 80GB HBM3"
LEVELS = (1, 4)


async def _runs_on_a_fake_h100(results: Path, nvml_name: str = H100_NVML) -> list[Path]:
    """The tiny model served by the fake vLLM protocol server at concurrencies 1 and 4, its GPU an H100 to NVML
    (or ``nvml_name``)."""
    from batchbench.adapters.vllm import VLLMEngine
    from batchbench.core.config import LoadConfig, ModelRef
    from batchbench.fixtures.protocol.vllm import VLLMServer
    from batchbench.load.runner import run
    from batchbench.workload.requests import Arrival, Lengths, WorkloadSpec

    server = VLLMServer(model="tiny-llama", token_delay=0.002)
    await server.start_async()
    paths = []
    try:
        async with VLLMEngine(model=ModelRef("tiny-llama"), url=server.url) as engine:
            for c in LEVELS:
                wl = WorkloadSpec(f"c{c}", 4 * c, prompt=Lengths.fixed(8), output=Lengths.fixed(16),
                                  arrival=Arrival("closed", concurrency=c)).build()
                result = await run(engine, wl, results_dir=results, load=LoadConfig(scrape_interval_s=0.05),
                                   gpu=GpuOptions(nvml=fake_nvml([FakeGpu(name=nvml_name)])))
                paths.append(result.path)
    finally:
        await server.stop_async()
    return paths


async def test_a_report_of_runs_on_an_h100_gives_each_points_share_of_its_bound(tmp_path: Path) -> None:
    results = tmp_path / "results"
    paths = await _runs_on_a_fake_h100(results)
    docs = [load(p) for p in paths]
    assert all(d.header.gpus is not None and d.header.gpus.devices[0].name == H100_NVML for d in docs)

    built = build_report(results, tmp_path / "report")
    layout = json.loads((tmp_path / "report" / "report.json").read_text(encoding="utf-8"))[
        "findings"]["engines"]["vllm"]["layouts"]["continuous"]
    assert layout["limit"]["setup"] == {
        "gpu": "H100 SXM", "gpu_source": f"NVML: {H100_NVML}", "model": "tiny-llama", "tp": 1,
        "weight_dtype": "bf16", "kv_dtype": "bf16", "prompt_len": 8, "output_len": 16}
    # Each point's share is its measured figures against the bound recomputed here from the same inputs.
    config = json.loads((tiny_model_dir() / "config.json").read_text(encoding="utf-8"))
    curve = limits(config, find_accelerator("H100"), prompt_len=8, output_len=16, memory_fraction=1.0).curve(LEVELS)
    assert built.findings is not None
    f = built.findings.layout("vllm", "continuous")
    assert f is not None
    for point, bound in zip(layout["points"], curve, strict=True):
        share, measured = point["limit"], f.point(bound.concurrency)
        assert measured is not None and share["bound"] == bound.bound == "bandwidth"
        assert share["output_tok_s_bound"] == pytest.approx(bound.output_tok_s)
        assert share["tpot_s_bound"] == pytest.approx(bound.tpot_s)
        tok, tpot = measured.figure("output_tok_s"), measured.figure("tpot_p50_s")
        assert tok is not None and tpot is not None
        assert share["output_tok_s_share"] == pytest.approx(tok.value / bound.output_tok_s)
        assert share["tpot_share"] == pytest.approx(bound.tpot_s / tpot.value)
        # A fake server on a CPU is far from an H100's limit, and never past it.
        assert 0 < share["share"] < 0.01 and not share["beats_bound"]
        assert share["sentence"].endswith(f"of the memory-bandwidth limit at batch {bound.concurrency}")

    markdown = (tmp_path / "report" / "report.md").read_text(encoding="utf-8")
    (detail,) = [d for d in built.findings.details if "against the limit on paper" in d]
    assert detail.startswith(f"vllm, continuous, against the limit on paper (1 x H100 SXM (NVML: {H100_NVML}), "
                             "tiny-llama, bf16 weights, bf16 KV, 8 + 16 tokens): ")
    assert f"{layout['points'][1]['limit']['sentence']}" in detail and detail in markdown
    assert "| Of the limit |" in markdown and "(bandwidth) |" in markdown
    assert "dashed the limit on paper (1 x H100 SXM" in markdown
    html = (tmp_path / "report" / "report.html").read_text(encoding="utf-8")
    assert "limit on paper, 1 x H100 SXM" in html  # the headline figure's legend names the bound's line


async def test_compare_of_runs_on_two_gpus_gives_each_its_share_of_its_own_limit(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The same runs measured "on" an H100 and an A100: ``compare`` names the GPUs as what differs, and sets each
    series' share of the limit of the GPU it ran on beside the other's; the shares are the runs' own."""
    on_h100, on_a100 = tmp_path / "h100", tmp_path / "a100"
    await _runs_on_a_fake_h100(on_h100)
    await _runs_on_a_fake_h100(on_a100, "NVIDIA A100-SXM4-80GB")
    assert main(["compare", str(on_h100), str(on_a100), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert "engine_gpus: NVIDIA H100 80GB HBM3 -> NVIDIA A100-SXM4-80GB" in found["environment_differences"]
    lines = found["limit_shares"]
    assert len(lines) == len(LEVELS), lines
    for line in lines:
        assert line.startswith("vllm ") and " of its limit on paper (bandwidth; 1 x H100 SXM " in line
        assert "-> " in line and "(bandwidth; 1 x A100 " in line
    # Each run's share is its own output tokens/s over the bound at its batch size on its GPU.
    rows = [r for r in json.loads(json.dumps(load_rows(on_a100, None, print)))]
    for row in rows:
        share = row["of_limit"]
        assert share["bound"] == "bandwidth" and 0 < share["share"] < 1 and "A100" in share["setup"]
    assert main(["compare", str(on_h100), str(on_a100)]) == 0
    assert "each against the limit on paper of the GPU it ran on" in capsys.readouterr().out


def _on_gpu(doc: RunDocument, name: str, **engine: object) -> RunDocument:
    """A synthetic run as if the tiny model had run on the GPU NVML calls ``name``, ``engine`` added to its
    description; its workload 16 + 10 tokens a request."""
    h = doc.header
    workload = dataclasses.replace(h.workload, num_requests=240, prompt_tokens=TokenCounts(240 * 16, 16, 16),
                                   output_tokens=TokenCounts(2400, 10, 10))
    header = dataclasses.replace(
        h, gpus=GpuSelection([GpuDevice(0, name, "GPU-1")], "every visible GPU"), workload=workload,
        engine=EngineDescription.of(codec.encode(h.engine) | {"model": {"path": "tiny-llama"}, **engine}))
    return dataclasses.replace(doc, header=header)


def test_the_servers_arguments_give_tp_and_dtypes_and_a_gpu_given_replaces_nvmls() -> None:
    (doc,) = sweep((8,))
    argv = ["--model", "x", "--tensor-parallel-size", "2", "--dtype", "float16", "--kv-cache-dtype=fp8"]
    found, why = run_limit(_on_gpu(doc, H100_NVML, server_args=argv), {
        **json.loads((tiny_model_dir() / "config.json").read_text(encoding="utf-8"))})
    assert why is None and found is not None
    s = found.setup
    assert (s.tp, s.weight_dtype, s.kv_dtype, s.prompt_len, s.output_len) == (2, "fp16", "fp8", 16, 10)
    assert found.limits.plan.tp == 2 and found.limits.plan.kv_dtype == "fp8"
    assert s.command().startswith("batchbench plan --model tiny-llama --gpu 'H100 SXM' --tp 2 --weight-dtype fp16 "
                                  "--kv-dtype fp8")
    # --gpu NAME (an engine at a URL): the row given, whatever NVML named.
    given = findings_from_documents([_on_gpu(doc, "NVIDIA GeForce RTX 4090")], gpu=find_accelerator("H200"))
    f = given.layout("alpha", "continuous")
    assert f is not None and f.limit is not None and f.limit.setup is not None
    assert f.limit.setup.gpu_source == "--gpu H200" and set(f.limit.points) == {8}


def test_a_gpu_the_table_does_not_list_is_said_not_guessed() -> None:
    found = findings_from_documents([_on_gpu(d, "NVIDIA GeForce RTX 4090") for d in sweep((1, 8))])
    f = found.layout("alpha", "continuous")
    assert f is not None and f.limit is not None and f.limit.setup is None and f.limit.points == {}
    assert ("alpha: no limit on paper beside its curves: no GPU row: its GPU, NVIDIA GeForce RTX 4090, is not in the "
            "accelerators table (fixtures/accelerators.toml).") in found.details


def test_a_cpu_runs_report_says_there_is_no_gpu_row_and_why(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    for doc in sweep((1, 2, 4)):
        selection = GpuSelection([], "not read", "no NVML: NVML Shared Library Not Found")
        doc = dataclasses.replace(doc, header=dataclasses.replace(doc.header, gpus=selection))
        (results / f"{doc.header.run_id}.json").write_text(doc.to_json(), encoding="utf-8")
    built = build_report(results, tmp_path / "report", plots=False)
    assert built.findings is not None
    line = ("alpha: no limit on paper beside its curves: no GPU row: the engine ran on this host's CPU (no NVML: "
            "NVML Shared Library Not Found).")
    assert [d for d in built.findings.details if "limit on paper" in d] == [line]
    markdown = (tmp_path / "report" / "report.md").read_text(encoding="utf-8")
    assert line in markdown and "Of the limit" not in markdown
    layout = json.loads((tmp_path / "report" / "report.json").read_text(encoding="utf-8"))[
        "findings"]["engines"]["alpha"]["layouts"]["continuous"]
    assert layout["limit"] == {"setup": None, "no_limit": line.split("curves: ")[1].rstrip(".")}
    assert all(p["limit"] is None for p in layout["points"])


def test_the_headline_draws_the_bound_beside_the_curve_only_when_given() -> None:
    points = [HeadlinePoint(c, (100.0 * c,) * 3, (0.05 * c,) * 3) for c in (1, 2, 4)]
    bound = [BoundMark(c, 400.0 * c, 0.01) for c in (1, 2, 4)]
    plain = headline_svg("alpha", points, sweet_spot=None, slo_ttft_p99_s=None, color="C0")
    drawn = headline_svg("alpha", points, sweet_spot=None, slo_ttft_p99_s=None, color="C0", bound=bound,
                         bound_label="limit on paper, 1 x H100 SXM")
    assert plain is not None and drawn is not None
    assert "limit on paper" not in plain and "limit on paper, 1 x H100 SXM" in drawn


def test_report_gpu_names_the_gpu_of_an_engine_at_a_url(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from batchbench import cli

    results = tmp_path / "results"
    results.mkdir()
    for doc in sweep((1, 4)):
        doc = _on_gpu(doc, "not sampled", mode="url")
        doc = dataclasses.replace(doc, header=dataclasses.replace(
            doc.header, gpus=GpuSelection([], "not read", "no NVML: Driver Not Loaded")))
        (results / f"{doc.header.run_id}.json").write_text(doc.to_json(), encoding="utf-8")
    out = tmp_path / "report"
    assert cli.main(["report", str(results), "--out", str(out), "--format", "json"]) == 0
    layout = json.loads((out / "report.json").read_text(encoding="utf-8"))["findings"]["engines"]["alpha"][
        "layouts"]["continuous"]["limit"]
    assert layout == {"setup": None, "no_limit": "no GPU row: the run names no GPU (no NVML: Driver Not Loaded); the "
                                                 "engine is at a URL: --gpu NAME gives its GPU"}
    assert cli.main(["report", str(results), "--out", str(out), "--format", "json", "--gpu", "h100"]) == 0
    layout = json.loads((out / "report.json").read_text(encoding="utf-8"))["findings"]["engines"]["alpha"][
        "layouts"]["continuous"]["limit"]
    assert layout["setup"]["gpu"] == "H100 SXM" and layout["setup"]["gpu_source"] == "--gpu H100 SXM"
    capsys.readouterr()
    for command in ("report", "run", "bench", "capacity"):
        with pytest.raises(SystemExit) as exit_:
            cli.main([command, *([str(results)] if command == "report" else []), "--gpu", "RTX 4090"])
        assert exit_.value.code == 2 and "no GPU named 'RTX 4090': one of H100 SXM" in capsys.readouterr().err


def test_a_gpu_given_to_bench_is_recorded_and_a_later_report_uses_it(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``bench --gpu`` for an engine at a URL: each run records the row (``gpus.declared``), so ``report`` of the
    folder later draws the limit on paper without being told again."""
    from batchbench import cli
    from tests.server_process import serving

    with serving("batchbench.fixtures.protocol", "vllm", "--token-delay", "0.001", "--model", "tiny-llama",
                 "--model-root", str(tiny_model_dir())) as url:
        code = cli.main(["bench", "--engine", "vllm", "--engine-url", url, "--gpu", "h100", "--concurrency", "1,4",
                         "--num-requests", "8", "--results-dir", str(tmp_path / "results"), "--no-report"])
    assert code == 0, capsys.readouterr().err
    (run_dir,) = (tmp_path / "results").glob("bench-*")
    docs = [load(p) for p in sorted(run_dir.glob("vllm_*.json"))]
    assert len(docs) == 2 and all(d.header.gpus is not None and d.header.gpus.declared == "H100 SXM" for d in docs)
    out = tmp_path / "report"
    assert cli.main(["report", str(run_dir), "--out", str(out), "--format", "json"]) == 0
    limit = json.loads((out / "report.json").read_text(encoding="utf-8"))["findings"]["engines"]["vllm"]["layouts"][
        "continuous"]["limit"]
    assert limit["setup"]["gpu"] == "H100 SXM", limit
    assert limit["setup"]["gpu_source"] == "--gpu H100 SXM, given to the run"
