"""Suite: KV-cache sizing from the model config predicts the engine's capacity, and regime 3's onset.

The calculator (:func:`batchbench.analysis.theory.kv_cache_bytes_per_token`,
:func:`batchbench.analysis.theory.kv_capacity_tokens`) works from the model config
alone: 2 (K and V) x layers x *KV* heads x head_dim x bytes per element, and
whole blocks of the engine's block size. Its predictions, rounded and reported
the way the engine says it does (:class:`batchbench.core.config.KVLayout`),
are compared, exactly, with the capacity the engine reports
(``ServerMetrics.kv_capacity_tokens``):

- the cache an engine sizes from a KV space it was given in bytes
  (``Engine.kv_space_bytes``; a CPU engine launched by the harness), in
  whole blocks of its default block size;
- a cache of a given number of blocks (``kv_capacity_tokens`` in whole
  ``Engine.kv_block_size`` blocks: the KV-limited engine of
  ``suites/test_regimes.py``), where the server may also log how many blocks
  the same memory would have held without that limit
  (``Engine.kv_block_override``);
- from the reported capacity, the concurrency at which the regimes sweep's
  workload stops fitting: regime 3's onset, checked against the sweep.

Engines that do not report their KV capacity are skipped, with the reason.

What each engine test measures: the capacity the engine itself reports, against the calculator's prediction. For a
KV space in bytes the whole chain is checked (bytes per token from the config, whole blocks). For a cache of N
blocks the prediction is N x the block size, so it checks the engine's own accounting of its cache (blocks kept
back, rounding, capacity in full-length requests), not the bytes-per-token arithmetic; that arithmetic is checked
there only where the server logs the blocks the same memory would have held (``Engine.kv_block_override``), and
otherwise by the pure tests here and the KV-space test.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from batchbench.adapters.base import Engine
from batchbench.adapters.registry import engine_class
from batchbench.analysis.theory import kv_bytes_per_token_of_config, kv_capacity_tokens, kv_fit_concurrency
from batchbench.core.config import KVLayout
from batchbench.experiment.harness import Harness
from batchbench.fixtures import tiny_model_dir
from batchbench.measures.guardrails import KV_DANGER
from suites.test_regimes import Sweep, get_sweep

GiB = 1 << 30
#: A block size that divides a GiB-sized cache of the tiny model evenly (the default of a paged CPU engine).
BLOCK_128 = 128


def model_config(model: str | None = None) -> dict[str, Any]:
    """The Hugging Face config of the session's model (the tiny Llama unless --model names a local directory)."""
    path = Path(model) if model is not None else tiny_model_dir()
    config_file = path / "config.json"
    if not config_file.is_file():
        pytest.skip(f"no local config.json for model {model!r}: the KV footprint cannot be computed offline")
    return json.loads(config_file.read_text())


def sweep_layout(sweep: Sweep) -> KVLayout:
    layout = sweep.kv_layout
    assert layout is not None, f"engine {sweep.design.engine!r} took a KV capacity in blocks but has no KV layout"
    return layout


def predicted_override_capacity(harness: Harness, sweep: Sweep) -> tuple[int, int]:
    """(blocks, capacity the engine should report) for the KV-limited design's cache given in blocks.

    The adapter asks for ceil(kv_capacity_tokens / block size) blocks; the
    calculator turns the bytes those blocks take back into whole-block tokens.
    """
    design, layout = sweep.design, sweep_layout(sweep)
    assert design.batching.kv_capacity_tokens is not None and design.max_model_len is not None
    per_token = kv_bytes_per_token_of_config(model_config(harness.options.model))
    block = layout.block_tokens
    blocks = layout.blocks(design.batching.kv_capacity_tokens)
    capacity = kv_capacity_tokens(blocks * block * per_token, per_token, block)
    return blocks, layout.reported_capacity(capacity)


def skip_unless_reports_kv(engine_name: str) -> None:
    if not engine_class(engine_name).capabilities.reports_kv_capacity:
        pytest.skip(f"engine {engine_name!r} does not report its KV-cache capacity")


def reported_capacity(harness: Harness, engine: Engine) -> float:
    sample = harness.scrape(engine)
    assert sample is not None and sample.kv_capacity_tokens is not None, (
        f"engine {engine.name!r} claims to report its KV capacity but its metrics have none: {sample}"
    )
    return sample.kv_capacity_tokens


def test_gqa_shrinks_the_kv_cache_by_the_group_size() -> None:
    """Pure: the tiny Llama has 4 attention heads sharing 2 KV heads (GQA), so its KV cache per token is
    half the MHA one and twice the tokens fit in the same memory."""
    config = model_config()
    gqa = kv_bytes_per_token_of_config(config)
    mha = kv_bytes_per_token_of_config(config, kv_heads=config["num_attention_heads"])
    # 2 (K, V) x 2 layers x 2 KV heads x 64 dims x 2 bytes (bf16).
    assert gqa == 2 * 2 * 2 * 64 * 2 == 1024
    assert mha == 2 * 2 * 4 * 64 * 2 == 2048
    assert mha / gqa == config["num_attention_heads"] / config["num_key_value_heads"]
    assert kv_capacity_tokens(GiB, gqa, BLOCK_128) == 2 * kv_capacity_tokens(GiB, mha, BLOCK_128) == 1 << 20
    # Getting this wrong (counting attention heads) would halve every predicted batch size.


