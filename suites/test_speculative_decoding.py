"""Suite: speculative decoding against batching, with and without n-gram speculation.

N-gram speculation (prompt lookup) needs no draft model: it proposes the tokens that followed the latest
n-gram's earlier occurrence in the request's own tokens, and one model step verifies them all. The same engine
runs with it on and off (two live engines, runs alternated), closed loop at each batch size of ``BATCHES``;
TPOT and ITL come from the client's clock, the acceptance rate from the engine's own counters
(:class:`batchbench.measures.speculation.SpeculationCounters`), and the findings
(:mod:`batchbench.analysis.findings`) name the crossover batch size from which speculation stops paying.

The workload: random prompts and greedy decoding. With the embedded tiny random-weight model greedy decoding
falls into a short repeating cycle within a few tokens, which n-gram lookup then predicts; a real model on
real text accepts far less, so the figures here are the mechanism's ceiling, not a forecast.

What the mechanism predicts, and is asserted:

- the engine drafts and accepts (acceptance rate in (0, 1] by its own counters), and with speculation off it
  drafts nothing;
- every step emits one streamed chunk: ``1 + accepted`` tokens when it verified a draft, one token when it had
  none. So after the first token (from prefill) a run's D decode tokens come in ``D - accepted`` chunks, and
  the client's tokens per chunk at batch 1 match ``D / (D - accepted)`` by the engine's counter (within
  ``CHUNK_SLACK``: a draft accepted past max_tokens is counted but not sent);
- on an accelerator host, at batch 1, where a step's cost hardly grows with its tokens, TPOT with speculation
  is below TPOT without, and the gain is at most the tokens a drafted step emits (a verifying step costs no
  less than a plain one); judged on quiet runs only (:mod:`batchbench.analysis.validity`). On two vCPUs it is measured
  and reported, not asserted: a tiny-model step takes about a millisecond, the idle engine of the pair
  busy-polls the same cores, and the client often reads several steps' chunks at once, so TPOT there moved
  from x0.84 to x140 between runs (a figure the upper bound rightly refuses).

The crossover batch size is measured and reported (findings, the report), not asserted: where the step cost
grows with its tokens (an accelerator's compute-bound regime) the gain shrinks with the batch; on a CPU with
the tiny model the cost of a step is mostly per sequence, not per token, and speculation may pay at every
batch size measured.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import pytest

from batchbench.adapters.base import Engine
from batchbench.adapters.registry import engine_class
from batchbench.analysis.findings import findings_from_documents
from batchbench.analysis.repeats import Estimate, RepeatProtocol, Repeats, paired
from batchbench.core import codec, environment
from batchbench.core.config import BatchingConfig
from batchbench.experiment.harness import Harness
from batchbench.load.runner import MeasuredRun
from batchbench.measures.speculation import SpeculationCounters, speedup
from batchbench.pytest_plugin import IntervalChecks
from batchbench.results.document import RunDocument
from batchbench.workload.profiles import Profile
from batchbench.workload.requests import Arrival, Lengths, Workload, WorkloadSpec

METHOD = "ngram"
DRAFT_TOKENS = 4
#: Batch sizes, quick profile; the full profile goes on to the throughput regime of an accelerator.
BATCHES_QUICK = (1, 4, 16)
BATCHES_FULL = (1, 4, 16, 64, 128)
#: Output tokens per request: long enough that most steps come after the first n-gram match.
OUTPUT = 64
PROMPT = 32
REPEATS = 2
#: On a GPU, where the speedup is asserted: passes, and at most, while its interval straddles a limit.
GPU_REPEATS, MAX_REPEATS = 3, 6
#: Client tokens per chunk at batch 1 against the engine's prediction, D / (D - accepted): this share either way.
CHUNK_SLACK = 0.15
#: TPOT without over with, at batch 1, must exceed this.
MIN_SPEEDUP_AT_1 = 1.1


def batches(profile: Profile) -> tuple[int, ...]:
    return BATCHES_QUICK if profile.name == "quick" else BATCHES_FULL


def workload(batch: int) -> Workload:
    """One closed-loop wave of ``batch`` requests (at least 4): random prompts, fixed output."""
    return WorkloadSpec(f"speculation-c{batch}", max(4, batch), prompt=Lengths.fixed(PROMPT),
                        output=Lengths.fixed(OUTPUT), arrival=Arrival("closed", concurrency=batch), seed=5).build()


def decode_chunks(result: MeasuredRun) -> tuple[int, int]:
    """(output tokens, streamed chunks) after each request's first token, which comes from prefill."""
    tokens = chunks = 0
    for record in result.records:
        counts = [n for n in record.chunk_tokens if n > 0]
        tokens += sum(counts) - (counts[0] if counts else 0)
        chunks += max(0, len(counts) - 1)
    return tokens, chunks


def tokens_per_chunk(result: MeasuredRun) -> float:
    tokens, chunks = decode_chunks(result)
    return tokens / chunks


def predicted_tokens_per_chunk(result: MeasuredRun, counters: SpeculationCounters) -> float:
    """D decode tokens in D - accepted steps, one chunk each."""
    tokens, _ = decode_chunks(result)
    return tokens / (tokens - counters.accepted_tokens)


