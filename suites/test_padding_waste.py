"""Suite 2: padding waste: one long prompt among many short ones.

A static batch is a rectangle: every prompt is padded to the longest one. The
classic case, one 4096-token prompt among thirty-one 100-token prompts,
leaves 31 x (4096 - 100) / (32 x 4096) = 94.5% of the prefill slots as
padding. The quick profile keeps that ratio at a length the tiny model and
CI time allow (1024 and 25). An engine that pads must report exactly the
analytic pad fraction and pay for it in latency; an engine that packs
variable-length sequences (continuous batching over paged KV) pays only for
the real tokens. Each layout is measured twice (the repeat protocol,
:mod:`batchbench.analysis.repeats`) and the faster run counts: interference on a
shared machine only ever adds time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from batchbench.adapters.base import Engine
from batchbench.adapters.registry import get_spec
from batchbench.analysis.repeats import RepeatProtocol
from batchbench.analysis.theory import padding_fraction
from batchbench.harness import Harness
from batchbench.load.runner import RunResult
from batchbench.workload.requests import Arrival, Lengths, Workload, WorkloadSpec

BATCH = 32
OUTPUT_TOKENS = 8  # short outputs: the suite is about prefill


def lengths(harness: Harness) -> tuple[int, int]:
    """(long, short) in the classic 4096:100 ratio, as long as the profile's context allows."""
    long = min(4096, harness.profile.max_model_len // 2)
    return long, round(long * 100 / 4096)


def batches(harness: Harness) -> dict[str, Workload]:
    long, short = lengths(harness)
    arrival = Arrival("waves", concurrency=BATCH)
    return {
        "homogeneous": WorkloadSpec("pad-homogeneous", BATCH, prompt=Lengths.fixed(short),
                                    output=Lengths.fixed(OUTPUT_TOKENS), arrival=arrival).build(),
        "mixed": WorkloadSpec("pad-mixed", BATCH, prompt=Lengths.mixed(short=short, long=long, period=BATCH),
                              output=Lengths.fixed(OUTPUT_TOKENS), arrival=arrival).build(),
    }


def wave_time(result: RunResult) -> float:
    return max(r.done_s for r in result.records) - min(r.sent_s for r in result.records)


def test_classic_case_is_94_5_percent() -> None:
    assert padding_fraction([4096] + [100] * 31) == pytest.approx(0.9451, abs=1e-4)


def test_padding_cost(harness: Harness, start_engine: Callable[..., Engine], engine_name: str,
                      benchmark: Any) -> None:
    # A static-only engine pads a batch of BATCH; a continuous one keeps its default.
    engine = start_engine(engine_name, get_spec(engine_name).batch_of(BATCH))
    work = batches(harness)
    runs: dict[str, RunResult] = {}

    def measure(tag: str, i: int) -> RunResult:
        result = harness.measure(engine, work[tag], tag=tag, labels={"suite": "padding", "batch": tag},
                                 benchmark=benchmark if (tag == "mixed" and i == 1) else None)
        assert result.summary.failed == 0, result.summary.failures
        return result

    for tag in work:
        # Best of two (one layout's repeats back to back, as the analytic comparison is per layout).
        attempts = RepeatProtocol(repeats=2).run([tag], measure)[tag].runs
        runs[tag] = min(attempts, key=wave_time)

    prompt_lens = {tag: [r.prompt_len for r in wl.requests] for tag, wl in work.items()}
    analytic = padding_fraction(prompt_lens["mixed"])
    # What each layout costs in prompt tokens: padded (B x longest) or real (the sum).
    padded_ratio = (BATCH * max(prompt_lens["mixed"])) / sum(prompt_lens["homogeneous"])
    real_ratio = sum(prompt_lens["mixed"]) / sum(prompt_lens["homogeneous"])
    cost_ratio = wave_time(runs["mixed"]) / wave_time(runs["homogeneous"])
    benchmark.extra_info.update({
        "analytic_pad_fraction": analytic, "padded_token_ratio": padded_ratio, "real_token_ratio": real_ratio,
        "latency_cost_ratio_mixed_over_homogeneous": cost_ratio,
        "mixed_ttft_p50": runs["mixed"].summary.ttft.p50, "homogeneous_ttft_p50": runs["homogeneous"].summary.ttft.p50,
    })

    if engine.capabilities.pads_batches:
        for tag in work:
            measured = runs[tag].engine_report["prompt_pad_fraction"]
            assert measured == pytest.approx(padding_fraction(prompt_lens[tag]), abs=1e-12), tag
        benchmark.extra_info["measured_pad_fraction"] = runs["mixed"].engine_report["prompt_pad_fraction"]
        # It computes the padding: the mixed batch costs more than its real tokens alone would.
        assert cost_ratio > real_ratio, (
            f"{engine_name} paid {cost_ratio:.1f}x, less than the real tokens' {real_ratio:.1f}x")
    else:
        # No padding: the cost follows the real tokens (attention is quadratic in the long prompt, so allow
        # some excess), far below what padding to the longest prompt would cost.
        assert cost_ratio < padded_ratio / 2, (
            f"{engine_name} paid {cost_ratio:.1f}x for the mixed batch, as if it padded ({padded_ratio:.0f}x tokens)"
        )
