"""The sweep that crosses all three regimes: its workload and the engine config that puts regime 3 mid-sweep.

One design per engine, chosen by capability (:func:`sweep_design`): a
KV-limited continuous engine gets a KV cache that holds exactly ``fit``
sequences of the sweep's workload; an engine with a cache split over slots gets
``fit`` slots of one sequence each; a padded static engine runs its standard
padded batch. The regimes suite (``suites/test_regimes.py``) asserts what the
sweep shows; ``batchbench run`` measures the same sweep for its report, so the
two never disagree on what was swept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from batchbench.adapters.base import Engine
from batchbench.adapters.spec import EngineSpec
from batchbench.core.config import BatchingConfig
from batchbench.workload.profiles import Profile
from batchbench.workload.requests import Arrival, Lengths, Workload, WorkloadSpec

#: Generations (batches of ``fit`` requests) each level runs for: enough for a throughput figure
#: that spans several prefill-decode cycles, few enough to keep the suite within its budget.
GENERATIONS = 6

@dataclass(frozen=True)
class SweepDesign:
    """The workload and engine config of one engine's sweep, sized so regime 3 begins at ``fit``."""

    engine: str
    prompt_len: int
    #: Output lengths are uniform in [output_min, output_len].
    output_len: int
    output_min: int
    #: Concurrency from which the engine cannot take more sequences at once (KV fit, or padded batch size).
    fit: int
    batching: BatchingConfig
    #: The KV-limited engine's context window (None: the session's).
    max_model_len: int | None = None
    #: Tokens per KV block of the KV-limited engine (None: no KV limit in the design).
    block_size: int | None = None

    def num_requests(self, concurrency: int) -> int:
        """``GENERATIONS`` generations of ``min(c, fit)`` in-flight requests, and at least two per client.

        Below ``fit`` a level lasts GENERATIONS request lifetimes; above it the
        queue needs every client to send twice so that late requests meet the
        steady-state queue (the first wave only meets part of it).
        """
        return max(2 * concurrency, GENERATIONS * min(concurrency, self.fit))

    def workload(self, concurrency: int, num_requests: int | None = None) -> Workload:
        output = (Lengths.fixed(self.output_len) if self.output_min == self.output_len
                  else Lengths.uniform(self.output_min, self.output_len))
        return WorkloadSpec(
            "regimes", num_requests or self.num_requests(concurrency), prompt=Lengths.fixed(self.prompt_len),
            output=output, arrival=Arrival("closed", concurrency=concurrency), seed=5,
        ).build()

    def describe(self) -> dict[str, Any]:
        return {"engine": self.engine, "prompt_len": self.prompt_len, "output": [self.output_min, self.output_len],
                "fit": self.fit, "batching": self.batching.label(), "max_model_len": self.max_model_len,
                "block_size": self.block_size}


