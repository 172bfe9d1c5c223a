"""hf-static: the classic static-batching baseline, real compute, in a server process of its own.

Requests are gathered into a batch, left-padded to the longest prompt and run through Hugging Face
transformers' ``generate()`` as one tensor (:class:`batchbench.adapters.hf_batchers.StaticBatcher` in
:mod:`batchbench.adapters.hf_server`, launched as a local process or run by hand and reached at a URL). Nothing
joins a running batch; every slot decodes until the longest request of the batch is done. Pad tokens in prefill
and the decode steps of finished slots are counted exactly by the server (see :meth:`HFServerEngine.report`):
that waste is what continuous batching removes (hf-continuous is the same model and kernels, batched
continuously).

The server speaks vLLM's completions stream, so the client side is the OpenAI-compatible one
(:class:`~batchbench.adapters.openai_compat.OpenAICompletionsEngine` over the fast stream client):
hf-static is timed on the client's clock exactly as vLLM is, and its model steps never hold the
load generator's GIL.

The model is the tiny Llama config in fixtures/ with seeded random weights, so nothing is downloaded;
any local Llama-style config directory works.
"""

from __future__ import annotations

from typing import Any, ClassVar

from batchbench.adapters.base import EngineNotHealthy
from batchbench.adapters.hf_engine import LOCAL_PROGRAM, HFServerEngine
from batchbench.adapters.spec import EngineSpec, LocalRun
from batchbench.core.config import BatchingConfig, Capabilities

#: Padded batch size when BatchingConfig.max_batch_size is unset.
DEFAULT_BATCH_SIZE = 8


class HFStaticEngine(HFServerEngine):
    """Static batching with padding, over transformers ``generate()``.

    BatchingConfig mapping: max_batch_size is the padded batch size (``--max-batch-size``, default 8);
    a batch closes when it is full or ``batch_window_s`` after its first request arrived.
    max_batched_tokens, chunked prefill and KV capacity have no meaning here and are refused, and so is
    speculative decoding: ``generate()``'s prompt lookup (``prompt_lookup_num_tokens``) is assisted
    generation, which transformers 5.19 refuses for more than one sequence ("assisted generate is only
    supported for batch_size = 1", ``generation/utils.py``), so it cannot speculate over a padded batch.
    """

    name: ClassVar[str] = "hf-static"
    batcher: ClassVar[str] = "static"
    capabilities: ClassVar[Capabilities] = Capabilities(
        batching_modes=frozenset({"static"}), server_metrics=True, pads_batches=True
    )

    def __init__(self, batching: BatchingConfig | None = None, *, batch_window_s: float = 0.02,
                 **options: Any) -> None:
        super().__init__(batching or BatchingConfig(mode="static", max_batch_size=DEFAULT_BATCH_SIZE), **options)
        self.max_batch_size = self.batching.max_batch_size or DEFAULT_BATCH_SIZE
        self.batch_window_s = batch_window_s

    @classmethod
    def check_config(cls, batching: BatchingConfig, *, max_model_len: int | None = None) -> None:
        super().check_config(batching, max_model_len=max_model_len)
        b = batching
        if b.max_batched_tokens is not None or b.chunked_prefill or b.kv_capacity_tokens is not None:
            raise ValueError(
                "engine 'hf-static' pads whole batches: max_batched_tokens, chunked_prefill and "
                "kv_capacity_tokens do not apply (set only max_batch_size)"
            )

    def batcher_args(self, batching: BatchingConfig) -> list[str]:
        return ["--max-batch-size", str(self.max_batch_size), "--batch-window-s", f"{self.batch_window_s:g}"]

    def check_server(self, info: dict[str, Any]) -> None:
        if info.get("max_batch_size") != self.max_batch_size:
            raise EngineNotHealthy(
                self.name, f"the server at {self.base_url} pads batches of {info.get('max_batch_size')}, not "
                f"{self.max_batch_size}: give --batching mode=static,max_batch_size={info.get('max_batch_size')} "
                "or start it with that --max-batch-size", permanent=True)

    def describe(self) -> dict[str, Any]:
        info = self.server_info or {}
        return super().describe() | {"batch_window_s": info.get("batch_window_s", self.batch_window_s)}


SPEC = EngineSpec(
    name="hf-static",
    engine_class=HFStaticEngine,
    summary="transformers generate() over left-padded batches: real static batching with real padding, "
            "in a local server process",
    embedded=True,
    local=LocalRun(program=LOCAL_PROGRAM),
    container=False,
    start_estimate_s=5.0,  # measured on two vCPUs: 3 s
)
