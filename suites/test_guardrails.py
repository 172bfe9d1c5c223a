"""Suite 7: the operational guardrails every engine must expose, and the KV danger zone.

What an operator needs from a run, per engine: TTFT p50/p99 by batch-size
bucket, tokens/s per accelerator, KV-cache usage over time, queue depth and
rejection rate. And the run must flag when the KV cache enters the danger
zone (>= 85% used), where the next burst preempts or queues.

Measured against an independent prediction: the engine's own KV usage, sampled through the run, peaks past 85% in
a cache sized by arithmetic to be too small for the load, and stays below it in the default cache the same
arithmetic says is roomy. Arithmetic, not claimed here: that the flag (``kv_danger_entered``) follows from those
samples, which tests/test_results.py unit-tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from batchbench.adapters.base import Engine
from batchbench.adapters.registry import get_spec
from batchbench.core import codec
from batchbench.core.config import BatchingConfig, LoadConfig
from batchbench.experiment.harness import Harness
from batchbench.measures.guardrails import KV_DANGER
from batchbench.measures.metrics import ttft_by_bucket
from batchbench.pytest_plugin import skip_unless_capable
from batchbench.results import document as results
from batchbench.workload.profiles import chat_workload
from batchbench.workload.requests import Arrival, Lengths, WorkloadSpec

BUCKETS = (1, 2, 4, 8, 16)


def test_guardrail_metrics_are_exposed(harness: Harness, start_engine: Callable[..., Engine], engine_name: str,
                                       batching: BatchingConfig | None, benchmark: Any) -> None:
    if batching is None:  # the engine's own way of batching the profile's concurrency
        batching = get_spec(engine_name).batch_of(harness.profile.concurrency)
    engine = start_engine(engine_name, batching)
    # Poisson arrivals past what one request at a time could serve, so batch sizes vary over the run.
    workload = chat_workload(harness.profile, arrival=Arrival("poisson", rate=4.0 * harness.profile.concurrency))
    result = harness.measure(engine, workload, tag="guardrails", labels={"suite": "guardrails"},
                             benchmark=benchmark, load=LoadConfig(request_timeout_s=harness.profile.request_timeout_s,
                                                                  scrape_interval_s=0.1))
    doc = results.load(result.path)
    guard = doc.guardrails()
    buckets = ttft_by_bucket(result.records, lambda r: r.in_flight_at_send, BUCKETS)
    gpus = len(doc.header.environment["gpus"]) or 1  # per accelerator; a CPU run counts as one
    benchmark.extra_info.update({
        "ttft_by_bucket": {k: (None if d is None else {"p50": d.p50, "p99": d.p99}) for k, d in buckets.items()},
        "output_tokens_per_s_per_accelerator": result.summary.output_token_throughput / gpus,
        "rejection_rate": result.summary.rejection_rate,
        "guardrails": codec.encode(guard),
    })

    assert result.summary.ok == len(workload.requests)
    assert sum(d.count for d in buckets.values() if d is not None) == result.summary.ok
    assert sum(1 for d in buckets.values() if d is not None) >= 2, "the arrivals should give several batch sizes"
    assert result.summary.rejection_rate == 0
    assert result.summary.output_token_throughput > 0
    if not engine.capabilities.server_metrics:
        pytest.skip(f"{engine_name} exposes no server metrics")
    # A time series, not a single reading: the scraper kept sampling through the run.
    assert guard.samples >= 5
    assert guard.running_peak is not None and guard.running_peak >= 1
    assert guard.waiting_peak is not None
    if engine.capabilities.reports_kv_capacity:
        assert guard.kv_capacity_tokens and guard.kv_usage_peak is not None and guard.kv_usage_peak > 0


def test_kv_danger_zone_is_flagged_when_entered(harness: Harness, start_engine: Callable[..., Engine],
                                               engine_name: str) -> None:
    engine = start_engine(engine_name)
    if not engine.capabilities.reports_kv_capacity:
        pytest.skip(f"{engine_name} reports no KV-cache usage: no danger zone to flag")
    skip_unless_capable(engine_name, "exact_output_length",
                        "the tight cache fills only if every request decodes its max_tokens")
    max_len = harness.options.max_model_len
    cls = type(engine)
    # Each sequence holds prompt + output tokens of KV. Sixteen concurrent sequences need 3072 tokens:
    # past 85% of a ~2k-token cache (the engine's minimum: max_model_len beside the blocks it keeps back);
    # on the default cache (1 GiB on a CPU engine: a million tokens of the tiny model) the same load stays
    # far below it.
    prompt, output, concurrency = 64, 128, 16
    block = cls.kv_block_size or 1
    small = max(cls.min_kv_capacity_tokens(max_len), math.ceil(concurrency * (prompt + output) / 2 / block) * block)
    fill = WorkloadSpec("kv-fill", 2 * concurrency, prompt=Lengths.fixed(prompt), output=Lengths.fixed(output),
                        arrival=Arrival("closed", concurrency=concurrency)).build()
    tight = BatchingConfig(kv_capacity_tokens=small, max_batch_size=64)
    if cls.kv_per_slot:  # a cache split over slots fills as its slots do: half as many as the sequences
        tight = BatchingConfig(kv_capacity_tokens=concurrency // 2 * max_len, max_batch_size=concurrency // 2)
    flags = {}
    for tag, batching in (("roomy", None), ("tight", tight)):
        engine = start_engine(engine_name, batching)
        result = harness.measure(engine, fill, tag=f"kv-{tag}", labels={"suite": "guardrails", "kv": tag},
                                 load=LoadConfig(request_timeout_s=harness.profile.request_timeout_s,
                                                 scrape_interval_s=0.05))
        assert result.summary.failed == 0, result.summary.failures
        flags[tag] = results.load(result.path).guardrails()
    harness.release(engine_name, tight)
    tight_kv, roomy_kv = flags["tight"], flags["roomy"]
    # The engine's samples against the sizes' prediction (the flags themselves are the samples' arithmetic).
    assert tight_kv.kv_usage_peak is not None and tight_kv.kv_usage_peak >= KV_DANGER
    assert tight_kv.kv_danger_time_s is not None and tight_kv.kv_danger_time_s > 0
    assert roomy_kv.kv_usage_peak is not None and roomy_kv.kv_usage_peak < KV_DANGER
    assert (tight_kv.kv_danger_entered, roomy_kv.kv_danger_entered) == (True, False)  # and the run says so
