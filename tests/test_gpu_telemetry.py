"""GPU telemetry (batchbench.measures.gpu) against a fake NVML: which GPUs, the run's energy, what it bought."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchbench.core.environment import cuda_visible_devices
from batchbench.measures.gpu import GpuMeter, GpuOptions, GpuTelemetry, energy_of
from batchbench.results import document as results
from batchbench.results.document import load
from batchbench.results.schema import json_schema
from tests.fake_nvml import FakeGpu, fake_nvml

TWO = [FakeGpu(uuid="GPU-aaaa1111-0000", power_w=400.0), FakeGpu(uuid="GPU-bbbb2222-0000", power_w=600.0)]


def measure(meter: GpuMeter, seconds: float) -> GpuTelemetry:
    meter.start(time.perf_counter())
    time.sleep(seconds)
    return meter.stop()


def test_every_visible_gpu_is_sampled_through_the_run_and_the_energy_is_the_counters_growth() -> None:
    nvml = fake_nvml(TWO)
    seen = []
    meter = GpuMeter(None, "CUDA_VISIBLE_DEVICES is not set", interval_s=0.05, on_sample=seen.append, nvml=nvml)
    assert [d.index for d in meter.selection.devices] == [0, 1] and meter.selection.unavailable is None
    assert meter.selection.reason.startswith("every visible GPU")
    started = time.perf_counter()
    telemetry = measure(meter, 0.5)
    elapsed = time.perf_counter() - started
    # Sampled through the run, every GPU at each moment, each handed on as it was taken.
    assert telemetry.samples == len(seen) == len(meter.samples) and telemetry.samples >= 2 * 6
    assert {s.gpu for s in seen} == {0, 1} and seen == sorted(seen, key=lambda s: s.t)
    assert telemetry.energy_source == "energy counter"
    assert telemetry.energy_j == pytest.approx(1000.0 * elapsed, rel=0.1)
    assert telemetry.mean_power_w == pytest.approx(1000.0) and telemetry.peak_power_w == pytest.approx(1000.0)
    assert telemetry.mean_utilization_gpu == 90 and telemetry.mean_utilization_memory == 60
    assert telemetry.peak_memory_used_bytes == 80 * 2**30 and telemetry.mean_sm_clock_mhz == 1980
    assert telemetry.read_errors == 0 and telemetry.unavailable is None
    assert nvml.state["shutdowns"] == 1 and meter.stop() is telemetry  # stopped once, however often asked


def test_the_engines_gpus_are_sampled_by_index_or_uuid_and_an_unknown_id_is_said() -> None:
    devices, setting = cuda_visible_devices({"CUDA_VISIBLE_DEVICES": "1"})
    meter = GpuMeter(devices, f"{setting} for the engine's server", interval_s=1, nvml=fake_nvml(TWO))
    assert [d.uuid for d in meter.selection.devices] == ["GPU-bbbb2222-0000"]
    assert meter.selection.reason == "1: CUDA_VISIBLE_DEVICES=1 for the engine's server"
    by_uuid = GpuMeter(["GPU-aaaa"], "the container's --gpus GPU-aaaa", interval_s=1, nvml=fake_nvml(TWO))
    assert [d.index for d in by_uuid.selection.devices] == [0]
    unknown = GpuMeter(["7"], "CUDA_VISIBLE_DEVICES=7", interval_s=1, nvml=fake_nvml(TWO))
    assert unknown.selection.devices == []
    assert unknown.selection.unavailable == "no GPU sampled: 7 names none of the 2 GPU(s) NVML sees"
    none = GpuMeter([], "CUDA_VISIBLE_DEVICES=", interval_s=1, nvml=fake_nvml(TWO))
    assert none.selection.unavailable == "no GPU sampled: the engine uses none"
    assert measure(none, 0).unavailable == "no GPU sampled: the engine uses none"
    assert cuda_visible_devices({}) == (None, "CUDA_VISIBLE_DEVICES is not set")


def test_without_an_energy_counter_the_power_samples_are_integrated() -> None:
    meter = GpuMeter(None, "all", interval_s=0.05, nvml=fake_nvml([FakeGpu(power_w=300.0, energy_counter=False)]))
    telemetry = measure(meter, 0.5)
    span = meter.samples[-1].t - meter.samples[0].t
    assert telemetry.energy_source == "power samples" and telemetry.read_errors == 0  # "Not Supported" is no error
    assert telemetry.energy_j == pytest.approx(300.0 * span, rel=1e-6)
    assert all(s.energy_j is None and s.power_w == 300.0 for s in meter.samples)


def test_without_nvml_every_field_is_there_and_says_why() -> None:
    meter = GpuMeter(None, "all", interval_s=0.1, nvml=None)  # the real pynvml, or none: no GPU on this host
    if meter.selection.devices:
        pytest.skip("this host has GPUs that NVML sees")
    assert meter.selection.unavailable is not None and meter.selection.unavailable.startswith("no NVML: ")
    telemetry = measure(meter, 0)
    assert telemetry.unavailable == meter.selection.unavailable and telemetry.energy_j is None
    energy = energy_of(telemetry, output_tokens=100, ok_requests=4, duration_s=1.0, gpu_hour_cost=2.0)
    assert energy.tokens_per_joule is None and energy.cost_per_million_output_tokens is None
    assert energy.unavailable == telemetry.unavailable and energy.gpu_hour_cost == 2.0
    broken = GpuMeter(None, "all", interval_s=0.1, nvml=fake_nvml(TWO, init_error="Driver Not Loaded"))
    assert broken.selection.unavailable == "no NVML: Driver Not Loaded"
    off = GpuOptions(enabled=False).meter(None, "all", interval_s=0.1, on_sample=print)
    assert off.selection.unavailable == "GPU telemetry turned off (--no-gpu-telemetry)"


@given(joules=st.floats(1e-3, 1e9), tokens=st.integers(1, 10**9), requests=st.integers(1, 10**6),
       gpus=st.integers(1, 8), duration=st.floats(1e-3, 1e5), price=st.floats(0, 100))
def test_energy_and_cost_per_unit_of_work(joules: float, tokens: int, requests: int, gpus: int, duration: float,
                                          price: float) -> None:
    telemetry = GpuTelemetry(gpus=gpus, energy_j=joules, energy_source="energy counter")
    e = energy_of(telemetry, output_tokens=tokens, ok_requests=requests, duration_s=duration, gpu_hour_cost=price)
    assert e.tokens_per_joule * joules == pytest.approx(tokens)
    assert e.joules_per_request * requests == pytest.approx(joules)
    # What the GPUs' hours over the run cost, spread over the output: back to the price.
    assert e.cost_per_million_output_tokens * tokens / 1e6 == pytest.approx(price * gpus * duration / 3600)
    assert e.unavailable is None
    assert energy_of(telemetry, output_tokens=tokens, ok_requests=requests, duration_s=duration,
                     gpu_hour_cost=None).unavailable == "no --gpu-hour-cost given: no cost figure"


async def test_a_run_records_the_gpus_in_header_samples_footer_and_summary(tmp_path: Path) -> None:
    from batchbench.adapters.vllm import VLLMEngine
    from batchbench.core.config import LoadConfig, ModelRef
    from batchbench.fixtures.protocol.vllm import VLLMServer
    from batchbench.load.runner import run
    from batchbench.workload.requests import Arrival, Lengths, WorkloadSpec

    server = VLLMServer(model="fake-model", token_delay=0.005)
    await server.start_async()
    try:
        wl = WorkloadSpec("gpu", 8, prompt=Lengths.fixed(4), output=Lengths.fixed(16),
                          arrival=Arrival("closed", concurrency=4)).build()
        async with VLLMEngine(model=ModelRef("fake-model"), url=server.url) as engine:
            result = await run(engine, wl, results_dir=tmp_path, load=LoadConfig(scrape_interval_s=0.05),
                               gpu=GpuOptions(gpu_hour_cost=3.5, nvml=fake_nvml([FakeGpu(power_w=700.0)])))
            plain = await run(engine, wl, results_dir=tmp_path, gpu=GpuOptions(enabled=False))
    finally:
        await server.stop_async()
    raw = json.loads(result.path.read_text(encoding="utf-8"))
    assert list(jsonschema.Draft202012Validator(json_schema()).iter_errors(raw)) == []
    doc = load(result.path)
    assert doc.header.gpus is not None and [d.name for d in doc.header.gpus.devices] == ["NVIDIA H200"]
    assert doc.header.gpus.reason.startswith("every visible GPU: the engine is at a URL")
    assert doc.footer is not None and doc.footer.gpu is not None and doc.footer.gpu.samples == len(doc.gpu_samples)
    assert len(doc.gpu_samples) >= 2 and doc.footer.gpu.energy_j == pytest.approx(700 * result.duration_s, rel=0.2)
    energy = doc.footer.summary.energy if doc.footer.summary is not None else None
    assert energy is not None and energy == result.summary.energy
    tokens = sum(r.output_tokens for r in result.records)
    assert tokens == 8 * 16 and energy.tokens_per_joule == pytest.approx(tokens / doc.footer.gpu.energy_j)
    assert energy.joules_per_request == pytest.approx(doc.footer.gpu.energy_j / 8)
    assert energy.cost_per_million_output_tokens == pytest.approx(3.5 * result.duration_s / 3600 / tokens * 1e6)
    # Turned off: the same keys, saying why they are empty.
    off = load(plain.path)
    assert off.gpu_samples == [] and off.footer is not None and off.footer.gpu is not None
    assert off.footer.gpu.unavailable == "GPU telemetry turned off (--no-gpu-telemetry)"
    assert off.footer.summary is not None and off.footer.summary.energy is not None
    assert off.footer.summary.energy.unavailable == off.footer.gpu.unavailable


def _with_energy(doc: results.RunDocument, watts: float, price: float | None) -> results.RunDocument:
    """The document as if its GPU had drawn ``watts`` through the run."""
    assert doc.footer is not None and doc.footer.summary is not None
    s = doc.footer.summary
    telemetry = GpuTelemetry(gpus=1, energy_j=watts * s.duration_s, energy_source="energy counter")
    energy = energy_of(telemetry, output_tokens=round(s.output_token_throughput * s.duration_s), ok_requests=s.ok,
                       duration_s=s.duration_s, gpu_hour_cost=price)
    footer = dataclasses.replace(doc.footer, summary=dataclasses.replace(s, energy=energy), gpu=telemetry)
    return dataclasses.replace(doc, footer=footer)


def test_findings_give_tokens_per_joule_along_the_curve_and_say_why_there_are_none() -> None:
    from batchbench.analysis.findings import findings_from_documents
    from tests.synthetic_runs import sweep

    # Throughput min(c, 8) x 100 tok/s at a power of 300 W + 25 W per busy slot: the most tokens per joule at the fit.
    docs = [_with_energy(d, 300 + 25 * min(d.header.labels.concurrency or 0, 8), 2.0) for d in sweep(repeats=2)]
    found = findings_from_documents(docs)
    point = found.engines["alpha"].layouts["continuous"].point(8)
    assert point is not None and point.figure("tokens_per_joule").value == pytest.approx(808 / 500)  # repeats: +0, +2%
    (text,) = [d for d in found.details if "per joule" in d]
    assert text.startswith("alpha, continuous: 0.311 output tokens per joule at batch 1, 1.62 at batch 32; the most "
                           "at batch 8: 1.62 [")
    # $2 an hour over 808 tokens a second: $0.688 per million.
    assert "J per request" in text and ", $0.688 [" in text and "per million output tokens at $2 per GPU-hour" in text
    # Without GPU telemetry: the reason, once.
    bare = findings_from_documents(sweep())
    assert [d for d in bare.details if "energy" in d] == ["alpha: no energy figures (no GPU telemetry in these "
                                                         "documents)."]


@pytest.mark.parametrize("price", ["-1", "inf", "three"])
def test_a_bad_gpu_hour_cost_is_a_usage_error_before_anything_starts(price: str,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from batchbench import cli

    for command in ("run", "bench"):
        with pytest.raises(SystemExit) as exit_:
            cli.main([command, "--gpu-hour-cost", price])
        assert exit_.value.code == 2 and "--gpu-hour-cost" in capsys.readouterr().err
