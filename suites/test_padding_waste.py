"""Suite 2: padding waste: one long prompt among many short ones.

A static batch is a rectangle: every prompt is padded to the longest one. The
classic case, one 4096-token prompt among thirty-one 100-token prompts,
leaves 31 x (4096 - 100) / (32 x 4096) = 94.5% of the prefill slots as
padding. The quick profile keeps that ratio at half its context (the main
job's padding pair, :func:`batchbench.analysis.main_job.padding_pair`). An engine that pads must pad exactly the
analytic fraction and pay for it in latency; an engine that packs
variable-length sequences (continuous batching over paged KV) pays only for
the real tokens. Both batches run side by side in each pass, at least three
times (the repeat protocol, :mod:`batchbench.analysis.repeats`), and the cost
ratio is paired pass by pass and decided by its interval
(:class:`batchbench.pytest_plugin.IntervalChecks`).

Measured against an independent prediction: the pad fraction of the prompt tensor the padding engine's model was
given (its engine report's ``prompt_pad_fraction``, taken from the prompt tensor's shape), against the arithmetic
of the prompt lengths alone; the latency cost ratio, against the padded and real token ratios. The arithmetic itself
(:func:`batchbench.analysis.theory.padding_fraction`) is unit-tested in tests/test_metrics.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from batchbench.adapters.base import Engine
from batchbench.adapters.registry import get_spec
from batchbench.analysis.main_job import padding_pair
from batchbench.analysis.repeats import Estimate, RepeatProtocol, Repeats, paired
from batchbench.analysis.theory import padding_fraction
from batchbench.core import codec
from batchbench.experiment.harness import Harness
from batchbench.load.runner import MeasuredRun
from batchbench.pytest_plugin import IntervalChecks
from batchbench.workload.requests import Workload

BATCH = 32


def batches(harness: Harness) -> dict[str, Workload]:
    """One wave of BATCH: the main job's padding pair (one long prompt among short ones, the classic 4096:100
    ratio at half the profile's context), so the suite and ``batchbench run`` measure padding alike."""
    return padding_pair(harness.profile.max_model_len, BATCH)


def wave_time(result: MeasuredRun) -> float:
    return max(r.done_s for r in result.records) - min(r.sent_s for r in result.records)


def test_classic_case_is_94_5_percent() -> None:
    assert padding_fraction([4096] + [100] * 31) == pytest.approx(0.9451, abs=1e-4)


#: Passes in which both batches are run side by side; more, up to MAX_REPEATS, while a claim's interval straddles
#: its limit (the repeat protocol, batchbench.analysis.repeats).
REPEATS = 3
MAX_REPEATS = 6


def test_padding_cost(harness: Harness, start_engine: Callable[..., Engine], engine_name: str,
                      benchmark: Any) -> None:
    # A static-only engine pads a batch of BATCH; a continuous one keeps its default.
    engine = start_engine(engine_name, get_spec(engine_name).batch_of(BATCH))
    work = batches(harness)
    prompt_lens = {tag: [r.prompt_len for r in wl.requests] for tag, wl in work.items()}
    analytic = padding_fraction(prompt_lens["padded-mixed"])
    # What each layout costs in prompt tokens: padded (B x longest) or real (the sum).
    padded_ratio = (BATCH * max(prompt_lens["padded-mixed"])) / sum(prompt_lens["homogeneous"])
    real_ratio = sum(prompt_lens["padded-mixed"]) / sum(prompt_lens["homogeneous"])
    series: dict[str, Repeats[MeasuredRun]] = {tag: Repeats() for tag in work}

    def judged() -> tuple[IntervalChecks, Estimate | None]:
        cost = paired(series["padded-mixed"], series["homogeneous"], wave_time)
        checks = IntervalChecks()
        if engine.capabilities.pads_batches:
            # It computes the padding: the mixed batch costs more than its real tokens alone would.
            checks.check(f"{engine_name} pads: the mixed batch's time over the homogeneous one's", cost, real_ratio,
                         "above", of=list(series.values()))
        else:
            # No padding: the cost follows the real tokens (attention is quadratic in the long prompt, so allow
            # some excess), far below what padding to the longest prompt would cost.
            checks.check(f"{engine_name} packs: the mixed batch's time over the homogeneous one's", cost,
                         padded_ratio / 2, "below", of=list(series.values()))
        return checks, cost

    def measure_all() -> None:
        protocol = RepeatProtocol(repeats=REPEATS, max_repeats=MAX_REPEATS, together=True, look_once=True,
                                  settled=lambda _: judged()[0].decided)
        for tag, repeat in protocol.schedule(series):
            result = harness.measure(engine, work[tag], tag=tag, labels={"suite": "padding", "batch": tag,
                                                                        "repeat": repeat})
            assert result.summary.failed == 0, result.summary.failures
            series[tag].add(result, result.machine)

    benchmark.pedantic(measure_all, rounds=1, iterations=1)
    checks, cost = judged()
    mixed = series["padded-mixed"].runs[-1]
    benchmark.extra_info.update({
        "analytic_pad_fraction": analytic, "padded_token_ratio": padded_ratio, "real_token_ratio": real_ratio,
        "latency_cost_ratio_mixed_over_homogeneous": codec.encode(cost),
        "mixed_ttft_p50": mixed.summary.ttft.p50,
        "homogeneous_ttft_p50": series["homogeneous"].runs[-1].summary.ttft.p50,
    })
    if engine.capabilities.pads_batches:
        for tag in work:
            for run in series[tag].runs:
                measured = run.engine_report["prompt_pad_fraction"]
                assert measured == pytest.approx(padding_fraction(prompt_lens[tag]), abs=1e-12), tag
        benchmark.extra_info["measured_pad_fraction"] = mixed.engine_report["prompt_pad_fraction"]
    checks.finish(f"real tokens x{real_ratio:.1f}, padded x{padded_ratio:.0f}")