def fit_target(profile: Profile) -> int:
    """The sweep point where regime 3 should begin: the middle of the sweep (8 of 1..32),
    leaving under-utilised points below it and memory-bound points above it."""
    return profile.sweep[len(profile.sweep) // 2]


def sequence_lengths(profile: Profile) -> tuple[int, int]:
    """Prompt and (longest) output length of the sweep's requests: 192 and 64 in the quick profile.

    A prompt of 3x the profile's median holds three quarters of a sequence's
    final KV blocks from the start. A paged engine admits a request once its prompt's
    blocks fit and grows it a block at a time, so with short prompts it would
    admit far more sequences than the cache can finish and run a larger batch
    than ``fit`` for part of each request (then preempt): the knee would be
    blurred. The output (2x the median) still spans dozens of decode steps,
    the unit of queueing in regime 3.
    """
    return 3 * profile.prompt_median, 2 * profile.output_median


def kv_limited_design(profile: Profile, engine: str, engine_class: type[Engine]) -> SweepDesign:
    """A KV cache that holds exactly ``fit_target`` sequences of the sweep's workload.

    A sequence keeps KV for prompt + output - 1 tokens, in whole blocks of the
    engine's ``kv_block_size``. Outputs vary only within the last block, so every
    sequence needs the same number of blocks (the fit is exact) while requests
    finish at different steps: the closed loop refills the batch continuously
    instead of in lock-step generations with a client round trip between them.

    The cache gets ``fit * blocks_per_sequence + kv_reserved_blocks + 1``
    blocks: the engine keeps ``kv_reserved_blocks`` back (a null block), and
    one spare keeps ``fit`` sequences from preempting each other (usage at
    ``fit`` is then fit*bps/(fit*bps+1) >= 0.85). ``max_model_len`` is the
    smallest power-of-two number of blocks that holds a sequence: the engine
    refuses a cache smaller than max_model_len, and one that reports capacity
    in full-length requests (``KVLayout.reports_full_length_requests``) reports
    ``num_blocks / blocks(max_model_len) * max_model_len``, exact in floating
    point when that divisor is a power of two.
    """
    block = engine_class.kv_block_size
    assert block is not None, f"engine {engine!r} takes no KV capacity in blocks"
    prompt, output = sequence_lengths(profile)
    fit = fit_target(profile)
    bps = math.ceil((prompt + output - 1) / block)
    # The shortest output whose sequence still reaches into the last block.
    output_min = block * (bps - 1) - prompt + 2
    blocks = fit * bps + engine_class.kv_reserved_blocks + 1
    max_model_len = block * 2 ** math.ceil(math.log2(math.ceil((prompt + output) / block)))
    # max_batch_size: room for every client of the sweep, so the KV cache is the only limit.
    batching = BatchingConfig(kv_capacity_tokens=blocks * block, max_batch_size=4 * max(profile.sweep))
    return SweepDesign(engine, prompt, output, output_min, fit, batching, max_model_len, block)


def slot_limited_design(profile: Profile, engine: str) -> SweepDesign:
    """``fit_target`` slots, each with a part of the cache that holds one sequence of the sweep's workload.

    An engine whose cache is split evenly over a fixed number of slots (``Engine.kv_per_slot``: llama.cpp's
    server without ``--kv-unified``) runs at most that many sequences; a request beyond them waits for a slot,
    never preempts. The slot is the KV block: ``max_model_len`` tokens (the smallest power of two that holds a
    prompt and the longest output), ``fit`` of them in all. Outputs vary over their upper half, so requests end at
    different steps and the closed loop refills the slots continuously, as in :func:`kv_limited_design`.
    """
    prompt, output = sequence_lengths(profile)
    fit = fit_target(profile)
    max_model_len = 2 ** math.ceil(math.log2(prompt + output))
    batching = BatchingConfig(kv_capacity_tokens=fit * max_model_len, max_batch_size=fit)
    return SweepDesign(engine, prompt, output, output // 2 + 1, fit, batching, max_model_len, max_model_len)


def static_design(profile: Profile, spec: EngineSpec) -> SweepDesign:
    """A padded static engine at the profile's standard batch size (the config suite 1 uses, so the engine
    is shared).

    There is no KV cache to fill, so prompts are the profile's median: a static
    batch prefills every prompt in full, compute that grows with the batch and
    is not amortised, so long prompts would blur the under-utilised regime.
    Fixed output lengths: a static batch runs until its longest request is
    done, so with mixed lengths a request sent when an early one finished
    would wait for the rest of the batch even below the batch size, a
    queueing that belongs to static batching (suite 1), not to regime 3.
    """
    prompt, output = profile.prompt_median, 2 * profile.output_median
    bs = profile.concurrency
    batching = spec.batch_of(bs)
    assert batching is not None, f"engine {spec.name!r} batches continuously: no padded batch to design for"
    return SweepDesign(spec.name, prompt, output, output, bs, batching)


def sweep_design(profile: Profile, spec: EngineSpec) -> SweepDesign | None:
    """The design that pushes this engine into regime 3, by capability; None: no recipe for it yet."""
    cls = spec.engine_class
    if cls.capabilities.reports_kv_capacity and cls.kv_per_slot:
        return slot_limited_design(profile, spec.name)
    if cls.capabilities.reports_kv_capacity and cls.kv_block_size is not None:
        return kv_limited_design(profile, spec.name, cls)
    if cls.capabilities.pads_batches:
        return static_design(profile, spec)
    return None
