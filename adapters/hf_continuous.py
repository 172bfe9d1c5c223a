"""hf-continuous: transformers' own continuous batching, on the same model, kernels and server as hf-static.

The server (:mod:`batchbench.adapters.hf_server` with ``--batching continuous``) runs transformers 5.19's
continuous batching manager (``model.init_continuous_batching()``, :class:`batchbench.adapters.hf_batchers.
ContinuousBatcher`): a paged KV cache, a FIFO scheduler that admits a request at the next step when the step's
token budget and the cache have room, and prefill split over steps when a prompt exceeds the budget. Beside
hf-static it isolates the batching strategy: one library, one model, one process layout, static against continuous.

Measured on two vCPUs with the tiny model, its first requests are served within a second of start (the cache is
made to a fixed size on the CPU: transformers would otherwise take 90% of the host's RAM for it, 29 s to allocate).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from batchbench.adapters.base import EngineNotHealthy
from batchbench.adapters.hf_engine import LOCAL_PROGRAM, HFServerEngine
from batchbench.adapters.spec import EngineSpec, LocalRun
from batchbench.core.config import BatchingConfig, Capabilities, KVLayout


class HFContinuousEngine(HFServerEngine):
    """Continuous batching over transformers' paged-attention manager.

    BatchingConfig mapping (``ContinuousBatchingConfig`` of transformers 5.19): max_batch_size → the most requests
    one step holds (``max_requests_per_batch``, default 1024), max_batched_tokens → the step's token budget
    (``max_batch_tokens``; transformers sizes it when unset), kv_capacity_tokens → whole blocks of
    ``kv_block_size`` tokens (``num_blocks``; unset: transformers sizes the cache from free GPU memory, or a fixed
    size on the CPU), memory_fraction → ``max_memory_percent``. Chunked prefill is how its scheduler works (a
    prompt beyond the budget is split over steps); it cannot be switched off, so ``chunked_prefill=false`` is
    refused, and so are a per-request prefill cap, prefix caching (transformers' block sharing has no hit counters),
    LoRA and speculative decoding.
    """

    name: ClassVar[str] = "hf-continuous"
    batcher: ClassVar[str] = "continuous"
    capabilities: ClassVar[Capabilities] = Capabilities(
        batching_modes=frozenset({"continuous"}), server_metrics=True, reports_kv_capacity=True)
    #: Tokens per KV-cache block (transformers' ``page_size``; its default, 256, is too coarse to size a cache by).
    kv_block_size: ClassVar[int | None] = 16

    @classmethod
    def check_config(cls, batching: BatchingConfig, *, max_model_len: int | None = None) -> None:
        super().check_config(batching, max_model_len=max_model_len)
        if batching.chunked_prefill is False:
            raise ValueError("engine 'hf-continuous': transformers' scheduler always splits a prompt beyond the "
                             "step's token budget over steps; chunked prefill cannot be switched off")
        budget, seqs = batching.max_batched_tokens, batching.max_batch_size
        if budget is not None and seqs is not None and budget < seqs:
            raise ValueError(f"engine 'hf-continuous': max_batched_tokens ({budget}) must be >= max_batch_size "
                             f"({seqs}): every running sequence needs a token of the step's budget")

    def kv_blocks(self) -> int | None:
        """Blocks asked for: the capacity in whole blocks, None when the engine sizes its cache."""
        cap = self.batching.kv_capacity_tokens
        return None if cap is None else math.ceil(cap / (self.kv_block_size or 1))

    def batcher_args(self, batching: BatchingConfig) -> list[str]:
        args = ["--block-size", str(self.kv_block_size)]
        if batching.max_batch_size is not None:
            args += ["--max-batch-size", str(batching.max_batch_size)]
        if batching.max_batched_tokens is not None:
            args += ["--max-batch-tokens", str(batching.max_batched_tokens)]
        if (blocks := self.kv_blocks()) is not None:
            args += ["--kv-blocks", str(blocks)]
        if batching.memory_fraction is not None:
            args += ["--memory-fraction", str(batching.memory_fraction)]
        return args

    def check_server(self, info: dict[str, Any]) -> None:
        wanted = {"max_batch_size": self.batching.max_batch_size, "max_batch_tokens": self.batching.max_batched_tokens,
                  "kv_blocks": self.kv_blocks()}
        wrong = {k: info.get(k) for k, v in wanted.items() if v is not None and info.get(k) != v}
        if wrong:
            has = ", ".join(f"{k}={v}" for k, v in wrong.items())
            raise EngineNotHealthy(self.name, f"the server at {self.base_url} runs with {has}, not as configured "
                                   f"({self.batching.label()})", permanent=True)

    def kv_layout(self) -> KVLayout | None:
        """Blocks of ``kv_block_size`` tokens when the cache is given in tokens; unknown otherwise."""
        if self.batching.kv_capacity_tokens is None:
            return None
        return KVLayout(self.kv_block_size or 1, self.model.max_model_len)

    def describe(self) -> dict[str, Any]:
        info = self.server_info or {}
        return super().describe() | {key: info.get(key) for key in ("max_batch_tokens", "kv_blocks", "block_size")}


SPEC = EngineSpec(
    name="hf-continuous",
    engine_class=HFContinuousEngine,
    summary="transformers' continuous batching (paged KV cache, chunked prefill) on hf-static's model and "
            "kernels, in a local server process",
    embedded=True,
    local=LocalRun(program=LOCAL_PROGRAM),
    container=False,
    start_estimate_s=5.0,  # measured on two vCPUs: 3 s
)
