"""The vLLM personality behind vLLM's own command line (``batchbench-protocol:local``'s entrypoint): the flags that
shape what it serves are read as vLLM reads them, the rest are named and ignored."""

from __future__ import annotations

import json

from batchbench.fixtures.protocol.vllm_serve import make_server


def test_the_vllm_adapters_arguments_shape_the_server() -> None:
    server, ignored = make_server(
        ["--model", "/model", "--host", "0.0.0.0", "--port", "8000", "--dtype", "bfloat16", "--skip-tokenizer-init",
         "--served-model-name", "tiny-llama", "--load-format", "dummy", "--max-model-len", "2048",
         "--max-num-seqs", "8", "--block-size", "32", "--num-gpu-blocks-override", "17",
         "--lora-modules", json.dumps({"name": "a", "path": "/x"}), "b=/y"],
        environ={"VLLM_SERVER_DEV_MODE": "1", "VLLM_API_KEY": "k-123"})
    assert (server.host, server.port, server.model, server.model_root) == ("0.0.0.0", 8000, "tiny-llama", "/model")
    assert (server.max_running, server.max_total_tokens, server.kv_capacity_tokens) == (8, 2048, 17 * 32)
    assert server.loras == ("a", "b") and server.dev_mode and server.api_key == "k-123"
    assert ignored == ["--dtype", "bfloat16", "--skip-tokenizer-init", "--load-format", "dummy"]


def test_without_flags_it_is_vllms_defaults_where_they_matter() -> None:
    server, ignored = make_server([], environ={})
    assert (server.host, server.port, server.model, server.model_root) == (
        "0.0.0.0", 8000, "batchbench/tiny-llama", "batchbench/tiny-llama")
    assert not server.dev_mode and server.loras == () and server.api_key is None and ignored == []