def test_capacity_reported_as_full_length_requests() -> None:
    """Pure: a capacity reported in full-length requests is the capacity when the block size divides
    max_model_len, less otherwise."""
    def reported(capacity: int, block: int, max_len: int) -> int:
        return KVLayout(block, max_len, reports_full_length_requests=True).reported_capacity(capacity)

    assert reported(1 << 20, BLOCK_128, 2048) == 1 << 20
    assert reported(66 * 32, 32, 256) == 66 * 32
    # 66 blocks hold 66 / ceil(200 / 32) = 9.43 requests of 200 tokens: 1885 tokens of them.
    assert reported(66 * 32, 32, 200) == 1885


@pytest.mark.engine
def test_predicts_kv_space_capacity(
    harness: Harness, start_engine: Callable[..., Engine], engine_name: str
) -> None:
    """A KV space of so many bytes, in whole default-size blocks, is the capacity the engine reports."""
    skip_unless_reports_kv(engine_name)
    engine = start_engine(engine_name)
    space, layout = engine.kv_space_bytes(), engine.kv_layout()
    if space is None or layout is None:
        pytest.skip(f"engine {engine_name!r} was given no known KV space here (it sizes its KV cache from "
                    "accelerator memory, or runs at a URL)")
    per_token = kv_bytes_per_token_of_config(model_config(harness.options.model))
    predicted = layout.reported_capacity(kv_capacity_tokens(space, per_token, layout.block_tokens))
    reported = reported_capacity(harness, engine)
    print(f"{engine_name}: {space / GiB:g} GiB / {per_token} B per token → predicted {predicted}, "
          f"reported {reported:.0f}")
    assert reported == predicted


@pytest.mark.engine
@pytest.mark.slow
def test_predicts_block_override_capacity(harness: Harness, engine_name: str) -> None:
    """A cache of N blocks reports N blocks' tokens, and the blocks the engine would have had without the
    limit (when its log says) are what the calculator fits in the same KV space."""
    skip_unless_reports_kv(engine_name)
    sweep = get_sweep(harness, engine_name)
    blocks, predicted = predicted_override_capacity(harness, sweep)
    block = sweep_layout(sweep).block_tokens
    per_token = kv_bytes_per_token_of_config(model_config(harness.options.model))
    print(f"{engine_name}: {blocks} blocks x {block} → predicted {predicted}, "
          f"reported {sweep.kv_capacity_tokens}")
    assert sweep.kv_capacity_tokens == predicted

    # The server logs the block count its KV space would have given (what the calculator fits in that
    # space at this block size) and the one it was given instead.
    log, space = sweep.server_log, sweep.kv_space_bytes
    if space is None:
        print(f"{engine_name}: no known KV space; the block count without the override is not checked")
        return
    if log is None or not log.is_file():
        print(f"{engine_name}: no local server log; the block count without the override is not checked")
        return
    found = engine_class(engine_name).kv_block_override(log.read_text())
    assert found is not None, f"no block-count override line in {log.name}"
    would_have = kv_capacity_tokens(space, per_token, block) // block
    print(f"{engine_name}: without the override {space / GiB:g} GiB would hold {would_have} blocks; "
          f"the log says {found[0]}")
    assert found == (would_have, blocks)


@pytest.mark.engine
@pytest.mark.slow
def test_predicts_memory_bound_onset(harness: Harness, engine_name: str) -> None:
    """The predicted capacity (equal to the reported one: previous test) over the sweep's sequence
    footprint in whole blocks predicts where the cache fills; the sweep's first concurrency with a run
    reaching KV usage >= KV_DANGER or preempting is within 2x of it.

    The sweep doubles concurrency, so "within one sweep step" is a factor of 2 either way. Every run
    counts, busy or quiet: how full the cache gets does not depend on how fast the machine is.
    """
    skip_unless_reports_kv(engine_name)
    sweep = get_sweep(harness, engine_name)
    design = sweep.design
    _, capacity = predicted_override_capacity(harness, sweep)
    predicted = kv_fit_concurrency(capacity, design.prompt_len, design.output_len, sweep_layout(sweep).block_tokens)
    full = sorted(c for c, runs in sweep.repeats.items()
                  if any((p.kv_usage_peak or 0) >= KV_DANGER or (p.preemptions or 0) > 0 for p in runs))
    assert full, f"{engine_name}: the KV cache never filled in the sweep: {sweep.table()}"
    onset = full[0]
    regime3 = next((p.concurrency for p in sweep.report.points if p.regime == "memory-bound"), None)
    print(f"{engine_name}: capacity {capacity} tokens, {design.prompt_len}+{design.output_len}"
          f"-token sequences → predicted onset {predicted}, measured {onset} (first memory-bound label: {regime3})")
    assert predicted / 2 <= onset <= 2 * predicted, (predicted, onset, sweep.table())