def test_speculation_against_batch_size(
    harness: Harness, start_engine: Callable[..., Engine], engine_name: str, benchmark: Any
) -> None:
    if METHOD not in engine_class(engine_name).capabilities.speculation_methods:
        pytest.skip(f"engine {engine_name!r} has no {METHOD} speculative decoding (Capabilities.speculation_methods)")
    if harness.max_live_engines < 2:
        pytest.skip(f"--max-live-engines {harness.max_live_engines}: the comparison alternates two live engines")
    spec = BatchingConfig(speculative_method=METHOD, speculative_tokens=DRAFT_TOKENS)
    engines = {on: start_engine(engine_name, spec if on else None) for on in (True, False)}
    sizes = batches(harness.profile)

    def measure(key: tuple[int, bool], repeat: int) -> MeasuredRun:
        batch, on = key
        result = harness.measure(engines[on], workload(batch), tag=f"spec-{'on' if on else 'off'}-c{batch}",
                                 benchmark=benchmark if key == (1, True) and repeat == 0 else None,
                                 labels={"suite": "speculative_decoding", "layout": "continuous",
                                         "concurrency": batch, "repeat": repeat})
        assert result.summary.failed == 0, result.summary.failures
        return result

    keys = [(b, on) for b in sizes for on in (True, False)]
    on_gpu = bool(environment.capture()["gpus"])
    series: dict[tuple[int, bool], Repeats[MeasuredRun]] = {key: Repeats() for key in keys}

    def judged() -> tuple[IntervalChecks, Estimate | None]:
        """On a GPU, TPOT at batch 1 without speculation over with it, paired pass by pass: above
        MIN_SPEEDUP_AT_1, and no more than the tokens a drafted step yields by the engine's counters."""
        checks = IntervalChecks()
        if not on_gpu:
            return checks, None
        gain = paired(series[(1, False)], series[(1, True)], lambda r: r.summary.tpot.p50 if r.summary.tpot
                      else None)
        steps = [c.tokens_per_step for r in series[(1, True)].runs
                 if (c := SpeculationCounters.over(r.samples)) is not None and c.tokens_per_step]
        of = (series[(1, False)], series[(1, True)])
        checks.check("batch 1: TPOT speedup with speculation", gain, MIN_SPEEDUP_AT_1, "above", of=of)
        if steps:
            checks.check("batch 1: TPOT speedup against the tokens per drafted step", gain,
                         statistics.median(steps), "below", of=of)
        return checks, gain

    # Every key each pass; on a GPU, again while the speedup's interval straddles a limit.
    for key, repeat in RepeatProtocol(repeats=GPU_REPEATS if on_gpu else REPEATS, max_repeats=MAX_REPEATS,
                                      alternate=True, together=True, look_once=True,
                                      settled=lambda _: judged()[0].decided).schedule(series):
        result = measure(key, repeat)
        series[key].add(result, result.machine)
    runs = {key: reps.runs for key, reps in series.items()}
    tpot = {key: statistics.median(r.summary.tpot.p50 for r in rs if r.summary.tpot) for key, rs in runs.items()}
    counters = {key: [SpeculationCounters.over(r.samples) for r in rs] for key, rs in runs.items()}

    findings = findings_from_documents([RunDocument.load(r.path) for rs in runs.values() for r in rs],
                                       suite="speculative_decoding")
    assert len(findings.speculation) == 1, findings.details
    found = findings.speculation[0]
    print(f"\n{engine_name}: " + next(s for s in findings.details if "speculation" in s))
    print("batch  TPOT p50 off / on (ms)  speedup  ITL/token p50 off / on (ms)  ITL/chunk p50 off / on (ms)  "
          "acceptance  tokens/step  tokens/chunk")
    for b in sizes:
        on, off = runs[(b, True)][0].summary, runs[(b, False)][0].summary
        c = next((x for x in counters[(b, True)] if x is not None), None)
        print(f"{b:5}  {tpot[(b, False)] * 1e3:8.2f} / {tpot[(b, True)] * 1e3:6.2f}  "
              f"x{speedup(tpot[(b, False)], tpot[(b, True)]):6.2f}  "
              f"{off.itl.p50 * 1e3:10.2f} / {on.itl.p50 * 1e3:6.2f}  "  # type: ignore[union-attr]
              f"{off.itl_per_chunk.p50 * 1e3:10.2f} / {on.itl_per_chunk.p50 * 1e3:6.2f}  "  # type: ignore[union-attr]
              f"{c.acceptance_rate if c else float('nan'):10.3f}  {c.tokens_per_step if c else float('nan'):11.2f}  "
              f"{tokens_per_chunk(runs[(b, True)][0]):12.2f}")
    benchmark.extra_info.update({"speculation": codec.encode(found)})

    if all(c is None for cs in counters.values() for c in cs):
        pytest.skip(f"engine {engine_name!r} exposes no speculation counters: the acceptance rate cannot be checked")
    for b in sizes:
        for c in counters[(b, True)]:
            assert c is not None and c.drafts > 0, f"batch {b}: speculation on, yet the engine drafted nothing"
            assert c.acceptance_rate is not None and 0 < c.acceptance_rate <= 1, c
        assert all(c is None or c.drafts == 0 for c in counters[(b, False)]), "speculation off, yet drafts"
    for r, c in zip(runs[(1, True)], counters[(1, True)]):
        assert c is not None
        measured, predicted = tokens_per_chunk(r), predicted_tokens_per_chunk(r, c)
        assert abs(measured / predicted - 1) <= CHUNK_SLACK, (
            f"batch 1: {measured:.2f} tokens per chunk, {predicted:.2f} predicted from the engine's accepted tokens")
    checks, gain = judged()
    if not on_gpu:  # TPOT on two vCPUs is reported (findings, the report), not asserted: see the module docstring
        checks.not_made("batch 1: TPOT speedup with speculation, no more than the tokens per drafted step",
                        "GPU only: TPOT on two shared vCPUs is too noisy to assert (reported in the findings)")
    checks.finish("batch 1" if gain is None else f"batch 1: speedup {gain.format(lambda v: f'x{v:.2f}')}")
